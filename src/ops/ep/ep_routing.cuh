// Dispatch's routing: which PE and expert each token's rows go to, their
// ranks, the count rows every PE publishes, and the per-block counts that
// let a block take its rank offsets from the blocks started before it.
#pragma once
#include "ops/ep/ep_device_helpers.cuh"

namespace symheap::ep::EP_DEVICE_NS::kernels {

// ------------------------------------------------------------ routing

// Dispatch is one grid. Every block ranks its own tokens, then takes its
// rank offsets from the counts of the blocks before it; ticket 0 publishes
// this PE's count row into every PE; each word carries the call's epoch in
// its upper half, so no fence has to order the row before a flag.

__device__ __forceinline__ bool kept_id(const Params& p, int64_t id) {
  return id >= 0 && id < p.cfg.num_experts;
}

// Token-major routing works on chunks of route_chunk(p) tokens: the whole
// block first loads their ids into shared memory as destination PEs (dst:
// int16 [route_chunk * K], coalesced; route_chunk * K is at most
// 8 * blockDim.x, one round of for_each_pair).
__device__ __forceinline__ int64_t route_chunk(const Params& p) {
  const int64_t c = 8 * static_cast<int64_t>(blockDim.x) / p.cfg.topk;
  return c > 0 ? c : 1;
}

// Calls f(j, id) for every pair j in [lo, hi) with the whole block, eight
// loads in flight per thread.
template <class F>
__device__ __forceinline__ void for_each_pair(const Params& p, int64_t lo, int64_t hi, F f) {
  constexpr int kBatch = 8;
  for (int64_t j0 = lo + threadIdx.x; j0 < hi; j0 += kBatch * static_cast<int64_t>(blockDim.x)) {
    int64_t id[kBatch];
#pragma unroll
    for (int q = 0; q < kBatch; ++q) {
      const int64_t j = j0 + q * static_cast<int64_t>(blockDim.x);
      id[q] = j < hi ? topk_id(p, j) : -1;
    }
#pragma unroll
    for (int q = 0; q < kBatch; ++q) {
      const int64_t j = j0 + q * static_cast<int64_t>(blockDim.x);
      if (j < hi) f(j, id[q]);
    }
  }
}

// Whether pair j's id is kept. With `hist`, counts a kept id per expert;
// with `bad`, keeps the lowest index of an id out of range.
__device__ __forceinline__ bool tally_id(const Params& p, int64_t j, int64_t id, int32_t* hist,
                                         int32_t* bad) {
  if (kept_id(p, id)) {
    if (hist) atomicAdd(&hist[id], 1);
    return true;
  }
  if (bad && id != -1) atomicMin(bad, static_cast<int>(j));
  return false;
}

// Loads the destinations of tokens [s, e) into dst (-1: dropped), tallying
// their ids (tally_id). Whole block; ends with a barrier.
__device__ inline void load_dests(const Params& p, int64_t s, int64_t e, int16_t* dst,
                                  int32_t* hist, int32_t* bad) {
  const int K = p.cfg.topk, L = p.geo.local_experts;
  const int64_t lo = s * K;
  for_each_pair(p, lo, e * K, [&](int64_t j, int64_t id) {
    dst[j - lo] = tally_id(p, j, id, hist, bad) ? static_cast<int16_t>(id / L) : int16_t{-1};
  });
  __syncthreads();
}

// Bit d (d < 64) set when the token whose destinations are row[0, K) sends
// a row to PE d.
__device__ __forceinline__ uint64_t dest_mask(const int16_t* row, int K) {
  uint64_t mask = 0;
  for (int k = 0; k < K; ++k)
    if (row[k] >= 0 && row[k] < 64) mask |= 1ull << row[k];
  return mask;
}
__device__ __forceinline__ bool sends_to(const int16_t* row, int K, uint64_t mask, int d) {
  if (d < 64) return (mask >> d) & 1u;
  for (int k = 0; k < K; ++k)
    if (row[k] == d) return true;
  return false;
}

// Token-major, whole block, for a small call (every id in one round of
// loads: dst holds load_dests' destinations of every token): adds to run[d]
// (0 on entry) the rows that the call's tokens send to each PE d and, for
// the tokens t of [keep_lo, keep_hi), sets pos[t * n + d] = the rank of
// token t's row to PE d among them (-1: no row). warp_rows: [warps][n]
// shared scratch.
__device__ inline void rank_dest_rows(const Params& p, int64_t keep_lo, int64_t keep_hi,
                                      int32_t* run, int32_t* warp_rows, const int16_t* dst,
                                      int32_t* pos) {
  const int n = p.n_pes, K = p.cfg.topk, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int warps = static_cast<int>(blockDim.x >> 5);
  for (int64_t s = 0; s < p.num_tokens; s += blockDim.x) {
    const int64_t t = s + threadIdx.x;
    const int16_t* row = dst + t * K;
    const uint64_t mask = t < p.num_tokens ? dest_mask(row, K) : 0;
    for (int d = 0; d < n; ++d) {
      const unsigned b = __ballot_sync(0xffffffffu, t < p.num_tokens && sends_to(row, K, mask, d));
      if (lane == 0) warp_rows[warp * n + d] = __popc(b);
    }
    __syncthreads();
    for (int d = 0; d < n; ++d) {
      const bool hit = t < p.num_tokens && sends_to(row, K, mask, d);
      const unsigned b = __ballot_sync(0xffffffffu, hit);
      int32_t r = run[d] + __popc(b & ((1u << lane) - 1u));
      for (int w = 0; w < warp; ++w) r += warp_rows[w * n + d];
      if (t < p.num_tokens && t >= keep_lo && t < keep_hi) pos[t * n + d] = hit ? r : -1;
    }
    __syncthreads();
    for (int d = threadIdx.x; d < n; d += blockDim.x)
      for (int w = 0; w < warps; ++w) run[d] += warp_rows[w * n + d];
    __syncthreads();
  }
}

// Token-major, whole block, for a small call with at most one token per
// thread (token j: thread j): the same results as rank_dest_rows over every
// token (run on entry 0) for tokens [keep_lo, keep_hi), each count taken by
// one barrier (a call's critical path: no scratch, no per-warp sums).
// dst: load_dests' destinations of every token.
__device__ __forceinline__ bool rank_by_barriers_fits(const Params& p, int64_t keep) {
  return p.num_tokens <= static_cast<int64_t>(blockDim.x) && p.n_pes <= 64 &&
         (1 + keep) * p.n_pes <= 64;
}
__device__ inline void rank_by_barriers(const Params& p, int64_t keep_lo, int64_t keep_hi,
                                        int32_t* run, const int16_t* dst, int32_t* pos) {
  const int n = p.n_pes, K = p.cfg.topk;
  const int64_t j = threadIdx.x;
  const uint64_t mask = j < p.num_tokens ? dest_mask(dst + j * K, K) : 0;
  for (int d = 0; d < n; ++d) {
    const bool hit = (mask >> d) & 1u;
    const int total = __syncthreads_count(hit);
    if (threadIdx.x == 0) run[d] = total;
    for (int64_t t = keep_lo; t < keep_hi; ++t) {
      const int earlier = __syncthreads_count(hit && j < t);
      if (j == t) pos[t * n + d] = hit ? earlier : -1;
    }
  }
  __syncthreads();
}

// Token-major, whole block: rank_dest_rows' counts and ranks for the tokens
// of [lo, hi) (no ranks without pos), one chunk (route_chunk) at a time:
// after load_dests, one warp ranks the chunk's tokens 32 at a time by
// ballots (no per-warp sums; one barrier per chunk).
__device__ __forceinline__ void rank_by_warp(const Params& p, int64_t lo, int64_t hi, int32_t* run,
                                             int16_t* dst, int32_t* pos, int32_t* hist,
                                             int32_t* bad) {
  const int n = p.n_pes, K = p.cfg.topk;
  const int64_t C = route_chunk(p);
  for (int64_t c0 = lo; c0 < hi; c0 += C) {
    const int32_t m = static_cast<int32_t>(imin(C, hi - c0));  // tokens of the chunk
    load_dests(p, c0, c0 + m, dst, hist, bad);
    if (threadIdx.x < 32) {
      const int lane = threadIdx.x;
      for (int32_t s = 0; s < m; s += 32) {
        const int32_t i = s + lane;  // (the chunk's token i)
        const int16_t* row = dst + i * K;
        const uint64_t mask = i < m ? dest_mask(row, K) : 0;
        for (int d = 0; d < n; ++d) {
          const bool hit = i < m && sends_to(row, K, mask, d);
          const int32_t earlier = run[d];
          const unsigned b = __ballot_sync(0xffffffffu, hit);
          if (pos && i < m)
            pos[(c0 + i) * n + d] = hit ? earlier + __popc(b & ((1u << lane) - 1u)) : -1;
          __syncwarp();
          if (lane == 0) run[d] = earlier + __popc(b);
          __syncwarp();
        }
      }
    }
    __syncthreads();
  }
}

// Expert-major, whole block: hist[e] += the kept (token, slot) pairs of
// [lo, hi) with expert e.
__device__ inline void count_expert_pairs(const Params& p, int64_t lo, int64_t hi, int32_t* hist,
                                          int32_t* bad) {
  for_each_pair(p, lo, hi, [&](int64_t j, int64_t id) { tally_id(p, j, id, hist, bad); });
  __syncthreads();
}

// Expert-major, whole block: as count_expert_pairs, and pos[j] = the rank
// of pair j among this PE's pairs to its expert (-1: dropped). ids: shared
// scratch of blockDim.x words.
__device__ inline void rank_expert_pairs(const Params& p, int64_t lo, int64_t hi, int32_t* hist,
                                         int32_t* ids, int32_t* pos, int32_t* bad) {
  for (int64_t s = lo; s < hi; s += blockDim.x) {
    const int64_t j = s + threadIdx.x;
    const int64_t raw = j < hi ? topk_id(p, j) : -1;
    const int32_t id = tally_id(p, j, raw, nullptr, j < hi ? bad : nullptr)
                           ? static_cast<int32_t>(raw) : -1;
    ids[threadIdx.x] = id;
    __syncthreads();
    if (j < hi) {
      int32_t r = -1;
      if (id >= 0) {
        r = hist[id];
        for (unsigned i = 0; i < threadIdx.x; ++i) r += ids[i] == id;
      }
      pos[j] = r;
    }
    __syncthreads();
    if (id >= 0) atomicAdd(&hist[id], 1);
    __syncthreads();
  }
}

__device__ __forceinline__ uint64_t tagged(uint64_t epoch, int32_t v) {
  return (epoch << 32) | static_cast<uint32_t>(v);
}
__device__ __forceinline__ bool has_tag(uint64_t word, uint64_t epoch) {
  return static_cast<uint32_t>(word >> 32) == static_cast<uint32_t>(epoch);
}

// PE q's count rows of call `epoch`. Two sets, by parity: call k's rows are
// overwritten only by call k + 2, which no peer starts before this PE ended
// call k + 1, so a block may read them until its kernel ends.
__device__ __forceinline__ uint64_t* count_rows(const Params& p, int q, uint64_t epoch) {
  return at<uint64_t>(p, q, p.geo.off_count_rows) +
         (epoch & 1) * static_cast<size_t>(p.n_pes) * p.geo.count_words;
}

// Token-major: PE pe's destination sums of call `epoch` (Geometry::
// off_dest_sums). Each block adds kSumBlock plus its share to a cell, so a
// cell is complete once its upper bits count every block of the grid.
constexpr int kSumShift = 40;
constexpr uint64_t kSumBlock = uint64_t{1} << kSumShift;
__device__ __forceinline__ uint64_t* dest_sums(const Params& p, int pe, uint64_t epoch) {
  return at<uint64_t>(p, pe, p.geo.off_dest_sums) +
         (epoch & 1) * static_cast<size_t>(p.n_pes) * (p.n_pes + 1);
}

// Token-major, whole block, before it waits for anything: adds the share of
// `blocks` blocks to this PE's row of every PE's destination sums: `run`
// (rows per destination) and whether they saw a failure.
__device__ inline void add_dest_sums(const Params& p, uint64_t epoch, const int32_t* run,
                                     bool failed, unsigned blocks) {
  const int n = p.n_pes, W = n + 1;
  for (int i = threadIdx.x; i < n * W; i += blockDim.x) {
    const int q = i / W, c = i % W;
    if (!stores_reach(p, q)) continue;  // (its waits take this PE's count row)
    const uint64_t share = c < n ? static_cast<uint64_t>(run[c]) : failed ? 1 : 0;
    dev::add_relaxed(dest_sums(p, q, epoch) + p.my_pe * W + c, blocks * kSumBlock + share);
  }
}

// Ticket 0, once it counted every token: publishes this PE's count row
// [status, detail, rows per destination, pairs per expert] into every PE;
// expert-major, then this PE's send order (first combine row of each expert)
// into its own workspace (token-major blocks derive theirs from the row).
// scan: shared scratch of 2 * E words.
__device__ inline void publish_counts(const Params& p, uint64_t epoch, bool tm, const int32_t* run,
                                      const int32_t* hist, int bad, int32_t* scan,
                                      const uint32_t* slot_bits = nullptr) {
  const int n = p.n_pes, E = p.cfg.num_experts, L = p.geo.local_experts, CW = p.geo.count_words;
  int32_t status = p.arg_status, detail = p.arg_detail;
  if (status == kOk && bad != INT32_MAX) {
    const int64_t id = topk_id(p, bad);
    status = kExpertOutOfRange;
    detail = static_cast<int32_t>(id < INT32_MIN ? INT32_MIN : id > INT32_MAX ? INT32_MAX : id);
  }
  auto dest_rows = [&](int d) {
    if (tm) return run[d];
    int32_t rows = 0;
    for (int l = 0; l < L; ++l) rows += hist[d * L + l];
    return rows;
  };
  // Words [lo, hi) of the row, into every PE.
  auto store_words = [&](int lo, int hi) {
    const int m = hi - lo;
    for (int64_t i = threadIdx.x; i < static_cast<int64_t>(n) * m; i += blockDim.x) {
      const int q = static_cast<int>(i / m), w = lo + static_cast<int>(i % m);
      if (!stores_reach(p, q)) continue;  // the host puts this PE's row there
      int32_t v = 0;
      if (w == kCountStatus) v = status;
      else if (w == kCountDetail) v = detail;
      else if (status == kOk && w < kCountDest + n) v = dest_rows(w - kCountDest);
      else if (status == kOk && w < kCountDest + n + E) v = hist[w - kCountDest - n];
      else if (status == kOk && slot_bits && w < kCountDest + n + E + n * p.geo.slot_words)
        v = static_cast<int32_t>(slot_bits[w - kCountDest - n - E]);
      dev::store_relaxed(count_rows(p, q, epoch) + p.my_pe * CW + w, tagged(epoch, v));
    }
  };
  // Token-major: the words other blocks may wait for go first (status,
  // detail, destinations; then the expert counts, which only ticket 0 reads).
  if (tm) {
    store_words(0, kCountDest + n);
    store_words(kCountDest + n, CW);
    __syncthreads();
    return;
  }
  store_words(0, CW);
  for (int j = threadIdx.x; j < E; j += blockDim.x) scan[j] = status != kOk ? 0 : hist[j];
  block_exclusive_scan(scan, scan + E, E);
  uint64_t* prefix = at<uint64_t>(p, p.my_pe, p.geo.off_send_prefix);
  for (int j = threadIdx.x; j < E; j += blockDim.x)
    dev::store_relaxed(prefix + j, tagged(epoch, scan[j]));
  __syncthreads();
}

// Polls until ready() holds. False once timeout_ns passed since `start`
// (then timed_out() records it) or another wait failed (`stop` set, or a
// timeout in the error word); then sets `stop`.
template <class Ready, class TimedOut>
__device__ inline bool await_count(const Params& p, uint64_t start, volatile int* stop,
                                   Ready ready, TimedOut timed_out) {
  const uint64_t* err = local_word(p, kErrorWord);
  unsigned spins = 0;
  while (!ready()) {
    spin_pause();
    if ((++spins & 1023u) != 0) continue;
    if (*stop || dev::load_relaxed(err) == kPeerTimeout) {
      *stop = 1;
      return false;
    }
    if (dev::global_timer_ns() - start > p.timeout_ns) {
      timed_out();
      *stop = 1;
      return false;
    }
  }
  return true;
}

// Polls `word` until it carries `epoch` (await_count; a timeout names PE
// `late`).
__device__ inline bool await_tag(const Params& p, const uint64_t* word, uint64_t epoch,
                                 uint64_t start, int late, volatile int* stop, uint64_t* seen) {
  return await_count(
      p, start, stop, [&] { return has_tag(*seen = dev::load_relaxed(word), epoch); },
      [&] {
        record_error(p, kPeerTimeout, late, p.my_pe, epoch, kWaitCounts, *seen >> 32, epoch);
      });
}

// Whole block: waits until every PE's count row (and, expert-major, this
// PE's send order) carry this call's epoch. Token-major blocks that do not
// write the call's expert counts (`all_words` false) wait only for each
// row's status and destination words. With `cache` (token-major), leaves
// the values of those words there ([n][kCountDest + n]) for make_plan.
// False in every thread after a timeout (recorded, naming the late PE) or
// another wait's.
__device__ inline bool wait_counts(const Params& p, uint64_t epoch, bool tm, bool all_words,
                                   int32_t* cache) {
  __shared__ int failed;
  const int n = p.n_pes;
  const int CW = tm ? kCountDest + n : p.geo.count_words;  // words of each row waited first
  const int64_t cells = static_cast<int64_t>(n) * CW;
  const int cols = tm ? 0 : p.cfg.num_experts;  // the send order's words
  const uint64_t* rows = count_rows(p, p.my_pe, epoch);
  const uint64_t* prefix = at<uint64_t>(p, p.my_pe, p.geo.off_send_prefix);
  volatile int* stop = &failed;
  if (threadIdx.x == 0) failed = 0;
  __syncthreads();
  const uint64_t start = dev::global_timer_ns();
  for (int64_t i = threadIdx.x; i < cells + cols && !*stop; i += blockDim.x) {
    const int q = i < cells ? static_cast<int>(i / CW) : p.my_pe;
    const uint64_t* word = i < cells ? rows + q * p.geo.count_words + i % CW : prefix + (i - cells);
    uint64_t seen;
    if (!await_tag(p, word, epoch, start, q, stop, &seen)) break;
    if (cache) cache[i] = static_cast<int32_t>(seen);
  }
  if (tm && all_words) {  // the expert counts, after the row's first words
    const int rest = p.geo.count_words - CW;
    for (int64_t i = threadIdx.x; i < static_cast<int64_t>(n) * rest && !*stop; i += blockDim.x) {
      const int q = static_cast<int>(i / rest);
      uint64_t seen;
      if (!await_tag(p, rows + q * p.geo.count_words + CW + i % rest, epoch, start, q, stop, &seen))
        break;
    }
  }
  __syncthreads();  // (blocks read only the tagged words themselves: no fence)
  return failed == 0;
}

// Token-major, whole block: as wait_counts (no expert counts, `cache`
// required), from the destination sums: waits until every PE's sums count
// every block of its grid, or, for a PE whose grid was not resident at once
// (its blocks rank one after another), until its ticket 0's count row is in.
// The cached status of a PE with a failure is kBadArgument (its detail is
// only ticket 0's to report).
__device__ inline bool wait_dest_sums(const Params& p, uint64_t epoch, int32_t* cache) {
  __shared__ int failed;
  const int n = p.n_pes, W = n + 1, CW = kCountDest + n;
  const uint64_t* sums = dest_sums(p, p.my_pe, epoch);
  const uint64_t* rows = count_rows(p, p.my_pe, epoch);
  const uint64_t blocks = gridDim.x;
  volatile int* stop = &failed;
  if (threadIdx.x == 0) failed = 0;
  __syncthreads();
  const uint64_t start = dev::global_timer_ns();
  for (int i = threadIdx.x; i < n * W && !*stop; i += blockDim.x) {
    const int q = i / W, c = i % W;
    const int w = c < n ? kCountDest + c : kCountStatus;  // the same count in q's row
    const uint64_t* word = rows + q * p.geo.count_words + w;
    uint64_t sum = 0;
    auto ready = [&] {
      sum = dev::load_relaxed(sums + i);
      if ((sum >> kSumShift) == blocks) {
        const int32_t v = static_cast<int32_t>(sum & (kSumBlock - 1));
        cache[q * CW + w] = c < n ? v : v ? kBadArgument : kOk;
        return true;
      }
      const uint64_t tagged_word = dev::load_relaxed(word);
      if (!has_tag(tagged_word, epoch)) return false;
      cache[q * CW + w] = static_cast<int32_t>(tagged_word);
      return true;
    };
    if (!await_count(p, start, stop, ready, [&] {
          record_error(p, kPeerTimeout, q, p.my_pe, epoch, kWaitCounts, sum >> kSumShift, blocks);
        }))
      break;
    if (c == n) cache[q * CW + kCountDetail] = 0;
  }
  __syncthreads();
  return failed == 0;
}

// ------------------------------------------------------------ block counts

// Where the blocks of a dispatch grid leave their counts (ep_config.hpp).
__device__ __forceinline__ int route_cols(const Params& p, bool tm) {
  return tm ? p.n_pes : p.cfg.num_experts;
}
__device__ __forceinline__ int32_t* route_totals(const Params& p, uint64_t epoch) {
  return at<int32_t>(p, p.my_pe, p.geo.off_route_totals) +
         (epoch & 1) * (p.n_pes + p.cfg.num_experts + 1);
}

// Whole block, before it waits for anything: publishes the block's counts
// (run: rows per destination, token-major; hist: pairs per expert) for the
// blocks after it, adds them and its lowest bad pair to this call's totals,
// then says so in its done word.
__device__ inline void share_block_counts(const Params& p, uint64_t epoch, bool tm, int ticket,
                                          const int32_t* run, const int32_t* hist, int bad) {
  const int n = p.n_pes, E = p.cfg.num_experts, cols = route_cols(p, tm);
  const int32_t* own = tm ? run : hist;
  if (tm) add_dest_sums(p, epoch, run, p.arg_status != kOk || bad != INT32_MAX, 1);
  uint64_t* mine =
      at<uint64_t>(p, p.my_pe, p.geo.off_route_counts) + static_cast<size_t>(ticket) * cols;
  for (int c = threadIdx.x; c < cols; c += blockDim.x)
    dev::store_relaxed(mine + c, tagged(epoch, own[c]));
  int32_t* totals = route_totals(p, epoch);
  for (int j = threadIdx.x; j < n + E; j += blockDim.x) {
    const int32_t v = j < n ? (tm ? run[j] : 0) : hist[j - n];
    if (v) atomicAdd(totals + j, v);
  }
  if (threadIdx.x == 0 && bad != INT32_MAX) atomicMax(totals + n + E, INT32_MAX - bad);
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0)
    dev::store_relaxed(at<uint64_t>(p, p.my_pe, p.geo.off_route_done) + ticket, tagged(epoch, 1));
}

