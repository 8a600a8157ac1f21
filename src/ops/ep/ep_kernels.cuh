// CUDA kernels of expert-parallel dispatch/combine. The protocol is the cpu
// implementation's (ep_cpu.cpp): routing counts exchanged through every PE's
// count rows, rows stored straight into their final place, epoch flags.
//
// Kernels never wait on a block of their own grid, only on kernels of other
// PEs that never wait on them, so no grid needs to be co-resident:
//   route          ranks the tokens per destination / expert, and its last
//                  block publishes this PE's count row (never waits);
//   dispatch       waits for every count row, stores rows into peers (or, in
//                  pack mode, into local staging for the copy engines), adds
//                  1 per block to each peer's data flag; its last block waits
//                  for every peer's blocks and writes the outputs;
//   combine_send   waits until each source consumed its combine buffer, then
//                  stores rows back into their source's buffer (pack mode:
//                  into local staging);
//   combine_reduce waits for every peer's rows, sums per token, and its last
//                  block marks this PE's buffer consumed on every peer.
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

#ifdef __CUDACC__
constexpr int kThreads = 512;  // dispatch / combine blocks
constexpr int kRouteThreads = 256;
#else  // the host emulation: fewer OS threads per block, hence more blocks per grid
constexpr int kThreads = 64;
constexpr int kRouteThreads = 64;
#endif
constexpr int kWarpsPerBlock = kThreads / 32;
constexpr int kMaxBlocks = 128;

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
                          kWaitCombine = 4 };

struct Params {
  Config c;
  Geometry g;
  char* const* peers;  // heap base of every PE, as seen from this device (device table)
  uint64_t ws;         // heap offset of the workspace
  int32_t me, n;
  int64_t T;  // tokens of this call (0 when this PE aborts)
  int32_t host_status, host_detail;
  int32_t pack;  // copy engine: stage locally, the host moves the rows
  int32_t flag_per_epoch;  // what each peer adds to a data / combine flag per call
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
  return reinterpret_cast<T*>(p.peers[pe] + p.ws + off);
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
__device__ __forceinline__ void st_release(uint64_t* a, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(a), "l"(v) : "memory");
}
__device__ __forceinline__ void add_release(uint64_t* a, uint64_t v) {
  asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(a), "l"(v) : "memory");
}
__device__ __forceinline__ uint64_t now_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ void spin_pause() {}
#else
inline uint64_t ld_acquire(const uint64_t* a) { return __atomic_load_n(a, __ATOMIC_ACQUIRE); }
inline void st_release(uint64_t* a, uint64_t v) { __atomic_store_n(a, v, __ATOMIC_RELEASE); }
inline void add_release(uint64_t* a, uint64_t v) { __atomic_fetch_add(a, v, __ATOMIC_RELEASE); }
inline uint64_t now_ns() {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                   std::chrono::steady_clock::now().time_since_epoch())
                                   .count());
}
inline void spin_pause() { sched_yield(); }
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
    while ((seen = ld_acquire(flags + q)) < target) {
      spin_pause();
      if ((++spins & 1023u) == 0) {
        if (ld_volatile(err) == kPeerTimeout) return false;
        if (now_ns() - start > p.timeout_ns) {
          const int32_t kind = off_flags == p.g.off_count_flag  ? kWaitCounts
                               : off_flags == p.g.off_data_flag  ? kWaitData
                               : off_flags == p.g.off_freed_flag ? kWaitFreed
                                                                 : kWaitCombine;
          record_error(p, kPeerTimeout, q, p.me, epoch, kind, seen, target);
          return false;
        }
      }
    }
  }
  return true;
}

// True in exactly one block: the last of the grid to get here. Its threads
// then see every other block's writes. Resets the counter for the next call.
__device__ inline bool last_block(const Params& p, int counter) {
  __shared__ bool is_last;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    auto* c = reinterpret_cast<unsigned long long*>(local_word(p, counter));
    unsigned long long prev = atomicAdd(c, 1ull);
    is_last = prev == gridDim.x - 1;
    if (is_last) *c = 0;
  }
  __syncthreads();
  if (is_last) __threadfence();
  return is_last;
}

