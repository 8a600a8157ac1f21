// Combine: every received row goes back to its source PE, which sums each
// token's rows (one grid for intranode and low_latency; stage, then reduce
// for the copy engine).
#pragma once
#include "ops/ep/ep_dispatch.cuh"
#ifndef __CUDACC__
#include "ops/ep/ep_numeric.hpp"
#endif

namespace symheap::ep::EP_DEVICE_NS::kernels {

// ------------------------------------------------------------ combine

// PE pe's combine buffer and statuses of call `epoch`. With two sets (by
// call parity), call k + 1's senders write into the set that the receiving
// PE summed in its call k - 1; a sender starts call k + 1 only after its
// call k ended, which waited for the receiver's call-k rows, which the
// receiver sends after its call k - 1 ended: no "consumed" flag is needed.
// With one set, senders wait for that flag (off_freed_flag).
__device__ __forceinline__ size_t combine_set(const Params& p, uint64_t epoch) {
  return p.geo.combine_sets == 2 ? static_cast<size_t>(epoch & 1) : 0;
}
__device__ __forceinline__ char* combine_buf(const Params& p, int pe, uint64_t epoch) {
  return at<char>(p, pe, p.geo.off_combine_buf) +
         combine_set(p, epoch) * p.geo.combine_rows * p.geo.combine_row_bytes;
}
__device__ __forceinline__ int32_t* combine_status(const Params& p, int pe, uint64_t epoch) {
  return at<int32_t>(p, pe, p.geo.off_combine_status) + combine_set(p, epoch) * p.n_pes;
}

// The end of a block that stored rows into other PEs' combine buffers
// (combine's senders, redispatch's store); every thread of the block calls it.
// Any thread's `bad` (a handle naming a place outside the buffers) makes the
// block's status kBadHandle; a status other than kOk goes to this PE's entry
// of every PE's status row (cleared once read, by the next call of that
// buffer set); then the block counts itself in every PE's combine flag.
__device__ __forceinline__ void finish_store_block(const Params& p, bool bad, bool ok, bool send,
                                                   uint64_t epoch) {
  __shared__ bool block_bad;
  if (threadIdx.x == 0) block_bad = false;
  __syncthreads();
  if (bad) block_bad = true;
  __syncthreads();
  if (threadIdx.x == 0) {
    const int32_t status = !ok ? kPeerTimeout : block_bad ? kBadHandle : p.arg_status;
    if (send && block_bad) record_error(p, kBadHandle, 0, p.my_pe, epoch);
    if (status != kOk)
      for (int q = 0; q < p.n_pes; ++q)
        if (stores_reach(p, q)) combine_status(p, q, epoch)[p.my_pe] = status;
  }
  publish(p, p.geo.off_combine_flag, 1, true);
}

// Expert-major: where received row r goes back to: its source PE and its
// row there (the source's combine row; in stage mode, the row of this PE's
// staging buffer). False when the handle names a place outside the op's
// buffers: a handle edited by the caller must never make a kernel or a copy
// write out of bounds.
__device__ __forceinline__ bool combine_target(const Params& p, int64_t r, int* src,
                                               int64_t* row) {
  const Geometry& g = p.geo;
  *src = p.handle_recv_meta[r * kMetaWords + kMetaSrcPe];
  const int32_t crow = p.handle_recv_meta[r * kMetaWords + kMetaCombineRow];
  if (*src < 0 || *src >= p.n_pes || crow < 0 || crow >= g.combine_rows) return false;
  *row = crow;
  // packed per source, in send order
  if (p.pack_for_copy_engine && p.cfg.layout == Layout::ExpertMajor) {
    int64_t at_row = crow - static_cast<int64_t>(p.handle_summary[4 * *src]);
    for (int q = 0; q < *src; ++q) at_row += p.handle_summary[4 * q + 1];
    if (at_row < 0 || at_row >= g.recv_rows) return false;
    *row = at_row;
  }
  return true;
}

// token_slots: whether slot k of source q holds a row here (the handle's
// slot bits; slots past max_tokens never do, whatever an edited summary says).
__device__ __forceinline__ bool slot_filled(const Params& p, int q, int64_t k) {
  if (k < 0 || k >= p.cfg.max_tokens) return false;
  const int32_t word =
      p.handle_summary[slot_bits_at(p.n_pes, p.geo.local_experts) + q * p.geo.slot_words + k / 32];
  return (static_cast<uint32_t>(word) >> (k % 32)) & 1u;
}

// Token-major: the k-th row from source q goes back to q's combine row
// summary[4q] + k (q sent its rows to this PE in token order, from its
// combine row summary[4q] on). False outside the combine buffer (an edited
// handle).
__device__ __forceinline__ bool token_major_target(const Params& p, int q, int64_t k,
                                                   int64_t* row) {
  *row = static_cast<int64_t>(p.handle_summary[4 * q]) + k;
  return *row >= 0 && *row < p.geo.combine_rows;
}

// The copy plan of the copy engine, segment (from, to, rows) of source q,
// lies inside the buffers (the handle's summary is the caller's memory).
__device__ __forceinline__ bool segment_in_bounds(const Params& p, int q, int64_t packed) {
  const int64_t to = p.handle_summary[4 * q], rows = p.handle_summary[4 * q + 1];
  const int64_t from = p.cfg.layout == Layout::TokenMajor ? p.handle_summary[4 * q + 2] : packed;
  return rows >= 0 && to >= 0 && from >= 0 && to + rows <= p.geo.combine_rows &&
         from + rows <= p.geo.recv_rows;
}

// The handle's valid rows, by the whole block: token-major [0, total);
// expert-major (l, i < count[l]) numbered expert by expert, with first[l] the
// number of the first row of expert l. Counts are clamped to the buffer, so
// an edited summary stays in bounds; a call the host aborted has no rows.
__device__ inline int64_t count_valid_rows(const Params& p, int64_t* first) {
  const int n = p.n_pes, L = p.geo.local_experts;
  __shared__ int64_t valid;
  if (p.arg_status != kOk) {
    if (threadIdx.x == 0) valid = 0;
  } else if (p.cfg.layout == Layout::TokenMajor) {
    if (threadIdx.x == 0) {
      const int64_t total = p.handle_summary[4 * n + L];
      valid = total < 0 ? 0 : total > p.geo.recv_rows ? p.geo.recv_rows : total;
    }
  } else {
    for (int l = threadIdx.x; l < L; l += blockDim.x) {
      const int64_t c = p.handle_summary[4 * n + l];
      first[l] = c < 0 ? 0 : c > p.geo.expert_cap ? p.geo.expert_cap : c;
    }
    const int64_t total = block_exclusive_scan(first, first + L, L);
    if (threadIdx.x == 0) valid = total;
  }
  __syncthreads();
  return valid;
}

// Expert-major: the handle row of valid row j (count_valid_rows' numbering).
__device__ __forceinline__ int64_t expert_major_row(const Params& p, const int64_t* first,
                                                    int64_t j) {
  int lo = 0, hi = p.geo.local_experts - 1;  // the last l with first[l] <= j
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (first[mid] <= j) lo = mid;
    else hi = mid - 1;
  }
  return lo * p.geo.expert_cap + (j - first[lo]);
}

