"""Host checks of the Hopper forward kernel's shared-memory placement and
register fragments (tests/cpp/hopper_layout_tests.cu, CuTe's layout algebra on
the cpu): every element lands where the wgmma descriptors' 128-byte swizzle
puts it, and P, S and O hold the (row, column) the kernel's index arithmetic
names. Built with the kernel (CUTLASS's headers and nvcc, sm_90a)."""
import glob
import os
import subprocess
import sys

from symheap import _core

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
BUILT, WHY = _core.attention_hopper_forward_status()


def test_hopper_layouts_match_the_swizzle_and_the_fragments():
    if not BUILT:  # a build without the kernel (no nvcc or no CUTLASS headers) says which
        assert WHY.startswith("the Hopper forward kernel was not built: ") and len(WHY) > 45, WHY
        return
    found = glob.glob(os.path.join(ROOT, "build", "*", "symheap_hopper_layout_tests"))
    assert found, "the build that made the Hopper kernel has no symheap_hopper_layout_tests"
    exe = max(found, key=os.path.getmtime)
    subprocess.run([sys.executable, "-m", "cmake", "--build", os.path.dirname(exe), "--target",
                    "symheap_hopper_layout_tests"], check=True, capture_output=True, timeout=1200)
    run = subprocess.run([exe], capture_output=True, text=True, timeout=300)
    lines = run.stdout.splitlines()
    assert run.returncode == 0, run.stdout + run.stderr
    for dtype in ("bf16", "f16"):
        for d in (64, 128, 256):
            assert f"ok   {dtype} head dim {d}: " in run.stdout, run.stdout
        for d in (64, 128):
            assert f"ok   {dtype} backward head dim {d}: " in run.stdout, run.stdout
        for d in (64, 128, 256):
            assert f"ok   {dtype} pingpong head dim {d}: " in run.stdout, run.stdout
        assert f"ok   {dtype} TMA boxes: " in run.stdout, run.stdout
    assert lines[-1].endswith(" 0 failed") and int(lines[-1].split()[0]) > 100000, lines[-1]
