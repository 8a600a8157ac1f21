// The cuDNN fast path of the attention op (see cudnn_attention.hpp).
//
// State: one cuDNN handle per device and the built graphs, both in the
// device's slot of the runtime (Runtime::device_caches), shared by every
// thread. A graph is keyed by everything it bakes in (direction, dtype,
// shapes, strides, scale, masking); building one happens once per key under
// the slot's lock. A handle may not be used by two threads at once, so each
// device's handle has a mutex held while the stream is set and the graph
// launched (launching is asynchronous: the lock is held for microseconds).
#include "ops/attention/cudnn_attention.hpp"

#include <cuda_runtime.h>
#include <dlfcn.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

#include <cudnn_frontend.h>

#include "symheap/errors.hpp"
#include "symheap/runtime.hpp"

// The frontend resolves every cuDNN symbol through this handle
// (NV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING); set once by load_library().
namespace cudnn_frontend {
void* cudnn_dlhandle = nullptr;
}

namespace symheap::attention::cudnn {
namespace fe = cudnn_frontend;

namespace {

constexpr const char* kSoname = "libcudnn.so.9";

std::string frontend_version() {
  return std::to_string(CUDNN_FRONTEND_MAJOR_VERSION) + "." + std::to_string(CUDNN_FRONTEND_MINOR_VERSION) +
         "." + std::to_string(CUDNN_FRONTEND_PATCH_VERSION);
}

struct Library {
  std::string error;  // "" when usable
  size_t version = 0;
};

// Opens libcudnn once per process: the copy already loaded (torch's), else
// SYMHEAP_CUDNN_LIBRARY, else the soname through the loader's search path.
Library load_library() {
  Library lib;
  void* handle = dlopen(kSoname, RTLD_NOW | RTLD_NOLOAD);
  std::string tried = std::string(kSoname) + " (already loaded)";
  if (!handle) {
    const char* path = std::getenv("SYMHEAP_CUDNN_LIBRARY");
    if (path && *path) {
      handle = dlopen(path, RTLD_NOW | RTLD_GLOBAL);
      tried += std::string(", ") + path + " (SYMHEAP_CUDNN_LIBRARY)";
      if (!handle) {
        const char* e = dlerror();
        tried += std::string(": ") + (e ? e : "unknown error");
      }
    }
  }
  if (!handle) {
    handle = dlopen(kSoname, RTLD_NOW | RTLD_GLOBAL);
    tried += std::string(", ") + kSoname + " (search path)";
    if (!handle) {
      const char* e = dlerror();
      tried += std::string(": ") + (e ? e : "unknown error");
    }
  }
  if (!handle) {
    lib.error = "cannot open the cuDNN library; tried " + tried +
                ". Install nvidia-cudnn-cu13 (torch's CUDA wheels bring it), import torch first, or "
                "set SYMHEAP_CUDNN_LIBRARY to the path of libcudnn.so.9";
    return lib;
  }
  using GetVersion = size_t (*)();
  auto get_version = reinterpret_cast<GetVersion>(dlsym(handle, "cudnnGetVersion"));
  if (!get_version) {
    lib.error = "the cuDNN library has no cudnnGetVersion symbol";
    return lib;
  }
  lib.version = get_version();
  if (lib.version < 90000) {
    lib.error = "cuDNN " + std::to_string(lib.version) + " is too old: the fused attention path needs cuDNN 9";
    return lib;
  }
  fe::cudnn_dlhandle = handle;
  // The frontend opens libcudart itself for its few CUDA runtime calls and,
  // when several majors are on the path, takes the first. Point it at the one
  // this process already loaded (torch's), unless the user chose one.
  for (const char* cudart : {"libcudart.so.13", "libcudart.so.12"}) {
    void* loaded = dlopen(cudart, RTLD_NOW | RTLD_NOLOAD);
    if (loaded) {
      setenv("CUDNN_FRONTEND_CUDART_LIB_NAME", cudart, /*overwrite=*/0);
      dlclose(loaded);  // drops only the reference NOLOAD took
      break;
    }
  }
  return lib;
}

const Library& library() {
  static const Library lib = load_library();  // thread-safe once
  return lib;
}

void check_cuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess)
    throw std::runtime_error(std::string("attention (cuDNN): ") + what + " failed: " + cudaGetErrorName(err));
}

