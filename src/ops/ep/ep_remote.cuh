// Kernels of a device op with PEs on other nodes (kernel='copy_engine'):
// the kernels store into mapped PEs only, so this PE's routing-count row
// reaches another node's PEs through the host (ep_device_driver.hpp):
//   count_row    one block: this PE's count row over every token, published
//                (tagged) into every mapped PE, this one included; the host
//                then puts it to the other nodes with a signal on their
//                count flags;
//   wait_remote  one block: waits until the flags that other nodes' PEs set
//                through the remote transport (or one given PE's) reach a
//                target, so that the grids after it never spin (holding
//                every SM) on bytes that the network engine's kernels still
//                have to land here.
#pragma once
#include "ops/ep/ep_dispatch.cuh"

namespace symheap::ep::EP_DEVICE_NS::kernels {

// The counts are those dispatch_kernel's ticket 0 publishes (the same ids,
// the same status), so its later publication into mapped PEs agrees.
__global__ void __launch_bounds__(kThreads) count_row_kernel(Params p) {
  const int n = p.n_pes, E = p.cfg.num_experts;
  const bool tm = p.cfg.layout == Layout::TokenMajor;
  const uint64_t epoch = dev::load_relaxed(local_word(p, kDispatchEpoch)) + 1;
  EP_DYNAMIC_SHARED(int32_t, dyn);
  int32_t* hist = dyn;         // [E] pairs per expert
  int32_t* run = hist + E;     // [n] rows per destination
  int32_t* scratch = run + n;  // [max(2 E, 4 kThreads)]: a chunk's ids as int16, or the scan
  __shared__ int bad;
  if (threadIdx.x == 0) bad = INT32_MAX;
  for (int i = threadIdx.x; i < E + n; i += blockDim.x) hist[i] = 0;  // and run
  __syncthreads();
  if (tm)
    rank_by_warp(p, 0, p.num_tokens, run, reinterpret_cast<int16_t*>(scratch), nullptr, hist,
                 &bad);
  else
    count_expert_pairs(p, 0, p.num_tokens * p.cfg.topk, hist, &bad);
  publish_counts(p, epoch, tm, run, hist, bad, scratch);
}

template <class Rt>
void launch_count_row(Rt& rt, const Params& p, StreamHandle stream) {
  const size_t scratch =
      std::max(2 * static_cast<size_t>(p.cfg.num_experts), 4 * static_cast<size_t>(kThreads));
  const size_t shared =
      (static_cast<size_t>(p.cfg.num_experts) + p.n_pes + scratch) * sizeof(int32_t);
  rt.launch(count_row_kernel, 1, kThreads, shared, stream, p);
}

// A timeout is recorded (naming the late PE) like any wait's; the grids
// after it then see the error word and give up at once. It never releases
// the next kernel early (release_next_kernel): that grid's blocks would take
// the SMs while it waits.
// only >= 0: PE `only`'s flag alone (forwarding: a source of another node,
// or a PE of this node whose copies raise it).
__global__ void __launch_bounds__(32) wait_remote_kernel(Params p, uint64_t off_flags,
                                                         uint64_t target, uint64_t epoch,
                                                         int32_t only) {
  if (threadIdx.x == 0) wait_all(p, off_flags, target, epoch, only < 0, only);
}

template <class Rt>
void launch_wait_remote(Rt& rt, const Params& p, size_t off_flags, uint64_t target,
                        uint64_t epoch, StreamHandle stream, int32_t only = -1) {
  rt.launch(wait_remote_kernel, 1, 32, 0, stream, p, static_cast<uint64_t>(off_flags), target,
            epoch, only);
}

}  // namespace symheap::ep::EP_DEVICE_NS::kernels
