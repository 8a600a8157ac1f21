"""bench/decode_fragment_replay.py: the keys-major decode kernel's index and
fragment arithmetic (copy destinations, ldmatrix addresses, MMA layouts, the
pipeline's order) replayed in float64 against softmax(q k^T) v, with every
mutation of a formula caught. No GPU needed; a layout change in
src/ops/attention/decode_cuda.cu is mirrored there."""
import os
import subprocess
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def test_replay_exact_and_mutations_caught():
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "decode_fragment_replay.py")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "every mutation is caught" in proc.stdout, proc.stdout
    # Each head dim bucket and both row layouts (swizzled from 64, padded below).
    for db in (32, 64, 128, 256):
        assert f"'DB': {db}," in proc.stdout, proc.stdout
