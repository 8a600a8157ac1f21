// CUDA path of attention over a KV cache: an append kernel (new rows into the
// cache at each sequence's length), a split-K attention kernel, and a combine
// kernel that merges the splits by their log-sum-exp.
//
// The attention kernel runs one CTA per (key split, kv head x query tile,
// sequence). The CTA's query vectors are up to M (query row, head) pairs of
// one kv-head group, so each K/V row is read once for all of them. A key row
// is spread over DB/8 lanes (16-byte loads, 8 elements each); the dot
// products are reduced with shuffles, and each lane keeps an online softmax
// and the fp32 output columns it owns. Lengths and block ids are read on the
// device only: a bad one is recorded in a host-mapped word (raised by the next
// call or by cache_check_cuda) and the sequence gets NaN outputs, with no
// access out of bounds and no write to the cache.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <string>

#include "backends/cuda_kernel_cache.cuh"
#include "backends/cuda_util.cuh"
#include "ops/attention/common.hpp"
#include "ops/attention/decode.hpp"
#include "symheap/errors.hpp"
#include "symheap/runtime.hpp"

namespace symheap::attention {
namespace kvcache {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kMinKeysPerSplit = 128;
constexpr int kMaxSplits = 256;

// Codes of the recorded error word: code << 56 | sequence << 32 | value.
enum : unsigned { kBadLength = 1, kNoRoom = 2, kBadBlock = 3 };

struct Params {
  const void* q;
  void* out;
  float* lse;
  int64_t q_sb, q_sr, q_sh, o_sb, o_sr, o_sh, lse_sb, lse_sh;
  const void* k;
  const void* v;
  int64_t k_sb, k_sr, k_sh, v_sb, v_sr, v_sh;
  const void* k_new;
  const void* v_new;
  int64_t kn_sb, kn_sr, kn_sh, vn_sb, vn_sr, vn_sh;
  int s_new;
  const int32_t* cu_q;
  int64_t total_q;
  int seqlen_q;
  const int32_t* seqlens_k;
  int cumulative;
  const int32_t* table;
  int64_t table_stride;
  int block_size, num_blocks, capacity;
  int batch, heads_q, heads_kv, group, d;
  float scale, softcap;
  int win_left, win_right;
  const float* alibi;
  int64_t alibi_sb;
  int splits, mtiles;
  int64_t vectors;  // flat query rows x heads_q: the workspace's stride between splits
  float* part_out;  // [split][vector][d]
  float* part_lse;  // [split][vector]
  unsigned long long* error;  // host-mapped
};

__device__ __forceinline__ void record_error(const Params& p, unsigned code, int b, int value) {
  volatile unsigned long long* w = p.error;
  if (*w != 0ull) return;  // keep the first one seen
  *w = static_cast<unsigned long long>(code) << 56 |
       static_cast<unsigned long long>(static_cast<unsigned>(b) & 0xFFFFFFu) << 32 |
       static_cast<unsigned>(value);
  __threadfence_system();
}

__device__ __forceinline__ int length_before(const Params& p, int b) {
  return p.cumulative ? p.seqlens_k[b + 1] - p.seqlens_k[b] : p.seqlens_k[b];
}

struct QSeq {
  int64_t q0;  // first packed row (0 for fixed lengths)
  int sq;
  int64_t flat0;  // first row in the flat row numbering of the workspace
};

// Packed lengths are clamped to the buffers (as the other attention kernels do).
__device__ __forceinline__ QSeq query_seq(const Params& p, int b) {
  if (!p.cu_q) return QSeq{0, p.seqlen_q, static_cast<int64_t>(b) * p.seqlen_q};
  const int64_t q1 = min(static_cast<int64_t>(p.cu_q[b + 1]), p.total_q);
  const int64_t q0 = max(int64_t{0}, min(static_cast<int64_t>(p.cu_q[b]), q1));
  return QSeq{q0, static_cast<int>(min(q1 - q0, static_cast<int64_t>(p.seqlen_q))), q0};
}

// Block and in-block row of cache row j; false for a block id out of range.
__device__ __forceinline__ bool locate(const Params& p, int b, int j, int* block, int* row) {
  if (!p.table) {
    *block = b;
    *row = j;
    return true;
  }
  const int id = p.table[b * p.table_stride + j / p.block_size];
  *block = id;
  *row = j % p.block_size;
  return id >= 0 && id < p.num_blocks;
}

template <class T>
__device__ __forceinline__ void to_float8(const uint4& u, float f[8]);
template <>
__device__ __forceinline__ void to_float8<__nv_bfloat16>(const uint4& u, float f[8]) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 x = __bfloat1622float2(h[i]);
    f[2 * i] = x.x;
    f[2 * i + 1] = x.y;
  }
}
template <>
__device__ __forceinline__ void to_float8<__half>(const uint4& u, float f[8]) {
  const __half2* h = reinterpret_cast<const __half2*>(&u);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 x = __half22float2(h[i]);
    f[2 * i] = x.x;
    f[2 * i + 1] = x.y;
  }
}

