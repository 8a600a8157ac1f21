// Argument checks of an attention call from shapes and dtypes, shared by the
// torch front end and the XLA FFI handlers (one message per mistake).
#include "ops/attention/call_plan.hpp"

#include <climits>
#include <cmath>
#include <cstdio>
#include <string>

#include "symheap/errors.hpp"

namespace symheap::attention {
namespace {

constexpr int kMaxHeadDim = 256;

[[noreturn]] void fail(const std::string& message) {
  throw InvalidArgument("attention: " + message);
}

// A shape as Python writes a tuple: (3,), (1, 8, 4).
std::string shape_str(const std::vector<int64_t>& s) {
  std::string r = "(";
  for (size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
  return r + (s.size() == 1 ? ",)" : ")");
}

// A float as Python's repr writes the usual cases: 1.0, 0.5, -1.0, inf.
std::string float_str(double x) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "%.17g", x);
  std::string r = buf;
  if (r.find_first_of(".eni") == std::string::npos) r += ".0";
  return r;
}

bool float_dtype(const std::string& d) {
  return d == "float32" || d == "float16" || d == "bfloat16";
}

DType to_dtype(const std::string& d) {
  return d == "float16" ? DType::F16 : d == "bfloat16" ? DType::BF16 : DType::F32;
}

void check_qkv(const CallSpec& s) {
  const size_t want = s.varlen ? 3 : 4;
  const char* layout = s.varlen ? "(total, H, D)" : "(B, S, H, D)";
  const ArgSpec* qkv[] = {&s.q, &s.k, &s.v};
  const char* names[] = {"q", "k", "v"};
  for (int n = 0; n < 3; ++n)
    if (qkv[n]->shape.size() != want)
      fail(std::string(names[n]) + " must be " + layout + ", got shape " + shape_str(qkv[n]->shape));
  if (!(s.q.dtype == s.k.dtype && s.k.dtype == s.v.dtype))
    fail("q, k, v must share a dtype, got " + s.q.dtype + ", " + s.k.dtype + ", " + s.v.dtype);
  if (!float_dtype(s.q.dtype))
    fail("dtype " + s.q.dtype + " is not supported: use float16 or bfloat16 (float32 on cpu)");
  if (s.on_cuda && s.q.dtype == "float32")
    fail("the CUDA path takes float16 or bfloat16; cast q, k, v (float32 runs on cpu)");
  if (s.k.shape != s.v.shape)
    fail("k and v must have one shape, got " + shape_str(s.k.shape) + " and " + shape_str(s.v.shape));
  const int64_t d = s.q.shape.back();
  if (d != s.k.shape.back())
    fail("q and k head dims differ: " + std::to_string(d) + " vs " + std::to_string(s.k.shape.back()));
  if (d < 1 || d > kMaxHeadDim)
    fail("head dim " + std::to_string(d) + " is outside [1, " + std::to_string(kMaxHeadDim) + "]");
  const int64_t hq = s.q.shape[want - 2], hkv = s.k.shape[want - 2];
  if (hkv < 1 || hq % hkv)
    fail("query heads (" + std::to_string(hq) + ") must be a multiple of key/value heads (" +
         std::to_string(hkv) + ")");
}

BroadcastPlan broadcast(const ArgSpec& x, const char* name, bool float_ok, int64_t B, int64_t Hq,
                        int64_t Hkv, int64_t Sq, int64_t Sk) {
  BroadcastPlan p;
  if (!x.present) return p;
  const std::string n = name;
  if (float_ok) {
    if (!float_dtype(x.dtype)) fail(n + " must be float32, float16 or bfloat16, got " + x.dtype);
  } else if (x.dtype != "bool") {
    fail(n + " must be a bool tensor (True = attend), got " + x.dtype +
         "; use bias= for additive masks");
  }
  if (x.shape.size() > 4)
    fail(n + " must have at most 4 dims (B, H, Sq, Sk), got shape " + shape_str(x.shape));
  const size_t pad = 4 - x.shape.size();
  for (size_t d = 0; d < x.shape.size(); ++d) p.dims[pad + d] = x.shape[d];
  const int64_t b = p.dims[0], h = p.dims[1], sq = p.dims[2], sk = p.dims[3];
  const bool ok = (b == B || b == 1) && (h == Hq || h == Hkv || h == 1) && (sq == Sq || sq == 1) &&
                  sk == Sk;
  if (!ok)
    fail(n + " of shape " + shape_str(x.shape) +
         " does not broadcast as (B or 1, Hq or Hkv or 1, Sq or 1, Sk) = (" + std::to_string(B) +
         " or 1, " + std::to_string(Hq) + " or " + std::to_string(Hkv) + " or 1, " +
         std::to_string(Sq) + " or 1, " + std::to_string(Sk) + ")");
  p.present = true;
  p.kv_heads = h == Hkv && Hkv != Hq && h != 1;
  p.per_row = sq != 1 || Sq == 1;
  return p;
}

size_t align256(size_t n) { return (n + 255) / 256 * 256; }

}  // namespace

