// Backward kernels (recomputation from the log-sum-exp, as in FlashAttention 2),
// split so that no output is accumulated across CTAs: no atomics, and the
// result does not depend on scheduling (the backward is always deterministic).
//   delta: rowsum(dout * out) per query row and head.
//   dq:    one CTA per query block walks the key blocks (S, dP, dS, dQ += dS K).
//   dk/dv: one CTA per key block and kv head walks every query head of its
//          group and the query blocks that see it (dV += P^T dO, dK += dS^T Q);
//          it also writes dbias. For large head dims dV and dK run as two
//          passes so that one accumulator fits in registers.
#pragma once
#include "ops/attention/cuda_common.cuh"

namespace symheap::attention::cuda {

constexpr int kDeltaThreads = 256;

// delta = rowsum(dout * out) for every (query row, head) of the tensors (rows
// packed for varlen: a row outside every sequence gets a delta nobody reads),
// flat over rows x heads with delta_lanes(DB) lanes a pair, a 16-byte chunk
// each, so a warp reads whole rows of consecutive pairs (one warp a pair left
// 3/4 of its lanes idle at head dim 64). With kZeroDq it also zeroes the
// pair's fp32 dQ accumulator (the fused backward's workspace) in the same
// pass, in place of a memset of its own. The launcher checks that rows are
// 16-byte aligned and the head dim is a multiple of 8.
constexpr int delta_lanes(int db) {
  int lanes = 1;
  while (lanes < 32 && 8 * lanes < db) lanes *= 2;
  return lanes;
}

template <class T, int DB, bool kZeroDq>
__global__ void __launch_bounds__(kDeltaThreads) attention_bwd_delta_kernel(const KArgs p, int64_t rows) {
  constexpr int kLanes = delta_lanes(DB);
  const int64_t pair = (static_cast<int64_t>(blockIdx.x) * kDeltaThreads + threadIdx.x) / kLanes;
  if (pair >= rows * p.heads_q) return;  // a pair's lanes leave together
  const int lane = threadIdx.x % kLanes;
  const unsigned group = kLanes == 32 ? 0xffffffffu
                                      : ((1u << kLanes) - 1) << (threadIdx.x % 32 / kLanes * kLanes);
  const int64_t r = pair / p.heads_q;
  const int h = static_cast<int>(pair % p.heads_q);
  const int64_t b = p.cu_q ? 0 : r / p.seqlen_q, i = p.cu_q ? r : r % p.seqlen_q;
  const T* o = static_cast<const T*>(p.out) + b * p.o_sb + i * p.o_sr + h * p.o_sh;
  const T* dout = static_cast<const T*>(p.dout) + b * p.do_sb + i * p.do_sr + h * p.do_sh;
  float acc = 0.0f;
  for (int c = 8 * lane; c < p.d; c += 8 * kLanes) {
    const uint4 ov = *reinterpret_cast<const uint4*>(o + c);
    const uint4 dv = *reinterpret_cast<const uint4*>(dout + c);
    const T* oe = reinterpret_cast<const T*>(&ov);
    const T* de = reinterpret_cast<const T*>(&dv);
#pragma unroll
    for (int u = 0; u < 8; ++u) acc += static_cast<float>(oe[u]) * static_cast<float>(de[u]);
    if constexpr (kZeroDq) {
      float4* dq = reinterpret_cast<float4*>(p.dq_accum + b * p.dqa_sb + i * p.dqa_sr + h * p.dqa_sh + c);
      dq[0] = dq[1] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
  }
#pragma unroll
  for (int w = kLanes / 2; w > 0; w >>= 1) acc += __shfl_xor_sync(group, acc, w);
  if (lane == 0) p.delta[b * p.delta_sb + h * p.delta_sh + i] = acc;
}

// ------------------------------------------------------------------ dq

template <int DB>
struct DqConfig {
  static constexpr int kBlockM = 64;
  static constexpr int kBlockN = DB <= 128 ? 64 : 32;
  static constexpr int kWarps = kBlockM / 16;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kLd = DB + 8;
  static constexpr size_t kSmem =
      sizeof(uint16_t) * (2 * kBlockM * kLd + 2 * kBlockN * kLd + DB * (kBlockN + 8));
};

template <class T, int DB>
__global__ void __launch_bounds__(DqConfig<DB>::kThreads) attention_bwd_dq_kernel(const KArgs p) {
  using C = DqConfig<DB>;
  constexpr int BM = C::kBlockM, BN = C::kBlockN, LD = C::kLd, NT = C::kThreads;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sdO = sQ + BM * LD;
  T* sK = sdO + BM * LD;
  T* sV = sK + BN * LD;
  T* sKt = sV + BN * LD;  // [DB][BN + 8]

  const int b = blockIdx.z, hq = blockIdx.y, m0 = blockIdx.x * BM;
  const Seq seq = sequence(p, b);
  if (m0 >= seq.sq) return;
  const int hk = hq / p.group;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
  const int rows = min(BM, seq.sq - m0);
  const LogitCtx logit(p, b, hq, seq);
  const uint32_t bh = static_cast<uint32_t>(b * p.heads_q + hq);

  load_rows<T, BM, DB, NT>(sQ, static_cast<const T*>(p.q) + b * p.q_sb + (seq.q0 + m0) * p.q_sr + hq * p.q_sh,
                           p.q_sr, rows, p.d);
  load_rows<T, BM, DB, NT>(sdO,
                           static_cast<const T*>(p.dout) + b * p.do_sb + (seq.q0 + m0) * p.do_sr + hq * p.do_sh,
                           p.do_sr, rows, p.d);
  const T* k = static_cast<const T*>(p.k) + b * p.k_sb + seq.k0 * p.k_sr + hk * p.k_sh;
  const T* v = static_cast<const T*>(p.v) + b * p.v_sb + seq.k0 * p.v_sr + hk * p.v_sh;

  const int r_lo = m0 + warp * 16 + g;
  float lse[2], delta[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int i = r_lo + 8 * h;
    lse[h] = INFINITY;  // rows past the end, or with no visible key: p = 0
    delta[h] = 0.0f;
    if (i < seq.sq) {
      const float x = p.lse[b * p.lse_sb + hq * p.lse_sh + seq.q0 + i];
      if (x != -INFINITY) lse[h] = x;
      delta[h] = p.delta[b * p.delta_sb + hq * p.delta_sh + seq.q0 + i];
    }
  }

  const detail::KeyRange first = detail::visible_keys(m0, seq.sq, seq.sk, p.win_left, p.win_right);
  const detail::KeyRange last =
      detail::visible_keys(m0 + rows - 1, seq.sq, seq.sk, p.win_left, p.win_right);
  float acc[DB / 8][4];
#pragma unroll
  for (int dt = 0; dt < DB / 8; ++dt) acc[dt][0] = acc[dt][1] = acc[dt][2] = acc[dt][3] = 0.0f;

  for (int n0 = first.lo / BN * BN; n0 < last.hi; n0 += BN) {
    __syncthreads();
    const int cols = min(BN, seq.sk - n0);
    load_rows<T, BN, DB, NT>(sK, k + n0 * p.k_sr, p.k_sr, cols, p.d);
    load_rows<T, BN, DB, NT>(sV, v + n0 * p.v_sr, p.v_sr, cols, p.d);
    load_rows_t<T, BN, DB, NT>(sKt, k + n0 * p.k_sr, p.k_sr, cols, p.d);
    __syncthreads();

    float s[BN / 8][4], dp[BN / 8][4];
#pragma unroll
    for (int nt = 0; nt < BN / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[nt][e] = dp[nt][e] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < DB / 16; ++kk) {
      uint32_t aq[4], ado[4];
      load_a(aq, sQ, LD, warp * 16, kk * 16, lane);
      load_a(ado, sdO, LD, warp * 16, kk * 16, lane);
#pragma unroll
      for (int nt = 0; nt < BN / 8; ++nt) {
        uint32_t bf[2];
        load_b(bf, sK, LD, nt * 8, kk * 16, lane);
        mma<T>(s[nt], aq, bf);
        load_b(bf, sV, LD, nt * 8, kk * 16, lane);
        mma<T>(dp[nt], ado, bf);
      }
    }
#pragma unroll
    for (int nt = 0; nt < BN / 8; ++nt) {
      const int j0 = n0 + nt * 8 + 2 * t;  // even
      detail::U32x4 bits[2] = {};
      if (p.dropout) {
        bits[0] = dropout_octet(p, bh, r_lo, j0);
        bits[1] = dropout_octet(p, bh, r_lo + 8, j0);
      }
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int h = e >> 1, i = r_lo + 8 * h, j = j0 + (e & 1);
        float dcap;
        const float x = logit(p, s[nt][e], i, j, &dcap);
        const float pr = __expf(x - lse[h]);
        const float keep = p.dropout ? dropout_keep(p, bits[h], j) : 1.0f;
        const float ds = pr * (dp[nt][e] * keep - delta[h]);
        s[nt][e] = ds * dcap * p.scale;
      }
    }
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      uint32_t a[4];
      c_to_a<T>(a, s[2 * kk], s[2 * kk + 1]);
#pragma unroll
      for (int dt = 0; dt < DB / 8; ++dt) {
        uint32_t bf[2];
        load_b(bf, sKt, BN + 8, dt * 8, kk * 16, lane);
        mma<T>(acc[dt], a, bf);
      }
    }
  }

