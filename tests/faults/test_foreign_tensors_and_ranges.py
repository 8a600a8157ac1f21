"""Tensors on devices that hold no data (meta), integers past the core's ranges,
outputs whose storage a caller still holds, and arguments only one PE got
wrong: each a clear exception (on every PE together where the call is
collective), never a crash, a stray write or a silently different call."""
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

import symheap
from symheap.attention import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
from symheap.ep import EpConfig, EpDispatchCombine
import symheap.ep as ep
from symheap.testing import run_threads


def run_isolated(code: str) -> str:
    """Runs `code` in a fresh interpreter (a crash there fails this test, not the run)."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, f"rc {done.returncode}\n{done.stdout}\n{done.stderr[-3000:]}"
    return done.stdout


def test_meta_tensors_are_refused_and_nothing_is_written():
    out = run_isolated("""
        import pytest, torch
        from symheap.attention import flash_attn_with_kvcache as kv
        # One 8-row block of k_cache inside a larger poisoned buffer: a block
        # table the call could not read would send the appended rows past it.
        big = torch.full((4 * 8 * 2 * 16,), 7.0)
        k_cache = big[:8 * 2 * 16].view(1, 8, 2, 16)
        v_cache = torch.zeros(1, 8, 2, 16)
        q, new = torch.randn(2, 1, 4, 16), torch.ones(2, 1, 2, 16)
        lens = torch.tensor([20, 20], dtype=torch.int32)
        meta_table = torch.zeros(2, 4, dtype=torch.int32, device="meta")
        with pytest.raises(ValueError, match="block_table is on meta"):
            kv(q, k_cache, v_cache, new, new, cache_seqlens=lens, block_table=meta_table)
        assert bool((big[8 * 2 * 16:] == 7.0).all()) and bool((k_cache == 7.0).all())
        dense = torch.zeros(2, 32, 2, 16)
        with pytest.raises(ValueError, match="meta"):
            kv(q.to("meta"), dense, dense, cache_seqlens=lens)
        with pytest.raises(ValueError, match="k is on meta"):
            kv(q, dense, dense, new.to("meta"), new, cache_seqlens=lens)
        with pytest.raises(ValueError, match="alibi_slopes is on meta"):
            kv(q, dense, dense, cache_seqlens=lens, alibi_slopes=torch.zeros(4, device="meta"))
        print("ok")
    """)
    assert out.strip().endswith("ok")


def test_meta_tensors_are_refused_by_ep_and_rma():
    out = run_isolated("""
        import pytest, torch, symheap
        from symheap.ep import EpConfig, EpDispatchCombine
        symheap.init(0, 1, symheap.get_unique_id(), device=0)
        op = EpDispatchCombine(EpConfig(hidden=64, max_tokens_per_rank=8, num_experts=4, topk=2,
                                        dtype="float32"))
        idx, w = torch.randint(0, 4, (8, 2)), torch.rand(8, 2)
        with pytest.raises(ValueError, match="x is on meta"):
            op.dispatch(torch.empty(8, 64, device="meta"), idx, w)
        with pytest.raises(ValueError, match="on meta"):
            op.dispatch(torch.randn(8, 64), idx.to("meta"), w)
        d = op.dispatch(torch.randn(8, 64), idx, w)  # the op still works
        y = op.combine(d.x, d.handle)
        assert y.shape == (8, 64)
        buf = symheap.empty((16,), "float32")
        with pytest.raises(ValueError, match="meta"):
            symheap.put(buf, torch.empty(16, device="meta"), 0)
        op.close()
        symheap.finalize()
        print("ok")
    """)
    assert out.strip().endswith("ok")


def test_window_sides_past_32_bits_malformed_windows_and_dropout_near_one_are_refused():
    q = torch.randn(1, 16, 2, 32)
    with pytest.raises(ValueError, match="fit in 32 bits"):
        flash_attn_func(q, q, q, window_size=(2 ** 32 + 3, -1))  # once read as (3, -1)
    with pytest.raises(ValueError, match="fit in 64 bits"):
        flash_attn_func(q, q, q, window_size=(2 ** 70, 0))
    with pytest.raises(ValueError, match="window_size must be a pair"):
        flash_attn_func(q, q, q, window_size=(1, 2, 3))
    with pytest.raises(ValueError, match="must be an int, got float"):
        flash_attn_func(q, q, q, window_size=(1.7, 2))
    with pytest.raises(ValueError, match="rounds to 1 in float32"):
        flash_attn_func(q, q, q, dropout_p=0.99999999)


def test_kvcache_integers_past_their_ranges():
    q, cache = torch.randn(2, 1, 4, 16), torch.randn(2, 32, 2, 16)
    with pytest.raises(ValueError, match="cache_seqlens must fit in an int32"):
        flash_attn_with_kvcache(q, cache, cache, cache_seqlens=2 ** 40)
    with pytest.raises(ValueError, match="num_splits must fit in 32 bits"):
        flash_attn_with_kvcache(q, cache, cache, cache_seqlens=5, num_splits=2 ** 31)
    with pytest.raises(ValueError, match="num_splits must be an int, got float"):
        flash_attn_with_kvcache(q, cache, cache, cache_seqlens=5, num_splits=2.5)
    with pytest.raises(ValueError, match=r"q must be \(B, Sq, Hq, D\)"):
        flash_attn_with_kvcache(torch.tensor(1.0), cache, cache, cache_seqlens=5)
    shared = torch.zeros(1, 32, 2, 16).expand(2, 32, 2, 16)  # both sequences in one memory
    new = torch.ones(2, 1, 2, 16)
    with pytest.raises(ValueError, match="must not share memory; dimension 0 has stride 0"):
        flash_attn_with_kvcache(q, shared, shared, new, new, cache_seqlens=5)
    with pytest.raises(ValueError, match="hold no rows"):
        flash_attn_with_kvcache(q, cache[:, :0], cache[:, :0], cache_seqlens=0)


def test_paged_varlen_max_seqlen_q_near_the_int32_limit():
    """max_seqlen_q only bounds the sequences' query rows: any bound from the
    longest sequence up gives the same result (once, near 2^31, all zeros)."""
    gen = torch.Generator().manual_seed(3)
    i32 = lambda *a: torch.tensor(a, dtype=torch.int32)  # noqa: E731
    cache = torch.randn(4, 8, 2, 16, generator=gen)
    q = torch.randn(10, 4, 16, generator=gen)
    table, cu_q, cu_k = i32([0, 1], [2, 3]), i32(0, 4, 10), i32(0, 5, 10)
    want = flash_attn_varlen_func(q, cache, cache, cu_q, cu_k, 6, 0, block_table=table)
    for bound in (2 ** 31 - 16, 2 ** 31 - 15, 2 ** 31 - 1, 2 ** 40):
        got = flash_attn_varlen_func(q, cache, cache, cu_q, cu_k, bound, 0, block_table=table)
        assert torch.equal(got, want), bound
    with pytest.raises(ValueError, match="max_seqlen_q must fit in 64 bits"):
        flash_attn_varlen_func(q, cache, cache, cu_q, cu_k, 2 ** 70, 0, block_table=table)


@pytest.mark.parametrize("call", ["fixed", "kvcache"])
def test_pooled_outputs_stay_while_their_storage_is_held(call):
    """An output whose caller keeps only its storage object (untyped_storage())
    is not handed out again by the next calls."""
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(1, 8, 2, 16, generator=gen)
    cache = torch.randn(1, 32, 2, 16, generator=gen)

    def run(x):
        if call == "fixed":
            return flash_attn_func(x, q, q)
        return flash_attn_with_kvcache(x, cache, cache, cache_seqlens=20)

    out = run(q)
    storage, keep = out.untyped_storage(), out.clone()
    del out
    for _ in range(3):
        run(torch.randn(q.shape, generator=gen))
    held = torch.empty(0).set_(storage).view(keep.shape)
    assert torch.equal(held, keep)


def _op():
    return EpDispatchCombine(EpConfig(hidden=64, max_tokens_per_rank=8, num_experts=4, topk=2,
                                      dtype="float32"))


def test_ep_config_refuses_bools():
    with pytest.raises(TypeError, match="EpConfig.topk must be an int, got bool"):
        EpConfig(hidden=64, max_tokens_per_rank=8, num_experts=4, topk=True, dtype="float32")


def test_ep_expert_ids_past_32_bits_are_reported_as_such():
    """Ids travel between PEs in 32 bits, clamped: the message says "at least"."""
    def pe():
        op = _op()
        x, w = torch.randn(8, 64), torch.rand(8, 2)
        for ids, said in ((1 << 40, "an expert id >= 2147483647"),
                          (-(1 << 40), "an expert id <= -2147483648"), (9, "expert id 9 ")):
            idx = torch.zeros(8, 2, dtype=torch.int64)
            idx[3, 1] = ids
            with pytest.raises(ValueError, match=said):
                op.dispatch(x, idx, w)
        op.close()

    run_threads(pe, 1)


def test_ep_close_from_another_pe_thread_changes_nothing():
    ops, gate = {}, threading.Barrier(2)

    def pe():
        me = symheap.my_pe()
        ops[me] = _op()
        gate.wait()
        if me == 0:
            with pytest.raises(symheap.SymheapError, match="call it from the thread of PE 1"):
                ops[1].close()
        gate.wait()
        x = torch.randn(8, 64)
        d = ops[me].dispatch(x, torch.randint(0, 4, (8, 2)), torch.rand(8, 2))
        ops[me].combine(d.x, d.handle)  # still open on both PEs
        ops[me].close()
        return symheap.heap_usage()["live_buffers"]

    used = run_threads(pe, 2, init_kwargs=dict(timeout=30))
    assert used == [0, 0]


def test_ep_handle_of_another_pe_thread_is_refused():
    """PE threads of one process hold ops with one id: a handle from the other
    PE's dispatch is refused (it once combined that PE's rows silently)."""
    handles, gate = {}, threading.Barrier(2)

    def pe():
        me = symheap.my_pe()
        op = _op()
        x = torch.randn(8, 64)
        d = op.dispatch(x, torch.randint(0, 4, (8, 2)), torch.rand(8, 2))
        handles[me] = d.handle
        gate.wait()
        with pytest.raises((ValueError, symheap.SymheapError)) as err:
            op.combine(d.x, handles[1] if me == 0 else d.handle)
        if me == 0:
            assert "from this op on another PE" in str(err.value)
        else:
            assert "aborted on every PE" in str(err.value)
        d = op.dispatch(x, torch.randint(0, 4, (8, 2)), torch.rand(8, 2))
        assert op.combine(d.x, d.handle).shape == (8, 64)
        op.close()

    run_threads(pe, 2, init_kwargs=dict(timeout=60))


def test_ep_edited_handle_is_named():
    """A handle whose rows were edited out of range: every PE is told that PE's
    handle names rows outside the op's buffers; the op stays usable."""
    def pe():
        op = _op()
        d = op.dispatch(torch.randn(8, 64), torch.randint(0, 4, (8, 2)), torch.rand(8, 2))
        if symheap.my_pe() == 0:
            d.handle.send_rows.fill_(-7)
        with pytest.raises((ValueError, symheap.SymheapError),
                           match="PE 0 passed a combine handle whose rows lie outside"):
            op.combine(d.x, d.handle)
        d = op.dispatch(torch.randn(8, 64), torch.randint(0, 4, (8, 2)), torch.rand(8, 2))
        assert op.combine(d.x, d.handle).shape == (8, 64)
        op.close()

    run_threads(pe, 2, init_kwargs=dict(timeout=60))