// Copy engine, before the host's copies: stages expert-major rows in send
// order (token-major rows go straight from expert_out), checks the handle,
// and hands the copy plan (one segment per source) to the host.
__global__ void __launch_bounds__(kThreads) combine_pack_kernel(Params p) {
  start_kernel();
  const int n = p.n_pes;
  const Geometry& g = p.geo;
  const bool tm = p.cfg.layout == Layout::TokenMajor;
  const uint64_t epoch = dev::load_relaxed(local_word(p, kCombineEpoch)) + 1;
  __shared__ bool ok;
  EP_DYNAMIC_SHARED(int64_t, first_of);  // expert-major: [2 L]
  if (threadIdx.x == 0) ok = wait_all(p, g.off_freed_flag, epoch - 1, epoch);
  const int64_t valid_rows = count_valid_rows(p, first_of);
  const bool send = ok && p.arg_status == kOk;
  const int lane = threadIdx.x & 31;
  const int64_t warp0 = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  const size_t crb = g.combine_row_bytes;
  const int P = p.row_pieces;
  bool bad = false;
  if (send && !tm) {
    for (int64_t u = warp0; u < valid_rows * P; u += warps) {
      const int64_t r = expert_major_row(p, first_of, u / P);
      int src;
      int64_t row;
      if (!combine_target(p, r, &src, &row)) {
        bad = true;
        continue;
      }
      warp_copy_piece(at<char>(p, p.my_pe, g.off_stage_combine) + row * crb,
                      p.expert_output + r * crb,
                      crb, static_cast<int>(u % P), P, lane);
    }
  }
  if (bad) *local_word(p, kHandleBad) = 1;
  if (!last_block(p, kSendDone, gridDim.x)) return;
  if (threadIdx.x != 0) return;
  bool handle_ok = dev::load_relaxed(local_word(p, kHandleBad)) == 0;
  *local_word(p, kHandleBad) = 0;
  if (send) {  // the copy plan must stay inside the buffers too
    int64_t packed = 0;
    for (int q = 0; q < n; ++q) {
      if (!segment_in_bounds(p, q, packed)) handle_ok = false;
      packed += p.handle_summary[4 * q + 1];
    }
  }
  if (send && !handle_ok) record_error(p, kBadHandle, 0, p.my_pe, epoch);
  for (int q = 0; q < n; ++q)  // (the host puts this PE's own entry into other nodes' PEs)
    if (stores_reach(p, q))
      combine_status(p, q, epoch)[p.my_pe] =
          !ok ? kPeerTimeout : !handle_ok ? kBadHandle : p.arg_status;
  volatile int32_t* h = p.host_mirror;
  int segs = 0;
  int32_t packed = 0;
  if (send && handle_ok)
    for (int q = 0; q < n; ++q) {
      const int32_t rows = p.handle_summary[4 * q + 1];
      if (rows) {
        volatile int32_t* sg = h + kHostSegment0 + 4 * segs++;
        sg[0] = q;
        sg[1] = tm ? p.handle_summary[4 * q + 2] : packed;
        sg[2] = p.handle_summary[4 * q];
        sg[3] = rows;
      }
      packed += rows;
    }
  h[kHostSegments] = segs;
  __threadfence_system();
}

