// CUDA side of the KV-cache attention XLA FFI handler: what the torch front
// end does with tensor allocations around the core (zeroed outputs for the
// varlen rows no sequence owns), done on XLA's stream.
#include <cuda_runtime.h>

#include <cmath>

#include "backends/cuda_util.cuh"
#include "xla_ffi/attention_kvcache_ffi.hpp"

namespace symheap::attention::xla {
namespace {

__global__ void fill_f32(float* p, int64_t n, float value) {
  for (int64_t e = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; e < n;
       e += int64_t{gridDim.x} * blockDim.x)
    p[e] = value;
}

}  // namespace

void prepare_cache_call_cuda(const CacheCallBuffers& c, int device, void* stream) {
  ::symheap::cuda::ScopedDevice on(device);
  auto s = static_cast<cudaStream_t>(stream);
  const CacheArgs& a = c.args;
  if (c.k_cache_in && c.k_cache_in != a.k_cache.data)
    SYMHEAP_CUDA_CHECK(cudaMemcpyAsync(a.k_cache.data, c.k_cache_in, c.cache_bytes,
                                       cudaMemcpyDeviceToDevice, s));
  if (c.v_cache_in && c.v_cache_in != a.v_cache.data)
    SYMHEAP_CUDA_CHECK(cudaMemcpyAsync(a.v_cache.data, c.v_cache_in, c.cache_bytes,
                                       cudaMemcpyDeviceToDevice, s));
  if (!c.clear_rows) return;
  if (c.out_bytes) SYMHEAP_CUDA_CHECK(cudaMemsetAsync(a.out.data, 0, c.out_bytes, s));
  if (c.lse_count) {
    constexpr int kThreads = 256;
    const int64_t blocks = (c.lse_count + kThreads - 1) / kThreads;
    fill_f32<<<static_cast<unsigned>(blocks < 4096 ? blocks : 4096), kThreads, 0, s>>>(
        a.lse, c.lse_count, -INFINITY);
    SYMHEAP_CUDA_CHECK_LAUNCH("attention.kvcache.xla.fill_lse");
  }
}

}  // namespace symheap::attention::xla
