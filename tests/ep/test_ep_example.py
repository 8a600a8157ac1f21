"""examples/ep_moe.py runs as documented: threads, and one PE per process under torchrun."""
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def _run(*args):
    env = dict(os.environ, SYMHEAP_BACKEND="cpu", OMP_NUM_THREADS="1")
    # the symheap this test imported: the installed one, or the source tree in development
    import symheap
    here = os.path.dirname(os.path.dirname(symheap.__file__))
    env["PYTHONPATH"] = os.pathsep.join([here, env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=180,
                          cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_ep_example_threads():
    out = _run("examples/ep_moe.py")
    for r in range(2):
        assert f"PE {r}/2:" in out and "32 tokens combined" in out, out


def test_ep_example_torchrun():
    out = _run("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "examples/ep_moe.py", "torch")
    for r in range(2):
        assert f"PE {r}/2:" in out, out
