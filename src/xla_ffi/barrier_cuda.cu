// The device side of symheap.jax.barrier on CUDA: one thread runs the
// device-wide barrier_all of device.cuh on XLA's stream (no host wait). A
// timeout is recorded in the PE's device error record and raised by the next
// host-side quiet or barrier of that PE.
#include <cuda_runtime.h>

#include "symheap/device.cuh"
#include "symheap/errors.hpp"
#include "symheap/runtime.hpp"

namespace symheap::xla_ffi {

namespace {
__global__ void device_barrier_kernel(DeviceContext ctx) { device::barrier_all(ctx); }
}  // namespace

void launch_device_barrier(const PeState& s, void* stream) {
  device_barrier_kernel<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(device_context(s));
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess)
    throw StateError(std::string("symheap.jax.barrier: kernel launch failed on device ") +
                     std::to_string(s.device) + ": " + cudaGetErrorString(err));
}

}  // namespace symheap::xla_ffi
