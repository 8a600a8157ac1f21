// Hopper dK/dV kernel at head dim 256, dQ fused or from the pipelined dQ
// kernel (sm_90a; batch layout; the logit features with dQ fused). At 256 the
// head-dim-128 kernel's split (each warpgroup 64
// keys with all of dK and dV) would hold 256 fp32 accumulators a thread, so
// the warpgroups split the other way: one CTA per 64 keys of one (batch
// entry, kv head), and per 64-row query tile
//   S^T, dP^T:  each warpgroup the tile's 64 keys x its 32 query rows
//               (64 x 32 x 256 products), then P and dS for those;
//   P^T, dS^T:  both halves to shared memory (one barrier of the two);
//   dV, dK:     each warpgroup the 64 keys x its 128 of the 256 columns,
//               P^T dO and dS^T Q, both operands in shared memory;
//   dQ:         (kFuseDq) each warpgroup the 64 rows x its 128 columns, dS K,
//               staged over the Q/dO buffer's columns its dK and dV read,
//               added to the fp32 workspace by a producer warp's bulk
//               reductions (see the kernel).
// A third warpgroup feeds K and V once and the Q/dO tiles into two buffers
// by TMA, as in the head-dim-128 kernel (cuda_backward_hopper.cuh), whose
// rules it follows: P from the forward's lse, dS = P (dP - delta) scale.
// Shared memory: K, V 32 KiB each, Q, dO 2 x 32 KiB each, P^T and dS 8 KiB
// each: 208 KiB. The default backward at 256 is the form with dQ
// (kHopperBackwardDefaults); deterministic calls take the one without.
#pragma once
#include "ops/attention/cuda_backward_hopper.cuh"

namespace symheap::attention::cuda {

template <class T>
struct HopperDkv256Config : HopperDkvTiles<typename hopper::CuteType<T>::type, 64, 64, 256> {
  using Tiles = HopperDkvTiles<typename hopper::CuteType<T>::type, 64, 64, 256>;
  static constexpr int DB = 256;
  using E = typename hopper::CuteType<T>::type;
  static constexpr int kBlockN = 64;  // keys per CTA
  static constexpr int kBlockM = 64;  // query rows per tile
  static constexpr int kThreads = 256;  // the consumers

  using BN = cute::Int<kBlockN>;
  using BM = cute::Int<kBlockM>;
  using D = cute::Int<DB>;
  using K = cute::GMMA::Major;
  // Both warpgroups side by side along N (the second mode of the products).
  using SideBySide = cute::Layout<cute::Shape<cute::_1, cute::_2, cute::_1>>;
  // S^T, dP^T (BN x BM) = K, V (BN x DB) times Q^T, dO^T; 32 rows a warpgroup.
  using MmaSdP = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<E, E, float, cute::Shape<cute::_64, cute::_32, D>>(), SideBySide{}));
  // dV, dK (BN x DB) += P^T, dS^T (shared memory, BN x BM, K-major) times dO,
  // Q (MN-major as the B operand DB x BM); 128 columns a warpgroup.
  using MmaDkv = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<E, E, float, cute::Shape<cute::_64, cute::_128, BM>, K::K, K::MN>(),
      SideBySide{}));
  // dQ (BM x DB) = dS (BM x BN, MN-major as A) times K (MN-major as the B
  // operand DB x BN): 64-column atoms (an MN-major operand in the 128-byte
  // swizzle spans whole 64-element rows), the warpgroups taking them in turn.
  using MmaDq = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<E, E, float, cute::Shape<cute::_64, cute::_64, BN>, K::MN, K::MN>(),
      SideBySide{}));

  // K, V, Q, dO, P, dS (P and dS in the layout of dS: P^T and dS^T are the
  // K-major A operands of dV and dK); + lse and delta (two buffers of BM
  // floats each), (kFeatures) the second warpgroup's per-key sums of a bias
  // gradient summed over the query rows (BN floats), five mbarriers and 1024
  // for the alignment.
  static constexpr size_t kSmemTiles =
      sizeof(E) * (2 * Tiles::kKVElems + 2 * Tiles::kQElems + 2 * Tiles::kDsElems);
  static constexpr int stat_floats(bool features) { return 4 * kBlockM + (features ? kBlockN : 0); }
  static constexpr size_t smem(bool features) {
    return kSmemTiles + stat_floats(features) * sizeof(float) + 5 * sizeof(uint64_t) + 1024;
  }
  static constexpr size_t kSmem = smem(false);
  static_assert(smem(true) <= 227 * 1024, "shared memory of a CTA");
  static_assert(sizeof(E) * Tiles::kKVElems == kBlockN * DB * 2, "a K/V tile holds a staged dK or dV");
};