template <class T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16(x);
}
template <>
__device__ __forceinline__ __half from_float<__half>(float x) {
  return __float2half(x);
}

__device__ __forceinline__ uint4 load16(const void* base, int64_t elem_offset) {
  return __ldg(reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(base) + elem_offset));
}

// ---------------------------------------------------------------- append

// One CTA per (new row t, sequence b). A sequence whose rows would not fit, or
// whose blocks for them are out of range, writes nothing.
__global__ void __launch_bounds__(kThreads) append_kernel(const Params p) {
  const int t = blockIdx.x, b = blockIdx.y;
  const int len = length_before(p, b);
  if (len < 0 || len > p.capacity - p.s_new) {
    if (t == 0 && threadIdx.x == 0) record_error(p, len < 0 ? kBadLength : kNoRoom, b, len);
    return;
  }
  if (p.table) {
    const int first = len / p.block_size, last = (len + p.s_new - 1) / p.block_size;
    for (int c = first; c <= last; ++c) {
      const int id = p.table[b * p.table_stride + c];
      if (id < 0 || id >= p.num_blocks) {
        if (t == 0 && threadIdx.x == 0) record_error(p, kBadBlock, b, id);
        return;
      }
    }
  }
  int block, row;
  locate(p, b, len + t, &block, &row);
  const int chunks = p.d / 8;
  for (int idx = threadIdx.x; idx < p.heads_kv * chunks; idx += kThreads) {
    const int h = idx / chunks, c = (idx % chunks) * 8;
    const uint4 kx = load16(p.k_new, b * p.kn_sb + t * p.kn_sr + h * p.kn_sh + c);
    const uint4 vx = load16(p.v_new, b * p.vn_sb + t * p.vn_sr + h * p.vn_sh + c);
    *reinterpret_cast<uint4*>(static_cast<uint16_t*>(const_cast<void*>(p.k)) + block * p.k_sb +
                              row * p.k_sr + h * p.k_sh + c) = kx;
    *reinterpret_cast<uint4*>(static_cast<uint16_t*>(const_cast<void*>(p.v)) + block * p.v_sb +
                              row * p.v_sr + h * p.v_sh + c) = vx;
  }
}

// ---------------------------------------------------------------- attention

template <int DB, int M>
struct Tile {
  static constexpr int kLanes = DB / 8;          // lanes per key row
  static constexpr int kRowsPerWarp = 32 / kLanes;
  static constexpr int kStep = kWarps * kRowsPerWarp;
  static constexpr int kUnroll = M <= 2 ? 8 : M <= 4 ? 4 : 2;
  static constexpr size_t kSmem = sizeof(float) * kWarps * M * (DB + 2);
};