// Shared memory of combine_pack_kernel and combine_kernel: the first valid
// row per expert (expert-major) or per source (token-major).
inline size_t combine_shared_bytes(const Params& p) {
  return 2 * static_cast<size_t>(std::max(p.geo.local_experts, p.n_pes)) * sizeof(int64_t);
}

template <class Rt>
void launch_combine_pack(Rt& rt, const Params& p, int blocks, StreamHandle stream) {
  rt.launch(combine_pack_kernel, blocks, kThreads, combine_shared_bytes(p), stream, p);
}

// Thread 0 (others: 0): issues the atomic that gives this combine block its
// place in the order in which the blocks of its grid start (its ticket: the
// result modulo gridDim.x). Issued before wait_prior_kernel, as it does not
// depend on the previous kernel: every call of an op takes one ticket per
// block of its grid (a fixed size) from a counter that is never reset, only
// wrapped at a multiple of the grid (the low half of kCombineTicket), and a
// block calls release_next_kernel only once it has its ticket, so no block
// of a later call takes one of this call's.
__device__ __forceinline__ uint32_t take_ticket(const Params& p) {
  if (threadIdx.x != 0) return 0;
  const uint32_t wrap = (0x80000000u / gridDim.x) * gridDim.x;
  return atomicInc(reinterpret_cast<unsigned*>(local_word(p, kCombineTicket)), wrap - 1);
}
// The combine tickets taken so far (modulo the wrap).
__device__ __forceinline__ uint32_t tickets_taken(const Params& p) {
  return *reinterpret_cast<const volatile uint32_t*>(local_word(p, kCombineTicket));
}

// The whole warp: the next unit of work past a first round of `first` units
// (each warp's own), from a per-call counter; units once none are left.
// claimed: [kWarpsPerBlock] shared slots.
__device__ inline int64_t claim_unit(uint64_t* counter, int64_t first, int64_t units,
                                     int64_t* claimed) {
  if (units <= first) return units;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0)
    claimed[warp] = first + static_cast<int64_t>(
                                atomicAdd(reinterpret_cast<unsigned long long*>(counter), 1ull));
  __syncwarp();
  const int64_t u = claimed[warp];
  __syncwarp();
  return u;
}