// Ticket 0: this PE's counts over every token into run, hist and bad (as
// rank_by_warp / count_expert_pairs), read from the totals once every
// other block's done word says it added to them, or, if some block has not
// within kRouteGraceNs (a grid that is not resident at once), counted from
// every id. dst: as rank_by_warp.
__device__ inline void count_all(const Params& p, uint64_t epoch, bool tm, int32_t* run,
                                 int32_t* hist, int* bad, int16_t* dst) {
  const int n = p.n_pes, E = p.cfg.num_experts;
  __shared__ int missing;
  volatile int* late = &missing;
  if (threadIdx.x == 0) missing = 0;
  __syncthreads();
  const uint64_t* done = at<uint64_t>(p, p.my_pe, p.geo.off_route_done);
  const uint64_t start = dev::global_timer_ns();
  for (unsigned b = 1 + threadIdx.x; b < gridDim.x && !*late; b += blockDim.x)
    while (!has_tag(dev::load_relaxed(done + b), epoch)) {
      if (*late || dev::global_timer_ns() - start > kRouteGraceNs) {
        *late = 1;
        break;
      }
      spin_pause();
    }
  __syncthreads();
  for (int i = threadIdx.x; i < n + E; i += blockDim.x) (i < n ? run[i] : hist[i - n]) = 0;
  if (threadIdx.x == 0) *bad = INT32_MAX;
  __syncthreads();
  if (!missing) {
    __threadfence();  // the totals after the done words
    const volatile int32_t* totals = route_totals(p, epoch);
    for (int i = threadIdx.x; i < n + E; i += blockDim.x)
      (i < n ? run[i] : hist[i - n]) = totals[i];
    if (threadIdx.x == 0 && totals[n + E] != 0) *bad = INT32_MAX - totals[n + E];
    __syncthreads();
  } else if (tm) {
    rank_by_warp(p, 0, p.num_tokens, run, dst, nullptr, hist, bad);
  } else {
    count_expert_pairs(p, 0, p.num_tokens * p.cfg.topk, hist, bad);
  }
}

