// Launchers of the Hopper forward kernel for one element type; the
// attention_cuda_hopper_*.cu files instantiate them (built only with CUTLASS's
// headers, for sm_90a).
#pragma once
#include <cuda.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <type_traits>

#include "ops/attention/cuda_backward_hopper.cuh"
#include "ops/attention/cuda_backward_hopper_d256.cuh"
#include "ops/attention/cuda_forward_hopper.cuh"
#include "ops/attention/cuda_forward_hopper_persistent.cuh"
#include "ops/attention/cuda_launch.cuh"
#include "symheap/errors.hpp"

namespace symheap::attention::cuda {

// cuTensorMapEncodeTiled (through the runtime's driver entry point); null
// where the driver lacks it.
using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                 const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                 CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
inline EncodeTiled tensor_map_encoder() {
  static const EncodeTiled encode =
      reinterpret_cast<EncodeTiled>(::symheap::cuda::driver_entry_point("cuTensorMapEncodeTiled"));
  return encode;
}

// The map of one (batch, rows, heads, cols) tensor for the TMA kernels, its
// strides in elements: boxes of box_cols x box_rows, rows past `rows` read as
// zeros (and dropped by a store). False where TMA cannot address it
// (alignment, strides).
inline bool encode_map(CUtensorMap* map, CUtensorMapDataType type, int elem_bytes, const void* base, int cols,
                       int rows, int heads, int batch, int64_t row_stride, int64_t head_stride, int64_t batch_stride,
                       int box_cols, int box_rows, CUtensorMapSwizzle swizzle) {
  const EncodeTiled encode = tensor_map_encoder();
  if (!encode || !tma_addressable(base, elem_bytes, row_stride, head_stride, batch_stride)) return false;
  const int64_t strides[3] = {row_stride * elem_bytes, head_stride * elem_bytes, batch_stride * elem_bytes};
  const cuuint64_t dims[4] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows),
                              static_cast<cuuint64_t>(heads), static_cast<cuuint64_t>(batch)};
  const cuuint64_t byte_strides[3] = {static_cast<cuuint64_t>(strides[0]), static_cast<cuuint64_t>(strides[1]),
                                      static_cast<cuuint64_t>(strides[2])};
  const cuuint32_t box[4] = {static_cast<cuuint32_t>(box_cols), static_cast<cuuint32_t>(box_rows), 1, 1};
  const cuuint32_t unit[4] = {1, 1, 1, 1};
  return encode(map, type, 4, const_cast<void*>(base), dims, byte_strides, box, unit, CU_TENSOR_MAP_INTERLEAVE_NONE,
                swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// A 16-bit tensor of head dim `cols` (64, 128 or 256) for the wgmma tiles: boxes
// of 64 columns x box_rows rows in the 128-byte swizzle (each 64-column part
// of a tile: the 128-byte swizzle spans 64 of them).
inline bool encode_rows_map(CUtensorMap* map, bool bf16, const void* base, int rows, int heads, int batch,
                            int64_t row_stride, int64_t head_stride, int64_t batch_stride, int box_rows = 128,
                            int cols = 128) {
  return encode_map(map, bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2, base, cols,
                    rows, heads, batch, row_stride, head_stride, batch_stride, 64, box_rows,
                    CU_TENSOR_MAP_SWIZZLE_128B);
}

// The forward's maps. Batch layout: every sequence starts at row 0 of its
// batch entry, so a tile past its length reads zeros. Packed (cu_seqlens):
// one batch entry of all the rows; a tile past a sequence reads the next
// one's rows, which the kernel masks (K) or zeroes (V). Head dims 64, 128 and
// 256; kv_rows: the kernel's keys a tile (a K or V box's rows); Q boxes of
// 128 rows (the wide persistent form re-encodes Q alone with its own
// q_rows: encode_forward_q_map).
inline bool encode_forward_q_map(CUtensorMap* q, const KArgs& p, bool bf16, int q_rows) {
  if (p.cu_q) {
    const int tq = static_cast<int>(p.total_q);
    // (the batch stride of a one-entry dimension only has to be valid)
    return encode_rows_map(q, bf16, p.q, tq, p.heads_q, 1, p.q_sr, p.q_sh, p.q_sr * tq, q_rows, p.d);
  }
  return encode_rows_map(q, bf16, p.q, p.seqlen_q, p.heads_q, p.batch, p.q_sr, p.q_sh, p.q_sb, q_rows, p.d);
}
inline bool encode_forward_maps(FwdTmaMaps* m, const KArgs& p, bool bf16, int kv_rows) {
  if (p.d != 128 && p.d != 64 && p.d != 256) return false;
  if (p.cu_q && (p.total_q <= 0 || p.total_k <= 0 || p.total_q > INT32_MAX || p.total_k > INT32_MAX)) return false;
  if (!encode_forward_q_map(&m->q, p, bf16, 128)) return false;
  const int d = p.d, r = kv_rows;
  if (p.cu_q) {
    const int tk = static_cast<int>(p.total_k);
    return encode_rows_map(&m->k, bf16, p.k, tk, p.heads_kv, 1, p.k_sr, p.k_sh, p.k_sr * tk, r, d) &&
           encode_rows_map(&m->v, bf16, p.v, tk, p.heads_kv, 1, p.v_sr, p.v_sh, p.v_sr * tk, r, d);
  }
  return encode_rows_map(&m->k, bf16, p.k, p.seqlen_k, p.heads_kv, p.batch, p.k_sr, p.k_sh, p.k_sb, r, d) &&
         encode_rows_map(&m->v, bf16, p.v, p.seqlen_k, p.heads_kv, p.batch, p.v_sr, p.v_sh, p.v_sb, r, d);
}

template <class T, int DB, bool kFeatures, bool kLean, bool kPingpong = false, bool kTma = false,
          bool kMaskRows = false, LogitFeatures kServes = kAllFeatures>
void forward_hopper(const Launch& l, const KArgs& p, const FwdTmaMaps& maps) {
  using C = HopperFwdKernelConfig<T, DB, kPingpong>;
  // The TMA-fed kernel is compiled without the bias pass (forward_hopper_bucket
  // sends calls with a bias to the lockstep kernel).
  if (kTma && kFeatures && p.bias)
    throw Unsupported("attention: the TMA-fed Hopper forward takes no bias (an internal routing error)");
  static ReadyDevices ready{0};
  constexpr bool kMaskAlibi = kServes == kMaskAlibiFeatures;
  launch(l, attention_fwd_hopper_kernel<T, DB, kFeatures, kLean, kPingpong, kTma, kMaskRows, kServes>,
         dim3(blocks(p.seqlen_q, C::kBlockM), p.heads_q, p.batch), kTma ? 384 : C::kThreads,
         kMaskRows ? C::smem_mask_rows() : C::smem(kFeatures && !kPingpong), p,
         kMaskRows    ? (kMaskAlibi ? "fwd_hopper_tma_mask_alibi_rows" : "fwd_hopper_tma_features_mask_rows")
         : kMaskAlibi ? "fwd_hopper_tma_mask_alibi"
         : kServes == kSoftcapFeature ? "fwd_hopper_tma_softcap"
         : kServes == kDropoutFeature ? "fwd_hopper_tma_dropout"
         : kServes == kBiasFeature    ? "fwd_hopper_bias"
         : kFeatures  ? (kTma ? "fwd_hopper_tma_features" : "fwd_hopper_features")
         : kTma       ? (kLean ? "fwd_hopper_tma_lean" : "fwd_hopper_tma")
         : kPingpong  ? (kLean ? "fwd_hopper_pingpong_lean" : "fwd_hopper_pingpong")
         : kLean      ? "fwd_hopper_lean"
                      : "fwd_hopper",
         DB, ready, maps);
}

// The persistent form of the TMA-fed kernel (one CTA an SM walking the query
// blocks). Without a mask every block has the same work: 1.00-1.10x the
// one-CTA-a-block kernel (H200, three runs). Under a mask (causal, a window)
// it takes the blocks in pairs of equal total work where there are at least
// two pairs an SM (walk_item); with fewer it would leave SMs idle and the
// one-CTA-a-block kernel serves. $SYMHEAP_ATTN_FWD_PERSISTENT: 1 forces it
// wherever the TMA kernel runs (pairing as above), 0 never. Launches it
// where it serves the call; false where it does not (packed calls too).
// At head dim 64 its wide form (three consumer warpgroups, 192-row blocks:
// wide_forward_serves) takes calls with at least kWideMinRows query rows
// (kWideMinRowsMasked under a mask), where the 192-row blocks' last one and
// the diagonal's masked tiles waste little: on H200 1.07-1.21x the two-
// warpgroup form from 2048 rows without a mask; causal 0.95x at 2048,
// 1.00-1.08x at 4096, 1.08-1.13x from 8192 (bench/RESULTS.md, "A wide
// head-dim-64 forward"); float16 alike (1.08-1.21x without a mask from 2048
// rows, 1.01-1.10x causal from 4096; bench/attn_notes.md 50). Without a mask
// also below 2048: 1.08-1.19x at 768, 1024 and 1536 rows in both dtypes, while
// at 512 one float16 round lost (0.94x; bench/attn_notes.md 55).
// $SYMHEAP_ATTN_FWD_D64_WIDE = 1 forces it wherever the persistent form runs
// at 64 (either dtype), 0 never.
constexpr int kWideMinRows = 768;
constexpr int kWideMinRowsMasked = 4096;
inline bool wide_forward_serves(const KArgs& p) {
  const char* v = std::getenv("SYMHEAP_ATTN_FWD_D64_WIDE");
  if (v && v[0] == '0') return false;
  if (v && v[0] == '1') return true;
  const bool masked = p.win_left >= 0 || p.win_right >= 0;
  return p.seqlen_q >= (masked ? kWideMinRowsMasked : kWideMinRows);
}

template <class T, int DB, bool kWide>
bool forward_hopper_persistent_form(const Launch& l, const KArgs& p, const FwdTmaMaps& maps, bool lean) {
  using C = HopperPersistentConfig<T, DB, kWide>;
  const bool paired = p.win_left >= 0 || p.win_right >= 0;  // under a mask
  const int64_t blocks_m = blocks(p.seqlen_q, C::kBlockM);
  const int64_t units = (paired ? (blocks_m + 1) / 2 : blocks_m) * p.heads_q * p.batch;
  const int sms = sm_count(l.device);
  const char* forced = std::getenv("SYMHEAP_ATTN_FWD_PERSISTENT");
  if (forced && forced[0] == '0') return false;
  if (!(forced && forced[0] == '1') && paired && units < 2 * static_cast<int64_t>(sms)) return false;
  // The wide form's Q boxes hold its 192 rows (the caller's maps, 128); its
  // K and V boxes are the caller's.
  static_assert(C::kBlockN == HopperPingpongConfig<T, DB>::kBlockN, "the caller's K and V boxes");
  const FwdTmaMaps* use = &maps;
  FwdTmaMaps wide_maps;
  if constexpr (kWide) {
    wide_maps = maps;
    if (!encode_forward_q_map(&wide_maps.q, p, std::is_same_v<T, __nv_bfloat16>, C::kBlockM)) return false;
    use = &wide_maps;
  }
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>(units, sms)));
  // (one mbarrier more than the other kernels: Q's "empty")
  const size_t smem = C::kSmem + sizeof(uint64_t);
  const int threads = 128 + C::kThreads;
  static ReadyDevices ready{0}, ready_lean{0};
  constexpr const char* name = kWide ? "fwd_hopper_persistent_wide" : "fwd_hopper_persistent";
  constexpr const char* name_lean = kWide ? "fwd_hopper_persistent_wide_lean" : "fwd_hopper_persistent_lean";
  if (lean)
    launch(l, attention_fwd_hopper_persistent_kernel<T, DB, true, kWide>, grid, threads, smem, p, name_lean, DB,
           ready_lean, *use, paired);
  else
    launch(l, attention_fwd_hopper_persistent_kernel<T, DB, false, kWide>, grid, threads, smem, p, name, DB, ready,
           *use, paired);
  return true;
}

