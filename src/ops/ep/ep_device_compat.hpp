// Lets ep_kernels.cuh compile as host C++ as well as CUDA. On the host, the
// kernels run in an emulation (ep_emulated.cpp): one OS thread per CUDA
// thread, the blocks of a grid one after another, __syncthreads and warp
// ballots as real barriers, atomics as host atomics. It exists so that the
// cpu test suite exercises the kernels' logic (indexing, protocol, aborts,
// timeouts) on machines without a GPU. `__shared__` variables become
// function statics, so the emulation runs one PE per process.
#pragma once

// The kernels and their driver live in a namespace of their own in each
// compilation (EP_DEVICE_NS): nvcc's host-side launch stubs and the
// emulation's host functions would otherwise share mangled names.
#ifdef __CUDACC__
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#define EP_DEVICE_NS cuda_impl
#define EP_DYNAMIC_SHARED(type, name) extern __shared__ type name[]

#include "symheap/device.cuh"

// The kernels' memory-model operations and peer addressing: the device API's.
namespace symheap::ep::cuda_impl {
namespace dev = ::symheap::device;
}
#else
#define EP_DEVICE_NS host_emulation

#include <sched.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <vector>

#define __global__ inline
#define __device__
#define __forceinline__ inline
#define __shared__ static
#define __launch_bounds__(...)
#define EP_DYNAMIC_SHARED(type, name) type* name = ::symheap::ep::host_emulation::emu::dynamic_shared<type>()

namespace symheap::ep::host_emulation::emu {

struct Int4 {
  int x, y, z, w;
};

struct Dim3 {
  unsigned x = 1, y = 1, z = 1;
};

// A barrier that can be reused: waiters of one round leave before the next
// round's arrivals count.
struct Barrier {
  std::mutex mu;
  std::condition_variable cv;
  int arrived = 0;
  uint64_t round = 0;
  uint32_t bits = 0, result = 0;  // warp ballot
  int tally = 0, tally_result = 0;  // __syncthreads_count
  // Returns the OR of every arrival's `bits` (used by ballots); with `sum`,
  // leaves there the total of every arrival's `add`.
  uint32_t arrive_and_wait(int parties, uint32_t mine, int add = 0, int* sum = nullptr) {
    std::unique_lock<std::mutex> lock(mu);
    const uint64_t r = round;
    bits |= mine;
    tally += add;
    if (++arrived == parties) {
      result = bits;
      tally_result = tally;
      bits = 0;
      tally = 0;
      arrived = 0;
      ++round;
      cv.notify_all();
    } else {
      cv.wait(lock, [&] { return round != r; });
    }
    if (sum) *sum = tally_result;
    return result;
  }
};

struct Block {
  int threads = 0;
  Barrier sync;
  std::vector<Barrier> warps;
  std::vector<unsigned char> dynamic;
  Block(int n, size_t dynamic_bytes) : threads(n), warps((n + 31) / 32), dynamic(dynamic_bytes + 16) {}
};

inline thread_local Block* t_block = nullptr;

template <class T>
T* dynamic_shared() {
  return reinterpret_cast<T*>(t_block->dynamic.data());
}

}  // namespace symheap::ep::host_emulation::emu

