// bfloat16 instantiation of the Hopper kernels.
#include "ops/attention/cuda_forward_hopper_launch.cuh"

namespace symheap::attention::cuda {
void run_forward_hopper_bf16(const Launch& l, const KArgs& p) { run_forward_hopper<__nv_bfloat16>(l, p); }
void run_dkdv_hopper_bf16(const Launch& l, const KArgs& p) { dkdv_hopper_bucket<__nv_bfloat16>(l, p); }
}  // namespace symheap::attention::cuda
