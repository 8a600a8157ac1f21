// Kernels that drive the device API (include/symheap/device.cuh) for the GPU
// tests and the bandwidth/latency benchmark, plus the benchmark's reference
// transfers (a plain SM copy kernel and cudaMemcpyPeerAsync). This module has
// its own copy of the core library, whose runtime state it never uses: every
// call gets the PE's DeviceContext (by value) and its device explicitly.
#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "backends/cuda_api.hpp"
#include "backends/cuda_util.cuh"
#include "devtest/devtest.hpp"
#include "symheap/device.cuh"
#include "symheap/errors.hpp"

namespace symheap::devtest {
namespace {

using cuda::check_stream;
using cuda::ScopedDevice;

namespace dev = symheap::device;
using u64 = unsigned long long;

constexpr int kThreadScopeBlock = 128;
constexpr int kWarpScopeBlock = 128;  // 4 warps
constexpr int kBlockScopeBlock = 512;

struct Slice {
  u64 begin, len;
};

__device__ __forceinline__ Slice slice_of(u64 unit, u64 nbytes, u64 chunk) {
  u64 begin = unit * chunk;
  if (begin >= nbytes) return {nbytes, 0};
  return {begin, nbytes - begin < chunk ? nbytes - begin : chunk};
}

__global__ void put_kernel(DeviceContext ctx, char* dst, const char* src, u64 nbytes, int pe,
                           int scope, u64 units, u64 chunk, u64* signal, int nbi) {
  if (scope == kThread) {
    u64 unit = blockIdx.x * static_cast<u64>(blockDim.x) + threadIdx.x;
    if (unit >= units) return;
    Slice sl = slice_of(unit, nbytes, chunk);
    if (signal) {
      dev::put_signal(ctx, dst + sl.begin, src + sl.begin, sl.len, signal, 1, dev::kSignalAdd, pe);
    } else if (nbi) {
      dev::put_nbi(ctx, dst + sl.begin, src + sl.begin, sl.len, pe);
      dev::quiet();
    } else {
      dev::put(ctx, dst + sl.begin, src + sl.begin, sl.len, pe);
    }
  } else if (scope == kWarp) {
    u64 unit = (blockIdx.x * static_cast<u64>(blockDim.x) + threadIdx.x) / 32;
    if (unit >= units) return;  // uniform across the warp
    Slice sl = slice_of(unit, nbytes, chunk);
    if (signal) {
      dev::put_signal_warp(ctx, dst + sl.begin, src + sl.begin, sl.len, signal, 1,
                           dev::kSignalAdd, pe);
    } else if (nbi) {
      dev::put_nbi_warp(ctx, dst + sl.begin, src + sl.begin, sl.len, pe);
      dev::quiet();
    } else {
      dev::put_warp(ctx, dst + sl.begin, src + sl.begin, sl.len, pe);
    }
  } else {
    Slice sl = slice_of(blockIdx.x, nbytes, chunk);
    if (signal) {
      dev::put_signal_block(ctx, dst + sl.begin, src + sl.begin, sl.len, signal, 1,
                            dev::kSignalAdd, pe);
    } else if (nbi) {
      dev::put_nbi_block(ctx, dst + sl.begin, src + sl.begin, sl.len, pe);
      dev::quiet();
    } else {
      dev::put_block(ctx, dst + sl.begin, src + sl.begin, sl.len, pe);
    }
  }
}

__global__ void get_kernel(DeviceContext ctx, char* dst, const char* src, u64 nbytes, int pe,
                           int scope, u64 units, u64 chunk) {
  if (scope == kThread) {
    u64 unit = blockIdx.x * static_cast<u64>(blockDim.x) + threadIdx.x;
    if (unit >= units) return;
    Slice sl = slice_of(unit, nbytes, chunk);
    dev::get(ctx, dst + sl.begin, src + sl.begin, sl.len, pe);
  } else if (scope == kWarp) {
    u64 unit = (blockIdx.x * static_cast<u64>(blockDim.x) + threadIdx.x) / 32;
    if (unit >= units) return;
    Slice sl = slice_of(unit, nbytes, chunk);
    dev::get_warp(ctx, dst + sl.begin, src + sl.begin, sl.len, pe);
  } else {
    Slice sl = slice_of(blockIdx.x, nbytes, chunk);
    dev::get_block(ctx, dst + sl.begin, src + sl.begin, sl.len, pe);
  }
}

__global__ void atomics_kernel(DeviceContext ctx, long long* counter, long long* cas_word,
                               long long* swap_word, long long cond, long long value, int pe,
                               int threads, long long* out) {
  int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= threads) return;
  out[t] = dev::atomic_fetch_add(ctx, counter, 1ll, pe);
  if (t == 0) {
    dev::atomic_add(ctx, counter, 1000ll, pe);
    out[threads] = dev::atomic_compare_swap(ctx, cas_word, cond, value, pe);
    out[threads + 1] = dev::atomic_swap(ctx, swap_word, value, pe);
  }
}

__global__ void wait_kernel(DeviceContext ctx, u64* signal, int cmp, u64 value, u64* out) {
  *out = dev::signal_wait_until(ctx, signal, cmp, value);
}

__global__ void barrier_kernel(DeviceContext ctx, u64* slots, int rounds, int scope, u64* bad) {
  bool leader = threadIdx.x == 0;
  for (int r = 0; r < rounds; ++r) {
    if (leader)
      for (int p = 0; p < ctx.n_pes; ++p)
        dev::signal_op(ctx, slots + ctx.my_pe, static_cast<u64>(r + 1), dev::kSignalSet, p);
    if (scope == kThread) {
      if (leader) dev::barrier_all(ctx);
    } else if (scope == kWarp) {
      dev::barrier_all_warp(ctx);
    } else {
      dev::barrier_all_block(ctx);
    }
    if (leader)
      for (int q = 0; q < ctx.n_pes; ++q)
        if (dev::load_acquire(slots + q) != static_cast<u64>(r + 1)) atomicAdd(bad, 1ull);
    // A second barrier: nobody overwrites a slot before everyone checked it.
    if (scope == kThread) {
      if (leader) dev::barrier_all(ctx);
    } else if (scope == kWarp) {
      dev::barrier_all_warp(ctx);
    } else {
      dev::barrier_all_block(ctx);
    }
  }
}

// Variant 0 is the library's put_signal and signal_wait_until, the figure
// reported. The others take the library out piece by piece, to show where a
// round trip's time goes: the peer pointers are computed once before the loop
// and the payload is the loop counter (no table or source load).
//   1  payload store, release store of the signal, acquire poll
//   2  as 1 with an explicit fence.acq_rel and a relaxed signal store
//   3  as 1, polling with relaxed loads and one fence after the wait
//   4  release store of the signal only (no payload)
//   5  relaxed store of the signal only: no ordering at all (lower bound)
__device__ __forceinline__ void ping_pong_send(int variant, u64* rdata, u64* rsig, u64 i) {
  if (variant <= 3) dev::store_relaxed(rdata, i);
  if (variant == 2) {
    dev::fence_acq_rel();
    dev::store_relaxed(rsig, i);
  } else if (variant == 5) {
    dev::store_relaxed(rsig, i);
  } else {
    dev::store_release(rsig, i);
  }
}

__device__ __forceinline__ void ping_pong_wait(int variant, const u64* sig, u64 i) {
  if (variant == 3) {
    while (dev::load_relaxed(sig) < i) {
    }
    dev::fence_acq_rel();
  } else {
    while (dev::load_acquire(sig) < i) {
    }
  }
}

__global__ void ping_pong_kernel(DeviceContext ctx, u64* data, u64* signal, int peer,
                                 int initiator, int iters, int variant) {
  if (variant == 0) {
    for (int i = 1; i <= iters; ++i) {
      if (initiator) {
        *data = static_cast<u64>(i);
        dev::put_signal(ctx, data, data, 8, signal, static_cast<u64>(i), dev::kSignalSet, peer);
        dev::signal_wait_until(ctx, signal, dev::kGe, static_cast<u64>(i));
      } else {
        dev::signal_wait_until(ctx, signal, dev::kGe, static_cast<u64>(i));
        dev::put_signal(ctx, data, data, 8, signal, static_cast<u64>(i), dev::kSignalSet, peer);
      }
    }
    return;
  }
  // Diagnostic variants: no timeout, so the caller runs them only after
  // variant 0 completed (both PEs are known to be running).
  char* base = dev::peer_base(ctx, peer);
  u64* rdata = reinterpret_cast<u64*>(base + (reinterpret_cast<char*>(data) - ctx.my_base));
  u64* rsig = reinterpret_cast<u64*>(base + (reinterpret_cast<char*>(signal) - ctx.my_base));
  for (int i = 1; i <= iters; ++i) {
    if (initiator) {
      ping_pong_send(variant, rdata, rsig, static_cast<u64>(i));
      ping_pong_wait(variant, signal, static_cast<u64>(i));
    } else {
      ping_pong_wait(variant, signal, static_cast<u64>(i));
      ping_pong_send(variant, rdata, rsig, static_cast<u64>(i));
    }
  }
}

// The reference an SM put is measured against: the simplest 16-byte
// grid-stride copy, no slicing, no unrolling.
__global__ void plain_copy(int4* dst, const int4* src, u64 n_vec) {
  for (u64 i = blockIdx.x * static_cast<u64>(blockDim.x) + threadIdx.x; i < n_vec;
       i += static_cast<u64>(gridDim.x) * blockDim.x)
    dst[i] = src[i];
}

__global__ void fill_kernel(uint32_t* dst, u64 n, uint32_t seed) {
  for (u64 i = blockIdx.x * static_cast<u64>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<u64>(gridDim.x) * blockDim.x) {
    uint32_t x = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    x ^= x >> 15;
    x *= 2246822519u;
    x ^= x >> 13;
    dst[i] = x;
  }
}

cudaStream_t as_stream(StreamHandle h) { return reinterpret_cast<cudaStream_t>(h); }

struct Grid {
  unsigned blocks, threads;
  u64 chunk;
};

Grid grid_for(int scope, int units, size_t nbytes) {
  if (units < 1) throw InvalidArgument("units must be >= 1");
  if (scope < kThread || scope > kBlock) throw InvalidArgument("scope must be 0, 1 or 2");
  u64 chunk = ((nbytes + units - 1) / units + 15) / 16 * 16;
  if (chunk == 0) chunk = 16;
  Grid g{0, 0, chunk};
  if (scope == kThread) {
    g.threads = kThreadScopeBlock;
    g.blocks = (units + kThreadScopeBlock - 1) / kThreadScopeBlock;
  } else if (scope == kWarp) {
    g.threads = kWarpScopeBlock;
    g.blocks = (units * 32 + kWarpScopeBlock - 1) / kWarpScopeBlock;
  } else {
    g.threads = kBlockScopeBlock;
    g.blocks = units;
  }
  return g;
}

// [p, p + n) lies in this PE's heap (ctx.my_base, ctx.heap_size).
void check_symmetric(const DeviceContext& ctx, const void* p, size_t n, const char* what) {
  const char* c = static_cast<const char*>(p);
  if (c < ctx.my_base || n > ctx.heap_size ||
      static_cast<size_t>(c - ctx.my_base) > ctx.heap_size - n)
    throw InvalidArgument(std::string(what) + " must lie in this PE's symmetric heap");
}

void check_pe(const DeviceContext& ctx, int pe) {
  if (pe < 0 || pe >= ctx.n_pes)
    throw InvalidArgument("pe must be in [0, " + std::to_string(ctx.n_pes) + "), got " +
                          std::to_string(pe));
}

}  // namespace

