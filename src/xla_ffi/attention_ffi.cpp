// XLA FFI handlers of the attention op (forward and backward, cpu and CUDA)
// and their Python capsules.
//
// Every call carries its options as attributes and its optional inputs (bias,
// mask, alibi slopes, cu_seqlens) as trailing arguments named by flags. The
// handler describes its buffers as a CallSpec, so shapes and options are
// checked by the same code as the torch front end, fills the op core's Args
// and runs on XLA's buffers: outputs are written in place, the one scratch
// output (sized by scratch_layout from shapes) holds padded copies, the CUDA
// backward's delta and the fp32 dbias accumulator.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <cstring>
#include <exception>
#include <limits>
#include <string>
#include <vector>

#include "bindings/registry.hpp"
#include "ops/attention/attention.hpp"
#include "ops/attention/call_plan.hpp"
#include "ops/attention/common.hpp"
#include "ops/attention/path_choice.hpp"
#include "symheap/errors.hpp"
#ifdef SYMHEAP_WITH_CUDNN
#include "ops/attention/cudnn_attention.hpp"
#endif
#include "xla/ffi/api/ffi.h"
#include "xla_ffi/attention_ffi.hpp"
#include "xla_ffi/ffi_common.hpp"

namespace ffi = xla::ffi;
namespace py = pybind11;

