"""Expert-parallel dispatch/combine on CUDA GPUs: every kernel and layout,
threads and processes, CUDA-graph replay, errors. The PE programs and their
references are the cpu tests' (tests/ep/test_ep_programs.py)."""
import os
import sys

import pytest
import torch

sys.path[:0] = [os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", d)
                for d in ("ep", "runtime")]

import symheap  # noqa: E402
from symheap.testing import run_threads  # noqa: E402

import test_ep_programs as progs  # noqa: E402

two_gpus = pytest.mark.two_gpus
KERNELS = ["intranode", "low_latency", "copy_engine"]


def cfg(**kw):
    base = dict(hidden=256, max_tokens_per_rank=48, num_experts=16, topk=4, dtype="bfloat16")
    base.update(kw)
    return base


def run_per_device(fn, args):
    from launch import run_process_per_device
    return run_process_per_device(fn, [0, 1], args=args)


@two_gpus
@pytest.mark.parametrize("kernel", KERNELS)
def test_token_major_threads(kernel):
    configs = [cfg(kernel=kernel), cfg(kernel=kernel, dtype="float8_e4m3fn", scale_dim=128),
               cfg(kernel=kernel, dtype="float32", hidden=64)]
    if kernel == "intranode":
        configs.append(cfg(kernel=kernel, max_recv_tokens=96, dtype="float16"))
    run_threads(progs.many_configs, 2, args=(configs,))


@two_gpus
@pytest.mark.parametrize("kernel", ["intranode", "low_latency"])
def test_token_slots_threads(kernel):
    configs = [cfg(kernel=kernel, layout="token_slots"),
               cfg(kernel=kernel, layout="token_slots", dtype="float8_e4m3fn", scale_dim=128),
               cfg(kernel=kernel, layout="token_slots", dtype="float32", hidden=64),
               cfg(kernel=kernel, layout="token_slots", hidden=7168, max_tokens_per_rank=16,
                   num_experts=32, topk=8)]
    run_threads(progs.many_configs, 2, args=(configs,))


@two_gpus
@pytest.mark.parametrize("kernel", KERNELS)
def test_expert_major_threads(kernel):
    configs = [cfg(kernel=kernel, layout="expert_major"),
               cfg(kernel=kernel, layout="expert_major", dtype="float8_e4m3fn", scale_dim=64,
                   num_experts=8, topk=2)]
    run_threads(progs.many_configs, 2, args=(configs,))


@two_gpus
def test_deepseek_row_width():
    """Full-width rows (7168) of bf16 and fp8 with 56 scales per row."""
    configs = [cfg(hidden=7168, max_tokens_per_rank=16, num_experts=32, topk=8),
               cfg(hidden=7168, max_tokens_per_rank=16, num_experts=32, topk=8,
                   dtype="float8_e4m3fn", scale_dim=128, kernel="low_latency",
                   layout="expert_major")]
    run_threads(progs.many_configs, 2, args=(configs, progs.DEFAULT_PLAN[:3]))


@two_gpus
def test_many_tokens_rank_by_look_back():
    """More ids than one round of loads: dispatch blocks rank by look-back and
    plan from the destination sums (with "zero_on_odd", next to a PE whose
    call is small); the last config's combine buffer (2400 rows of 56 KiB,
    over 128 MiB) comes in one set."""
    many = dict(max_tokens_per_rank=1200, num_experts=32, topk=8)
    configs = [cfg(**many), cfg(**many, max_recv_tokens=2400, dtype="float16"),
               cfg(**many, kernel="copy_engine"), cfg(**many, layout="expert_major"),
               cfg(**many, hidden=28672), cfg(**many, layout="token_slots")]
    run_threads(progs.many_configs, 2, args=(configs,), init_kwargs={"heap_size": "2G"})


@two_gpus
def test_ops_in_turn_rank_by_look_back():
    """Ops created one after another, each closed first (the same heap range), one
    look-back call each: a new op's first dispatch runs at the epoch where the previous
    op's blocks left their counts and done words, which must not pass for its own."""
    many = dict(max_tokens_per_rank=1200, num_experts=32, topk=8)
    configs = [cfg(**many, max_recv_tokens=2400), cfg(**many, kernel="low_latency"),
               cfg(**many), cfg(**many, layout="expert_major"),
               cfg(**many, layout="expert_major", kernel="low_latency")]
    for offsets in run_threads(progs.ops_in_turn, 2, args=(configs,),
                               init_kwargs={"heap_size": "2G"}):
        assert len(set(offsets)) == 1, offsets


@two_gpus
def test_two_processes_match_two_threads():
    configs = [cfg(), cfg(kernel="low_latency", layout="expert_major"),
               cfg(kernel="copy_engine", dtype="float16"),
               cfg(kernel="low_latency", layout="token_slots")]
    by_threads = run_threads(progs.many_configs, 2, args=(configs,))
    by_processes = run_per_device(progs.many_configs, (configs,))
    assert by_threads == by_processes


