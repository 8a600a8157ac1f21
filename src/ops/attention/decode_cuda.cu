// CUDA path of attention over a KV cache: an append kernel (new rows into the
// cache at each sequence's length), a split-K attention kernel, and a combine
// kernel that merges the splits by their log-sum-exp.
//
// An attention kernel runs one CTA per (key split, kv head x query vectors,
// sequence). The query vectors are (query row, head) pairs of one kv-head
// group, so each K/V row is read once for all of them; K/V tiles stream
// through shared memory by cp.async and the products run on the tensor cores.
// keys_major_kernel (keys on the MMA rows, 8 or 16 query vectors per CTA on
// its columns; at head dim 128 many sequences x kv heads run it two CTAs an
// SM) runs most calls; attention_kernel (16 vectors per CTA on the MMA rows),
// the kernel it replaced, runs calls of many sequences x kv heads at other
// head dims (choose_kernel) or when SYMHEAP_DECODE_KERNEL asks for it. Lengths and
// block ids are read on the device only: a bad one is recorded in a
// host-mapped word (raised by the next call or by cache_check_cuda) and the
// sequence gets NaN outputs, with no access out of bounds and no write to
// the cache.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <type_traits>

#include "backends/cuda_kernel_cache.cuh"
#include "backends/cuda_util.cuh"
#include "ops/attention/common.hpp"
#include "ops/attention/cuda_common.cuh"
#include "ops/attention/decode.hpp"
#include "symheap/errors.hpp"
#include "symheap/runtime.hpp"

namespace symheap::attention {
namespace kvcache {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kMinKeysPerSplit = 128;
constexpr int kMaxSplits = 256;

// Codes of the recorded error word: code << 56 | sequence << 32 | value.
enum : unsigned { kBadLength = 1, kNoRoom = 2, kBadBlock = 3 };

struct Params {
  const void* q;
  void* out;
  float* lse;
  int64_t q_sb, q_sr, q_sh, o_sb, o_sr, o_sh, lse_sb, lse_sh;
  const void* k;
  const void* v;
  int64_t k_sb, k_sr, k_sh, v_sb, v_sr, v_sh;
  const void* k_new;
  const void* v_new;
  int64_t kn_sb, kn_sr, kn_sh, vn_sb, vn_sr, vn_sh;
  int s_new;
  const int32_t* cu_q;
  int64_t total_q;
  int seqlen_q;
  const int32_t* seqlens_k;
  int cumulative;
  const int32_t* table;
  int64_t table_stride;
  int block_size, block_shift, num_blocks, capacity;  // block_shift: log2(block_size) or -1
  int batch, heads_q, heads_kv, group, d;
  float scale, softcap;
  int win_left, win_right;
  const float* alibi;
  int64_t alibi_sb;
  int splits, mtiles;
  int64_t vectors;  // flat query rows x heads_q: the workspace's stride between splits
  float* part_out;  // [split][vector][d]
  float* part_lse;  // [split][vector]
  int cluster_merge;  // the splits of a CTA's vectors are one thread-block cluster: merged there
  unsigned long long* error;  // host-mapped
};

__device__ __forceinline__ void record_error(const Params& p, unsigned code, int b, int value) {
  volatile unsigned long long* w = p.error;
  if (*w != 0ull) return;  // keep the first one seen
  *w = static_cast<unsigned long long>(code) << 56 |
       static_cast<unsigned long long>(static_cast<unsigned>(b) & 0xFFFFFFu) << 32 |
       static_cast<unsigned>(value);
  __threadfence_system();
}

__device__ __forceinline__ int length_before(const Params& p, int b) {
  return p.cumulative ? p.seqlens_k[b + 1] - p.seqlens_k[b] : p.seqlens_k[b];
}

struct QSeq {
  int64_t q0;  // first packed row (0 for fixed lengths)
  int sq;
  int64_t flat0;  // first row in the flat row numbering of the workspace
};

// Packed lengths are clamped to the buffers (as the other attention kernels do).
__device__ __forceinline__ QSeq query_seq(const Params& p, int b) {
  if (!p.cu_q) return QSeq{0, p.seqlen_q, static_cast<int64_t>(b) * p.seqlen_q};
  const int64_t q1 = min(static_cast<int64_t>(p.cu_q[b + 1]), p.total_q);
  const int64_t q0 = max(int64_t{0}, min(static_cast<int64_t>(p.cu_q[b]), q1));
  return QSeq{q0, static_cast<int>(min(q1 - q0, static_cast<int64_t>(p.seqlen_q))), q0};
}

// Block and in-block row of cache row j; false for a block id out of range.
__device__ __forceinline__ bool locate(const Params& p, int b, int j, int* block, int* row) {
  if (!p.table) {
    *block = b;
    *row = j;
    return true;
  }
  const int id = p.table[b * p.table_stride + j / p.block_size];
  *block = id;
  *row = j % p.block_size;
  return id >= 0 && id < p.num_blocks;
}

template <class T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16(x);
}
template <>
__device__ __forceinline__ __half from_float<__half>(float x) {
  return __float2half(x);
}

__device__ __forceinline__ uint4 load16(const void* base, int64_t elem_offset) {
  return __ldg(reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(base) + elem_offset));
}

// ---------------------------------------------------------------- append

// One CTA per (new row t, sequence b). A sequence whose rows would not fit, or
// whose blocks for them are out of range, writes nothing.
__global__ void __launch_bounds__(kThreads) append_kernel(const Params p) {
  const int t = blockIdx.x, b = blockIdx.y;
  const int len = length_before(p, b);
  if (len < 0 || len > p.capacity - p.s_new) {
    if (t == 0 && threadIdx.x == 0) record_error(p, len < 0 ? kBadLength : kNoRoom, b, len);
    return;
  }
  if (p.table) {
    const int first = len / p.block_size, last = (len + p.s_new - 1) / p.block_size;
    for (int c = first; c <= last; ++c) {
      const int id = p.table[b * p.table_stride + c];
      if (id < 0 || id >= p.num_blocks) {
        if (t == 0 && threadIdx.x == 0) record_error(p, kBadBlock, b, id);
        return;
      }
    }
  }
  int block, row;
  locate(p, b, len + t, &block, &row);
  const int chunks = p.d / 8;
  for (int idx = threadIdx.x; idx < p.heads_kv * chunks; idx += kThreads) {
    const int h = idx / chunks, c = (idx % chunks) * 8;
    const uint4 kx = load16(p.k_new, b * p.kn_sb + t * p.kn_sr + h * p.kn_sh + c);
    const uint4 vx = load16(p.v_new, b * p.vn_sb + t * p.vn_sr + h * p.vn_sh + c);
    *reinterpret_cast<uint4*>(static_cast<uint16_t*>(const_cast<void*>(p.k)) + block * p.k_sb +
                              row * p.k_sr + h * p.k_sh + c) = kx;
    *reinterpret_cast<uint4*>(static_cast<uint16_t*>(const_cast<void*>(p.v)) + block * p.v_sb +
                              row * p.v_sr + h * p.v_sh + c) = vx;
  }
}

// ---------------------------------------------------------------- attention, queries on M

// The query-major kernel (the default before keys_major_kernel; kept to
// compare the two: SYMHEAP_DECODE_KERNEL=previous). Keys are staged through
// shared memory in tiles of kTileKeys rows by cp.async, Tile::kStages deep,
// so the loads of the next tiles are in flight while one is computed. Each
// warp takes 16 keys of a tile: S = Q K^T and O += P V on the tensor cores
// (mma.sync m16n8k16, fp32 accumulation), the 16 rows of Q being the CTA's
// query vectors, with an online softmax per row.
constexpr int kTileKeys = 64;
constexpr int kVectors = 16;  // query vectors (row, head) per CTA

template <int DB>
struct Tile {
  static constexpr int kLd = DB + 8;  // padded rows: conflict-free fragment loads
  static constexpr int kStages = DB <= 128 ? 3 : 2;
  static constexpr int kStageElems = 2 * kTileKeys * kLd;  // K then V
  static constexpr int kChunksPerThread = kTileKeys * DB / 8 / kThreads;
  static constexpr size_t kPipeBytes = sizeof(uint16_t) * (kStages * kStageElems + kVectors * kLd);
  static constexpr size_t kMergeBytes = sizeof(float) * kWarps * kVectors * (DB + 2);
  static constexpr size_t kSmem = kPipeBytes > kMergeBytes ? kPipeBytes : kMergeBytes;
};

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool fill) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem),
               "r"(fill ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Four 8x8 b16 matrices, transposed: the B fragments (keys x dims, "col") of
// two 8-column blocks of a row-major V tile, from shared-memory byte address a.
__device__ __forceinline__ void ldmatrix_x4_trans_at(uint32_t r[4], unsigned a) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t r[4], const void* smem) {
  ldmatrix_x4_trans_at(r, static_cast<unsigned>(__cvta_generic_to_shared(smem)));
}

// Four 8x8 b16 matrices as stored: with rows = keys and columns = dims of a
// row-major K tile, the B fragments of S = Q K^T for two 8-key blocks.
__device__ __forceinline__ void ldmatrix_x4_at(uint32_t r[4], unsigned a) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}
__device__ __forceinline__ void ldmatrix_x4(uint32_t r[4], const void* smem) {
  ldmatrix_x4_at(r, static_cast<unsigned>(__cvta_generic_to_shared(smem)));
}

// The keys one split of a CTA walks: [k_lo, k_hi), inside the keys any of
// the CTA's vectors [v0, v0 + nv) sees (visible ranges grow with the row),
// that span cut into `splits` ranges of whole tn-key tiles; t_begin is the
// first key of the split's first tile.
struct SplitKeys {
  int k_lo, k_hi, t_begin, n_tiles;
};

template <int TN>
__device__ __forceinline__ SplitKeys split_keys(const Params& p, const QSeq& qs, int sk, bool bad,
                                                int v0, int nv, int n_vec, int split) {
  int span_lo = 0, span_hi = 0;
  const int last = min(n_vec, v0 + nv) - 1;
  if (!bad) {
    span_lo = detail::visible_keys(v0 / p.group, qs.sq, sk, p.win_left, p.win_right).lo;
    span_hi = detail::visible_keys(last / p.group, qs.sq, sk, p.win_left, p.win_right).hi;
  }
  if (span_hi < span_lo) span_hi = span_lo;
  const int aligned_lo = span_lo / TN * TN;
  const int per_split = ((span_hi - aligned_lo + p.splits - 1) / p.splits + TN - 1) / TN * TN;
  SplitKeys k;
  k.k_lo = max(span_lo, aligned_lo + split * per_split);
  k.k_hi = min(span_hi, aligned_lo + (split + 1) * per_split);
  k.t_begin = k.k_lo / TN * TN;
  k.n_tiles = k.k_hi > k.k_lo ? (k.k_hi - k.t_begin + TN - 1) / TN : 0;
  return k;
}

