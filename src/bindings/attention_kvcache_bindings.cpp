// Python bindings of the KV-cache attention core (decode.hpp). A call's
// options are set on an AttentionCacheCall and its torch tensors handed to
// attention_cache_torch, which reads them in C++ (address, dtype, shape,
// element strides, device); the core checks them (cache_args) and runs on the
// cpu or CUDA without the GIL. attention_kvcache_eager is the decode call's
// whole eager path in one C++ call where its arguments need no conversion.
// set_tensor describes a tensor by its fields (the JAX front end's plans,
// made from shapes at trace time).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <array>
#include <cstdint>
#include <deque>
#include <limits>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "bindings/plain_values.hpp"
#include "bindings/registry.hpp"
#include "bindings/torch_tensor.hpp"
#include "ops/attention/decode.hpp"
#include "symheap/errors.hpp"

namespace py = pybind11;
using namespace symheap;
using namespace symheap::attention;

namespace {

// A CacheCall's tensor arguments by name, in attention_cache_torch's order.
struct TensorArg {
  const char* name;
  TensorDesc CacheCall::*member;
};
constexpr std::array<TensorArg, 12> kTensorArgs = {{
    {"q", &CacheCall::q},
    {"k_cache", &CacheCall::k_cache},
    {"v_cache", &CacheCall::v_cache},
    {"k", &CacheCall::k},
    {"v", &CacheCall::v},
    {"out", &CacheCall::out},
    {"lse", &CacheCall::lse},
    {"cache_seqlens", &CacheCall::cache_seqlens},
    {"cu_seqlens_q", &CacheCall::cu_seqlens_q},
    {"cu_seqlens_k", &CacheCall::cu_seqlens_k},
    {"block_table", &CacheCall::block_table},
    {"alibi_slopes", &CacheCall::alibi_slopes},
}};
using TensorArgs = std::array<py::handle, kTensorArgs.size()>;

TensorDesc& call_tensor(CacheCall& c, const std::string& name) {
  for (const TensorArg& arg : kTensorArgs)
    if (name == arg.name) return c.*arg.member;
  throw InvalidArgument("attention (kv cache): no tensor argument '" + name + "'");
}

// torch's name of a dtype the reader does not know ("float64" for torch.float64).
std::string other_dtype_name(py::handle tensor) {
  const std::string name = py::str(tensor.attr("dtype"));
  return name.rfind("torch.", 0) == 0 ? name.substr(6) : name;
}

using TensorRefs = std::array<bindings::TensorRef, kTensorArgs.size()>;

TensorRefs read_args(const TensorArgs& args) {
  TensorRefs refs;
  for (size_t i = 0; i < args.size(); ++i) refs[i] = bindings::read_layout(args[i]);
  return refs;
}

// Describes each tensor argument that is not None (read by read_args); all
// must be on q's device. Returns that device (-1: the cpu).
int describe(CacheCall& c, const TensorArgs& args, TensorRefs& refs) {
  int q_device = -1;
  for (size_t i = 0; i < args.size(); ++i) {
    bindings::TensorRef& r = refs[i];
    if (!r.present) continue;
    const char* name = kTensorArgs[i].name;
    if (!r.is_tensor)
      throw py::type_error(
          std::string("attention: ") + name + " must be a torch.Tensor, got " +
          py::str(py::type::handle_of(args[i]).attr("__name__")).cast<std::string>());
    bindings::require_usable_device(r, "attention: ", name);
    if (i == 0) {
      q_device = r.device;
    } else if (r.device != q_device) {
      bindings::TensorRef q_place;  // for the message
      q_place.device = q_device;
      throw InvalidArgument(std::string("attention: ") + name + " is on " + r.device_str() +
                            " but q is on " + q_place.device_str());
    }
    TensorDesc& t = c.*kTensorArgs[i].member;
    t.present = true;
    t.data = reinterpret_cast<const void*>(r.ptr);
    t.dtype = r.dtype == bindings::TorchDType::Other ? other_dtype_name(args[i])
                                                     : bindings::torch_dtype_name(r.dtype);
    t.shape = std::move(r.shape);
    t.strides = std::move(r.strides);
  }
  return q_device;
}

// Recycled tensors of the KV-cache calls, per (device, q's dtype, inference
// mode): the eager decode call's out and lse (each back in its pool once its
// caller drops it) and every CUDA call's workspace. Tensors over
// kPoolMaxBytes, and all of them while the stream is captured into a CUDA
// graph (the graph's memory pool must own what its replays write), are made
// per call. Used under the GIL.
using bindings::kPoolMaxBytes;
constexpr size_t kPooled = bindings::kPoolEntries;

struct CachePools {
  int device;
  bindings::TorchDType dtype;
  bool inference;
  bindings::TensorPool out, lse, workspace;
};

CachePools& pools_of(int device, bindings::TorchDType dtype, bool inference) {
  // Never freed (outlives the interpreter's teardown); a deque keeps each
  // entry in place while another thread adds one during a GIL release.
  static auto* pools = new std::deque<CachePools>;
  for (CachePools& p : *pools)
    if (p.device == device && p.dtype == dtype && p.inference == inference) return p;
  using bindings::TensorPool;
  using bindings::TorchDType;
  pools->push_back(CachePools{device, dtype, inference, TensorPool(dtype, device, kPooled),
                              TensorPool(TorchDType::F32, device, kPooled),
                              TensorPool(TorchDType::I64, device, kPooled, /*internal=*/true)});
  return pools->back();
}

py::object take(bindings::TensorPool& pool, const std::vector<int64_t>& shape,
                int64_t element_bytes, uintptr_t stream, bool capturing, uintptr_t* data) {
  int64_t bytes = element_bytes;
  for (int64_t d : shape) bytes *= d;
  if (capturing || bytes > kPoolMaxBytes) return pool.make(shape, data);
  return pool.take(shape, stream, data);
}

// Where a call runs: its pools and, on CUDA, torch's current stream of the device.
struct Placement {
  uintptr_t stream = 0;
  bool capturing = false;
  CachePools* pools = nullptr;
};

Placement placement(int device, bindings::TorchDType dtype) {
  Placement at;
  at.pools = &pools_of(device, dtype, bindings::torch_inference_mode());
  if (device < 0) return at;
  at.stream = bindings::torch_current_stream(device);
#ifdef SYMHEAP_WITH_CUDA
  at.capturing = cache_stream_capturing(reinterpret_cast<void*>(at.stream));
#endif
  return at;
}

// Runs a described call with the GIL released: on the cpu (device -1), or on
// CUDA with one plan, its workspace and the launch on the placement's stream.
void launch(const CacheCall& c, int device, const Placement& at) {
  const CacheArgs a = cache_args(c);
  if (device < 0) {
    py::gil_scoped_release nogil;
    cache_attention_cpu(a, 0);
    return;
  }
#ifdef SYMHEAP_WITH_CUDA
  const CacheCudaPlan plan = cache_attention_cuda_plan(a, device);
  py::object workspace;  // back in its pool (or freed) after the launch, in the stream's order
  uintptr_t data = 0;
  if (plan.bytes > 0) {
    const std::vector<int64_t> words{static_cast<int64_t>((plan.bytes + 7) / 8)};
    workspace = take(at.pools->workspace, words, 8, at.stream, at.capturing, &data);
  }
  py::gil_scoped_release nogil;
  cache_attention_cuda(a, plan, reinterpret_cast<void*>(at.stream), reinterpret_cast<void*>(data),
                       plan.bytes);
#else
  (void)at;
  throw InvalidArgument("attention: q is on a CUDA device but symheap was built without CUDA");
#endif
}

bool unit_rows(const bindings::TensorRef& r) {
  return !r.present || r.strides.empty() || r.strides.back() == 1;
}

int64_t element_bytes(bindings::TorchDType t) {
  return t == bindings::TorchDType::F32 ? 4 : 2;
}

// flash_attn_with_kvcache in one C++ call: out, or (out, lse) with
// `return_lse`. None where the call needs the front end's general path:
// an option that is not a plain value (an exact bool, int or float, a tuple
// of two ints), an int cache_seqlens, an input that needs a copy (a last
// dimension of stride other than 1, alibi slopes that are not contiguous
// float32), a tensor that requires grad while grad mode is on, or a tensor
// the C++ reader did not read (a device other than the cpu and CUDA).
py::object decode_eager(py::handle q, py::handle k_cache, py::handle v_cache, py::handle k,
                        py::handle v, py::handle cache_seqlens, py::handle block_table,
                        py::handle causal, py::handle window, py::handle softmax_scale,
                        py::handle softcap, py::handle alibi_slopes, py::handle num_splits,
                        py::handle return_lse) {
  using bindings::TorchDType;
  if (!PyBool_Check(causal.ptr()) || !PyBool_Check(return_lse.ptr())) return py::none();
  if (!PyTuple_CheckExact(window.ptr()) || PyTuple_GET_SIZE(window.ptr()) != 2) return py::none();
  int64_t win[2] = {}, splits = 0;
  for (int i = 0; i < 2; ++i)
    if (!bindings::exact_int(PyTuple_GET_ITEM(window.ptr(), i), &win[i])) return py::none();
  double scale = 0, cap = 0;
  const bool has_scale = !softmax_scale.is_none();
  if ((has_scale && !bindings::plain_number(softmax_scale, &scale)) ||
      !bindings::plain_number(softcap, &cap) || !bindings::exact_int(num_splits, &splits))
    return py::none();

  const py::handle none(Py_None);
  TensorArgs args = {q,    k_cache, v_cache, k,    v,           none,
                     none, cache_seqlens, none, none, block_table, alibi_slopes};
  TensorRefs refs = read_args(args);
  for (const bindings::TensorRef& r : refs)
    if (r.present && !r.native) return py::none();
  const bindings::TensorRef &rq = refs[0], &slopes = refs[11];
  if (!rq.present || rq.shape.size() != 4 || rq.strides[3] != 1) return py::none();
  if (rq.dtype != TorchDType::F32 && rq.dtype != TorchDType::F16 && rq.dtype != TorchDType::BF16)
    return py::none();
  if (!unit_rows(refs[3]) || !unit_rows(refs[4]) || !unit_rows(refs[7]) || !unit_rows(refs[10]))
    return py::none();
  if (slopes.present && (slopes.dtype != TorchDType::F32 || !slopes.contiguous)) return py::none();
  if (bindings::torch_grad_enabled())
    for (int i = 0; i < 5; ++i)
      if (refs[i].present && bindings::requires_grad(args[i])) return py::none();

  // Outputs: out like q (contiguous), lse (B, Hq, Sq) float32.
  const int device = rq.device;
  const int64_t head_dim = rq.shape[3];
  const std::vector<int64_t> out_shape = rq.shape;
  const std::vector<int64_t> lse_shape{rq.shape[0], rq.shape[2], rq.shape[1]};
  Placement at = placement(device, rq.dtype);
  CachePools& pools = *at.pools;
  uintptr_t out_ptr = 0, lse_ptr = 0;
  py::object out =
      take(pools.out, out_shape, element_bytes(rq.dtype), at.stream, at.capturing, &out_ptr);
  py::object lse = take(pools.lse, lse_shape, 4, at.stream, at.capturing, &lse_ptr);
  auto output_ref = [&](uintptr_t ptr, const std::vector<int64_t>& shape, TorchDType dtype) {
    bindings::TensorRef r;
    r.present = r.is_tensor = r.native = true;
    r.ptr = ptr;
    r.dtype = dtype;
    r.device = device;
    r.shape = shape;
    r.strides = bindings::contiguous_strides(shape);
    return r;
  };
  args[5] = out;
  args[6] = lse;
  refs[5] = output_ref(out_ptr, out_shape, rq.dtype);
  refs[6] = output_ref(lse_ptr, lse_shape, TorchDType::F32);

  CacheCall c;
  describe(c, args, refs);
  set_cache_options(c, head_dim, causal.ptr() == Py_True, win[0], win[1],
                    has_scale ? &scale : nullptr, cap);
  c.num_splits = splits;
  launch(c, device, at);
  if (return_lse.ptr() == Py_True) return py::make_tuple(std::move(out), std::move(lse));
  return out;
}

}  // namespace