# Redispatch (combine's reverse through a handle: combine's gradient) on every
# layout with fixed shapes, before and after combines (they share epochs); 1200
# tokens give combine per-row flags (a larger flag step per call), and 28672-wide
# rows a single combine set (redispatch then waits for "consumed" flags).
_MANY = dict(max_tokens_per_rank=1200, num_experts=32, topk=8)
REDISPATCH_CONFIGS = [
    cfg(layout="token_slots"), cfg(layout="expert_major"),
    cfg(max_recv_tokens=96, dtype="float16"), cfg(kernel="low_latency"),
    cfg(kernel="low_latency", layout="expert_major", dtype="float32", hidden=64),
    cfg(kernel="low_latency", layout="token_slots", hidden=7168, max_tokens_per_rank=16,
        num_experts=32, topk=8),
    cfg(**_MANY, layout="token_slots"), cfg(**_MANY, layout="expert_major"),
    cfg(**_MANY, kernel="low_latency"),
    cfg(**_MANY, hidden=28672, max_recv_tokens=2400)]


@two_gpus
def test_redispatch_threads_and_processes():
    """Every received row holds its source token's row bit for bit (zeros elsewhere),
    the same with a thread and with a process per GPU."""
    heap = {"heap_size": "2G"}
    by_threads = run_threads(progs.redispatch_configs, 2, args=(REDISPATCH_CONFIGS,),
                             init_kwargs=heap, join_timeout=900)
    from launch import run_process_per_device
    by_processes = run_process_per_device(progs.redispatch_configs, [0, 1],
                                          args=(REDISPATCH_CONFIGS,), init_kwargs=heap,
                                          timeout=900)
    assert by_threads == by_processes


@two_gpus
def test_plain_launches_match_early_launches(monkeypatch):
    """SYMHEAP_EP_PDL=0 (no programmatic dependent launch) gives the same
    results as the default; each run checks itself against the reference."""
    configs = [cfg(), cfg(kernel="low_latency", layout="expert_major"),
               cfg(kernel="copy_engine", dtype="float16"),
               cfg(kernel="low_latency", layout="token_slots")]
    early = run_threads(progs.many_configs, 2, args=(configs,))
    monkeypatch.setenv("SYMHEAP_EP_PDL", "0")
    plain = run_threads(progs.many_configs, 2, args=(configs,))
    assert plain == early


@two_gpus
@pytest.mark.parametrize("layout", ["token_major", "token_slots", "expert_major"])
def test_low_latency_graph_replay(layout):
    kw = cfg(kernel="low_latency", layout=layout, num_experts=8)
    assert run_threads(progs.graph_replay, 2, args=(kw, 10)) == [10, 10]


@two_gpus
@pytest.mark.parametrize("kernel", KERNELS + ["intranode+slots", "low_latency+slots"])
@pytest.mark.parametrize("fault,match", [("too_many_tokens", "max_tokens_per_rank=48"),
                                         ("expert_too_large", "expert id 16"),
                                         ("wrong_dtype", "x must have dtype bfloat16")])
def test_bad_input(kernel, fault, match):
    layout = "token_major"
    if kernel.endswith("+slots"):
        kernel, layout = kernel[:-len("+slots")], "token_slots"
    results = run_threads(progs.bad_input_then_recover, 2,
                          args=(cfg(kernel=kernel, layout=layout), 1, fault))
    for rank, ((kind, msg), recovered) in enumerate(results):
        assert recovered
        if rank == 1:
            assert kind == "ValueError" and match in msg, msg
        else:
            assert kind == "SymheapError" and "PE 1" in msg, msg


@two_gpus
@pytest.mark.parametrize("kw", [dict(max_recv_tokens=60),
                                dict(layout="expert_major", kernel="low_latency", num_experts=4,
                                     topk=2, expert_capacity=60)])
def test_receive_overflow(kw):
    for msg in run_threads(progs.overflow, 2, args=(cfg(**kw),)):
        assert "overflow" in msg or "would receive" in msg, msg


@two_gpus
def test_interleaved_ops_and_misuse():
    assert run_threads(progs.interleaved_ops, 2) == [True, True]
    for errors in run_threads(progs.combine_misuse, 2):
        assert len(errors) == 3


@two_gpus
def test_absent_peer_times_out():
    results = run_threads(progs.absent_peer, 2, args=(1,), init_kwargs={"timeout": 2.0})
    assert results[1] is None
    assert "timed out" in results[0] and "PE 1" in results[0], results[0]


@two_gpus
def test_close_frees_heap():
    for before, after in run_threads(progs.heap_after_ops, 2, args=(cfg(kernel="copy_engine"),)):
        assert before == after


@two_gpus
@pytest.mark.parametrize("layout", ["token_major", "expert_major"])
def test_tampered_handle_raises_instead_of_writing_out_of_bounds(layout):
    assert run_threads(progs.tampered_handle, 2, args=(layout,)) == [
        ["ValueError", "ValueError", "ok", "ok"], ["SymheapError", "SymheapError", "ok", "ok"]]


@two_gpus
@pytest.mark.parametrize("kernel", KERNELS)
def test_call_from_a_thread_that_is_not_the_pes(kernel):
    """PE 1's dispatch and combine from a helper thread whose current device is
    GPU 0: they run on GPU 1 (torch's current stream there) and GPU 0 stays
    the helper's current device."""
    results = run_threads(progs.from_other_thread, 2,
                          args=(cfg(kernel=kernel), (0,)), devices=[0, 1])
    assert results == [[], [(0, 0)]]