template <class T, int DB>
bool forward_hopper_persistent(const Launch& l, const KArgs& p, const FwdTmaMaps& maps, bool lean) {
  if (p.cu_q) return false;
  if constexpr (DB == 64)
    if (wide_forward_serves(p))
      return forward_hopper_persistent_form<T, DB, true>(l, p, maps, lean);
  return forward_hopper_persistent_form<T, DB, false>(l, p, maps, lean);
}

// At head dims 64 and 256 the default ("hopper") runs the TMA-fed pingpong
// kernel and its persistent form as at head dim 128, where TMA can address the
// tensors: on H200 0.99-1.11x the lockstep kernel at 64 (128-key tiles, four
// K/V stages), 1.34-1.49x at 256 (64-key tiles, two stages); see
// bench/RESULTS.md. $SYMHEAP_ATTN_FWD_D64_TMA / $SYMHEAP_ATTN_FWD_D256_TMA = 0
// keep the lockstep kernel (two CTAs an SM at 64, one at 256) there.
inline bool tma_forward_switch_on(const char* name) {
  const char* v = std::getenv(name);
  return !(v && v[0] == '0');
}
inline bool d64_tma_forward() { return tma_forward_switch_on("SYMHEAP_ATTN_FWD_D64_TMA"); }
inline bool d256_tma_forward() { return tma_forward_switch_on("SYMHEAP_ATTN_FWD_D256_TMA"); }

