// FlashAttention-style multi-head attention: the op core, free of Python.
//
// Everything a call needs is passed in `Args`: pointers, element strides,
// shapes, options, and (on CUDA) the device, the stream and the workspace.
// The PyTorch wrapper fills it from tensors; an XLA FFI handler can fill it
// from buffers the same way.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

namespace symheap::attention {

enum class DType : int { F32 = 0, F16 = 1, BF16 = 2 };
const char* dtype_name(DType t);
size_t dtype_size(DType t);

// q, k, v, out, dout, dq, dk, dv: element [b, row, head, col] lives at
// data + b*batch_stride + row*row_stride + head*head_stride + col (unit stride
// along the head dimension). For variable-length batches batch_stride is 0
// and `row` is the packed row (cu_seqlens[b] + position).
struct Tensor {
  void* data = nullptr;
  DType dtype = DType::F32;
  int64_t batch_stride = 0;
  int64_t row_stride = 0;
  int64_t head_stride = 0;
};

// bias, mask and dbias: element [b, h, i, j] at data + b*sb + h*sh + i*sq + j*sk.
// A stride of 0 broadcasts that dimension. `kv_heads` says the head dimension
// has H_kv entries (head index hq / group) rather than H_q (or 1 with sh = 0).
// For dbias (always fp32, H_q heads) sq = 0 means "sum over query rows".
struct Broadcast {
  void* data = nullptr;
  DType dtype = DType::F32;  // bias: F32/F16/BF16; mask: bytes, nonzero = keep
  int64_t sb = 0, sh = 0, sq = 0, sk = 1;
  bool kv_heads = false;
};

struct Args {
  // Shapes. For variable-length batches seqlen_q / seqlen_k are the upper
  // bounds (max_seqlen) and total_q / total_k the packed row counts.
  int batch = 0;
  int heads_q = 0;
  int heads_kv = 0;
  int head_dim = 0;
  int seqlen_q = 0;
  int seqlen_k = 0;
  int64_t total_q = 0;
  int64_t total_k = 0;
  const int32_t* cu_seqlens_q = nullptr;  // [batch + 1] or null (fixed lengths)
  const int32_t* cu_seqlens_k = nullptr;

  // Options. Logit of (i, j): softcap(scale * q.k) + bias + alibi, with
  // softcap(x) = c * tanh(x / c) when c > 0. Key j is visible to query i when
  // i + (Sk - Sq) - window_left <= j <= i + (Sk - Sq) + window_right (a
  // negative window side is unbounded; causal is window_right = 0, so the
  // diagonal is aligned bottom-right) and the mask allows it.
  float scale = 1.0f;
  float softcap = 0.0f;
  int window_left = -1;
  int window_right = -1;
  Broadcast bias;                         // data null: no bias
  Broadcast mask;                         // data null: no mask
  const float* alibi_slopes = nullptr;    // [batch or 1][heads_q]: -slope * |i + Sk - Sq - j|
  int64_t alibi_batch_stride = 0;
  float dropout_p = 0.0f;                 // on the probabilities, kept ones scaled by 1/(1-p)
  uint64_t seed = 0;
  uint64_t offset = 0;                    // below 2^32

  // Forward.
  Tensor q, k, v, out;
  float* lse = nullptr;                   // [b*lse_batch_stride + h*lse_head_stride + row]
  int64_t lse_batch_stride = 0;
  int64_t lse_head_stride = 0;

  // Backward (out and lse come from the forward).
  Tensor dout, dq, dk, dv;
  Broadcast dbias;                        // fp32, H_q heads; data null: no dbias
  bool deterministic = false;

  bool varlen() const { return cu_seqlens_q != nullptr; }
  int group() const { return heads_q / heads_kv; }
};

// Throws InvalidArgument naming what is wrong (shapes, strides, options).
void validate(const Args& a, bool backward);

// cpu path: fp32 accumulation over F32/F16/BF16 inputs, `threads` workers
// (0 = a default from the machine and SYMHEAP_ATTN_THREADS).
void forward_cpu(const Args& a, int threads);
void backward_cpu(const Args& a, int threads);

// The dropout generator: 16 random bits for element (b*H_q + h, i, j) of the
// call (seed, offset). Identical on cpu and CUDA; kept iff bits >= threshold.
// (j is 64-bit so that every octet j / 8 < 2^32 of the counter can be asked for.)
uint32_t dropout_bits(uint64_t seed, uint64_t offset, uint32_t bh, uint32_t i, uint64_t j);
uint32_t dropout_threshold(float p);

// cpu building blocks shared with the KV-cache path (decode_cpu.cpp): the
// worker pool (same thread count rule) and fp32 row conversions.
void cpu_parallel_for(int64_t items, int threads, const std::function<void(int64_t)>& fn);
// The threads a cpu call of `work` multiply-adds runs on: `threads` when given
// (> 0); else 1 for small work (worker threads start per call), else 0 (the
// default count).
int cpu_threads_for(int64_t work, int threads);
void cpu_load_row(const void* base, DType t, int64_t off, int n, float* dst);
void cpu_store_row(void* base, DType t, int64_t off, int n, const float* src);
float cpu_dot(const float* x, const float* y, int n);

#ifdef SYMHEAP_WITH_CUDA
// CUDA path: F16/BF16 tensors, head_dim a multiple of 8 (<= 256), rows
// 16-byte aligned. Runs on `stream`, which must belong to `device`; no host
// synchronisation and no device allocation.
void forward_cuda(const Args& a, int device, void* stream);
// Bytes of device workspace the backward needs, from shapes alone.
size_t backward_cuda_workspace_bytes(const Args& a);
void backward_cuda(const Args& a, int device, void* stream, void* workspace, size_t bytes);
#endif

}  // namespace symheap::attention
