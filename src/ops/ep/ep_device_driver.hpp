// Host side of the device implementation: what each call launches (each
// kernel's launcher, with its shared memory, sits under the kernel), and on
// which stream, over a small runtime `Rt` (CUDA in ep_cuda.cu, the host
// emulation in ep_emulated.cpp). Rt provides:
//   int32_t* host / host_dev      the host-mapped mirror (kernels::HostWord)
//   launch(kernel, grid, block, shared_bytes, stream, args...)
//   launch_early(...)             as launch; the kernel may start while the
//                                 previous one on the stream ends
//   peers_can_store(ptr)          the kernels of this op's other PEs may store at
//                                 `ptr` (memory a caller gave)
//   sync(stream)                  waits for the stream
//   zero_async(ptr, bytes, stream)
//   channels_after(stream)        copy-engine channels wait for the stream's work
//   copy(pe, dst, src, bytes)     a copy on the channel to `pe`
//   read(host, src, bytes, stream) device bytes into host memory, after the
//                                 stream's work (synchronous)
//   write(dst, host, bytes, stream) host bytes into device memory, likewise
//   signal(pe, flag)              adds 1 to `flag` after the channel's copies
//   stream_after_channels(stream) the stream waits for every channel
//   read_words(words, out, n)     the host reads n device words now
//
// Host synchronisation, by kernel:
//   low_latency   never (fixed capacity; graph capturable);
//   intranode     only without max_recv_tokens, to return exactly the rows received;
//   copy_engine   after packing, to learn the copy plan, in dispatch and in combine;
//                 and, with other PEs in this process, until they queued their copies
//                 (transports/copy_engine_issue_board.hpp says why).
//
// PEs of other nodes (copy_engine only; ep_op.cpp refuses the other kernels):
// the kernels store into mapped PEs only, and the host reaches the others
// through the remote transport, ordered on the caller's stream (cuda: NCCL
// sends after the stream's work, which waits for them; the cpu emulation:
// messages, each kernel having ended before the next call). Dispatch: a
// count_row kernel, then the row put to each of them with a signal on its
// count flag, then the host waits for theirs before the packing grid; the
// packed rows go as puts, the last with a signal on the data flag, and the
// host waits for theirs before the finish. Combine: the host waits for their
// "consumed" flags, then the pack, this PE's status word and rows as puts
// with a signal on the combine flag, a host wait for theirs, the sums, then
// the "consumed" flag. No kernel ever spins on a word the network engine
// must land (wait_remote_on_host says why).
// Epochs of such an op are counted by the host too (the put's offsets
// alternate with them). With forwarding inside a node (Op::nodes.forward),
// a dispatch's rows for another node go once per token to this PE's
// forwarder there, and combine's rows of a source on another node are summed
// by its forwarder here (see "Forwarding inside a node" below).
#pragma once
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "ops/ep/ep_device.hpp"
#include "ops/ep/ep_kernels.cuh"
#include "symheap/errors.hpp"
#include "symheap/wait.hpp"
#include "transports/remote_trace.hpp"
#include "transports/transport.hpp"

namespace symheap::ep::EP_DEVICE_NS {

// Rt with every device operation counted (DeviceImpl::device_ops).
template <class Rt>
class CountedRt : public Rt {
 public:
  template <class... A>
  explicit CountedRt(A&&... args) : Rt(std::forward<A>(args)...) {}
  DeviceOps ops;

  template <class... KA, class... A>
  void launch(void (*kernel)(KA...), int grid, int block, size_t shared, StreamHandle stream,
              A&&... args) {
    ++ops.launches;
    Rt::launch(kernel, grid, block, shared, stream, std::forward<A>(args)...);
  }
  template <class... KA, class... A>
  void launch_early(void (*kernel)(KA...), int grid, int block, size_t shared,
                    StreamHandle stream, A&&... args) {
    ++ops.launches;
    Rt::launch_early(kernel, grid, block, shared, stream, std::forward<A>(args)...);
  }
  void sync(StreamHandle stream) {
    ++ops.host_syncs;
    Rt::sync(stream);
  }
  void zero_async(void* p, size_t bytes, StreamHandle stream) {
    ++ops.memsets;
    Rt::zero_async(p, bytes, stream);
  }
  void channels_after(StreamHandle stream) {
    ++ops.stream_waits;
    Rt::channels_after(stream);
  }
  void copy(int pe, void* dst, const void* src, size_t bytes) {
    ++ops.copies;
    Rt::copy(pe, dst, src, bytes);
  }
  void read(void* host, const void* src, size_t bytes, StreamHandle stream) {
    ++ops.copies;
    ++ops.host_syncs;
    Rt::read(host, src, bytes, stream);
  }
  void write(void* dst, const void* host, size_t bytes, StreamHandle stream) {
    ++ops.copies;
    ++ops.host_syncs;
    Rt::write(dst, host, bytes, stream);
  }
  void signal(int pe, uint64_t* flag) {
    ++ops.copies;
    Rt::signal(pe, flag);
  }
  void stream_after_channels(StreamHandle stream) {
    ++ops.stream_waits;
    Rt::stream_after_channels(stream);
  }
};

template <class Rt>
class DeviceDriver final : public DeviceImpl {
 public:
  template <class... A>
  explicit DeviceDriver(A&&... args) : rt_(std::forward<A>(args)...) {}

  DeviceOps device_ops() const override { return rt_.ops; }

