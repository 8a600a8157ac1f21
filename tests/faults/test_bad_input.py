"""Bad input and faults: a clear Python exception, never an abort, a hang or a stray write."""
import threading

import numpy as np
import pytest

import symheap
from symheap.testing import PeFailure, run_threads


def test_calls_before_init():
    symheap.set_device(7)
    assert not symheap.is_initialized()
    for call in (symheap.my_pe, symheap.n_pes, symheap.barrier_all, symheap.quiet,
                 lambda: symheap.malloc(16), lambda: symheap.empty(4, like="numpy"),
                 lambda: symheap.put(bytearray(8), b"12345678", 0),
                 lambda: symheap.peer_kind(0), symheap.finalize):
        with pytest.raises(symheap.SymheapError, match="not initialised"):
            call()


def test_malformed_unique_id():
    with pytest.raises(ValueError, match="malformed unique_id"):
        symheap.init(0, 1, b"not an id")
    with pytest.raises(ValueError, match="malformed unique_id"):
        symheap.init(0, 1, symheap.get_unique_id()[:-1])
    with pytest.raises(TypeError, match="unique_id"):
        symheap.init(0, 1, "a string")
    assert not symheap.is_initialized()


def test_rank_out_of_range_and_bad_sizes():
    uid = symheap.get_unique_id()
    with pytest.raises(ValueError, match="outside"):
        symheap.init(2, 2, uid)
    with pytest.raises(ValueError, match="outside"):
        symheap.init(-1, 2, uid)
    with pytest.raises(ValueError, match="world_size"):
        symheap.init(0, 0, uid)
    with pytest.raises(ValueError, match="cannot parse heap size"):
        symheap.init(0, 1, uid, heap_size="lots")
    with pytest.raises(ValueError, match="unknown unit"):
        symheap.init(0, 1, uid, heap_size="12 parsecs")
    with pytest.raises(ValueError, match="device"):
        symheap.init(0, 1, uid, device=10_000)
    assert not symheap.is_initialized()


def test_unparsable_heap_size_env(monkeypatch):
    monkeypatch.setenv("SYMHEAP_HEAP_SIZE", "1.5 apples")
    with pytest.raises(ValueError, match="SYMHEAP_HEAP_SIZE|heap size"):
        symheap.init(0, 1, symheap.get_unique_id())


def _errors_of(fn, n, **kw):
    with pytest.raises(PeFailure) as info:
        run_threads(fn, n, **kw)
    return info.value.errors


