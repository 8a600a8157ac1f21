// Argument checks shared by the cpu and CUDA paths, and the dropout generator's
// host entry points.
#include <cmath>
#include <string>

#include "ops/attention/attention.hpp"
#include "ops/attention/common.hpp"
#include "symheap/errors.hpp"

namespace symheap::attention {

const char* dtype_name(DType t) {
  switch (t) {
    case DType::F32: return "float32";
    case DType::F16: return "float16";
    case DType::BF16: return "bfloat16";
  }
  return "unknown";
}

size_t dtype_size(DType t) { return t == DType::F32 ? 4 : 2; }

namespace {
// Messages are built only on failure: validate() runs on every call.
void require(bool ok, const char* message) {
  if (!ok) throw InvalidArgument(std::string("attention: ") + message);
}
template <class MakeMessage>
void require(bool ok, MakeMessage make_message) {
  if (!ok) throw InvalidArgument("attention: " + make_message());
}

bool valid_dtype(DType t) {
  return t == DType::F32 || t == DType::F16 || t == DType::BF16;
}

void check_tensor(const Tensor& t, const char* name, DType want, bool empty) {
  require(t.data != nullptr || empty, [&] { return std::string(name) + " is missing"; });
  require(t.dtype == want, [&] {
    return std::string(name) + " is " + dtype_name(t.dtype) + " but q is " + dtype_name(want) +
           ": give q, k, v (and gradients) one dtype";
  });
}
}  // namespace

void validate(const Args& a, bool backward) {
  require(a.batch >= 1, [&] { return "batch must be >= 1, got " + std::to_string(a.batch); });
  require(a.heads_q >= 1 && a.heads_kv >= 1, "head counts must be >= 1");
  require(a.heads_q % a.heads_kv == 0, [&] {
    return "the number of query heads (" + std::to_string(a.heads_q) +
           ") must be a multiple of the number of key/value heads (" +
           std::to_string(a.heads_kv) + ")";
  });
  require(a.head_dim >= 1 && a.head_dim <= 256,
          [&] { return "head_dim must be in [1, 256], got " + std::to_string(a.head_dim); });
  require(a.seqlen_q >= 0 && a.seqlen_k >= 0, "sequence lengths must be >= 0");
  require((a.cu_seqlens_q == nullptr) == (a.cu_seqlens_k == nullptr),
          "give both cu_seqlens_q and cu_seqlens_k, or neither");
  if (a.varlen()) require(a.total_q >= 0 && a.total_k >= 0, "packed row counts must be >= 0");
  require(std::isfinite(a.scale), "softmax_scale must be finite");
  require(std::isfinite(a.softcap) && a.softcap >= 0, "softcap must be >= 0 (0 disables it)");
  require(a.dropout_p >= 0 && a.dropout_p < 1,
          [&] { return "dropout_p must be in [0, 1), got " + std::to_string(a.dropout_p); });
  require(a.offset < (uint64_t{1} << 32), "the dropout offset must be below 2^32");
  require(valid_dtype(a.q.dtype), "unsupported dtype");
  // Empty tensors may come with a null address.
  const bool no_q = a.varlen() ? a.total_q == 0 : a.seqlen_q == 0;
  const bool no_k = a.varlen() ? a.total_k == 0 : a.seqlen_k == 0;
  check_tensor(a.q, "q", a.q.dtype, no_q);
  check_tensor(a.k, "k", a.q.dtype, no_k);
  check_tensor(a.v, "v", a.q.dtype, no_k);
  check_tensor(a.out, "out", a.q.dtype, no_q);
  require(a.lse != nullptr || no_q, "lse buffer is missing");
  if (a.bias.data) require(valid_dtype(a.bias.dtype), "bias dtype must be float32, float16 or bfloat16");
  if (backward) {
    check_tensor(a.dout, "dout", a.q.dtype, no_q);
    check_tensor(a.dq, "dq", a.q.dtype, no_q);
    check_tensor(a.dk, "dk", a.q.dtype, no_k);
    check_tensor(a.dv, "dv", a.q.dtype, no_k);
    if (a.dbias.data) {
      require(a.bias.data != nullptr, "dbias needs a bias");
      require(a.dbias.dtype == DType::F32 && !a.dbias.kv_heads,
              "the dbias workspace must be float32 with one slice per query head");
    }
  }
}

uint32_t dropout_bits(uint64_t seed, uint64_t offset, uint32_t bh, uint32_t i, uint64_t j) {
  const uint32_t octet = static_cast<uint32_t>(j >> 3);
  return detail::dropout_half(detail::dropout_octet(seed, offset, bh, i, octet), static_cast<uint32_t>(j & 7u));
}

uint32_t dropout_threshold(float p) {
  double t = std::floor(static_cast<double>(p) * 65536.0);
  if (t <= 0) return 0;
  if (t >= 65536.0) return 65536u;  // keeps nothing
  return static_cast<uint32_t>(t);
}

}  // namespace symheap::attention