// The logit features compiled in only when the call uses one; without them
// the lean softmax for a positive scale (as forward_pipelined_plain decides).
// With them and without a bias, the TMA kernel where its maps encode (on
// H200, S 4096: 1.16-1.21x the lockstep kernel at 128, 1.19-1.44x at 256, 1.09-1.36x at 64),
// in its kMaskRows form for a mask mask_rows_copyable allows at head dims 64
// and 256, in its mask-and-ALiBi form for other calls whose only features are
// a mask and ALiBi (1.09x with a mask at 128, 1.16x with ALiBi), in its
// softcap and dropout forms for calls with that feature alone (form_serves);
// else the lockstep kernel, whose bias tiles come through shared memory (the
// TMA kernel reads the bias element by element: 0.47x at 128), in its
// bias-only form for calls whose only feature is a bias.
// Head dim 128 without them: `mode` picks the kernel whose warpgroups take
// turns (kPingpong), that one fed by a TMA producer (kTma; a call TMA cannot
// address takes kPingpong), or the lockstep one. Head dims 64 and 256: kTma
// (with d64_tma_forward, d256_tma_forward) where TMA can address the call,
// else the lockstep one (no cp.async-fed pingpong kernel there).
template <class T, int DB>
void forward_hopper_bucket(const Launch& l, const KArgs& p, HopperForward mode) {
  static const FwdTmaMaps no_maps{};
  const bool lean = p.scale > 1e-30f, features = logit_features(p);
  if (mode == HopperForward::kTma) {
    FwdTmaMaps maps;
    const bool tma_features = features && !p.bias;
    if ((!features || tma_features) &&
        encode_forward_maps(&maps, p, std::is_same_v<T, __nv_bfloat16>, HopperPingpongConfig<T, DB>::kBlockN)) {
      if (features) {
        if constexpr (HopperPingpongConfig<T, DB>::kMaskStage)
          if (mask_rows_copyable(p))
            return form_serves(kMaskAlibiFeatures, p)
                       ? forward_hopper<T, DB, true, false, true, true, true, kMaskAlibiFeatures>(l, p, maps)
                       : forward_hopper<T, DB, true, false, true, true, true>(l, p, maps);
        if (form_serves(kMaskAlibiFeatures, p))
          return forward_hopper<T, DB, true, false, true, true, false, kMaskAlibiFeatures>(l, p, maps);
        if (form_serves(kSoftcapFeature, p))
          return forward_hopper<T, DB, true, false, true, true, false, kSoftcapFeature>(l, p, maps);
        if (form_serves(kDropoutFeature, p))
          return forward_hopper<T, DB, true, false, true, true, false, kDropoutFeature>(l, p, maps);
        return forward_hopper<T, DB, true, false, true, true>(l, p, maps);
      }
      if (forward_hopper_persistent<T, DB>(l, p, maps, lean)) return;
      if (lean) return forward_hopper<T, DB, false, true, true, true>(l, p, maps);
      return forward_hopper<T, DB, false, false, true, true>(l, p, maps);
    }
    mode = HopperForward::kPingpong;
  }
  if (features) {
    if (form_serves(kBiasFeature, p))
      return forward_hopper<T, DB, true, false, false, false, false, kBiasFeature>(l, p, no_maps);
    return forward_hopper<T, DB, true, false>(l, p, no_maps);
  }
  if constexpr (DB == 128) {
    if (mode == HopperForward::kPingpong) {
      if (lean) return forward_hopper<T, DB, false, true, true>(l, p, no_maps);
      return forward_hopper<T, DB, false, false, true>(l, p, no_maps);
    }
  }
  if (lean) return forward_hopper<T, DB, false, true>(l, p, no_maps);
  forward_hopper<T, DB, false, false>(l, p, no_maps);
}