  __syncthreads();
  stage_acc<T, DB>(sQ, warp * 16, acc, 1.0f, 1.0f, lane);
  __syncwarp();
  const int warp_rows = min(16, rows - warp * 16);
  if (warp_rows > 0) {
    T* dq = static_cast<T*>(p.dq) + b * p.dq_sb + (seq.q0 + m0 + warp * 16) * p.dq_sr + hq * p.dq_sh;
    store_warp_rows<T, DB>(sQ + warp * 16 * LD, dq, p.dq_sr, warp_rows, p.d, lane);
  }
}

// ------------------------------------------------------------------ dk, dv

template <int DB>
struct DkvConfig {
  static constexpr int kBlockN = 64;  // keys per CTA, 16 per warp
  static constexpr int kBlockM = DB <= 128 ? 64 : 32;
  static constexpr int kWarps = kBlockN / 16;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kLd = DB + 8;
  // Above this head dim dV and dK run as separate passes (register budget).
  static constexpr bool kSplit = DB > 64;
  static constexpr size_t kSmem = sizeof(uint16_t) * (2 * kBlockN * kLd + 2 * kBlockM * kLd +
                                                      2 * DB * (kBlockM + 8)) +
                                  sizeof(float) * 2 * kBlockM;
};

template <class T, int DB, bool kDoDv, bool kDoDk>
__global__ void __launch_bounds__(DkvConfig<DB>::kThreads) attention_bwd_dkdv_kernel(const KArgs p) {
  using C = DkvConfig<DB>;
  constexpr int BM = C::kBlockM, BN = C::kBlockN, LD = C::kLd, NT = C::kThreads;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sK = reinterpret_cast<T*>(smem_raw);
  T* sV = sK + BN * LD;
  T* sQ = sV + BN * LD;
  T* sdO = sQ + BM * LD;
  T* sQt = sdO + BM * LD;       // [DB][BM + 8]
  T* sdOt = sQt + DB * (BM + 8);  // [DB][BM + 8]
  float* sLse = reinterpret_cast<float*>(sdOt + DB * (BM + 8));
  float* sDelta = sLse + BM;

  const int b = blockIdx.z, hk = blockIdx.y, n0 = blockIdx.x * BN;
  const Seq seq = sequence(p, b);
  if (n0 >= seq.sk) return;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
  const int cols = min(BN, seq.sk - n0);
  load_rows<T, BN, DB, NT>(sK, static_cast<const T*>(p.k) + b * p.k_sb + (seq.k0 + n0) * p.k_sr + hk * p.k_sh,
                           p.k_sr, cols, p.d);
  load_rows<T, BN, DB, NT>(sV, static_cast<const T*>(p.v) + b * p.v_sb + (seq.k0 + n0) * p.v_sr + hk * p.v_sh,
                           p.v_sr, cols, p.d);

  // Query rows that see at least one key of [n0, n0 + cols).
  const int shift = seq.sk - seq.sq;
  const int i_lo = p.win_right < 0 ? 0 : max(0, n0 - shift - p.win_right);
  const int i_hi = p.win_left < 0 ? seq.sq : min(seq.sq, n0 + cols - 1 - shift + p.win_left + 1);
  const int j_lo = n0 + warp * 16 + g;  // this thread's keys: j_lo and j_lo + 8

  float acc_dv[kDoDv ? DB / 8 : 1][4], acc_dk[kDoDk ? DB / 8 : 1][4];
#pragma unroll
  for (int dt = 0; dt < (kDoDv ? DB / 8 : 1); ++dt)
    acc_dv[dt][0] = acc_dv[dt][1] = acc_dv[dt][2] = acc_dv[dt][3] = 0.0f;
#pragma unroll
  for (int dt = 0; dt < (kDoDk ? DB / 8 : 1); ++dt)
    acc_dk[dt][0] = acc_dk[dt][1] = acc_dk[dt][2] = acc_dk[dt][3] = 0.0f;

  for (int hq = hk * p.group; hq < (hk + 1) * p.group; ++hq) {
    const LogitCtx logit(p, b, hq, seq);
    const uint32_t bh = static_cast<uint32_t>(b * p.heads_q + hq);
    const T* q = static_cast<const T*>(p.q) + b * p.q_sb + seq.q0 * p.q_sr + hq * p.q_sh;
    const T* dout = static_cast<const T*>(p.dout) + b * p.do_sb + seq.q0 * p.do_sr + hq * p.do_sh;
    const DbiasSink dbias(p, b, hq, seq);
    float dbias_sum[2] = {0.0f, 0.0f};  // bias broadcast over query rows

    for (int m0 = i_lo / BM * BM; m0 < i_hi; m0 += BM) {
      __syncthreads();
      const int rows = min(BM, seq.sq - m0);
      load_rows<T, BM, DB, NT>(sQ, q + m0 * p.q_sr, p.q_sr, rows, p.d);
      load_rows<T, BM, DB, NT>(sdO, dout + m0 * p.do_sr, p.do_sr, rows, p.d);
      if constexpr (kDoDk) load_rows_t<T, BM, DB, NT>(sQt, q + m0 * p.q_sr, p.q_sr, rows, p.d);
      if constexpr (kDoDv) load_rows_t<T, BM, DB, NT>(sdOt, dout + m0 * p.do_sr, p.do_sr, rows, p.d);
      for (int r = threadIdx.x; r < BM; r += NT) {
        float lse = INFINITY, delta = 0.0f;  // rows past the end: p = 0
        if (r < rows) {
          const int64_t at = seq.q0 + m0 + r;
          const float x = p.lse[b * p.lse_sb + hq * p.lse_sh + at];
          if (x != -INFINITY) lse = x;
          if (kDoDk) delta = p.delta[b * p.delta_sb + hq * p.delta_sh + at];
        }
        sLse[r] = lse;
        sDelta[r] = delta;
      }
      __syncthreads();

      // S^T (keys x queries) and, for dK, dP^T.
      float s[BM / 8][4], dp[kDoDk ? BM / 8 : 1][4];
#pragma unroll
      for (int nt = 0; nt < BM / 8; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
#pragma unroll
      for (int nt = 0; nt < (kDoDk ? BM / 8 : 1); ++nt) dp[nt][0] = dp[nt][1] = dp[nt][2] = dp[nt][3] = 0.0f;
#pragma unroll
      for (int kk = 0; kk < DB / 16; ++kk) {
        uint32_t ak[4], av[4];
        load_a(ak, sK, LD, warp * 16, kk * 16, lane);
        if constexpr (kDoDk) load_a(av, sV, LD, warp * 16, kk * 16, lane);
#pragma unroll
        for (int nt = 0; nt < BM / 8; ++nt) {
          uint32_t bf[2];
          load_b(bf, sQ, LD, nt * 8, kk * 16, lane);
          mma<T>(s[nt], ak, bf);
          if constexpr (kDoDk) {
            load_b(bf, sdO, LD, nt * 8, kk * 16, lane);
            mma<T>(dp[nt], av, bf);
          }
        }
      }

#pragma unroll
      for (int nt = 0; nt < BM / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int j = j_lo + (e >> 1) * 8, r = nt * 8 + 2 * t + (e & 1), i = m0 + r;
          float dcap;
          const float x = logit(p, s[nt][e], i, j, &dcap);
          const float pr = __expf(x - sLse[r]);
          float keep = 1.0f;
          if (p.dropout) keep = dropout_keep(p, dropout_octet(p, bh, i, j), j);
          s[nt][e] = pr * keep;  // dropped-out probabilities, for dV
          if constexpr (kDoDk)
            dp[nt][e] = score_grad<true>(p, pr, dp[nt][e], keep, sDelta[r], dcap, dbias, i, j,
                                         &dbias_sum[e >> 1]);
        }

#pragma unroll
      for (int kk = 0; kk < BM / 16; ++kk) {
        if constexpr (kDoDv) {
          uint32_t a[4];
          c_to_a<T>(a, s[2 * kk], s[2 * kk + 1]);
#pragma unroll
          for (int dt = 0; dt < DB / 8; ++dt) {
            uint32_t bf[2];
            load_b(bf, sdOt, BM + 8, dt * 8, kk * 16, lane);
            mma<T>(acc_dv[dt], a, bf);
          }
        }
        if constexpr (kDoDk) {
          uint32_t a[4];
          c_to_a<T>(a, dp[2 * kk], dp[2 * kk + 1]);
#pragma unroll
          for (int dt = 0; dt < DB / 8; ++dt) {
            uint32_t bf[2];
            load_b(bf, sQt, BM + 8, dt * 8, kk * 16, lane);
            mma<T>(acc_dk[dt], a, bf);
          }
        }
      }
    }
    if (kDoDk && dbias.summed_rows()) dbias.write_row_sums(dbias_sum, j_lo, t);  // uniform over the CTA
  }

  // Each warp reads only its own rows of sK and sV: stage its results there.
  __syncthreads();
  const int warp_rows = min(16, cols - warp * 16);
  if constexpr (kDoDk) {
    stage_acc<T, DB>(sK, warp * 16, acc_dk, 1.0f, 1.0f, lane);
    __syncwarp();
    if (warp_rows > 0) {
      T* dk = static_cast<T*>(p.dk) + b * p.dk_sb + (seq.k0 + n0 + warp * 16) * p.dk_sr + hk * p.dk_sh;
      store_warp_rows<T, DB>(sK + warp * 16 * LD, dk, p.dk_sr, warp_rows, p.d, lane);
    }
  }
  if constexpr (kDoDv) {
    stage_acc<T, DB>(sV, warp * 16, acc_dv, 1.0f, 1.0f, lane);
    __syncwarp();
    if (warp_rows > 0) {
      T* dv = static_cast<T*>(p.dv) + b * p.dv_sb + (seq.k0 + n0 + warp * 16) * p.dv_sr + hk * p.dv_sh;
      store_warp_rows<T, DB>(sV + warp * 16 * LD, dv, p.dv_sr, warp_rows, p.d, lane);
    }
  }
}

}  // namespace symheap::attention::cuda