  int64_t dispatch(PeState& s, Op& op, const DispatchArgs& a) override {
    const Geometry& g = op.geo;
    int32_t detail = 0;
    int32_t status = a.status;
    if (status == kOk && (a.num_tokens < 0 || a.num_tokens > op.cfg.max_tokens)) {
      status = kTooManyTokens;
      detail = static_cast<int32_t>(std::min<int64_t>(a.num_tokens, INT32_MAX));
    }
    kernels::Params p = base_params(s, op);
    p.num_tokens = status == kOk ? a.num_tokens : 0;
    p.arg_status = status;
    p.arg_detail = detail;
    p.tokens = static_cast<const char*>(a.x);
    p.token_scales = static_cast<const char*>(a.scales);
    p.topk_idx = a.topk_idx;
    p.topk_idx_is_int64 = a.idx_int64;
    p.topk_weights = a.topk_weights;
    p.num_recv = a.num_recv;
    p.expert_counts = a.expert_counts;
    p.send_rows = a.send_rows;
    p.recv_meta = a.recv_meta;
    p.recv_summary = a.recv_summary;
    p.saved_weights = a.saved_weights;
    p.out_x = static_cast<char*>(a.out_x);
    p.out_scales = static_cast<char*>(a.out_scales);
    p.out_idx = a.out_idx;
    p.out_w = a.out_w;
    p.out_meta = a.out_meta;
    p.peers_write_outputs = op.peers_write_outputs ? 1 : 0;
    p.publish_outputs = op.peers_write_outputs && status == kOk && publishable(op, a) ? 1 : 0;
    const bool ce = op.cfg.kernel == Kernel::CopyEngine;
    const int blocks = dispatch_blocks(op);
    p.flag_per_epoch = ce ? 1 : blocks;
    p.row_pieces = row_pieces(op, g.combine_rows, g.row_bytes);
    p.tokens_per_block = std::max<int64_t>(1, (p.num_tokens + blocks - 1) / blocks);
    // Ticket 0 totals the call's counts before its own rows: when the other
    // blocks can take its tokens at no more per block, it takes none.
    p.spare_ticket0 =
        blocks > 1 && (p.num_tokens + blocks - 2) / (blocks - 1) <= p.tokens_per_block;
    if (remote(op)) exchange_counts(s, op, p, a.stream);
    if (op.cfg.token_slots)
      kernels::launch_dispatch_slots(rt_, p, blocks, a.stream);
    else
      kernels::launch_dispatch(rt_, p, blocks, a.stream);
    if (remote(op)) trace(op, "dispatch %llu: packing grid launched", op.dispatch_epoch);
    if (!ce) {
      if (a.out_x && !p.publish_outputs)
        kernels::launch_collect(rt_, p, op.geo.grid_blocks, a.stream);
      if (g.padded_output) {
        raise_own(op, status, detail, "dispatch");
        raise_recorded(s, op, a.stream);
        return -1;
      }
      rt_.sync(a.stream);  // intranode without max_recv_tokens: exact rows
      raise_own(op, status, detail, "dispatch");
      raise_recorded(s, op, a.stream);
      return mirror()[kernels::kHostNumRecv];
    }

    // Copy engine: the host reads the plan, then the channels move the rows.
    rt_.sync(a.stream);
    if (remote(op)) trace(op, "dispatch %llu: plan read", op.dispatch_epoch);
    volatile int32_t* h = mirror();
    const int32_t abort = h[kernels::kHostAbort];
    const int64_t num_recv = h[kernels::kHostNumRecv];
    const bool tm = op.cfg.layout == Layout::TokenMajor;
    const size_t K = static_cast<size_t>(op.cfg.topk);
    const bool fwd = remote(op) && op.nodes.forward;
    if (fwd) {  // (this call's, whatever an earlier call left)
      forwarded_.assign(op.nodes.pes_of.size(), std::vector<int64_t>());
      staged_meta_.clear();
    }
    rt_.channels_after(a.stream);
    for (int i = 0, n = h[kernels::kHostSegments]; i < n; ++i) {
      volatile int32_t* seg = h + kernels::kHostSegment0 + 4 * i;
      const int pe = seg[0];
      const int64_t from = seg[1], to = seg[2], rows = seg[3];
      if (fwd && !s.peers[pe].base) {  // to this PE's forwarder on pe's node
        forward_segment(s, op, pe, from, rows, a.stream);
        continue;
      }
      auto move = [&](size_t src_off, size_t dst_off, size_t row_bytes) {
        if (!row_bytes) return;
        const char* src = ws_addr(s, op, op.my_pe, src_off) + from * row_bytes;
        if (!s.peers[pe].base)
          queue_put(op, pe, dst_off + to * row_bytes, src, rows * row_bytes);
        else
          rt_.copy(pe, ws_addr(s, op, pe, dst_off) + to * row_bytes, src, rows * row_bytes);
      };
      move(g.off_stage_x, g.off_recv_x, g.row_bytes);
      move(g.off_stage_scales, g.off_recv_scales, g.scale_row_bytes);
      if (tm) move(g.off_stage_idx, g.off_recv_idx, K * 4);
      move(g.off_stage_w, g.off_recv_w, (tm ? K : 1) * 4);
      move(g.off_stage_meta, g.off_recv_meta, kMetaWords * 4);
    }
    signal_all(s, op, g.off_data_flag);
    if (fwd) {
      queue_forwarded_rows(s, op);
      send_queued(s, op, g.off_fwd_flag, 1, SignalOp::Add, a.stream, forwarders(op));
      forward_received(s, op, p, abort != 0, a.stream);
    } else {
      send_queued(s, op, g.off_data_flag, 1, SignalOp::Add, a.stream, op.remote_pes);
    }
    rt_.stream_after_channels(a.stream);
    if (remote(op))
      wait_remote_on_host(s, op, g.off_data_flag, op.dispatch_epoch, kernels::kWaitData,
                          op.dispatch_epoch);
    kernels::launch_finish_dispatch(rt_, p, abort, a.stream);
    if (remote(op)) trace(op, "dispatch %llu: rows sent, finish launched", op.dispatch_epoch);
    if (a.out_x) kernels::launch_collect(rt_, p, op.geo.grid_blocks, a.stream);
    if (op.board)
      op.board->publish_and_wait(0, "ep dispatch", op.my_pe, ++op.queued_dispatches,
                                 op.same_process_peers, op.timeout_s);
    raise_own(op, status, detail, "dispatch");
    raise_recorded(s, op, a.stream);
    return num_recv;
  }

