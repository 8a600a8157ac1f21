// Ceilings of moving a dispatch's rows between two GPUs over NVLink: the copy
// engine, SM-driven 16-byte vector stores and TMA bulk copies (cp.async.bulk
// through shared memory), in one direction and in both at once, on 4064 rows
// of 14336 bytes (the 4096-token bf16 case of ep_bench.py). Needs 2 GPUs.
//
//   nvcc -std=c++17 -arch=sm_90a -O2 -o /tmp/peer_copy_bench bench/peer_copy_bench.cu
//   /tmp/peer_copy_bench
#include <cstdio>
#include <cstdint>
#include <vector>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e)); exit(1);} } while (0)

__global__ void __launch_bounds__(512) vec_copy(int4* dst, const int4* src, int64_t rows, int row_vecs) {
  const int lane = threadIdx.x & 31;
  const int64_t warp = blockIdx.x * 16 + (threadIdx.x >> 5), warps = gridDim.x * 16;
  for (int64_t r = warp; r < rows; r += warps) {
    const int4* s = src + r * row_vecs; int4* d = dst + r * row_vecs;
    int i = lane;
    for (; i + 7 * 32 < row_vecs; i += 256) {
      int4 v[8];
#pragma unroll
      for (int q = 0; q < 8; ++q) v[q] = __ldg(s + i + 32 * q);
#pragma unroll
      for (int q = 0; q < 8; ++q) d[i + 32 * q] = v[q];
    }
    for (; i < row_vecs; i += 32) d[i] = s[i];
  }
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }

template <int STAGES>
__global__ void __launch_bounds__(32) tma_copy(char* dst, const char* src, int64_t rows, int row_bytes, int chunk) {
  extern __shared__ __align__(128) char smem[];
  __shared__ __align__(8) uint64_t bar[STAGES];
  if (threadIdx.x != 0) return;
  for (int s = 0; s < STAGES; ++s)
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(smem_addr(&bar[s])));
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  const int64_t pieces_per_row = row_bytes / chunk;
  const int64_t total = rows * pieces_per_row;
  int64_t it = 0;
  for (int64_t u = blockIdx.x; u < total; u += gridDim.x, ++it) {
    const int s = it % STAGES;
    const uint32_t phase = (it / STAGES) & 1;
    const int64_t off = (u / pieces_per_row) * row_bytes + (u % pieces_per_row) * chunk;
    asm volatile("cp.async.bulk.wait_group.read %0;" :: "n"(STAGES - 1) : "memory");
    uint32_t b = smem_addr(&bar[s]);
    uint32_t sm = smem_addr(smem + (size_t)s * chunk);
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(b), "r"(chunk) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 :: "r"(sm), "l"(src + off), "r"(chunk), "r"(b) : "memory");
    uint32_t done = 0;
    while (!done)
      asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                   : "=r"(done) : "r"(b), "r"(phase) : "memory");
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" :: "l"(dst + off), "r"(sm), "r"(chunk) : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
  }
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

int main() {
  const int64_t rows = 4064; const int row_bytes = 14336; const size_t bytes = rows * row_bytes;
  char *src[2], *dst[2];
  cudaStream_t st[2]; cudaEvent_t e0[2], e1[2];
  for (int d = 0; d < 2; ++d) {
    CK(cudaSetDevice(d)); CK(cudaDeviceEnablePeerAccess(1 - d, 0));
    CK(cudaMalloc(&src[d], bytes)); CK(cudaMalloc(&dst[d], bytes));
    CK(cudaMemset(src[d], d + 1, bytes));
    CK(cudaStreamCreateWithFlags(&st[d], cudaStreamNonBlocking));
    CK(cudaEventCreate(&e0[d])); CK(cudaEventCreate(&e1[d]));
    CK(cudaFuncSetAttribute(tma_copy<4>, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024));
    CK(cudaFuncSetAttribute(tma_copy<8>, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024));
  }
  int sms; CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  auto run = [&](const char* name, int dirs, auto launch) {
    for (int w = 0; w < 2; ++w) for (int d = 0; d < dirs; ++d) { CK(cudaSetDevice(d)); launch(d); }
    for (int d = 0; d < dirs; ++d) { CK(cudaSetDevice(d)); CK(cudaDeviceSynchronize()); }
    const int iters = 20;
    for (int d = 0; d < dirs; ++d) { CK(cudaSetDevice(d)); CK(cudaEventRecord(e0[d], st[d])); }
    for (int i = 0; i < iters; ++i) for (int d = 0; d < dirs; ++d) { CK(cudaSetDevice(d)); launch(d); }
    for (int d = 0; d < dirs; ++d) { CK(cudaSetDevice(d)); CK(cudaEventRecord(e1[d], st[d])); }
    float worst = 0;
    for (int d = 0; d < dirs; ++d) { CK(cudaSetDevice(d)); CK(cudaEventSynchronize(e1[d])); float ms; CK(cudaEventElapsedTime(&ms, e0[d], e1[d])); if (ms > worst) worst = ms; }
    CK(cudaGetLastError());
    printf("%-44s dirs=%d  %7.1f us  %6.1f GB/s per direction\n", name, dirs, worst * 1e3 / iters, bytes / (worst * 1e-3 / iters) * 1e-9);
  };
  for (int dirs = 1; dirs <= 2; ++dirs) {
    run("copy engine (cudaMemcpyPeerAsync)", dirs, [&](int d) { CK(cudaMemcpyPeerAsync(dst[1 - d], 1 - d, src[d], d, bytes, st[d])); });
    for (int g : {64, 96, 128, sms}) {
      char nm[64]; snprintf(nm, 64, "vector stores, %d x 512", g);
      run(nm, dirs, [&](int d) { vec_copy<<<g, 512, 0, st[d]>>>((int4*)dst[1 - d], (const int4*)src[d], rows, row_bytes / 16); });
    }
    for (int chunk : {7168, 14336}) for (int g : {32, 64, 128, sms}) {
      char nm[64]; snprintf(nm, 64, "tma 4 stages chunk %d, %d blocks", chunk, g);
      run(nm, dirs, [&](int d) { tma_copy<4><<<g, 32, 4 * chunk, st[d]>>>(dst[1 - d], src[d], rows, row_bytes, chunk); });
      snprintf(nm, 64, "tma 8 stages chunk %d, %d blocks", chunk, g);
      run(nm, dirs, [&](int d) { tma_copy<8><<<g, 32, 8 * chunk, st[d]>>>(dst[1 - d], src[d], rows, row_bytes, chunk); });
    }
  }
  std::vector<char> h(bytes);
  CK(cudaSetDevice(0)); CK(cudaMemset(dst[1], 0, bytes)); CK(cudaDeviceSynchronize());
  tma_copy<8><<<sms, 32, 8 * 7168, st[0]>>>(dst[1], src[0], rows, row_bytes, 7168);
  CK(cudaStreamSynchronize(st[0]));
  CK(cudaMemcpy(h.data(), dst[1], bytes, cudaMemcpyDefault));
  size_t bad = 0; for (size_t i = 0; i < bytes; ++i) bad += h[i] != 1;
  printf("tma copy check: %zu wrong bytes of %zu\n", bad, bytes);
  return 0;
}
