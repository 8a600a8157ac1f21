// Launchers of the attention kernels for one element type; the .cu file of
// each type instantiates them (two translation units compile in parallel).
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <string>
#include <type_traits>

#include "backends/cuda_util.cuh"
#include "ops/attention/cuda_backward.cuh"
#include "ops/attention/cuda_backward_dkdv_pipelined.cuh"
#include "ops/attention/cuda_backward_dkdv_shared.cuh"
#include "ops/attention/cuda_backward_dq_pipelined.cuh"
#include "ops/attention/cuda_forward.cuh"
#include "ops/attention/cuda_forward_pipelined.cuh"
#include "ops/attention/path_choice.hpp"

namespace symheap::attention::cuda {

// Host-side services the launchers need, defined in attention_cuda.cu.
// Raises the kernel's dynamic shared-memory limit once per (device, kernel).
void ensure_smem(int device, const void* kernel, size_t smem, const std::string& key);
// The device's multiprocessor count (persistent kernels size their grid by it);
// read once per device.
int sm_count(int device);

// Layouts of the pipelined backward other than the default, to time against
// it ($SYMHEAP_ATTN_OWN_BACKWARD): the dQ kernel of 16-row warps at every head
// dim (dq16); without logit features, at head dim 128 the dK/dV kernel of
// 32-row query tiles (dkdv32), and at the head dims of shared_dkdv_serves
// that of 64-row tiles whose warps each read every Q/dO fragment
// (dkdv_unshared), the layouts before the shared-fragment kernel.
// `dq_fused`: at the head dims of shared_dkdv_serves without logit features,
// the shared-fragment dK/dV kernel also computes dQ (fp32 atomics into
// KArgs::dq_accum) and the dQ kernel does not run (backward_fuses_dq in
// attention_cuda.cu decides).
struct BackwardVariant {
  bool dq16 = false;
  bool dkdv32 = false;
  bool dkdv_unshared = false;
  bool dq_fused = false;
  // The Hopper dK/dV kernel where it serves (SYMHEAP_ATTN_OWN_BACKWARD = hopper,
  // hopper_dq_separate or hopper_cp_async), with dQ inside it when dq_fused;
  // hopper_tma (= hopper): then fed by TMA where the call allows it.
  bool hopper = false;
  bool hopper_tma = false;
  // With `hopper` at head dim 256: the call suits that head dim's kernel
  // (cuda_backward_hopper_d256.cuh; the batch layout, TMA-addressable).
  bool hopper256 = false;
};

// Whether TMA can address a tensor at `base` with these strides (elements of
// elem_bytes each; rows, heads, batch entries): cuTensorMapEncodeTiled's rule,
// a 16-byte aligned base and positive byte strides, multiples of 16, below
// 2^40. encode_map (cuda_forward_hopper_launch.cuh) asks it; a caller may
// ask first to choose a kernel before any map is made.
inline bool tma_addressable(const void* base, int elem_bytes, int64_t row_stride, int64_t head_stride,
                            int64_t batch_stride) {
  if (reinterpret_cast<uintptr_t>(base) % 16 != 0) return false;
  for (int64_t s : {row_stride, head_stride, batch_stride}) {
    const int64_t bytes = s * elem_bytes;
    if (bytes <= 0 || bytes % 16 != 0 || bytes >= (int64_t{1} << 40)) return false;
  }
  return true;
}

// The logit features a call uses, as a LogitFeatures set (cuda_common.cuh).
inline unsigned call_features(const KArgs& p) {
  return (p.bias ? kBiasFeature : 0u) | (p.mask ? kMaskFeature : 0u) | (p.alibi ? kAlibiFeature : 0u) |
         (p.softcap > 0 ? kSoftcapFeature : 0u) | (p.dropout ? kDropoutFeature : 0u);
}
// Whether a call uses a logit feature: the pipelined kernels compile them in
// only then.
inline bool logit_features(const KArgs& p) { return call_features(p) != 0u; }
// Whether a kernel form compiled for the features `serves` alone takes a call:
// it uses no other. The Hopper kernels have such forms (in the ones that serve
// every feature, the other features' passes spilled registers or slowed the
// rest: bench/attn_notes.md 41-44).
inline bool form_serves(LogitFeatures serves, const KArgs& p) { return (call_features(p) & ~serves) == 0u; }

// Whether a feature call of the Hopper dK/dV kernel (head dim 64 or 128)
// takes one of its forms without a bias (every feature but the bias, softcap
// alone, dropout alone): no bias, and at 64 no softcap. Those recompute
// softcap's derivative from P (one more MUFU op a score) instead of keeping
// it: softcap's fwd+bwd ran 1.23x at 128 but 0.96x at 64 (one round), so at
// 64 softcap in the batch layout stays in the form for every feature (dropout:
// 1.08x and 1.07x). Packed calls take them at 64 too: there the form for every
// feature spills 400 bytes a thread, the one without a bias none.
inline bool no_bias_form_serves(const KArgs& p, int db) {
  return !p.bias && (db != 64 || !(p.softcap > 0) || p.cu_q);
}

struct Launch {
  int device;
  cudaStream_t stream;
  const char* type_name;
};

inline int head_dim_bucket(int d) {
  return d <= 32 ? 32 : d <= 64 ? 64 : d <= 96 ? 96 : d <= 128 ? 128 : d <= 192 ? 192 : 256;
}

inline unsigned blocks(int n, int per_block) { return static_cast<unsigned>((n + per_block - 1) / per_block); }

// "fwd.64", "delta": a kernel's name in the per-device caches and in errors.
inline std::string kernel_key(const char* name, int db) {
  return db ? std::string(name) + "." + std::to_string(db) : std::string(name);
}

// Devices (one bit each, ordinals below 64) where one kernel's shared-memory
// limit is already raised: after the first launch on a device, a launch costs
// no lookup, lock or string. Higher ordinals take ensure_smem's cache.
using ReadyDevices = std::atomic<uint64_t>;

// `more`: the kernel's parameters after p, if any.
template <class Kernel, class... More>
void launch(const Launch& l, Kernel kernel, dim3 grid, int threads, size_t smem, const KArgs& p,
            const char* name, int db, ReadyDevices& ready, const More&... more) {
  const uint64_t bit = l.device >= 0 && l.device < 64 ? uint64_t{1} << l.device : 0;
  if (!(ready.load(std::memory_order_acquire) & bit)) {
    ensure_smem(l.device, reinterpret_cast<const void*>(kernel), smem,
                kernel_key(name, db) + "." + l.type_name);
    ready.fetch_or(bit, std::memory_order_acq_rel);
  }
  kernel<<<grid, threads, smem, l.stream>>>(p, more...);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess)
    ::symheap::cuda::check(err, ("attention kernel " + kernel_key(name, db)).c_str(), __FILE__, __LINE__);
}

