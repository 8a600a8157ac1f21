// Persistent form of the TMA-fed pingpong forward (head dims 128, 64 and 256,
// no logit features, batch layout): one CTA an SM walks query blocks (work items)
// instead of one CTA a block, so what a block costs besides its key tiles
// (barrier setup, the wait for Q and the first K/V tile, the output) overlaps
// the neighbouring blocks' tiles: the producer loads the next item's Q once
// both consumer warpgroups issued their last S product of the current one,
// and its K/V tiles as soon as stages free, while the consumers finish.
// The per-tile arithmetic is that of attention_fwd_hopper_kernel's kTma form
// (same bits). The output goes from registers to memory (the Q buffer, where
// the other kernels stage it, already holds the next item's Q).
// The order of the blocks: walk_item. kWide (head dim 64): three consumer
// warpgroups (HopperWideConfig), taking their turns on the tensor cores in a
// ring as the two do; each row's arithmetic is the same, so the same bits.
#pragma once
#include "ops/attention/cuda_forward_hopper.cuh"

namespace symheap::attention::cuda {

namespace hopper {
// Query block (its first row m0), head and batch entry of a CTA's u-th step.
// CTA i takes work units i, i + grid, ...; a unit is one query block, or with
// `paired` two blocks of one (head, batch entry): the heaviest under a causal
// mask (the last) then the lightest (the first), the second last with the
// second, ..., so every unit costs the same (blocks_m + 1 key tiles) and the
// CTAs get equal work. `none`: the second of an odd middle pair.
struct FwdItem {
  int m0, hq, b;
  bool none;
};
__device__ __forceinline__ bool walk_item(const KArgs& p, int u, int block_rows, bool paired, FwdItem* it) {
  const int blocks_m = (p.seqlen_q + block_rows - 1) / block_rows;
  const int per_unit = paired ? 2 : 1, units_m = (blocks_m + per_unit - 1) / per_unit;
  const int64_t unit = blockIdx.x + static_cast<int64_t>(u / per_unit) * gridDim.x;
  if (unit >= static_cast<int64_t>(units_m) * p.heads_q * p.batch) return false;
  const int j = static_cast<int>(unit % units_m), rest = static_cast<int>(unit / units_m);
  const bool second = paired && (u & 1);
  const int m = second ? j : blocks_m - 1 - j;
  *it = FwdItem{m * block_rows, rest % p.heads_q, rest / p.heads_q, second && m == blocks_m - 1 - j};
  return true;
}
}  // namespace hopper

// The persistent kernels' tiles: the pingpong kernels', or the wide form's.
template <class T, int DB, bool kWide>
using HopperPersistentConfig = std::conditional_t<kWide, HopperWideConfig<T>, HopperPingpongConfig<T, DB>>;

template <class T, int DB, bool kLean, bool kWide = false>
__global__ void __launch_bounds__(128 + HopperPersistentConfig<T, DB, kWide>::kThreads, 1)
    attention_fwd_hopper_persistent_kernel(const KArgs p, const __grid_constant__ FwdTmaMaps maps, bool paired) {
  using namespace cute;
  using namespace hopper;
  static_assert(!kWide || DB == 64, "the wide persistent form serves head dim 64");
  using C = HopperPersistentConfig<T, DB, kWide>;
  constexpr int kStages = C::kStageCount;
  constexpr bool kPvInFlight = kPvInFlightStages<kStages>;
  static_assert(C::kSmem + sizeof(uint64_t) <= 227 * 1024, "a CTA's shared memory");
  using E = typename C::E;
  constexpr int BM = C::kBlockM, BN = C::kBlockN, NT = C::kThreads;  // NT: the consumers
  constexpr float kLog2e = 1.4426950408889634f;
  extern __shared__ unsigned char smem_raw[];
  E* q_s = reinterpret_cast<E*>(smem_raw + ((1024 - smem_addr(smem_raw) % 1024) % 1024));
  E* k_s = q_s + C::kQElems;
  E* v_s = k_s + C::kKVElems;
  Tensor sQ = make_tensor(make_smem_ptr(q_s), typename C::SmemQ{});
  Tensor sK = make_tensor(make_smem_ptr(k_s), typename C::SmemKV{});
  Tensor sV = make_tensor(make_smem_ptr(v_s), typename C::SmemKV{});
  Tensor sVt = make_tensor(make_smem_ptr(v_s), typename C::SmemVt{});
  // full[s], empty[s] per K/V stage, then Q's full and empty (kBarrierBytes
  // has room for 2 kStages + 1; the empty one takes the alignment's slack).
  uint64_t* full = reinterpret_cast<uint64_t*>(v_s + C::kKVElems);
  uint64_t* empty = full + kStages;
  uint64_t* q_full = empty + kStages;
  uint64_t* q_empty = q_full + 1;

  // Key tiles [n_begin, n_end) of an item, as the other kernels find them.
  auto key_tiles = [&](const FwdItem& it, const Seq& seq, detail::KeyRange* first, detail::KeyRange* last) {
    const int rows = min(BM, seq.sq - it.m0);
    *first = detail::visible_keys(it.m0, seq.sq, seq.sk, p.win_left, p.win_right);
    *last = detail::visible_keys(it.m0 + rows - 1, seq.sq, seq.sk, p.win_left, p.win_right);
  };

  if (threadIdx.x == 0) {
    for (int i = 0; i < kStages; ++i) {
      mbar_init(full + i, 1);
      mbar_init(empty + i, NT / 32);
    }
    mbar_init(q_full, 1);
    mbar_init(q_empty, NT / 32);
    mbar_fence_init();
  }
  __syncthreads();

  if (threadIdx.x < 128) {
    registers_down<24>();
    if (threadIdx.x == 0) {
      constexpr uint32_t kHalf = 64 * sizeof(E);  // bytes of a box row
      constexpr int kBoxes = DB / 64;              // boxes a tile (64 columns each)
      int tile = 0, k = 0;                         // K/V tiles and items so far
      FwdItem it;
      for (int u = 0; walk_item(p, u, BM, paired, &it); ++u) {
        const Seq seq = sequence(p, it.b);
        if (it.none || it.m0 >= seq.sq) continue;  // (the consumers skip it too)
        detail::KeyRange first, last;
        key_tiles(it, seq, &first, &last);
        const int n_begin = first.lo / BN * BN, n_end = last.hi;
        // Both consumer warpgroups issued their last S product of item k - 1.
        if (k > 0) mbar_wait(q_empty, (k - 1) & 1);
        mbar_arrive_expect_tx(q_full, kBoxes * BM * kHalf);
        for (int h = 0; h < kBoxes; ++h)
          tma_load_4d(at(sQ, 0, 64 * h), &maps.q, q_full, 64 * h, it.m0, it.hq, it.b);
        const int hk = it.hq / p.group;
        for (int n0 = n_begin; n0 < n_end; n0 += BN, ++tile) {
          const int s = tile % kStages;
          if (tile >= kStages) mbar_wait(empty + s, ((tile / kStages) + 1) & 1);
          mbar_arrive_expect_tx(full + s, 2 * kBoxes * BN * kHalf);
          for (int h = 0; h < kBoxes; ++h) {
            tma_load_4d(at(sK, 0, 64 * h, s), &maps.k, full + s, 64 * h, n0, hk, it.b);
            tma_load_4d(at(sV, 0, 64 * h, s), &maps.v, full + s, 64 * h, n0, hk, it.b);
          }
        }
        ++k;
      }
    }
    return;
  }
  // (the producer's 24 and the consumers' registers fill the SM's 64K)
  registers_up<kWide ? 160 : 240>();

  const int tid = static_cast<int>(threadIdx.x) - 128, lane = tid % 32, g = lane >> 2, t = lane & 3;
  const int wg = tid / 128;
  constexpr int kWarpgroups = NT / 128;
  const int warp_row0 = (tid / 32) * 16;  // this warp's first row (warpgroup w: rows 64 w ..)
  typename C::MmaS mma_s;
  typename C::MmaO mma_o;
  auto thr_s = mma_s.get_thread_slice(tid);
  auto thr_o = mma_o.get_thread_slice(tid);
  Tensor tSrQ = thr_s.partition_fragment_A(sQ);
  Tensor tSrK = thr_s.partition_fragment_B(sK);
  Tensor tOrVt = thr_o.partition_fragment_B(sVt);
  Tensor tSrS = partition_fragment_C(mma_s, Shape<Int<BM>, Int<BN>>{});
  Tensor tOrO = partition_fragment_C(mma_o, Shape<Int<BM>, Int<DB>>{});
  Tensor tOrP = make_tensor<E>(partition_shape_A(mma_o, Shape<Int<BM>, Int<BN>>{}));
  const float scale_log2 = p.scale * kLog2e;

  int tile = 0, k = 0;
  FwdItem item;
  for (int u = 0; walk_item(p, u, BM, paired, &item); ++u) {
    const int m0 = item.m0, hq = item.hq, b = item.b;
    const Seq seq = sequence(p, b);
    if (item.none || m0 >= seq.sq) continue;
    auto row = [&](int h) { return m0 + warp_row0 + g + 8 * h; };
    detail::KeyRange first, last;
    key_tiles(item, seq, &first, &last);
    const int n_begin = first.lo / BN * BN, n_end = last.hi;

    clear(tOrO);
    float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.0f, 0.0f};
    mbar_wait(q_full, k & 1);
    bool q_released = false;
    // This warp's part of "both warpgroups are done reading Q" (after its
    // warpgroup's last S product; at once for an item without key tiles).
    auto release_q = [&] {
      warp_arrive(q_empty, lane);
      q_released = true;
    };

    for (int n0 = n_begin, it = 0; n0 < n_end; n0 += BN, ++it, ++tile) {
      const int buf = tile % kStages;
      mbar_wait(full + buf, (tile / kStages) & 1);
      // Turns in a ring: warpgroup w issues its S product after w - 1's, and
      // the first one an item's first product at once (the last one does not
      // hand its last turn of an item on).
      if (wg > 0 || it > 0) named_barrier_sync(1 + wg);
      warpgroup_gemm<true, false, false>(mma_s, tSrQ, tSrK(_, _, _, buf), tSrS);
      if (wg + 1 < kWarpgroups || n0 + BN < n_end) named_barrier_arrive(1 + (wg + 1) % kWarpgroups);
      warpgroup_wait_all(tSrS);
      // The previous tile's P V product (issued before this S product, which
      // completes after it) landed: O and P are free, its stage is released.
      if (kPvInFlight && it > 0) pv_landed(tOrO, tOrP, empty + (tile + kStages - 1) % kStages, lane);
      if (n0 + BN >= n_end) release_q();

      // Logits in log2 units (raw scores for kLean); -inf where hidden.
      if (n0 >= last.lo && n0 + BN <= first.hi) scale_logits<kLean, BN>(tSrS, scale_log2);
      else mask_logits<kLean, BN>(tSrS, n0, t, row, seq, p, scale_log2);
      if constexpr (kLean) {
        lean_softmax<DB, BN>(tSrS, tOrO, row_max, row_sum, scale_log2);
      } else {
        float base[2];
        online_rescale<DB, BN>(tSrS, tOrO, row_max, row_sum, base);
#pragma unroll
        for (int nt = 0; nt < BN / 8; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const float x = exp2_fast(tSrS(4 * nt + e) - base[e >> 1]);
            row_sum[e >> 1] += x;
            tSrS(4 * nt + e) = x;
          }
      }
      pack_p<T, BN>(tSrS, tOrP);
      // kPvInFlight: not waited for here; the next tile's S product queues behind it.
      warpgroup_gemm<false, true, !kPvInFlight>(mma_o, tOrP, tOrVt(_, _, _, buf), tOrO);
      if constexpr (!kPvInFlight) warp_arrive(empty + buf, lane);
    }
    // (ptxas adds a wait where this block and the path without key tiles meet,
    // its note C7517: it cannot tell that nothing is in flight there. No cost.)
    if (kPvInFlight && n_begin < n_end) {
      warpgroup_wait<0>();
      pv_landed(tOrO, tOrP, empty + (tile + kStages - 1) % kStages, lane);
    }
    if (!q_released) release_q();
    ++k;

    // The output straight from the accumulators (4-byte pairs), and lse.
    float inv[2], lse[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) finish_row(row_max[h], row_sum[h], inv + h, lse + h);
    if (t == 0) {
      float* l = p.lse + b * p.lse_sb + hq * p.lse_sh + seq.q0;
      if (row(0) < seq.sq) l[row(0)] = lse[0];
      if (row(1) < seq.sq) l[row(1)] = lse[1];
    }
    E* out = static_cast<E*>(p.out) + b * p.o_sb + (seq.q0 + m0 + warp_row0 + g) * p.o_sr + hq * p.o_sh + 2 * t;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if (row(h) >= seq.sq) continue;
#pragma unroll
      for (int dt = 0; dt < DB / 8; ++dt)
        *reinterpret_cast<uint32_t*>(out + 8 * h * p.o_sr + dt * 8) =
            Pack<T>::two(tOrO(4 * dt + 2 * h) * inv[h], tOrO(4 * dt + 2 * h + 1) * inv[h]);
    }
  }
}

}  // namespace symheap::attention::cuda