  void combine(PeState& s, Op& op, const CombineArgs& a) override {
    const Geometry& g = op.geo;
    int32_t status = a.status;
    if (status == kOk && (a.num_tokens < 0 || a.num_tokens > op.cfg.max_tokens))
      status = kBadArgument;
    kernels::Params p = base_params(s, op);
    p.num_tokens = status == kOk ? a.num_tokens : 0;
    p.arg_status = status;
    p.expert_output = static_cast<const char*>(a.expert_out);
    p.handle_send_rows = a.send_rows;
    p.handle_recv_meta = a.recv_meta;
    p.handle_summary = a.recv_summary;
    p.combine_weights = a.weights;
    p.combined_out = static_cast<char*>(a.out);
    p.row_pieces = row_pieces(op, g.combine_rows, g.combine_row_bytes);
    const bool ce = op.cfg.kernel == Kernel::CopyEngine;
    if (!ce) {
      // Senders and reducers resident together. Many rows: each token is
      // reduced once its rows landed, and two warps share a row, so fewer
      // tokens are still on the wire when a peer's last rows land (what is
      // summed after that delays this PE's next call, and so the peer's).
      // Few rows: the reducers (split finer) wait until every PE has sent.
      static_assert(kMaxPieces >= 2, "a row's flags cover two pieces");
      p.per_row_flags = per_row_flags(op);
      if (p.per_row_flags) p.row_pieces = std::max(p.row_pieces, 2);
      p.sender_blocks = sender_blocks(op, p.per_row_flags);
      const int reducers = reducer_blocks(op, p.per_row_flags);
      p.reduce_pieces = p.per_row_flags ? kernels::kReduceSplit * p.row_pieces
                                        : row_pieces(op, op.cfg.max_tokens, g.combine_row_bytes);
      p.flag_per_epoch = p.sender_blocks;
      kernels::launch_combine(rt_, p, reducers, a.stream);
    } else {
      // Copy engine: the host reads the plan, the channels move the rows,
      // then the sums.
      p.flag_per_epoch = 1;
      const uint64_t epoch = remote(op) ? ++op.combine_epoch : 0;
      if (remote(op) && g.combine_sets == 1 && epoch > 1)  // their buffers, consumed
        wait_remote_on_host(s, op, g.off_freed_flag, epoch - 1, kernels::kWaitFreed, epoch);
      kernels::launch_combine_pack(rt_, p, send_blocks(op), a.stream);
      rt_.sync(a.stream);
      if (remote(op)) trace(op, "combine %llu: plan read", op.combine_epoch);
      volatile int32_t* h = mirror();
      const size_t crb = g.combine_row_bytes;
      const bool tm = op.cfg.layout == Layout::TokenMajor;
      const bool fwd = remote(op) && op.nodes.forward;
      if (fwd) make_combine_plans(s, op, a, a.stream);  // (while the stream is idle)
      rt_.channels_after(a.stream);
      // Other nodes' PEs read this PE's status (the pack wrote it into its
      // own entry here) before its rows, as mapped PEs do.
      const size_t status_off =
          g.off_combine_status + (g.combine_sets == 2 ? (epoch & 1) : 0) * op.n_pes * 4 + op.my_pe * 4;
      // (forwarding: those this PE forwards for get it with their sums)
      const std::vector<int> sources = fwd ? forwarded_sources(op) : std::vector<int>();
      std::vector<int> direct;
      for (int q : op.remote_pes)
        if (std::find(sources.begin(), sources.end(), q) == sources.end()) direct.push_back(q);
      for (int q : direct) queue_put(op, q, status_off, ws_addr(s, op, op.my_pe, status_off), 4);
      for (int i = 0, n = h[kernels::kHostSegments]; i < n; ++i) {
        volatile int32_t* seg = h + kernels::kHostSegment0 + 4 * i;
        const int pe = seg[0];
        const int64_t from = seg[1], to = seg[2], rows = seg[3];
        const char* src = tm ? static_cast<const char*>(a.expert_out) + from * crb
                             : ws_addr(s, op, op.my_pe, g.off_stage_combine) + from * crb;
        if (fwd && !s.peers[pe].base) {  // to pe's forwarder here, which sums them
          const int f = op.nodes.forwarder(pe, op.nodes.node_of[op.my_pe]);
          rt_.copy(f, ws_addr(s, op, f, g.off_stage_rows) + (pe * g.combine_rows + to) * crb,
                   src, rows * crb);
        } else if (!s.peers[pe].base) {
          queue_put(op, pe, g.off_combine_buf + to * crb, src, rows * crb);
        } else {
          rt_.copy(pe, ws_addr(s, op, pe, g.off_combine_buf) + to * crb, src, rows * crb);
        }
      }
      signal_all(s, op, g.off_combine_flag);
      send_queued(s, op, g.off_combine_flag, 1, SignalOp::Add, a.stream, direct);
      if (fwd) {
        for (int f : combine_forwarders_here(op))  // after the rows this PE staged there
          rt_.signal(f, reinterpret_cast<uint64_t*>(ws_addr(s, op, f, g.off_stage_flag)) + op.my_pe);
        send_combine_plans(s, op, a.stream);
        send_sums(s, op, p, sources, epoch, status_off, a.stream);
      }
      rt_.stream_after_channels(a.stream);
      if (remote(op)) {
        trace(op, "combine %llu: rows sent", op.combine_epoch);
        wait_remote_on_host(s, op, g.off_combine_flag, epoch, kernels::kWaitCombine, epoch);
        trace(op, "combine %llu: rows in", op.combine_epoch);
      }
      if (fwd) {  // the reduction reads the handle as rewritten for the sums from other nodes
        p.handle_send_rows = reinterpret_cast<const int32_t*>(ws_addr(s, op, op.my_pe, g.off_fwd_send));
        if (!tm)
          p.combine_weights = reinterpret_cast<const float*>(ws_addr(s, op, op.my_pe, g.off_fwd_weights));
      }
      p.reduce_pieces = row_pieces(op, op.cfg.max_tokens, g.combine_row_bytes);
      kernels::launch_combine_reduce(rt_, p, reduce_blocks(op), a.stream);
      if (remote(op)) trace(op, "combine %llu: sums launched", op.combine_epoch);
      if (remote(op) && g.combine_sets == 1)  // this PE consumed their rows
        send_queued(s, op, g.off_freed_flag, epoch, SignalOp::Set, a.stream, op.remote_pes);
    }
    if (ce && op.board)
      op.board->publish_and_wait(1, "ep combine", op.my_pe, ++op.queued_combines,
                                 op.same_process_peers, op.timeout_s);
    raise_own(op, status, 0, "combine");
    raise_recorded(s, op, a.stream);
  }

