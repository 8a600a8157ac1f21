// Python bindings of the attention op core. The Python wrapper fills an
// AttentionArgs from tensors (raw addresses and element strides) and calls the
// cpu or CUDA entry point; the GIL is released while the op runs.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <utility>

#include "bindings/registry.hpp"
#include "bindings/torch_tensor.hpp"
#include "ops/attention/attention.hpp"
#include "ops/attention/call_plan.hpp"
#include "ops/attention/path_choice.hpp"
#ifdef SYMHEAP_WITH_CUDNN
#include "ops/attention/cudnn_attention.hpp"
#elif !defined(SYMHEAP_CUDNN_MISSING)
#define SYMHEAP_CUDNN_MISSING "the build did not look for cuDNN"
#endif
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

// (shape, dtype name) or None.
ArgSpec arg_spec(const py::object& o) {
  ArgSpec s;
  if (o.is_none()) return s;
  auto t = o.cast<py::tuple>();
  s.present = true;
  s.shape = t[0].cast<std::vector<int64_t>>();
  s.dtype = t[1].cast<std::string>();
  return s;
}

py::tuple dims(const BroadcastPlan& b) { return py::make_tuple(b.dims[0], b.dims[1], b.dims[2], b.dims[3]); }

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
  for (const auto* t : {&tq, &tk, &tv, &to, &tl})
    bindings::require_usable_device(*t, "attention: ", "a tensor");
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
  // The checks and shape plan of one call (call_plan.hpp): each array given
  // as (shape, dtype name) or None. Raises ValueError naming the argument.
  m.def(
      "attention_plan_call",
      [](bool varlen, bool on_cuda, py::object q, py::object k, py::object v, py::object bias,
         py::object mask, py::object alibi_slopes, py::object cu_seqlens_q, py::object cu_seqlens_k,
         int64_t max_seqlen_q, int64_t max_seqlen_k, bool causal, int64_t window_left,
         int64_t window_right, py::object softmax_scale, double softcap, double dropout_p) {
        CallSpec s;
        s.varlen = varlen;
        s.on_cuda = on_cuda;
        s.q = arg_spec(q);
        s.k = arg_spec(k);
        s.v = arg_spec(v);
        s.bias = arg_spec(bias);
        s.mask = arg_spec(mask);
        s.alibi_slopes = arg_spec(alibi_slopes);
        s.cu_seqlens_q = arg_spec(cu_seqlens_q);
        s.cu_seqlens_k = arg_spec(cu_seqlens_k);
        s.max_seqlen_q = max_seqlen_q;
        s.max_seqlen_k = max_seqlen_k;
        s.causal = causal;
        s.window_left = window_left;
        s.window_right = window_right;
        s.has_scale = !softmax_scale.is_none();
        if (s.has_scale) s.softmax_scale = softmax_scale.cast<double>();
        s.softcap = softcap;
        s.dropout_p = dropout_p;
        const CallPlan p = plan_call(s);
        py::dict r;
        r["batch"] = p.batch;
        r["heads_q"] = p.heads_q;
        r["heads_kv"] = p.heads_kv;
        r["head_dim"] = p.head_dim;
        r["head_dim_run"] = p.head_dim_run;
        r["seqlen_q"] = p.seqlen_q;
        r["seqlen_k"] = p.seqlen_k;
        r["scale"] = p.scale;
        r["window"] = py::make_tuple(p.window_left, p.window_right);
        r["bias_dims"] = p.bias.present ? py::object(dims(p.bias)) : py::object(py::none());
        r["bias_kv_heads"] = p.bias.kv_heads;
        r["bias_per_row"] = p.bias.per_row;
        r["mask_dims"] = p.mask.present ? py::object(dims(p.mask)) : py::object(py::none());
        r["mask_kv_heads"] = p.mask.kv_heads;
        r["scratch_forward"] = scratch_layout(p, false, false).total;
        r["scratch_backward"] = scratch_layout(p, true, p.bias.present).total;
        r["cudnn_reserve_forward"] = cudnn_workspace_reserve(p, false);
        r["cudnn_reserve_backward"] = cudnn_workspace_reserve(p, true);
        return r;
      },
      py::arg("varlen"), py::arg("on_cuda"), py::arg("q"), py::arg("k"), py::arg("v"),
      py::arg("bias") = py::none(), py::arg("mask") = py::none(),
      py::arg("alibi_slopes") = py::none(), py::arg("cu_seqlens_q") = py::none(),
      py::arg("cu_seqlens_k") = py::none(), py::arg("max_seqlen_q") = 0,
      py::arg("max_seqlen_k") = 0, py::arg("causal") = false, py::arg("window_left") = -1,
      py::arg("window_right") = -1, py::arg("softmax_scale") = py::none(),
      py::arg("softcap") = 0.0, py::arg("dropout_p") = 0.0);

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
              dropout_bits(seed, offset, bh, static_cast<uint32_t>(i), static_cast<uint64_t>(j)) >=
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

  // The path of a call (docs/attention.md): "auto", "cudnn" or "own".
  m.def("attention_choose_path", [](py::object backend, bool on_cuda) {
    std::optional<std::string> requested;
    if (!backend.is_none()) {
      if (!py::isinstance<py::str>(backend))
        throw InvalidArgument("attention: backend must be one of " + path_names() + ", got " +
                              py::repr(backend).cast<std::string>());
      requested = backend.cast<std::string>();
    }
    return std::string(path_name(choose_path(requested, on_cuda)));
  }, py::arg("backend"), py::arg("on_cuda"));
  m.attr("attention_path_env") = kPathEnv;
  // The own CUDA forward kernel a call of this (padded) head dim runs:
  // "hopper", "pipelined" or "basic" ($SYMHEAP_ATTN_OWN_FORWARD can force
  // any of them, or "pipelined_previous").
  m.def("attention_own_forward_kernel", [](int head_dim) { return std::string(own_forward_kernel(head_dim)); },
        py::arg("head_dim"));
  m.attr("attention_own_forward_env") = kOwnForwardEnv;
  // The Hopper forward kernel: (built, "" or the reason it is not).
  m.def("attention_hopper_forward_status", [] {
    const std::string why = hopper_forward_unavailable_reason();
    return std::make_pair(why.empty(), why);
  });
  // The same for the backward kernels ($SYMHEAP_ATTN_OWN_BACKWARD).
  m.def("attention_own_backward_kernel", [](int head_dim) { return std::string(own_backward_kernel(head_dim)); },
        py::arg("head_dim"));
  m.attr("attention_own_backward_env") = kOwnBackwardEnv;
  // {head dim: (the default backward's Hopper kernels there, what a call runs
  // that cannot fuse dQ)} where they are built.
  py::dict hopper_defaults;
  for (const HopperBackwardDefault& d : kHopperBackwardDefaults)
    hopper_defaults[py::int_(d.head_dim)] = py::make_tuple(d.kernel, d.without_fused_dq);
  m.attr("attention_hopper_backward_defaults") = hopper_defaults;
  // The backward's kernels for one call that fuses dQ or not.
  m.def("attention_backward_kernel_for_call",
        [](int head_dim, bool dq_fused) {
          return std::string(backward_kernel_for_call(own_backward_kernel(head_dim), head_dim, dq_fused));
        },
        py::arg("head_dim"), py::arg("dq_fused"));

  // The cuDNN path: (usable, version or the reason it is not).
