// Device helpers shared by every EP kernel: workspace addressing, error
// recording, bounded waits, block arrival order, flag publication, warp
// copies and a block scan. The memory-model operations are the device API's
// (symheap/device.cuh; its host emulation in ep_device_compat.hpp).
#pragma once
#include "ops/ep/ep_params.cuh"

namespace symheap::ep::EP_DEVICE_NS::kernels {

// ------------------------------------------------------------ primitives

// Byte `off` of PE pe's workspace (this PE's without a load from the peer table).
template <class T>
__device__ __forceinline__ T* at(const Params& p, int pe, size_t off) {
  return reinterpret_cast<T*>(
      (pe == p.my_pe ? p.my_workspace
                     : dev::peer_heap_ptr(p.peer_bases, pe, p.workspace_offset)) +
      off);
}
__device__ __forceinline__ uint64_t* local_word(const Params& p, int w) {
  return at<uint64_t>(p, p.my_pe, p.geo.off_local) + w;
}
// Whether the kernels store into PE q themselves: a PE of another node has
// no load/store path, and the host moves what it needs through the remote
// transport (ep_device_driver.hpp).
__device__ __forceinline__ bool stores_reach(const Params& p, int q) {
  return !p.has_remote_peers || p.peer_bases[q] != nullptr;
}

#ifdef __CUDACC__
// What a poll does between two reads (the emulation yields its OS thread).
__device__ __forceinline__ void spin_pause() {}
// Thread 0: brings the peer table into this SM's L1 at kernel start, so the
// first stores into each peer do not wait for it.
__device__ __forceinline__ void prefetch_peers(const Params& p) {
  if (threadIdx.x == 0)
    for (int q = 0; q < p.n_pes; q += 16)
      asm volatile("prefetch.global.L1 [%0];" ::"l"(p.peer_bases + q));
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
inline void spin_pause() { sched_yield(); }
inline void prefetch_peers(const Params&) {}
inline void prefetch_l2(const void*) {}
inline void release_next_kernel() {}
inline void wait_prior_kernel() {}
inline void start_kernel() {}
#endif

// Records the first failure on this PE (device word, then the host mirror).
__device__ inline void record_error(const Params& p, int32_t status, int32_t detail, int32_t pe,
                                    uint64_t epoch, int32_t wait = kWaitNone, uint64_t seen = 0,
                                    uint64_t target = 0) {
  auto* word = reinterpret_cast<unsigned long long*>(local_word(p, kErrorWord));
  if (atomicCAS(word, 0ull, static_cast<unsigned long long>(status)) == 0ull) {
    volatile int32_t* h = p.host_mirror;
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

// One thread waits until flags[q] >= target for every PE q (with
// remote_only, every PE the kernels do not store into; with only >= 0,
// PE `only` alone). After a timeout
// (recorded, naming the first late PE) it returns false at once, and so do
// later waits, so a broken job fails fast instead of hanging.
__device__ inline bool wait_all(const Params& p, size_t off_flags, uint64_t target,
                                uint64_t epoch, bool remote_only = false, int only = -1) {
  const uint64_t* flags = at<uint64_t>(p, p.my_pe, off_flags);
  const uint64_t* err = local_word(p, kErrorWord);
  if (dev::load_relaxed(err) == kPeerTimeout) return false;
  const uint64_t start = dev::global_timer_ns();
  for (int q = 0; q < p.n_pes; ++q) {
    if ((remote_only && stores_reach(p, q)) || (only >= 0 && q != only)) continue;
    unsigned spins = 0;
    uint64_t seen;
    while ((seen = dev::load_relaxed(flags + q)) < target) {  // cheap polls; an acquire below
      spin_pause();
      if ((++spins & 1023u) == 0) {
        if (dev::load_relaxed(err) == kPeerTimeout) return false;
        if (dev::global_timer_ns() - start > p.timeout_ns) {
          const bool fwd = p.geo.fwd_on_device;
          const int32_t kind = fwd && off_flags == p.geo.off_fwd_flag     ? kWaitForward
                               : fwd && off_flags == p.geo.off_stage_flag ? kWaitStaged
                               : fwd && off_flags == p.geo.off_plan_flag  ? kWaitPlan
                               : off_flags == p.geo.off_count_flag  ? kWaitCounts
                               : off_flags == p.geo.off_data_flag  ? kWaitData
                               : off_flags == p.geo.off_freed_flag ? kWaitFreed
                               : off_flags == p.geo.off_entered    ? kWaitEntered
                                                                 : kWaitCombine;
          record_error(p, kPeerTimeout, q, p.my_pe, epoch, kind, seen, target);
          return false;
        }
      }
    }
    dev::load_acquire(flags + q);  // orders what the caller reads next after the flag
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
  dev::fence_acq_rel();
  for (int q = 0; q < p.n_pes; ++q) {
    if (!stores_reach(p, q)) continue;
    uint64_t* flag = at<uint64_t>(p, q, off_flags) + p.my_pe;
    if (add) dev::add_relaxed(flag, value);
    else dev::store_relaxed(flag, value);
  }
}

__device__ __forceinline__ int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }
__device__ __forceinline__ int64_t imax(int64_t a, int64_t b) { return a > b ? a : b; }

__device__ __forceinline__ int64_t topk_id(const Params& p, int64_t i) {
  return p.topk_idx_is_int64 ? static_cast<const int64_t*>(p.topk_idx)[i]
                             : static_cast<const int32_t*>(p.topk_idx)[i];
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

}  // namespace symheap::ep::EP_DEVICE_NS::kernels
