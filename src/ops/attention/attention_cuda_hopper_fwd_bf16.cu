// bfloat16 instantiation of the Hopper forward kernels (the backward's are in
// attention_cuda_hopper_bwd_bf16.cu: two translation units compile in about
// half the time of one on a build with several jobs).
#include "ops/attention/cuda_forward_hopper_launch.cuh"

namespace symheap::attention::cuda {
void run_forward_hopper_bf16(const Launch& l, const KArgs& p, HopperForward mode) {
  run_forward_hopper<__nv_bfloat16>(l, p, mode);
}
}  // namespace symheap::attention::cuda
