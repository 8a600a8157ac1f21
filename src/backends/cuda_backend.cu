// The `cuda` backend: each PE's symmetric heap is one cudaMalloc block on
// its GPU, reserved at init. Peers in the same process are reached through
// direct pointers once peer access is enabled; peers in other processes of
// the node through legacy CUDA IPC handles (docs/cuda.md says why).
// Host operations are ordered on the caller's stream; host waits poll.
#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "backends/cuda_api.hpp"
#include "backends/cuda_backend.cuh"
#include "backends/cuda_util.cuh"
#include "symheap/device.cuh"
#include "symheap/errors.hpp"
#include "symheap/runtime.hpp"

namespace symheap::cuda {

// ---------------------------------------------------------------- errors

void* driver_entry_point(const char* name) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found{};
#if CUDART_VERSION >= 12050
  const cudaError_t err = cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &found);
#else
  const cudaError_t err = cudaGetDriverEntryPoint(name, &fn, cudaEnableDefault, &found);
#endif
  if (err != cudaSuccess || found != cudaDriverEntryPointSuccess) {
    cudaGetLastError();
    return nullptr;
  }
  return fn;
}

void throw_cuda_error(cudaError_t err, const char* call, const char* file, int line) {
  cudaGetLastError();  // clear a non-sticky error so later calls are unaffected
  const char* base = std::strrchr(file, '/');
  std::string where = std::string(base ? base + 1 : file) + ":" + std::to_string(line);
  std::string msg = std::string("CUDA error ") + cudaGetErrorName(err) + " (" +
                    cudaGetErrorString(err) + ") in " + call + " at " + where;
  switch (err) {
    case cudaErrorMemoryAllocation:
      throw HeapExhausted(msg + ": the GPU is out of memory (lower SYMHEAP_HEAP_SIZE or free "
                                "tensors first)");
    case cudaErrorInvalidResourceHandle:
      throw InvalidArgument(msg + " (a stream or event of another device, or destroyed?)");
    case cudaErrorInvalidDevice:
      throw InvalidArgument(msg);
    default:
      throw StateError(msg);
  }
}

ScopedDevice::ScopedDevice(int device) {
  int current = -1;
  SYMHEAP_CUDA_CHECK(cudaGetDevice(&current));
  if (current != device) {
    SYMHEAP_CUDA_CHECK(cudaSetDevice(device));
    previous_ = current;
  }
}

ScopedDevice::~ScopedDevice() {
  if (previous_ >= 0) cudaSetDevice(previous_);  // best effort in a destructor
}

// ---------------------------------------------------------------- kernels

namespace {

// A signal after the stream's earlier work (kernels, copy-engine copies):
// the fence orders what this thread has seen of it before the release.
__global__ void signal_kernel(unsigned long long* word, unsigned long long value, int op) {
  device::fence_acq_rel();
  device::detail::signal_store(word, value, op);
}

enum AtomicOp { kFetchAdd = 0, kCompareSwap = 1, kSwap = 2 };

__global__ void atomic_kernel(int op, unsigned long long* word, unsigned long long a,
                              unsigned long long b, unsigned long long* out) {
  unsigned long long old = 0;
  if (op == kFetchAdd) old = atomicAdd_system(word, a);
  else if (op == kCompareSwap) old = atomicCAS_system(word, a, b);
  else old = atomicExch_system(word, a);
  *out = old;
  __threadfence_system();
}

// ---------------------------------------------------------------- helpers

std::string to_hex(const void* data, size_t n) {
  static const char digits[] = "0123456789abcdef";
  const auto* p = static_cast<const unsigned char*>(data);
  std::string out(2 * n, '0');
  for (size_t i = 0; i < n; ++i) {
    out[2 * i] = digits[p[i] >> 4];
    out[2 * i + 1] = digits[p[i] & 15];
  }
  return out;
}

bool from_hex(const std::string& text, void* data, size_t n) {
  if (text.size() != 2 * n) return false;
  auto* p = static_cast<unsigned char*>(data);
  for (size_t i = 0; i < n; ++i) {
    int v = 0;
    for (int k = 0; k < 2; ++k) {
      char c = text[2 * i + k];
      int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
      if (d < 0) return false;
      v = v * 16 + d;
    }
    p[i] = static_cast<unsigned char>(v);
  }
  return true;
}

const char kHandlePrefix[] = "cudaipc:";

std::string device_uuid(int device) {
  cudaDeviceProp prop;
  SYMHEAP_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  return to_hex(&prop.uuid, sizeof prop.uuid);
}

using WriteValue64 = CUresult(CUDAAPI*)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);