// Merges online-softmax state (m2, l2, acc2) into (m, l, acc).
template <int N>
__device__ __forceinline__ void merge(float& m, float& l, float* acc, float m2, float l2,
                                      const float* acc2) {
  const float mm = fmaxf(m, m2);
  const float a = m == -INFINITY ? 0.0f : __expf(m - mm);
  const float c = m2 == -INFINITY ? 0.0f : __expf(m2 - mm);
  l = l * a + l2 * c;
#pragma unroll
  for (int e = 0; e < N; ++e) acc[e] = acc[e] * a + acc2[e] * c;
  m = mm;
}

template <class T, int DB, int M>
__global__ void __launch_bounds__(kThreads) attention_kernel(const Params p) {
  using C = Tile<DB, M>;
  constexpr int L = C::kLanes, U = C::kUnroll;
  extern __shared__ __align__(16) float smem[];
  const int split = blockIdx.x, b = blockIdx.z;
  const int hk = blockIdx.y / p.mtiles, v0 = (blockIdx.y % p.mtiles) * M;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, col = (lane % L) * 8, slot = lane / L;
  const QSeq qs = query_seq(p, b);
  const int n_vec = qs.sq * p.group;
  if (v0 >= n_vec) return;  // the combine reads no vector of this tile
  const int len = length_before(p, b);
  const int sk = len + p.s_new;
  bool bad = len < 0 || len > p.capacity - p.s_new;
  if (bad && split == 0 && blockIdx.y == 0 && threadIdx.x == 0)
    record_error(p, len < 0 ? kBadLength : kNoRoom, b, len);

  // The tile's query vectors: vector v is row v / group of head hk * group + v % group.
  float qf[M][8];
  int lo[M], hi[M], diag[M];
  float slope[M];
#pragma unroll
  for (int m = 0; m < M; ++m) {
    const int vec = v0 + m, i = vec / p.group, hq = hk * p.group + vec % p.group;
    const bool valid = vec < n_vec && !bad;
    uint4 raw = make_uint4(0, 0, 0, 0);
    if (valid && col < p.d) raw = load16(p.q, b * p.q_sb + (qs.q0 + i) * p.q_sr + hq * p.q_sh + col);
    to_float8<T>(raw, qf[m]);
    const detail::KeyRange vis = detail::visible_keys(i, qs.sq, sk, p.win_left, p.win_right);
    lo[m] = valid ? vis.lo : 0;
    hi[m] = valid ? vis.hi : 0;
    diag[m] = i + sk - qs.sq;
    slope[m] = p.alibi && valid ? p.alibi[b * p.alibi_sb + hq] : 0.0f;
  }
  // Keys any vector of the tile sees, cut into `splits` equal ranges.
  int span_lo = lo[0], span_hi = hi[0];
#pragma unroll
  for (int m = 1; m < M; ++m)
    if (hi[m] > lo[m]) {
      span_lo = span_hi > span_lo ? min(span_lo, lo[m]) : lo[m];
      span_hi = max(span_hi, hi[m]);
    }
  if (span_hi < span_lo) span_hi = span_lo;
  const int per_split = (span_hi - span_lo + p.splits - 1) / p.splits;
  const int k_lo = span_lo + split * per_split;
  const int k_hi = min(span_hi, k_lo + per_split);

  float run_max[M], run_sum[M], acc[M][8];
#pragma unroll
  for (int m = 0; m < M; ++m) {
    run_max[m] = -INFINITY;
    run_sum[m] = 0.0f;
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[m][e] = 0.0f;
  }
  const uint16_t* kc = static_cast<const uint16_t*>(p.k) + hk * p.k_sh + col;
  const uint16_t* vc = static_cast<const uint16_t*>(p.v) + hk * p.v_sh + col;

  for (int base = k_lo; base < k_hi; base += C::kStep * U) {
    uint4 kr[U], vr[U];
    int jj[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int j = base + u * C::kStep + warp * C::kRowsPerWarp + slot;
      jj[u] = j;
      kr[u] = vr[u] = make_uint4(0, 0, 0, 0);
      if (j < k_hi) {
        int block, row;
        if (locate(p, b, j, &block, &row)) {
          if (col < p.d) {
            kr[u] = __ldg(reinterpret_cast<const uint4*>(kc + block * p.k_sb + row * p.k_sr));
            vr[u] = __ldg(reinterpret_cast<const uint4*>(vc + block * p.v_sb + row * p.v_sr));
          }
        } else {
          if (!bad) record_error(p, kBadBlock, b, block);
          bad = true;
        }
      }
    }
    float s[U][M];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float kf[8];
      to_float8<T>(kr[u], kf);
#pragma unroll
      for (int m = 0; m < M; ++m) {
        float x = 0.0f;
#pragma unroll
        for (int e = 0; e < 8; ++e) x = fmaf(qf[m][e], kf[e], x);
#pragma unroll
        for (int off = L / 2; off >= 1; off /= 2) x += __shfl_xor_sync(0xffffffffu, x, off);
        const int j = jj[u];
        if (j >= k_hi || j < lo[m] || j >= hi[m]) {
          s[u][m] = -INFINITY;
        } else {
          x *= p.scale;
          if (p.softcap > 0.0f) x = p.softcap * tanhf(x / p.softcap);
          if (slope[m] != 0.0f) x -= slope[m] * fabsf(static_cast<float>(diag[m] - j));
          s[u][m] = x;
        }
      }
    }
#pragma unroll
    for (int m = 0; m < M; ++m) {
      float tile_max = s[0][m];
#pragma unroll
      for (int u = 1; u < U; ++u) tile_max = fmaxf(tile_max, s[u][m]);
      const float m_new = fmaxf(run_max[m], tile_max);
      if (m_new == -INFINITY) continue;
      const float rescale = __expf(run_max[m] - m_new);
      run_sum[m] *= rescale;
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[m][e] *= rescale;
      run_max[m] = m_new;
#pragma unroll
      for (int u = 0; u < U; ++u) s[u][m] = __expf(s[u][m] - m_new);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float vf[8];
      to_float8<T>(vr[u], vf);
#pragma unroll
      for (int m = 0; m < M; ++m) {
        if (run_max[m] == -INFINITY) continue;
        run_sum[m] += s[u][m];
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[m][e] = fmaf(s[u][m], vf[e], acc[m][e]);
      }
    }
  }

  // Merge the key slots of a warp (lanes col apart by L), then the warps.