template <class T, int DB>
void forward_bucket(const Launch& l, const KArgs& p) {
  using C = FwdConfig<DB>;
  static ReadyDevices ready{0};
  launch(l, attention_fwd_kernel<T, DB>, dim3(blocks(p.seqlen_q, C::kBlockM), p.heads_q, p.batch),
         C::kThreads, C::kSmem, p, "fwd", DB, ready);
}

template <class T, int DB, bool kFeatures, int MT>
void dq_pipelined(const Launch& l, const KArgs& p) {
  using C = PipelinedDqConfig<DB, MT>;
  static ReadyDevices ready{0};
  const char* name = MT == 1 ? (kFeatures ? "dq_pipelined16_features" : "dq_pipelined16")
                             : (kFeatures ? "dq_pipelined_features" : "dq_pipelined");
  launch(l, attention_bwd_dq_pipelined_kernel<T, DB, kFeatures, MT>,
         dim3(blocks(p.seqlen_q, C::kBlockM), p.heads_q, p.batch), C::kThreads, C::kSmem, p, name, DB,
         ready);
}

// The dQ kernel of the default layout (kDqRowTiles), or with 16-row warps
// at every head dim (`dq16`: SYMHEAP_ATTN_OWN_BACKWARD = pipelined_dq16).
template <class T, int DB, bool kFeatures>
void dq_pipelined(const Launch& l, const KArgs& p, bool dq16) {
  if constexpr (kDqRowTiles<DB> == 1) dq_pipelined<T, DB, kFeatures, 1>(l, p);
  else if (dq16) dq_pipelined<T, DB, kFeatures, 1>(l, p);
  else dq_pipelined<T, DB, kFeatures, kDqRowTiles<DB>>(l, p);
}

