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

// put with SM stores: a copy kernel on `stream` writes `nbytes` from `src`
// to `remote_dst` (the peer's memory as this device addresses it).
// `blocks` <= 0 picks a grid from the device's cached occupancy.
void put_load_store(PeState& s, char* remote_dst, const void* src, size_t nbytes,
                    StreamHandle stream, int blocks);

// put through the copy-engine channel (my device -> `pe`'s device), ordered
// after `stream`; then, when `remote_signal` is not null, sets/adds `value`
// on it from the same channel (no SM used for set). Completion: quiet() on
// this PE, or the signal on the receiver.
void put_copy_engine(PeState& s, int pe, char* remote_dst, const void* src, size_t nbytes,
                     StreamHandle stream, uint64_t* remote_signal, uint64_t value, SignalOp op);

// Waits for every kernel and copy on `device`, whatever stream (finalize:
// nothing may still touch a peer's memory when its mapping closes).
void synchronize_device(int device);

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

// Kernel-cache bookkeeping: how many distinct entries were made on `device`.
int kernel_cache_entries(int device);

}  // namespace symheap::cuda
