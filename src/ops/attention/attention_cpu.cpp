// cpu path: tiled attention with an online softmax (fp32 accumulation), and
// the backward by recomputation from the log-sum-exp, as in FlashAttention 2.
// Work is split over (batch, head) items among a few threads; each item runs
// in a fixed order, so results do not depend on the thread count.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <exception>
#include <functional>
#include <limits>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "ops/attention/attention.hpp"
#include "ops/attention/common.hpp"
#include "symheap/errors.hpp"

namespace symheap::attention {
namespace {

using namespace detail;

constexpr int kBlockM = 64;  // query rows per tile
constexpr int kBlockN = 64;  // key rows per tile
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// ------------------------------------------------------------ element access

float load_scalar(const void* base, DType t, int64_t idx) {
  switch (t) {
    case DType::F32: return static_cast<const float*>(base)[idx];
    case DType::F16: return f16_to_f32(static_cast<const uint16_t*>(base)[idx]);
    case DType::BF16: return bf16_to_f32(static_cast<const uint16_t*>(base)[idx]);
  }
  return 0;
}

void load_row(const void* base, DType t, int64_t off, int n, float* dst) {
  switch (t) {
    case DType::F32: std::copy_n(static_cast<const float*>(base) + off, n, dst); break;
    case DType::F16: {
      const uint16_t* s = static_cast<const uint16_t*>(base) + off;
      for (int c = 0; c < n; ++c) dst[c] = f16_to_f32(s[c]);
      break;
    }
    case DType::BF16: {
      const uint16_t* s = static_cast<const uint16_t*>(base) + off;
      for (int c = 0; c < n; ++c) dst[c] = bf16_to_f32(s[c]);
      break;
    }
  }
}

void store_row(void* base, DType t, int64_t off, int n, const float* src) {
  switch (t) {
    case DType::F32: std::copy_n(src, n, static_cast<float*>(base) + off); break;
    case DType::F16: {
      uint16_t* d = static_cast<uint16_t*>(base) + off;
      for (int c = 0; c < n; ++c) d[c] = f32_to_f16(src[c]);
      break;
    }
    case DType::BF16: {
      uint16_t* d = static_cast<uint16_t*>(base) + off;
      for (int c = 0; c < n; ++c) d[c] = f32_to_bf16(src[c]);
      break;
    }
  }
}

float dot(const float* x, const float* y, int n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int c = 0;
  for (; c + 8 <= n; c += 8)
    for (int u = 0; u < 8; ++u) acc[u] += x[c + u] * y[c + u];
  for (; c < n; ++c) acc[c & 7] += x[c] * y[c];
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

void axpy(float alpha, const float* x, float* y, int n) {
  for (int c = 0; c < n; ++c) y[c] += alpha * x[c];
}

// ------------------------------------------------------------ sequences

struct Seq {
  int sq, sk;          // lengths of this batch entry
  int64_t q0, k0;      // first packed row (0 for fixed lengths)
};

Seq sequence(const Args& a, int b) {
  if (!a.varlen()) return {a.seqlen_q, a.seqlen_k, 0, 0};
  return {a.cu_seqlens_q[b + 1] - a.cu_seqlens_q[b], a.cu_seqlens_k[b + 1] - a.cu_seqlens_k[b],
          a.cu_seqlens_q[b], a.cu_seqlens_k[b]};
}

void check_cu_seqlens(const int32_t* cu, int batch, int64_t total, int max_len, const char* name) {
  for (int b = 0; b < batch; ++b) {
    int64_t len = static_cast<int64_t>(cu[b + 1]) - cu[b];
    if (cu[b] < 0 || len < 0 || cu[b + 1] > total)
      throw InvalidArgument(std::string("attention: ") + name + " must be non-decreasing, start >= 0 " +
                            "and end <= the packed row count " + std::to_string(total) +
                            "; entry " + std::to_string(b) + " spans [" + std::to_string(cu[b]) +
                            ", " + std::to_string(cu[b + 1]) + ")");
    if (len > max_len)
      throw InvalidArgument(std::string("attention: sequence ") + std::to_string(b) + " of " + name +
                            " has length " + std::to_string(len) + " > max_seqlen " +
                            std::to_string(max_len) + "; pass the true maximum");
  }
}

int64_t row_offset(const Tensor& t, int b, int64_t row, int h) {
  return b * t.batch_stride + row * t.row_stride + h * t.head_stride;
}

// ------------------------------------------------------------ logits

// Turns raw dot products of query row i with keys [n0, n0 + n) into logits
// (-inf where hidden). When `dcap` is given it receives d logit / d(scale*q.k).
struct LogitRule {
  const Args& a;
  int b, hq, hk;
  Seq seq;
  float slope = 0;

  LogitRule(const Args& args, int b_, int hq_, const Seq& s)
      : a(args), b(b_), hq(hq_), hk(hq_ / args.group()), seq(s) {
    if (a.alibi_slopes) slope = a.alibi_slopes[b * a.alibi_batch_stride + hq];
  }

  const char* broadcast_base(const Broadcast& x, size_t elem, int i) const {
    int head = x.kv_heads ? hk : hq;
    return static_cast<const char*>(x.data) +
           static_cast<int64_t>(elem) * (b * x.sb + head * x.sh + static_cast<int64_t>(i) * x.sq);
  }

  void apply(int i, int n0, int n, float* s, float* dcap) const {
    KeyRange vis = visible_keys(i, seq.sq, seq.sk, a.window_left, a.window_right);
    for (int c = 0; c < n; ++c) {
      float x = s[c] * a.scale;
      if (a.softcap > 0) {
        float t = std::tanh(x / a.softcap);
        x = a.softcap * t;
        if (dcap) dcap[c] = 1.0f - t * t;
      } else if (dcap) {
        dcap[c] = 1.0f;
      }
      s[c] = x;
    }
    if (a.bias.data) {
      const char* base = broadcast_base(a.bias, dtype_size(a.bias.dtype), i);
      for (int c = 0; c < n; ++c)
        s[c] += load_scalar(base, a.bias.dtype, static_cast<int64_t>(n0 + c) * a.bias.sk);
    }
    if (a.alibi_slopes) {
      int64_t diag = static_cast<int64_t>(i) + seq.sk - seq.sq;
      for (int c = 0; c < n; ++c)
        s[c] -= slope * static_cast<float>(std::llabs(diag - (n0 + c)));
    }
    const uint8_t* mask = a.mask.data ? reinterpret_cast<const uint8_t*>(broadcast_base(a.mask, 1, i))
                                      : nullptr;
    for (int c = 0; c < n; ++c) {
      int j = n0 + c;
      bool hidden = j < vis.lo || j >= vis.hi || (mask && !mask[static_cast<int64_t>(j) * a.mask.sk]);
      if (hidden) s[c] = kNegInf;
    }
  }
};

// Dropout scale of each key of one row: 0 (dropped) or 1/(1-p) (kept).
struct DropoutRule {
  bool on;
  uint32_t threshold;
  float keep_scale;
  uint64_t seed, offset;
  uint32_t bh;

  DropoutRule(const Args& a, int b, int hq)
      : on(a.dropout_p > 0),
        threshold(dropout_threshold(a.dropout_p)),
        keep_scale(1.0f / (1.0f - a.dropout_p)),
        seed(a.seed),
        offset(a.offset),
        bh(static_cast<uint32_t>(b * a.heads_q + hq)) {}

  void scales(int i, int n0, int n, float* out) const {
    if (!on) {
      std::fill_n(out, n, 1.0f);
      return;
    }
    U32x4 r{};
    for (int c = 0; c < n; ++c) {
      uint32_t j = static_cast<uint32_t>(n0 + c);
      if (c == 0 || (j & 7u) == 0) r = dropout_octet(seed, offset, bh, static_cast<uint32_t>(i), j >> 3);
      out[c] = dropout_half(r, j) >= threshold ? keep_scale : 0.0f;
    }
  }
};

// ------------------------------------------------------------ threads

int default_threads() {
  if (const char* env = std::getenv("SYMHEAP_ATTN_THREADS")) {
    int n = std::atoi(env);
    if (n >= 1) return std::min(n, 256);
  }
  unsigned hw = std::thread::hardware_concurrency();
  return static_cast<int>(std::clamp(hw == 0 ? 1u : hw, 1u, 8u));
}

// Keys visible to any of the query rows [m0, m0 + rows): visible ranges only
// grow with the row, so the span is [lo(first row), hi(last row)).
struct KeySpan {
  int lo, hi;
};
KeySpan tile_key_span(const Args& a, const Seq& seq, int m0, int rows) {
  return {visible_keys(m0, seq.sq, seq.sk, a.window_left, a.window_right).lo,
          visible_keys(m0 + rows - 1, seq.sq, seq.sk, a.window_left, a.window_right).hi};
}

// Loads keys and values [n0, n0 + cols) of kv head hk as fp32 rows.
void load_kv_tile(const Args& a, int b, int hk, const Seq& seq, int n0, int cols, int d,
                  float* k, float* v) {
  for (int c = 0; c < cols; ++c) {
    load_row(a.k.data, a.k.dtype, row_offset(a.k, b, seq.k0 + n0 + c, hk), d, &k[c * d]);
    load_row(a.v.data, a.v.dtype, row_offset(a.v, b, seq.k0 + n0 + c, hk), d, &v[c * d]);
  }
}

template <class Fn>
void parallel_for(int64_t items, int threads, Fn fn) {
  if (threads <= 0) threads = default_threads();
  int n = static_cast<int>(std::min<int64_t>(threads, items));
  if (n <= 1) {
    for (int64_t it = 0; it < items; ++it) fn(it);
    return;
  }
  std::atomic<int64_t> next{0};
  std::exception_ptr error;
  std::mutex error_mu;
  auto worker = [&] {
    try {
      for (int64_t it; (it = next.fetch_add(1)) < items;) fn(it);
    } catch (...) {
      std::lock_guard<std::mutex> lock(error_mu);
      if (!error) error = std::current_exception();
      next = items;
    }
  };
  std::vector<std::thread> pool;
  try {
    for (int t = 1; t < n; ++t) pool.emplace_back(worker);
  } catch (...) {
    // No more threads to be had: run with those already started.
  }
  worker();
  for (auto& t : pool) t.join();
  if (error) std::rethrow_exception(error);
}

// Rows of a tile buffer: a block, or the whole sequence when shorter (a short
// call then zero-fills kilobytes, not a full block's).
int tile_size(int length, int block) { return std::max(1, std::min(block, length)); }

// ------------------------------------------------------------ forward

void forward_item(const Args& a, int b, int hq) {
  const Seq seq = sequence(a, b);
  const int d = a.head_dim, hk = hq / a.group();
  const LogitRule logits(a, b, hq, seq);
  const DropoutRule dropout(a, b, hq);
  const int bm = tile_size(seq.sq, kBlockM), bn = tile_size(seq.sk, kBlockN);
  std::vector<float> q(bm * d), k(bn * d), v(bn * d), acc(bm * d);
  std::vector<float> m(bm), l(bm), s(bn), keep(bn);

  for (int m0 = 0; m0 < seq.sq; m0 += kBlockM) {
    const int rows = std::min(kBlockM, seq.sq - m0);
    for (int r = 0; r < rows; ++r)
      load_row(a.q.data, a.q.dtype, row_offset(a.q, b, seq.q0 + m0 + r, hq), d, &q[r * d]);
    std::fill(m.begin(), m.end(), kNegInf);
    std::fill(l.begin(), l.end(), 0.0f);
    std::fill(acc.begin(), acc.end(), 0.0f);
    const KeySpan span = tile_key_span(a, seq, m0, rows);
    for (int n0 = span.lo; n0 < span.hi; n0 += kBlockN) {
      const int cols = std::min(kBlockN, span.hi - n0);
      load_kv_tile(a, b, hk, seq, n0, cols, d, k.data(), v.data());
      for (int r = 0; r < rows; ++r) {
        const int i = m0 + r;
        for (int c = 0; c < cols; ++c) s[c] = dot(&q[r * d], &k[c * d], d);
        logits.apply(i, n0, cols, s.data(), nullptr);
        float tile_max = kNegInf;
        for (int c = 0; c < cols; ++c) tile_max = std::max(tile_max, s[c]);
        if (tile_max == kNegInf) continue;  // nothing visible here
        const float m_new = std::max(m[r], tile_max);
        const float rescale = std::exp(m[r] - m_new);  // 0 on the first visible tile
        l[r] *= rescale;
        float* o = &acc[r * d];
        for (int c = 0; c < d; ++c) o[c] *= rescale;
        dropout.scales(i, n0, cols, keep.data());
        for (int c = 0; c < cols; ++c) {
          const float p = std::exp(s[c] - m_new);
          l[r] += p;
          if (p * keep[c] != 0.0f) axpy(p * keep[c], &v[c * d], o, d);
        }
        m[r] = m_new;
      }
    }
    for (int r = 0; r < rows; ++r) {
      const int64_t row = seq.q0 + m0 + r;
      float* o = &acc[r * d];
      float lse = kNegInf;
      if (l[r] > 0) {
        const float inv = 1.0f / l[r];
        for (int c = 0; c < d; ++c) o[c] *= inv;
        lse = m[r] + std::log(l[r]);
      }  // else: no visible key, the row stays zero
      store_row(a.out.data, a.out.dtype, row_offset(a.out, b, row, hq), d, o);
      a.lse[b * a.lse_batch_stride + hq * a.lse_head_stride + row] = lse;
    }
  }
}

// ------------------------------------------------------------ backward

// One (batch, kv head) item: every query head of its group, so dk and dv are
// summed in a fixed order without atomics.
void backward_item(const Args& a, int b, int hk) {
  const Seq seq = sequence(a, b);
  const int d = a.head_dim, group = a.group();
  const int bm = tile_size(seq.sq, kBlockM), bn = tile_size(seq.sk, kBlockN);
  std::vector<float> q(bm * d), dout(bm * d), o(bm * d), dq(bm * d);
  std::vector<float> k(bn * d), v(bn * d);
  std::vector<float> dk(static_cast<size_t>(seq.sk) * d, 0.0f), dv(static_cast<size_t>(seq.sk) * d, 0.0f);
  std::vector<float> lse(bm), delta(bm), s(bn), dcap(bn), keep(bn);
  float* dbias = static_cast<float*>(a.dbias.data);

  for (int hq = hk * group; hq < (hk + 1) * group; ++hq) {
    const LogitRule logits(a, b, hq, seq);
    const DropoutRule dropout(a, b, hq);
    for (int m0 = 0; m0 < seq.sq; m0 += kBlockM) {
      const int rows = std::min(kBlockM, seq.sq - m0);
      for (int r = 0; r < rows; ++r) {
        const int64_t row = seq.q0 + m0 + r;
        load_row(a.q.data, a.q.dtype, row_offset(a.q, b, row, hq), d, &q[r * d]);
        load_row(a.dout.data, a.dout.dtype, row_offset(a.dout, b, row, hq), d, &dout[r * d]);
        load_row(a.out.data, a.out.dtype, row_offset(a.out, b, row, hq), d, &o[r * d]);
        delta[r] = dot(&dout[r * d], &o[r * d], d);
        const float x = a.lse[b * a.lse_batch_stride + hq * a.lse_head_stride + row];
        // A row with no visible key has lse -inf; +inf makes every p exactly 0.
        lse[r] = x == kNegInf ? std::numeric_limits<float>::infinity() : x;
      }
      std::fill(dq.begin(), dq.end(), 0.0f);
      const KeySpan span = tile_key_span(a, seq, m0, rows);
      for (int n0 = span.lo; n0 < span.hi; n0 += kBlockN) {
        const int cols = std::min(kBlockN, span.hi - n0);
        load_kv_tile(a, b, hk, seq, n0, cols, d, k.data(), v.data());
        for (int r = 0; r < rows; ++r) {
          const int i = m0 + r;
          for (int c = 0; c < cols; ++c) s[c] = dot(&q[r * d], &k[c * d], d);
          logits.apply(i, n0, cols, s.data(), dcap.data());
          dropout.scales(i, n0, cols, keep.data());
          float* dbias_row = nullptr;
          if (dbias)
            dbias_row = dbias + b * a.dbias.sb + hq * a.dbias.sh + static_cast<int64_t>(i) * a.dbias.sq;
          for (int c = 0; c < cols; ++c) {
            const float p = std::exp(s[c] - lse[r]);
            if (p == 0.0f) continue;  // hidden or negligible: no gradient flows
            const int j = n0 + c;
            const float dp_kept = dot(&dout[r * d], &v[c * d], d);
            if (keep[c] != 0.0f) axpy(p * keep[c], &dout[r * d], &dv[static_cast<size_t>(j) * d], d);
            const float ds = p * (dp_kept * keep[c] - delta[r]);  // d loss / d logit
            if (dbias_row) dbias_row[static_cast<int64_t>(j) * a.dbias.sk] += ds;
            const float ds_raw = ds * dcap[c] * a.scale;  // d loss / d (q.k)
            axpy(ds_raw, &k[c * d], &dq[r * d], d);
            axpy(ds_raw, &q[r * d], &dk[static_cast<size_t>(j) * d], d);
          }
        }
      }
      for (int r = 0; r < rows; ++r)
        store_row(a.dq.data, a.dq.dtype, row_offset(a.dq, b, seq.q0 + m0 + r, hq), d, &dq[r * d]);
    }
  }
  for (int j = 0; j < seq.sk; ++j) {
    store_row(a.dk.data, a.dk.dtype, row_offset(a.dk, b, seq.k0 + j, hk), d, &dk[static_cast<size_t>(j) * d]);
    store_row(a.dv.data, a.dv.dtype, row_offset(a.dv, b, seq.k0 + j, hk), d, &dv[static_cast<size_t>(j) * d]);
  }
}

void check_host_lengths(const Args& a) {
  if (!a.varlen()) return;
  check_cu_seqlens(a.cu_seqlens_q, a.batch, a.total_q, a.seqlen_q, "cu_seqlens_q");
  check_cu_seqlens(a.cu_seqlens_k, a.batch, a.total_k, a.seqlen_k, "cu_seqlens_k");
}

int threads_for(const Args& a, int threads) {
  const int64_t work = static_cast<int64_t>(a.batch) * a.heads_q * a.seqlen_q * a.seqlen_k * a.head_dim;
  return cpu_threads_for(work, threads);
}

}  // namespace

void forward_cpu(const Args& a, int threads) {
  validate(a, false);
  check_host_lengths(a);
  threads = threads_for(a, threads);
  parallel_for(static_cast<int64_t>(a.batch) * a.heads_q, threads, [&](int64_t it) {
    forward_item(a, static_cast<int>(it / a.heads_q), static_cast<int>(it % a.heads_q));
  });
}

// dbias slices accumulate (+=) over query rows: the caller zero-fills it.
void backward_cpu(const Args& a, int threads) {
  validate(a, true);
  check_host_lengths(a);
  threads = threads_for(a, threads);
  parallel_for(static_cast<int64_t>(a.batch) * a.heads_kv, threads, [&](int64_t it) {
    backward_item(a, static_cast<int>(it / a.heads_kv), static_cast<int>(it % a.heads_kv));
  });
}

// ------------------------------------------------------------ shared with the KV-cache path

// Worker threads start per call (tens of microseconds each): with the default
// thread count, a call below this many multiply-adds runs on the calling thread.
constexpr int64_t kInlineWork = int64_t{1} << 16;

int cpu_threads_for(int64_t work, int threads) {
  if (threads > 0) return threads;
  return work < kInlineWork ? 1 : threads;
}

void cpu_parallel_for(int64_t items, int threads, const std::function<void(int64_t)>& fn) {
  parallel_for(items, threads, fn);
}
void cpu_load_row(const void* base, DType t, int64_t off, int n, float* dst) {
  load_row(base, t, off, n, dst);
}
void cpu_store_row(void* base, DType t, int64_t off, int n, const float* src) {
  store_row(base, t, off, n, src);
}
float cpu_dot(const float* x, const float* y, int n) { return dot(x, y, n); }

}  // namespace symheap::attention
