// Device building blocks of the CUDA attention kernels: the kernel argument
// block, tensor-core fragments (mma.sync m16n8k16, fp32 accumulate), tile
// loads into padded shared memory, and the logit rule (same as the cpu path).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "ops/attention/common.hpp"

namespace symheap::attention::cuda {

// Everything the kernels read, by value (no global device symbol).
struct KArgs {
  const void* q;
  const void* k;
  const void* v;
  void* out;
  float* lse;
  const void* dout;
  void* dq;
  void* dk;
  void* dv;
  int64_t q_sb, q_sr, q_sh, k_sb, k_sr, k_sh, v_sb, v_sr, v_sh, o_sb, o_sr, o_sh;
  int64_t do_sb, do_sr, do_sh, dq_sb, dq_sr, dq_sh, dk_sb, dk_sr, dk_sh, dv_sb, dv_sr, dv_sh;
  int64_t lse_sb, lse_sh;
  float* delta;  // backward workspace: rowsum(dout * out), laid out like lse
  int64_t delta_sb, delta_sh;
  // Backward workspace of the dK/dV kernel that also accumulates dQ (fp32,
  // rows x heads_q x d, zeroed before it runs); null on the other paths.
  float* dq_accum;
  int64_t dqa_sb, dqa_sr, dqa_sh;
  int batch, heads_q, heads_kv, group, d, seqlen_q, seqlen_k;
  int64_t total_q, total_k;
  const int32_t* cu_q;
  const int32_t* cu_k;
  float scale, softcap;
  int win_left, win_right;
  const void* bias;
  int bias_dtype;  // 0 f32, 1 f16, 2 bf16
  int64_t bias_sb, bias_sh, bias_sq, bias_sk;
  int bias_kv;
  const uint8_t* mask;
  int64_t mask_sb, mask_sh, mask_sq, mask_sk;
  int mask_kv;
  const float* alibi;
  int64_t alibi_sb;
  int dropout;
  uint32_t drop_threshold;
  float keep_scale;
  uint64_t seed, offset;
  float* dbias;
  int64_t dbias_sb, dbias_sh, dbias_sq, dbias_sk;
};

template <class T>
struct Pack;
template <>
struct Pack<__half> {
  static __device__ __forceinline__ uint32_t two(float x, float y) {
    __half2 h = __floats2half2_rn(x, y);
    return *reinterpret_cast<uint32_t*>(&h);
  }
};
template <>
struct Pack<__nv_bfloat16> {
  static __device__ __forceinline__ uint32_t two(float x, float y) {
    __nv_bfloat162 h = __floats2bfloat162_rn(x, y);
    return *reinterpret_cast<uint32_t*>(&h);
  }
};

// D (16x8, fp32) += A (16x16, row) * B (16x8, col). Fragment layout, with
// g = lane / 4 and t = lane % 4: a = {A[g][2t..], A[g+8][2t..], A[g][2t+8..],
// A[g+8][2t+8..]}, b = {B[2t..][g], B[2t+8..][g]}, c = {C[g][2t], C[g][2t+1],
// C[g+8][2t], C[g+8][2t+1]}.
template <class T>
__device__ __forceinline__ void mma(float c[4], const uint32_t a[4], const uint32_t b[2]);
template <>
__device__ __forceinline__ void mma<__half>(float c[4], const uint32_t a[4], const uint32_t b[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
template <>
__device__ __forceinline__ void mma<__nv_bfloat16>(float c[4], const uint32_t a[4],
                                                   const uint32_t b[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

template <class T>
__device__ __forceinline__ uint32_t lds32(const T* p) {
  return *reinterpret_cast<const uint32_t*>(p);
}

// A fragment: rows r0.., cols c0.. of a row-major shared tile with leading dim ld.
template <class T>
__device__ __forceinline__ void load_a(uint32_t a[4], const T* s, int ld, int r0, int c0, int lane) {
  const int g = lane >> 2, t = lane & 3;
  a[0] = lds32(s + (r0 + g) * ld + c0 + 2 * t);
  a[1] = lds32(s + (r0 + g + 8) * ld + c0 + 2 * t);
  a[2] = lds32(s + (r0 + g) * ld + c0 + 2 * t + 8);
  a[3] = lds32(s + (r0 + g + 8) * ld + c0 + 2 * t + 8);
}

// B fragment (k x n = 16 x 8) of a tile stored n-major: B[k][n] = s[(n0+n)*ld + k0+k].
template <class T>
__device__ __forceinline__ void load_b(uint32_t b[2], const T* s, int ld, int n0, int k0, int lane) {
  const int g = lane >> 2, t = lane & 3;
  b[0] = lds32(s + (n0 + g) * ld + k0 + 2 * t);
  b[1] = lds32(s + (n0 + g) * ld + k0 + 2 * t + 8);
}

// Two accumulator tiles (16 x 8 each, columns 16*kk .. 16*kk+15) as the A
// fragment of the next product (the C and A layouts line up).
template <class T>
__device__ __forceinline__ void c_to_a(uint32_t a[4], const float c0[4], const float c1[4]) {
  a[0] = Pack<T>::two(c0[0], c0[1]);
  a[1] = Pack<T>::two(c0[2], c0[3]);
  a[2] = Pack<T>::two(c1[0], c1[1]);
  a[3] = Pack<T>::two(c1[2], c1[3]);
}

// Rows [0, ROWS) x cols [0, DB) of a global tile into shared memory (row-major,
// leading dim DB + 8), zero where row >= valid_rows or col >= d. 16-byte
// accesses: the launcher checks that rows are 16-byte aligned.
template <class T, int ROWS, int DB, int NT>
__device__ __forceinline__ void load_rows(T* s, const T* g, int64_t row_stride, int valid_rows, int d) {
  constexpr int kChunks = DB / 8;
  for (int idx = threadIdx.x; idx < ROWS * kChunks; idx += NT) {
    const int r = idx / kChunks, c = idx % kChunks;
    uint4 val = make_uint4(0, 0, 0, 0);
    if (r < valid_rows && c * 8 < d) val = *reinterpret_cast<const uint4*>(g + r * row_stride + c * 8);
    *reinterpret_cast<uint4*>(s + r * (DB + 8) + c * 8) = val;
  }
}

// The same tile transposed: s[col * (ROWS + 8) + row].
template <class T, int ROWS, int DB, int NT>
__device__ __forceinline__ void load_rows_t(T* s, const T* g, int64_t row_stride, int valid_rows, int d) {
  constexpr int kChunks = DB / 8;
  for (int idx = threadIdx.x; idx < ROWS * kChunks; idx += NT) {
    const int r = idx % ROWS, c = idx / ROWS;  // consecutive threads: consecutive rows
    uint4 val = make_uint4(0, 0, 0, 0);
    if (r < valid_rows && c * 8 < d) val = *reinterpret_cast<const uint4*>(g + r * row_stride + c * 8);
    const T* e = reinterpret_cast<const T*>(&val);
#pragma unroll
    for (int u = 0; u < 8; ++u) s[(c * 8 + u) * (ROWS + 8) + r] = e[u];
  }
}

// Writes a warp's 16 rows (staged row-major in shared memory, leading dim
// DB + 8) to global memory with 16-byte stores.
template <class T, int DB>
__device__ __forceinline__ void store_warp_rows(const T* s, T* g, int64_t row_stride, int valid_rows,
                                                int d, int lane) {
  constexpr int kChunks = DB / 8;
  for (int idx = lane; idx < 16 * kChunks; idx += 32) {
    const int r = idx / kChunks, c = idx % kChunks;
    if (r < valid_rows && c * 8 < d)
      *reinterpret_cast<uint4*>(g + r * row_stride + c * 8) =
          *reinterpret_cast<const uint4*>(s + r * (DB + 8) + c * 8);
  }
}

// Stages a 16 x DB fp32 accumulator (DB/8 tiles) of one warp, times `row_scale`
// per row, into rows [r0, r0 + 16) of a row-major shared tile.
template <class T, int DB>
__device__ __forceinline__ void stage_acc(T* s, int r0, const float (*acc)[4], float scale_lo,
                                          float scale_hi, int lane) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int dt = 0; dt < DB / 8; ++dt) {
    *reinterpret_cast<uint32_t*>(s + (r0 + g) * (DB + 8) + dt * 8 + 2 * t) =
        Pack<T>::two(acc[dt][0] * scale_lo, acc[dt][1] * scale_lo);
    *reinterpret_cast<uint32_t*>(s + (r0 + g + 8) * (DB + 8) + dt * 8 + 2 * t) =
        Pack<T>::two(acc[dt][2] * scale_hi, acc[dt][3] * scale_hi);
  }
}

// ---- sequences and the logit rule

struct Seq {
  int sq, sk;
  int64_t q0, k0;  // first packed row
};

// The (key block, kv head, batch entry) of a dK/dV CTA of a (key blocks, kv
// heads, batch) grid, from its place in the launch order (x fastest). Under a
// causal mask the first key blocks see the most query rows; in launch order
// each group of (kv head, batch entry) pairs, about kKeyBlockGroupCtas CTAs,
// runs its heaviest blocks first, so the kernel's last CTAs are light ones and
// the last wave's tail is short, while a group's Q, dO and dQ rows are read by
// CTAs resident at about the same time, as in the plain order (L2).
constexpr unsigned kKeyBlockGroupCtas = 128;
struct KeyBlockCta {
  int n_block, hk, b;
};
__device__ __forceinline__ KeyBlockCta key_block_cta() {
  // 32-bit: a grid of 2^31 CTAs or more cannot be launched.
  const unsigned nb = gridDim.x, pairs = gridDim.y * gridDim.z;
  const unsigned linear = blockIdx.x + nb * (blockIdx.y + gridDim.y * blockIdx.z);
  const unsigned group = max(1u, kKeyBlockGroupCtas / nb);
  const unsigned first = linear / (group * nb) * group;  // the group's first pair
  const unsigned members = min(group, pairs - first);
  const unsigned r = linear - first * nb, pair = first + r % members;
  return {static_cast<int>(r / members), static_cast<int>(pair % gridDim.y),
          static_cast<int>(pair / gridDim.y)};
}

// Lengths from cu_seqlens are clamped to the buffers and to max_seqlen, so a
// bad cu_seqlens can give wrong numbers but never an access out of bounds.
__device__ __forceinline__ Seq sequence(const KArgs& p, int b) {
  if (!p.cu_q) return Seq{p.seqlen_q, p.seqlen_k, 0, 0};
  int64_t q1 = min(static_cast<int64_t>(p.cu_q[b + 1]), p.total_q);
  int64_t q0 = max(int64_t{0}, min(static_cast<int64_t>(p.cu_q[b]), q1));
  int64_t k1 = min(static_cast<int64_t>(p.cu_k[b + 1]), p.total_k);
  int64_t k0 = max(int64_t{0}, min(static_cast<int64_t>(p.cu_k[b]), k1));
  return Seq{static_cast<int>(min(q1 - q0, static_cast<int64_t>(p.seqlen_q))),
             static_cast<int>(min(k1 - k0, static_cast<int64_t>(p.seqlen_k))), q0, k0};
}

constexpr float kLog2e = 1.4426950408889634f;  // logits in log2 units: x log2 e

// 2^x in one MUFU instruction; 2^-inf = 0 (denormal results flush to zero).
__device__ __forceinline__ float exp2_fast(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// tanh(x) in one MUFU instruction (relative error about 2^-11, the
// instruction FlashAttention's softcap uses) instead of tanhf's branchy
// sequence; 1 - 2 / (1 + e^2x) took two, and the softcap forward ran 0.77-0.80x
// as fast so (bench/attn_notes.md 41, 42). Forward and backward use this one,
// so the backward's P is the forward's.
__device__ __forceinline__ float tanh_fast(float x) {
  float t;
  asm("tanh.approx.f32 %0, %1;\n" : "=f"(t) : "f"(x));
  return t;
}

__device__ __forceinline__ float load_bias(const void* base, int dtype, int64_t idx) {
  if (dtype == 0) return static_cast<const float*>(base)[idx];
  if (dtype == 1) return __half2float(static_cast<const __half*>(base)[idx]);
  return __bfloat162float(static_cast<const __nv_bfloat16*>(base)[idx]);
}

// Whether a kernel may copy the bias in 16-byte chunks along the keys (a
// 16-bit bias, contiguous along the keys, rows and heads 16-byte aligned);
// else it reads the bias element by element (LogitCtx).
__host__ __device__ inline bool bias_rows_copyable(const KArgs& p) {
  return p.bias && p.bias_dtype != 0 && p.bias_sk == 1 && p.bias_sq % 8 == 0 && p.bias_sh % 8 == 0 &&
         p.bias_sb % 8 == 0 && reinterpret_cast<uintptr_t>(p.bias) % 16 == 0;
}

// Whether a kernel may copy the mask in 16-byte chunks along the keys
// (contiguous along the keys; rows, heads and batches 16-byte aligned).
__host__ __device__ inline bool mask_rows_copyable(const KArgs& p) {
  return p.mask && p.mask_sk == 1 && p.mask_sq % 16 == 0 && p.mask_sh % 16 == 0 && p.mask_sb % 16 == 0 &&
         reinterpret_cast<uintptr_t>(p.mask) % 16 == 0;
}

// Two adjacent 16-bit bias values (f16 or bf16, the KArgs dtype code) as floats.
__device__ __forceinline__ float2 bias_pair(uint32_t bits, int dtype) {
  if (dtype == 1) return __half22float2(*reinterpret_cast<const __half2*>(&bits));
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&bits));
}

// The logit features a kernel's form serves, a bit each: fragment_log2 and
// the kernels compile in the passes of those alone, and the launch sends a
// form only calls that use no other (form_serves in cuda_launch.cuh). An
// enum, so that a bool cannot pass for a set.
enum LogitFeatures : unsigned {
  kBiasFeature = 1u,
  kMaskFeature = 2u,
  kAlibiFeature = 4u,
  kSoftcapFeature = 8u,
  kDropoutFeature = 16u,
  kAllFeatures = 31u,
  kMaskAlibiFeatures = kMaskFeature | kAlibiFeature,
  kAllButBiasFeatures = kAllFeatures & ~kBiasFeature,
};

// fragment_log2's default sink for softcap's derivative: none wanted.
struct NoDcapSink {
  __device__ __forceinline__ void operator()(int, float) const {}
};

// Per-(batch, query head) context of the logit rule.
struct LogitCtx {
  const char* bias;     // at [b, head, 0, 0]
  const uint8_t* mask;  // at [b, head, 0, 0]
  float slope;
  float inv_softcap;  // 1 / softcap (softcap > 0)
  int sq, sk;

  __device__ __forceinline__ LogitCtx(const KArgs& p, int b, int hq, const Seq& s) {
    const int hk = hq / p.group;
    bias = nullptr;
    mask = nullptr;
    if (p.bias) {
      const int esz = p.bias_dtype == 0 ? 4 : 2;
      bias = static_cast<const char*>(p.bias) +
             esz * (b * p.bias_sb + (p.bias_kv ? hk : hq) * p.bias_sh);
    }
    if (p.mask) mask = p.mask + b * p.mask_sb + (p.mask_kv ? hk : hq) * p.mask_sh;
    slope = p.alibi ? p.alibi[b * p.alibi_sb + hq] : 0.0f;
    inv_softcap = p.softcap > 0 ? 1.0f / p.softcap : 0.0f;
    sq = s.sq;
    sk = s.sk;
  }

  // ALiBi's distance of key j from query row i's diagonal (its penalty:
  // slope times this).
  __device__ __forceinline__ float alibi_distance(int i, int j) const {
    return fabsf(static_cast<float>(i + sk - sq - j));
  }

  // Logit of (i, j) from the raw dot product; -inf when hidden. `dcap`
  // receives d logit / d (scale * q.k). The branches test only what is the
  // same for every thread; the bias and mask reads are predicated on the
  // element being inside the sequence (a branch per element on its
  // visibility made the feature kernels several times slower).
  __device__ __forceinline__ float operator()(const KArgs& p, float raw, int i, int j,
                                              float* dcap) const {
    const int diag = i + sk - sq;
    const bool inside = (i < sq) & (j < sk);
    bool visible = inside & ((p.win_left < 0) | (j >= diag - p.win_left)) &
                   ((p.win_right < 0) | (j <= diag + p.win_right));
    float x = raw * p.scale;
    *dcap = 1.0f;
    if (p.softcap > 0) {
      const float t = tanh_fast(x * inv_softcap);
      x = p.softcap * t;
      *dcap = 1.0f - t * t;
    }
    if (bias) {
      const int64_t at = inside ? i * p.bias_sq + j * p.bias_sk : 0;
      const float value = load_bias(bias, p.bias_dtype, at);
      x += value;
    }
    if (slope != 0.0f) x -= slope * alibi_distance(i, j);
    if (mask) visible &= mask[inside ? i * p.mask_sq + j * p.mask_sk : 0] != 0;
    return visible ? x : -INFINITY;
  }

  // softcap's derivative, 1 - tanh(u)^2, of each score of a fragment, from
  // its P (x(k), overwritten), for calls without a bias: P = 2^(logit log2 e -
  // lse2(k)), so wherever P > 0 the logit is (log2 P + lse2(k)) ln 2, and less
  // the ALiBi term it is softcap tanh(u). Where P is 0 so is ds, and the
  // derivative given is 0. One lg2 a score, where the derivative kept from
  // the S^T pass to dS took 16 registers (the dK/dV kernel's no-bias form).
  template <int N, class X, class Lse2, class Row, class Col>
  __device__ __forceinline__ void softcap_derivative_from_p(X x, Lse2 lse2, Row row_of, Col col_of) const {
    constexpr float kLn2 = 0.6931471805599453f;
#pragma unroll
    for (int k = 0; k < N; ++k) {
      float log2_p;
      asm("lg2.approx.ftz.f32 %0, %1;\n" : "=f"(log2_p) : "f"(x(k)));
      x(k) = (log2_p + lse2(k)) * kLn2;
    }
    if (slope != 0.0f) {
#pragma unroll
      for (int k = 0; k < N; ++k) x(k) += slope * alibi_distance(row_of(k), col_of(k));
    }
#pragma unroll
    for (int k = 0; k < N; ++k) {
      const float t = x(k) * inv_softcap;
      x(k) = fmaxf(1.0f - t * t, 0.0f);  // fmaxf: also 0 for the NaN of a P of 0
    }
  }

  // fragment_log2's bias and mask passes (the bias in log2 units with
  // kLog2). An element outside the sequence (already hidden) reads element 0
  // of the bias and the nearest element inside of the mask, so no address is
  // selected per element. The bias: one loop per dtype, so a pass's loads
  // issue together (a dtype branch per element serialised them).
  template <bool kLog2, int N, class X, class Row, class Col>
  __device__ __forceinline__ void add_bias(const KArgs& p, X x, Row row_of, Col col_of) const {
    auto at = [&](int k) -> int64_t {
      const int i = row_of(k), j = col_of(k);
      return (i < sq) & (j < sk) ? i * p.bias_sq + j * p.bias_sk : 0;
    };
    const void* base = bias;
    if (p.bias_dtype == 0) {
#pragma unroll
      for (int k = 0; k < N; ++k) add_one<kLog2>(x(k), static_cast<const float*>(base)[at(k)]);
    } else if (p.bias_dtype == 1) {
#pragma unroll
      for (int k = 0; k < N; ++k) add_one<kLog2>(x(k), __half2float(static_cast<const __half*>(base)[at(k)]));
    } else {
#pragma unroll
      for (int k = 0; k < N; ++k)
        add_one<kLog2>(x(k), __bfloat162float(static_cast<const __nv_bfloat16*>(base)[at(k)]));
    }
  }
  // Two keys' mask bytes (the first in the low byte): a zero byte hides its logit.
  __device__ __forceinline__ static void mask_pair(uint32_t bytes, float& x0, float& x1) {
    if (!(bytes & 0xffu)) x0 = -INFINITY;
    if (!(bytes >> 8)) x1 = -INFINITY;
  }
  template <bool kLog2>
  __device__ __forceinline__ static void add_one(float& x, float v) {
    if constexpr (kLog2) x = fmaf(v, kLog2e, x);
    else x += v;
  }
  // kKeyPairs (the forward's row-major fragments): elements 2m and 2m + 1 are
  // keys j and j + 1 of one row, j even. Where the mask's keys are contiguous
  // and its rows, heads and batches start at even bytes (and sk is even), such
  // a pair is one 16-bit load. Else, with the keys contiguous, a row pointer
  // per row and the key as an offset from it.
  template <bool kKeyPairs, int N, class X, class Row, class Col>
  __device__ __forceinline__ void apply_mask(const KArgs& p, X x, Row row_of, Col col_of) const {
    if (kKeyPairs && p.mask_sk == 1 && ((p.mask_sq | sk) & 1) == 0 && reinterpret_cast<uintptr_t>(mask) % 2 == 0) {
#pragma unroll
      for (int k = 0; k < N; k += 2) {
        const uint8_t* r = mask + min(row_of(k), sq - 1) * p.mask_sq + min(col_of(k), sk - 2);
        mask_pair(__ldg(reinterpret_cast<const unsigned short*>(r)), x(k), x(k + 1));
      }
    } else if (!kKeyPairs && p.mask_sk == 1) {
#pragma unroll
      for (int k = 0; k < N; ++k) {
        const uint8_t* r = mask + min(row_of(k), sq - 1) * p.mask_sq;
        if (!__ldg(r + min(col_of(k), sk - 1))) x(k) = -INFINITY;
      }
    } else {
#pragma unroll
      for (int k = 0; k < N; ++k)
        if (!mask[min(row_of(k), sq - 1) * p.mask_sq + min(col_of(k), sk - 1) * p.mask_sk]) x(k) = -INFINITY;
    }
  }

  // The same rule, as logits in log2 units, over N elements of one thread's
  // accumulator fragment: element k is x(k) (the raw q.k), at query row
  // row_of(k) and key col_of(k). Each feature is tested once for the
  // fragment, not once per element (per-element branches cost several times
  // the arithmetic). With skip_bias the caller adds the bias itself (from
  // shared memory). `full`: every element is inside the sequence and the
  // window (the caller's tile test), so the visibility pass, a dozen
  // instructions an element, is skipped. With softcap, dcap(k, d) receives
  // element k's d logit / d (scale q.k) (the dK/dV kernels'; the forward's
  // sink drops it). kKeyPairs: see apply_mask. kServes: the features of the
  // caller's form (its calls have no other).
  template <int N, bool kKeyPairs = false, LogitFeatures kServes = kAllFeatures, class X, class Row, class Col,
            class Dcap = NoDcapSink>
  __device__ __forceinline__ void fragment_log2(const KArgs& p, X x, Row row_of, Col col_of, bool skip_bias,
                                                bool full, Dcap dcap = {}) const {
    // The forward (no derivative wanted) is bound by instruction issue: it
    // folds the constants into each pass, so the logits are in log2 units
    // from the first one. The dK/dV kernels keep scale first and log2 e
    // last: folded, their softcap and bias rows ran 0.65-0.95x.
    constexpr bool kFold = std::is_same<Dcap, NoDcapSink>::value;
    if constexpr (kFold) {
      if ((kServes & kSoftcapFeature) && p.softcap > 0) {
        // softcap tanh(u), u = scale q.k / softcap, in log2 units: a tanh(u), a =
        // softcap log2 e.
        const float to_u = p.scale * inv_softcap, a = p.softcap * kLog2e;
#pragma unroll
        for (int k = 0; k < N; ++k) x(k) = a * tanh_fast(x(k) * to_u);
      } else {
        const float to_log2 = p.scale * kLog2e;
#pragma unroll
        for (int k = 0; k < N; ++k) x(k) *= to_log2;
      }
    } else {
#pragma unroll
      for (int k = 0; k < N; ++k) x(k) *= p.scale;
      if ((kServes & kSoftcapFeature) && p.softcap > 0) {
#pragma unroll
        for (int k = 0; k < N; ++k) {
          const float t = tanh_fast(x(k) * inv_softcap);
          x(k) = p.softcap * t;
          dcap(k, 1.0f - t * t);
        }
      }
    }
    if ((kServes & kBiasFeature) && bias && !skip_bias) add_bias<kFold, N>(p, x, row_of, col_of);
    if ((kServes & kAlibiFeature) && slope != 0.0f) {
      const float slope_unit = kFold ? slope * kLog2e : slope;
#pragma unroll
      for (int k = 0; k < N; ++k) x(k) -= slope_unit * alibi_distance(row_of(k), col_of(k));
    }
    if (full) {
      if constexpr (!kFold) {
#pragma unroll
        for (int k = 0; k < N; ++k) x(k) *= kLog2e;
      }
    } else {
      const bool left = p.win_left >= 0, right = p.win_right >= 0;
#pragma unroll
      for (int k = 0; k < N; ++k) {
        const int i = row_of(k), j = col_of(k), diag = i + sk - sq;
        const bool visible = (j < sk) & (i < sq) & (!left | (j >= diag - p.win_left)) &
                             (!right | (j <= diag + p.win_right));
        x(k) = visible ? (kFold ? x(k) : x(k) * kLog2e) : -INFINITY;
      }
    }
    if ((kServes & kMaskFeature) && mask) apply_mask<kKeyPairs, N>(p, x, row_of, col_of);
  }
};

// The keep factor a score's 16 random bits give: 1 / (1 - p) kept, 0 dropped.
__device__ __forceinline__ float dropout_keep_half(const KArgs& p, uint32_t half) {
  return half >= p.drop_threshold ? p.keep_scale : 0.0f;
}
__device__ __forceinline__ float dropout_keep(const KArgs& p, const detail::U32x4& r, int j) {
  return dropout_keep_half(p, detail::dropout_half(r, static_cast<uint32_t>(j)));
}

// The Philox call of key j's octet in query row i.
__device__ __forceinline__ detail::U32x4 dropout_octet(const KArgs& p, uint32_t bh, int i, int j) {
  return detail::dropout_octet(p.seed, p.offset, bh, static_cast<uint32_t>(i),
                               static_cast<uint32_t>(j) >> 3);
}

// A 4 x 4 transpose of words over four lanes (idx: this lane's place among
// them; its partners lane ^ stride, ^ 2 stride): lane idx holds call idx's
// words w[0..3] and is left with word idx of every call, w[u] from call u.
__device__ __forceinline__ void transpose4_lanes(uint32_t w[4], int idx, int stride) {
#pragma unroll
  for (int bit = 0; bit < 2; ++bit) {
    // Entries l and l + s (l in {0, l1}) differ in this bit; a lane hands the
    // partner the two whose bit differs from its own.
    const bool hi = (idx >> bit) & 1;
    const int s = 1 << bit, l1 = bit ? 1 : 2;
    const uint32_t r0 = __shfl_xor_sync(0xffffffffu, hi ? w[0] : w[s], stride << bit);
    const uint32_t r1 = __shfl_xor_sync(0xffffffffu, hi ? w[l1] : w[l1 + s], stride << bit);
    if (hi) {  // (constant indices: selects, not a local array)
      w[0] = r0;
      w[l1] = r1;
    } else {
      w[s] = r0;
      w[l1 + s] = r1;
    }
  }
}

// Keep factors of one thread's eight accumulator elements of two 8-key blocks
// in the row-major (forward) fragment: rows r0 and r1, keys j0, j0 + 1, j0 +
// 8, j0 + 9 (j0 = 8 n + 2 t, n even, t = lane % 4). The four lanes of a quad
// need the same four Philox calls (rows r0 and r1 by the octets of keys j0
// and j0 + 8): lane t computes call t (row r_(t % 2), octet of j0 + 8 (t /
// 2)), and a 4 x 4 transpose over the quad leaves it word t of each: keys
// 2 t and 2 t + 1 of the octet. keep[4 s + 2 h + c]: row r_h, key j0 + 8 s +
// c. Every lane of the warp calls it.
__device__ __forceinline__ void dropout_keep_rows(const KArgs& p, uint32_t bh, int r0, int r1, int j0, int lane,
                                                  float keep[8]) {
  const int t = lane & 3;
  const detail::U32x4 r = dropout_octet(p, bh, (t & 1) ? r1 : r0, j0 + 8 * (t >> 1));
  uint32_t w[4] = {r.x, r.y, r.z, r.w};
  transpose4_lanes(w, t, 1);
#pragma unroll
  for (int u = 0; u < 4; ++u) {
    keep[4 * (u >> 1) + 2 * (u & 1)] = dropout_keep_half(p, w[u] & 0xffffu);
    keep[4 * (u >> 1) + 2 * (u & 1) + 1] = dropout_keep_half(p, w[u] >> 16);
  }
}

// The same for the transposed (dK/dV) fragment, two 8-query blocks: element
// 2 h + c of block s is query i0 + 8 s + c (i0 = 8 n + 2 t, n even) and key
// k0 + 8 h, k0 = 16 w + g (g = lane / 4; warp w's 16 keys are two octets,
// key k0's bits the g-th 16 of its call). The eight lanes of one t need the
// same eight calls: lane g computes call u = g (c = u % 2, h = u / 2 % 2,
// s = u / 4), and an 8 x 8 transpose of 16-bit entries over those lanes
// (three exchange stages, lane ^ 4, ^ 8, ^ 16) leaves it entry g of every
// call, entry u from call u. keep[4 s + 2 h + c].
__device__ __forceinline__ void dropout_keep_cols(const KArgs& p, uint32_t bh, int i0, int k0, int lane,
                                                  float keep[8]) {
  const int g = lane >> 2;
  const detail::U32x4 r = dropout_octet(p, bh, i0 + 8 * (g >> 2) + (g & 1), k0 - g + 8 * ((g >> 1) & 1));
  uint32_t w[4] = {r.x, r.y, r.z, r.w};  // entry e: half e % 2 of w[e / 2]
  {
    // Bit 0 of the entry: the halves of each word. A lane hands the partner its
    // entries whose bit 0 differs from g's, packed two a word.
    const bool hi = g & 1;
    const uint32_t pick = hi ? 0x5410u : 0x7632u;  // low halves : high halves
    const uint32_t a = __shfl_xor_sync(0xffffffffu, __byte_perm(w[0], w[1], pick), 4);
    const uint32_t b = __shfl_xor_sync(0xffffffffu, __byte_perm(w[2], w[3], pick), 4);
    const uint32_t into0 = hi ? 0x3254u : 0x5410u, into1 = hi ? 0x3276u : 0x7610u;
    w[0] = __byte_perm(w[0], a, into0);
    w[1] = __byte_perm(w[1], a, into1);
    w[2] = __byte_perm(w[2], b, into0);
    w[3] = __byte_perm(w[3], b, into1);
  }
  // Bits 1 and 2: a 4 x 4 transpose of the words over lanes ^ 8, ^ 16.
  transpose4_lanes(w, g >> 1, 8);
#pragma unroll
  for (int u = 0; u < 8; ++u) keep[u] = dropout_keep_half(p, (w[u >> 1] >> (16 * (u & 1))) & 0xffffu);
}

__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// ---- the gradient of the logit features (both dK/dV kernels)

// Where the bias gradient of one (batch, query head) goes: d loss / d logit
// per element, or summed over the query rows when the bias is broadcast over
// them (dbias_sq == 0; sums over broadcast heads and batches are the caller's).
struct DbiasSink {
  float* at;  // dbias at [b, hq, 0, 0]; null without dbias
  int64_t sq, sk;
  int rows, cols;

  __device__ __forceinline__ DbiasSink(const KArgs& p, int b, int hq, const Seq& s)
      : at(p.dbias ? p.dbias + b * p.dbias_sb + hq * p.dbias_sh : nullptr),
        sq(p.dbias_sq),
        sk(p.dbias_sk),
        rows(s.sq),
        cols(s.sk) {}

  // Summed over query rows: the kernel keeps per-key sums (summed_rows) and
  // writes them once per head (write_row_sums).
  __device__ __forceinline__ bool summed_rows() const { return at && sq == 0; }

  // ds of score (i, j) at (i, j), inside the sequence (not summed_rows()).
  __device__ __forceinline__ void store(float ds, int i, int j) const {
    if (i < rows && j < cols) at[i * sq + j * sk] = ds;
  }

  // Records ds of score (i, j): into `row_sum` (this key's sum) or at (i, j).
  __device__ __forceinline__ void record(float ds, int i, int j, float* row_sum) const {
    if (!at) return;
    if (sq == 0) *row_sum += ds;
    else if (i < rows && j < cols) at[i * sq + j * sk] = ds;
  }

  // The per-key sums of a warp's 16 keys (j_lo and j_lo + 8 for the thread
  // with g = lane / 4; the four threads of a quad hold parts of one key's
  // sum): reduced over the quad, written, and reset.
  __device__ __forceinline__ void write_row_sums(float sums[2], int j_lo, int t) const {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float sum = quad_sum(sums[h]);
      const int j = j_lo + 8 * h;
      if (t == 0 && j < cols) at[j * sk] = sum;
      sums[h] = 0.0f;
    }
  }
};

// A dK/dV CTA whose keys (n0 .. n0 + cols of kv head hk) no query row sees:
// with dbias summed over the query rows, those keys' sums are zero for every
// query head of the group (threads `thread` of `nthreads`).
__device__ __forceinline__ void zero_dbias_row_sums(const KArgs& p, int b, int hk, int n0, int cols, int thread,
                                                    int nthreads) {
  if (!p.dbias || p.dbias_sq != 0) return;
  for (int idx = thread; idx < cols * p.group; idx += nthreads) {
    const int hq = hk * p.group + idx / cols, j = n0 + idx % cols;
    p.dbias[b * p.dbias_sb + hq * p.dbias_sh + j * p.dbias_sk] = 0.0f;
  }
}

// The Hopper dK/dV kernels' feature steps on a score's P and dP (both keep
// them in the S^T and dP^T registers between the two products). Dropout: dV
// takes P keep (returned); P keeps its value, with the verdict as its sign.
__device__ __forceinline__ float dropout_code(float& pr, float keep) {
  const float dropped = pr * keep;
  pr = keep > 0.0f ? pr : -pr;
  return dropped;
}
// ... and for dS: dP keep, and P's value back (N scores, s(k) and dp(k)).
template <int N, class S, class DP>
__device__ __forceinline__ void dropout_decode(const KArgs& p, S s, DP dp) {
#pragma unroll
  for (int k = 0; k < N; ++k) {
    const float coded = s(k);
    dp(k) *= coded < 0.0f ? 0.0f : p.keep_scale;
    s(k) = fabsf(coded);
  }
}
// softcap's derivative of score k in half precision: half k % 2 of d[k / 2].
__device__ __forceinline__ void set_half_dcap(__half2* d, int k, float v) {
  if (k & 1) d[k >> 1].y = __float2half_rn(v);
  else d[k >> 1].x = __float2half_rn(v);
}
__device__ __forceinline__ float half_dcap(const __half2* d, int k) {
  return __half2float((k & 1) ? d[k >> 1].y : d[k >> 1].x);
}

// Gradient of one score: ds = d loss / d logit = P (dP keep - delta), with P
// the probability before dropout and keep its dropout factor (0 or
// 1 / (1 - rate)); ds is the bias gradient (recorded when kDbias). Returns
// d loss / d (q.k) = ds * dcap * scale (dcap: d logit / d (scale q.k)).
template <bool kDbias>
__device__ __forceinline__ float score_grad(const KArgs& p, float pr, float dp, float keep, float delta,
                                            float dcap, const DbiasSink& dbias, int i, int j,
                                            float* row_sum) {
  const float ds = pr * (dp * keep - delta);
  if constexpr (kDbias) dbias.record(ds, i, j, row_sum);
  return ds * dcap * p.scale;
}

}  // namespace symheap::attention::cuda
