// dK/dV kernel of the backward whose warps share the Q and dO fragments
// (head dims 64 and 128, no logit features): the math and the CTA of
// attention_bwd_dkdv_pipelined_kernel (128 keys, 8 warps, 64-row query tiles
// of every query head of the group double-buffered by cp.async, the same
// swizzle), with another split of the work. There each warp owns 16 keys and
// reads every Q and dO fragment of a tile twice (B of S^T and dP^T, then B of
// dV and dK through .trans): at head dim 128, 128 of its 144 ldmatrix per
// tile. Here
//  - S^T = K Q^T and dP^T = V dO^T run on a 4 x 2 warp grid, 32 keys x 32 query
//    rows per warp (each fragment read serves two mma tiles), and P^T, dS^T go
//    to shared memory as 16-bit tiles (the rounding of the register repack);
//  - after a barrier, dV += P^T dO and dK += dS^T Q run on a 4 x 2 grid of 32
//    keys x DB / 2 columns per warp, so the dK and dV accumulators keep their
//    size (2 x 64 registers at head dim 128, 2 x 32 at 64).
// At head dim 128: 112 ldmatrix and 32 shared stores per warp and tile
// instead of 144 ldmatrix (240 bytes of shared memory per mma instead of
// 288), and one more barrier, of the two warps of a key group only (they
// alone exchange P^T and dS^T), so the other warps keep the tensor cores busy
// meanwhile. At head dim 64 the warp's K and V A fragments (32 keys, 64
// registers) stay in registers, as the pipelined kernel keeps its 16 keys'
// there: 48 ldmatrix and 32 shared stores per warp and tile against its 64
// ldmatrix. The default at head dims 64 and 128 without logit features;
// $SYMHEAP_ATTN_OWN_BACKWARD = pipelined_dkdv_unshared runs the pipelined
// kernel instead.
//
// kFuseDq (the default where the call is not deterministic): the kernel also
// computes dQ += dS K, so the separate dQ kernel (which recomputes S and dP)
// does not run. dS^T of the whole tile (128 keys x 64 rows) is in shared
// memory once every warp has written its part, i.e. after the next tile's
// first barrier: dS^T is double-buffered, and the dQ product of tile it - 1
// runs right after that barrier, on a 2 x 4 warp grid of 32 rows x DB / 4
// columns per warp (32 fp32 accumulators at head dim 128, 16 at 64;
// transient). Each warp adds its
// slice to an fp32 workspace with vector atomics (red.global.add.v2.f32);
// attention_bwd_dq_convert_kernel writes dQ in the tensor's dtype after.
#pragma once

#include "ops/attention/cuda_backward_dkdv_pipelined.cuh"
#include "ops/attention/path_choice.hpp"

