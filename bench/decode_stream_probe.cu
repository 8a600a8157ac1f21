// Decode stream probe: how fast an SM can draw a paged KV cache from DRAM
// with the copy pattern of the keys-major decode kernel
// (src/ops/attention/decode_cuda.cu) and with others, with no attention
// arithmetic at all. The decode kernel's SMs draw 79-82% of DRAM's peak where
// cuDNN's draw 90-93% (bench/attn_notes.md 34, 48); this separates what the
// copies themselves allow from what the kernel around them costs.
//
// The cache is the bench's (bench/attn_decode_bench.py): batch B, L keys a
// sequence, Hkv 8, D 128, bf16, in 256-row blocks taken in shuffled order, K
// and V apart ([num_blocks, 256, Hkv, D]: a kv head's rows 2 KiB apart). A CTA
// streams one (sequence, kv head)'s K and V rows (or 1 / splits of them).
// Modes:
//   stages   rows through shared memory by 16-byte cp.async, S stages of T
//            rows of K and V, one CTA barrier a tile (the decode kernel's
//            feed: 8 warps, 128-row tiles, 3 stages; or 4 warps, 64-row
//            tiles, 3 stages, two CTAs an SM); "padded": rows 272 bytes apart
//            in shared memory, as the kernel laid them out before its tiles
//            were swizzled; "ends": with the kernel's start (the length read
//            before the lookups) and end (the warps' partial outputs merged
//            through shared memory and stored)
//   dense    the same over a head-major copy (each kv head's rows contiguous)
//   ldg      no shared memory: 16-byte ld.global.nc into registers, R rows a
//            thread in flight
//   copy     cudaMemcpyAsync device to device of the same bytes (read + write
//            counted: the bench's "copy bandwidth")
// Each mode reads every byte once; a checksum over what was read is compared
// with the host's, so no mode can skip its loads.
//   nvcc -O3 -std=c++17 -arch=sm_90a -o /tmp/decode_stream_probe bench/decode_stream_probe.cu
//   /tmp/decode_stream_probe            # B 16 x L 16384 and 128 x 1024
//   /tmp/decode_stream_probe 1 131072   # one shape: B L
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <type_traits>
#include <vector>

