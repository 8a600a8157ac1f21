// NVLink probe for the EP kernels' copy phase (2 GPUs with peer access): how
// fast rows of 14336 B (7168 bf16), 4096 per GPU, move into the other GPU by
// copy engine (cudaMemcpyPeerAsync), SM stores (a warp per row), TMA bulk
// copies (cp.async.bulk through shared memory) and receiver loads, with one
// GPU sending or both at once, with or without half the rows staying local.
// GPU 0's rows are checked against their source after each mode (outputs
// poisoned first).
//   nvcc -O3 -std=c++17 -arch=sm_90a -o /tmp/nvlink_probe bench/nvlink_probe.cu
//   /tmp/nvlink_probe              # every mode
//   /tmp/nvlink_probe push-pull    # SM stores mixed with receiver loads only
//   /tmp/nvlink_probe claimed      # rows claimed from a counter vs a fixed share per warp
#include <cuda_runtime.h>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { printf("CUDA %s at %d: %s\n", #x, __LINE__, cudaGetErrorString(e_)); exit(1);} } while (0)

constexpr int kThreads = 512;

__device__ __forceinline__ int4 ld_stream(const int4* a) {
  int4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.s32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(a));
  return v;
}

// A warp copies nv 16-byte vectors, eight loads in flight per lane (L2 loads
// when `cached`, e.g. from a peer; else streaming loads).
__device__ __forceinline__ void warp_copy(int4* d, const int4* s, int nv, int lane, bool cached) {
  for (int i0 = lane; i0 < nv; i0 += 8 * 32) {
    int4 v[8];
#pragma unroll
    for (int q = 0; q < 8; ++q) if (i0 + q * 32 < nv) v[q] = cached ? __ldcg(s + i0 + q * 32) : ld_stream(s + i0 + q * 32);
#pragma unroll
    for (int q = 0; q < 8; ++q) if (i0 + q * 32 < nv) d[i0 + q * 32] = v[q];
  }
}

// Row r goes to dst_peer if (r % self_every) != 0 or self_every == 0, else dst_self.
__device__ __forceinline__ char* row_dst(char* peer, char* self, int r, int self_every, size_t rb) {
  return (self_every && r % self_every == 0 ? self : peer) + static_cast<size_t>(r) * rb;
}

__global__ void __launch_bounds__(kThreads) sm_rows(char* peer, char* self, const char* src, int rows, int rb, int self_every) {
  const int lane = threadIdx.x & 31;
  const int warp = blockIdx.x * (kThreads / 32) + (threadIdx.x >> 5), warps = gridDim.x * (kThreads / 32);
  const int nv = rb / 16;
  for (int r = warp; r < rows; r += warps) {
    int4* d = reinterpret_cast<int4*>(row_dst(peer, self, r, self_every, rb));
    const int4* s = reinterpret_cast<const int4*>(src + static_cast<size_t>(r) * rb);
    warp_copy(d, s, nv, lane, false);
  }
}

// As sm_rows, but each warp claims its next chunk (a row, or 1/split of one)
// from a counter: SMs that move rows faster take more of them.
__global__ void __launch_bounds__(kThreads) sm_rows_claimed(char* peer, char* self, const char* src, int rows, int rb, int self_every, int split, unsigned* counter) {
  const int lane = threadIdx.x & 31;
  const int cb = rb / split, nv = cb / 16;
  for (;;) {
    unsigned c = 0;
    if (lane == 0) c = atomicAdd(counter, 1u);
    c = __shfl_sync(0xffffffffu, c, 0);
    if (c >= static_cast<unsigned>(rows * split)) break;
    const int r = c / split, part = c % split;
    int4* d = reinterpret_cast<int4*>(row_dst(peer, self, r, self_every, rb) + part * cb);
    const int4* s = reinterpret_cast<const int4*>(src + static_cast<size_t>(r) * rb + part * cb);
    warp_copy(d, s, nv, lane, false);
  }
}