#pragma unroll
  for (int off = L; off < 32; off *= 2)
#pragma unroll
    for (int m = 0; m < M; ++m) {
      float other[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) other[e] = __shfl_xor_sync(0xffffffffu, acc[m][e], off);
      const float m2 = __shfl_xor_sync(0xffffffffu, run_max[m], off);
      const float l2 = __shfl_xor_sync(0xffffffffu, run_sum[m], off);
      merge<8>(run_max[m], run_sum[m], acc[m], m2, l2, other);
    }
  bad = __syncthreads_or(bad);
  float* s_acc = smem;                        // [warp][m][DB]
  float* s_max = smem + kWarps * M * DB;      // [warp][m]
  float* s_sum = s_max + kWarps * M;
  if (slot == 0) {
#pragma unroll
    for (int m = 0; m < M; ++m) {
#pragma unroll
      for (int e = 0; e < 8; ++e) s_acc[(warp * M + m) * DB + col + e] = acc[m][e];
      if (lane == 0) {
        s_max[warp * M + m] = run_max[m];
        s_sum[warp * M + m] = run_sum[m];
      }
    }
  }
  __syncthreads();
  const float nan = __int_as_float(0x7fffffff);
  for (int idx = threadIdx.x; idx < M * DB; idx += kThreads) {
    const int m = idx / DB, c = idx % DB, vec = v0 + m;
    if (vec >= n_vec || c >= p.d) continue;
    float gmax = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) gmax = fmaxf(gmax, s_max[w * M + m]);
    float sum = 0.0f, o = 0.0f;
    if (gmax != -INFINITY) {
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        const float f = s_max[w * M + m] == -INFINITY ? 0.0f : __expf(s_max[w * M + m] - gmax);
        sum += s_sum[w * M + m] * f;
        o += s_acc[(w * M + m) * DB + c] * f;
      }
    }
    const float out = bad ? nan : sum > 0.0f ? o / sum : 0.0f;
    const float lse = bad ? nan : sum > 0.0f ? gmax + __logf(sum) : -INFINITY;
    const int i = vec / p.group, hq = hk * p.group + vec % p.group;
    if (p.splits == 1) {
      static_cast<T*>(p.out)[b * p.o_sb + (qs.q0 + i) * p.o_sr + hq * p.o_sh + c] = from_float<T>(out);
      if (c == 0) p.lse[b * p.lse_sb + hq * p.lse_sh + qs.q0 + i] = lse;
    } else {
      const int64_t v = split * p.vectors + (qs.flat0 + i) * p.heads_q + hq;
      p.part_out[v * p.d + c] = out;
      if (c == 0) p.part_lse[v] = lse;
    }
  }
}