// Sender role of combine_kernel: stores every received row of another PE (a
// piece per unit of work) back into its source's combine buffer and sets the
// piece's flag there. Token-major units visit the other sources in turn, each
// in its token order, so every source's reducers find their first tokens
// early, and every warp moves rows over the links; rows of this PE's own
// tokens stay where they are (its reducers read them). After its first unit
// a warp claims the next from a counter, so rows leave in the order the
// reducers sum them even when some SMs get less of the links than others.
// Each unit checks its row's place against the op's buffers first (the
// handle is the caller's memory); at the end the block tells every source of
// a failure it saw, then adds its share to their combine flags.
__device__ inline void send_back(const Params& p, int block, int blocks, uint64_t epoch) {
  const int n = p.n_pes;
  const Geometry& g = p.geo;
  const bool tm = p.cfg.layout == Layout::TokenMajor;
  __shared__ bool ok;
  __shared__ int64_t longest;  // token-major: rows of the other source with the most
  EP_DYNAMIC_SHARED(int64_t, first_of);  // expert-major: [2 L]
  int64_t* src_first = first_of;         // token-major: [n] first receive row from each source
  int64_t* src_rows = first_of + n;      // and [n] its rows
  if (threadIdx.x == 0) {
    ok = p.geo.combine_sets == 2 || wait_all(p, g.off_freed_flag, epoch - 1, epoch);
    // Two sets: the previous call's statuses (every reader ended with it)
    // are cleared before this block's flags, which peers wait for before
    // their next call writes that set.
    if (p.geo.combine_sets == 2 && block == 0)
      for (int q = 0; q < n; ++q) combine_status(p, p.my_pe, epoch + 1)[q] = kOk;
  }
  const int64_t valid_rows = count_valid_rows(p, first_of);
  if (tm) {
    if (threadIdx.x == 0) {
      longest = 0;
      for (int q = 0; q < n; ++q) {  // (no handle when valid_rows == 0)
        const int64_t f = valid_rows ? p.handle_summary[4 * q + 2] : 0;
        const int64_t r = valid_rows ? p.handle_summary[4 * q + 1] : 0;
        src_first[q] = f < 0 ? 0 : f;
        src_rows[q] = r < 0 ? 0 : r > valid_rows ? valid_rows : r;
        if (q != p.my_pe && src_rows[q] > longest) longest = src_rows[q];
      }
    }
    __syncthreads();
  }
  const bool send = ok && p.arg_status == kOk;
  const int lane = threadIdx.x & 31;
  const int64_t warp0 = static_cast<int64_t>(block) * kWarpsPerBlock + (threadIdx.x >> 5);
  const int64_t warps = static_cast<int64_t>(blocks) * kWarpsPerBlock;
  const size_t crb = g.combine_row_bytes;
  const int P = p.row_pieces;
  const int others = n - 1;  // token-major: the sources whose rows go over the links
  const int64_t units = (tm ? others * longest : valid_rows) * P;
  bool bad = false;
  int src;
  int64_t row;
  // Units past the first round, claimed in order (senders' and reducers'
  // counters, two of each by call parity: block 0 clears the next call's,
  // whose last user has ended).
  uint64_t* next = local_word(p, kSendNext + static_cast<int>(epoch & 1));
  if (block == 0 && threadIdx.x == 0) {
    *local_word(p, kSendNext + static_cast<int>(~epoch & 1)) = 0;
    *local_word(p, kReduceNext + static_cast<int>(~epoch & 1)) = 0;
  }
  __shared__ int64_t claimed[kWarpsPerBlock];
  for (int64_t u = send ? warp0 : units; u < units; u = claim_unit(next, warps, units, claimed)) {
    const int64_t h = u / P;
    const int piece = static_cast<int>(u % P);
    int64_t r;
    bool placed;
    if (tm) {
      const int other = static_cast<int>(h % others);
      src = other < p.my_pe ? other : other + 1;
      const int64_t k = h / others;
      if (k >= src_rows[src] || (p.cfg.token_slots && !slot_filled(p, src, k))) continue;
      r = src_first[src] + k;
      if (r >= valid_rows) continue;
      placed = token_major_target(p, src, k, &row);
    } else {
      r = expert_major_row(p, first_of, h);
      placed = combine_target(p, r, &src, &row);
    }
    if (!placed) {
      bad = true;
      continue;
    }
    warp_copy_piece(combine_buf(p, src, epoch) + row * crb, p.expert_output + r * crb, crb, piece,
                    P, lane);
    if (!p.per_row_flags) continue;
    __syncwarp();  // every lane's stores, then lane 0's fence and flag
    if (lane == 0) {
      __threadfence_system();
      dev::store_relaxed(at<uint64_t>(p, src, g.off_row_flags) + row * kMaxPieces + piece, epoch);
    }
  }
  finish_store_block(p, bad, ok, send, epoch);
}

