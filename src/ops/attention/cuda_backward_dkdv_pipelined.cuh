// Pipelined dK/dV kernel of the backward (head dims 64, 128 and 256, exactly):
// the math of attention_bwd_dkdv_kernel (cuda_backward.cuh) on the building
// blocks of the pipelined forward. One CTA per (key block, kv head, batch);
// each warp owns 16 keys and keeps their dK and dV accumulators in registers
// for the whole kernel. The CTA walks the query tiles of every query head of
// its kv head's group as one sequence (so grouped-query attention sums its
// heads inside the CTA: no atomics, and the result does not depend on
// scheduling). Q and dO tiles, with their lse and delta, are double-buffered
// with cp.async (tile t+1 loads while tile t is computed); every fragment
// comes from XOR-swizzled shared memory through ldmatrix (.trans for Q and dO
// as the B operands of dK += dS^T Q and dV += P^T dO, so nothing is transposed
// by hand). Probabilities by ex2 from the lse in log2 units. At head dim 256
// dV and dK run as two passes (kDoDv, kDoDk) so that one accumulator of 128
// registers fits; it also writes dbias (the pass that computes dS).
#pragma once
#include <climits>

#include "ops/attention/cuda_forward_pipelined.cuh"

namespace symheap::attention::cuda {

// Query rows per tile: the scores S^T and dP^T of a warp take BM / 2
// registers each, next to the dK and dV accumulators (DB / 2 registers each).
// 64 at head dim 64; at 128 64 without the logit features (each K and V
// fragment read through ldmatrix then serves 64 rows instead of 32: 144
// ldmatrix.x4 per 256 mma instead of 2 x 80, and half the barriers; 12 bytes
// spilled) and 32 with them (64 rows spill about 140 bytes); 32 at 256.
template <int DB, bool kFeatures>
inline constexpr int kDkvRowTile = DB == 64 || (DB == 128 && !kFeatures) ? 64 : 32;

template <int DB, int BM>
struct PipelinedDkvConfig {
  static_assert(DB == 64 || DB == 128 || DB == 256, "the pipelined dK/dV serves head dims 64, 128 and 256");
  static_assert(BM == 32 || BM == 64, "query tiles of 32 or 64 rows");
  static constexpr int kBlockN = 128;  // keys per CTA, 16 per warp
  static constexpr int kBlockM = BM;
  static constexpr int kWarps = kBlockN / 16;
  static constexpr int kThreads = kWarps * 32;
  // dV and dK as separate passes (both accumulators would take 256 registers).
  static constexpr bool kSplit = DB == 256;
  // The warp's K and V fragments (A operands, DB / 4 registers each) stay in
  // registers where they fit (not next to the logit features); else they are
  // re-read from shared memory per tile.
  template <bool kFeatures>
  static constexpr bool kKVInRegisters = DB == 64 && !kFeatures;
  // K and V of the block, then two buffers each of Q and dO, then two buffers
  // each of the tile's lse (log2 units) and delta.
  static constexpr size_t kSmemTiles = sizeof(uint16_t) * DB * (2 * kBlockN + 4 * kBlockM);
  static constexpr size_t kSmem = kSmemTiles + sizeof(float) * 4 * kBlockM;
  static_assert(kBlockM % 16 == 0 && kBlockN % 16 == 0, "whole mma tiles");
  static_assert((kBlockM * DB / 8) % kThreads == 0 && (kBlockN * DB / 8) % kThreads == 0,
                "load_tile: whole rounds of 16-byte copies per thread");
  static_assert(kBlockM <= kThreads, "one thread per query row loads the tile's lse and delta");
  static_assert(kSmem <= 227 * 1024, "shared memory of one CTA on sm_90");
};

namespace pipelined {

// Rows [lo, hi) of the queries that see key j (the inverse of
// detail::visible_keys), clamped to int.
struct RowRange {
  int lo, hi;
};
__device__ __forceinline__ RowRange rows_seeing(int j, int shift, int left, int right) {
  const long long lo = right < 0 ? INT_MIN : static_cast<long long>(j) - shift - right;
  const long long hi = left < 0 ? INT_MAX : static_cast<long long>(j) - shift + left + 1;
  return RowRange{static_cast<int>(max(lo, static_cast<long long>(INT_MIN))),
                  static_cast<int>(min(hi, static_cast<long long>(INT_MAX)))};
}

// The query tiles (BM rows) a dK/dV CTA of keys [n0, n0 + cols) visits: from
// the tile of the first row that sees one of its keys to the last such row,
// m_tiles per query head of the group (n_tiles in all).
struct QueryTiles {
  int m_begin, m_tiles, n_tiles;
};
template <int BM>
__device__ __forceinline__ QueryTiles query_tiles(const KArgs& p, const Seq& seq, int n0, int cols) {
  const int shift = seq.sk - seq.sq;
  const int i_lo = p.win_right < 0 ? 0 : max(0, n0 - shift - p.win_right);
  const int i_hi = p.win_left < 0 ? seq.sq : min(seq.sq, n0 + cols - 1 - shift + p.win_left + 1);
  const int m_begin = i_lo / BM * BM;
  const int m_tiles = i_hi > i_lo ? (i_hi - m_begin + BM - 1) / BM : 0;
  return QueryTiles{m_begin, m_tiles, m_tiles * p.group};
}

// The walk's tile `it` as query tile m (of m_tiles) of head h of the kv
// group, advanced tile by tile: no division of `it` a tile.
struct TileCursor {
  int m, h;
  __device__ __forceinline__ TileCursor next(int m_tiles) const {
    return m + 1 < m_tiles ? TileCursor{m + 1, h} : TileCursor{0, h + 1};
  }
};

// Rows [0, cols) of dK and dV (row strides from p) set to zero: no query row
// sees those keys.
template <int DB, int NT, class E>
__device__ __forceinline__ void zero_key_rows(E* dk, E* dv, const KArgs& p, int cols) {
  constexpr int kChunks = DB / 8;
  for (int idx = threadIdx.x; idx < cols * kChunks; idx += NT) {
    const int r = idx / kChunks, c = idx % kChunks;
    *reinterpret_cast<uint4*>(dk + r * p.dk_sr + c * 8) = make_uint4(0, 0, 0, 0);
    *reinterpret_cast<uint4*>(dv + r * p.dv_sr + c * 8) = make_uint4(0, 0, 0, 0);
  }
}

}  // namespace pipelined

template <class T, int DB, int kRows, bool kFeatures, bool kDoDv, bool kDoDk>
__global__ void __launch_bounds__(PipelinedDkvConfig<DB, kRows>::kThreads)
    attention_bwd_dkdv_pipelined_kernel(const KArgs p) {
  using namespace pipelined;
  using C = PipelinedDkvConfig<DB, kRows>;
  constexpr int BM = C::kBlockM, BN = C::kBlockN, NT = C::kThreads;
  constexpr bool kKVReg = C::template kKVInRegisters<kFeatures>;
  constexpr float kLog2e = 1.4426950408889634f;
  static_assert(kDoDv || kDoDk, "a pass computes dV, dK or both");
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* sK = reinterpret_cast<T*>(smem_raw);
  T* sV = sK + BN * DB;
  T* sQ = sV + BN * DB;       // two buffers of BM x DB
  T* sdO = sQ + 2 * BM * DB;  // two buffers of BM x DB
  float* sLse = reinterpret_cast<float*>(smem_raw + C::kSmemTiles);  // two buffers of BM
  float* sDelta = sLse + 2 * BM;                                    // two buffers of BM

  const int n0 = blockIdx.x * BN, hk = blockIdx.y, b = blockIdx.z;
  const Seq seq = sequence(p, b);
  if (n0 >= seq.sk) return;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
  const int cols = min(BN, seq.sk - n0);
  // dbias comes with a bias (validate.cpp), so only with the features.
  const bool dbias_rows_summed = kFeatures && kDoDk && p.dbias && p.dbias_sq == 0;

  // Query rows that see at least one key of [n0, n0 + cols); the same for
  // every query head. Tiles: m_tiles per head, then the next head.
  const int shift = seq.sk - seq.sq;
  const pipelined::QueryTiles tiles = pipelined::query_tiles<BM>(p, seq, n0, cols);
  const int m_begin = tiles.m_begin, m_tiles = tiles.m_tiles, n_tiles = tiles.n_tiles;

  T* dk = static_cast<T*>(p.dk) + b * p.dk_sb + (seq.k0 + n0) * p.dk_sr + hk * p.dk_sh;
  T* dv = static_cast<T*>(p.dv) + b * p.dv_sb + (seq.k0 + n0) * p.dv_sr + hk * p.dv_sh;
  constexpr int kChunks = DB / 8;
  if (n_tiles == 0) {  // no query row sees these keys: zero gradients
    for (int idx = threadIdx.x; idx < cols * kChunks; idx += NT) {
      const int r = idx / kChunks, c = idx % kChunks;
      if (kDoDk) *reinterpret_cast<uint4*>(dk + r * p.dk_sr + c * 8) = make_uint4(0, 0, 0, 0);
      if (kDoDv) *reinterpret_cast<uint4*>(dv + r * p.dv_sr + c * 8) = make_uint4(0, 0, 0, 0);
    }
    if (dbias_rows_summed) zero_dbias_row_sums(p, b, hk, n0, cols, threadIdx.x, NT);
    return;
  }

  auto tile_head = [&](int it) { return hk * p.group + it / m_tiles; };
  auto tile_row0 = [&](int it) { return m_begin + (it % m_tiles) * BM; };
  // Loads tile `it`'s Q and dO rows into buffer `buf` (cp.async, not committed).
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
  // +inf where the row is past the end or sees no key (its probabilities are
  // then 0), and delta.
  auto read_stats = [&](int it, float* lse2, float* delta) {
    const int hq = tile_head(it), i = tile_row0(it) + static_cast<int>(threadIdx.x);
    *lse2 = INFINITY;
    *delta = 0.0f;
    if (i < seq.sq) {
      const float x = p.lse[b * p.lse_sb + hq * p.lse_sh + seq.q0 + i];
      if (x != -INFINITY) *lse2 = x * kLog2e;
      if (kDoDk) *delta = p.delta[b * p.delta_sb + hq * p.delta_sh + seq.q0 + i];
    }
  };

  // Prologue: K and V of the block and the first Q/dO tile, one group.
  load_tile<T, BN, DB, NT>(sK, static_cast<const T*>(p.k) + b * p.k_sb + (seq.k0 + n0) * p.k_sr + hk * p.k_sh,
                           p.k_sr, cols);
  if (kDoDk)
    load_tile<T, BN, DB, NT>(sV, static_cast<const T*>(p.v) + b * p.v_sb + (seq.k0 + n0) * p.v_sr + hk * p.v_sh,
                             p.v_sr, cols);
  load_q_do(0, 0);
  cp_async_commit();
  if (threadIdx.x < BM) read_stats(0, &sLse[threadIdx.x], &sDelta[threadIdx.x]);

  // This thread's keys: j0 and j0 + 8; the query rows that see each (used
  // without logit features), and the rows for which a whole tile sees every
  // key of the block.
  const int j0 = n0 + warp * 16 + g;
  const RowRange sees[2] = {rows_seeing(j0, shift, p.win_left, p.win_right),
                            rows_seeing(j0 + 8, shift, p.win_left, p.win_right)};
  const int full_lo = rows_seeing(n0 + BN - 1, shift, p.win_left, p.win_right).lo;
  const int full_hi = rows_seeing(n0, shift, p.win_left, p.win_right).hi;
  const float scale_log2 = p.scale * kLog2e;

  // ldmatrix lane addresses: A fragments of this warp's K/V rows; B fragments
  // of Q/dO rows (S^T = K Q^T, dP^T = V dO^T); B fragments of Q/dO through
  // .trans (dK += dS^T Q, dV += P^T dO).
  const int a_row = warp * 16 + (lane & 7) + ((lane >> 3) & 1) * 8, a_chunk = lane >> 4;
  const int b_row = (lane & 7) + (lane >> 4) * 8, b_chunk = (lane >> 3) & 1;
  const int bt_row = (lane & 7) + ((lane >> 3) & 1) * 8, bt_chunk = lane >> 4;

  float acc_dv[kDoDv ? DB / 8 : 1][4], acc_dk[kDoDk ? DB / 8 : 1][4];
#pragma unroll
  for (int dt = 0; dt < (kDoDv ? DB / 8 : 1); ++dt)
    acc_dv[dt][0] = acc_dv[dt][1] = acc_dv[dt][2] = acc_dv[dt][3] = 0.0f;
#pragma unroll
  for (int dt = 0; dt < (kDoDk ? DB / 8 : 1); ++dt)
    acc_dk[dt][0] = acc_dk[dt][1] = acc_dk[dt][2] = acc_dk[dt][3] = 0.0f;
  uint32_t kreg[kKVReg ? DB / 16 : 1][4], vreg[kKVReg && kDoDk ? DB / 16 : 1][4];
  float dbias_sum[2] = {0.0f, 0.0f};  // bias broadcast over query rows: this head's sums

  for (int it = 0; it < n_tiles; ++it) {
    const int buf = it & 1;
    const T* sQb = sQ + buf * BM * DB;
    const T* sdOb = sdO + buf * BM * DB;
    const float* lse2 = sLse + buf * BM;
    const float* delta = sDelta + buf * BM;
    cp_async_wait<0>();  // tile `it` (and K, V) has landed
    __syncthreads();     // ... for every thread; and tile it-1 is consumed
    const bool has_next = it + 1 < n_tiles;
    float next_lse2 = INFINITY, next_delta = 0.0f;
    if (has_next) {
      load_q_do(it + 1, buf ^ 1);
      if (threadIdx.x < BM) read_stats(it + 1, &next_lse2, &next_delta);
    }
    cp_async_commit();  // possibly empty: keeps the group count uniform
    if constexpr (kKVReg) {
      if (it == 0) {
#pragma unroll
        for (int kk = 0; kk < DB / 16; ++kk) {
          ldsm_x4(kreg[kk], smem_addr(sK + swizzle<DB>(a_row, 2 * kk + a_chunk)));
          if constexpr (kDoDk) ldsm_x4(vreg[kk], smem_addr(sV + swizzle<DB>(a_row, 2 * kk + a_chunk)));
        }
      }
    }
    const int hq = tile_head(it), m0 = tile_row0(it);

    // S^T = K Q^T and (for dK) dP^T = V dO^T: this warp's 16 keys x BM rows.
    float s[BM / 8][4], dp[kDoDk ? BM / 8 : 1][4];
#pragma unroll
    for (int nt = 0; nt < BM / 8; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
#pragma unroll
    for (int nt = 0; nt < (kDoDk ? BM / 8 : 1); ++nt) dp[nt][0] = dp[nt][1] = dp[nt][2] = dp[nt][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < DB / 16; ++kk) {
      uint32_t ak_s[4], av_s[4];
      const uint32_t* ak = ak_s;
      const uint32_t* av = av_s;
      if constexpr (kKVReg) {
        ak = kreg[kk];
        if constexpr (kDoDk) av = vreg[kk];
      } else {
        ldsm_x4(ak_s, smem_addr(sK + swizzle<DB>(a_row, 2 * kk + a_chunk)));
        if constexpr (kDoDk) ldsm_x4(av_s, smem_addr(sV + swizzle<DB>(a_row, 2 * kk + a_chunk)));
      }
#pragma unroll
      for (int np = 0; np < BM / 16; ++np) {
        uint32_t qf[4];
        ldsm_x4(qf, smem_addr(sQb + swizzle<DB>(np * 16 + b_row, 2 * kk + b_chunk)));
        mma<T>(s[2 * np], ak, qf);
        mma<T>(s[2 * np + 1], ak, qf + 2);
        if constexpr (kDoDk) {
          uint32_t of[4];
          ldsm_x4(of, smem_addr(sdOb + swizzle<DB>(np * 16 + b_row, 2 * kk + b_chunk)));
          mma<T>(dp[2 * np], av, of);
          mma<T>(dp[2 * np + 1], av, of + 2);
        }
      }
    }

    // P (dropped out, for dV) and dS = P * (dP * keep - delta), times
    // d logit / d (scale q.k) and scale (for dK). Element e of tile nt:
    // key j0 + 8 (e >> 1), query row m0 + 8 nt + 2 t + (e & 1).
    const bool full = m0 >= full_lo && m0 + BM <= full_hi;
    const LogitCtx logit(p, b, hq, seq);
    const DbiasSink dbias(p, b, hq, seq);
    const uint32_t bh = static_cast<uint32_t>(b * p.heads_q + hq);
#pragma unroll
    for (int nt = 0; nt < BM / 8; ++nt) {
      const int c = nt * 8 + 2 * t;
      const float2 l2 = *reinterpret_cast<const float2*>(lse2 + c);
      const float2 dl = *reinterpret_cast<const float2*>(delta + c);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int h = e >> 1, j = j0 + 8 * h, i = m0 + c + (e & 1);
        float x2, dcap = 1.0f, keep = 1.0f;
        if constexpr (kFeatures) {
          x2 = logit(p, s[nt][e], i, j, &dcap) * kLog2e;
          if (p.dropout) keep = dropout_keep(p, dropout_octet(p, bh, i, j), j);
        } else {
          x2 = full || (i >= sees[h].lo && i < sees[h].hi) ? s[nt][e] * scale_log2 : -INFINITY;
        }
        const float pr = exp2_fast(x2 - ((e & 1) ? l2.y : l2.x));
        s[nt][e] = pr * keep;
        if constexpr (kDoDk)
          dp[nt][e] = score_grad<kFeatures>(p, pr, dp[nt][e], keep, (e & 1) ? dl.y : dl.x, dcap, dbias, i,
                                            j, &dbias_sum[h]);
      }
    }

    // dV += P^T dO and dK += dS^T Q, P^T and dS^T straight from the score
    // registers, dO and Q through ldmatrix.trans.
#pragma unroll
    for (int kk = 0; kk < BM / 16; ++kk) {
      if constexpr (kDoDv) {
        uint32_t a[4];
        c_to_a<T>(a, s[2 * kk], s[2 * kk + 1]);
#pragma unroll
        for (int d2 = 0; d2 < DB / 16; ++d2) {
          uint32_t of[4];
          ldsm_x4_trans(of, smem_addr(sdOb + swizzle<DB>(kk * 16 + bt_row, 2 * d2 + bt_chunk)));
          mma<T>(acc_dv[2 * d2], a, of);
          mma<T>(acc_dv[2 * d2 + 1], a, of + 2);
        }
      }
      if constexpr (kDoDk) {
        uint32_t a[4];
        c_to_a<T>(a, dp[2 * kk], dp[2 * kk + 1]);
#pragma unroll
        for (int d2 = 0; d2 < DB / 16; ++d2) {
          uint32_t qf[4];
          ldsm_x4_trans(qf, smem_addr(sQb + swizzle<DB>(kk * 16 + bt_row, 2 * d2 + bt_chunk)));
          mma<T>(acc_dk[2 * d2], a, qf);
          mma<T>(acc_dk[2 * d2 + 1], a, qf + 2);
        }
      }
    }

    // The next tile's statistics (buffer buf ^ 1 was consumed before this
    // iteration's barrier; the next barrier publishes them).
    if (has_next && threadIdx.x < BM) {
      sLse[(buf ^ 1) * BM + threadIdx.x] = next_lse2;
      sDelta[(buf ^ 1) * BM + threadIdx.x] = next_delta;
    }
    // The last tile of a head: its row sums of dS (uniform over the CTA).
    if (dbias_rows_summed && (it + 1) % m_tiles == 0) dbias.write_row_sums(dbias_sum, j0, t);
  }
  cp_async_wait<0>();

  // Each warp reads only its own rows of sK and sV (the A fragments); other
  // threads' copies into them were ordered by the loop's first barrier. Stage
  // the results there, swizzled, and write them out with 16-byte stores.
  __syncwarp();
  const int warp_rows = min(16, cols - warp * 16);
  auto store = [&](T* s_stage, const float (*acc)[4], T* out, int64_t row_stride) {
    const int r = warp * 16 + g;
#pragma unroll
    for (int dt = 0; dt < DB / 8; ++dt) {
      *reinterpret_cast<uint32_t*>(s_stage + swizzle<DB>(r, dt) + 2 * t) = Pack<T>::two(acc[dt][0], acc[dt][1]);
      *reinterpret_cast<uint32_t*>(s_stage + swizzle<DB>(r + 8, dt) + 2 * t) =
          Pack<T>::two(acc[dt][2], acc[dt][3]);
    }
    __syncwarp();
    if (warp_rows > 0) {
#pragma unroll
      for (int k2 = 0; k2 < 16 * kChunks / 32; ++k2) {
        const int idx = lane + k2 * 32, rr = idx / kChunks, cc = idx % kChunks;
        if (rr < warp_rows)
          *reinterpret_cast<uint4*>(out + (warp * 16 + rr) * row_stride + cc * 8) =
              *reinterpret_cast<const uint4*>(s_stage + swizzle<DB>(warp * 16 + rr, cc));
      }
    }
  };
  if constexpr (kDoDk) store(sK, acc_dk, dk, p.dk_sr);
  if constexpr (kDoDv) store(sV, acc_dv, dv, p.dv_sr);
}

}  // namespace symheap::attention::cuda