namespace symheap::attention::xla {
namespace {

using symheap::xla_ffi::dtype_name;

ArgSpec arg_spec(const ffi::AnyBuffer& b) {
  ArgSpec s;
  s.present = true;
  auto dims = b.dimensions();
  s.shape.assign(dims.begin(), dims.end());
  s.dtype = dtype_name(b.element_type());
  return s;
}

using symheap::xla_ffi::attr;

// The inputs of one call: q, k, v (then out, lse, dout for the backward) and
// the optional trailing ones the flags announce.
struct Inputs {
  std::vector<ffi::AnyBuffer> fixed;
  std::optional<ffi::AnyBuffer> bias, mask, alibi, cu_q, cu_k;
};

Inputs read_inputs(const ffi::RemainingArgs& args, const ffi::Dictionary& attrs, size_t fixed) {
  Inputs in;
  size_t at = 0;
  auto next = [&]() {
    auto b = args.get<ffi::AnyBuffer>(at++);
    if (!b.has_value()) throw InvalidArgument("attention: the call has too few operands");
    return *b;
  };
  for (size_t i = 0; i < fixed; ++i) in.fixed.push_back(next());
  if (attr<bool>(attrs, "has_bias")) in.bias = next();
  if (attr<bool>(attrs, "has_mask")) in.mask = next();
  if (attr<bool>(attrs, "has_alibi")) in.alibi = next();
  if (attr<bool>(attrs, "varlen")) {
    in.cu_q = next();
    in.cu_k = next();
  }
  if (at != args.size()) throw InvalidArgument("attention: the call has too many operands");
  return in;
}

CallSpec call_spec(const Inputs& in, const ffi::Dictionary& attrs, bool on_cuda) {
  CallSpec s;
  s.on_cuda = on_cuda;
  s.varlen = attr<bool>(attrs, "varlen");
  s.q = arg_spec(in.fixed[0]);
  s.k = arg_spec(in.fixed[1]);
  s.v = arg_spec(in.fixed[2]);
  if (in.bias) s.bias = arg_spec(*in.bias);
  if (in.mask) s.mask = arg_spec(*in.mask);
  if (in.alibi) s.alibi_slopes = arg_spec(*in.alibi);
  if (s.varlen) {
    s.cu_seqlens_q = arg_spec(*in.cu_q);
    s.cu_seqlens_k = arg_spec(*in.cu_k);
    s.max_seqlen_q = attr<int64_t>(attrs, "max_seqlen_q");
    s.max_seqlen_k = attr<int64_t>(attrs, "max_seqlen_k");
  }
  s.causal = attr<bool>(attrs, "causal");
  s.window_left = attr<int64_t>(attrs, "window_left");
  s.window_right = attr<int64_t>(attrs, "window_right");
  s.has_scale = attr<bool>(attrs, "has_scale");
  s.softmax_scale = attr<float>(attrs, "softmax_scale");
  s.softcap = attr<float>(attrs, "softcap");
  s.dropout_p = attr<float>(attrs, "dropout_p");
  return s;
}

void require_shape(const ffi::AnyBuffer& b, const std::vector<int64_t>& want, ffi::DataType dtype,
                   const char* name) {
  auto dims = b.dimensions();
  std::vector<int64_t> got(dims.begin(), dims.end());
  if (got != want || b.element_type() != dtype)
    throw InvalidArgument(std::string("attention: the ") + name +
                          " buffer does not match the call (shape or dtype)");
}

ffi::DataType ffi_dtype(DType t) {
  return t == DType::F16 ? ffi::DataType::F16 : t == DType::BF16 ? ffi::DataType::BF16 : ffi::DataType::F32;
}

// (B, S, H, D) or (total, H, D), contiguous, with head dim `d` in memory.
Tensor tensor(void* data, const CallPlan& p, bool keys, int d) {
  Tensor t;
  t.data = data;
  t.dtype = p.dtype;
  const int heads = keys ? p.heads_kv : p.heads_q;
  const int seq = keys ? p.seqlen_k : p.seqlen_q;
  t.head_stride = d;
  t.row_stride = static_cast<int64_t>(heads) * d;
  t.batch_stride = p.varlen ? 0 : t.row_stride * seq;
  return t;
}

// The path a call asked for: the "backend" attribute ("" = $SYMHEAP_ATTN_BACKEND).
Path requested_path(const ffi::Dictionary& attrs, bool on_cuda) {
  auto name = attrs.get<std::string_view>("backend");
  if (!name.has_value()) throw InvalidArgument("attention: the call has no attribute 'backend'");
  std::optional<std::string> requested;
  if (!name->empty()) requested = std::string(*name);
  return choose_path(requested, on_cuda);
}

Broadcast broadcast(const BroadcastPlan& b, void* data, DType dtype) {
  Broadcast x;
  x.data = data;
  x.dtype = dtype;
  x.sb = b.sb();
  x.sh = b.sh();
  x.sq = b.sq();
  x.sk = 1;
  x.kv_heads = b.kv_heads;
  return x;
}

Call prepare(ffi::RemainingArgs args, ffi::RemainingRets rets, ffi::Dictionary attrs, bool backward,
             bool on_cuda) {
  Call c;
  Inputs in = read_inputs(args, attrs, backward ? 6 : 3);
  const CallPlan p = plan_call(call_spec(in, attrs, on_cuda));
  c.plan = p;
  const bool want_dbias = backward && attr<bool>(attrs, "want_dbias");
  if (want_dbias && !p.bias.present)
    throw InvalidArgument("attention: a bias gradient needs a bias");
  c.layout = scratch_layout(p, backward, want_dbias);
  const bool pad = on_cuda && c.layout.padded;
  const int d_run = p.head_dim_run;

  // Results: forward (out, lse, scratch); backward (dq, dk, dv, [dbias], scratch).
  std::vector<ffi::AnyBuffer> res;
  for (size_t i = 0; i < rets.size(); ++i) {
    auto r = rets.get<ffi::AnyBuffer>(i);
    if (!r.has_value()) throw InvalidArgument("attention: cannot read a result buffer");
    res.push_back(**r);
  }
  const size_t want_results = backward ? 4 + (want_dbias ? 1 : 0) : 3;
  if (res.size() != want_results) throw InvalidArgument("attention: the call has the wrong results");
  ffi::AnyBuffer& scratch = res.back();
  if (scratch.size_bytes() < c.layout.total)
    throw InvalidArgument("attention: the scratch result has " + std::to_string(scratch.size_bytes()) +
                          " bytes, the call needs " + std::to_string(c.layout.total));
  c.scratch = static_cast<char*>(scratch.untyped_data());
  c.scratch_bytes = scratch.size_bytes();
  auto piece = [&](ScratchLayout::Piece k) { return c.scratch + c.layout.offset[k]; };

  const std::vector<int64_t>& qshape = arg_spec(in.fixed[0]).shape;
  const std::vector<int64_t>& kshape = arg_spec(in.fixed[1]).shape;
  const ffi::DataType dt = ffi_dtype(p.dtype);
  Args& a = c.args;
  a.batch = p.batch;
  a.heads_q = p.heads_q;
  a.heads_kv = p.heads_kv;
  a.head_dim = d_run;
  a.seqlen_q = p.seqlen_q;
  a.seqlen_k = p.seqlen_k;
  a.total_q = p.total_q;
  a.total_k = p.total_k;
  a.scale = p.scale;
  a.softcap = p.softcap;
  a.window_left = p.window_left;
  a.window_right = p.window_right;
  a.dropout_p = p.dropout_p;
  a.seed = attr<uint64_t>(attrs, "seed");
  a.offset = attr<uint64_t>(attrs, "offset");
  a.deterministic = attr<bool>(attrs, "deterministic");
  if (p.varlen) {
    a.cu_seqlens_q = static_cast<const int32_t*>(in.cu_q->untyped_data());
    a.cu_seqlens_k = static_cast<const int32_t*>(in.cu_k->untyped_data());
  }
  if (p.bias.present) a.bias = broadcast(p.bias, in.bias->untyped_data(), p.bias_dtype);
  if (p.mask.present) a.mask = broadcast(p.mask, in.mask->untyped_data(), DType::F32);
  if (p.alibi) {
    if (in.alibi->element_type() != ffi::DataType::F32)
      throw InvalidArgument("attention: alibi_slopes must reach the handler as float32");
    a.alibi_slopes = static_cast<const float*>(in.alibi->untyped_data());
    a.alibi_batch_stride = p.alibi_per_batch ? p.heads_q : 0;
  }

  // The caller's q, k, v (and out, dout) and where the core reads them.
  c.user_q = tensor(in.fixed[0].untyped_data(), p, false, p.head_dim);
  c.user_k = tensor(in.fixed[1].untyped_data(), p, true, p.head_dim);
  c.user_v = tensor(in.fixed[2].untyped_data(), p, true, p.head_dim);
  a.q = pad ? tensor(piece(ScratchLayout::Q), p, false, d_run) : c.user_q;
  a.k = pad ? tensor(piece(ScratchLayout::K), p, true, d_run) : c.user_k;
  a.v = pad ? tensor(piece(ScratchLayout::V), p, true, d_run) : c.user_v;
  std::vector<int64_t> lse_shape = p.varlen
      ? std::vector<int64_t>{p.heads_q, p.total_q}
      : std::vector<int64_t>{p.batch, p.heads_q, p.seqlen_q};
  if (p.varlen) {
    a.lse_batch_stride = 0;
    a.lse_head_stride = p.total_q;
  } else {
    a.lse_batch_stride = static_cast<int64_t>(p.heads_q) * p.seqlen_q;
    a.lse_head_stride = p.seqlen_q;
  }
  if (!backward) {
    require_shape(res[0], qshape, dt, "out");
    require_shape(res[1], lse_shape, ffi::DataType::F32, "lse");
    c.user_out = tensor(res[0].untyped_data(), p, false, p.head_dim);
    a.out = pad ? tensor(piece(ScratchLayout::OUT), p, false, d_run) : c.user_out;
    a.lse = static_cast<float*>(res[1].untyped_data());
  } else {
    require_shape(in.fixed[3], qshape, dt, "out");
    require_shape(in.fixed[4], lse_shape, ffi::DataType::F32, "lse");
    require_shape(in.fixed[5], qshape, dt, "dout");
    require_shape(res[0], qshape, dt, "dq");
    require_shape(res[1], kshape, dt, "dk");
    require_shape(res[2], kshape, dt, "dv");
    c.user_out = tensor(in.fixed[3].untyped_data(), p, false, p.head_dim);
    c.user_dout = tensor(in.fixed[5].untyped_data(), p, false, p.head_dim);
    c.user_dq = tensor(res[0].untyped_data(), p, false, p.head_dim);
    c.user_dk = tensor(res[1].untyped_data(), p, true, p.head_dim);
    c.user_dv = tensor(res[2].untyped_data(), p, true, p.head_dim);
    a.out = pad ? tensor(piece(ScratchLayout::OUT), p, false, d_run) : c.user_out;
    a.dout = pad ? tensor(piece(ScratchLayout::DOUT), p, false, d_run) : c.user_dout;
    a.dq = pad ? tensor(piece(ScratchLayout::DQ), p, false, d_run) : c.user_dq;
    a.dk = pad ? tensor(piece(ScratchLayout::DK), p, true, d_run) : c.user_dk;
    a.dv = pad ? tensor(piece(ScratchLayout::DV), p, true, d_run) : c.user_dv;
    a.lse = static_cast<float*>(in.fixed[4].untyped_data());
    if (want_dbias) {
      ffi::AnyBuffer& dbias = res[3];
      require_shape(dbias, arg_spec(*in.bias).shape, in.bias->element_type(), "dbias");
      c.dbias_out = dbias.untyped_data();
      // The accumulator is (B, Hq, Sq or 1, Sk) fp32; reduced into dbias after.
      Broadcast ws;
      ws.data = piece(ScratchLayout::DBIAS);
      ws.dtype = DType::F32;
      ws.sk = 1;
      const int64_t r = p.bias.per_row ? p.seqlen_q : 1;
      ws.sq = p.bias.per_row ? p.seqlen_k : 0;
      ws.sh = r * p.seqlen_k;
      ws.sb = static_cast<int64_t>(p.heads_q) * ws.sh;
      a.dbias = ws;
    }
    c.delta = piece(ScratchLayout::DELTA);
    // The own backward's workspace: delta and, when no dbias piece follows
    // it, the rest of the scratch result (cuDNN's reserve, room for an fp32
    // dQ: the fused dQ's accumulator; without it the dQ kernel runs).
    static_assert(ScratchLayout::DELTA + 1 == ScratchLayout::DBIAS && ScratchLayout::DBIAS + 1 == ScratchLayout::COUNT,
                  "delta is the last piece but dbias");
    c.delta_bytes = want_dbias ? (c.layout.bytes[ScratchLayout::DELTA] + 255) / 256 * 256
                               : c.scratch_bytes - c.layout.offset[ScratchLayout::DELTA];
  }
  c.padded = pad;
  return c;
}

// Sums the (B, Hq, R, Sk) fp32 accumulator over the bias's broadcast dims into
// dbias (the bias's own shape and dtype).
void reduce_dbias_cpu(const Call& c) {
  const CallPlan& p = c.plan;
  const BroadcastPlan& b = p.bias;
  const int64_t R = p.bias.per_row ? p.seqlen_q : 1, Sk = p.seqlen_k;
  const int64_t ob = b.dims[0], oh = b.dims[1];
  const float* ws = static_cast<const float*>(c.args.dbias.data);
  const int64_t n = ob * oh * R * Sk;
  std::vector<float> acc(static_cast<size_t>(n), 0.0f);
  for (int64_t bi = 0; bi < p.batch; ++bi)
    for (int64_t h = 0; h < p.heads_q; ++h) {
      const int64_t to_b = ob == 1 ? 0 : bi;
      const int64_t to_h = oh == 1 ? 0 : b.kv_heads ? h / (p.heads_q / p.heads_kv) : h;
      const float* src = ws + (bi * p.heads_q + h) * R * Sk;
      float* dst = acc.data() + (to_b * oh + to_h) * R * Sk;
      for (int64_t e = 0; e < R * Sk; ++e) dst[e] += src[e];
    }
  switch (p.bias_dtype) {
    case DType::F32: std::memcpy(c.dbias_out, acc.data(), acc.size() * sizeof(float)); break;
    case DType::F16: {
      auto* o = static_cast<uint16_t*>(c.dbias_out);
      for (int64_t e = 0; e < n; ++e) o[e] = detail::f32_to_f16(acc[e]);
      break;
    }
    case DType::BF16: {
      auto* o = static_cast<uint16_t*>(c.dbias_out);
      for (int64_t e = 0; e < n; ++e) o[e] = detail::f32_to_bf16(acc[e]);
      break;
    }
  }
}

// Varlen rows outside every sequence are never written by the core.
void clear_unwritten_cpu(const Call& c, bool backward) {
  const CallPlan& p = c.plan;
  if (!p.varlen) return;
  const size_t e = dtype_size(p.dtype);
  const size_t q_bytes = static_cast<size_t>(p.total_q) * p.heads_q * p.head_dim * e;
  const size_t k_bytes = static_cast<size_t>(p.total_k) * p.heads_kv * p.head_dim * e;
  if (!backward) {
    std::memset(c.args.out.data, 0, q_bytes);
    float* lse = c.args.lse;
    for (int64_t i = 0; i < int64_t{p.heads_q} * p.total_q; ++i)
      lse[i] = -std::numeric_limits<float>::infinity();
  } else {
    std::memset(c.args.dq.data, 0, q_bytes);
    std::memset(c.args.dk.data, 0, k_bytes);
    std::memset(c.args.dv.data, 0, k_bytes);
  }
}

ffi::Error forward_cpu_impl(ffi::RemainingArgs args, ffi::RemainingRets rets, ffi::Dictionary attrs) {
  return symheap::xla_ffi::guarded([&] {
    requested_path(attrs, false);  // rejects backend='cudnn' on cpu
    Call c = prepare(args, rets, attrs, false, false);
    clear_unwritten_cpu(c, false);
    forward_cpu(c.args, 0);
  });
}

ffi::Error backward_cpu_impl(ffi::RemainingArgs args, ffi::RemainingRets rets, ffi::Dictionary attrs) {
  return symheap::xla_ffi::guarded([&] {
    requested_path(attrs, false);
    Call c = prepare(args, rets, attrs, true, false);
    clear_unwritten_cpu(c, true);
    if (c.args.dbias.data)
      std::memset(c.args.dbias.data, 0, c.layout.bytes[ScratchLayout::DBIAS]);
    backward_cpu(c.args, 0);
    if (c.dbias_out) reduce_dbias_cpu(c);
  });
}

#ifdef SYMHEAP_WITH_CUDA
// Runs the call through cuDNN when its path allows it and cuDNN takes it (the
// rule of the torch front end); false: the own kernels run it. The graph is
// built at the first call of its key (host work: no command-buffer claim);
// the workspace is the scratch result's tail (cudnn_workspace_reserve).
bool run_cudnn(const Call& c, Path path, bool backward, int device, void* stream) {
  if (path == Path::Own) return false;
#ifdef SYMHEAP_WITH_CUDNN
  std::string why;
  if (c.padded) why = "cuDNN takes head dims that are multiples of 8 up to 256";
  else if (backward && c.args.dbias.data) why = "a bias gradient runs on the own kernels";
  if (why.empty()) {
    // The workspace: the scratch result past the call's own pieces, 256-byte aligned.
    const uintptr_t begin = reinterpret_cast<uintptr_t>(c.scratch);
    const uintptr_t end = begin + c.scratch_bytes;
    const uintptr_t workspace_at = (begin + c.layout.total + 255) / 256 * 256;
    const size_t available = workspace_at < end ? end - workspace_at : 0;
    why = cudnn::try_run(c.args, backward, device, stream,
                         available ? reinterpret_cast<void*>(workspace_at) : nullptr, available);
    if (why.empty()) return true;
  }
  if (path == Path::Cudnn) throw Unsupported("attention: backend='cudnn' cannot run this call: " + why);
  return false;
#else
  (void)c, (void)backward, (void)device, (void)stream;
  return false;  // choose_path already refused a forced "cudnn"
#endif
}

ffi::Error forward_cuda_impl(void* stream, int32_t device, ffi::RemainingArgs args, ffi::RemainingRets rets, ffi::Dictionary attrs) {
  return symheap::xla_ffi::guarded([&] {
    const Path path = requested_path(attrs, true);
    Call c = prepare(args, rets, attrs, false, true);
    if (!run_cudnn(c, path, false, device, stream)) run_forward_cuda(c, device, stream);
  });
}

ffi::Error backward_cuda_impl(void* stream, int32_t device, ffi::RemainingArgs args, ffi::RemainingRets rets, ffi::Dictionary attrs) {
  return symheap::xla_ffi::guarded([&] {
    const Path path = requested_path(attrs, true);
    Call c = prepare(args, rets, attrs, true, true);
    if (!run_cudnn(c, path, true, device, stream)) run_backward_cuda(c, device, stream);
  });
}
#endif

}  // namespace
}  // namespace symheap::attention::xla

