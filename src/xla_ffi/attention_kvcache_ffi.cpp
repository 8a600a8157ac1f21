// XLA FFI handler of attention over a KV cache (symheap.jax.flash_attn_with_kvcache
// and the paged path of flash_attn_varlen_func), cpu and CUDA, and its Python
// capsules.
//
// The handler describes its buffers as a CacheCall (dtype names, shapes,
// row-major strides), so every check is the op core's (cache_args in
// decode_args.cpp) and raises the torch front end's message as an ffi::Error.
// Operands, in order: q, k_cache, v_cache, [k, v] (appends), cache_seqlens or
// [cu_seqlens_q, cu_seqlens_k] (varlen), [block_table] (paged),
// [alibi_slopes] (has_alibi). Results: out, lse, [k_cache, v_cache]
// (appends; aliased to the operand caches), scratch (uint8: the CUDA split
// partials, sized at trace time with the split count pinned in num_splits).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <climits>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "bindings/registry.hpp"
#include "ops/attention/decode.hpp"
#include "symheap/errors.hpp"
#include "xla/ffi/api/ffi.h"
#include "xla_ffi/attention_kvcache_ffi.hpp"
#include "xla_ffi/ffi_common.hpp"

namespace ffi = xla::ffi;
namespace py = pybind11;

namespace symheap::attention::xla {
namespace {

using symheap::xla_ffi::attr;
using symheap::xla_ffi::dtype_name;

[[noreturn]] void fail(const std::string& message) {
  throw InvalidArgument("attention (kv cache): " + message);
}

// A buffer as the core sees a tensor: XLA's buffers are dense and row-major.
TensorDesc describe(const ffi::AnyBuffer& b) {
  TensorDesc t;
  t.present = true;
  t.data = b.untyped_data();
  t.dtype = dtype_name(b.element_type());
  auto dims = b.dimensions();
  t.shape.assign(dims.begin(), dims.end());
  t.strides.assign(t.shape.size(), 1);
  for (size_t i = t.shape.size(); i-- > 1;) t.strides[i - 1] = t.strides[i] * t.shape[i];
  return t;
}

int int_attr(const ffi::Dictionary& attrs, const char* name) {
  const int64_t v = attr<int64_t>(attrs, name);
  if (v < INT_MIN || v > INT_MAX) fail(std::string(name) + " must fit in int32, got " + std::to_string(v));
  return static_cast<int>(v);
}

CacheCallBuffers prepare(const ffi::RemainingArgs& args, const ffi::RemainingRets& rets,
                         const ffi::Dictionary& attrs) {
  const bool varlen = attr<bool>(attrs, "varlen");
  const bool appends = attr<bool>(attrs, "appends");
  size_t at = 0;
  auto next = [&]() {
    auto b = args.get<ffi::AnyBuffer>(at++);
    if (!b.has_value()) fail("the XLA call has too few operands");
    return *b;
  };
  CacheCall call;
  call.q = describe(next());
  const ffi::AnyBuffer k_cache = next(), v_cache = next();
  if (appends) {
    call.k = describe(next());
    call.v = describe(next());
  }
  if (varlen) {
    call.cu_seqlens_q = describe(next());
    call.cu_seqlens_k = describe(next());
  } else {
    call.cache_seqlens = describe(next());
  }
  if (attr<bool>(attrs, "paged")) call.block_table = describe(next());
  if (attr<bool>(attrs, "has_alibi")) call.alibi_slopes = describe(next());
  if (at != args.size()) fail("the XLA call has too many operands");

  std::vector<ffi::AnyBuffer> res;
  for (size_t i = 0; i < rets.size(); ++i) {
    auto r = rets.get<ffi::AnyBuffer>(i);
    if (!r.has_value()) fail("cannot read a result buffer of the XLA call");
    res.push_back(**r);
  }
  if (res.size() != (appends ? 5u : 3u)) fail("the XLA call has the wrong number of results");
  call.out = describe(res[0]);
  call.lse = describe(res[1]);
  CacheCallBuffers c;
  if (appends) {
    // The caches are read and written through the results (aliased to the operands).
    for (int i = 0; i < 2; ++i) {
      const ffi::AnyBuffer& in = i ? v_cache : k_cache;
      const ffi::AnyBuffer& out = res[2 + i];
      auto a = in.dimensions(), b = out.dimensions();
      if (in.element_type() != out.element_type() ||
          !std::equal(a.begin(), a.end(), b.begin(), b.end()))
        fail("the updated cache results must have the caches' shape and dtype");
    }
    call.k_cache = describe(res[2]);
    call.v_cache = describe(res[3]);
    c.k_cache_in = k_cache.untyped_data();
    c.v_cache_in = v_cache.untyped_data();
    c.cache_bytes = k_cache.size_bytes();
  } else {
    call.k_cache = describe(k_cache);
    call.v_cache = describe(v_cache);
  }
  call.max_seqlen_q = attr<int64_t>(attrs, "max_seqlen_q");  // (cache_args checks the ranges)
  call.scale = attr<float>(attrs, "scale");
  call.softcap = attr<float>(attrs, "softcap");
  call.window_left = int_attr(attrs, "window_left");
  call.window_right = int_attr(attrs, "window_right");
  call.num_splits = attr<int64_t>(attrs, "num_splits");
  c.args = cache_args(call);  // every shape, dtype and option check
  c.clear_rows = varlen;
  c.out_bytes = res[0].size_bytes();
  c.lse_count = static_cast<int64_t>(res[1].element_count());
  c.scratch = res.back().untyped_data();
  c.scratch_bytes = res.back().size_bytes();
  return c;
}

ffi::Error kvcache_cpu_impl(ffi::RemainingArgs args, ffi::RemainingRets rets, ffi::Dictionary attrs) {
  return symheap::xla_ffi::guarded([&] {
    CacheCallBuffers c = prepare(args, rets, attrs);
    const CacheArgs& a = c.args;
    if (c.k_cache_in != a.k_cache.data) std::memcpy(a.k_cache.data, c.k_cache_in, c.cache_bytes);
    if (c.v_cache_in != a.v_cache.data) std::memcpy(a.v_cache.data, c.v_cache_in, c.cache_bytes);
    if (c.clear_rows) {
      std::memset(a.out.data, 0, c.out_bytes);
      std::fill(a.lse, a.lse + c.lse_count, -std::numeric_limits<float>::infinity());
    }
    // Checks every length and block id before it writes to the caches.
    cache_attention_cpu(a, 0);
  });
}

#ifdef SYMHEAP_WITH_CUDA
ffi::Error kvcache_cuda_impl(void* stream, int32_t device, ffi::RemainingArgs args,
                             ffi::RemainingRets rets, ffi::Dictionary attrs) {
  return symheap::xla_ffi::guarded([&] {
    CacheCallBuffers c = prepare(args, rets, attrs);
    prepare_cache_call_cuda(c, device, stream);
    // Lengths and block ids are checked by the kernels; an error they record is
    // raised by the next call on the device (or symheap.jax.kvcache_check).
    cache_attention_cuda(c.args, device, stream, c.scratch, c.scratch_bytes);
  });
}
#endif

}  // namespace
}  // namespace symheap::attention::xla