// The merge of a vector's key splits: out = sum_s w_s o_s / sum_s w_s with
// w_s = exp(lse_s - max lse), one pass with a running maximum (so no load
// waits for another); an empty split has lse -inf, any NaN split makes the
// result NaN. The combine kernel and the cluster merge both use it.
constexpr float kLog2e = 1.4426950408889634f;

using attention::cuda::exp2_fast;

struct SplitMerge {
  float m = -INFINITY, total = 0.0f, o = 0.0f;
  bool nan = false;

  __device__ __forceinline__ void add(float lse, float out) {
    nan |= lse != lse;
    const bool live = lse != -INFINITY && lse == lse;
    const float m_new = live ? fmaxf(m, lse) : m;
    // exp2 of -inf is 0: the running sums are 0 until the first live split.
    const float f = m_new == m ? 1.0f : exp2_fast((m - m_new) * kLog2e);
    const float w = live ? exp2_fast((lse - m_new) * kLog2e) : 0.0f;
    total = total * f + w;
    o = o * f + (live ? w * out : 0.0f);
    m = m_new;
  }
  __device__ __forceinline__ float out() const {
    return nan ? __int_as_float(0x7fffffff) : total > 0.0f ? o / total : 0.0f;
  }
  __device__ __forceinline__ float lse() const {
    return nan ? __int_as_float(0x7fffffff) : total > 0.0f ? m + __logf(total) : -INFINITY;
  }
};

// Splits merged per batch of loads: every load of a batch is issued (predicated,
// no branch) before the merge arithmetic.
constexpr int kMergeBatch = 8;

// The end of an attention kernel: the warps' online-softmax states (each
// warp saw different keys of every vector) are in shared memory, s_acc
// [warp][vector][ACC_LD] and s_max, s_sum [warp][vector]; merges them and
// writes the CTA's vectors (NaN for a bad sequence) to out and lse (one
// split) or to the split's rows of the workspace, or with p.cluster_merge to
// s_part ([NV][DB] outputs, then [NV] lse) for merge_cluster. Every thread of
// the CTA calls it (it has a barrier). The weights of the warps come first,
// once per vector (in place of s_max; the lse in place of warp 0's s_sum), so
// an output element costs WARPS loads and FMAs, no exp and no division.
template <class T, int DB, int ACC_LD, int WARPS, int NV, int NT>
__device__ __forceinline__ void merge_and_store(const Params& p, const float* s_acc, float* s_max,
                                                float* s_sum, bool bad, int b, int hk, int v0,
                                                int n_vec, const QSeq& qs, int split,
                                                float* s_part = nullptr) {
  for (int m = threadIdx.x; m < NV; m += NT) {
    float gmax = -INFINITY;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) gmax = fmaxf(gmax, s_max[w * NV + m]);
    float f[WARPS], sum = 0.0f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) {
      const float mw = s_max[w * NV + m];
      f[w] = mw == -INFINITY ? 0.0f : __expf(mw - gmax);
      sum += s_sum[w * NV + m] * f[w];
    }
    const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) s_max[w * NV + m] = f[w] * inv;
    s_sum[m] = sum > 0.0f ? gmax + __logf(sum) : -INFINITY;
  }
  __syncthreads();
  const float nan = __int_as_float(0x7fffffff);
  for (int idx = threadIdx.x; idx < NV * DB; idx += NT) {
    const int m = idx / DB, c = idx % DB, vec = v0 + m;
    if (vec >= n_vec || c >= p.d) continue;
    float o = 0.0f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w)
      o = fmaf(s_acc[(w * NV + m) * ACC_LD + c], s_max[w * NV + m], o);
    const float out = bad ? nan : o;
    const float lse = bad ? nan : s_sum[m];
    const int i = vec / p.group, hq = hk * p.group + vec % p.group;
    if (p.splits == 1) {
      static_cast<T*>(p.out)[b * p.o_sb + (qs.q0 + i) * p.o_sr + hq * p.o_sh + c] = from_float<T>(out);
      if (c == 0) p.lse[b * p.lse_sb + hq * p.lse_sh + qs.q0 + i] = lse;
    } else if (s_part) {
      s_part[m * DB + c] = out;
      if (c == 0) s_part[NV * DB + m] = lse;
    } else {
      const int64_t v = split * p.vectors + (qs.flat0 + i) * p.heads_q + hq;
      p.part_out[v * p.d + c] = out;
      if (c == 0) p.part_lse[v] = lse;
    }
  }
}

// Thread-block clusters (sm_90): a barrier over every thread of the cluster
// (release / acquire: shared-memory writes before it are visible to every
// CTA of the cluster after it), its two halves without memory ordering, and
// a load from another CTA's shared memory.
__device__ __forceinline__ void cluster_barrier() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.release.aligned;\n"
               "barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void cluster_arrive_relaxed() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void cluster_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.wait.aligned;\n" ::: "memory");
#endif
}

__device__ __forceinline__ float load_cluster_shared(const float* local, unsigned rank) {
  float x = 0.0f;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  unsigned remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n"
               : "=r"(remote)
               : "r"(static_cast<unsigned>(__cvta_generic_to_shared(local))), "r"(rank));
  asm volatile("ld.shared::cluster.f32 %0, [%1];\n" : "=f"(x) : "r"(remote) : "memory");
#endif
  return x;
}

// The split merge of a call whose splits of one (vectors, kv head, sequence)
// are the CTAs of one cluster (rank = split): every CTA has its split's
// outputs and lse in s_part (merge_and_store); after a cluster barrier each
// CTA merges a 1/splits share of the (vector, column) items from all of
// them, in split order (as the combine kernel does: the same bits), and
// writes out and lse. A second barrier keeps every CTA's shared memory alive
// until the others have read it: a relaxed one, since each thread arrives
// after its remote loads have been consumed (a release would first wait for
// the global stores of out and lse to be performed).
template <class T, int DB, int NV, int NT>
__device__ __forceinline__ void merge_cluster(const Params& p, const float* s_part, int b, int hk,
                                              int v0, int n_vec, const QSeq& qs, int split) {
  cluster_barrier();
  const int n = p.splits;
  const int per = (NV * DB + n - 1) / n;
  const int end = min(NV * DB, (split + 1) * per);
  for (int idx = split * per + static_cast<int>(threadIdx.x); idx < end; idx += NT) {
    const int m = idx / DB, c = idx % DB, vec = v0 + m;
    if (vec >= n_vec || c >= p.d) continue;
    SplitMerge merge;
    for (int s0 = 0; s0 < n; s0 += kMergeBatch) {
      float xs[kMergeBatch], ys[kMergeBatch];
#pragma unroll
      for (int k = 0; k < kMergeBatch; ++k) {
        const int s = s0 + k;
        xs[k] = s < n ? load_cluster_shared(s_part + NV * DB + m, s) : -INFINITY;
        ys[k] = s < n ? load_cluster_shared(s_part + idx, s) : 0.0f;
      }
#pragma unroll
      for (int k = 0; k < kMergeBatch; ++k) merge.add(xs[k], ys[k]);
    }
    const int i = vec / p.group, hq = hk * p.group + vec % p.group;
    static_cast<T*>(p.out)[b * p.o_sb + (qs.q0 + i) * p.o_sr + hq * p.o_sh + c] =
        from_float<T>(merge.out());
    if (c == 0) p.lse[b * p.lse_sb + hq * p.lse_sh + qs.q0 + i] = merge.lse();
  }
  cluster_arrive_relaxed();
  cluster_wait();
}

// The two halves of both attention kernels' query staging: the loads of the
// CTA's query vectors [v0, v0 + NV) of kv head hk into registers (zeros past
// n_vec and the head dim; query vector v is row v / group of head hk * group
// + v % group), issued before the sequence's length is read so the two are in
// flight together, then their stores into sQ (row r = vector v0 + r,
// leading dimension LD; zeros for a sequence whose length is bad).
template <int DB, int NV, int NT>
struct QueryChunks {
  static constexpr int kCount = (NV * (DB / 8) + NT - 1) / NT;  // 16-byte chunks per thread
  uint4 raw[kCount];

  __device__ __forceinline__ void load(const Params& p, int b, int hk, int v0, int n_vec,
                                       const QSeq& qs) {
#pragma unroll
    for (int n = 0; n < kCount; ++n) {
      const int idx = threadIdx.x + n * NT;
      const int r = idx / (DB / 8), c = (idx % (DB / 8)) * 8, vec = v0 + r;
      raw[n] = make_uint4(0, 0, 0, 0);
      if (idx < NV * (DB / 8) && vec < n_vec && c < p.d)
        raw[n] = load16(p.q, b * p.q_sb + (qs.q0 + vec / p.group) * p.q_sr +
                                 (hk * p.group + vec % p.group) * p.q_sh + c);
    }
  }
  template <class T, int LD>
  __device__ __forceinline__ void store(T* sQ, bool bad) const {
#pragma unroll
    for (int n = 0; n < kCount; ++n) {
      const int idx = threadIdx.x + n * NT;
      const int r = idx / (DB / 8), c = (idx % (DB / 8)) * 8;
      if (idx < NV * (DB / 8))
        *reinterpret_cast<uint4*>(sQ + r * LD + c) = bad ? make_uint4(0, 0, 0, 0) : raw[n];
    }
  }
};

