// Pipelined dQ kernel of the backward (head dims 64, 128 and 256, exactly):
// the same math as attention_bwd_dq_kernel (cuda_backward.cuh) on the
// building blocks of the pipelined forward. One CTA per 128 query rows; each
// warp owns 16 * MT rows and keeps its dQ accumulator in registers. K and V
// tiles are double-buffered with cp.async (tile j+1 loads while tile j is
// computed); Q and dO fragments come from swizzled shared memory through
// ldmatrix, K and V fragments too (ldmatrix.trans gives K as the B operand of
// dS K, so no transposed copy of K is stored). With MT = 2 every K and V
// fragment read from shared memory serves two 16-row products.
#pragma once
#include "ops/attention/cuda_forward_pipelined.cuh"

namespace symheap::attention::cuda {

// MT: 16-row mma tiles per warp. 2 (32 rows, 4 warps) at head dims 64 and
// 128, with S and dP of 32 keys next to the dQ accumulator (at 128 ptxas
// keeps 13 values in local memory, 13 L1 loads per 32-key tile against 192
// mma); 1 (16 rows, 8 warps) at 256 (the accumulator of 32 rows would take
// 256 registers), and everywhere with SYMHEAP_ATTN_OWN_BACKWARD =
// pipelined_dq16 (to compare the two).
template <int DB, int MT>
struct PipelinedDqConfig {
  static_assert(DB == 64 || DB == 128 || DB == 256, "the pipelined dQ serves head dims 64, 128 and 256");
  static_assert(MT == 1 || (MT == 2 && DB <= 128), "32-row warps at head dims 64 and 128 only");
  static constexpr int kRowTiles = MT;
  static constexpr int kBlockM = 128;
  // 16-row warps: 64 keys (32 at 256). 32-row warps: 32 keys, so S and dP of
  // 32 rows take 32 registers each (64 keys spill at head dim 64 too).
  static constexpr int kBlockN = MT == 2 ? 32 : DB <= 128 ? 64 : 32;
  static constexpr int kWarps = kBlockM / (16 * MT);
  static constexpr int kThreads = kWarps * 32;
  // 32-row warps: two CTAs per SM (128 threads of <= 255 registers; 96 KiB
  // of shared memory at head dim 128), 8 warps as with 16-row warps. (A
  // minimum-blocks launch bound is not needed for that, and with 16-row
  // warps it costs registers.)
  // Q and dO, then two buffers each of K and V.
  static constexpr size_t kSmem = sizeof(uint16_t) * DB * (2 * kBlockM + 4 * kBlockN);
  static_assert(kBlockM == kWarps * 16 * MT && kBlockN % 16 == 0, "whole mma tiles");
  static_assert(kSmem <= 227 * 1024, "shared memory of one CTA on sm_90");
};

// The row tiles per warp of the default dQ kernel at head dim DB.
template <int DB>
inline constexpr int kDqRowTiles = DB <= 128 ? 2 : 1;

template <class T, int DB, bool kFeatures, int MT>
__global__ void __launch_bounds__(PipelinedDqConfig<DB, MT>::kThreads)
    attention_bwd_dq_pipelined_kernel(const KArgs p) {
  using namespace pipelined;
  using C = PipelinedDqConfig<DB, MT>;
  constexpr int BM = C::kBlockM, BN = C::kBlockN, NT = C::kThreads;
  constexpr float kLog2e = 1.4426950408889634f;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sdO = sQ + BM * DB;
  T* sK = sdO + BM * DB;     // two buffers of BN x DB
  T* sV = sK + 2 * BN * DB;  // two buffers of BN x DB

  const int m0 = (gridDim.x - 1 - blockIdx.x) * BM, hq = blockIdx.y, b = blockIdx.z;
  const Seq seq = sequence(p, b);
  if (m0 >= seq.sq) return;
  const int hk = hq / p.group;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
  const int rows = min(BM, seq.sq - m0);
  const int warp_row0 = warp * 16 * MT;  // this warp's first row in the block
  // This thread's rows: row(mt, h) = m0 + warp_row0 + 16 mt + g + 8 h.
  auto row = [&](int mt, int h) { return m0 + warp_row0 + 16 * mt + g + 8 * h; };

  const T* k = static_cast<const T*>(p.k) + b * p.k_sb + seq.k0 * p.k_sr + hk * p.k_sh;
  const T* v = static_cast<const T*>(p.v) + b * p.v_sb + seq.k0 * p.v_sr + hk * p.v_sh;
  const detail::KeyRange first = detail::visible_keys(m0, seq.sq, seq.sk, p.win_left, p.win_right);
  const detail::KeyRange last =
      detail::visible_keys(m0 + rows - 1, seq.sq, seq.sk, p.win_left, p.win_right);
  const int n_begin = first.lo / BN * BN, n_end = last.hi;

  T* dq = static_cast<T*>(p.dq) + b * p.dq_sb + (seq.q0 + m0) * p.dq_sr + hq * p.dq_sh;
  if (n_begin >= n_end) {  // no row of this block sees a key (causal with Sq > Sk, windows)
    constexpr int kChunks = DB / 8;
    for (int idx = threadIdx.x; idx < rows * kChunks; idx += NT)
      *reinterpret_cast<uint4*>(dq + (idx / kChunks) * p.dq_sr + (idx % kChunks) * 8) = make_uint4(0, 0, 0, 0);
    return;
  }

  // Q, dO and the first K/V tile: one group.
  load_tile<T, BM, DB, NT>(sQ, static_cast<const T*>(p.q) + b * p.q_sb + (seq.q0 + m0) * p.q_sr + hq * p.q_sh,
                           p.q_sr, rows);
  load_tile<T, BM, DB, NT>(
      sdO, static_cast<const T*>(p.dout) + b * p.do_sb + (seq.q0 + m0) * p.do_sr + hq * p.do_sh, p.do_sr,
      rows);
  load_tile<T, BN, DB, NT>(sK, k + n_begin * p.k_sr, p.k_sr, seq.sk - n_begin);
  load_tile<T, BN, DB, NT>(sV, v + n_begin * p.v_sr, p.v_sr, seq.sk - n_begin);
  cp_async_commit();

  // lse in log2 units; +inf for rows past the end or with no visible key
  // (their probabilities are 0).
  float lse2[MT][2], delta[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int i = row(mt, h);
      lse2[mt][h] = INFINITY;
      delta[mt][h] = 0.0f;
      if (i < seq.sq) {
        const float x = p.lse[b * p.lse_sb + hq * p.lse_sh + seq.q0 + i];
        if (x != -INFINITY) lse2[mt][h] = x * kLog2e;
        delta[mt][h] = p.delta[b * p.delta_sb + hq * p.delta_sh + seq.q0 + i];
      }
    }
  const float scale_log2 = p.scale * kLog2e;
  const LogitCtx logit(p, b, hq, seq);
  const uint32_t bh = static_cast<uint32_t>(b * p.heads_q + hq);
  const int a_row = warp_row0 + (lane & 7) + ((lane >> 3) & 1) * 8, a_chunk = lane >> 4;
  // 16-row warps keep their rows' visible keys for the whole loop; 32-row
  // warps compute them per boundary tile (registers are scarce there).
  detail::KeyRange kept[2] = {};
  if constexpr (MT == 1) {
    kept[0] = detail::visible_keys(row(0, 0), seq.sq, seq.sk, p.win_left, p.win_right);
    kept[1] = detail::visible_keys(row(0, 1), seq.sq, seq.sk, p.win_left, p.win_right);
  }

  float acc[MT][DB / 8][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int dt = 0; dt < DB / 8; ++dt)
      acc[mt][dt][0] = acc[mt][dt][1] = acc[mt][dt][2] = acc[mt][dt][3] = 0.0f;

  for (int n0 = n_begin, it = 0; n0 < n_end; n0 += BN, ++it) {
    const int buf = it & 1;
    const T* sKb = sK + buf * BN * DB;
    const T* sVb = sV + buf * BN * DB;
    cp_async_wait<0>();  // tile `it` (and Q, dO) has landed
    __syncthreads();     // ... for every thread; and tile it-1 is consumed
    if (n0 + BN < n_end) {
      load_tile<T, BN, DB, NT>(sK + (buf ^ 1) * BN * DB, k + (n0 + BN) * p.k_sr, p.k_sr, seq.sk - n0 - BN);
      load_tile<T, BN, DB, NT>(sV + (buf ^ 1) * BN * DB, v + (n0 + BN) * p.v_sr, p.v_sr, seq.sk - n0 - BN);
    }
    cp_async_commit();

    // S = Q K^T and dP = dO V^T for this warp's rows x BN keys; each K and
    // V fragment serves MT row tiles.
    float s[MT][BN / 8][4], dp[MT][BN / 8][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < BN / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mt][nt][e] = dp[mt][nt][e] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < DB / 16; ++kk) {
      uint32_t aq[MT][4], ado[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        ldsm_x4(aq[mt], smem_addr(sQ + swizzle<DB>(a_row + 16 * mt, 2 * kk + a_chunk)));
        ldsm_x4(ado[mt], smem_addr(sdO + swizzle<DB>(a_row + 16 * mt, 2 * kk + a_chunk)));
      }
#pragma unroll
      for (int np = 0; np < BN / 16; ++np) {
        const int b_row = np * 16 + (lane & 7) + (lane >> 4) * 8, b_chunk = 2 * kk + ((lane >> 3) & 1);
        uint32_t kf[4], vf[4];
        ldsm_x4(kf, smem_addr(sKb + swizzle<DB>(b_row, b_chunk)));
        ldsm_x4(vf, smem_addr(sVb + swizzle<DB>(b_row, b_chunk)));
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma<T>(s[mt][2 * np], aq[mt], kf);
          mma<T>(s[mt][2 * np + 1], aq[mt], kf + 2);
          mma<T>(dp[mt][2 * np], ado[mt], vf);
          mma<T>(dp[mt][2 * np + 1], ado[mt], vf + 2);
        }
      }
    }