void put(const DeviceContext& ctx, int device, void* dst, const void* src, size_t nbytes, int pe, int scope, int units,
         uint64_t* signal, bool nbi, StreamHandle stream) {
  check_symmetric(ctx, dst, nbytes, "device put destination");
  if (signal) check_symmetric(ctx, signal, 8, "device put signal");
  check_pe(ctx, pe);
  check_stream(device, stream);
  Grid g = grid_for(scope, units, nbytes);
  ScopedDevice on(device);
  put_kernel<<<g.blocks, g.threads, 0, as_stream(stream)>>>(
      ctx, static_cast<char*>(dst), static_cast<const char*>(src), nbytes, pe,
      scope, static_cast<u64>(units), g.chunk, reinterpret_cast<u64*>(signal), nbi ? 1 : 0);
  SYMHEAP_CUDA_CHECK_LAUNCH("put_kernel");
}

void get(const DeviceContext& ctx, int device, void* dst, const void* src, size_t nbytes, int pe, int scope, int units,
         StreamHandle stream) {
  check_symmetric(ctx, src, nbytes, "device get source");
  check_pe(ctx, pe);
  check_stream(device, stream);
  Grid g = grid_for(scope, units, nbytes);
  ScopedDevice on(device);
  get_kernel<<<g.blocks, g.threads, 0, as_stream(stream)>>>(
      ctx, static_cast<char*>(dst), static_cast<const char*>(src), nbytes, pe,
      scope, static_cast<u64>(units), g.chunk);
  SYMHEAP_CUDA_CHECK_LAUNCH("get_kernel");
}

