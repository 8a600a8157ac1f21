// Dispatch by counts (intranode, low_latency token-major / expert-major,
// copy engine): every block routes its tokens, waits for every PE's count
// row and stores its rows where they belong.
#pragma once
#include "ops/ep/ep_routing.cuh"

namespace symheap::ep::EP_DEVICE_NS::kernels {

// ------------------------------------------------------------ dispatch

// Shared state of a dispatch block, computed identically by every block from
// the count matrix: abort decision, destination bases and send-list prefixes.
struct DispatchPlan {
  int32_t abort_status, abort_detail, abort_pe;
};

// Word i of PE q's count row (once wait_counts saw this call's tag on it).
__device__ inline int32_t count_cell(const Params& p, uint64_t epoch, int q, int i) {
  return static_cast<int32_t>(
      dev::load_relaxed(count_rows(p, p.my_pe, epoch) + q * p.geo.count_words + i));
}

// Fills `plan` and, in shared memory, base[] (first row of this PE's rows at
// each destination / in each expert's run) and prefix[] (first row of each
// destination / expert in this PE's send order = its combine rows). `cache`:
// wait_counts' copy of the words it needs (token-major), else null.
__device__ inline void make_plan(const Params& p, uint64_t epoch, bool tm, DispatchPlan& plan,
                                 int32_t* base, int32_t* prefix, const int32_t* cache) {
  const int n = p.n_pes, E = p.cfg.num_experts, L = p.geo.local_experts;
  const int cols = tm ? n : E;
  const int first = tm ? kCountDest : kCountDest + n;
  const int CW = kCountDest + n;  // (the cache's row)
  auto cell = [&](int q, int i) { return cache ? cache[q * CW + i] : count_cell(p, epoch, q, i); };
  const uint64_t* my_prefix = at<uint64_t>(p, p.my_pe, p.geo.off_send_prefix);
  __shared__ int bad_pe, overflow_at;
  if (threadIdx.x == 0) {
    bad_pe = n;
    overflow_at = cols;
  }
  __syncthreads();
  for (int q = threadIdx.x; q < n; q += blockDim.x)
    if (cell(q, kCountStatus) != kOk) atomicMin(&bad_pe, q);
  for (int j = threadIdx.x; j < cols; j += blockDim.x) {
    int64_t total = 0, before = 0;
    for (int q = 0; q < n; ++q) {
      int32_t v = cell(q, first + j);
      total += v;
      if (q < p.my_pe) before += v;
    }
    base[j] = static_cast<int32_t>(before);
    if (tm) {  // this PE's rows to the destinations before j
      int32_t sent = 0;
      for (int d = 0; d < j; ++d) sent += cell(p.my_pe, first + d);
      prefix[j] = sent;
    } else {
      prefix[j] = static_cast<int32_t>(dev::load_relaxed(my_prefix + j));
    }
    if (total > (tm ? p.geo.recv_rows : p.geo.expert_cap)) atomicMin(&overflow_at, j);
  }
  __syncthreads();
  if (bad_pe < n) {
    plan.abort_status = cell(bad_pe, kCountStatus);
    plan.abort_detail = cell(bad_pe, kCountDetail);
    plan.abort_pe = bad_pe;
  } else if (overflow_at < cols) {
    plan.abort_status = kRecvOverflow;
    plan.abort_detail = overflow_at;
    plan.abort_pe = tm ? overflow_at : overflow_at / L;
  } else {
    plan.abort_status = kOk;
    plan.abort_detail = 0;
    plan.abort_pe = -1;
  }
}

// Whether this PE must record an abort for the host to raise later. Not when
// the caller found a bad argument here: it raised that at once.
__device__ inline bool must_report(const Params& p, const DispatchPlan& plan) {
  if (plan.abort_status == kOk || p.arg_status != kOk) return false;
  if (plan.abort_pe != p.my_pe) return true;
  return plan.abort_status == kExpertOutOfRange || plan.abort_status == kRecvOverflow;
}

// Outputs of a dispatch that derive from the count matrix: counts, the
// handle's summary. One block. rows: shared scratch of n * n words (each
// PE's rows to each destination, loaded at once rather than one dependent
// load after another), unless `cache` (wait_counts') holds them already.
__device__ inline void finish_counts(const Params& p, uint64_t epoch, bool tm, bool abort,
                                     int32_t* rows, const int32_t* cache) {
  const int n = p.n_pes, L = p.geo.local_experts;
  if (!cache)
    for (int i = threadIdx.x; i < n * n; i += blockDim.x)
      rows[i] = abort ? 0 : count_cell(p, epoch, i / n, kCountDest + i % n);
  for (int l = threadIdx.x; l < L; l += blockDim.x) {
    int32_t c = 0;
    if (!abort)
      for (int q = 0; q < n; ++q) c += count_cell(p, epoch, q, kCountDest + n + p.my_pe * L + l);
    p.expert_counts[l] = c;
    p.recv_summary[4 * n + l] = c;
  }
  __syncthreads();
  auto cell = [&](int q, int d) {  // PE q's rows to PE d
    return !cache ? rows[q * n + d] : abort ? 0 : cache[q * (kCountDest + n) + kCountDest + d];
  };
  for (int q = threadIdx.x; q < n; q += blockDim.x) {
    int32_t range_start = 0, first_row = 0, sent_before = 0;
    for (int d = 0; d < p.my_pe; ++d) range_start += cell(q, d);
    for (int d = 0; d < q; ++d) sent_before += cell(p.my_pe, d);
    if (tm)
      for (int r = 0; r < q; ++r) first_row += cell(r, p.my_pe);
    p.recv_summary[4 * q] = range_start;
    p.recv_summary[4 * q + 1] = cell(q, p.my_pe);
    p.recv_summary[4 * q + 2] = first_row;
    p.recv_summary[4 * q + 3] = sent_before;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int32_t total = 0;
    for (int q = 0; q < n; ++q) total += cell(q, p.my_pe);
    *p.num_recv = total;
    p.recv_summary[4 * n + L] = total;
    p.recv_summary[4 * n + L + 1] = 0;
    p.recv_summary[4 * n + L + 2] = 0;
    p.recv_summary[4 * n + L + 3] = 0;
    static_cast<volatile int32_t*>(p.host_mirror)[kHostNumRecv] = total;
  }
  __syncthreads();
}

// Expert-major: the handle's private copy of the valid rows' metadata (one
// 16-byte vector per row), made once every row has landed and the summary
// is written (token-major handles need none: combine finds each row's
// source and combine row from the summary). Whole block: copies part `part`
// of `parts` of it, several loads in flight per thread.
__device__ inline void copy_meta(const Params& p, int64_t rows, int part, int parts) {
  static_assert(kMetaWords * 4 == 16, "a row's metadata is one 16-byte vector");
  const int n = p.n_pes;
  const int4* meta = at<int4>(p, p.my_pe, p.geo.off_recv_meta);
  int4* out = reinterpret_cast<int4*>(p.recv_meta);
  const int64_t cap = p.geo.expert_cap;
  auto valid = [&](int64_t r) { return r % cap < p.recv_summary[4 * n + r / cap]; };
  const int64_t lo = rows * part / parts, hi = rows * (part + 1) / parts;
  constexpr int kBatch = 8;
  for (int64_t i0 = lo + threadIdx.x; i0 < hi; i0 += kBatch * static_cast<int64_t>(blockDim.x)) {
    int4 v[kBatch];
#pragma unroll
    for (int q = 0; q < kBatch; ++q) {
      const int64_t i = i0 + q * static_cast<int64_t>(blockDim.x);
      if (i < hi && valid(i)) v[q] = __ldcg(meta + i);
    }
#pragma unroll
    for (int q = 0; q < kBatch; ++q) {
      const int64_t i = i0 + q * static_cast<int64_t>(blockDim.x);
      if (i < hi && valid(i)) out[i] = v[q];
    }
  }
}

// One thread: true once flags[q] >= target for every PE q, false if that
// takes more than `ns` (nothing is recorded: the caller has a fallback).
__device__ inline bool landed_within(const Params& p, size_t off_flags, uint64_t target,
                                     uint64_t ns) {
  const uint64_t* flags = at<uint64_t>(p, p.my_pe, off_flags);
  const uint64_t start = dev::global_timer_ns();
  for (int q = 0; q < p.n_pes; ++q) {
    while (dev::load_relaxed(flags + q) < target) {
      if (dev::global_timer_ns() - start > ns) return false;
      spin_pause();
    }
    dev::load_acquire(flags + q);
  }
  return true;
}

// End of an expert-major dispatch (not pack mode), once the block published
// its rows (`order`: its arrival). The rows' metadata is copied in
// parts of at least kMetaPartRows rows: part 0 by the last block; part h by
// the block that arrived h places before it if every row lands within
// kHelpNs (a bounded wait: a block never waits long for blocks that may not
// have started), else by the last block, which reads each helper's decision.
__device__ inline void finish_dispatch(const Params& p, uint64_t epoch, unsigned order,
                                       bool abort) {
  constexpr int64_t kMetaPartRows = 1024;
  const bool last = order == gridDim.x - 1;
  const int most = 1 + static_cast<int>(imin(kMetaHelpers, gridDim.x - 1));
  const int part = static_cast<int>(gridDim.x - 1 - order);
  if (part >= most) return;
  const uint64_t target = epoch * p.flag_per_epoch;
  uint64_t* decision = local_word(p, kMetaHelp);  // part h's at h - 1
  __shared__ bool landed;
  __shared__ unsigned left;  // bit h: part h's helper did not take it
  if (threadIdx.x == 0) {
    if (last) {
      landed = wait_all(p, p.geo.off_data_flag, target, epoch);
      left = 0;
    } else {
      landed = landed_within(p, p.geo.off_data_flag, target, kHelpNs);
      // (the last block reads it)
      dev::store_relaxed(decision + part - 1, tagged(epoch, landed ? 1 : 0));
    }
  }
  __syncthreads();
  if (!landed || abort) {
    if (last && threadIdx.x == 0) *local_word(p, kDispatchEpoch) = epoch;
    return;
  }
  const int parts = static_cast<int>(
      imin(most, imax(1, (p.geo.recv_rows + kMetaPartRows - 1) / kMetaPartRows)));
  if (part < parts) copy_meta(p, p.geo.recv_rows, part, parts);
  if (!last) return;
  const int h = static_cast<int>(threadIdx.x);
  if (h >= 1 && h < parts) {  // a helper decides within kHelpNs of its arrival
    const uint64_t start = dev::global_timer_ns();
    uint64_t word;
    while (!has_tag(word = dev::load_relaxed(decision + h - 1), epoch) &&
           dev::global_timer_ns() - start < p.timeout_ns)
      spin_pause();
    if (!has_tag(word, epoch) || static_cast<uint32_t>(word) != 1u) atomicOr(&left, 1u << h);
  }
  __syncthreads();
  for (int k = 1; k < parts; ++k)
    if ((left >> k) & 1u) copy_meta(p, p.geo.recv_rows, k, parts);
  __syncthreads();
  if (threadIdx.x == 0) *local_word(p, kDispatchEpoch) = epoch;
}

// ------------------------------------------------------------ published outputs

// A board word (Geometry::off_out_board): the call's epoch and an address.
__device__ __forceinline__ uint64_t out_word(uint64_t epoch, const void* a) {
  return ((epoch & kOutTagMask) << kOutTagShift) | (reinterpret_cast<uint64_t>(a) >> 4);
}

// Ticket 0, when the op's peers write its outputs: this call's output
// addresses (null unless it publishes them) onto every PE's board, first
// thing, so peers that have this PE's counts find them at once.
__device__ inline void post_output_addresses(const Params& p, uint64_t epoch) {
  const bool on = p.publish_outputs != 0;
  const void* field[kOutFields] = {on ? p.out_x : nullptr, on ? p.out_scales : nullptr,
                                   on ? p.out_idx : nullptr, on ? p.out_w : nullptr,
                                   on ? p.out_meta : nullptr};
  for (int i = threadIdx.x; i < p.n_pes * kOutFields; i += blockDim.x) {
    const int q = i / kOutFields, f = i % kOutFields;
    dev::store_relaxed(at<uint64_t>(p, q, p.geo.off_out_board) + p.my_pe * kOutFields + f,
                       out_word(epoch, field[f]));
  }
}

// One thread: PE q's output addresses of this call (null: its receive
// buffer), once its words carry this epoch. A timeout is recorded (the call
// raises) and leaves them null.
__device__ inline void read_outputs(const Params& p, uint64_t epoch, int q, char** out) {
  const uint64_t* words = at<uint64_t>(p, p.my_pe, p.geo.off_out_board) + q * kOutFields;
  const uint64_t* err = local_word(p, kErrorWord);
  const uint64_t start = dev::global_timer_ns();
  const uint64_t tag = epoch & kOutTagMask;
  unsigned spins = 0;
  for (int f = 0; f < kOutFields; ++f) out[f] = nullptr;
  for (int f = 0; f < kOutFields; ++f) {
    uint64_t w;
    while (((w = dev::load_relaxed(words + f)) >> kOutTagShift) != tag) {
      spin_pause();
      if ((++spins & 1023u) != 0) continue;
      if (dev::load_relaxed(err) == kPeerTimeout) return;
      if (dev::global_timer_ns() - start > p.timeout_ns) {
        record_error(p, kPeerTimeout, q, p.my_pe, epoch, kWaitCounts, w >> kOutTagShift, tag);
        return;
      }
    }
    out[f] = reinterpret_cast<char*>((w & ((uint64_t{1} << kOutTagShift) - 1)) << 4);
  }
}

// Ticket 0 of a call that published its outputs (no collect follows): the
// defaults past the counts, as collect_kernel writes them (token-major ids
// -1, weights 0, metadata -1; expert-major weights 0). After finish_counts.
__device__ inline void fill_output_defaults(const Params& p, bool tm) {
  const Geometry& g = p.geo;
  const int64_t K = p.cfg.topk;
  if (tm) {
    const int64_t valid = *p.num_recv;
    for (int64_t i = valid * K + threadIdx.x; i < g.recv_rows * K; i += blockDim.x) {
      p.out_idx[i] = -1;
      p.out_w[i] = 0.0f;
    }
    for (int64_t i = valid * kMetaWords + threadIdx.x; i < g.recv_rows * kMetaWords;
         i += blockDim.x)
      p.out_meta[i] = -1;
  } else {
    for (int64_t r = threadIdx.x; r < g.recv_rows; r += blockDim.x)
      if (r % g.expert_cap >= p.expert_counts[r / g.expert_cap]) p.out_w[r] = 0.0f;
  }
  __syncthreads();
}

// The call's kind, when the host can tell, fixed at compile time: each
// instance holds only the code its calls run (one kernel for every kind is
// larger than an SM's instruction cache).
enum DispatchPath : int {
  kAnyDispatch,      // decided at run time (expert-major, copy engine)
  kSmallTokenMajor,  // token-major, small (every id in one round of loads)
  kLargeTokenMajor,  // token-major, ranked by look-back
};
// Small: every id of the call in one round of loads (eight per thread).
constexpr bool small_dispatch(int64_t tokens, int topk) {
  return tokens * topk <= 8 * static_cast<int64_t>(kThreads);
}
inline DispatchPath dispatch_path(const Params& p) {
  if (p.cfg.layout != Layout::TokenMajor || p.pack_for_copy_engine) return kAnyDispatch;
  return small_dispatch(p.num_tokens, p.cfg.topk) ? kSmallTokenMajor : kLargeTokenMajor;
}

// Routes, then stores (or, in pack mode, stages) the rows of this block's
// tokens: p.tokens_per_block of them, by ticket (the order blocks start;
// none for ticket 0 when p.spare_ticket0).
// Every block waits for every count row, so all agree on aborts and on
// destinations; a block waits only for blocks with an earlier ticket (which
// started before it) and for ticket 0, which never waits for a block that
// may not have started, so the grid needs no co-residency.
template <int Path>
__global__ void __launch_bounds__(kThreads) dispatch_kernel(Params p) {
  const int n = p.n_pes, K = p.cfg.topk, E = p.cfg.num_experts, L = p.geo.local_experts;
  const bool tm = Path != kAnyDispatch || p.cfg.layout == Layout::TokenMajor;
  const bool pack = Path == kAnyDispatch && p.pack_for_copy_engine;
  const Geometry& g = p.geo;
  prefetch_peers(p);
  start_kernel();
  const uint64_t epoch = dev::load_relaxed(local_word(p, kDispatchEpoch)) + 1;
  const int cols = tm ? n : E;
  EP_DYNAMIC_SHARED(int32_t, dyn);
  int32_t* base = dyn;             // [cols]
  int32_t* prefix = base + cols;   // [cols]
  int32_t* before = prefix + cols; // [cols] rank offsets from the earlier blocks
  int32_t* used = before + cols;   // [cols] the columns this block's rows use
  int32_t* hist = used + cols;     // [E] pairs per expert
  int32_t* run = hist + E;         // [n] rows per destination (token-major)
  // [max(warps * n + 4 * blockDim.x (token-major ids as int16), blockDim.x, 2 * cols, n * n,
  //      n * (kCountDest + n) (token-major: the count words' cache))]
  int32_t* scratch = run + n;
  int16_t* dst = reinterpret_cast<int16_t*>(scratch + kWarpsPerBlock * n);
  // A small call (every id in one round of loads, at most eight per
  // thread) needs no look-back: token-major, every block ranks every token
  // and keeps its own tokens' ranks (no block reads another's); expert-major,
  // each block counts the pairs before its own, and ticket 0 also those after.
  const bool small =
      Path == kSmallTokenMajor || (Path == kAnyDispatch && small_dispatch(p.num_tokens, K));
  __shared__ int ticket, bad, n_used;
  if (threadIdx.x == 0) {
    bad = INT32_MAX;
    n_used = 0;
  }
  for (int i = threadIdx.x; i < E + n; i += blockDim.x) hist[i] = 0;  // and run
  __syncthreads();
  auto* tickets = reinterpret_cast<unsigned long long*>(local_word(p, kDispatchTicket));
  unsigned long long taken = 0;
  if (threadIdx.x == 0) taken = atomicAdd(tickets, 1ull);
  // Small token-major calls load every id while the ticket is on its way
  // (every block tallies them; ticket 0's tally is the one published).
  if (small && tm) load_dests(p, 0, p.num_tokens, dst, hist, &bad);
  if (threadIdx.x == 0) {
    ticket = static_cast<int>(taken);
    if (ticket == static_cast<int>(gridDim.x) - 1) *tickets = 0;  // every block has its ticket
  }
  __syncthreads();
  if (p.peers_write_outputs && !pack && ticket == 0) post_output_addresses(p, epoch);
  // (a spare ticket 0 takes the empty range at T)
  const int64_t slot = ticket - p.spare_ticket0;
  const int64_t t0 = slot < 0 ? p.num_tokens : imin(slot * p.tokens_per_block, p.num_tokens);
  const int64_t t1 = imin(t0 + p.tokens_per_block, p.num_tokens);
  // Ranks of the rows: among this PE's rows to their destination or expert
  // (small calls) or among this block's (plus before[], from the look-back).
  int32_t* pos = at<int32_t>(p, p.my_pe, g.off_scratch_pos);
  bool ranked = true;
  if (small) {
    for (int c = threadIdx.x; c < cols; c += blockDim.x) before[c] = 0;
    if (tm) {
      if (rank_by_barriers_fits(p, t1 - t0)) rank_by_barriers(p, t0, t1, run, dst, pos);
      else rank_dest_rows(p, t0, t1, run, scratch, dst, pos);
    } else {
      count_expert_pairs(p, 0, t0 * K, hist, ticket == 0 ? &bad : nullptr);
      rank_expert_pairs(p, t0 * K, t1 * K, hist, scratch, pos, ticket == 0 ? &bad : nullptr);
      if (ticket == 0) count_expert_pairs(p, t1 * K, p.num_tokens * K, hist, &bad);
    }
    // (every block ranked every token: ticket 0 adds them for the grid, so
    // a PE whose blocks rank by look-back need not wait for this count row)
    if (ticket == 0) {
      publish_counts(p, epoch, tm, run, hist, bad, scratch);
      if (tm) add_dest_sums(p, epoch, run, p.arg_status != kOk || bad != INT32_MAX, gridDim.x);
    }
  } else {
    if (tm) rank_by_warp(p, t0, t1, run, dst, pos, hist, &bad);
    else rank_expert_pairs(p, t0 * K, t1 * K, hist, scratch, pos, &bad);
    share_block_counts(p, epoch, tm, ticket, run, hist, bad);
    for (int c = threadIdx.x; c < cols; c += blockDim.x)
      if ((tm ? run : hist)[c] > 0) used[atomicAdd(&n_used, 1)] = c;
    __syncthreads();
    if (ticket == 0) {
      count_all(p, epoch, tm, run, hist, &bad, dst);
      publish_counts(p, epoch, tm, run, hist, bad, scratch);
    }
    ranked = look_back(p, epoch, tm, ticket, used, n_used, before);
  }
  // The next call's totals and destination sums: the previous call, the
  // last to add to them, ended here; peers add to the sums only after they
  // saw this call's data flags, which follow these stores (publish).
  if (ticket == 0) {
    int32_t* next = route_totals(p, epoch + 1);
    for (int i = threadIdx.x; i <= n + E; i += blockDim.x) next[i] = 0;
    uint64_t* next_sums = tm ? dest_sums(p, p.my_pe, epoch + 1) : nullptr;
    for (int i = threadIdx.x; tm && i < n * (n + 1); i += blockDim.x) next_sums[i] = 0;
  }

  __shared__ DispatchPlan plan;
  // (token-major: the count words a plan needs, cached in the scratch that
  // the routing no longer uses; finish_counts reuses it after the plan.
  // Blocks that ranked by look-back take them from the destination sums;
  // ticket 0, which reports failures and the expert counts, from the rows.)
  int32_t* cache = tm ? scratch : nullptr;
  const bool by_sums = tm && !small && ticket != 0;
  const bool counted = ranked && (by_sums ? wait_dest_sums(p, epoch, cache)
                                          : wait_counts(p, epoch, tm, ticket == 0, cache));
  if (counted) {
    DispatchPlan local;
    make_plan(p, epoch, tm, local, base, prefix, cache);
    if (threadIdx.x == 0) plan = local;
  } else if (threadIdx.x == 0) {
    plan = DispatchPlan{kPeerTimeout, 0, -1};
  }
  __syncthreads();
  const bool abort = plan.abort_status != kOk;
  if (ticket == 0) {  // the call's outputs that need only the counts
    if (threadIdx.x == 0 && must_report(p, plan))
      record_error(p, plan.abort_status, plan.abort_detail, plan.abort_pe, epoch);
    finish_counts(p, epoch, tm, abort, scratch, cache);  // (an abort reads no cell)
    if (p.publish_outputs && !pack) fill_output_defaults(p, tm);
  }
  // Where rows go when not into a receive buffer: this PE's outputs, and
  // each peer's published ones (null: its receive buffer).
  __shared__ char* self_out[kOutFields];
  __shared__ char* peer_out[kMaxOutPeers][kOutFields];
  if (threadIdx.x == 0) {
    self_out[kOutX] = p.out_x;
    self_out[kOutScales] = p.out_scales;
    self_out[kOutIdx] = reinterpret_cast<char*>(p.out_idx);
    self_out[kOutW] = reinterpret_cast<char*>(p.out_w);
    self_out[kOutMeta] = reinterpret_cast<char*>(p.out_meta);
  }
  if (p.peers_write_outputs && !pack) {
    const int q = static_cast<int>(threadIdx.x);
    if (!abort && q < n && q != p.my_pe) read_outputs(p, epoch, q, peer_out[q]);
  }
  __syncthreads();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int warps = static_cast<int>(blockDim.x >> 5);
  const int64_t T = abort ? 0 : p.num_tokens;
  const int64_t b0 = imin(t0, T), b1 = imin(t1, T);  // this block's tokens

  // Destination of a row: a peer's receive buffer, or local staging (pack).
  auto target = [&](int d, size_t off) {
    return pack ? at<char>(p, p.my_pe, off) : at<char>(p, d, off);
  };
  const size_t off_x = pack ? g.off_stage_x : g.off_recv_x;
  const size_t off_s = pack ? g.off_stage_scales : g.off_recv_scales;
  const size_t off_i = pack ? g.off_stage_idx : g.off_recv_idx;
  const size_t off_w = pack ? g.off_stage_w : g.off_recv_w;
  const size_t off_m = pack ? g.off_stage_meta : g.off_recv_meta;
  const int S = g.send_cols;

  // One unit = one piece of one (token, column) row: small batches spread
  // their rows over every warp of the grid.
  // (32-bit unit indices: make_geometry bounds max_tokens * send_cols *
  // kMaxPieces; 64-bit divisions would cost code and time)
  const int P = p.row_pieces;
  const int32_t units = static_cast<int32_t>((b1 - b0) * S * P);
  for (int32_t u = warp; u < units; u += warps) {
    const int32_t i = static_cast<int32_t>(b0) * S + u / P, t = i / S;
    const int piece = u % P;
    if (pos[i] < 0) continue;
    const int32_t id = tm ? -1 : static_cast<int32_t>(topk_id(p, i));
    const int d = tm ? i % S : id / L;
    const int32_t rank = before[tm ? d : id] + pos[i];
    const int32_t crow = prefix[tm ? d : id] + rank;
    const int64_t r = pack ? crow
                      : tm   ? static_cast<int64_t>(base[d]) + rank
                             : static_cast<int64_t>(id % L) * g.expert_cap + base[id] + rank;
    // Rows go straight into the destination's own outputs: this PE's when the
    // caller gave them (token-major; any layout when published), a peer's
    // when it published them; else into its receive buffer (collect_kernel
    // copies them out there when its caller owns the outputs).
    char* const* out = nullptr;
    if (!pack && d == p.my_pe && p.out_x && (tm || p.publish_outputs)) out = self_out;
    else if (!pack && d != p.my_pe && p.peers_write_outputs && peer_out[d][kOutX]) out = peer_out[d];
    const bool direct = out != nullptr;
    warp_copy_piece((direct ? out[kOutX] : target(d, off_x)) + r * g.row_bytes,
                    p.tokens + t * g.row_bytes, g.row_bytes, piece, P, lane);
    if (piece != 0) continue;
    if (g.scale_row_bytes)
      warp_copy((direct ? out[kOutScales] : target(d, off_s)) + r * g.scale_row_bytes,
                p.token_scales + t * g.scale_row_bytes, g.scale_row_bytes, lane);
    if (tm) {
      int32_t* idx = reinterpret_cast<int32_t*>(direct ? out[kOutIdx] : target(d, off_i)) + r * K;
      float* w = reinterpret_cast<float*>(direct ? out[kOutW] : target(d, off_w)) + r * K;
      for (int k = lane; k < K; k += 32) {
        const int64_t e = topk_id(p, static_cast<int64_t>(t) * K + k);
        const bool local = kept_id(p, e) && static_cast<int32_t>(e) / L == d;
        idx[k] = local ? static_cast<int32_t>(e) % L : -1;
        w[k] = local ? p.topk_weights[static_cast<int64_t>(t) * K + k] : 0.0f;
      }
    } else if (lane == 0) {
      reinterpret_cast<float*>(direct ? out[kOutW] : target(d, off_w))[r] = p.topk_weights[i];
    }
    if (lane < kMetaWords) {  // (expert-major: into the receive buffer, for the handle's copy)
      const int32_t slot = tm ? -1 : i % S;
      const int32_t v = lane == kMetaSrcPe ? p.my_pe : lane == kMetaToken ? t
                                                  : lane == kMetaSlot ? slot : crow;
      reinterpret_cast<int32_t*>(direct && tm ? out[kOutMeta]
                                              : target(d, off_m))[r * kMetaWords + lane] = v;
    }
  }
  // Peers wait for the rows: flag them first (thread 0 waits in the fence
  // while the others write the handle).
  if (!pack) publish(p, g.off_data_flag, 1, true);
  // Handle: the combine row of every (token, destination | slot) of this
  // block's tokens, -1 if none; the blocks share the rows past T.
  for (int32_t i = static_cast<int32_t>(b0 * S) + threadIdx.x; i < b1 * S; i += blockDim.x) {
    const int col = tm ? i % S : static_cast<int>(topk_id(p, i));
    p.send_rows[i] = pos[i] < 0 ? -1 : prefix[col] + before[col] + pos[i];
  }
  const int64_t gtid = static_cast<int64_t>(ticket) * blockDim.x + threadIdx.x;
  const int64_t gthreads = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = T * S + gtid; i < static_cast<int64_t>(p.cfg.max_tokens) * S; i += gthreads)
    p.send_rows[i] = -1;
  if (p.saved_weights)
    for (int64_t i = gtid; i < T * K; i += gthreads) p.saved_weights[i] = p.topk_weights[i];