template <class T, int DB>
__global__ void __launch_bounds__(kThreads) attention_kernel(const Params p) {
  using C = Tile<DB>;
  constexpr int TN = kTileKeys, LD = C::kLd, R = C::kChunksPerThread;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* stages = reinterpret_cast<T*>(smem_raw);
  T* sQ = stages + C::kStages * C::kStageElems;
  const int split = blockIdx.x, b = blockIdx.z;
  const int hk = blockIdx.y / p.mtiles, v0 = (blockIdx.y % p.mtiles) * kVectors;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // The combine kernel may be scheduled now: it waits for this grid's end.
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
  const QSeq qs = query_seq(p, b);
  const int n_vec = qs.sq * p.group;
  if (v0 >= n_vec) return;  // the combine reads no vector of this tile
  // The query loads are in flight together with the sequence's length.
  QueryChunks<DB, kVectors, kThreads> q_chunks;
  q_chunks.load(p, b, hk, v0, n_vec, qs);
  const int len = length_before(p, b);
  const int sk = len + p.s_new;
  bool bad = len < 0 || len > p.capacity - p.s_new;
  if (bad && split == 0 && blockIdx.y == 0 && threadIdx.x == 0)
    record_error(p, len < 0 ? kBadLength : kNoRoom, b, len);
  q_chunks.template store<T, LD>(sQ, bad);
  // This thread's two rows (g, g + 8): visible keys and ALiBi. open_lo and
  // open_hi bound the keys both rows see (a row past the CTA's vectors
  // bounds nothing: its results are never written).
  int lo[2], hi[2], diag[2], open_lo = 0, open_hi = INT_MAX;
  float slope[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int vec = v0 + g + 8 * h, i = vec / p.group;
    const bool valid = vec < n_vec && !bad;
    const detail::KeyRange vis = detail::visible_keys(i, qs.sq, sk, p.win_left, p.win_right);
    lo[h] = valid ? vis.lo : 0;
    hi[h] = valid ? vis.hi : 0;
    if (vec < n_vec) {
      open_lo = max(open_lo, lo[h]);
      open_hi = min(open_hi, hi[h]);
    }
    diag[h] = i + sk - qs.sq;
    slope[h] = p.alibi && valid ? p.alibi[b * p.alibi_sb + hk * p.group + vec % p.group] : 0.0f;
  }
  const float inv_softcap = p.softcap > 0.0f ? 1.0f / p.softcap : 0.0f;
  const SplitKeys keys = split_keys<TN>(p, qs, sk, bad, v0, kVectors, n_vec, split);
  const int k_lo = keys.k_lo, k_hi = keys.k_hi, t_begin = keys.t_begin, n_tiles = keys.n_tiles;

  // This thread's 16-byte chunks of a tile: rows chunk_row0 + r * kRowStride.
  const int chunk_row0 = threadIdx.x / (DB / 8), chunk_col = (threadIdx.x % (DB / 8)) * 8;
  constexpr int kRowStride = kThreads / (DB / 8);
  const T* kbase = static_cast<const T*>(p.k) + hk * p.k_sh + chunk_col;
  const T* vbase = static_cast<const T*>(p.v) + hk * p.v_sh + chunk_col;
  // Where each row of a tile lives (element offsets of its K and V rows),
  // found once per row by the first TN threads (two slots: the tile being
  // issued and the next one), so issuing a tile costs no multiplication.
  __shared__ int64_t row_k[2][TN], row_v[2][TN];  // -1: no row (zero fill)
  auto lookup = [&](int tile) {
    if (threadIdx.x < TN) {
      const int j = t_begin + tile * TN + threadIdx.x;
      int64_t ko = -1, vo = -1;
      if (tile < n_tiles && j >= k_lo && j < k_hi) {
        int block = b, row = j;
        if (p.table) {
          const int col = p.block_shift >= 0 ? j >> p.block_shift : j / p.block_size;
          block = __ldg(p.table + b * p.table_stride + col);
          row = p.block_shift >= 0 ? j & (p.block_size - 1) : j % p.block_size;
          if (block < 0 || block >= p.num_blocks) {
            if (!bad) record_error(p, kBadBlock, b, block);
            bad = true;
            block = -1;
          }
        }
        if (block >= 0) {
          ko = block * p.k_sb + row * p.k_sr;
          vo = block * p.v_sb + row * p.v_sr;
        }
      }
      row_k[tile & 1][threadIdx.x] = ko;
      row_v[tile & 1][threadIdx.x] = vo;
    }
  };
  const bool col_ok = chunk_col < p.d;
  auto issue = [&](int tile) {
    if (tile < n_tiles) {
      T* sk_ = stages + (tile % C::kStages) * C::kStageElems;
      T* sv_ = sk_ + TN * LD;
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const int row = chunk_row0 + r * kRowStride;
        const int64_t ko = row_k[tile & 1][row], vo = row_v[tile & 1][row];
        const bool fill = ko >= 0 && col_ok;
        cp_async16(sk_ + row * LD + chunk_col, kbase + (fill ? ko : 0), fill);
        cp_async16(sv_ + row * LD + chunk_col, vbase + (fill ? vo : 0), fill);
      }
    }
    cp_async_commit();
  };

  float acc[DB / 8][4];
#pragma unroll
  for (int dt = 0; dt < DB / 8; ++dt) acc[dt][0] = acc[dt][1] = acc[dt][2] = acc[dt][3] = 0.0f;
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.0f, 0.0f};

#pragma unroll
  for (int s = 0; s < C::kStages - 1; ++s) {
    lookup(s);
    __syncthreads();
    issue(s);
    __syncthreads();  // slot s & 1 is read before tile s + 2 is looked up
  }
  lookup(C::kStages - 1);
  // The query fragments stay in registers for every tile (sQ is visible
  // after the prologue's barriers); at DB 256 they would not fit.
  constexpr bool kQInRegisters = DB <= 128;
  uint32_t q_frag[kQInRegisters ? DB / 16 : 1][4];
  if constexpr (kQInRegisters) {
#pragma unroll
    for (int kk = 0; kk < DB / 16; ++kk) attention::cuda::load_a(q_frag[kk], sQ, LD, 0, kk * 16, lane);
  }
  for (int tile = 0; tile < n_tiles; ++tile) {
    cp_async_wait<C::kStages - 2>();
    // This tile (and sQ) landed for every thread, the previous tile is
    // consumed, and the row slot of the tile to issue is written.
    __syncthreads();
    issue(tile + C::kStages - 1);
    lookup(tile + C::kStages);  // the other row slot: read after the next barrier
    const T* sK = stages + (tile % C::kStages) * C::kStageElems + warp * 16 * LD;
    const T* sV = sK + TN * LD;
    const int j0 = t_begin + tile * TN + warp * 16;  // this warp's 16 keys

    float s[2][4] = {{0, 0, 0, 0}, {0, 0, 0, 0}};
#pragma unroll
    for (int kk = 0; kk < DB / 16; ++kk) {
      uint32_t a_smem[4];
      const uint32_t* a = a_smem;
      if constexpr (kQInRegisters) {
        a = q_frag[kk];
      } else {
        attention::cuda::load_a(a_smem, sQ, LD, 0, kk * 16, lane);
      }
      // Matrix lane / 8: keys 8 * (lane / 16) + 0..7, dims 8 * (lane / 8 % 2) + 0..7.
      uint32_t bf[4];
      ldmatrix_x4(bf, sK + ((lane >> 4) * 8 + (lane & 7)) * LD + kk * 16 + ((lane >> 3) & 1) * 8);
      attention::cuda::mma<T>(s[0], a, bf);
      attention::cuda::mma<T>(s[1], a, bf + 2);
    }
    // Logits (row g + 8 * (e >> 1), key j0 + nb * 8 + 2t + (e & 1)). Only a
    // warp whose 16 keys are not all inside the split and visible to every
    // row checks them one by one.
#pragma unroll
    for (int nb = 0; nb < 2; ++nb)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int h = e >> 1, j = j0 + nb * 8 + 2 * t + (e & 1);
        float x = s[nb][e] * p.scale;
        if (p.softcap > 0.0f) x = p.softcap * attention::cuda::tanh_fast(x * inv_softcap);
        if (slope[h] != 0.0f) x -= slope[h] * fabsf(static_cast<float>(diag[h] - j));
        s[nb][e] = x;
      }
    const bool inside = j0 >= k_lo && j0 + 16 <= k_hi && j0 >= open_lo && j0 + 16 <= open_hi;
    if (!__all_sync(0xffffffffu, inside)) {
#pragma unroll
      for (int nb = 0; nb < 2; ++nb)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int h = e >> 1, j = j0 + nb * 8 + 2 * t + (e & 1);
          if (j < k_lo || j >= k_hi || j < lo[h] || j >= hi[h]) s[nb][e] = -INFINITY;
        }
    }
    float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int nb = 0; nb < 2; ++nb)
#pragma unroll
      for (int e = 0; e < 4; ++e) tile_max[e >> 1] = fmaxf(tile_max[e >> 1], s[nb][e]);
    float rescale[2], base[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float m_new = fmaxf(row_max[h], attention::cuda::quad_max(tile_max[h]));
      rescale[h] = row_max[h] == -INFINITY ? 0.0f : __expf(row_max[h] - m_new);
      base[h] = m_new == -INFINITY ? 0.0f : m_new;
      row_max[h] = m_new;
      row_sum[h] *= rescale[h];
    }
    // Once the running maxima settle, most tiles leave the output as it is.
    if (__any_sync(0xffffffffu, rescale[0] != 1.0f || rescale[1] != 1.0f)) {
#pragma unroll
      for (int dt = 0; dt < DB / 8; ++dt) {
        acc[dt][0] *= rescale[0];
        acc[dt][1] *= rescale[0];
        acc[dt][2] *= rescale[1];
        acc[dt][3] *= rescale[1];
      }
    }
#pragma unroll
    for (int nb = 0; nb < 2; ++nb)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float pr = __expf(s[nb][e] - base[e >> 1]);
        row_sum[e >> 1] += pr;
        s[nb][e] = pr;
      }
    // acc += P V: P from the score registers, V fragments by ldmatrix.trans.
    uint32_t a[4];
    attention::cuda::c_to_a<T>(a, s[0], s[1]);
    const int mat = lane >> 3, mrow = lane & 7;
    const T* vrow = sV + ((mat & 1) * 8 + mrow) * LD + (mat >> 1) * 8;
#pragma unroll
    for (int dt = 0; dt < DB / 8; dt += 2) {
      uint32_t bf[4];
      ldmatrix_x4_trans(bf, vrow + dt * 8);
      attention::cuda::mma<T>(acc[dt], a, bf);
      attention::cuda::mma<T>(acc[dt + 1], a, bf + 2);
    }
  }
  cp_async_wait<0>();
  bad = __syncthreads_or(bad);  // also: the stages are free, the merge reuses the memory

  // Merge the warps (each saw different keys of every row) through shared memory.
  float* s_acc = reinterpret_cast<float*>(smem_raw);  // [warp][row][DB]
  float* s_max = s_acc + kWarps * kVectors * DB;       // [warp][row]
  float* s_sum = s_max + kWarps * kVectors;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float sum = attention::cuda::quad_sum(row_sum[h]);
    const int r = g + 8 * h;
#pragma unroll
    for (int dt = 0; dt < DB / 8; ++dt) {
      s_acc[(warp * kVectors + r) * DB + dt * 8 + 2 * t] = acc[dt][2 * h];
      s_acc[(warp * kVectors + r) * DB + dt * 8 + 2 * t + 1] = acc[dt][2 * h + 1];
    }
    if (t == 0) {
      s_max[warp * kVectors + r] = row_max[h];
      s_sum[warp * kVectors + r] = sum;
    }
  }
  __syncthreads();
  merge_and_store<T, DB, DB, kWarps, kVectors, kThreads>(p, s_acc, s_max, s_sum, bad, b, hk, v0,
                                                         n_vec, qs, split);
}

// ---------------------------------------------------------------- attention, keys on M

