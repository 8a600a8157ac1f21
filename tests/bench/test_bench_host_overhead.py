"""bench/host_overhead.py on the cpu backend, briefly: both launch models run the EP
pair, and --rounds alternates them and reports the median of the rounds' ratios. The
figures themselves come from full runs (bench/RESULTS.md)."""
import os
import re
import subprocess
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SCRIPT = os.path.join(ROOT, "bench", "host_overhead.py")


def test_rounds_report_the_median_ratio():
    import symheap
    package_parent = os.path.dirname(os.path.dirname(symheap.__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (package_parent, os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run([sys.executable, SCRIPT, "--backend", "cpu", "--iters", "40", "--skip-8",
                           "--no-attention", "--rounds", "3", "--cases", "intranode"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert out.count("2 PEs: threads / processes per pair") == 3, out
    m = re.search(r"2 PEs over 3 rounds: threads / processes per pair, median ([0-9.]+)x "
                  r"\(rounds ([0-9. ]+)\)", out)
    assert m, out
    rounds = [float(x) for x in m.group(2).split()]
    assert len(rounds) == 3 and rounds == sorted(rounds) and float(m.group(1)) == rounds[1], out