// This thread's place in the fragments (tests/cpp/hopper_layout_tests.cu
// checks each against CuTe's partition). Warp w of warpgroup wg, lane = 4 g + t:
//   S^T, dP^T element i (16): key 16 (w % 4) + g + 8 ((i >> 1) & 1),
//     query row 32 wg + 8 (i >> 2) + 2 t + (i & 1);
//   dV, dK element i (64): the same key, column 128 wg + 8 (i >> 2) + 2 t + (i & 1);
//   dQ element i (64): query row 16 (w % 4) + g + 8 ((i >> 1) & 1), column
//     128 (i / 32) + 64 wg + 8 ((i % 32) >> 2) + 2 t + (i & 1).
namespace hopper256 {
__host__ __device__ __forceinline__ int key_of(int tid, int i) { return ((tid / 32) % 4) * 16 + (tid % 32) / 4 + 8 * ((i >> 1) & 1); }
__host__ __device__ __forceinline__ int s_row_of(int tid, int i) { return 32 * (tid / 128) + 8 * (i >> 2) + 2 * (tid % 4) + (i & 1); }
__host__ __device__ __forceinline__ int kv_col_of(int tid, int i) { return 128 * (tid / 128) + 8 * (i >> 2) + 2 * (tid % 4) + (i & 1); }
__host__ __device__ __forceinline__ int dq_col_of(int tid, int i) {
  return 128 * (i / 32) + 64 * (tid / 128) + 8 * ((i % 32) >> 2) + 2 * (tid % 4) + (i & 1);
}
}  // namespace hopper256