  // Shares combine's epochs and flags: adds to each peer's combine flag what
  // one combine call of this op adds there (a store block per combine sender block).
  void redispatch(PeState& s, Op& op, const RedispatchArgs& a) override {
    const Geometry& g = op.geo;
    if (op.cfg.kernel == Kernel::CopyEngine)
      throw Unsupported("ep redispatch runs on the SM kernels (intranode, low_latency); "
                        "kernel='copy_engine' has none");
    int32_t status = a.status;
    if (status == kOk && (a.num_tokens < 0 || a.num_tokens > op.cfg.max_tokens))
      status = kBadArgument;
    kernels::Params store = base_params(s, op);
    store.num_tokens = status == kOk ? a.num_tokens : 0;
    store.arg_status = status;
    store.token_rows = static_cast<const char*>(a.rows);
    store.redispatched_out = static_cast<char*>(a.out);
    store.handle_send_rows = a.send_rows;
    store.handle_recv_meta = a.recv_meta;
    store.handle_summary = a.recv_summary;
    store.flag_per_epoch = sender_blocks(op, per_row_flags(op));
    kernels::Params pull = store;
    store.row_pieces = row_pieces(op, g.combine_rows, g.combine_row_bytes);
    pull.row_pieces = row_pieces(op, g.recv_rows, g.combine_row_bytes);
    kernels::launch_redispatch(
        rt_, store, pull, blocks_for(op, g.recv_rows * pull.row_pieces, kernels::kWarpsPerBlock),
        a.stream);
    raise_own(op, status, 0, "redispatch");
    raise_recorded(s, op, a.stream);
  }

  void check(PeState& s, Op& op, StreamHandle stream, bool sync) override {
    if (sync) rt_.sync(stream);
    raise_recorded(s, op, stream);
  }

 private:
  CountedRt<Rt> rt_;

  volatile int32_t* mirror() { return rt_.host; }

  // Whether this call's outputs can be published to the peers: every one the
  // layout needs is given, and the peers' kernels can store into each
  // (Rt::peers_can_store: memory of this GPU its peers may write, 16-byte aligned).
  bool publishable(const Op& op, const DispatchArgs& a) {
    const bool tm = op.cfg.layout == Layout::TokenMajor;
    const void* need[] = {a.out_x, op.geo.scale_row_bytes ? a.out_scales : a.out_x, a.out_w,
                          tm ? a.out_idx : a.out_x, tm ? a.out_meta : a.out_x};
    for (const void* ptr : need)
      if (!ptr || !rt_.peers_can_store(ptr)) return false;
    return true;
  }

  static int blocks_for(const Op& op, int64_t items, int per_block) {
    int64_t b = (items + per_block - 1) / per_block;
    return static_cast<int>(std::clamp<int64_t>(b, 1, op.geo.grid_blocks));
  }
  // Grids and pieces depend on the config only, so every PE adds the same to a
  // flag. A row is split between warps when the rows a call expects are
  // fewer than the warps of a full grid (small batches: latency).
  static int row_pieces(const Op& op, int64_t rows, size_t row_bytes) {
    const int64_t warps = static_cast<int64_t>(op.geo.grid_blocks) * kernels::kWarpsPerBlock;
    const int64_t by_rows = warps / std::max<int64_t>(rows, 1);
    const int64_t vectors = static_cast<int64_t>(row_bytes / 16);
    return static_cast<int>(std::clamp<int64_t>(std::min(by_rows, vectors), 1, kMaxPieces));
  }
  // One more block than the rows need while the GPU has room: ticket 0,
  // which totals the counts and writes the call's outputs, then sends no rows
  // (spare_ticket0), so that work never delays a row.
  static int dispatch_blocks(const Op& op) {
    const int64_t pairs = static_cast<int64_t>(op.cfg.max_tokens) * op.geo.send_cols;
    const int blocks = blocks_for(op, pairs * row_pieces(op, op.geo.combine_rows, op.geo.row_bytes),
                                  kernels::kWarpsPerBlock);
    return blocks < op.geo.grid_blocks ? blocks + 1 : blocks;
  }
  // Combine's reducers wait per row (not for whole PEs) from kRowFlagRows rows on.
  static bool per_row_flags(const Op& op) { return op.geo.combine_rows >= kernels::kRowFlagRows; }
  // Combine: some blocks reduce while the others send (as rows land, a sum
  // moves three rows' worth of memory per token, a send one), all of them
  // resident at once on a large GPU. Half and half for few rows; with row
  // flags (many rows) 5/8 reduce, and the senders join them once done.
  static int reduce_share(const Op& op, bool row_flags) {
    return row_flags ? op.geo.grid_blocks * 5 / 8 : op.geo.grid_blocks / 2;
  }
  static int reducer_blocks(const Op& op, bool row_flags) {
    const int most = std::max(1, reduce_share(op, row_flags));
    if (!row_flags) return std::min(most, reduce_blocks(op));
    return std::min(most, blocks_for(op, op.cfg.max_tokens * row_pieces(op, op.geo.combine_rows,
                                                                     op.geo.combine_row_bytes),
                                     kernels::kWarpsPerBlock));
  }
  static int sender_blocks(const Op& op, bool row_flags) {
    const int most = std::max(1, op.geo.grid_blocks - reduce_share(op, row_flags));
    return std::min(most, send_blocks(op));
  }
  static int send_blocks(const Op& op) {  // enough to move every combine row at once
    return blocks_for(op, op.geo.combine_rows *
                          row_pieces(op, op.geo.combine_rows, op.geo.combine_row_bytes),
                      kernels::kWarpsPerBlock);
  }
  static int reduce_blocks(const Op& op) {
    return blocks_for(op, op.cfg.max_tokens *
                          row_pieces(op, op.cfg.max_tokens, op.geo.combine_row_bytes),
                      kernels::kWarpsPerBlock);
  }

