// Redispatch: the reverse of combine through a dispatch's handle (the
// gradient of combine). No routing and no count exchange: the handle already
// says where every row went.
//   redispatch_store  every PE stores each token's row into its own combine
//                     buffer, at every row its dispatch chose for the token
//                     (send_rows), checks the handle's receive side too, and
//                     publishes its status and combine flag on every PE (a
//                     block each, as combine's senders do);
//   redispatch_pull   every PE waits for every PE's flag, then loads each row
//                     it received at dispatch from its source's combine
//                     buffer (the row combine would send back there) and
//                     zeroes the rows nothing landed in.
// A call shares combine's epoch, buffers (by call parity), statuses, flags
// and "consumed" flags, so combines and redispatches interleave in any
// order: each keeps the guarantees the other relies on (ep_combine.cuh).
// Two kernels, so that no block waits on a block of its own grid.
#pragma once
#include "ops/ep/ep_combine.cuh"

namespace symheap::ep::EP_DEVICE_NS::kernels {

// Token-major: the segment of rows from source q (first receive row, rows),
// clamped to the receive buffer.
__device__ __forceinline__ void source_segment(const Params& p, int q, int64_t* first,
                                               int64_t* rows) {
  const int64_t f = p.handle_summary[4 * q + 2], r = p.handle_summary[4 * q + 1];
  *first = f < 0 ? 0 : f;
  *rows = r < 0 ? 0 : r > p.geo.recv_rows ? p.geo.recv_rows : r;
}

// Where received row r came from: 1 with its source PE and the source's
// combine row, 0 when no row landed at r, -1 when the handle places it
// outside the op's buffers (an edited handle). Token-major: src_first and
// src_rows hold source_segment of every source.
__device__ inline int redispatch_source(const Params& p, const int64_t* src_first,
                                        const int64_t* src_rows, int64_t r, int* src,
                                        int64_t* crow) {
  if (p.cfg.layout == Layout::ExpertMajor) {
    const int64_t cap = p.geo.expert_cap;
    const int32_t count = p.handle_summary[4 * p.n_pes + r / cap];
    if (r % cap >= count) return 0;  // past the expert's rows (their metadata is stale)
    return combine_target(p, r, src, crow) ? 1 : -1;
  }
  for (int q = 0; q < p.n_pes; ++q) {
    const int64_t k = r - src_first[q];
    if (k < 0 || k >= src_rows[q]) continue;
    if (p.cfg.token_slots && !slot_filled(p, q, k)) return 0;
    *src = q;
    return token_major_target(p, q, k, crow) ? 1 : -1;
  }
  return 0;
}

// Stores this PE's token rows into its own combine buffer (a piece of a
// (token, column) pair per unit of work). The grid has as many blocks as a
// combine of this op has senders (flag_per_epoch), and each block, as a
// sender does, publishes its status (if not ok) and adds 1 to this PE's
// combine flag on every PE once its own stores are done.
__global__ void __launch_bounds__(kThreads) redispatch_store_kernel(Params p) {
  start_kernel();
  const Geometry& g = p.geo;
  const int n = p.n_pes, S = g.send_cols;
  const uint64_t epoch = dev::load_relaxed(local_word(p, kCombineEpoch)) + 1;
  __shared__ bool ok;
  if (threadIdx.x == 0) {
    // One set: every PE must be done with every combine buffer of the
    // previous call (pulls read peers' buffers; combines their own). Two
    // sets: the call before the previous one used this set, and every PE
    // ended it before it sent its previous call's flags, which this PE's
    // previous call waited for.
    ok = g.combine_sets == 2 || wait_all(p, g.off_freed_flag, epoch - 1, epoch);
    if (blockIdx.x == 0) {
      // The next combine's work counters (this call uses none), and with two
      // sets the next call's statuses here (read by this PE's previous call),
      // cleared before this block's flags: peers wait for every flag of this
      // call before their next call writes them.
      *local_word(p, kSendNext + static_cast<int>(~epoch & 1)) = 0;
      *local_word(p, kReduceNext + static_cast<int>(~epoch & 1)) = 0;
      if (g.combine_sets == 2)
        for (int q = 0; q < n; ++q) combine_status(p, p.my_pe, epoch + 1)[q] = kOk;
    }
  }
  __syncthreads();
  const bool send = ok && p.arg_status == kOk;
  const int lane = threadIdx.x & 31;
  const int64_t warp0 = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  const size_t crb = g.combine_row_bytes;
  const int P = p.row_pieces;
  bool bad = false;
  if (send) {
    // The receive side of the handle must lie inside the buffers too, before
    // any PE pulls: every PE then aborts the call together.
    if (p.cfg.layout == Layout::TokenMajor) {
      if (blockIdx.x == 0 && threadIdx.x == 0)
        for (int q = 0; q < n; ++q) {
          const int64_t to = p.handle_summary[4 * q], rows = p.handle_summary[4 * q + 1],
                        from = p.handle_summary[4 * q + 2];
          if (rows < 0 || rows > g.recv_rows ||
              (rows > 0 && (to < 0 || from < 0 || to + rows > g.combine_rows ||
                            from + rows > g.recv_rows)))
            bad = true;
        }
    } else {
      const int64_t threads = static_cast<int64_t>(gridDim.x) * blockDim.x;
      for (int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
           r < g.recv_rows; r += threads) {
        int src;
        int64_t crow;
        if (redispatch_source(p, nullptr, nullptr, r, &src, &crow) < 0) bad = true;
      }
    }
    char* mine = combine_buf(p, p.my_pe, epoch);
    const int64_t units = p.num_tokens * S * P;
    for (int64_t u = warp0; u < units; u += warps) {
      const int64_t h = u / P;
      const int32_t row = p.handle_send_rows[h];  // (token h / S, column h % S)
      if (row < 0 || row >= g.combine_rows) {
        if (row != -1) bad = true;
        continue;
      }
      warp_copy_piece(mine + row * crb, p.token_rows + (h / S) * crb, crb,
                      static_cast<int>(u % P), P, lane);
    }
  }
  finish_store_block(p, bad, ok, send, epoch);
}

// Copies piece `piece` of `pieces` of a row from a peer's combine buffer
// (L2 loads, after the flag's acquire), or zeroes it (src null).
__device__ __forceinline__ void warp_pull_piece(char* dst, const char* src, size_t bytes,
                                                int piece, int pieces, int lane) {
  const int64_t nv = static_cast<int64_t>(bytes >> 4);
  int4* d = reinterpret_cast<int4*>(dst);
  const int4* s = reinterpret_cast<const int4*>(src);
  const int64_t lo = nv * piece / pieces, hi = nv * (piece + 1) / pieces;
  if (!s) {
    const int4 zero{0, 0, 0, 0};
    for (int64_t i = lo + lane; i < hi; i += 32) d[i] = zero;
    return;
  }
  int64_t i = lo + lane;
  for (; i + 3 * 32 < hi; i += 4 * 32) {
    int4 v[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) v[q] = __ldcg(s + i + q * 32);
#pragma unroll
    for (int q = 0; q < 4; ++q) d[i + q * 32] = v[q];
  }
  for (; i < hi; i += 32) d[i] = __ldcg(s + i);
}

// Waits for every PE's stored rows, then fills every row of the output (a
// piece per unit of work): the row it received at dispatch, from its
// source's combine buffer, or zeros. The last block to finish ends the call
// as a combine does (finish_combine: a failure a peer published, and with
// one combine set, "consumed" on every PE: this PE reads no buffer any more).
__global__ void __launch_bounds__(kThreads) redispatch_pull_kernel(Params p) {
  start_kernel();
  const Geometry& g = p.geo;
  const int n = p.n_pes;
  const uint64_t epoch = dev::load_relaxed(local_word(p, kCombineEpoch)) + 1;
  EP_DYNAMIC_SHARED(int64_t, segments);  // token-major: [n] first receive row, [n] rows
  int64_t* src_first = segments;
  int64_t* src_rows = segments + n;
  __shared__ bool go;
  if (threadIdx.x == 0) {
    go = p.arg_status == kOk && all_rows_landed(p, epoch);  // no handle when aborted
    if (go && p.cfg.layout == Layout::TokenMajor)
      for (int q = 0; q < n; ++q) source_segment(p, q, src_first + q, src_rows + q);
  }
  __syncthreads();
  const int lane = threadIdx.x & 31;
  const int64_t warp0 = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  const size_t crb = g.combine_row_bytes;
  const int P = p.row_pieces;
  const int64_t units = go ? g.recv_rows * P : 0;
  for (int64_t u = warp0; u < units; u += warps) {
    const int64_t r = u / P;
    int src = 0;
    int64_t crow = 0;
    // (a place outside the buffers was refused by the store kernel; zeros)
    const bool landed = redispatch_source(p, src_first, src_rows, r, &src, &crow) > 0;
    warp_pull_piece(p.redispatched_out + r * crb,
                    landed ? combine_buf(p, src, epoch) + crow * crb : nullptr, crb,
                    static_cast<int>(u % P), P, lane);
  }
  if (!last_block(p, kReduceDone, gridDim.x) || threadIdx.x != 0) return;
  finish_combine(p, epoch, wait_all(p, g.off_combine_flag, epoch * p.flag_per_epoch, epoch));
}

// Shared memory of redispatch_pull_kernel.
inline size_t redispatch_pull_shared_bytes(const Params& p) {
  return 2 * static_cast<size_t>(p.n_pes) * sizeof(int64_t);
}

// Launches both kernels: flag_per_epoch store blocks (what a combine adds to
// each combine flag) and `pull_blocks` pull blocks (fixed by the config).
template <class Rt>
void launch_redispatch(Rt& rt, const Params& store, const Params& pull, int pull_blocks,
                       StreamHandle stream) {
  rt.launch_early(redispatch_store_kernel, store.flag_per_epoch, kThreads, 0, stream, store);
  rt.launch_early(redispatch_pull_kernel, pull_blocks, kThreads,
                  redispatch_pull_shared_bytes(pull), stream, pull);
}

}  // namespace symheap::ep::EP_DEVICE_NS::kernels
