"""Scale checks on every GPU of the machine (meant for 4 or 8 GPUs): one
process with a thread per GPU, one process per GPU (plain, torchrun, mpirun),
and 2 processes x (N/2) threads; the shmem host and device APIs, EP
dispatch/combine and attention in each. Skipped below 3 GPUs: the 2-GPU tests cover
that case."""
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

import symheap
from symheap.testing import run_processes, run_threads

import gpu_programs as progs
from launch import run_process_per_device

N = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = pytest.mark.skipif(N < 3, reason=f"scale run needs 3+ GPUs, this machine has {N}")
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def host_and_device_api_twice():
    """host API, device API, then finalize and init again on the same thread and device."""
    rank, world, device = symheap.my_pe(), symheap.n_pes(), symheap.current_device()
    first = (progs.host_api(), progs.device_api())
    symheap.finalize()
    # the second job's id was made by the parent thread before the launch
    symheap.init(rank, world, _REINIT_IDS[0], device=device)
    second = (progs.host_api(), progs.device_api())
    return first, second


_REINIT_IDS = []


def _check_twice(results):
    for phase in (0, 1):
        progs.check_host_api([r[phase][0] for r in results])
        progs.check_device_api([r[phase][1] for r in results])


def test_spmt_thread_per_gpu_with_reinit():
    _REINIT_IDS[:] = [symheap.get_unique_id()]
    results = run_threads(host_and_device_api_twice, N)
    _check_twice(results)
    assert results[0][0][0]["kinds"] == ["self"] + ["same_process"] * (N - 1)


def test_process_per_gpu():
    results = run_process_per_device(progs.host_api, list(range(N)))
    progs.check_host_api(results)
    assert results[0]["kinds"] == ["self"] + ["same_node"] * (N - 1)
    progs.check_device_api(run_process_per_device(progs.device_api, list(range(N))))


def test_two_processes_by_half_the_gpus():
    half = N // 2
    results = run_processes(progs.host_api, 2, threads_per_proc=half, spread_devices=True)
    progs.check_host_api(results)
    for rank, r in enumerate(results):
        for p, kind in enumerate(r["kinds"]):
            want = ("self" if p == rank else
                    "same_process" if p // half == rank // half else "same_node")
            assert kind == want, (rank, p, kind)
    progs.check_device_api(run_processes(progs.device_api, 2, threads_per_proc=half,
                                         spread_devices=True))


def test_ep_and_attention_in_every_launch_model():
    """EP dispatch/combine (every kernel) and attention on all N GPUs: one
    thread per GPU, one process per GPU, and 2 processes x N/2 threads give the
    same received rows and combined sums."""
    by_threads = run_threads(progs.ep_and_attention, N)
    by_processes = run_process_per_device(progs.ep_and_attention, list(range(N)))
    by_halves = run_processes(progs.ep_and_attention, 2, threads_per_proc=N // 2,
                              spread_devices=True)
    digests = [r["ep"] for r in by_threads]
    assert [r["ep"] for r in by_processes] == digests
    assert [r["ep"] for r in by_halves] == digests
    assert len({d for pe in digests for d in pe}) == 3 * N  # every PE and config differs


LAUNCHED = textwrap.dedent("""
    import os
    import sys
    sys.path.insert(0, {here!r})
    import conftest  # noqa: F401  (cuda backend, short waits)
    import symheap
    import gpu_programs as progs

    front = sys.argv[1]
    if front == "torch":
        import torch.distributed as dist
        dist.init_process_group("gloo")
        symheap.init_torch()
        gather = lambda x: (lambda box: (dist.all_gather_object(box, x), box)[1])(
            [None] * dist.get_world_size())
    else:
        from mpi4py import MPI
        symheap.init_mpi()
        gather = lambda x: MPI.COMM_WORLD.allgather(x)
    host = gather(progs.host_api())
    dev = gather(progs.device_api())
    ep = gather(progs.ep_and_attention())
    symheap.finalize()
    progs.check_host_api(host)
    progs.check_device_api(dev)
    assert len(ep) == len(host)
    err = max(e["attention_err"] for e in ep)
    # one write per line: the ranks share the launcher's stdout pipe
    os.write(1, f"SCALE-OK {{front}} {{len(host)}} attention err {{err}}\\n".encode())
""")


def _launch(cmd, tmp_path, front):
    script = tmp_path / "scale_launched.py"
    script.write_text(LAUNCHED.format(here=HERE))
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    proc = subprocess.run(cmd + [str(script), front], capture_output=True, text=True,
                          timeout=240, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count(f"SCALE-OK {front} {N}") == N, proc.stdout[-2000:]


def test_torchrun_process_per_gpu(tmp_path):
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    _launch([sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={N}",
             "--master-addr=127.0.0.1", f"--master-port={port}"], tmp_path, "torch")


def test_mpirun_process_per_gpu(tmp_path):
    pytest.importorskip("mpi4py")
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        pytest.skip("mpirun is not installed on this machine")
    _launch([mpirun, "-np", str(N), "--oversubscribe", sys.executable], tmp_path, "mpi")