__device__ __forceinline__ int64_t topk_id(const Params& p, int64_t i) {
  return p.idx64 ? static_cast<const int64_t*>(p.idx)[i] : static_cast<const int32_t*>(p.idx)[i];
}

// Copies `bytes` with the 32 lanes of a warp: 16-byte vectors when aligned.
__device__ __forceinline__ void warp_copy(char* dst, const char* src, size_t bytes, int lane) {
  if (((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) | bytes) & 15) == 0) {
    const int4* s = reinterpret_cast<const int4*>(src);
    int4* d = reinterpret_cast<int4*>(dst);
    const size_t nv = bytes >> 4;
    size_t i = lane;
    for (; i + 96 < nv; i += 128) {  // four loads in flight per lane
      int4 a = s[i], b = s[i + 32], c = s[i + 64], e = s[i + 96];
      d[i] = a;
      d[i + 32] = b;
      d[i + 64] = c;
      d[i + 96] = e;
    }
    for (; i < nv; i += 32) d[i] = s[i];
  } else if (((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) | bytes) & 3) ==
             0) {
    const int32_t* s = reinterpret_cast<const int32_t*>(src);
    int32_t* d = reinterpret_cast<int32_t*>(dst);
    for (size_t i = lane; i < bytes / 4; i += 32) d[i] = s[i];
  } else {
    for (size_t i = lane; i < bytes; i += 32) dst[i] = src[i];
  }
}

// Ordered compaction by the whole block: for i in [0, n), emit(i, rank) with
// the rank of i among the items where pred holds (-1 where it does not).
// Returns the number of hits (in every thread).
template <class Pred, class Emit>
__device__ int block_compact(int64_t n, Pred pred, Emit emit) {
  __shared__ int warp_hits[32];
  __shared__ int running;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  if (threadIdx.x == 0) running = 0;
  __syncthreads();
  for (int64_t start = 0; start < n; start += blockDim.x) {
    const int64_t i = start + threadIdx.x;
    const bool hit = i < n && pred(i);
    const unsigned ballot = __ballot_sync(0xffffffffu, hit);
    if (lane == 0) warp_hits[warp] = __popc(ballot);
    __syncthreads();
    int before = running;
    for (int w = 0; w < warp; ++w) before += warp_hits[w];
    if (i < n) emit(i, hit ? before + __popc(ballot & ((1u << lane) - 1u)) : -1);
    __syncthreads();
    if (threadIdx.x == 0)
      for (int w = 0; w < nwarps; ++w) running += warp_hits[w];
    __syncthreads();
  }
  return running;
}

// ------------------------------------------------------------ route