// ---------------------------------------------------------------- combine

// One warp per (query row, head): out = sum_s w_s o_s / sum_s w_s with
// w_s = exp(lse_s - max lse); any NaN split makes the result NaN.
template <class T>
__global__ void __launch_bounds__(kThreads) combine_kernel(const Params p) {
  const int b = blockIdx.y;
  const int vec = blockIdx.x * kWarps + threadIdx.x / 32, lane = threadIdx.x % 32;
  const QSeq qs = query_seq(p, b);
  const int i = vec / p.heads_q, hq = vec % p.heads_q;
  if (i >= qs.sq) return;
  const int64_t v = (qs.flat0 + i) * p.heads_q + hq;
  float gmax = -INFINITY;
  bool nan = false;
  for (int s = lane; s < p.splits; s += 32) {
    const float x = p.part_lse[s * p.vectors + v];
    nan |= x != x;
    gmax = fmaxf(gmax, x);
  }
  nan = __any_sync(0xffffffffu, nan);
#pragma unroll
  for (int off = 16; off >= 1; off /= 2) gmax = fmaxf(gmax, __shfl_xor_sync(0xffffffffu, gmax, off));
  float sum = 0.0f;
  if (gmax != -INFINITY)
    for (int s = lane; s < p.splits; s += 32) sum += __expf(p.part_lse[s * p.vectors + v] - gmax);
#pragma unroll
  for (int off = 16; off >= 1; off /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, off);
  const float qnan = __int_as_float(0x7fffffff);
  T* out = static_cast<T*>(p.out) + b * p.o_sb + (qs.q0 + i) * p.o_sr + hq * p.o_sh;
  for (int c = lane; c < p.d; c += 32) {
    float o = 0.0f;
    if (sum > 0.0f)
      for (int s = 0; s < p.splits; ++s) {
        const float x = p.part_lse[s * p.vectors + v];
        if (x != -INFINITY) o += p.part_out[(s * p.vectors + v) * p.d + c] * __expf(x - gmax);
      }
    out[c] = from_float<T>(nan ? qnan : sum > 0.0f ? o / sum : 0.0f);
  }
  if (lane == 0)
    p.lse[b * p.lse_sb + hq * p.lse_sh + qs.q0 + i] =
        nan ? qnan : sum > 0.0f ? gmax + __logf(sum) : -INFINITY;
}

// ---------------------------------------------------------------- host side

void require(bool ok, const std::string& message) {
  if (!ok) throw InvalidArgument("attention (kv cache, CUDA): " + message);
}

