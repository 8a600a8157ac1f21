// Host checks of the layouts the Hopper forward kernel (cuda_forward_hopper.cuh)
// relies on, through CuTe's own layout algebra: no GPU needed. For each element
// type and head dim of HopperFwdConfig, and the pingpong kernels' configs
// (HopperPingpongConfig: 128-key tiles in 3 or 4 stages at head dims 128 and
// 64, 64-key tiles in 2 stages at 256):
//  1. placement: an element placed through a shared-memory tensor (the way the
//     kernel's copies and output staging place it) lands where the 128-byte
//     swizzle the wgmma descriptors name puts it (16-byte chunk c of row r of
//     an 8-row atom at chunk c ^ (r % 8), atoms 1024 bytes apart, rows first);
//  2. fragments: value i of a thread's S accumulator is the (row, key) of
//     value i of its P operand for O += P V (so P is S converted element by
//     element), and both, and the O accumulator, are the (row, column) the
//     kernel's index arithmetic names (element 4 n + 2 h + c: row 16 w + g +
//     8 h, column 8 n + 2 t + c).
// The same for the Hopper dK/dV kernel (cuda_backward_hopper.cuh, HopperDkvConfig):
// K, V, Q, dO, dS (one buffer and two) and their transposed views, and the S^T, P^T, dV/dK and dQ
// fragments (check_backward_config).
// And the TMA kernels' boxes (check_tma_boxes): a box of 64 columns x `rows`
// rows written with the 128-byte swizzle (row r at r * 128 bytes of the box,
// its 16-byte chunk j at j ^ (r % 8)) lands every element where the kernel's
// tensor places it, box h of stage s at byte (s * boxes + h) * rows * 128
// (boxes: head dim / 64 a tile).
// Built when the Hopper kernel is (target symheap_hopper_layout_tests), run
// by tests/attention/test_attention_hopper_layouts.py. Prints each failure
// with its values; the exit status is the number of failed checks.
#include <cstdint>
#include <cstdio>

#include "ops/attention/cuda_backward_hopper.cuh"
#include "ops/attention/cuda_backward_hopper_d256.cuh"
#include "ops/attention/cuda_forward_hopper.cuh"