CallPlan plan_call(const CallSpec& s) {
  check_qkv(s);
  CallPlan p;
  p.varlen = s.varlen;
  p.on_cuda = s.on_cuda;
  p.dtype = to_dtype(s.q.dtype);
  int64_t B, Sq, Sk;
  if (s.varlen) {
    const ArgSpec* cus[] = {&s.cu_seqlens_q, &s.cu_seqlens_k};
    const char* names[] = {"cu_seqlens_q", "cu_seqlens_k"};
    for (int n = 0; n < 2; ++n)
      if (!cus[n]->present || cus[n]->dtype != "int32" || cus[n]->shape.size() != 1)
        fail(std::string(names[n]) +
             " must be a 1-D int32 tensor of sequence starts (length batch + 1)");
    const int64_t nq = s.cu_seqlens_q.shape[0], nk = s.cu_seqlens_k.shape[0];
    if (nq != nk || nq < 2)
      fail("cu_seqlens_q and cu_seqlens_k must both have batch + 1 >= 2 entries, got " +
           std::to_string(nq) + " and " + std::to_string(nk));
    B = nq - 1;
    Sq = s.max_seqlen_q;
    Sk = s.max_seqlen_k;
    if (Sq < 0 || Sk < 0 || Sq > INT32_MAX || Sk > INT32_MAX)  // int32 in the kernels
      fail("max_seqlen_q and max_seqlen_k must be in [0, " + std::to_string(INT32_MAX) +
           "], got " + std::to_string(Sq) + " and " + std::to_string(Sk));
    p.total_q = s.q.shape[0];
    p.total_k = s.k.shape[0];
  } else {
    B = s.q.shape[0];
    Sq = s.q.shape[1];
    Sk = s.k.shape[1];
    if (s.k.shape[0] != B)
      fail("q has batch " + std::to_string(B) + " but k has batch " + std::to_string(s.k.shape[0]));
  }
  const size_t hd = s.varlen ? 1 : 2;
  const int64_t Hq = s.q.shape[hd], Hkv = s.k.shape[hd], D = s.q.shape[hd + 1];
  if (s.window_left < -1 || s.window_right < -1 || s.window_left > INT32_MAX ||
      s.window_right > INT32_MAX)
    fail("window_size sides must be >= -1 (-1 = unbounded) and fit in 32 bits, got (" +
         std::to_string(s.window_left) + ", " + std::to_string(s.window_right) + ")");
  const double scale = s.has_scale ? s.softmax_scale : 1.0 / std::sqrt(static_cast<double>(D));
  if (!std::isfinite(scale)) fail("softmax_scale must be finite");
  if (!(s.softcap >= 0 && std::isfinite(s.softcap)))
    fail("softcap must be >= 0 (0 disables it), got " + float_str(s.softcap));
  if (!(s.dropout_p >= 0 && s.dropout_p < 1))
    fail("dropout_p must be in [0, 1), got " + float_str(s.dropout_p));
  if (static_cast<float>(s.dropout_p) >= 1.0f)  // the kernels' type
    fail("dropout_p " + float_str(s.dropout_p) + " rounds to 1 in float32, which the kernels "
         "use: give at most " + float_str(std::nextafter(1.0f, 0.0f)));

  p.bias = broadcast(s.bias, "bias", true, B, Hq, Hkv, Sq, Sk);
  if (p.bias.present) p.bias_dtype = to_dtype(s.bias.dtype);
  p.mask = broadcast(s.mask, "mask", false, B, Hq, Hkv, Sq, Sk);
  if (s.alibi_slopes.present) {
    const auto& a = s.alibi_slopes.shape;
    const bool ok = (a.size() == 1 && a[0] == Hq) ||
                    (a.size() == 2 && (a[0] == B || a[0] == 1) && a[1] == Hq);
    if (!ok)
      fail("alibi_slopes must have shape (" + std::to_string(Hq) + ",) or (" + std::to_string(B) +
           ", " + std::to_string(Hq) + "), got " + shape_str(a));
    p.alibi = true;
    p.alibi_per_batch = a.size() == 2 && a[0] > 1;
  }
  const int64_t limit = int64_t{1} << 31;
  if (B >= limit || Sq >= limit || Sk >= limit || Hq >= limit)
    fail("batch, heads and sequence lengths must be below 2^31");
  p.batch = static_cast<int>(B);
  p.heads_q = static_cast<int>(Hq);
  p.heads_kv = static_cast<int>(Hkv);
  p.head_dim = static_cast<int>(D);
  p.head_dim_run = s.on_cuda ? static_cast<int>((D + 7) / 8 * 8) : static_cast<int>(D);
  p.seqlen_q = static_cast<int>(Sq);
  p.seqlen_k = static_cast<int>(Sk);
  p.scale = static_cast<float>(scale);
  p.softcap = static_cast<float>(s.softcap);
  p.dropout_p = static_cast<float>(s.dropout_p);
  p.window_left = static_cast<int>(s.window_left);
  p.window_right = s.causal ? 0 : static_cast<int>(s.window_right);
  return p;
}

