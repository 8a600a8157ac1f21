// CUDA-only entry points beyond the Backend interface, in plain C++ (no CUDA
// types) so that the pybind11 bindings compile with the host compiler.
// Defined in src/backends/cuda_*.cu and src/transports/*.cu; only built when
// SYMHEAP_WITH_CUDA is set.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "symheap/runtime.hpp"

namespace symheap::cuda {

// True when the process-wide backend is the cuda one.
bool backend_active();

// Throws InvalidArgument unless `stream` (0 = legacy default) belongs to `device`.
void check_stream(int device, StreamHandle stream);

// put with SM stores: a copy kernel on `stream` writes into the peer's heap.
// `blocks` <= 0 picks a grid from the device's cached occupancy.
void put_load_store(PeState& s, void* dst, const void* src, size_t nbytes, int pe,
                    StreamHandle stream, int blocks);

// put through the copy-engine channel (my device -> the peer's device),
// ordered after `stream`; then, when `signal` is not null, sets/adds
// `value` on the peer's signal word from the same channel (no SM used for
// set). Completion: quiet() on this PE, or the signal on the receiver.
void put_copy_engine(PeState& s, void* dst, const void* src, size_t nbytes, int pe,
                     StreamHandle stream, uint64_t* signal, uint64_t value, SignalOp op);

// A batch of copy-engine transfers whose addresses the caller computed (an
// op's rows into its peers' workspaces), on the same channels as
// put_copy_engine: begin orders the channels to `pes` after `stream`'s work
// so far; copy and signal queue on the channel to `pe` (`remote_*`: the
// peer's memory as this device addresses it); end makes `stream` wait for
// those channels.
void copy_engine_begin(PeState& s, const std::vector<int>& pes, StreamHandle stream);
void copy_engine_copy(PeState& s, int pe, void* remote_dst, const void* src, size_t nbytes);
void copy_engine_signal(PeState& s, int pe, uint64_t* remote_word, uint64_t value, SignalOp op);
void copy_engine_end(PeState& s, const std::vector<int>& pes, StreamHandle stream);

// Waits for every copy-engine channel that starts on `device`.
void sync_channels(int device);
// Number of channels created so far from `device` (for tests).
size_t channel_count(int device);

// The first failure a kernel recorded on this PE (device.cuh) and clears it.
struct DeviceError {
  int code = 0;  // DeviceErrorCode; 0 when none
  std::string message;
};
DeviceError take_device_error(PeState& s);

// Why cuStreamWriteValue64 is not used on `device` ("" when it is).
std::string stream_memops_status(int device);

// ---- kernels for tests and benchmarks (cuda_devtest.cu) -------------------
namespace devtest {
enum Scope { kThread = 0, kWarp = 1, kBlock = 2 };
// Each of `units` (threads, warps or blocks per `scope`) moves one slice of
// [0, nbytes) with put/get (optionally put_signal adding 1 to `signal` per
// slice) through the device API, on `stream`.
void put(PeState& s, void* dst, const void* src, size_t nbytes, int pe, int scope, int units,
         uint64_t* signal, bool nbi, StreamHandle stream);
void get(PeState& s, void* dst, const void* src, size_t nbytes, int pe, int scope, int units,
         StreamHandle stream);
// `threads` threads each do fetch_add(+1) on `counter` of PE pe, then thread 0
// does compare_swap(cas_word, cond, value) and swap(swap_word, value); the old
// values go to `out` (device memory, threads + 2 int64 words).
void atomics(PeState& s, int64_t* counter, int64_t* cas_word, int64_t* swap_word, int64_t cond,
             int64_t value, int pe, int threads, int64_t* out, StreamHandle stream);
// A kernel waits until the local word satisfies cmp/value and stores what it
// saw in `out` (device memory).
void wait_until(PeState& s, uint64_t* signal, int cmp, uint64_t value, uint64_t* out,
                StreamHandle stream);
// `rounds` device barriers at `scope`; before each, writes round+1 into slot
// my_pe of `slots` on every PE; after it checks that every slot on this PE
// holds round+1 and counts mismatches into `bad` (device memory, 1 word).
void barrier_rounds(PeState& s, uint64_t* slots, int rounds, int scope, uint64_t* bad,
                    StreamHandle stream);
// Ping-pong of 8-byte put_signal between this PE and `peer`: the initiator
// sends, the other echoes; `iters` round trips.
void ping_pong(PeState& s, uint64_t* data, uint64_t* signal, int peer, bool initiator, int iters,
               StreamHandle stream);
// References for the bandwidth benchmark.
void plain_copy_kernel(void* dst, const void* src, size_t nbytes, int blocks, int device,
                       StreamHandle stream);
void memcpy_peer(void* dst, int dst_device, const void* src, int src_device, size_t nbytes,
                 StreamHandle stream);
// Fills `n` uint32 words with hash(seed, index) using the kernel cache of
// the current device (used by the concurrent-launch test).
void fill_pattern(uint32_t* dst, size_t n, uint32_t seed, StreamHandle stream);
// Kernel-cache bookkeeping: how many distinct entries were made on `device`.
int kernel_cache_entries(int device);
}  // namespace devtest

}  // namespace symheap::cuda