namespace {

int g_failed = 0, g_checks = 0;

void check(bool ok, const char* what, int a, int b, int c, int d) {
  ++g_checks;
  if (!ok && g_failed++ < 20) std::printf("FAIL %s (%d, %d, %d, %d)\n", what, a, b, c, d);
}

// The canonical K-major 128-byte swizzled offset (bytes) of element (r, c) of
// a rows x cols tile of 2-byte elements, buffer `stage`.
long canonical_sw128(int r, int c, int rows, int cols, int stage) {
  const long atom = (r / 8) + static_cast<long>(rows / 8) * ((c / 64) + static_cast<long>(cols / 64) * stage);
  const int chunk = (c % 64) / 8;
  return atom * 1024 + (r % 8) * 128 + ((chunk ^ (r % 8)) * 16) + (c % 8) * 2;
}

template <class Tensor>
long byte_offset(Tensor& t, const void* base, int r, int c) {
  return reinterpret_cast<const char*>(cute::raw_pointer_cast(&t(r, c))) - static_cast<const char*>(base);
}
template <class Tensor>
long byte_offset(Tensor& t, const void* base, int r, int c, int s) {
  return reinterpret_cast<const char*>(cute::raw_pointer_cast(&t(r, c, s))) - static_cast<const char*>(base);
}

template <class T, int DB, class C = symheap::attention::cuda::HopperFwdConfig<T, DB>>
void check_config(const char* name) {
  using namespace cute;
  using E = typename C::E;
  constexpr int BM = C::kBlockM, BN = C::kBlockN;
  const int failed_before = g_failed, checks_before = g_checks;

  // 1. Placement, over a 1024-byte aligned base (as the kernel aligns it).
  alignas(1024) static unsigned char buf[1 << 20];
  E* base = reinterpret_cast<E*>(buf);
  Tensor sQ = make_tensor(make_smem_ptr(base), typename C::SmemQ{});
  Tensor sKV = make_tensor(make_smem_ptr(base), typename C::SmemKV{});
  Tensor sVt = make_tensor(make_smem_ptr(base), typename C::SmemVt{});
  for (int r = 0; r < BM; ++r)
    for (int c = 0; c < DB; ++c)
      check(byte_offset(sQ, base, r, c) == canonical_sw128(r, c, BM, DB, 0), "Q placement", DB, r, c, 0);
  for (int s = 0; s < C::kStageCount; ++s)
    for (int r = 0; r < BN; ++r)
      for (int c = 0; c < DB; ++c) {
        const long want = canonical_sw128(r, c, BN, DB, s);
        check(byte_offset(sKV, base, r, c, s) == want, "K/V placement", DB, r, c, s);
        check(byte_offset(sVt, base, c, r, s) == want, "V^T is V transposed", DB, r, c, s);
      }

  // 2. Fragments: coordinates of every thread's values through identity tensors.
  typename C::MmaS mma_s;
  typename C::MmaO mma_o;
  Tensor id_s = make_identity_tensor(Shape<Int<BM>, Int<BN>>{});
  Tensor id_o = make_identity_tensor(Shape<Int<BM>, Int<DB>>{});
  for (int tid = 0; tid < C::kThreads; ++tid) {
    const int lane = tid % 32, g = lane / 4, t = lane % 4, row0 = (tid / 32) * 16;
    Tensor s_coord = mma_s.get_thread_slice(tid).partition_C(id_s);
    Tensor p_coord = mma_o.get_thread_slice(tid).partition_A(id_s);
    Tensor o_coord = mma_o.get_thread_slice(tid).partition_C(id_o);
    check(size(s_coord) == BN / 2 && size(p_coord) == BN / 2 && size(o_coord) == DB / 2, "fragment sizes", DB,
          tid, int(size(s_coord)), int(size(p_coord)));
    for (int i = 0; i < BN / 2; ++i) {
      const int row = row0 + g + 8 * ((i >> 1) & 1), col = 8 * (i >> 2) + 2 * t + (i & 1);
      const auto s = s_coord(i), pa = p_coord(i);
      check(get<0>(s) == row && get<1>(s) == col, "S accumulator coordinates", DB, tid, i, get<0>(s) * 1000 + get<1>(s));
      check(get<0>(pa) == get<0>(s) && get<1>(pa) == get<1>(s), "P operand = S accumulator", DB, tid, i,
            get<0>(pa) * 1000 + get<1>(pa));
    }
    for (int i = 0; i < DB / 2; ++i) {
      const int row = row0 + g + 8 * ((i >> 1) & 1), col = 8 * (i >> 2) + 2 * t + (i & 1);
      const auto o = o_coord(i);
      check(get<0>(o) == row && get<1>(o) == col, "O accumulator coordinates", DB, tid, i, get<0>(o) * 1000 + get<1>(o));
    }
  }
  std::printf("%s %s head dim %d: %d checks (%d keys x %d stages)\n", g_failed == failed_before ? "ok  " : "FAIL",
              name, DB, g_checks - checks_before, BN, C::kStageCount);
}

// The canonical MN-major 128-byte swizzled offset (bytes) of element (m, k)
// of an m-rows-contiguous tile of 64 x cols 2-byte elements.
long canonical_sw128_mn(int m, int k) {
  return (k / 8) * 1024L + (k % 8) * 128 + (((m / 8) ^ (k % 8)) * 16) + (m % 8) * 2;
}

// K, V, Q, dO (and their transposed views) and dS (dS^T; P too at head dim
// 256) of a dK/dV kernel's config C placed in the canonical 128-byte swizzle
// (the failure names DB: 64 and 128 for cuda_backward_hopper.cuh, 256 for
// cuda_backward_hopper_d256.cuh).
template <class C, int DB, class E>
void check_backward_placement(E* base) {
  using namespace cute;
  constexpr int BM = C::kBlockM, BN = C::kBlockN;
  Tensor sK = make_tensor(make_smem_ptr(base), typename C::SmemKV{});
  Tensor sKt = make_tensor(make_smem_ptr(base), typename C::SmemKt{});
  Tensor sQ = make_tensor(make_smem_ptr(base), typename C::SmemQ{});
  Tensor sQt = make_tensor(make_smem_ptr(base), typename C::SmemQt{});
  Tensor sdS = make_tensor(make_smem_ptr(base), typename C::SmemDs{});
  Tensor sdSt = make_tensor(make_smem_ptr(base), typename C::SmemDst{});
  for (int r = 0; r < BN; ++r)
    for (int c = 0; c < DB; ++c) {
      const long want = canonical_sw128(r, c, BN, DB, 0);
      check(byte_offset(sK, base, r, c) == want, "bwd K placement", DB, r, c, 0);
      check(byte_offset(sKt, base, c, r) == want, "bwd K^T is K transposed", DB, r, c, 0);
    }
  for (int s = 0; s < 2; ++s)
    for (int r = 0; r < BM; ++r)
      for (int c = 0; c < DB; ++c) {
        const long want = canonical_sw128(r, c, BM, DB, s);
        check(byte_offset(sQ, base, r, c, s) == want, "bwd Q/dO placement", DB, r, c, s);
        check(byte_offset(sQt, base, c, r, s) == want, "bwd Q^T/dO^T is Q/dO transposed", DB, r, c, s);
      }
  for (int q = 0; q < BM; ++q)
    for (int k = 0; k < BN; ++k)
      check(byte_offset(sdS, base, q, k) == canonical_sw128_mn(q, k) &&
                byte_offset(sdSt, base, k, q) == canonical_sw128_mn(q, k),
            "bwd dS (and dS^T) placement", DB, q, k, 0);
}

// An operand a product reads from shared memory: the same elements for every
// thread of a warpgroup, so the dK/dV kernels may slice it for the
// warpgroup's first thread (warpgroup_first_thread: descriptors in uniform
// registers). `Operand` 0 is A (shape M x K), 1 is B (N x K).
template <int Operand, class Mma, class Shape>
void check_operand_per_warpgroup(const Mma& mma, Shape shape, int threads, const char* what, int db) {
  using namespace cute;
  Tensor id = make_identity_tensor(shape);
  for (int tid = 0; tid < threads; ++tid) {
    auto part = [&](int t) {
      if constexpr (Operand == 0) return mma.get_thread_slice(t).partition_A(id);
      else return mma.get_thread_slice(t).partition_B(id);
    };
    Tensor mine = part(tid), first = part(tid / 128 * 128);
    bool same = size(mine) == size(first) && size(mine) > 0;
    for (int i = 0; same && i < size(mine); ++i) same = mine(i) == first(i);
    check(same, what, db, tid, int(size(mine)), 0);
  }
}

// dK and dV staged for 16-byte stores (store_dk_dv): kv_stage_offset places
// each 16-byte chunk of each key row once, inside the row's own bytes; the 8
// rows of an stmatrix matrix (keys 8 a .. + 7, one chunk) in 8 different bank
// groups; lane addresses (kv_stmatrix_offset xor nt << 4, warps of 16 keys
// from 16 (w % key_warps), chunks from chunk0_step (w / key_warps)) as the
// accumulators' matrices name them; and the 256 reading threads' rows tid /
// (DB / 8) + k (256 / (DB / 8)) at one offset plus k row steps.
template <int DB, int BN>
void check_kv_staging(int key_warps, int chunk0_step, int warp_chunks) {
  using symheap::attention::cuda::hopper::kv_stage_offset;
  using symheap::attention::cuda::hopper::kv_stmatrix_offset;
  constexpr int kChunks = DB / 8, kRowStep = 256 / kChunks;
  static bool seen[BN * kChunks];
  for (bool& x : seen) x = false;
  for (int key = 0; key < BN; ++key)
    for (int c = 0; c < kChunks; ++c) {
      const int off = kv_stage_offset<DB>(key, c), chunk = off / 16;
      check(off % 16 == 0 && off / (DB * 2) == key && !seen[chunk], "bwd dK/dV staging placement", DB, key, c, off);
      seen[chunk] = true;
    }
  for (int a = 0; a < BN / 8; ++a)
    for (int c = 0; c < kChunks; ++c) {
      int groups = 0;
      for (int r = 0; r < 8; ++r) groups |= 1 << ((kv_stage_offset<DB>(8 * a + r, c) / 16) % 8);
      check(groups == 0xff, "bwd dK/dV staging: an stmatrix matrix's rows in 8 bank groups", DB, a, c, groups);
    }
  for (int warp = 0; warp < 8; ++warp)
    for (int lane = 0; lane < 32; ++lane)
      for (int nt = 0; nt < warp_chunks; nt += 2) {
        const int j = lane / 8, key0 = 16 * (warp % key_warps), chunk0 = chunk0_step * (warp / key_warps);
        check((kv_stmatrix_offset<DB>(lane, key0, chunk0) ^ (nt << 4)) ==
                  kv_stage_offset<DB>(key0 + 8 * (j % 2) + lane % 8, chunk0 + nt + j / 2),
              "bwd dK/dV stmatrix row addresses", DB, warp * 32 + lane, nt, 0);
      }
  for (int tid = 0; tid < 256; ++tid)
    for (int k = 0; k < BN / kRowStep; ++k) {
      const int c = tid % kChunks, r0 = tid / kChunks;
      check(kv_stage_offset<DB>(r0 + k * kRowStep, c) == kv_stage_offset<DB>(r0, c) + k * kRowStep * DB * 2,
            "bwd dK/dV staging reads a row step apart", DB, tid, k, 0);
    }
}

// The backward's dK/dV kernel (cuda_backward_hopper.cuh): placement of K, V,
// Q, dO (and their transposed views) and dS; S^T, dP^T, P^T / dS^T operands,
// dV / dK and dQ coordinates as the kernel's index arithmetic names them.
template <class T, int DB>
void check_backward_config(const char* name) {
  using namespace cute;
  using symheap::attention::cuda::hopper::ds_stmatrix_offset;
  using C = symheap::attention::cuda::HopperDkvConfig<T, DB>;
  using E = typename C::E;
  constexpr int BM = C::kBlockM, BN = C::kBlockN;
  const int failed_before = g_failed, checks_before = g_checks;
  alignas(1024) static unsigned char buf[1 << 20];
  E* base = reinterpret_cast<E*>(buf);
  check_backward_placement<C, DB>(base);
  // This kernel's dS (dS^T) in two buffers: buffer s is the single-buffer
  // placement, BN / 8 atoms of 1024 bytes further per buffer.
  {
    Tensor sdS2 = make_tensor(make_smem_ptr(base), typename C::SmemDs2{});
    Tensor sdSt2 = make_tensor(make_smem_ptr(base), typename C::SmemDst2{});
    for (int s = 0; s < 2; ++s)
      for (int q = 0; q < BM; ++q)
        for (int k = 0; k < BN; ++k) {
          const long want = s * (BN / 8) * 1024L + canonical_sw128_mn(q, k);
          check(byte_offset(sdS2, base, q, k, s) == want && byte_offset(sdSt2, base, k, q, s) == want,
                "bwd dS (and dS^T) placement, two buffers", DB, q, k, s);
        }
  }

  // dS^T stored by stmatrix: lane l of warp w, group nt (even), buffer s, at
  // ds_stmatrix_offset xor nt << 4 (as the kernel computes it), is row l % 8
  // of matrix j = l / 8 there: key 16 w + 8 (j % 2) + l % 8, query rows 8 (nt
  // + j / 2) onwards.
  {
    Tensor sdS2 = make_tensor(make_smem_ptr(base), typename C::SmemDs2{});
    for (int s = 0; s < 2; ++s)
      for (int warp = 0; warp < C::kThreads / 32; ++warp)
        for (int lane = 0; lane < 32; ++lane)
          for (int nt = 0; nt < BM / 8; nt += 2) {
            const int j = lane / 8, key = 16 * warp + 8 * (j % 2) + lane % 8, q = 8 * (nt + j / 2);
            const long got = (ds_stmatrix_offset(lane, 16 * warp, 0) ^ (nt << 4)) + s * long(C::kDsBufferBytes);
            check(got == byte_offset(sdS2, base, q, key, s), "bwd dS^T stmatrix row addresses", DB,
                  warp * 32 + lane, nt, s);
          }
  }
  check_kv_staging<DB, BN>(C::kThreads / 32, 0, DB / 8);

  typename C::MmaSdP mma_sdp;
  typename C::MmaDkv mma_dkv;
  typename C::MmaDk mma_dk;
  typename C::MmaDq mma_dq;
  constexpr int NT = C::kThreads;
  check_operand_per_warpgroup<0>(mma_sdp, Shape<Int<BN>, Int<DB>>{}, NT, "bwd K/V operand per warpgroup", DB);
  check_operand_per_warpgroup<1>(mma_sdp, Shape<Int<BM>, Int<DB>>{}, NT, "bwd Q/dO operand per warpgroup", DB);
  check_operand_per_warpgroup<1>(mma_dkv, Shape<Int<DB>, Int<BM>>{}, NT, "bwd dO^T operand per warpgroup", DB);
  check_operand_per_warpgroup<0>(mma_dk, Shape<Int<BN>, Int<BM>>{}, NT, "bwd dS^T operand per warpgroup", DB);
  check_operand_per_warpgroup<1>(mma_dk, Shape<Int<DB>, Int<BM>>{}, NT, "bwd Q^T operand per warpgroup", DB);
  check_operand_per_warpgroup<0>(mma_dq, Shape<Int<BM>, Int<BN>>{}, 128 * C::kDqWarpgroups,
                                 "bwd dS operand per warpgroup", DB);
  check_operand_per_warpgroup<1>(mma_dq, Shape<Int<DB>, Int<BN>>{}, 128 * C::kDqWarpgroups,
                                 "bwd K^T operand per warpgroup", DB);
  Tensor id_s = make_identity_tensor(Shape<Int<BN>, Int<BM>>{});
  Tensor id_kv = make_identity_tensor(Shape<Int<BN>, Int<DB>>{});
  Tensor id_q = make_identity_tensor(Shape<Int<BM>, Int<DB>>{});
  for (int tid = 0; tid < C::kThreads; ++tid) {
    const int lane = tid % 32, g = lane / 4, t = lane % 4, key0 = (tid / 32) * 16;
    Tensor s_coord = mma_sdp.get_thread_slice(tid).partition_C(id_s);
    Tensor p_coord = mma_dkv.get_thread_slice(tid).partition_A(id_s);
    Tensor kv_coord = mma_dkv.get_thread_slice(tid).partition_C(id_kv);
    Tensor dk_coord = mma_dk.get_thread_slice(tid).partition_C(id_kv);
    check(size(s_coord) == BM / 2 && size(p_coord) == BM / 2 && size(kv_coord) == DB / 2, "bwd fragment sizes",
          DB, tid, int(size(s_coord)), int(size(kv_coord)));
    for (int i = 0; i < BM / 2; ++i) {
      const int key = key0 + g + 8 * ((i >> 1) & 1), col = 8 * (i >> 2) + 2 * t + (i & 1);
      const auto s = s_coord(i), pa = p_coord(i);
      check(get<0>(s) == key && get<1>(s) == col, "bwd S^T coordinates", DB, tid, i, get<0>(s) * 1000 + get<1>(s));
      check(get<0>(pa) == get<0>(s) && get<1>(pa) == get<1>(s), "bwd P^T operand = S^T accumulator", DB, tid, i,
            get<0>(pa) * 1000 + get<1>(pa));
    }
    // stmatrix register j of group nt holds elements 4 (nt + j / 2) + 2 (j %
    // 2) and + 1: row g, columns 2 t and + 1 of matrix j (key 16 w + 8 (j %
    // 2) + g; query row or column 8 (nt + j / 2) + 2 t), in S^T / dS^T as in
    // dK and dV.
    for (int nt = 0; nt < DB / 8; nt += 2)
      for (int j = 0; j < 4; ++j)
        for (int c = 0; c < 2; ++c) {
          const int i = 4 * (nt + j / 2) + 2 * (j % 2) + c, key = key0 + 8 * (j % 2) + g;
          const int col = 8 * (nt + j / 2) + 2 * t + c;
          const auto d = dk_coord(i), v = kv_coord(i);
          check(get<0>(d) == key && get<1>(d) == col && get<0>(v) == key && get<1>(v) == col,
                "bwd dK/dV stmatrix registers", DB, tid, i, 0);
          if (i < BM / 2) {
            const auto s = s_coord(i);
            check(get<0>(s) == key && get<1>(s) == col, "bwd dS^T stmatrix registers", DB, tid, i, 0);
          }
        }
    for (int i = 0; i < DB / 2; ++i) {
      const int key = key0 + g + 8 * ((i >> 1) & 1), col = 8 * (i >> 2) + 2 * t + (i & 1);
      const auto o = kv_coord(i);
      const auto d = dk_coord(i);
      check(get<0>(o) == key && get<1>(o) == col && get<0>(d) == key && get<1>(d) == col, "bwd dV/dK coordinates",
            DB, tid, i, get<0>(d) * 1000 + get<1>(d));
    }
    {  // at head dim 64 either warpgroup computes dQ (by turns), as the first would
      Tensor q_coord = mma_dq.get_thread_slice(tid % (128 * C::kDqWarpgroups)).partition_C(id_q);
      check(size(q_coord) == 32, "bwd dQ fragment size", DB, tid, int(size(q_coord)), 0);
      const int row0 = ((tid % 128) / 32) * 16 + g, col0 = (tid / 128 % C::kDqWarpgroups) * 64 + 2 * t;
      for (int i = 0; i < 32; ++i) {
        const auto o = q_coord(i);
        check(get<0>(o) == row0 + 8 * ((i >> 1) & 1) && get<1>(o) == col0 + 8 * (i >> 2) + (i & 1),
              "bwd dQ coordinates", DB, tid, i, get<0>(o) * 1000 + get<1>(o));
      }
    }
  }
  // The staged dQ tile (the TMA kernel's): every element where a box of 32
  // fp32 columns x BM rows in the 128-byte swizzle puts it, each element once;
  // and each store of a warp (a float2 of element 4 nt + 2 h of every lane) at
  // most a 2-way bank conflict. An 8-byte store goes to shared memory as two
  // half-warp requests; in each, rows g and g ^ 1 (g = lane / 4) put their
  // column pairs in the same two 16-byte chunks under the swizzle, so every
  // bank takes 2 of the half-warp's 32 words (ncu: 4 wavefronts a store
  // against 2; the row-major tile before was 8-way).
  {
    static bool seen[BM * DB];
    for (bool& x : seen) x = false;
    for (int r = 0; r < BM; ++r)
      for (int c = 0; c < DB; ++c) {
        const int i = C::dq_stage_index(r, c);
        const long want = (c / 32) * (BM * 128L) + r * 128L + ((((c % 32) * 4 / 16) ^ (r % 8)) * 16) + (c % 4) * 4;
        check(i >= 0 && i < BM * DB && 4L * i == want && !seen[i], "bwd dQ staging placement", DB, r, c, i);
        if (i >= 0 && i < BM * DB) seen[i] = true;
      }
    for (int warp = 0; warp < C::kThreads / 32; ++warp)
      for (int nt = 0; nt < 8; ++nt)
        for (int h = 0; h < 2; ++h) {
          int bank_uses[2][32] = {};  // per half-warp
          for (int lane = 0; lane < 32; ++lane) {
            const int tid = warp * 32 + lane, g = lane / 4, t = lane % 4;
            const int row = ((tid % 128) / 32) * 16 + g + 8 * h, col = (tid / 128 % C::kDqWarpgroups) * 64 + 2 * t + 8 * nt;
            const int i = C::dq_stage_index(row, col), row0 = row - 8 * h, col0 = col - 8 * nt;
            check(i == C::dq_stage_base(row0, col0) + C::dq_stage_offset(C::dq_stage_chunk(row0, col0), nt, h),
                  "bwd dQ staging index as the kernel computes it", DB, tid, nt, h);
            ++bank_uses[lane / 16][i % 32];
            ++bank_uses[lane / 16][(i + 1) % 32];
          }
          int ways = 0;
          for (int half = 0; half < 2; ++half)
            for (int k = 0; k < 32; ++k) ways = std::max(ways, bank_uses[half][k]);
          check(ways <= 2, "bwd dQ staging stores at most 2-way per half-warp", DB, warp, 10 * nt + h, ways);
        }
  }
  std::printf("%s %s backward head dim %d: %d checks\n", g_failed == failed_before ? "ok  " : "FAIL", name, DB,
              g_checks - checks_before);
}

// Byte offset of element (r, c) of stage s as the TMA copies of head dim db
// (64, 128 or 256) write it: db / 64 boxes of 64 columns a stage, the producer's
// box h of stage s at its tensor's element (0, 64 h, s).
long tma_box_sw128(int r, int c, int rows, int s, int db = 128) {
  const long box = static_cast<long>(db / 64) * s + c / 64;
  return box * rows * 128 + r * 128L + ((((c % 64) / 8) ^ (r % 8)) * 16) + (c % 8) * 2;
}

// A tile the TMA unit fills (`kStaged`: one of `stages`, t(r, c, s)): each
// element where a box of 64 columns x `rows` rows in the 128-byte swizzle puts
// it, and each box's bytes contiguous (rows x 128), starting at the tensor's
// element (0, 64 h) (, s) as the producer names it.
template <int DB, bool kStaged, class Tensor, class E>
void check_box_tiles(Tensor& t, const E* base, int rows, int stages, const char* what, const char* start) {
  for (int s = 0; s < stages; ++s) {
    auto offset = [&](int r, int c) -> long {
      if constexpr (kStaged) return byte_offset(t, base, r, c, s);
      else return byte_offset(t, base, r, c);
    };
    for (int r = 0; r < rows; ++r)
      for (int c = 0; c < DB; ++c) check(offset(r, c) == tma_box_sw128(r, c, rows, s, DB), what, DB, r, c, s);
    for (int h = 0; h < DB / 64; ++h)
      check(offset(0, 64 * h) == (static_cast<long>(DB / 64) * s + h) * rows * 128, start, DB, h, s, 0);
  }
}

// The tiles the TMA kernels fill: the forward's Q and its K/V stages at head
// dims 128 (three stages, two boxes a tile), 64 (four, one box) and 256 (two
// stages of 64 keys, four boxes of 64 rows).
template <class T, int DB>
void check_forward_tma_boxes(const char* name) {
  using namespace cute;
  using F = symheap::attention::cuda::HopperPingpongConfig<T, DB>;
  using E = typename F::E;
  static_assert(F::kBlockN == (DB == 256 ? 64 : 128) && F::kStageCount == (DB == 64 ? 4 : DB == 128 ? 3 : 2),
                "the pingpong tiles");
  alignas(1024) static unsigned char buf[1 << 20];
  E* base = reinterpret_cast<E*>(buf);
  Tensor fQ = make_tensor(make_smem_ptr(base), typename F::SmemQ{});
  Tensor fKV = make_tensor(make_smem_ptr(base), typename F::SmemKV{});
  check_box_tiles<DB, false>(fQ, base, F::kBlockM, 1, "TMA box: forward Q", "TMA box start: forward Q");
  check_box_tiles<DB, true>(fKV, base, F::kBlockN, F::kStageCount, "TMA box: forward K/V stage",
                            "TMA box start: forward K/V");
  // The transaction bytes the producer expects: the whole tiles.
  check(cosize_v<typename F::SmemQ> * 2 == (DB / 64) * F::kBlockM * 128, "TMA bytes: forward Q", DB, 0, 0, 0);
  check(cosize_v<typename F::SmemKV> * 2 == F::kStageCount * (DB / 64) * F::kBlockN * 128,
        "TMA bytes: forward K/V", DB, 0, 0, 0);
  // Room for the mbarriers (full and empty a stage, Q's full; the persistent
  // form's Q empty takes the alignment's slack) within a CTA's 227 KiB.
  check(F::kBarrierBytes == (2 * F::kStageCount + 1) * 8, "mbarrier bytes: forward", DB, F::kStageCount, 0, 0);
  check(F::smem(false) + 8 <= 227 * 1024, "shared memory: forward", DB, static_cast<int>(F::smem(false)), 0, 0);
  (void)name;
}

// The dK/dV kernel's K, V (one stage) and two Q/dO stages, DB / 64 boxes a
// tile.
template <class T, int DB>
void check_backward_tma_boxes() {
  using namespace cute;
  using B = symheap::attention::cuda::HopperDkvConfig<T, DB>;
  using E = typename B::E;
  alignas(1024) static unsigned char buf[1 << 20];
  E* base = reinterpret_cast<E*>(buf);
  Tensor bKV = make_tensor(make_smem_ptr(base), typename B::SmemKV{});
  Tensor bQ = make_tensor(make_smem_ptr(base), typename B::SmemQ{});
  check_box_tiles<DB, false>(bKV, base, B::kBlockN, 1, "TMA box: backward K/V", "TMA box start: backward K/V");
  check_box_tiles<DB, true>(bQ, base, B::kBlockM, 2, "TMA box: backward Q/dO stage", "TMA box start: backward Q/dO");
}

// The dK/dV kernel of head dim 256 (cuda_backward_hopper_d256.cuh): K, V, Q,
// dO, P and dS placed as above; the coordinates of each fragment as the
// kernel's index functions (hopper256::) name them, against CuTe's partition;
// P^T/dS^T and dK/dV by stmatrix as the kernel addresses and fills them.
template <class T>
void check_backward256_config(const char* name) {
  using namespace cute;
  using namespace symheap::attention::cuda::hopper256;
  using symheap::attention::cuda::hopper::ds_stmatrix_offset;
  using C = symheap::attention::cuda::HopperDkv256Config<T>;
  using E = typename C::E;
  constexpr int BM = C::kBlockM, BN = C::kBlockN, DB = C::DB;
  const int failed_before = g_failed, checks_before = g_checks;
  alignas(1024) static unsigned char buf[1 << 20];
  E* base = reinterpret_cast<E*>(buf);
  check_backward_placement<C, DB>(base);
  Tensor sK = make_tensor(make_smem_ptr(base), typename C::SmemKV{});
  Tensor sQ = make_tensor(make_smem_ptr(base), typename C::SmemQ{});
  Tensor sdS = make_tensor(make_smem_ptr(base), typename C::SmemDs{});
  // P^T and dS^T stored by stmatrix: lane l of warp w (warpgroup wg = w / 4),
  // group nt (0 or 2), at ds_stmatrix_offset(l, 16 (w % 4), 4 wg) xor nt << 4,
  // is row l % 8 of matrix j = l / 8: key 16 (w % 4) + 8 (j % 2) + l % 8,
  // query rows 32 wg + 8 (nt + j / 2) onwards; and register j of group nt
  // (fragment elements 4 (nt + j / 2) + 2 (j % 2) and + 1) holds row g,
  // columns 2 t and + 1 of it, as key_of and s_row_of name them.
  for (int tid = 0; tid < C::kThreads; ++tid) {
    const int lane = tid % 32, warp = tid / 32, wg = warp / 4, g = lane / 4, t = lane % 4;
    for (int nt = 0; nt < 4; nt += 2) {
      const int j = lane / 8, key = 16 * (warp % 4) + 8 * (j % 2) + lane % 8, q = 32 * wg + 8 * (nt + j / 2);
      const long got = ds_stmatrix_offset(lane, 16 * (warp % 4), 4 * wg) ^ (nt << 4);
      check(got == byte_offset(sdS, base, q, key), "bwd256 P^T/dS^T stmatrix row addresses", DB, tid, nt, 0);
      for (int jj = 0; jj < 4; ++jj)
        for (int c = 0; c < 2; ++c) {
          const int i = 4 * (nt + jj / 2) + 2 * (jj % 2) + c;
          check(key_of(tid, i) == 16 * (warp % 4) + 8 * (jj % 2) + g &&
                    s_row_of(tid, i) == 32 * wg + 8 * (nt + jj / 2) + 2 * t + c,
                "bwd256 P^T/dS^T stmatrix registers", DB, tid, i, 0);
        }
    }
    // dK/dV: element i is (key_of, kv_col_of); the stmatrix groups' registers
    // as in the head-dim-128 kernel, chunks from 16 wg.
    for (int nt = 0; nt < 16; nt += 2)
      for (int jj = 0; jj < 4; ++jj)
        for (int c = 0; c < 2; ++c) {
          const int i = 4 * (nt + jj / 2) + 2 * (jj % 2) + c;
          check(key_of(tid, i) == 16 * (warp % 4) + 8 * (jj % 2) + g &&
                    kv_col_of(tid, i) == 128 * wg + 8 * (nt + jj / 2) + 2 * t + c,
                "bwd256 dK/dV stmatrix registers", DB, tid, i, 0);
        }
  }
  check_kv_staging<DB, BN>(4, 16, 16);
  // The TMA boxes: K and V one stage of 64 rows, Q and dO two stages of 64.
  check_box_tiles<DB, false>(sK, base, BN, 1, "TMA box: bwd256 K/V", "TMA box start: bwd256 K/V");
  check_box_tiles<DB, true>(sQ, base, BM, 2, "TMA box: bwd256 Q/dO stage", "TMA box start: bwd256 Q/dO");

  typename C::MmaSdP mma_sdp;
  typename C::MmaDkv mma_dkv;
  typename C::MmaDq mma_dq;
  constexpr int NT = C::kThreads;
  check_operand_per_warpgroup<0>(mma_sdp, Shape<Int<BN>, Int<DB>>{}, NT, "bwd256 K/V operand per warpgroup", DB);
  check_operand_per_warpgroup<1>(mma_sdp, Shape<Int<BM>, Int<DB>>{}, NT, "bwd256 Q/dO operand per warpgroup", DB);
  check_operand_per_warpgroup<0>(mma_dkv, Shape<Int<BN>, Int<BM>>{}, NT, "bwd256 P^T/dS^T operand per warpgroup",
                                 DB);
  check_operand_per_warpgroup<1>(mma_dkv, Shape<Int<DB>, Int<BM>>{}, NT, "bwd256 dO^T/Q^T operand per warpgroup",
                                 DB);
  check_operand_per_warpgroup<0>(mma_dq, Shape<Int<BM>, Int<BN>>{}, NT, "bwd256 dS operand per warpgroup", DB);
  check_operand_per_warpgroup<1>(mma_dq, Shape<Int<DB>, Int<BN>>{}, NT, "bwd256 K^T operand per warpgroup", DB);
  Tensor id_s = make_identity_tensor(Shape<Int<BN>, Int<BM>>{});
  Tensor id_kv = make_identity_tensor(Shape<Int<BN>, Int<DB>>{});
  Tensor id_q = make_identity_tensor(Shape<Int<BM>, Int<DB>>{});
  for (int tid = 0; tid < C::kThreads; ++tid) {
    Tensor s_coord = mma_sdp.get_thread_slice(tid).partition_C(id_s);
    Tensor kv_coord = mma_dkv.get_thread_slice(tid).partition_C(id_kv);
    Tensor q_coord = mma_dq.get_thread_slice(tid).partition_C(id_q);
    check(size(s_coord) == 16 && size(kv_coord) == 64 && size(q_coord) == 64, "bwd256 fragment sizes", DB, tid,
          int(size(s_coord)), int(size(q_coord)));
    for (int i = 0; i < 16; ++i) {
      const auto s = s_coord(i);
      check(get<0>(s) == key_of(tid, i) && get<1>(s) == s_row_of(tid, i), "bwd256 S^T coordinates", DB, tid, i,
            get<0>(s) * 1000 + get<1>(s));
    }
    for (int i = 0; i < 64; ++i) {
      const auto o = kv_coord(i);
      check(get<0>(o) == key_of(tid, i) && get<1>(o) == kv_col_of(tid, i), "bwd256 dV/dK coordinates", DB, tid, i,
            get<0>(o) * 1000 + get<1>(o));
      const auto d = q_coord(i);
      check(get<0>(d) == key_of(tid, i) && get<1>(d) == dq_col_of(tid, i), "bwd256 dQ coordinates", DB, tid, i,
            get<0>(d) * 1000 + get<1>(d));
    }
  }
  // Every (key, row) of S^T, (key, column) of dK/dV and (row, column) of dQ
  // belongs to exactly one thread.
  static int seen_s[BN][BM], seen_kv[BN][DB], seen_q[BM][DB];
  for (auto& r : seen_s) for (int& x : r) x = 0;
  for (auto& r : seen_kv) for (int& x : r) x = 0;
  for (auto& r : seen_q) for (int& x : r) x = 0;
  for (int tid = 0; tid < C::kThreads; ++tid) {
    for (int i = 0; i < 16; ++i) ++seen_s[key_of(tid, i)][s_row_of(tid, i)];
    for (int i = 0; i < 64; ++i) {
      ++seen_kv[key_of(tid, i)][kv_col_of(tid, i)];
      ++seen_q[key_of(tid, i)][dq_col_of(tid, i)];
    }
  }
  for (int a = 0; a < BN; ++a)
    for (int c = 0; c < DB; ++c) {
      check(seen_kv[a][c] == 1, "bwd256 dV/dK covered once", DB, a, c, seen_kv[a][c]);
      check(seen_q[a][c] == 1, "bwd256 dQ covered once", DB, a, c, seen_q[a][c]);
      if (c < BM) check(seen_s[a][c] == 1, "bwd256 S^T covered once", DB, a, c, seen_s[a][c]);
    }
  // The staged dQ (kFuseDq): element i of a thread, stored at half i / 32's
  // buffer + the head-dim-128 thread form, is where the 128-byte-swizzled
  // 32-column boxes of that half put (row, column % 128), which the bulk
  // reduction of box column / 32 reads; each warpgroup only inside its own
  // 16 KiB of each half (the columns of Q and dO its dK and dV products read).
  {
    using C128 = symheap::attention::cuda::HopperDkvConfig<T, 128>;
    for (int tid = 0; tid < C::kThreads; ++tid) {
      const int row0 = key_of(tid, 0), col0 = dq_col_of(tid, 0);
      const int base = C128::dq_stage_base(row0, col0), chunk = C128::dq_stage_chunk(row0, col0);
      for (int i = 0; i < 64; i += 2) {
        const int row = key_of(tid, i), col = dq_col_of(tid, i), half = i / 32;
        const int at = base + C128::dq_stage_offset(chunk, (i % 32) / 4, (i >> 1) & 1);
        check(half == col / 128 && at == C128::dq_stage_index(row, col % 128) && at / (BM * 64) == tid / 128,
              "bwd256 dQ staging", DB, tid, i, at);
        const long box = col / 32, within = at - (box % 4) * BM * 32;  // the box's start in its half
        check(within >= 0 && within < BM * 32, "bwd256 dQ staging in its box", DB, tid, i, int(within));
      }
    }
  }
  std::printf("%s %s backward head dim 256: %d checks\n", g_failed == failed_before ? "ok  " : "FAIL", name,
              g_checks - checks_before);
}

template <class T>
void check_tma_boxes(const char* name) {
  const int failed_before = g_failed, checks_before = g_checks;
  check_forward_tma_boxes<T, 128>(name);
  check_forward_tma_boxes<T, 64>(name);
  check_forward_tma_boxes<T, 256>(name);
  check_backward_tma_boxes<T, 128>();
  check_backward_tma_boxes<T, 64>();
  std::printf("%s %s TMA boxes: %d checks\n", g_failed == failed_before ? "ok  " : "FAIL", name,
              g_checks - checks_before);
}

}  // namespace