// Two 16-bit floats of one 32-bit word, to and from fp32.
#ifdef __CUDACC__
__device__ __forceinline__ float2 halves_to_float2(uint32_t w, DType dt) {
  return dt == DType::BF16 ? __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w))
                           : __half22float2(*reinterpret_cast<const __half2*>(&w));
}
__device__ __forceinline__ uint32_t float2_to_halves(float a, float b, DType dt) {
  if (dt == DType::BF16) {
    __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&v);
  }
  __half2 v = __floats2half2_rn(a, b);
  return *reinterpret_cast<uint32_t*>(&v);
}
#else
struct float2 {
  float x, y;
};
inline float2 halves_to_float2(uint32_t w, DType dt) {
  uint16_t lo = static_cast<uint16_t>(w & 0xffffu), hi = static_cast<uint16_t>(w >> 16);
  if (dt == DType::BF16) return {bf16_to_float(lo), bf16_to_float(hi)};
  return {fp16_to_float(lo), fp16_to_float(hi)};
}
inline uint32_t float2_to_halves(float a, float b, DType dt) {
  uint32_t lo = dt == DType::BF16 ? float_to_bf16(a) : float_to_fp16(a);
  uint32_t hi = dt == DType::BF16 ? float_to_bf16(b) : float_to_fp16(b);
  return lo | (hi << 16);
}
#endif

// Converts 16 bytes of `dt` values to floats; returns how many.
__device__ __forceinline__ int unpack16(int4 v, DType dt, float* f) {
  if (dt == DType::F32) {
    f[0] = __int_as_float(v.x);
    f[1] = __int_as_float(v.y);
    f[2] = __int_as_float(v.z);
    f[3] = __int_as_float(v.w);
    return 4;
  }
  const uint32_t words[4] = {static_cast<uint32_t>(v.x), static_cast<uint32_t>(v.y),
                             static_cast<uint32_t>(v.z), static_cast<uint32_t>(v.w)};
  for (int i = 0; i < 4; ++i) {
    float2 x = halves_to_float2(words[i], dt);
    f[2 * i] = x.x;
    f[2 * i + 1] = x.y;
  }
  return 8;
}

__device__ __forceinline__ int4 pack16(const float* f, DType dt) {
  int4 v;
  if (dt == DType::F32) {
    v.x = __float_as_int(f[0]);
    v.y = __float_as_int(f[1]);
    v.z = __float_as_int(f[2]);
    v.w = __float_as_int(f[3]);
    return v;
  }
  v.x = static_cast<int>(float2_to_halves(f[0], f[1], dt));
  v.y = static_cast<int>(float2_to_halves(f[2], f[3], dt));
  v.z = static_cast<int>(float2_to_halves(f[4], f[5], dt));
  v.w = static_cast<int>(float2_to_halves(f[6], f[7], dt));
  return v;
}


// Sums piece `piece` (of P) of token t's rows into its output row, weighted
// in expert-major; row_of(j) is where column j's row lies (null: none). A
// lane sums kVecs vectors of two rows at once, so their loads are in flight
// together (sums stay in row order).
template <class RowOf>
__device__ inline void reduce_token_piece(const Params& p, int64_t t, int piece, int P, int lane,
                                          RowOf row_of) {
  const int K = p.cfg.topk, S = p.geo.send_cols;
  const bool tm = p.cfg.layout == Layout::TokenMajor;
  const DType dt = p.geo.combine_dtype;
  const int64_t vecs = static_cast<int64_t>(p.geo.combine_row_bytes / 16);
  int4* out = reinterpret_cast<int4*>(p.combined_out + t * p.geo.combine_row_bytes);
  const int64_t lo = vecs * piece / P, hi = vecs * (piece + 1) / P;
  constexpr int kVecs = 4;
  for (int64_t c0 = lo + lane; c0 < hi; c0 += 32 * kVecs) {
    float acc[kVecs][8] = {};
    for (int j0 = 0; j0 < S; j0 += 2) {
      const int4* src[2];
      float wt[2];
      int4 v[2][kVecs];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int j = j0 + h;
        src[h] = j < S ? row_of(j) : nullptr;
        wt[h] = src[h] && !tm ? p.combine_weights[t * K + j] : 1.0f;
#pragma unroll
        for (int q = 0; q < kVecs; ++q)
          if (src[h] && c0 + 32 * q < hi) v[h][q] = __ldcg(src[h] + c0 + 32 * q);
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if (!src[h]) continue;
#pragma unroll
        for (int q = 0; q < kVecs; ++q) {
          if (c0 + 32 * q >= hi) continue;
          float f[8];
          const int m = unpack16(v[h][q], dt, f);
          for (int i = 0; i < m; ++i) acc[q][i] += wt[h] * f[i];
        }
      }
    }
#pragma unroll
    for (int q = 0; q < kVecs; ++q)
      if (c0 + 32 * q < hi) out[c0 + 32 * q] = pack16(acc[q], dt);
  }
}

