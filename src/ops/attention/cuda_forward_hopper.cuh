// Hopper forward kernel (sm_90a; head dims 64, 128 and 256, exactly): both
// products on the warpgroup tensor-core instructions (wgmma). One CTA per 128
// query rows, two warpgroups of 64 rows each. S = Q K^T reads Q and K from
// shared memory (128-byte swizzled, the layout wgmma's descriptors name);
// O += P V takes P from registers (the fp32 accumulator of S converted in
// place: the wgmma accumulator and register-operand layouts line up, as for
// mma.sync) and V from shared memory, read transposed by the instruction.
// K and V tiles stream through two shared-memory buffers each with cp.async
// (tile j+1 loads while tile j is computed; one barrier a tile); at head dim
// 128 without logit features, through three, with the warpgroups taking
// turns on the tensor cores (kPingpong). Its TMA-fed form (kTma) is the
// default where TMA can address the call: three stages at head dim 128, four
// at 64, two at 256 (there $SYMHEAP_ATTN_FWD_D64_TMA / _D256_TMA = 0 keep the
// lockstep kernel). The softmax
// (kLean: its lean form without logit features and for a positive scale), the
// masks and the logit features are those of the pipelined kernel
// (cuda_forward_pipelined.cuh):
// each thread holds rows g and g + 8 of its warp's 16, columns 2t, 2t + 1 of
// every 8, exactly as there.
// CuTe (CUTLASS's headers, the nvidia-cutlass wheel) builds the swizzled
// layouts and the wgmma descriptors; nothing else of CUTLASS is used.
#pragma once
#include <cuda.h>

#include <type_traits>

#include <cute/arch/mma_sm90.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cute/tensor.hpp>

#include "ops/attention/cuda_forward_pipelined.cuh"

namespace symheap::attention::cuda {

namespace hopper {
template <class T>
struct CuteType;
template <>
struct CuteType<__half> {
  using type = cute::half_t;
};
template <>
struct CuteType<__nv_bfloat16> {
  using type = cute::bfloat16_t;
};
}  // namespace hopper

// kStages: K and V buffers each (2; more for the kernel whose warpgroups take
// turns on the tensor cores, kPingpong below: HopperPingpongConfig).
// kBN: keys a tile. The lockstep kernel takes 128 at head dim 128; 64 at 256
// (the output accumulator takes 128 registers a thread) and at 64, where a
// thread then needs at most 128 registers, so two CTAs share an SM and one's
// softmax runs while the other's products do.
// kMbarriers: room for the pingpong kernel's mbarriers (its configs set it;
// only the two-stage lockstep kernel goes without).
// kWarpgroups: consumer warpgroups, 64 query rows each (2; 3 in the wide
// persistent form at head dim 64, HopperWideConfig).
template <class T, int DB, int kStages = 2, int kBN = DB == 128 ? 128 : 64, bool kMbarriers = (kStages > 2),
          int kWarpgroups = 2>
struct HopperFwdConfig {
  static_assert(DB == 64 || DB == 128 || DB == 256, "the Hopper forward serves head dims 64, 128 and 256");
  using E = typename hopper::CuteType<T>::type;
  static constexpr int kBlockM = 64 * kWarpgroups;
  static constexpr int kBlockN = kBN;
  static constexpr int kStageCount = kStages;
  // CTAs per SM (the register cap of __launch_bounds__); the logit features
  // would spill under 128 registers.
  static constexpr int min_blocks(bool features) { return DB == 64 && !features ? 2 : 1; }
  static constexpr int kThreads = 128 * kWarpgroups;  // warpgroups of 64 query rows

  using BM = cute::Int<kBlockM>;
  using BN = cute::Int<kBlockN>;
  using D = cute::Int<DB>;
  // S (BM x BN) = Q (BM x DB) K^T; each warpgroup takes 64 rows.
  using MmaS = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<E, E, float, cute::Shape<cute::_64, BN, D>>(),
      cute::Layout<cute::Shape<cute::Int<kWarpgroups>, cute::_1, cute::_1>>{}));
  // O (BM x DB) += P (BM x BN, registers) V; V is stored keys x DB, so as
  // the B operand (DB x keys) it is MN-major.
  using MmaO = decltype(cute::make_tiled_mma(
      cute::GMMA::rs_op_selector<E, E, float, cute::Shape<cute::_64, D, BN>, cute::GMMA::Major::K,
                                 cute::GMMA::Major::MN>(),
      cute::Layout<cute::Shape<cute::Int<kWarpgroups>, cute::_1, cute::_1>>{}));
  using SmemQ = decltype(cute::tile_to_shape(cute::GMMA::Layout_K_SW128_Atom<E>{}, cute::Shape<BM, D>{}));
  // K and V: kStages buffers each (the third mode).
  using Stages = cute::Int<kStages>;
  using SmemKV =
      decltype(cute::tile_to_shape(cute::GMMA::Layout_K_SW128_Atom<E>{}, cute::Shape<BN, D, Stages>{}));
  // V^T: the same bytes seen as DB x keys.
  using SmemVt = decltype(cute::composition(
      SmemKV{}, cute::make_ordered_layout(cute::Shape<D, BN, Stages>{},
                                          cute::Step<cute::_2, cute::_1, cute::_3>{})));
  static constexpr int kQElems = cute::cosize_v<SmemQ>;
  static constexpr int kKVElems = cute::cosize_v<SmemKV>;
  // The swizzle repeats every 1024 bytes and is applied by the hardware to
  // addresses: every tile starts 1024-byte aligned (the base is aligned in
  // the kernel, hence the extra 1024).
  static_assert((kQElems * sizeof(E)) % 1024 == 0 && (kKVElems * sizeof(E)) % 1024 == 0, "1024-byte tiles");
  // The pingpong kernel's mbarriers (a full and an empty one per stage) follow V
  // (and, in the TMA kernel, Q's one).
  static constexpr size_t kBarrierBytes = kMbarriers ? (2 * kStages + 1) * sizeof(uint64_t) : 0;
  static constexpr size_t kSmem = sizeof(E) * (kQElems + 2 * kKVElems) + 1024 + kBarrierBytes;
  // The logit features' kernel also keeps each warp's 16 rows x kBlockN keys
  // of a 16-bit bias, two tiles (the next one flies with K and V); 225 KiB in
  // all at head dims 128 and 256.
  static constexpr int kBiasElems = 2 * 8 * 16 * kBlockN;
  static constexpr size_t smem(bool features) { return kSmem + (features ? 2 * kBiasElems : 0); }
  // The TMA-fed feature kernel's kMaskRows form stages each warp's 16 rows x
  // kBlockN keys of a byte mask, two tiles (the next one flies during this
  // one's softmax and products), after the mbarriers. Rows are padded by 16
  // bytes, so the 8 rows one read of the accumulator layout touches start in
  // 8 bank groups. Only where it fits (head dims 64 and 256: at 128 the
  // three K/V stages leave under 2 KiB).
  static constexpr int kMaskRow = kBlockN + 16;
  static constexpr size_t kMaskStageBytes = 8 * 2 * 16 * kMaskRow;
  static constexpr size_t smem_mask_rows() { return kSmem + 128 + kMaskStageBytes; }
  static constexpr bool kMaskStage = smem_mask_rows() <= 227 * 1024;
};