namespace symheap::attention::cuda {

template <int DB, bool kFuseDq = false>
struct SharedDkvConfig {
  static_assert(shared_dkdv_serves(DB), "a head dim of shared_dkdv_serves (path_choice.hpp)");
  static constexpr int kBlockN = 128;  // keys per CTA
  static constexpr int kBlockM = 64;   // query rows per tile
  static constexpr int kWarps = 8;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kWarpKeys = 32;                   // 4 key groups
  static constexpr int kWarpRows = kBlockM / 2;          // S^T, dP^T: 2 row halves
  static constexpr int kWarpCols = DB / 2;               // dV, dK: 2 column halves
  static_assert(kBlockN / kWarpKeys * 2 == kWarps, "a 4 x 2 warp grid");
  // dQ += dS K (kFuseDq): a 2 x 4 grid of 32 query rows x DB / 4 columns.
  static constexpr int kDqWarpRows = kBlockM / 2;
  static constexpr int kDqWarpCols = DB / 4;
  // The column loops take 16 columns (two mma tiles, one ldmatrix.x4.trans)
  // per step: 2 steps of dV / dK and 1 of dQ per warp at head dim 64.
  static_assert(kWarpCols % 16 == 0 && kDqWarpCols % 16 == 0, "whole 16-column steps per warp");
  static constexpr int kDsBuffers = kFuseDq ? 2 : 1;
  // The warp's K and V A fragments of S^T and dP^T (DB / 2 registers each)
  // stay in registers at head dim 64, next to the 2 x 32 accumulators (no
  // spills); at 128 they are re-read from shared memory per tile.
  static constexpr bool kKVInRegisters = DB == 64;
  // K, V; two buffers each of Q and dO; P^T and dS^T (keys x rows; dS^T
  // twice when dQ is fused); then two buffers each of the tile's lse (log2
  // units) and delta.
  static constexpr size_t kSmemTiles =
      sizeof(uint16_t) * (DB * (2 * kBlockN + 4 * kBlockM) + (1 + kDsBuffers) * kBlockN * kBlockM);
  static constexpr size_t kSmem = kSmemTiles + sizeof(float) * 4 * kBlockM;
  static_assert((kBlockM * DB / 8) % kThreads == 0 && (kBlockN * DB / 8) % kThreads == 0,
                "load_tile: whole rounds of 16-byte copies per thread");
  static_assert(kBlockM <= kThreads, "one thread per query row loads the tile's lse and delta");
  static_assert(kSmem <= 227 * 1024, "shared memory of one CTA on sm_90");
};

namespace pipelined {

// Barrier 1 + kg of the two warps of key group kg (warps kg and kg + 4):
// orders their shared-memory accesses like __syncthreads does for the CTA.
// (The id is a register, so ptxas reserves all 16 barriers of the CTA; they
// belong to the CTA, occupancy does not depend on them. Immediate ids behind
// a switch cost 8 more bytes of spills.)
__device__ __forceinline__ void pair_barrier(int kg) {
  asm volatile("bar.sync %0, 64;\n" ::"r"(1 + kg) : "memory");
}

}  // namespace pipelined

template <class T, int DB, bool kFuseDq>
__global__ void __launch_bounds__(SharedDkvConfig<DB, kFuseDq>::kThreads)
    attention_bwd_dkdv_shared_kernel(const KArgs p) {
  using namespace pipelined;
  using C = SharedDkvConfig<DB, kFuseDq>;
  constexpr int BM = C::kBlockM, BN = C::kBlockN, NT = C::kThreads;
  constexpr int KT = C::kWarpKeys / 16;  // 16-key mma tiles of a warp
  constexpr int RT = C::kWarpRows / 8;   // 8-row mma tiles of a warp (S^T, dP^T)
  constexpr int CT = C::kWarpCols / 8;   // 8-column mma tiles of a warp (dV, dK)
  constexpr float kLog2e = 1.4426950408889634f;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* sK = reinterpret_cast<T*>(smem_raw);
  T* sV = sK + BN * DB;
  T* sQ = sV + BN * DB;       // two buffers of BM x DB
  T* sdO = sQ + 2 * BM * DB;  // two buffers of BM x DB
  T* sP = sdO + 2 * BM * DB;  // P^T: BN x BM
  T* sdS = sP + BN * BM;      // dS^T: BN x BM (two buffers with kFuseDq)
  float* sLse = reinterpret_cast<float*>(smem_raw + C::kSmemTiles);  // two buffers of BM
  float* sDelta = sLse + 2 * BM;                                    // two buffers of BM

  const int n0 = blockIdx.x * BN, hk = blockIdx.y, b = blockIdx.z;
  const Seq seq = sequence(p, b);
  if (n0 >= seq.sk) return;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
  // Warp grid: key group (32 keys) x half (query rows of S^T / dP^T, then
  // head-dim columns of dV / dK).
  const int kg = warp % 4, half = warp / 4;
  const int cols = min(BN, seq.sk - n0);

  // Query rows that see at least one key of [n0, n0 + cols), as in the
  // pipelined kernel: tiles m_tiles per head, then the next head.
  const int shift = seq.sk - seq.sq;
  const pipelined::QueryTiles tiles = pipelined::query_tiles<BM>(p, seq, n0, cols);
  const int m_begin = tiles.m_begin, m_tiles = tiles.m_tiles, n_tiles = tiles.n_tiles;

  T* dk = static_cast<T*>(p.dk) + b * p.dk_sb + (seq.k0 + n0) * p.dk_sr + hk * p.dk_sh;
  T* dv = static_cast<T*>(p.dv) + b * p.dv_sb + (seq.k0 + n0) * p.dv_sr + hk * p.dv_sh;
  if (n_tiles == 0) return pipelined::zero_key_rows<DB, NT>(dk, dv, p, cols);  // no row sees these keys

  auto tile_head = [&](int it) { return hk * p.group + it / m_tiles; };
  auto tile_row0 = [&](int it) { return m_begin + (it % m_tiles) * BM; };
  auto load_q_do = [&](int it, int buf) {
    const int hq = tile_head(it), m0 = tile_row0(it), rows = min(BM, seq.sq - m0);
    const int64_t row = seq.q0 + m0;
    load_tile<T, BM, DB, NT>(sQ + buf * BM * DB,
                             static_cast<const T*>(p.q) + b * p.q_sb + row * p.q_sr + hq * p.q_sh, p.q_sr,
                             rows);
    load_tile<T, BM, DB, NT>(sdO + buf * BM * DB,
                             static_cast<const T*>(p.dout) + b * p.do_sb + row * p.do_sr + hq * p.do_sh,
                             p.do_sr, rows);
  };
  // This thread's query row of tile `it` (threads < BM): lse in log2 units,
  // +inf where the row is past the end or sees no key, and delta.
  auto read_stats = [&](int it, float* lse2, float* delta) {
    const int hq = tile_head(it), i = tile_row0(it) + static_cast<int>(threadIdx.x);
    *lse2 = INFINITY;
    *delta = 0.0f;
    if (i < seq.sq) {
      const float x = p.lse[b * p.lse_sb + hq * p.lse_sh + seq.q0 + i];
      if (x != -INFINITY) *lse2 = x * kLog2e;
      *delta = p.delta[b * p.delta_sb + hq * p.delta_sh + seq.q0 + i];
    }
  };

  // Prologue: K and V of the block and the first Q/dO tile, one group.
  load_tile<T, BN, DB, NT>(sK, static_cast<const T*>(p.k) + b * p.k_sb + (seq.k0 + n0) * p.k_sr + hk * p.k_sh,
                           p.k_sr, cols);
  load_tile<T, BN, DB, NT>(sV, static_cast<const T*>(p.v) + b * p.v_sb + (seq.k0 + n0) * p.v_sr + hk * p.v_sh,
                           p.v_sr, cols);
  load_q_do(0, 0);
  cp_async_commit();
  if (threadIdx.x < BM) read_stats(0, &sLse[threadIdx.x], &sDelta[threadIdx.x]);

  // This thread's keys in S^T / dP^T: jb + 8 q, q = 2 mt + h (mma tile mt,
  // fragment half h); the query rows that see key jb, and the rows for which a
  // whole tile sees every key of the block.
  const int jb = n0 + kg * C::kWarpKeys + g;
  const RowRange sees = rows_seeing(jb, shift, p.win_left, p.win_right);
  const int full_lo = rows_seeing(n0 + BN - 1, shift, p.win_left, p.win_right).lo;
  const int full_hi = rows_seeing(n0, shift, p.win_left, p.win_right).hi;
  const float scale_log2 = p.scale * kLog2e;

  // ldmatrix lane addresses (as in the pipelined kernel): A fragments (K, V,
  // P^T, dS^T rows); B fragments of Q/dO rows; B fragments through .trans.
  const int a_row = (lane & 7) + ((lane >> 3) & 1) * 8, a_chunk = lane >> 4;
  const int b_row = (lane & 7) + (lane >> 4) * 8, b_chunk = (lane >> 3) & 1;
  const int bt_row = (lane & 7) + ((lane >> 3) & 1) * 8, bt_chunk = lane >> 4;
  const int key_row0 = kg * C::kWarpKeys;     // this warp's first key row in the block
  const int q_row0 = half * C::kWarpRows;     // ... first query row of S^T / dP^T
  const int col_chunk0 = half * CT;            // ... first 16-byte column chunk of dV / dK

  float acc_dv[KT][CT][4], acc_dk[KT][CT][4];
#pragma unroll
  for (int mt = 0; mt < KT; ++mt)
#pragma unroll
    for (int ct = 0; ct < CT; ++ct)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc_dv[mt][ct][e] = acc_dk[mt][ct][e] = 0.0f;

  // dQ += dS K of tile `done` (kFuseDq), once every warp's dS^T of it is in
  // s_ds: 32 query rows (q_row0, as in S^T) x DB / 4 columns of this warp,
  // over the block's BN keys. dS as A through ldmatrix.trans of dS^T (the
  // lane addresses of the B fragments: keys b_row, row chunk b_chunk), K as
  // B through ldmatrix.trans (keys bt_row, column chunk bt_chunk), as dO and
  // Q in dV and dK. Rows past the sequence add nothing (dS is 0 there, and
  // the workspace ends with the sequence).
  constexpr int DQ_RT = C::kDqWarpRows / 16, DQ_CT = C::kDqWarpCols / 8;
  const int dq_chunk0 = kg * DQ_CT;  // this warp's first 16-byte column chunk of dQ
  auto dq_product = [&](int done, const T* s_ds) {
    float acc[DQ_RT][DQ_CT][4];
#pragma unroll
    for (int rt = 0; rt < DQ_RT; ++rt)
#pragma unroll
      for (int ct = 0; ct < DQ_CT; ++ct)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[rt][ct][e] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      uint32_t da[DQ_RT][4];
#pragma unroll
      for (int rt = 0; rt < DQ_RT; ++rt)
        ldsm_x4_trans(da[rt], smem_addr(s_ds + swizzle<BM>(kk * 16 + b_row, (q_row0 + rt * 16) / 8 + b_chunk)));
#pragma unroll
      for (int d2 = 0; d2 < DQ_CT / 2; ++d2) {
        uint32_t kf[4];
        ldsm_x4_trans(kf, smem_addr(sK + swizzle<DB>(kk * 16 + bt_row, dq_chunk0 + 2 * d2 + bt_chunk)));
#pragma unroll
        for (int rt = 0; rt < DQ_RT; ++rt) {
          mma<T>(acc[rt][2 * d2], da[rt], kf);
          mma<T>(acc[rt][2 * d2 + 1], da[rt], kf + 2);
        }
      }
    }
    const int hq = tile_head(done), m0 = tile_row0(done);
    float* out = p.dq_accum + b * p.dqa_sb + (seq.q0 + m0) * p.dqa_sr + hq * p.dqa_sh + dq_chunk0 * 8 + 2 * t;
#pragma unroll
    for (int rt = 0; rt < DQ_RT; ++rt) {
      const int r = q_row0 + rt * 16 + g;
#pragma unroll
      for (int ct = 0; ct < DQ_CT; ++ct) {
        if (m0 + r < seq.sq)
          atomicAdd(reinterpret_cast<float2*>(out + r * p.dqa_sr + ct * 8),
                    make_float2(acc[rt][ct][0], acc[rt][ct][1]));
        if (m0 + r + 8 < seq.sq)
          atomicAdd(reinterpret_cast<float2*>(out + (r + 8) * p.dqa_sr + ct * 8),
                    make_float2(acc[rt][ct][2], acc[rt][ct][3]));
      }
    }
  };

