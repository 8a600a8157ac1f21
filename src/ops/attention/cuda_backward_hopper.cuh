// Hopper dK/dV kernel, dQ fused or not (sm_90a; head dims 64 and 128; the
// logit features in the TMA-fed form with dQ fused, kFeatures): the products
// of the backward on wgmma (five with dQ fused; else
// dQ comes from the pipelined dQ kernel, cuda_backward_dq_pipelined.cuh). One CTA per 128
// keys of one (batch entry, kv head), two warpgroups of 64 keys; it walks
// the query tiles (64 rows) of every query head of its group, as the
// shared-fragment kernel (cuda_backward_dkdv_shared.cuh) does, and follows
// its rules: P from the forward's lse, dS = P (dP - delta) scale, dQ added to
// the fp32 workspace (KArgs::dq_accum) that attention_bwd_dq_convert_kernel
// converts after.
// Per tile, each warpgroup:
//   S^T = K Q^T and dP^T = V dO^T   (64 keys x 64 rows; K, V, Q, dO in shared memory)
//   dS^T to shared memory (two buffers, by turns)
//   dV += P^T dO and dK += dS^T Q   (P^T from registers: the accumulator layout
//                                    is the register-operand layout, as in the
//                                    Hopper forward; dS^T from shared memory; dO,
//                                    Q read transposed)
//   with kFuseDq, after a barrier, dQ (64 rows x 64 columns a warpgroup; one
//   by turns at head dim 64) = dS K over the block's 128 keys, added with
//   fp32 atomics, or (kTma) staged in shared memory for bulk reductions.
// Shared memory: the 128-byte swizzled layouts of cuda_forward_hopper.cuh,
// every element placed through a CuTe tensor (hopper::at).
// The default at head dims 64 and 128 with dQ fused
// (kHopperBackwardDefaults): at 128 7-9% faster than the
// shared-fragment kernel on H100 once the spills went from 772 to 40 bytes a
// thread, at 64 once fed by TMA; slower without dQ fused (bench/attn_notes.md,
// sections 15, 16 and 20).
#pragma once
#include "ops/attention/cuda_backward_dkdv_pipelined.cuh"
#include "ops/attention/cuda_forward_hopper.cuh"

namespace symheap::attention::cuda {

namespace hopper {
// The 128 threads of warpgroup `wg` (barrier ids 1 and 2; __syncthreads takes 0).
__device__ __forceinline__ void warpgroup_barrier(int wg) {
  asm volatile("bar.sync %0, 128;\n" ::"r"(1 + wg) : "memory");
}
// Named barrier `id` of `kCount` threads: wait for all, or arrive and go on.
template <int kCount>
__device__ __forceinline__ void bar_sync(int id) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "n"(kCount) : "memory");
}
template <int kCount>
__device__ __forceinline__ void bar_arrive(int id) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "n"(kCount) : "memory");
}
}  // namespace hopper

// The dK/dV kernels' shared tiles, in the 128-byte swizzle of the wgmma
// operands: K and V (kBN x kDB), K^T (the same bytes seen as kDB x kBN); Q and
// dO (kBM x kDB, two buffers each) and their transposes; dS (and P at head dim
// 256) as kBM x kBN with the rows contiguous (one MN-major atom of 64 rows),
// dS^T the same bytes seen as kBN x kBM.
template <class E, int kBN, int kBM, int kDB>
struct HopperDkvTiles {
  using SmemKV = decltype(cute::tile_to_shape(cute::GMMA::Layout_K_SW128_Atom<E>{},
                                              cute::Shape<cute::Int<kBN>, cute::Int<kDB>>{}));
  using SmemKt = decltype(cute::composition(
      SmemKV{}, cute::make_ordered_layout(cute::Shape<cute::Int<kDB>, cute::Int<kBN>>{},
                                          cute::Step<cute::_2, cute::_1>{})));
  using SmemQ = decltype(cute::tile_to_shape(cute::GMMA::Layout_K_SW128_Atom<E>{},
                                             cute::Shape<cute::Int<kBM>, cute::Int<kDB>, cute::_2>{}));
  using SmemQt = decltype(cute::composition(
      SmemQ{}, cute::make_ordered_layout(cute::Shape<cute::Int<kDB>, cute::Int<kBM>, cute::_2>{},
                                         cute::Step<cute::_2, cute::_1, cute::_3>{})));
  using SmemDs = decltype(cute::tile_to_shape(cute::GMMA::Layout_MN_SW128_Atom<E>{},
                                              cute::Shape<cute::Int<kBM>, cute::Int<kBN>>{}));
  using SmemDst = decltype(cute::composition(
      SmemDs{}, cute::make_ordered_layout(cute::Shape<cute::Int<kBN>, cute::Int<kBM>>{},
                                          cute::Step<cute::_2, cute::_1>{})));
  // dS and dS^T in two buffers (the head-dim-64/128 kernel's), one after the other.
  using SmemDs2 = decltype(cute::tile_to_shape(cute::GMMA::Layout_MN_SW128_Atom<E>{},
                                               cute::Shape<cute::Int<kBM>, cute::Int<kBN>, cute::_2>{}));
  using SmemDst2 = decltype(cute::composition(
      SmemDs2{}, cute::make_ordered_layout(cute::Shape<cute::Int<kBN>, cute::Int<kBM>, cute::_2>{},
                                           cute::Step<cute::_2, cute::_1, cute::_3>{})));

  static constexpr int kKVElems = cute::cosize_v<SmemKV>;
  static constexpr int kQElems = cute::cosize_v<SmemQ>;
  static constexpr int kDsElems = cute::cosize_v<SmemDs>;
  static_assert((kKVElems * sizeof(E)) % 1024 == 0 && (kQElems * sizeof(E)) % 1024 == 0 &&
                    (kDsElems * sizeof(E)) % 1024 == 0,
                "1024-byte tiles");
};

template <class T, int DB>
struct HopperDkvConfig : HopperDkvTiles<typename hopper::CuteType<T>::type, 128, 64, DB> {
  static_assert(DB == 64 || DB == 128, "the Hopper backward serves head dims 64 and 128");
  using Tiles = HopperDkvTiles<typename hopper::CuteType<T>::type, 128, 64, DB>;
  using E = typename hopper::CuteType<T>::type;
  static constexpr int kBlockN = 128;  // keys per CTA
  static constexpr int kBlockM = 64;   // query rows per tile
  static constexpr int kThreads = 256;

