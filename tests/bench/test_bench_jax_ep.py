"""bench/jax_ep_bench.py --smoke on the cpu platform: the script checks every timed program
(symheap.jax dispatch + combine and both all_to_all baselines) against numpy before it
times it and exits non-zero on a wrong answer, so this runs those checks and the report's
code without a GPU. The GPU figures come from tests/gpu/run_all.sh."""
import os
import subprocess
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def test_jax_ep_bench_smoke_checks_every_program():
    import symheap
    package_parent = os.path.dirname(os.path.dirname(symheap.__file__))
    env = dict(os.environ, SYMHEAP_BACKEND="cpu",
               PYTHONPATH=os.pathsep.join(p for p in (package_parent, os.environ.get("PYTHONPATH"))
                                          if p))
    env.pop("XLA_FLAGS", None)  # the script asks for its two cpu devices itself
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "jax_ep_bench.py"),
                           "--smoke", "--iters", "2", "--parts"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = proc.stdout
    for tokens, kernel in ((64, "intranode"), (8, "low_latency")):
        assert f"summary {tokens} tokens {kernel}: symheap.jax" in out, out
        assert "one row per expert choice" in out
        assert f"baselines {tokens} tokens {kernel}, pair in a chain of 8" in out
        assert f"parts {tokens} tokens {kernel} shard_map" in out
        assert f"parts {tokens} tokens {kernel} threads" in out
