"""symheap.ep.dispatch / combine under torch autograd (cpu backend, every launch model):
outputs and gradients of x, topk_weights and the experts against a single-PE reference."""
import pytest

torch = pytest.importorskip("torch")

import symheap.ep as ep  # noqa: E402
from symheap.testing import run_processes, run_threads  # noqa: E402

import ep_autograd_programs as progs  # noqa: E402

LAYOUTS = ["token_major", "token_slots", "expert_major"]


def cfg(n_pes, **kw):
    base = dict(hidden=16, max_tokens_per_rank=5, num_experts=2 * n_pes, topk=3, dtype="float32")
    base.update(kw)
    return base


def run_and_check(launch, n_pes, cfg_kw, tokens, seed, layers=2, **kw):
    results = launch(progs.layer_grads, n_pes, (cfg_kw, seed, tokens, layers), **kw)
    progs.check_against_reference(results, cfg_kw, seed, tokens, layers)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_threads_two_pes(layout):
    run_and_check(run_threads, 2, cfg(2, layout=layout), [5, 4], seed=1)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_threads_four_pes_with_an_empty_pe(layout):
    run_and_check(run_threads, 4, cfg(4, layout=layout), [5, 0, 3, 5], seed=2)


def test_expert_major_weights_applied_on_the_expert_side():
    """The weight gradient then flows back through dispatch's received weights."""
    c = cfg(2, layout="expert_major")
    results = run_threads(progs.layer_grads, 2, args=(c, 3, [4, 5], 2, True))
    progs.check_against_reference(results, c, 3, [4, 5])


def test_low_latency_kernel_name():
    run_and_check(run_threads, 2, cfg(2, kernel="low_latency"), [5, 5], seed=4)


def test_tight_expert_capacity():
    c = cfg(2, layout="expert_major", expert_capacity=8)  # 2 PEs x 5 tokens, 1 row per expert
    run_and_check(run_threads, 2, c, [5, 5], seed=5)


@pytest.mark.parametrize("layout", ["token_major", "expert_major"])
def test_processes(layout):
    run_and_check(run_processes, 2, cfg(2, layout=layout), [5, 3], seed=6)


@pytest.mark.parametrize("layout", ["token_slots", "expert_major"])
def test_two_processes_by_two_threads(layout):
    run_and_check(run_processes, 2, cfg(4, layout=layout), [4, 5, 0, 2], seed=7,
                  threads_per_proc=2)


def _fp8_refused():
    c = ep.EpConfig(hidden=16, max_tokens_per_rank=2, num_experts=2, topk=1,
                    dtype="float8_e4m3fn")
    with ep.EpDispatchCombine(c) as op:
        x = torch.zeros(2, 16).to(torch.float8_e4m3fn)
        with pytest.raises(ValueError, match="autograd needs a bfloat16"):
            ep.dispatch(op, x, torch.zeros(2, 1, dtype=torch.int64), torch.ones(2, 1))
        d = op.dispatch(x, torch.zeros(2, 1, dtype=torch.int64), torch.ones(2, 1))
        with pytest.raises(ValueError, match="autograd needs"):
            ep.combine(op, d.x.to(torch.bfloat16), d.handle)
        op.combine(d.x.to(torch.bfloat16), d.handle)
    return True


def _wrong_handle():
    c = ep.EpConfig(hidden=16, max_tokens_per_rank=2, num_experts=2, topk=1, dtype="float32")
    with ep.EpDispatchCombine(c) as op:
        idx, w = torch.zeros(2, 1, dtype=torch.int64), torch.ones(2, 1)
        d = op.dispatch(torch.zeros(2, 16), idx, w)
        with pytest.raises(TypeError, match="RoutedHandle"):
            ep.combine(op, d.x, d.handle)
        with pytest.raises(TypeError, match="op must be an EpDispatchCombine"):
            ep.dispatch(None, torch.zeros(2, 16), idx, w)
        op.combine(d.x, d.handle)
    return True


def test_bad_input_raises():
    assert run_threads(_fp8_refused, 1) == [True]
    assert run_threads(_wrong_handle, 1) == [True]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_device_kernels_emulated_with_padded_outputs(layout):
    """The CUDA kernels run in the host emulation (one PE per process): low_latency
    returns capacity-sized outputs whose rows past the valid count are stale."""
    env = {"SYMHEAP_EP_EMULATE_DEVICE": "1", "SYMHEAP_TIMEOUT": "20"}
    run_and_check(run_processes, 2, cfg(2, kernel="low_latency", layout=layout), [5, 3],
                  seed=8, layers=1, env=env, timeout=240)


def test_copy_engine_emulated_backward_dispatches():
    """copy_engine has no redispatch: combine's backward dispatches the output gradient
    with the forward's routing instead (the same rows), in the host emulation."""
    env = {"SYMHEAP_EP_EMULATE_DEVICE": "1", "SYMHEAP_TIMEOUT": "20"}
    run_and_check(run_processes, 2, cfg(2, kernel="copy_engine", layout="expert_major"),
                  [5, 3], seed=9, layers=1, env=env, timeout=240)