// Each GPU: pushes its rows r (r % P != P - 1, or every row if P == 0) from
// src into the peer's recv, and pulls the peer's rows r (r % P == P - 1)
// from the peer's src into its own recv. P == 1: pull only.
__global__ void __launch_bounds__(kThreads) push_pull(char* peer_recv, char* my_recv, const char* src, const char* peer_src, int rows, int rb, int P) {
  const int lane = threadIdx.x & 31;
  const int warp = blockIdx.x * (kThreads / 32) + (threadIdx.x >> 5), warps = gridDim.x * (kThreads / 32);
  const int nv = rb / 16;
  for (int r = warp; r < rows; r += warps) {
    const bool pull = P && r % P == P - 1;
    int4* d = reinterpret_cast<int4*>((pull ? my_recv : peer_recv) + static_cast<size_t>(r) * rb);
    const int4* s = reinterpret_cast<const int4*>((pull ? peer_src : src) + static_cast<size_t>(r) * rb);
    warp_copy(d, s, nv, lane, pull);
  }
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }
__device__ __forceinline__ void mbar_init(uint64_t* b) { asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(b)) : "memory"); }
__device__ __forceinline__ void mbar_wait(uint64_t* b, uint32_t parity) {
  uint32_t done = 0;
  while (!done)
    asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }" : "=r"(done) : "r"(smem_addr(b)), "r"(parity) : "memory");
}
__device__ __forceinline__ void tma_load(void* smem, const void* g, uint32_t bytes, uint64_t* b) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(b)), "r"(bytes) : "memory");
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(smem_addr(smem)), "l"(g), "r"(bytes), "r"(smem_addr(b)) : "memory");
}
__device__ __forceinline__ void tma_store(void* g, const void* smem, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(g), "r"(smem_addr(smem)), "r"(bytes) : "memory");
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}
template <int N> __device__ __forceinline__ void tma_wait_read() { asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory"); }
__device__ __forceinline__ void tma_wait_all() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }

// `pipes` lanes-0 per block (warps 0..pipes-1), each with `S` stages of one chunk.
// Chunks: rows split in `split` pieces. Lag 1: store k-1 must have been read before
// its stage is reloaded (S >= 2).
template <int S>
__global__ void __launch_bounds__(kThreads) tma_rows(char* peer, char* self, const char* src, int rows, int rb, int self_every, int pipes, int split) {
  extern __shared__ __align__(128) char smem[];
  __shared__ __align__(8) uint64_t bars[16 * S];
  const int warp = threadIdx.x >> 5;
  if (warp >= pipes || (threadIdx.x & 31)) return;
  const int cb = rb / split;
  char* buf = smem + static_cast<size_t>(warp) * S * cb;
  uint64_t* bar = bars + warp * S;
  for (int s = 0; s < S; ++s) mbar_init(bar + s);
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  const int pipe = blockIdx.x * pipes + warp, npipes = gridDim.x * pipes;
  const int chunks = rows * split;
  // this pipe's chunks: c = pipe + k * npipes
  const int mine = chunks > pipe ? (chunks - pipe + npipes - 1) / npipes : 0;
  auto chunk_src = [&](int k) { int c = pipe + k * npipes; return src + static_cast<size_t>(c / split) * rb + (c % split) * cb; };
  auto chunk_dst = [&](int k) { int c = pipe + k * npipes; return row_dst(peer, self, c / split, self_every, rb) + (c % split) * cb; };
  for (int k = 0; k < S && k < mine; ++k) tma_load(buf + k * cb, chunk_src(k), cb, bar + k);
  for (int k = 0; k < mine; ++k) {
    const int s = k % S;
    mbar_wait(bar + s, (k / S) & 1);
    tma_store(chunk_dst(k), buf + s * cb, cb);
    // reload the stage of store k-1 (lag 1) with chunk k-1+S
    if (k >= 1 && k - 1 + S < mine) {
      tma_wait_read<1>();
      const int s1 = (k - 1) % S;
      tma_load(buf + s1 * cb, chunk_src(k - 1 + S), cb, bar + s1);
    }
  }
  tma_wait_all();
}

struct Gpu { char *src, *dst_self, *recv; unsigned* counters; cudaStream_t st; cudaEvent_t a, b; };

