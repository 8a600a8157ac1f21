// Ring all-gather with the symheap device API.
//
// `buf` holds n_pes chunks of `chunk_bytes`; on entry PE p's own data sits in
// chunk p. In step k every PE forwards chunk (me - k) mod n to its right
// neighbour with a block-scope put_signal that adds 1 to the neighbour's
// `arrived` word; before forwarding a chunk that came from the left, a PE
// waits until `arrived` reaches `base + k`. After n - 1 steps every PE holds
// all chunks. One block per PE; `base` is the value of `arrived` at entry,
// so the same word serves any number of calls without a reset.
//
// Built here at run time with NVRTC (see ring_allgather.py); any CUDA
// compiler works the same way: add symheap's include/ folder to the path.
#include "symheap/device.cuh"

extern "C" __global__ void ring_allgather(symheap::DeviceContext ctx, char* buf,
                                          unsigned long long chunk_bytes,
                                          unsigned long long* arrived, unsigned long long base) {
  namespace dev = symheap::device;
  const int me = ctx.my_pe, n = ctx.n_pes;
  const int right = (me + 1) % n;
  for (int k = 0; k < n - 1; ++k) {
    if (k > 0) dev::signal_wait_until_block(ctx, arrived, dev::kGe, base + k);
    const int chunk = ((me - k) % n + n) % n;
    char* p = buf + static_cast<unsigned long long>(chunk) * chunk_bytes;
    dev::put_signal_block(ctx, p, p, chunk_bytes, arrived, 1ull, dev::kSignalAdd, right);
  }
  dev::signal_wait_until_block(ctx, arrived, dev::kGe, base + n - 1);
}
