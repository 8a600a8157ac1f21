// Forward kernel: one CTA per (query block, query head, batch entry); each
// warp owns 16 query rows and keeps its output tile in registers while it
// walks the visible key blocks with an online softmax.
#pragma once
#include "ops/attention/cuda_common.cuh"

namespace symheap::attention::cuda {

template <int DB>
struct FwdConfig {
  static constexpr int kBlockM = 64;
  static constexpr int kBlockN = DB <= 128 ? 64 : 32;
  static constexpr int kWarps = kBlockM / 16;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kLd = DB + 8;
  static constexpr size_t kSmem =
      sizeof(uint16_t) * (kBlockM * kLd + kBlockN * kLd + DB * (kBlockN + 8));
};

template <class T, int DB>
__global__ void __launch_bounds__(FwdConfig<DB>::kThreads)
    attention_fwd_kernel(const KArgs p) {
  using C = FwdConfig<DB>;
  constexpr int BM = C::kBlockM, BN = C::kBlockN, LD = C::kLd, NT = C::kThreads;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sK = sQ + BM * LD;
  T* sVt = sK + BN * LD;  // [DB][BN + 8]

  const int b = blockIdx.z, hq = blockIdx.y, m0 = blockIdx.x * BM;
  const Seq seq = sequence(p, b);
  if (m0 >= seq.sq) return;
  const int hk = hq / p.group;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
  const int rows = min(BM, seq.sq - m0);
  const LogitCtx logit(p, b, hq, seq);
  const uint32_t bh = static_cast<uint32_t>(b * p.heads_q + hq);

  const T* q = static_cast<const T*>(p.q) + b * p.q_sb + (seq.q0 + m0) * p.q_sr + hq * p.q_sh;
  const T* k = static_cast<const T*>(p.k) + b * p.k_sb + seq.k0 * p.k_sr + hk * p.k_sh;
  const T* v = static_cast<const T*>(p.v) + b * p.v_sb + seq.k0 * p.v_sr + hk * p.v_sh;
  load_rows<T, BM, DB, NT>(sQ, q, p.q_sr, rows, p.d);

  const detail::KeyRange first = detail::visible_keys(m0, seq.sq, seq.sk, p.win_left, p.win_right);
  const detail::KeyRange last =
      detail::visible_keys(m0 + rows - 1, seq.sq, seq.sk, p.win_left, p.win_right);
  const int n_begin = first.lo / BN * BN, n_end = last.hi;

  float acc[DB / 8][4];
#pragma unroll
  for (int dt = 0; dt < DB / 8; ++dt) acc[dt][0] = acc[dt][1] = acc[dt][2] = acc[dt][3] = 0.0f;
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.0f, 0.0f};
  const int r_lo = m0 + warp * 16 + g;  // this thread's rows: r_lo and r_lo + 8

  for (int n0 = n_begin; n0 < n_end; n0 += BN) {
    __syncthreads();  // the previous tiles are consumed (and sQ is loaded)
    const int cols = min(BN, seq.sk - n0);
    load_rows<T, BN, DB, NT>(sK, k + n0 * p.k_sr, p.k_sr, cols, p.d);
    load_rows_t<T, BN, DB, NT>(sVt, v + n0 * p.v_sr, p.v_sr, cols, p.d);
    __syncthreads();

    float s[BN / 8][4];
#pragma unroll
    for (int nt = 0; nt < BN / 8; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < DB / 16; ++kk) {
      uint32_t a[4];
      load_a(a, sQ, LD, warp * 16, kk * 16, lane);
#pragma unroll
      for (int nt = 0; nt < BN / 8; ++nt) {
        uint32_t bf[2];
        load_b(bf, sK, LD, nt * 8, kk * 16, lane);
        mma<T>(s[nt], a, bf);
      }
    }

    // Logits, the new running max, probabilities.
    float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int nt = 0; nt < BN / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = r_lo + (e >> 1) * 8, j = n0 + nt * 8 + 2 * t + (e & 1);
        float dcap;
        s[nt][e] = logit(p, s[nt][e], i, j, &dcap);
        tile_max[e >> 1] = fmaxf(tile_max[e >> 1], s[nt][e]);
      }
    float rescale[2], base[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float m_new = fmaxf(row_max[h], quad_max(tile_max[h]));
      rescale[h] = row_max[h] == -INFINITY ? 0.0f : __expf(row_max[h] - m_new);
      base[h] = m_new == -INFINITY ? 0.0f : m_new;
      row_max[h] = m_new;
      row_sum[h] *= rescale[h];
    }
#pragma unroll
    for (int dt = 0; dt < DB / 8; ++dt) {
      acc[dt][0] *= rescale[0];
      acc[dt][1] *= rescale[0];
      acc[dt][2] *= rescale[1];
      acc[dt][3] *= rescale[1];
    }
#pragma unroll
    for (int nt = 0; nt < BN / 8; ++nt) {
      detail::U32x4 r_lo_bits{}, r_hi_bits{};
      const int j0 = n0 + nt * 8 + 2 * t;  // even: j0 and j0 + 1 share a Philox call
      if (p.dropout) {
        r_lo_bits = dropout_octet(p, bh, r_lo, j0);
        r_hi_bits = dropout_octet(p, bh, r_lo + 8, j0);
      }
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float pr = __expf(s[nt][e] - base[e >> 1]);
        row_sum[e >> 1] += pr;
        s[nt][e] = p.dropout ? pr * dropout_keep(p, (e >> 1) ? r_hi_bits : r_lo_bits, j0 + (e & 1))
                             : pr;
      }
    }

    // acc += P V, P taken straight from the score registers.
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      uint32_t a[4];
      c_to_a<T>(a, s[2 * kk], s[2 * kk + 1]);
#pragma unroll
      for (int dt = 0; dt < DB / 8; ++dt) {
        uint32_t bf[2];
        load_b(bf, sVt, BN + 8, dt * 8, kk * 16, lane);
        mma<T>(acc[dt], a, bf);
      }
    }
  }

  __syncthreads();  // every warp's rows of sQ are loaded even if no key block ran
  float inv[2], lse[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float sum = quad_sum(row_sum[h]);
    inv[h] = sum > 0.0f ? 1.0f / sum : 0.0f;  // no visible key: zeros, not NaN
    lse[h] = sum > 0.0f ? row_max[h] + __logf(sum) : -INFINITY;
  }
  // Each warp reads only its own rows of sQ, so it can stage its output there.
  __syncwarp();
  stage_acc<T, DB>(sQ, warp * 16, acc, inv[0], inv[1], lane);
  __syncwarp();
  const int warp_rows = min(16, rows - warp * 16);
  if (warp_rows > 0) {
    T* out = static_cast<T*>(p.out) + b * p.o_sb + (seq.q0 + m0 + warp * 16) * p.o_sr + hq * p.o_sh;
    store_warp_rows<T, DB>(sQ + warp * 16 * LD, out, p.o_sr, warp_rows, p.d, lane);
  }
  if (t == 0) {
    float* l = p.lse + b * p.lse_sb + hq * p.lse_sh + seq.q0;
    if (r_lo < seq.sq) l[r_lo] = lse[0];
    if (r_lo + 8 < seq.sq) l[r_lo + 8] = lse[1];
  }
}

}  // namespace symheap::attention::cuda