// Token-major: block d ranks the tokens with a kept expert on PE d and counts
// the slots of each of d's experts. Expert-major: block e ranks the (token,
// slot) pairs of expert e. Block 0 also validates every id (an id out of
// range counts as dropped, so memory stays safe, and aborts the call).
__global__ void __launch_bounds__(kRouteThreads) route_kernel(Params p) {
  const int n = p.n, K = p.c.topk, E = p.c.num_experts, L = p.g.local_experts;
  const bool tm = p.c.layout == Layout::TokenMajor;
  int32_t* pos = at<int32_t>(p, p.me, p.g.off_scratch_pos);
  int32_t* counts = at<int32_t>(p, p.me, p.g.off_scratch_counts);
  const int64_t T = p.T;
  const int b = blockIdx.x;
  auto kept = [&](int64_t id) { return id >= 0 && id < E; };

  if (tm) {
    const int d = b;
    EP_DYNAMIC_SHARED(int32_t, per_expert);  // [L] slots of d's experts
    for (int l = threadIdx.x; l < L; l += blockDim.x) per_expert[l] = 0;
    __syncthreads();
    int total = block_compact(
        T,
        [&](int64_t t) {
          for (int k = 0; k < K; ++k) {
            int64_t id = topk_id(p, t * K + k);
            if (kept(id) && id / L == d) return true;
          }
          return false;
        },
        [&](int64_t t, int r) { pos[t * n + d] = r; });
    for (int64_t i = threadIdx.x; i < T * K; i += blockDim.x) {
      int64_t id = topk_id(p, i);
      if (kept(id) && id / L == d) atomicAdd(&per_expert[id % L], 1);
    }
    __syncthreads();
    for (int l = threadIdx.x; l < L; l += blockDim.x)
      counts[kCountDest + n + d * L + l] = per_expert[l];
    if (threadIdx.x == 0) counts[kCountDest + d] = total;
  } else {
    const int e = b;
    int total = block_compact(
        T * K, [&](int64_t i) { return topk_id(p, i) == e; },
        [&](int64_t i, int r) {
          if (r >= 0) pos[i] = r;
        });
    if (b == 0)
      for (int64_t i = threadIdx.x; i < T * K; i += blockDim.x)
        if (!kept(topk_id(p, i))) pos[i] = -1;
    if (threadIdx.x == 0) counts[kCountDest + n + e] = total;
  }
  if (b == 0) {
    __shared__ int found;
    __shared__ long long bad_id;
    if (threadIdx.x == 0) found = 0;
    __syncthreads();
    for (int64_t i = threadIdx.x; i < T * K; i += blockDim.x) {
      int64_t id = topk_id(p, i);
      if (id < -1 || id >= E)
        if (atomicCAS(&found, 0, 1) == 0) bad_id = id;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      counts[kCountStatus] = found ? kExpertOutOfRange : kOk;
      long long v = found ? bad_id : 0;
      counts[kCountDetail] = static_cast<int32_t>(v < INT32_MIN ? INT32_MIN : v > INT32_MAX ? INT32_MAX : v);
    }
  }

  if (!last_block(p, kRouteDone)) return;
  if (threadIdx.x == 0) {  // first combine row of each destination (expert) in send order
    int32_t* prefix = at<int32_t>(p, p.me, p.g.off_scratch_prefix);
    const int first = tm ? kCountDest : kCountDest + n;
    int32_t sum = 0;
    for (int j = 0; j < (tm ? n : E); ++j) {
      prefix[j] = sum;
      sum += counts[first + j];
    }
  }
  // Publish [status, detail, dest counts, expert counts] into every PE.
  const uint64_t epoch = ld_volatile(local_word(p, kDispatchEpoch)) + 1;
  int32_t status = p.host_status ? p.host_status : counts[kCountStatus];
  int32_t detail = p.host_status ? p.host_detail : counts[kCountDetail];
  const int CW = p.g.count_words;
  for (int q = 0; q < n; ++q) {
    int32_t* row = at<int32_t>(p, q, p.g.off_count_rows) + p.me * CW;
    for (int i = threadIdx.x; i < CW; i += blockDim.x) {
      int32_t v = 0;
      if (i == kCountStatus) v = status;
      else if (i == kCountDetail) v = detail;
      else if (status == kOk && i < kCountDest + n) {
        int d = i - kCountDest;
        if (tm) v = counts[i];
        else
          for (int l = 0; l < L; ++l) v += counts[kCountDest + n + d * L + l];
      } else if (status == kOk && i < kCountDest + n + E) {
        v = counts[i];
      }
      row[i] = v;
    }
  }
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x == 0)
    for (int q = 0; q < n; ++q) st_release(at<uint64_t>(p, q, p.g.off_count_flag) + p.me, epoch);
}

// ------------------------------------------------------------ dispatch

// Shared state of a dispatch block, computed identically by every block from
// the count matrix: abort decision, destination bases and send-list prefixes.
struct DispatchPlan {
  int32_t abort_status, abort_detail, abort_pe;
};

__device__ inline int32_t count_cell(const Params& p, int q, int i) {
  return __ldcg(at<int32_t>(p, p.me, p.g.off_count_rows) + q * p.g.count_words + i);
}

