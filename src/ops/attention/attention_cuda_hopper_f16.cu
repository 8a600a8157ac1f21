// float16 instantiation of the Hopper kernels.
#include "ops/attention/cuda_forward_hopper_launch.cuh"

namespace symheap::attention::cuda {
void run_forward_hopper_f16(const Launch& l, const KArgs& p, HopperForward mode) {
  run_forward_hopper<__half>(l, p, mode);
}
bool run_dkdv_hopper_f16(const Launch& l, const KArgs& p, bool fuse_dq, bool tma) {
  return dkdv_hopper_bucket<__half>(l, p, fuse_dq, tma);
}
}  // namespace symheap::attention::cuda
