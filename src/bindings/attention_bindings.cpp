// Python bindings of the attention op core. The Python wrapper fills an
// AttentionArgs from tensors (raw addresses and element strides) and calls the
// cpu or CUDA entry point; the GIL is released while the op runs.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <string>

#include "bindings/registry.hpp"
#include "bindings/torch_tensor.hpp"
#include "ops/attention/attention.hpp"
#include "symheap/errors.hpp"

namespace py = pybind11;
using namespace symheap;
using namespace symheap::attention;

namespace {

DType parse_dtype(const std::string& name) {
  if (name == "float32") return DType::F32;
  if (name == "float16") return DType::F16;
  if (name == "bfloat16") return DType::BF16;
  throw InvalidArgument("attention: unsupported dtype '" + name +
                        "': use float16, bfloat16 (or float32 on cpu)");
}

template <class T>
T* as_ptr(uintptr_t addr) {
  return reinterpret_cast<T*>(addr);
}

Tensor& tensor_field(Args& a, const std::string& name) {
  if (name == "q") return a.q;
  if (name == "k") return a.k;
  if (name == "v") return a.v;
  if (name == "out") return a.out;
  if (name == "dout") return a.dout;
  if (name == "dq") return a.dq;
  if (name == "dk") return a.dk;
  if (name == "dv") return a.dv;
  throw InvalidArgument("attention: no tensor field '" + name + "'");
}

Broadcast& broadcast_field(Args& a, const std::string& name) {
  if (name == "bias") return a.bias;
  if (name == "mask") return a.mask;
  if (name == "dbias") return a.dbias;
  throw InvalidArgument("attention: no broadcast field '" + name + "'");
}

// The address and (batch, row, head) element strides of a fixed-length
// (B, S, H, D) tensor; its shape and dtype were checked when its plan was made.
void fill_tensor(Tensor& t, const bindings::TensorRef& r) {
  t.data = as_ptr<void>(r.ptr);
  t.batch_stride = r.strides[0];
  t.row_stride = r.strides[1];
  t.head_stride = r.strides[2];
}

// Forward of a fixed-length call from its plan's arguments (shapes, options,
// dtypes) and the call's tensors: one entry, the GIL released while it runs.
// On CUDA it runs on `stream`, default torch's current stream of q's device.
void forward_tensors(const Args& plan, py::handle q, py::handle k, py::handle v, py::handle out,
                     py::handle lse, py::handle stream) {
  Args a = plan;
  const auto tq = bindings::read_address(q), tk = bindings::read_address(k),
             tv = bindings::read_address(v), to = bindings::read_address(out),
             tl = bindings::read_address(lse);
  fill_tensor(a.q, tq);
  fill_tensor(a.k, tk);
  fill_tensor(a.v, tv);
  fill_tensor(a.out, to);
  a.lse = as_ptr<float>(tl.ptr);  // (B, Hq, Sq) float32
  a.lse_batch_stride = tl.strides[0];
  a.lse_head_stride = tl.strides[1];
  const int device = tq.device;
  if (device < 0) {
    py::gil_scoped_release nogil;
    forward_cpu(a, 0);
    return;
  }
#ifdef SYMHEAP_WITH_CUDA
  const uintptr_t h =
      stream.is_none() ? bindings::torch_current_stream(device) : stream.cast<uintptr_t>();
  py::gil_scoped_release nogil;
  forward_cuda(a, device, as_ptr<void>(h));
#else
  (void)stream;
  throw InvalidArgument("attention: q is on a CUDA device but symheap was built without CUDA");
#endif
}

}  // namespace