  // kKVInRegisters: the K and V A fragments of S^T and dP^T, read once (the
  // first tile, after K and V have landed).
  constexpr int KVR = C::kKVInRegisters ? DB / 16 : 1;
  uint32_t kreg[KVR][KT][4], vreg[KVR][KT][4];
  for (int it = 0; it < n_tiles; ++it) {
    const int buf = it & 1;
    const T* sQb = sQ + buf * BM * DB;
    const T* sdOb = sdO + buf * BM * DB;
    const float* lse2 = sLse + buf * BM;
    const float* delta = sDelta + buf * BM;
    cp_async_wait<0>();  // tile `it` (and K, V) has landed
    __syncthreads();     // ... for every thread; tile it-1, P^T and dS^T are consumed
    const bool has_next = it + 1 < n_tiles;
    float next_lse2 = INFINITY, next_delta = 0.0f;
    if (has_next) {
      load_q_do(it + 1, buf ^ 1);
      if (threadIdx.x < BM) read_stats(it + 1, &next_lse2, &next_delta);
    }
    cp_async_commit();  // possibly empty: keeps the group count uniform
    // The previous tile's dS^T is complete (the barrier above); the S^T/dP^T
    // stores below go to the other buffer.
    T* const sdSb = sdS + (kFuseDq ? buf * BN * BM : 0);
    if constexpr (kFuseDq)
      if (it > 0) dq_product(it - 1, sdS + (buf ^ 1) * BN * BM);
    if constexpr (C::kKVInRegisters) {
      if (it == 0) {
#pragma unroll
        for (int kk = 0; kk < DB / 16; ++kk)
#pragma unroll
          for (int mt = 0; mt < KT; ++mt) {
            ldsm_x4(kreg[kk][mt], smem_addr(sK + swizzle<DB>(key_row0 + mt * 16 + a_row, 2 * kk + a_chunk)));
            ldsm_x4(vreg[kk][mt], smem_addr(sV + swizzle<DB>(key_row0 + mt * 16 + a_row, 2 * kk + a_chunk)));
          }
      }
    }
    const int hq = tile_head(it), m0 = tile_row0(it);

    // S^T = K Q^T and dP^T = V dO^T: 32 keys x 32 query rows of this warp.
    {
      float s[KT][RT][4], dp[KT][RT][4];
#pragma unroll
      for (int mt = 0; mt < KT; ++mt)
#pragma unroll
        for (int nt = 0; nt < RT; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) s[mt][nt][e] = dp[mt][nt][e] = 0.0f;
#pragma unroll
      for (int kk = 0; kk < DB / 16; ++kk) {
        uint32_t ak_s[KT][4], av_s[KT][4];
        uint32_t (*ak)[4] = ak_s;
        uint32_t (*av)[4] = av_s;
        if constexpr (C::kKVInRegisters) {
          ak = kreg[kk];
          av = vreg[kk];
        } else {
#pragma unroll
          for (int mt = 0; mt < KT; ++mt) {
            ldsm_x4(ak_s[mt], smem_addr(sK + swizzle<DB>(key_row0 + mt * 16 + a_row, 2 * kk + a_chunk)));
            ldsm_x4(av_s[mt], smem_addr(sV + swizzle<DB>(key_row0 + mt * 16 + a_row, 2 * kk + a_chunk)));
          }
        }
#pragma unroll
        for (int np = 0; np < RT / 2; ++np) {
          uint32_t qf[4], of[4];
          ldsm_x4(qf, smem_addr(sQb + swizzle<DB>(q_row0 + np * 16 + b_row, 2 * kk + b_chunk)));
          ldsm_x4(of, smem_addr(sdOb + swizzle<DB>(q_row0 + np * 16 + b_row, 2 * kk + b_chunk)));
#pragma unroll
          for (int mt = 0; mt < KT; ++mt) {
            mma<T>(s[mt][2 * np], ak[mt], qf);
            mma<T>(s[mt][2 * np + 1], ak[mt], qf + 2);
            mma<T>(dp[mt][2 * np], av[mt], of);
            mma<T>(dp[mt][2 * np + 1], av[mt], of + 2);
          }
        }
      }

      // P and dS = P (dP - delta) scale (score_grad, no features). Element e
      // of tile (mt, nt): key jb + 8 q with q = 2 mt + (e >> 1), query row
      // i = m0 + q_row0 + 8 nt + 2 t + (e & 1); the rows seeing key jb + 8 q
      // are those seeing jb shifted by 8 q (a clamped bound stays beyond every
      // row), so the mask tests i - 8 q. Stored 16-bit, keys as rows.
      const bool full = m0 >= full_lo && m0 + BM <= full_hi;
      const DbiasSink no_dbias(p, b, hq, seq);
#pragma unroll
      for (int nt = 0; nt < RT; ++nt) {
        const int c = q_row0 + nt * 8 + 2 * t;
        const float2 l2 = *reinterpret_cast<const float2*>(lse2 + c);
        const float2 dl = *reinterpret_cast<const float2*>(delta + c);
#pragma unroll
        for (int mt = 0; mt < KT; ++mt) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int q = 2 * mt + (e >> 1), i = m0 + c + (e & 1), shifted = i - 8 * q;
            // Bitwise, not short-circuit: selects, no branches.
            const bool seen = full | ((shifted >= sees.lo) & (shifted < sees.hi));
            const float x2 = seen ? s[mt][nt][e] * scale_log2 : -INFINITY;
            const float pr = exp2_fast(x2 - ((e & 1) ? l2.y : l2.x));
            s[mt][nt][e] = pr;
            dp[mt][nt][e] = score_grad<false>(p, pr, dp[mt][nt][e], 1.0f, (e & 1) ? dl.y : dl.x, 1.0f,
                                              no_dbias, i, jb + 8 * q, nullptr);
          }
          const int row = key_row0 + mt * 16 + g, chunk = c / 8;
          *reinterpret_cast<uint32_t*>(sP + swizzle<BM>(row, chunk) + 2 * t) =
              Pack<T>::two(s[mt][nt][0], s[mt][nt][1]);
          *reinterpret_cast<uint32_t*>(sP + swizzle<BM>(row + 8, chunk) + 2 * t) =
              Pack<T>::two(s[mt][nt][2], s[mt][nt][3]);
          *reinterpret_cast<uint32_t*>(sdSb + swizzle<BM>(row, chunk) + 2 * t) =
              Pack<T>::two(dp[mt][nt][0], dp[mt][nt][1]);
          *reinterpret_cast<uint32_t*>(sdSb + swizzle<BM>(row + 8, chunk) + 2 * t) =
              Pack<T>::two(dp[mt][nt][2], dp[mt][nt][3]);
        }
      }
    }
    // P^T and dS^T of this warp's 32 keys (all BM rows) are in shared memory:
    // the two warps of the key group wrote them and only they read them.
    pair_barrier(kg);

    // dV += P^T dO and dK += dS^T Q: 32 keys x DB / 2 columns of this warp,
    // over the tile's BM rows.