// kFuseDq: dQ here; else the pipelined dQ kernel computes it (no atomics:
// deterministic calls take that form). There is no room for a dQ staging tile
// (64 KiB): each warpgroup stages its dQ over the columns of the tile's Q and
// dO buffer that its own dK and dV products read (64 rows x 128 columns of
// each, 32 KiB, the place of 64 dQ columns in fp32), and a producer warp adds
// the tile to the fp32 workspace by bulk reductions (32-column boxes in the
// 128-byte swizzle: the head-dim-128 kernel's staging layout, a half of the
// columns in each buffer), then releases the buffer to the producer. (Added
// by per-thread fp32 atomics, dQ took four tenths of the kernel's stall
// samples, the L2 at 71% of its throughput.)
// kFeatures (with kFuseDq): the logit features as the head-dim-128 kernel
// applies them (fragment_log2 over a thread's S^T fragment, dropout's verdict
// as P's sign, softcap's derivative in half precision, DbiasSink); a bias
// gradient summed over the query rows adds the two warpgroups' per-key sums
// (each holds 32 of a tile's rows) through shared memory.
template <class T, bool kFuseDq, bool kFeatures = false>
__global__ void __launch_bounds__(384, 1)
    attention_bwd_dkdv_hopper256_kernel(const KArgs p, const __grid_constant__ BwdTmaMaps maps) {
  static_assert(!kFeatures || kFuseDq, "the logit features in the form with dQ fused");
  using namespace cute;
  using namespace hopper;
  using namespace hopper256;
  using pipelined::RowRange;
  using pipelined::rows_seeing;
  using C = HopperDkv256Config<T>;
  using E = typename C::E;
  constexpr int BM = C::kBlockM, BN = C::kBlockN, NT = C::kThreads, DB = C::DB;
  constexpr float kLog2e = 1.4426950408889634f;
  extern __shared__ unsigned char smem_raw[];
  unsigned char* base = smem_raw + ((1024 - smem_addr(smem_raw) % 1024) % 1024);
  E* k_s = reinterpret_cast<E*>(base);
  E* v_s = k_s + C::kKVElems;
  E* q_s = v_s + C::kKVElems;
  E* do_s = q_s + C::kQElems;
  E* p_s = do_s + C::kQElems;
  E* ds_s = p_s + C::kDsElems;
  float* s_lse = reinterpret_cast<float*>(base + C::kSmemTiles);  // two buffers of BM
  float* s_delta = s_lse + 2 * BM;                                // two buffers of BM
  float* s_dbias = s_delta + 2 * BM;  // (kFeatures) BN floats
  // K and V landed; Q/dO buffer landed (full) and released (empty).
  uint64_t* kv_full = reinterpret_cast<uint64_t*>(base + C::kSmemTiles + C::stat_floats(kFeatures) * sizeof(float));
  uint64_t* full = kv_full + 1;
  uint64_t* empty = full + 2;
  Tensor sK = make_tensor(make_smem_ptr(k_s), typename C::SmemKV{});
  Tensor sV = make_tensor(make_smem_ptr(v_s), typename C::SmemKV{});
  Tensor sKt = make_tensor(make_smem_ptr(k_s), typename C::SmemKt{});
  Tensor sQ = make_tensor(make_smem_ptr(q_s), typename C::SmemQ{});
  Tensor sdO = make_tensor(make_smem_ptr(do_s), typename C::SmemQ{});
  Tensor sQt = make_tensor(make_smem_ptr(q_s), typename C::SmemQt{});
  Tensor sdOt = make_tensor(make_smem_ptr(do_s), typename C::SmemQt{});
  Tensor sPt = make_tensor(make_smem_ptr(p_s), typename C::SmemDst{});
  Tensor sdS = make_tensor(make_smem_ptr(ds_s), typename C::SmemDs{});
  Tensor sdSt = make_tensor(make_smem_ptr(ds_s), typename C::SmemDst{});

  const KeyBlockCta cta = key_block_cta();  // heaviest key blocks first under a causal mask
  const int n0 = cta.n_block * BN, hk = cta.hk, b = cta.b;
  const Seq seq = sequence(p, b);
  if (n0 >= seq.sk) return;
  const int cols = min(BN, seq.sk - n0);
  const int shift = seq.sk - seq.sq;
  const pipelined::QueryTiles tiles = pipelined::query_tiles<BM>(p, seq, n0, cols);
  const int m_begin = tiles.m_begin, m_tiles = tiles.m_tiles, n_tiles = tiles.n_tiles;
  E* dk = static_cast<E*>(p.dk) + b * p.dk_sb + (seq.k0 + n0) * p.dk_sr + hk * p.dk_sh;
  E* dv = static_cast<E*>(p.dv) + b * p.dv_sb + (seq.k0 + n0) * p.dv_sr + hk * p.dv_sh;
  if (n_tiles == 0) {  // no row sees these keys
    if constexpr (kFeatures) zero_dbias_row_sums(p, b, hk, n0, cols, threadIdx.x, 384);
    return pipelined::zero_key_rows<DB, 384>(dk, dv, p, cols);
  }

  auto tile_head = [&](int it) { return hk * p.group + it / m_tiles; };
  auto tile_row0 = [&](int it) { return m_begin + (it % m_tiles) * BM; };

  // Tile `it`'s dQ staged over Q/dO buffer it % 2 (kFuseDq): half h of the
  // columns (128 h .. 128 h + 127) over the Q (h = 0) or dO (h = 1) buffer, in
  // the head-dim-128 kernel's staging layout (C128::dq_stage_index).
  using C128 = HopperDkvConfig<T, 128>;
  static_assert(C128::kBlockM == BM && C::kQElems == 2 * BM * DB && BM * 128 * sizeof(float) == BM * DB * sizeof(E),
                "a dQ half in fp32 fills a Q/dO buffer");
  auto dq_half = [&](int buf, int h) {
    return reinterpret_cast<float*>((h == 0 ? q_s : do_s) + buf * BM * DB);
  };
  constexpr int kDqBarrierThreads = NT + 32, kDqFullBarrier = 4;  // (ids 4 and 5)
  // The consumer warps release a buffer, or (kFuseDq) the dQ warp once the
  // unit has read the dQ staged over it.
  init_tile_barriers(kv_full, full, empty, kFuseDq ? 1 : NT / 32);
  if (threadIdx.x < 128) {  // the producer warpgroup
    registers_down<24>();
    if (threadIdx.x == 0)
      produce_tiles<BN, BM, DB, E>(maps, sK, sV, sQ, sdO, kv_full, full, empty, n0, hk, b, n_tiles, tile_row0,
                                   tile_head);
    if constexpr (kFuseDq) {
      if (threadIdx.x / 32 == 1) {  // the dQ warp
        for (int it = 0; it < n_tiles; ++it) {
          const int buf = it & 1;
          bar_sync<kDqBarrierThreads>(kDqFullBarrier + buf);
          if (threadIdx.x == 32) {
#pragma unroll
            for (int box = 0; box < DB / C128::kDqBoxCols; ++box)
              tma_reduce_add_4d(&maps.dq_accum, dq_half(buf, box / 4) + (box % 4) * BM * C128::kDqBoxCols,
                                box * C128::kDqBoxCols, tile_row0(it), tile_head(it), b);
            bulk_wait_all<true>();  // the unit has read the buffer
            mbar_arrive(empty + buf);
          }
          __syncwarp();
        }
        if (threadIdx.x == 32) bulk_wait_all<false>();  // every reduction done before the CTA ends
      }
    }
    return;
  }
  registers_up<240>();
  const int tid = static_cast<int>(threadIdx.x) - 128, lane = tid % 32;

  // The statistics of query row `tid` of tile `it` (threads < BM).
  auto read_stats = [&](int it, float* lse2, float* delta) {
    row_stats(p, seq, b, tile_head(it), tile_row0(it) + tid, lse2, delta);
  };
  auto consumers_sync = [] { asm volatile("bar.sync 3, 256;\n" ::: "memory"); };
  if (tid < BM) read_stats(0, &s_lse[tid], &s_delta[tid]);

  typename C::MmaSdP mma_sdp;
  typename C::MmaDkv mma_dkv;
  typename C::MmaDq mma_dq;
  const int wg0 = warpgroup_first_thread(tid);  // (descriptors in uniform registers)
  auto thr_sdp = mma_sdp.get_thread_slice(wg0);
  auto thr_dkv = mma_dkv.get_thread_slice(wg0);
  auto thr_dq = mma_dq.get_thread_slice(wg0);
  Tensor tSrK = thr_sdp.partition_fragment_A(sK);      // (MMA, 1, DB / 16)
  Tensor tSrV = thr_sdp.partition_fragment_A(sV);
  Tensor tSrQ = thr_sdp.partition_fragment_B(sQ);      // (MMA, 1, DB / 16, 2)
  Tensor tSrdO = thr_sdp.partition_fragment_B(sdO);
  Tensor tDrPt = thr_dkv.partition_fragment_A(sPt);    // (MMA, 1, BM / 16)
  Tensor tDrdSt = thr_dkv.partition_fragment_A(sdSt);
  Tensor tDrdOt = thr_dkv.partition_fragment_B(sdOt);  // (MMA, 2?, BM / 16, 2)
  Tensor tDrQt = thr_dkv.partition_fragment_B(sQt);
  Tensor tQrdS = thr_dq.partition_fragment_A(sdS);     // (MMA, 1, BN / 16)
  Tensor tQrKt = thr_dq.partition_fragment_B(sKt);
  Tensor tSrS = partition_fragment_C(mma_sdp, Shape<Int<BN>, Int<BM>>{});
  Tensor tSrdP = partition_fragment_C(mma_sdp, Shape<Int<BN>, Int<BM>>{});
  Tensor tDrdV = partition_fragment_C(mma_dkv, Shape<Int<BN>, Int<DB>>{});
  Tensor tDrdK = partition_fragment_C(mma_dkv, Shape<Int<BN>, Int<DB>>{});
  Tensor tQrdQ = partition_fragment_C(mma_dq, Shape<Int<BM>, Int<DB>>{});
  static_assert(size(decltype(tSrS){}) == 16 && size(decltype(tDrdV){}) == 64 && size(decltype(tQrdQ){}) == 64,
                "the per-thread shares of the warpgroup tiles");
  clear(tDrdV);
  clear(tDrdK);

  // The query rows that see this thread's two keys, and those for which a
  // whole tile sees every key of the block.
  const RowRange sees[2] = {rows_seeing(n0 + key_of(tid, 0), shift, p.win_left, p.win_right),
                            rows_seeing(n0 + key_of(tid, 2), shift, p.win_left, p.win_right)};
  const int full_lo = rows_seeing(n0 + BN - 1, shift, p.win_left, p.win_right).lo;
  const int full_hi = rows_seeing(n0, shift, p.win_left, p.win_right).hi;
  const float scale_log2 = p.scale * kLog2e;
  // This lane's P^T / dS^T stmatrix addresses, group 0 (ds_stmatrix_offset):
  // keys from 16 (w % 4), query rows from 32 wg (chunks of 8 from 4 wg).
  const int key0 = key_of(tid, 0) - (lane >> 2);
  const uint32_t p_addr = smem_addr(p_s) + ds_stmatrix_offset(lane, key0, 4 * (tid / 128));
  const uint32_t ds_addr = smem_addr(ds_s) + ds_stmatrix_offset(lane, key0, 4 * (tid / 128));
  float dbias_sum[2] = {0.0f, 0.0f};  // kFeatures, bias broadcast over query rows: this head's sums

  pipelined::TileCursor cur{0, 0};
  for (int it = 0; it < n_tiles; ++it) {
    const int buf = uniform_int(it & 1);  // (the Q/dO descriptors in uniform registers)
    const int m0 = m_begin + cur.m * BM;
    const pipelined::TileCursor next = cur.next(m_tiles);
    if (it == 0) mbar_wait(kv_full, 0);
    mbar_wait(full + buf, (it >> 1) & 1);  // tile `it` landed
    // Every thread: tile it - 1's P^T, dS^T and dS are consumed (their
    // products waited for), this tile's statistics published.
    consumers_sync();
    const bool has_next = it + 1 < n_tiles;
    float next_lse2 = INFINITY, next_delta = 0.0f;
    if (has_next && tid < BM)
      row_stats(p, seq, b, hk * p.group + next.h, m_begin + next.m * BM + tid, &next_lse2, &next_delta);
    const float* lse2 = s_lse + buf * BM;
    const float* delta = s_delta + buf * BM;

    // S^T and dP^T (this warpgroup's 32 rows): P is computed while dP^T's
    // product runs.
    issue_s_dp(mma_sdp, tSrK, tSrQ, tSrV, tSrdO, buf, tSrS, tSrdP);

    // P; rows past the sequence have lse +inf: P = 0. A tile whose every
    // row sees every key of the block takes the branch without the mask.
    auto softmax_p = [&](auto masked) {
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        const int r = s_row_of(tid, i), i_row = m0 + r;
        float x2 = fmaf(tSrS(i), scale_log2, -lse2[r]);
        if constexpr (decltype(masked)::value) {
          const RowRange& s = sees[(i >> 1) & 1];
          x2 = (i_row >= s.lo) & (i_row < s.hi) ? x2 : -INFINITY;
        }
        tSrS(i) = exp2_fast(x2);
      }
    };
    // (kFeatures) Element i of S^T: query row row_of(i), key col_of(i);
    // softcap's derivative there: half i % 2 of dcap2[i / 2].
    const int hq = hk * p.group + cur.h;
    auto row_of = [&](int i) { return m0 + s_row_of(tid, i); };
    auto col_of = [&](int i) { return n0 + key_of(tid, i); };
    __half2 dcap2[kFeatures ? 8 : 1];
    uint32_t p_two[8], ds_two[8];
    if constexpr (kFeatures) {
      // The logit rule (window, mask and sequence ends too), in log2 units.
      const LogitCtx logit(p, b, hq, seq);
      const bool full = m0 >= full_lo && m0 + BM <= full_hi && m0 + BM <= seq.sq && cols == BN;
      logit.fragment_log2<16>(
          p, [&](int i) -> float& { return tSrS(i); }, row_of, col_of, false, full,
          [&](int i, float d) { set_half_dcap(dcap2, i, d); });
#pragma unroll
      for (int i = 0; i < 16; ++i) tSrS(i) = exp2_fast(tSrS(i) - lse2[s_row_of(tid, i)]);
      // P^T for dV dropped out; dS (below) takes P and the dropout's verdict (the sign).
      if (p.dropout) {
        const uint32_t bh = static_cast<uint32_t>(b * p.heads_q + hq);
#pragma unroll
        for (int nt = 0; nt < 4; nt += 2) {
          float keep[8];  // element 4 nt + e
          dropout_keep_cols(p, bh, row_of(4 * nt), col_of(0), lane, keep);
          float dropped[8];
#pragma unroll
          for (int e = 0; e < 8; ++e) dropped[e] = dropout_code(tSrS(4 * nt + e), keep[e]);
#pragma unroll
          for (int q = 0; q < 4; ++q) p_two[2 * nt + q] = Pack<T>::two(dropped[2 * q], dropped[2 * q + 1]);
        }
      } else {
#pragma unroll
        for (int i = 0; i < 16; i += 2) p_two[i / 2] = Pack<T>::two(tSrS(i), tSrS(i + 1));
      }
      warpgroup_wait<0>();  // dP^T landed
      warpgroup_fence_operand(tSrdP);
      // ds = P (dP keep - delta), the bias gradient, then ds dcap scale.
      if (p.dropout)
        dropout_decode<16>(p, [&](int i) -> float& { return tSrS(i); }, [&](int i) -> float& { return tSrdP(i); });
#pragma unroll
      for (int i = 0; i < 16; i += 2) {
        const float2 dl = *reinterpret_cast<const float2*>(delta + s_row_of(tid, i));
        tSrdP(i) = tSrS(i) * (tSrdP(i) - dl.x);
        tSrdP(i + 1) = tSrS(i + 1) * (tSrdP(i + 1) - dl.y);
      }
      const DbiasSink dbias(p, b, hq, seq);
      if (dbias.summed_rows()) {
#pragma unroll
        for (int i = 0; i < 16; ++i) dbias_sum[(i >> 1) & 1] += tSrdP(i);
        // The last tile of a head (uniform over the CTA): the second
        // warpgroup's quad sums go to shared memory, the first adds them to
        // its own (after the barrier below) and writes.
        if (cur.m + 1 == m_tiles && tid >= 128) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const float sum = quad_sum(dbias_sum[h]);
            if (lane % 4 == 0) s_dbias[key_of(tid, 2 * h)] = sum;
            dbias_sum[h] = 0.0f;
          }
        }
      } else if (dbias.at) {
#pragma unroll
        for (int i = 0; i < 16; ++i) dbias.store(tSrdP(i), row_of(i), col_of(i));
      }
      if (p.softcap > 0) {
#pragma unroll
        for (int i = 0; i < 16; ++i) tSrdP(i) *= half_dcap(dcap2, i);
      }