// The pingpong kernels' tiles (one CTA an SM, so no occupancy to keep): 128
// keys a tile at head dims 128 and 64 (at 64, S takes 64 registers a thread
// and O 32, far below the consumers' 240). K/V stages: 3 at 128 (48 KiB
// each, 176 KiB with Q); 4 at 64, where a tile's products take half as long
// as at 128, so more tiles fly to cover the copies' latency (32 KiB each,
// 144 KiB with Q). At 256: 64 keys a tile, as the lockstep kernel (O takes
// 128 registers a thread, S 32, P 16) and two stages of 64 KiB (192 KiB with
// Q's 64; a third would pass the 227 KiB an SM gives a CTA). Two are enough
// with TMA: the producer refills a stage once both warpgroups released it
// (its empty mbarrier), where the cp.async feed copies two tiles ahead.
template <class T, int DB>
using HopperPingpongConfig =
    HopperFwdConfig<T, DB, DB == 64 ? 4 : DB == 128 ? 3 : 2, DB == 256 ? 64 : 128, true>;
// The persistent forward's wide form at head dim 64: three consumer
// warpgroups (192 query rows a block) over the same 128-key tiles and four
// stages, 160 registers a consumer thread. The form with two waits on the
// tensor cores more than it queues on them (bench/attn_notes.md 22: 0.52
// eligible warps a scheduler); a third warpgroup's softmax fills those waits.
template <class T>
using HopperWideConfig = HopperFwdConfig<T, 64, 4, 128, true, 3>;
// Whether the pingpong kernels leave a tile's P V product running into the
// next tile's turn (waited for with the next S product, the tile's K/V stage
// released then): forward 1.03-1.10x at head dim 64 and 0.97-1.08x at 128 on
// H100, where there are four and three stages; 0.93-0.98x at 256, whose two
// stages make the producer wait for the later release (bench/RESULTS.md,
// tenth set).
template <int kStages>
inline constexpr bool kPvInFlightStages = kStages > 2;
// The config of attention_fwd_hopper_kernel's form.
template <class T, int DB, bool kPingpong>
using HopperFwdKernelConfig = std::conditional_t<kPingpong, HopperPingpongConfig<T, DB>, HopperFwdConfig<T, DB>>;

namespace hopper {

// The copies of the pipelined kernel.
using pipelined::cp_async16;
using pipelined::cp_async16_bytes;
using pipelined::cp_async_commit;
using pipelined::cp_async_wait;
using pipelined::smem_addr;

// Shared memory written through the generic proxy (cp.async, stores) made
// visible to the async proxy that wgmma reads it through.
__device__ __forceinline__ void fence_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// Four 8 x 8 matrices of 16-bit elements into shared memory (stmatrix):
// register j holds matrix j's elements (row lane / 4, columns 2 (lane % 4) and
// + 1, as a wgmma accumulator pair packed), and lane l gives the shared-window
// address of row l % 8 of matrix l / 8 (16 contiguous bytes).
__device__ __forceinline__ void stmatrix_x4(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r0), "r"(r1),
               "r"(r2), "r"(r3)
               : "memory");
}

// mbarriers (shared memory, 8 bytes each) for the pingpong kernel.
__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}
// This warp's one arrival on `bar` (barriers counted in warps), once all its
// lanes got here.
__device__ __forceinline__ void warp_arrive(uint64_t* bar, int lane) {
  __syncwarp();
  if (lane == 0) mbar_arrive(bar);
}
// Arrives on `bar` once every cp.async this thread issued so far has landed
// (the count of the barrier's phase includes this thread's arrival).
__device__ __forceinline__ void mbar_arrive_on_copies(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}
// Waits until the phase of parity `parity` of `bar` has completed.
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n"
      "}\n" ::"r"(smem_addr(bar)),
      "r"(parity)
      : "memory");
}
// Named barriers of both warpgroups (256 threads): one side waits, the other
// arrives without waiting. Ids 1 and 2 (0 is __syncthreads').
__device__ __forceinline__ void named_barrier_sync(int id) {
  asm volatile("bar.sync %0, 256;\n" ::"r"(id) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(int id) {
  asm volatile("bar.arrive %0, 256;\n" ::"r"(id) : "memory");
}

// The producer warpgroup of the TMA kernel (kTma): one thread's bulk tensor
// copies fill a stage and complete its mbarrier's transaction count.
__device__ __forceinline__ void mbar_fence_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes)
               : "memory");
}
// The box at coordinates (c0 .. c3) of `map` into shared memory at `dst`;
// its bytes count against `bar`'s transaction count.
__device__ __forceinline__ void tma_load_4d(void* dst, const CUtensorMap* map, uint64_t* bar, int c0, int c1,
                                            int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5, %6}], [%2];\n" ::"r"(smem_addr(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_addr(bar)), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}