void check_cudnn(cudnnStatus_t status, const char* what) {
  if (status != CUDNN_STATUS_SUCCESS)
    throw std::runtime_error(std::string("attention (cuDNN): ") + what + " failed: " +
                             fe::detail::get_error_string(status));
}

void check_fe(fe::error_t status, const char* what) {
  if (status.is_bad())
    throw std::runtime_error(std::string(what) + ": " + status.get_message());
}

// Makes `device` current for the calling thread and restores the previous one.
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    check_cuda(cudaGetDevice(&previous_), "cudaGetDevice");
    if (previous_ != device) {
      check_cuda(cudaSetDevice(device), "cudaSetDevice");
      changed_ = true;
    }
  }
  ~DeviceScope() {
    if (changed_) cudaSetDevice(previous_);
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int previous_ = 0;
  bool changed_ = false;
};

// One handle per device. Never destroyed: the caches live until process exit,
// when the driver may already be gone, and a handle holds no memory worth
// returning before then.
struct DeviceHandle {
  std::mutex mu;  // one thread at a time sets the stream and launches
  cudnnHandle_t handle = nullptr;
};

std::shared_ptr<DeviceHandle> device_handle(int device) {
  return Runtime::instance().device_caches(device).get<DeviceHandle>("attention.cudnn.handle", [] {
    auto h = std::make_shared<DeviceHandle>();
    check_cudnn(fe::detail::create_handle(&h->handle), "cudnnCreate");
    return h;
  });
}

enum Uid : int64_t { kQ = 1, kK, kV, kO, kStats, kDO, kDQ, kDK, kDV };

// A graph cuDNN built for one key, or the reason it would not.
struct GraphEntry {
  std::shared_ptr<fe::graph::Graph> graph;
  std::string failure;
  int64_t workspace = 0;
};

bool causal_like(const Args& a) { return a.window_right == 0; }

// Everything a graph bakes in: a call whose key matches may reuse the graph.
std::string graph_key(const Args& a, bool backward) {
  std::string key = backward ? "attention.cudnn.bwd" : "attention.cudnn.fwd";
  auto add = [&key](int64_t v) {
    key += ':';
    key += std::to_string(v);
  };
  auto add_tensor = [&add](const Tensor& t) {
    add(t.batch_stride);
    add(t.row_stride);
    add(t.head_stride);
  };
  uint32_t scale_bits = 0;
  std::memcpy(&scale_bits, &a.scale, sizeof scale_bits);
  for (int64_t v : {int64_t(a.q.dtype), int64_t(a.batch), int64_t(a.heads_q), int64_t(a.heads_kv),
                    int64_t(a.head_dim), int64_t(a.seqlen_q), int64_t(a.seqlen_k), int64_t(scale_bits),
                    int64_t(a.window_left), int64_t(a.window_right), int64_t(a.deterministic)})
    add(v);
  add_tensor(a.q);
  add_tensor(a.k);
  add_tensor(a.v);
  add_tensor(a.out);
  add(a.lse_batch_stride);
  add(a.lse_head_stride);
  if (backward) {
    add_tensor(a.dout);
    add_tensor(a.dq);
    add_tensor(a.dk);
    add_tensor(a.dv);
  }
  return key;
}

