"""examples/moe_block.py at the tiny size on the cpu backend, in every launch model: the
run must check itself against its one-device reference and say so."""
import os
import random
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("torch")

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def run_demo(*args, timeout=240):
    env = dict(os.environ, SYMHEAP_BACKEND="cpu")
    proc = subprocess.run([sys.executable, "examples/moe_block.py", "--backend", "cpu",
                           "--size", "tiny", "--steps", "2", *args],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)
    return proc.returncode, proc.stdout + proc.stderr


@pytest.mark.parametrize("launch,pes", [("threads", 4), ("processes", 2), ("mixed", 4),
                                        ("torchrun", 2), ("mpirun", 2)])
def test_demo_launch(launch, pes):
    if launch == "mpirun" and shutil.which("mpirun") is None:
        pytest.fail("mpirun not found: scripts/setup.sh installs OpenMPI")
    rc, out = run_demo("--launch", launch, "--pes", str(pes))
    assert rc == 0, out[-3000:]
    assert f"{pes} PEs on the cpu backend" in out, out[-3000:]
    assert "outputs, gradients and parameters match the one-device reference" in out, out[-3000:]
    assert "time split per step: attention" in out and "all checks passed" in out, out[-3000:]


def test_demo_baseline_and_plot(tmp_path):
    """The torch.distributed baseline passes the same check; --plot works or says why not."""
    png = tmp_path / "split.png"
    rc, out = run_demo("--launch", "threads", "--pes", "2", "--baseline", "--plot", str(png))
    assert rc == 0, out[-3000:]
    assert out.count("match the one-device reference") == 2, out[-3000:]
    try:
        import matplotlib  # noqa: F401
        assert png.stat().st_size > 1000, out[-3000:]
    except ImportError:
        assert "matplotlib is not installed" in out, out[-3000:]


def test_demo_jax_launch():
    """The JAX block (symheap.jax) in both program shapes, checked against its one-device
    reference; a build without symheap.jax fails here, saying so."""
    seed = random.randrange(1 << 20)  # fresh parameters and data each run
    rc, out = run_demo("--launch", "jax", "--jax-mode", "threads,shard_map", "--pes", "2",
                       "--seed", str(seed), timeout=300)
    out = f"(--seed {seed})\n{out}"
    assert rc == 0, out[-3000:]
    assert "2 PEs on the cpu backend" in out and "launch: jax/threads, jax/shard_map" in out, \
        out[-3000:]
    for mode in ("threads", "shard_map"):
        assert f"jax/{mode}: " in out and "tokens/s" in out, out[-3000:]
    assert out.count("outputs, gradients and parameters match the one-device reference") == 2, \
        out[-3000:]
    assert out.count("time split per step: ") == 2 and "not timed apart" in out, out[-3000:]
    assert "all checks passed" in out, out[-3000:]


def test_demo_bad_arguments():
    rc, out = run_demo("--launch", "threads", "--pes", "3", timeout=120)
    assert rc != 0 and "--pes 3 must divide the 8 experts" in out, out[-2000:]
    rc, out = run_demo("--launch", "carrier-pigeon", timeout=120)
    assert rc != 0 and "unknown carrier-pigeon" in out, out[-2000:]
    rc, out = run_demo("--launch", "jax", "--jax-mode", "pmap", timeout=120)
    assert rc != 0 and "--jax-mode: unknown pmap" in out, out[-2000:]