#pragma unroll
      for (int i = 0; i < 16; i += 2)
        ds_two[i / 2] = Pack<T>::two(tSrdP(i) * p.scale, tSrdP(i + 1) * p.scale);
    } else {
      if (m0 >= full_lo && m0 + BM <= full_hi) softmax_p(std::false_type{});
      else softmax_p(std::true_type{});
      warpgroup_wait<0>();  // dP^T landed
      warpgroup_fence_operand(tSrdP);
      // dS = P (dP - delta) scale; P^T and dS^T into shared memory, two
      // stmatrix groups each (ds_stmatrix_offset).
#pragma unroll
      for (int i = 0; i < 16; i += 2) {
        const float2 dl = *reinterpret_cast<const float2*>(delta + s_row_of(tid, i));
        p_two[i / 2] = Pack<T>::two(tSrS(i), tSrS(i + 1));
        ds_two[i / 2] =
            Pack<T>::two(tSrS(i) * (tSrdP(i) - dl.x) * p.scale, tSrS(i + 1) * (tSrdP(i + 1) - dl.y) * p.scale);
      }
    }
#pragma unroll
    for (int nt = 0; nt < 4; nt += 2) {
      stmatrix_x4(p_addr ^ (nt << 4), p_two[2 * nt], p_two[2 * nt + 1], p_two[2 * nt + 2], p_two[2 * nt + 3]);
      stmatrix_x4(ds_addr ^ (nt << 4), ds_two[2 * nt], ds_two[2 * nt + 1], ds_two[2 * nt + 2], ds_two[2 * nt + 3]);
    }
    fence_async_shared();
    consumers_sync();  // both warpgroups' halves of P^T and dS^T in place
    if constexpr (kFeatures) {
      if (cur.m + 1 == m_tiles && tid < 128 && p.dbias && p.dbias_sq == 0) {
        // One lane a quad adds the second warpgroup's sum of its key.
        if (lane % 4 == 0) {
#pragma unroll
          for (int h = 0; h < 2; ++h) dbias_sum[h] += s_dbias[key_of(tid, 2 * h)];
        }
        DbiasSink(p, b, hq, seq).write_row_sums(dbias_sum, n0 + key_of(tid, 0), lane % 4);
      }
    }

    // dV += P^T dO and dK += dS^T Q (this warpgroup's 128 columns).
    warpgroup_fence_operand(tDrdV);
    warpgroup_fence_operand(tDrdK);
    warpgroup_arrive();
    CUTE_UNROLL
    for (int kb = 0; kb < size<2>(tDrPt); ++kb) gemm(mma_dkv, tDrPt(_, _, kb), tDrdOt(_, _, kb, buf), tDrdV);
    CUTE_UNROLL
    for (int kb = 0; kb < size<2>(tDrdSt); ++kb) gemm(mma_dkv, tDrdSt(_, _, kb), tDrQt(_, _, kb, buf), tDrdK);
    warpgroup_commit_batch();
    // dQ = dS K (this warpgroup's 128 columns) behind them.
    if constexpr (kFuseDq) {
      warpgroup_gemm<true, false>(mma_dq, tQrdS, tQrKt, tQrdQ);  // waits for every group
    } else {
      warpgroup_wait<0>();
    }
    warpgroup_fence_operand(tDrdV);
    warpgroup_fence_operand(tDrdK);
    if constexpr (kFuseDq) {
      // This warpgroup's columns of buffer `buf` are read (its dK and dV
      // products landed; both warpgroups' S^T and dP^T products, which read all
      // of them, landed before the barrier above): dQ goes over them. Element i
      // (query row key_of(tid, i), column dq_col_of(tid, i)): half i / 32, the
      // element (i % 32) of the head-dim-128 kernel's thread there. Rows past
      // the sequence are past the map's rows, dropped by the unit.
      const int row0 = key_of(tid, 0), col0 = dq_col_of(tid, 0);
      const int base = C128::dq_stage_base(row0, col0), chunk = C128::dq_stage_chunk(row0, col0);
#pragma unroll
      for (int i = 0; i < 64; i += 2) {
        float* at = dq_half(buf, i / 32) + base + C128::dq_stage_offset(chunk, (i % 32) / 4, (i >> 1) & 1);
        *reinterpret_cast<float2*>(at) = make_float2(tQrdQ(i), tQrdQ(i + 1));
      }
      fence_async_shared();  // the stores, seen by the unit's reads
      bar_arrive<kDqBarrierThreads>(kDqFullBarrier + buf);
    } else {
      warp_arrive(empty + buf, lane);  // this warp is done with Q/dO buffer `buf`
    }

    // The next tile's statistics (buffer buf ^ 1 was consumed before this
    // iteration's first barrier; the next one publishes them).
    if (has_next && tid < BM) {
      s_lse[(buf ^ 1) * BM + tid] = next_lse2;
      s_delta[(buf ^ 1) * BM + tid] = next_delta;
    }
    cur = next;
  }

  // dK and dV, staged over K and V (both warpgroups' last products, which
  // read them, waited for): this warpgroup's 128 columns of its warp's keys.
  consumers_sync();
  store_dk_dv<T, DB, BN, 16>(tDrdK, tDrdV, k_s, v_s, key0, 16 * (tid / 128), tid, dk, p.dk_sr, dv, p.dv_sr, cols,
                             consumers_sync);
}

}  // namespace symheap::attention::cuda