namespace sax = symheap::attention::xla;

// The cpu handlers read cu_seqlens on the host (they live in host memory).
XLA_FFI_DEFINE_HANDLER_SYMBOL(symheap_attention_fwd_cpu, sax::forward_cpu_impl,
                              ffi::Ffi::Bind().RemainingArgs().RemainingRets().Attrs());
XLA_FFI_DEFINE_HANDLER_SYMBOL(symheap_attention_bwd_cpu, sax::backward_cpu_impl,
                              ffi::Ffi::Bind().RemainingArgs().RemainingRets().Attrs());

#ifdef SYMHEAP_WITH_CUDA
// Pure device work on XLA's stream (kernels and memsets, no host reads or
// synchronisation). Command-buffer compatibility is not claimed until a GPU
// run has shown the calls record and replay correctly (first calls set kernel
// attributes on the host).
XLA_FFI_DEFINE_HANDLER_SYMBOL(symheap_attention_fwd_cuda, sax::forward_cuda_impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<void*>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attrs());
XLA_FFI_DEFINE_HANDLER_SYMBOL(symheap_attention_bwd_cuda, sax::backward_cuda_impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<void*>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attrs());
#endif

SYMHEAP_BINDINGS(xla_attention) {
  m.def("xla_attention_targets", []() {
    py::dict cpu, cuda;
    cpu["symheap_attention_fwd"] = symheap::xla_ffi::capsule(symheap_attention_fwd_cpu);
    cpu["symheap_attention_bwd"] = symheap::xla_ffi::capsule(symheap_attention_bwd_cpu);
#ifdef SYMHEAP_WITH_CUDA
    cuda["symheap_attention_fwd"] = symheap::xla_ffi::capsule(symheap_attention_fwd_cuda);
    cuda["symheap_attention_bwd"] = symheap::xla_ffi::capsule(symheap_attention_bwd_cuda);
#endif
    py::dict out;
    out["cpu"] = cpu;
    out["CUDA"] = cuda;
    return out;
  });
}
