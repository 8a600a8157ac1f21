"""Peers on another node (SYMHEAP_NODE_ID): kinds, and the error every
operation on a remote peer raises while no remote transport exists."""
import numpy as np
import pytest

import symheap
from symheap.testing import run_processes

NODES = ["node-a", "node-b"]
PES_PER_NODE = 2  # 2 processes (one per node id) x 2 threads


def _node(pe):
    return NODES[pe // PES_PER_NODE]


def _refused_calls(x, src, sig, word, pe):
    calls = {"get": lambda: symheap.get(np.empty_like(src), x, pe),
             "signal_op": lambda: symheap.signal_op(sig, 1, pe),
             "atomic_fetch_add": lambda: symheap.atomic_fetch_add(word, 1, pe),
             "atomic_compare_swap": lambda: symheap.atomic_compare_swap(word, 0, 1, pe),
             "atomic_swap": lambda: symheap.atomic_swap(word, 1, pe),
             "peer_tensor": lambda: symheap.peer_tensor(x, pe)}
    for via in ("auto", "load_store", "copy_engine"):
        calls[f"put/{via}"] = lambda via=via: symheap.put(x, src, pe, via=via)
        calls[f"put_signal/{via}"] = lambda via=via: symheap.put_signal(x, src, sig, 1, pe,
                                                                        via=via)
    return calls


def _two_nodes():
    me, n = symheap.my_pe(), symheap.n_pes()
    kinds = [symheap.peer_kind(p) for p in range(n)]
    buddy = me ^ 1  # the other PE of this node (the other thread of this process)
    x = symheap.empty((256,), "float32", like="numpy")
    sig = symheap.empty((1,), "uint64", like="numpy")
    word = symheap.empty((1,), "int64", like="numpy")
    x[:] = np.nan
    sig[:] = 0
    word[:] = 0
    src = np.random.default_rng().standard_normal(256).astype(np.float32)
    symheap.barrier_all(timeout=30)

    messages = {}
    for p in range(n):
        if _node(p) == _node(me):
            continue
        for name, call in _refused_calls(x, src, sig, word, p).items():
            with pytest.raises(symheap.UnsupportedError) as err:
                call()
            messages[(p, name)] = str(err.value)
    symheap.barrier_all(timeout=30)  # through the bootstrap: some peers are remote
    untouched = bool(np.isnan(x).all()) and int(sig[0]) == 0 and int(word[0]) == 0
    symheap.barrier_all(timeout=30)

    # Peers of the same node still work: data, signal and atomic to the buddy.
    symheap.put_signal(x, src, sig, 1, buddy)
    symheap.signal_wait_until(sig, "eq", 1, timeout=30)
    received = x.copy()
    symheap.atomic_fetch_add(word, me + 1, buddy)
    symheap.barrier_all(timeout=30)
    fetched = np.full_like(src, np.nan)
    symheap.get(fetched, x, buddy)  # the buddy's copy holds what this PE sent
    total = int(word[0])
    symheap.barrier_all(timeout=30)
    for buf in (x, sig, word):
        symheap.free(buf)
    return kinds, messages, untouched, src, received, fetched, total


def test_two_nodes_of_two_pes():
    results = run_processes(_two_nodes, 2, threads_per_proc=2, init_kwargs={"timeout": 60.0},
                            env_per_proc=[{"SYMHEAP_NODE_ID": node} for node in NODES],
                            timeout=240)
    n = len(results)
    assert n == 4
    for me, (kinds, messages, untouched, src, received, fetched, total) in enumerate(results):
        buddy = me ^ 1
        expected = ["self" if p == me else "same_process" if _node(p) == _node(me) else "remote"
                    for p in range(n)]
        assert kinds == expected
        remote = [p for p in range(n) if _node(p) != _node(me)]
        assert sorted({p for p, _ in messages}) == remote
        assert len(messages) == len(remote) * 12
        for (p, name), text in messages.items():
            assert f"PE {p} is remote (node '{_node(p)}'; PE {me} is on node '{_node(me)}')" \
                in text, (name, text)
            assert "remote transport" in text and "not implemented" in text, (name, text)
        assert untouched  # no refused call wrote anything
        np.testing.assert_array_equal(received, results[buddy][3])
        np.testing.assert_array_equal(fetched, src)
        assert total == buddy + 1
