"""The examples run as documented."""
import os
import subprocess
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def _run(*args):
    env = dict(os.environ, SYMHEAP_BACKEND="cpu")
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=180,
                          cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_demo():
    out = _run("examples/demo.py")
    for r in range(4):
        assert f"PE {r}/4" in out and f"from PE {(r - 1) % 4}" in out
        assert f"got {[float((r - 1) % 4)] * 4}" in out


def test_processes_example():
    out = _run("examples/processes.py")
    assert "PE 0: got [3.0, 3.0, 3.0, 3.0]" in out
    assert "'same_process', 'same_node', 'same_node'" in out