WriteValue64 write_value64() {
  static const WriteValue64 fn = reinterpret_cast<WriteValue64>(cuda::driver_entry_point("cuStreamWriteValue64"));
  return fn;
}

}  // namespace

// ---------------------------------------------------------------- resources

DeviceResources::~DeviceResources() {
  // Best effort: at process exit the driver may already be gone.
  if (ops) cudaStreamDestroy(ops);
  if (pinned) cudaFreeHost(pinned);
}

DeviceResources& resources(int device) {
  // Leaked on purpose: destructors at exit would call into a torn-down driver.
  static auto* table_mu = new std::mutex;
  static auto* table = new std::map<int, std::shared_ptr<DeviceResources>>;
  std::lock_guard<std::mutex> lock(*table_mu);
  auto& entry = (*table)[device];
  if (!entry) {
    ScopedDevice on(device);
    auto r = std::make_shared<DeviceResources>();
    r->device = device;
    SYMHEAP_CUDA_CHECK(cudaStreamCreateWithFlags(&r->ops, cudaStreamNonBlocking));
    SYMHEAP_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&r->pinned), 4096,
                                     cudaHostAllocPortable | cudaHostAllocMapped));
    // Load our kernels now: with CUDA's lazy module loading, a first launch
    // may wait for kernels already running on the device, and a host signal
    // must never wait behind a kernel that spins until it arrives.
    cudaFuncAttributes attrs;
    SYMHEAP_CUDA_CHECK(cudaFuncGetAttributes(&attrs, signal_kernel));
    SYMHEAP_CUDA_CHECK(cudaFuncGetAttributes(&attrs, atomic_kernel));
    r->memops_ok = write_value64() != nullptr;
    entry = r;
  }
  return *entry;
}

void check_stream(int device, StreamHandle stream) {
  if (stream == 0) return;
  int owner = -1;
  cudaError_t err = cudaStreamGetDevice(reinterpret_cast<cudaStream_t>(stream), &owner);
  if (err != cudaSuccess) {
    cudaGetLastError();
    throw InvalidArgument("stream 0x" + to_hex(&stream, sizeof stream) +
                          " is not a valid CUDA stream (" + cudaGetErrorString(err) + ")");
  }
  if (owner != device)
    throw InvalidArgument("the stream belongs to device " + std::to_string(owner) +
                          " but the operation runs on the PE of device " +
                          std::to_string(device) +
                          " (pass a stream of the PE's device, or stream=None)");
}