    // dS = P * (dP * keep - delta), times d logit / d (scale q.k) and scale.
    const bool full = n0 >= last.lo && n0 + BN <= first.hi;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      // This thread's rows' visible keys (read only where the tile crosses
      // a boundary).
      detail::KeyRange mine[2] = {kept[0], kept[1]};
      if constexpr (!kFeatures && MT > 1) {
        if (!full) {
          mine[0] = detail::visible_keys(row(mt, 0), seq.sq, seq.sk, p.win_left, p.win_right);
          mine[1] = detail::visible_keys(row(mt, 1), seq.sq, seq.sk, p.win_left, p.win_right);
        }
      }
#pragma unroll
      for (int nt = 0; nt < BN / 8; ++nt) {
        const int j0 = n0 + nt * 8 + 2 * t;  // even: j0 and j0 + 1 share a Philox call
        detail::U32x4 bits[2] = {};
        if constexpr (kFeatures) {
          if (p.dropout) {
            bits[0] = dropout_octet(p, bh, row(mt, 0), j0);
            bits[1] = dropout_octet(p, bh, row(mt, 1), j0);
          }
        }
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int h = e >> 1, j = j0 + (e & 1);
          float x2, dcap = 1.0f, keep = 1.0f;
          if constexpr (kFeatures) {
            x2 = logit(p, s[mt][nt][e], row(mt, h), j, &dcap) * kLog2e;
            if (p.dropout) keep = dropout_keep(p, bits[h], j);
          } else {
            x2 = full || (j >= mine[h].lo && j < mine[h].hi) ? s[mt][nt][e] * scale_log2 : -INFINITY;
          }
          const float pr = exp2_fast(x2 - lse2[mt][h]);
          const float ds = pr * (dp[mt][nt][e] * keep - delta[mt][h]);
          s[mt][nt][e] = ds * dcap * p.scale;
        }
      }
    }

    // dQ += dS K, K as the B operand through ldmatrix.trans; each K
    // fragment serves MT row tiles.
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      uint32_t a[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) c_to_a<T>(a[mt], s[mt][2 * kk], s[mt][2 * kk + 1]);
#pragma unroll
      for (int dp2 = 0; dp2 < DB / 16; ++dp2) {
        uint32_t kf[4];
        ldsm_x4_trans(kf, smem_addr(sKb + swizzle<DB>(kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8,
                                                      2 * dp2 + (lane >> 4))));
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma<T>(acc[mt][2 * dp2], a[mt], kf);
          mma<T>(acc[mt][2 * dp2 + 1], a[mt], kf + 2);
        }
      }
    }
  }
  // Only this warp reads its rows of sQ, but other warps' cp.async wrote
  // them: the loop's first barrier ordered those copies before this staging
  // (the loop runs at least once, see the early return above).
  cp_async_wait<0>();
  __syncwarp();
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int dt = 0; dt < DB / 8; ++dt) {
      const int r = warp_row0 + 16 * mt + g;
      *reinterpret_cast<uint32_t*>(sQ + swizzle<DB>(r, dt) + 2 * t) =
          Pack<T>::two(acc[mt][dt][0], acc[mt][dt][1]);
      *reinterpret_cast<uint32_t*>(sQ + swizzle<DB>(r + 8, dt) + 2 * t) =
          Pack<T>::two(acc[mt][dt][2], acc[mt][dt][3]);
    }
  __syncwarp();
  const int warp_rows = min(16 * MT, rows - warp_row0);
  if (warp_rows > 0) {
    constexpr int kChunks = DB / 8;
#pragma unroll
    for (int it = 0; it < 16 * MT * kChunks / 32; ++it) {
      const int idx = lane + it * 32, r = idx / kChunks, c = idx % kChunks;
      if (r < warp_rows)
        *reinterpret_cast<uint4*>(dq + (warp_row0 + r) * p.dq_sr + c * 8) =
            *reinterpret_cast<const uint4*>(sQ + swizzle<DB>(warp_row0 + r, c));
    }
  }
}

}  // namespace symheap::attention::cuda
