// float16 instantiation of the Hopper dK/dV kernels (see attention_cuda_hopper_fwd_f16.cu).
#include "ops/attention/cuda_forward_hopper_launch.cuh"

namespace symheap::attention::cuda {
bool run_dkdv_hopper_f16(const Launch& l, const KArgs& p, bool fuse_dq, bool tma) {
  return dkdv_hopper_bucket<__half>(l, p, fuse_dq, tma);
}
}  // namespace symheap::attention::cuda
