"""The cuda backend under every launch model: threads x GPUs in one process,
one process per GPU (CUDA IPC), processes x threads; host API, torch tensors
and streams, the device API, copy-engine channels, concurrent launches,
failures, finalize and re-init."""
import gc
import importlib.util
import os

import numpy as np
import pytest
import torch

import symheap
from symheap import _core
from symheap.testing import run_processes, run_threads

import gpu_programs as progs
from launch import run_process_per_device

two_gpus = pytest.mark.two_gpus
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_backend_is_cuda():
    assert _core.built_with_cuda
    assert symheap.backend() == "cuda"
    assert symheap.device_count() == torch.cuda.device_count()


# --------------------------------------------------------------- launch models

@two_gpus
def test_two_threads_two_gpus_host_api():
    results = run_threads(progs.host_api, 2)
    progs.check_host_api(results)
    assert [r["kinds"] for r in results] == [["self", "same_process"], ["same_process", "self"]]
    assert [r["device"] for r in results] == [0, 1]


@two_gpus
def test_two_processes_one_gpu_each_ipc():
    results = run_process_per_device(progs.host_api, [0, 1])
    progs.check_host_api(results)
    assert [r["kinds"] for r in results] == [["self", "same_node"], ["same_node", "self"]]


@two_gpus
def test_two_processes_by_two_threads():
    # 4 PEs on 2 GPUs: each process drives both GPUs, so every GPU holds a PE
    # of each process (IPC between processes, peer access inside one).
    results = run_processes(progs.host_api, 2, threads_per_proc=2)
    progs.check_host_api(results)
    for rank, r in enumerate(results):
        for p, kind in enumerate(r["kinds"]):
            want = "self" if p == rank else "same_process" if p // 2 == rank // 2 else "same_node"
            assert kind == want, (rank, p, kind)


@two_gpus
def test_torch_tensors_threads():
    progs.check_torch_tensors(run_threads(progs.torch_tensors, 2))


@two_gpus
def test_torch_tensors_processes():
    progs.check_torch_tensors(run_process_per_device(progs.torch_tensors, [0, 1]))


# --------------------------------------------------------------- device API

@two_gpus
def test_device_api_threads():
    progs.check_device_api(run_threads(progs.device_api, 2))


@two_gpus
def test_device_api_processes():
    progs.check_device_api(run_process_per_device(progs.device_api, [0, 1]))


def test_device_api_single_pe():
    # one PE: every operation targets itself
    progs.check_device_api(run_threads(progs.device_api, 1))


@two_gpus
def test_example_ring_allgather():
    pytest.importorskip("cupy", reason="the example compiles its kernel with CuPy (NVRTC)")
    spec = importlib.util.spec_from_file_location(
        "ring_allgather", os.path.join(ROOT, "examples", "ring_allgather.py"))
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    for rank, (got, expected) in enumerate(run_threads(example.ring_allgather, 2)):
        np.testing.assert_array_equal(got, expected, err_msg=f"PE {rank}")


# --------------------------------------------------------------- copy engines

@two_gpus
def test_copy_engine_channels():
    results = run_threads(progs.copy_engine, 2)
    for rank, r in enumerate(results):
        assert all(r["rounds_ok"]), (rank, r["rounds_ok"])
        # one channel to the one destination device, made once and reused
        assert r["new_channels"] <= 1, r


@two_gpus
def test_copy_engine_channels_processes():
    for rank, r in enumerate(run_process_per_device(progs.copy_engine, [0, 1])):
        assert all(r["rounds_ok"]), (rank, r["rounds_ok"])
        assert r["new_channels"] == 1, r


# --------------------------------------------------------------- concurrency

@two_gpus
def test_eight_threads_two_gpus_concurrent_launches():
    results = run_threads(progs.concurrent_launches, 2, args=(4,))
    for rank, r in enumerate(results):
        assert not r["errors"], r["errors"]
        assert r["ok"] == [True, True], (rank, r["ok"])
        first, after_one, after_two = r["entries"]
        # at most the two kernels used (fill, SM put) were added, each once
        # per device, however many threads launched them first
        assert after_one - first <= 2, r["entries"]
        assert after_two == after_one, r["entries"]


# --------------------------------------------------------------- failures and lifecycle

@two_gpus
def test_failures_raise_clearly():
    results = run_threads(progs.failures, 2, init_kwargs={"timeout": 5})
    for r in results:
        kind, message = r["foreign_stream"]
        assert kind == "ValueError" and "belongs to device" in message
        assert r["pageable_load_store"][0] == "ValueError", r["pageable_load_store"]
        assert r["off_heap"][0] == "ValueError", r["off_heap"]
        assert r["bad_via"][0] == "ValueError"
        assert r["numpy_view"][0] == "SymheapError"
        assert r["device_timeout"][0] == "TimeoutError", r["device_timeout"]
        assert "signal_wait_until" in r["device_timeout"][1]
        assert r["after_timeout"] == (None, "")
        assert r["still_works"]


def test_cuda_backend_needs_a_pe():
    with pytest.raises(symheap.SymheapError):
        symheap.device_context()


@two_gpus
def test_finalize_releases_and_reinit_works():
    heap = 4 << 30

    def free_memory():
        gc.collect()
        out = []
        for d in (0, 1):
            with torch.cuda.device(d):
                torch.cuda.synchronize()
                torch.cuda.empty_cache()  # torch's own cached blocks are not ours
                out.append(torch.cuda.mem_get_info(d)[0])
        return out

    free_before = free_memory()
    for _ in range(2):  # init -> use -> finalize, twice on the same device slots
        ranges = run_threads(progs.heap_roundtrip, 2, args=(heap - (64 << 20),),
                             init_kwargs={"heap_size": heap})
        assert ranges == [(1, 1), (2, 2)]
        free_after = free_memory()
        for d in (0, 1):  # the 4 GiB heaps were returned to the driver
            assert free_before[d] - free_after[d] < (1 << 30), (d, free_before, free_after)
    # and a different heap size after finalize
    progs.check_host_api(run_threads(progs.host_api, 2, init_kwargs={"heap_size": "64M"}))
    assert _core.active_devices() == []
