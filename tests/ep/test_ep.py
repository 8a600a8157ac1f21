"""Expert-parallel dispatch/combine on the cpu backend, in every launch model."""
import pytest

torch = pytest.importorskip("torch")

import symheap  # noqa: E402
from symheap.ep import EpConfig, EpDispatchCombine, dequantize_fp8, quantize_fp8  # noqa: E402
from symheap.testing import PeFailure, run_processes, run_threads  # noqa: E402

import test_ep_programs as progs  # noqa: E402


def cfg(n_pes, **kw):
    base = dict(hidden=32, max_tokens_per_rank=6, num_experts=4 * n_pes, topk=3,
                dtype="bfloat16")
    base.update(kw)
    return base


DTYPES = [dict(dtype="bfloat16"), dict(dtype="float16", scale_dim=16, scale_dtype="bfloat16"),
          dict(dtype="float32"), dict(dtype="float8_e4m3fn", scale_dim=8)]


# ------------------------------------------------------------ config checks

def test_config_validation():
    EpConfig(hidden=32, max_tokens_per_rank=4, num_experts=8, topk=2)
    with pytest.raises(ValueError, match="kernel"):
        EpConfig(hidden=32, max_tokens_per_rank=4, num_experts=8, topk=2, kernel="fast")
    with pytest.raises(ValueError, match="topk"):
        EpConfig(hidden=32, max_tokens_per_rank=4, num_experts=2, topk=3)
    with pytest.raises(ValueError, match="dtype"):
        EpConfig(hidden=32, max_tokens_per_rank=4, num_experts=8, topk=2, dtype="int8")
    with pytest.raises(ValueError, match="scale_dim"):
        EpConfig(hidden=32, max_tokens_per_rank=4, num_experts=8, topk=2, scale_dim=5)
    with pytest.raises(ValueError, match="positive"):
        EpConfig(hidden=32, max_tokens_per_rank=0, num_experts=8, topk=2)
    c = EpConfig(hidden=32, max_tokens_per_rank=4, num_experts=8, topk=2, dtype=torch.float8_e4m3fn)
    assert c.dtype == "float8_e4m3fn" and c.combine_dtype == "bfloat16"


def _make(kw):
    try:
        EpDispatchCombine(EpConfig(**kw)).close()
    except ValueError as e:
        return str(e)
    return None


def test_config_checked_against_world():
    errors = run_threads(_make, 2, args=(dict(hidden=32, max_tokens_per_rank=4, num_experts=5,
                                              topk=2),))
    assert all("multiple of the number of PEs" in e for e in errors)
    errors = run_threads(_make, 2, args=(dict(hidden=6, max_tokens_per_rank=4, num_experts=4,
                                              topk=2),))
    assert all("16 bytes" in e for e in errors)
    errors = run_threads(_make, 2, args=(dict(hidden=32, max_tokens_per_rank=4, num_experts=4,
                                              topk=2, max_recv_tokens=9),))
    assert all("max_recv_tokens" in e for e in errors)
    errors = run_threads(_make, 2, args=(dict(hidden=32, max_tokens_per_rank=2**26, num_experts=8,
                                              topk=8, layout="expert_major"),))
    assert all("too large" in e and "tokens per rank" in e for e in errors)
    slots = dict(hidden=32, max_tokens_per_rank=4, num_experts=4, topk=2, layout="token_slots")
    errors = run_threads(_make, 2, args=(dict(slots, kernel="copy_engine"),))
    assert all("layout='token_slots' runs on the SM kernels" in e for e in errors)
    errors = run_threads(_make, 2, args=(dict(slots, max_recv_tokens=4),))
    assert all("bounds the packed token_major layout only" in e for e in errors)


def test_fp8_helpers_round_trip():
    x = torch.randn(5, 64)
    q, s = quantize_fp8(x, 16)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (5, 4)
    torch.testing.assert_close(dequantize_fp8(q, s), x, rtol=0.07, atol=1e-6)


# ------------------------------------------------------------ threads

def test_threads_two_pes_all_dtypes_token_major():
    digests = run_threads(progs.many_configs, 2, args=([cfg(2, **d) for d in DTYPES],))
    assert len(digests) == 2


def test_threads_two_pes_all_dtypes_expert_major():
    configs = [cfg(2, layout="expert_major", **d) for d in DTYPES]
    run_threads(progs.many_configs, 2, args=(configs,))


def test_threads_two_pes_all_dtypes_token_slots():
    configs = [cfg(2, layout="token_slots", kernel="low_latency", **d) for d in DTYPES]
    run_threads(progs.many_configs, 2, args=(configs,))


