"""Ring all-gather written with the symheap device API (ring_allgather.cu).

The kernel is compiled at run time with NVRTC through CuPy and receives the
PE's DeviceContext by value, from ``symheap.device_context()``. Run it as
one thread per GPU:

    python examples/ring_allgather.py            # all visible GPUs
"""
from __future__ import annotations

import os

import numpy as np

import symheap

HERE = os.path.dirname(os.path.abspath(__file__))
INCLUDE = os.path.join(os.path.dirname(HERE), "include")


def _kernel():
    import cupy
    with open(os.path.join(HERE, "ring_allgather.cu")) as f:
        source = f.read()
    module = cupy.RawModule(code=source, options=("-I" + INCLUDE, "--std=c++17"))
    return module.get_function("ring_allgather")


def ring_allgather(chunk_elems: int = 1 << 16, seed: int = 0):
    """Collective: every PE contributes ``chunk_elems`` float32 values and
    returns (gathered array, expected array) as numpy."""
    import cupy
    import torch

    me, n, device = symheap.my_pe(), symheap.n_pes(), symheap.current_device()
    chunk_bytes = chunk_elems * 4
    buf = symheap.empty((n, chunk_elems), "float32")
    arrived = symheap.empty((1,), "uint64")
    buf.fill_(float("nan"))  # poison: every chunk but our own must be overwritten
    mine = torch.from_numpy(
        np.random.default_rng(seed + me).standard_normal(chunk_elems, dtype=np.float32))
    buf[me].copy_(mine.to(buf.device))
    arrived.zero_()
    torch.cuda.synchronize(device)
    symheap.barrier_all()

    ctx = np.frombuffer(symheap.device_context(), dtype=symheap.device_context_dtype()).copy()
    with cupy.cuda.Device(device):
        kernel = _kernel()
        kernel((1,), (256,), (ctx, np.uint64(buf.data_ptr()), np.uint64(chunk_bytes),
                              np.uint64(arrived.data_ptr()), np.uint64(0)))
        cupy.cuda.runtime.deviceSynchronize()
    symheap.quiet()  # raises if a wait in the kernel timed out
    symheap.barrier_all()

    expected = np.stack([
        np.random.default_rng(seed + p).standard_normal(chunk_elems, dtype=np.float32)
        for p in range(n)])
    got = buf.cpu().numpy()
    symheap.free(buf)
    symheap.free(arrived)
    return got, expected


if __name__ == "__main__":
    from symheap.testing import run_threads
    n = symheap.device_count()
    for rank, (got, expected) in enumerate(run_threads(ring_allgather, n)):
        ok = np.array_equal(got, expected)
        print(f"PE {rank}: all-gather of {n} chunks {'matches' if ok else 'DIFFERS'}")
