// float16 instantiation of the attention kernels.
#include "ops/attention/cuda_launch.cuh"

namespace symheap::attention::cuda {
void run_forward_f16(const Launch& l, const KArgs& p, bool pipelined, bool previous) {
  run_forward<__half>(l, p, pipelined, previous);
}
void run_backward_f16(const Launch& l, const KArgs& p, bool pipelined, BackwardVariant variant) {
  run_backward<__half>(l, p, pipelined, variant);
}
}  // namespace symheap::attention::cuda
