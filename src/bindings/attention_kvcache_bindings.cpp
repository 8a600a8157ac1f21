// Python bindings of the KV-cache attention core (decode.hpp). The Python
// wrapper describes each tensor (address, dtype name, shape, element strides)
// in an AttentionCacheCall; the core checks them (cache_args) and runs on the
// cpu or CUDA without the GIL.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <string>
#include <vector>

#include "bindings/registry.hpp"
#include "ops/attention/decode.hpp"
#include "symheap/errors.hpp"

namespace py = pybind11;
using namespace symheap;
using namespace symheap::attention;

namespace {

TensorDesc& call_tensor(CacheCall& c, const std::string& name) {
  if (name == "q") return c.q;
  if (name == "k_cache") return c.k_cache;
  if (name == "v_cache") return c.v_cache;
  if (name == "k") return c.k;
  if (name == "v") return c.v;
  if (name == "out") return c.out;
  if (name == "lse") return c.lse;
  if (name == "cache_seqlens") return c.cache_seqlens;
  if (name == "cu_seqlens_q") return c.cu_seqlens_q;
  if (name == "cu_seqlens_k") return c.cu_seqlens_k;
  if (name == "block_table") return c.block_table;
  if (name == "alibi_slopes") return c.alibi_slopes;
  throw InvalidArgument("attention (kv cache): no tensor argument '" + name + "'");
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

  m.def(
      "attention_cache_cpu",
      [](const CacheCall& c, int threads) {
        const CacheArgs a = cache_args(c);
        py::gil_scoped_release nogil;
        cache_attention_cpu(a, threads);
      },
      py::arg("call"), py::arg("threads") = 0);

#ifdef SYMHEAP_WITH_CUDA
  m.def("attention_cache_cuda_workspace_bytes", [](const CacheCall& c, int device) {
    return cache_attention_cuda_workspace_bytes(cache_args(c), device);
  });
  m.def("attention_cache_cuda", [](const CacheCall& c, int device, uintptr_t stream,
                                   uintptr_t workspace, size_t bytes) {
    const CacheArgs a = cache_args(c);
    py::gil_scoped_release nogil;
    cache_attention_cuda(a, device, reinterpret_cast<void*>(stream),
                         reinterpret_cast<void*>(workspace), bytes);
  });
  m.def("attention_cache_check_cuda", [](int device, uintptr_t stream, bool sync) {
    py::gil_scoped_release nogil;
    cache_check_cuda(device, reinterpret_cast<void*>(stream), sync);
  });
#endif
}