// ---------------------------------------------------------------- backend

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(int count) : count_(count) {
    // SYMHEAP_CUDA_STREAM_MEMOPS: "always" (default: host-issued set-signals
    // use cuStreamWriteValue64, no SM), "local" (not into other processes'
    // heaps) or "never" (a one-thread kernel for every signal).
    const char* env = std::getenv("SYMHEAP_CUDA_STREAM_MEMOPS");
    std::string v = env && *env ? env : "always";
    if (v == "always") memops_policy_ = MemopsPolicy::Always;
    else if (v == "never") memops_policy_ = MemopsPolicy::Never;
    else if (v == "local") memops_policy_ = MemopsPolicy::Local;
    else
      throw InvalidArgument("SYMHEAP_CUDA_STREAM_MEMOPS='" + v +
                            "' must be local, always or never");
  }
  const char* name() const override { return "cuda"; }
  int device_count() override { return count_; }
  bool unmap_before_owner_frees() const override { return true; }  // CUDA IPC
  void drain(int device) override {
    cuda::sync_channels(device);  // the copy engines' work, then the kernels'
    cuda::synchronize_device(device);
  }

  int current_device() override {
    int d = 0;
    SYMHEAP_CUDA_CHECK(cudaGetDevice(&d));
    return d;
  }
  void set_device(int device) override {
    if (device < 0 || device >= count_)
      throw InvalidArgument("device " + std::to_string(device) + " out of range: " +
                            std::to_string(count_) + " CUDA devices are visible");
    SYMHEAP_CUDA_CHECK(cudaSetDevice(device));
  }

  std::shared_ptr<Region> create_heap(int device, size_t bytes, const std::string&) override {
    resources(device);  // streams, pinned words and kernels ready before any kernel runs
    ScopedDevice on(device);
    void* base = nullptr;
    cudaError_t err = cudaMalloc(&base, bytes);
    if (err != cudaSuccess) {
      cudaGetLastError();
      size_t free_b = 0, total_b = 0;
      cudaMemGetInfo(&free_b, &total_b);
      cudaGetLastError();
      throw HeapExhausted("cannot reserve a symmetric heap of " + format_size(bytes) +
                          " on CUDA device " + std::to_string(device) + " (" +
                          format_size(free_b) + " free of " + format_size(total_b) + ": " +
                          cudaGetErrorString(err) +
                          "); lower heap_size= / SYMHEAP_HEAP_SIZE");
    }
    auto region = std::make_shared<Region>();
    region->base = base;
    region->size = bytes;
    region->on_release = [base, device] {
      int prev = -1;
      if (cudaGetDevice(&prev) != cudaSuccess) return;  // driver already shut down
      cudaSetDevice(device);
      cudaFree(base);  // waits for work that still touches the heap
      cudaSetDevice(prev);
      cudaGetLastError();
    };
    cudaIpcMemHandle_t handle;
    SYMHEAP_CUDA_CHECK(cudaIpcGetMemHandle(&handle, base));
    region->export_handle =
        kHandlePrefix + to_hex(&handle, sizeof handle) + ":" + device_uuid(device);
    return region;
  }

  std::shared_ptr<Region> open_peer_heap(int device, const std::string& text,
                                         size_t bytes) override {
    cudaIpcMemHandle_t handle;
    size_t prefix = sizeof kHandlePrefix - 1;
    size_t colon = text.find(':', prefix);
    if (text.compare(0, prefix, kHandlePrefix) != 0 || colon == std::string::npos ||
        !from_hex(text.substr(prefix, colon - prefix), &handle, sizeof handle))
      throw InvalidArgument("malformed CUDA IPC heap handle '" + text.substr(0, 40) +
                            "...' (do all PEs use the cuda backend?)");
    std::string key = text + "@" + std::to_string(device);
    std::lock_guard<std::mutex> lock(ipc_mu_);
    if (auto live = ipc_open_[key].lock()) return live;
    ScopedDevice on(device);
    void* base = nullptr;
    cudaError_t err = cudaIpcOpenMemHandle(&base, handle, cudaIpcMemLazyEnablePeerAccess);
    if (err != cudaSuccess) {
      cudaGetLastError();
      // The driver maps a handle once per process: another local device may
      // already hold this mapping; reach it through peer access instead.
      for (auto& [other_key, weak] : ipc_open_) {
        auto live = weak.lock();
        if (!live || other_key.compare(0, text.size() + 1, text + "@") != 0) continue;
        int other = std::stoi(other_key.substr(text.size() + 1));
        enable_peer_access(device, other);
        return live;
      }
      throw StateError(std::string("cudaIpcOpenMemHandle failed on device ") +
                       std::to_string(device) + ": " + cudaGetErrorString(err) +
                       " (is the peer process gone, or run inside another container?)");
    }
    auto region = std::make_shared<Region>();
    region->base = base;
    region->size = bytes;
    region->on_release = [base, device] {
      int prev = -1;
      if (cudaGetDevice(&prev) != cudaSuccess) return;
      cudaSetDevice(device);
      cudaIpcCloseMemHandle(base);
      cudaSetDevice(prev);
      cudaGetLastError();
    };
    ipc_open_[key] = region;
    // Peer access to the owner's GPU, when this process sees it, explicitly
    // rather than lazily (see signal()).
    int owner = local_device_with_uuid(text.substr(colon + 1));
    if (owner >= 0 && owner != device) {
      try {
        enable_peer_access(device, owner);
      } catch (const std::exception&) {
        // best effort: the IPC mapping works without it (lazy peer access)
      }
    }
    return region;
  }

  void unexport(const std::string&) override {}  // legacy IPC handles cannot be revoked

  void enable_peer_access(int device, int peer) override {
    if (device == peer) return;
    int can = 0;
    SYMHEAP_CUDA_CHECK(cudaDeviceCanAccessPeer(&can, device, peer));
    if (!can)
      throw Unsupported("CUDA device " + std::to_string(device) + " cannot access device " +
                        std::to_string(peer) +
                        " directly (no NVLink/PCIe peer-to-peer path), so PEs on them have "
                        "no load/store path to each other");
    ScopedDevice on(device);
    cudaError_t err = cudaDeviceEnablePeerAccess(peer, 0);
    if (err == cudaErrorPeerAccessAlreadyEnabled) {
      cudaGetLastError();  // clears the error so it does not surface later
      return;
    }
    SYMHEAP_CUDA_CHECK(err);
  }

  void copy(int device, void* dst, const void* src, size_t nbytes,
            StreamHandle stream) override {
    if (nbytes == 0) return;
    check_stream(device, stream);
    ScopedDevice on(device);
    SYMHEAP_CUDA_CHECK(cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyDefault,
                                       reinterpret_cast<cudaStream_t>(stream)));
  }

  void signal(int device, uint64_t* word, uint64_t value, SignalOp op,
              StreamHandle stream) override {
    check_stream(device, stream);
    ScopedDevice on(device);
    DeviceResources& res = resources(device);
    bool use_memops = op == SignalOp::Set && res.memops_ok &&
                      (memops_policy_ == MemopsPolicy::Always ||
                       (memops_policy_ == MemopsPolicy::Local && !in_ipc_mapping(word)));
    if (use_memops) {
      // No SM: the stream's front end writes the word after earlier work,
      // with a memory barrier (the default flags).
      CUresult r = write_value64()(reinterpret_cast<CUstream>(stream),
                                   reinterpret_cast<CUdeviceptr>(word), value, 0);
      if (r == CUDA_SUCCESS) return;
      cudaGetLastError();
      res.memops_ok = false;  // signals use the one-thread kernel from now on
    }
    signal_kernel<<<1, 1, 0, reinterpret_cast<cudaStream_t>(stream)>>>(
        reinterpret_cast<unsigned long long*>(word), value,
        op == SignalOp::Add ? device::kSignalAdd : device::kSignalSet);
    SYMHEAP_CUDA_CHECK_LAUNCH("signal_kernel");
  }

  uint64_t load_word(int device, const uint64_t* word) override {
    DeviceResources& res = resources(device);
    ScopedDevice on(device);
    std::lock_guard<std::mutex> lock(res.mu);
    SYMHEAP_CUDA_CHECK(
        cudaMemcpyAsync(res.pinned, word, sizeof(uint64_t), cudaMemcpyDefault, res.ops));
    SYMHEAP_CUDA_CHECK(cudaStreamSynchronize(res.ops));
    return *reinterpret_cast<volatile uint64_t*>(res.pinned);
  }

  int64_t fetch_add(int device, int64_t* word, int64_t value) override {
    return run_atomic(device, kFetchAdd, word, static_cast<uint64_t>(value), 0);
  }
  int64_t compare_swap(int device, int64_t* word, int64_t expected, int64_t desired) override {
    return run_atomic(device, kCompareSwap, word, static_cast<uint64_t>(expected),
                      static_cast<uint64_t>(desired));
  }
  int64_t swap(int device, int64_t* word, int64_t value) override {
    return run_atomic(device, kSwap, word, static_cast<uint64_t>(value), 0);
  }

  void quiet(int device, StreamHandle stream) override {
    check_stream(device, stream);
    ScopedDevice on(device);
    SYMHEAP_CUDA_CHECK(cudaStreamSynchronize(reinterpret_cast<cudaStream_t>(stream)));
    sync_channels(device);
  }

  // Operations issued on one stream already complete in order, and each
  // signal carries a memory barrier: nothing to add.
  void fence(int device, StreamHandle stream) override { check_stream(device, stream); }

  void zero(int device, void* dst, size_t nbytes) override {
    ScopedDevice on(device);
    SYMHEAP_CUDA_CHECK(cudaMemset(dst, 0, nbytes));
  }

 private:
  bool in_ipc_mapping(const void* p) {
    std::lock_guard<std::mutex> lock(ipc_mu_);
    for (auto& [key, weak] : ipc_open_) {
      auto live = weak.lock();
      if (live && p >= live->base && p < static_cast<char*>(live->base) + live->size) return true;
    }
    return false;
  }

  // Index of the local device with this UUID (hex), or -1 when not visible.
  int local_device_with_uuid(const std::string& uuid) {
    std::lock_guard<std::mutex> lock(uuid_mu_);
    if (uuids_.empty())
      for (int d = 0; d < count_; ++d) uuids_.push_back(device_uuid(d));
    for (int d = 0; d < count_; ++d)
      if (uuids_[d] == uuid) return d;
    return -1;
  }

  int64_t run_atomic(int device, int op, int64_t* word, uint64_t a, uint64_t b) {
    DeviceResources& res = resources(device);
    ScopedDevice on(device);
    std::lock_guard<std::mutex> lock(res.mu);
    atomic_kernel<<<1, 1, 0, res.ops>>>(op, reinterpret_cast<unsigned long long*>(word), a, b,
                                        reinterpret_cast<unsigned long long*>(res.pinned + 1));
    SYMHEAP_CUDA_CHECK_LAUNCH("atomic_kernel");
    SYMHEAP_CUDA_CHECK(cudaStreamSynchronize(res.ops));
    return static_cast<int64_t>(*reinterpret_cast<volatile uint64_t*>(res.pinned + 1));
  }

  enum class MemopsPolicy { Local, Always, Never };
  int count_;
  MemopsPolicy memops_policy_ = MemopsPolicy::Always;
  std::mutex ipc_mu_;
  std::map<std::string, std::weak_ptr<Region>> ipc_open_;  // handle@device -> mapping
  std::mutex uuid_mu_;
  std::vector<std::string> uuids_;  // by local device index
};