ScratchLayout scratch_layout(const CallPlan& p, bool backward, bool want_dbias) {
  ScratchLayout l;
  const int64_t rows_q = p.varlen ? p.total_q : int64_t{p.batch} * p.seqlen_q;
  const int64_t rows_k = p.varlen ? p.total_k : int64_t{p.batch} * p.seqlen_k;
  const int64_t d8 = (p.head_dim + 7) / 8 * 8;
  const size_t elem = dtype_size(p.dtype);
  l.padded = d8 != p.head_dim;
  if (l.padded) {
    const size_t q_bytes = static_cast<size_t>(rows_q) * p.heads_q * d8 * elem;
    const size_t kv_bytes = static_cast<size_t>(rows_k) * p.heads_kv * d8 * elem;
    l.bytes[ScratchLayout::Q] = l.bytes[ScratchLayout::OUT] = q_bytes;
    l.bytes[ScratchLayout::K] = l.bytes[ScratchLayout::V] = kv_bytes;
    if (backward) {
      l.bytes[ScratchLayout::DOUT] = l.bytes[ScratchLayout::DQ] = q_bytes;
      l.bytes[ScratchLayout::DK] = l.bytes[ScratchLayout::DV] = kv_bytes;
    }
  }
  if (backward) {
    l.bytes[ScratchLayout::DELTA] = static_cast<size_t>(rows_q) * p.heads_q * sizeof(float);
    if (want_dbias)
      l.bytes[ScratchLayout::DBIAS] = static_cast<size_t>(p.batch) * p.heads_q *
                                      (p.bias.per_row ? p.seqlen_q : 1) * p.seqlen_k * sizeof(float);
  }
  size_t at = 0;
  for (int i = 0; i < ScratchLayout::COUNT; ++i) {
    l.offset[i] = at;
    at += align256(l.bytes[i]);
  }
  l.total = at;
  return l;
}

}  // namespace symheap::attention
