// Python bindings of the KV-cache attention core (decode.hpp). A call's
// options are set on an AttentionCacheCall and its torch tensors handed to
// attention_cache_torch, which reads them in C++ (address, dtype, shape,
// element strides, device); the core checks them (cache_args) and runs on the
// cpu or CUDA without the GIL. set_tensor describes a tensor by its fields
// (the JAX front end's plans, made from shapes at trace time).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <array>
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

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

// Describes each tensor argument that is not None, read through the bindings'
// torch reader; all must be on q's device. Returns that device (-1: the cpu).
int describe(CacheCall& c, const TensorArgs& args) {
  bindings::TensorRef q_place;  // q's device only, for the message of a mismatch
  for (size_t i = 0; i < args.size(); ++i) {
    bindings::TensorRef r = bindings::read_layout(args[i]);
    if (!r.present) continue;
    const char* name = kTensorArgs[i].name;
    if (!r.is_tensor)
      throw py::type_error(
          std::string("attention: ") + name + " must be a torch.Tensor, got " +
          py::str(py::type::handle_of(args[i]).attr("__name__")).cast<std::string>());
    if (i == 0) {
      q_place.device = r.device;
    } else if (r.device != q_place.device) {
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
  return q_place.device;
}

#ifdef SYMHEAP_WITH_CUDA
// torch.empty's keyword arguments for a float32 workspace on `device` (used
// where torch's C++ API is not loaded), made once per device; GIL held.
const py::dict& workspace_kwargs(int device) {
  static std::map<int, py::dict*> made;  // never freed: outlives the interpreter's teardown
  py::dict*& kw = made[device];
  if (!kw) kw = new py::dict(bindings::empty_kwargs(bindings::TorchDType::F32, device));
  return *kw;
}
#endif

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
  // plan, the workspace from torch's caching allocator on the current stream
  // (capturable in a CUDA graph) and the launch there.
  m.def("attention_cache_torch", [](CacheCall& c, py::handle q, py::handle k_cache,
                                    py::handle v_cache, py::handle k, py::handle v,
                                    py::handle out, py::handle lse, py::handle cache_seqlens,
                                    py::handle cu_seqlens_q, py::handle cu_seqlens_k,
                                    py::handle block_table, py::handle alibi_slopes) {
    const int device = describe(c, {q, k_cache, v_cache, k, v, out, lse, cache_seqlens,
                                    cu_seqlens_q, cu_seqlens_k, block_table, alibi_slopes});
    const CacheArgs a = cache_args(c);
    if (device < 0) {
      py::gil_scoped_release nogil;
      cache_attention_cpu(a, 0);
      return;
    }
#ifdef SYMHEAP_WITH_CUDA
    const CacheCudaPlan plan = cache_attention_cuda_plan(a, device);
    const uintptr_t stream = bindings::torch_current_stream(device);
    py::object workspace;  // freed after the launch, in the stream's order
    uintptr_t data = 0;
    if (plan.bytes > 0) {
      const std::vector<int64_t> floats{static_cast<int64_t>((plan.bytes + 3) / 4)};
      workspace = bindings::torch_empty(floats, bindings::TorchDType::F32, device,
                                        workspace_kwargs(device));
      data = bindings::tensor_data_ptr(workspace);
    }
    py::gil_scoped_release nogil;
    cache_attention_cuda(a, plan, reinterpret_cast<void*>(stream), reinterpret_cast<void*>(data),
                         plan.bytes);
#else
    throw InvalidArgument("attention: q is on a CUDA device but symheap was built without CUDA");
#endif
  });

#ifdef SYMHEAP_WITH_CUDA
  m.def("attention_cache_check_cuda", [](int device, uintptr_t stream, bool sync) {
    py::gil_scoped_release nogil;
    cache_check_cuda(device, reinterpret_cast<void*>(stream), sync);
  });
#endif
}
