// Host-issued puts with SM stores (via="load_store"): a copy kernel on the
// caller's stream writes straight into the peer's heap, one contiguous
// slice per block, with the device API's block-scope copy.
#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "backends/cuda_api.hpp"
#include "backends/cuda_kernel_cache.cuh"
#include "backends/cuda_util.cuh"
#include "symheap/device.cuh"
#include "symheap/errors.hpp"
#include "symheap/runtime.hpp"

namespace symheap::cuda {
namespace {

constexpr int kPutThreads = 512;
constexpr size_t kMinBytesPerBlock = 64 << 10;  // below this, fewer blocks win

__global__ void __launch_bounds__(kPutThreads)
    sm_put_kernel(char* dst, const char* src, unsigned long long nbytes,
                  unsigned long long chunk) {
  unsigned long long begin = static_cast<unsigned long long>(blockIdx.x) * chunk;
  if (begin >= nbytes) return;
  unsigned long long len = nbytes - begin < chunk ? nbytes - begin : chunk;
  device::detail::copy_bytes(dst + begin, src + begin, len, threadIdx.x, blockDim.x);
}

// Kernels can read device memory (ours or a peer's) and mapped pinned host
// memory; pageable host memory would fault the whole context, so refuse it.
const void* kernel_readable(const void* src, int device, const char* what) {
  cudaPointerAttributes attr;
  SYMHEAP_CUDA_CHECK(cudaPointerGetAttributes(&attr, src));
  if (attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged) return src;
  if (attr.type == cudaMemoryTypeHost && attr.devicePointer) return attr.devicePointer;
  throw InvalidArgument(std::string(what) +
                        ": the source is pageable host memory, which a kernel on device " +
                        std::to_string(device) +
                        " cannot read; pass a CUDA tensor, or use via='auto' / 'copy_engine'");
}

}  // namespace

void put_load_store(PeState& s, char* remote, const void* src, size_t nbytes,
                    StreamHandle stream, int blocks) {
  check_stream(s.device, stream);
  if (nbytes == 0) return;
  ScopedDevice on(s.device);
  const void* readable = kernel_readable(src, s.device, "put(via='load_store')");
  auto info = kernel_info(s.device, "sm_put", sm_put_kernel, kPutThreads);
  size_t grid = blocks > 0 ? static_cast<size_t>(blocks)
                           : std::min<size_t>(info->full_grid(),
                                              (nbytes + kMinBytesPerBlock - 1) / kMinBytesPerBlock);
  grid = std::max<size_t>(grid, 1);
  size_t chunk = ((nbytes + grid - 1) / grid + 15) / 16 * 16;  // keeps 16-byte alignment
  grid = (nbytes + chunk - 1) / chunk;
  sm_put_kernel<<<static_cast<unsigned>(grid), kPutThreads, 0,
                  reinterpret_cast<cudaStream_t>(stream)>>>(
      remote, static_cast<const char*>(readable), nbytes, chunk);
  SYMHEAP_CUDA_CHECK_LAUNCH("sm_put_kernel");
}

void synchronize_device(int device) {
  ScopedDevice on(device);
  cudaDeviceSynchronize();  // an error here belongs to the kernel; finalize goes on
  cudaGetLastError();
}

int kernel_cache_entries(int device) { return kernel_cache_stats(device)->made.load(); }

}  // namespace symheap::cuda
