// Forwarding inside a node on the device path (copy_engine across nodes;
// the host side is in ep_device_driver.hpp). A source on another node puts,
// once per node, the rows of its tokens bound for any PE of this node (by
// token) and, by its staging row, what per-PE sending puts beside each row
// (ids, weights, metadata) to its forwarder here; once they landed,
// forward_rows stores each row into its destination's receive buffer on
// this node, at the row per-PE sending would have put it there.
// Combine: this node's PEs copy the rows of such a source's tokens into its
// forwarder's staging rows; the source sends a plan per token (its combine
// rows there, their weights); forward_sums adds each token's rows, and the
// host puts the sums back to the source, one row per token.
#pragma once
#include "ops/ep/ep_combine.cuh"
#include "ops/ep/ep_dispatch.cuh"

namespace symheap::ep::EP_DEVICE_NS::kernels {

// Rows from `src` into the receive buffers of this node's PEs (the mapped
// ones). The source's staging rows are in send order: per column (a
// destination PE, token-major, or an expert) [prefix, prefix + rows), which
// land at [base, base + rows) of that column's destination; the count
// matrix gives both, as the source's own packing computed them.
__global__ void __launch_bounds__(kThreads) forward_rows_kernel(Params p, int32_t src) {
  const Geometry& g = p.geo;
  const int n = p.n_pes, L = g.local_experts, K = p.cfg.topk;
  const bool tm = p.cfg.layout == Layout::TokenMajor;
  const int cols = tm ? n : p.cfg.num_experts;
  const int first = tm ? kCountDest : kCountDest + n;
  if (dev::load_relaxed(local_word(p, kErrorWord)) == kPeerTimeout) return;  // a wait gave up
  const uint64_t epoch = dev::load_relaxed(local_word(p, kDispatchEpoch)) + 1;
  EP_DYNAMIC_SHARED(int32_t, dyn);
  int32_t* rows = dyn;            // [cols] src's rows per column
  int32_t* prefix = rows + cols;  // [cols] its first staging row per column
  int64_t* base = reinterpret_cast<int64_t*>(prefix + cols + (cols & 1));  // [cols]
  for (int j = threadIdx.x; j < cols; j += blockDim.x) {
    int64_t before = 0;
    for (int q = 0; q < src; ++q) before += count_cell(p, epoch, q, first + j);
    base[j] = tm ? before : static_cast<int64_t>(j % L) * g.expert_cap + before;
    rows[j] = count_cell(p, epoch, src, first + j);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int32_t sum = 0;
    for (int j = 0; j < cols; ++j) {
      prefix[j] = sum;
      sum += rows[j];
    }
  }
  __syncthreads();
  const int64_t total = static_cast<int64_t>(prefix[cols - 1]) + rows[cols - 1];
  const int lane = threadIdx.x & 31;
  const int64_t warps = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> 5;
  const int64_t mine = src * g.combine_rows;  // src's staging rows here
  const size_t idx_bytes = static_cast<size_t>(K) * 4, w_bytes = (tm ? K : 1) * 4;
  for (int64_t r = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
       r < total && r < g.combine_rows; r += warps) {
    int lo = 0, hi = cols - 1;  // the last column starting at or before r holds it
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (prefix[mid] <= r) lo = mid;
      else hi = mid - 1;
    }
    const int j = lo, d = tm ? j : j / L;
    if (!stores_reach(p, d)) continue;  // a PE of another node: not forwarded here
    const int64_t dst = base[j] + (r - prefix[j]);
    const int32_t* meta = at<int32_t>(p, p.my_pe, g.off_fwd_meta) + (mine + r) * kMetaWords;
    const int32_t t = meta[kMetaToken];
    if (dst < 0 || dst >= g.recv_rows || t < 0 || t >= p.cfg.max_tokens) continue;  // (bounds)
    const int64_t tok = static_cast<int64_t>(src) * p.cfg.max_tokens + t;
    warp_copy(at<char>(p, d, g.off_recv_x) + dst * g.row_bytes,
              at<char>(p, p.my_pe, g.off_fwd_x) + tok * g.row_bytes, g.row_bytes, lane);
    if (g.scale_row_bytes)
      warp_copy(at<char>(p, d, g.off_recv_scales) + dst * g.scale_row_bytes,
                at<char>(p, p.my_pe, g.off_fwd_scales) + tok * g.scale_row_bytes,
                g.scale_row_bytes, lane);
    if (tm)
      warp_copy(at<char>(p, d, g.off_recv_idx) + dst * idx_bytes,
                at<char>(p, p.my_pe, g.off_fwd_idx) + (mine + r) * idx_bytes, idx_bytes, lane);
    warp_copy(at<char>(p, d, g.off_recv_w) + dst * w_bytes,
              at<char>(p, p.my_pe, g.off_fwd_w) + (mine + r) * w_bytes, w_bytes, lane);
    warp_copy(at<char>(p, d, g.off_recv_meta) + dst * kMetaWords * 4,
              reinterpret_cast<const char*>(meta), kMetaWords * 4, lane);
  }
}

