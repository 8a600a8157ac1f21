// The CUDA runtime of the device driver (ep_device_driver.hpp): launches on
// the caller's stream, a host-mapped mirror for errors and copy plans, and
// copy-engine channels (one stream per destination PE, ordered after the
// caller's stream with events).
#include <cuda_runtime.h>

#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "ops/ep/ep_device_driver.hpp"

namespace symheap::ep {
namespace cuda_impl {
namespace {

void cuda_check(cudaError_t err, const char* what, int line) {
  if (err == cudaSuccess) return;
  cudaGetLastError();  // clear non-sticky errors
  throw StateError(std::string("ep (ep_cuda.cu:") + std::to_string(line) + "): " + what +
                   " failed: " + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")");
}
#define EP_CUDA(call) cuda_check((call), #call, __LINE__)

cudaStream_t as_stream(StreamHandle h) { return reinterpret_cast<cudaStream_t>(h); }

class CudaRt {
 public:
  int32_t* host = nullptr;      // host-mapped mirror
  int32_t* host_dev = nullptr;  // its device address

  CudaRt(PeState& s, Op& op) : device_(s.device), channels_(op.n_pes), done_(op.n_pes) {
    int major = 0;
    EP_CUDA(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device_));
    const char* pdl = std::getenv("SYMHEAP_EP_PDL");
    early_ = major >= 9 && !(pdl && std::strcmp(pdl, "0") == 0);
    const size_t words =
        kernels::kHostSegment0 + 4 * static_cast<size_t>(std::max(op.n_pes, op.cfg.num_experts));
    EP_CUDA(cudaHostAlloc(reinterpret_cast<void**>(&host), words * 4,
                          cudaHostAllocMapped | cudaHostAllocPortable));
    std::fill(host, host + words, 0);
    EP_CUDA(cudaHostGetDevicePointer(reinterpret_cast<void**>(&host_dev), host, 0));
    EP_CUDA(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming));
    // Zero the sync words on a private stream that waits for nothing else
    // (not even kernels of other ops still running), and wait for exactly that.
    cudaStream_t setup = nullptr;
    EP_CUDA(cudaStreamCreateWithFlags(&setup, cudaStreamNonBlocking));
    cudaError_t err = cudaMemsetAsync(s.base() + op.ws_offset, 0, op.geo.sync_bytes, setup);
    if (err == cudaSuccess) err = cudaStreamSynchronize(setup);
    cudaStreamDestroy(setup);
    EP_CUDA(err);
  }
  CudaRt(const CudaRt&) = delete;
  CudaRt& operator=(const CudaRt&) = delete;

  ~CudaRt() {  // best effort: the process may be exiting
    int previous = -1;
    cudaGetDevice(&previous);
    cudaSetDevice(device_);
    for (auto s : channels_)
      if (s) cudaStreamDestroy(s);
    for (auto e : done_)
      if (e) cudaEventDestroy(e);
    if (ready_) cudaEventDestroy(ready_);
    if (host) cudaFreeHost(host);
    if (previous >= 0) cudaSetDevice(previous);
  }

  template <class... KA, class... A>
  void launch(void (*kernel)(KA...), int grid, int block, size_t shared, StreamHandle stream,
              A&&... args) {
    allow_shared(kernel, shared);
    kernel<<<grid, block, shared, as_stream(stream)>>>(std::forward<A>(args)...);
    EP_CUDA(cudaGetLastError());
  }
  // As launch, but the kernel's blocks may start while the previous kernel
  // on the stream ends (programmatic dependent launch, sm_90+; its
  // start_kernel() waits for that kernel's memory): no launch gap between
  // back-to-back calls. SYMHEAP_EP_PDL=0 turns it off.
  template <class... KA, class... A>
  void launch_early(void (*kernel)(KA...), int grid, int block, size_t shared,
                    StreamHandle stream, A&&... args) {
    if (!early_) return launch(kernel, grid, block, shared, stream, std::forward<A>(args)...);
    allow_shared(kernel, shared);
    cudaLaunchAttribute early{};
    early.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    early.val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t config{};
    config.gridDim = dim3(static_cast<unsigned>(grid));
    config.blockDim = dim3(static_cast<unsigned>(block));
    config.dynamicSmemBytes = shared;
    config.stream = as_stream(stream);
    config.attrs = &early;
    config.numAttrs = 1;
    EP_CUDA(cudaLaunchKernelEx(&config, kernel, std::forward<A>(args)...));
  }
  void sync(StreamHandle stream) { EP_CUDA(cudaStreamSynchronize(as_stream(stream))); }
  void zero_async(void* p, size_t bytes, StreamHandle stream) {
    EP_CUDA(cudaMemsetAsync(p, 0, bytes, as_stream(stream)));
  }
  void channels_after(StreamHandle stream) {
    EP_CUDA(cudaEventRecord(ready_, as_stream(stream)));
    for (size_t pe = 0; pe < channels_.size(); ++pe)
      EP_CUDA(cudaStreamWaitEvent(channel(static_cast<int>(pe)), ready_, 0));
  }
  void copy(int pe, void* dst, const void* src, size_t bytes) {
    EP_CUDA(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, channel(pe)));
  }
  void signal(int pe, uint64_t* flag) {
    kernels::signal_kernel<<<1, 1, 0, channel(pe)>>>(flag, 1);
    EP_CUDA(cudaGetLastError());
  }
  void stream_after_channels(StreamHandle stream) {
    for (size_t pe = 0; pe < channels_.size(); ++pe) {
      EP_CUDA(cudaEventRecord(done_[pe], channel(static_cast<int>(pe))));
      EP_CUDA(cudaStreamWaitEvent(as_stream(stream), done_[pe], 0));
    }
  }

 private:
  int device_;
  bool early_ = false;  // launch_early uses programmatic dependent launch
  std::vector<cudaStream_t> channels_;  // copy engine: one per destination PE
  std::vector<cudaEvent_t> done_;
  cudaEvent_t ready_ = nullptr;

  template <class K>
  static void allow_shared(K kernel, size_t shared) {
    if (shared > 48 * 1024)  // many experts: opt in to more shared memory (else a clear error)
      EP_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                   static_cast<int>(shared)));
  }
  cudaStream_t channel(int pe) {
    if (!channels_[pe]) {
      EP_CUDA(cudaStreamCreateWithFlags(&channels_[pe], cudaStreamNonBlocking));
      EP_CUDA(cudaEventCreateWithFlags(&done_[pe], cudaEventDisableTiming));
    }
    return channels_[pe];
  }
};

}  // namespace
}  // namespace cuda_impl

std::shared_ptr<DeviceImpl> make_cuda_device(PeState& s, Op& op) {
  return std::make_shared<cuda_impl::DeviceDriver<cuda_impl::CudaRt>>(s, op);
}

int cuda_sm_count(int device) {
  int n = 0;
  if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || n < 1)
    throw StateError("ep: cannot read the SM count of CUDA device " + std::to_string(device));
  return n;
}

}  // namespace symheap::ep
