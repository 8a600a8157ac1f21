// Pipelined forward kernel (head dims 64, 128 and 256, exactly): one CTA per
// 128 query rows, 4 warps of 32 rows (8 warps of 16 at head dim 256); each
// warp keeps its rows of the output accumulator in registers, and of Q too
// at head dim 64 (else the Q fragments are re-read from shared memory for
// every key tile). K and V tiles stream through two
// shared-memory buffers each with cp.async (tile j+1 loads while tile j is
// computed), and every fragment comes from XOR-swizzled shared memory through
// ldmatrix (.trans for V, so V is never transposed by hand). The softmax runs
// in log2 space (the scale times log2(e) folded into one multiply, exp2).
// kFeatures compiles in the logit rule of LogitCtx (bias, bool mask, ALiBi,
// softcap, dropout); without it only the causal/window/length mask remains,
// and only on key tiles that cross a boundary.
// kLean (without kFeatures, for a positive scale only) trims the softmax and
// the addressing: the row max is taken of the raw scores, the scale folds
// into the one FFMA before each exp2 (scale * s - base), a row's base (its
// running max) moves only when a tile's max exceeds it by a factor over 2^8, and
// the output accumulator is rescaled only when some base of the warp moved
// (the factor is 1 otherwise); ldmatrix addresses are a lane base XOR the
// chunk pair, tile loads step their addresses.
#pragma once
#include "ops/attention/cuda_common.cuh"