@pytest.mark.parametrize("layout", ["token_major", "token_slots", "expert_major"])
def test_threads_four_pes(layout):
    run_threads(progs.many_configs, 4, args=([cfg(4, layout=layout)],))


def test_redispatch_every_layout():
    """Rows back to where dispatch placed each token, before and after combines."""
    plan = progs.DEFAULT_PLAN[:4]
    layouts = [dict(layout="token_major"), dict(layout="token_slots"),
               dict(layout="expert_major", dtype="float32"), dict(kernel="copy_engine")]
    run_threads(progs.redispatch_configs, 2, args=([cfg(2, **kw) for kw in layouts], plan))
    run_threads(progs.redispatch_configs, 4, args=([cfg(4, **kw) for kw in layouts[:3]], plan))


@pytest.mark.parametrize("layout", ["token_major", "token_slots", "expert_major"])
def test_redispatch_misuse_aborts_on_every_pe(layout):
    assert run_threads(progs.tampered_redispatch, 2, args=(layout,)) == [
        ["ValueError"] * 3 + ["ok"] * 2, ["SymheapError"] * 3 + ["ok"] * 2]


@pytest.mark.parametrize("kernel", ["intranode", "low_latency", "copy_engine"])
def test_kernels_and_padded_outputs(kernel):
    """Every kernel name runs on cpu; low_latency and intranode with
    max_recv_tokens keep capacity-sized outputs."""
    configs = [cfg(2, kernel=kernel), cfg(2, kernel=kernel, layout="expert_major",
                                          dtype="float32", topk=2)]
    if kernel == "intranode":
        configs.append(cfg(2, kernel=kernel, max_recv_tokens=12))
    run_threads(progs.many_configs, 2, args=(configs,))


def test_tight_capacities_fit():
    """max_recv_tokens / expert_capacity exactly large enough for all_to_one."""
    plan = [("all_to_one", "full"), ("random", "full"), ("all_to_one", "full")]
    configs = [cfg(2, max_recv_tokens=12),
               cfg(2, layout="expert_major", num_experts=4, topk=2, expert_capacity=12)]
    run_threads(progs.many_configs, 2, args=(configs, plan))


def test_expert_major_weight_override():
    def body():
        return progs.run_iterations(EpConfig(**cfg(2, layout="expert_major")),
                                    combine_weight_override=True)
    run_threads(body, 2)


def test_many_iterations_no_leak():
    plan = [(p, t) for _ in range(5) for p, t in progs.DEFAULT_PLAN]
    run_threads(progs.many_configs, 2, args=([cfg(2, hidden=16, dtype="float32")], plan))


def test_interleaved_ops_and_old_handles():
    assert run_threads(progs.interleaved_ops, 2) == [True, True]


def test_close_frees_heap():
    for before, after in run_threads(progs.heap_after_ops, 2, args=(cfg(2),)):
        assert before == after


# ------------------------------------------------------------ processes and mixes

def test_processes_and_threads_agree():
    configs = [cfg(2), cfg(2, layout="expert_major", dtype="float8_e4m3fn", scale_dim=8),
               cfg(2, layout="token_slots")]
    by_threads = run_threads(progs.many_configs, 2, args=(configs,))
    by_processes = run_processes(progs.many_configs, 2, args=(configs,))
    assert by_threads == by_processes


def test_processes_four_pes():
    configs = [cfg(4), cfg(4, layout="expert_major", dtype="float16")]
    run_processes(progs.many_configs, 4, args=(configs,))


def test_two_processes_by_two_threads():
    configs = [cfg(4, dtype="float32"), cfg(4, layout="expert_major", kernel="low_latency")]
    mixed = run_processes(progs.many_configs, 2, args=(configs,), threads_per_proc=2)
    threads = run_threads(progs.many_configs, 4, args=(configs,))
    assert mixed == threads


# ------------------------------------------------------------ errors

@pytest.mark.parametrize("fault,match", [
    ("too_many_tokens", "max_tokens_per_rank=6"),
    ("expert_too_large", "expert id 8"),
    ("expert_negative", "expert id -2"),
    ("wrong_dtype", "x must have dtype bfloat16"),
    ("wrong_shape", "topk_weights must have shape"),
    ("int_weights", "topk_weights must have dtype float32"),
])
@pytest.mark.parametrize("layout", ["token_major", "expert_major"])
def test_bad_input_raises_everywhere(fault, match, layout):
    culprit = 1
    results = run_threads(progs.bad_input_then_recover, 2,
                          args=(cfg(2, num_experts=8, layout=layout), culprit, fault))
    for rank, ((kind, msg), recovered) in enumerate(results):
        assert recovered
        if rank == culprit:
            assert kind == "ValueError", msg
            assert match in msg, msg
        else:
            assert kind == "SymheapError", msg
            assert f"PE {culprit}" in msg, msg


