// CUDA side of the attention XLA FFI handlers: what the torch front end does
// with tensor ops around the core (zero fills, head-dim padding, the dbias
// reduction over broadcast dims), done here with small kernels on XLA's
// stream. Device work only: no host synchronisation, no allocation.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "xla_ffi/attention_ffi.hpp"

namespace symheap::attention::xla {
namespace {

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess)
    throw std::runtime_error(std::string("attention (XLA, CUDA): ") + what + " failed: " +
                             cudaGetErrorName(err));
}

// Makes `device` current for the launches and restores the caller's device.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    check(cudaGetDevice(&previous_), "cudaGetDevice");
    if (previous_ != device) {
      check(cudaSetDevice(device), "cudaSetDevice");
      changed_ = true;
    }
  }
  ~DeviceGuard() {
    if (changed_) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
  bool changed_ = false;
};

constexpr int kThreads = 256;

int blocks_for(int64_t n) {
  const int64_t b = (n + kThreads - 1) / kThreads;
  return static_cast<int>(b < 65535 * 32 ? (b < 1 ? 1 : b) : 65535 * 32);
}

// Head-dim vectors of 16-bit elements: dst (n, d_dst) <- src (n, d_src),
// zero-filled past d_src (padding) or cut at d_dst (unpadding).
__global__ void copy_vectors(const uint16_t* __restrict__ src, uint16_t* __restrict__ dst,
                             int64_t n, int d_src, int d_dst) {
  const int64_t total = n * d_dst;
  for (int64_t e = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; e < total;
       e += int64_t{gridDim.x} * blockDim.x) {
    const int64_t row = e / d_dst;
    const int col = static_cast<int>(e - row * d_dst);
    dst[e] = col < d_src ? src[row * d_src + col] : uint16_t{0};
  }
}

__global__ void fill_f32(float* p, int64_t n, float value) {
  for (int64_t e = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; e < n;
       e += int64_t{gridDim.x} * blockDim.x)
    p[e] = value;
}

// dbias[ob, oh, r, j] = sum of ws[b, h, r, j] over the (b, h) that broadcast
// onto (ob, oh); ws is (B, Hq, R, Sk) fp32. One thread per output element.
__global__ void reduce_dbias(const float* __restrict__ ws, void* __restrict__ out, int dtype,
                             int batch, int heads_q, int group, int64_t R, int64_t Sk, int64_t ob,
                             int64_t oh, int kv_heads) {
  const int64_t total = ob * oh * R * Sk;
  const int64_t slice = R * Sk;
  for (int64_t e = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; e < total;
       e += int64_t{gridDim.x} * blockDim.x) {
    const int64_t within = e % slice;
    const int64_t h_out = (e / slice) % oh;
    const int64_t b_out = e / (slice * oh);
    const int b0 = ob == 1 ? 0 : static_cast<int>(b_out), b1 = ob == 1 ? batch : b0 + 1;
    int h0, h1;
    if (oh == 1) {
      h0 = 0;
      h1 = heads_q;
    } else if (kv_heads) {
      h0 = static_cast<int>(h_out) * group;
      h1 = h0 + group;
    } else {
      h0 = static_cast<int>(h_out);
      h1 = h0 + 1;
    }
    float sum = 0.0f;
    for (int b = b0; b < b1; ++b)
      for (int h = h0; h < h1; ++h) sum += ws[(int64_t{b} * heads_q + h) * slice + within];
    if (dtype == 0) static_cast<float*>(out)[e] = sum;
    else if (dtype == 1) static_cast<__half*>(out)[e] = __float2half_rn(sum);
    else static_cast<__nv_bfloat16*>(out)[e] = __float2bfloat16_rn(sum);
  }
}

int64_t vectors(const CallPlan& p, bool keys) {
  const int64_t rows = p.varlen ? (keys ? p.total_k : p.total_q)
                                : int64_t{p.batch} * (keys ? p.seqlen_k : p.seqlen_q);
  return rows * (keys ? p.heads_kv : p.heads_q);
}

