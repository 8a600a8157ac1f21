// Op registry (per device slot) and the backend-independent entry points.
#include "ops/ep/ep_op.hpp"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>

#include "ops/ep/ep_device.hpp"
#include "symheap/errors.hpp"
#include "transports/transport.hpp"

namespace symheap::ep {

namespace {

// Ops of one PE, kept in its device slot: reachable from any thread.
struct Registry {
  std::mutex mu;
  std::map<int64_t, std::shared_ptr<Op>> ops;
  int64_t next_id = 1;
};

std::shared_ptr<Registry> registry_of(PeState& s) {
  static const std::string kKey = "ep.registry";  // looked up on every call: made once
  return s.caches.get<Registry>(kKey, [] { return std::make_shared<Registry>(); });
}

bool on_cuda() { return std::string(Runtime::instance().backend().name()) == "cuda"; }

}  // namespace

NodeLayout node_layout(const PeState& s) {
  NodeLayout l;
  std::vector<std::string> ids;
  for (int p = 0; p < s.n_pes; ++p) {
    const std::string& id = s.peers[p].info.node_id;
    size_t node = std::find(ids.begin(), ids.end(), id) - ids.begin();
    if (node == ids.size()) {
      ids.push_back(id);
      l.pes_of.emplace_back();
    }
    l.node_of.push_back(static_cast<int>(node));
    l.local_index.push_back(static_cast<int>(l.pes_of[node].size()));
    l.pes_of[node].push_back(p);
  }
  bool several = false;
  for (const auto& pes : l.pes_of) several |= pes.size() > 1;
  // SYMHEAP_EP_HIERARCHICAL=0 sends every row straight to its destination.
  const char* v = std::getenv("SYMHEAP_EP_HIERARCHICAL");
  const bool allowed = !(v && std::strcmp(v, "0") == 0);
  l.forward = allowed && l.pes_of.size() > 1 && several;
  return l;
}

int local_grid_blocks(PeState& s) {
#ifdef SYMHEAP_WITH_CUDA
  if (on_cuda()) return cuda_sm_count(s.device);
#endif
  (void)s;
  return kDefaultGridBlocks;
}

int64_t create(PeState& s, const Config& cfg, size_t ws_offset, size_t ws_bytes,
               bool caller_outputs) {
  Geometry geo = make_geometry(cfg, s.n_pes);
  if (ws_bytes < geo.total)
    throw InvalidArgument("ep workspace of " + std::to_string(ws_bytes) + " bytes is smaller than the " +
                          std::to_string(geo.total) + " the config needs");
  // The cpu implementation reaches remote peers through the remote transport,
  // and so does the host side of the copy-engine kernels (and their
  // emulation); the other kernels store into every PE themselves.
  const bool host_rows = !on_cuda() && !emulate_device();
  const bool kernels_reach_remote = cfg.kernel == Kernel::CopyEngine;
  std::vector<int> remote_pes;
  for (int p = 0; p < s.n_pes; ++p) {
    if (s.peers[p].base) continue;
    remote_pes.push_back(p);
    std::string why = s.transports->unreachable_reason(p);
    if (why.empty() && !host_rows && !kernels_reach_remote)
      why = "across nodes the EP kernels run as kernel='copy_engine' (the host moves rows to "
            "other nodes); kernel='" + std::string(kernel_name(cfg.kernel)) +
            "' stores into every PE from the GPU and needs a load/store path to it";
    if (!why.empty())
      throw Unsupported(s.no_path_message(p, "EpDispatchCombine (it needs every PE)") +
                        "; the remote transport cannot serve it: " + why);
  }
  s.checked_offset(s.base() + ws_offset, geo.total, "ep workspace");
  auto op = std::make_shared<Op>();
  op->cfg = cfg;
  op->geo = geo;
  op->job = s.job;
  op->my_pe = s.my_pe;
  op->n_pes = s.n_pes;
  op->device = s.device;
  op->ws_offset = ws_offset;
  op->timeout_s = s.timeout_s;
  op->nodes = node_layout(s);
  // The cpu implementation forwards host rows; the device path forwards
  // (copy_engine) when the geometry holds its regions.
  op->nodes.forward &= host_rows ? geo.fwd_rec_bytes > 0 : geo.fwd_on_device;
  if (!host_rows) op->remote_pes = remote_pes;
  // (SYMHEAP_EP_PEERS_WRITE_OUTPUTS=0: rows land in the receive buffer first;
  // a reference for comparing the two on a device. Set alike on every PE.)
  const char* pw = std::getenv("SYMHEAP_EP_PEERS_WRITE_OUTPUTS");
  bool one_process = s.n_pes <= kMaxOutPeers;
  for (int p = 0; p < s.n_pes; ++p)
    one_process &= s.peers[p].kind == PeerKind::Self || s.peers[p].kind == PeerKind::SameProcess;
  op->peers_write_outputs = caller_outputs && !host_rows && one_process &&
                            cfg.kernel != Kernel::CopyEngine && !cfg.token_slots &&
                            !(pw && std::strcmp(pw, "0") == 0);
  {
    DeviceGuard guard(s.device);
    // The sync words start at zero on every PE before any PE writes them
    // (the caller barriers after create).
#ifdef SYMHEAP_WITH_CUDA
    if (on_cuda()) {
      op->impl = make_cuda_device(s, *op);  // zeroes them itself
      if (cfg.kernel == Kernel::CopyEngine) {
        for (int p = 0; p < s.n_pes; ++p)
          if (s.peers[p].kind == PeerKind::SameProcess) op->same_process_peers.push_back(p);
        if (!op->same_process_peers.empty())
          op->board = IssueBoard::for_workspace(s.job, ws_offset, s.n_pes);
      }
    }
#endif
    if (!op->impl) {
      Runtime::instance().backend().zero(s.device, s.base() + ws_offset, geo.sync_bytes);
      if (emulate_device()) op->impl = make_emulated_device(s, *op);
    }
  }
  auto reg = registry_of(s);
  std::lock_guard<std::mutex> lock(reg->mu);
  op->id = reg->next_id++;
  reg->ops[op->id] = op;
  return op->id;
}

void destroy(PeState& s, int64_t id) {
  auto reg = registry_of(s);
  std::shared_ptr<Op> op;
  {
    std::lock_guard<std::mutex> lock(reg->mu);
    auto it = reg->ops.find(id);
    if (it == reg->ops.end()) return;
    op = it->second;
    reg->ops.erase(it);
  }
  std::lock_guard<std::mutex> wait_for_calls(op->mu);
  DeviceGuard guard(s.device);
  op->impl.reset();
}

std::shared_ptr<Op> find(uint64_t job, int rank, int64_t id, std::shared_ptr<PeState>* state) {
  return find(Runtime::instance().slot_of_rank(job, rank), rank, id, state);
}

std::shared_ptr<Op> find(std::shared_ptr<PeState> s, int rank, int64_t id,
                         std::shared_ptr<PeState>* state) {
  if (!s || s->peers.empty())
    throw StateError("ep: PE " + std::to_string(rank) +
                     " is not initialised in this process (finalized already?)");
  auto op = find(*s, id);
  *state = std::move(s);
  return op;
}

std::shared_ptr<Op> find(PeState& s, int64_t id) {
  auto reg = registry_of(s);
  std::lock_guard<std::mutex> lock(reg->mu);
  auto it = reg->ops.find(id);
  if (it == reg->ops.end())
    throw StateError("ep: this EpDispatchCombine was closed (op " + std::to_string(id) +
                     " of PE " + std::to_string(s.my_pe) + ")");
  return it->second;
}

namespace {
// A call that failed part-way (a wait timed out, a peer died, an interrupt)
// leaves the PEs out of step on this op's sync words: remember the cause so
// every later call raises it at once instead of waiting for another timeout.
// Bad arguments are found before anything moves and leave the op usable.
template <class F>
auto guarded(PeState& s, Op& op, const char* what, F&& body) {
  PeUse use(s);
  if (!op.failure.empty())
    throw StateError("ep " + std::string(what) + " on PE " + std::to_string(op.my_pe) +
                     ": this EpDispatchCombine failed earlier and is out of step with its "
                     "peers (" + op.failure +
                     "); close it and create a new one on every PE (or finalize and init "
                     "again if a PE died)");
  try {
    return body();
  } catch (const TimeoutError& e) {
    op.failure = e.what();
    throw;
  } catch (const JobFailed& e) {
    op.failure = e.what();
    throw;
  } catch (const RemoteError& e) {  // part of the call's traffic to another node was lost
    op.failure = e.what();
    throw;
  } catch (const InvalidArgument&) {
    throw;  // found before anything moved, or aborted in step on every PE
  } catch (const StateError&) {
    throw;
  } catch (...) {  // an interrupt (Ctrl-C) part-way
    op.failure = "an earlier call was interrupted part-way";
    throw;
  }
}
}  // namespace

int64_t dispatch(PeState& s, Op& op, const DispatchArgs& a) {
  std::lock_guard<std::mutex> lock(op.mu);
  return guarded(s, op, "dispatch", [&]() -> int64_t {
    DeviceGuard guard(s.device);
    if (op.impl) return op.impl->dispatch(s, op, a);
    return dispatch_cpu(s, op, a);
  });
}

void combine(PeState& s, Op& op, const CombineArgs& a) {
  std::lock_guard<std::mutex> lock(op.mu);
  guarded(s, op, "combine", [&] {
    DeviceGuard guard(s.device);
    if (op.impl) return op.impl->combine(s, op, a);
    combine_cpu(s, op, a);
  });
}

bool has_redispatch(const Op& op) { return !op.impl || op.cfg.kernel != Kernel::CopyEngine; }

void redispatch(PeState& s, Op& op, const RedispatchArgs& a) {
  std::lock_guard<std::mutex> lock(op.mu);
  if (!has_redispatch(op))
    throw Unsupported("ep redispatch (the gradient of combine through a dispatch's handle) "
                      "runs on the cpu backend and on the intranode and low_latency kernels; "
                      "kernel='copy_engine' has none");
  guarded(s, op, "redispatch", [&] {
    DeviceGuard guard(s.device);
    if (op.impl) return op.impl->redispatch(s, op, a);
    redispatch_cpu(s, op, a);
  });
}

void ready(PeState& s, Op& op) {
  std::lock_guard<std::mutex> lock(op.mu);
  guarded(s, op, "call", [] {});
}

void check(PeState& s, Op& op, StreamHandle stream, bool sync) {
  std::lock_guard<std::mutex> lock(op.mu);
  if (!op.impl) return;
  if (!op.failure.empty()) {
    // The failure was raised already; still wait for the stream (close()
    // frees the buffers next), but report nothing new.
    try {
      DeviceGuard guard(s.device);
      op.impl->check(s, op, stream, sync);
    } catch (const std::exception&) {
    }
    return;
  }
  guarded(s, op, "check", [&] {
    DeviceGuard guard(s.device);
    op.impl->check(s, op, stream, sync);
  });
}

}  // namespace symheap::ep