def test_bad_input_in_processes():
    results = run_processes(progs.bad_input_then_recover, 2,
                            args=(cfg(2), 0, "expert_too_large"))
    assert results[0][0][0] == "ValueError" and results[1][0][0] == "SymheapError"


@pytest.mark.parametrize("kw", [dict(max_recv_tokens=7),
                                dict(layout="expert_major", num_experts=4, topk=2,
                                     expert_capacity=7)])
def test_receive_overflow_raises_everywhere(kw):
    for msg in run_threads(progs.overflow, 2, args=(cfg(2, **kw),)):
        assert "would receive 12 rows" in msg, msg


def test_combine_misuse():
    for errors in run_threads(progs.combine_misuse, 2):
        assert "layout='expert_major' only" in errors[0]
        assert "expert_out must have shape" in errors[1]
        assert "another EpDispatchCombine" in errors[2]


@pytest.mark.parametrize("layout", ["token_major", "expert_major"])
def test_call_from_a_thread_that_is_not_the_pes(layout):
    results = run_threads(progs.from_other_thread, 2, args=(cfg(2, layout=layout),),
                          devices=[0, 1])
    assert results[0] == []
    assert results[1] == [(0, 0), (7, 7)]  # the helper's current device is kept


def _argument_errors():
    """Exact messages and types of bad calls on one PE (no peer involved)."""
    c = EpConfig(hidden=16, max_tokens_per_rank=4, num_experts=2, topk=2, dtype="float32")
    c2 = EpConfig(hidden=16, max_tokens_per_rank=4, num_experts=2, topk=2, dtype="float32",
                  layout="expert_major")
    x, idx, w = torch.randn(3, 16), torch.tensor([[0, 1]] * 3), torch.rand(3, 2)
    got = []

    def call(fn):
        try:
            fn()
        except Exception as e:
            got.append((type(e).__name__, str(e)))
        else:
            got.append(None)

    with EpDispatchCombine(c) as ep, EpDispatchCombine(c2) as em:
        call(lambda: ep.dispatch(x.numpy(), idx, w))
        call(lambda: ep.dispatch(x[:, :8], idx, w))
        call(lambda: ep.dispatch(x.half(), idx, w))
        call(lambda: ep.dispatch(x, idx.float(), w))
        call(lambda: ep.dispatch(x, idx, w[:2]))
        call(lambda: ep.dispatch(x, idx, w, torch.ones(3, 1)))
        call(lambda: ep.dispatch(x, idx, None))
        d = ep.dispatch(x, idx, w)
        y = torch.zeros(d.handle.rows_shape)
        call(lambda: ep.combine(y, "handle"))
        call(lambda: ep.combine(y.double(), d.handle))
        call(lambda: ep.combine(y, d.handle, out=torch.empty(2, 16)))
        call(lambda: ep.combine(y, d.handle, topk_weights=w))
        d.handle.num_tokens = 9
        call(lambda: ep.combine(y, d.handle))
        d.handle.num_tokens = 3
        d.handle.summary = d.handle.summary[:-1]
        call(lambda: ep.combine(y, d.handle))
        call(lambda: em.combine(y, d.handle))
        e = em.dispatch(x, idx, w)
        ye = torch.zeros(e.handle.rows_shape)
        call(lambda: em.combine(ye, e.handle, topk_weights=w[:, :1]))
        e.handle.weights = None
        call(lambda: em.combine(ye, e.handle))
        ok = em.combine(ye, e.handle, topk_weights=w)  # still usable; explicit weights
        got.append(tuple(ok.shape))
    return got