namespace sax = symheap::attention::xla;

// The cpu handler reads lengths and block tables on the host.
XLA_FFI_DEFINE_HANDLER_SYMBOL(symheap_attention_kvcache_cpu, sax::kvcache_cpu_impl,
                              ffi::Ffi::Bind().RemainingArgs().RemainingRets().Attrs());

#ifdef SYMHEAP_WITH_CUDA
// Device work on XLA's stream only: no host synchronisation, no allocation
// (the split partials live in the scratch result). Command-buffer
// compatibility is not claimed (first calls set kernel attributes on the host).
XLA_FFI_DEFINE_HANDLER_SYMBOL(symheap_attention_kvcache_cuda, sax::kvcache_cuda_impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<void*>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attrs());
#endif

SYMHEAP_BINDINGS(xla_attention_kvcache) {
  using symheap::attention::CacheCall;
  m.def("xla_attention_kvcache_targets", []() {
    py::dict by_platform;
    by_platform["cpu"] = symheap::xla_ffi::capsule(symheap_attention_kvcache_cpu);
#ifdef SYMHEAP_WITH_CUDA
    by_platform["CUDA"] = symheap::xla_ffi::capsule(symheap_attention_kvcache_cuda);
#endif
    py::dict out;
    out["symheap_attention_kvcache"] = by_platform;
    return out;
  });
  // Trace time: the call described with placeholder addresses (no data is read).
  m.def("xla_attention_kvcache_validate",
        [](const CacheCall& c) { (void)symheap::attention::cache_args(c); });
#ifdef SYMHEAP_WITH_CUDA
  // Trace time: (splits, scratch bytes) of the call on `device`; the split
  // count is then passed to the handler so the scratch fits on any device.
  m.def("xla_attention_kvcache_cuda_plan", [](const CacheCall& c, int device) {
    CacheCall pinned = c;
    pinned.num_splits = symheap::attention::cache_attention_cuda_splits(
        symheap::attention::cache_args(c), device);
    const size_t bytes = symheap::attention::cache_attention_cuda_workspace_bytes(
        symheap::attention::cache_args(pinned), device);
    return py::make_tuple(pinned.num_splits, bytes);
  });
#endif
}