// Token t's row in column j of this PE's combine buffer, or null when it
// has none. An edited handle never makes a kernel read outside the buffer.
__device__ __forceinline__ const int4* combine_row(const Params& p, int64_t t, int j,
                                                   uint64_t epoch) {
  const int32_t row = p.handle_send_rows[t * p.geo.send_cols + j];
  if (row < 0) return nullptr;
  if (row >= p.geo.combine_rows) {
    record_error(p, kBadHandle, 0, p.my_pe, epoch);
    return nullptr;
  }
  return reinterpret_cast<const int4*>(combine_buf(p, p.my_pe, epoch)) +
         row * (p.geo.combine_row_bytes / 16);
}

// End of a combine on this PE, by one thread: reports a failure a sender PE
// published (after its rows, when `landed`). One combine set: once every
// reducing block is done, marks the statuses read and tells every PE its
// rows here were consumed. Two sets: once every block has started (the
// next call's senders clear this call's statuses).
__device__ inline void finish_combine(const Params& p, uint64_t epoch, bool landed) {
  const Geometry& g = p.geo;
  int32_t* status = combine_status(p, p.my_pe, epoch);
  if (landed && p.arg_status == kOk)
    for (int q = 0; q < p.n_pes; ++q) {
      const int32_t s = static_cast<const volatile int32_t*>(status)[q];
      if (s != kOk && s != kPeerTimeout) {
        record_error(p, s, 0, q, epoch);
        break;
      }
    }
  if (g.combine_sets == 1) {
    for (int q = 0; q < p.n_pes; ++q) status[q] = kOk;
    __threadfence_system();  // (one fence orders every flag below)
    for (int q = 0; q < p.n_pes; ++q)  // (the host tells other nodes' PEs)
      if (stores_reach(p, q)) dev::store_relaxed(at<uint64_t>(p, q, g.off_freed_flag) + p.my_pe, epoch);
  }
  *local_word(p, kCombineEpoch) = epoch;
}

// One thread: waits until every PE has sent its rows here; true when they
// landed and no sender reported a failure.
__device__ inline bool all_rows_landed(const Params& p, uint64_t epoch) {
  if (!wait_all(p, p.geo.off_combine_flag, epoch * p.flag_per_epoch, epoch)) return false;
  for (int q = 0; q < p.n_pes; ++q)
    if (__ldcg(combine_status(p, p.my_pe, epoch) + q) != kOk) return false;
  return true;
}

// Copy engine, after the host's copies: waits for every peer's rows, then
// sums them per token.
__global__ void __launch_bounds__(kThreads) combine_reduce_kernel(Params p) {
  start_kernel();
  const uint64_t epoch = dev::load_relaxed(local_word(p, kCombineEpoch)) + 1;
  __shared__ bool peers_ok;
  if (threadIdx.x == 0) peers_ok = all_rows_landed(p, epoch);
  __syncthreads();
  const int lane = threadIdx.x & 31;
  const int64_t warp0 = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  const int P = p.reduce_pieces;
  if (peers_ok)
    for (int64_t u = warp0; u < p.num_tokens * P; u += warps)
      reduce_token_piece(p, u / P, static_cast<int>(u % P), P, lane,
                         [&](int j) { return combine_row(p, u / P, j, epoch); });
  if (last_block(p, kReduceDone, gridDim.x) && threadIdx.x == 0)
    finish_combine(p, epoch, wait_all(p, p.geo.off_combine_flag, epoch * p.flag_per_epoch, epoch));
}

template <class Rt>
void launch_combine_reduce(Rt& rt, const Params& p, int blocks, StreamHandle stream) {
  rt.launch(combine_reduce_kernel, blocks, kThreads, 0, stream, p);
}

// Lane 0 of a reducing warp: waits until `flag` (a piece of a row) reaches
// `epoch`. Gives up when a sender PE reported a failure, when another wait
// timed out, or after the timeout, naming a PE whose senders are not done.
__device__ inline bool wait_row(const Params& p, const uint64_t* flag, uint64_t epoch) {
  const uint64_t* err = local_word(p, kErrorWord);
  const volatile int32_t* status = combine_status(p, p.my_pe, epoch);
  const uint64_t start = dev::global_timer_ns();
  unsigned spins = 0;
  while (dev::load_relaxed(flag) < epoch) {  // cheap polls; one acquire once it is set
    spin_pause();
    if ((++spins & 255u) != 0) continue;
    if (dev::load_relaxed(err) == kPeerTimeout) return false;
    for (int q = 0; q < p.n_pes; ++q)
      if (status[q] != kOk) return false;
    if (dev::global_timer_ns() - start > p.timeout_ns) {
      const uint64_t target = epoch * p.flag_per_epoch;
      const uint64_t* done = at<uint64_t>(p, p.my_pe, p.geo.off_combine_flag);
      int late = p.my_pe;
      for (int q = p.n_pes - 1; q >= 0; --q)
        if (dev::load_relaxed(done + q) < target) late = q;
      record_error(p, kPeerTimeout, late, p.my_pe, epoch, kWaitCombine,
                   dev::load_relaxed(done + late),
                   target);
      return false;
    }
  }
  return dev::load_acquire(flag) >= epoch;
}