#define CK(x)                                                                                 \
  do {                                                                                        \
    cudaError_t e_ = (x);                                                                     \
    if (e_ != cudaSuccess) {                                                                  \
      std::printf("CUDA %s at line %d: %s\n", #x, __LINE__, cudaGetErrorString(e_));          \
      std::exit(1);                                                                           \
    }                                                                                         \
  } while (0)

constexpr int kHkv = 8, kD = 128, kBlock = 256;
constexpr int kRowBytes = kD * 2;          // one kv head's row of K or V
constexpr int kChunksPerRow = kRowBytes / 16;

struct Cache {
  const char* k;        // [num_blocks, kBlock, kHkv, kD] bf16, or dense [B, kHkv, L, kD]
  const char* v;
  const int* table;     // [B, L / kBlock] block ids (paged only)
  int L;
  bool dense;
  const int* lengths;   // [B], each L: what the "with ends" mode reads first
  float* out;           // [CTAs, kD]: what it writes last
};

// Address of row j of kv head hk of sequence b.
__device__ __forceinline__ const char* row_addr(const Cache& c, const char* base, int b, int hk, int j) {
  if (c.dense) return base + ((static_cast<size_t>(b) * kHkv + hk) * c.L + j) * kRowBytes;
  const int blk = c.table[b * (c.L / kBlock) + j / kBlock];
  return base + ((static_cast<size_t>(blk) * kBlock + j % kBlock) * kHkv + hk) * kRowBytes;
}

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16;\n" ::"r"(dst), "l"(gmem));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ unsigned fold(uint4 x) { return x.x ^ x.y ^ x.z ^ x.w; }

// The decode kernel's feed: T rows of K and of V a stage, S stages, rows
// looked up by the first T threads into a slot per stage, one barrier a tile.
// Every thread folds the chunks it copied (read back from shared memory).
// PITCH: bytes between rows in shared memory (the decode kernel padded its
// rows to 272 bytes, D + 8 elements, for conflict-free ldmatrix reads, until
// it swizzled packed rows instead).
// ENDS: the decode kernel's start and end around the copies, without its
// arithmetic: the sequence's length read before the first lookup (the lookups
// wait for it), and at the end the warps' partial outputs (8 vectors x D
// floats a warp) through shared memory, merged and stored to global memory.
template <int WARPS, int S, int PITCH = kRowBytes, bool ENDS = false>
__global__ void __launch_bounds__(32 * WARPS) stages_kernel(Cache c, int splits, unsigned* sums) {
  constexpr int NT = 32 * WARPS, T = 16 * WARPS;
  constexpr int kRowStride = NT / kChunksPerRow, kChunks = T / kRowStride;
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ const char* src_k[S][T];
  __shared__ const char* src_v[S][T];
  const int b = blockIdx.z, hk = blockIdx.y, split = blockIdx.x;
  const int len = ENDS ? __ldg(c.lengths + b) : c.L;
  const int keys = len / splits, j0 = split * keys, n_tiles = keys / T;
  const int row0 = threadIdx.x / kChunksPerRow, col = (threadIdx.x % kChunksPerRow) * 16;
  auto lookup = [&](int tile, int slot) {
    if (threadIdx.x < T && tile < n_tiles) {
      src_k[slot][threadIdx.x] = row_addr(c, c.k, b, hk, j0 + tile * T + threadIdx.x);
      src_v[slot][threadIdx.x] = row_addr(c, c.v, b, hk, j0 + tile * T + threadIdx.x);
    }
  };
  auto issue = [&](int tile, int slot) {
    if (tile < n_tiles) {
      unsigned char* sk = smem + static_cast<size_t>(slot) * 2 * T * PITCH;
      unsigned char* sv = sk + T * PITCH;
#pragma unroll
      for (int r = 0; r < kChunks; ++r) {
        const int row = row0 + r * kRowStride;
        cp_async16(sk + row * PITCH + col, src_k[slot][row] + col);
        cp_async16(sv + row * PITCH + col, src_v[slot][row] + col);
      }
    }
    cp_async_commit();
  };
  for (int s = 0; s < S; ++s) lookup(s, s);
  __syncthreads();
  for (int s = 0; s < S - 1; ++s) issue(s, s);
  unsigned acc = 0;
  for (int tile = 0; tile < n_tiles; ++tile) {
    const int slot = tile % S;
    cp_async_wait<S - 2>();
    __syncthreads();  // tile landed for all; tile - 1's slot is free
    const int next = tile + S - 1;
    issue(next, next % S);
    lookup(tile + S, slot);  // read by the issue after the next barrier
    const unsigned char* sk = smem + static_cast<size_t>(slot) * 2 * T * PITCH;
#pragma unroll
    for (int r = 0; r < kChunks; ++r) {
      const int off = (row0 + r * kRowStride) * PITCH + col;
      acc ^= fold(*reinterpret_cast<const uint4*>(sk + off)) ^
             fold(*reinterpret_cast<const uint4*>(sk + T * PITCH + off));
    }
  }
  cp_async_wait<0>();
  if constexpr (ENDS) {
    __syncthreads();  // the stages are free: the merge reuses them
    float* part = reinterpret_cast<float*>(smem);  // [warp][8 vectors][kD]
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    for (int i = lane; i < 8 * kD; i += 32) part[warp * 8 * kD + i] = static_cast<float>(acc & 0xff) + i;
    __syncthreads();
    const size_t cta = (static_cast<size_t>(b) * gridDim.y + hk) * gridDim.x + split;
    for (int i = threadIdx.x; i < 8 * kD; i += NT) {
      float o = 0.0f;
      for (int w = 0; w < WARPS; ++w) o += part[w * 8 * kD + i];
      if (i < kD) c.out[cta * kD + i] = o;
    }
  }
  atomicXor(sums, acc);
}

// Loads straight into registers: each thread keeps R rows' chunks of K and of
// V in flight (16-byte ld.global.nc, no L1 allocation), a warp per 2 rows a
// step as in the copies above.
template <int R>
__global__ void __launch_bounds__(256) ldg_kernel(Cache c, int splits, unsigned* sums) {
  constexpr int NT = 256, kRowStride = NT / kChunksPerRow;
  const int b = blockIdx.z, hk = blockIdx.y, split = blockIdx.x;
  const int keys = c.L / splits, j0 = split * keys;
  const int row0 = threadIdx.x / kChunksPerRow, col = (threadIdx.x % kChunksPerRow) * 16;
  unsigned acc = 0;
  for (int j = j0 + row0; j < j0 + keys; j += R * kRowStride) {
    uint4 kx[R], vx[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int jr = j + r * kRowStride;
      if (jr < j0 + keys) {
        const char* ka = row_addr(c, c.k, b, hk, jr) + col;
        const char* va = row_addr(c, c.v, b, hk, jr) + col;
        asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                     : "=r"(kx[r].x), "=r"(kx[r].y), "=r"(kx[r].z), "=r"(kx[r].w) : "l"(ka));
        asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                     : "=r"(vx[r].x), "=r"(vx[r].y), "=r"(vx[r].z), "=r"(vx[r].w) : "l"(va));
      } else {
        kx[r] = vx[r] = make_uint4(0, 0, 0, 0);
      }
    }
#pragma unroll
    for (int r = 0; r < R; ++r) acc ^= fold(kx[r]) ^ fold(vx[r]);
  }
  atomicXor(sums, acc);
}