template <class Rt>
void launch_forward_rows(Rt& rt, const Params& p, int32_t src, int blocks, StreamHandle stream) {
  const size_t cols = p.cfg.layout == Layout::TokenMajor ? p.n_pes : p.cfg.num_experts;
  const size_t shared = (2 * cols + (cols & 1)) * sizeof(int32_t) + cols * sizeof(int64_t);
  rt.launch(forward_rows_kernel, blocks, kThreads, shared, stream, p, src);
}

// The partial sums of `records` tokens of `src` (a source on another node
// this PE forwards for). Record i of its plan [token, combine row per column
// (-1: none here), weight per column] names rows this node's PEs staged
// here; their weighted sum in fp32, rounded to the combine dtype, goes to
// row i of this PE's partials for src, which the host puts back to src.
__global__ void __launch_bounds__(kThreads) forward_sums_kernel(Params p, int32_t src,
                                                                int32_t records) {
  const Geometry& g = p.geo;
  if (dev::load_relaxed(local_word(p, kErrorWord)) == kPeerTimeout) return;  // a wait gave up
  const int S = g.send_cols;
  const DType dt = g.combine_dtype;
  const size_t crb = g.combine_row_bytes;
  const int64_t vecs = static_cast<int64_t>(crb / 16), cap = p.cfg.max_tokens;
  const int lane = threadIdx.x & 31;
  const int64_t warps = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> 5;
  const int32_t* plans = at<int32_t>(p, p.my_pe, g.off_plan_rec) + src * cap * g.plan_words;
  const char* staged = at<char>(p, p.my_pe, g.off_stage_rows) + src * g.combine_rows * crb;
  char* partial = at<char>(p, p.my_pe, g.off_partial) + src * cap * crb;
  for (int64_t i = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
       i < records && i < cap; i += warps) {
    const int32_t* rec = plans + i * g.plan_words;
    int4* out = reinterpret_cast<int4*>(partial + i * crb);
    for (int64_t c = lane; c < vecs; c += 32) {
      float acc[8] = {};
      for (int j = 0; j < S; ++j) {
        const int32_t crow = rec[1 + j];
        if (crow < 0 || crow >= g.combine_rows) continue;
        const float w = __int_as_float(rec[1 + S + j]);
        float f[8];
        const int m =
            unpack16(__ldcg(reinterpret_cast<const int4*>(staged + crow * crb) + c), dt, f);
        for (int k = 0; k < m; ++k) acc[k] += w * f[k];
      }
      out[c] = pack16(acc, dt);
    }
  }
}

template <class Rt>
void launch_forward_sums(Rt& rt, const Params& p, int32_t src, int32_t records, int blocks,
                         StreamHandle stream) {
  rt.launch(forward_sums_kernel, blocks, kThreads, 0, stream, p, src, records);
}

}  // namespace symheap::ep::EP_DEVICE_NS::kernels
