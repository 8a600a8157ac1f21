"""The CUDA kernels of symheap.ep, compiled for the host and run in an
emulation on the cpu backend (SYMHEAP_EP_EMULATE_DEVICE=1, one PE per
process): the same PE programs and references as tests/ep/test_ep.py, so the
kernels' logic (routing, placement, protocol, aborts, timeouts, copy plans)
is checked on machines without a GPU. CUDA-specific behaviour (memory
ordering, graph capture, speed) is tests/gpu's business."""
import pytest

pytest.importorskip("torch")

from symheap.testing import run_processes  # noqa: E402

import test_ep_programs as progs  # noqa: E402

EMULATE = {"SYMHEAP_EP_EMULATE_DEVICE": "1", "SYMHEAP_TIMEOUT": "20"}
KERNELS = ["intranode", "low_latency", "copy_engine"]


def cfg(**kw):
    base = dict(hidden=32, max_tokens_per_rank=6, num_experts=8, topk=3, dtype="bfloat16")
    base.update(kw)
    return base


def emulated(fn, n, args, env=None, **kw):
    return run_processes(fn, n, args=args, env={**EMULATE, **(env or {})}, timeout=240, **kw)


def test_every_kernel_and_layout_matches_the_cpu_implementation():
    configs = [cfg(kernel=k, layout=layout) for k in KERNELS
               for layout in ("token_major", "expert_major")]
    # The shape variants below take the first three patterns of the plan (a
    # random route, every token to one PE, round robin with random drops):
    # the whole plan runs on the six kernel x layout configs above.
    variants = [cfg(dtype="float8_e4m3fn", scale_dim=8, kernel="low_latency",
                    layout="expert_major"),
                cfg(dtype="float32", kernel="copy_engine"),
                cfg(dtype="float16", max_recv_tokens=12, scale_dim=16, scale_dtype="float16"),
                # several tokens per routing chunk, and rows split between warps
                cfg(max_tokens_per_rank=40, hidden=256),
                # every id in one pass, more tokens than a block has threads
                cfg(max_tokens_per_rank=150),
                # too many ids for one pass: blocks rank from the blocks before them
                cfg(max_tokens_per_rank=200),
                cfg(max_tokens_per_rank=200, layout="expert_major"),
                cfg(max_tokens_per_rank=40, kernel="low_latency", layout="expert_major"),
                # fixed slots: no count before the rows; block 0 counts in chunks
                cfg(layout="token_slots"),
                cfg(layout="token_slots", kernel="low_latency", dtype="float8_e4m3fn",
                    scale_dim=8),
                cfg(layout="token_slots", max_tokens_per_rank=40, hidden=256),
                cfg(layout="token_slots", max_tokens_per_rank=200)]
    short = progs.DEFAULT_PLAN[:3]
    by_kernels = emulated(progs.many_configs, 2, (configs,))
    by_cpu = run_processes(progs.many_configs, 2, args=(configs,))
    assert by_kernels == by_cpu  # bit for bit: rows, and combine's fp32 sums
    by_kernels = emulated(progs.many_configs, 2, (variants, short))
    by_cpu = run_processes(progs.many_configs, 2, args=(variants, short))
    assert by_kernels == by_cpu


def test_one_combine_set_when_the_buffer_is_large():
    # A combine buffer over 128 MiB (600 rows of 224 KiB) comes in one set:
    # senders (and redispatch) wait for the previous call's "consumed" flags.
    # Three calls: each waits for the one before it, with redispatches before
    # and after combines.
    configs = [cfg(max_tokens_per_rank=300, hidden=57344, dtype="float32")]
    heap = {"SYMHEAP_HEAP_SIZE": "1G"}
    plan = progs.DEFAULT_PLAN[:3]
    by_kernels = emulated(progs.redispatch_configs, 2, (configs, plan), env=heap)
    by_cpu = run_processes(progs.redispatch_configs, 2, args=(configs, plan), env=heap)
    assert by_kernels == by_cpu


# Redispatch (combine's reverse through a handle) on every layout with fixed
# shapes: received rows traced to their source, bit for bit the cpu
# implementation's, before and after combines (they share epochs); 40 tokens
# give the combine per-row flags (a larger flag step per call).
def redispatch_configs(n):
    bound = dict(max_recv_tokens=6 * n)  # intranode token_major with fixed shapes
    if n == 2:
        return [cfg(layout="token_slots"), cfg(layout="expert_major"),
                cfg(dtype="float16", **bound), cfg(kernel="low_latency", dtype="float32"),
                cfg(kernel="low_latency", layout="expert_major"),
                cfg(max_tokens_per_rank=40, hidden=256, layout="token_slots")]
    return [cfg(num_experts=16, kernel="low_latency", layout="token_slots"),
            cfg(num_experts=16, max_tokens_per_rank=40, layout="expert_major"),
            cfg(num_experts=16, kernel="low_latency", **bound)]