// The device's error word: pinned host memory mapped into the device.
struct ErrorWord {
  unsigned long long* host = nullptr;
  unsigned long long* dev = nullptr;
  ~ErrorWord() {
    if (host) cudaFreeHost(host);  // best effort: the process may be exiting
  }
};

std::shared_ptr<ErrorWord> error_word(int device) {
  return Runtime::instance().device_caches(device).get<ErrorWord>("attention.kvcache.error", [&] {
    cuda::ScopedDevice on(device);
    auto w = std::make_shared<ErrorWord>();
    SYMHEAP_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&w->host), sizeof(unsigned long long),
                                     cudaHostAllocMapped | cudaHostAllocPortable));
    *w->host = 0;
    SYMHEAP_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&w->dev), w->host, 0));
    return w;
  });
}

void raise_recorded(ErrorWord& w, int device) {
  const unsigned long long x = __atomic_exchange_n(w.host, 0ull, __ATOMIC_SEQ_CST);
  if (x == 0) return;
  const unsigned code = static_cast<unsigned>(x >> 56);
  const int b = static_cast<int>((x >> 32) & 0xFFFFFFu);
  const int value = static_cast<int>(static_cast<uint32_t>(x));
  std::string what;
  if (code == kBadBlock)
    what = "sequence " + std::to_string(b) + " uses block id " + std::to_string(value) +
           ", outside [0, num_blocks)";
  else if (code == kNoRoom)
    what = "sequence " + std::to_string(b) + " has " + std::to_string(value) +
           " cached rows, which leaves no room for the appended rows (or exceeds the capacity)";
  else
    what = "sequence " + std::to_string(b) + " has the negative key length " + std::to_string(value);
  throw InvalidArgument("attention (kv cache): an earlier call on CUDA device " +
                        std::to_string(device) + " found that " + what +
                        " (cache_seqlens / cu_seqlens_k / block_table); that sequence's cache was "
                        "not written and its outputs are NaN");
}

int head_dim_bucket(int d) { return d <= 32 ? 32 : d <= 64 ? 64 : d <= 128 ? 128 : 256; }

struct Plan {
  int db, m, mtiles, splits;
  int64_t vectors;
  size_t bytes;
};

int sm_count(int device) {
  auto info = cuda::kernel_info(device, "attention.kvcache.combine", combine_kernel<__half>, kThreads);
  return info->sm_count;
}

Plan make_plan(const CacheArgs& a, int device) {
  Plan pl{};
  pl.db = head_dim_bucket(a.head_dim);
  const int64_t n_vec = static_cast<int64_t>(a.seqlen_q) * a.group();
  pl.m = n_vec <= 1 ? 1 : n_vec <= 2 ? 2 : n_vec <= 4 ? 4 : 8;
  pl.mtiles = static_cast<int>(std::max<int64_t>(1, (n_vec + pl.m - 1) / pl.m));
  const int64_t base = static_cast<int64_t>(a.batch) * a.heads_kv * pl.mtiles;
  const int64_t useful = std::max<int64_t>(1, (a.capacity + kMinKeysPerSplit - 1) / kMinKeysPerSplit);
  int64_t splits;
  if (a.num_splits > 0) {
    splits = a.num_splits;
  } else {
    const int64_t target = 4LL * sm_count(device);  // about one wave of resident CTAs
    splits = std::min(useful, (target + base - 1) / base);
  }
  pl.splits = static_cast<int>(std::clamp<int64_t>(splits, 1, kMaxSplits));
  const int64_t rows = a.varlen() ? a.total_q : static_cast<int64_t>(a.batch) * a.seqlen_q;
  pl.vectors = rows * a.heads_q;
  pl.bytes = pl.splits > 1
                 ? static_cast<size_t>(pl.splits) * pl.vectors * (a.head_dim + 1) * sizeof(float)
                 : 0;
  pl.bytes = (pl.bytes + 255) / 256 * 256;
  return pl;
}