// Registers move from the producer warpgroup to the two consumer ones.
template <int N>
__device__ __forceinline__ void registers_down() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void registers_up() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}

// Element (r, c) of a shared tile. The layouts' swizzle acts on byte
// addresses, so an element's place comes through the tensor (which applies it
// to the pointer), never from the layout's own offsets.
template <class Tensor, class... Coord>
__device__ __forceinline__ auto* at(Tensor& s, Coord... coord) {
  return cute::raw_pointer_cast(&s(coord...));
}

// Rows [0, ROWS) of a global tile (row stride in elements, DB columns) into
// the shared tile `s` (rows x DB); rows >= valid_rows become zeros. `g` must
// point at a readable row.
template <int ROWS, int DB, int NT, class E, class Tensor>
__device__ __forceinline__ void load_tile(Tensor s, const E* g, int64_t row_stride, int valid_rows) {
  constexpr int kChunks = DB / 8;
  static_assert((ROWS * kChunks) % NT == 0, "whole tile rounds per thread");
#pragma unroll
  for (int it = 0; it < ROWS * kChunks / NT; ++it) {
    const int idx = static_cast<int>(threadIdx.x) + it * NT;
    const int r = idx / kChunks, c = idx % kChunks;
    const bool ok = r < valid_rows;
    cp_async16(smem_addr(at(s, r, c * 8)), ok ? g + r * row_stride + c * 8 : g, ok);
  }
}

// A warp's 16 mask rows (query rows i0 .. i0 + 15) x BN keys from key n0 into
// `s` (16 rows of kRow bytes). Rows past sq and keys past sk become zeros
// (hidden; their logits are hidden by the sequence's ends anyway).
template <int BN, int kRow>
__device__ __forceinline__ void load_mask_rows(uint8_t* s, const uint8_t* mask, const KArgs& p, int i0, int n0,
                                               int sq, int sk, int lane) {
  constexpr int kChunks = BN / 16;
  static_assert((16 * kChunks) % 32 == 0 && kRow % 16 == 0, "whole 16-byte chunks per lane");
#pragma unroll
  for (int it = 0; it < 16 * kChunks / 32; ++it) {
    const int idx = lane + it * 32, r = idx / kChunks, c = idx % kChunks;
    const int i = i0 + r, j = n0 + c * 16;
    const int bytes = i < sq ? max(0, min(16, sk - j)) : 0;
    const uint8_t* src = bytes ? mask + i * p.mask_sq + j : mask;
    cp_async16_bytes(smem_addr(s + r * kRow + c * 16), src, bytes);
  }
}

// One warpgroup product C (+)= A B, issued and (kWait) waited for. kZeroInit:
// C = A B; kRegA: A is a register fragment (else shared-memory descriptors).
// Without kWait, warpgroup_wait_all(c) ends it.
template <bool kZeroInit, bool kRegA, bool kWait = true, class Mma, class TA, class TB, class TC>
__device__ __forceinline__ void warpgroup_gemm(Mma& mma, TA& a, const TB& b, TC& c) {
  using namespace cute;
  if constexpr (kRegA) warpgroup_fence_operand(a);
  warpgroup_fence_operand(c);
  warpgroup_arrive();
  if constexpr (kZeroInit) mma.accumulate_ = GMMA::ScaleOut::Zero;
  CUTE_UNROLL
  for (int kb = 0; kb < size<2>(a); ++kb) {
    gemm(mma, a(_, _, kb), b(_, _, kb), c);
    mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
  if constexpr (kWait) {
    warpgroup_wait<0>();
    warpgroup_fence_operand(c);
    if constexpr (kRegA) warpgroup_fence_operand(a);
  }
}
template <class TC>
__device__ __forceinline__ void warpgroup_wait_all(TC& c) {
  cute::warpgroup_wait<0>();
  cute::warpgroup_fence_operand(c);
}

// A warp's 16 bias rows (query rows i0 .. i0 + 15) x BN keys from key n0 into
// `s` (16 x BN, 16-bit): chunk c of row r lands at chunk c ^ (r % 8), so the
// 8 rows that one read of the accumulator layout touches hit 8 bank groups.
// Rows past sq and keys past sk become zeros (their logits are hidden).
template <int BN>
__device__ __forceinline__ void load_bias_rows(uint16_t* s, const char* bias, const KArgs& p, int i0, int n0,
                                               int sq, int sk, int lane) {
  constexpr int kChunks = BN / 8;
  const uint16_t* g = reinterpret_cast<const uint16_t*>(bias);
#pragma unroll
  for (int it = 0; it < 16 * kChunks / 32; ++it) {
    const int idx = lane + it * 32, r = idx / kChunks, c = idx % kChunks;
    const int i = i0 + r, j = n0 + c * 8;
    const int bytes = i < sq ? 2 * max(0, min(8, sk - j)) : 0;
    const uint16_t* src = bytes ? g + i * p.bias_sq + j : g;
    cp_async16_bytes(smem_addr(s + r * BN + ((c ^ (r & 7)) << 3)), src, bytes);
  }
}

// A row's 1 / sum (0 without a visible key: zeros, not NaN) and its lse from
// the running max (log2 units) and this thread's part of the sum. One fused
// multiply-add, written out, so every kernel that calls it gives the same bits.
__device__ __forceinline__ void finish_row(float row_max, float thread_sum, float* inv, float* lse) {
  constexpr float kLn2 = 0.6931471805599453f;
  const float sum = quad_sum(thread_sum);
  *inv = sum > 0.0f ? 1.0f / sum : 0.0f;
  *lse = sum > 0.0f ? __fmaf_rn(row_max, kLn2, __logf(sum)) : -INFINITY;
}

// The per-tile softmax steps of the kernels without logit features (the
// kernels below and the persistent form), element i of a thread's fragment
// being row g + 8 h, key 8 nt + 2 t + c (i = 4 nt + 2 h + c).

// Logits in log2 units (raw scores for kLean, whose softmax scales inside its
// FFMA), for a tile every row of the block sees whole.
template <bool kLean, int BN, class FragS>
__device__ __forceinline__ void scale_logits(FragS& tSrS, float scale_log2) {
  if constexpr (!kLean) {
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) tSrS(i) *= scale_log2;
  }
}

