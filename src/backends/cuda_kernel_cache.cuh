// Per-device kernel cache: launch facts (attributes, occupancy, SM count)
// are computed once per (device, kernel) and shared by every thread that
// drives that device, under the device-cache lock. The CUDA runtime loads
// the module of each kernel into each device's context on first use; this
// cache keeps our own per-launch work (attribute and occupancy queries) off
// the hot path.
#pragma once
#include <atomic>
#include <memory>
#include <string>

#include "backends/cuda_util.cuh"
#include "symheap/runtime.hpp"

namespace symheap::cuda {

struct KernelInfo {
  int device = -1;
  int threads = 0;        // block size the entry was made for
  int sm_count = 0;
  int blocks_per_sm = 0;  // resident blocks per SM at `threads`
  cudaFuncAttributes attrs{};
  int full_grid() const { return sm_count * (blocks_per_sm > 0 ? blocks_per_sm : 1); }
};

// How many KernelInfo entries were made on a device (tests check that
// concurrent first launches make each entry once).
struct KernelCacheStats {
  std::atomic<int> made{0};
};

inline std::shared_ptr<KernelCacheStats> kernel_cache_stats(int device) {
  return Runtime::instance().device_caches(device).get<KernelCacheStats>(
      "symheap.cuda.kernel_stats", [] { return std::make_shared<KernelCacheStats>(); });
}

template <class Kernel>
std::shared_ptr<KernelInfo> kernel_info(int device, const char* name, Kernel kernel, int threads,
                                        size_t dynamic_smem = 0) {
  std::string key = std::string("symheap.cuda.kernel.") + name + "." + std::to_string(threads);
  auto stats = kernel_cache_stats(device);  // before get(): its lock is not recursive
  return Runtime::instance().device_caches(device).get<KernelInfo>(key, [&] {
    ScopedDevice on(device);
    auto info = std::make_shared<KernelInfo>();
    info->device = device;
    info->threads = threads;
    SYMHEAP_CUDA_CHECK(cudaFuncGetAttributes(&info->attrs, kernel));
    SYMHEAP_CUDA_CHECK(
        cudaDeviceGetAttribute(&info->sm_count, cudaDevAttrMultiProcessorCount, device));
    SYMHEAP_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
        &info->blocks_per_sm, kernel, threads, dynamic_smem));
    stats->made.fetch_add(1);
    return info;
  });
}

}  // namespace symheap::cuda