#ifdef SYMHEAP_WITH_CUDNN
  m.def("attention_cudnn_status", [] {
    py::gil_scoped_release nogil;
    std::string why = cudnn::unavailable_reason();
    return std::make_pair(why.empty(), why.empty() ? cudnn::version_string() : why);
  });
  // (ok, workspace bytes, reason): builds or finds the call's graph.
  m.def("attention_cudnn_prepare", [](const Args& a, int device, bool backward) {
    py::gil_scoped_release nogil;
    cudnn::Prepared p = cudnn::prepare(a, backward, device);
    return std::make_tuple(p.ok, p.workspace_bytes, p.reason);
  });
  // Runs a call through the graph prepare() found: `args` is the call's block
  // (or one filled for an earlier call of the same signature; it is copied),
  // the pointers are this call's.
  m.def("attention_cudnn_forward", [](const Args& args, int device, uintptr_t stream, uintptr_t workspace,
                                      size_t bytes, uintptr_t q, uintptr_t k, uintptr_t v, uintptr_t out,
                                      uintptr_t lse) {
    Args a = args;
    a.q.data = as_ptr<void>(q);
    a.k.data = as_ptr<void>(k);
    a.v.data = as_ptr<void>(v);
    a.out.data = as_ptr<void>(out);
    a.lse = as_ptr<float>(lse);
    py::gil_scoped_release nogil;
    cudnn::forward(a, device, as_ptr<void>(stream), as_ptr<void>(workspace), bytes);
  });
  m.def("attention_cudnn_backward", [](const Args& args, int device, uintptr_t stream, uintptr_t workspace,
                                       size_t bytes, uintptr_t q, uintptr_t k, uintptr_t v, uintptr_t out,
                                       uintptr_t lse, uintptr_t dout, uintptr_t dq, uintptr_t dk, uintptr_t dv) {
    Args a = args;
    a.q.data = as_ptr<void>(q);
    a.k.data = as_ptr<void>(k);
    a.v.data = as_ptr<void>(v);
    a.out.data = as_ptr<void>(out);
    a.lse = as_ptr<float>(lse);
    a.dout.data = as_ptr<void>(dout);
    a.dq.data = as_ptr<void>(dq);
    a.dk.data = as_ptr<void>(dk);
    a.dv.data = as_ptr<void>(dv);
    py::gil_scoped_release nogil;
    cudnn::backward(a, device, as_ptr<void>(stream), as_ptr<void>(workspace), bytes);
  });
#else
  m.def("attention_cudnn_status", [] {
    return std::make_pair(false, std::string("the cuDNN path was not built: ") +
                                     SYMHEAP_CUDNN_MISSING);
  });
#endif
}