bool aligned(const Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.data) % 16 == 0 && t.batch_stride % 8 == 0 &&
         t.row_stride % 8 == 0 && t.head_stride % 8 == 0;
}

void validate_cuda(const CacheArgs& a) {
  require(a.q.dtype == DType::F16 || a.q.dtype == DType::BF16,
          std::string("takes float16 or bfloat16 tensors, got ") + dtype_name(a.q.dtype));
  require(a.head_dim % 8 == 0, "head_dim must be a multiple of 8 (the caches cannot be padded in "
                               "place), got " + std::to_string(a.head_dim));
  const char* names[] = {"q", "out", "k_cache", "v_cache", "k", "v"};
  const Tensor* tensors[] = {&a.q, &a.out, &a.k_cache, &a.v_cache, &a.k_new, &a.v_new};
  for (int n = 0; n < (a.appends() ? 6 : 4); ++n)
    require(aligned(*tensors[n]), std::string(names[n]) +
                                      " needs 16-byte aligned rows (address and strides multiples "
                                      "of 8 elements)");
  require(a.batch <= 65535, "batch must be <= 65535");
  require(a.seqlen_new <= 65535 || !a.appends(), "at most 65535 rows can be appended per call");
}

Params params(const CacheArgs& a, const Plan& pl, void* workspace, unsigned long long* error) {
  Params p{};
  p.q = a.q.data;
  p.out = a.out.data;
  p.lse = a.lse;
  p.q_sb = a.q.batch_stride, p.q_sr = a.q.row_stride, p.q_sh = a.q.head_stride;
  p.o_sb = a.out.batch_stride, p.o_sr = a.out.row_stride, p.o_sh = a.out.head_stride;
  p.lse_sb = a.lse_batch_stride, p.lse_sh = a.lse_head_stride;
  p.k = a.k_cache.data;
  p.v = a.v_cache.data;
  p.k_sb = a.k_cache.batch_stride, p.k_sr = a.k_cache.row_stride, p.k_sh = a.k_cache.head_stride;
  p.v_sb = a.v_cache.batch_stride, p.v_sr = a.v_cache.row_stride, p.v_sh = a.v_cache.head_stride;
  p.k_new = a.k_new.data;
  p.v_new = a.v_new.data;
  p.kn_sb = a.k_new.batch_stride, p.kn_sr = a.k_new.row_stride, p.kn_sh = a.k_new.head_stride;
  p.vn_sb = a.v_new.batch_stride, p.vn_sr = a.v_new.row_stride, p.vn_sh = a.v_new.head_stride;
  p.s_new = a.appends() ? a.seqlen_new : 0;
  p.cu_q = a.cu_seqlens_q;
  p.total_q = a.total_q;
  p.seqlen_q = a.seqlen_q;
  p.seqlens_k = a.seqlens_k;
  p.cumulative = a.seqlens_k_cumulative;
  p.table = a.block_table;
  p.table_stride = a.block_table_stride;
  p.block_size = a.paged() ? a.block_size : 1;
  p.num_blocks = a.num_blocks;
  p.capacity = a.capacity;
  p.batch = a.batch, p.heads_q = a.heads_q, p.heads_kv = a.heads_kv, p.group = a.group();
  p.d = a.head_dim;
  p.scale = a.scale, p.softcap = a.softcap;
  p.win_left = a.window_left, p.win_right = a.window_right;
  p.alibi = a.alibi_slopes;
  p.alibi_sb = a.alibi_batch_stride;
  p.splits = pl.splits;
  p.mtiles = pl.mtiles;
  p.vectors = pl.vectors;
  if (pl.splits > 1) {
    p.part_out = static_cast<float*>(workspace);
    p.part_lse = p.part_out + static_cast<size_t>(pl.splits) * pl.vectors * a.head_dim;
  }
  p.error = error;
  return p;
}

