"""bench/attn_feature_bench.py --smoke on the cpu: every feature row (bias with its
gradient, causal window, softcap, GQA, varlen, boolean mask, ALiBi, dropout, varlen with
softcap) runs forward
and forward+backward, with the variant columns (--compare-forward, --compare-backward) and
SDPA where an explicit mask expresses the row, and the script exits non-zero when an
output differs from the fp32 reference (dropout's through the call's keep mask). The GPU figures come from the
script itself on a GPU (bench/RESULTS.md)."""
import os
import subprocess
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SCRIPT = os.path.join(ROOT, "bench", "attn_feature_bench.py")


def run(*args):
    import symheap
    package_parent = os.path.dirname(os.path.dirname(symheap.__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (package_parent, os.environ.get("PYTHONPATH")) if p))
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True,
                          timeout=300, env=env)


def test_every_feature_row_runs_and_matches_the_reference():
    proc = run("--smoke", "--compare-forward", "pipelined", "--compare-backward", "pipelined_dq_separate")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = {line.split("|")[0].strip(): line for line in proc.stdout.splitlines() if "|" in line}
    assert "variant fwd+bwd" in rows["feature"], rows["feature"]
    for feature in ("bias", "window", "softcap", "gqa", "varlen", "mask", "alibi", "dropout",
                    "varlen_softcap"):
        assert feature in rows, proc.stdout
        assert "error" not in rows[feature] and "variant" in rows[feature], rows[feature]
        assert len(rows[feature].split("|")) == 6, rows[feature]  # every column filled
    for feature in ("bias", "window", "gqa", "mask"):  # SDPA can say these rows
        assert "n/a" not in rows[feature], rows[feature]


def test_an_unknown_feature_is_refused_before_any_row():
    proc = run("--smoke", "--features", "bias,nope")
    assert proc.returncode != 0 and "unknown feature(s) nope" in proc.stderr, proc.stdout + proc.stderr
    assert "bias |" not in proc.stdout