SYMHEAP_BINDINGS(attention_kvcache) {
  py::class_<CacheCall>(m, "AttentionCacheCall")
      .def(py::init<>())
      .def_readwrite("max_seqlen_q", &CacheCall::max_seqlen_q)
      .def_readwrite("scale", &CacheCall::scale)
      .def_readwrite("softcap", &CacheCall::softcap)
      .def_readwrite("window_left", &CacheCall::window_left)
      .def_readwrite("window_right", &CacheCall::window_right)
      .def_readwrite("num_splits", &CacheCall::num_splits)
      .def("set_tensor", [](CacheCall& c, const std::string& name, uintptr_t ptr,
                            const std::string& dtype, std::vector<int64_t> shape,
                            std::vector<int64_t> strides) {
        if (shape.size() != strides.size())
          throw InvalidArgument("attention (kv cache): " + name + ": shape and strides differ in length");
        TensorDesc& t = call_tensor(c, name);
        t.present = true;
        t.data = reinterpret_cast<const void*>(ptr);
        t.dtype = dtype;
        t.shape = std::move(shape);
        t.strides = std::move(strides);
      });

  // One call from torch tensors (None: absent), on q's device: on CUDA, one
  // plan, the workspace from the pools (or torch's caching allocator) on the
  // current stream (capturable in a CUDA graph) and the launch there.
  m.def("attention_cache_torch", [](CacheCall& c, py::handle q, py::handle k_cache,
                                    py::handle v_cache, py::handle k, py::handle v,
                                    py::handle out, py::handle lse, py::handle cache_seqlens,
                                    py::handle cu_seqlens_q, py::handle cu_seqlens_k,
                                    py::handle block_table, py::handle alibi_slopes) {
    const TensorArgs args = {q,   k_cache,      v_cache,      k,           v,
                             out, lse,          cache_seqlens, cu_seqlens_q, cu_seqlens_k,
                             block_table, alibi_slopes};
    TensorRefs refs = read_args(args);
    const bindings::TorchDType dtype = refs[0].dtype;
    const int device = describe(c, args, refs);
    launch(c, device, placement(device, dtype));
  });

  m.def("attention_kvcache_eager", &decode_eager,
        "flash_attn_with_kvcache where its arguments need no conversion: out, or (out, lse); "
        "None otherwise (the front end's general path).");

  // The scalar options of a call from the user's (softmax_scale None: the default).
  m.def("attention_cache_options", [](int64_t head_dim, bool causal, int64_t window_left,
                                      int64_t window_right, std::optional<double> softmax_scale,
                                      double softcap) {
    CacheCall c;
    set_cache_options(c, head_dim, causal, window_left, window_right,
                      softmax_scale ? &*softmax_scale : nullptr, softcap);
    py::dict options;
    options["window_left"] = c.window_left;
    options["window_right"] = c.window_right;
    options["scale"] = static_cast<double>(c.scale);
    options["softcap"] = static_cast<double>(c.softcap);
    return options;
  });

#ifdef SYMHEAP_WITH_CUDA
  m.def("attention_cache_check_cuda", [](int device, uintptr_t stream, bool sync) {
    py::gil_scoped_release nogil;
    cache_check_cuda(device, reinterpret_cast<void*>(stream), sync);
  });
#endif
}
