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
