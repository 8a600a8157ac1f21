"""The C++ unit tests (tests/cpp/unit_tests.cpp: allocator, size parsing, EP
geometry, EP host routing, the order of init and finalize). The executable comes
from the CMake build of this tree (SYMHEAP_BUILD_TESTS, on by default): the newest
build/*/symheap_unit_tests, rebuilt first by its build directory (cheap: it only
relinks against the core already built there)."""
import glob
import os
import subprocess
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def _unit_test_binary():
    found = glob.glob(os.path.join(ROOT, "build", "*", "symheap_unit_tests"))
    if found:
        exe = max(found, key=os.path.getmtime)
        build_dir = os.path.dirname(exe)
        subprocess.run([sys.executable, "-m", "cmake", "--build", build_dir, "--target",
                        "symheap_unit_tests"], check=True, capture_output=True, timeout=600)
        return exe
    # No build directory with the tests (e.g. an installed copy): configure a
    # cpu-only one just for them.
    build_dir = os.path.join(ROOT, "build", "cpp-unit-tests")
    import pybind11
    subprocess.run([sys.executable, "-m", "cmake", "-S", ROOT, "-B", build_dir,
                    "-DSYMHEAP_CUDA=OFF", "-DSYMHEAP_XLA_FFI=OFF", "-DSYMHEAP_BUILD_TESTS=ON",
                    f"-DPython_EXECUTABLE={sys.executable}",
                    f"-Dpybind11_DIR={pybind11.get_cmake_dir()}"],
                   check=True, capture_output=True, timeout=600)
    subprocess.run([sys.executable, "-m", "cmake", "--build", build_dir, "--target",
                    "symheap_unit_tests"], check=True, capture_output=True, timeout=1200)
    return os.path.join(build_dir, "symheap_unit_tests")


def test_cpp_unit_tests_pass():
    exe = _unit_test_binary()
    run = subprocess.run([exe], capture_output=True, text=True, timeout=120)
    lines = run.stdout.splitlines()
    assert run.returncode == 0, run.stdout + run.stderr
    # every group ran and the run checked something
    for name in ("allocator", "size_parsing", "ep_geometry", "ep_host_routing"):
        assert f"ok   {name}" in lines, run.stdout
    checks = int(lines[-1].split()[0])
    assert checks > 1000 and lines[-1].endswith(" 0 failed"), lines[-1]
