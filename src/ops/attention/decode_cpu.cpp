// Attention over a KV cache: the argument checks (shared with CUDA) and the
// cpu path. The cpu path reads lengths and block tables on the host, so it
// checks every block id and length a call would use before it writes
// anything. Work is split over (batch, kv head, query chunk) items; each item
// loads a key/value row once for every query head of its group.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "ops/attention/common.hpp"
#include "ops/attention/decode.hpp"
#include "symheap/errors.hpp"

namespace symheap::attention {
namespace {

constexpr int kRowsPerItem = 16;  // query rows of one item (times the group's heads)
constexpr int kKeysPerTile = 64;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

[[noreturn]] void fail(const std::string& message) {
  throw InvalidArgument("attention (kv cache): " + message);
}

std::string str(int64_t x) { return std::to_string(x); }

void check_same_dtype(const Tensor& t, const char* name, DType want) {
  SYMHEAP_REQUIRE(t.dtype == want, fail,
                  std::string(name) + " is " + dtype_name(t.dtype) + " but q is " +
                      dtype_name(want) + ": give q, the caches and k, v one dtype");
}

}  // namespace

void validate_cache(const CacheArgs& a) {
  SYMHEAP_REQUIRE(a.batch >= 1, fail, "batch must be >= 1, got " + str(a.batch));
  SYMHEAP_REQUIRE(a.heads_q >= 1 && a.heads_kv >= 1, fail, "head counts must be >= 1");
  SYMHEAP_REQUIRE(a.heads_q % a.heads_kv == 0, fail,
                  "the number of query heads (" + str(a.heads_q) +
                      ") must be a multiple of the number of key/value heads in the cache (" +
                      str(a.heads_kv) + ")");
  SYMHEAP_REQUIRE(a.head_dim >= 1 && a.head_dim <= 256, fail,
                  "head_dim must be in [1, 256], got " + str(a.head_dim));
  SYMHEAP_REQUIRE(a.q.dtype == DType::F32 || a.q.dtype == DType::F16 || a.q.dtype == DType::BF16,
                  fail, "unsupported dtype");
  SYMHEAP_REQUIRE(a.seqlen_q >= 0, fail, "seqlen_q must be >= 0");
  if (a.varlen()) SYMHEAP_REQUIRE(a.total_q >= 0, fail, "the packed query row count must be >= 0");
  const bool no_q = a.varlen() ? a.total_q == 0 : a.seqlen_q == 0;
  SYMHEAP_REQUIRE(a.q.data != nullptr || no_q, fail, "q is missing");
  SYMHEAP_REQUIRE(a.out.data != nullptr || no_q, fail, "out is missing");
  SYMHEAP_REQUIRE(a.lse != nullptr || no_q, fail, "the lse buffer is missing");
  SYMHEAP_REQUIRE(a.k_cache.data != nullptr && a.v_cache.data != nullptr, fail,
                  "k_cache and v_cache are missing or hold no rows (give caches of at least "
                  "one row)");
  check_same_dtype(a.out, "out", a.q.dtype);
  check_same_dtype(a.k_cache, "k_cache", a.q.dtype);
  check_same_dtype(a.v_cache, "v_cache", a.q.dtype);
  SYMHEAP_REQUIRE(a.seqlens_k != nullptr, fail,
                  "cache_seqlens (the rows already in the cache) is missing");
  if (a.paged()) {
    SYMHEAP_REQUIRE(a.block_size >= 1, fail, "block_size must be >= 1, got " + str(a.block_size));
    SYMHEAP_REQUIRE(a.num_blocks >= 1, fail, "the cache must hold at least one block");
    SYMHEAP_REQUIRE(a.max_blocks >= 1, fail, "block_table must have at least one column");
    SYMHEAP_REQUIRE(a.block_table_stride >= a.max_blocks || a.batch == 1, fail,
                    "block_table rows overlap (row stride " + str(a.block_table_stride) + " < " +
                        str(a.max_blocks) + " columns)");
    SYMHEAP_REQUIRE(static_cast<int64_t>(a.max_blocks) * a.block_size == a.capacity, fail,
                    "capacity must be max_blocks * block_size = " +
                        str(static_cast<int64_t>(a.max_blocks) * a.block_size) + ", got " +
                        str(a.capacity));
  } else {
    SYMHEAP_REQUIRE(a.capacity >= 0, fail, "the cache capacity must be >= 0");
  }
  if (a.appends()) {
    SYMHEAP_REQUIRE(a.v_new.data != nullptr, fail, "give both k and v to append, or neither");
    SYMHEAP_REQUIRE(!a.varlen(), fail,
                    "appending new keys takes fixed-length queries (q of shape (B, S, H, D))");
    SYMHEAP_REQUIRE(a.seqlen_new >= 1, fail, "k and v to append must have at least one row");
    check_same_dtype(a.k_new, "k", a.q.dtype);
    check_same_dtype(a.v_new, "v", a.q.dtype);
  } else {
    SYMHEAP_REQUIRE(a.v_new.data == nullptr, fail, "give both k and v to append, or neither");
  }
  SYMHEAP_REQUIRE(std::isfinite(a.scale), fail, "softmax_scale must be finite");
  SYMHEAP_REQUIRE(std::isfinite(a.softcap) && a.softcap >= 0, fail,
                  "softcap must be >= 0 (0 disables it)");
  SYMHEAP_REQUIRE(a.window_left >= -1 && a.window_right >= -1, fail,
                  "window sides must be >= -1 (-1 = unbounded)");
  SYMHEAP_REQUIRE(a.num_splits >= 0, fail,
                  "num_splits must be >= 0 (0 = automatic), got " + str(a.num_splits));
}

namespace {

using detail::KeyRange;
using detail::visible_keys;

int key_length_before(const CacheArgs& a, int b) {
  return a.seqlens_k_cumulative ? a.seqlens_k[b + 1] - a.seqlens_k[b] : a.seqlens_k[b];
}

struct QRows {
  int64_t first;  // packed row (0 for fixed lengths)
  int count;
};

QRows query_rows(const CacheArgs& a, int b) {
  if (!a.varlen()) return {0, a.seqlen_q};
  return {a.cu_seqlens_q[b], a.cu_seqlens_q[b + 1] - a.cu_seqlens_q[b]};
}

// Element offset of cache row j (0 <= j < capacity) of sequence b, head h.
int64_t cache_offset(const CacheArgs& a, const Tensor& t, int b, int64_t j, int h) {
  if (!a.paged()) return b * t.batch_stride + j * t.row_stride + h * t.head_stride;
  const int32_t block = a.block_table[b * a.block_table_stride + j / a.block_size];
  return block * t.batch_stride + (j % a.block_size) * t.row_stride + h * t.head_stride;
}

// Every length and block id the call reads or writes, before anything is written.
void check_host_state(const CacheArgs& a) {
  if (a.varlen()) {
    for (int b = 0; b < a.batch; ++b) {
      const int64_t s0 = a.cu_seqlens_q[b], s1 = a.cu_seqlens_q[b + 1];
      SYMHEAP_REQUIRE(s0 >= 0 && s1 >= s0 && s1 <= a.total_q, fail,
                      "cu_seqlens_q must be non-decreasing, start >= 0 and end <= the packed row "
                      "count " + str(a.total_q) + "; entry " + str(b) + " spans [" + str(s0) +
                          ", " + str(s1) + ")");
      SYMHEAP_REQUIRE(s1 - s0 <= a.seqlen_q, fail,
                      "sequence " + str(b) + " has " + str(s1 - s0) +
                          " query rows > max_seqlen_q " + str(a.seqlen_q));
    }
  }
  const char* lengths = a.seqlens_k_cumulative ? "cu_seqlens_k" : "cache_seqlens";
  for (int b = 0; b < a.batch; ++b) {
    const int64_t before = key_length_before(a, b);
    SYMHEAP_REQUIRE(before >= 0, fail,
                    std::string(lengths) + " gives sequence " + str(b) + " the length " +
                        str(before) + "; lengths must be >= 0");
    const int64_t after = before + (a.appends() ? a.seqlen_new : 0);
    SYMHEAP_REQUIRE(after <= a.capacity, fail,
                    "sequence " + str(b) + " needs " + str(after) + " cache rows (" + str(before) +
                        (a.appends() ? " + " + str(a.seqlen_new) + " appended" : std::string()) +
                        ") but the cache holds " + str(a.capacity) + " per sequence" +
                        (a.paged() ? " (max_blocks " + str(a.max_blocks) + " x block_size " + str(a.block_size) + ")" : std::string()));
    if (!a.paged()) continue;
    const int64_t used = (after + a.block_size - 1) / a.block_size;
    for (int64_t c = 0; c < used; ++c) {
      const int32_t id = a.block_table[b * a.block_table_stride + c];
      SYMHEAP_REQUIRE(id >= 0 && id < a.num_blocks, fail,
                      "block_table[" + str(b) + ", " + str(c) + "] = " + str(id) +
                          " is outside [0, num_blocks = " + str(a.num_blocks) + ")");
    }
  }
}

void append_rows(const CacheArgs& a) {
  const size_t row_bytes = static_cast<size_t>(a.head_dim) * dtype_size(a.q.dtype);
  for (int b = 0; b < a.batch; ++b) {
    const int before = key_length_before(a, b);
    for (int t = 0; t < a.seqlen_new; ++t)
      for (int h = 0; h < a.heads_kv; ++h) {
        const Tensor* src[] = {&a.k_new, &a.v_new};
        const Tensor* dst[] = {&a.k_cache, &a.v_cache};
        for (int x = 0; x < 2; ++x) {
          const int64_t from = b * src[x]->batch_stride + t * src[x]->row_stride + h * src[x]->head_stride;
          const int64_t to = cache_offset(a, *dst[x], b, before + t, h);
          std::memcpy(static_cast<char*>(dst[x]->data) + to * dtype_size(a.q.dtype),
                      static_cast<const char*>(src[x]->data) + from * dtype_size(a.q.dtype), row_bytes);
        }
      }
  }
}

// One item: query rows [m0, m0 + rows) of sequence b, every head of kv head hk.
void attend_item(const CacheArgs& a, int b, int hk, int m0) {
  const QRows qr = query_rows(a, b);
  const int rows = std::min(kRowsPerItem, qr.count - m0);
  if (rows <= 0) return;
  const int d = a.head_dim, group = a.group(), n = rows * group;
  const int sq = qr.count;
  const int sk = key_length_before(a, b) + (a.appends() ? a.seqlen_new : 0);
  // Vector r is query row m0 + r / group of head hk * group + r % group.
  std::vector<float> q(static_cast<size_t>(n) * d), acc(static_cast<size_t>(n) * d, 0.0f);
  std::vector<float> m(n, kNegInf), l(n, 0.0f), slope(n, 0.0f);
  std::vector<float> k(static_cast<size_t>(kKeysPerTile) * d), v(static_cast<size_t>(kKeysPerTile) * d);
  std::vector<float> s(kKeysPerTile);
  for (int r = 0; r < n; ++r) {
    const int hq = hk * group + r % group;
    const int64_t row = qr.first + m0 + r / group;
    cpu_load_row(a.q.data, a.q.dtype, b * a.q.batch_stride + row * a.q.row_stride + hq * a.q.head_stride,
                 d, &q[static_cast<size_t>(r) * d]);
    if (a.alibi_slopes) slope[r] = a.alibi_slopes[b * a.alibi_batch_stride + hq];
  }
  const int lo = visible_keys(m0, sq, sk, a.window_left, a.window_right).lo;
  const int hi = visible_keys(m0 + rows - 1, sq, sk, a.window_left, a.window_right).hi;
  for (int n0 = lo; n0 < hi; n0 += kKeysPerTile) {
    const int cols = std::min(kKeysPerTile, hi - n0);
    for (int c = 0; c < cols; ++c) {
      cpu_load_row(a.k_cache.data, a.q.dtype, cache_offset(a, a.k_cache, b, n0 + c, hk), d, &k[c * d]);
      cpu_load_row(a.v_cache.data, a.q.dtype, cache_offset(a, a.v_cache, b, n0 + c, hk), d, &v[c * d]);
    }
    for (int r = 0; r < n; ++r) {
      const int i = m0 + r / group;
      const KeyRange vis = visible_keys(i, sq, sk, a.window_left, a.window_right);
      const float* qr_ = &q[static_cast<size_t>(r) * d];
      float tile_max = kNegInf;
      for (int c = 0; c < cols; ++c) {
        const int j = n0 + c;
        if (j < vis.lo || j >= vis.hi) {
          s[c] = kNegInf;
          continue;
        }
        float x = cpu_dot(qr_, &k[c * d], d) * a.scale;
        if (a.softcap > 0) x = a.softcap * std::tanh(x / a.softcap);
        if (a.alibi_slopes) x -= slope[r] * static_cast<float>(std::llabs(static_cast<int64_t>(i) + sk - sq - j));
        s[c] = x;
        tile_max = std::max(tile_max, x);
      }
      if (tile_max == kNegInf) continue;
      const float m_new = std::max(m[r], tile_max);
      const float rescale = std::exp(m[r] - m_new);
      float* o = &acc[static_cast<size_t>(r) * d];
      l[r] *= rescale;
      for (int c = 0; c < d; ++c) o[c] *= rescale;
      for (int c = 0; c < cols; ++c) {
        const float p = std::exp(s[c] - m_new);
        if (p == 0.0f) continue;
        l[r] += p;
        const float* vr = &v[c * d];
        for (int e = 0; e < d; ++e) o[e] += p * vr[e];
      }
      m[r] = m_new;
    }
  }
  for (int r = 0; r < n; ++r) {
    const int hq = hk * group + r % group;
    const int64_t row = qr.first + m0 + r / group;
    float* o = &acc[static_cast<size_t>(r) * d];
    float lse = kNegInf;
    if (l[r] > 0) {
      const float inv = 1.0f / l[r];
      for (int c = 0; c < d; ++c) o[c] *= inv;
      lse = m[r] + std::log(l[r]);
    }  // else: no visible key, the row stays zero
    cpu_store_row(a.out.data, a.out.dtype, b * a.out.batch_stride + row * a.out.row_stride + hq * a.out.head_stride,
                  d, o);
    a.lse[b * a.lse_batch_stride + hq * a.lse_head_stride + row] = lse;
  }
}

}  // namespace

void cache_attention_cpu(const CacheArgs& a, int threads) {
  validate_cache(a);
  check_host_state(a);
  if (a.appends()) append_rows(a);
  const int chunks = (a.seqlen_q + kRowsPerItem - 1) / kRowsPerItem;
  const int64_t items = static_cast<int64_t>(a.batch) * a.heads_kv * chunks;
  if (items == 0) return;
  // Work bound: every query row over the whole capacity (a decode step is small).
  const int64_t rows = a.varlen() ? a.total_q : static_cast<int64_t>(a.batch) * a.seqlen_q;
  const int64_t work = rows * a.heads_q * a.capacity * a.head_dim;
  cpu_parallel_for(items, cpu_threads_for(work, threads), [&](int64_t it) {
    const int chunk = static_cast<int>(it % chunks);
    const int hk = static_cast<int>(it / chunks % a.heads_kv);
    const int b = static_cast<int>(it / chunks / a.heads_kv);
    attend_item(a, b, hk, chunk * kRowsPerItem);
  });
}

}  // namespace symheap::attention
