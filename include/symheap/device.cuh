// symheap device API: one-sided communication from CUDA kernels.
//
// Every function takes the PE's DeviceContext by value (get it on the host
// with symheap::device_context(state) or, from Python, symheap.device_context()).
// Addresses are symmetric: pass the address of a buffer on *this* PE's heap
// and the function finds PE `pe`'s copy at the same offset.
//
// Scopes. `put`, `get`, ... are called by one thread; `*_warp` by all 32 lanes
// of a warp together; `*_block` by every thread of the block together. Warp
// and block variants split the bytes between their threads and issue any
// signal once, after all of the data.
//
// Memory model. Puts are plain stores over NVLink/PCIe (or local stores for
// the calling PE). `fence` orders them before later stores from the same
// thread to any PE; `quiet` makes them visible system-wide. A put_signal's
// signal becomes visible only after its data. signal_wait_until has acquire
// semantics: data put before the signal is visible once it returns.
//
// Waits never hang forever: after ctx.timeout_ns they record the failure in
// ctx.error_record (the host raises it as TimeoutError at the next quiet or
// barrier) and return.
//
// The header needs no standard headers, so it also compiles under NVRTC
// (CuPy RawModule, cuda.core): add the include/ folder to the include path.
#pragma once

#include "symheap/device_context.h"

