// Attention over a KV cache (inference, forward only): the op core of the
// paged varlen call and of the decode call, free of Python and of torch.
//
// `CacheArgs` holds raw pointers, element strides and shapes; the PyTorch
// wrapper fills it from tensors and an XLA FFI handler can fill it from
// buffers. A call optionally appends new keys and values to the cache at each
// sequence's current length, then runs attention of the queries over the
// cache. The cache is dense ([batch, capacity, Hkv, D]) or paged
// ([num_blocks, block_size, Hkv, D] pools and a block table).
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "ops/attention/attention.hpp"

namespace symheap::attention {

struct CacheArgs {
  int batch = 0;
  int heads_q = 0;
  int heads_kv = 0;
  int head_dim = 0;

  // Queries and output: element [b, row, head, col] as in `Tensor`. Fixed
  // lengths: `seqlen_q` rows per sequence. Packed: cu_seqlens_q [batch + 1],
  // batch_stride 0, seqlen_q the maximum length and total_q the row count.
  Tensor q, out;
  int seqlen_q = 0;
  const int32_t* cu_seqlens_q = nullptr;
  int64_t total_q = 0;
  float* lse = nullptr;  // [b*lse_batch_stride + h*lse_head_stride + row]
  int64_t lse_batch_stride = 0;
  int64_t lse_head_stride = 0;

  // The cache. Dense (block_table null): k_cache.batch_stride steps over
  // sequences and `capacity` rows each. Paged: k_cache.batch_stride steps over
  // blocks of `block_size` rows; cache row j of sequence b is row
  // j % block_size of block block_table[b * block_table_stride + j / block_size],
  // and capacity = max_blocks * block_size.
  Tensor k_cache, v_cache;
  int capacity = 0;
  const int32_t* block_table = nullptr;
  int64_t block_table_stride = 0;
  int max_blocks = 0;
  int block_size = 0;
  int num_blocks = 0;

  // Rows in the cache before the call: seqlens_k[b], or with
  // `seqlens_k_cumulative` seqlens_k[b + 1] - seqlens_k[b] (cu_seqlens_k of
  // the varlen call).
  const int32_t* seqlens_k = nullptr;
  bool seqlens_k_cumulative = false;

  // New keys and values [b, row, head, col] (fixed length seqlen_new; data
  // null: none). Row t of sequence b is written to cache row seqlens_k[b] + t;
  // the keys attended are then the first seqlens_k[b] + seqlen_new rows.
  Tensor k_new, v_new;
  int seqlen_new = 0;

  // Options, as in `Args`: visibility is aligned bottom-right (query row i of
  // sq sees key j <= i + sk - sq with causal), softcap, ALiBi.
  float scale = 1.0f;
  float softcap = 0.0f;
  int window_left = -1;
  int window_right = -1;
  const float* alibi_slopes = nullptr;  // [batch or 1][heads_q]
  int64_t alibi_batch_stride = 0;

  // CUDA: splits of the key length (0 = chosen from the shapes and the device).
  int num_splits = 0;