template <class T, int DB, int BM, bool kFeatures>
void dkdv_pipelined(const Launch& l, const KArgs& p) {
  using C = PipelinedDkvConfig<DB, BM>;
  const dim3 grid(blocks(p.seqlen_k, C::kBlockN), p.heads_kv, p.batch);
  if constexpr (C::kSplit) {
    static ReadyDevices ready_dv{0}, ready_dk{0};
    launch(l, attention_bwd_dkdv_pipelined_kernel<T, DB, BM, kFeatures, true, false>, grid, C::kThreads,
           C::kSmem, p, kFeatures ? "dv_pipelined_features" : "dv_pipelined", DB, ready_dv);
    launch(l, attention_bwd_dkdv_pipelined_kernel<T, DB, BM, kFeatures, false, true>, grid, C::kThreads,
           C::kSmem, p, kFeatures ? "dk_pipelined_features" : "dk_pipelined", DB, ready_dk);
  } else {
    static ReadyDevices ready{0};
    // Another query tile than the default is another kernel (shared memory, name).
    const char* name = BM != kDkvRowTile<DB, kFeatures> ? "dkdv_pipelined32"
                       : kFeatures                      ? "dkdv_pipelined_features"
                                                        : "dkdv_pipelined";
    launch(l, attention_bwd_dkdv_pipelined_kernel<T, DB, BM, kFeatures, true, true>, grid, C::kThreads,
           C::kSmem, p, name, DB, ready);
  }
}

template <class T, int DB, bool kFuseDq = false>
void dkdv_shared(const Launch& l, const KArgs& p) {
  using C = SharedDkvConfig<DB, kFuseDq>;
  static ReadyDevices ready{0};
  const dim3 grid(blocks(p.seqlen_k, C::kBlockN), p.heads_kv, p.batch);
  launch(l, attention_bwd_dkdv_shared_kernel<T, DB, kFuseDq>, grid, C::kThreads, C::kSmem, p,
         kFuseDq ? "dkdv_shared_dq" : "dkdv_shared", DB, ready);
}

// Rows of the dq tensor (packed rows for varlen).
inline int64_t dq_rows(const KArgs& p) {
  return p.cu_q ? p.total_q : static_cast<int64_t>(p.batch) * p.seqlen_q;
}

// The delta kernel over every (row, head) pair of `rows` query rows.
template <class T, int DB, bool kZeroDq>
void launch_delta(const Launch& l, const KArgs& p, int64_t rows, ReadyDevices& ready) {
  const int64_t threads = rows * p.heads_q * delta_lanes(DB);
  if (threads == 0) return;
  launch(l, attention_bwd_delta_kernel<T, DB, kZeroDq>,
         dim3(static_cast<unsigned>((threads + kDeltaThreads - 1) / kDeltaThreads)), kDeltaThreads, 0, p,
         kZeroDq ? "delta_zero_dq" : "delta", DB, ready, rows);
}

// The Hopper dK/dV kernel (attention_cuda.cu picks the type's instance); `tma`
// (with fuse_dq): fed by a TMA producer where the call allows it. False when
// nothing ran: a call with logit features whose tensor maps do not encode.
bool run_dkdv_hopper(const Launch& l, const KArgs& p, bool f16, bool fuse_dq, bool tma);

template <class T, int DB, bool kFeatures>
void dkdv_pipelined(const Launch& l, const KArgs& p, BackwardVariant variant);  // below

// The backward with dQ fused into the dK/dV kernel (the head dims of
// shared_dkdv_serves, and 256 on the Hopper kernel; logit features only on
// the Hopper kernel at 64 and 128): delta (its kernel also zeroes the fp32
// workspace), dK/dV (the shared-fragment kernel, or the Hopper one) + dQ, then
// dQ converted into its dtype.
template <class T, int DB>
void backward_dq_fused(const Launch& l, const KArgs& p, bool hopper, bool hopper_tma) {
  static ReadyDevices ready_delta{0};
  const int64_t rows = dq_rows(p);
  if (p.seqlen_q > 0) launch_delta<T, DB, true>(l, p, rows, ready_delta);
  if (p.seqlen_k > 0) {
    if constexpr (shared_dkdv_serves(DB)) {
      if (hopper) {
        if (!run_dkdv_hopper(l, p, std::is_same_v<T, __half>, true, hopper_tma)) {
          // Logit features whose maps did not encode: the pipelined kernels
          // write dQ themselves (the zeroed workspace stays unread).
          if (p.seqlen_q > 0) dq_pipelined<T, DB, true>(l, p, false);
          return dkdv_pipelined<T, DB, true>(l, p, BackwardVariant{});
        }
      } else {
        dkdv_shared<T, DB, true>(l, p);
      }
    } else {  // head dim 256: the Hopper kernel only (backward_fuses_dq)
      run_dkdv_hopper(l, p, std::is_same_v<T, __half>, true, true);
    }
  }
  if (p.seqlen_q > 0 && rows > 0) {
    constexpr int kThreads = 256;
    const int64_t work = rows * p.heads_q * (DB / 8);
    const auto grid = static_cast<unsigned>(std::min<int64_t>((work + kThreads - 1) / kThreads, 1 << 20));
    attention_bwd_dq_convert_kernel<T><<<grid, kThreads, 0, l.stream>>>(p, rows);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) ::symheap::cuda::check(err, "attention kernel dq_convert", __FILE__, __LINE__);
  }
}