// Token-major: where this PE's own row of token t lies in expert_out (the
// combine row of that row, mapped back through the handle's summary), or
// null if the handle places it outside the valid rows.
__device__ __forceinline__ const int4* own_row(const Params& p, int32_t crow, uint64_t epoch) {
  const int32_t* mine = p.handle_summary + 4 * p.my_pe;
  const int64_t k = static_cast<int64_t>(crow) - mine[3];
  const int64_t r = mine[2] + k;
  const int64_t total = p.handle_summary[4 * p.n_pes + p.geo.local_experts];
  if (k < 0 || k >= mine[1] || r < 0 || r >= total || r >= p.geo.recv_rows) {
    record_error(p, kBadHandle, 0, p.my_pe, epoch);
    return nullptr;
  }
  return reinterpret_cast<const int4*>(p.expert_output) + r * (p.geo.combine_row_bytes / 16);
}

// Reducer role of combine_kernel: sums each token's rows (token-major: its
// own row straight from expert_out) once they have landed: with row_flags,
// as soon as every piece it needs has (the sums overlap the transfer), else
// once every sender PE is done (fewer waits: small calls). The lanes of a
// warp look up where a token's rows lie before it waits (the handle is
// ready from the start), so only the rows' loads follow the wait. With
// row_flags, units past each reducer warp's first come from a counter in
// token order (the order rows land in), and sender blocks that sent every
// row they could claim join in (`block` < 0): the sums left when the last
// rows land are shared by every block. One block ends the call once every
// sender PE is done: the last reducer to start (two combine sets), or the
// last block to finish its sums (one set: the buffer is consumed).
__device__ inline void reduce_landed(const Params& p, int block, int blocks, uint64_t epoch,
                                     uint32_t senders_in) {
  const Geometry& g = p.geo;
  const int S = g.send_cols;
  const bool tm = p.cfg.layout == Layout::TokenMajor;
  const bool joins = block < 0;  // a sender block, done sending
  const int lane = threadIdx.x & 31;
  const int64_t warp0 =
      joins ? -1 : static_cast<int64_t>(block) * kWarpsPerBlock + (threadIdx.x >> 5);
  const int64_t warps = static_cast<int64_t>(blocks) * kWarpsPerBlock;  // reducer warps
  const int P = p.reduce_pieces;  // with row_flags, kReduceSplit parts per flagged piece
  const int split = p.per_row_flags ? P / p.row_pieces : 1;
  const int64_t units = p.num_tokens * P;
  const uint64_t* flags = at<uint64_t>(p, p.my_pe, g.off_row_flags);
  uint64_t* counter = local_word(p, kReduceNext + static_cast<int>(epoch & 1));
  __shared__ int64_t claimed[kWarpsPerBlock];
  auto next = [&](int64_t u) {  // the whole warp
    return p.per_row_flags ? claim_unit(counter, warps, units, claimed) : u + warps;
  };
  auto place = [&](int64_t t, int j) -> const int4* {  // where token t's row j lies
    if (tm && j == p.my_pe) {
      const int32_t crow = p.handle_send_rows[t * S + j];
      return crow < 0 ? nullptr : own_row(p, crow, epoch);
    }
    return combine_row(p, t, j, epoch);
  };
  EP_DYNAMIC_SHARED(int64_t, place_words);  // [warps][S] (combine_kernel's launch sizes it)
  const bool cached = S <= kMaxCachedCols;
  const int4** places =
      reinterpret_cast<const int4**>(place_words) + static_cast<int64_t>(threadIdx.x >> 5) * S;
  auto look_up = [&](int64_t t) {  // the whole warp
    if (!cached) return;
    for (int j = lane; j < S; j += 32) places[j] = place(t, j);
    __syncwarp();
  };
  if (!joins && warp0 < units) look_up(warp0 / P);
  __shared__ bool go;
  if (threadIdx.x == 0) {
    go = p.per_row_flags || all_rows_landed(p, epoch);
    // A sender joins only once every sender has started (their first units
    // are theirs alone): the ticket counter is past them (not if it wrapped
    // since, which only keeps the sender out).
    if (joins) go = go && tickets_taken(p) >= senders_in;
  }
  __syncthreads();
  const int64_t first = !go ? units : joins ? next(0) : warp0;
  for (int64_t u = first; u < units; u = next(u)) {
    const int64_t t = u / P;
    const int piece = static_cast<int>(u % P);
    if (u != warp0) look_up(t);
    // This PE's own row is in memory already: its piece heads for L2 while
    // the other PEs' rows land, so the sum after the wait reads L2 only.
    if (p.per_row_flags && tm && cached && places[p.my_pe]) {
      const int64_t vecs = static_cast<int64_t>(g.combine_row_bytes / 16);
      for (int64_t v = vecs * piece / P + 8 * lane; v < vecs * (piece + 1) / P; v += 8 * 32)
        prefetch_l2(places[p.my_pe] + v);
    }
    bool ready = true;
    if (lane == 0 && p.per_row_flags)
      for (int j = 0; j < S && ready; ++j) {
        const int32_t row = p.handle_send_rows[t * S + j];
        if (row >= 0 && row < g.combine_rows && !(tm && j == p.my_pe))
          ready = wait_row(p, flags + static_cast<int64_t>(row) * kMaxPieces + piece / split,
                           epoch);
      }
    // Lane 0's acquire, then the warp's reads (the barrier orders them).
    if (__ballot_sync(0xffffffffu, lane == 0 && ready) == 0u) break;  // the host raises it
    reduce_token_piece(p, t, piece, P, lane,
                       [&](int j) { return cached ? places[j] : place(t, j); });
    __syncwarp();  // every lane read places[] before the next look-up
  }
  const bool ends = g.combine_sets == 2
                        ? block == blocks - 1
                        : last_block(p, kReduceDone, p.per_row_flags ? gridDim.x : blocks);
  if (!ends || threadIdx.x != 0) return;
  // Without row flags, `go` already means every sender PE is done.
  finish_combine(p, epoch, (go && !p.per_row_flags) ||
                               wait_all(p, g.off_combine_flag, epoch * p.flag_per_epoch, epoch));
}