  bool paged() const { return block_table != nullptr; }
  bool varlen() const { return cu_seqlens_q != nullptr; }
  bool appends() const { return k_new.data != nullptr; }
  int group() const { return heads_q / heads_kv; }
};

// A call as front ends describe it: each tensor with its dtype name, shape
// and element strides (absent ones not `present`). `cache_args` checks every
// shape, dtype and stride against the others and fills a CacheArgs; this is
// where all the shape checks live, for every front end.
struct TensorDesc {
  bool present = false;
  const void* data = nullptr;
  std::string dtype;  // "float32", "float16", "bfloat16", "int32", ...
  std::vector<int64_t> shape, strides;
};

struct CacheCall {
  // Decode: q (B, Sq, Hq, D), cache_seqlens (B,) int32, optional k, v
  // (B, S_new, Hkv, D) to append, out like q, lse (B, Hq, Sq) float32.
  // Paged varlen: q (total_q, Hq, D), cu_seqlens_q and cu_seqlens_k (B + 1,)
  // int32 (key lengths are the differences), max_seqlen_q, a block table,
  // out like q, lse (Hq, total_q) float32.
  // Caches: dense (B, capacity, Hkv, D), or with block_table (B, max_blocks)
  // int32, paged (num_blocks, block_size, Hkv, D).
  TensorDesc q, k_cache, v_cache, k, v, out, lse;
  TensorDesc cache_seqlens, cu_seqlens_q, cu_seqlens_k, block_table, alibi_slopes;
  int64_t max_seqlen_q = 0;  // (64 bits: cache_args checks the ranges, front ends pass ints on)
  float scale = 1.0f;
  float softcap = 0.0f;
  int window_left = -1;
  int window_right = -1;
  int64_t num_splits = 0;
};
CacheArgs cache_args(const CacheCall& call);

// Sets a call's scalar options from the user's: no softmax_scale (null) means
// 1/sqrt(head_dim), and a causal call sees no key right of its query (its
// window's right side is 0). Every front end sets them through this.
void set_cache_options(CacheCall& call, int64_t head_dim, bool causal, int64_t window_left,
                       int64_t window_right, const double* softmax_scale, double softcap);

// Checks of shapes, strides and options (no data is read). Throws
// InvalidArgument naming the argument and the allowed range.
void validate_cache(const CacheArgs& a);

// cpu path: also checks the lengths and the block ids a call would use
// (cache_seqlens >= 0, room for the appended rows, block ids in
// [0, num_blocks)) before it writes anything, and raises InvalidArgument.
void cache_attention_cpu(const CacheArgs& a, int threads);

#ifdef SYMHEAP_WITH_CUDA
// How a CUDA call runs on its device: which attention kernel (the query-major
// one where `previous`, else the keys-major one with `nb` n8 blocks of query
// vectors a CTA in `shape`), how many key-length splits, merged in a
// thread-block cluster or by the combine kernel, and the device workspace the
// launch needs (`bytes`). Made from the shapes, the options and the device
// (and SYMHEAP_DECODE_KERNEL / SYMHEAP_DECODE_MERGE, read on every call).
struct CacheCudaPlan {
  int device = -1, db = 0, mtiles = 1, splits = 1, nb = 1, shape = 0;
  bool previous = false, cluster = false;
  int64_t vectors = 0;
  size_t bytes = 0;
};

// Checks the args for the CUDA path and plans the call on `device`: a front
// end that allocates the workspace per call plans once, then launches.
CacheCudaPlan cache_attention_cuda_plan(const CacheArgs& a, int device);

// Launches a planned call (the args it was planned from); see below.
void cache_attention_cuda(const CacheArgs& a, const CacheCudaPlan& plan, void* stream,
                          void* workspace, size_t bytes);

// Bytes of device workspace (the partial results of the key-length splits),
// from the shapes alone; 0 when one split suffices. Pass the same args (and
// the same device) to cache_attention_cuda.
size_t cache_attention_cuda_workspace_bytes(const CacheArgs& a, int device);

// The key-length splits a call would use on `device` (a.num_splits when set).
// With num_splits fixed to this value the workspace size depends on the
// shapes alone, so a front end that sizes its scratch ahead of the call (XLA)
// can pin the choice.
int cache_attention_cuda_splits(const CacheArgs& a, int device);

// CUDA path: F16/BF16, head_dim a multiple of 8 (<= 256), 16-byte aligned
// rows. No host synchronisation and no allocation, so it can be captured in a
// CUDA graph. Lengths and block ids live on the device and are checked there:
// a sequence whose append would not fit or that names a block id out of range
// writes nothing to the cache, gets NaN outputs, and the first such error is
// recorded for the device. It is raised (InvalidArgument) by the next call on
// that device or by cache_check_cuda.
void cache_attention_cuda(const CacheArgs& a, int device, void* stream, void* workspace,
                          size_t bytes);

// Whether `stream` is being captured into a CUDA graph: a front end that
// recycles outputs or workspaces then allocates them per call instead, so the
// graph's memory pool owns what a replay writes.
bool cache_stream_capturing(void* stream);

// Raises the error a cache call recorded on `device` (and clears it); with
// `sync` it first waits for `stream`.
void cache_check_cuda(int device, void* stream, bool sync);
#endif

}  // namespace symheap::attention