template <class Attributes>
void set_masking(Attributes& attr, const Args& a) {
  if (causal_like(a)) {
    // Bottom-right aligned as the own kernels; with Sq == Sk that is the
    // top-left diagonal, which every cuDNN 9 release takes.
    if (a.seqlen_q == a.seqlen_k) attr.set_causal_mask(true);
    else attr.set_causal_mask_bottom_right(true);
    // cuDNN keeps key j for query i when j > i' - left_bound (i' the aligned
    // row); the op keeps j >= i' - window_left. A window reaching past the
    // first key changes nothing and is left out.
    if (a.window_left >= 0 && a.window_left < a.seqlen_k) attr.set_diagonal_band_left_bound(a.window_left + 1);
  }
}

std::shared_ptr<GraphEntry> build_graph(const Args& a, bool backward, DeviceHandle& dh) {
  auto entry = std::make_shared<GraphEntry>();
  try {
    const auto io = a.q.dtype == DType::F16 ? fe::DataType_t::HALF : fe::DataType_t::BFLOAT16;
    auto g = std::make_shared<fe::graph::Graph>();
    g->set_io_data_type(io)
        .set_intermediate_data_type(fe::DataType_t::FLOAT)
        .set_compute_data_type(fe::DataType_t::FLOAT);
    const int64_t B = a.batch, Hq = a.heads_q, Hkv = a.heads_kv, D = a.head_dim;
    const int64_t Sq = a.seqlen_q, Sk = a.seqlen_k;
    // (B, H, S, D) views of the op's (B, S, H, D) tensors.
    auto bhsd = [](const Tensor& t) { return std::vector<int64_t>{t.batch_stride, t.head_stride, t.row_stride, 1}; };
    auto input = [&](const char* name, Uid uid, int64_t h, int64_t s, const Tensor& t) {
      return g->tensor(fe::graph::Tensor_attributes().set_name(name).set_uid(uid).set_dim({B, h, s, D}).set_stride(
          bhsd(t)));
    };
    const std::vector<int64_t> stats_dim{B, Hq, Sq, 1};
    const std::vector<int64_t> stats_stride{a.lse_batch_stride, a.lse_head_stride, 1, 1};
    auto q = input("Q", kQ, Hq, Sq, a.q);
    auto k = input("K", kK, Hkv, Sk, a.k);
    auto v = input("V", kV, Hkv, Sk, a.v);
    if (!backward) {
      auto attr = fe::graph::SDPA_attributes().set_name("sdpa").set_generate_stats(true).set_attn_scale(a.scale);
      set_masking(attr, a);
      auto [o, stats] = g->sdpa(q, k, v, attr);
      o->set_output(true).set_uid(kO).set_dim({B, Hq, Sq, D}).set_stride(bhsd(a.out));
      stats->set_output(true).set_uid(kStats).set_data_type(fe::DataType_t::FLOAT).set_dim(stats_dim).set_stride(
          stats_stride);
    } else {
      auto o = input("O", kO, Hq, Sq, a.out);
      auto dout = input("dO", kDO, Hq, Sq, a.dout);
      auto stats = g->tensor(fe::graph::Tensor_attributes()
                                 .set_name("Stats")
                                 .set_uid(kStats)
                                 .set_dim(stats_dim)
                                 .set_stride(stats_stride)
                                 .set_data_type(fe::DataType_t::FLOAT));
      auto attr = fe::graph::SDPA_backward_attributes().set_name("sdpa_backward").set_attn_scale(a.scale);
      set_masking(attr, a);
      if (a.deterministic) attr.set_deterministic_algorithm(true);
      auto [dq, dk, dv] = g->sdpa_backward(q, k, v, o, dout, stats, attr);
      dq->set_output(true).set_uid(kDQ).set_dim({B, Hq, Sq, D}).set_stride(bhsd(a.dq));
      dk->set_output(true).set_uid(kDK).set_dim({B, Hkv, Sk, D}).set_stride(bhsd(a.dk));
      dv->set_output(true).set_uid(kDV).set_dim({B, Hkv, Sk, D}).set_stride(bhsd(a.dv));
    }
    std::lock_guard<std::mutex> lock(dh.mu);
    check_fe(g->validate(), "validate");
    check_fe(g->build_operation_graph(dh.handle), "build_operation_graph");
    check_fe(g->create_execution_plans({fe::HeurMode_t::A}), "create_execution_plans");
    check_fe(g->check_support(dh.handle), "check_support");
    check_fe(g->build_plans(dh.handle), "build_plans");
    int64_t workspace = 0;
    check_fe(g->get_workspace_size(workspace), "get_workspace_size");
    entry->graph = std::move(g);
    entry->workspace = workspace;
  } catch (const std::exception& e) {
    entry->failure = std::string("cuDNN rejected the graph: ") + e.what();
  }
  return entry;
}