#pragma unroll
    for (int kk = 0; kk < BM / 16; ++kk) {
      uint32_t pa[KT][4], sa[KT][4];
#pragma unroll
      for (int mt = 0; mt < KT; ++mt) {
        ldsm_x4(pa[mt], smem_addr(sP + swizzle<BM>(key_row0 + mt * 16 + a_row, 2 * kk + a_chunk)));
        ldsm_x4(sa[mt], smem_addr(sdSb + swizzle<BM>(key_row0 + mt * 16 + a_row, 2 * kk + a_chunk)));
      }
#pragma unroll
      for (int d2 = 0; d2 < CT / 2; ++d2) {
        uint32_t of[4], qf[4];
        ldsm_x4_trans(of, smem_addr(sdOb + swizzle<DB>(kk * 16 + bt_row, col_chunk0 + 2 * d2 + bt_chunk)));
        ldsm_x4_trans(qf, smem_addr(sQb + swizzle<DB>(kk * 16 + bt_row, col_chunk0 + 2 * d2 + bt_chunk)));
#pragma unroll
        for (int mt = 0; mt < KT; ++mt) {
          mma<T>(acc_dv[mt][2 * d2], pa[mt], of);
          mma<T>(acc_dv[mt][2 * d2 + 1], pa[mt], of + 2);
          mma<T>(acc_dk[mt][2 * d2], sa[mt], qf);
          mma<T>(acc_dk[mt][2 * d2 + 1], sa[mt], qf + 2);
        }
      }
    }

    // The next tile's statistics (buffer buf ^ 1 was consumed before this
    // iteration's first barrier; the next one publishes them).
    if (has_next && threadIdx.x < BM) {
      sLse[(buf ^ 1) * BM + threadIdx.x] = next_lse2;
      sDelta[(buf ^ 1) * BM + threadIdx.x] = next_delta;
    }
  }
  cp_async_wait<0>();
  if constexpr (kFuseDq) {
    __syncthreads();  // the last tile's dS^T, from every warp
    dq_product(n_tiles - 1, sdS + ((n_tiles - 1) & 1) * BN * BM);
    __syncthreads();  // every warp has read sK, which the staging below overwrites
  }

  // The rows of sK and sV of a key group are read only by its two warps
  // (and, with kFuseDq, by every warp before the barrier above), before the
  // last tile's pair barrier, which both have passed: each warp stages its
  // 32 keys x DB / 2 columns there, swizzled, and writes them out with
  // 16-byte stores.
  const int warp_rows = min(C::kWarpKeys, cols - key_row0);
  auto store = [&](T* s_stage, const float (*acc)[CT][4], T* out, int64_t row_stride) {
#pragma unroll
    for (int mt = 0; mt < KT; ++mt) {
      const int r = key_row0 + mt * 16 + g;
#pragma unroll
      for (int ct = 0; ct < CT; ++ct) {
        *reinterpret_cast<uint32_t*>(s_stage + swizzle<DB>(r, col_chunk0 + ct) + 2 * t) =
            Pack<T>::two(acc[mt][ct][0], acc[mt][ct][1]);
        *reinterpret_cast<uint32_t*>(s_stage + swizzle<DB>(r + 8, col_chunk0 + ct) + 2 * t) =
            Pack<T>::two(acc[mt][ct][2], acc[mt][ct][3]);
      }
    }
    __syncwarp();
    if (warp_rows > 0) {
#pragma unroll
      for (int k2 = 0; k2 < C::kWarpKeys * CT / 32; ++k2) {
        const int idx = lane + k2 * 32, rr = idx / CT, cc = col_chunk0 + idx % CT;
        if (rr < warp_rows)
          *reinterpret_cast<uint4*>(out + (key_row0 + rr) * row_stride + cc * 8) =
              *reinterpret_cast<const uint4*>(s_stage + swizzle<DB>(key_row0 + rr, cc));
      }
    }
  };
  store(sK, acc_dk, dk, p.dk_sr);
  store(sV, acc_dv, dv, p.dv_sr);
}