// Fills `plan` and, in dynamic shared memory, base[] (first row of this PE's
// rows at each destination / in each expert's run) and prefix[] (first row of
// each destination / expert in this PE's send order = its combine rows).
__device__ inline void make_plan(const Params& p, DispatchPlan& plan, int32_t* base,
                                 int32_t* prefix) {
  const int n = p.n, E = p.c.num_experts, L = p.g.local_experts;
  const bool tm = p.c.layout == Layout::TokenMajor;
  const int cols = tm ? n : E;
  const int first = tm ? kCountDest : kCountDest + n;
  __shared__ int bad_pe, overflow_at;
  if (threadIdx.x == 0) {
    bad_pe = n;
    overflow_at = cols;
  }
  __syncthreads();
  for (int q = threadIdx.x; q < n; q += blockDim.x)
    if (count_cell(p, q, kCountStatus) != kOk) atomicMin(&bad_pe, q);
  const int32_t* my_prefix = at<int32_t>(p, p.me, p.g.off_scratch_prefix);  // by route_kernel
  for (int j = threadIdx.x; j < cols; j += blockDim.x) {
    int64_t total = 0, before = 0;
    for (int q = 0; q < n; ++q) {
      int32_t v = count_cell(p, q, first + j);
      total += v;
      if (q < p.me) before += v;
    }
    base[j] = static_cast<int32_t>(before);
    prefix[j] = my_prefix[j];
    if (total > (tm ? p.g.recv_rows : p.g.expert_cap)) atomicMin(&overflow_at, j);
  }
  __syncthreads();
  if (bad_pe < n) {
    plan.abort_status = count_cell(p, bad_pe, kCountStatus);
    plan.abort_detail = count_cell(p, bad_pe, kCountDetail);
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
// handle's summary. One block, before this PE signals its rows: once a peer
// has every PE's rows it may publish its next count row over this one.
__device__ inline void finish_counts(const Params& p, bool abort) {
  const int n = p.n, L = p.g.local_experts;
  const bool tm = p.c.layout == Layout::TokenMajor;
  for (int l = threadIdx.x; l < L; l += blockDim.x) {
    int32_t c = 0;
    if (!abort)
      for (int q = 0; q < n; ++q) c += count_cell(p, q, kCountDest + n + p.me * L + l);
    p.expert_counts[l] = c;
    p.summary[4 * n + l] = c;
  }
  for (int q = threadIdx.x; q < n; q += blockDim.x) {
    int32_t range_start = 0, rows = 0, first_row = 0;
    if (!abort) {
      if (tm) {
        for (int d = 0; d < p.me; ++d) range_start += count_cell(p, q, kCountDest + d);
        rows = count_cell(p, q, kCountDest + p.me);
        for (int r = 0; r < q; ++r) first_row += count_cell(p, r, kCountDest + p.me);
      } else {
        for (int e = 0; e < p.me * L; ++e) range_start += count_cell(p, q, kCountDest + n + e);
        for (int l = 0; l < L; ++l) rows += count_cell(p, q, kCountDest + n + p.me * L + l);
      }
    }
    p.summary[4 * q] = range_start;
    p.summary[4 * q + 1] = rows;
    p.summary[4 * q + 2] = first_row;
    p.summary[4 * q + 3] = 0;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int32_t total = 0;
    for (int q = 0; q < n; ++q) total += p.summary[4 * q + 1];
    *p.num_recv = total;
    p.summary[4 * n + L] = total;
    p.summary[4 * n + L + 1] = 0;
    p.summary[4 * n + L + 2] = 0;
    p.summary[4 * n + L + 3] = 0;
    static_cast<volatile int32_t*>(p.host)[kHostNumRecv] = total;
  }
  __syncthreads();
}

// The handle's private copy of the valid rows' metadata, by one block once
// every row has landed (the summary is already written).
__device__ inline void finish_meta(const Params& p) {
  const int n = p.n, L = p.g.local_experts;
  const int32_t* meta = at<int32_t>(p, p.me, p.g.off_recv_meta);
  if (p.c.layout == Layout::TokenMajor) {
    const int64_t words = static_cast<int64_t>(p.summary[4 * n + L]) * kMetaWords;
    for (int64_t i = threadIdx.x; i < words; i += blockDim.x) p.recv_meta[i] = __ldcg(meta + i);
  } else {
    const int64_t cap = p.g.expert_cap;
    for (int64_t i = threadIdx.x; i < p.g.recv_rows * kMetaWords; i += blockDim.x) {
      int64_t row = i / kMetaWords;
      if (row % cap < p.summary[4 * n + row / cap]) p.recv_meta[i] = __ldcg(meta + i);
    }
  }
}

// Stores (or, in pack mode, stages) every row of this PE. Every block waits
// for the count rows, so every block agrees on aborts and on destinations.
__global__ void __launch_bounds__(kThreads) dispatch_kernel(Params p) {
  const int n = p.n, K = p.c.topk, E = p.c.num_experts, L = p.g.local_experts;
  const bool tm = p.c.layout == Layout::TokenMajor;
  const Geometry& g = p.g;
  const uint64_t epoch = ld_volatile(local_word(p, kDispatchEpoch)) + 1;
  EP_DYNAMIC_SHARED(int32_t, dyn);
  const int cols = tm ? n : E;
  int32_t* base = dyn;  // [cols]
  int32_t* prefix = base + cols;
  __shared__ bool counts_ok;
  __shared__ DispatchPlan plan;
  if (threadIdx.x == 0) counts_ok = wait_all(p, g.off_count_flag, epoch, epoch);
  __syncthreads();
  if (counts_ok) {
    DispatchPlan local;
    make_plan(p, local, base, prefix);
    if (threadIdx.x == 0) plan = local;
  } else if (threadIdx.x == 0) {
    plan = DispatchPlan{kPeerTimeout, 0, -1};
  }
  __syncthreads();
  const bool abort = plan.abort_status != kOk;
  const int32_t* pos = at<int32_t>(p, p.me, g.off_scratch_pos);
  const int lane = threadIdx.x & 31;
  const int64_t warp0 = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  const int64_t T = abort ? 0 : p.T;

  // Destination of a row: a peer's receive buffer, or local staging (pack).
  auto target = [&](int d, size_t off) { return p.pack ? at<char>(p, p.me, off) : at<char>(p, d, off); };
  const size_t off_x = p.pack ? g.off_stage_x : g.off_recv_x;
  const size_t off_s = p.pack ? g.off_stage_scales : g.off_recv_scales;
  const size_t off_i = p.pack ? g.off_stage_idx : g.off_recv_idx;
  const size_t off_w = p.pack ? g.off_stage_w : g.off_recv_w;
  const size_t off_m = p.pack ? g.off_stage_meta : g.off_recv_meta;

  for (int64_t t = warp0; t < T; t += warps) {
    const char* src = p.x + t * g.row_bytes;
    const char* src_scales = p.scales + t * g.scale_row_bytes;
    if (tm) {
      for (int d = 0; d < n; ++d) {
        const int32_t ps = pos[t * n + d];
        if (ps < 0) continue;
        const int32_t crow = prefix[d] + ps;
        const int64_t r = p.pack ? crow : static_cast<int64_t>(base[d]) + ps;
        warp_copy(target(d, off_x) + r * g.row_bytes, src, g.row_bytes, lane);
        if (g.scale_row_bytes)
          warp_copy(target(d, off_s) + r * g.scale_row_bytes, src_scales, g.scale_row_bytes, lane);
        int32_t* idx = reinterpret_cast<int32_t*>(target(d, off_i)) + r * K;
        float* w = reinterpret_cast<float*>(target(d, off_w)) + r * K;
        for (int k = lane; k < K; k += 32) {
          int64_t id = topk_id(p, t * K + k);
          bool local = id >= 0 && id < E && id / L == d;
          idx[k] = local ? static_cast<int32_t>(id % L) : -1;
          w[k] = local ? p.w[t * K + k] : 0.0f;
        }
        if (lane < kMetaWords) {
          int32_t v = lane == kMetaSrcPe ? p.me : lane == kMetaToken ? static_cast<int32_t>(t)
                                                : lane == kMetaSlot ? -1 : crow;
          reinterpret_cast<int32_t*>(target(d, off_m))[r * kMetaWords + lane] = v;
        }
      }
    } else {
      for (int k = 0; k < K; ++k) {
        const int64_t id = topk_id(p, t * K + k);
        if (id < 0 || id >= E) continue;
        const int d = static_cast<int>(id / L);
        const int32_t ps = pos[t * K + k];
        const int32_t crow = prefix[id] + ps;
        const int64_t r = p.pack ? crow : (id % L) * g.expert_cap + base[id] + ps;
        warp_copy(target(d, off_x) + r * g.row_bytes, src, g.row_bytes, lane);
        if (g.scale_row_bytes)
          warp_copy(target(d, off_s) + r * g.scale_row_bytes, src_scales, g.scale_row_bytes, lane);
        if (lane == 0) reinterpret_cast<float*>(target(d, off_w))[r] = p.w[t * K + k];
        if (lane < kMetaWords) {
          int32_t v = lane == kMetaSrcPe ? p.me : lane == kMetaToken ? static_cast<int32_t>(t)
                                                : lane == kMetaSlot ? k : crow;
          reinterpret_cast<int32_t*>(target(d, off_m))[r * kMetaWords + lane] = v;
        }
      }
    }
  }
  // Handle: the combine row of every (token, destination | slot), -1 if none.
  const int send_cols = g.send_cols;
  const int64_t gtid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t gthreads = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = gtid; i < static_cast<int64_t>(p.c.max_tokens) * send_cols; i += gthreads) {
    const int64_t t = i / send_cols;
    int32_t v = -1;
    if (t < T) {
      if (tm) {
        int32_t ps = pos[i];
        if (ps >= 0) v = prefix[i % send_cols] + ps;
      } else {
        int64_t id = topk_id(p, i);
        if (id >= 0 && id < E) v = prefix[id] + pos[i];
      }
    }
    p.send_rows[i] = v;
  }
  if (p.saved_w)
    for (int64_t i = gtid; i < T * K; i += gthreads) p.saved_w[i] = p.w[i];

  __threadfence_system();
  auto signal_rows = [&] {
    if (!p.pack && threadIdx.x == 0)
      for (int q = 0; q < n; ++q) add_release(at<uint64_t>(p, q, g.off_data_flag) + p.me, 1);
  };
  if (!last_block(p, kDispatchDone)) {
    signal_rows();
    return;
  }
  if (threadIdx.x == 0 && must_report(p, plan))
    record_error(p, plan.abort_status, plan.abort_detail, plan.abort_pe, epoch);
  finish_counts(p, abort);
  if (p.pack) {
    // The copy plan for the host: one segment per destination (token-major)
    // or per expert (expert-major) with rows.
    if (threadIdx.x == 0) {
      volatile int32_t* h = p.host;
      int segs = 0;
      if (!abort)
        for (int j = 0; j < cols; ++j) {
          int32_t rows = count_cell(p, p.me, (tm ? kCountDest : kCountDest + n) + j);
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
  signal_rows();
  __shared__ bool landed;
  if (threadIdx.x == 0) landed = wait_all(p, g.off_data_flag, epoch * p.flag_per_epoch, epoch);
  __syncthreads();
  if (landed && !abort) finish_meta(p);
  __syncthreads();
  if (threadIdx.x == 0) *local_word(p, kDispatchEpoch) = epoch;
}

// Copy engine: once the host queued the copies and their signals, waits for
// every peer's rows and copies the handle's metadata (dispatch_kernel in pack
// mode already wrote the counts).
__global__ void __launch_bounds__(kThreads) finish_kernel(Params p, int32_t abort) {
  const uint64_t epoch = ld_volatile(local_word(p, kDispatchEpoch)) + 1;
  __shared__ bool ok;
  if (threadIdx.x == 0) ok = wait_all(p, p.g.off_data_flag, epoch * p.flag_per_epoch, epoch);
  __syncthreads();
  if (ok && !abort) finish_meta(p);
  __syncthreads();
  if (threadIdx.x == 0) *local_word(p, kDispatchEpoch) = epoch;
}

// ------------------------------------------------------------ combine

// Rows of this PE's handle that hold data: token-major [0, total), expert-
// major (l, i < count[l]).
__device__ __forceinline__ bool valid_row(const Params& p, int64_t r) {
  const int n = p.n, L = p.g.local_experts;
  if (p.c.layout == Layout::TokenMajor) return r < p.h_summary[4 * n + L];
  return r % p.g.expert_cap < p.h_summary[4 * n + r / p.g.expert_cap];
}

// Where received row r goes back to: its source PE and its row there (the
// source's combine row; in stage mode, the row of this PE's staging buffer).
// False when the handle names a place outside the op's buffers: a handle
// edited by the caller must never make a kernel or a copy write out of bounds.
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

// The copy plan of the copy engine, segment (from, to, rows) of source q,
// lies inside the buffers (the handle's summary is the caller's memory).
__device__ __forceinline__ bool segment_in_bounds(const Params& p, int q, int64_t packed) {
  const int64_t to = p.h_summary[4 * q], rows = p.h_summary[4 * q + 1];
  const int64_t from = p.c.layout == Layout::TokenMajor ? p.h_summary[4 * q + 2] : packed;
  return rows >= 0 && to >= 0 && from >= 0 && to + rows <= p.g.combine_rows &&
         from + rows <= p.g.recv_rows;
}

__global__ void __launch_bounds__(kThreads) combine_send_kernel(Params p) {
  const int n = p.n;
  const Geometry& g = p.g;
  const uint64_t epoch = ld_volatile(local_word(p, kCombineEpoch)) + 1;
  __shared__ bool ok, handle_ok;
  if (threadIdx.x == 0) {
    ok = wait_all(p, g.off_freed_flag, epoch - 1, epoch);
    handle_ok = true;
  }
  __syncthreads();
  const bool send = ok && p.host_status == kOk;
  // Block 0 checks the whole handle first, so every PE learns of a bad one.
  if (blockIdx.x == 0 && send) {
    for (int64_t r = threadIdx.x; r < g.recv_rows; r += blockDim.x) {
      int src;
      int64_t row;
      if (valid_row(p, r) && !combine_target(p, r, &src, &row)) handle_ok = false;
    }
    if (p.pack && threadIdx.x == 0) {
      int64_t packed = 0;
      for (int q = 0; q < n; ++q) {
        if (!segment_in_bounds(p, q, packed)) handle_ok = false;
        packed += p.h_summary[4 * q + 1];
      }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      *local_word(p, kHandleBad) = handle_ok ? 0 : 1;
      if (!handle_ok) record_error(p, kBadHandle, 0, p.me, epoch);
    }
  }
  const int lane = threadIdx.x & 31;
  const int64_t warp0 = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  const size_t crb = g.combine_row_bytes;
  const bool stage = p.pack && p.c.layout == Layout::ExpertMajor;
  if (send && (!p.pack || stage)) {
    for (int64_t r = warp0; r < g.recv_rows; r += warps) {
      int src;
      int64_t row;
      if (!valid_row(p, r) || !combine_target(p, r, &src, &row)) continue;
      char* dst = stage ? at<char>(p, p.me, g.off_stage_combine) + row * crb
                        : at<char>(p, src, g.off_combine_buf) + row * crb;
      warp_copy(dst, p.expert_out + r * crb, crb, lane);
    }
  }
  if (blockIdx.x == 0 && threadIdx.x == 0)
    for (int q = 0; q < n; ++q)
      at<int32_t>(p, q, g.off_combine_status)[p.me] =
          !ok ? kPeerTimeout : !handle_ok ? kBadHandle : p.host_status;
  if (!p.pack) {
    __threadfence_system();
    __syncthreads();
    if (threadIdx.x == 0)
      for (int q = 0; q < n; ++q) add_release(at<uint64_t>(p, q, g.off_combine_flag) + p.me, 1);
    return;
  }
  __threadfence_system();
  if (!last_block(p, kSendDone)) return;
  if (threadIdx.x == 0) {  // copy plan: one segment per source with rows
    volatile int32_t* h = p.host;
    int segs = 0;
    int32_t packed = 0;
    if (send && ld_volatile(local_word(p, kHandleBad)) == 0)
      for (int q = 0; q < n; ++q) {
        int32_t rows = p.h_summary[4 * q + 1];
        if (rows) {
          volatile int32_t* s = h + kHostSegment0 + 4 * segs++;
          s[0] = q;
          s[1] = p.c.layout == Layout::TokenMajor ? p.h_summary[4 * q + 2] : packed;
          s[2] = p.h_summary[4 * q];
          s[3] = rows;
        }
        packed += rows;
      }
    h[kHostSegments] = segs;
    __threadfence_system();
  }
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

__global__ void __launch_bounds__(kThreads) combine_reduce_kernel(Params p) {
  const int n = p.n, K = p.c.topk;
  const bool tm = p.c.layout == Layout::TokenMajor;
  const Geometry& g = p.g;
  const uint64_t epoch = ld_volatile(local_word(p, kCombineEpoch)) + 1;
  __shared__ int32_t bad_pe, bad_status;
  if (threadIdx.x == 0) {
    bad_pe = n;
    bad_status = kOk;
    if (!wait_all(p, g.off_combine_flag, epoch * p.flag_per_epoch, epoch)) {
      bad_pe = -1;
      bad_status = kPeerTimeout;
    }
  }
  __syncthreads();
  if (bad_status == kOk) {
    for (int q = threadIdx.x; q < n; q += blockDim.x)
      if (__ldcg(at<int32_t>(p, p.me, g.off_combine_status) + q) != kOk) atomicMin(&bad_pe, q);
    __syncthreads();
    if (threadIdx.x == 0 && bad_pe < n)
      bad_status = __ldcg(at<int32_t>(p, p.me, g.off_combine_status) + bad_pe);
    __syncthreads();
  }
  const DType dt = g.combine_dtype;
  const size_t crb = g.combine_row_bytes;
  const int64_t chunks = static_cast<int64_t>(crb / 16);
  const char* buf = at<char>(p, p.me, g.off_combine_buf);
  const int cols = tm ? n : K;
  const int lane = threadIdx.x & 31;
  const int64_t warp0 = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  if (bad_status == kOk) {
    for (int64_t t = warp0; t < p.T; t += warps) {
      for (int64_t c = lane; c < chunks; c += 32) {
        float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        int m = 0;
        for (int j = 0; j < cols; ++j) {
          const int32_t row = p.h_send_rows[t * g.send_cols + j];
          if (row < 0) continue;
          if (row >= g.combine_rows) {  // an edited handle: never read outside the buffer
            record_error(p, kBadHandle, 0, p.me, epoch);
            continue;
          }
          const float wt = tm ? 1.0f : p.cw[t * K + j];
          int4 v = __ldcg(reinterpret_cast<const int4*>(buf + static_cast<int64_t>(row) * crb) + c);
          float f[8];
          m = unpack16(v, dt, f);
          for (int i = 0; i < m; ++i) acc[i] += wt * f[i];
        }
        reinterpret_cast<int4*>(p.out + t * crb)[c] = pack16(acc, dt);
      }
    }
  }
  if (!last_block(p, kReduceDone)) return;
  if (threadIdx.x == 0) {
    if (bad_status != kOk && bad_status != kPeerTimeout && p.host_status == kOk)
      record_error(p, bad_status, 0, bad_pe, epoch);
    __threadfence_system();
    for (int q = 0; q < n; ++q) st_release(at<uint64_t>(p, q, g.off_freed_flag) + p.me, epoch);
    *local_word(p, kCombineEpoch) = epoch;
  }
}

// Copy engine: after the copies of one channel, tells the peer they landed.
__global__ void signal_kernel(uint64_t* flag, uint64_t add) {
  __threadfence_system();
  add_release(flag, add);
}

}  // namespace symheap::ep::EP_DEVICE_NS::kernels
