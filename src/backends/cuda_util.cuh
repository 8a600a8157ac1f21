// Error checking and small helpers shared by the CUDA sources. Every CUDA
// call goes through SYMHEAP_CUDA_CHECK, which turns a failure into a C++
// exception of errors.hpp (the bindings make it a Python exception).
#pragma once
#include <cuda.h>
#include <cuda_runtime.h>

#include <string>

#include "symheap/errors.hpp"

namespace symheap::cuda {

[[noreturn]] void throw_cuda_error(cudaError_t err, const char* call, const char* file, int line);

inline void check(cudaError_t err, const char* call, const char* file, int line) {
  if (err != cudaSuccess) throw_cuda_error(err, call, file, line);
}

// A driver API function (version 12.0 of its signature) through the
// runtime's entry point, so that the library needs no link-time libcuda;
// null where the driver lacks it. Callers keep it in a function-local static.
void* driver_entry_point(const char* name);

// Checks the launch of the kernel just enqueued (bad configuration, no
// kernel image for this GPU, sticky errors from earlier kernels).
inline void check_launch(const char* kernel, const char* file, int line) {
  check(cudaGetLastError(), kernel, file, line);
}

// Sets the calling thread's device for a scope and restores the previous
// one; cheap when the device is already current.
class ScopedDevice {
 public:
  explicit ScopedDevice(int device);
  ~ScopedDevice();
  ScopedDevice(const ScopedDevice&) = delete;
  ScopedDevice& operator=(const ScopedDevice&) = delete;

 private:
  int previous_ = -1;
};

}  // namespace symheap::cuda

#define SYMHEAP_CUDA_CHECK(call) ::symheap::cuda::check((call), #call, __FILE__, __LINE__)
#define SYMHEAP_CUDA_CHECK_LAUNCH(name) ::symheap::cuda::check_launch(name, __FILE__, __LINE__)