// Whole block: before[c] = the rows (token-major: to PE c) or pairs
// (expert-major: to expert c) of every block with an earlier ticket, for the
// columns list[0, m) this block uses (0 for the others). Those blocks
// published their counts before waiting for anything, so this waits only on
// blocks that started. False in every thread after a timeout.
__device__ inline bool look_back(const Params& p, uint64_t epoch, bool tm, int ticket,
                                 const int32_t* list, int m, int32_t* before) {
  __shared__ int failed;
  const int cols = route_cols(p, tm);
  const uint64_t* counts = at<uint64_t>(p, p.my_pe, p.geo.off_route_counts);
  volatile int* stop = &failed;
  for (int c = threadIdx.x; c < cols; c += blockDim.x) before[c] = 0;
  if (threadIdx.x == 0) failed = 0;
  __syncthreads();
  const uint64_t start = dev::global_timer_ns();
  const int64_t items = static_cast<int64_t>(m) * ticket;  // (earlier block, column)
  auto word = [&](int64_t i) { return counts + (i / m) * cols + list[i % m]; };
  constexpr int kBatch = 8;
  for (int64_t i0 = threadIdx.x; i0 < items && !*stop;
       i0 += kBatch * static_cast<int64_t>(blockDim.x)) {
    uint64_t v[kBatch];
#pragma unroll
    for (int q = 0; q < kBatch; ++q) {
      const int64_t i = i0 + q * static_cast<int64_t>(blockDim.x);
      v[q] = i < items ? dev::load_relaxed(word(i)) : 0;
    }
#pragma unroll
    for (int q = 0; q < kBatch; ++q) {
      const int64_t i = i0 + q * static_cast<int64_t>(blockDim.x);
      if (i >= items) continue;
      if (!has_tag(v[q], epoch) && !await_tag(p, word(i), epoch, start, p.my_pe, stop, &v[q]))
        break;
      atomicAdd(&before[list[i % m]], static_cast<int32_t>(v[q]));
    }
  }
  __syncthreads();
  return failed == 0;
}

}  // namespace symheap::ep::EP_DEVICE_NS::kernels