// The dK/dV kernel: at the head dims of shared_dkdv_serves without features
// the one whose warps share Q/dO fragments (cuda_backward_dkdv_shared.cuh),
// or the pipelined one of 64-row tiles (`dkdv_unshared`:
// SYMHEAP_ATTN_OWN_BACKWARD = pipelined_dkdv_unshared) or, at head dim 128,
// of 32-row tiles (`dkdv32`: = pipelined_dkdv32); elsewhere the pipelined one
// of the default query tile (kDkvRowTile).
template <class T, int DB, bool kFeatures>
void dkdv_pipelined(const Launch& l, const KArgs& p, BackwardVariant variant) {
  constexpr int kRows = kDkvRowTile<DB, kFeatures>;
  if constexpr (shared_dkdv_serves(DB) && !kFeatures) {
    if constexpr (DB == 128)
      if (variant.dkdv32) return dkdv_pipelined<T, DB, 32, kFeatures>(l, p);
    if (!variant.dkdv_unshared) return dkdv_shared<T, DB>(l, p);
  }
  dkdv_pipelined<T, DB, kRows, kFeatures>(l, p);
}

// The pipelined dQ and dK/dV kernels (head dims 64, 128 and 256, exactly);
// the logit features are compiled in only when the call uses one.
template <class T, int DB>
void backward_pipelined(const Launch& l, const KArgs& p, BackwardVariant variant) {
  static ReadyDevices ready_delta{0};
  const bool features = logit_features(p);
  // (dq_fused with logit features: the Hopper kernel serves them, backward_fuses_dq)
  if constexpr (shared_dkdv_serves(DB) || DB == 256) {
    if (variant.dq_fused) return backward_dq_fused<T, DB>(l, p, variant.hopper, variant.hopper_tma);
  }
  if (p.seqlen_q > 0) {
    launch_delta<T, DB, false>(l, p, dq_rows(p), ready_delta);
    if (features) dq_pipelined<T, DB, true>(l, p, variant.dq16);
    else dq_pipelined<T, DB, false>(l, p, variant.dq16);
  }
  if (p.seqlen_k > 0) {
    if constexpr (shared_dkdv_serves(DB) || DB == 256) {
      if (variant.hopper && !features && (DB != 256 || variant.hopper256)) {
        run_dkdv_hopper(l, p, std::is_same_v<T, __half>, false, false);
        return;
      }
    }
    if (features) dkdv_pipelined<T, DB, true>(l, p, variant);
    else dkdv_pipelined<T, DB, false>(l, p, variant);
  }
}

template <class T, int DB>
void backward_bucket(const Launch& l, const KArgs& p) {
  static ReadyDevices ready_delta{0}, ready_dq{0}, ready_dv{0}, ready_dk{0}, ready_dkdv{0};
  if (p.seqlen_q > 0) {
    launch_delta<T, DB, false>(l, p, dq_rows(p), ready_delta);
    using Q = DqConfig<DB>;
    launch(l, attention_bwd_dq_kernel<T, DB>, dim3(blocks(p.seqlen_q, Q::kBlockM), p.heads_q, p.batch),
           Q::kThreads, Q::kSmem, p, "dq", DB, ready_dq);
  }
  if (p.seqlen_k > 0) {
    using K = DkvConfig<DB>;
    const dim3 grid(blocks(p.seqlen_k, K::kBlockN), p.heads_kv, p.batch);
    if constexpr (K::kSplit) {
      launch(l, attention_bwd_dkdv_kernel<T, DB, true, false>, grid, K::kThreads, K::kSmem, p,
             "dv", DB, ready_dv);
      launch(l, attention_bwd_dkdv_kernel<T, DB, false, true>, grid, K::kThreads, K::kSmem, p,
             "dk", DB, ready_dk);
    } else {
      launch(l, attention_bwd_dkdv_kernel<T, DB, true, true>, grid, K::kThreads, K::kSmem, p,
             "dkdv", DB, ready_dkdv);
    }
  }
}