void copy(const Tensor& src, int d_src, const Tensor& dst, int d_dst, int64_t n, cudaStream_t s) {
  if (n == 0) return;
  copy_vectors<<<blocks_for(n * d_dst), kThreads, 0, s>>>(static_cast<const uint16_t*>(src.data),
                                                          static_cast<uint16_t*>(dst.data), n,
                                                          d_src, d_dst);
  check(cudaGetLastError(), "launch of the head-dim copy");
}

void zero(void* p, size_t bytes, cudaStream_t s) {
  if (bytes) check(cudaMemsetAsync(p, 0, bytes, s), "cudaMemsetAsync");
}

size_t tensor_bytes(const CallPlan& p, bool keys, int d) {
  return static_cast<size_t>(vectors(p, keys)) * d * dtype_size(p.dtype);
}

}  // namespace

void run_forward_cuda(const Call& c, int device, void* stream) {
  DeviceGuard guard(device);
  auto s = static_cast<cudaStream_t>(stream);
  const CallPlan& p = c.plan;
  const Args& a = c.args;
  const int d = p.head_dim, dr = p.head_dim_run;
  if (c.padded) {
    copy(c.user_q, d, a.q, dr, vectors(p, false), s);
    copy(c.user_k, d, a.k, dr, vectors(p, true), s);
    copy(c.user_v, d, a.v, dr, vectors(p, true), s);
  }
  if (p.varlen) {  // rows outside every sequence: out 0, lse -inf
    zero(a.out.data, tensor_bytes(p, false, dr), s);
    const int64_t n = int64_t{p.heads_q} * p.total_q;
    if (n) {
      fill_f32<<<blocks_for(n), kThreads, 0, s>>>(a.lse, n, -__builtin_huge_valf());
      check(cudaGetLastError(), "launch of the lse fill");
    }
  }
  forward_cuda(a, device, stream);
  if (c.padded) copy(a.out, dr, c.user_out, d, vectors(p, false), s);
}

void run_backward_cuda(const Call& c, int device, void* stream) {
  DeviceGuard guard(device);
  auto s = static_cast<cudaStream_t>(stream);
  const CallPlan& p = c.plan;
  const Args& a = c.args;
  const int d = p.head_dim, dr = p.head_dim_run;
  if (c.padded) {
    copy(c.user_q, d, a.q, dr, vectors(p, false), s);
    copy(c.user_k, d, a.k, dr, vectors(p, true), s);
    copy(c.user_v, d, a.v, dr, vectors(p, true), s);
    copy(c.user_out, d, a.out, dr, vectors(p, false), s);
    copy(c.user_dout, d, a.dout, dr, vectors(p, false), s);
  }
  if (p.varlen) {
    zero(a.dq.data, tensor_bytes(p, false, dr), s);
    zero(a.dk.data, tensor_bytes(p, true, dr), s);
    zero(a.dv.data, tensor_bytes(p, true, dr), s);
  }
  if (a.dbias.data) zero(a.dbias.data, c.layout.bytes[ScratchLayout::DBIAS], s);
  backward_cuda(a, device, stream, c.delta, c.delta_bytes);
  if (c.padded) {
    copy(a.dq, dr, c.user_dq, d, vectors(p, false), s);
    copy(a.dk, dr, c.user_dk, d, vectors(p, true), s);
    copy(a.dv, dr, c.user_dv, d, vectors(p, true), s);
  }
  if (c.dbias_out) {
    const int64_t R = p.bias.per_row ? p.seqlen_q : 1;
    const int64_t n = p.bias.dims[0] * p.bias.dims[1] * R * p.seqlen_k;
    if (n) {
      reduce_dbias<<<blocks_for(n), kThreads, 0, s>>>(
          static_cast<const float*>(a.dbias.data), c.dbias_out, static_cast<int>(p.bias_dtype),
          p.batch, p.heads_q, p.heads_q / p.heads_kv, R, p.seqlen_k, p.bias.dims[0],
          p.bias.dims[1], p.bias.kv_heads ? 1 : 0);
      check(cudaGetLastError(), "launch of the dbias reduction");
    }
  }
}

}  // namespace symheap::attention::xla