// The same for any other tile, -inf at the keys a row does not see.
template <bool kLean, int BN, class FragS, class Row>
__device__ __forceinline__ void mask_logits(FragS& tSrS, int n0, int t, Row row, const Seq& seq, const KArgs& p,
                                            float scale_log2) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const detail::KeyRange r = detail::visible_keys(row(h), seq.sq, seq.sk, p.win_left, p.win_right);
#pragma unroll
    for (int nt = 0; nt < BN / 8; ++nt)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int i = 4 * nt + 2 * h + c, j = n0 + nt * 8 + 2 * t + c;
        const float x = kLean ? tSrS(i) : tSrS(i) * scale_log2;
        tSrS(i) = j >= r.lo && j < r.hi ? x : -INFINITY;
      }
  }
}

// This thread's max of row h (g + 8 h) over the tile.
template <int BN, class FragS>
__device__ __forceinline__ float row_tile_max(const FragS& tSrS, int h) {
  float m = -INFINITY;
#pragma unroll
  for (int nt = 0; nt < BN / 8; ++nt) m = fmaxf(m, fmaxf(tSrS(4 * nt + 2 * h), tSrS(4 * nt + 2 * h + 1)));
  return m;
}

// The pipelined kernel's lean softmax (cuda_forward_pipelined.cuh): the max
// of raw scores (scale > 0), the scale inside the exp2's FFMA, and a row's
// base moves only when a tile's max passes it by 2^8, so the output is
// rescaled only when some base of the warp moved. P replaces the logits.
template <int DB, int BN, class FragS, class FragO>
__device__ __forceinline__ void lean_softmax(FragS& tSrS, FragO& tOrO, float* row_max, float* row_sum,
                                             float scale_log2) {
  constexpr float kStaleMax = 8.0f;
  float neg_base[2], rescale[2];
  bool moved = false;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float tile_m = quad_max(row_tile_max<BN>(tSrS, h)) * scale_log2;
    const float m_new = tile_m > row_max[h] + kStaleMax ? tile_m : row_max[h];
    const float base = m_new == -INFINITY ? 0.0f : m_new;  // nothing visible yet
    moved |= m_new != row_max[h];
    rescale[h] = exp2_fast(row_max[h] - base);
    row_sum[h] *= rescale[h];
    row_max[h] = m_new;
    neg_base[h] = -base;
  }
  if (__any_sync(0xffffffffu, moved)) {
#pragma unroll
    for (int i = 0; i < DB / 2; ++i) tOrO(i) *= rescale[(i >> 1) & 1];
  }
#pragma unroll
  for (int i = 0; i < BN / 2; ++i) {
    const float x = exp2_fast(fmaf(tSrS(i), scale_log2, neg_base[(i >> 1) & 1]));
    row_sum[(i >> 1) & 1] += x;
    tSrS(i) = x;
  }
}

// Online softmax, first step: the new running max of each row, what was
// summed so far rescaled to it; base[h] is what the tile's exp2 subtracts.
template <int DB, int BN, class FragS, class FragO>
__device__ __forceinline__ void online_rescale(const FragS& tSrS, FragO& tOrO, float* row_max, float* row_sum,
                                               float* base) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float m_new = fmaxf(row_max[h], quad_max(row_tile_max<BN>(tSrS, h)));
    base[h] = m_new == -INFINITY ? 0.0f : m_new;  // a row with nothing visible yet
    const float rescale = exp2_fast(row_max[h] - base[h]);
    row_max[h] = m_new;
    row_sum[h] *= rescale;
#pragma unroll
    for (int dt = 0; dt < DB / 8; ++dt) {
      tOrO(4 * dt + 2 * h) *= rescale;
      tOrO(4 * dt + 2 * h + 1) *= rescale;
    }
  }
}

// A pingpong kernel's P V product of a tile landed (kPvInFlight: waited for
// with the next tile's S product, or after the last tile): O and P may be
// touched from here on, and the tile's K/V stage is released (this warp's part).
template <class FragO, class FragP>
__device__ __forceinline__ void pv_landed(FragO& tOrO, FragP& tOrP, uint64_t* stage_empty, int lane) {
  cute::warpgroup_fence_operand(tOrO);
  cute::warpgroup_fence_operand(tOrP);
  warp_arrive(stage_empty, lane);
}