namespace symheap::attention::cuda {

template <int DB, bool kFeatures>
struct PipelinedFwdConfig {
  static_assert(DB == 64 || DB == 128 || DB == 256,
                "the pipelined forward serves head dims 64, 128 and 256");
  static constexpr int kBlockM = 128;
  // 16-row mma tiles per warp. Two (32 rows, 4 warps) reuse every K and V
  // fragment read from shared memory for two products, which halves the
  // ldmatrix traffic per mma; at head dim 256 the accumulator of 32 rows
  // would not fit in registers, so it runs one (16 rows, 8 warps).
  static constexpr int kRowTiles = DB <= 128 ? 2 : 1;
  // 32 keys per tile where the accumulator takes 128 registers (32 rows x
  // 128, 16 rows x 256): the scores of a 16-row tile then take 16 registers,
  // not 32, which keeps everything in the register file without spills.
  static constexpr int kBlockN = kRowTiles * DB <= 128 ? 64 : 32;
  static constexpr int kWarps = kBlockM / (16 * kRowTiles);
  static constexpr int kThreads = kWarps * 32;
  // Two CTAs per SM for 32-row warps (<= 255 registers a thread): 8 warps.
  static constexpr int kMinBlocks = kRowTiles == 2 ? 2 : 1;
  // Q fragments in registers for the whole kernel (kRowTiles * DB / 2
  // registers a thread) where they fit next to the accumulator; else read
  // again from shared memory per key tile.
  static constexpr bool kQInRegisters = kRowTiles * DB <= 128;
  // Q (reused to stage the output), then two K and two V buffers.
  static constexpr size_t kSmem = sizeof(uint16_t) * DB * (kBlockM + 4 * kBlockN);
};

namespace pipelined {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared, asynchronously; zeros when !valid (no read).
// 16 bytes to shared memory, of which the first `bytes` come from `src` and
// the rest are zeros.
__device__ __forceinline__ void cp_async16_bytes(uint32_t dst, const void* src, int bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
  cp_async16_bytes(dst, src, valid ? 16 : 0);
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Waits until at most N of this thread's committed groups are pending.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ void ldsm_x4(uint32_t r[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}
__device__ __forceinline__ void ldsm_x4_trans(uint32_t r[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}

// Element offset of (row r, 16-byte chunk c) in a row-major tile of DB
// columns: the chunk index is XORed with r % 8, so the 8 rows an ldmatrix
// phase (or a cp.async warp) touches fall in 8 different bank groups.
template <int DB>
__device__ __forceinline__ int swizzle(int r, int c) {
  return r * DB + ((c ^ (r & 7)) << 3);
}

// Rows [0, ROWS) of a global tile (row stride in elements, exactly DB
// columns) into a swizzled shared tile; rows >= valid_rows become zeros.
// `g` must point at a readable row (valid_rows >= 1 at every call).
template <class T, int ROWS, int DB, int NT>
__device__ __forceinline__ void load_tile(T* s, const T* g, int64_t row_stride, int valid_rows) {
  constexpr int kChunks = DB / 8;
  static_assert((ROWS * kChunks) % NT == 0, "whole tile rounds per thread");
#pragma unroll
  for (int it = 0; it < ROWS * kChunks / NT; ++it) {
    const int idx = static_cast<int>(threadIdx.x) + it * NT;
    const int r = idx / kChunks, c = idx % kChunks;
    const bool ok = r < valid_rows;
    cp_async16(smem_addr(s + swizzle<DB>(r, c)), ok ? g + r * row_stride + c * 8 : g, ok);
  }
}

// load_tile with the addresses stepped, not recomputed per round: NT is a
// multiple of the chunks per row, so every round keeps the thread's chunk
// and moves its row by kStep (a multiple of 8: the swizzle does not change).
template <class T, int ROWS, int DB, int NT>
__device__ __forceinline__ void load_tile_stepped(T* s, const T* g, int64_t row_stride, int valid_rows) {
  constexpr int kChunks = DB / 8, kStep = NT / kChunks;
  static_assert(NT % kChunks == 0 && kStep % 8 == 0 && ROWS % kStep == 0, "whole rows per round");
  const int r0 = static_cast<int>(threadIdx.x) / kChunks, c = static_cast<int>(threadIdx.x) % kChunks;
  const T* src = g + r0 * row_stride + c * 8;
  const uint32_t dst = smem_addr(s + swizzle<DB>(r0, c));
#pragma unroll
  for (int it = 0; it < ROWS / kStep; ++it) {
    const bool ok = r0 + it * kStep < valid_rows;
    cp_async16(dst + it * kStep * DB * sizeof(T), ok ? src + it * kStep * row_stride : g, ok);
  }
}

// A K or V tile of the main loop: the lean kernel's copies stepped through the
// rows (load_tile_stepped), the previous one's by load_tile.
template <class T, int ROWS, int DB, int NT, bool kStepped>
__device__ __forceinline__ void load_next_tile(T* s, const T* g, int64_t row_stride, int valid_rows) {
  if constexpr (kStepped)
    load_tile_stepped<T, ROWS, DB, NT>(s, g, row_stride, valid_rows);
  else
    load_tile<T, ROWS, DB, NT>(s, g, row_stride, valid_rows);
}

// Byte offset, in a swizzled row r, of 16-byte chunk 2 kk + x (x in {0, 1}):
// 2 kk + x == 2 kk ^ x, so the swizzled chunk is (x ^ (r & 7)) ^ 2 kk and the
// offset is lane_off ^ (kk << 5) with lane_off = (x ^ (r & 7)) << 4 fixed per
// lane (and it stays inside the row: both terms are below DB / 8 chunks).
__device__ __forceinline__ uint32_t chunk_pair_offset(uint32_t lane_off, int kk) {
  return lane_off ^ static_cast<uint32_t>(kk << 5);
}

}  // namespace pipelined

template <class T, int DB, bool kFeatures, bool kLean = false>
__global__ void __launch_bounds__(PipelinedFwdConfig<DB, kFeatures>::kThreads,
                                  PipelinedFwdConfig<DB, kFeatures>::kMinBlocks)
    attention_fwd_pipelined_kernel(const KArgs p) {
  static_assert(!(kLean && kFeatures), "the lean softmax has no logit features");
  using namespace pipelined;
  using C = PipelinedFwdConfig<DB, kFeatures>;
  constexpr int BM = C::kBlockM, BN = C::kBlockN, NT = C::kThreads, MT = C::kRowTiles;
  constexpr float kLog2e = 1.4426950408889634f, kLn2 = 0.6931471805599453f;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sK = sQ + BM * DB;      // two buffers of BN x DB
  T* sV = sK + 2 * BN * DB;  // two buffers of BN x DB

  // The heaviest query blocks (the last ones under a causal mask) start first.
  const int m0 = (gridDim.x - 1 - blockIdx.x) * BM, hq = blockIdx.y, b = blockIdx.z;
  const Seq seq = sequence(p, b);
  if (m0 >= seq.sq) return;
  const int hk = hq / p.group;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
  const int rows = min(BM, seq.sq - m0);
  const int warp_row0 = warp * 16 * MT;  // this warp's first row in the block

  const T* q = static_cast<const T*>(p.q) + b * p.q_sb + (seq.q0 + m0) * p.q_sr + hq * p.q_sh;
  const T* k = static_cast<const T*>(p.k) + b * p.k_sb + seq.k0 * p.k_sr + hk * p.k_sh;
  const T* v = static_cast<const T*>(p.v) + b * p.v_sb + seq.k0 * p.v_sr + hk * p.v_sh;

  // Key tiles [n_begin, n_end) hold every key some row of this block sees.
  // A tile is "full" (visible to every row) when it starts at or after the
  // last row's first key and ends at or before the first row's end.
  const detail::KeyRange first = detail::visible_keys(m0, seq.sq, seq.sk, p.win_left, p.win_right);
  const detail::KeyRange last =
      detail::visible_keys(m0 + rows - 1, seq.sq, seq.sk, p.win_left, p.win_right);
  const int n_begin = first.lo / BN * BN, n_end = last.hi;
  // This thread's rows: row(mt, h) = m0 + warp_row0 + 16 mt + g + 8 h.
  auto row = [&](int mt, int h) { return m0 + warp_row0 + 16 * mt + g + 8 * h; };

  // Prologue: Q and the first K tile (group 0), the first V tile (group 1).
  load_tile<T, BM, DB, NT>(sQ, q, p.q_sr, rows);
  if (n_begin < n_end) load_tile<T, BN, DB, NT>(sK, k + n_begin * p.k_sr, p.k_sr, seq.sk - n_begin);
  cp_async_commit();
  if (n_begin < n_end) load_tile<T, BN, DB, NT>(sV, v + n_begin * p.v_sr, p.v_sr, seq.sk - n_begin);
  cp_async_commit();
  cp_async_wait<1>();
  __syncthreads();

  // This warp's Q rows as A fragments (lane addresses for ldmatrix).
  const int q_row = warp_row0 + (lane & 7) + ((lane >> 3) & 1) * 8, q_chunk = lane >> 4;
  // kLean: each lane's ldmatrix row addresses (bytes) and chunk offsets
  // (chunk_pair_offset); row k of a tile is k * DB * sizeof(T) further.
  constexpr uint32_t kRowBytes = DB * sizeof(T);
  const uint32_t q_lane = smem_addr(sQ) + q_row * kRowBytes;
  const uint32_t q_off = (q_chunk ^ (q_row & 7)) << 4;
  const uint32_t k_lane = smem_addr(sK) + ((lane & 7) + (lane >> 4) * 8) * kRowBytes;
  const uint32_t k_off = (((lane >> 3) & 1) ^ (lane & 7)) << 4;
  const uint32_t v_lane = smem_addr(sV) + ((lane & 7) + ((lane >> 3) & 1) * 8) * kRowBytes;
  const uint32_t v_off = ((lane >> 4) ^ (lane & 7)) << 4;
  uint32_t qf[MT][C::kQInRegisters ? DB / 16 : 1][4];
  if constexpr (C::kQInRegisters) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int kk = 0; kk < DB / 16; ++kk)
        ldsm_x4(qf[mt][kk], smem_addr(sQ + swizzle<DB>(q_row + 16 * mt, 2 * kk + q_chunk)));
  }