// The handle and graph of one call; entry->graph is null when cuDNN cannot take it.
struct Lookup {
  std::shared_ptr<DeviceHandle> handle;
  std::shared_ptr<GraphEntry> entry;
  std::string reason;  // why there is no graph
};

Lookup lookup(const Args& a, bool backward, int device) {
  Lookup l;
  l.reason = unavailable_reason();
  if (l.reason.empty()) l.reason = unsupported_reason(a, backward);
  if (!l.reason.empty()) return l;
  try {
    l.handle = device_handle(device);
  } catch (const std::exception& e) {
    l.reason = e.what();
    return l;
  }
  DeviceHandle& dh = *l.handle;
  l.entry = Runtime::instance().device_caches(device).get<GraphEntry>(
      graph_key(a, backward), [&] { return build_graph(a, backward, dh); });
  if (!l.entry->graph) l.reason = l.entry->failure;
  return l;
}

bool aligned(const Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.data) % 16 == 0 && t.batch_stride % 8 == 0 && t.row_stride % 8 == 0 &&
         t.head_stride % 8 == 0;
}

// Runs the call's graph; returns false (running nothing) when there is none,
// with the reason in `why`, or when `bytes` fall short of its workspace, with
// the shortfall in `short_of`.
bool run(const Args& a, bool backward, int device, void* stream, void* workspace, size_t bytes,
         std::string& why, std::string& short_of) {
  validate(a, backward);
  DeviceScope scope(device);
  Lookup l = lookup(a, backward, device);
  if (!l.entry || !l.entry->graph) {
    why = l.reason;
    return false;
  }
  if (bytes < static_cast<size_t>(l.entry->workspace) || (l.entry->workspace > 0 && workspace == nullptr)) {
    short_of = "the workspace has " + std::to_string(bytes) + " bytes; it needs " +
               std::to_string(l.entry->workspace);
    return false;
  }
  if (reinterpret_cast<uintptr_t>(workspace) % 256 != 0)
    throw InvalidArgument("attention (cuDNN): the workspace must be 256-byte aligned");
#if CUDART_VERSION >= 12080
  if (stream) {
    int stream_device = -1;
    check_cuda(cudaStreamGetDevice(static_cast<cudaStream_t>(stream), &stream_device), "cudaStreamGetDevice");
    if (stream_device != device)
      throw InvalidArgument("attention (cuDNN): the stream belongs to device " + std::to_string(stream_device) +
                            " but the tensors are on device " + std::to_string(device));
  }
#endif
  std::unordered_map<int64_t, void*> pack{{kQ, a.q.data}, {kK, a.k.data}, {kV, a.v.data},
                                          {kO, a.out.data}, {kStats, a.lse}};
  if (backward) {
    pack[kDO] = a.dout.data;
    pack[kDQ] = a.dq.data;
    pack[kDK] = a.dk.data;
    pack[kDV] = a.dv.data;
  }
  std::lock_guard<std::mutex> lock(l.handle->mu);
  check_cudnn(fe::detail::set_stream(l.handle->handle, static_cast<cudaStream_t>(stream)), "cudnnSetStream");
  fe::error_t status = l.entry->graph->execute(l.handle->handle, pack, workspace);
  if (status.is_bad())
    throw std::runtime_error("attention (cuDNN): executing the " + std::string(backward ? "backward" : "forward") +
                             " graph failed: " + status.get_message());
  return true;
}