// The default attention kernel. With one new token and GQA group 4 a CTA has
// only 4 real query vectors, so the previous kernel (query vectors on the m16
// rows of the products) wasted 3/4 of every MMA and of the softmax work. Here
// the products are transposed: S^T = K Q^T puts 16 keys on the M rows and 8
// query vectors on the N columns, and O^T += V^T P^T takes V^T from the tile
// by ldmatrix.trans and P^T, the score registers, as the B operand after an
// in-register 8x8 transpose (movmatrix). Per 16 keys a warp issues 8 + 8 MMAs
// at head dim 128 (was 16 + 16) and holds 4 logits per thread (was 8).
//
// A CTA has kWarps warps (8 up to head dim 128: two per scheduler to hide the
// latency of the products and the shuffles), each owning 16 keys of every
// 16 * kWarps-key tile with its own online softmax; the warps merge once, at
// the end of the split. Tiles stream through kStages cp.async stages. Only a
// warp whose keys reach an edge of the split or of a visible range masks.
//
// NB n8 blocks of query vectors per CTA: 1 (8 vectors) where a kv head has at
// most 8, else 2 (16 vectors, each K/V fragment feeding two MMAs, as the
// query-major kernel reads K/V once per 16 vectors); 1 at head dim 256
// (registers).
constexpr int kKmBlockVectors = 8;  // query vectors (row, head) of one n8 block

inline int keys_major_blocks(int64_t vectors_per_kv_head, int db) {
  return vectors_per_kv_head > kKmBlockVectors && db <= 128 ? 2 : 1;
}

// The kernel's shapes at head dim 128: kWide, 8 warps (128-key tiles) and one
// CTA an SM; kTwoPerSm, 4 warps and 3 stages (about 100 KB of shared memory),
// two CTAs an SM, each streaming on its own. Elsewhere only kWide.
enum KmShape : int { kWide = 0, kTwoPerSm = 1 };

template <int DB, int NB, int SHAPE = kWide>
struct KeysMajor {
  static constexpr int kVectors = kKmBlockVectors * NB;
  static constexpr int kWarps = SHAPE == kTwoPerSm ? 4 : DB <= 128 ? 8 : 4;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kTileKeys = 16 * kWarps;
  static constexpr int kLd = DB + 8;  // sQ's padded rows: conflict-free ldmatrix
  // K and V tile rows: packed, their 16-byte chunks XOR-swizzled by the row's
  // low three bits, where a row has at least 8 chunks (then the copies' stores
  // and the ldmatrix reads of 8 rows at one chunk are both conflict-free);
  // else padded like sQ.
  static constexpr bool kSwizzle = DB >= 64;
  static constexpr int kRowElems = kSwizzle ? DB : kLd;
  static constexpr int kStages = DB <= 64 ? 4 : 3;
  static constexpr int kStageElems = 2 * kTileKeys * kRowElems;  // K then V
  static constexpr int kChunksPerThread = kTileKeys * DB / 8 / kThreads;
  static constexpr int kRowStride = kThreads / (DB / 8);  // rows between a thread's chunks
  static constexpr size_t kPipeBytes =
      sizeof(uint16_t) * (kStages * kStageElems + kVectors * kLd);
  // The warps' merge: s_acc rows of kAccLd floats (4 floats of padding: the
  // stores of one instruction, rows 2t + h and columns g, hit 32 banks).
  static constexpr int kAccLd = DB + 4;
  static constexpr size_t kMergeBytes = sizeof(float) * kWarps * kVectors * (kAccLd + 2);
  static constexpr size_t kSmem = kPipeBytes > kMergeBytes ? kPipeBytes : kMergeBytes;
  // The split's outputs and lse for a cluster merge, past the warps' merge.
  static constexpr size_t kPartOffset = (kMergeBytes + 15) / 16 * 16;
  static_assert(kPartOffset + sizeof(float) * kVectors * (DB + 1) <= kSmem,
                "room for the cluster merge's partial results");
  static_assert(kTileKeys * DB / 8 % kThreads == 0, "whole chunks per thread");
  static_assert(kTileKeys <= kThreads, "one row lookup per thread");

  // Where 16-byte chunk `chunk` of tile row `row` lives (elements from the
  // start of the K or V tile).
  __device__ __forceinline__ static int offset(int row, int chunk) {
    return row * kRowElems + (kSwizzle ? chunk ^ (row & 7) : chunk) * 8;
  }
};

// What a missing cache row reads (zero K and V; 16-byte chunks at any column
// of the widest head dim), so a tile's copies need no per-row size.
__device__ __align__(16) uint4 zero_row[256 * sizeof(uint16_t) / sizeof(uint4)];

// cp.async of `bytes` (16 or 0: zero fill) from global to shared memory.
__device__ __forceinline__ void cp_async16_bytes(void* smem, const void* gmem, int bytes) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem),
               "r"(bytes));
}

