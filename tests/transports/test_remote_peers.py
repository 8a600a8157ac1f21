"""Peers on another node (SYMHEAP_NODE_ID): kinds, transports, and the error
every operation on a remote peer raises while no remote transport exists.
The program is backend-neutral (torch tensors): tests/gpu runs it on cuda."""
import numpy as np
import pytest

import symheap
from symheap import _core
from symheap.testing import run_processes

torch = pytest.importorskip("torch")

NODES = ["node-a", "node-b"]
PES_PER_NODE = 2  # 2 processes (one per node id) x 2 threads


def _node(pe):
    return NODES[pe // PES_PER_NODE]


def _refused_calls(x, src, sig, word, pe):
    calls = {"get": lambda: symheap.get(torch.empty_like(src), x, pe),
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


def two_nodes():
    """One PE of a 2 nodes x 2 PEs job: refused calls to remote peers, then
    data, a signal and an atomic to the other PE of its node."""
    me, n = symheap.my_pe(), symheap.n_pes()
    kinds = [symheap.peer_kind(p) for p in range(n)]
    transports = [_core.transport_of(p) for p in range(n)]
    buddy = me ^ 1  # the other PE of this node (the other thread of this process)
    x = symheap.empty((256,), "float32")
    sig = symheap.empty((1,), "uint64")
    word = symheap.empty((1,), "int64")
    x.fill_(float("nan"))
    sig.zero_()
    word.zero_()
    src = torch.randn(256, device=x.device)
    symheap.barrier_all(timeout=30)

    messages = {}
    for p in range(n):
        if _node(p) == _node(me):
            continue
        for name, call in _refused_calls(x, src, sig, word, p).items():
            with pytest.raises(symheap.UnsupportedError) as err:
                call()
            messages[(p, name)] = str(err.value)
    from symheap.ep import EpConfig, EpDispatchCombine
    with pytest.raises(symheap.SymheapError) as err:  # every PE reports, none waits
        EpDispatchCombine(EpConfig(hidden=32, max_tokens_per_rank=4, num_experts=8, topk=2))
    messages[(None, "ep")] = str(err.value)
    symheap.barrier_all(timeout=30)  # through the bootstrap: some peers are remote
    untouched = bool(x.isnan().all()) and int(sig[0]) == 0 and int(word[0]) == 0
    symheap.barrier_all(timeout=30)

    # Peers of the same node still work: data, signal and atomic to the buddy.
    symheap.put_signal(x, src, sig, 1, buddy)
    symheap.signal_wait_until(sig, "eq", 1, timeout=30)
    received = x.cpu().numpy().copy()
    symheap.atomic_fetch_add(word, me + 1, buddy)
    symheap.barrier_all(timeout=30)
    fetched = torch.full_like(src, float("nan"))
    symheap.get(fetched, x, buddy)  # the buddy's copy holds what this PE sent
    symheap.quiet()
    total = int(word[0])
    symheap.barrier_all(timeout=30)
    for buf in (x, sig, word):
        symheap.free(buf)
    return (kinds, transports, messages, untouched, src.cpu().numpy(), received,
            fetched.cpu().numpy(), total)


def run_two_nodes(**kwargs):
    return run_processes(two_nodes, 2, threads_per_proc=2, init_kwargs={"timeout": 60.0},
                         env_per_proc=[{"SYMHEAP_NODE_ID": node} for node in NODES],
                         timeout=240, **kwargs)


def check_two_nodes(results):
    n = len(results)
    assert n == 4
    for me, r in enumerate(results):
        kinds, transports, messages, untouched, src, received, fetched, total = r
        buddy = me ^ 1
        expected = ["self" if p == me else "same_process" if _node(p) == _node(me) else "remote"
                    for p in range(n)]
        assert kinds == expected
        assert transports == ["remote" if k == "remote" else "load_store" for k in kinds]
        remote = [p for p in range(n) if _node(p) != _node(me)]
        ep = messages.pop((None, "ep"))
        # the first remote PE each PE meets, as every PE reports it
        for q in range(n):
            first = next(p for p in range(n) if _node(p) != _node(q))
            assert f"PE {q}: UnsupportedError: EpDispatchCombine (it needs every PE): PE " \
                f"{first} is remote (node '{_node(first)}'" in ep, ep
        assert sorted({p for p, _ in messages}) == remote
        assert len(messages) == len(remote) * 12
        for (p, name), text in messages.items():
            assert f"PE {p} is remote (node '{_node(p)}'; PE {me} is on node '{_node(me)}')" \
                in text, (name, text)
            assert "remote transport" in text and "not implemented" in text, (name, text)
        assert untouched  # no refused call wrote anything
        np.testing.assert_array_equal(received, results[buddy][4])
        np.testing.assert_array_equal(fetched, src)
        assert total == buddy + 1


def test_two_nodes_of_two_pes():
    check_two_nodes(run_two_nodes())