@pytest.mark.parametrize("n", [2, 4])
def test_redispatch_matches_the_cpu_implementation(n):
    configs, plan = redispatch_configs(n), progs.DEFAULT_PLAN[:4 if n == 2 else 2]
    by_kernels = emulated(progs.redispatch_configs, n, (configs, plan))
    by_cpu = run_processes(progs.redispatch_configs, n, args=(configs, plan))
    assert by_kernels == by_cpu


@pytest.mark.parametrize("layout", ["token_slots", "expert_major"])
def test_tampered_handle_aborts_a_redispatch_on_every_pe(layout):
    assert emulated(progs.tampered_redispatch, 2, (layout,)) == [
        ["ValueError"] * 3 + ["ok"] * 2, ["SymheapError"] * 3 + ["ok"] * 2]


def test_four_pes():
    configs = [cfg(num_experts=16, kernel="intranode"),
               cfg(num_experts=16, kernel="copy_engine", layout="expert_major", dtype="float32"),
               cfg(num_experts=16, kernel="low_latency", layout="token_slots")]
    emulated(progs.many_configs, 4, (configs,))


@pytest.mark.parametrize("kw,fault,match", [
    (dict(kernel="low_latency"), "expert_too_large", "expert id 8"),
    (dict(kernel="intranode"), "expert_negative", "expert id -2"),
    (dict(kernel="intranode", max_tokens_per_rank=200), "expert_too_large", "expert id 8"),
    (dict(kernel="intranode", max_recv_tokens=12), "too_many_tokens", "max_tokens_per_rank=6"),
    (dict(kernel="copy_engine", layout="expert_major"), "wrong_dtype", "x must have dtype"),
    (dict(kernel="low_latency", layout="token_slots"), "expert_too_large", "expert id 8"),
    (dict(kernel="intranode", layout="token_slots"), "too_many_tokens", "max_tokens_per_rank=6"),
])
def test_bad_input(kw, fault, match):
    results = emulated(progs.bad_input_then_recover, 2, (cfg(**kw), 1, fault))
    for rank, ((kind, msg), recovered) in enumerate(results):
        assert recovered
        if rank == 1:
            assert kind == "ValueError" and match in msg, msg
        else:
            assert kind == "SymheapError" and "PE 1" in msg, msg


@pytest.mark.parametrize("kw", [dict(kernel="low_latency", max_recv_tokens=7),
                                dict(kernel="copy_engine", layout="expert_major", num_experts=4,
                                     topk=2, expert_capacity=7)])
def test_receive_overflow(kw):
    for msg in emulated(progs.overflow, 2, (cfg(**kw),)):
        assert "would receive" in msg, msg


def test_interleaved_ops_and_combine_misuse():
    assert emulated(progs.interleaved_ops, 2, ()) == [True, True]
    for errors in emulated(progs.combine_misuse, 2, ()):
        assert len(errors) == 3


def test_absent_peer_times_out():
    results = run_processes(progs.absent_peer, 2, args=(1,), init_kwargs={"timeout": 2.0},
                            env=EMULATE, timeout=240)
    assert results[1] is None
    assert "timed out" in results[0] and "PE 1" in results[0], results[0]


def test_one_pe_per_process():
    from symheap.testing import PeFailure
    with pytest.raises(PeFailure, match="one PE per process"):
        run_processes(progs.many_configs, 1, args=([cfg()],), threads_per_proc=2, env=EMULATE)


@pytest.mark.parametrize("layout", ["token_major", "expert_major"])
def test_tampered_handle_raises_instead_of_writing_out_of_bounds(layout):
    """The kernels bound-check combine's handle (an edited summary or row
    metadata): the culprit raises ValueError, its peer SymheapError, and the
    op goes on."""
    assert emulated(progs.tampered_handle, 2, (layout,)) == [
        ["ValueError", "ValueError", "ok", "ok"], ["SymheapError", "SymheapError", "ok", "ok"]]


def test_ops_in_turn_on_one_heap_range():
    # 180 tokens of top-3 are more ids than one round of loads: dispatch blocks rank
    # from the counts of the blocks before them, and ticket 0 totals theirs once
    # their done words carry the call's epoch. Each op below makes one call and
    # is closed; the next gets the same heap range and starts at that same epoch,
    # so words the previous op left there must not pass for its own.
    big = dict(max_tokens_per_rank=180)
    configs = [cfg(kernel="intranode", max_recv_tokens=360, **big),
               cfg(kernel="low_latency", **big),
               cfg(layout="expert_major", **big),
               cfg(layout="expert_major", kernel="low_latency", **big)]
    for offsets in emulated(progs.ops_in_turn, 2, (configs,)):
        assert len(set(offsets)) == 1, offsets  # every op got the same range
