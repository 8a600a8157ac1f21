"""Faults on CUDA: a dead process's CUDA IPC peers fail fast and finalize
cleanly; finalize while another thread keeps copy kernels running does not
crash. Each PE is a subprocess that the test starts, times and kills."""
import json
import os
import signal
import sys
import time

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "faults"))

from faultproc import finish, start  # noqa: E402

two_gpus = pytest.mark.two_gpus

_IPC_PE = """
import json, sys, time
import torch
import symheap
rank, world, uid, victim = (int(sys.argv[1]), int(sys.argv[2]), bytes.fromhex(sys.argv[3]),
                            int(sys.argv[4]))
symheap.init(rank, world, uid, device=rank, heap_size="256M", timeout=60)
assert symheap.peer_kind((rank + 1) % world) == "same_node"  # CUDA IPC
word = symheap.empty((1,), "int64")
data = symheap.empty((1 << 20,), "float32")
symheap.barrier_all()
print("ready", flush=True)
t0 = time.monotonic()
try:
    if rank == victim:
        time.sleep(60)
    elif rank % 2:
        symheap.signal_wait_until(word, "eq", 1)
    else:
        symheap.put(data, torch.ones(1 << 20, device="cuda"), victim)
        symheap.quiet()
        symheap.barrier_all()
    outcome = "returned"
except Exception as e:
    outcome = f"{type(e).__name__}: {e}"
raised_at = time.time()
f0 = time.monotonic()
symheap.finalize()
print(json.dumps({"outcome": outcome, "raised_at": raised_at,
                  "finalize_s": time.monotonic() - f0}), flush=True)
"""


@two_gpus
def test_dead_process_ends_its_ipc_peers_waits_within_2s():
    import torch
    import symheap
    world = min(torch.cuda.device_count(), 4)
    victim = world - 1
    uid = symheap.get_unique_id().hex()
    procs = [start(_IPC_PE, args=(r, world, uid, victim)) for r in range(world)]
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "ready", finish(p, 60).describe()
        time.sleep(0.5)
        killed_at = time.time()
        os.kill(procs[victim].pid, signal.SIGKILL)
        for r in range(world):
            if r == victim:
                continue
            run = finish(procs[r], 60)
            assert run.rc == 0, run.describe()
            report = json.loads(run.out.strip().splitlines()[-1])
            assert report["outcome"].startswith("SymheapError"), report
            assert f"PE {victim}" in report["outcome"], report
            assert report["raised_at"] - killed_at < 2.0, report
            assert report["finalize_s"] < 2.0, report  # unmapping a dead peer's IPC memory
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.communicate()


_KERNEL_PE = """
import sys, threading, time
import torch
import symheap
rank, world, uid, via = int(sys.argv[1]), int(sys.argv[2]), bytes.fromhex(sys.argv[3]), sys.argv[4]
symheap.init(rank, world, uid, device=rank, heap_size="512M", timeout=30)
dst = symheap.empty((64 << 20,), "float32")  # 256 MiB
src = torch.rand(64 << 20, device="cuda")
done, errors, stop = [0], [], threading.Event()

def pound():
    symheap.set_device(rank)
    stream = torch.cuda.Stream()
    while not stop.is_set():
        try:
            symheap.put(dst, src, (rank + 1) % world, stream=stream, via=via)
            done[0] += 1
        except (symheap.SymheapError, ValueError) as e:
            errors.append(type(e).__name__)
            if len(errors) > 3:
                return

t = threading.Thread(target=pound)
t.start()
time.sleep(0.5)
symheap.finalize()   # copy kernels of the other thread are (most likely) still running
stop.set()
t.join(30)
assert not t.is_alive()
torch.cuda.synchronize()
print("OK", done[0], len(errors), flush=True)
"""


@two_gpus
@pytest.mark.parametrize("via", ["auto", "load_store", "copy_engine"])
def test_finalize_while_another_thread_runs_copy_kernels(via):
    import symheap
    uid = symheap.get_unique_id().hex()
    procs = [start(_KERNEL_PE, args=(r, 2, uid, via)) for r in range(2)]
    runs = [finish(p, 120) for p in procs]
    for run in runs:
        assert run.rc == 0 and run.out.startswith("OK"), run.describe()
        assert int(run.out.split()[1]) > 0
