"""tests/gpu/run_sharded.sh's report, on a throwaway test file (no GPU needed):
the sums over shards that finish, and over shards that SHARD_TIMEOUT stops
before their own summary (counted from their progress lines)."""
import os
import re
import subprocess
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))

# Eleven tests: 3 fail, the one named "hang" sleeps far past any deadline here.
FAKE = """
import time
import pytest

@pytest.mark.parametrize("i", range(9))
def test_quick(i):
    assert i % 4 != 1  # i = 1 and 5 fail

def test_fails():
    assert False

def test_hang():
    time.sleep(600)
"""


def run_sharded(tmp_path, shards, expr, deadline):
    tree = tmp_path / "tree"
    (tree / "tests" / "gpu").mkdir(parents=True)
    script = tree / "tests" / "gpu" / "run_sharded.sh"
    script.write_text(open(os.path.join(ROOT, "tests", "gpu", "run_sharded.sh")).read())
    (tree / "tests" / "gpu" / "test_fake.py").write_text(FAKE)
    env = dict(os.environ, PYTHON=sys.executable, OUT=str(tmp_path / "out"),
               SHARD_TIMEOUT=str(deadline), PATH=os.environ.get("PATH", ""))
    env.pop("CUDA_VISIBLE_DEVICES", None)
    proc = subprocess.run(["bash", str(script), str(shards), "tests/gpu/test_fake.py", expr],
                          cwd=tree, env=env, capture_output=True, text=True, timeout=deadline + 120)
    last = proc.stdout.strip().splitlines()[-1]
    counts = {k: int(re.search(rf"(\d+) {k}", last).group(1))
              for k in ("passed", "failed", "errors", "skipped")}
    return proc.returncode, last, counts, (tmp_path / "out" / "sharded_test_fake.log").read_text()


def test_finished_shards_are_summed(tmp_path):
    rc, last, counts, log = run_sharded(tmp_path, 3, "not hang", 300)
    assert counts == {"passed": 7, "failed": 3, "errors": 0, "skipped": 0}, last
    assert "of 10" in last and "ended before their summary" not in last, last
    assert rc == 1  # failures make the run fail
    assert "test_fails" in log  # the shards' logs are joined into one file


def test_shards_stopped_by_the_deadline_are_counted(tmp_path):
    # Shard 1 (every other test from the first) ends with test_hang and is stopped
    # at the deadline; its tests before it still count, from its progress line.
    rc, last, counts, _ = run_sharded(tmp_path, 2, "", 20)
    assert counts["passed"] == 7 and counts["failed"] == 3, last
    assert "1 shard(s) ended before their summary" in last, last
    assert "of 11" in last and rc == 1, last