  using BN = cute::Int<kBlockN>;
  using BM = cute::Int<kBlockM>;
  using D = cute::Int<DB>;
  using K = cute::GMMA::Major;
  using Warpgroups = cute::Layout<cute::Shape<cute::_2, cute::_1, cute::_1>>;
  // S^T, dP^T (BN x BM) = K, V (BN x DB) times Q^T, dO^T; 64 keys a warpgroup.
  using MmaSdP = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<E, E, float, cute::Shape<cute::_64, BM, D>>(), Warpgroups{}));
  // dV, dK (BN x DB) += P^T, dS^T (registers) times dO, Q (BM x DB: MN-major
  // as the B operand DB x BM).
  using MmaDkv = decltype(cute::make_tiled_mma(
      cute::GMMA::rs_op_selector<E, E, float, cute::Shape<cute::_64, D, BM>, K::K, K::MN>(), Warpgroups{}));
  // dK (BN x DB) += dS^T (shared memory: sdS seen as BN x BM, K-major) times
  // Q (MN-major as the B operand DB x BM): dS^T takes no registers.
  using MmaDk = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<E, E, float, cute::Shape<cute::_64, D, BM>, K::K, K::MN>(), Warpgroups{}));
  // dQ (BM x DB) = dS (BM x BN; dS^T stored rows-contiguous, so MN-major as
  // A) times K (BN x DB; MN-major as the B operand DB x BN). An MN-major
  // operand with the 128-byte swizzle spans whole 64-element rows, so the
  // two warpgroups split DB only where each takes 64 columns; at head dim 64
  // one warpgroup computes a tile's dQ alone, the two in turn (tile parity:
  // four products a tile each and dQ every other tile, where the first alone
  // had six against four). Its accumulator layout is the same in either.
  static constexpr int kDqWarpgroups = DB / 64;
  using MmaDq = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<E, E, float, cute::Shape<cute::_64, cute::_64, BN>, K::MN, K::MN>(),
      cute::Layout<cute::Shape<cute::_1, cute::Int<kDqWarpgroups>, cute::_1>>{}));

  // dS^T in two buffers, by turns (kTileStartBarrier in the kernel).
  static constexpr size_t kSmemTiles =
      sizeof(E) * (2 * Tiles::kKVElems + 2 * Tiles::kQElems + 2 * Tiles::kDsElems);
  // + lse and delta, two buffers of BM floats each; + the TMA kernel's five
  // mbarriers; + 1024 for the alignment.
  static constexpr size_t kSmem = kSmemTiles + 4 * kBlockM * sizeof(float) + 5 * sizeof(uint64_t) + 1024;
  // The TMA kernel's dQ tiles (fp32, BM x DB, placed by dq_stage_index), two
  // buffers, each added to the workspace by bulk reductions (one a 32-column
  // box); after everything else.
  static constexpr size_t kDqTileBytes = kBlockM * DB * sizeof(float);
  // Element (r, c) of a staged dQ tile, in floats from the buffer's start: DB
  // / 32 boxes of BM rows x 32 columns (128 bytes a row), each in the 128-byte
  // swizzle the bulk reduction's map names (16-byte chunk j of row r at chunk
  // j ^ (r % 8)). Row-major rows 256 or 512 bytes apart fell in the same banks:
  // a warp's stores (8 rows x 4 column pairs) were 8-way conflicts, about a
  // tenth of the head-dim-64 kernel's time (ncu, bench/attn_notes.md 27).
  // Left: 2-way, rows g and g ^ 1 of a half-warp sharing two 16-byte chunks
  // (the layout tests).
  static constexpr int kDqBoxCols = 32;
  static __host__ __device__ constexpr int dq_stage_index(int r, int c) {
    return (c / kDqBoxCols) * (kBlockM * kDqBoxCols) + r * kDqBoxCols +
           ((((c % kDqBoxCols) >> 2) ^ (r & 7)) << 2) + (c & 3);
  }
  // The same for a thread's dQ elements, rows row0 + 8 h, columns col0 + 8 nt
  // (row0 % 8 = g, col0 % 32 < 8), as the kernel computes it: a base and a
  // chunk per thread, then per nt one xor (col0's chunk is 0 or 1, so adding
  // 2 (nt % 4) is an xor). Equal to dq_stage_index (the layout tests).
  static __host__ __device__ constexpr int dq_stage_base(int row0, int col0) {
    return (col0 / kDqBoxCols) * (kBlockM * kDqBoxCols) + row0 * kDqBoxCols + (col0 & 3);
  }
  static __host__ __device__ constexpr int dq_stage_chunk(int row0, int col0) {
    return ((col0 % kDqBoxCols) >> 2) ^ (row0 & 7);
  }
  static __host__ __device__ constexpr int dq_stage_offset(int chunk, int nt, int h) {
    return (nt / 4) * (kBlockM * kDqBoxCols) + 8 * h * kDqBoxCols + ((chunk ^ (2 * (nt % 4))) << 2);
  }
  static constexpr int kDsBufferBytes = Tiles::kDsElems * sizeof(E);
  static_assert(sizeof(E) * Tiles::kQElems == kBlockN * DB * 2, "a Q/dO buffer holds a staged dK or dV");
  static constexpr size_t kDqTileOffset = (kSmem - 1024 + 1023) / 1024 * 1024;  // from the aligned base
  static constexpr size_t kSmemTma = kDqTileOffset + 2 * kDqTileBytes + 1024;
  static_assert(kSmemTma <= 227 * 1024, "shared memory of the TMA kernel");
};

namespace hopper {
// The dK/dV kernels' stores by stmatrix, four 8 x 8 matrices a group: a
// warp's accumulators hold keys key0 + g and key0 + 8 + g (g = lane / 4) and
// column pairs 8 nt + 2 (lane % 4) of 8-column chunks nt; matrix j of group nt
// (even) is keys key0 + 8 (j % 2) .. + 7 (its rows) by chunk nt + j / 2 (each
// row 8 contiguous elements), from registers 4 (nt + j / 2) + 2 (j % 2) and +
// 1 of the accumulator. Lane l gives the address of row l % 8 of matrix l / 8.
// The offsets below are lane l's for group 0 in chunks from chunk0 on; under
// the swizzles, group nt's is that one with nt << 4 xored in (the layout
// tests check both against the tiles).
//
// In a dS-layout tile (MN-major 128-byte swizzle: 64 query rows by 8 keys an
// atom of 1024 bytes, keys' atoms one after another), where chunks are 8
// query rows.
__host__ __device__ constexpr int ds_stmatrix_offset(int lane, int key0, int chunk0) {
  const int key = key0 + 8 * ((lane >> 3) & 1) + (lane & 7);
  return (key / 8) * 1024 + (key % 8) * 128 + (((chunk0 + (lane >> 4)) ^ (key % 8)) << 4);
}
// dK and dV staged for 16-byte global stores: row-major key rows of DB
// elements, 16-byte chunk c of row r at chunk c ^ (r % 8), so the 8 rows of
// an stmatrix matrix fall in 8 different bank groups and a row's chunks stay
// in its own 2 DB bytes.
template <int DB>
__host__ __device__ constexpr int kv_stage_offset(int key, int chunk) {
  return key * DB * 2 + ((chunk ^ (key % 8)) << 4);
}
template <int DB>
__host__ __device__ constexpr int kv_stmatrix_offset(int lane, int key0, int chunk0) {
  return kv_stage_offset<DB>(key0 + 8 * ((lane >> 3) & 1) + (lane & 7), chunk0 + (lane >> 4));
}

// A CTA's dK and dV (BN keys x DB, dS carried the scale): each warp's share
// (kChunks column chunks from chunk0, keys from key0) staged by stmatrix in
// k_stage and v_stage (each BN x DB, free shared memory), then written by the
// 256 consumer threads (tid) a 16-byte chunk a store, rows below `cols`. A
// warp's 4-byte stores straight from the accumulators kept the CTA's end (the
// SM's: one CTA an SM) on the load/store unit for about two tiles' time (ncu,
// bench/attn_notes.md 36). `sync` is the consumers' barrier; it is called
// once before the staging reads.
template <class T, int DB, int BN, int kChunks, class E, class Acc, class Sync>
__device__ __forceinline__ void store_dk_dv(const Acc& tDrdK, const Acc& tDrdV, E* k_stage, E* v_stage, int key0,
                                            int chunk0, int tid, E* dk, int64_t dk_sr, E* dv, int64_t dv_sr,
                                            int cols, Sync sync) {
  const int lane = tid % 32;
  const uint32_t k_addr = smem_addr(k_stage) + kv_stmatrix_offset<DB>(lane, key0, chunk0);
  const uint32_t v_addr = smem_addr(v_stage) + kv_stmatrix_offset<DB>(lane, key0, chunk0);
  auto two = [](const Acc& acc, int i) { return Pack<T>::two(acc(i), acc(i + 1)); };
#pragma unroll
  for (int nt = 0; nt < kChunks; nt += 2) {
    stmatrix_x4(k_addr ^ (nt << 4), two(tDrdK, 4 * nt), two(tDrdK, 4 * nt + 2), two(tDrdK, 4 * nt + 4),
                two(tDrdK, 4 * nt + 6));
    stmatrix_x4(v_addr ^ (nt << 4), two(tDrdV, 4 * nt), two(tDrdV, 4 * nt + 2), two(tDrdV, 4 * nt + 4),
                two(tDrdV, 4 * nt + 6));
  }
  sync();
  // Thread tid: chunk tid % kRowChunks of rows tid / kRowChunks + kRowStep k
  // (the same chunk of the swizzle in each: kRowStep is a multiple of 8).
  constexpr int kRowChunks = DB / 8, kRowStep = 256 / kRowChunks;
  static_assert(kRowStep % 8 == 0 && BN % kRowStep == 0, "whole passes of the staged rows");
  const int c = tid % kRowChunks, r0 = tid / kRowChunks;
  const unsigned char* k_src = reinterpret_cast<const unsigned char*>(k_stage) + kv_stage_offset<DB>(r0, c);
  const unsigned char* v_src = reinterpret_cast<const unsigned char*>(v_stage) + kv_stage_offset<DB>(r0, c);
#pragma unroll
  for (int k = 0; k < BN / kRowStep; ++k) {
    const int r = r0 + k * kRowStep;
    if (r < cols) {
      *reinterpret_cast<uint4*>(dk + r * dk_sr + c * 8) = *reinterpret_cast<const uint4*>(k_src + k * kRowStep * DB * 2);
      *reinterpret_cast<uint4*>(dv + r * dv_sr + c * 8) = *reinterpret_cast<const uint4*>(v_src + k * kRowStep * DB * 2);
    }
  }
}
}  // namespace hopper