  kernels::Params base_params(PeState& s, Op& op) {
    kernels::Params p{};
    p.cfg = op.cfg;
    p.geo = op.geo;
    p.peer_bases = s.peer_table();
    p.workspace_offset = op.ws_offset;
    p.my_workspace = s.base() + op.ws_offset;
    p.my_pe = op.my_pe;
    p.n_pes = op.n_pes;
    p.timeout_ns = static_cast<uint64_t>(op.timeout_s * 1e9);
    p.host_mirror = rt_.host_dev;
    p.pack_for_copy_engine = op.cfg.kernel == Kernel::CopyEngine;
    p.has_remote_peers = remote(op) ? 1 : 0;
    return p;
  }

  // Copy engine: +1 on `flag_off` of every PE, from each channel after its copies.
  void signal_all(PeState& s, Op& op, size_t flag_off) {
    for (int q = 0; q < op.n_pes; ++q)
      if (s.peers[q].base)
        rt_.signal(q, reinterpret_cast<uint64_t*>(ws_addr(s, op, q, flag_off)) + op.my_pe);
  }

  // ---- PEs of other nodes (see the top of the file)

  struct Put {
    size_t dst_off;  // in the op's workspace
    const void* src;
    size_t bytes;
  };
  std::vector<std::vector<Put>> queued_;  // per PE: puts not yet sent

  static bool remote(const Op& op) { return !op.remote_pes.empty(); }
  static size_t payload_off(const Op& op) { return op.geo.off_local + 8 * kRemotePayload; }
  // 8 bytes of this PE's workspace that a bare flag's put carries.
  static const char* payload(PeState& s, const Op& op) {
    return ws_addr(s, op, op.my_pe, payload_off(op));
  }

  void queue_put(const Op& op, int pe, size_t dst_off, const void* src, size_t bytes) {
    if (queued_.size() < static_cast<size_t>(op.n_pes)) queued_.resize(op.n_pes);
    if (bytes) queued_[pe].push_back(Put{dst_off, src, bytes});
  }

  // Sends each PE of `to` (other nodes' PEs) its queued puts on `stream`,
  // the last with a signal on this PE's word at `flag_off` there (with no
  // puts, 8 bytes to its payload word carry the signal): the flag follows
  // every byte.
  void send_queued(PeState& s, Op& op, size_t flag_off, uint64_t value, SignalOp sig,
                   StreamHandle stream, const std::vector<int>& to) {
    std::vector<std::vector<Put>> batch;
    batch.swap(queued_);  // (nothing stays queued if a put throws)
    batch.resize(op.n_pes);
    for (int q : to) {
      std::vector<Put>& puts = batch[q];
      if (puts.empty()) puts.push_back(Put{payload_off(op), payload(s, op), 8});
      Transport& t = s.transports->select(q);
      for (size_t i = 0; i + 1 < puts.size(); ++i)
        t.put(s, q, op.ws_offset + puts[i].dst_off, puts[i].src, puts[i].bytes, stream);
      const Put& last = puts.back();
      t.put_signal(s, q, op.ws_offset + last.dst_off, last.src, last.bytes,
                   op.ws_offset + flag_off + 8 * static_cast<size_t>(op.my_pe), value, sig,
                   stream);
    }
  }

  // Dispatch, before the packing grid: this PE's count row to other nodes'
  // PEs, and a wait for theirs.
  void exchange_counts(PeState& s, Op& op, const kernels::Params& p, StreamHandle stream) {
    const Geometry& g = op.geo;
    const uint64_t epoch = ++op.dispatch_epoch;
    kernels::launch_count_row(rt_, p, stream);
    trace(op, "dispatch %llu: count row launched", epoch);
    const size_t row_bytes = static_cast<size_t>(g.count_words) * 8;
    const size_t row_off = g.off_count_rows + (epoch & 1) * op.n_pes * row_bytes +
                           static_cast<size_t>(op.my_pe) * row_bytes;
    for (int q : op.remote_pes) queue_put(op, q, row_off, ws_addr(s, op, op.my_pe, row_off), row_bytes);
    send_queued(s, op, g.off_count_flag, 1, SignalOp::Add, stream, op.remote_pes);
    trace(op, "dispatch %llu: count row sent", epoch);
    wait_remote_on_host(s, op, g.off_count_flag, epoch, kernels::kWaitCounts, epoch);
    trace(op, "dispatch %llu: counts in", epoch);
  }

  // ---- Forwarding inside a node (dispatch; Op::nodes.forward)
  //
  // What per-PE sending puts into a PE of another node goes to this PE's
  // forwarder there instead: the ids, weights and metadata of each segment
  // at the forwarder's rows [this PE][staging row], and each token's row
  // (and scales) once per node, at [this PE][token]; one signal on the
  // forwarder's fwd flag follows them. The forwarder waits for that flag
  // (on the host), forward_rows_kernel stores the rows into its
  // node's receive buffers where per-PE sending would have put them, and
  // its copy-engine channels raise the source's data flag on each PE of the
  // node after that kernel, as a source's own channels do.

  std::vector<std::vector<int64_t>> forwarded_;  // per node: staging row of each token, or -1
  std::vector<int32_t> staged_meta_;             // this call's staging metadata, read back

  // This PE's forwarder on every other node.
  static std::vector<int> forwarders(const Op& op) {
    const NodeLayout& nl = op.nodes;
    std::vector<int> out;
    for (int node = 0; node < static_cast<int>(nl.pes_of.size()); ++node)
      if (node != nl.node_of[op.my_pe]) out.push_back(nl.forwarder(op.my_pe, node));
    return out;
  }

