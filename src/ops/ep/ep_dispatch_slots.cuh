// Dispatch to fixed slots (token_slots layout): no count wait before the
// rows move.
#pragma once
#include "ops/ep/ep_dispatch.cuh"

namespace symheap::ep::EP_DEVICE_NS::kernels {

// ------------------------------------------------------------ token_slots dispatch

// Word i of the slot bits for destination d in a count row.
__device__ __forceinline__ int count_bits_word(const Params& p, int d, int i) {
  return count_bits_at(p.n_pes, p.cfg.num_experts) + d * p.geo.slot_words + i;
}

// Whole block, block 0 of a token_slots dispatch: this PE's counts over
// every token (as rank_by_warp: run, hist, bad) and bits[d * slot_words +
// t / 32] bit t % 32 set when token t sends a row to PE d. hist and run
// are 0 on entry; dst: as rank_by_warp.
__device__ inline void count_slots(const Params& p, int32_t* run, int32_t* hist, int32_t* bad,
                                   int16_t* dst, uint32_t* bits) {
  const int n = p.n_pes, K = p.cfg.topk, W = p.geo.slot_words;
  for (int i = threadIdx.x; i < n * W; i += blockDim.x) bits[i] = 0;
  __syncthreads();
  if (p.num_tokens <= static_cast<int64_t>(blockDim.x) && small_dispatch(p.num_tokens, K) &&
      n <= 64) {
    // Small (every id in one chunk): token t is thread t's; a warp's
    // ballot is a word of bits.
    load_dests(p, 0, p.num_tokens, dst, hist, bad);
    const int64_t t = threadIdx.x;
    const uint64_t mask = t < p.num_tokens ? dest_mask(dst + t * K, K) : 0;
    const int lane = threadIdx.x & 31, word = threadIdx.x >> 5;
    for (int d = 0; d < n; ++d) {
      const bool hit = (mask >> d) & 1u;
      const unsigned b = __ballot_sync(0xffffffffu, hit);
      if (lane == 0 && word < W) bits[d * W + word] = b;
      const int rows = __syncthreads_count(hit);
      if (threadIdx.x == 0) run[d] = rows;
    }
    __syncthreads();
    return;
  }
  const int64_t C = route_chunk(p);
  for (int64_t c0 = 0; c0 < p.num_tokens; c0 += C) {
    const int64_t m = imin(C, p.num_tokens - c0);
    load_dests(p, c0, c0 + m, dst, hist, bad);
    for (int64_t i = threadIdx.x; i < m; i += blockDim.x) {
      const int64_t t = c0 + i;
      for (int k = 0; k < K; ++k) {
        const int d = dst[i * K + k];
        if (d >= 0) atomicOr(&bits[d * W + t / 32], 1u << (t % 32));
      }
    }
    __syncthreads();
  }
  for (int d = threadIdx.x; d < n; d += blockDim.x) {
    int32_t rows = 0;
    for (int i = 0; i < W; ++i) rows += __popc(bits[d * W + i]);
    run[d] = rows;
  }
  __syncthreads();
}

// token_slots: the row of this PE's token t on every destination.
__device__ __forceinline__ int64_t me_slot(const Params& p, int64_t t) {
  return static_cast<int64_t>(p.my_pe) * p.cfg.max_tokens + t;
}

// Block 0, once every count row is in: the outputs of a token_slots
// dispatch (expert counts, rows received, the handle's summary with every
// source's slot bits for this PE; see summary_words). An aborted call
// receives nothing.
__device__ inline void finish_slots(const Params& p, uint64_t epoch, bool abort,
                                    const int32_t* cache) {
  const int n = p.n_pes, L = p.geo.local_experts, W = p.geo.slot_words;
  const int32_t M = p.cfg.max_tokens;
  int32_t* bits = p.recv_summary + slot_bits_at(n, L);
  // (one round of loads: expert counts and slot bits together)
  for (int i = threadIdx.x; i < L + n * W; i += blockDim.x) {
    if (i < L) {
      int32_t c = 0;
      for (int q = 0; q < n && !abort; ++q)
        c += count_cell(p, epoch, q, kCountDest + n + p.my_pe * L + i);
      p.expert_counts[i] = c;
      p.recv_summary[4 * n + i] = c;
    } else {
      const int j = i - L;
      bits[j] = abort ? 0 : count_cell(p, epoch, j / W, count_bits_word(p, p.my_pe, j % W));
    }
  }
  for (int q = threadIdx.x; q < n; q += blockDim.x) {
    p.recv_summary[4 * q] = p.my_pe * M;   // q's combine rows for its tokens sent here
    p.recv_summary[4 * q + 1] = M;      // q's slots here
    p.recv_summary[4 * q + 2] = q * M;  // the first of them
    p.recv_summary[4 * q + 3] = q * M;  // this PE's combine rows for its tokens sent to q
  }
  if (threadIdx.x == 0) {
    int32_t total = 0;  // (cache: wait_counts' first words of each row)
    for (int q = 0; q < n && !abort; ++q)
      total += cache[q * (kCountDest + n) + kCountDest + p.my_pe];
    *p.num_recv = total;
    p.recv_summary[4 * n + L] = n * M;
    p.recv_summary[4 * n + L + 1] = 0;
    p.recv_summary[4 * n + L + 2] = 0;
    p.recv_summary[4 * n + L + 3] = 0;
    static_cast<volatile int32_t*>(p.host_mirror)[kHostNumRecv] = total;
  }
  __syncthreads();
}

// Whole block: sets bit (t - b0) * S + d of sent (shared memory) when token
// t of [b0, b1) sends a row to PE d (an id out of range sends nothing:
// block 0's count reports it). Ends with a barrier.
__device__ inline void load_sent_bits(const Params& p, int64_t b0, int64_t b1, uint32_t* sent) {
  const int K = p.cfg.topk, L = p.geo.local_experts, S = p.geo.send_cols;
  const int64_t words = ((b1 - b0) * S + 31) / 32;
  for (int64_t i = threadIdx.x; i < words; i += blockDim.x) sent[i] = 0;
  __syncthreads();
  for_each_pair(p, b0 * K, b1 * K, [&](int64_t j, int64_t id) {
    if (!kept_id(p, id)) return;
    const int64_t bit = (j / K - b0) * S + id / L;
    atomicOr(&sent[bit / 32], 1u << (bit % 32));
  });
  __syncthreads();
}
__device__ __forceinline__ bool sent_bit(const uint32_t* sent, int64_t bit) {
  return (sent[bit / 32] >> (bit % 32)) & 1u;
}

// token_slots dispatch: token t's row goes to row me * max_tokens + t of
// each destination, so a block places its rows without any count; it waits
// only for each PE's word saying it started this call (its receive buffer
// is no longer read). Blocks also mark the slots they do not fill as empty
// (source -1, ids -1, weights 0). Roles go by block index, so that a block
// reads its tokens' ids and brings their rows into L2 at once. Block 0
// stores this PE's "entered" word on every PE, counts every token and
// publishes the count row (status, rows per destination, expert counts,
// slot bits), then writes the call's outputs from every PE's row, which
// decides an abort (a bad id or argument anywhere). With spare_ticket0 it
// sends no rows: it stores only epoch-tagged words into peers, so it adds
// its data flags with no fence, and its outputs are written while the rows
// move (a kernel ends with its last block). The block with the last ticket
// (every block has started, block 0 too) waits for every PE's rows and for
// block 0; after an abort it clears the send table, so a combine of the
// handle moves nothing.
__global__ void __launch_bounds__(kThreads, 1) dispatch_slots_kernel(Params p) {
  const int n = p.n_pes, K = p.cfg.topk, E = p.cfg.num_experts, L = p.geo.local_experts;
  const int S = p.geo.send_cols, W = p.geo.slot_words;
  const Geometry& g = p.geo;
  const int64_t M = p.cfg.max_tokens;
  prefetch_peers(p);
  start_kernel();
  auto* tickets = reinterpret_cast<unsigned long long*>(local_word(p, kDispatchTicket));
  unsigned long long taken = 0;
  if (threadIdx.x == 0) taken = atomicAdd(tickets, 1ull);  // (read at the end)
  const uint64_t epoch = dev::load_relaxed(local_word(p, kDispatchEpoch)) + 1;
  const bool counter = blockIdx.x == 0;
  const bool sender = !counter || !p.spare_ticket0;  // stores rows (or marks slots) in peers
  if (counter)
    for (int q = threadIdx.x; q < n; q += blockDim.x)
      dev::store_relaxed(at<uint64_t>(p, q, g.off_entered) + p.my_pe, epoch);
  // This block's tokens, and its place among the senders.
  const int spare = p.spare_ticket0 ? 1 : 0;
  const int64_t slot = static_cast<int64_t>(blockIdx.x) - spare;
  const int64_t b0 = slot < 0 ? p.num_tokens : imin(slot * p.tokens_per_block, p.num_tokens);
  const int64_t b1 = imin(b0 + p.tokens_per_block, p.num_tokens);
  for (int64_t off = threadIdx.x * 128ll; off < (b1 - b0) * static_cast<int64_t>(g.row_bytes);
       off += blockDim.x * 128ll)
    prefetch_l2(p.tokens + b0 * g.row_bytes + off);
  EP_DYNAMIC_SHARED(int32_t, dyn);
  int32_t* hist = dyn;                                       // [E]
  int32_t* run = hist + E;                                   // [n]
  int32_t* base = run + n;                                   // [n] (make_plan's)
  int32_t* prefix = base + n;                                // [n]
  uint32_t* bits = reinterpret_cast<uint32_t*>(prefix + n);  // [n * W]
  uint32_t* sent = bits + n * W;                             // [ceil(tokens_per_block * S / 32)]
  // [max(4 * blockDim.x (ids as int16), n * (kCountDest + n) (count words))]
  int32_t* scratch =
      reinterpret_cast<int32_t*>(sent + (p.tokens_per_block * S + 31) / 32);
  __shared__ int ticket, bad;
  __shared__ bool entered;
  __shared__ int stop;
  if (threadIdx.x == 0) {
    bad = INT32_MAX;
    entered = true;
  }
  if (counter) {
    for (int i = threadIdx.x; i < E + n; i += blockDim.x) hist[i] = 0;  // and run
    __syncthreads();
    count_slots(p, run, hist, &bad, reinterpret_cast<int16_t*>(scratch), bits);
    publish_counts(p, epoch, true, run, hist, bad, scratch, bits);
  }
  if (sender) {
    load_sent_bits(p, b0, b1, sent);
    if (threadIdx.x == 0) entered = wait_all(p, g.off_entered, epoch, epoch);
    __syncthreads();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int warps = static_cast<int>(blockDim.x >> 5);
    const int P = p.row_pieces;
    const int32_t units = entered ? static_cast<int32_t>((b1 - b0) * S * P) : 0;
    for (int32_t u = warp; u < units; u += warps) {
      const int32_t i = u / P, t = static_cast<int32_t>(b0) + i / S, d = i % S;
      const int piece = u % P;
      const bool sends = sent_bit(sent, i);
      const int64_t r = me_slot(p, t);
      if (sends)
        warp_copy_piece(at<char>(p, d, g.off_recv_x) + r * g.row_bytes, p.tokens + t * g.row_bytes,
                        g.row_bytes, piece, P, lane);
      if (piece != 0) continue;
      if (sends && g.scale_row_bytes)
        warp_copy(at<char>(p, d, g.off_recv_scales) + r * g.scale_row_bytes,
                  p.token_scales + t * g.scale_row_bytes, g.scale_row_bytes, lane);
      int32_t* idx = at<int32_t>(p, d, g.off_recv_idx) + r * K;
      float* w = at<float>(p, d, g.off_recv_w) + r * K;
      for (int k = lane; k < K; k += 32) {
        const int64_t e = topk_id(p, static_cast<int64_t>(t) * K + k);
        const bool local = kept_id(p, e) && static_cast<int32_t>(e) / L == d;
        idx[k] = local ? static_cast<int32_t>(e) % L : -1;
        w[k] = local ? p.topk_weights[static_cast<int64_t>(t) * K + k] : 0.0f;
      }
      if (lane < kMetaWords) {
        const int32_t v = !sends ? -1 : lane == kMetaSrcPe ? p.my_pe : lane == kMetaToken ? t
                                      : lane == kMetaSlot  ? -1 : d * static_cast<int32_t>(M) + t;
        at<int32_t>(p, d, g.off_recv_meta)[r * kMetaWords + lane] = v;
      }
    }
    // The slots of tokens past T are empty on every destination (the
    // senders share them), and the send table is written before the flags,
    // which the last block waits for before it may clear the table.
    const int64_t gtid = (static_cast<int64_t>(blockIdx.x) - spare) * blockDim.x + threadIdx.x;
    const int64_t gthreads = static_cast<int64_t>(gridDim.x - spare) * blockDim.x;
    for (int64_t i = gtid; entered && i < (M - p.num_tokens) * n; i += gthreads) {
      const int d = static_cast<int>(i % n);
      const int64_t r = me_slot(p, p.num_tokens + i / n);
      for (int k = 0; k < K; ++k) {
        at<int32_t>(p, d, g.off_recv_idx)[r * K + k] = -1;
        at<float>(p, d, g.off_recv_w)[r * K + k] = 0.0f;
      }
      for (int f = 0; f < kMetaWords; ++f)
        at<int32_t>(p, d, g.off_recv_meta)[r * kMetaWords + f] = -1;
    }
    for (int64_t i = threadIdx.x; i < (b1 - b0) * S; i += blockDim.x) {
      const int64_t t = b0 + i / S;
      const int d = static_cast<int>(i % S);
      p.send_rows[b0 * S + i] = sent_bit(sent, i) ? static_cast<int32_t>(d * M + t) : -1;
    }
    for (int64_t i = p.num_tokens * S + gtid; i < M * S; i += gthreads) p.send_rows[i] = -1;
    publish(p, g.off_data_flag, 1, true);
  } else if (threadIdx.x == 0) {
    for (int q = 0; q < n; ++q) dev::add_relaxed(at<uint64_t>(p, q, g.off_data_flag) + p.my_pe, 1);
  }

  if (counter) {  // the call's outputs, from every PE's count row
    int32_t* cache = scratch;
    const bool counted = wait_counts(p, epoch, true, true, cache);
    __shared__ DispatchPlan plan;
    if (counted) {
      DispatchPlan local;
      make_plan(p, epoch, true, local, base, prefix, cache);
      if (threadIdx.x == 0) plan = local;
    } else if (threadIdx.x == 0) {
      plan = DispatchPlan{kPeerTimeout, 0, -1};
    }
    __syncthreads();
    const bool abort = plan.abort_status != kOk || !entered;
    if (threadIdx.x == 0 && must_report(p, plan))
      record_error(p, plan.abort_status, plan.abort_detail, plan.abort_pe, epoch);
    finish_slots(p, epoch, abort, cache);
    // (the last block reads only this word's abort bit: no fence)
    if (threadIdx.x == 0)
      dev::store_relaxed(local_word(p, kSlotsDone), tagged(epoch, abort ? 1 : 0));
  }
  if (threadIdx.x == 0) {
    ticket = static_cast<int>(taken);
    if (ticket == static_cast<int>(gridDim.x) - 1) *tickets = 0;  // every block has its ticket
  }
  __syncthreads();
  if (ticket != static_cast<int>(gridDim.x) - 1) return;
  __shared__ bool aborted;
  if (threadIdx.x == 0) {
    const bool landed = wait_all(p, g.off_data_flag, epoch * p.flag_per_epoch, epoch);
    stop = 0;
    uint64_t seen = 0;
    const bool done = await_tag(p, local_word(p, kSlotsDone), epoch, dev::global_timer_ns(),
                                p.my_pe, &stop, &seen);
    aborted = !landed || !done || static_cast<uint32_t>(seen) != 0u;
  }
  __syncthreads();
  if (aborted)
    for (int64_t i = threadIdx.x; i < M * S; i += blockDim.x) p.send_rows[i] = -1;
  __syncthreads();
  if (threadIdx.x == 0) *local_word(p, kDispatchEpoch) = epoch;
}

// Launches dispatch_slots_kernel on `blocks` blocks. Shared memory: counts
// per expert and destination, base and prefix (make_plan), slot bits, the
// block's sent bits, scratch (ids as int16; the count words' cache).
template <class Rt>
void launch_dispatch_slots(Rt& rt, const Params& p, int blocks, StreamHandle stream) {
  const Geometry& g = p.geo;
  const size_t n = static_cast<size_t>(p.n_pes);
  const size_t sent_words = (static_cast<size_t>(p.tokens_per_block) * g.send_cols + 31) / 32;
  const size_t shared =
      (static_cast<size_t>(p.cfg.num_experts) + 3 * n + n * g.slot_words + sent_words +
       std::max(4 * static_cast<size_t>(kThreads), n * (kCountDest + n))) *
      sizeof(int32_t);
  rt.launch_early(dispatch_slots_kernel, blocks, kThreads, shared, stream, p);
}

}  // namespace symheap::ep::EP_DEVICE_NS::kernels