template <class T, int DB, int M>
void launch_attention(const Params& p, const Plan& pl, cudaStream_t stream) {
  attention_kernel<T, DB, M><<<dim3(pl.splits, p.heads_kv * pl.mtiles, p.batch), kThreads,
                               Tile<DB, M>::kSmem, stream>>>(p);
  SYMHEAP_CUDA_CHECK_LAUNCH("attention.kvcache.attention_kernel");
}

template <class T, int DB>
void dispatch_m(const Params& p, const Plan& pl, cudaStream_t stream) {
  switch (pl.m) {
    case 1: return launch_attention<T, DB, 1>(p, pl, stream);
    case 2: return launch_attention<T, DB, 2>(p, pl, stream);
    case 4: return launch_attention<T, DB, 4>(p, pl, stream);
    default: return launch_attention<T, DB, 8>(p, pl, stream);
  }
}

template <class T>
void run(const CacheArgs& a, const Plan& pl, const Params& p, cudaStream_t stream) {
  if (p.s_new > 0) {
    append_kernel<<<dim3(p.s_new, p.batch), kThreads, 0, stream>>>(p);
    SYMHEAP_CUDA_CHECK_LAUNCH("attention.kvcache.append_kernel");
  }
  if (a.seqlen_q == 0 || (a.varlen() && a.total_q == 0)) return;
  switch (pl.db) {
    case 32: dispatch_m<T, 32>(p, pl, stream); break;
    case 64: dispatch_m<T, 64>(p, pl, stream); break;
    case 128: dispatch_m<T, 128>(p, pl, stream); break;
    default: dispatch_m<T, 256>(p, pl, stream); break;
  }
  if (pl.splits > 1) {
    const int64_t warps = static_cast<int64_t>(a.seqlen_q) * a.heads_q;
    combine_kernel<T><<<dim3(static_cast<unsigned>((warps + kWarps - 1) / kWarps), p.batch), kThreads,
                        0, stream>>>(p);
    SYMHEAP_CUDA_CHECK_LAUNCH("attention.kvcache.combine_kernel");
  }
}

}  // namespace kvcache

size_t cache_attention_cuda_workspace_bytes(const CacheArgs& a, int device) {
  validate_cache(a);
  kvcache::validate_cuda(a);
  return kvcache::make_plan(a, device).bytes;
}

void cache_attention_cuda(const CacheArgs& a, int device, void* stream, void* workspace,
                          size_t bytes) {
  validate_cache(a);
  kvcache::validate_cuda(a);
  auto error = kvcache::error_word(device);
  kvcache::raise_recorded(*error, device);
  const kvcache::Plan pl = kvcache::make_plan(a, device);
  kvcache::require(bytes >= pl.bytes && (pl.bytes == 0 || workspace != nullptr),
                   "the workspace has " + std::to_string(bytes) + " bytes; it needs " +
                       std::to_string(pl.bytes) + " (cache_attention_cuda_workspace_bytes)");
  kvcache::require(reinterpret_cast<uintptr_t>(workspace) % 16 == 0,
                   "the workspace must be 16-byte aligned");
  kvcache::require(static_cast<int64_t>(a.heads_kv) * pl.mtiles <= 65535,
                   "too many query rows for one call (kv heads x query tiles must be <= 65535); "
                   "split the queries");
  cuda::ScopedDevice on(device);
  const kvcache::Params p = kvcache::params(a, pl, workspace, error->dev);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (a.q.dtype == DType::F16) kvcache::run<__half>(a, pl, p, s);
  else kvcache::run<__nv_bfloat16>(a, pl, p, s);
}

void cache_check_cuda(int device, void* stream, bool sync) {
  auto error = kvcache::error_word(device);
  if (sync) {
    cuda::ScopedDevice on(device);
    SYMHEAP_CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)));
  }
  kvcache::raise_recorded(*error, device);
}

}  // namespace symheap::attention