// Q and dO (64-row boxes) and K and V (kv_rows-row boxes) of a batch-layout
// call for the dK/dV kernels.
inline bool encode_backward_qkv_maps(BwdTmaMaps* m, const KArgs& p, bool bf16, int kv_rows) {
  const int d = p.d;
  return encode_rows_map(&m->q, bf16, p.q, p.seqlen_q, p.heads_q, p.batch, p.q_sr, p.q_sh, p.q_sb, 64, d) &&
         encode_rows_map(&m->dout, bf16, p.dout, p.seqlen_q, p.heads_q, p.batch, p.do_sr, p.do_sh, p.do_sb, 64,
                         d) &&
         encode_rows_map(&m->k, bf16, p.k, p.seqlen_k, p.heads_kv, p.batch, p.k_sr, p.k_sh, p.k_sb, kv_rows, d) &&
         encode_rows_map(&m->v, bf16, p.v, p.seqlen_k, p.heads_kv, p.batch, p.v_sr, p.v_sh, p.v_sb, kv_rows, d);
}

// The fp32 dQ workspace of the batch layout, d / 32 boxes of 32 columns x 64
// rows a tile, in the 128-byte swizzle the kernels stage them in
// (HopperDkvConfig::dq_stage_index).
inline bool encode_dq_accum_map(BwdTmaMaps* m, const KArgs& p) {
  return encode_map(&m->dq_accum, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, p.dq_accum, p.d, p.seqlen_q, p.heads_q,
                    p.batch, p.dqa_sr, p.dqa_sh, p.dqa_sb, 32, 64, CU_TENSOR_MAP_SWIZZLE_128B);
}