__global__ void fill_kernel(uint4* p, size_t n, unsigned seed) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    unsigned x = static_cast<unsigned>(i) * 2654435761u ^ seed;
    x ^= x >> 13; x *= 0x5bd1e995u; x ^= x >> 15;
    p[i] = make_uint4(x, x * 3u + 1u, x * 5u + 7u, ~x);
  }
}

// XOR of every 16-byte chunk's four words over a buffer (the modes' expected sum).
__global__ void xor_all_kernel(const uint4* p, size_t n, unsigned* sum) {
  unsigned acc = 0;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x)
    acc ^= fold(p[i]);
  atomicXor(sum, acc);
}

struct Timer {
  cudaEvent_t a, b;
  Timer() { CK(cudaEventCreate(&a)); CK(cudaEventCreate(&b)); }
  template <class F>
  float us(F&& f, int reps) {  // best of three, reps launches each
    float best = 1e30f;
    for (int round = 0; round < 3; ++round) {
      CK(cudaEventRecord(a));
      for (int i = 0; i < reps; ++i) f();
      CK(cudaEventRecord(b));
      CK(cudaEventSynchronize(b));
      float ms = 0;
      CK(cudaEventElapsedTime(&ms, a, b));
      best = std::min(best, ms * 1e3f / reps);
    }
    return best;
  }
};