void atomics(const DeviceContext& ctx, int device, int64_t* counter, int64_t* cas_word, int64_t* swap_word, int64_t cond,
             int64_t value, int pe, int threads, int64_t* out, StreamHandle stream) {
  for (const void* w : {static_cast<const void*>(counter), static_cast<const void*>(cas_word),
                        static_cast<const void*>(swap_word)})
    check_symmetric(ctx, w, 8, "device atomic word");
  check_pe(ctx, pe);
  if (threads < 1) throw InvalidArgument("threads must be >= 1");
  check_stream(device, stream);
  ScopedDevice on(device);
  atomics_kernel<<<(threads + 127) / 128, 128, 0, as_stream(stream)>>>(
      ctx, reinterpret_cast<long long*>(counter),
      reinterpret_cast<long long*>(cas_word), reinterpret_cast<long long*>(swap_word), cond,
      value, pe, threads, reinterpret_cast<long long*>(out));
  SYMHEAP_CUDA_CHECK_LAUNCH("atomics_kernel");
}

void wait_until(const DeviceContext& ctx, int device, uint64_t* signal, int cmp, uint64_t value, uint64_t* out,
                StreamHandle stream) {
  check_symmetric(ctx, signal, 8, "device wait signal");
  if (cmp < 0 || cmp > 5) throw InvalidArgument("cmp must be in [0, 5]");
  check_stream(device, stream);
  ScopedDevice on(device);
  wait_kernel<<<1, 1, 0, as_stream(stream)>>>(ctx, reinterpret_cast<u64*>(signal),
                                              cmp, value, reinterpret_cast<u64*>(out));
  SYMHEAP_CUDA_CHECK_LAUNCH("wait_kernel");
}

