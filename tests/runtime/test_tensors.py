"""Tensors and arrays on the heap, and views of peers' copies."""
import pytest

import symheap
from symheap.testing import run_processes, run_threads

import pe_programs

pytest.importorskip("torch")


def test_threads_peer_views():
    results = run_threads(pe_programs.torch_tensors_and_peer_views, 3, devices=[2, 5, 7])
    for ok_read, ok_write, live, devices in results:
        assert ok_read and ok_write and live
        assert devices == [2, 5, 7]  # rank -> device map of same-process peers


def test_processes_peer_views():
    results = run_processes(pe_programs.torch_tensors_and_peer_views, 2)
    for ok_read, ok_write, live, devices in results:
        assert ok_read and ok_write and live
        assert devices == [0]


def _remote_peer():
    me = symheap.my_pe()
    kinds = [symheap.peer_kind(p) for p in range(symheap.n_pes())]
    x = symheap.empty((4,), "float32", like="numpy")
    other = 1 - me
    with pytest.raises(symheap.UnsupportedError, match="remote"):
        symheap.put(x, x, other)
    with pytest.raises(symheap.UnsupportedError, match="remote"):
        symheap.peer_tensor(x, other)
    with pytest.raises(ValueError, match="no device in this process"):
        symheap.device_of(other)
    symheap.barrier_all()  # falls back to the bootstrap: no load/store path
    symheap.free(x)
    return kinds


def test_remote_peers_raise_clear_errors():
    results = run_processes(_remote_peer, 2, env_per_proc=[{"SYMHEAP_NODE_ID": "node-a"},
                                                           {"SYMHEAP_NODE_ID": "node-b"}])
    assert results == [["self", "remote"], ["remote", "self"]]