// dQ from the fp32 workspace of the fused kernel (rows x heads_q x d, the
// rows packed for varlen, as the dq tensor): 8 columns per thread.
template <class T>
__global__ void attention_bwd_dq_convert_kernel(const KArgs p, int64_t rows) {
  const int chunks = p.d / 8;
  const int64_t work = rows * p.heads_q * chunks;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < work;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int c = static_cast<int>(idx % chunks);
    const int64_t rh = idx / chunks, r = rh / p.heads_q;
    const int h = static_cast<int>(rh % p.heads_q);
    const int64_t b = p.cu_q ? 0 : r / p.seqlen_q, i = p.cu_q ? r : r % p.seqlen_q;
    const float* src = p.dq_accum + b * p.dqa_sb + i * p.dqa_sr + h * p.dqa_sh + c * 8;
    const float4 x = *reinterpret_cast<const float4*>(src);
    const float4 y = *reinterpret_cast<const float4*>(src + 4);
    *reinterpret_cast<uint4*>(static_cast<T*>(p.dq) + b * p.dq_sb + i * p.dq_sr + h * p.dq_sh + c * 8) =
        make_uint4(Pack<T>::two(x.x, x.y), Pack<T>::two(x.z, x.w), Pack<T>::two(y.x, y.y),
                   Pack<T>::two(y.z, y.w));
  }
}

}  // namespace symheap::attention::cuda
