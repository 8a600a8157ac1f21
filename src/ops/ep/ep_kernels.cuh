// CUDA kernels of expert-parallel dispatch/combine. The protocol is the cpu
// implementation's (ep_cpu.cpp): routing counts exchanged through every PE's
// count rows, rows stored straight into their final place, epoch flags.
//
// Blocks never wait on a block of their own grid that may not have started,
// only on blocks that took an earlier ticket and on kernels of other PEs, so
// no grid needs to be co-resident:
//   dispatch       every block counts and ranks its own tokens, publishes
//                  its counts for the blocks after it and adds them to this
//                  PE's totals (token-major: also to every PE's destination
//                  sums); it takes its rank offsets from the blocks before
//                  it (a look-back). Ticket 0 publishes this PE's count row
//                  (epoch-tagged words, no fence) from the totals once every
//                  block added to them, or after a grace period from a count
//                  of its own (small calls rank from one round of loads,
//                  with no look-back). Every block waits for every PE's
//                  counts (token-major blocks with a look-back: from the
//                  sums, unless a count row comes first), stores its rows
//                  into peers (or, in pack mode, into local staging for the
//                  copy engines) and adds 1 to each peer's data flag;
//                  token-major, the block with the last ticket then waits
//                  for every PE's blocks; expert-major, the last block to
//                  arrive does, and copies the rows' metadata into the
//                  handle, helped by the few blocks that arrived just
//                  before it when the rows land soon (a bounded wait);
//   dispatch_slots (token_slots) rows go to fixed rows, so blocks wait only
//                  for each destination's "entered" word; block 0 counts,
//                  publishes the count row and writes the outputs meanwhile;
//   combine        (intranode, low_latency) blocks take roles in the order
//                  they start: senders wait until each source consumed its
//                  combine buffer (unless it has two, used in turn), store
//                  rows back into it (in the order of a shared counter)
//                  and flag each piece of a row;
//                  reducers (started after every sender) sum
//                  each token once its pieces have landed; the last reducer
//                  to finish marks this PE's buffer consumed on every peer
//                  (with two buffers, the last to start ends the call);
//   combine_pack / combine_reduce   the copy engine's combine: stage and plan,
//                  then (after the host's copies) sum.
// Small batches split each row between several warps, so a call of a few
// hundred rows still uses the whole GPU.
// Epochs live on the device, so the launches can be captured in a CUDA graph
// and replayed. Every wait gives up after timeout_ns, recording the late PE
// in the error word (and its host-mapped mirror); the host raises it.
//
// The file also compiles as host C++ (ep_device_compat.hpp): the cpu test
// suite runs these kernels in an emulation (ep_emulated.cpp).
#pragma once
#include <cstdint>

#include "ops/ep/ep_config.hpp"
#include "ops/ep/ep_device_compat.hpp"
#ifndef __CUDACC__
#include "ops/ep/ep_numeric.hpp"
#endif

namespace symheap::ep::EP_DEVICE_NS::kernels {

// Combine reduces each token as soon as its rows landed (one flag per piece
// of a row) from this many combine rows on; smaller calls wait for whole PEs.
#ifdef __CUDACC__
constexpr int kThreads = 512;  // dispatch / combine blocks
constexpr int64_t kRowFlagRows = 2048;
#else  // the host emulation: fewer OS threads per block, hence more blocks per grid
constexpr int kThreads = 64;
constexpr int64_t kRowFlagRows = 64;
#endif
constexpr int kWarpsPerBlock = kThreads / 32;
// With row flags, combine sums each piece of a row in this many parts (each
// a warp's unit): the sums left when the last rows land take fewer rounds.
constexpr int kReduceSplit = 2;
// Combine's reducers keep where each row of a token lies in shared memory
// ([warps][send_cols] pointers) when a token has at most this many columns.
constexpr int kMaxCachedCols = 128;
// kRouteGraceNs: how long dispatch's ticket 0 waits for the other blocks'
// counts before it counts every token itself (they are late only when the
// grid is not resident at once; the emulation runs one block at a time).
// kHelpNs: how long a block that arrived just before dispatch's last one
// waits for every row to land, to copy a part of the metadata.
#ifdef __CUDACC__
constexpr uint64_t kRouteGraceNs = 20000;
constexpr uint64_t kHelpNs = 20000;
#else
constexpr uint64_t kRouteGraceNs = 0;
constexpr uint64_t kHelpNs = 0;
#endif

// Host-mapped mirror (int32 words): what the host reads without a device
// synchronisation, or after one.
enum HostWord : int {
  kHostStatus = 0, kHostDetail = 1, kHostPe = 2, kHostEpoch = 3,  // first recorded failure
  kHostNumRecv = 4,  // rows received (sync paths)
  kHostAbort = 5,    // the last packed call was aborted (copy engine)
  kHostSegments = 6, // number of copy segments below
  // A timed-out wait (with the first failure): which flags, the late PE's
  // flag as last read, and the value waited for.
  kHostWait = 7, kHostSeen = 8, kHostTarget = 9,
  kHostSegment0 = 12  // [4 * i]: (peer, staging / source row, destination row, rows)
};

// What a wait was for (kHostWait).
enum WaitKind : int32_t { kWaitNone = 0, kWaitCounts = 1, kWaitData = 2, kWaitFreed = 3,
                          kWaitCombine = 4, kWaitEntered = 5 };

struct Params {
  Config c;
  Geometry g;
  char* const* peers;  // heap base of every PE, as seen from this device (device table)
  uint64_t ws;         // heap offset of the workspace
  char* self;          // this PE's workspace: local words need no load from the table
  int32_t me, n;
  int64_t T;  // tokens of this call (0 when this PE aborts)
  int32_t host_status, host_detail;
  int32_t pack;  // copy engine: stage locally, the host moves the rows
  int64_t tokens_per_block;  // dispatch_kernel: tokens routed and sent by one block
  int32_t spare_ticket0;     // dispatch_kernel: ticket 0 (which totals the counts) takes no
                             // tokens; ticket t takes those of slot t - 1
  int32_t flag_per_epoch;  // what each peer adds to a data / combine flag per call
  int32_t pieces;          // warps that share one row (at most kMaxPieces)
  int32_t senders;         // combine_kernel: blocks that send (the others reduce)
  int32_t row_flags;       // combine_kernel: reducers wait per row, not for whole PEs
  int32_t reduce_pieces;   // warps that share one token's sum (row_flags: kReduceSplit * pieces)
  uint64_t timeout_ns;
  int32_t* host;  // device address of the host-mapped mirror
  // dispatch
  const char* x;
  const char* scales;
  const void* idx;
  int32_t idx64;
  const float* w;
  int32_t* num_recv;
  int32_t* expert_counts;
  int32_t* send_rows;
  int32_t* recv_meta;
  int32_t* summary;
  float* saved_w;
  // combine
  const char* expert_out;
  const int32_t* h_send_rows;
  const int32_t* h_meta;
  const int32_t* h_summary;
  const float* cw;
  char* out;
};

// ------------------------------------------------------------ primitives

template <class T>
__device__ __forceinline__ T* at(const Params& p, int pe, size_t off) {
  return reinterpret_cast<T*>((pe == p.me ? p.self : p.peers[pe] + p.ws) + off);
}
__device__ __forceinline__ uint64_t* local_word(const Params& p, int w) {
  return at<uint64_t>(p, p.me, p.g.off_local) + w;
}

#ifdef __CUDACC__
__device__ __forceinline__ uint64_t ld_acquire(const uint64_t* a) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(a) : "memory");
  return v;
}
__device__ __forceinline__ void st_word(uint64_t* a, uint64_t v) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(a), "l"(v) : "memory");
}
__device__ __forceinline__ void add_release(uint64_t* a, uint64_t v) {
  asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(a), "l"(v) : "memory");
}
__device__ __forceinline__ void add_relaxed(uint64_t* a, uint64_t v) {
  asm volatile("red.relaxed.sys.global.add.u64 [%0], %1;" ::"l"(a), "l"(v) : "memory");
}
__device__ __forceinline__ uint64_t now_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ void spin_pause() {}
// Orders this thread's earlier writes (and, after a barrier, its block's)
// before its later ones, for every PE: with a relaxed flag after it, a
// release. Lighter than __threadfence_system (no sequentially consistent order).
__device__ __forceinline__ void fence_release() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }
// Thread 0: brings the peer table into this SM's L1 at kernel start, so the
// first stores into each peer do not wait for it.
__device__ __forceinline__ void prefetch_peers(const Params& p) {
  if (threadIdx.x == 0)
    for (int q = 0; q < p.n; q += 16) asm volatile("prefetch.global.L1 [%0];" ::"l"(p.peers + q));
}
// Starts bringing the 128-byte line at `a` into L2 (no register waits for it).
__device__ __forceinline__ void prefetch_l2(const void* a) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(a));
}
// Programmatic dependent launch (sm_90+; the host opts in per launch): the
// next kernel on the stream may start once every block of this one called
// release_next_kernel(); each kernel waits for the previous one's memory
// (wait_prior_kernel) before reading any. start_kernel: both, at once.
__device__ __forceinline__ void release_next_kernel() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void wait_prior_kernel() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void start_kernel() {
  release_next_kernel();
  wait_prior_kernel();
}
#else
inline uint64_t ld_acquire(const uint64_t* a) { return __atomic_load_n(a, __ATOMIC_ACQUIRE); }
inline void st_word(uint64_t* a, uint64_t v) { __atomic_store_n(a, v, __ATOMIC_RELAXED); }
inline void add_release(uint64_t* a, uint64_t v) { __atomic_fetch_add(a, v, __ATOMIC_RELEASE); }
inline void add_relaxed(uint64_t* a, uint64_t v) { __atomic_fetch_add(a, v, __ATOMIC_RELAXED); }
inline uint64_t now_ns() {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                   std::chrono::steady_clock::now().time_since_epoch())
                                   .count());
}
inline void spin_pause() { sched_yield(); }
inline void fence_release() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void prefetch_peers(const Params&) {}
inline void prefetch_l2(const void*) {}
inline void release_next_kernel() {}
inline void wait_prior_kernel() {}
inline void start_kernel() {}
#endif
__device__ __forceinline__ uint64_t ld_volatile(const uint64_t* a) {
  return *reinterpret_cast<const volatile uint64_t*>(a);
}