def test_argument_errors_keep_their_types_and_messages():
    pre = " (dispatch aborted on every PE)"
    cpre = " (combine aborted on every PE)"
    assert run_threads(_argument_errors, 1)[0] == [
        ("TypeError", "x must be a torch.Tensor, got ndarray" + pre),
        ("ValueError", "x must have shape [num_tokens, 16], got (3, 8)" + pre),
        ("ValueError", "x must have dtype float32, got float16" + pre),
        ("ValueError", "topk_idx must have dtype int64 or int32, got float32" + pre),
        ("ValueError", "topk_weights must have shape (3, 2), got (2, 2)" + pre),
        ("ValueError", "scales given, but the config has scale_dim=0" + pre),
        ("TypeError", "topk_weights must be a torch.Tensor, got NoneType" + pre),
        ("TypeError", "handle must be the EpHandle of a dispatch, got str" + cpre),
        ("ValueError", "expert_out must have dtype float32, got float64" + cpre),
        ("ValueError", "out must be a contiguous float32 tensor of shape (3, 16) on cpu" + cpre),
        ("ValueError", "token_major combine sums rows the expert side already weighted: "
                       "topk_weights applies to layout='expert_major' only" + cpre),
        ("ValueError", "handle was modified: its layout or num_tokens no longer match this op"
         + cpre),
        ("ValueError", "handle.summary must have shape (10,), got (9,)" + cpre),
        ("ValueError", "handle comes from another EpDispatchCombine, or from this op on another "
                       "PE" + cpre),
        ("ValueError", "topk_weights must have shape (3, 2), got (3, 1)" + cpre),
        ("TypeError", "handle.weights must be a torch.Tensor, got NoneType" + cpre),
        (3, 16)]


def test_absent_peer_times_out_naming_it():
    results = run_threads(progs.absent_peer, 2, args=(1,), init_kwargs={"timeout": 1.0})
    assert results[1] is None
    assert "timed out" in results[0] and "from PE(s) 1" in results[0]


def _closed_use():
    c = EpConfig(**cfg(2))
    ep = EpDispatchCombine(c)
    ep.close()
    ep.close()  # idempotent
    try:
        ep.dispatch(*progs.make_inputs(c, 2, symheap.my_pe(), 1, "random", "full"))
    except symheap.SymheapError as e:
        return str(e)


def test_use_after_close():
    assert all("closed" in m for m in run_threads(_closed_use, 2))


def test_rejects_wrong_config_type():
    def body():
        with pytest.raises(TypeError):
            EpDispatchCombine(dict(hidden=32))
    run_threads(body, 1)


def test_mismatched_configs_across_pes():
    def body():
        me = symheap.my_pe()
        try:
            EpDispatchCombine(EpConfig(**cfg(2, hidden=32 if me == 0 else 64)))
        except ValueError as e:
            return str(e)
    for msg in run_threads(body, 2):
        assert "different arguments" in msg


def test_failure_surfaces_as_pe_failure():
    """An assertion inside a PE program is reported (the harness can fail)."""
    def body():
        c = EpConfig(**cfg(2))
        with EpDispatchCombine(c) as ep:
            inputs = [progs.make_inputs(c, 2, r, 1, "random", "full") for r in range(2)]
            out = ep.dispatch(*inputs[symheap.my_pe()])
            inputs[0][0][0, 5] += 1  # a wrong reference must be caught
            progs.check_dispatch(c, ep, out, inputs, symheap.my_pe(), 2)
    with pytest.raises(PeFailure, match="differs"):
        run_threads(body, 2)


@pytest.mark.parametrize("layout", ["token_major", "expert_major"])
def test_tampered_handle_raises_instead_of_writing_out_of_bounds(layout):
    results = run_threads(progs.tampered_handle, 2, args=(layout,))
    assert results[0] == ["ValueError", "ValueError", "ok", "ok"]
    assert results[1] == ["SymheapError", "SymheapError", "ok", "ok"]


def _views_outlive_their_output(layout):
    """Handle storage is recycled once a dispatch's output and handle are gone; a view
    of it kept by the caller (num_recv_tokens, expert_counts) must keep its values."""
    import torch
    c = EpConfig(**cfg(1, layout=layout, dtype="float32"))
    g = torch.Generator().manual_seed(7)
    kept = []
    with EpDispatchCombine(c) as ep:
        for t in (2, 5, 3, 6, 1, 4, 6, 2):
            x = torch.randn(t, 32, generator=g)
            idx = torch.rand(t, c.num_experts, generator=g).topk(c.topk, dim=1).indices
            w = torch.rand(t, c.topk, generator=g)
            d = ep.dispatch(x, idx, w)
            want_counts = torch.bincount(idx.flatten(), minlength=c.num_experts).to(torch.int32)
            rows = t if layout != "expert_major" else int(want_counts.sum())
            kept.append((d.num_recv_tokens, d.expert_counts, rows, want_counts))
            y = torch.zeros(d.handle.rows_shape)
            ep.combine(y, d.handle)
            del d  # output and handle gone: only the views above hold the storage
        return [(int(n), cnt.tolist(), rows, want.tolist()) for n, cnt, rows, want in kept]


@pytest.mark.parametrize("layout", ["token_major", "expert_major"])
def test_kept_views_of_a_handle_survive_later_dispatches(layout):
    for n, counts, rows, want in run_threads(_views_outlive_their_output, 1, args=(layout,))[0]:
        assert n == rows
        assert counts == want
