// Per-device resources of the cuda backend, shared by the backend, the
// copy-engine channels and the test kernels.
#pragma once
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>

namespace symheap::cuda {

struct DeviceResources {
  int device = -1;
  // Non-blocking stream for host polls and host atomics: never queued behind
  // user work on the legacy default stream.
  cudaStream_t ops = nullptr;
  uint64_t* pinned = nullptr;  // mapped pinned words for results of `ops`
  std::mutex mu;               // guards `pinned`
  std::atomic<bool> memops_ok{true};  // signals may use cuStreamWriteValue64
  ~DeviceResources();
};

// Created on first use, never destroyed before exit; thread-safe.
DeviceResources& resources(int device);

}  // namespace symheap::cuda