std::string describe(const uint64_t* rec, const std::string& pe);

bool backend_active() { return std::strcmp(Runtime::instance().backend().name(), "cuda") == 0; }

DeviceError take_device_error(PeState& s) {
  uint64_t rec[4] = {0, 0, 0, 0};
  {
    // On the private non-blocking stream: never waits behind user kernels.
    DeviceResources& res = resources(s.device);
    ScopedDevice on(s.device);
    std::lock_guard<std::mutex> lock(res.mu);
    SYMHEAP_CUDA_CHECK(cudaMemcpyAsync(res.pinned + 8, s.device_error_record(), sizeof rec,
                                       cudaMemcpyDefault, res.ops));
    SYMHEAP_CUDA_CHECK(cudaStreamSynchronize(res.ops));
    std::memcpy(rec, res.pinned + 8, sizeof rec);
    if (rec[0] == 0) return {};
    SYMHEAP_CUDA_CHECK(cudaMemsetAsync(s.device_error_record(), 0, sizeof rec, res.ops));
    SYMHEAP_CUDA_CHECK(cudaStreamSynchronize(res.ops));
  }
  std::string pe = "PE " + std::to_string(s.my_pe);
  DeviceError out;
  out.code = static_cast<int>(rec[0]);
  out.message = describe(rec, pe);
  if (out.code == kDeviceNoPath && rec[1] < static_cast<uint64_t>(s.n_pes))
    out.message = s.no_path_message(static_cast<int>(rec[1]), ("a kernel on " + pe).c_str()) +
                  " (the device API has no remote transport; the operation was skipped)";
  return out;
}