// Combine in one grid (intranode, low_latency). Blocks take their role in
// the order they start: the first p.sender_blocks send rows back, the others
// reduce (with row_flags, each token as soon as its rows have landed, so the
// sums overlap the transfer, and senders join the reducers once they are
// done). Blocks wait only on senders of this grid that started before them
// and on other PEs' senders, so the grid needs no co-residency.
__global__ void __launch_bounds__(kThreads) combine_kernel(Params p) {
  // The role's ticket is on its way while the block waits for the previous
  // kernel (take_ticket).
  const uint32_t raw = take_ticket(p);
  wait_prior_kernel();
  const uint64_t epoch = dev::load_relaxed(local_word(p, kCombineEpoch)) + 1;
  __shared__ int ticket;
  __shared__ uint32_t first_ticket;  // this call's first
  if (threadIdx.x == 0) {
    ticket = static_cast<int>(raw % gridDim.x);
    first_ticket = raw - static_cast<uint32_t>(ticket);
  }
  __syncthreads();
  release_next_kernel();  // (only once this block has its ticket: take_ticket)
  const bool sender = ticket < p.sender_blocks;
  if (sender) {
    send_back(p, ticket, p.sender_blocks, epoch);
    if (!p.per_row_flags) return;
  }
  reduce_landed(p, sender ? -1 : ticket - p.sender_blocks,
                static_cast<int>(gridDim.x) - p.sender_blocks,
                epoch, first_ticket + static_cast<uint32_t>(p.sender_blocks));
}

// Launches combine_kernel: p.sender_blocks senders and `reducers` reducers.
// Shared memory: combine_shared_bytes, or the reducers' look-ups of where
// each row of a token lies (reduce_landed), whichever is larger.
template <class Rt>
void launch_combine(Rt& rt, const Params& p, int reducers, StreamHandle stream) {
  const Geometry& g = p.geo;
  const size_t places =
      g.send_cols <= kMaxCachedCols
          ? static_cast<size_t>(kWarpsPerBlock) * g.send_cols * sizeof(int64_t)
          : 0;
  rt.launch_early(combine_kernel, p.sender_blocks + reducers, kThreads,
                  std::max(combine_shared_bytes(p), places), stream, p);
}

}  // namespace symheap::ep::EP_DEVICE_NS::kernels