  // Staging rows [from, from + rows) bound for `pe` (another node): their
  // ids, weights and metadata to the forwarder; their tokens' rows later,
  // once per token (queue_forwarded_rows).
  void forward_segment(PeState& s, Op& op, int pe, int64_t from, int64_t rows,
                       StreamHandle stream) {
    const Geometry& g = op.geo;
    const bool tm = op.cfg.layout == Layout::TokenMajor;
    const size_t K = static_cast<size_t>(op.cfg.topk);
    const int node = op.nodes.node_of[pe], f = op.nodes.forwarder(op.my_pe, node);
    const int64_t at = static_cast<int64_t>(op.my_pe) * g.combine_rows + from;
    auto put = [&](size_t stage_off, size_t fwd_off, size_t row_bytes) {
      queue_put(op, f, fwd_off + at * row_bytes,
                ws_addr(s, op, op.my_pe, stage_off) + from * row_bytes, rows * row_bytes);
    };
    if (tm) put(g.off_stage_idx, g.off_fwd_idx, K * 4);
    put(g.off_stage_w, g.off_fwd_w, (tm ? K : 1) * 4);
    put(g.off_stage_meta, g.off_fwd_meta, kMetaWords * 4);
    // The tokens of these rows (their metadata, read back once per call).
    if (staged_meta_.empty()) {
      staged_meta_.resize(static_cast<size_t>(g.combine_rows) * kMetaWords);
      rt_.read(staged_meta_.data(), ws_addr(s, op, op.my_pe, g.off_stage_meta),
               staged_meta_.size() * 4, stream);
    }
    std::vector<int64_t>& row_of = forwarded_[node];
    if (row_of.empty()) row_of.assign(op.cfg.max_tokens, -1);
    for (int64_t r = from; r < from + rows && r < g.combine_rows; ++r) {
      const int32_t t = staged_meta_[r * kMetaWords + kMetaToken];
      if (t >= 0 && t < op.cfg.max_tokens && row_of[t] < 0) row_of[t] = r;
    }
  }

  // Each token's row and scales once per node, from one of its staging rows,
  // adjacent tokens with adjacent staging rows in one put.
  void queue_forwarded_rows(PeState& s, Op& op) {
    const Geometry& g = op.geo;
    const int64_t cap = op.cfg.max_tokens;
    for (int node = 0; node < static_cast<int>(forwarded_.size()); ++node) {
      const std::vector<int64_t>& row_of = forwarded_[node];
      if (row_of.empty()) continue;
      const int f = op.nodes.forwarder(op.my_pe, node);
      auto put = [&](int64_t t0, int64_t r0, int64_t k) {
        const int64_t at = static_cast<int64_t>(op.my_pe) * cap + t0;
        queue_put(op, f, g.off_fwd_x + at * g.row_bytes,
                  ws_addr(s, op, op.my_pe, g.off_stage_x) + r0 * g.row_bytes, k * g.row_bytes);
        if (g.scale_row_bytes)
          queue_put(op, f, g.off_fwd_scales + at * g.scale_row_bytes,
                    ws_addr(s, op, op.my_pe, g.off_stage_scales) + r0 * g.scale_row_bytes,
                    k * g.scale_row_bytes);
      };
      int64_t t0 = -1, r0 = -1, k = 0;
      for (int64_t t = 0; t < cap; ++t) {
        const int64_t r = row_of[t];
        if (r < 0) continue;
        if (k > 0 && t == t0 + k && r == r0 + k) {
          ++k;
          continue;
        }
        if (k > 0) put(t0, r0, k);
        t0 = t, r0 = r, k = 1;
      }
      if (k > 0) put(t0, r0, k);
    }
    forwarded_.clear();
    staged_meta_.clear();
  }

  // As the forwarder of sources on other nodes: waits for each one's puts,
  // stores its rows into this node's receive buffers (unless the call
  // aborted: every PE decided so from the same counts), then raises that
  // source's data flag on every PE of this node from the copy-engine channels.
  void forward_received(PeState& s, Op& op, const kernels::Params& p, bool abort,
                        StreamHandle stream) {
    const Geometry& g = op.geo;
    const NodeLayout& nl = op.nodes;
    const std::vector<int> sources = forwarded_sources(op);
    if (sources.empty()) return;
    const uint64_t epoch = op.dispatch_epoch;
    const int blocks = blocks_for(op, g.combine_rows, kernels::kWarpsPerBlock);
    for (int src : sources) {
      wait_on_host(s, op, g.off_fwd_flag, epoch, kernels::kWaitForward, epoch, {src});
      if (!abort) kernels::launch_forward_rows(rt_, p, src, blocks, stream);
    }
    trace(op, "dispatch %llu: forwarding launched", epoch);
    rt_.channels_after(stream);
    for (int src : sources)
      for (int d : nl.pes_of[nl.node_of[op.my_pe]])
        rt_.signal(d, reinterpret_cast<uint64_t*>(ws_addr(s, op, d, g.off_data_flag)) + src);
  }

  // ---- Forwarding inside a node (combine)
  //
  // A row of a source on another node goes to the source's forwarder on this
  // node (a copy into its staging rows [source][combine row], then a signal
  // on its stage flag from the channel), not across. The source sends each
  // forwarder a plan (per token with rows there: those combine rows and
  // their weights); the forwarder waits for its node's staged rows and the
  // plans, sums each token's rows (forward_sums_kernel) and puts one row per
  // token back into the source's combine buffer, at the row of the token's
  // first column there, after its status word, with a signal on its combine
  // flag there. The source's reduction reads the handle's send table and
  // weights rewritten by the host: that row with weight 1, the token's other
  // rows on that node none.

  // Sources on other nodes whose forwarder on this node is this PE.
  static std::vector<int> forwarded_sources(const Op& op) {
    const NodeLayout& nl = op.nodes;
    const int my_node = nl.node_of[op.my_pe];
    std::vector<int> out;
    for (int src = 0; src < op.n_pes; ++src)
      if (nl.node_of[src] != my_node && nl.forwarder(src, my_node) == op.my_pe) out.push_back(src);
    return out;
  }

  // PEs of this node that forward for a source on another node.
  static std::vector<int> combine_forwarders_here(const Op& op) {
    const NodeLayout& nl = op.nodes;
    const int my_node = nl.node_of[op.my_pe];
    std::vector<int> out;
    for (int src = 0; src < op.n_pes; ++src) {
      if (nl.node_of[src] == my_node) continue;
      const int f = nl.forwarder(src, my_node);
      if (std::find(out.begin(), out.end(), f) == out.end()) out.push_back(f);
    }
    return out;
  }