// Records the first failure on this PE (device word, then the host mirror).
__device__ inline void record_error(const Params& p, int32_t status, int32_t detail, int32_t pe,
                                    uint64_t epoch, int32_t wait = kWaitNone, uint64_t seen = 0,
                                    uint64_t target = 0) {
  auto* word = reinterpret_cast<unsigned long long*>(local_word(p, kErrorWord));
  if (atomicCAS(word, 0ull, static_cast<unsigned long long>(status)) == 0ull) {
    volatile int32_t* h = p.host;
    h[kHostDetail] = detail;
    h[kHostPe] = pe;
    h[kHostEpoch] = static_cast<int32_t>(epoch);
    h[kHostWait] = wait;
    h[kHostSeen] = static_cast<int32_t>(seen);
    h[kHostTarget] = static_cast<int32_t>(target);
    __threadfence_system();
    h[kHostStatus] = status;
    __threadfence_system();
  }
}

// One thread waits until flags[q] >= target for every PE q. After a timeout
// (recorded, naming the first late PE) it returns false at once, and so do
// later waits, so a broken job fails fast instead of hanging.
__device__ inline bool wait_all(const Params& p, size_t off_flags, uint64_t target,
                                uint64_t epoch) {
  const uint64_t* flags = at<uint64_t>(p, p.me, off_flags);
  const uint64_t* err = local_word(p, kErrorWord);
  if (ld_volatile(err) == kPeerTimeout) return false;
  const uint64_t start = now_ns();
  for (int q = 0; q < p.n; ++q) {
    unsigned spins = 0;
    uint64_t seen;
    while ((seen = ld_volatile(flags + q)) < target) {  // cheap polls; an acquire below
      spin_pause();
      if ((++spins & 1023u) == 0) {
        if (ld_volatile(err) == kPeerTimeout) return false;
        if (now_ns() - start > p.timeout_ns) {
          const int32_t kind = off_flags == p.g.off_count_flag  ? kWaitCounts
                               : off_flags == p.g.off_data_flag  ? kWaitData
                               : off_flags == p.g.off_freed_flag ? kWaitFreed
                               : off_flags == p.g.off_entered    ? kWaitEntered
                                                                 : kWaitCombine;
          record_error(p, kPeerTimeout, q, p.me, epoch, kind, seen, target);
          return false;
        }
      }
    }
    ld_acquire(flags + q);  // orders what the caller reads next after the flag
  }
  return true;
}

// The order in which the blocks of a grid get here (0: first). The last of
// `blocks` sees every other block's writes and resets the counter for the
// next call.
__device__ inline unsigned arrival(const Params& p, int counter, unsigned blocks) {
  __shared__ unsigned order;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    auto* c = reinterpret_cast<unsigned long long*>(local_word(p, counter));
    order = static_cast<unsigned>(atomicAdd(c, 1ull));
    if (order == blocks - 1) *c = 0;
  }
  __syncthreads();
  if (order == blocks - 1) __threadfence();
  return order;
}
// True in exactly one block: the last of `blocks` to get here (arrival).
__device__ inline bool last_block(const Params& p, int counter, unsigned blocks) {
  return arrival(p, counter, blocks) == blocks - 1;
}

// Makes the block's writes visible to every PE, then sets (or adds `value`
// to) this PE's word at `off_flags` on every PE. One fence for the block
// and its flags: the barrier orders every thread's writes before thread 0's
// fence, which orders them before the relaxed flag updates.
__device__ inline void publish(const Params& p, size_t off_flags, uint64_t value, bool add) {
  __syncthreads();
  if (threadIdx.x != 0) return;
  fence_release();
  for (int q = 0; q < p.n; ++q) {
    uint64_t* flag = at<uint64_t>(p, q, off_flags) + p.me;
    if (add) add_relaxed(flag, value);
    else st_word(flag, value);
  }
}

__device__ __forceinline__ int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }
__device__ __forceinline__ int64_t imax(int64_t a, int64_t b) { return a > b ? a : b; }

__device__ __forceinline__ int64_t topk_id(const Params& p, int64_t i) {
  return p.idx64 ? static_cast<const int64_t*>(p.idx)[i] : static_cast<const int32_t*>(p.idx)[i];
}

#ifdef __CUDACC__
// Source rows are the caller's inputs, read once: skip L1.
__device__ __forceinline__ int4 load_stream(const int4* a) {
  int4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.s32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(a));
  return v;
}
#else
inline int4 load_stream(const int4* a) { return *a; }
#endif

// Copies 16-byte vectors [lo, hi) of a row with the 32 lanes of a warp,
// eight loads in flight per lane.
__device__ __forceinline__ void warp_copy_vectors(int4* dst, const int4* src, int64_t lo,
                                                  int64_t hi, int lane) {
  int64_t i = lo + lane;
  for (; i + 7 * 32 < hi; i += 8 * 32) {
    int4 v[8];
#pragma unroll
    for (int q = 0; q < 8; ++q) v[q] = load_stream(src + i + q * 32);
#pragma unroll
    for (int q = 0; q < 8; ++q) dst[i + q * 32] = v[q];
  }
  for (; i < hi; i += 32) dst[i] = load_stream(src + i);
}

// Piece `piece` of `pieces` of a row of `bytes` (a multiple of 16).
__device__ __forceinline__ void warp_copy_piece(char* dst, const char* src, size_t bytes,
                                                int piece, int pieces, int lane) {
  const int64_t nv = static_cast<int64_t>(bytes >> 4);
  warp_copy_vectors(reinterpret_cast<int4*>(dst), reinterpret_cast<const int4*>(src),
                    nv * piece / pieces, nv * (piece + 1) / pieces, lane);
}

// Copies `bytes` with the 32 lanes of a warp: 16-byte vectors when aligned.
__device__ __forceinline__ void warp_copy(char* dst, const char* src, size_t bytes, int lane) {
  if (((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) | bytes) & 15) == 0) {
    warp_copy_piece(dst, src, bytes, 0, 1, lane);
  } else if (((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) | bytes) & 3) ==
             0) {
    const int32_t* s = reinterpret_cast<const int32_t*>(src);
    int32_t* d = reinterpret_cast<int32_t*>(dst);
    for (size_t i = lane; i < bytes / 4; i += 32) d[i] = s[i];
  } else {
    for (size_t i = lane; i < bytes; i += 32) dst[i] = src[i];
  }
}

// Exclusive prefix sum of a[0, len) in shared memory by the whole block
// (tmp: len more elements); returns the total in every thread.
template <class T>
__device__ T block_exclusive_scan(T* a, T* tmp, int len) {
  __syncthreads();
  for (int off = 1; off < len; off <<= 1) {  // inclusive, Hillis-Steele
    for (int i = threadIdx.x; i < len; i += blockDim.x) tmp[i] = a[i] + (i >= off ? a[i - off] : 0);
    __syncthreads();
    for (int i = threadIdx.x; i < len; i += blockDim.x) a[i] = tmp[i];
    __syncthreads();
  }
  const T total = len > 0 ? a[len - 1] : 0;
  for (int i = threadIdx.x; i < len; i += blockDim.x) tmp[i] = i > 0 ? a[i - 1] : 0;
  __syncthreads();
  for (int i = threadIdx.x; i < len; i += blockDim.x) a[i] = tmp[i];
  __syncthreads();
  return total;
}

// ------------------------------------------------------------ routing

// Dispatch is one grid. Every block ranks its own tokens, then takes its
// rank offsets from the counts of the blocks before it; ticket 0 publishes
// this PE's count row into every PE; each word carries the call's epoch in
// its upper half, so no fence has to order the row before a flag.

__device__ __forceinline__ bool kept_id(const Params& p, int64_t id) {
  return id >= 0 && id < p.c.num_experts;
}