  if (tm && !pack) {
    // Token-major: nothing to copy once the rows are in. The block that took
    // the last ticket (every block has started) waits for every PE's blocks
    // (this PE's flag counts its own, so all of them have read the epoch),
    // and the kernel ends with it.
    if (ticket == static_cast<int>(gridDim.x) - 1 && threadIdx.x == 0) {
      wait_all(p, g.off_data_flag, epoch * p.flag_per_epoch, epoch);
      *local_word(p, kDispatchEpoch) = epoch;
    }
    return;
  }
  const unsigned order = arrival(p, kDispatchDone, gridDim.x);
  const bool last = order == gridDim.x - 1;
  if (pack) {
    if (!last) return;
    // The copy plan for the host: one segment per destination (token-major)
    // or per expert (expert-major) with rows.
    if (threadIdx.x == 0) {
      volatile int32_t* h = p.host_mirror;
      int segs = 0;
      if (!abort)
        for (int j = 0; j < cols; ++j) {
          int32_t rows = count_cell(p, epoch, p.my_pe, (tm ? kCountDest : kCountDest + n) + j);
          if (rows == 0) continue;
          volatile int32_t* s = h + kHostSegment0 + 4 * segs++;
          s[0] = tm ? j : j / L;
          s[1] = prefix[j];
          s[2] = tm ? base[j] : static_cast<int32_t>((j % L) * g.expert_cap + base[j]);
          s[3] = rows;
        }
      h[kHostSegments] = segs;
      h[kHostAbort] = abort ? 1 : 0;
      __threadfence_system();
    }
    return;  // finish_kernel completes the call once the copies landed
  }
  finish_dispatch(p, epoch, order, abort);
}

