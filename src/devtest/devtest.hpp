// Kernels for the GPU tests and the bandwidth/latency benchmark, in the
// separate module symheap._devtest (built with SYMHEAP_BUILD_TESTS). Plain
// C++ (no CUDA types), so the bindings compile with the host compiler. Every
// call takes the calling PE's DeviceContext and device explicitly (this
// module's copy of the core has no runtime state of its own); symmetric
// addresses are checked against ctx's heap.
#pragma once
#include <cstddef>
#include <cstdint>

#include "symheap/device_context.h"
#include "symheap/runtime.hpp"

namespace symheap::devtest {

enum Scope { kThread = 0, kWarp = 1, kBlock = 2 };

// Each of `units` (threads, warps or blocks per `scope`) moves one slice of
// [0, nbytes) with put/get (optionally put_signal adding 1 to `signal` per
// slice) through the device API, on `stream`.
void put(const DeviceContext& ctx, int device, void* dst, const void* src, size_t nbytes, int pe,
         int scope, int units, uint64_t* signal, bool nbi, StreamHandle stream);
void get(const DeviceContext& ctx, int device, void* dst, const void* src, size_t nbytes, int pe,
         int scope, int units, StreamHandle stream);
// `threads` threads each do fetch_add(+1) on `counter` of PE pe, then thread 0
// does compare_swap(cas_word, cond, value) and swap(swap_word, value); the old
// values go to `out` (device memory, threads + 2 int64 words).
void atomics(const DeviceContext& ctx, int device, int64_t* counter, int64_t* cas_word,
             int64_t* swap_word, int64_t cond, int64_t value, int pe, int threads, int64_t* out,
             StreamHandle stream);
// A kernel waits until the local word satisfies cmp/value and stores what it
// saw in `out` (device memory).
void wait_until(const DeviceContext& ctx, int device, uint64_t* signal, int cmp, uint64_t value,
                uint64_t* out, StreamHandle stream);
// `rounds` device barriers at `scope`; before each, writes round+1 into slot
// my_pe of `slots` on every PE; after it checks that every slot on this PE
// holds round+1 and counts mismatches into `bad` (device memory, 1 word).
void barrier_rounds(const DeviceContext& ctx, int device, uint64_t* slots, int rounds, int scope,
                    uint64_t* bad, StreamHandle stream);
// Ping-pong of 8-byte put_signal between this PE and `peer`: the initiator
// sends, the other echoes; `iters` round trips. Variant 0 runs the library's
// calls; 1 .. kPingPongVariants - 1 are diagnostic (devtest_kernels.cu).
constexpr int kPingPongVariants = 6;
void ping_pong(const DeviceContext& ctx, int device, uint64_t* data, uint64_t* signal, int peer,
               bool initiator, int iters, int variant, StreamHandle stream);
// References for the bandwidth benchmark.
void plain_copy_kernel(void* dst, const void* src, size_t nbytes, int blocks, int device,
                       StreamHandle stream);
void memcpy_peer(void* dst, int dst_device, const void* src, int src_device, size_t nbytes,
                 StreamHandle stream);
// Fills `n` uint32 words with hash(seed, index) (fill_pattern_host in
// tests/gpu/gpu_programs.py is its numpy twin).
void fill_pattern(uint32_t* dst, size_t n, uint32_t seed, int device, StreamHandle stream);

}  // namespace symheap::devtest