namespace symheap::ep::host_emulation::kernels {

using int4 = emu::Int4;
inline thread_local emu::Dim3 threadIdx, blockIdx, blockDim, gridDim;

inline void __syncthreads() { emu::t_block->sync.arrive_and_wait(emu::t_block->threads, 0); }
inline int __syncthreads_count(int pred) {
  int sum = 0;
  emu::t_block->sync.arrive_and_wait(emu::t_block->threads, 0, pred ? 1 : 0, &sum);
  return sum;
}
inline unsigned __ballot_sync(unsigned, bool pred) {
  return emu::t_block->warps[threadIdx.x / 32].arrive_and_wait(32, pred ? 1u << (threadIdx.x % 32) : 0u);
}
inline void __syncwarp(unsigned mask = 0xffffffffu) { __ballot_sync(mask, false); }
inline int __popc(unsigned v) { return __builtin_popcount(v); }
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void __threadfence_system() { std::atomic_thread_fence(std::memory_order_seq_cst); }

inline int atomicAdd(int* a, int v) { return __atomic_fetch_add(a, v, __ATOMIC_SEQ_CST); }
inline unsigned long long atomicAdd(unsigned long long* a, unsigned long long v) {
  return __atomic_fetch_add(a, v, __ATOMIC_SEQ_CST);
}
template <class T>
inline T atomicCAS(T* a, T expected, T desired) {
  __atomic_compare_exchange_n(a, &expected, desired, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
  return expected;
}
inline int atomicMin(int* a, int v) {
  int old = __atomic_load_n(a, __ATOMIC_SEQ_CST);
  while (v < old &&
         !__atomic_compare_exchange_n(a, &old, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
  }
  return old;
}
inline unsigned atomicOr(unsigned* a, unsigned v) { return __atomic_fetch_or(a, v, __ATOMIC_SEQ_CST); }
inline unsigned atomicInc(unsigned* a, unsigned limit) {  // old >= limit ? 0 : old + 1
  unsigned old = __atomic_load_n(a, __ATOMIC_SEQ_CST);
  while (!__atomic_compare_exchange_n(a, &old, old >= limit ? 0u : old + 1u, false,
                                      __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
  }
  return old;
}
inline int atomicMax(int* a, int v) {
  int old = __atomic_load_n(a, __ATOMIC_SEQ_CST);
  while (v > old &&
         !__atomic_compare_exchange_n(a, &old, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
  }
  return old;
}
inline unsigned long long atomicMax(unsigned long long* a, unsigned long long v) {
  unsigned long long old = __atomic_load_n(a, __ATOMIC_SEQ_CST);
  while (v > old &&
         !__atomic_compare_exchange_n(a, &old, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
  }
  return old;
}
template <class T>
inline T __ldcg(const T* p) {
  T v;
  std::atomic_thread_fence(std::memory_order_acquire);
  std::memcpy(&v, const_cast<const T*>(p), sizeof(T));
  return v;
}
inline float __int_as_float(int v) {
  float f;
  std::memcpy(&f, &v, 4);
  return f;
}
inline int __float_as_int(float f) {
  int v;
  std::memcpy(&v, &f, 4);
  return v;
}

}  // namespace symheap::ep::host_emulation::kernels

// The device API's memory-model operations and peer addressing
// (symheap/device.cuh) that the kernels use, as host atomics.
namespace symheap::ep::host_emulation::dev {

template <class T>
struct same_type {
  typedef T type;
};

template <class T = char>
inline T* peer_heap_ptr(char* const* peer_bases, int pe, uint64_t offset) {
  return reinterpret_cast<T*>(peer_bases[pe] + offset);
}
template <class W>
inline W load_acquire(const W* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
template <class W>
inline W load_relaxed(const W* p) { return __atomic_load_n(p, __ATOMIC_RELAXED); }
template <class W>
inline void store_relaxed(W* p, typename same_type<W>::type v) { __atomic_store_n(p, v, __ATOMIC_RELAXED); }
template <class W>
inline void store_release(W* p, typename same_type<W>::type v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
template <class W>
inline void add_relaxed(W* p, typename same_type<W>::type v) { __atomic_fetch_add(p, v, __ATOMIC_RELAXED); }
template <class W>
inline void add_release(W* p, typename same_type<W>::type v) { __atomic_fetch_add(p, v, __ATOMIC_RELEASE); }
inline void fence_acq_rel() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline uint64_t global_timer_ns() {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                   std::chrono::steady_clock::now().time_since_epoch())
                                   .count());
}

}  // namespace symheap::ep::host_emulation::dev

#endif  // __CUDACC__
