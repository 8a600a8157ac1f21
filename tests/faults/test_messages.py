"""Every bad argument gets a ValueError/TypeError naming it and its range,
and a failed call leaves nothing behind."""
import numpy as np
import pytest

import symheap
from symheap.testing import run_threads

HUGE = [1 << 31, 1 << 40, 1 << 63, 1 << 64, -(1 << 40), -(1 << 64)]


def _bad_pes():
    dst = symheap.empty((8,), "float64", like="numpy")
    word = symheap.empty((1,), "int64", like="numpy")
    src = np.random.rand(8)
    symheap.barrier_all()
    calls = {
        "put": lambda pe: symheap.put(dst, src, pe),
        "get": lambda pe: symheap.get(src, dst, pe),
        "put_signal": lambda pe: symheap.put_signal(dst, src, word, 1, pe),
        "signal_op": lambda pe: symheap.signal_op(word, 1, pe),
        "atomic_fetch_add": lambda pe: symheap.atomic_fetch_add(word, 1, pe),
        "atomic_swap": lambda pe: symheap.atomic_swap(word, 1, pe),
        "peer_kind": lambda pe: symheap.peer_kind(pe),
    }
    for name, call in calls.items():
        for pe in HUGE:
            with pytest.raises(ValueError, match=r"pe[ =]-?\d+ (out of range \[0, 2\)|is outside)"):
                call(pe)
        for pe in (True, False, 1.0, "1"):
            with pytest.raises(TypeError, match="pe must be an int"):
                call(pe)
    symheap.barrier_all()
    return True


def test_pe_arguments_out_of_range_or_of_the_wrong_type():
    assert run_threads(_bad_pes, 2, init_kwargs={"heap_size": "1M"}) == [True, True]


def _bad_sizes():
    dst = symheap.empty((8,), "float64", like="numpy")
    word = symheap.empty((1,), "uint64", like="numpy")
    for n in (1 << 64, 1 << 63, -1):
        with pytest.raises(ValueError, match="nbytes"):
            symheap.put(dst, np.zeros(8), 0, nbytes=n)
        with pytest.raises(ValueError, match=r"nbytes=-?\d+ is outside the allowed range"):
            symheap.malloc(n)
    for value in (1 << 64, -1):
        with pytest.raises(ValueError, match=r"value=-?\d+ is outside the allowed range "
                                             r"\[0, 18446744073709551615\]"):
            symheap.signal_op(word, value, 0)
    with pytest.raises(ValueError, match=r"value=\d+ is outside .*9223372036854775807"):
        symheap.atomic_fetch_add(word.view(np.int64), 1 << 63, 0)
    usage = symheap.heap_usage()
    for shape in [(1 << 62, 4), (1 << 40, 1 << 40), (1 << 64,)]:
        with pytest.raises(ValueError, match="shape"):
            symheap.empty(shape, "float32", like="numpy")
    assert symheap.heap_usage() == usage  # nothing allocated by the failed calls
    return True


def test_sizes_and_values_beyond_the_core_types():
    assert run_threads(_bad_sizes, 1, init_kwargs={"heap_size": "1M"}) == [True]


def test_init_arguments_beyond_the_core_types():
    uid = symheap.get_unique_id()
    with pytest.raises(ValueError, match=r"rank=\d+ is outside the allowed range"):
        symheap.init(1 << 40, 2, uid)
    with pytest.raises(ValueError, match=r"world_size=\d+ is outside"):
        symheap.init(0, 1 << 31, uid)
    with pytest.raises(ValueError, match=r"heap_size=\d+ is outside"):
        symheap.init(0, 1, uid, heap_size=1 << 64)
    with pytest.raises(ValueError, match=r"device=\d+ is outside"):
        symheap.set_device(1 << 33)
    with pytest.raises(TypeError, match="rank must be an int, got bool"):
        symheap.init(True, 2, uid)
    assert not symheap.is_initialized()


def test_ep_config_fields_beyond_int32():
    from symheap.ep import EpConfig
    for name in ("hidden", "max_tokens_per_rank", "num_experts"):
        kw = dict(hidden=16, max_tokens_per_rank=4, num_experts=4, topk=2, dtype="float32")
        kw[name] = 1 << 40
        with pytest.raises(ValueError, match=rf"EpConfig.{name} .*\[1, 2147483647\]"):
            EpConfig(**kw)


def test_max_seqlen_beyond_int32():
    torch = pytest.importorskip("torch")
    from symheap.attention import flash_attn_varlen_func
    q = torch.randn(4, 2, 8)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"max_seqlen_q and max_seqlen_k must be in \[0, "):
        flash_attn_varlen_func(q, q, q, cu, cu, 1 << 40, 4)


def _failed_empty_frees_its_block(monkeypatch):
    before = symheap.heap_usage()

    def broken_view(*args, **kw):
        raise RuntimeError("view failed")

    monkeypatch.setattr(symheap._memory, "_numpy_view", broken_view)
    with pytest.raises(RuntimeError, match="view failed"):
        symheap.empty((16,), "float32", like="numpy")
    monkeypatch.undo()
    assert symheap.heap_usage() == before
    return True


def test_failed_empty_does_not_leak_its_block(monkeypatch):
    assert run_threads(_failed_empty_frees_its_block, 1, args=(monkeypatch,),
                       init_kwargs={"heap_size": "1M"}) == [True]


def _typed_misuse():
    me, n = symheap.my_pe(), symheap.n_pes()
    floats = symheap.empty((4,), "float64", like="numpy")
    f32 = symheap.empty((8,), "float32", like="numpy")
    words = symheap.empty((4,), "int64", like="numpy")
    floats[:] = 1.5
    words[:] = 7
    symheap.barrier_all()
    for call in (lambda: symheap.atomic_fetch_add(floats, 1, 0),
                 lambda: symheap.atomic_compare_swap(floats, 0, 1, 0),
                 lambda: symheap.atomic_swap(floats, 1, 0),
                 lambda: symheap.signal_op(floats, 1, 0),
                 lambda: symheap.signal_wait_until(floats, "eq", 1, timeout=1)):
        with pytest.raises(TypeError, match=r"64-bit integer words .*float64"):
            call()
    src = np.random.rand(4)  # float64, 32 bytes: same size as f32, another dtype
    with pytest.raises(TypeError, match="dst has dtype float32 but src has dtype float64"):
        symheap.put(f32, src, (me + 1) % n)
    with pytest.raises(TypeError, match="dst has dtype float64 but src has dtype float32"):
        symheap.get(np.zeros(4), f32, (me + 1) % n)
    symheap.barrier_all()
    intact = bool(np.all(floats == 1.5) and np.all(words == 7))  # nothing was written
    symheap.barrier_all()
    assert intact
    # The same dtypes and raw bytes still move.
    symheap.put(floats, src, (me + 1) % n)
    symheap.put(f32.view(np.uint8), np.arange(32, dtype=np.uint8), (me + 1) % n)
    symheap.barrier_all()
    return floats.copy(), f32.view(np.uint8).copy(), src


def test_atomics_on_float_words_and_mixed_dtype_puts_raise():
    res = run_threads(_typed_misuse, 2, init_kwargs={"heap_size": "1M"})
    for me in range(2):
        floats, raw, _ = res[me]
        np.testing.assert_array_equal(floats, res[1 - me][2])
        np.testing.assert_array_equal(raw, np.arange(32, dtype=np.uint8))