// The dK/dV kernel's maps (head dims 64 and 128). Packed (cu_seqlens): one
// batch entry of all the rows, as encode_forward_maps; the workspace's rows
// are the packed rows too (dqa_sb 0). Rows past a sequence read the next
// one's, which the kernel (kPacked) zeroes.
inline bool encode_backward_maps(BwdTmaMaps* m, const KArgs& p, bool bf16) {
  if (p.d != 128 && p.d != 64) return false;
  const int d = p.d;
  if (p.cu_q) {
    if (p.total_q <= 0 || p.total_k <= 0 || p.total_q > INT32_MAX || p.total_k > INT32_MAX) return false;
    const int tq = static_cast<int>(p.total_q), tk = static_cast<int>(p.total_k);
    // (the batch stride of a one-entry dimension only has to be valid)
    return encode_rows_map(&m->q, bf16, p.q, tq, p.heads_q, 1, p.q_sr, p.q_sh, p.q_sr * tq, 64, d) &&
           encode_rows_map(&m->dout, bf16, p.dout, tq, p.heads_q, 1, p.do_sr, p.do_sh, p.do_sr * tq, 64, d) &&
           encode_rows_map(&m->k, bf16, p.k, tk, p.heads_kv, 1, p.k_sr, p.k_sh, p.k_sr * tk, 128, d) &&
           encode_rows_map(&m->v, bf16, p.v, tk, p.heads_kv, 1, p.v_sr, p.v_sh, p.v_sr * tk, 128, d) &&
           encode_map(&m->dq_accum, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, p.dq_accum, d, tq, p.heads_q, 1,
                      p.dqa_sr, p.dqa_sh, p.dqa_sr * tq, 32, 64, CU_TENSOR_MAP_SWIZZLE_128B);
  }
  return encode_backward_qkv_maps(m, p, bf16, 128) && encode_dq_accum_map(m, p);
}