// P (16-bit, the P V product's register A operand) from the probabilities.
template <class T, int BN, class FragS, class FragP>
__device__ __forceinline__ void pack_p(const FragS& tSrS, FragP& tOrP) {
  using E = typename CuteType<T>::type;
#pragma unroll
  for (int i = 0; i < BN / 2; i += 2) {
    const uint32_t two = Pack<T>::two(tSrS(i), tSrS(i + 1));
    tOrP(i) = reinterpret_cast<const E*>(&two)[0];
    tOrP(i + 1) = reinterpret_cast<const E*>(&two)[1];
  }
}

}  // namespace hopper

// The TMA kernel's tensor maps (kTma): Q, K and V as (head dim, rows, heads,
// batch), boxes of 64 columns x a tile's rows (Q 128; K and V the config's
// keys a tile: 128, or 64 at head dim 256) with the 128-byte swizzle of the
// wgmma tiles (each 64-column part of a tile is one box: four at head dim
// 256, two at 128, one at 64). Unused elsewhere.
struct FwdTmaMaps {
  CUtensorMap q, k, v;
};

// kPingpong (head dim 128, or 64 and 256 with kTma, without logit features):
// the two warpgroups take turns on the tensor cores, so one's softmax runs
// while the other's products do. The block-wide barrier of each tile goes:
// K/V buffers (three; with kTma four at head dim 64, two at 256), each with
// a "full" mbarrier (every thread arrives once its copies of the tile landed)
// and an "empty" one (each warp arrives when its warpgroup is done with the
// tile); two named barriers hand the turn over. Tile j + 2 is copied once
// both warpgroups are done with tile j - 1, whose buffer it takes.
// kTma (with kPingpong): a third warpgroup produces. One of its
// threads loads Q once and each K/V stage with bulk tensor copies (TMA) as
// soon as both consumer warpgroups released it; the consumers issue no
// copies, and setmaxnreg moves registers from the producer to them.
// At head dims 64 and 256 only the TMA form exists (HopperPingpongConfig);
// the cp.async feed's prefetch distance assumes three stages.
// kFeatures with kTma (every head dim, forward_hopper_bucket): the logit
// features in the TMA form; a bias would be read by fragment_log2 from global
// memory (no stage of it in shared memory there), so bias calls take the
// lockstep kernel. kServes (with kFeatures): the logit features the form's
// calls may have, the others' passes compiled out (the launch checks
// form_serves). The TMA-fed kernel's forms: every feature but the bias (its
// calls have none), a mask and ALiBi (their softcap and dropout registers
// spilled 28 bytes at 128), softcap alone, dropout alone; the lockstep
// kernel's: every feature, the bias alone (the form for every feature spills
// 108 bytes at 128 and 24 at 256, ptxas; this one none).
template <class T, int DB, bool kFeatures, bool kLean, bool kPingpong = false, bool kTma = false,
          bool kMaskRows = false, LogitFeatures kServes = kAllFeatures>