// The 8x8 b16 matrix whose fragments (row lane / 4, columns 2 (lane % 4) + 0..1)
// the warp holds, transposed, in the same fragment layout.
__device__ __forceinline__ uint32_t movmatrix_trans(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

template <class T, int DB, int NB, int SHAPE = kWide>
__global__ void __launch_bounds__(KeysMajor<DB, NB, SHAPE>::kThreads, 1)
    keys_major_kernel(const Params p) {
  using C = KeysMajor<DB, NB, SHAPE>;
  constexpr int TN = C::kTileKeys, LD = C::kLd, NT = C::kThreads, NV = C::kVectors;
  constexpr int RE = C::kRowElems;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* stages = reinterpret_cast<T*>(smem_raw);
  T* sQ = stages + C::kStages * C::kStageElems;
  const int split = blockIdx.x, b = blockIdx.z;
  const int hk = blockIdx.y / p.mtiles, v0 = (blockIdx.y % p.mtiles) * NV;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // The combine kernel may be scheduled now: it waits for this grid's end.
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
  const QSeq qs = query_seq(p, b);
  const int n_vec = qs.sq * p.group;
  if (v0 >= n_vec) return;  // the combine reads no vector of this tile
  // The query loads are in flight together with the sequence's length.
  QueryChunks<DB, NV, NT> q_chunks;
  q_chunks.load(p, b, hk, v0, n_vec, qs);
  const int len = length_before(p, b);
  const int sk = len + p.s_new;
  bool bad = len < 0 || len > p.capacity - p.s_new;
  if (bad && split == 0 && blockIdx.y == 0 && threadIdx.x == 0)
    record_error(p, len < 0 ? kBadLength : kNoRoom, b, len);
  q_chunks.template store<T, LD>(sQ, bad);
  // This thread's query vectors u = 2 n + h (column 2t + h of n8 block n,
  // vector 8 n + 2t + h of the CTA): visible keys and ALiBi. open_lo and
  // open_hi bound the keys every real vector of the CTA sees (a vector past
  // n_vec bounds nothing: its results are never written).
  int lo[2 * NB], hi[2 * NB], diag[2 * NB], open_lo = 0, open_hi = INT_MAX;
  float slope[2 * NB];
#pragma unroll
  for (int h = 0; h < 2 * NB; ++h) {
    const int vec = v0 + 8 * (h >> 1) + 2 * t + (h & 1), i = vec / p.group;
    const bool valid = vec < n_vec && !bad;
    const detail::KeyRange vis = detail::visible_keys(i, qs.sq, sk, p.win_left, p.win_right);
    lo[h] = valid ? vis.lo : 0;
    hi[h] = valid ? vis.hi : 0;
    if (vec < n_vec) {
      open_lo = max(open_lo, lo[h]);
      open_hi = min(open_hi, hi[h]);
    }
    diag[h] = i + sk - qs.sq;
    slope[h] = p.alibi && valid ? p.alibi[b * p.alibi_sb + hk * p.group + vec % p.group] : 0.0f;
  }
  const float inv_softcap = p.softcap > 0.0f ? 1.0f / p.softcap : 0.0f;
  const SplitKeys keys = split_keys<TN>(p, qs, sk, bad, v0, NV, n_vec, split);
  const int k_lo = keys.k_lo, k_hi = keys.k_hi, t_begin = keys.t_begin, n_tiles = keys.n_tiles;

  // This thread's 16-byte chunks of a tile: rows chunk_row0 + r * kRowStride.
  const int chunk_row0 = threadIdx.x / (DB / 8), chunk = threadIdx.x % (DB / 8);
  const int chunk_col = chunk * 8;
  const T* khead = static_cast<const T*>(p.k) + hk * p.k_sh;
  const T* vhead = static_cast<const T*>(p.v) + hk * p.v_sh;
  // Where each row of a tile lives ({K, V} addresses; zero_row where the
  // tile has no row), found once per row by the first TN threads, in the slot
  // of the tile's stage: issuing a row costs one 16-byte shared load and two
  // 64-bit adds. Two steps, so that the prologue has the block-table loads of
  // all its tiles in flight at once: row_block (thread threadIdx.x < TN's
  // row of a tile: its block id as read, or kNoRow), then store_row.
  __shared__ ulonglong2 row_src[C::kStages][TN];
  // The kernel's only static shared memory: one 16-byte __shared__ variable
  // more made every call 10-20% slower on H200, why was not found
  // (bench/attn_notes.md section 54); a flag reaches the CTA by a barrier
  // (__syncthreads_or) instead.
  constexpr long long kNoRow = -(1LL << 40);  // outside the range of an int32 block id
  auto row_block = [&](int tile) -> long long {
    const int j = t_begin + tile * TN + threadIdx.x;
    if (threadIdx.x >= TN || tile >= n_tiles || j < k_lo || j >= k_hi) return kNoRow;
    if (!p.table) return b;
    const int col = p.block_shift >= 0 ? j >> p.block_shift : j / p.block_size;
    return __ldg(p.table + b * p.table_stride + col);
  };
  auto store_row = [&](int tile, int slot, long long id) {
    if (threadIdx.x >= TN) return;
    const T* ks = reinterpret_cast<const T*>(zero_row);
    const T* vs = ks;
    if (id != kNoRow) {
      const int j = t_begin + tile * TN + threadIdx.x;
      int block = static_cast<int>(id), row = j;
      if (p.table) {
        row = p.block_shift >= 0 ? j & (p.block_size - 1) : j % p.block_size;
        if (block < 0 || block >= p.num_blocks) {
          if (!bad) record_error(p, kBadBlock, b, block);
          bad = true;
          block = -1;
        }
      }
      if (block >= 0) {
        ks = khead + block * p.k_sb + row * p.k_sr;
        vs = vhead + block * p.v_sb + row * p.v_sr;
      }
    }
    row_src[slot][threadIdx.x] =
        make_ulonglong2(reinterpret_cast<uintptr_t>(ks), reinterpret_cast<uintptr_t>(vs));
  };
  // A chunk past the head dim is zero filled from an address inside the row.
  const bool col_ok = chunk_col < p.d;
  const int col_bytes = col_ok ? chunk_col * static_cast<int>(sizeof(T)) : 0;
  const int copy_bytes = col_ok ? 16 : 0;
  auto issue = [&](int tile, int stage) {
    if (tile < n_tiles) {
      T* sk_ = stages + stage * C::kStageElems;
      T* sv_ = sk_ + TN * RE;
#pragma unroll
      for (int r = 0; r < C::kChunksPerThread; ++r) {
        const int row = chunk_row0 + r * C::kRowStride, at = C::offset(row, chunk);
        const ulonglong2 src = row_src[stage][row];
        cp_async16_bytes(sk_ + at, reinterpret_cast<const char*>(src.x) + col_bytes, copy_bytes);
        cp_async16_bytes(sv_ + at, reinterpret_cast<const char*>(src.y) + col_bytes, copy_bytes);
      }
    }
    cp_async_commit();
  };

  // acc[n][mt]: O^T rows (dims) mt * 16 + g + 8 (e >> 1), column 2t + (e & 1)
  // of n8 block n.
  float acc[NB][DB / 16][4];
#pragma unroll
  for (int n = 0; n < NB; ++n)
#pragma unroll
    for (int mt = 0; mt < DB / 16; ++mt)
      acc[n][mt][0] = acc[n][mt][1] = acc[n][mt][2] = acc[n][mt][3] = 0.0f;
  // Per vector u: the warp's running maximum, and this lane's part of the
  // running sum (summed over the warp at the end).
  float row_max[2 * NB], row_sum[2 * NB];
#pragma unroll
  for (int u = 0; u < 2 * NB; ++u) row_max[u] = -INFINITY, row_sum[u] = 0.0f;

  {
    long long ids[C::kStages];
#pragma unroll
    for (int s = 0; s < C::kStages; ++s) ids[s] = row_block(s);
#pragma unroll
    for (int s = 0; s < C::kStages; ++s) store_row(s, s, ids[s]);
  }
  __syncthreads();
#pragma unroll
  for (int s = 0; s < C::kStages - 1; ++s) issue(s, s);
  // Q^T as the B operand (dims x vectors), in registers for every tile (sQ
  // is visible after the prologue's barriers).
  uint32_t q_frag[NB][DB / 16][2];
#pragma unroll
  for (int n = 0; n < NB; ++n)
#pragma unroll
    for (int kk = 0; kk < DB / 16; ++kk)
      attention::cuda::load_b(q_frag[n][kk], sQ, LD, 8 * n, kk * 16, lane);
  // ldmatrix lane addresses inside the warp's 16 keys: K as A (keys x dims,
  // matrix m = lane / 8 at keys 8 (m & 1), dims 8 (m >> 1)) and V^T as A via
  // .trans (dims x keys, matrix m at dims 8 (m & 1), keys 8 (m >> 1)).
  // Byte offsets inside a tile, the same for every tile: the swizzle costs
  // one add an ldmatrix.
  const int k_row = warp * 16 + (lane & 7) + ((lane >> 3) & 1) * 8, k_chunk = lane >> 4;
  const int v_row = warp * 16 + (lane >> 4) * 8 + (lane & 7), v_chunk = (lane >> 3) & 1;
  unsigned k_at[DB / 16], v_at[DB / 16];
#pragma unroll
  for (int i = 0; i < DB / 16; ++i) {
    k_at[i] = sizeof(T) * C::offset(k_row, 2 * i + k_chunk);
    v_at[i] = sizeof(T) * (TN * RE + C::offset(v_row, 2 * i + v_chunk));
  }
  const unsigned stages_at = static_cast<unsigned>(__cvta_generic_to_shared(stages));
  int stage = 0;  // tile % kStages; the stage issued is the one before it
  for (int tile = 0; tile < n_tiles; ++tile) {
    cp_async_wait<C::kStages - 2>();
    // This tile landed for every thread, the previous tile is consumed (so
    // its row slot is free), and the row slot of the tile to issue is written.
    __syncthreads();
    issue(tile + C::kStages - 1, stage == 0 ? C::kStages - 1 : stage - 1);
    // The next barrier orders this slot's write before its read.
    store_row(tile + C::kStages, stage, row_block(tile + C::kStages));
    const unsigned tile_at = stages_at + sizeof(T) * stage * C::kStageElems;
    stage = stage + 1 == C::kStages ? 0 : stage + 1;
    const int j0 = t_begin + tile * TN + warp * 16;  // this warp's 16 keys

    // S^T = K Q^T, two accumulation chains per n8 block (even / odd dims
    // blocks); each K fragment feeds the NB blocks.
    float s[NB][4], s_odd[NB][4];
#pragma unroll
    for (int n = 0; n < NB; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[n][e] = s_odd[n][e] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < DB / 16; ++kk) {
      uint32_t a[4];
      ldmatrix_x4_at(a, tile_at + k_at[kk]);
#pragma unroll
      for (int n = 0; n < NB; ++n)
        attention::cuda::mma<T>(kk & 1 ? s_odd[n] : s[n], a, q_frag[n][kk]);
    }
    // Logit (key j0 + g + 8 (e >> 1), vector u = 2 n + (e & 1)).
#pragma unroll
    for (int n = 0; n < NB; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int u = 2 * n + (e & 1), j = j0 + g + 8 * (e >> 1);
        float x = (s[n][e] + s_odd[n][e]) * p.scale;
        if (p.softcap > 0.0f) x = p.softcap * attention::cuda::tanh_fast(x * inv_softcap);
        if (slope[u] != 0.0f) x -= slope[u] * fabsf(static_cast<float>(diag[u] - j));
        s[n][e] = x;
      }
    const bool inside = j0 >= k_lo && j0 + 16 <= k_hi && j0 >= open_lo && j0 + 16 <= open_hi;
    if (!__all_sync(0xffffffffu, inside)) {
#pragma unroll
      for (int n = 0; n < NB; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int u = 2 * n + (e & 1), j = j0 + g + 8 * (e >> 1);
          if (j < k_lo || j >= k_hi || j < lo[u] || j >= hi[u]) s[n][e] = -INFINITY;
        }
    }
    // The maximum of each column over the warp's 16 keys: lanes of one t.
    float rescale[2 * NB], base[2 * NB];
    bool moved = false;
#pragma unroll
    for (int u = 0; u < 2 * NB; ++u) {
      const int n = u >> 1, h = u & 1;
      float m = fmaxf(s[n][h], s[n][h + 2]);
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 4));
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 8));
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 16));
      const float m_new = fmaxf(row_max[u], m);
      rescale[u] = row_max[u] == -INFINITY ? 0.0f : exp2_fast((row_max[u] - m_new) * kLog2e);
      base[u] = m_new == -INFINITY ? 0.0f : m_new * kLog2e;  // in log2 units
      row_max[u] = m_new;
      row_sum[u] *= rescale[u];
      moved |= rescale[u] != 1.0f;
    }
    // Once the running maxima settle, most tiles leave the output as it is.
    if (__any_sync(0xffffffffu, moved)) {
#pragma unroll
      for (int n = 0; n < NB; ++n)
#pragma unroll
        for (int mt = 0; mt < DB / 16; ++mt) {
          acc[n][mt][0] *= rescale[2 * n];
          acc[n][mt][1] *= rescale[2 * n + 1];
          acc[n][mt][2] *= rescale[2 * n];
          acc[n][mt][3] *= rescale[2 * n + 1];
        }
    }
    // P^T (keys x vectors) as the B operand: each 8-key half of an n8 block,
    // packed in the C layout, is the transpose of the B fragment, so
    // movmatrix turns it.
    uint32_t pb[NB][2];
#pragma unroll
    for (int n = 0; n < NB; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int u = 2 * n + (e & 1);
        const float pr = exp2_fast(fmaf(s[n][e], kLog2e, -base[u]));
        row_sum[u] += pr;
        s[n][e] = pr;
      }
      pb[n][0] = movmatrix_trans(attention::cuda::Pack<T>::two(s[n][0], s[n][1]));
      pb[n][1] = movmatrix_trans(attention::cuda::Pack<T>::two(s[n][2], s[n][3]));
    }
#pragma unroll
    for (int mt = 0; mt < DB / 16; ++mt) {
      uint32_t a[4];
      ldmatrix_x4_trans_at(a, tile_at + v_at[mt]);
#pragma unroll
      for (int n = 0; n < NB; ++n) attention::cuda::mma<T>(acc[n][mt], a, pb[n]);
    }
  }
  cp_async_wait<0>();
  bad = __syncthreads_or(bad);  // also: the stages are free, the merge reuses the memory

  // Merge the warps (each saw different keys of every vector) through shared memory.
  constexpr int ACC_LD = C::kAccLd;
  float* s_acc = reinterpret_cast<float*>(smem_raw);  // [warp][vector][ACC_LD]
  float* s_max = s_acc + C::kWarps * NV * ACC_LD;      // [warp][vector]
  float* s_sum = s_max + C::kWarps * NV;
#pragma unroll
  for (int u = 0; u < 2 * NB; ++u) {
    const int n = u >> 1, h = u & 1;
    float sum = row_sum[u];
    sum += __shfl_xor_sync(0xffffffffu, sum, 4);
    sum += __shfl_xor_sync(0xffffffffu, sum, 8);
    sum += __shfl_xor_sync(0xffffffffu, sum, 16);
    const int r = 8 * n + 2 * t + h;
#pragma unroll
    for (int mt = 0; mt < DB / 16; ++mt) {
      s_acc[(warp * NV + r) * ACC_LD + mt * 16 + g] = acc[n][mt][h];
      s_acc[(warp * NV + r) * ACC_LD + mt * 16 + g + 8] = acc[n][mt][h + 2];
    }
    if (g == 0) {
      s_max[warp * NV + r] = row_max[u];
      s_sum[warp * NV + r] = sum;
    }
  }
  __syncthreads();
  float* s_part = p.cluster_merge ? reinterpret_cast<float*>(smem_raw + C::kPartOffset) : nullptr;
  merge_and_store<T, DB, ACC_LD, C::kWarps, NV, NT>(p, s_acc, s_max, s_sum, bad, b, hk, v0, n_vec,
                                                    qs, split, s_part);
  if (p.cluster_merge) merge_cluster<T, DB, NV, NT>(p, s_part, b, hk, v0, n_vec, qs, split);
}

// ---------------------------------------------------------------- combine