  // As a source: its plans (in off_plan_out, one per other node) and the
  // rewritten send table and weights, from the handle (read back to the
  // host; the stream must have no work left: a copy from or to pageable
  // memory waits for it).
  void make_combine_plans(PeState& s, Op& op, const CombineArgs& a, StreamHandle stream) {
    const Geometry& g = op.geo;
    const Config& c = op.cfg;
    const NodeLayout& nl = op.nodes;
    const bool tm = c.layout == Layout::TokenMajor;
    const int S = g.send_cols, K = c.topk, n = op.n_pes, W = g.plan_words;
    const int my_node = nl.node_of[op.my_pe];
    const int64_t cap = c.max_tokens;
    const int64_t T = a.status == kOk && a.num_tokens > 0 && a.num_tokens <= cap ? a.num_tokens : 0;
    std::vector<int32_t> rows(static_cast<size_t>(cap) * S, -1), summary(4 * n, 0);
    std::vector<float> w(tm ? 0 : static_cast<size_t>(cap) * K, 0.0f);
    if (T > 0) {
      rt_.read(rows.data(), a.send_rows, static_cast<size_t>(T) * S * 4, stream);
      if (!tm) {
        rt_.read(w.data(), a.weights, static_cast<size_t>(T) * K * 4, stream);
        rt_.read(summary.data(), a.recv_summary, summary.size() * 4, stream);
      }
    }
    const size_t plan_ints = 4 + static_cast<size_t>(cap) * W;
    std::vector<std::vector<int32_t>> plan(nl.pes_of.size(), std::vector<int32_t>(4, 0));
    std::vector<int32_t> rec(W);
    for (int64_t t = 0; t < T; ++t)
      for (int node = 0; node < static_cast<int>(nl.pes_of.size()); ++node) {
        if (node == my_node) continue;
        std::fill(rec.begin(), rec.end(), -1);
        int first = -1;
        for (int j = 0; j < S; ++j) {
          const int32_t crow = rows[t * S + j];
          if (crow < 0 || crow >= g.combine_rows ||  // (an edited handle: the kernels report it)
              nl.node_of[holder_of(tm, n, summary.data(), j, crow)] != node)
            continue;
          const float wj = tm ? 1.0f : w[t * K + j];
          rec[1 + j] = crow;
          std::memcpy(&rec[1 + S + j], &wj, 4);
          if (first < 0) first = j;
        }
        if (first < 0) continue;
        rec[0] = static_cast<int32_t>(t);
        plan[node].insert(plan[node].end(), rec.begin(), rec.end());
        ++plan[node][0];
        for (int j = 0; j < S; ++j)  // the sum lands at the first column's row
          if (j != first && rec[1 + j] >= 0) rows[t * S + j] = -1;
        if (!tm) w[t * K + first] = 1.0f;
      }
    rt_.write(ws_addr(s, op, op.my_pe, g.off_fwd_send), rows.data(), rows.size() * 4, stream);
    if (!tm) rt_.write(ws_addr(s, op, op.my_pe, g.off_fwd_weights), w.data(), w.size() * 4, stream);
    plan_records_.assign(nl.pes_of.size(), 0);
    for (int node = 0; node < static_cast<int>(nl.pes_of.size()); ++node) {
      if (node == my_node) continue;
      rt_.write(ws_addr(s, op, op.my_pe, g.off_plan_out + node * plan_ints * 4), plan[node].data(),
                plan[node].size() * 4, stream);
      plan_records_[node] = plan[node][0];
    }
  }

  std::vector<int32_t> plan_records_;  // per node: records of this call's plan there

  // The plans to this PE's forwarders, through the remote transport, with a
  // signal on their plan flags.
  void send_combine_plans(PeState& s, Op& op, StreamHandle stream) {
    const Geometry& g = op.geo;
    const NodeLayout& nl = op.nodes;
    const int W = g.plan_words;
    const int64_t cap = op.cfg.max_tokens;
    const size_t plan_ints = 4 + static_cast<size_t>(cap) * W;
    for (int node = 0; node < static_cast<int>(nl.pes_of.size()); ++node) {
      if (node == nl.node_of[op.my_pe]) continue;
      const int f = nl.forwarder(op.my_pe, node);
      const char* out = ws_addr(s, op, op.my_pe, g.off_plan_out + node * plan_ints * 4);
      queue_put(op, f, g.off_plan_count + static_cast<size_t>(op.my_pe) * 4, out, 4);
      queue_put(op, f, g.off_plan_rec + static_cast<size_t>(op.my_pe) * cap * W * 4, out + 16,
                static_cast<size_t>(plan_records_[node]) * W * 4);
    }
    send_queued(s, op, g.off_plan_flag, 1, SignalOp::Add, stream, forwarders(op));
  }

  // As the forwarder of `sources`: waits (on the host) for this node's
  // staged rows and their plans, reads the plans, sums, and sends each
  // source this PE's status word and the sums, then a signal on this PE's
  // combine flag there.
  void send_sums(PeState& s, Op& op, const kernels::Params& p, const std::vector<int>& sources,
                 uint64_t epoch, size_t status_off, StreamHandle stream) {
    if (sources.empty()) return;
    const Geometry& g = op.geo;
    const int W = g.plan_words, S = g.send_cols;
    const int64_t cap = op.cfg.max_tokens;
    const size_t crb = g.combine_row_bytes;
    wait_on_host(s, op, g.off_stage_flag, epoch, kernels::kWaitStaged, epoch,
                 op.nodes.pes_of[op.nodes.node_of[op.my_pe]]);
    wait_on_host(s, op, g.off_plan_flag, epoch, kernels::kWaitPlan, epoch, sources);
    rt_.sync(stream);
    trace(op, "combine %llu: rows to sum and plans here", epoch);
    if (mirror()[kernels::kHostStatus] == kPeerTimeout) raise_recorded(s, op, stream);
    std::vector<int32_t> plan;
    for (int src : sources) {
      int32_t records = 0;
      rt_.read(&records, ws_addr(s, op, op.my_pe, g.off_plan_count + static_cast<size_t>(src) * 4), 4,
               stream);
      records = std::clamp<int32_t>(records, 0, static_cast<int32_t>(cap));
      plan.resize(static_cast<size_t>(records) * W);
      if (records)
        rt_.read(plan.data(), ws_addr(s, op, op.my_pe, g.off_plan_rec + src * cap * W * 4),
                 plan.size() * 4, stream);
      if (records)
        kernels::launch_forward_sums(rt_, p, src, records,
                                     blocks_for(op, records, kernels::kWarpsPerBlock), stream);
      queue_put(op, src, status_off, ws_addr(s, op, op.my_pe, status_off), 4);
      const char* sums = ws_addr(s, op, op.my_pe, g.off_partial + src * cap * crb);
      int64_t i0 = 0, row0 = -1, k = 0;  // sums of adjacent rows there in one put
      auto put = [&] {
        if (k) queue_put(op, src, g.off_combine_buf + row0 * crb, sums + i0 * crb, k * crb);
      };
      for (int64_t i = 0; i < records; ++i) {
        const int32_t* rec = plan.data() + i * W;
        int64_t row = -1;
        for (int j = 0; j < S && row < 0; ++j)
          if (rec[1 + j] >= 0 && rec[1 + j] < g.combine_rows) row = rec[1 + j];
        if (row < 0) continue;
        if (k && i == i0 + k && row == row0 + k) {
          ++k;
          continue;
        }
        put();
        i0 = i, row0 = row, k = 1;
      }
      put();
    }
    send_queued(s, op, g.off_combine_flag, 1, SignalOp::Add, stream, sources);
  }