// The Hopper dK/dV kernel, dQ fused into it or not (head dims 64 and 128).
template <class T, int DB, bool kFuseDq, bool kTma = false, bool kPacked = false, bool kFeatures = false,
          LogitFeatures kServes = kAllFeatures>
void dkdv_hopper(const Launch& l, const KArgs& p, const BwdTmaMaps& maps) {
  using C = HopperDkvConfig<T, DB>;
  static ReadyDevices ready{0};
  const char* name = !kFeatures ? (kPacked   ? "dkdv_hopper_dq_tma_packed"
                                   : kTma    ? "dkdv_hopper_dq_tma"
                                   : kFuseDq ? "dkdv_hopper_dq"
                                             : "dkdv_hopper")
                     : kServes == kMaskAlibiFeatures  ? (kPacked ? "dkdv_hopper_mask_alibi_packed" : "dkdv_hopper_mask_alibi")
                     : kServes == kAllButBiasFeatures ? (kPacked ? "dkdv_hopper_no_bias_packed" : "dkdv_hopper_no_bias")
                     : kServes == kSoftcapFeature     ? (kPacked ? "dkdv_hopper_softcap_packed" : "dkdv_hopper_softcap")
                     : kServes == kDropoutFeature     ? (kPacked ? "dkdv_hopper_dropout_packed" : "dkdv_hopper_dropout")
                     : kPacked                        ? "dkdv_hopper_features_packed"
                                                      : "dkdv_hopper_features";
  launch(l, attention_bwd_dkdv_hopper_kernel<T, DB, kFuseDq, kTma, kPacked, kFeatures, kServes>,
         dim3(blocks(p.seqlen_k, C::kBlockN), p.heads_kv, p.batch), kTma ? 384 : C::kThreads,
         kTma ? C::kSmemTma : C::kSmem, p, name, DB, ready, maps);
}

