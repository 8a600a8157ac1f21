// Received rows into caller-owned outputs (DispatchArgs::out_*, what the XLA
// front end passes) when the peers did not store them there themselves
// (Params::publish_outputs): launched after a dispatch kernel on the same stream,
// once every row has landed in the receive buffer (a dispatch kernel ends
// only then). Copies only the rows within the counts, and skips those the
// dispatch kernel stored there itself (token-major rows a PE sends to
// itself): no full-capacity copy. Past the counts it writes the cheap
// defaults (token-major ids -1, weights 0, metadata -1; expert-major
// weights 0) and leaves x and scales alone. token_slots: every slot (its
// empty slots hold those defaults already).
#pragma once
#include "ops/ep/ep_device_helpers.cuh"

namespace symheap::ep::EP_DEVICE_NS::kernels {

__global__ void __launch_bounds__(kThreads) collect_kernel(Params p) {
  start_kernel();
  const Geometry& g = p.geo;
  const bool slots = p.cfg.token_slots;
  const bool tm = p.cfg.layout == Layout::TokenMajor;
  const int K = p.cfg.topk;
  // Token-major: rows [0, valid) arrived; [self_lo, self_hi) are this PE's
  // own, already in place (not when packed for the copy engine: the channels
  // moved every row into the receive buffer).
  int64_t valid = g.recv_rows, self_lo = 0, self_hi = 0;
  if (tm && !slots) {
    valid = *p.num_recv;
    if (p.out_x && !p.pack_for_copy_engine) {
      self_lo = p.recv_summary[4 * p.my_pe + 2];
      self_hi = self_lo + p.recv_summary[4 * p.my_pe + 1];
    }
  }
  const char* x = at<char>(p, p.my_pe, g.off_recv_x);
  const char* scales = at<char>(p, p.my_pe, g.off_recv_scales);
  const char* idx = at<char>(p, p.my_pe, g.off_recv_idx);
  const char* w = at<char>(p, p.my_pe, g.off_recv_w);
  const char* meta = at<char>(p, p.my_pe, g.off_recv_meta);
  const size_t topk_bytes = static_cast<size_t>(K) * 4, meta_bytes = kMetaWords * 4;
  const int lane = threadIdx.x & 31;
  const int64_t warps = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> 5;
  for (int64_t r = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
       r < g.recv_rows; r += warps) {
    const bool in = tm ? r < valid : r % g.expert_cap < p.expert_counts[r / g.expert_cap];
    if (in && r >= self_lo && r < self_hi) continue;
    if (in) {
      warp_copy(p.out_x + r * g.row_bytes, x + r * g.row_bytes, g.row_bytes, lane);
      if (g.scale_row_bytes)
        warp_copy(p.out_scales + r * g.scale_row_bytes, scales + r * g.scale_row_bytes,
                  g.scale_row_bytes, lane);
      if (tm) {
        warp_copy(reinterpret_cast<char*>(p.out_idx) + r * topk_bytes, idx + r * topk_bytes,
                  topk_bytes, lane);
        warp_copy(reinterpret_cast<char*>(p.out_w) + r * topk_bytes, w + r * topk_bytes,
                  topk_bytes, lane);
        warp_copy(reinterpret_cast<char*>(p.out_meta) + r * meta_bytes, meta + r * meta_bytes,
                  meta_bytes, lane);
      } else if (lane == 0) {
        p.out_w[r] = reinterpret_cast<const float*>(w)[r];
      }
    } else if (tm) {
      for (int k = lane; k < K; k += 32) {
        p.out_idx[r * K + k] = -1;
        p.out_w[r * K + k] = 0.0f;
      }
      if (lane < kMetaWords) p.out_meta[r * kMetaWords + lane] = -1;
    } else if (lane == 0) {
      p.out_w[r] = 0.0f;
    }
  }
}

// One warp per row over at most a full grid of blocks.
template <class Rt>
void launch_collect(Rt& rt, const Params& p, int max_blocks, StreamHandle stream) {
  const int64_t per_block = kWarpsPerBlock;
  const int64_t blocks = (p.geo.recv_rows + per_block - 1) / per_block;
  rt.launch_early(collect_kernel, static_cast<int>(std::clamp<int64_t>(blocks, 1, max_blocks)),
                  kThreads, 0, stream, p);
}

}  // namespace symheap::ep::EP_DEVICE_NS::kernels