template <class T, int DB, bool kFeatures, bool kLean = false>
void forward_pipelined(const Launch& l, const KArgs& p) {
  using C = PipelinedFwdConfig<DB, kFeatures>;
  static ReadyDevices ready{0};
  launch(l, attention_fwd_pipelined_kernel<T, DB, kFeatures, kLean>,
         dim3(blocks(p.seqlen_q, C::kBlockM), p.heads_q, p.batch), C::kThreads, C::kSmem, p,
         kFeatures ? "fwd_pipelined_features" : kLean ? "fwd_pipelined_lean" : "fwd_pipelined", DB, ready);
}

// Without logit features: the lean softmax where the scale is positive (its
// max of raw scores needs that; and not so small that scale * log2(e) would
// round to 0 and turn a masked -inf into NaN) unless `previous` asks for the
// softmax before it.
template <class T, int DB>
void forward_pipelined_plain(const Launch& l, const KArgs& p, bool previous) {
  if (!previous && p.scale > 1e-30f) forward_pipelined<T, DB, false, true>(l, p);
  else forward_pipelined<T, DB, false>(l, p);
}

// `pipelined`: the call runs on the pipelined kernel (own_forward_kernel in
// path_choice.cpp decides; `previous`: its softmax before the lean one). The
// logit features are compiled in only when the call uses one.
template <class T>
void run_forward(const Launch& l, const KArgs& p, bool pipelined, bool previous) {
  if (pipelined && pipelined_forward_serves(p.d)) {
    const bool features = logit_features(p);
    if (p.d == 64)
      return features ? forward_pipelined<T, 64, true>(l, p) : forward_pipelined_plain<T, 64>(l, p, previous);
    if (p.d == 128)
      return features ? forward_pipelined<T, 128, true>(l, p) : forward_pipelined_plain<T, 128>(l, p, previous);
    return features ? forward_pipelined<T, 256, true>(l, p) : forward_pipelined_plain<T, 256>(l, p, previous);
  }
  switch (head_dim_bucket(p.d)) {
    case 32: return forward_bucket<T, 32>(l, p);
    case 64: return forward_bucket<T, 64>(l, p);
    case 96: return forward_bucket<T, 96>(l, p);
    case 128: return forward_bucket<T, 128>(l, p);
    case 192: return forward_bucket<T, 192>(l, p);
    default: return forward_bucket<T, 256>(l, p);
  }
}

// `pipelined`: the call runs on the pipelined backward kernels, in `variant`
// (own_backward_kernel in path_choice.cpp decides both).
template <class T>
void run_backward(const Launch& l, const KArgs& p, bool pipelined, BackwardVariant variant) {
  if (pipelined && pipelined_forward_serves(p.d)) {
    if (p.d == 64) return backward_pipelined<T, 64>(l, p, variant);
    if (p.d == 128) return backward_pipelined<T, 128>(l, p, variant);
    return backward_pipelined<T, 256>(l, p, variant);
  }
  switch (head_dim_bucket(p.d)) {
    case 32: return backward_bucket<T, 32>(l, p);
    case 64: return backward_bucket<T, 64>(l, p);
    case 96: return backward_bucket<T, 96>(l, p);
    case 128: return backward_bucket<T, 128>(l, p);
    case 192: return backward_bucket<T, 192>(l, p);
    default: return backward_bucket<T, 256>(l, p);
  }
}

// Defined in attention_cuda_f16.cu and attention_cuda_bf16.cu.
void run_forward_f16(const Launch& l, const KArgs& p, bool pipelined, bool previous);
void run_backward_f16(const Launch& l, const KArgs& p, bool pipelined, BackwardVariant variant);
void run_forward_bf16(const Launch& l, const KArgs& p, bool pipelined, bool previous);
void run_backward_bf16(const Launch& l, const KArgs& p, bool pipelined, BackwardVariant variant);
// Defined in attention_cuda_hopper_{fwd,bwd}_{f16,bf16}.cu, built with CUTLASS's headers
// (SYMHEAP_WITH_HOPPER_ATTN); attention_cuda.cu checks the device first.
// `mode`: which Hopper forward a call takes (kTma at every head dim where TMA
// can address the call; kPingpong at head dim 128 only, without logit
// features; with them forward_hopper_bucket picks the TMA kernel or the
// lockstep one).
enum class HopperForward { kLockstep, kPingpong, kTma };
void run_forward_hopper_f16(const Launch& l, const KArgs& p, HopperForward mode);
void run_forward_hopper_bf16(const Launch& l, const KArgs& p, HopperForward mode);
bool run_dkdv_hopper_f16(const Launch& l, const KArgs& p, bool fuse_dq, bool tma);
bool run_dkdv_hopper_bf16(const Launch& l, const KArgs& p, bool fuse_dq, bool tma);
void require_hopper(int device);

}  // namespace symheap::attention::cuda