__global__ void __launch_bounds__(kTma ? 384 : HopperFwdConfig<T, DB>::kThreads,
                                  kPingpong ? 1 : HopperFwdConfig<T, DB>::min_blocks(kFeatures))
    attention_fwd_hopper_kernel(const KArgs p, const __grid_constant__ FwdTmaMaps maps) {
  static_assert(!(kLean && kFeatures), "the lean softmax has no logit features");
  static_assert(!kPingpong || DB == 128 || kTma, "the pingpong kernel serves head dim 128 (64 and 256: fed by TMA)");
  static_assert(!kPingpong || !kFeatures || kTma, "the logit features in the TMA-fed pingpong kernel only");
  static_assert(!kTma || kPingpong, "the TMA kernel is a pingpong kernel");
  using namespace cute;
  using namespace hopper;
  using C = HopperFwdKernelConfig<T, DB, kPingpong>;
  constexpr int kStages = C::kStageCount;
  static_assert(!kPingpong || kTma || kStages == 3,
                "the cp.async feed copies tile it + 2 into the buffer of tile it - 1");
  static_assert(!kTma || C::smem(false) <= 227 * 1024, "a CTA's shared memory");
  static_assert(!kMaskRows || (kTma && kFeatures && C::kMaskStage),
                "the mask staged by rows: the TMA-fed feature kernel, where shared memory has room");
  static_assert(!kMaskRows || C::kBarrierBytes <= 128, "the mask stage starts 128 bytes after the mbarriers' start");
  static_assert(kServes == kAllFeatures || (kFeatures && (kTma ? !(kServes & kBiasFeature) : kServes == kBiasFeature)),
                "a form of the feature kernels: the TMA-fed one's without a bias, the lockstep one's the bias alone");
  static_assert(!kMaskRows || (kServes & kMaskFeature), "the mask staged by rows: a form that serves a mask");
  constexpr bool kPvInFlight = kPingpong && kPvInFlightStages<kStages>;
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

  // The heaviest query blocks (the last ones under a causal mask) start first.
  const int m0 = (gridDim.x - 1 - blockIdx.x) * BM, hq = blockIdx.y, b = blockIdx.z;
  const Seq seq = sequence(p, b);
  if (m0 >= seq.sq) return;
  const int hk = hq / p.group;
  // kTma: threads 0-127 produce; tid numbers the consumers from 0.
  const int tid = static_cast<int>(threadIdx.x) - (kTma ? 128 : 0), lane = tid % 32, g = lane >> 2, t = lane & 3;
  const int rows = min(BM, seq.sq - m0);
  const int warp_row0 = (tid / 32) * 16;  // this warp's first row (warpgroup w: rows 64 w ..)
  auto row = [&](int h) { return m0 + warp_row0 + g + 8 * h; };

  const E* q = static_cast<const E*>(p.q) + b * p.q_sb + (seq.q0 + m0) * p.q_sr + hq * p.q_sh;
  const E* k = static_cast<const E*>(p.k) + b * p.k_sb + seq.k0 * p.k_sr + hk * p.k_sh;
  const E* v = static_cast<const E*>(p.v) + b * p.v_sb + seq.k0 * p.v_sr + hk * p.v_sh;

  // Key tiles [n_begin, n_end) hold every key some row of this block sees;
  // a tile is "full" when every row sees every key of it.
  const detail::KeyRange first = detail::visible_keys(m0, seq.sq, seq.sk, p.win_left, p.win_right);
  const detail::KeyRange last = detail::visible_keys(m0 + rows - 1, seq.sq, seq.sk, p.win_left, p.win_right);
  const int n_begin = first.lo / BN * BN, n_end = last.hi;

  // The bias through shared memory (kFeatures): each warp's own rows.
  LogitCtx logit(p, b, hq, seq);
  // kMaskRows (a mask that mask_rows_copyable allows): each warp copies its
  // own rows of the next tile's mask into shared memory, where the mask pass
  // reads it, instead of gathering bytes from global memory element by
  // element. A template flag: the staging's code would change the other
  // feature calls' register allocation.
  const uint8_t* const mask_g = logit.mask;
  if constexpr (kMaskRows) logit.mask = nullptr;
  constexpr int kMaskRow = C::kMaskRow;
  uint8_t* const mask_s =
      reinterpret_cast<uint8_t*>(v_s + C::kKVElems) + 128 + (tid / 32) * 2 * 16 * kMaskRow;
  auto load_mask_tile = [&](int it, int n) {
    load_mask_rows<BN, kMaskRow>(mask_s + (it & 1) * 16 * kMaskRow, mask_g, p, m0 + warp_row0, n, seq.sq,
                                 seq.sk, lane);
    cp_async_commit();
  };
  const bool bias_tiles = kFeatures && !kPingpong && bias_rows_copyable(p);
  uint16_t* bias_s = reinterpret_cast<uint16_t*>(v_s + C::kKVElems) + (tid / 32) * 16 * BN;
  auto load_bias_tile = [&](int buf, int n) {
    load_bias_rows<BN>(bias_s + buf * 8 * 16 * BN, logit.bias, p, m0 + warp_row0, n, seq.sq, seq.sk, lane);
  };

  // The pingpong kernel's barriers: full[s], then empty[s], per stage (kTma:
  // then one for Q).
  uint64_t* full = reinterpret_cast<uint64_t*>(v_s + C::kKVElems);
  uint64_t* empty = full + kStages;
  uint64_t* q_full = empty + kStages;
  const int wg = tid / 128;
  auto load_kv = [&](int stage, int n) {
    load_tile<BN, DB, NT>(sK(_, _, stage), k + n * p.k_sr, p.k_sr, seq.sk - n);
    load_tile<BN, DB, NT>(sV(_, _, stage), v + n * p.v_sr, p.v_sr, seq.sk - n);
  };
  if constexpr (kPingpong) {
    if (threadIdx.x == 0) {
      for (int i = 0; i < kStages; ++i) {
        // kTma: the producer's arrival with the bytes, else every consumer
        // thread once its copies landed.
        mbar_init(full + i, kTma ? 1 : NT);
        mbar_init(empty + i, NT / 32);
      }
      if constexpr (kTma) {
        mbar_init(q_full, 1);
        mbar_fence_init();
      }
    }
    __syncthreads();
  }
  if constexpr (kTma) {
    if (threadIdx.x < 128) {
      registers_down<24>();
      if (threadIdx.x == 0) {
        constexpr uint32_t kHalf = 64 * sizeof(E);  // bytes of a box row
        constexpr int kBoxes = DB / 64;              // boxes a tile (64 columns each)
        // Packed (varlen) maps have one batch entry: rows are seq.q0 + row.
        const int qb = p.cu_q ? 0 : b, q0 = static_cast<int>(seq.q0), k0 = static_cast<int>(seq.k0);
        mbar_arrive_expect_tx(q_full, kBoxes * BM * kHalf);
        for (int h = 0; h < kBoxes; ++h)
          tma_load_4d(at(sQ, 0, 64 * h), &maps.q, q_full, 64 * h, q0 + m0, hq, qb);
        for (int n0 = n_begin, it = 0; n0 < n_end; n0 += BN, ++it) {
          const int s = it % kStages;
          // Both consumer warpgroups are done with the tile that held stage s.
          if (it >= kStages) mbar_wait(empty + s, ((it / kStages) + 1) & 1);
          mbar_arrive_expect_tx(full + s, 2 * kBoxes * BN * kHalf);
          for (int h = 0; h < kBoxes; ++h) {
            tma_load_4d(at(sK, 0, 64 * h, s), &maps.k, full + s, 64 * h, k0 + n0, hk, qb);
            tma_load_4d(at(sV, 0, 64 * h, s), &maps.v, full + s, 64 * h, k0 + n0, hk, qb);
          }
        }
      }
      return;
    }
    registers_up<240>();
    if constexpr (kMaskRows)
      if (n_begin < n_end) load_mask_tile(0, n_begin);
    mbar_wait(q_full, 0);
  } else {
    // Prologue: Q and the first K, V (and bias) tiles (the pingpong kernel: two).
    load_tile<BM, DB, NT>(sQ, q, p.q_sr, rows);
    if (n_begin < n_end) {
      load_kv(0, n_begin);
      if (bias_tiles) load_bias_tile(0, n_begin);
    }
    cp_async_commit();
    if constexpr (kPingpong) {
      if (n_begin < n_end) mbar_arrive_on_copies(full);
      if (n_begin + BN < n_end) {
        load_kv(1, n_begin + BN);
        cp_async_commit();
        mbar_arrive_on_copies(full + 1);
      }
    }
  }

  typename C::MmaS mma_s;
  typename C::MmaO mma_o;
  auto thr_s = mma_s.get_thread_slice(tid);
  auto thr_o = mma_o.get_thread_slice(tid);
  Tensor tSrQ = thr_s.partition_fragment_A(sQ);   // descriptors (MMA, 1, DB / 16)
  Tensor tSrK = thr_s.partition_fragment_B(sK);   // (MMA, 1, DB / 16, 2)
  Tensor tOrVt = thr_o.partition_fragment_B(sVt); // (MMA, 1, BN / 16, 2)
  // Accumulators: element 4 nt + 2 h + c is (row g + 8 h, column 8 nt + 2 t + c).
  Tensor tSrS = partition_fragment_C(mma_s, Shape<Int<BM>, Int<BN>>{});
  Tensor tOrO = partition_fragment_C(mma_o, Shape<Int<BM>, Int<DB>>{});
  // P as the A operand: element i is element i of S (the layouts line up).
  Tensor tOrP = make_tensor<E>(partition_shape_A(mma_o, Shape<Int<BM>, Int<BN>>{}));
  static_assert(size(decltype(tSrS){}) == BN / 2 && size(decltype(tOrO){}) == DB / 2 &&
                    size(decltype(tOrP){}) == BN / 2,
                "one 64-row warpgroup tile per thread");
  clear(tOrO);

  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.0f, 0.0f};
  const float scale_log2 = p.scale * kLog2e;
  const uint32_t bh = static_cast<uint32_t>(b * p.heads_q + hq);

  for (int n0 = n_begin, it = 0; n0 < n_end; n0 += BN, ++it) {
    const int buf = kPingpong ? it % kStages : it & 1;
    if constexpr (kPingpong) {
      // Tile `it` (and Q) landed; wait for this warpgroup's turn (warpgroup
      // 1 first waits for warpgroup 0's first product), issue S = Q K^T, then
      // hand the turn over (the last tile's turn goes to nobody).
      mbar_wait(full + buf, (it / kStages) & 1);
      if constexpr (kTma) {
        // A packed call's box reads the next sequence's rows past this one's
        // keys: their logits are masked, but P V would take a NaN or Inf of
        // theirs into this sequence (0 x Inf). Warpgroup 0 zeroes them before
        // it hands the turn over, so warpgroup 1's products see the zeros too.
        if (p.cu_k && wg == 0 && n0 + BN > seq.sk) {
          for (int idx = tid; idx < BN * (DB / 8); idx += 128) {
            const int r = idx / (DB / 8), c = idx % (DB / 8);
            if (n0 + r >= seq.sk) *reinterpret_cast<uint4*>(at(sV, r, c * 8, buf)) = make_uint4(0, 0, 0, 0);
          }
          fence_async_shared();
          asm volatile("bar.sync 3, 128;\n" ::: "memory");  // warpgroup 0's zeros, then its products
        }
      } else {
        fence_async_shared();  // (TMA writes through the async proxy)
      }
      if (wg == 1 || it > 0) named_barrier_sync(1 + wg);
      warpgroup_gemm<true, false, false>(mma_s, tSrQ, tSrK(_, _, _, buf), tSrS);
      if (wg == 0 || n0 + BN < n_end) named_barrier_arrive(2 - wg);
      warpgroup_wait_all(tSrS);
      // The previous tile's P V product (issued before this S product, which
      // completes after it) landed: O and P are free, its stage is released.
      if (kPvInFlight && it > 0) pv_landed(tOrO, tOrP, empty + (it + kStages - 1) % kStages, lane);
      // Tile it + 2 into the buffer of tile it - 1, once both warpgroups are
      // done with it (kTma: the producer's work).
      if constexpr (!kTma) {
        if (n0 + 2 * BN < n_end) {
          const int next = (it + 2) % kStages;
          if (it >= 1) mbar_wait(empty + next, ((it - 1) / kStages) & 1);
          load_kv(next, n0 + 2 * BN);
          cp_async_commit();
          mbar_arrive_on_copies(full + next);
        }
      }
    } else {
      const bool has_next = n0 + BN < n_end;
      // One barrier a tile: the K and V tiles `it` (and Q) landed for every
      // thread, and both warpgroups are done with tile it-1, whose buffers the
      // next tile's copies take (they fly during this tile's products).
      cp_async_wait<0>();
      fence_async_shared();
      __syncthreads();
      if (has_next) {
        load_kv(buf ^ 1, n0 + BN);
        if (bias_tiles) load_bias_tile(buf ^ 1, n0 + BN);
      }
      cp_async_commit();

      warpgroup_gemm<true, false>(mma_s, tSrQ, tSrK(_, _, _, buf), tSrS);
    }

    // Logits in log2 units (raw scores for kLean); -inf where hidden. The
    // TMA-fed form serves no bias (forward_hopper_bucket): without the bias
    // pass compiled in, its feature forms are 0.55-0.72x the instructions.
    if constexpr (kFeatures) {
      // Element i: row g + 8 h, key 8 nt + 2 t + c (i = 4 nt + 2 h + c).
      const bool full = n0 >= last.lo && n0 + BN <= first.hi && m0 + BM <= seq.sq;
      logit.fragment_log2<BN / 2, true, kServes>(
          p, [&](int i) -> float& { return tSrS(i); }, [&](int i) { return row((i >> 1) & 1); },
          [&](int i) { return n0 + (i >> 2) * 8 + 2 * t + (i & 1); }, /*skip_bias=*/kTma || bias_tiles, full);
      if constexpr (kMaskRows) {
        // This tile's rows landed (this lane's copies, then the warp's); the
        // next tile's go into the buffer that the last tile's pass read.
        cp_async_wait<0>();
        __syncwarp();
        const uint8_t* m_row = mask_s + (it & 1) * 16 * kMaskRow + g * kMaskRow + 2 * t;
#pragma unroll
        for (int i = 0; i < BN / 2; i += 2) {
          const int nt = i >> 2, h = (i >> 1) & 1;
          LogitCtx::mask_pair(*reinterpret_cast<const uint16_t*>(m_row + 8 * h * kMaskRow + 8 * nt), tSrS(i),
                              tSrS(i + 1));
        }
        if (n0 + BN < n_end) load_mask_tile(it + 1, n0 + BN);
      }
      if (bias_tiles) {
        // This thread's bias pair (row g + 8 h, keys 8 nt + 2 t, + 1) sits in
        // chunk nt ^ g of its row; -inf (hidden) stays -inf.
        const uint16_t* bias_row = bias_s + buf * 8 * 16 * BN + g * BN + 2 * t;
#pragma unroll
        for (int i = 0; i < BN / 2; i += 2) {
          const int nt = i >> 2, h = (i >> 1) & 1;
          const float2 bv = bias_pair(
              *reinterpret_cast<const uint32_t*>(bias_row + 8 * h * BN + ((nt ^ g) << 3)), p.bias_dtype);
          tSrS(i) += bv.x * kLog2e;
          tSrS(i + 1) += bv.y * kLog2e;
        }
      }
    } else if (n0 >= last.lo && n0 + BN <= first.hi) {
      scale_logits<kLean, BN>(tSrS, scale_log2);
    } else {
      mask_logits<kLean, BN>(tSrS, n0, t, row, seq, p, scale_log2);
    }

    if constexpr (kLean) {
      lean_softmax<DB, BN>(tSrS, tOrO, row_max, row_sum, scale_log2);
    } else {
      float base[2];
      online_rescale<DB, BN>(tSrS, tOrO, row_max, row_sum, base);
#pragma unroll
      for (int nt = 0; nt < BN / 8; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float x = exp2_fast(tSrS(4 * nt + e) - base[e >> 1]);
          row_sum[e >> 1] += x;
          tSrS(4 * nt + e) = x;
        }
      }
      if constexpr (kFeatures && (kServes & kDropoutFeature)) {
        if (p.dropout) {  // two 8-key blocks a round (dropout_keep_rows)
#pragma unroll
          for (int nt = 0; nt < BN / 8; nt += 2) {
            float keep[8];
            dropout_keep_rows(p, bh, row(0), row(1), n0 + nt * 8 + 2 * t, lane, keep);
#pragma unroll
            for (int e = 0; e < 8; ++e) tSrS(4 * nt + e) *= keep[e];
          }
        }
      }
    }
    pack_p<T, BN>(tSrS, tOrP);

    // kPvInFlight: not waited for here, so the next tile's S product queues
    // behind it on the tensor cores as soon as this warpgroup has the turn again.
    warpgroup_gemm<false, true, !kPvInFlight>(mma_o, tOrP, tOrVt(_, _, _, buf), tOrO);
    if constexpr (kPingpong && !kPvInFlight) warp_arrive(empty + buf, lane);
  }
  // (ptxas adds a wait where this block and the path without key tiles meet,
  // its note C7517: it cannot tell that nothing is in flight there. No cost.)
  if constexpr (kPvInFlight) {
    if (n_begin < n_end) {
      warpgroup_wait<0>();
      pv_landed(tOrO, tOrP, empty + (n_end - n_begin - 1) / BN % kStages, lane);
    }
  }
  if constexpr (!kTma) {
    cp_async_wait<0>();
    // Without a key tile no barrier has passed since the Q load, and every
    // thread copied rows of every warp: wait for all of them before the
    // staging below overwrites those rows. (kTma: every consumer waited for
    // Q's barrier.)
    if (n_begin >= n_end) __syncthreads();
  }

  // Each warp stages its 16 rows of the output in its own rows of sQ (only
  // its warpgroup's products read them, and those are done), then writes
  // them out with 16-byte stores.
  float inv[2], lse[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) finish_row(row_max[h], row_sum[h], inv + h, lse + h);
  if (t == 0) {
    float* l = p.lse + b * p.lse_sb + hq * p.lse_sh + seq.q0;
    if (row(0) < seq.sq) l[row(0)] = lse[0];
    if (row(1) < seq.sq) l[row(1)] = lse[1];
  }
#pragma unroll
  for (int dt = 0; dt < DB / 8; ++dt)
#pragma unroll
    for (int h = 0; h < 2; ++h)
      *reinterpret_cast<uint32_t*>(at(sQ, warp_row0 + g + 8 * h, dt * 8 + 2 * t)) =
          Pack<T>::two(tOrO(4 * dt + 2 * h) * inv[h], tOrO(4 * dt + 2 * h + 1) * inv[h]);
  __syncwarp();
  const int warp_rows = min(16, rows - warp_row0);
  if (warp_rows > 0) {
    E* out = static_cast<E*>(p.out) + b * p.o_sb + (seq.q0 + m0 + warp_row0) * p.o_sr + hq * p.o_sh;
    constexpr int kChunks = DB / 8;
#pragma unroll
    for (int it = 0; it < 16 * kChunks / 32; ++it) {
      const int idx = lane + it * 32, r = idx / kChunks, c = idx % kChunks;
      if (r < warp_rows)
        *reinterpret_cast<uint4*>(out + r * p.o_sr + c * 8) =
            *reinterpret_cast<const uint4*>(at(sQ, warp_row0 + r, c * 8));
    }
  }
}

}  // namespace symheap::attention::cuda