int main() {
  check_tma_boxes<__nv_bfloat16>("bf16");
  check_tma_boxes<__half>("f16");
  check_backward_config<__nv_bfloat16, 64>("bf16");
  check_backward_config<__nv_bfloat16, 128>("bf16");
  check_backward_config<__half, 64>("f16");
  check_backward_config<__half, 128>("f16");
  check_backward256_config<__nv_bfloat16>("bf16");
  check_backward256_config<__half>("f16");
  check_config<__nv_bfloat16, 64>("bf16");
  check_config<__nv_bfloat16, 128>("bf16");
  check_config<__nv_bfloat16, 256>("bf16");
  check_config<__half, 64>("f16");
  check_config<__half, 128>("f16");
  check_config<__half, 256>("f16");
  // The pingpong kernels' tiles (128 keys in 3 stages at 128, in 4 at 64; 64
  // keys in 2 at 256).
  using symheap::attention::cuda::HopperPingpongConfig;
  check_config<__nv_bfloat16, 64, HopperPingpongConfig<__nv_bfloat16, 64>>("bf16 pingpong");
  check_config<__nv_bfloat16, 128, HopperPingpongConfig<__nv_bfloat16, 128>>("bf16 pingpong");
  check_config<__nv_bfloat16, 256, HopperPingpongConfig<__nv_bfloat16, 256>>("bf16 pingpong");
  check_config<__half, 64, HopperPingpongConfig<__half, 64>>("f16 pingpong");
  check_config<__half, 128, HopperPingpongConfig<__half, 128>>("f16 pingpong");
  check_config<__half, 256, HopperPingpongConfig<__half, 256>>("f16 pingpong");
  std::printf("%d checks, %d failed\n", g_checks, g_failed);
  return g_failed > 255 ? 255 : g_failed;
}