int run_shape(int B, int L) {
  if (L % kBlock != 0 || L < 1024) {
    std::printf("L must be a multiple of %d and at least 1024, got %d\n", kBlock, L);
    return 2;
  }
  int dev = 0, sms = 0;
  CK(cudaGetDevice(&dev));
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  const int blocks_per_seq = L / kBlock, num_blocks = B * blocks_per_seq;
  const size_t bytes = static_cast<size_t>(num_blocks) * kBlock * kHkv * kRowBytes;  // one of K, V
  char *k, *v, *kd, *vd, *scratch;
  int* table;
  unsigned* sums;
  CK(cudaMalloc(&k, bytes));
  CK(cudaMalloc(&v, bytes));
  CK(cudaMalloc(&kd, bytes));
  CK(cudaMalloc(&vd, bytes));
  CK(cudaMalloc(&scratch, bytes));
  CK(cudaMalloc(&table, sizeof(int) * num_blocks));
  CK(cudaMalloc(&sums, sizeof(unsigned) * 2));
  int* lengths;
  CK(cudaMalloc(&lengths, sizeof(int) * B));
  {
    const std::vector<int> full(B, L);
    CK(cudaMemcpy(lengths, full.data(), sizeof(int) * B, cudaMemcpyHostToDevice));
  }
  fill_kernel<<<4 * sms, 256>>>(reinterpret_cast<uint4*>(k), bytes / 16, 1u);
  fill_kernel<<<4 * sms, 256>>>(reinterpret_cast<uint4*>(v), bytes / 16, 2u);
  CK(cudaGetLastError());
  std::vector<int> ids(num_blocks);
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), std::mt19937(7));
  CK(cudaMemcpy(table, ids.data(), sizeof(int) * num_blocks, cudaMemcpyHostToDevice));
  // The dense copy holds the same rows head-major: same checksum.
  CK(cudaMemset(sums, 0, sizeof(unsigned) * 2));
  xor_all_kernel<<<4 * sms, 256>>>(reinterpret_cast<const uint4*>(k), bytes / 16, sums);
  xor_all_kernel<<<4 * sms, 256>>>(reinterpret_cast<const uint4*>(v), bytes / 16, sums);
  unsigned expected = 0;
  CK(cudaMemcpy(&expected, sums, sizeof(unsigned), cudaMemcpyDeviceToHost));
  {
    // Head-major copy: for each (b, hk), rows j in order (a strided 2D copy a block).
    for (int b = 0; b < B; ++b)
      for (int blk = 0; blk < blocks_per_seq; ++blk) {
        const size_t src_row0 = static_cast<size_t>(ids[b * blocks_per_seq + blk]) * kBlock * kHkv;
        for (int hk = 0; hk < kHkv; ++hk) {
          const size_t dst = ((static_cast<size_t>(b) * kHkv + hk) * L + blk * kBlock) * kRowBytes;
          CK(cudaMemcpy2DAsync(kd + dst, kRowBytes, k + (src_row0 + hk) * kRowBytes, kHkv * kRowBytes,
                               kRowBytes, kBlock, cudaMemcpyDeviceToDevice));
          CK(cudaMemcpy2DAsync(vd + dst, kRowBytes, v + (src_row0 + hk) * kRowBytes, kHkv * kRowBytes,
                               kRowBytes, kBlock, cudaMemcpyDeviceToDevice));
        }
      }
    CK(cudaDeviceSynchronize());
  }
  const double kv_bytes = 2.0 * bytes;
  Timer timer;
  const int reps = std::max(3, static_cast<int>(2e9 / kv_bytes));
  const float copy_us = timer.us([&] { CK(cudaMemcpyAsync(scratch, v, bytes, cudaMemcpyDeviceToDevice)); }, reps);
  const double copy_bw = 2.0 * bytes / (copy_us * 1e-6);
  std::printf("\nB %d x L %d (Hkv %d, D %d, bf16; K+V %.0f MB), %d SMs; device-to-device copy %.0f GB/s "
              "(read + write)\n", B, L, kHkv, kD, kv_bytes / 1e6, sms, copy_bw / 1e9);

  int failures = 0;
  auto report = [&](const char* name, int ctas, auto launch) {
    CK(cudaMemset(sums, 0, sizeof(unsigned)));
    launch();
    CK(cudaGetLastError());
    unsigned got = 0;
    CK(cudaMemcpy(&got, sums, sizeof(unsigned), cudaMemcpyDeviceToHost));
    const bool ok = got == expected;
    failures += !ok;
    const float us = timer.us(launch, reps);
    const double bw = kv_bytes / (us * 1e-6);
    std::printf("  %-34s %6d CTAs %9.1f us %6.0f GB/s %6.1f%% of copy  %s\n", name, ctas, us, bw / 1e9,
                100.0 * bw / copy_bw, ok ? "sum ok" : "SUM WRONG");
  };
  // Splits as the decode kernel's rule would give about one CTA an SM (or two).
  auto splits_for = [&](int per_sm) {
    int s = 1;
    while (static_cast<long>(B) * kHkv * s * 2 <= static_cast<long>(per_sm) * sms && L / (2 * s) >= 1024) s *= 2;
    return s;
  };
  float* out;  // a row of kD floats per CTA of the stages grids
  CK(cudaMalloc(&out, sizeof(float) * kD * B * kHkv * std::max(splits_for(1), splits_for(2))));
  const Cache paged{k, v, table, L, false, lengths, out}, dense{kd, vd, nullptr, L, true, lengths, out};
  // The decode kernel's two shapes: 8 warps one CTA an SM, 4 warps two; rows
  // packed in shared memory, and (paged) at the kernel's former padded pitch and with
  // its start and end (ENDS).
  auto run_stages = [&](auto warps, auto pitch, auto ends, int per_sm) {
    constexpr int W = decltype(warps)::value, P = decltype(pitch)::value, S = 3, T = 16 * W;
    constexpr bool E = decltype(ends)::value;
    const size_t smem = static_cast<size_t>(S) * 2 * T * P;
    CK(cudaFuncSetAttribute(stages_kernel<W, S, P, E>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                            static_cast<int>(smem)));
    for (const Cache* c : {&paged, &dense}) {
      if ((P != kRowBytes || E) && c->dense) continue;
      const int sp = splits_for(per_sm);
      const dim3 grid(sp, kHkv, B);
      char name[64];
      std::snprintf(name, sizeof name, "%s, %d warps, %d rows x %d stages%s%s", c->dense ? "dense" : "stages",
                    W, T, S, P != kRowBytes ? ", padded" : "", E ? ", ends" : "");
      report(name, sp * kHkv * B, [&] { stages_kernel<W, S, P, E><<<grid, 32 * W, smem>>>(*c, sp, sums); });
    }
  };
  using Packed = std::integral_constant<int, kRowBytes>;
  using Padded = std::integral_constant<int, kRowBytes + 16>;
  using Bare = std::false_type;
  using Ends = std::true_type;
  run_stages(std::integral_constant<int, 8>{}, Packed{}, Bare{}, 1);
  run_stages(std::integral_constant<int, 8>{}, Padded{}, Bare{}, 1);
  run_stages(std::integral_constant<int, 8>{}, Padded{}, Ends{}, 1);
  run_stages(std::integral_constant<int, 4>{}, Packed{}, Bare{}, 2);
  run_stages(std::integral_constant<int, 4>{}, Padded{}, Bare{}, 2);
  run_stages(std::integral_constant<int, 4>{}, Padded{}, Ends{}, 2);
  run_stages(std::integral_constant<int, 4>{}, Packed{}, Ends{}, 2);
  for (const Cache* c : {&paged, &dense}) {
    const int sp = splits_for(1);
    const dim3 grid(sp, kHkv, B);
    report(c->dense ? "ldg dense, 4 rows in flight" : "ldg, 4 rows in flight", sp * kHkv * B,
           [&] { ldg_kernel<4><<<grid, 256>>>(*c, sp, sums); });
    report(c->dense ? "ldg dense, 8 rows in flight" : "ldg, 8 rows in flight", sp * kHkv * B,
           [&] { ldg_kernel<8><<<grid, 256>>>(*c, sp, sums); });
    const int sp2 = splits_for(4);
    const dim3 grid2(sp2, kHkv, B);
    report(c->dense ? "ldg dense, 8 rows, grid of 4 an SM" : "ldg, 8 rows, grid of 4 an SM", sp2 * kHkv * B,
           [&] { ldg_kernel<8><<<grid2, 256>>>(*c, sp2, sums); });
  }
  CK(cudaFree(k));
  CK(cudaFree(v));
  CK(cudaFree(kd));
  CK(cudaFree(vd));
  CK(cudaFree(scratch));
  CK(cudaFree(table));
  CK(cudaFree(sums));
  CK(cudaFree(lengths));
  CK(cudaFree(out));
  return failures ? 1 : 0;
}

int main(int argc, char** argv) {
  if (argc == 3) return run_shape(std::atoi(argv[1]), std::atoi(argv[2]));
  if (argc != 1) {
    std::printf("usage: %s [B L]\n", argv[0]);
    return 2;
  }
  int rc = 0;
  rc |= run_shape(16, 16384);
  rc |= run_shape(128, 1024);
  rc |= run_shape(1, 131072);
  return rc;
}