  float acc[MT][DB / 8][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int dt = 0; dt < DB / 8; ++dt)
      acc[mt][dt][0] = acc[mt][dt][1] = acc[mt][dt][2] = acc[mt][dt][3] = 0.0f;
  // Running max in log2 units, and this thread's share of the row sums.
  float row_max[MT][2], row_sum[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      row_max[mt][h] = -INFINITY;
      row_sum[mt][h] = 0.0f;
    }
  const float scale_log2 = p.scale * kLog2e;
  const LogitCtx logit(p, b, hq, seq);
  const uint32_t bh = static_cast<uint32_t>(b * p.heads_q + hq);

  for (int n0 = n_begin, it = 0; n0 < n_end; n0 += BN, ++it) {
    const int buf = it & 1;
    const T* sKb = sK + buf * BN * DB;
    const T* sVb = sV + buf * BN * DB;
    const bool has_next = n0 + BN < n_end;
    if (it > 0) {
      cp_async_wait<1>();  // K tile `it` has landed (V tile `it` may still fly)
      __syncthreads();     // ... for every thread; and K tile it-1 is consumed
    }
    if (has_next)
      load_next_tile<T, BN, DB, NT, kLean>(sK + (buf ^ 1) * BN * DB, k + (n0 + BN) * p.k_sr,
                                           p.k_sr, seq.sk - n0 - BN);
    cp_async_commit();  // possibly empty: keeps the group count uniform

    // S = Q K^T for this warp's rows x BN keys; each K fragment serves MT tiles.
    float s[MT][BN / 8][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < BN / 8; ++nt) s[mt][nt][0] = s[mt][nt][1] = s[mt][nt][2] = s[mt][nt][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < DB / 16; ++kk) {
      uint32_t qs[MT][4];
      if constexpr (!C::kQInRegisters) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          if constexpr (kLean)
            ldsm_x4(qs[mt], q_lane + 16 * mt * kRowBytes + chunk_pair_offset(q_off, kk));
          else
            ldsm_x4(qs[mt], smem_addr(sQ + swizzle<DB>(q_row + 16 * mt, 2 * kk + q_chunk)));
        }
      }
#pragma unroll
      for (int np = 0; np < BN / 16; ++np) {
        uint32_t kf[4];
        if constexpr (kLean)
          ldsm_x4(kf, k_lane + (buf * BN + np * 16) * kRowBytes + chunk_pair_offset(k_off, kk));
        else
          ldsm_x4(kf, smem_addr(sKb + swizzle<DB>(np * 16 + (lane & 7) + (lane >> 4) * 8,
                                                  2 * kk + ((lane >> 3) & 1))));
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          const uint32_t* a;
          if constexpr (C::kQInRegisters) a = qf[mt][kk];
          else a = qs[mt];
          mma<T>(s[mt][2 * np], a, kf);
          mma<T>(s[mt][2 * np + 1], a, kf + 2);
        }
      }
    }

    // Logits in log2 units (raw scores for kLean); -inf where hidden.
    if constexpr (kFeatures) {
      const bool full = n0 >= last.lo && n0 + BN <= first.hi && m0 + BM <= seq.sq;
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)  // element k: nt = k / 4, e = k % 4
        logit.fragment_log2<BN / 2, true>(
            p, [&](int k) -> float& { return s[mt][k >> 2][k & 3]; },
            [&](int k) { return row(mt, (k >> 1) & 1); }, [&](int k) { return n0 + (k >> 2) * 8 + 2 * t + (k & 1); },
            false, full);
    } else if (n0 >= last.lo && n0 + BN <= first.hi) {
      if constexpr (!kLean) {  // the lean softmax scales inside its FFMA
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int nt = 0; nt < BN / 8; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[mt][nt][e] *= scale_log2;
      }
    } else {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          // Computed here, not kept: registers are scarce in the loop.
          const detail::KeyRange r =
              detail::visible_keys(row(mt, h), seq.sq, seq.sk, p.win_left, p.win_right);
#pragma unroll
          for (int nt = 0; nt < BN / 8; ++nt)
#pragma unroll
            for (int e = 2 * h; e < 2 * h + 2; ++e) {
              const int j = n0 + nt * 8 + 2 * t + (e & 1);
              const float v = kLean ? s[mt][nt][e] : s[mt][nt][e] * scale_log2;
              s[mt][nt][e] = j >= r.lo && j < r.hi ? v : -INFINITY;
            }
        }
    }

    if constexpr (kLean) {
      // Scores are raw here (scale > 0, so the max commutes with it).
      constexpr float kStaleMax = 8.0f;  // log2 headroom over a row's base
      float neg_base[MT][2], rescale[MT][2];
      bool moved = false;
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          float tile_max = -INFINITY;
#pragma unroll
          for (int nt = 0; nt < BN / 8; ++nt)
            tile_max = fmaxf(tile_max, fmaxf(s[mt][nt][2 * h], s[mt][nt][2 * h + 1]));
          // The base moves only when the tile's max passes it by more than
          // kStaleMax (the first visible key always does): any base gives the
          // same out and lse, and P <= 2^kStaleMax fits 16-bit P and fp32 sums.
          const float tile_m = quad_max(tile_max) * scale_log2;
          const float m_new = tile_m > row_max[mt][h] + kStaleMax ? tile_m : row_max[mt][h];
          const float base = m_new == -INFINITY ? 0.0f : m_new;  // nothing visible yet
          moved |= m_new != row_max[mt][h];
          rescale[mt][h] = exp2_fast(row_max[mt][h] - base);
          row_sum[mt][h] *= rescale[mt][h];
          row_max[mt][h] = m_new;
          neg_base[mt][h] = -base;
        }
      // Warp-uniform branch; where no row's base moved every factor is 1 (or
      // the row has seen nothing and its accumulator is still zero).
      if (__any_sync(0xffffffffu, moved)) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int dt = 0; dt < DB / 8; ++dt)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[mt][dt][e] *= rescale[mt][e >> 1];
      }
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < BN / 8; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            s[mt][nt][e] = exp2_fast(fmaf(s[mt][nt][e], scale_log2, neg_base[mt][e >> 1]));
            row_sum[mt][e >> 1] += s[mt][nt][e];
          }
    } else {
      // Online softmax: new running max, rescale what was summed so far.
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        float base[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          float tile_max = -INFINITY;
#pragma unroll
          for (int nt = 0; nt < BN / 8; ++nt)
            tile_max = fmaxf(tile_max, fmaxf(s[mt][nt][2 * h], s[mt][nt][2 * h + 1]));
          const float m_new = fmaxf(row_max[mt][h], quad_max(tile_max));
          base[h] = m_new == -INFINITY ? 0.0f : m_new;  // a row with nothing visible yet
          const float rescale = exp2_fast(row_max[mt][h] - base[h]);
          row_max[mt][h] = m_new;
          row_sum[mt][h] *= rescale;
#pragma unroll
          for (int dt = 0; dt < DB / 8; ++dt) {
            acc[mt][dt][2 * h] *= rescale;
            acc[mt][dt][2 * h + 1] *= rescale;
          }
        }
#pragma unroll
        for (int nt = 0; nt < BN / 8; ++nt) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            s[mt][nt][e] = exp2_fast(s[mt][nt][e] - base[e >> 1]);
            row_sum[mt][e >> 1] += s[mt][nt][e];
          }
        }
        if constexpr (kFeatures) {
          if (p.dropout) {  // two 8-key blocks a round (dropout_keep_rows)
#pragma unroll
            for (int nt = 0; nt < BN / 8; nt += 2) {
              float keep[8];
              dropout_keep_rows(p, bh, row(mt, 0), row(mt, 1), n0 + nt * 8 + 2 * t, lane, keep);
#pragma unroll
              for (int e = 0; e < 4; ++e) {
                s[mt][nt][e] *= keep[e];
                s[mt][nt + 1][e] *= keep[4 + e];
              }
            }
          }
        }
      }
    }

    cp_async_wait<1>();  // V tile `it` has landed
    __syncthreads();     // ... for every thread; and V tile it-1 is consumed
    if (has_next)
      load_next_tile<T, BN, DB, NT, kLean>(sV + (buf ^ 1) * BN * DB, v + (n0 + BN) * p.v_sr,
                                           p.v_sr, seq.sk - n0 - BN);
    cp_async_commit();

    // acc += P V, P straight from the score registers, V through
    // ldmatrix.trans; each V fragment serves MT tiles.
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      uint32_t a[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) c_to_a<T>(a[mt], s[mt][2 * kk], s[mt][2 * kk + 1]);
#pragma unroll
      for (int dp = 0; dp < DB / 16; ++dp) {
        uint32_t vf[4];
        if constexpr (kLean)
          ldsm_x4_trans(vf, v_lane + (buf * BN + kk * 16) * kRowBytes + chunk_pair_offset(v_off, dp));
        else
          ldsm_x4_trans(vf, smem_addr(sVb + swizzle<DB>(kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8,
                                                        2 * dp + (lane >> 4))));
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma<T>(acc[mt][2 * dp], a[mt], vf);
          mma<T>(acc[mt][2 * dp + 1], a[mt], vf + 2);
        }
      }
    }
  }
  cp_async_wait<0>();

  // Only this warp ever reads its rows of sQ (the ldmatrix above), so it
  // stages its output there and writes it out with 16-byte stores.
  __syncwarp();
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    float inv[2], lse[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float sum = quad_sum(row_sum[mt][h]);
      inv[h] = sum > 0.0f ? 1.0f / sum : 0.0f;  // no visible key: zeros, not NaN
      lse[h] = sum > 0.0f ? row_max[mt][h] * kLn2 + __logf(sum) : -INFINITY;
    }
    const int r = warp_row0 + 16 * mt + g;