// One CTA per (query row x head, sequence); each thread merges its column
// over the splits (SplitMerge: one round trip to memory per BATCH splits; the
// split's lse is the same address for every thread of the CTA). BATCH 16
// takes the 9-16 splits of a short row in one round trip: at 1 x 8k and 1 x
// 16k keys (16 splits) the call took 1.1-1.4 us less than with 8, while 4
// splits lost 0.2-0.3 us to the wider batch's idle loads (bench/attn_notes.md,
// section 52), so up to 8 splits keep BATCH 8.
template <class T, int BATCH>
__global__ void __launch_bounds__(kThreads) combine_kernel(const Params p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // Launched as a programmatic dependent of the attention kernel: the
  // partial results are complete and visible once this returns.
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
  const int b = blockIdx.y, vec = blockIdx.x;
  const QSeq qs = query_seq(p, b);
  const int i = vec / p.heads_q, hq = vec % p.heads_q;
  if (i >= qs.sq) return;
  const int64_t v = (qs.flat0 + i) * p.heads_q + hq;
  T* out = static_cast<T*>(p.out) + b * p.o_sb + (qs.q0 + i) * p.o_sr + hq * p.o_sh;
  for (int c0 = 0; c0 < p.d; c0 += kThreads) {
    const int c = c0 + threadIdx.x;
    const bool in_row = c < p.d;
    const int64_t col = in_row ? c : 0;  // a thread past the row reads column 0, unused
    SplitMerge merge;
    for (int s0 = 0; s0 < p.splits; s0 += BATCH) {
      float xs[BATCH], ys[BATCH];
#pragma unroll
      for (int k = 0; k < BATCH; ++k) {
        const int s = s0 + k;
        xs[k] = s < p.splits ? p.part_lse[s * p.vectors + v] : -INFINITY;
        ys[k] = s < p.splits ? p.part_out[(s * p.vectors + v) * p.d + col] : 0.0f;
      }
#pragma unroll
      for (int k = 0; k < BATCH; ++k) merge.add(xs[k], ys[k]);
    }
    if (in_row) out[c] = from_float<T>(merge.out());
    if (c == 0) p.lse[b * p.lse_sb + hq * p.lse_sh + qs.q0 + i] = merge.lse();
  }
}

// ---------------------------------------------------------------- host side

[[noreturn]] void fail(const std::string& message) {
  throw InvalidArgument("attention (kv cache, CUDA): " + message);
}

// The device's error word: pinned host memory mapped into the device.
struct ErrorWord {
  unsigned long long* host = nullptr;
  unsigned long long* dev = nullptr;
  ~ErrorWord() {
    if (host) cudaFreeHost(host);  // best effort: the process may be exiting
  }
};

std::shared_ptr<ErrorWord> error_word(int device) {
  return Runtime::instance().device_caches(device).get<ErrorWord>("attention.kvcache.error", [&] {
    ::symheap::cuda::ScopedDevice on(device);
    auto w = std::make_shared<ErrorWord>();
    SYMHEAP_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&w->host), sizeof(unsigned long long),
                                     cudaHostAllocMapped | cudaHostAllocPortable));
    *w->host = 0;
    SYMHEAP_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&w->dev), w->host, 0));
    return w;
  });
}

void raise_recorded(ErrorWord& w, int device) {
  const unsigned long long x = __atomic_exchange_n(w.host, 0ull, __ATOMIC_SEQ_CST);
  if (x == 0) return;
  const unsigned code = static_cast<unsigned>(x >> 56);
  const int b = static_cast<int>((x >> 32) & 0xFFFFFFu);
  const int value = static_cast<int>(static_cast<uint32_t>(x));
  std::string what;
  if (code == kBadBlock)
    what = "sequence " + std::to_string(b) + " uses block id " + std::to_string(value) +
           ", outside [0, num_blocks)";
  else if (code == kNoRoom)
    what = "sequence " + std::to_string(b) + " has " + std::to_string(value) +
           " cached rows, which leaves no room for the appended rows (or exceeds the capacity)";
  else
    what = "sequence " + std::to_string(b) + " has the negative key length " + std::to_string(value);
  throw InvalidArgument("attention (kv cache): an earlier call on CUDA device " +
                        std::to_string(device) + " found that " + what +
                        " (cache_seqlens / cu_seqlens_k / block_table); that sequence's cache was "
                        "not written and its outputs are NaN");
}

int head_dim_bucket(int d) { return d <= 32 ? 32 : d <= 64 ? 64 : d <= 128 ? 128 : 256; }

// Which attention kernel a call runs: the keys-major one (keys_major_kernel,
// with 1 or 2 n8 blocks of query vectors: keys_major_blocks; at head dim 128
// in one of two shapes, KmShape) or the query-major one it replaced
// (attention_kernel). $SYMHEAP_DECODE_KERNEL = "keys_major" (the wide shape),
// "keys_major_x2" (two CTAs an SM; head dim 128, elsewhere the wide shape) or
// "previous" forces one, to compare them in one process; "auto", empty or
// unset: choose_kernel decides. Read on every call, so a CUDA graph keeps the
// kernel of its capture.
constexpr const char* kKernelEnv = "SYMHEAP_DECODE_KERNEL";
enum class KernelChoice { Auto, KeysMajor, KeysMajorTwoPerSm, Previous };

KernelChoice kernel_choice() {
  const char* env = std::getenv(kKernelEnv);
  if (!env || !*env || std::strcmp(env, "auto") == 0) return KernelChoice::Auto;
  if (std::strcmp(env, "keys_major") == 0) return KernelChoice::KeysMajor;
  if (std::strcmp(env, "keys_major_x2") == 0) return KernelChoice::KeysMajorTwoPerSm;
  if (std::strcmp(env, "previous") == 0) return KernelChoice::Previous;
  throw InvalidArgument(std::string("attention (kv cache): ") + kKernelEnv +
                        " must be 'auto', 'keys_major', 'keys_major_x2' or 'previous', got '" +
                        env + "'");
}

// At head dims other than 128: with at least this many (sequence, kv head)
// pairs per SM, the CTAs run unsplit in several waves, and the query-major
// kernel (less shared memory, so more CTAs resident per SM) was the faster one
// on H100 at head dim 128 (the one benched; the rule stays for the others):
// 0.86x the time of the keys-major one at batch 64 x 1k keys, 0.98-0.99x at
// batch 64-128 with 4k-16k, while the keys-major one was 0.89-0.98x of it up to
// batch 16 (bench/RESULTS.md, the keys-major decode table).
constexpr int64_t kPreviousPairsPerSm = 3;
// At head dim 128 the keys-major kernel runs two CTAs an SM when the wide
// shape's unsplit CTAs would take an even number of waves (pairs over SMs,
// rounded up): then the two-CTAs grid's last wave is more than half full,
// while with an odd number it holds at most one CTA an SM, and the wide
// shape's full waves are the faster. On H200 (Hq 32 over Hkv 8, 132 SMs), two
// CTAs an SM against the wide shape: 0.77x the time at batch 17 x 4k (136
// pairs), 0.90-0.95x at batch 24-256 x 1k, 0.91-1.00x at batch 56, 64 and 96
// (448-768 pairs: even waves); 1.08-1.14x at batch 40, 48 and 80 x 4k-16k
// (odd waves), 1.19x at batch 16 (one wave) (bench/RESULTS.md, "two CTAs an
// SM" and "even waves").
struct KernelPick {
  bool previous;
  KmShape shape;
  bool forced;  // by SYMHEAP_DECODE_KERNEL
  int sms;      // the device's SM count (when not forced)
};

KernelPick choose_kernel(const CacheArgs& a, int device, int db) {
  const KernelChoice choice = kernel_choice();
  const KmShape two = db == 128 ? kTwoPerSm : kWide;
  switch (choice) {
    case KernelChoice::Previous: return {true, kWide, true, 0};
    case KernelChoice::KeysMajor: return {false, kWide, true, 0};
    case KernelChoice::KeysMajorTwoPerSm: return {false, two, true, 0};
    case KernelChoice::Auto: break;
  }
  int sms = 0;
  SYMHEAP_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const int64_t pairs = static_cast<int64_t>(a.batch) * a.heads_kv;
  if (db == 128) return {false, ((pairs + sms - 1) / sms) % 2 == 0 ? kTwoPerSm : kWide, false, sms};
  return {pairs >= kPreviousPairsPerSm * sms, kWide, false, sms};
}

// make_plan's choice (decode.hpp): the query-major kernel (attention_kernel)
// where `previous`, else keys_major_kernel with `nb` n8 blocks of query
// vectors a CTA, in `shape` (a KmShape: kWide but at head dim 128); the splits
// merged in a thread-block cluster (merge_cluster) where `cluster`.
using Plan = CacheCudaPlan;

struct SmemReady {};

// The device's SM count, the number of attention CTAs a call aims for (with
// `all_resident`: as many as can be resident at once). Also raises the
// kernel's dynamic shared-memory limit, once per device.
template <class Kernel>
int ready_kernel(int device, const std::string& name, Kernel kernel, int threads, size_t smem,
                 bool all_resident = false) {
  Runtime::instance().device_caches(device).get<SmemReady>(name + ".smem", [&] {
    ::symheap::cuda::ScopedDevice on(device);
    SYMHEAP_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            static_cast<int>(smem)));
    return std::make_shared<SmemReady>();
  });
  const auto info = ::symheap::cuda::kernel_info(device, name.c_str(), kernel, threads, smem);
  return all_resident ? info->full_grid() : info->sm_count;
}

// Calls f(kernel, name, threads, dynamic shared memory) with the attention
// kernel a plan runs.
template <class T, int DB, class F>
auto with_kernel(const Plan& pl, F&& f) {
  const std::string suffix =
      std::string(std::is_same<T, __half>::value ? "f16." : "bf16.") + std::to_string(DB);
  if (pl.previous)
    return f(attention_kernel<T, DB>, "attention.kvcache." + suffix, kThreads, Tile<DB>::kSmem);
  if constexpr (DB == 128) {
    if (pl.shape == kTwoPerSm) {
      if (pl.nb == 2)
        return f(keys_major_kernel<T, DB, 2, kTwoPerSm>, "attention.kvcache.km2x2." + suffix,
                 KeysMajor<DB, 2, kTwoPerSm>::kThreads, KeysMajor<DB, 2, kTwoPerSm>::kSmem);
      return f(keys_major_kernel<T, DB, 1, kTwoPerSm>, "attention.kvcache.km1x2." + suffix,
               KeysMajor<DB, 1, kTwoPerSm>::kThreads, KeysMajor<DB, 1, kTwoPerSm>::kSmem);
    }
  }
  if constexpr (DB <= 128) {
    if (pl.nb == 2)
      return f(keys_major_kernel<T, DB, 2>, "attention.kvcache.km2." + suffix,
               KeysMajor<DB, 2>::kThreads, KeysMajor<DB, 2>::kSmem);
  }
  return f(keys_major_kernel<T, DB, 1>, "attention.kvcache.km1." + suffix,
           KeysMajor<DB, 1>::kThreads, KeysMajor<DB, 1>::kSmem);
}

template <class T, class F>
auto with_kernel(const Plan& pl, F&& f) {
  switch (pl.db) {
    case 32: return with_kernel<T, 32>(pl, f);
    case 64: return with_kernel<T, 64>(pl, f);
    case 128: return with_kernel<T, 128>(pl, f);
    default: return with_kernel<T, 256>(pl, f);
  }
}

