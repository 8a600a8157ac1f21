// The CUDA runtime of the device driver (ep_device_driver.hpp): launches on
// the caller's stream, a host-mapped mirror for errors and copy plans, and
// the copy-engine transport's channels (src/transports/copy_engine.cu).
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "backends/cuda_api.hpp"
#include "backends/cuda_util.cuh"
#include "ops/ep/ep_device_driver.hpp"

namespace symheap::ep {
namespace cuda_impl {
namespace {

cudaStream_t as_stream(StreamHandle h) { return reinterpret_cast<cudaStream_t>(h); }

class CudaRt {
 public:
  int32_t* host = nullptr;      // host-mapped mirror
  int32_t* host_dev = nullptr;  // its device address

  CudaRt(PeState& s, Op& op) : pe_(&s), device_(s.device) {
    for (int q = 0; q < op.n_pes; ++q) {  // (other nodes' PEs: the remote transport)
      if (s.peers[q].base) peers_.push_back(q);
      const int d = s.peers[q].info.device;
      if (s.peers[q].kind == PeerKind::SameProcess && d != device_ &&
          std::find(peer_devices_.begin(), peer_devices_.end(), d) == peer_devices_.end())
        peer_devices_.push_back(d);
    }
    int major = 0;
    SYMHEAP_CUDA_CHECK(
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device_));
    const char* pdl = std::getenv("SYMHEAP_EP_PDL");
    early_ = major >= 9 && !(pdl && std::strcmp(pdl, "0") == 0);
    look_words_ = static_cast<size_t>(op.n_pes);
    const size_t words =
        kernels::kHostSegment0 + 4 * static_cast<size_t>(std::max(op.n_pes, op.cfg.num_experts));
    SYMHEAP_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&host), words * 4,
                                     cudaHostAllocMapped | cudaHostAllocPortable));
    std::fill(host, host + words, 0);
    SYMHEAP_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&host_dev), host, 0));
    // Every kernel loaded now, before any of this op's waits spins
    // (kernels::for_each_kernel says why).
    kernels::for_each_kernel([](auto kernel) {
      cudaFuncAttributes attrs;
      SYMHEAP_CUDA_CHECK(cudaFuncGetAttributes(&attrs, kernel));
    });
    // Zero the sync words on a private stream that waits for nothing else
    // (not even kernels of other ops still running), and wait for exactly that.
    cudaStream_t setup = nullptr;
    SYMHEAP_CUDA_CHECK(cudaStreamCreateWithFlags(&setup, cudaStreamNonBlocking));
    cudaError_t err = cudaMemsetAsync(s.base() + op.ws_offset, 0, op.geo.sync_bytes, setup);
    if (err == cudaSuccess) err = cudaStreamSynchronize(setup);
    cudaStreamDestroy(setup);
    SYMHEAP_CUDA_CHECK(err);
  }
  CudaRt(const CudaRt&) = delete;
  CudaRt& operator=(const CudaRt&) = delete;

  ~CudaRt() {  // best effort: the process may be exiting
    int previous = -1;
    cudaGetDevice(&previous);
    cudaSetDevice(device_);
    if (host) cudaFreeHost(host);
    if (look_host_) cudaFreeHost(look_host_);
    if (look_) cudaStreamDestroy(look_);
    if (previous >= 0) cudaSetDevice(previous);
  }

  template <class... KA, class... A>
  void launch(void (*kernel)(KA...), int grid, int block, size_t shared, StreamHandle stream,
              A&&... args) {
    allow_shared(kernel, shared);
    kernel<<<grid, block, shared, as_stream(stream)>>>(std::forward<A>(args)...);
    SYMHEAP_CUDA_CHECK(cudaGetLastError());
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
    SYMHEAP_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<A>(args)...));
  }
  void sync(StreamHandle stream) {
    SYMHEAP_CUDA_CHECK(cudaStreamSynchronize(as_stream(stream)));
  }
  // Memory of this GPU that the kernels of this op's other PEs may store
  // into: 16-byte aligned, below 2^48 (the board's encoding), and either a
  // plain allocation (cudaMalloc / cuMemAlloc: the peer access enabled between
  // the job's GPUs covers it) or a mapping every peer GPU has read-write
  // access to (VMM and pool memory need grants of their own; XLA maps its
  // region with them). The allocations found so are remembered by range:
  // callers reuse their buffers, and each look costs driver calls.
  bool peers_can_store(const void* ptr) {
    const uintptr_t a = reinterpret_cast<uintptr_t>(ptr);
    if (a % 16 != 0 || (a >> 48) != 0) return false;
    for (const auto& [start, size] : storable_)
      if (a >= start && a - start < size) return true;
    cudaPointerAttributes attr{};
    if (cudaPointerGetAttributes(&attr, ptr) != cudaSuccess) {
      cudaGetLastError();
      return false;
    }
    if (attr.type != cudaMemoryTypeDevice || attr.device != device_) return false;
    uint64_t start = 0, size = 0, plain = 0;
    if (!pointer_attribute(ptr, CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, &start) ||
        !pointer_attribute(ptr, CU_POINTER_ATTRIBUTE_RANGE_SIZE, &size) ||
        !pointer_attribute(ptr, CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, &plain))
      return false;
    if (!plain) {
      for (int d : peer_devices_) {
        ::symheap::cuda::ScopedDevice on(d);  // the flags are those of the current device
        uint64_t flags = 0;
        if (!pointer_attribute(ptr, CU_POINTER_ATTRIBUTE_ACCESS_FLAGS, &flags) ||
            flags != CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
          return false;
      }
    }
    if (storable_.size() >= 64) storable_.clear();
    storable_.emplace_back(static_cast<uintptr_t>(start), static_cast<uintptr_t>(size));
    return true;
  }
  void zero_async(void* p, size_t bytes, StreamHandle stream) {
    SYMHEAP_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, as_stream(stream)));
  }
  // Copy engine: the transport's channels to every PE.
  void channels_after(StreamHandle stream) { cuda::copy_engine_begin(*pe_, peers_, stream); }
  void copy(int pe, void* dst, const void* src, size_t bytes) {
    cuda::copy_engine_copy(*pe_, pe, dst, src, bytes);
  }
  void signal(int pe, uint64_t* flag) {
    cuda::copy_engine_signal(*pe_, pe, flag, 1, SignalOp::Add);
  }
  void read(void* host, const void* src, size_t bytes, StreamHandle stream) {
    SYMHEAP_CUDA_CHECK(
        cudaMemcpyAsync(host, src, bytes, cudaMemcpyDeviceToHost, as_stream(stream)));
    SYMHEAP_CUDA_CHECK(cudaStreamSynchronize(as_stream(stream)));
  }
  void write(void* dst, const void* host, size_t bytes, StreamHandle stream) {
    SYMHEAP_CUDA_CHECK(
        cudaMemcpyAsync(dst, host, bytes, cudaMemcpyHostToDevice, as_stream(stream)));
    SYMHEAP_CUDA_CHECK(cudaStreamSynchronize(as_stream(stream)));
  }
  void stream_after_channels(StreamHandle stream) {
    cuda::copy_engine_end(*pe_, peers_, stream);
  }
  // A host look at n <= n_pes device words, on a stream of its own that
  // waits for no other work (the caller's stream may hold kernels a while).
  void read_words(const uint64_t* words, uint64_t* out, size_t n) {
    if (!look_) {
      SYMHEAP_CUDA_CHECK(cudaStreamCreateWithFlags(&look_, cudaStreamNonBlocking));
      SYMHEAP_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&look_host_),
                                       sizeof(uint64_t) * look_words_, cudaHostAllocPortable));
    }
    SYMHEAP_CUDA_CHECK(
        cudaMemcpyAsync(look_host_, words, n * sizeof(uint64_t), cudaMemcpyDeviceToHost, look_));
    SYMHEAP_CUDA_CHECK(cudaStreamSynchronize(look_));
    std::copy(look_host_, look_host_ + n, out);
  }

 private:
  PeState* pe_;
  int device_;
  std::vector<int> peers_;  // every mapped PE: the copy engine's destinations
  bool early_ = false;  // launch_early uses programmatic dependent launch
  cudaStream_t look_ = nullptr;  // read_words
  uint64_t* look_host_ = nullptr;
  size_t look_words_ = 0;

  std::vector<int> peer_devices_;  // the other GPUs that drive PEs of this op in this process
  std::vector<std::pair<uintptr_t, uintptr_t>> storable_;  // peers_can_store's ranges (start, size)

  // cuPointerGetAttribute through the runtime's driver entry point (the
  // library does not link the driver API); false where it fails.
  static bool pointer_attribute(const void* ptr, CUpointer_attribute which, uint64_t* out) {
    using Get = CUresult (*)(void*, CUpointer_attribute, CUdeviceptr);
    static const Get get = reinterpret_cast<Get>(::symheap::cuda::driver_entry_point("cuPointerGetAttribute"));
    // Each attribute read here is at most 8 bytes wide (an int, flags or an address).
    unsigned long long value = 0;
    if (!get || get(&value, which, static_cast<CUdeviceptr>(reinterpret_cast<uintptr_t>(ptr))) !=
                    CUDA_SUCCESS)
      return false;
    *out = value;
    return true;
  }

  template <class K>
  static void allow_shared(K kernel, size_t shared) {
    if (shared > 48 * 1024)  // many experts: opt in to more shared memory (else a clear error)
      SYMHEAP_CUDA_CHECK(cudaFuncSetAttribute(
          kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(shared)));
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
