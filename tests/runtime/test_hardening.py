"""Inputs that once crashed, hung or wrote where they should not: each now raises."""
import time

import numpy as np
import pytest

import symheap
from symheap.testing import run_processes, run_threads


class _FakeDeviceArray:
    __cuda_array_interface__ = {"shape": (64,), "typestr": "|u1", "data": (8, False),
                                "version": 3}


def _raw_addresses_refused():
    buf = symheap.malloc(64)
    symheap.barrier_all()
    with pytest.raises(ValueError, match="host memory only"):
        symheap.get(_FakeDeviceArray(), buf, 0)
    with pytest.raises(ValueError, match="host memory only"):
        symheap.put(buf, _FakeDeviceArray(), 0)
    with pytest.raises(TypeError, match="raw address"):
        symheap.SymBuffer(object(), 0, 64, 0, 1)
    buf.free()
    return True


def test_raw_addresses_are_refused_on_cpu():
    assert run_threads(_raw_addresses_refused, 1) == [True]


def _bad_timeouts():
    for bad in (float("nan"), float("inf"), 0, -1):
        with pytest.raises(ValueError, match="timeout"):
            symheap.barrier_all(timeout=bad)
        with pytest.raises(ValueError, match="timeout"):
            symheap.signal_wait_until(symheap.malloc(8), "eq", 1, timeout=bad)
    symheap.barrier_all()
    return True


def test_non_finite_timeouts_raise():
    assert run_threads(_bad_timeouts, 2) == [True, True]


def _misaligned_signal():
    me = symheap.my_pe()
    dst = symheap.empty((4,), "float64", like="numpy")
    raw = symheap.empty((16,), "uint8", like="numpy")
    dst[:] = -1.0
    symheap.barrier_all()
    if me == 0:
        with pytest.raises(ValueError, match="8-byte aligned"):
            symheap.put_signal(dst, np.ones(4), raw[1:9], 1, 1)
    symheap.barrier_all()
    return dst.tolist()


def test_put_signal_validates_the_signal_before_moving_data():
    assert run_threads(_misaligned_signal, 2)[1] == [-1.0] * 4  # nothing landed on PE 1


def _late_barrier():
    if symheap.my_pe() == 1:
        time.sleep(15)  # past init's timeout plus the client's 10 s of slack
    symheap.barrier_all(timeout=40)  # through the bootstrap: the peers are remote
    return symheap.peer_kind(1 - symheap.my_pe())


def test_per_call_timeout_longer_than_init_timeout():
    results = run_processes(_late_barrier, 2, init_kwargs={"timeout": 4.0},
                            env_per_proc=[{"SYMHEAP_NODE_ID": "a"}, {"SYMHEAP_NODE_ID": "b"}])
    assert results == ["remote", "remote"]


def _tampered_ep_handle(layout="token_major"):
    """Edited combine handles on one PE (cpu; cuda and its emulation reuse it)."""
    import torch
    from symheap.ep import EpConfig, EpDispatchCombine
    me, n = symheap.my_pe(), symheap.n_pes()
    cfg = EpConfig(hidden=32, max_tokens_per_rank=4, num_experts=4, topk=2, dtype="float32",
                   layout=layout)
    g = torch.Generator().manual_seed(me)
    dev = torch.device("cuda", symheap.current_device()) if symheap.backend() == "cuda" else "cpu"
    x = torch.randn(4, 32, generator=g).to(dev)
    idx = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(4)]).to(dev, torch.int64)
    w = torch.rand(4, 2, generator=g).to(dev)
    outcome = []
    with EpDispatchCombine(cfg) as ep:
        d = ep.dispatch(x, idx, w)
        if me == 0 and layout == "token_major":  # PE 1's rows go back past the buffer
            d.handle.summary[4 * 1] = 10 ** 8
        elif me == 0:
            d.handle.recv_meta[0, 3] = 10 ** 8
            d.handle.recv_meta[0, 0] = 0
        try:
            ep.combine(d.x.clone(), d.handle)
            ep.check()  # cuda: a kernel found it; raised at the next call or here
        except (ValueError, symheap.SymheapError) as e:
            outcome.append(type(e).__name__)
        d2 = ep.dispatch(x, idx, w)  # the op still works afterwards
        bad = d2.handle
        if me == 0:
            bad.send_rows = bad.send_rows[:1]
        try:
            ep.combine(d2.x.clone(), bad)
            ep.check()
        except (ValueError, symheap.SymheapError) as e:
            outcome.append(type(e).__name__)
        # Then right results again, from calls that reuse the failed calls'
        # buffers and statuses (the kernels alternate between two sets).
        for _ in range(2):
            d3 = ep.dispatch(x, idx, w)
            if layout == "token_major":
                out = ep.combine(d3.x * d3.topk_weights.sum(1, keepdim=True), d3.handle)
            else:
                out = ep.combine(d3.x, d3.handle)
            ep.check()
            ref = x * w.sum(1, keepdim=True)
            outcome.append("ok" if torch.allclose(out, ref, rtol=1e-5, atol=1e-5) else "wrong")
    return outcome


@pytest.mark.parametrize("layout", ["token_major", "expert_major"])
def test_tampered_ep_handle_raises_instead_of_writing_out_of_bounds(layout):
    pytest.importorskip("torch")
    results = run_threads(_tampered_ep_handle, 2, args=(layout,))
    assert results[0] == ["ValueError", "ValueError", "ok", "ok"]
    assert results[1] == ["SymheapError", "SymheapError", "ok", "ok"]