std::string describe(const uint64_t* rec, const std::string& pe) {
  switch (rec[0]) {
    case kDeviceWaitTimeout:
      return "device signal_wait_until on " + pe + " timed out: the word at heap offset " +
             std::to_string(rec[1]) + " was " + std::to_string(rec[2]) + ", still not the " +
             std::to_string(rec[3]) + " it waited for (the PE expected to signal is late)";
    case kDeviceBarrierTimeout:
      return "device barrier_all on " + pe + " timed out waiting for PE " +
             std::to_string(rec[1]) + " (it reached " + std::to_string(rec[2]) +
             " device barriers, " + std::to_string(rec[3]) + " were needed)";
    case kDeviceNoPath:
      return "a kernel on " + pe + " addressed PE " + std::to_string(rec[1]) +
             ", which has no load/store path from it (remote peer); the operation was skipped";
    default:
      return "unknown device error record " + std::to_string(rec[0]) + " on " + pe;
  }
}

}  // namespace symheap::cuda

namespace symheap {

std::unique_ptr<Backend> make_cuda_backend(std::string* why_not) {
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess || count == 0) {
    if (why_not)
      *why_not = err != cudaSuccess
                     ? std::string("no usable CUDA driver or device (") + cudaGetErrorName(err) +
                           ": " + cudaGetErrorString(err) + ")"
                     : std::string("no CUDA device is visible (CUDA_VISIBLE_DEVICES?)");
    cudaGetLastError();
    return nullptr;
  }
  return std::make_unique<cuda::CudaBackend>(count);
}

}  // namespace symheap