def test_world_size_mismatch_reaches_every_pe():
    uid = symheap.get_unique_id()
    errors = {}

    def pe(rank, world):
        try:
            symheap.init(rank, world, uid, device=rank, timeout=20)
            symheap.finalize()
        except Exception as e:  # collected for the assertions below
            errors[rank] = e

    ts = [threading.Thread(target=pe, args=(0, 2)), threading.Thread(target=pe, args=(1, 3))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert set(errors) == {0, 1}
    for e in errors.values():
        assert isinstance(e, ValueError) and "world_size mismatch" in str(e)


def test_init_twice_on_one_device_slot():
    def twice():
        symheap.init(symheap.my_pe(), symheap.n_pes(), symheap.get_unique_id())

    errors = _errors_of(twice, 1)
    assert errors[0][0] == "SymheapError" and "init was called twice" in errors[0][1]


def test_two_pes_on_one_device():
    uid = symheap.get_unique_id()
    errors = {}

    def pe(rank):
        try:
            symheap.init(rank, 2, uid, device=3, timeout=3)
            symheap.finalize()
        except Exception as e:  # collected for the assertions below
            errors[rank] = e

    ts = [threading.Thread(target=pe, args=(r,)) for r in range(2)]
    for t in ts:
        t.start()
        t.join(0.5)
    for t in ts:
        t.join(30)
    assert len(errors) == 2
    kinds = sorted(type(e).__name__ for e in errors.values())
    assert kinds == ["SymheapError", "TimeoutError"], errors
    assert any("already hosts PE" in str(e) for e in errors.values())


def test_missing_pe_at_init_is_named():
    uid = symheap.get_unique_id()
    with pytest.raises(TimeoutError, match=r"PE\(s\) \[1, 2\]"):
        symheap.init(0, 3, uid, device=0, timeout=1.5)
    assert not symheap.is_initialized()
    # The slot is free again: a fresh job on the same device works.
    run_threads(lambda: symheap.barrier_all(), 1)


def test_missing_root_is_named():
    uid = symheap.get_unique_id()
    with pytest.raises(TimeoutError, match="bootstrap root \\(PE 0\\)"):
        symheap.init(1, 2, uid, device=1, timeout=1.0)


def _skip_barrier():
    if symheap.my_pe() == 0:
        with pytest.raises(TimeoutError, match=r"PE\(s\) 1 never reached the barrier"):
            symheap.barrier_all(timeout=1.0)
    return "ok"


def test_missing_pe_at_barrier_is_named():
    assert run_threads(_skip_barrier, 2) == ["ok", "ok"]


def _heap_exhausted():
    with pytest.raises(MemoryError, match=r"heap size 1 MiB.*SYMHEAP_HEAP_SIZE"):
        symheap.malloc(2 << 20)
    buf = symheap.malloc(1024)  # still usable afterwards
    buf.free()
    return True


def test_heap_exhausted():
    assert run_threads(_heap_exhausted, 2, init_kwargs={"heap_size": "1M"}) == [True, True]


def _mismatched_malloc():
    me = symheap.my_pe()
    with pytest.raises(ValueError, match="different arguments"):
        symheap.malloc(100 + me)
    buf = symheap.malloc(64)  # every PE saw the error; the heap is still in step
    off = buf.offset
    buf.free()
    return off


def test_collective_malloc_size_mismatch():
    offs = run_threads(_mismatched_malloc, 3)
    assert offs[0] == offs[1] == offs[2]


def _bad_frees(shared):
    me = symheap.my_pe()
    buf = symheap.malloc(32)
    shared[me] = buf
    symheap.barrier_all()
    with pytest.raises(ValueError, match="another PE"):
        symheap.free(shared[1 - me])
    with pytest.raises(ValueError, match="not the start of a live symmetric allocation"):
        symheap.free(np.zeros(4))
    symheap.barrier_all()
    buf.free()
    with pytest.raises(ValueError, match="already freed"):
        buf.free()
    with pytest.raises(ValueError, match="freed"):
        buf.ptr
    return True


def test_free_foreign_and_double():
    assert run_threads(_bad_frees, 2, args=({},)) == [True, True]


def _bad_rma():
    me, n = symheap.my_pe(), symheap.n_pes()
    dst = symheap.empty((8,), "float64", like="numpy")
    word = symheap.empty((1,), "int64", like="numpy")
    guard = symheap.empty((8,), "float64", like="numpy")
    guard[:] = 42.0
    symheap.barrier_all()
    src = np.ones(8)
    with pytest.raises(ValueError, match="pe 5 out of range"):
        symheap.put(dst, src, 5)
    with pytest.raises(ValueError, match="pe -1 out of range"):
        symheap.get(src, dst, -1)
    with pytest.raises(ValueError, match="not on this PE's symmetric heap"):
        symheap.put(np.zeros(8), src, 0)
    with pytest.raises(ValueError, match="fewer than"):
        symheap.put(dst, np.ones(9), (me + 1) % n)
    with pytest.raises(ValueError, match="exceeds"):
        symheap.put(dst, src, 0, nbytes=65)
    with pytest.raises(ValueError, match="fewer than"):
        symheap.get(np.zeros(16), dst, 0)
    with pytest.raises(ValueError, match="int64 word"):
        symheap.atomic_fetch_add(word.view(np.uint8)[:4], 1, 0)
    with pytest.raises(ValueError, match="cmp must be"):
        symheap.signal_wait_until(word, "almost", 1)
    with pytest.raises(ValueError, match="signal op"):
        symheap.signal_op(word, 1, 0, op="multiply")
    with pytest.raises(TimeoutError, match="still not == 99"):
        symheap.signal_wait_until(word.view(np.uint64), "eq", 99, timeout=0.2)
    symheap.barrier_all()
    stale = dst
    symheap.free(dst)
    # A freed allocation is no longer a valid target, even through an old array.
    with pytest.raises(ValueError, match="outside the symmetric allocation"):
        symheap.put(stale, src, (me + 1) % n)
    symheap.barrier_all()
    assert np.all(guard == 42.0)  # nothing was written next to the buffers
    return True


def test_rma_bad_arguments():
    assert run_threads(_bad_rma, 2) == [True, True]
