"""finalize + init again, shared-memory hygiene, and the launcher front ends."""
import os
import stat
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import symheap
from symheap import _core
from symheap.testing import PeFailure, run_processes, run_threads

import pe_programs

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def _check_cycles(results, cycles):
    for per_pe in results:
        assert len(per_pe) == cycles
        for got, expected, _ in per_pe:
            np.testing.assert_array_equal(got, expected)


def test_reinit_threads():
    uids = [symheap.get_unique_id() for _ in range(2)]
    _check_cycles(run_threads(pe_programs.reinit_cycles, 4, args=(uids,)), 3)


def test_reinit_processes_mixed():
    uids = [symheap.get_unique_id()]
    _check_cycles(run_processes(pe_programs.reinit_cycles, 2, args=(uids,), threads_per_proc=2),
                  2)


class _EchoBootstrap:
    """The bootstrap of a one-PE job (the exchange is an echo) that records the
    modes of this process's heap segments while init exchanges its record."""
    failure = ""

    def __init__(self):
        self.modes, self.closed = None, None

    def allgather(self, data, tag):
        if tag == "init":
            self.modes = [stat.S_IMODE(os.stat("/dev/shm/" + name).st_mode)
                          for name in pe_programs.heap_segments_of_this_process()]
        return [data]

    def close(self, grace_s):
        self.closed = grace_s


def test_heap_segment_is_owner_only_and_unlinked():
    boot = _EchoBootstrap()
    symheap.set_device(5)
    assert _core.init_pe(12345, 5, 0, 1, 1 << 20, 5.0, lambda: boot) is boot
    try:
        assert boot.modes == [0o600], boot.modes  # one segment, owner-only, during init
        assert pe_programs.heap_segments_of_this_process() == []  # unlinked once mapped
    finally:
        _core.finalize_pe(5, boot)
    assert boot.closed is not None and _core.slot_identity(5) is None


def _segments_after_init():
    symheap.barrier_all()
    return pe_programs.heap_segments_of_this_process()


def test_no_segment_names_survive_init():
    # Names are unlinked once every peer has mapped the heap, so a crash later leaks nothing.
    assert run_processes(_segments_after_init, 2) == [[], []]
    assert run_threads(_segments_after_init, 2) == [[], []]


def test_killed_processes_leave_no_segments():
    before = {f for f in os.listdir("/dev/shm") if f.startswith("symheap.")}
    with pytest.raises(PeFailure):
        run_processes(pe_programs.die_hard_after_init, 2, timeout=60)
    after = {f for f in os.listdir("/dev/shm") if f.startswith("symheap.")}
    assert after <= before


def test_stale_segment_of_dead_process_is_reaped():
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    dead_pid = int(proc.stdout)
    path = f"/dev/shm/symheap.{dead_pid}.00000000deadbeef.0.1"
    with open(path, "wb") as f:
        f.write(b"x")
    run_threads(lambda: None, 1)
    assert not os.path.exists(path)


def _run_script(cmd, timeout=150):
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "tests", "runtime") + os.pathsep +
               os.environ.get("PYTHONPATH", ""), SYMHEAP_BACKEND="cpu",
               OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


LAUNCHED = textwrap.dedent("""
    import sys
    import numpy as np
    import symheap
    import pe_programs

    def main(front_end):
        if front_end == "torch":
            import torch.distributed as dist
            dist.init_process_group("gloo")
            symheap.init_torch()
        else:
            symheap.init_mpi()
        for cycle in range(2):
            got, expected, kinds = pe_programs.ring_put_signal(128)
            np.testing.assert_array_equal(got, expected)
            assert kinds[symheap.my_pe()] == "self"
            assert all(k == "same_node" for i, k in enumerate(kinds) if i != symheap.my_pe())
            r = pe_programs.atomics_and_get()
            if symheap.my_pe() == 0:
                assert r["total"] == 10 * sum(p + 1 for p in range(symheap.n_pes())), r
            print(f"OK {front_end} pe {symheap.my_pe()}/{symheap.n_pes()} "
                  f"device {symheap.current_device()} cycle {cycle}", flush=True)
            symheap.finalize()
            if cycle == 0:
                if front_end == "torch":
                    symheap.init_torch()
                else:
                    symheap.init_mpi()
        if front_end == "torch":
            dist.destroy_process_group()

    main(sys.argv[1])
""")


@pytest.fixture
def launched_script(tmp_path):
    path = tmp_path / "launched.py"
    path.write_text(LAUNCHED)
    return str(path)


def _ok_lines(out):
    # Two processes share the launcher's stdout, so lines may interleave.
    import re
    return sorted(re.findall(r"OK \w+ pe \d+/\d+ device \d+ cycle \d+", out))


def _free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torchrun_gloo(launched_script):
    pytest.importorskip("torch")
    out = _run_script([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                       "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
                       launched_script, "torch"])
    assert _ok_lines(out) == [
        "OK torch pe 0/2 device 0 cycle 0", "OK torch pe 0/2 device 0 cycle 1",
        "OK torch pe 1/2 device 1 cycle 0", "OK torch pe 1/2 device 1 cycle 1"]


def test_mpirun(launched_script):
    pytest.importorskip("mpi4py")
    import shutil
    mpirun = shutil.which("mpirun")
    assert mpirun, "mpirun not found: scripts/setup.sh installs OpenMPI"
    out = _run_script([mpirun, "-np", "2", "--oversubscribe", sys.executable, launched_script,
                       "mpi"])
    assert _ok_lines(out) == [
        "OK mpi pe 0/2 device 0 cycle 0", "OK mpi pe 0/2 device 0 cycle 1",
        "OK mpi pe 1/2 device 1 cycle 0", "OK mpi pe 1/2 device 1 cycle 1"]