int main(int argc, char** argv) {
  const int max_rows = 8192, rb = 14336;
  int rows = 4096;  // per mode: 8192 with every 2nd row local is the EP dispatch's 4096 tokens on 2 PEs
  const size_t bytes = static_cast<size_t>(max_rows) * rb;
  constexpr int kIters = 20;
  int ng; CK(cudaGetDeviceCount(&ng));
  if (ng < 2) { printf("need 2 GPUs\n"); return 1; }
  Gpu g[2];
  for (int d = 0; d < 2; ++d) {
    CK(cudaSetDevice(d));
    CK(cudaDeviceEnablePeerAccess(1 - d, 0));
    CK(cudaMalloc(&g[d].src, bytes)); CK(cudaMalloc(&g[d].dst_self, bytes)); CK(cudaMalloc(&g[d].recv, bytes));
    CK(cudaMalloc(&g[d].counters, 2 * kIters * sizeof(unsigned)));
    std::vector<unsigned char> h(bytes);
    for (size_t i = 0; i < bytes; ++i) h[i] = static_cast<unsigned char>((i * 131 + d * 7) >> 3);
    CK(cudaMemcpy(g[d].src, h.data(), bytes, cudaMemcpyHostToDevice));
    CK(cudaStreamCreateWithFlags(&g[d].st, cudaStreamNonBlocking));
    CK(cudaEventCreate(&g[d].a)); CK(cudaEventCreate(&g[d].b));
    CK(cudaFuncSetAttribute(tma_rows<2>, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024));
    CK(cudaFuncSetAttribute(tma_rows<3>, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024));
    CK(cudaFuncSetAttribute(tma_rows<4>, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024));
    CK(cudaFuncSetAttribute(tma_rows<6>, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024));
  }
  // kind: 0 SM, 1 TMA, 2 CE (memcpyPeer), 3 push/pull (S: the P of push_pull); dirs: 1 (GPU0 -> 1
  // only) or 2; self_every: every k-th row stays local
  auto run = [&](const char* name, int kind, int dirs, int self_every, int grid, int S, int pipes, int split) {
    const int iters = kIters;
    float ms[2] = {0, 0};
    for (int rep = 0; rep < 2; ++rep) {  // warm-up, then timed
      for (int d = 0; d < 2; ++d) {  // poison both GPUs' outputs before anything is queued
        CK(cudaSetDevice(d));
        CK(cudaMemset(g[d].recv, 0xEE, bytes));
        CK(cudaMemset(g[d].dst_self, 0xEE, bytes));
        CK(cudaMemset(g[d].counters, 0, 2 * kIters * sizeof(unsigned)));
        CK(cudaDeviceSynchronize());
      }
      for (int d = 0; d < dirs; ++d) {
        CK(cudaSetDevice(d));
        CK(cudaEventRecord(g[d].a, g[d].st));
        for (int it = 0; it < iters; ++it) {
          char* peer = g[1 - d].recv;
          if (kind == 0) sm_rows<<<grid, kThreads, 0, g[d].st>>>(peer, g[d].dst_self, g[d].src, rows, rb, self_every);
          else if (kind == 1) {
            const size_t sh = static_cast<size_t>(pipes) * S * (rb / split);
            if (S == 2) tma_rows<2><<<grid, kThreads, sh, g[d].st>>>(peer, g[d].dst_self, g[d].src, rows, rb, self_every, pipes, split);
            if (S == 3) tma_rows<3><<<grid, kThreads, sh, g[d].st>>>(peer, g[d].dst_self, g[d].src, rows, rb, self_every, pipes, split);
            if (S == 4) tma_rows<4><<<grid, kThreads, sh, g[d].st>>>(peer, g[d].dst_self, g[d].src, rows, rb, self_every, pipes, split);
            if (S == 6) tma_rows<6><<<grid, kThreads, sh, g[d].st>>>(peer, g[d].dst_self, g[d].src, rows, rb, self_every, pipes, split);
          } else if (kind == 4) {
            sm_rows_claimed<<<grid, kThreads, 0, g[d].st>>>(peer, g[d].dst_self, g[d].src, rows, rb, self_every, split, g[d].counters + rep * kIters + it);
          } else if (kind == 3) {
            push_pull<<<grid, kThreads, 0, g[d].st>>>(peer, g[d].recv, g[d].src, g[1 - d].src, rows, rb, S);
          } else {
            CK(cudaMemcpyPeerAsync(peer, 1 - d, g[d].src, d, static_cast<size_t>(rows) * rb, g[d].st));
          }
          CK(cudaGetLastError());
        }
        CK(cudaEventRecord(g[d].b, g[d].st));
      }
      for (int d = 0; d < dirs; ++d) { CK(cudaSetDevice(d)); CK(cudaStreamSynchronize(g[d].st)); CK(cudaEventElapsedTime(&ms[d], g[d].a, g[d].b)); }
    }
    // verify GPU 1's received rows (from GPU 0) and GPU 0's self rows
    std::vector<char> h0(bytes), h1(bytes), s0(bytes);
    CK(cudaSetDevice(0)); CK(cudaMemcpy(h0.data(), g[0].src, bytes, cudaMemcpyDeviceToHost)); CK(cudaMemcpy(s0.data(), g[0].dst_self, bytes, cudaMemcpyDeviceToHost));
    CK(cudaSetDevice(1)); CK(cudaMemcpy(h1.data(), g[1].recv, bytes, cudaMemcpyDeviceToHost));
    bool ok = true; size_t peer_rows = 0;
    for (int r = 0; r < rows; ++r) {
      const bool self = (kind < 2 || kind == 4) && self_every && r % self_every == 0;
      const char* got = (self ? s0.data() : h1.data()) + static_cast<size_t>(r) * rb;
      if (memcmp(got, h0.data() + static_cast<size_t>(r) * rb, rb) != 0) ok = false;
      if (!self) ++peer_rows;
    }
    for (int d = 0; d < dirs; ++d) {
      const double us = ms[d] * 1e3 / iters;
      printf("%-44s gpu%d %8.1f us  NVLink %6.1f GB/s  %s\n", name, d, us, peer_rows * static_cast<double>(rb) / us / 1e3, ok ? "ok" : "MISMATCH");
    }
  };
  char name[128];
  if (argc > 1 && strcmp(argv[1], "claimed") == 0) {  // static vs claimed rows, the EP dispatch's shape too
    run("CE memcpyPeer 2 dirs", 2, 2, 0, 0, 0, 0, 1);
    for (int rep = 0; rep < 2; ++rep)
      for (int r : {4096, 8192}) {
        rows = r;
        const int self = r == 8192 ? 2 : 0;
        snprintf(name, sizeof name, "SM static %d rows%s 2 dirs", r, self ? " self 1/2" : ""); run(name, 0, 2, self, 132, 0, 0, 1);
        for (int split : {1, 2, 4}) {
          snprintf(name, sizeof name, "SM claimed/%d %d rows%s 2 dirs", split, r, self ? " self 1/2" : ""); run(name, 4, 2, self, 132, 0, 0, split);
        }
      }
    return 0;
  }
  for (int P : {0, 1, 2, 3, 4}) for (int grid : {132}) {
    snprintf(name, sizeof name, "push/pull P%d grid %d 2 dirs", P, grid); run(name, 3, 2, 0, grid, P, 0, 1);
  }
  if (argc > 1 && strcmp(argv[1], "push-pull") == 0) return 0;
  run("CE memcpyPeer 1 dir", 2, 1, 0, 0, 0, 0, 1);
  run("CE memcpyPeer 2 dirs", 2, 2, 0, 0, 0, 0, 1);
  for (int grid : {132, 264}) {
    snprintf(name, sizeof name, "SM grid %d 1 dir", grid); run(name, 0, 1, 0, grid, 0, 0, 1);
    snprintf(name, sizeof name, "SM grid %d 2 dirs", grid); run(name, 0, 2, 0, grid, 0, 0, 1);
    snprintf(name, sizeof name, "SM grid %d 2 dirs + self 1/2", grid); run(name, 0, 2, 2, grid, 0, 0, 1);
  }
  struct T { int S, pipes, split, grid; };
  for (T t : {T{2, 1, 1, 132}, T{4, 1, 1, 132}, T{6, 1, 1, 132}, T{3, 2, 1, 132}, T{4, 2, 2, 132}, T{3, 4, 1, 132}, T{4, 4, 2, 132}, T{4, 8, 4, 132}, T{2, 4, 1, 264}, T{4, 2, 1, 132}}) {
    snprintf(name, sizeof name, "TMA S%d pipes%d split%d grid%d 1 dir", t.S, t.pipes, t.split, t.grid); run(name, 1, 1, 0, t.grid, t.S, t.pipes, t.split);
    snprintf(name, sizeof name, "TMA S%d pipes%d split%d grid%d 2 dirs", t.S, t.pipes, t.split, t.grid); run(name, 1, 2, 0, t.grid, t.S, t.pipes, t.split);
    snprintf(name, sizeof name, "TMA S%d pipes%d split%d grid%d 2d+self", t.S, t.pipes, t.split, t.grid); run(name, 1, 2, 2, t.grid, t.S, t.pipes, t.split);
  }
  return 0;
}