// Launches the dispatch_kernel instance for the call's path on `blocks`
// blocks (Rt: ep_device_driver.hpp's runtime). Shared memory: base, prefix,
// rank offsets and used columns per column, counts per expert and
// destination, scratch (routing; the count words' cache).
template <class Rt>
void launch_dispatch(Rt& rt, const Params& p, int blocks, StreamHandle stream) {
  const int cols = p.cfg.layout == Layout::TokenMajor ? p.n_pes : p.cfg.num_experts;
  const size_t n = static_cast<size_t>(p.n_pes);
  const size_t scratch = std::max({static_cast<size_t>(kWarpsPerBlock) * n +
                                       4 * static_cast<size_t>(kThreads),
                                   static_cast<size_t>(kThreads), 2 * static_cast<size_t>(cols),
                                   n * n, n * (kCountDest + n)});
  const size_t shared =
      (4 * static_cast<size_t>(cols) + p.cfg.num_experts + p.n_pes + scratch) * sizeof(int32_t);
  switch (dispatch_path(p)) {
    case kSmallTokenMajor:
      rt.launch_early(dispatch_kernel<kSmallTokenMajor>, blocks, kThreads, shared, stream, p);
      break;
    case kLargeTokenMajor:
      rt.launch_early(dispatch_kernel<kLargeTokenMajor>, blocks, kThreads, shared, stream, p);
      break;
    default:
      rt.launch_early(dispatch_kernel<kAnyDispatch>, blocks, kThreads, shared, stream, p);
  }
}

// Copy engine: once the host queued the copies and their signals, waits for
// every peer's rows and copies the handle's metadata (expert-major;
// dispatch_kernel in pack mode already wrote the counts).
__global__ void __launch_bounds__(kThreads) finish_kernel(Params p, int32_t abort) {
  start_kernel();
  const uint64_t epoch = dev::load_relaxed(local_word(p, kDispatchEpoch)) + 1;
  __shared__ bool ok;
  if (threadIdx.x == 0) ok = wait_all(p, p.geo.off_data_flag, epoch * p.flag_per_epoch, epoch);
  __syncthreads();
  if (ok && !abort && p.cfg.layout == Layout::ExpertMajor) copy_meta(p, p.geo.recv_rows, 0, 1);
  __syncthreads();
  if (threadIdx.x == 0) *local_word(p, kDispatchEpoch) = epoch;
}

template <class Rt>
void launch_finish_dispatch(Rt& rt, const Params& p, int32_t abort, StreamHandle stream) {
  rt.launch(finish_kernel, 1, kThreads, 0, stream, p, abort);
}

}  // namespace symheap::ep::EP_DEVICE_NS::kernels