void execute(const Args& a, bool backward, int device, void* stream, void* workspace, size_t bytes) {
  std::string why, short_of;
  if (run(a, backward, device, stream, workspace, bytes, why, short_of)) return;
  if (!why.empty()) throw Unsupported("attention (cuDNN): this call cannot run through cuDNN: " + why);
  throw InvalidArgument("attention (cuDNN): " + short_of + " (from prepare)");
}

}  // namespace

std::string unavailable_reason() { return library().error; }

std::string version_string() {
  const Library& lib = library();
  std::string fe_version = "frontend " + frontend_version();
  if (lib.version == 0) return fe_version;
  const size_t v = lib.version;
  return "cuDNN " + std::to_string(v / 10000) + "." + std::to_string(v / 100 % 100) + "." +
         std::to_string(v % 100) + " (" + fe_version + ")";
}

std::string unsupported_reason(const Args& a, bool backward) {
  if (a.q.dtype != DType::F16 && a.q.dtype != DType::BF16) return "cuDNN takes float16 and bfloat16 only";
  if (a.head_dim % 8 != 0 || a.head_dim > 256) return "cuDNN takes head dims that are multiples of 8 up to 256";
  if (a.varlen()) return "variable-length batches (cu_seqlens) run on the own kernels";
  if (a.bias.data) return "an additive bias runs on the own kernels";
  if (a.mask.data) return "a boolean mask runs on the own kernels";
  if (a.alibi_slopes) return "ALiBi slopes run on the own kernels";
  if (a.softcap > 0) return "softcap runs on the own kernels";
  if (a.dropout_p > 0)
    return "dropout runs on the own kernels (its counter-based keep mask differs from cuDNN's generator)";
  if (a.window_right > 0) return "a window with a right side other than 0 (causal) or -1 runs on the own kernels";
  if (a.window_left >= 0 && a.window_right != 0)
    return "a sliding window without causal masking runs on the own kernels";
  if (causal_like(a) && a.seqlen_q > a.seqlen_k)
    return "causal masking with seqlen_q > seqlen_k (rows with no visible key) runs on the own kernels";
  if (a.batch == 0 || a.seqlen_q == 0 || a.seqlen_k == 0) return "empty calls run on the own kernels";
  const Tensor* tensors[] = {&a.q, &a.k, &a.v, &a.out, &a.dout, &a.dq, &a.dk, &a.dv};
  for (int n = 0; n < (backward ? 8 : 4); ++n) {
    if (!aligned(*tensors[n])) return "cuDNN needs 16-byte aligned rows";
    if (tensors[n]->row_stride == 0 || tensors[n]->head_stride == 0)
      return "cuDNN needs tensors without broadcast (stride 0) rows or heads";
  }
  if (reinterpret_cast<uintptr_t>(a.lse) % 16 != 0) return "cuDNN needs a 16-byte aligned lse";
  return "";
}

Prepared prepare(const Args& a, bool backward, int device) {
  Prepared p;
  validate(a, backward);
  DeviceScope scope(device);
  Lookup l = lookup(a, backward, device);
  if (!l.entry || !l.entry->graph) {
    p.reason = l.reason;
    return p;
  }
  p.ok = true;
  p.workspace_bytes = static_cast<size_t>(l.entry->workspace);
  return p;
}

void forward(const Args& a, int device, void* stream, void* workspace, size_t bytes) {
  execute(a, false, device, stream, workspace, bytes);
}

void backward(const Args& a, int device, void* stream, void* workspace, size_t bytes) {
  execute(a, true, device, stream, workspace, bytes);
}

std::string try_run(const Args& a, bool backward, int device, void* stream, void* workspace, size_t bytes) {
  std::string why, short_of;
  if (run(a, backward, device, stream, workspace, bytes, why, short_of)) return "";
  return why.empty() ? short_of : why;
}

}  // namespace symheap::attention::cudnn