template <class F>
auto with_kernel(const CacheArgs& a, const Plan& pl, F&& f) {
  return a.q.dtype == DType::F16 ? with_kernel<__half>(pl, f) : with_kernel<__nv_bfloat16>(pl, f);
}

// How the splits of a call are merged: by the CTAs of a thread-block cluster
// (one cluster per (query vectors, kv head, sequence), its CTAs the splits;
// no second kernel, no round trip through the workspace) where the cluster
// fits, else by the
// combine kernel. $SYMHEAP_DECODE_MERGE = "kernel" forces the combine kernel
// (to compare the two in one process); "auto", empty or unset: the cluster
// where it fits. Read on every call, like SYMHEAP_DECODE_KERNEL.
constexpr const char* kMergeEnv = "SYMHEAP_DECODE_MERGE";
// At most 16 CTAs a cluster on sm_90 (8 portable; 9-16 where the occupancy
// query finds room).
constexpr int kMaxClusterSplits = 16;
// The cluster the automatic split choice falls back to (portable), and the
// most keys of the capacity a split may then walk: the fallback's 64 CTAs (8
// splits over 8 kv heads) stream about 2.7 TB/s on H100 and H200 alike, while 16
// splits through the combine kernel stream at the device's memory: on H100 no
// faster up to 16k keys, on H200 (4.8 TB/s peak) faster from 6k keys on. So a
// device of more than kFastMemoryBytesPerSecond keeps the fallback to 4k keys
// (bench/RESULTS.md, "KV-cache decode on H200: the 8-split fallback bounded by
// the memory's speed").
constexpr int kPreferredClusterSplits = 8;
constexpr int kClusterFallbackKeys = 2048;
constexpr int kClusterFallbackKeysFastMemory = 512;
constexpr double kFastMemoryBytesPerSecond = 4e12;

struct PeakMemory {
  double bytes_per_second = 0;
};

// Peak memory bandwidth from the memory clock (kHz, double data rate) and bus
// width, read once per device (a plan is made on every call).
double peak_memory_bytes_per_second(int device) {
  auto& caches = Runtime::instance().device_caches(device);
  return caches.get<PeakMemory>("attention.kvcache.peak_memory", [&] {
    int khz = 0, bits = 0;
    SYMHEAP_CUDA_CHECK(cudaDeviceGetAttribute(&khz, cudaDevAttrMemoryClockRate, device));
    SYMHEAP_CUDA_CHECK(cudaDeviceGetAttribute(&bits, cudaDevAttrGlobalMemoryBusWidth, device));
    auto peak = std::make_shared<PeakMemory>();
    peak->bytes_per_second = 2.0 * khz * 1e3 * (bits / 8.0);
    return peak;
  })->bytes_per_second;
}

bool merge_by_kernel() {
  const char* env = std::getenv(kMergeEnv);
  if (!env || !*env || std::strcmp(env, "auto") == 0) return false;
  if (std::strcmp(env, "kernel") == 0) return true;
  throw InvalidArgument(std::string("attention (kv cache): ") + kMergeEnv +
                        " must be 'auto' or 'kernel', got '" + env + "'");
}

struct ClusterRoom {
  int clusters = 0;  // of the size asked, resident at once on the device
};

// How many clusters of `size` CTAs of the kernel can be resident at once (0:
// none, or no cluster launch on this device), once per (device, kernel, size).
template <class Kernel>
int cluster_room(int device, const std::string& name, Kernel kernel, int threads, size_t smem,
                 int size) {
  return Runtime::instance().device_caches(device).get<ClusterRoom>(
      name + ".clusters." + std::to_string(size), [&] {
        ::symheap::cuda::ScopedDevice on(device);
        auto room = std::make_shared<ClusterRoom>();
        int supported = 0;
        SYMHEAP_CUDA_CHECK(cudaDeviceGetAttribute(&supported, cudaDevAttrClusterLaunch, device));
        if (!supported) return room;
        if (size > 8)
          SYMHEAP_CUDA_CHECK(cudaFuncSetAttribute(
              kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
        cudaLaunchConfig_t config{};
        config.gridDim = dim3(static_cast<unsigned>(size));
        config.blockDim = dim3(static_cast<unsigned>(threads));
        config.dynamicSmemBytes = smem;
        cudaLaunchAttribute cluster{};
        cluster.id = cudaLaunchAttributeClusterDimension;
        cluster.val.clusterDim.x = static_cast<unsigned>(size);
        cluster.val.clusterDim.y = cluster.val.clusterDim.z = 1;
        config.attrs = &cluster;
        config.numAttrs = 1;
        if (cudaOccupancyMaxActiveClusters(&room->clusters, kernel, &config) != cudaSuccess) {
          (void)cudaGetLastError();  // a size the device cannot run: no room
          room->clusters = 0;
        }
        return room;
      })->clusters;
}

// Caches of at least kBalancedSplitKeys keys whose (sequence, kv head) pairs
// number more than half the SMs and at most three rounds of them (the range
// measured): one split a pair left part of the SMs' last round empty (and at
// head dim 128 the two-CTAs shape took such calls when their rounds were
// even). Those take the wide shape and the fewest splits (at most
// kMaxBalancedSplits) whose CTAs fill their last round of SMs to within
// kBalancedSlack. Measured on H200 at head dim 128, batch 8-40 x 16k-64k keys:
// within 3% of each row's best split count, 0.86-0.90x the time of the rule
// before at batch 17-24 and 40 (bench/RESULTS.md, "Feature logits on full
// tiles; decode splits by rounds of SMs"); shorter caches lose by splitting.
constexpr int64_t kBalancedSplitKeys = 16384;
constexpr int kMaxBalancedSplits = 8;
constexpr double kBalancedSlack = 1.15;

int balanced_splits(int64_t pairs, int64_t sms, int64_t useful) {
  int best = 1;
  double best_fill = 0;
  for (int s = 1; s <= kMaxBalancedSplits && s <= useful; ++s) {
    const int64_t ctas = pairs * s, rounds = (ctas + sms - 1) / sms;
    const double fill = static_cast<double>(ctas) / static_cast<double>(rounds * sms);
    if (fill * kBalancedSlack >= 1.0) return s;
    if (fill > best_fill) {
      best_fill = fill;
      best = s;
    }
  }
  return best;
}

Plan make_plan(const CacheArgs& a, int device) {
  Plan pl{};
  pl.device = device;
  pl.db = head_dim_bucket(a.head_dim);
  const int64_t n_vec = static_cast<int64_t>(a.seqlen_q) * a.group();
  const KernelPick pick = choose_kernel(a, device, pl.db);
  pl.previous = pick.previous;
  pl.shape = pick.shape;
  pl.nb = keys_major_blocks(n_vec, pl.db);
  const int per_cta = pl.previous ? kVectors : kKmBlockVectors * pl.nb;
  pl.mtiles = static_cast<int>(std::max<int64_t>(1, (n_vec + per_cta - 1) / per_cta));
  const int64_t base = static_cast<int64_t>(a.batch) * a.heads_kv * pl.mtiles;
  const int64_t useful = std::max<int64_t>(1, (a.capacity + kMinKeysPerSplit - 1) / kMinKeysPerSplit);
  // About one CTA per SM (this also readies the kernel's shared memory): the
  // kernel is bound by its own instruction stream, and on H100 a second CTA per
  // SM made every latency-bound row slower (bench/RESULTS.md, the decode split
  // sweep), while fewer CTAs leave SMs idle. The two-CTAs-an-SM shape (many
  // pairs, so seldom split) aims at every CTA it can hold.
  auto ready = [&] {
    return with_kernel(a, pl, [&](auto kernel, const std::string& name, int threads, size_t smem) {
      return ready_kernel(device, name, kernel, threads, smem, pl.shape == kTwoPerSm);
    });
  };
  const bool balance = a.num_splits <= 0 && !pick.forced && !pl.previous && pl.db == 128 &&
                       a.capacity >= kBalancedSplitKeys && 2 * base > pick.sms &&
                       base <= 3 * pick.sms;
  if (balance) pl.shape = kWide;
  int64_t target = ready();
  if (pl.shape == kTwoPerSm && !pick.forced && target < 2 * pick.sms) {
    pl.shape = kWide;  // two do not fit an SM on this device (its shared memory)
    target = ready();
  }
  int64_t splits;
  if (a.num_splits > 0) {
    splits = a.num_splits;
  } else if (balance) {
    splits = balanced_splits(base, target, useful);
  } else {
    splits = std::min(useful, std::max<int64_t>(1, target / base));
  }
  pl.splits = static_cast<int>(std::clamp<int64_t>(splits, 1, kMaxSplits));
  // A cluster merge when every cluster of the grid can be resident at once
  // (a grid of clusters in waves was not measured; the combine kernel serves it).
  const bool by_kernel = merge_by_kernel();  // read (and checked) on every call
  auto cluster_fits = [&](int n) {
    if (pl.previous || n <= 1 || n > kMaxClusterSplits || by_kernel) return false;
    return with_kernel(a, pl, [&](auto kernel, const std::string& name, int threads,
                                  size_t smem) {
      return cluster_room(device, name, kernel, threads, smem, n);
    }) >= base;
  };
  pl.cluster = cluster_fits(pl.splits);
  // A first choice of 9-16 splits whose clusters do not fit gives way to 8
  // splits merged in a (portable) cluster while each split then walks at most
  // kClusterFallbackKeys keys of the capacity (fewer on fast memory, above).
  // Measured on H100 (bench/RESULTS.md, "KV-cache decode: the cluster merge's
  // last barrier relaxed, 8 splits in a cluster on short caches"): faster than
  // the combine kernel at 1 x 4k and 1 x 16k, slower at 1 x 64k and beyond
  // (half the SMs streaming), and halving 4 splits to 2 was slower too.
  const int fallback = kPreferredClusterSplits;
  auto short_cache = [&] {
    const int keys = peak_memory_bytes_per_second(device) > kFastMemoryBytesPerSecond
                         ? kClusterFallbackKeysFastMemory
                         : kClusterFallbackKeys;
    return a.capacity <= static_cast<int64_t>(fallback) * keys;
  };
  if (!pl.cluster && a.num_splits <= 0 && pl.splits > fallback && pl.splits <= 2 * fallback &&
      short_cache() && cluster_fits(fallback)) {
    pl.splits = fallback;
    pl.cluster = true;
  }
  // Where the wide shape's clusters do not all fit at once and each split
  // walks at most one of its key tiles (latency, not streaming), the two-CTAs
  // shape merges the same splits in its clusters (half the shared memory a
  // CTA: they fit) without the combine kernel. Measured on H200
  // (bench/RESULTS.md, "the two-CTAs shape's clusters on one-tile splits"):
  // 2 x 1k keys 9.0 -> 8.4 us; with more keys a split (1 x 8k-64k, 2 x
  // 4k-64k, 4 x 1k-64k) its smaller CTAs stream slower: 1-25% slower calls.
  if (!pl.cluster && pl.splits > 1 && pl.shape == kWide && pl.db == 128 && !pick.forced &&
      !pl.previous && !balance &&
      a.capacity <= static_cast<int64_t>(pl.splits) * KeysMajor<128, 1>::kTileKeys) {
    pl.shape = kTwoPerSm;  // (ready() also raises that kernel's shared-memory limit)
    pl.cluster = ready() >= 2 * pick.sms && cluster_fits(pl.splits);
    if (!pl.cluster) pl.shape = kWide;  // (readied above)
  }
  const int64_t rows = a.varlen() ? a.total_q : static_cast<int64_t>(a.batch) * a.seqlen_q;
  pl.vectors = rows * a.heads_q;
  // Sized for the combine kernel's partials even when a cluster merges: the
  // size then does not depend on the device (a JAX program's scratch is sized
  // at trace time for any device it runs on).
  pl.bytes = pl.splits > 1
                 ? static_cast<size_t>(pl.splits) * pl.vectors * (a.head_dim + 1) * sizeof(float)
                 : 0;
  pl.bytes = (pl.bytes + 255) / 256 * 256;
  return pl;
}

bool aligned(const Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.data) % 16 == 0 && t.batch_stride % 8 == 0 &&
         t.row_stride % 8 == 0 && t.head_stride % 8 == 0;
}

void validate_cuda(const CacheArgs& a) {
  SYMHEAP_REQUIRE(a.q.dtype == DType::F16 || a.q.dtype == DType::BF16, fail,
                  std::string("takes float16 or bfloat16 tensors, got ") + dtype_name(a.q.dtype));
  SYMHEAP_REQUIRE(a.head_dim % 8 == 0, fail,
                  "head_dim must be a multiple of 8 (the caches cannot be padded in place), got " +
                      std::to_string(a.head_dim));
  const char* names[] = {"q", "out", "k_cache", "v_cache", "k", "v"};
  const Tensor* tensors[] = {&a.q, &a.out, &a.k_cache, &a.v_cache, &a.k_new, &a.v_new};
  for (int n = 0; n < (a.appends() ? 6 : 4); ++n)
    SYMHEAP_REQUIRE(aligned(*tensors[n]), fail,
                    std::string(names[n]) +
                        " needs 16-byte aligned rows (address and strides multiples of 8 "
                        "elements)");
  SYMHEAP_REQUIRE(a.batch <= 65535, fail, "batch must be <= 65535");
  SYMHEAP_REQUIRE(a.seqlen_new <= 65535 || !a.appends(), fail,
                  "at most 65535 rows can be appended per call");
}

Params params(const CacheArgs& a, const Plan& pl, void* workspace, unsigned long long* error) {
  Params p{};
  p.q = a.q.data;
  p.out = a.out.data;
  p.lse = a.lse;
  p.q_sb = a.q.batch_stride, p.q_sr = a.q.row_stride, p.q_sh = a.q.head_stride;
  p.o_sb = a.out.batch_stride, p.o_sr = a.out.row_stride, p.o_sh = a.out.head_stride;
  p.lse_sb = a.lse_batch_stride, p.lse_sh = a.lse_head_stride;
  p.k = a.k_cache.data;
  p.v = a.v_cache.data;
  p.k_sb = a.k_cache.batch_stride, p.k_sr = a.k_cache.row_stride, p.k_sh = a.k_cache.head_stride;
  p.v_sb = a.v_cache.batch_stride, p.v_sr = a.v_cache.row_stride, p.v_sh = a.v_cache.head_stride;
  p.k_new = a.k_new.data;
  p.v_new = a.v_new.data;
  p.kn_sb = a.k_new.batch_stride, p.kn_sr = a.k_new.row_stride, p.kn_sh = a.k_new.head_stride;
  p.vn_sb = a.v_new.batch_stride, p.vn_sr = a.v_new.row_stride, p.vn_sh = a.v_new.head_stride;
  p.s_new = a.appends() ? a.seqlen_new : 0;
  p.cu_q = a.cu_seqlens_q;
  p.total_q = a.total_q;
  p.seqlen_q = a.seqlen_q;
  p.seqlens_k = a.seqlens_k;
  p.cumulative = a.seqlens_k_cumulative;
  p.table = a.block_table;
  p.table_stride = a.block_table_stride;
  p.block_size = a.paged() ? a.block_size : 1;
  p.block_shift = -1;
  for (int sh = 0; sh < 31; ++sh)
    if ((1 << sh) == p.block_size) p.block_shift = sh;
  p.num_blocks = a.num_blocks;
  p.capacity = a.capacity;
  p.batch = a.batch, p.heads_q = a.heads_q, p.heads_kv = a.heads_kv, p.group = a.group();
  p.d = a.head_dim;
  p.scale = a.scale, p.softcap = a.softcap;
  p.win_left = a.window_left, p.win_right = a.window_right;
  p.alibi = a.alibi_slopes;
  p.alibi_sb = a.alibi_batch_stride;
  p.splits = pl.splits;
  p.mtiles = pl.mtiles;
  p.vectors = pl.vectors;
  p.cluster_merge = pl.cluster ? 1 : 0;
  if (pl.splits > 1 && !pl.cluster) {
    p.part_out = static_cast<float*>(workspace);
    p.part_lse = p.part_out + static_cast<size_t>(pl.splits) * pl.vectors * a.head_dim;
  }
  p.error = error;
  return p;
}

void launch_attention(const CacheArgs& a, const Params& p, const Plan& pl, cudaStream_t stream) {
  const dim3 grid(pl.splits, p.heads_kv * pl.mtiles, p.batch);
  with_kernel(a, pl, [&](auto kernel, const std::string& name, int threads, size_t smem) {
    cudaLaunchConfig_t config{};
    config.gridDim = grid;
    config.blockDim = dim3(static_cast<unsigned>(threads));
    config.dynamicSmemBytes = smem;
    config.stream = stream;
    cudaLaunchAttribute cluster{};
    if (pl.cluster) {
      cluster.id = cudaLaunchAttributeClusterDimension;
      cluster.val.clusterDim.x = grid.x;
      cluster.val.clusterDim.y = cluster.val.clusterDim.z = 1;
      config.attrs = &cluster;
      config.numAttrs = 1;
    }
    SYMHEAP_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, p));
    SYMHEAP_CUDA_CHECK_LAUNCH(name.c_str());
    return 0;
  });
}

