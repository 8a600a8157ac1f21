// Turns a KV-cache call described by tensor shapes (CacheCall) into the op
// core's CacheArgs: every shape, dtype and stride check of the call lives here.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <utility>

#include "ops/attention/decode.hpp"
#include "symheap/errors.hpp"

namespace symheap::attention {
namespace {

[[noreturn]] void fail(const std::string& message) {
  throw InvalidArgument("attention (kv cache): " + message);
}

std::string str(int64_t x) { return std::to_string(x); }

std::string shape_str(const std::vector<int64_t>& s) {
  std::string out = "(";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + str(s[i]);
  return out + (s.size() == 1 ? ",)" : ")");
}

DType float_dtype(const TensorDesc& t, const char* name) {
  if (t.dtype == "float32") return DType::F32;
  if (t.dtype == "float16") return DType::F16;
  if (t.dtype == "bfloat16") return DType::BF16;
  fail(std::string(name) + " has dtype " + t.dtype + ": use float16 or bfloat16 (float32 on cpu)");
}

void need(const TensorDesc& t, const char* name, const char* what) {
  SYMHEAP_REQUIRE(t.present, fail, std::string(name) + " is missing: " + what);
}

void need_rank(const TensorDesc& t, const char* name, size_t rank, const char* layout) {
  SYMHEAP_REQUIRE(t.shape.size() == rank && t.strides.size() == rank, fail,
                  std::string(name) + " must be " + layout + ", got shape " + shape_str(t.shape));
}

void need_unit_last(const TensorDesc& t, const char* name) {
  SYMHEAP_REQUIRE(t.strides.back() == 1 || t.shape.back() <= 1, fail,
                  std::string(name) +
                      " needs unit stride along its last dimension (make it contiguous)");
}

// An int32 vector of n entries with unit stride.
void need_int_vector(const TensorDesc& t, const char* name, int64_t n, const char* what) {
  need(t, name, what);
  SYMHEAP_REQUIRE(t.dtype == "int32", fail, std::string(name) + " must be int32, got " + t.dtype);
  SYMHEAP_REQUIRE(t.shape.size() == 1 && t.shape[0] == n, fail,
                  std::string(name) + " must have shape (" + str(n) + ",), got " +
                      shape_str(t.shape));
  SYMHEAP_REQUIRE(t.strides[0] == 1 || n <= 1, fail, std::string(name) + " must be contiguous");
}

Tensor as_tensor(const TensorDesc& t, DType dtype, int64_t batch_stride, int64_t row_stride,
                 int64_t head_stride) {
  Tensor out;
  out.data = const_cast<void*>(t.data);
  out.dtype = dtype;
  out.batch_stride = batch_stride;
  out.row_stride = row_stride;
  out.head_stride = head_stride;
  return out;
}

}  // namespace

void set_cache_options(CacheCall& c, int64_t head_dim, bool causal, int64_t window_left,
                       int64_t window_right, const double* softmax_scale, double softcap) {
  SYMHEAP_REQUIRE(head_dim >= 1, fail, "head_dim must be >= 1, got " + str(head_dim));
  for (const int64_t side : {window_left, window_right})  // the range: validate_cache
    SYMHEAP_REQUIRE(side >= INT32_MIN && side <= INT32_MAX, fail,
                    "window sides must fit in 32 bits, got " + str(side));
  c.scale = static_cast<float>(softmax_scale ? *softmax_scale
                                             : 1.0 / std::sqrt(static_cast<double>(head_dim)));
  c.softcap = static_cast<float>(softcap);
  c.window_left = static_cast<int>(window_left);
  c.window_right = causal ? 0 : static_cast<int>(window_right);
}

CacheArgs cache_args(const CacheCall& c) {
  CacheArgs a;
  // Every size below is kept in 32 bits.
  const std::pair<const TensorDesc*, const char*> all[] = {
      {&c.q, "q"},
      {&c.k_cache, "k_cache"},
      {&c.v_cache, "v_cache"},
      {&c.k, "k"},
      {&c.v, "v"},
      {&c.out, "out"},
      {&c.lse, "lse"},
      {&c.cache_seqlens, "cache_seqlens"},
      {&c.cu_seqlens_q, "cu_seqlens_q"},
      {&c.cu_seqlens_k, "cu_seqlens_k"},
      {&c.block_table, "block_table"},
      {&c.alibi_slopes, "alibi_slopes"}};
  for (const auto& [t, name] : all)
    if (t->present)
      for (const int64_t d : t->shape)
        SYMHEAP_REQUIRE(d <= INT32_MAX, fail,
                        std::string(name) + " has a dimension of " + str(d) +
                            ": the KV-cache calls take dimensions below 2^31");
  SYMHEAP_REQUIRE(c.num_splits >= INT32_MIN && c.num_splits <= INT32_MAX, fail,
                  "num_splits must fit in 32 bits, got " + str(c.num_splits));
  const bool varlen = c.cu_seqlens_q.present;
  need(c.q, "q", "the queries");
  const DType dtype = float_dtype(c.q, "q");

  // Queries and output.
  int64_t B, Hq, D;
  if (varlen) {
    need_rank(c.q, "q", 3, "(total_q, Hq, D)");
    SYMHEAP_REQUIRE(!c.cache_seqlens.present, fail,
                    "the varlen call takes key lengths from cu_seqlens_k, not cache_seqlens");
    SYMHEAP_REQUIRE(!c.k.present && !c.v.present, fail, "the varlen call appends no keys (k, v)");
    need(c.block_table, "block_table", "the varlen call reads a paged cache");
    SYMHEAP_REQUIRE(c.cu_seqlens_q.shape.size() == 1 && c.cu_seqlens_q.shape[0] >= 2, fail,
                    "cu_seqlens_q must have batch + 1 >= 2 entries, got shape " +
                        shape_str(c.cu_seqlens_q.shape));
    B = c.cu_seqlens_q.shape[0] - 1;
    need_int_vector(c.cu_seqlens_q, "cu_seqlens_q", B + 1, "sequence starts");
    need_int_vector(c.cu_seqlens_k, "cu_seqlens_k", B + 1, "key sequence starts (batch + 1 entries)");
    SYMHEAP_REQUIRE(c.max_seqlen_q >= 0, fail,
                    "max_seqlen_q must be >= 0, got " + str(c.max_seqlen_q));
    Hq = c.q.shape[1];
    D = c.q.shape[2];
    // No sequence has more query rows than q: a larger bound means the same.
    a.seqlen_q = static_cast<int>(std::min<int64_t>(c.max_seqlen_q, c.q.shape[0]));
    a.cu_seqlens_q = static_cast<const int32_t*>(c.cu_seqlens_q.data);
    a.total_q = c.q.shape[0];
    a.q = as_tensor(c.q, dtype, 0, c.q.strides[0], c.q.strides[1]);
    a.seqlens_k = static_cast<const int32_t*>(c.cu_seqlens_k.data);
    a.seqlens_k_cumulative = true;
  } else {
    need_rank(c.q, "q", 4, "(B, Sq, Hq, D)");
    SYMHEAP_REQUIRE(!c.cu_seqlens_k.present, fail,
                    "cu_seqlens_k needs cu_seqlens_q (the varlen call)");
    B = c.q.shape[0];
    Hq = c.q.shape[2];
    D = c.q.shape[3];
    a.seqlen_q = static_cast<int>(c.q.shape[1]);
    a.q = as_tensor(c.q, dtype, c.q.strides[0], c.q.strides[1], c.q.strides[2]);
    need_int_vector(c.cache_seqlens, "cache_seqlens", B, "the rows already in each sequence's cache");
    a.seqlens_k = static_cast<const int32_t*>(c.cache_seqlens.data);
  }
  need_unit_last(c.q, "q");
  SYMHEAP_REQUIRE(B >= 1 && B <= 0x7fffffff, fail, "batch must be >= 1, got " + str(B));
  need(c.out, "out", "the output buffer");
  SYMHEAP_REQUIRE(c.out.shape == c.q.shape, fail,
                  "out must have q's shape " + shape_str(c.q.shape) + ", got " +
                      shape_str(c.out.shape));
  SYMHEAP_REQUIRE(c.out.dtype == c.q.dtype, fail, "out must have q's dtype " + c.q.dtype);
  need_unit_last(c.out, "out");
  a.out = varlen ? as_tensor(c.out, dtype, 0, c.out.strides[0], c.out.strides[1])
                 : as_tensor(c.out, dtype, c.out.strides[0], c.out.strides[1], c.out.strides[2]);
  need(c.lse, "lse", "the log-sum-exp buffer");
  SYMHEAP_REQUIRE(c.lse.dtype == "float32", fail, "lse must be float32");
  if (varlen) {
    need_rank(c.lse, "lse", 2, "(Hq, total_q)");
    SYMHEAP_REQUIRE(c.lse.shape[0] == Hq && c.lse.shape[1] == c.q.shape[0], fail,
                    "lse must have shape (" + str(Hq) + ", " + str(c.q.shape[0]) + "), got " +
                        shape_str(c.lse.shape));
    a.lse_batch_stride = 0;
    a.lse_head_stride = c.lse.strides[0];
  } else {
    need_rank(c.lse, "lse", 3, "(B, Hq, Sq)");
    SYMHEAP_REQUIRE(c.lse.shape[0] == B && c.lse.shape[1] == Hq && c.lse.shape[2] == c.q.shape[1],
                    fail,
                    "lse must have shape (" + str(B) + ", " + str(Hq) + ", " + str(c.q.shape[1]) +
                        "), got " + shape_str(c.lse.shape));
    a.lse_batch_stride = c.lse.strides[0];
    a.lse_head_stride = c.lse.strides[1];
  }
  need_unit_last(c.lse, "lse");
  a.lse = static_cast<float*>(const_cast<void*>(c.lse.data));

  // The cache.
  need(c.k_cache, "k_cache", "the key cache");
  need(c.v_cache, "v_cache", "the value cache");
  const char* cache_layout = c.block_table.present ? "(num_blocks, block_size, Hkv, D)"
                                                   : "(B, capacity, Hkv, D)";
  need_rank(c.k_cache, "k_cache", 4, cache_layout);
  need_rank(c.v_cache, "v_cache", 4, cache_layout);
  SYMHEAP_REQUIRE(c.k_cache.shape == c.v_cache.shape, fail,
                  "k_cache and v_cache must have one shape, got " + shape_str(c.k_cache.shape) +
                      " and " + shape_str(c.v_cache.shape));
  SYMHEAP_REQUIRE(c.k_cache.dtype == c.q.dtype && c.v_cache.dtype == c.q.dtype, fail,
                  "k_cache and v_cache must have q's dtype " + c.q.dtype + ", got " +
                      c.k_cache.dtype + " and " + c.v_cache.dtype);
  need_unit_last(c.k_cache, "k_cache");
  need_unit_last(c.v_cache, "v_cache");
  for (const TensorDesc* t : {&c.k_cache, &c.v_cache})
    SYMHEAP_REQUIRE(t->strides == c.k_cache.strides, fail,
                    "k_cache and v_cache must have the same strides");
  const int64_t Hkv = c.k_cache.shape[2];
  SYMHEAP_REQUIRE(c.k_cache.shape[3] == D, fail,
                  "the caches' head dim " + str(c.k_cache.shape[3]) + " differs from q's " +
                      str(D));
  SYMHEAP_REQUIRE(Hkv >= 1 && Hq >= 1 && Hq % Hkv == 0, fail,
                  "query heads (" + str(Hq) +
                      ") must be a multiple of the caches' key/value heads (" + str(Hkv) + ")");
  const auto& cs = c.k_cache.strides;
  a.k_cache = as_tensor(c.k_cache, dtype, cs[0], cs[1], cs[2]);
  a.v_cache = as_tensor(c.v_cache, dtype, cs[0], cs[1], cs[2]);
  if (c.block_table.present) {
    const TensorDesc& bt = c.block_table;
    SYMHEAP_REQUIRE(bt.dtype == "int32", fail, "block_table must be int32, got " + bt.dtype);
    SYMHEAP_REQUIRE(bt.shape.size() == 2 && bt.shape[0] == B && bt.shape[1] >= 1, fail,
                    "block_table must have shape (" + str(B) + ", max_blocks >= 1), got " +
                        shape_str(bt.shape));
    SYMHEAP_REQUIRE(bt.strides[1] == 1 || bt.shape[1] == 1, fail,
                    "block_table rows must be contiguous");
    SYMHEAP_REQUIRE(c.k_cache.shape[0] >= 1 && c.k_cache.shape[1] >= 1, fail,
                    "the paged caches need at least one block of at least one row, got shape " +
                        shape_str(c.k_cache.shape));
    SYMHEAP_REQUIRE(bt.shape[1] * c.k_cache.shape[1] <= 0x7fffffff, fail,
                    "max_blocks * block_size must fit in int32");
    a.block_table = static_cast<const int32_t*>(bt.data);
    a.block_table_stride = bt.strides[0];
    a.max_blocks = static_cast<int>(bt.shape[1]);
    a.block_size = static_cast<int>(c.k_cache.shape[1]);
    a.num_blocks = static_cast<int>(std::min<int64_t>(c.k_cache.shape[0], 0x7fffffff));
    a.capacity = a.max_blocks * a.block_size;
  } else {
    SYMHEAP_REQUIRE(!varlen, fail, "the varlen call needs a block_table");
    SYMHEAP_REQUIRE(c.k_cache.shape[0] == B, fail,
                    "the dense caches must have batch " + str(B) + " (q's), got " +
                        str(c.k_cache.shape[0]));
    SYMHEAP_REQUIRE(c.k_cache.shape[1] <= 0x7fffffff, fail, "the cache capacity must fit in int32");
    a.capacity = static_cast<int>(c.k_cache.shape[1]);
  }

  // New keys and values.
  SYMHEAP_REQUIRE(c.k.present == c.v.present, fail, "give both k and v to append, or neither");
  if (c.k.present) {
    need_rank(c.k, "k", 4, "(B, S_new, Hkv, D)");
    need_rank(c.v, "v", 4, "(B, S_new, Hkv, D)");
    SYMHEAP_REQUIRE(c.k.shape == c.v.shape, fail,
                    "k and v must have one shape, got " + shape_str(c.k.shape) + " and " +
                        shape_str(c.v.shape));
    SYMHEAP_REQUIRE(c.k.shape[0] == B && c.k.shape[2] == Hkv && c.k.shape[3] == D, fail,
                    "k and v must have shape (" + str(B) + ", S_new, " + str(Hkv) + ", " + str(D) +
                        ") to match q and the caches, got " + shape_str(c.k.shape));
    SYMHEAP_REQUIRE(c.k.shape[1] >= 1, fail, "k and v to append must have at least one row");
    // Rows are written in place: a cache whose distinct rows share memory (a
    // dimension of stride 0, as expand() makes) would take one row's writes
    // for another's.
    for (int d = 0; d < 3; ++d)
      SYMHEAP_REQUIRE(c.k_cache.shape[d] <= 1 || c.k_cache.strides[d] != 0, fail,
                      "k_cache and v_cache receive the appended rows in place, so their rows "
                      "must not share memory; dimension " + str(d) + " has stride 0 (expanded?): "
                      "give a cache of its own memory");
    SYMHEAP_REQUIRE(c.k.dtype == c.q.dtype && c.v.dtype == c.q.dtype, fail,
                    "k and v must have q's dtype " + c.q.dtype);
    need_unit_last(c.k, "k");
    need_unit_last(c.v, "v");
    a.k_new = as_tensor(c.k, dtype, c.k.strides[0], c.k.strides[1], c.k.strides[2]);
    a.v_new = as_tensor(c.v, dtype, c.v.strides[0], c.v.strides[1], c.v.strides[2]);
    a.seqlen_new = static_cast<int>(c.k.shape[1]);
  }

  if (c.alibi_slopes.present) {
    const TensorDesc& s = c.alibi_slopes;
    SYMHEAP_REQUIRE(s.dtype == "float32", fail, "alibi_slopes must be float32");
    const bool flat = s.shape.size() == 1 && s.shape[0] == Hq;
    const bool per_batch = s.shape.size() == 2 && (s.shape[0] == B || s.shape[0] == 1) && s.shape[1] == Hq;
    SYMHEAP_REQUIRE(flat || per_batch, fail,
                    "alibi_slopes must have shape (" + str(Hq) + ",) or (" + str(B) + ", " +
                        str(Hq) + "), got " + shape_str(s.shape));
    need_unit_last(s, "alibi_slopes");
    a.alibi_slopes = static_cast<const float*>(s.data);
    a.alibi_batch_stride = per_batch && s.shape[0] > 1 ? s.strides[0] : 0;
  }

  a.batch = static_cast<int>(B);
  a.heads_q = static_cast<int>(Hq);
  a.heads_kv = static_cast<int>(Hkv);
  a.head_dim = static_cast<int>(D);
  a.scale = c.scale;
  a.softcap = c.softcap;
  a.window_left = c.window_left;
  a.window_right = c.window_right;
  a.num_splits = static_cast<int>(c.num_splits);
  validate_cache(a);
  return a;
}

}  // namespace symheap::attention