// Token-major routing works on chunks of route_chunk(p) tokens: the whole
// block first loads their ids into shared memory as destination PEs (dst:
// int16 [route_chunk * K], coalesced; route_chunk * K is at most
// 8 * blockDim.x, one round of for_each_pair).
__device__ __forceinline__ int64_t route_chunk(const Params& p) {
  const int64_t c = 8 * static_cast<int64_t>(blockDim.x) / p.c.topk;
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
  const int K = p.c.topk, L = p.g.local_experts;
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
  const int n = p.n, K = p.c.topk, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int warps = static_cast<int>(blockDim.x >> 5);
  for (int64_t s = 0; s < p.T; s += blockDim.x) {
    const int64_t t = s + threadIdx.x;
    const int16_t* row = dst + t * K;
    const uint64_t mask = t < p.T ? dest_mask(row, K) : 0;
    for (int d = 0; d < n; ++d) {
      const unsigned b = __ballot_sync(0xffffffffu, t < p.T && sends_to(row, K, mask, d));
      if (lane == 0) warp_rows[warp * n + d] = __popc(b);
    }
    __syncthreads();
    for (int d = 0; d < n; ++d) {
      const bool hit = t < p.T && sends_to(row, K, mask, d);
      const unsigned b = __ballot_sync(0xffffffffu, hit);
      int32_t r = run[d] + __popc(b & ((1u << lane) - 1u));
      for (int w = 0; w < warp; ++w) r += warp_rows[w * n + d];
      if (t < p.T && t >= keep_lo && t < keep_hi) pos[t * n + d] = hit ? r : -1;
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
  return p.T <= static_cast<int64_t>(blockDim.x) && p.n <= 64 && (1 + keep) * p.n <= 64;
}
__device__ inline void rank_by_barriers(const Params& p, int64_t keep_lo, int64_t keep_hi,
                                        int32_t* run, const int16_t* dst, int32_t* pos) {
  const int n = p.n, K = p.c.topk;
  const int64_t j = threadIdx.x;
  const uint64_t mask = j < p.T ? dest_mask(dst + j * K, K) : 0;
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
  const int n = p.n, K = p.c.topk;
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
  return at<uint64_t>(p, q, p.g.off_count_rows) +
         (epoch & 1) * static_cast<size_t>(p.n) * p.g.count_words;
}

// Token-major: PE pe's destination sums of call `epoch` (Geometry::
// off_dest_sums). Each block adds kSumBlock plus its share to a cell, so a
// cell is complete once its upper bits count every block of the grid.
constexpr int kSumShift = 40;
constexpr uint64_t kSumBlock = uint64_t{1} << kSumShift;
__device__ __forceinline__ uint64_t* dest_sums(const Params& p, int pe, uint64_t epoch) {
  return at<uint64_t>(p, pe, p.g.off_dest_sums) +
         (epoch & 1) * static_cast<size_t>(p.n) * (p.n + 1);
}

// Token-major, whole block, before it waits for anything: adds the share of
// `blocks` blocks to this PE's row of every PE's destination sums: `run`
// (rows per destination) and whether they saw a failure.
__device__ inline void add_dest_sums(const Params& p, uint64_t epoch, const int32_t* run,
                                     bool failed, unsigned blocks) {
  const int n = p.n, W = n + 1;
  for (int i = threadIdx.x; i < n * W; i += blockDim.x) {
    const int q = i / W, c = i % W;
    const uint64_t share = c < n ? static_cast<uint64_t>(run[c]) : failed ? 1 : 0;
    add_relaxed(dest_sums(p, q, epoch) + p.me * W + c, blocks * kSumBlock + share);
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
  const int n = p.n, E = p.c.num_experts, L = p.g.local_experts, CW = p.g.count_words;
  int32_t status = p.host_status, detail = p.host_detail;
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
      int32_t v = 0;
      if (w == kCountStatus) v = status;
      else if (w == kCountDetail) v = detail;
      else if (status == kOk && w < kCountDest + n) v = dest_rows(w - kCountDest);
      else if (status == kOk && w < kCountDest + n + E) v = hist[w - kCountDest - n];
      else if (status == kOk && slot_bits && w < kCountDest + n + E + n * p.g.slot_words)
        v = static_cast<int32_t>(slot_bits[w - kCountDest - n - E]);
      st_word(count_rows(p, q, epoch) + p.me * CW + w, tagged(epoch, v));
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
  uint64_t* prefix = at<uint64_t>(p, p.me, p.g.off_send_prefix);
  for (int j = threadIdx.x; j < E; j += blockDim.x) st_word(prefix + j, tagged(epoch, scan[j]));
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
    if (*stop || ld_volatile(err) == kPeerTimeout) {
      *stop = 1;
      return false;
    }
    if (now_ns() - start > p.timeout_ns) {
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
      p, start, stop, [&] { return has_tag(*seen = ld_volatile(word), epoch); },
      [&] { record_error(p, kPeerTimeout, late, p.me, epoch, kWaitCounts, *seen >> 32, epoch); });
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
  const int n = p.n;
  const int CW = tm ? kCountDest + n : p.g.count_words;  // words of each row waited first
  const int64_t cells = static_cast<int64_t>(n) * CW;
  const int cols = tm ? 0 : p.c.num_experts;  // the send order's words
  const uint64_t* rows = count_rows(p, p.me, epoch);
  const uint64_t* prefix = at<uint64_t>(p, p.me, p.g.off_send_prefix);
  volatile int* stop = &failed;
  if (threadIdx.x == 0) failed = 0;
  __syncthreads();
  const uint64_t start = now_ns();
  for (int64_t i = threadIdx.x; i < cells + cols && !*stop; i += blockDim.x) {
    const int q = i < cells ? static_cast<int>(i / CW) : p.me;
    const uint64_t* word = i < cells ? rows + q * p.g.count_words + i % CW : prefix + (i - cells);
    uint64_t seen;
    if (!await_tag(p, word, epoch, start, q, stop, &seen)) break;
    if (cache) cache[i] = static_cast<int32_t>(seen);
  }
  if (tm && all_words) {  // the expert counts, after the row's first words
    const int rest = p.g.count_words - CW;
    for (int64_t i = threadIdx.x; i < static_cast<int64_t>(n) * rest && !*stop; i += blockDim.x) {
      const int q = static_cast<int>(i / rest);
      uint64_t seen;
      if (!await_tag(p, rows + q * p.g.count_words + CW + i % rest, epoch, start, q, stop, &seen))
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
  const int n = p.n, W = n + 1, CW = kCountDest + n;
  const uint64_t* sums = dest_sums(p, p.me, epoch);
  const uint64_t* rows = count_rows(p, p.me, epoch);
  const uint64_t blocks = gridDim.x;
  volatile int* stop = &failed;
  if (threadIdx.x == 0) failed = 0;
  __syncthreads();
  const uint64_t start = now_ns();
  for (int i = threadIdx.x; i < n * W && !*stop; i += blockDim.x) {
    const int q = i / W, c = i % W;
    const int w = c < n ? kCountDest + c : kCountStatus;  // the same count in q's row
    const uint64_t* word = rows + q * p.g.count_words + w;
    uint64_t sum = 0;
    auto ready = [&] {
      sum = ld_volatile(sums + i);
      if ((sum >> kSumShift) == blocks) {
        const int32_t v = static_cast<int32_t>(sum & (kSumBlock - 1));
        cache[q * CW + w] = c < n ? v : v ? kBadArgument : kOk;
        return true;
      }
      const uint64_t tagged_word = ld_volatile(word);
      if (!has_tag(tagged_word, epoch)) return false;
      cache[q * CW + w] = static_cast<int32_t>(tagged_word);
      return true;
    };
    if (!await_count(p, start, stop, ready, [&] {
          record_error(p, kPeerTimeout, q, p.me, epoch, kWaitCounts, sum >> kSumShift, blocks);
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
  return tm ? p.n : p.c.num_experts;
}
__device__ __forceinline__ int32_t* route_totals(const Params& p, uint64_t epoch) {
  return at<int32_t>(p, p.me, p.g.off_route_totals) + (epoch & 1) * (p.n + p.c.num_experts + 1);
}

// Whole block, before it waits for anything: publishes the block's counts
// (run: rows per destination, token-major; hist: pairs per expert) for the
// blocks after it, adds them and its lowest bad pair to this call's totals,
// then says so in its done word.
__device__ inline void share_block_counts(const Params& p, uint64_t epoch, bool tm, int ticket,
                                          const int32_t* run, const int32_t* hist, int bad) {
  const int n = p.n, E = p.c.num_experts, cols = route_cols(p, tm);
  const int32_t* own = tm ? run : hist;
  if (tm) add_dest_sums(p, epoch, run, p.host_status != kOk || bad != INT32_MAX, 1);
  uint64_t* mine = at<uint64_t>(p, p.me, p.g.off_route_counts) + static_cast<size_t>(ticket) * cols;
  for (int c = threadIdx.x; c < cols; c += blockDim.x) st_word(mine + c, tagged(epoch, own[c]));
  int32_t* totals = route_totals(p, epoch);
  for (int j = threadIdx.x; j < n + E; j += blockDim.x) {
    const int32_t v = j < n ? (tm ? run[j] : 0) : hist[j - n];
    if (v) atomicAdd(totals + j, v);
  }
  if (threadIdx.x == 0 && bad != INT32_MAX) atomicMax(totals + n + E, INT32_MAX - bad);
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) st_word(at<uint64_t>(p, p.me, p.g.off_route_done) + ticket, tagged(epoch, 1));
}

// Ticket 0: this PE's counts over every token into run, hist and bad (as
// rank_by_warp / count_expert_pairs), read from the totals once every
// other block's done word says it added to them, or, if some block has not
// within kRouteGraceNs (a grid that is not resident at once), counted from
// every id. dst: as rank_by_warp.
__device__ inline void count_all(const Params& p, uint64_t epoch, bool tm, int32_t* run,
                                 int32_t* hist, int* bad, int16_t* dst) {
  const int n = p.n, E = p.c.num_experts;
  __shared__ int missing;
  volatile int* late = &missing;
  if (threadIdx.x == 0) missing = 0;
  __syncthreads();
  const uint64_t* done = at<uint64_t>(p, p.me, p.g.off_route_done);
  const uint64_t start = now_ns();
  for (unsigned b = 1 + threadIdx.x; b < gridDim.x && !*late; b += blockDim.x)
    while (!has_tag(ld_volatile(done + b), epoch)) {
      if (*late || now_ns() - start > kRouteGraceNs) {
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
    for (int i = threadIdx.x; i < n + E; i += blockDim.x) (i < n ? run[i] : hist[i - n]) = totals[i];
    if (threadIdx.x == 0 && totals[n + E] != 0) *bad = INT32_MAX - totals[n + E];
    __syncthreads();
  } else if (tm) {
    rank_by_warp(p, 0, p.T, run, dst, nullptr, hist, bad);
  } else {
    count_expert_pairs(p, 0, p.T * p.c.topk, hist, bad);
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
  const uint64_t* counts = at<uint64_t>(p, p.me, p.g.off_route_counts);
  volatile int* stop = &failed;
  for (int c = threadIdx.x; c < cols; c += blockDim.x) before[c] = 0;
  if (threadIdx.x == 0) failed = 0;
  __syncthreads();
  const uint64_t start = now_ns();
  const int64_t items = static_cast<int64_t>(m) * ticket;  // (earlier block, column)
  auto word = [&](int64_t i) { return counts + (i / m) * cols + list[i % m]; };
  constexpr int kBatch = 8;
  for (int64_t i0 = threadIdx.x; i0 < items && !*stop; i0 += kBatch * static_cast<int64_t>(blockDim.x)) {
    uint64_t v[kBatch];
#pragma unroll
    for (int q = 0; q < kBatch; ++q) {
      const int64_t i = i0 + q * static_cast<int64_t>(blockDim.x);
      v[q] = i < items ? ld_volatile(word(i)) : 0;
    }
#pragma unroll
    for (int q = 0; q < kBatch; ++q) {
      const int64_t i = i0 + q * static_cast<int64_t>(blockDim.x);
      if (i >= items) continue;
      if (!has_tag(v[q], epoch) && !await_tag(p, word(i), epoch, start, p.me, stop, &v[q])) break;
      atomicAdd(&before[list[i % m]], static_cast<int32_t>(v[q]));
    }
  }
  __syncthreads();
  return failed == 0;
}

// ------------------------------------------------------------ dispatch

// Shared state of a dispatch block, computed identically by every block from
// the count matrix: abort decision, destination bases and send-list prefixes.
struct DispatchPlan {
  int32_t abort_status, abort_detail, abort_pe;
};

// Word i of PE q's count row (once wait_counts saw this call's tag on it).
__device__ inline int32_t count_cell(const Params& p, uint64_t epoch, int q, int i) {
  return static_cast<int32_t>(ld_volatile(count_rows(p, p.me, epoch) + q * p.g.count_words + i));
}

// Fills `plan` and, in shared memory, base[] (first row of this PE's rows at
// each destination / in each expert's run) and prefix[] (first row of each
// destination / expert in this PE's send order = its combine rows). `cache`:
// wait_counts' copy of the words it needs (token-major), else null.
__device__ inline void make_plan(const Params& p, uint64_t epoch, bool tm, DispatchPlan& plan,
                                 int32_t* base, int32_t* prefix, const int32_t* cache) {
  const int n = p.n, E = p.c.num_experts, L = p.g.local_experts;
  const int cols = tm ? n : E;
  const int first = tm ? kCountDest : kCountDest + n;
  const int CW = kCountDest + n;  // (the cache's row)
  auto cell = [&](int q, int i) { return cache ? cache[q * CW + i] : count_cell(p, epoch, q, i); };
  const uint64_t* my_prefix = at<uint64_t>(p, p.me, p.g.off_send_prefix);
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
      if (q < p.me) before += v;
    }
    base[j] = static_cast<int32_t>(before);
    if (tm) {  // this PE's rows to the destinations before j
      int32_t sent = 0;
      for (int d = 0; d < j; ++d) sent += cell(p.me, first + d);
      prefix[j] = sent;
    } else {
      prefix[j] = static_cast<int32_t>(ld_volatile(my_prefix + j));
    }
    if (total > (tm ? p.g.recv_rows : p.g.expert_cap)) atomicMin(&overflow_at, j);
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
  if (plan.abort_status == kOk || p.host_status != kOk) return false;
  if (plan.abort_pe != p.me) return true;
  return plan.abort_status == kExpertOutOfRange || plan.abort_status == kRecvOverflow;
}

// Outputs of a dispatch that derive from the count matrix: counts, the
// handle's summary. One block. rows: shared scratch of n * n words (each
// PE's rows to each destination, loaded at once rather than one dependent
// load after another), unless `cache` (wait_counts') holds them already.
__device__ inline void finish_counts(const Params& p, uint64_t epoch, bool tm, bool abort,
                                     int32_t* rows, const int32_t* cache) {
  const int n = p.n, L = p.g.local_experts;
  if (!cache)
    for (int i = threadIdx.x; i < n * n; i += blockDim.x)
      rows[i] = abort ? 0 : count_cell(p, epoch, i / n, kCountDest + i % n);
  for (int l = threadIdx.x; l < L; l += blockDim.x) {
    int32_t c = 0;
    if (!abort)
      for (int q = 0; q < n; ++q) c += count_cell(p, epoch, q, kCountDest + n + p.me * L + l);
    p.expert_counts[l] = c;
    p.summary[4 * n + l] = c;
  }
  __syncthreads();
  auto cell = [&](int q, int d) {  // PE q's rows to PE d
    return !cache ? rows[q * n + d] : abort ? 0 : cache[q * (kCountDest + n) + kCountDest + d];
  };
  for (int q = threadIdx.x; q < n; q += blockDim.x) {
    int32_t range_start = 0, first_row = 0, sent_before = 0;
    for (int d = 0; d < p.me; ++d) range_start += cell(q, d);
    for (int d = 0; d < q; ++d) sent_before += cell(p.me, d);
    if (tm)
      for (int r = 0; r < q; ++r) first_row += cell(r, p.me);
    p.summary[4 * q] = range_start;
    p.summary[4 * q + 1] = cell(q, p.me);
    p.summary[4 * q + 2] = first_row;
    p.summary[4 * q + 3] = sent_before;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int32_t total = 0;
    for (int q = 0; q < n; ++q) total += cell(q, p.me);
    *p.num_recv = total;
    p.summary[4 * n + L] = total;
    p.summary[4 * n + L + 1] = 0;
    p.summary[4 * n + L + 2] = 0;
    p.summary[4 * n + L + 3] = 0;
    static_cast<volatile int32_t*>(p.host)[kHostNumRecv] = total;
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
  const int n = p.n;
  const int4* meta = at<int4>(p, p.me, p.g.off_recv_meta);
  int4* out = reinterpret_cast<int4*>(p.recv_meta);
  const int64_t cap = p.g.expert_cap;
  auto valid = [&](int64_t r) { return r % cap < p.summary[4 * n + r / cap]; };
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
  const uint64_t* flags = at<uint64_t>(p, p.me, off_flags);
  const uint64_t start = now_ns();
  for (int q = 0; q < p.n; ++q) {
    while (ld_volatile(flags + q) < target) {
      if (now_ns() - start > ns) return false;
      spin_pause();
    }
    ld_acquire(flags + q);
  }
  return true;
}

// End of an expert-major dispatch (not pack mode), once the block published
// its rows (`order`: its arrival). The rows' metadata is copied in
// parts of at least kMetaPartRows rows: part 0 by the last block; part h by
// the block that arrived h places before it if every row lands within
// kHelpNs (a bounded wait: a block never waits long for blocks that may not
// have started), else by the last block, which reads each helper's decision.
__device__ inline void finish_dispatch(const Params& p, uint64_t epoch, unsigned order, bool abort) {
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
      landed = wait_all(p, p.g.off_data_flag, target, epoch);
      left = 0;
    } else {
      landed = landed_within(p, p.g.off_data_flag, target, kHelpNs);
      st_word(decision + part - 1, tagged(epoch, landed ? 1 : 0));  // (the last block reads it)
    }
  }
  __syncthreads();
  if (!landed || abort) {
    if (last && threadIdx.x == 0) *local_word(p, kDispatchEpoch) = epoch;
    return;
  }
  const int parts = static_cast<int>(
      imin(most, imax(1, (p.g.recv_rows + kMetaPartRows - 1) / kMetaPartRows)));
  if (part < parts) copy_meta(p, p.g.recv_rows, part, parts);
  if (!last) return;
  const int h = static_cast<int>(threadIdx.x);
  if (h >= 1 && h < parts) {  // a helper decides within kHelpNs of its arrival
    const uint64_t start = now_ns();
    uint64_t word;
    while (!has_tag(word = ld_volatile(decision + h - 1), epoch) &&
           now_ns() - start < p.timeout_ns)
      spin_pause();
    if (!has_tag(word, epoch) || static_cast<uint32_t>(word) != 1u) atomicOr(&left, 1u << h);
  }
  __syncthreads();
  for (int k = 1; k < parts; ++k)
    if ((left >> k) & 1u) copy_meta(p, p.g.recv_rows, k, parts);
  __syncthreads();
  if (threadIdx.x == 0) *local_word(p, kDispatchEpoch) = epoch;
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
  if (p.c.layout != Layout::TokenMajor || p.pack) return kAnyDispatch;
  return small_dispatch(p.T, p.c.topk) ? kSmallTokenMajor : kLargeTokenMajor;
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
  const int n = p.n, K = p.c.topk, E = p.c.num_experts, L = p.g.local_experts;
  const bool tm = Path != kAnyDispatch || p.c.layout == Layout::TokenMajor;
  const bool pack = Path == kAnyDispatch && p.pack;
  const Geometry& g = p.g;
  prefetch_peers(p);
  start_kernel();
  const uint64_t epoch = ld_volatile(local_word(p, kDispatchEpoch)) + 1;
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
  const bool small = Path == kSmallTokenMajor || (Path == kAnyDispatch && small_dispatch(p.T, K));
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
  if (small && tm) load_dests(p, 0, p.T, dst, hist, &bad);
  if (threadIdx.x == 0) {
    ticket = static_cast<int>(taken);
    if (ticket == static_cast<int>(gridDim.x) - 1) *tickets = 0;  // every block has its ticket
  }
  __syncthreads();
  // (a spare ticket 0 takes the empty range at T)
  const int64_t slot = ticket - p.spare_ticket0;
  const int64_t t0 = slot < 0 ? p.T : imin(slot * p.tokens_per_block, p.T);
  const int64_t t1 = imin(t0 + p.tokens_per_block, p.T);
  // Ranks of the rows: among this PE's rows to their destination or expert
  // (small calls) or among this block's (plus before[], from the look-back).
  int32_t* pos = at<int32_t>(p, p.me, g.off_scratch_pos);
  bool ranked = true;
  if (small) {
    for (int c = threadIdx.x; c < cols; c += blockDim.x) before[c] = 0;
    if (tm) {
      if (rank_by_barriers_fits(p, t1 - t0)) rank_by_barriers(p, t0, t1, run, dst, pos);
      else rank_dest_rows(p, t0, t1, run, scratch, dst, pos);
    } else {
      count_expert_pairs(p, 0, t0 * K, hist, ticket == 0 ? &bad : nullptr);
      rank_expert_pairs(p, t0 * K, t1 * K, hist, scratch, pos, ticket == 0 ? &bad : nullptr);
      if (ticket == 0) count_expert_pairs(p, t1 * K, p.T * K, hist, &bad);
    }
    // (every block ranked every token: ticket 0 adds them for the grid, so
    // a PE whose blocks rank by look-back need not wait for this count row)
    if (ticket == 0) {
      publish_counts(p, epoch, tm, run, hist, bad, scratch);
      if (tm) add_dest_sums(p, epoch, run, p.host_status != kOk || bad != INT32_MAX, gridDim.x);
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
    uint64_t* next_sums = tm ? dest_sums(p, p.me, epoch + 1) : nullptr;
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
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int warps = static_cast<int>(blockDim.x >> 5);
  const int64_t T = abort ? 0 : p.T;
  const int64_t b0 = imin(t0, T), b1 = imin(t1, T);  // this block's tokens

  // Destination of a row: a peer's receive buffer, or local staging (pack).
  auto target = [&](int d, size_t off) { return pack ? at<char>(p, p.me, off) : at<char>(p, d, off); };
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
  const int P = p.pieces;
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
    warp_copy_piece(target(d, off_x) + r * g.row_bytes, p.x + t * g.row_bytes, g.row_bytes, piece,
                    P, lane);
    if (piece != 0) continue;
    if (g.scale_row_bytes)
      warp_copy(target(d, off_s) + r * g.scale_row_bytes, p.scales + t * g.scale_row_bytes,
                g.scale_row_bytes, lane);
    if (tm) {
      int32_t* idx = reinterpret_cast<int32_t*>(target(d, off_i)) + r * K;
      float* w = reinterpret_cast<float*>(target(d, off_w)) + r * K;
      for (int k = lane; k < K; k += 32) {
        const int64_t e = topk_id(p, static_cast<int64_t>(t) * K + k);
        const bool local = kept_id(p, e) && static_cast<int32_t>(e) / L == d;
        idx[k] = local ? static_cast<int32_t>(e) % L : -1;
        w[k] = local ? p.w[static_cast<int64_t>(t) * K + k] : 0.0f;
      }
    } else if (lane == 0) {
      reinterpret_cast<float*>(target(d, off_w))[r] = p.w[i];
    }
    if (lane < kMetaWords) {
      const int32_t slot = tm ? -1 : i % S;
      const int32_t v = lane == kMetaSrcPe ? p.me : lane == kMetaToken ? t
                                                  : lane == kMetaSlot ? slot : crow;
      reinterpret_cast<int32_t*>(target(d, off_m))[r * kMetaWords + lane] = v;
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
  for (int64_t i = T * S + gtid; i < static_cast<int64_t>(p.c.max_tokens) * S; i += gthreads)
    p.send_rows[i] = -1;
  if (p.saved_w)
    for (int64_t i = gtid; i < T * K; i += gthreads) p.saved_w[i] = p.w[i];

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
      volatile int32_t* h = p.host;
      int segs = 0;
      if (!abort)
        for (int j = 0; j < cols; ++j) {
          int32_t rows = count_cell(p, epoch, p.me, (tm ? kCountDest : kCountDest + n) + j);
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

// ------------------------------------------------------------ token_slots dispatch

// Word i of the slot bits for destination d in a count row.
__device__ __forceinline__ int count_bits_word(const Params& p, int d, int i) {
  return count_bits_at(p.n, p.c.num_experts) + d * p.g.slot_words + i;
}

// Whole block, block 0 of a token_slots dispatch: this PE's counts over
// every token (as rank_by_warp: run, hist, bad) and bits[d * slot_words +
// t / 32] bit t % 32 set when token t sends a row to PE d. hist and run
// are 0 on entry; dst: as rank_by_warp.
__device__ inline void count_slots(const Params& p, int32_t* run, int32_t* hist, int32_t* bad,
                                   int16_t* dst, uint32_t* bits) {
  const int n = p.n, K = p.c.topk, W = p.g.slot_words;
  for (int i = threadIdx.x; i < n * W; i += blockDim.x) bits[i] = 0;
  __syncthreads();
  if (p.T <= static_cast<int64_t>(blockDim.x) && small_dispatch(p.T, K) && n <= 64) {
    // Small (every id in one chunk): token t is thread t's; a warp's
    // ballot is a word of bits.
    load_dests(p, 0, p.T, dst, hist, bad);
    const int64_t t = threadIdx.x;
    const uint64_t mask = t < p.T ? dest_mask(dst + t * K, K) : 0;
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
  for (int64_t c0 = 0; c0 < p.T; c0 += C) {
    const int64_t m = imin(C, p.T - c0);
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
  return static_cast<int64_t>(p.me) * p.c.max_tokens + t;
}

// Block 0, once every count row is in: the outputs of a token_slots
// dispatch (expert counts, rows received, the handle's summary with every
// source's slot bits for this PE; see summary_words). An aborted call
// receives nothing.
__device__ inline void finish_slots(const Params& p, uint64_t epoch, bool abort,
                                    const int32_t* cache) {
  const int n = p.n, L = p.g.local_experts, W = p.g.slot_words;
  const int32_t M = p.c.max_tokens;
  int32_t* bits = p.summary + slot_bits_at(n, L);
  // (one round of loads: expert counts and slot bits together)
  for (int i = threadIdx.x; i < L + n * W; i += blockDim.x) {
    if (i < L) {
      int32_t c = 0;
      for (int q = 0; q < n && !abort; ++q)
        c += count_cell(p, epoch, q, kCountDest + n + p.me * L + i);
      p.expert_counts[i] = c;
      p.summary[4 * n + i] = c;
    } else {
      const int j = i - L;
      bits[j] = abort ? 0 : count_cell(p, epoch, j / W, count_bits_word(p, p.me, j % W));
    }
  }
  for (int q = threadIdx.x; q < n; q += blockDim.x) {
    p.summary[4 * q] = p.me * M;   // q's combine rows for its tokens sent here
    p.summary[4 * q + 1] = M;      // q's slots here
    p.summary[4 * q + 2] = q * M;  // the first of them
    p.summary[4 * q + 3] = q * M;  // this PE's combine rows for its tokens sent to q
  }
  if (threadIdx.x == 0) {
    int32_t total = 0;  // (cache: wait_counts' first words of each row)
    for (int q = 0; q < n && !abort; ++q) total += cache[q * (kCountDest + n) + kCountDest + p.me];
    *p.num_recv = total;
    p.summary[4 * n + L] = n * M;
    p.summary[4 * n + L + 1] = 0;
    p.summary[4 * n + L + 2] = 0;
    p.summary[4 * n + L + 3] = 0;
    static_cast<volatile int32_t*>(p.host)[kHostNumRecv] = total;
  }
  __syncthreads();
}

// Whole block: sets bit (t - b0) * S + d of sent (shared memory) when token
// t of [b0, b1) sends a row to PE d (an id out of range sends nothing:
// block 0's count reports it). Ends with a barrier.
__device__ inline void load_sent_bits(const Params& p, int64_t b0, int64_t b1, uint32_t* sent) {
  const int K = p.c.topk, L = p.g.local_experts, S = p.g.send_cols;
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
  const int n = p.n, K = p.c.topk, E = p.c.num_experts, L = p.g.local_experts;
  const int S = p.g.send_cols, W = p.g.slot_words;
  const Geometry& g = p.g;
  const int64_t M = p.c.max_tokens;
  prefetch_peers(p);
  start_kernel();
  auto* tickets = reinterpret_cast<unsigned long long*>(local_word(p, kDispatchTicket));
  unsigned long long taken = 0;
  if (threadIdx.x == 0) taken = atomicAdd(tickets, 1ull);  // (read at the end)
  const uint64_t epoch = ld_volatile(local_word(p, kDispatchEpoch)) + 1;
  const bool counter = blockIdx.x == 0;
  const bool sender = !counter || !p.spare_ticket0;  // stores rows (or marks slots) in peers
  if (counter)
    for (int q = threadIdx.x; q < n; q += blockDim.x)
      st_word(at<uint64_t>(p, q, g.off_entered) + p.me, epoch);
  // This block's tokens, and its place among the senders.
  const int spare = p.spare_ticket0 ? 1 : 0;
  const int64_t slot = static_cast<int64_t>(blockIdx.x) - spare;
  const int64_t b0 = slot < 0 ? p.T : imin(slot * p.tokens_per_block, p.T);
  const int64_t b1 = imin(b0 + p.tokens_per_block, p.T);
  for (int64_t off = threadIdx.x * 128ll; off < (b1 - b0) * static_cast<int64_t>(g.row_bytes);
       off += blockDim.x * 128ll)
    prefetch_l2(p.x + b0 * g.row_bytes + off);
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
    const int P = p.pieces;
    const int32_t units = entered ? static_cast<int32_t>((b1 - b0) * S * P) : 0;
    for (int32_t u = warp; u < units; u += warps) {
      const int32_t i = u / P, t = static_cast<int32_t>(b0) + i / S, d = i % S;
      const int piece = u % P;
      const bool sends = sent_bit(sent, i);
      const int64_t r = me_slot(p, t);
      if (sends)
        warp_copy_piece(at<char>(p, d, g.off_recv_x) + r * g.row_bytes, p.x + t * g.row_bytes,
                        g.row_bytes, piece, P, lane);
      if (piece != 0) continue;
      if (sends && g.scale_row_bytes)
        warp_copy(at<char>(p, d, g.off_recv_scales) + r * g.scale_row_bytes,
                  p.scales + t * g.scale_row_bytes, g.scale_row_bytes, lane);
      int32_t* idx = at<int32_t>(p, d, g.off_recv_idx) + r * K;
      float* w = at<float>(p, d, g.off_recv_w) + r * K;
      for (int k = lane; k < K; k += 32) {
        const int64_t e = topk_id(p, static_cast<int64_t>(t) * K + k);
        const bool local = kept_id(p, e) && static_cast<int32_t>(e) / L == d;
        idx[k] = local ? static_cast<int32_t>(e) % L : -1;
        w[k] = local ? p.w[static_cast<int64_t>(t) * K + k] : 0.0f;
      }
      if (lane < kMetaWords) {
        const int32_t v = !sends ? -1 : lane == kMetaSrcPe ? p.me : lane == kMetaToken ? t
                                      : lane == kMetaSlot  ? -1 : d * static_cast<int32_t>(M) + t;
        at<int32_t>(p, d, g.off_recv_meta)[r * kMetaWords + lane] = v;
      }
    }
    // The slots of tokens past T are empty on every destination (the
    // senders share them), and the send table is written before the flags,
    // which the last block waits for before it may clear the table.
    const int64_t gtid = (static_cast<int64_t>(blockIdx.x) - spare) * blockDim.x + threadIdx.x;
    const int64_t gthreads = static_cast<int64_t>(gridDim.x - spare) * blockDim.x;
    for (int64_t i = gtid; entered && i < (M - p.T) * n; i += gthreads) {
      const int d = static_cast<int>(i % n);
      const int64_t r = me_slot(p, p.T + i / n);
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
    for (int64_t i = p.T * S + gtid; i < M * S; i += gthreads) p.send_rows[i] = -1;
    publish(p, g.off_data_flag, 1, true);
  } else if (threadIdx.x == 0) {
    for (int q = 0; q < n; ++q) add_relaxed(at<uint64_t>(p, q, g.off_data_flag) + p.me, 1);
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
    if (threadIdx.x == 0) st_word(local_word(p, kSlotsDone), tagged(epoch, abort ? 1 : 0));
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
    const bool done = await_tag(p, local_word(p, kSlotsDone), epoch, now_ns(), p.me, &stop, &seen);
    aborted = !landed || !done || static_cast<uint32_t>(seen) != 0u;
  }
  __syncthreads();
  if (aborted)
    for (int64_t i = threadIdx.x; i < M * S; i += blockDim.x) p.send_rows[i] = -1;
  __syncthreads();
  if (threadIdx.x == 0) *local_word(p, kDispatchEpoch) = epoch;
}

// Copy engine: once the host queued the copies and their signals, waits for
// every peer's rows and copies the handle's metadata (expert-major;
// dispatch_kernel in pack mode already wrote the counts).
__global__ void __launch_bounds__(kThreads) finish_kernel(Params p, int32_t abort) {
  start_kernel();
  const uint64_t epoch = ld_volatile(local_word(p, kDispatchEpoch)) + 1;
  __shared__ bool ok;
  if (threadIdx.x == 0) ok = wait_all(p, p.g.off_data_flag, epoch * p.flag_per_epoch, epoch);
  __syncthreads();
  if (ok && !abort && p.c.layout == Layout::ExpertMajor) copy_meta(p, p.g.recv_rows, 0, 1);
  __syncthreads();
  if (threadIdx.x == 0) *local_word(p, kDispatchEpoch) = epoch;
}

// ------------------------------------------------------------ combine

// PE pe's combine buffer and statuses of call `epoch`. With two sets (by
// call parity), call k + 1's senders write into the set that the receiving
// PE summed in its call k - 1; a sender starts call k + 1 only after its
// call k ended, which waited for the receiver's call-k rows, which the
// receiver sends after its call k - 1 ended: no "consumed" flag is needed.
// With one set, senders wait for that flag (off_freed_flag).
__device__ __forceinline__ size_t combine_set(const Params& p, uint64_t epoch) {
  return p.g.combine_sets == 2 ? static_cast<size_t>(epoch & 1) : 0;
}
__device__ __forceinline__ char* combine_buf(const Params& p, int pe, uint64_t epoch) {
  return at<char>(p, pe, p.g.off_combine_buf) +
         combine_set(p, epoch) * p.g.combine_rows * p.g.combine_row_bytes;
}
__device__ __forceinline__ int32_t* combine_status(const Params& p, int pe, uint64_t epoch) {
  return at<int32_t>(p, pe, p.g.off_combine_status) + combine_set(p, epoch) * p.n;
}

// Expert-major: where received row r goes back to: its source PE and its
// row there (the source's combine row; in stage mode, the row of this PE's
// staging buffer). False when the handle names a place outside the op's
// buffers: a handle edited by the caller must never make a kernel or a copy
// write out of bounds.
__device__ __forceinline__ bool combine_target(const Params& p, int64_t r, int* src,
                                               int64_t* row) {
  const Geometry& g = p.g;
  *src = p.h_meta[r * kMetaWords + kMetaSrcPe];
  const int32_t crow = p.h_meta[r * kMetaWords + kMetaCombineRow];
  if (*src < 0 || *src >= p.n || crow < 0 || crow >= g.combine_rows) return false;
  *row = crow;
  if (p.pack && p.c.layout == Layout::ExpertMajor) {  // packed per source, in send order
    int64_t at_row = crow - static_cast<int64_t>(p.h_summary[4 * *src]);
    for (int q = 0; q < *src; ++q) at_row += p.h_summary[4 * q + 1];
    if (at_row < 0 || at_row >= g.recv_rows) return false;
    *row = at_row;
  }
  return true;
}

// token_slots: whether slot k of source q holds a row here (the handle's
// slot bits; slots past max_tokens never do, whatever an edited summary says).
__device__ __forceinline__ bool slot_filled(const Params& p, int q, int64_t k) {
  if (k < 0 || k >= p.c.max_tokens) return false;
  const int32_t word =
      p.h_summary[slot_bits_at(p.n, p.g.local_experts) + q * p.g.slot_words + k / 32];
  return (static_cast<uint32_t>(word) >> (k % 32)) & 1u;
}

// Token-major: the k-th row from source q goes back to q's combine row
// summary[4q] + k (q sent its rows to this PE in token order, from its
// combine row summary[4q] on). False outside the combine buffer (an edited
// handle).
__device__ __forceinline__ bool token_major_target(const Params& p, int q, int64_t k,
                                                   int64_t* row) {
  *row = static_cast<int64_t>(p.h_summary[4 * q]) + k;
  return *row >= 0 && *row < p.g.combine_rows;
}

// The copy plan of the copy engine, segment (from, to, rows) of source q,
// lies inside the buffers (the handle's summary is the caller's memory).
__device__ __forceinline__ bool segment_in_bounds(const Params& p, int q, int64_t packed) {
  const int64_t to = p.h_summary[4 * q], rows = p.h_summary[4 * q + 1];
  const int64_t from = p.c.layout == Layout::TokenMajor ? p.h_summary[4 * q + 2] : packed;
  return rows >= 0 && to >= 0 && from >= 0 && to + rows <= p.g.combine_rows &&
         from + rows <= p.g.recv_rows;
}

// The handle's valid rows, by the whole block: token-major [0, total);
// expert-major (l, i < count[l]) numbered expert by expert, with first[l] the
// number of the first row of expert l. Counts are clamped to the buffer, so
// an edited summary stays in bounds; a call the host aborted has no rows.
__device__ inline int64_t count_valid_rows(const Params& p, int64_t* first) {
  const int n = p.n, L = p.g.local_experts;
  __shared__ int64_t valid;
  if (p.host_status != kOk) {
    if (threadIdx.x == 0) valid = 0;
  } else if (p.c.layout == Layout::TokenMajor) {
    if (threadIdx.x == 0) {
      const int64_t total = p.h_summary[4 * n + L];
      valid = total < 0 ? 0 : total > p.g.recv_rows ? p.g.recv_rows : total;
    }
  } else {
    for (int l = threadIdx.x; l < L; l += blockDim.x) {
      const int64_t c = p.h_summary[4 * n + l];
      first[l] = c < 0 ? 0 : c > p.g.expert_cap ? p.g.expert_cap : c;
    }
    const int64_t total = block_exclusive_scan(first, first + L, L);
    if (threadIdx.x == 0) valid = total;
  }
  __syncthreads();
  return valid;
}

// Expert-major: the handle row of valid row j (count_valid_rows' numbering).
__device__ __forceinline__ int64_t expert_major_row(const Params& p, const int64_t* first,
                                                    int64_t j) {
  int lo = 0, hi = p.g.local_experts - 1;  // the last l with first[l] <= j
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (first[mid] <= j) lo = mid;
    else hi = mid - 1;
  }
  return lo * p.g.expert_cap + (j - first[lo]);
}

// Copy engine, before the host's copies: stages expert-major rows in send
// order (token-major rows go straight from expert_out), checks the handle,
// and hands the copy plan (one segment per source) to the host.
__global__ void __launch_bounds__(kThreads) combine_pack_kernel(Params p) {
  start_kernel();
  const int n = p.n;
  const Geometry& g = p.g;
  const bool tm = p.c.layout == Layout::TokenMajor;
  const uint64_t epoch = ld_volatile(local_word(p, kCombineEpoch)) + 1;
  __shared__ bool ok;
  EP_DYNAMIC_SHARED(int64_t, first_of);  // expert-major: [2 L]
  if (threadIdx.x == 0) ok = wait_all(p, g.off_freed_flag, epoch - 1, epoch);
  const int64_t valid_rows = count_valid_rows(p, first_of);
  const bool send = ok && p.host_status == kOk;
  const int lane = threadIdx.x & 31;
  const int64_t warp0 = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  const size_t crb = g.combine_row_bytes;
  const int P = p.pieces;
  bool bad = false;
  if (send && !tm) {
    for (int64_t u = warp0; u < valid_rows * P; u += warps) {
      const int64_t r = expert_major_row(p, first_of, u / P);
      int src;
      int64_t row;
      if (!combine_target(p, r, &src, &row)) {
        bad = true;
        continue;
      }
      warp_copy_piece(at<char>(p, p.me, g.off_stage_combine) + row * crb, p.expert_out + r * crb,
                      crb, static_cast<int>(u % P), P, lane);
    }
  }
  if (bad) *local_word(p, kHandleBad) = 1;
  if (!last_block(p, kSendDone, gridDim.x)) return;
  if (threadIdx.x != 0) return;
  bool handle_ok = ld_volatile(local_word(p, kHandleBad)) == 0;
  *local_word(p, kHandleBad) = 0;
  if (send) {  // the copy plan must stay inside the buffers too
    int64_t packed = 0;
    for (int q = 0; q < n; ++q) {
      if (!segment_in_bounds(p, q, packed)) handle_ok = false;
      packed += p.h_summary[4 * q + 1];
    }
  }
  if (send && !handle_ok) record_error(p, kBadHandle, 0, p.me, epoch);
  for (int q = 0; q < n; ++q)
    combine_status(p, q, epoch)[p.me] =
        !ok ? kPeerTimeout : !handle_ok ? kBadHandle : p.host_status;
  volatile int32_t* h = p.host;
  int segs = 0;
  int32_t packed = 0;
  if (send && handle_ok)
    for (int q = 0; q < n; ++q) {
      const int32_t rows = p.h_summary[4 * q + 1];
      if (rows) {
        volatile int32_t* sg = h + kHostSegment0 + 4 * segs++;
        sg[0] = q;
        sg[1] = tm ? p.h_summary[4 * q + 2] : packed;
        sg[2] = p.h_summary[4 * q];
        sg[3] = rows;
      }
      packed += rows;
    }
  h[kHostSegments] = segs;
  __threadfence_system();
}

// Thread 0 (others: 0): issues the atomic that gives this combine block its
// place in the order in which the blocks of its grid start (its ticket: the
// result modulo gridDim.x). Issued before wait_prior_kernel, as it does not
// depend on the previous kernel: every call of an op takes one ticket per
// block of its grid (a fixed size) from a counter that is never reset, only
// wrapped at a multiple of the grid (the low half of kCombineTicket), and a
// block calls release_next_kernel only once it has its ticket, so no block
// of a later call takes one of this call's.
__device__ __forceinline__ uint32_t take_ticket(const Params& p) {
  if (threadIdx.x != 0) return 0;
  const uint32_t wrap = (0x80000000u / gridDim.x) * gridDim.x;
  return atomicInc(reinterpret_cast<unsigned*>(local_word(p, kCombineTicket)), wrap - 1);
}
// The combine tickets taken so far (modulo the wrap).
__device__ __forceinline__ uint32_t tickets_taken(const Params& p) {
  return *reinterpret_cast<const volatile uint32_t*>(local_word(p, kCombineTicket));
}

// The whole warp: the next unit of work past a first round of `first` units
// (each warp's own), from a per-call counter; units once none are left.
// claimed: [kWarpsPerBlock] shared slots.
__device__ inline int64_t claim_unit(uint64_t* counter, int64_t first, int64_t units,
                                     int64_t* claimed) {
  if (units <= first) return units;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0)
    claimed[warp] = first + static_cast<int64_t>(
                                atomicAdd(reinterpret_cast<unsigned long long*>(counter), 1ull));
  __syncwarp();
  const int64_t u = claimed[warp];
  __syncwarp();
  return u;
}

// Sender role of combine_kernel: stores every received row of another PE (a
// piece per unit of work) back into its source's combine buffer and sets the
// piece's flag there. Token-major units visit the other sources in turn, each
// in its token order, so every source's reducers find their first tokens
// early, and every warp moves rows over the links; rows of this PE's own
// tokens stay where they are (its reducers read them). After its first unit
// a warp claims the next from a counter, so rows leave in the order the
// reducers sum them even when some SMs get less of the links than others.
// Each unit checks its row's place against the op's buffers first (the
// handle is the caller's memory); at the end the block tells every source of
// a failure it saw, then adds its share to their combine flags.
__device__ inline void send_back(const Params& p, int block, int blocks, uint64_t epoch) {
  const int n = p.n;
  const Geometry& g = p.g;
  const bool tm = p.c.layout == Layout::TokenMajor;
  __shared__ bool ok;
  __shared__ int64_t longest;  // token-major: rows of the other source with the most
  EP_DYNAMIC_SHARED(int64_t, first_of);  // expert-major: [2 L]
  int64_t* src_first = first_of;         // token-major: [n] first receive row from each source
  int64_t* src_rows = first_of + n;      // and [n] its rows
  if (threadIdx.x == 0) {
    ok = p.g.combine_sets == 2 || wait_all(p, g.off_freed_flag, epoch - 1, epoch);
    // Two sets: the previous call's statuses (every reader ended with it)
    // are cleared before this block's flags, which peers wait for before
    // their next call writes that set.
    if (p.g.combine_sets == 2 && block == 0)
      for (int q = 0; q < n; ++q) combine_status(p, p.me, epoch + 1)[q] = kOk;
  }
  const int64_t valid_rows = count_valid_rows(p, first_of);
  if (tm) {
    if (threadIdx.x == 0) {
      longest = 0;
      for (int q = 0; q < n; ++q) {  // (no handle when valid_rows == 0)
        const int64_t f = valid_rows ? p.h_summary[4 * q + 2] : 0;
        const int64_t r = valid_rows ? p.h_summary[4 * q + 1] : 0;
        src_first[q] = f < 0 ? 0 : f;
        src_rows[q] = r < 0 ? 0 : r > valid_rows ? valid_rows : r;
        if (q != p.me && src_rows[q] > longest) longest = src_rows[q];
      }
    }
    __syncthreads();
  }
  const bool send = ok && p.host_status == kOk;
  const int lane = threadIdx.x & 31;
  const int64_t warp0 = static_cast<int64_t>(block) * kWarpsPerBlock + (threadIdx.x >> 5);
  const int64_t warps = static_cast<int64_t>(blocks) * kWarpsPerBlock;
  const size_t crb = g.combine_row_bytes;
  const int P = p.pieces;
  const int others = n - 1;  // token-major: the sources whose rows go over the links
  const int64_t units = (tm ? others * longest : valid_rows) * P;
  bool bad = false;
  int src;
  int64_t row;
  // Units past the first round, claimed in order (senders' and reducers'
  // counters, two of each by call parity: block 0 clears the next call's,
  // whose last user has ended).
  uint64_t* next = local_word(p, kSendNext + static_cast<int>(epoch & 1));
  if (block == 0 && threadIdx.x == 0) {
    *local_word(p, kSendNext + static_cast<int>(~epoch & 1)) = 0;
    *local_word(p, kReduceNext + static_cast<int>(~epoch & 1)) = 0;
  }
  __shared__ int64_t claimed[kWarpsPerBlock];
  for (int64_t u = send ? warp0 : units; u < units; u = claim_unit(next, warps, units, claimed)) {
    const int64_t h = u / P;
    const int piece = static_cast<int>(u % P);
    int64_t r;
    bool placed;
    if (tm) {
      const int other = static_cast<int>(h % others);
      src = other < p.me ? other : other + 1;
      const int64_t k = h / others;
      if (k >= src_rows[src] || (p.c.token_slots && !slot_filled(p, src, k))) continue;
      r = src_first[src] + k;
      if (r >= valid_rows) continue;
      placed = token_major_target(p, src, k, &row);
    } else {
      r = expert_major_row(p, first_of, h);
      placed = combine_target(p, r, &src, &row);
    }
    if (!placed) {
      bad = true;
      continue;
    }
    warp_copy_piece(combine_buf(p, src, epoch) + row * crb, p.expert_out + r * crb, crb, piece,
                    P, lane);
    if (!p.row_flags) continue;
    __syncwarp();  // every lane's stores, then lane 0's fence and flag
    if (lane == 0) {
      __threadfence_system();
      st_word(at<uint64_t>(p, src, g.off_row_flags) + row * kMaxPieces + piece, epoch);
    }
  }
  __shared__ bool block_bad;
  if (threadIdx.x == 0) block_bad = false;
  __syncthreads();
  if (bad) block_bad = true;
  __syncthreads();
  if (threadIdx.x == 0) {
    const int32_t status = !ok ? kPeerTimeout : block_bad ? kBadHandle : p.host_status;
    if (send && block_bad) record_error(p, kBadHandle, 0, p.me, epoch);
    if (status != kOk)  // cleared once read (two sets: by the source's next call)
      for (int q = 0; q < n; ++q) combine_status(p, q, epoch)[p.me] = status;
  }
  publish(p, g.off_combine_flag, 1, true);
}

// Two 16-bit floats of one 32-bit word, to and from fp32.
#ifdef __CUDACC__
__device__ __forceinline__ float2 halves_to_float2(uint32_t w, DType dt) {
  return dt == DType::BF16 ? __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w))
                           : __half22float2(*reinterpret_cast<const __half2*>(&w));
}
__device__ __forceinline__ uint32_t float2_to_halves(float a, float b, DType dt) {
  if (dt == DType::BF16) {
    __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&v);
  }
  __half2 v = __floats2half2_rn(a, b);
  return *reinterpret_cast<uint32_t*>(&v);
}
#else
struct float2 {
  float x, y;
};
inline float2 halves_to_float2(uint32_t w, DType dt) {
  uint16_t lo = static_cast<uint16_t>(w & 0xffffu), hi = static_cast<uint16_t>(w >> 16);
  if (dt == DType::BF16) return {bf16_to_float(lo), bf16_to_float(hi)};
  return {fp16_to_float(lo), fp16_to_float(hi)};
}
inline uint32_t float2_to_halves(float a, float b, DType dt) {
  uint32_t lo = dt == DType::BF16 ? float_to_bf16(a) : float_to_fp16(a);
  uint32_t hi = dt == DType::BF16 ? float_to_bf16(b) : float_to_fp16(b);
  return lo | (hi << 16);
}
#endif

// Converts 16 bytes of `dt` values to floats; returns how many.
__device__ __forceinline__ int unpack16(int4 v, DType dt, float* f) {
  if (dt == DType::F32) {
    f[0] = __int_as_float(v.x);
    f[1] = __int_as_float(v.y);
    f[2] = __int_as_float(v.z);
    f[3] = __int_as_float(v.w);
    return 4;
  }
  const uint32_t words[4] = {static_cast<uint32_t>(v.x), static_cast<uint32_t>(v.y),
                             static_cast<uint32_t>(v.z), static_cast<uint32_t>(v.w)};
  for (int i = 0; i < 4; ++i) {
    float2 x = halves_to_float2(words[i], dt);
    f[2 * i] = x.x;
    f[2 * i + 1] = x.y;
  }
  return 8;
}

__device__ __forceinline__ int4 pack16(const float* f, DType dt) {
  int4 v;
  if (dt == DType::F32) {
    v.x = __float_as_int(f[0]);
    v.y = __float_as_int(f[1]);
    v.z = __float_as_int(f[2]);
    v.w = __float_as_int(f[3]);
    return v;
  }
  v.x = static_cast<int>(float2_to_halves(f[0], f[1], dt));
  v.y = static_cast<int>(float2_to_halves(f[2], f[3], dt));
  v.z = static_cast<int>(float2_to_halves(f[4], f[5], dt));
  v.w = static_cast<int>(float2_to_halves(f[6], f[7], dt));
  return v;
}


// Sums piece `piece` (of P) of token t's rows into its output row, weighted
// in expert-major; row_of(j) is where column j's row lies (null: none). A
// lane sums kVecs vectors of two rows at once, so their loads are in flight
// together (sums stay in row order).
template <class RowOf>
__device__ inline void reduce_token_piece(const Params& p, int64_t t, int piece, int P, int lane,
                                          RowOf row_of) {
  const int K = p.c.topk, S = p.g.send_cols;
  const bool tm = p.c.layout == Layout::TokenMajor;
  const DType dt = p.g.combine_dtype;
  const int64_t vecs = static_cast<int64_t>(p.g.combine_row_bytes / 16);
  int4* out = reinterpret_cast<int4*>(p.out + t * p.g.combine_row_bytes);
  const int64_t lo = vecs * piece / P, hi = vecs * (piece + 1) / P;
  constexpr int kVecs = 4;
  for (int64_t c0 = lo + lane; c0 < hi; c0 += 32 * kVecs) {
    float acc[kVecs][8] = {};
    for (int j0 = 0; j0 < S; j0 += 2) {
      const int4* src[2];
      float wt[2];
      int4 v[2][kVecs];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int j = j0 + h;
        src[h] = j < S ? row_of(j) : nullptr;
        wt[h] = src[h] && !tm ? p.cw[t * K + j] : 1.0f;
#pragma unroll
        for (int q = 0; q < kVecs; ++q)
          if (src[h] && c0 + 32 * q < hi) v[h][q] = __ldcg(src[h] + c0 + 32 * q);
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if (!src[h]) continue;
#pragma unroll
        for (int q = 0; q < kVecs; ++q) {
          if (c0 + 32 * q >= hi) continue;
          float f[8];
          const int m = unpack16(v[h][q], dt, f);
          for (int i = 0; i < m; ++i) acc[q][i] += wt[h] * f[i];
        }
      }
    }
#pragma unroll
    for (int q = 0; q < kVecs; ++q)
      if (c0 + 32 * q < hi) out[c0 + 32 * q] = pack16(acc[q], dt);
  }
}

// Token t's row in column j of this PE's combine buffer, or null when it
// has none. An edited handle never makes a kernel read outside the buffer.
__device__ __forceinline__ const int4* combine_row(const Params& p, int64_t t, int j,
                                                   uint64_t epoch) {
  const int32_t row = p.h_send_rows[t * p.g.send_cols + j];
  if (row < 0) return nullptr;
  if (row >= p.g.combine_rows) {
    record_error(p, kBadHandle, 0, p.me, epoch);
    return nullptr;
  }
  return reinterpret_cast<const int4*>(combine_buf(p, p.me, epoch)) +
         row * (p.g.combine_row_bytes / 16);
}

// End of a combine on this PE, by one thread: reports a failure a sender PE
// published (after its rows, when `landed`). One combine set: once every
// reducing block is done, marks the statuses read and tells every PE its
// rows here were consumed. Two sets: once every block has started (the
// next call's senders clear this call's statuses).
__device__ inline void finish_combine(const Params& p, uint64_t epoch, bool landed) {
  const Geometry& g = p.g;
  int32_t* status = combine_status(p, p.me, epoch);
  if (landed && p.host_status == kOk)
    for (int q = 0; q < p.n; ++q) {
      const int32_t s = static_cast<const volatile int32_t*>(status)[q];
      if (s != kOk && s != kPeerTimeout) {
        record_error(p, s, 0, q, epoch);
        break;
      }
    }
  if (g.combine_sets == 1) {
    for (int q = 0; q < p.n; ++q) status[q] = kOk;
    __threadfence_system();  // (one fence orders every flag below)
    for (int q = 0; q < p.n; ++q) st_word(at<uint64_t>(p, q, g.off_freed_flag) + p.me, epoch);
  }
  *local_word(p, kCombineEpoch) = epoch;
}

// One thread: waits until every PE has sent its rows here; true when they
// landed and no sender reported a failure.
__device__ inline bool all_rows_landed(const Params& p, uint64_t epoch) {
  if (!wait_all(p, p.g.off_combine_flag, epoch * p.flag_per_epoch, epoch)) return false;
  for (int q = 0; q < p.n; ++q)
    if (__ldcg(combine_status(p, p.me, epoch) + q) != kOk) return false;
  return true;
}

// Copy engine, after the host's copies: waits for every peer's rows, then
// sums them per token.
__global__ void __launch_bounds__(kThreads) combine_reduce_kernel(Params p) {
  start_kernel();
  const uint64_t epoch = ld_volatile(local_word(p, kCombineEpoch)) + 1;
  __shared__ bool peers_ok;
  if (threadIdx.x == 0) peers_ok = all_rows_landed(p, epoch);
  __syncthreads();
  const int lane = threadIdx.x & 31;
  const int64_t warp0 = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  const int P = p.reduce_pieces;
  if (peers_ok)
    for (int64_t u = warp0; u < p.T * P; u += warps)
      reduce_token_piece(p, u / P, static_cast<int>(u % P), P, lane,
                         [&](int j) { return combine_row(p, u / P, j, epoch); });
  if (last_block(p, kReduceDone, gridDim.x) && threadIdx.x == 0)
    finish_combine(p, epoch, wait_all(p, p.g.off_combine_flag, epoch * p.flag_per_epoch, epoch));
}

// Lane 0 of a reducing warp: waits until `flag` (a piece of a row) reaches
// `epoch`. Gives up when a sender PE reported a failure, when another wait
// timed out, or after the timeout, naming a PE whose senders are not done.
__device__ inline bool wait_row(const Params& p, const uint64_t* flag, uint64_t epoch) {
  const uint64_t* err = local_word(p, kErrorWord);
  const volatile int32_t* status = combine_status(p, p.me, epoch);
  const uint64_t start = now_ns();
  unsigned spins = 0;
  while (ld_volatile(flag) < epoch) {  // cheap polls; one acquire once it is set
    spin_pause();
    if ((++spins & 255u) != 0) continue;
    if (ld_volatile(err) == kPeerTimeout) return false;
    for (int q = 0; q < p.n; ++q)
      if (status[q] != kOk) return false;
    if (now_ns() - start > p.timeout_ns) {
      const uint64_t target = epoch * p.flag_per_epoch;
      const uint64_t* done = at<uint64_t>(p, p.me, p.g.off_combine_flag);
      int late = p.me;
      for (int q = p.n - 1; q >= 0; --q)
        if (ld_volatile(done + q) < target) late = q;
      record_error(p, kPeerTimeout, late, p.me, epoch, kWaitCombine, ld_volatile(done + late),
                   target);
      return false;
    }
  }
  return ld_acquire(flag) >= epoch;
}

// Token-major: where this PE's own row of token t lies in expert_out (the
// combine row of that row, mapped back through the handle's summary), or
// null if the handle places it outside the valid rows.
__device__ __forceinline__ const int4* own_row(const Params& p, int32_t crow, uint64_t epoch) {
  const int32_t* mine = p.h_summary + 4 * p.me;
  const int64_t k = static_cast<int64_t>(crow) - mine[3];
  const int64_t r = mine[2] + k;
  const int64_t total = p.h_summary[4 * p.n + p.g.local_experts];
  if (k < 0 || k >= mine[1] || r < 0 || r >= total || r >= p.g.recv_rows) {
    record_error(p, kBadHandle, 0, p.me, epoch);
    return nullptr;
  }
  return reinterpret_cast<const int4*>(p.expert_out) + r * (p.g.combine_row_bytes / 16);
}

// Reducer role of combine_kernel: sums each token's rows (token-major: its
// own row straight from expert_out) once they have landed: with row_flags,
// as soon as every piece it needs has (the sums overlap the transfer), else
// once every sender PE is done (fewer waits: small calls). The lanes of a
// warp look up where a token's rows lie before it waits (the handle is
// ready from the start), so only the rows' loads follow the wait. With
// row_flags, units past each reducer warp's first come from a counter in
// token order (the order rows land in), and sender blocks that sent every
// row they could claim join in (`block` < 0): the sums left when the last
// rows land are shared by every block. One block ends the call once every
// sender PE is done: the last reducer to start (two combine sets), or the
// last block to finish its sums (one set: the buffer is consumed).
__device__ inline void reduce_landed(const Params& p, int block, int blocks, uint64_t epoch,
                                     uint32_t senders_in) {
  const Geometry& g = p.g;
  const int S = g.send_cols;
  const bool tm = p.c.layout == Layout::TokenMajor;
  const bool joins = block < 0;  // a sender block, done sending
  const int lane = threadIdx.x & 31;
  const int64_t warp0 =
      joins ? -1 : static_cast<int64_t>(block) * kWarpsPerBlock + (threadIdx.x >> 5);
  const int64_t warps = static_cast<int64_t>(blocks) * kWarpsPerBlock;  // reducer warps
  const int P = p.reduce_pieces;  // with row_flags, kReduceSplit parts per flagged piece
  const int split = p.row_flags ? P / p.pieces : 1;
  const int64_t units = p.T * P;
  const uint64_t* flags = at<uint64_t>(p, p.me, g.off_row_flags);
  uint64_t* counter = local_word(p, kReduceNext + static_cast<int>(epoch & 1));
  __shared__ int64_t claimed[kWarpsPerBlock];
  auto next = [&](int64_t u) {  // the whole warp
    return p.row_flags ? claim_unit(counter, warps, units, claimed) : u + warps;
  };
  auto place = [&](int64_t t, int j) -> const int4* {  // where token t's row j lies
    if (tm && j == p.me) {
      const int32_t crow = p.h_send_rows[t * S + j];
      return crow < 0 ? nullptr : own_row(p, crow, epoch);
    }
    return combine_row(p, t, j, epoch);
  };
  EP_DYNAMIC_SHARED(int64_t, place_words);  // [warps][S] (combine_kernel's launch sizes it)
  const bool cached = S <= kMaxCachedCols;
  const int4** places =
      reinterpret_cast<const int4**>(place_words) + static_cast<int64_t>(threadIdx.x >> 5) * S;
  auto look_up = [&](int64_t t) {  // the whole warp
    if (!cached) return;
    for (int j = lane; j < S; j += 32) places[j] = place(t, j);
    __syncwarp();
  };
  if (!joins && warp0 < units) look_up(warp0 / P);
  __shared__ bool go;
  if (threadIdx.x == 0) {
    go = p.row_flags || all_rows_landed(p, epoch);
    // A sender joins only once every sender has started (their first units
    // are theirs alone): the ticket counter is past them (not if it wrapped
    // since, which only keeps the sender out).
    if (joins) go = go && tickets_taken(p) >= senders_in;
  }
  __syncthreads();
  const int64_t first = !go ? units : joins ? next(0) : warp0;
  for (int64_t u = first; u < units; u = next(u)) {
    const int64_t t = u / P;
    const int piece = static_cast<int>(u % P);
    if (u != warp0) look_up(t);
    // This PE's own row is in memory already: its piece heads for L2 while
    // the other PEs' rows land, so the sum after the wait reads L2 only.
    if (p.row_flags && tm && cached && places[p.me]) {
      const int64_t vecs = static_cast<int64_t>(g.combine_row_bytes / 16);
      for (int64_t v = vecs * piece / P + 8 * lane; v < vecs * (piece + 1) / P; v += 8 * 32)
        prefetch_l2(places[p.me] + v);
    }
    bool ready = true;
    if (lane == 0 && p.row_flags)
      for (int j = 0; j < S && ready; ++j) {
        const int32_t row = p.h_send_rows[t * S + j];
        if (row >= 0 && row < g.combine_rows && !(tm && j == p.me))
          ready = wait_row(p, flags + static_cast<int64_t>(row) * kMaxPieces + piece / split,
                           epoch);
      }
    // Lane 0's acquire, then the warp's reads (the barrier orders them).
    if (__ballot_sync(0xffffffffu, lane == 0 && ready) == 0u) break;  // the host raises it
    reduce_token_piece(p, t, piece, P, lane,
                       [&](int j) { return cached ? places[j] : place(t, j); });
    __syncwarp();  // every lane read places[] before the next look-up
  }
  const bool ends = g.combine_sets == 2
                        ? block == blocks - 1
                        : last_block(p, kReduceDone, p.row_flags ? gridDim.x : blocks);
  if (!ends || threadIdx.x != 0) return;
  // Without row flags, `go` already means every sender PE is done.
  finish_combine(p, epoch, (go && !p.row_flags) ||
                               wait_all(p, g.off_combine_flag, epoch * p.flag_per_epoch, epoch));
}

// Combine in one grid (intranode, low_latency). Blocks take their role in
// the order they start: the first p.senders send rows back, the others
// reduce (with row_flags, each token as soon as its rows have landed, so the
// sums overlap the transfer, and senders join the reducers once they are
// done). Blocks wait only on senders of this grid that started before them
// and on other PEs' senders, so the grid needs no co-residency.
__global__ void __launch_bounds__(kThreads) combine_kernel(Params p) {
  // The role's ticket is on its way while the block waits for the previous
  // kernel (take_ticket).
  const uint32_t raw = take_ticket(p);
  wait_prior_kernel();
  const uint64_t epoch = ld_volatile(local_word(p, kCombineEpoch)) + 1;
  __shared__ int ticket;
  __shared__ uint32_t first_ticket;  // this call's first
  if (threadIdx.x == 0) {
    ticket = static_cast<int>(raw % gridDim.x);
    first_ticket = raw - static_cast<uint32_t>(ticket);
  }
  __syncthreads();
  release_next_kernel();  // (only once this block has its ticket: take_ticket)
  const bool sender = ticket < p.senders;
  if (sender) {
    send_back(p, ticket, p.senders, epoch);
    if (!p.row_flags) return;
  }
  reduce_landed(p, sender ? -1 : ticket - p.senders, static_cast<int>(gridDim.x) - p.senders,
                epoch, first_ticket + static_cast<uint32_t>(p.senders));
}

// Copy engine: after the copies of one channel, tells the peer they landed.
__global__ void signal_kernel(uint64_t* flag, uint64_t add) {
  fence_release();
  add_release(flag, add);
}

}  // namespace symheap::ep::EP_DEVICE_NS::kernels