SYMHEAP_BINDINGS(attention) {
  py::class_<Args>(m, "AttentionArgs")
      .def(py::init<>())
      .def_readwrite("batch", &Args::batch)
      .def_readwrite("heads_q", &Args::heads_q)
      .def_readwrite("heads_kv", &Args::heads_kv)
      .def_readwrite("head_dim", &Args::head_dim)
      .def_readwrite("seqlen_q", &Args::seqlen_q)
      .def_readwrite("seqlen_k", &Args::seqlen_k)
      .def_readwrite("total_q", &Args::total_q)
      .def_readwrite("total_k", &Args::total_k)
      .def_readwrite("scale", &Args::scale)
      .def_readwrite("softcap", &Args::softcap)
      .def_readwrite("window_left", &Args::window_left)
      .def_readwrite("window_right", &Args::window_right)
      .def_readwrite("alibi_batch_stride", &Args::alibi_batch_stride)
      .def_readwrite("dropout_p", &Args::dropout_p)
      .def_readwrite("seed", &Args::seed)
      .def_readwrite("offset", &Args::offset)
      .def_readwrite("lse_batch_stride", &Args::lse_batch_stride)
      .def_readwrite("lse_head_stride", &Args::lse_head_stride)
      .def_readwrite("deterministic", &Args::deterministic)
      .def("set_tensor",
           [](Args& a, const std::string& name, uintptr_t ptr, const std::string& dtype,
              int64_t batch_stride, int64_t row_stride, int64_t head_stride) {
             Tensor& t = tensor_field(a, name);
             t.data = as_ptr<void>(ptr);
             t.dtype = parse_dtype(dtype);
             t.batch_stride = batch_stride;
             t.row_stride = row_stride;
             t.head_stride = head_stride;
           })
      .def("set_broadcast",
           [](Args& a, const std::string& name, uintptr_t ptr, const std::string& dtype,
              int64_t sb, int64_t sh, int64_t sq, int64_t sk, bool kv_heads) {
             Broadcast& x = broadcast_field(a, name);
             x.data = as_ptr<void>(ptr);
             x.dtype = name == "mask" ? DType::F32 : parse_dtype(dtype);  // mask: bytes
             x.sb = sb;
             x.sh = sh;
             x.sq = sq;
             x.sk = sk;
             x.kv_heads = kv_heads;
           })
      .def("set_pointer", [](Args& a, const std::string& name, uintptr_t ptr) {
        if (name == "lse") a.lse = as_ptr<float>(ptr);
        else if (name == "cu_seqlens_q") a.cu_seqlens_q = as_ptr<const int32_t>(ptr);
        else if (name == "cu_seqlens_k") a.cu_seqlens_k = as_ptr<const int32_t>(ptr);
        else if (name == "alibi_slopes") a.alibi_slopes = as_ptr<const float>(ptr);
        else throw InvalidArgument("attention: no pointer field '" + name + "'");
      });

  m.def(
      "attention_forward_cpu",
      [](const Args& a, int threads) {
        py::gil_scoped_release nogil;
        forward_cpu(a, threads);
      },
      py::arg("args"), py::arg("threads") = 0);
  m.def(
      "attention_backward_cpu",
      [](const Args& a, int threads) {
        py::gil_scoped_release nogil;
        backward_cpu(a, threads);
      },
      py::arg("args"), py::arg("threads") = 0);
  m.def("attention_forward_tensors", &forward_tensors, py::arg("plan_args"), py::arg("q"),
        py::arg("k"), py::arg("v"), py::arg("out"), py::arg("lse"), py::arg("stream") = py::none());
  m.def("attention_dropout_bits", &dropout_bits, py::arg("seed"), py::arg("offset"),
        py::arg("bh"), py::arg("i"), py::arg("j"));
  m.def("attention_dropout_threshold", &dropout_threshold);
  // Keep mask of one (b*H_q + h) slice as a flat bytes object, row-major [sq][sk].
  m.def("attention_dropout_keep", [](uint64_t seed, uint64_t offset, uint32_t bh, int sq, int sk,
                                     float p) {
    if (sq < 0 || sk < 0) throw InvalidArgument("attention: negative shape");
    uint32_t threshold = dropout_threshold(p);
    std::string keep(static_cast<size_t>(sq) * sk, '\0');
    {
      py::gil_scoped_release nogil;
      for (int i = 0; i < sq; ++i)
        for (int j = 0; j < sk; ++j)
          keep[static_cast<size_t>(i) * sk + j] =
              dropout_bits(seed, offset, bh, static_cast<uint32_t>(i), static_cast<uint32_t>(j)) >=
              threshold;
    }
    return py::bytes(keep);
  });

#ifdef SYMHEAP_WITH_CUDA
  m.attr("attention_has_cuda") = true;
  m.def("attention_forward_cuda", [](const Args& a, int device, uintptr_t stream) {
    py::gil_scoped_release nogil;
    forward_cuda(a, device, as_ptr<void>(stream));
  });
  m.def("attention_backward_cuda_workspace_bytes", &backward_cuda_workspace_bytes);
  m.def("attention_backward_cuda", [](const Args& a, int device, uintptr_t stream,
                                      uintptr_t workspace, size_t bytes) {
    py::gil_scoped_release nogil;
    backward_cuda(a, device, as_ptr<void>(stream), as_ptr<void>(workspace), bytes);
  });
#else
  m.attr("attention_has_cuda") = false;
#endif
}
