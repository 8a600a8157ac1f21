// Init and finalize of one PE: the order of every step, over a Bootstrap.
// Every front end (Python, torch, JAX) makes these two calls and nothing else.
#include <unistd.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "symheap/errors.hpp"
#include "symheap/runtime.hpp"
#include "transports/transport.hpp"

namespace symheap {

namespace {

// PeInfo on the wire: seven fields, each as "<length>:<text>".
std::string encode(const PeInfo& info) {
  std::string out;
  for (const std::string& field :
       {std::to_string(info.rank), std::to_string(info.device), std::to_string(info.pid),
        std::to_string(info.heap_size), info.node_id, info.heap_handle, info.remote_address})
    out += std::to_string(field.size()) + ":" + field;
  return out;
}

PeInfo decode(const std::string& data, size_t from_rank) {
  auto bad = [&] {
    return StateError("the bootstrap delivered a malformed PE record from PE " +
                      std::to_string(from_rank));
  };
  std::vector<std::string> fields;
  size_t at = 0;
  while (at < data.size()) {
    size_t colon = data.find(':', at);
    if (colon == std::string::npos || colon == at || colon - at > 19) throw bad();
    char* end = nullptr;
    unsigned long long n = std::strtoull(data.c_str() + at, &end, 10);
    if (end != data.c_str() + colon || n > data.size() - colon - 1) throw bad();
    fields.push_back(data.substr(colon + 1, n));
    at = colon + 1 + n;
  }
  if (fields.size() != 7) throw bad();
  auto number = [&](const std::string& text) {
    char* end = nullptr;
    long long v = std::strtoll(text.c_str(), &end, 10);
    if (text.empty() || *end != '\0') throw bad();
    return v;
  };
  PeInfo info;
  info.rank = static_cast<int>(number(fields[0]));
  info.device = static_cast<int>(number(fields[1]));
  info.pid = number(fields[2]);
  info.heap_size = static_cast<size_t>(number(fields[3]));
  info.node_id = fields[4];
  info.heap_handle = fields[5];
  info.remote_address = fields[6];
  return info;
}

// The Python class each core exception becomes (src/bindings/module.cpp), so
// that a failure on one PE reads the same in every PE's message; null for an
// exception the core did not raise.
const char* core_class_of(const std::exception& e) {
  if (dynamic_cast<const InvalidArgument*>(&e)) return "ValueError";
  if (dynamic_cast<const TimeoutError*>(&e)) return "TimeoutError";
  if (dynamic_cast<const HeapExhausted*>(&e)) return "MemoryError";
  if (dynamic_cast<const Unsupported*>(&e)) return "UnsupportedError";
  if (dynamic_cast<const RemoteError*>(&e)) return "RemoteError";
  if (dynamic_cast<const StateError*>(&e)) return "SymheapError";
  return nullptr;
}
const char* python_class_of(const std::exception& e) {
  const char* cls = core_class_of(e);
  return cls ? cls : "RuntimeError";
}

}  // namespace

void Runtime::init_pe(uint64_t job, int device, int rank, int world, size_t heap_size,
                      double timeout_s, Bootstrap& boot, int xla_ordinal) {
  auto s = create_pe(job, device, rank, world, heap_size, timeout_s);
  bool connected = false;
  try {
    boot.connect();
    connected = true;
    PeInfo mine;
    mine.rank = rank;
    mine.device = device;
    mine.pid = static_cast<int64_t>(getpid());
    mine.node_id = this_node_id();
    mine.heap_handle = s->heap->export_handle;
    mine.heap_size = heap_size;
    mine.remote_address = remote_address_of_this_process();
    std::vector<std::string> records = boot.allgather(encode(mine), "init");
    if (static_cast<int>(records.size()) != world)
      throw StateError("bootstrap returned " + std::to_string(records.size()) +
                       " PE records for " + std::to_string(world) + " PEs");
    std::vector<PeInfo> infos;
    bool sizes_differ = false;
    for (size_t r = 0; r < records.size(); ++r) {
      infos.push_back(decode(records[r], r));
      sizes_differ |= infos.back().heap_size != infos.front().heap_size;
    }
    if (sizes_differ) {
      std::string detail;
      for (const PeInfo& info : infos)
        detail += (detail.empty() ? "PE " : ", PE ") + std::to_string(info.rank) + ": " +
                  std::to_string(info.heap_size);
      throw InvalidArgument("heap sizes differ across PEs (" + detail +
                            " bytes); set the same heap_size / SYMHEAP_HEAP_SIZE on every PE");
    }
    std::string error;  // reported to every PE, not just this one
    try {
      connect_peers(*s, infos);
    } catch (const std::exception& e) {
      error = "PE " + std::to_string(rank) + ": " + python_class_of(e) + ": " + e.what();
    }
    std::string errors;
    for (const std::string& e : boot.allgather(error, "init-connect"))
      if (!e.empty()) errors += (errors.empty() ? "" : "; ") + e;
    if (!errors.empty()) throw StateError("init failed while mapping peer heaps: " + errors);
    if (s->transports && s->transports->remote_needs_exchange()) {
      // The remote engine connects now that every PE knows its remote peers.
      std::vector<std::string> offers = boot.allgather(s->transports->remote_offer(), "init-remote");
      try {
        s->transports->remote_connect(*s, offers);
      } catch (const std::exception& e) {
        // Only the connect's own failures leave the remote peers unreachable;
        // anything else, above all what the interrupt check raised while the
        // connect waited (Ctrl-C: Python's KeyboardInterrupt), ends init as
        // it is (the other PEs learn it from the bootstrap's close).
        const char* cls = core_class_of(e);
        if (!cls || dynamic_cast<const JobFailed*>(&e)) throw;
        error = "PE " + std::to_string(rank) + ": " + cls + ": " + e.what();
      }
      for (const std::string& e : boot.allgather(error, "init-remote-connect"))
        if (!e.empty()) errors += (errors.empty() ? "" : "; ") + e;
      // Init goes on: operations on remote peers then raise, saying why.
      if (!errors.empty()) s->transports->remote_connect_failed(*s, errors);
    }
    backend().unexport(s->heap->export_handle);  // every peer has mapped it
    s->heap->export_handle.clear();
    if (xla_ordinal >= 0) map_xla_device(xla_ordinal, device);
  } catch (...) {
    destroy_pe(device);
    if (connected) {
      try {
        boot.close(0);  // init failed: the other PEs fail too, no goodbyes
      } catch (...) {
      }
    }
    throw;
  }
}

void Runtime::release_peer_mappings(PeState& s) {
  s.close_calls();  // host calls of other threads first, then their device work
  backend().drain(s.device);
  for (Peer& peer : s.peers) {
    if (peer.kind != PeerKind::SameNode) continue;
    peer.base = nullptr;
    peer.mapping.reset();
  }
}

void Runtime::finalize_pe(int device, Bootstrap& boot) {
  constexpr double kGoodbyeGraceS = 5.0;  // how long the root waits for the others' goodbyes
  try {
    auto s = slot(device);
    if (!s) throw StateError("no PE on device " + std::to_string(device));
    // Once the job failed (a PE died) no collective can complete: clean up here.
    if (boot.failure().empty()) {
      // Remote puts of this PE land before its peers leave (they are served
      // by the target's process, which the barrier keeps alive until then).
      if (s->transports) s->transports->quiet_remote(*s);
      boot.allgather("", "finalize");
      // Nobody sends remote requests any more: the remote engine closes in order.
      if (s->transports) s->transports->close_remote(*s);
      if (backend().unmap_before_owner_frees()) {
        release_peer_mappings(*s);
        boot.allgather("", "finalize-unmapped");
      }
    }
  } catch (...) {
    destroy_pe(device);
    try {
      boot.close(kGoodbyeGraceS);
    } catch (...) {  // the first error is the one to report
    }
    throw;
  }
  destroy_pe(device);
  boot.close(kGoodbyeGraceS);
}

}  // namespace symheap