  // SYMHEAP_REMOTE_TRACE=1 (remote_trace.hpp): the host's steps of a call with
  // other nodes' PEs (a launch that blocks shows as a gap before its line), next
  // to the remote engine's lines.
  static void trace(const Op& op, const char* fmt, uint64_t epoch) {
    if (!remote_trace_enabled()) return;
    char line[160];
    std::snprintf(line, sizeof line, fmt, static_cast<unsigned long long>(epoch));
    remote_trace_line("ep", op.my_pe, line);
  }

  // The error of a wait that timed out: `kind` names what PE `late` had to
  // send (kernels::WaitKind), `seen` and `target` its flag here.
  static TimeoutError late_peer(const Op& op, const std::string& what, int late, int32_t kind,
                                uint64_t seen, uint64_t target) {
    static const char* const kinds[] = {"", "routing counts", "dispatch rows",
                                        "its combine buffer to be freed", "combine rows",
                                        "the same dispatch to start there",
                                        "its rows to forward inside this node",
                                        "its rows to sum for a PE of another node",
                                        "its combine plan"};
    std::string waited;
    if (kind > 0 && kind < 9)
      waited = " (" + std::string(kinds[kind]) + ": its flag here read " + std::to_string(seen) +
               ", waited for " + std::to_string(target) + ")";
    return TimeoutError(what + "timed out after " + std::to_string(op.timeout_s) +
                        " s waiting for PE " + std::to_string(late) + waited +
                        " (did every PE make the same call?); the op is unusable now");
  }

  // Waits on the host until the flag at `off_flags` here of every other-node
  // PE reaches `target`. Never a kernel that spins on the GPU until the
  // network engine lands a word: the engine may need this device idle first
  // (NCCL connects a channel on its first use, and that waits for the device's
  // running kernels), so such a kernel would hold up the very word it waits for.
  void wait_remote_on_host(PeState& s, Op& op, size_t off_flags, uint64_t target, int32_t kind,
                           uint64_t epoch) {
    wait_on_host(s, op, off_flags, target, kind, epoch, op.remote_pes);
  }
  // As wait_remote_on_host, for the flags of `pes` here. Forwarding waits so
  // for its node's PEs too: their words come after their hosts' own waits
  // for other nodes.
  void wait_on_host(PeState& s, Op& op, size_t off_flags, uint64_t target, int32_t kind,
                    uint64_t epoch, const std::vector<int>& pes) {
    const auto* flags = reinterpret_cast<const uint64_t*>(ws_addr(s, op, op.my_pe, off_flags));
    std::vector<uint64_t> seen(op.n_pes);
    Waiter wait(&s, op.timeout_s);
    for (;;) {
      rt_.read_words(flags, seen.data(), seen.size());
      int late = -1;
      for (int q : pes)
        if (seen[q] < target) {
          late = q;
          break;
        }
      if (late < 0) return;
      if (!wait.pause())
        throw late_peer(op,
                        "ep call (epoch " + std::to_string(epoch) + ") on PE " +
                            std::to_string(op.my_pe) + " failed: ",
                        late, kind, seen[late], target);
    }
  }

  static void raise_own(const Op& op, int32_t status, int32_t detail, const char* call) {
    if (status == kOk) return;
    throw InvalidArgument(std::string("ep ") + call + " aborted on every PE: " +
                          describe_status(status, detail, op.my_pe, op.cfg));
  }

  // Raises the failure a kernel recorded, if any, and clears it.
  void raise_recorded(PeState& s, Op& op, StreamHandle stream) {
    volatile int32_t* h = mirror();
    const int32_t status = h[kernels::kHostStatus];
    if (status == kOk) return;
    const int32_t detail = h[kernels::kHostDetail], pe = h[kernels::kHostPe],
                  epoch = h[kernels::kHostEpoch];
    h[kernels::kHostStatus] = kOk;
    rt_.zero_async(s.base() + op.ws_offset + op.geo.off_local + 8 * kErrorWord, 8, stream);
    std::string what = "ep call (device epoch " + std::to_string(epoch) + ") on PE " +
                       std::to_string(op.my_pe) + " failed: ";
    if (status == kPeerTimeout) {
      throw late_peer(op, what, detail, h[kernels::kHostWait], h[kernels::kHostSeen],
                      h[kernels::kHostTarget]);
    }
    if (status == kRecvOverflow)
      throw InvalidArgument(
          what + "a receive buffer would overflow (" +
          (op.cfg.layout == Layout::TokenMajor
               ? "PE " + std::to_string(detail) + " would receive too many rows; raise max_recv_tokens)"
               : "expert " + std::to_string(detail) + " would receive too many rows; raise expert_capacity)"));
    std::string msg = what + describe_status(status, detail, pe, op.cfg);
    if (pe == op.my_pe) throw InvalidArgument(msg);
    throw StateError(msg);
  }
};

}  // namespace symheap::ep::EP_DEVICE_NS