void barrier_rounds(const DeviceContext& ctx, int device, uint64_t* slots, int rounds, int scope, uint64_t* bad,
                    StreamHandle stream) {
  check_symmetric(ctx, slots, 8 * static_cast<size_t>(ctx.n_pes), "device barrier slots");
  if (scope < kThread || scope > kBlock) throw InvalidArgument("scope must be 0, 1 or 2");
  check_stream(device, stream);
  ScopedDevice on(device);
  unsigned threads = scope == kThread ? 1 : scope == kWarp ? 32 : 256;
  barrier_kernel<<<1, threads, 0, as_stream(stream)>>>(
      ctx, reinterpret_cast<u64*>(slots), rounds, scope,
      reinterpret_cast<u64*>(bad));
  SYMHEAP_CUDA_CHECK_LAUNCH("barrier_kernel");
}

void ping_pong(const DeviceContext& ctx, int device, uint64_t* data, uint64_t* signal, int peer,
               bool initiator, int iters, int variant, StreamHandle stream) {
  if (variant < 0 || variant > kPingPongVariants - 1)
    throw InvalidArgument("ping-pong variant must be in [0, " +
                          std::to_string(kPingPongVariants - 1) + "]");
  check_symmetric(ctx, data, 8, "ping-pong data");
  check_symmetric(ctx, signal, 8, "ping-pong signal");
  check_pe(ctx, peer);
  check_stream(device, stream);
  ScopedDevice on(device);
  ping_pong_kernel<<<1, 1, 0, as_stream(stream)>>>(ctx,
                                                   reinterpret_cast<u64*>(data),
                                                   reinterpret_cast<u64*>(signal), peer,
                                                   initiator ? 1 : 0, iters, variant);
  SYMHEAP_CUDA_CHECK_LAUNCH("ping_pong_kernel");
}

void plain_copy_kernel(void* dst, const void* src, size_t nbytes, int blocks, int device,
                       StreamHandle stream) {
  if ((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) | nbytes) & 15)
    throw InvalidArgument("the reference copy kernel needs 16-byte aligned pointers and sizes");
  check_stream(device, stream);
  ScopedDevice on(device);
  plain_copy<<<std::max(blocks, 1), 512, 0, as_stream(stream)>>>(
      static_cast<int4*>(dst), static_cast<const int4*>(src), nbytes / 16);
  SYMHEAP_CUDA_CHECK_LAUNCH("plain_copy");
}

void memcpy_peer(void* dst, int dst_device, const void* src, int src_device, size_t nbytes,
                 StreamHandle stream) {
  check_stream(src_device, stream);
  ScopedDevice on(src_device);
  SYMHEAP_CUDA_CHECK(
      cudaMemcpyPeerAsync(dst, dst_device, src, src_device, nbytes, as_stream(stream)));
}

void fill_pattern(uint32_t* dst, size_t n, uint32_t seed, int device, StreamHandle stream) {
  check_stream(device, stream);
  ScopedDevice on(device);
  unsigned blocks = static_cast<unsigned>(std::max<size_t>(1, std::min<size_t>(1024, (n + 255) / 256)));
  fill_kernel<<<blocks, 256, 0, as_stream(stream)>>>(dst, n, seed);
  SYMHEAP_CUDA_CHECK_LAUNCH("fill_kernel");
}

}  // namespace symheap::devtest
