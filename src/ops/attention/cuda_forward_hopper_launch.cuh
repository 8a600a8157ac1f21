// Launchers of the Hopper forward kernel for one element type; the
// attention_cuda_hopper_*.cu files instantiate them (built only with CUTLASS's
// headers, for sm_90a).
#pragma once
#include "ops/attention/cuda_forward_hopper.cuh"
#include "ops/attention/cuda_launch.cuh"

namespace symheap::attention::cuda {

template <class T, int DB, bool kFeatures>
void forward_hopper(const Launch& l, const KArgs& p) {
  using C = HopperFwdConfig<T, DB>;
  static ReadyDevices ready{0};
  launch(l, attention_fwd_hopper_kernel<T, DB, kFeatures>, dim3(blocks(p.seqlen_q, C::kBlockM), p.heads_q, p.batch),
         C::kThreads, C::kSmem, p, kFeatures ? "fwd_hopper_features" : "fwd_hopper", DB, ready);
}

// The head dims of pipelined_forward_serves; the logit features compiled in
// only when the call uses one.
template <class T>
void run_forward_hopper(const Launch& l, const KArgs& p) {
  const bool features = logit_features(p);
  if (p.d == 64) return features ? forward_hopper<T, 64, true>(l, p) : forward_hopper<T, 64, false>(l, p);
  if (p.d == 128) return features ? forward_hopper<T, 128, true>(l, p) : forward_hopper<T, 128, false>(l, p);
  return features ? forward_hopper<T, 256, true>(l, p) : forward_hopper<T, 256, false>(l, p);
}

}  // namespace symheap::attention::cuda