#pragma unroll
    for (int dt = 0; dt < DB / 8; ++dt) {
      *reinterpret_cast<uint32_t*>(sQ + swizzle<DB>(r, dt) + 2 * t) =
          Pack<T>::two(acc[mt][dt][0] * inv[0], acc[mt][dt][1] * inv[0]);
      *reinterpret_cast<uint32_t*>(sQ + swizzle<DB>(r + 8, dt) + 2 * t) =
          Pack<T>::two(acc[mt][dt][2] * inv[1], acc[mt][dt][3] * inv[1]);
    }
    if (t == 0) {
      float* l = p.lse + b * p.lse_sb + hq * p.lse_sh + seq.q0;
      if (row(mt, 0) < seq.sq) l[row(mt, 0)] = lse[0];
      if (row(mt, 1) < seq.sq) l[row(mt, 1)] = lse[1];
    }
  }
  __syncwarp();
  const int warp_rows = min(16 * MT, rows - warp_row0);
  if (warp_rows > 0) {
    T* out = static_cast<T*>(p.out) + b * p.o_sb + (seq.q0 + m0 + warp_row0) * p.o_sr + hq * p.o_sh;
    constexpr int kChunks = DB / 8;
#pragma unroll
    for (int it = 0; it < 16 * MT * kChunks / 32; ++it) {
      const int idx = lane + it * 32, r = idx / kChunks, c = idx % kChunks;
      if (r < warp_rows)
        *reinterpret_cast<uint4*>(out + r * p.o_sr + c * 8) =
            *reinterpret_cast<const uint4*>(sQ + swizzle<DB>(warp_row0 + r, c));
    }
  }
}

}  // namespace symheap::attention::cuda