def test_ep_autograd_argument_one_pe_got_wrong_fails_every_pe_at_once():
    """A handle of the wrong type on one PE: that PE raises TypeError and the
    other aborts the same combine at once, not at its timeout; the op stays usable."""
    def pe():
        me = symheap.my_pe()
        op = _op()
        x = torch.randn(8, 64, requires_grad=True)
        d = ep.dispatch(op, x, torch.randint(0, 4, (8, 2)), torch.rand(8, 2))
        t0 = time.monotonic()
        with pytest.raises((TypeError, symheap.SymheapError)) as err:
            ep.combine(op, d.x, d.handle.handle if me == 0 else d.handle)
        waited = time.monotonic() - t0
        if me == 0:
            assert err.type is TypeError and "RoutedHandle" in str(err.value)
        else:
            assert "aborted on every PE" in str(err.value)
        d = ep.dispatch(op, x, torch.randint(0, 4, (8, 2)), torch.rand(8, 2))
        ep.combine(op, d.x, d.handle).sum().backward()
        op.close()
        return waited

    waits = run_threads(pe, 2, init_kwargs=dict(timeout=60))
    assert max(waits) < 20, waits


def test_calls_after_a_failed_collective_say_so():
    """After a collective timed out, a later one (finalize here) says it is
    refused for that earlier failure, and still releases the PE."""
    uid, seen = symheap.get_unique_id(), {}

    def pe(rank):
        symheap.init(rank, 2, uid, device=rank, timeout=3)
        try:
            if rank == 0:
                symheap.malloc(64)  # PE 1 never calls malloc
            else:
                symheap.barrier_all()
        except (TimeoutError, symheap.SymheapError):
            pass
        try:
            symheap.finalize()
            seen[rank] = ("finalized", symheap.is_initialized())
        except Exception as e:  # noqa: BLE001 - the message is the point
            seen[rank] = (str(e), symheap.is_initialized())

    threads = [threading.Thread(target=pe, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert "refused: the job failed earlier (bootstrap 'malloc' timed out" in seen[0][0], seen
    assert not seen[0][1] and not seen[1][1], seen  # both PEs released