template <class T>
void run(const CacheArgs& a, const Plan& pl, const Params& p, cudaStream_t stream) {
  if (p.s_new > 0) {
    append_kernel<<<dim3(p.s_new, p.batch), kThreads, 0, stream>>>(p);
    SYMHEAP_CUDA_CHECK_LAUNCH("attention.kvcache.append_kernel");
  }
  if (a.seqlen_q == 0 || (a.varlen() && a.total_q == 0)) return;
  launch_attention(a, p, pl, stream);
  if (pl.splits > 1 && !pl.cluster) {
    // A programmatic dependent launch: the combine's blocks are scheduled
    // while the attention kernel's last blocks run, so its launch latency
    // is off the critical path (it waits for the results in the kernel).
    const int64_t vectors = static_cast<int64_t>(a.seqlen_q) * a.heads_q;
    cudaLaunchConfig_t config{};
    config.gridDim = dim3(static_cast<unsigned>(vectors), p.batch);
    config.blockDim = dim3(kThreads);
    config.stream = stream;
    cudaLaunchAttribute overlap{};
    overlap.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    overlap.val.programmaticStreamSerializationAllowed = 1;
    config.attrs = &overlap;
    config.numAttrs = 1;
    if (p.splits > kMergeBatch)
      SYMHEAP_CUDA_CHECK(cudaLaunchKernelEx(&config, combine_kernel<T, 2 * kMergeBatch>, p));
    else
      SYMHEAP_CUDA_CHECK(cudaLaunchKernelEx(&config, combine_kernel<T, kMergeBatch>, p));
    SYMHEAP_CUDA_CHECK_LAUNCH("attention.kvcache.combine_kernel");
  }
}

}  // namespace kvcache

CacheCudaPlan cache_attention_cuda_plan(const CacheArgs& a, int device) {
  validate_cache(a);
  kvcache::validate_cuda(a);
  const kvcache::Plan pl = kvcache::make_plan(a, device);
  SYMHEAP_REQUIRE(static_cast<int64_t>(a.heads_kv) * pl.mtiles <= 65535, kvcache::fail,
                  "too many query rows for one call (kv heads x query tiles must be <= 65535); "
                  "split the queries");
  return pl;
}

size_t cache_attention_cuda_workspace_bytes(const CacheArgs& a, int device) {
  return cache_attention_cuda_plan(a, device).bytes;
}

int cache_attention_cuda_splits(const CacheArgs& a, int device) {
  return cache_attention_cuda_plan(a, device).splits;
}

void cache_attention_cuda(const CacheArgs& a, const CacheCudaPlan& pl, void* stream,
                          void* workspace, size_t bytes) {
  const int device = pl.device;
  auto error = kvcache::error_word(device);
  kvcache::raise_recorded(*error, device);
  SYMHEAP_REQUIRE(bytes >= pl.bytes && (pl.bytes == 0 || workspace != nullptr), kvcache::fail,
                  "the workspace has " + std::to_string(bytes) + " bytes; it needs " +
                      std::to_string(pl.bytes) + " (cache_attention_cuda_workspace_bytes)");
  SYMHEAP_REQUIRE(reinterpret_cast<uintptr_t>(workspace) % 16 == 0, kvcache::fail,
                  "the workspace must be 16-byte aligned");
  ::symheap::cuda::ScopedDevice on(device);
  const kvcache::Params p = kvcache::params(a, pl, workspace, error->dev);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (a.q.dtype == DType::F16) kvcache::run<__half>(a, pl, p, s);
  else kvcache::run<__nv_bfloat16>(a, pl, p, s);
}

void cache_attention_cuda(const CacheArgs& a, int device, void* stream, void* workspace,
                          size_t bytes) {
  cache_attention_cuda(a, cache_attention_cuda_plan(a, device), stream, workspace, bytes);
}

bool cache_stream_capturing(void* stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  SYMHEAP_CUDA_CHECK(cudaStreamIsCapturing(static_cast<cudaStream_t>(stream), &status));
  return status != cudaStreamCaptureStatusNone;
}

void cache_check_cuda(int device, void* stream, bool sync) {
  auto error = kvcache::error_word(device);
  if (sync) {
    ::symheap::cuda::ScopedDevice on(device);
    SYMHEAP_CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)));
  }
  kvcache::raise_recorded(*error, device);
}

}  // namespace symheap::attention