// `tma` (with dQ fused): fed by TMA where the maps encode (the batch layout;
// packed calls in a form of their own), else by the consumers' cp.async copies.
// A call with logit features runs only the TMA-fed form: false when its maps
// do not encode (nothing launched; the caller runs the pipelined kernels).
// Calls with a mask or ALiBi slopes and no other feature take its
// mask-and-ALiBi form; other calls without a bias (no_bias_form_serves) its
// form for softcap alone, for dropout alone, or for every feature but the
// bias; the rest the form for every feature.
template <class T, int DB, LogitFeatures kServes>
void dkdv_hopper_tma_form(const Launch& l, const KArgs& p, const BwdTmaMaps& maps) {
  p.cu_q ? dkdv_hopper<T, DB, true, true, true, true, kServes>(l, p, maps)
         : dkdv_hopper<T, DB, true, true, false, true, kServes>(l, p, maps);
}
template <class T, int DB>
bool dkdv_hopper_dim(const Launch& l, const KArgs& p, bool fuse_dq, bool tma) {
  static const BwdTmaMaps no_maps{};
  const bool features = logit_features(p);
  if (fuse_dq && tma) {
    BwdTmaMaps maps;
    if (encode_backward_maps(&maps, p, std::is_same_v<T, __nv_bfloat16>)) {
      if (!features)
        p.cu_q ? dkdv_hopper<T, DB, true, true, true>(l, p, maps) : dkdv_hopper<T, DB, true, true>(l, p, maps);
      else if (form_serves(kMaskAlibiFeatures, p))
        dkdv_hopper_tma_form<T, DB, kMaskAlibiFeatures>(l, p, maps);
      else if (!no_bias_form_serves(p, DB))
        dkdv_hopper_tma_form<T, DB, kAllFeatures>(l, p, maps);
      else if (form_serves(kSoftcapFeature, p))
        dkdv_hopper_tma_form<T, DB, kSoftcapFeature>(l, p, maps);
      else if (form_serves(kDropoutFeature, p))
        dkdv_hopper_tma_form<T, DB, kDropoutFeature>(l, p, maps);
      else
        dkdv_hopper_tma_form<T, DB, kAllButBiasFeatures>(l, p, maps);
      return true;
    }
  }
  if (features) return false;
  fuse_dq ? dkdv_hopper<T, DB, true>(l, p, no_maps) : dkdv_hopper<T, DB, false>(l, p, no_maps);
  return true;
}
// Head dim 256 (the batch layout, every tensor addressable by TMA:
// hopper256_backward_serves admits only such calls): its own kernel, 64 keys a
// CTA, K/V boxes of 64 rows, dQ fused or from the pipelined dQ kernel; the
// logit features with dQ fused (backward_fuses_dq).
template <class T>
void dkdv_hopper256(const Launch& l, const KArgs& p, bool fuse_dq) {
  using C = HopperDkv256Config<T>;
  const bool bf16 = std::is_same_v<T, __nv_bfloat16>;
  BwdTmaMaps maps{};
  const bool encoded =
      !p.cu_q && encode_backward_qkv_maps(&maps, p, bf16, C::kBlockN) && (!fuse_dq || encode_dq_accum_map(&maps, p));
  if (!encoded)  // the call was admitted by hopper256_backward_serves: a broken promise
    throw InvalidArgument("attention: the Hopper backward at head dim 256 could not address this call by TMA");
  static ReadyDevices ready{0}, ready_dq{0}, ready_features{0};
  const dim3 grid(blocks(p.seqlen_k, C::kBlockN), p.heads_kv, p.batch);
  if (logit_features(p)) {
    if (!fuse_dq)  // (backward_fuses_dq sends such calls to the pipelined kernels)
      throw InvalidArgument("attention: the Hopper backward at head dim 256 takes logit features with dQ fused only");
    launch(l, attention_bwd_dkdv_hopper256_kernel<T, true, true>, grid, 384, C::smem(true), p,
           "dkdv_hopper256_features", 256, ready_features, maps);
  } else if (fuse_dq)
    launch(l, attention_bwd_dkdv_hopper256_kernel<T, true>, grid, 384, C::kSmem, p, "dkdv_hopper256_dq", 256,
           ready_dq, maps);
  else
    launch(l, attention_bwd_dkdv_hopper256_kernel<T, false>, grid, 384, C::kSmem, p, "dkdv_hopper256", 256, ready,
           maps);
}
template <class T>
bool dkdv_hopper_bucket(const Launch& l, const KArgs& p, bool fuse_dq, bool tma) {
  if (p.d == 256) {
    dkdv_hopper256<T>(l, p, fuse_dq);
    return true;
  }
  return p.d == 64 ? dkdv_hopper_dim<T, 64>(l, p, fuse_dq, tma) : dkdv_hopper_dim<T, 128>(l, p, fuse_dq, tma);
}

// The head dims of pipelined_forward_serves.
template <class T>
void run_forward_hopper(const Launch& l, const KArgs& p, HopperForward mode) {
  if (p.d == 64)
    return forward_hopper_bucket<T, 64>(
        l, p, mode == HopperForward::kTma && d64_tma_forward() ? HopperForward::kTma : HopperForward::kLockstep);
  if (p.d == 128) return forward_hopper_bucket<T, 128>(l, p, mode);
  forward_hopper_bucket<T, 256>(
      l, p, mode == HopperForward::kTma && d256_tma_forward() ? HopperForward::kTma : HopperForward::kLockstep);
}

}  // namespace symheap::attention::cuda
