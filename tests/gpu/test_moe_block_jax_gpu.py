"""examples/moe_block.py --launch jax on 2 GPUs (bf16): both program shapes train the
block and match their one-device reference. Needs the CUDA gradient of EP combine
(redispatch); without it the run reports UNIMPLEMENTED and this test fails."""
import os
import random
import subprocess
import sys

import pytest

pytest.importorskip("jax")

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir)

pytestmark = pytest.mark.two_gpus


@pytest.mark.parametrize("size", ["tiny", "small"])
def test_moe_block_jax_two_gpus(size):
    env = dict(os.environ, SYMHEAP_BACKEND="cuda")
    env.pop("JAX_PLATFORMS", None)
    seed = random.SystemRandom().randrange(1 << 20)
    proc = subprocess.run([sys.executable, "examples/moe_block.py", "--backend", "cuda",
                           "--size", size, "--steps", "3", "--pes", "2", "--seed", str(seed),
                           "--launch", "jax", "--jax-mode", "threads,shard_map"],
                          cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=600)
    out = f"(--seed {seed})\n{proc.stdout[-6000:]}"
    assert proc.returncode == 0, out
    assert "2 PEs on the cuda backend" in out and "bfloat16" in out, out
    assert out.count("outputs, gradients and parameters match the one-device reference") == 2, out
    assert "all checks passed" in out, out
