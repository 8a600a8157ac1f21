"""The same PE programs under every launch model on the cpu backend."""
import numpy as np
import pytest

import symheap
from symheap.testing import run_processes, run_threads

import pe_programs


def check_ring(results, expect_kinds):
    n = len(results)
    for rank, (got, expected, kinds) in enumerate(results):
        np.testing.assert_array_equal(got, expected)
        assert kinds[rank] == "self"
        for p in range(n):
            if p != rank:
                assert kinds[p] == expect_kinds(rank, p), (rank, p, kinds)


def check_atomics(results):
    n = len(results)
    assert results[0]["total"] == 10 * sum(r + 1 for r in range(n))
    for rank, r in enumerate(results):
        np.testing.assert_array_equal(r["got"], np.arange(257, dtype=np.int32) * (r["peer"] + 1))
    olds = sorted(o for r in results for o in r["olds"])
    assert len(set(olds)) == len(olds)  # every fetch_add saw a distinct old value
    assert results[0]["winner"] in [100 + r for r in range(n)]
    assert sum(1 for r in results if r["cas_old"] == 0) == 1


@pytest.mark.parametrize("n", [2, 4, 8])
def test_threads(n):
    check_ring(run_threads(pe_programs.ring_put_signal, n), lambda a, b: "same_process")
    check_atomics(run_threads(pe_programs.atomics_and_get, n))


@pytest.mark.parametrize("n", [2, 4])
def test_processes(n):
    check_ring(run_processes(pe_programs.ring_put_signal, n), lambda a, b: "same_node")
    check_atomics(run_processes(pe_programs.atomics_and_get, n))


def test_two_processes_by_two_threads():
    results = run_processes(pe_programs.ring_put_signal, 2, threads_per_proc=2)
    check_ring(results, lambda a, b: "same_process" if a // 2 == b // 2 else "same_node")
    check_atomics(run_processes(pe_programs.atomics_and_get, 2, threads_per_proc=2))
    ids = run_processes(pe_programs.identity, 2, threads_per_proc=2)
    assert ids == [(0, 4, 0), (1, 4, 1), (2, 4, 0), (3, 4, 1)]


def test_deterministic_offsets():
    sizes = [100, 4096, 1, 77777, 256]
    offs = run_threads(pe_programs.heap_offsets, 3, args=(sizes,))
    assert offs[0] == offs[1] == offs[2]
    assert len(set(offs[0])) == len(sizes)
