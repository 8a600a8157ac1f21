// Launchers of the Hopper forward kernel for one element type; the
// attention_cuda_hopper_*.cu files instantiate them (built only with CUTLASS's
// headers, for sm_90a).
#pragma once
#include "ops/attention/cuda_backward_hopper.cuh"
#include "ops/attention/cuda_forward_hopper.cuh"
#include "ops/attention/cuda_launch.cuh"

namespace symheap::attention::cuda {

template <class T, int DB, bool kFeatures, bool kLean, bool kPingpong = false>
void forward_hopper(const Launch& l, const KArgs& p) {
  using C = HopperFwdConfig<T, DB, kPingpong ? 3 : 2>;
  static ReadyDevices ready{0};
  launch(l, attention_fwd_hopper_kernel<T, DB, kFeatures, kLean, kPingpong>,
         dim3(blocks(p.seqlen_q, C::kBlockM), p.heads_q, p.batch), C::kThreads, C::smem(kFeatures), p,
         kFeatures  ? "fwd_hopper_features"
         : kPingpong ? (kLean ? "fwd_hopper_pingpong_lean" : "fwd_hopper_pingpong")
         : kLean     ? "fwd_hopper_lean"
                     : "fwd_hopper",
         DB, ready);
}

// The logit features compiled in only when the call uses one; without them
// the lean softmax for a positive scale (as forward_pipelined_plain decides).
// `pingpong` (head dim 128 only): the kernel whose warpgroups take turns.
template <class T, int DB>
void forward_hopper_bucket(const Launch& l, const KArgs& p, bool pingpong) {
  if (logit_features(p)) return forward_hopper<T, DB, true, false>(l, p);
  if constexpr (DB == 128) {
    if (pingpong) {
      if (p.scale > 1e-30f) return forward_hopper<T, DB, false, true, true>(l, p);
      return forward_hopper<T, DB, false, false, true>(l, p);
    }
  }
  if (p.scale > 1e-30f) return forward_hopper<T, DB, false, true>(l, p);
  forward_hopper<T, DB, false, false>(l, p);
}

// The Hopper dK/dV kernel, dQ fused into it or not (head dims 64 and 128).
template <class T, int DB, bool kFuseDq>
void dkdv_hopper(const Launch& l, const KArgs& p) {
  using C = HopperDkvConfig<T, DB>;
  static ReadyDevices ready{0};
  launch(l, attention_bwd_dkdv_hopper_kernel<T, DB, kFuseDq>,
         dim3(blocks(p.seqlen_k, C::kBlockN), p.heads_kv, p.batch), C::kThreads, C::kSmem, p,
         kFuseDq ? "dkdv_hopper_dq" : "dkdv_hopper", DB, ready);
}

template <class T>
void dkdv_hopper_bucket(const Launch& l, const KArgs& p, bool fuse_dq) {
  if (p.d == 64) return fuse_dq ? dkdv_hopper<T, 64, true>(l, p) : dkdv_hopper<T, 64, false>(l, p);
  fuse_dq ? dkdv_hopper<T, 128, true>(l, p) : dkdv_hopper<T, 128, false>(l, p);
}

// The head dims of pipelined_forward_serves.
template <class T>
void run_forward_hopper(const Launch& l, const KArgs& p, bool pingpong) {
  if (p.d == 64) return forward_hopper_bucket<T, 64>(l, p, false);
  if (p.d == 128) return forward_hopper_bucket<T, 128>(l, p, pingpong);
  forward_hopper_bucket<T, 256>(l, p, false);
}

}  // namespace symheap::attention::cuda