// The TMA kernel's tensor maps (kTma): Q and dO with boxes of 64 columns x 64
// rows, K and V with boxes of 64 columns x 128 rows, in the 128-byte swizzle
// of the wgmma tiles (cuda_forward_hopper.cuh, FwdTmaMaps). Unused elsewhere.
struct BwdTmaMaps {
  CUtensorMap q, dout, k, v;
  CUtensorMap dq_accum;  // fp32, boxes of 32 columns x 64 rows, 128-byte swizzle
};

namespace hopper {
// The fp32 tile at `src` added into `map`'s box at (c0 .. c3) by the TMA
// unit (a bulk reduction, no per-element atomics); then committed as a group.
__device__ __forceinline__ void tma_reduce_add_4d(const CUtensorMap* map, const void* src, int c0, int c1, int c2,
                                                  int c3) {
  asm volatile(
      "cp.reduce.async.bulk.tensor.4d.global.shared::cta.add.tile.bulk_group"
      " [%0, {%2, %3, %4, %5}], [%1];\n"
      "cp.async.bulk.commit_group;\n" ::"l"(reinterpret_cast<uint64_t>(map)),
      "r"(smem_addr(src)), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}
// Rows [from, ROWS) of a 128-byte-swizzled shared tile of DB columns set to
// zero by the NT threads numbered by `tid`, 16 bytes a store (the swizzle
// moves whole 16-byte chunks).
template <int ROWS, int DB, int NT, class Tensor>
__device__ __forceinline__ void zero_rows_from(Tensor s, int from, int tid) {
  constexpr int kChunks = DB / 8;
  for (int idx = from * kChunks + tid; idx < ROWS * kChunks; idx += NT)
    *reinterpret_cast<uint4*>(at(s, idx / kChunks, idx % kChunks * 8)) = make_uint4(0, 0, 0, 0);
}
// The committed bulk groups have read their shared memory (kRead) or are done.
template <bool kRead>
__device__ __forceinline__ void bulk_wait_all() {
  if constexpr (kRead) asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
  else asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
}

// The first thread of the warpgroup of consumer thread `tid`, made warp-uniform
// for the compiler (a broadcast): what is derived from it (the wgmma
// descriptors of shared-memory operands, the same for all 128 threads of a
// warpgroup) is computed once in uniform registers, not per thread and moved
// to uniform registers before every wgmma.
__device__ __forceinline__ int warpgroup_first_thread(int tid) {
  return __shfl_sync(0xffffffffu, tid / 128, 0) * 128;
}
// `x`, the same in every lane, made known to be so (as above).
__device__ __forceinline__ int uniform_int(int x) { return __shfl_sync(0xffffffffu, x, 0); }

// The loads of query row i's statistics (head hq of sequence `seq` of batch
// entry b): lse (-inf past the end) and delta (0 there), not yet converted.
struct RowStats {
  float lse, delta;
};
__device__ __forceinline__ RowStats row_stats_load(const KArgs& p, const Seq& seq, int b, int hq, int i) {
  RowStats s{-INFINITY, 0.0f};
  if (i < seq.sq) {
    s.lse = p.lse[b * p.lse_sb + hq * p.lse_sh + seq.q0 + i];
    s.delta = p.delta[b * p.delta_sb + hq * p.delta_sh + seq.q0 + i];
  }
  return s;
}
// lse in log2 units as the dK/dV kernels use it: +inf where the row is past
// the end or sees no key (its P is then 0).
__device__ __forceinline__ float lse2_of(float lse) {
  constexpr float kLog2e = 1.4426950408889634f;
  return lse == -INFINITY ? INFINITY : lse * kLog2e;
}
// The dK/dV kernels' statistics of query row i: lse2_of(lse) and delta.
__device__ __forceinline__ void row_stats(const KArgs& p, const Seq& seq, int b, int hq, int i, float* lse2,
                                          float* delta) {
  const RowStats s = row_stats_load(p, seq, b, hq, i);
  *lse2 = lse2_of(s.lse);
  *delta = s.delta;
}

// The TMA-fed dK/dV kernels' mbarriers: K and V landed (kv_full), Q/dO buffer
// i landed (full[i]) and released by the consumers' `consumer_warps` warps
// (empty[i]); then every thread of the CTA sees them.
__device__ __forceinline__ void init_tile_barriers(uint64_t* kv_full, uint64_t* full, uint64_t* empty,
                                                   int consumer_warps) {
  if (threadIdx.x == 0) {
    mbar_init(kv_full, 1);
    for (int i = 0; i < 2; ++i) {
      mbar_init(full + i, 1);
      mbar_init(empty + i, consumer_warps);
    }
    mbar_fence_init();
  }
  __syncthreads();
}

// The producer thread of a TMA-fed dK/dV kernel: K and V of the block (BN
// rows from map row k_row) once, then tile it's Q and dO (BM rows from map
// row q_row(it), head head(it)) into buffer it % 2 once both consumer
// warpgroups released that buffer's previous tile; DB / 64 boxes a row.
template <int BN, int BM, int DB, class E, class SKV, class SQ, class QRow, class Head>
__device__ __forceinline__ void produce_tiles(const BwdTmaMaps& maps, SKV& sK, SKV& sV, SQ& sQ, SQ& sdO,
                                              uint64_t* kv_full, uint64_t* full, uint64_t* empty, int k_row,
                                              int hk, int map_b, int n_tiles, QRow q_row, Head head) {
  constexpr uint32_t kBoxRow = 64 * sizeof(E);  // bytes of a box row
  constexpr int kBoxes = DB / 64;
  mbar_arrive_expect_tx(kv_full, 2 * kBoxes * BN * kBoxRow);
  for (int h = 0; h < kBoxes; ++h) {
    tma_load_4d(at(sK, 0, 64 * h), &maps.k, kv_full, 64 * h, k_row, hk, map_b);
    tma_load_4d(at(sV, 0, 64 * h), &maps.v, kv_full, 64 * h, k_row, hk, map_b);
  }
  for (int it = 0; it < n_tiles; ++it) {
    const int buf = it & 1;
    // Both consumer warpgroups are done with tile it - 2, the buffer's last.
    if (it >= 2) mbar_wait(empty + buf, ((it >> 1) + 1) & 1);
    mbar_arrive_expect_tx(full + buf, 2 * kBoxes * BM * kBoxRow);
    const int hq = head(it), row = q_row(it);
    for (int h = 0; h < kBoxes; ++h) {
      tma_load_4d(at(sQ, 0, 64 * h, buf), &maps.q, full + buf, 64 * h, row, hq, map_b);
      tma_load_4d(at(sdO, 0, 64 * h, buf), &maps.dout, full + buf, 64 * h, row, hq, map_b);
    }
  }
}

// S^T = K Q^T and dP^T = V dO^T of Q/dO buffer `buf` issued together and
// committed apart; returns once S^T landed, dP^T's product still running (the
// caller waits for it with warpgroup_wait<0>), so P is computed under it.
template <class Mma, class FragK, class FragQ, class FragS>
__device__ __forceinline__ void issue_s_dp(Mma& mma, const FragK& tSrK, const FragQ& tSrQ, const FragK& tSrV,
                                           const FragQ& tSrdO, int buf, FragS& tSrS, FragS& tSrdP) {
  using namespace cute;
  warpgroup_fence_operand(tSrS);
  warpgroup_fence_operand(tSrdP);
  warpgroup_arrive();
  mma.accumulate_ = GMMA::ScaleOut::Zero;
  CUTE_UNROLL
  for (int kb = 0; kb < size<2>(tSrK); ++kb) {
    gemm(mma, tSrK(_, _, kb), tSrQ(_, _, kb, buf), tSrS);
    mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
  mma.accumulate_ = GMMA::ScaleOut::Zero;
  CUTE_UNROLL
  for (int kb = 0; kb < size<2>(tSrV); ++kb) {
    gemm(mma, tSrV(_, _, kb), tSrdO(_, _, kb, buf), tSrdP);
    mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
  warpgroup_wait<1>();  // S^T landed (the groups complete in order)
  warpgroup_fence_operand(tSrS);
}
}  // namespace hopper

// kTma: a third warpgroup produces. One of its threads loads K and V once and
// the Q/dO tiles into their two buffers with bulk tensor copies, each as soon
// as both consumer warpgroups released the buffer; the consumers issue no
// copies, and setmaxnreg moves registers to them. Its second warp adds each
// tile's dQ, staged by the consumers in one of two buffers, to the fp32
// workspace by one bulk reduction: the consumers arrive on that buffer's
// "full" barrier and go on, and wait on its "empty" barrier only before
// staging into it again two tiles later.
// kPacked (with kTma; cu_seqlens): the maps hold all the packed rows as one
// batch entry, so a box past a sequence's end reads the next sequence's rows,
// not zeros. The consumers zero those rows of K, V (once) and of each Q/dO
// tile that crosses the end before any product reads them: the products take
// them in with P = 0 or dS = 0, and 0 x inf is NaN; keys past the end are not
// masked either (without a window every row sees the whole block) and count
// on K's zero rows to add nothing to dQ. The staged dQ rows past the end are
// zeroed too, as the bulk reduction would add them to the next sequence's.
// With those zeros the products see the tiles the cp.async copies make.
// kFeatures (with kTma): the logit features (bias, mask, ALiBi, softcap,
// dropout; the rule of LogitCtx, applied feature by feature over a thread's
// fragment, one uniform branch a feature, as the forward kernels do) and the
// bias gradient (DbiasSink), as the pipelined dK/dV kernel computes them.
// Between P and dS a score keeps its P in the S^T registers, the sign saying
// whether dropout kept it, and softcap's derivative in half precision (16
// registers). kServes (with kFeatures): the logit features the form's calls
// may have, the others' passes compiled out (the launch checks form_serves).
// The forms: every feature (kAllFeatures); a mask and ALiBi (the form for
// every feature spilled 292 bytes a thread at head dim 128, ptxas, this one
// 28); every feature but the bias (no bias gradient, and softcap's derivative
// recomputed from P at dS rather than kept: 52 bytes spilled at 128, none at
// 64, against 288 and 72 in the form for every feature); softcap alone;
// dropout alone.
template <class T, int DB, bool kFuseDq, bool kTma = false, bool kPacked = false, bool kFeatures = false,
          LogitFeatures kServes = kAllFeatures>
__global__ void __launch_bounds__(kTma ? 384 : HopperDkvConfig<T, DB>::kThreads, 1)
    attention_bwd_dkdv_hopper_kernel(const KArgs p, const __grid_constant__ BwdTmaMaps maps) {
  static_assert(!kTma || kFuseDq, "the TMA kernel serves calls with dQ fused");
  static_assert(!kPacked || kTma, "kPacked is a form of the TMA kernel");
  static_assert(!kFeatures || kTma, "the logit features are in the TMA kernel only");
  static_assert(kServes == kAllFeatures || kFeatures, "kServes names a form of the feature kernel");
  // The features with a pass of their own between P and dS (a mask and ALiBi
  // have none: their calls' dS is the plain one).
  constexpr bool kBias = kFeatures && (kServes & kBiasFeature);
  constexpr bool kSoftcap = kFeatures && (kServes & kSoftcapFeature);
  constexpr bool kDropout = kFeatures && (kServes & kDropoutFeature);
  constexpr bool kDsFeatures = kBias || kSoftcap || kDropout;
  using namespace cute;
  using namespace hopper;
  using pipelined::RowRange;
  using pipelined::rows_seeing;
  using C = HopperDkvConfig<T, DB>;
  using E = typename C::E;
  constexpr int BM = C::kBlockM, BN = C::kBlockN, NT = C::kThreads;
  constexpr float kLog2e = 1.4426950408889634f;
  extern __shared__ unsigned char smem_raw[];
  unsigned char* base = smem_raw + ((1024 - smem_addr(smem_raw) % 1024) % 1024);
  E* k_s = reinterpret_cast<E*>(base);
  E* v_s = k_s + C::kKVElems;
  E* q_s = v_s + C::kKVElems;
  E* do_s = q_s + C::kQElems;
  E* ds_s = do_s + C::kQElems;
  float* s_lse = reinterpret_cast<float*>(base + C::kSmemTiles);  // two buffers of BM
  float* s_delta = s_lse + 2 * BM;                                // two buffers of BM
  // kTma: K and V landed; Q/dO buffer landed (full) and released (empty).
  uint64_t* kv_full = reinterpret_cast<uint64_t*>(s_delta + 2 * BM);
  uint64_t* full = kv_full + 1;
  uint64_t* empty = full + 2;
  // kTma: the tiles' dQ, staged for the bulk reduction (two buffers).
  float* s_dq = reinterpret_cast<float*>(base + C::kDqTileOffset);
  // Named barriers of the dQ staging (kTma): buffer b full (ids 4, 5) and
  // empty (6, 7), between the warpgroups that compute dQ and the dQ warp (at
  // head dim 64 buffer b is always warpgroup b's: tile parity picks both).
  constexpr int kDqBarrierThreads = 128 * C::kDqWarpgroups + 32;
  constexpr int kDqFullBarrier = 4, kDqEmptyBarrier = 6;
  Tensor sK = make_tensor(make_smem_ptr(k_s), typename C::SmemKV{});
  Tensor sV = make_tensor(make_smem_ptr(v_s), typename C::SmemKV{});
  Tensor sKt = make_tensor(make_smem_ptr(k_s), typename C::SmemKt{});
  Tensor sQ = make_tensor(make_smem_ptr(q_s), typename C::SmemQ{});
  Tensor sdO = make_tensor(make_smem_ptr(do_s), typename C::SmemQ{});
  Tensor sQt = make_tensor(make_smem_ptr(q_s), typename C::SmemQt{});
  Tensor sdOt = make_tensor(make_smem_ptr(do_s), typename C::SmemQt{});
  Tensor sdS = make_tensor(make_smem_ptr(ds_s), typename C::SmemDs2{});  // (BM, BN, 2)
  Tensor sdSt = make_tensor(make_smem_ptr(ds_s), typename C::SmemDst2{});

  // Heaviest key blocks first under a causal mask (the TMA-fed forms: in the
  // cp.async-fed ones the computed indices cost registers they do not have).
  const KeyBlockCta cta = kTma ? key_block_cta()
                              : KeyBlockCta{static_cast<int>(blockIdx.x), static_cast<int>(blockIdx.y),
                                            static_cast<int>(blockIdx.z)};
  const int n0 = cta.n_block * BN, hk = cta.hk, b = cta.b;
  const Seq seq = sequence(p, b);
  if (n0 >= seq.sk) return;
  // kTma: threads 0-127 produce; tid numbers the consumers from 0.
  const int tid = static_cast<int>(threadIdx.x) - (kTma ? 128 : 0), lane = tid % 32, g = lane >> 2, t = lane & 3;
  const int cols = min(BN, seq.sk - n0);
  // This thread's keys in S^T / dP^T / dK / dV: key_row(h) of the block.
  const int key_row0 = (tid / 32) * 16 + g;  // warpgroup w: keys 64 w ..
  auto key_row = [&](int h) { return key_row0 + 8 * h; };

  // Query rows that see at least one key of [n0, n0 + cols), tiles of BM,
  // m_tiles per head, then the next head of the group.
  const int shift = seq.sk - seq.sq;
  const pipelined::QueryTiles tiles = pipelined::query_tiles<BM>(p, seq, n0, cols);
  const int m_begin = tiles.m_begin, m_tiles = tiles.m_tiles, n_tiles = tiles.n_tiles;

  E* dk = static_cast<E*>(p.dk) + b * p.dk_sb + (seq.k0 + n0) * p.dk_sr + hk * p.dk_sh;
  E* dv = static_cast<E*>(p.dv) + b * p.dv_sb + (seq.k0 + n0) * p.dv_sr + hk * p.dv_sh;
  if (n_tiles == 0) {  // no row sees these keys
    if constexpr (kBias) zero_dbias_row_sums(p, b, hk, n0, cols, threadIdx.x, kTma ? 384 : NT);
    return pipelined::zero_key_rows<DB, kTma ? 384 : NT>(dk, dv, p, cols);
  }
  // The maps' coordinates of this sequence: packed, its first rows in the one
  // batch entry; else row 0 of entry b.
  const int map_b = kPacked ? 0 : b;
  const int map_q0 = kPacked ? static_cast<int>(seq.q0) : 0, map_k0 = kPacked ? static_cast<int>(seq.k0) : 0;

  auto tile_head = [&](int it) { return hk * p.group + it / m_tiles; };
  auto tile_row0 = [&](int it) { return m_begin + (it % m_tiles) * BM; };
  auto load_q_do = [&](int hq, int m0, int buf) {
    const int rows = min(BM, seq.sq - m0);
    const int64_t row = seq.q0 + m0;
    load_tile<BM, DB, NT>(sQ(_, _, buf), static_cast<const E*>(p.q) + b * p.q_sb + row * p.q_sr + hq * p.q_sh,
                          p.q_sr, rows);
    load_tile<BM, DB, NT>(sdO(_, _, buf),
                          static_cast<const E*>(p.dout) + b * p.do_sb + row * p.do_sr + hq * p.do_sh, p.do_sr,
                          rows);
  };
  // The statistics of query row `tid` of tile `it` (threads < BM).
  auto read_stats = [&](int it, float* lse2, float* delta) {
    row_stats(p, seq, b, tile_head(it), tile_row0(it) + tid, lse2, delta);
  };

  // The consumers' block barrier (kTma: the producer warpgroup is gone).
  auto consumers_sync = [] {
    if constexpr (kTma) asm volatile("bar.sync 3, 256;\n" ::: "memory");
    else __syncthreads();
  };
  // A tile's dS^T goes to buffer it % 2, so a warpgroup may store the next
  // tile's while the other's dQ product still reads this one's, and the next
  // tile's statistics are published before the dQ barrier: with TMA the
  // consumers need no block barrier at a tile's start and may run a tile out
  // of step (at head dim 64 the second warpgroup computes the next S^T and
  // dP^T under the first's dQ). The cp.async forms need it (the copies land
  // per thread; the next tile's copies overwrite the buffer tile it - 1 read),
  // and so does kPacked (its zeroed rows are plain stores by both warpgroups).
  constexpr bool kTileStartBarrier = !kTma || kPacked;
  if constexpr (kTma) {
    init_tile_barriers(kv_full, full, empty, NT / 32);
    if (threadIdx.x < 128) {
      registers_down<24>();
      if (threadIdx.x == 0) {
        produce_tiles<BN, BM, DB, E>(maps, sK, sV, sQ, sdO, kv_full, full, empty, map_k0 + n0, hk, map_b, n_tiles,
                                     [&](int it) { return map_q0 + tile_row0(it); }, tile_head);
      } else if (threadIdx.x / 32 == 1) {
        // The dQ warp: each tile's staged dQ into the workspace, in order,
        // one reduction a 32-column box. Rows past the last row of the map
        // (the batch layout: past the sequence) are dropped by the unit.
        for (int it = 0; it < n_tiles; ++it) {
          const int buf = it & 1;
          bar_sync<kDqBarrierThreads>(kDqFullBarrier + buf);
          if (threadIdx.x == 32) {
#pragma unroll
            for (int box = 0; box < DB / C::kDqBoxCols; ++box)
              tma_reduce_add_4d(&maps.dq_accum, s_dq + buf * BM * DB + box * BM * C::kDqBoxCols, box * C::kDqBoxCols,
                                map_q0 + tile_row0(it), tile_head(it), map_b);
            bulk_wait_all<true>();  // the unit has read the buffer
          }
          __syncwarp();
          // (the last two tiles' buffers are not staged into again)
          if (it + 2 < n_tiles) bar_arrive<kDqBarrierThreads>(kDqEmptyBarrier + buf);
        }
        if (threadIdx.x == 32) bulk_wait_all<false>();  // every reduction done before the CTA ends
      }
      return;
    }
    registers_up<240>();
  } else {
    // Prologue: K and V of the block and the first Q/dO tile, one group.
    load_tile<BN, DB, NT>(sK, static_cast<const E*>(p.k) + b * p.k_sb + (seq.k0 + n0) * p.k_sr + hk * p.k_sh,
                          p.k_sr, cols);
    load_tile<BN, DB, NT>(sV, static_cast<const E*>(p.v) + b * p.v_sb + (seq.k0 + n0) * p.v_sr + hk * p.v_sh,
                          p.v_sr, cols);
    load_q_do(hk * p.group, m_begin, 0);
    cp_async_commit();
  }
  if (tid < BM) read_stats(0, &s_lse[tid], &s_delta[tid]);
  if constexpr (!kTileStartBarrier) consumers_sync();  // tile 0's statistics, for every thread

  typename C::MmaSdP mma_sdp;
  typename C::MmaDkv mma_dkv;
  typename C::MmaDk mma_dk;
  typename C::MmaDq mma_dq;
  // The shared-memory operands' descriptors depend on the warpgroup only: sliced
  // for its first thread, known warp-uniform, they stay in uniform registers.
  const int wg0 = warpgroup_first_thread(tid);
  auto thr_sdp = mma_sdp.get_thread_slice(wg0);
  auto thr_dkv = mma_dkv.get_thread_slice(wg0);
  auto thr_dq = mma_dq.get_thread_slice(wg0 % (128 * C::kDqWarpgroups));  // dQ's warpgroups only
  auto thr_dk = mma_dk.get_thread_slice(wg0);
  Tensor tSrK = thr_sdp.partition_fragment_A(sK);      // (MMA, 1, DB / 16)
  Tensor tSrV = thr_sdp.partition_fragment_A(sV);
  Tensor tSrQ = thr_sdp.partition_fragment_B(sQ);      // (MMA, 1, DB / 16, 2)
  Tensor tSrdO = thr_sdp.partition_fragment_B(sdO);
  Tensor tDrdOt = thr_dkv.partition_fragment_B(sdOt);  // (MMA, 1, BM / 16, 2)
  Tensor tKrdSt = thr_dk.partition_fragment_A(sdSt);   // (MMA, 1, BM / 16, 2)
  Tensor tKrQt = thr_dk.partition_fragment_B(sQt);     // (MMA, 1, BM / 16, 2)
  Tensor tQrdS = thr_dq.partition_fragment_A(sdS);     // (MMA, 1, BN / 16, 2)
  Tensor tQrKt = thr_dq.partition_fragment_B(sKt);     // (MMA, 1, BN / 16)
  // Accumulators: element 4 nt + 2 h + c is (key key_row(h), column 8 nt + 2 t + c).
  Tensor tSrS = partition_fragment_C(mma_sdp, Shape<Int<BN>, Int<BM>>{});
  Tensor tSrdP = partition_fragment_C(mma_sdp, Shape<Int<BN>, Int<BM>>{});
  Tensor tDrdV = partition_fragment_C(mma_dkv, Shape<Int<BN>, Int<DB>>{});
  Tensor tDrdK = partition_fragment_C(mma_dk, Shape<Int<BN>, Int<DB>>{});
  // P^T and dS^T as A operands: element i is element i of S^T / dP^T.
  Tensor tDrP = make_tensor<E>(partition_shape_A(mma_dkv, Shape<Int<BN>, Int<BM>>{}));
  // dQ: element 4 nt + 2 h + c is (query row (tid % 128) / 32 * 16 + g + 8 h,
  // column (tid / 128 % kDqWarpgroups) * 64 + 8 nt + 2 t + c).
  Tensor tQrdQ = partition_fragment_C(mma_dq, Shape<Int<BM>, Int<DB>>{});
  static_assert(size(decltype(tSrS){}) == BM / 2 && size(decltype(tDrdV){}) == DB / 2 &&
                    size(decltype(tDrP){}) == BM / 2 && size(decltype(tQrdQ){}) == 32,
                "the per-thread shares of the warpgroup tiles");
  clear(tDrdV);
  clear(tDrdK);

  // The query rows that see this thread's keys, and those for which a whole
  // tile sees every key of the block.
  const RowRange sees[2] = {rows_seeing(n0 + key_row(0), shift, p.win_left, p.win_right),
                            rows_seeing(n0 + key_row(1), shift, p.win_left, p.win_right)};
  const int full_lo = rows_seeing(n0 + BN - 1, shift, p.win_left, p.win_right).lo;
  const int full_hi = rows_seeing(n0, shift, p.win_left, p.win_right).hi;
  const float scale_log2 = p.scale * kLog2e;
  // This lane's dS^T stmatrix address, buffer 0, group 0 (ds_stmatrix_offset).
  const uint32_t ds_addr0 = smem_addr(ds_s) + ds_stmatrix_offset(lane, key_row0 - g, 0);
  const int dq_row0 = ((tid % 128) / 32) * 16 + g, dq_col0 = (tid / 128 % C::kDqWarpgroups) * 64 + 2 * t;
  // Whether this thread's warpgroup computes tile it's dQ (warpgroup-uniform).
  auto dq_warpgroup = [&](int it) { return C::kDqWarpgroups == 2 || tid / 128 == (it & 1); };
  float dbias_sum[2] = {0.0f, 0.0f};  // kFeatures, bias broadcast over query rows: this head's sums

  pipelined::TileCursor cur{0, 0};
  for (int it = 0; it < n_tiles; ++it) {
    const int buf = uniform_int(it & 1);  // (the Q/dO descriptors in uniform registers)
    const int hq = hk * p.group + cur.h, m0 = m_begin + cur.m * BM;
    const pipelined::TileCursor next = cur.next(m_tiles);
    if constexpr (kTma) {
      if (it == 0) mbar_wait(kv_full, 0);
      mbar_wait(full + buf, (it >> 1) & 1);  // tile `it` landed
      if constexpr (kPacked) {
        // The next sequence's rows (kPacked above) become zeros: plain stores
        // after the landed copies, made visible to wgmma's proxy here and to
        // both warpgroups by the barrier below. Buffer `buf`'s last tile
        // (it - 2) is consumed: the producer waited for that to refill it.
        const int q_rows = seq.sq - m0;
        if (it == 0 && cols < BN) {
          zero_rows_from<BN, DB, NT>(sK, cols, tid);
          zero_rows_from<BN, DB, NT>(sV, cols, tid);
        }
        if (q_rows < BM) {
          zero_rows_from<BM, DB, NT>(sQ(_, _, buf), q_rows, tid);
          zero_rows_from<BM, DB, NT>(sdO(_, _, buf), q_rows, tid);
        }
        if ((it == 0 && cols < BN) || q_rows < BM) fence_async_shared();
      }
    } else {
      cp_async_wait<0>();  // tile `it` (and K, V) landed
    }
    if constexpr (!kTma) fence_async_shared();  // (TMA writes through the async proxy)
    // ... for every thread; tile it-1 is consumed. Without this barrier, the
    // previous tile's dQ barrier published this tile's statistics, and dS^T
    // buffer `buf` was last read by tile it - 2's dQ, which every warpgroup
    // finished before that barrier.
    if constexpr (kTileStartBarrier) consumers_sync();
    const bool has_next = it + 1 < n_tiles;
    // The next tile's statistics: loaded here, converted where published (before
    // the dQ barrier), so the loads' latency passes under this tile's products.
    RowStats next_stats{-INFINITY, 0.0f};
    if (has_next) {
      if constexpr (!kTma) load_q_do(hk * p.group + next.h, m_begin + next.m * BM, buf ^ 1);
      if (tid < BM) next_stats = row_stats_load(p, seq, b, hk * p.group + next.h, m_begin + next.m * BM + tid);
    }
    if constexpr (!kTma) cp_async_commit();
    const float* lse2 = s_lse + buf * BM;
    const float* delta = s_delta + buf * BM;

    // S^T and dP^T issued together, committed apart: P (the softmax of S^T)
    // is computed while dP^T's product runs, and dV's product is issued
    // before dS is computed, so each elementwise step overlaps a product.
    // At head dim 64 this thread's lse pairs are read before the products (the
    // registers are there), so P does not wait for them after S lands.
    constexpr bool kLseEarly = DB == 64;
    auto lse_pair = [&](int nt) { return *reinterpret_cast<const float2*>(lse2 + nt * 8 + 2 * t); };
    float2 lse_early[kLseEarly ? BM / 8 : 1];
    if constexpr (kLseEarly)
#pragma unroll
      for (int nt = 0; nt < BM / 8; ++nt) lse_early[nt] = lse_pair(nt);
    // The lse pair of query rows 8 nt + 2 t, + 1 (from registers at head dim 64).
    auto lse_of = [&](int nt) {
      if constexpr (kLseEarly) return lse_early[nt];
      else return lse_pair(nt);
    };
    issue_s_dp(mma_sdp, tSrK, tSrQ, tSrV, tSrdO, buf, tSrS, tSrdP);

    // P; element 4 nt + e is (key key_row(e / 2), query row m0 + 8 nt + 2 t +
    // e % 2). Rows past the sequence have lse +inf: P = 0. A tile whose every
    // row sees every key of the block (most tiles of a causal grid) takes the
    // branch without the mask's compares.
    auto softmax_p = [&](auto masked) {
#pragma unroll
      for (int nt = 0; nt < BM / 8; ++nt) {
        const int c0 = nt * 8 + 2 * t;
        const float2 l2 = lse_of(nt);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int h = e >> 1, i = m0 + c0 + (e & 1), idx = 4 * nt + e;
          float x2 = fmaf(tSrS(idx), scale_log2, -((e & 1) ? l2.y : l2.x));
          if constexpr (decltype(masked)::value) x2 = (i >= sees[h].lo) & (i < sees[h].hi) ? x2 : -INFINITY;
          tSrS(idx) = exp2_fast(x2);
        }
      }
    };
    auto set_p_operand = [&](int i, float p0, float p1) {
      const uint32_t pp = Pack<T>::two(p0, p1);
      tDrP(i) = reinterpret_cast<const E*>(&pp)[0];
      tDrP(i + 1) = reinterpret_cast<const E*>(&pp)[1];
    };
    // (kFeatures) Element k of S^T: query row row_of(k), key col_of(k); softcap's
    // derivative there: half k % 2 of dcap2[k / 2].
    auto row_of = [&](int k) { return m0 + (k >> 2) * 8 + 2 * t + (k & 1); };
    auto col_of = [&](int k) { return n0 + key_row((k >> 1) & 1); };
    __half2 dcap2[kBias ? BM / 4 : 1];
    if constexpr (kFeatures) {
      // The logit rule (window, mask and sequence ends too), in log2 units.
      const LogitCtx logit(p, b, hq, seq);
      const bool full = m0 >= full_lo && m0 + BM <= full_hi && m0 + BM <= seq.sq && cols == BN;
      logit.fragment_log2<BM / 2, false, kServes>(
          p, [&](int k) -> float& { return tSrS(k); }, row_of, col_of, /*skip_bias=*/!kBias, full,
          [&](int k, float d) {
            if constexpr (kBias) set_half_dcap(dcap2, k, d);
          });
#pragma unroll
      for (int nt = 0; nt < BM / 8; ++nt) {
        const float2 l2 = lse_of(nt);
#pragma unroll
        for (int e = 0; e < 4; ++e) tSrS(4 * nt + e) = exp2_fast(tSrS(4 * nt + e) - ((e & 1) ? l2.y : l2.x));
      }
      // dV takes P dropped out; dS (below) P and the dropout's verdict (the sign).
      if (kDropout && p.dropout) {
        const uint32_t bh = static_cast<uint32_t>(b * p.heads_q + hq);
#pragma unroll
        for (int nt = 0; nt < BM / 8; nt += 2) {
          float keep[8];  // element 4 nt + e
          dropout_keep_cols(p, bh, row_of(4 * nt), col_of(0), lane, keep);
#pragma unroll
          for (int k = 4 * nt; k < 4 * nt + 8; k += 2) {
            const float dropped0 = dropout_code(tSrS(k), keep[k - 4 * nt]);
            set_p_operand(k, dropped0, dropout_code(tSrS(k + 1), keep[k + 1 - 4 * nt]));
          }
        }
      } else {
#pragma unroll
        for (int k = 0; k < BM / 2; k += 2) set_p_operand(k, tSrS(k), tSrS(k + 1));
      }
    } else {
      if (m0 >= full_lo && m0 + BM <= full_hi) softmax_p(std::false_type{});
      else softmax_p(std::true_type{});
#pragma unroll
      for (int i = 0; i < BM / 2; i += 2) set_p_operand(i, tSrS(i), tSrS(i + 1));
    }

    // dV += P^T dO, running while dS is computed.
    warpgroup_fence_operand(tDrP);
    warpgroup_fence_operand(tDrdV);
    warpgroup_arrive();
    CUTE_UNROLL
    for (int kb = 0; kb < size<2>(tDrP); ++kb) gemm(mma_dkv, tDrP(_, _, kb), tDrdOt(_, _, kb, buf), tDrdV);
    warpgroup_commit_batch();
    warpgroup_wait<1>();  // dP^T landed; dV's product may still run
    warpgroup_fence_operand(tSrdP);

    // dS = P (dP - delta) scale, over the fp32 P (kDsFeatures: ds = P (dP keep
    // - delta), the bias gradient, then ds dcap scale).
    auto ds_times = [&](float factor) {
#pragma unroll
      for (int nt = 0; nt < BM / 8; ++nt) {
        const float2 dl = *reinterpret_cast<const float2*>(delta + nt * 8 + 2 * t);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int idx = 4 * nt + e;
          tSrdP(idx) = tSrS(idx) * (tSrdP(idx) - ((e & 1) ? dl.y : dl.x)) * factor;
        }
      }
    };
    if constexpr (kDsFeatures) {
      if (kDropout && p.dropout)
        dropout_decode<BM / 2>(p, [&](int k) -> float& { return tSrS(k); }, [&](int k) -> float& { return tSrdP(k); });
      ds_times(1.0f);
      if constexpr (kBias) {
        const DbiasSink dbias(p, b, hq, seq);
        if (dbias.summed_rows()) {
#pragma unroll
          for (int k = 0; k < BM / 2; ++k) dbias_sum[(k >> 1) & 1] += tSrdP(k);
          // The last tile of a head: its row sums of dS (uniform over the CTA).
          if (cur.m + 1 == m_tiles) dbias.write_row_sums(dbias_sum, n0 + key_row0, t);
        } else if (dbias.at) {
#pragma unroll
          for (int k = 0; k < BM / 2; ++k) dbias.store(tSrdP(k), row_of(k), col_of(k));
        }
      }
      if (kSoftcap && p.softcap > 0) {
        if constexpr (kBias) {
#pragma unroll
          for (int k = 0; k < BM / 2; ++k) tSrdP(k) *= half_dcap(dcap2, k);
        } else {
          // From P, whose registers are free now (the forms without a bias).
          auto lse2_of = [&](int k) { return (k & 1) ? lse_of(k / 4).y : lse_of(k / 4).x; };
          LogitCtx(p, b, hq, seq).softcap_derivative_from_p<BM / 2>([&](int k) -> float& { return tSrS(k); },
                                                                     lse2_of, row_of, col_of);
#pragma unroll
          for (int k = 0; k < BM / 2; ++k) tSrdP(k) *= tSrS(k);
        }
      }
#pragma unroll
      for (int k = 0; k < BM / 2; ++k) tSrdP(k) *= p.scale;
    } else {
      ds_times(p.scale);
    }
    // dS^T into shared memory for dK and dQ, four stmatrix groups (above
    // ds_stmatrix_offset).
    {
      const uint32_t ds_addr = ds_addr0 + buf * C::kDsBufferBytes;
      auto two = [&](int i) { return Pack<T>::two(tSrdP(i), tSrdP(i + 1)); };
#pragma unroll
      for (int nt = 0; nt < BM / 8; nt += 2)
        stmatrix_x4(ds_addr ^ (nt << 4), two(4 * nt), two(4 * nt + 2), two(4 * nt + 4), two(4 * nt + 6));
    }

    // dK += dS^T Q: reads this warpgroup's rows of dS^T, which only its
    // threads wrote.
    fence_async_shared();
    warpgroup_barrier(tid / 128);
    warpgroup_fence_operand(tDrdK);
    warpgroup_arrive();
    CUTE_UNROLL
    for (int kb = 0; kb < size<2>(tKrdSt); ++kb) gemm(mma_dk, tKrdSt(_, _, kb, buf), tKrQt(_, _, kb, buf), tDrdK);
    warpgroup_commit_batch();
    // dV's and dK's products landed: P^T's registers and the accumulators are
    // free, and (kTma) this warp is done with Q/dO buffer `buf` (dQ reads dS^T
    // and K only). With TMA, dK's product runs on through the dQ barrier and
    // this is called after dQ's product is issued.
    auto dkv_landed = [&] {
      warpgroup_fence_operand(tDrdV);
      warpgroup_fence_operand(tDrdK);
      warpgroup_fence_operand(tDrP);
      if constexpr (kTma) warp_arrive(empty + buf, lane);
    };
    if constexpr (!kTma) {
      warpgroup_wait<0>();
      dkv_landed();
    }

    // The next tile's statistics (buffer buf ^ 1 was last read by tile it - 1,
    // before the previous dQ barrier; the next barrier publishes them).
    if (has_next && tid < BM) {
      s_lse[(buf ^ 1) * BM + tid] = lse2_of(next_stats.lse);
      s_delta[(buf ^ 1) * BM + tid] = next_stats.delta;
    }

    // dQ of this tile once both warpgroups' dS^T is in shared memory.
    auto tQrdS_buf = tQrdS(_, _, _, buf);
    if constexpr (kFuseDq && kTma) {
      consumers_sync();  // (this thread's dS^T stores were fenced before the warpgroup barrier)
      if (dq_warpgroup(it)) {  // both at head dim 128, one by turns at 64
        warpgroup_gemm<true, false, false>(mma_dq, tQrdS_buf, tQrKt, tQrdQ);
        warpgroup_wait<1>();  // the groups complete in order: dV and dK first
        dkv_landed();
        warpgroup_wait_all(tQrdQ);
        if constexpr (kPacked) {
          // Rows past the sequence are the next one's in the workspace: zeros
          // there add nothing (not even a NaN of this sequence's own).
#pragma unroll
          for (int h = 0; h < 2; ++h)
            if (m0 + dq_row0 + 8 * h >= seq.sq)
#pragma unroll
              for (int nt = 0; nt < 8; ++nt) tQrdQ(4 * nt + 2 * h) = tQrdQ(4 * nt + 2 * h + 1) = 0.0f;
        }
        // Buffer `buf` was last staged for tile it - 2: the dQ warp says when
        // the unit has read it.
        if (it >= 2) bar_sync<kDqBarrierThreads>(kDqEmptyBarrier + buf);
        float* stage = s_dq + buf * BM * DB + C::dq_stage_base(dq_row0, dq_col0);
        const int chunk = C::dq_stage_chunk(dq_row0, dq_col0);
#pragma unroll
        for (int nt = 0; nt < 8; ++nt)
#pragma unroll
          for (int h = 0; h < 2; ++h)
            *reinterpret_cast<float2*>(stage + C::dq_stage_offset(chunk, nt, h)) =
                make_float2(tQrdQ(4 * nt + 2 * h), tQrdQ(4 * nt + 2 * h + 1));
        fence_async_shared();  // the stores, seen by the unit's reads
        bar_arrive<kDqBarrierThreads>(kDqFullBarrier + buf);
      } else {
        warpgroup_wait<0>();
        dkv_landed();
      }
    } else if constexpr (kFuseDq) {
      fence_async_shared();
      consumers_sync();
      if (dq_warpgroup(it)) {
        warpgroup_gemm<true, false>(mma_dq, tQrdS_buf, tQrKt, tQrdQ);
        float* out = p.dq_accum + b * p.dqa_sb + (seq.q0 + m0) * p.dqa_sr + hq * p.dqa_sh + dq_col0;
#pragma unroll
        for (int nt = 0; nt < 8; ++nt)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int r = dq_row0 + 8 * h;
            if (m0 + r < seq.sq)
              atomicAdd(reinterpret_cast<float2*>(out + r * p.dqa_sr + nt * 8),
                        make_float2(tQrdQ(4 * nt + 2 * h), tQrdQ(4 * nt + 2 * h + 1)));
          }
      }
    }
    cur = next;
  }
  if constexpr (!kTma) cp_async_wait<0>();

  // dK and dV, staged in the Q and dO buffers.
  consumers_sync();  // every product is done with Q and dO
  store_dk_dv<T, DB, BN, DB / 8>(tDrdK, tDrdV, q_s, do_s, key_row0 - g, 0, tid, dk, p.dk_sr, dv, p.dv_sr, cols,
                                 consumers_sync);
}

}  // namespace symheap::attention::cuda
