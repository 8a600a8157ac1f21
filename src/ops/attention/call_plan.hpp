// The checks and shape planning of one attention call, from the shapes and
// dtypes of its arguments alone. Every front end (the torch functions, the
// XLA FFI handlers) describes its arguments as a CallSpec and gets the same
// errors and the same plan back.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "ops/attention/attention.hpp"

namespace symheap::attention {

// One argument as a front end sees it. dtype by name: "float32", "float16",
// "bfloat16", "bool", "int32", ... (anything else is reported as given).
struct ArgSpec {
  bool present = false;
  std::vector<int64_t> shape;
  std::string dtype;
};

struct CallSpec {
  bool varlen = false;
  bool on_cuda = false;  // the CUDA path: float16/bfloat16, head dim padded to a multiple of 8
  ArgSpec q, k, v, bias, mask, alibi_slopes, cu_seqlens_q, cu_seqlens_k;
  int64_t max_seqlen_q = 0, max_seqlen_k = 0;  // varlen only
  bool causal = false;
  int64_t window_left = -1, window_right = -1;
  bool has_scale = false;  // false: 1/sqrt(head_dim)
  double softmax_scale = 0;
  double softcap = 0;
  double dropout_p = 0;
};

// bias or mask seen as (B or 1, Hq or Hkv or 1, Sq or 1, Sk), row-major.
struct BroadcastPlan {
  bool present = false;
  int64_t dims[4] = {1, 1, 1, 1};
  bool kv_heads = false;  // the head dim has Hkv != Hq entries
  bool per_row = false;   // has a query-row dimension (dbias keeps it)
  // Element strides of a contiguous array of `dims`, 0 on broadcast dims.
  int64_t sb() const { return dims[0] == 1 ? 0 : dims[1] * dims[2] * dims[3]; }
  int64_t sh() const { return dims[1] == 1 ? 0 : dims[2] * dims[3]; }
  int64_t sq() const { return dims[2] == 1 ? 0 : dims[3]; }
};

struct CallPlan {
  bool varlen = false;
  bool on_cuda = false;
  DType dtype = DType::F32;
  int batch = 0, heads_q = 0, heads_kv = 0;
  int head_dim = 0;      // the caller's
  int head_dim_run = 0;  // what the core runs (CUDA: padded to a multiple of 8)
  int seqlen_q = 0, seqlen_k = 0;  // max_seqlen for varlen
  int64_t total_q = 0, total_k = 0;  // packed rows (varlen)
  float scale = 1, softcap = 0, dropout_p = 0;
  int window_left = -1, window_right = -1;
  BroadcastPlan bias, mask;
  DType bias_dtype = DType::F32;
  bool alibi = false;
  bool alibi_per_batch = false;  // (B, Hq) with B > 1
};

// Throws InvalidArgument ("attention: ...") naming the argument and what is allowed.
CallPlan plan_call(const CallSpec& spec);

// The one scratch buffer an XLA FFI call takes (forward or backward), laid
// out to serve both the cpu and the CUDA handler (the result shapes of a call
// cannot depend on the platform): padded copies of q, k, v, out (and dout, dq,
// dk, dv) when the head dim is not a multiple of 8, the CUDA backward's delta
// (rowsum(dout * out)) and the fp32 dbias accumulator. Offsets in bytes, each
// 256-aligned; a piece not needed has size 0.
struct ScratchLayout {
  enum Piece { Q, K, V, OUT, DOUT, DQ, DK, DV, DELTA, DBIAS, COUNT };
  size_t offset[COUNT] = {};
  size_t bytes[COUNT] = {};
  size_t total = 0;
  bool padded = false;  // q, k, v, ... run through padded copies on CUDA
};
ScratchLayout scratch_layout(const CallPlan& p, bool backward, bool want_dbias);

}  // namespace symheap::attention
