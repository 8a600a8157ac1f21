"""bench/shmem_bw.py end to end on the cpu backend, with the CUDA-only calls
replaced by host copies: catches mistakes in the script's own logic (argument
lists, collective calls made by one PE only, verification, the report) without
a GPU. The GPU figures themselves come from tests/gpu/run_all.sh."""
import os
import subprocess
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))

DRIVER = r"""
import ctypes, sys, types
sys.path[:0] = [sys.argv[2], sys.argv[1] + "/bench"]
import torch, symheap
from symheap import _core

class Stream:
    cuda_stream = 0

class Event:
    def __init__(self, **kw): pass
    def record(self, stream=None): pass
    def elapsed_time(self, other): return 4.0

torch.cuda.current_stream = lambda device=None: Stream()
torch.cuda.synchronize = lambda device=None: None
torch.cuda.get_device_properties = lambda device: types.SimpleNamespace(multi_processor_count=8)
torch.cuda.get_device_name = lambda device=0: "mock"
torch.cuda.Event = Event
randint, device = torch.randint, torch.device
torch.randint = lambda *a, device=None, **kw: randint(*a, **kw)
torch.device = lambda kind, index=None: device("cpu")

def ping_pong(ctx, device, data, sig, peer, initiator, iters, stream, variant=0):
    ctypes.c_uint64.from_address(data).value = iters
    ctypes.c_uint64.from_address(sig).value = iters

mock = types.SimpleNamespace(**{k: getattr(_core, k) for k in dir(_core) if not k.startswith("__")})
mock.bench_sm_put = lambda d, s, n, pe, blocks, h: _core.put(d, s, n, pe, h)
devtest = types.SimpleNamespace(
    memcpy_peer=lambda d, dd, s, sd, n, h: ctypes.memmove(d, s, n),
    plain_copy=lambda d, s, n, blocks, dev, h: ctypes.memmove(d, s, n),
    ping_pong=ping_pong)
sys.modules["symheap._devtest"] = devtest  # built with CUDA only
symheap._devtest = devtest

import shmem_bw
shmem_bw._core = mock
symheap.backend = lambda: "cuda"
sys.argv = ["shmem_bw", "--max-size", "64M", "--watchdog", "120", "--latency-variants"]
shmem_bw.main()
"""


def test_shmem_bw_script_runs_and_verifies():
    env = dict(os.environ, SYMHEAP_BACKEND="cpu")
    import symheap
    package_parent = os.path.dirname(os.path.dirname(symheap.__file__))
    proc = subprocess.run([sys.executable, "-c", DRIVER, ROOT, package_parent], capture_output=True, text=True,
                          timeout=170, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "all transfers verified" in out
    assert "64 MiB" in out and "summary @ 64 MiB" in out
    assert "one-way latency" in out
    assert "ping-pong variant 5" in out
