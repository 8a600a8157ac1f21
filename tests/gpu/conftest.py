"""GPU tests: run with `pytest tests/gpu` on a machine with CUDA GPUs
(tests/gpu/run_all.sh does the build, the tests and the benchmarks).
They skip only when no CUDA device is present."""
import os
import sys

# Forced, not defaulted: tests/conftest.py (loaded first) defaults to cpu.
os.environ["SYMHEAP_BACKEND"] = "cuda"
os.environ.setdefault("SYMHEAP_HEAP_SIZE", "256M")
os.environ["SYMHEAP_TIMEOUT"] = os.environ.get("SYMHEAP_GPU_TEST_TIMEOUT", "20")  # fail fast
# Never use NVLink multicast on shared machines.
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import pytest  # noqa: E402


def cuda_device_count() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pytest_collection_modifyitems(config, items):
    n = cuda_device_count()
    for item in items:
        need = 2 if item.get_closest_marker("two_gpus") else 1
        if n < need:
            item.add_marker(pytest.mark.skip(
                reason=f"needs {need} CUDA device(s), this machine has {n}"))


def pytest_configure(config):
    config.addinivalue_line("markers", "two_gpus: needs at least two CUDA devices")