namespace symheap {
namespace device {

typedef unsigned long long u64;

enum SignalOp { kSignalSet = 0, kSignalAdd = 1 };
enum Compare { kEq = 0, kNe = 1, kGt = 2, kGe = 3, kLt = 4, kLe = 5 };

// ------------------------------------------------------------ addressing

// PE `pe`'s heap base as seen from this device (null: no load/store path),
// for 0 <= pe < n_pes: from the context itself for the first PEs
// (DeviceContext::first_peer_bases), else from the peer table.
__device__ __forceinline__ char* peer_base(const DeviceContext& ctx, int pe) {
  return pe < kContextPeerBases ? ctx.first_peer_bases[pe] : ctx.peer_bases[pe];
}

// Load/store address of PE `pe`'s copy of symmetric `local`, or null when
// `pe` has no load/store path (remote).
template <class T>
__device__ __forceinline__ T* peer_ptr(const DeviceContext& ctx, const T* local, int pe) {
  char* base = peer_base(ctx, pe);
  if (base == nullptr) return nullptr;
  return reinterpret_cast<T*>(base + (reinterpret_cast<const char*>(local) - ctx.my_base));
}

// Byte `offset` of PE `pe`'s heap, from a peer table (DeviceContext::peer_bases).
// No reachability check: for kernels that checked every PE once (can_reach)
// and address by heap offset.
template <class T = char>
__device__ __forceinline__ T* peer_heap_ptr(char* const* peer_bases, int pe, u64 offset) {
  return reinterpret_cast<T*>(peer_bases[pe] + offset);
}

__device__ __forceinline__ bool can_reach(const DeviceContext& ctx, int pe) {
  return pe >= 0 && pe < ctx.n_pes && peer_base(ctx, pe) != nullptr;
}

namespace detail {
// Makes a parameter take its type from the others (no deduction from it).
template <class T>
struct same_type {
  typedef T type;
};
}  // namespace detail

// ------------------------------------------------------------ memory model
// Building blocks for kernels that run their own protocol on heap words (the
// functions below use them; so do symheap's op kernels). Words are 64-bit
// words of global memory (the heap or device memory); every operation is
// system scope: coherent with the other GPUs and the host.

// Acquire load: once it has seen a value stored by a release (or after a
// fence), this thread's later loads see what the writer stored before it.
template <class W>
__device__ __forceinline__ W load_acquire(const W* p) {
  static_assert(sizeof(W) == 8, "a 64-bit word");
  W v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
// Relaxed load (volatile): read from memory every time, ordered with nothing.
// For polls whose result is followed by a fence or an acquire load.
template <class W>
__device__ __forceinline__ W load_relaxed(const W* p) {
  static_assert(sizeof(W) == 8, "a 64-bit word");
  return *reinterpret_cast<const volatile W*>(p);
}
// Relaxed store: ordered after earlier stores only by a fence before it.
template <class W>
__device__ __forceinline__ void store_relaxed(W* p, typename detail::same_type<W>::type v) {
  static_assert(sizeof(W) == 8, "a 64-bit word");
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
// Release store: visible only after this thread's earlier loads and stores.
template <class W>
__device__ __forceinline__ void store_release(W* p, typename detail::same_type<W>::type v) {
  static_assert(sizeof(W) == 8, "a 64-bit word");
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
// Adds without returning the old value (a reduction: nothing to wait for).
template <class W>
__device__ __forceinline__ void add_relaxed(W* p, typename detail::same_type<W>::type v) {
  static_assert(sizeof(W) == 8, "a 64-bit word");
  asm volatile("red.relaxed.sys.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
// As add_relaxed, with release semantics (after this thread's earlier stores).
template <class W>
__device__ __forceinline__ void add_release(W* p, typename detail::same_type<W>::type v) {
  static_assert(sizeof(W) == 8, "a 64-bit word");
  asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
// Orders this thread's earlier loads and stores (and, after a
// __syncthreads/__syncwarp, its block's or warp's) before its later ones,
// for every PE: followed by a relaxed store or add, a release; preceded by a
// relaxed load, an acquire. Lighter than __threadfence_system(), which also
// keeps one order of every such fence (sequential consistency).
__device__ __forceinline__ void fence_acq_rel() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }
// The GPU's global nanosecond timer (the same on every SM of a device).
__device__ __forceinline__ u64 global_timer_ns() {
  u64 t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// ------------------------------------------------------------ internals

namespace detail {

__device__ __forceinline__ bool compare_holds(u64 lhs, int cmp, u64 rhs) {
  switch (cmp) {
    case kEq: return lhs == rhs;
    case kNe: return lhs != rhs;
    case kGt: return lhs > rhs;
    case kGe: return lhs >= rhs;
    case kLt: return lhs < rhs;
    default: return lhs <= rhs;
  }
}

// Records the first failure of this PE (later ones are dropped); the host
// turns the record into an exception at its next quiet or barrier.
inline __device__ __noinline__ void report(const DeviceContext& ctx, u64 code, u64 a, u64 b,
                                           u64 c) {
  u64* rec = ctx.error_record;
  if (atomicCAS(rec, 0ull, code) == 0ull) {
    rec[1] = a;
    rec[2] = b;
    rec[3] = c;
    __threadfence_system();
  }
}

// Copies n bytes with `nthreads` cooperating threads; `lane` in [0, nthreads).
// 16-byte vectors (four in flight per thread) while both pointers allow it,
// then 8-byte words, then single bytes for what is left.
__device__ __forceinline__ void copy_bytes(char* dst, const char* src, u64 n, unsigned lane,
                                           unsigned nthreads) {
  const u64 align = reinterpret_cast<u64>(dst) | reinterpret_cast<u64>(src);
  u64 done = 0;
  if ((align & 15) == 0) {
    const int4* s = reinterpret_cast<const int4*>(src);
    int4* d = reinterpret_cast<int4*>(dst);
    const u64 nv = n >> 4;
    u64 i = lane;
    for (; i + 3ull * nthreads < nv; i += 4ull * nthreads) {
      int4 a = s[i], b = s[i + nthreads], c = s[i + 2ull * nthreads], e = s[i + 3ull * nthreads];
      d[i] = a;
      d[i + nthreads] = b;
      d[i + 2ull * nthreads] = c;
      d[i + 3ull * nthreads] = e;
    }
    for (; i < nv; i += nthreads) d[i] = s[i];
    done = nv << 4;
  }
  if ((align & 7) == 0) {  // `done` is a multiple of 16: alignment is unchanged
    const u64* s = reinterpret_cast<const u64*>(src);
    u64* d = reinterpret_cast<u64*>(dst);
    const u64 nw = n >> 3;
    for (u64 i = (done >> 3) + lane; i < nw; i += nthreads) d[i] = s[i];
    done = nw << 3;
  }
  for (u64 j = done + lane; j < n; j += nthreads) dst[j] = src[j];
}

__device__ __forceinline__ unsigned lane_in_warp() {
  unsigned lane;
  asm volatile("mov.u32 %0, %%laneid;" : "=r"(lane));
  return lane;
}

__device__ __forceinline__ unsigned thread_in_block() {
  return threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
}

__device__ __forceinline__ unsigned block_threads() { return blockDim.x * blockDim.y * blockDim.z; }

// PE `pe`'s heap base, or null (recorded) when it has no load/store path.
__device__ __forceinline__ char* peer_base_or_report(const DeviceContext& ctx, int pe) {
  char* base = pe >= 0 && pe < ctx.n_pes ? peer_base(ctx, pe) : nullptr;
  if (base == nullptr) report(ctx, kDeviceNoPath, static_cast<u64>(pe), 0, 0);
  return base;
}

// PE `pe`'s copy of symmetric `local` from its heap base.
__device__ __forceinline__ char* at_peer(const DeviceContext& ctx, char* base, const void* local) {
  return base + (static_cast<const char*>(local) - ctx.my_base);
}

__device__ __forceinline__ char* peer_or_report(const DeviceContext& ctx, const void* local,
                                                int pe) {
  char* base = peer_base_or_report(ctx, pe);
  return base ? at_peer(ctx, base, local) : nullptr;
}

template <class W>
__device__ __forceinline__ u64* word_ptr(W* w) {
  static_assert(sizeof(W) == 8, "signal and atomic words are 64-bit");
  return reinterpret_cast<u64*>(w);
}

// A release at system scope: the signal becomes visible after every store
// this thread has seen (its own and, after a __syncthreads/__syncwarp, its
// block's or warp's; release is cumulative), with no separate fence.
__device__ __forceinline__ void signal_store(u64* remote, u64 value, int op) {
  if (op == kSignalAdd) add_release(remote, value);
  else store_release(remote, value);
}

}  // namespace detail

// ------------------------------------------------------------ ordering

// Orders this thread's earlier puts before its later ones, to every PE.
__device__ __forceinline__ void fence() { __threadfence_system(); }
// Completes this thread's earlier puts: visible to every PE and the host.
__device__ __forceinline__ void quiet() { __threadfence_system(); }

// ------------------------------------------------------------ put / get

// Thread scope.
__device__ __forceinline__ void put(const DeviceContext& ctx, void* dst, const void* src,
                                    u64 nbytes, int pe) {
  char* remote = detail::peer_or_report(ctx, dst, pe);
  if (remote) detail::copy_bytes(remote, static_cast<const char*>(src), nbytes, 0, 1);
}
// Stores are issued and the function returns; completion comes with quiet().
__device__ __forceinline__ void put_nbi(const DeviceContext& ctx, void* dst, const void* src,
                                        u64 nbytes, int pe) {
  put(ctx, dst, src, nbytes, pe);
}
__device__ __forceinline__ void get(const DeviceContext& ctx, void* dst, const void* src,
                                    u64 nbytes, int pe) {
  const char* remote = detail::peer_or_report(ctx, src, pe);
  if (remote) detail::copy_bytes(static_cast<char*>(dst), remote, nbytes, 0, 1);
}

// Warp scope: every lane of the warp calls with the same arguments.
__device__ __forceinline__ void put_warp(const DeviceContext& ctx, void* dst, const void* src,
                                         u64 nbytes, int pe) {
  char* remote = detail::peer_or_report(ctx, dst, pe);
  if (remote)
    detail::copy_bytes(remote, static_cast<const char*>(src), nbytes, detail::lane_in_warp(), 32);
  __syncwarp();
}
__device__ __forceinline__ void put_nbi_warp(const DeviceContext& ctx, void* dst, const void* src,
                                             u64 nbytes, int pe) {
  put_warp(ctx, dst, src, nbytes, pe);
}
__device__ __forceinline__ void get_warp(const DeviceContext& ctx, void* dst, const void* src,
                                         u64 nbytes, int pe) {
  const char* remote = detail::peer_or_report(ctx, src, pe);
  if (remote)
    detail::copy_bytes(static_cast<char*>(dst), remote, nbytes, detail::lane_in_warp(), 32);
  __syncwarp();
}

// Block scope: every thread of the block calls with the same arguments.
__device__ __forceinline__ void put_block(const DeviceContext& ctx, void* dst, const void* src,
                                          u64 nbytes, int pe) {
  char* remote = detail::peer_or_report(ctx, dst, pe);
  if (remote)
    detail::copy_bytes(remote, static_cast<const char*>(src), nbytes, detail::thread_in_block(),
                       detail::block_threads());
  __syncthreads();
}
__device__ __forceinline__ void put_nbi_block(const DeviceContext& ctx, void* dst,
                                              const void* src, u64 nbytes, int pe) {
  put_block(ctx, dst, src, nbytes, pe);
}
__device__ __forceinline__ void get_block(const DeviceContext& ctx, void* dst, const void* src,
                                          u64 nbytes, int pe) {
  const char* remote = detail::peer_or_report(ctx, src, pe);
  if (remote)
    detail::copy_bytes(static_cast<char*>(dst), remote, nbytes, detail::thread_in_block(),
                       detail::block_threads());
  __syncthreads();
}

// ------------------------------------------------------------ signals

// Sets or adds `value` to PE `pe`'s copy of the symmetric word `sig`, after
// every earlier store of this thread.
template <class W>
__device__ __forceinline__ void signal_op(const DeviceContext& ctx, W* sig, u64 value, int op,
                                          int pe) {
  u64* remote = reinterpret_cast<u64*>(detail::peer_or_report(ctx, detail::word_ptr(sig), pe));
  if (remote) detail::signal_store(remote, value, op);
}

template <class W>
__device__ __forceinline__ void put_signal(const DeviceContext& ctx, void* dst, const void* src,
                                           u64 nbytes, W* sig, u64 value, int op, int pe) {
  char* base = detail::peer_base_or_report(ctx, pe);  // one lookup for data and signal
  if (base == nullptr) return;
  detail::copy_bytes(detail::at_peer(ctx, base, dst), static_cast<const char*>(src), nbytes, 0, 1);
  detail::signal_store(reinterpret_cast<u64*>(detail::at_peer(ctx, base, detail::word_ptr(sig))),
                       value, op);
}
template <class W>
__device__ __forceinline__ void put_signal_warp(const DeviceContext& ctx, void* dst,
                                                const void* src, u64 nbytes, W* sig, u64 value,
                                                int op, int pe) {
  put_warp(ctx, dst, src, nbytes, pe);  // ends with __syncwarp
  if (detail::lane_in_warp() == 0) signal_op(ctx, sig, value, op, pe);
  __syncwarp();
}
template <class W>
__device__ __forceinline__ void put_signal_block(const DeviceContext& ctx, void* dst,
                                                 const void* src, u64 nbytes, W* sig, u64 value,
                                                 int op, int pe) {
  put_block(ctx, dst, src, nbytes, pe);  // ends with __syncthreads
  if (detail::thread_in_block() == 0) signal_op(ctx, sig, value, op, pe);
  __syncthreads();
}

// Waits until this PE's word `sig` satisfies `cmp` against `value`; returns
// the word. On timeout records the failure and returns the last value seen.
template <class W>
__device__ __forceinline__ u64 signal_wait_until(const DeviceContext& ctx, W* sig, int cmp,
                                                 u64 value) {
  const u64* w = detail::word_ptr(sig);
  u64 seen = load_acquire(w);
  if (detail::compare_holds(seen, cmp, value)) return seen;
  u64 start = global_timer_ns();
  for (unsigned i = 1;; ++i) {
    seen = load_acquire(w);
    if (detail::compare_holds(seen, cmp, value)) return seen;
    if ((i & 255) == 0 && global_timer_ns() - start > ctx.timeout_ns) {
      detail::report(ctx, kDeviceWaitTimeout,
                     static_cast<u64>(reinterpret_cast<const char*>(w) - ctx.my_base), seen,
                     value);
      return seen;
    }
  }
}
template <class W>
__device__ __forceinline__ u64 signal_wait_until_block(const DeviceContext& ctx, W* sig, int cmp,
                                                       u64 value) {
  __shared__ u64 seen;
  if (detail::thread_in_block() == 0) seen = signal_wait_until(ctx, sig, cmp, value);
  __syncthreads();
  return seen;
}

// ------------------------------------------------------------ atomics
// On a 64-bit word of PE `pe`'s heap, system scope (coherent with the host
// and every other GPU). Signed words wrap like two's complement.

template <class W>
__device__ __forceinline__ void atomic_add(const DeviceContext& ctx, W* dst,
                                           typename detail::same_type<W>::type value, int pe) {
  u64* remote = reinterpret_cast<u64*>(detail::peer_or_report(ctx, detail::word_ptr(dst), pe));
  if (remote) atomicAdd_system(remote, static_cast<u64>(value));
}
template <class W>
__device__ __forceinline__ W atomic_fetch_add(const DeviceContext& ctx, W* dst,
                                              typename detail::same_type<W>::type value, int pe) {
  u64* remote = reinterpret_cast<u64*>(detail::peer_or_report(ctx, detail::word_ptr(dst), pe));
  return remote ? static_cast<W>(atomicAdd_system(remote, static_cast<u64>(value))) : W(0);
}
template <class W>
__device__ __forceinline__ W atomic_compare_swap(const DeviceContext& ctx, W* dst,
                                                 typename detail::same_type<W>::type cond,
                                                 typename detail::same_type<W>::type value,
                                                 int pe) {
  u64* remote = reinterpret_cast<u64*>(detail::peer_or_report(ctx, detail::word_ptr(dst), pe));
  return remote ? static_cast<W>(atomicCAS_system(remote, static_cast<u64>(cond),
                                                  static_cast<u64>(value)))
                : W(0);
}
template <class W>
__device__ __forceinline__ W atomic_swap(const DeviceContext& ctx, W* dst,
                                         typename detail::same_type<W>::type value, int pe) {
  u64* remote = reinterpret_cast<u64*>(detail::peer_or_report(ctx, detail::word_ptr(dst), pe));
  return remote ? static_cast<W>(atomicExch_system(remote, static_cast<u64>(value))) : W(0);
}

// ------------------------------------------------------------ barrier

// Barrier over all PEs, also completing this thread's earlier puts. Exactly
// one caller per PE: one thread, one warp or one block. Each PE counts its
// own arrivals in slot my_pe of every PE's counters, so no reset is needed
// and host barriers (separate counters) may be mixed in between.
inline __device__ __noinline__ void barrier_all(const DeviceContext& ctx) {
  __threadfence_system();
  const u64 offset =
      static_cast<u64>(reinterpret_cast<const char*>(ctx.device_barrier) - ctx.my_base) +
      static_cast<u64>(ctx.my_pe) * sizeof(u64);
  u64 epoch = 0;
  for (int p = 0; p < ctx.n_pes; ++p) {
    char* base = peer_base(ctx, p);
    if (base == nullptr) {
      detail::report(ctx, kDeviceNoPath, static_cast<u64>(p), 0, 0);
      return;
    }
    u64 old = atomicAdd_system(reinterpret_cast<u64*>(base + offset), 1ull);
    if (p == ctx.my_pe) epoch = old + 1;
  }
  u64 start = global_timer_ns();
  for (int q = 0; q < ctx.n_pes; ++q) {
    for (unsigned i = 1;; ++i) {
      u64 seen = load_acquire(ctx.device_barrier + q);
      if (seen >= epoch) break;
      if ((i & 255) == 0 && global_timer_ns() - start > ctx.timeout_ns) {
        detail::report(ctx, kDeviceBarrierTimeout, static_cast<u64>(q), seen, epoch);
        return;
      }
    }
  }
  __threadfence_system();
}
__device__ __forceinline__ void barrier_all_warp(const DeviceContext& ctx) {
  __syncwarp();
  if (detail::lane_in_warp() == 0) barrier_all(ctx);
  __syncwarp();
}
__device__ __forceinline__ void barrier_all_block(const DeviceContext& ctx) {
  __syncthreads();
  if (detail::thread_in_block() == 0) barrier_all(ctx);
  __syncthreads();
}

}  // namespace device
}  // namespace symheap
