"""EpDispatchCombine.dispatch / combine as the core's own functions: keyword
arguments, Python's argument errors, stream= conversion, use after close, and a
subclass that overrides the methods."""
import pytest

torch = pytest.importorskip("torch")

import symheap  # noqa: E402
from symheap.ep import EpConfig, EpDispatchCombine  # noqa: E402
from symheap.testing import run_threads  # noqa: E402

import test_ep_programs as progs  # noqa: E402


def _config():
    return EpConfig(hidden=16, max_tokens_per_rank=5, num_experts=8, topk=2, dtype="float32",
                    layout="expert_major")


def _errors(calls):
    got = []
    for call in calls:
        try:
            call()
            got.append(None)
        except Exception as e:  # noqa: BLE001 - the type and message are the result
            got.append(f"{type(e).__name__}: {e}")
    return got


def keyword_calls():
    cfg = _config()
    me, n = symheap.my_pe(), symheap.n_pes()
    inputs = [progs.make_inputs(cfg, n, r, 11, "random", "full") for r in range(n)]
    x, idx, w, scales = inputs[me]
    ep = EpDispatchCombine(cfg)
    out = ep.dispatch(topk_weights=w, topk_idx=idx, x=x, stream=0)
    progs.check_dispatch(cfg, ep, out, inputs, me, n)
    y = progs.identity_experts(cfg, out, x.device)
    res = torch.full((x.shape[0], cfg.hidden), float("nan"))
    got = ep.combine(y, handle=out.handle, topk_weights=w * 2, out=res, stream=None)
    assert got is res
    progs.check_combine(cfg, res, x, idx, w, scales, me, weight_scale=2.0)
    # Argument errors are raised before the call starts, on this PE alone.
    errors = _errors([lambda: ep.dispatch(x, idx),
                      lambda: ep.dispatch(x, idx, w, None, 0),
                      lambda: ep.dispatch(x, idx, w, bogus=1),
                      lambda: ep.dispatch(x, idx, w, x=x),
                      lambda: ep.combine(y),
                      lambda: ep.dispatch(x, idx, w, stream=True),
                      lambda: ep.dispatch(x, idx, w, stream=-1)])
    progs.run_once(cfg, ep, 12)  # still in step with the other PEs
    dispatch = ep.dispatch
    ep.close()
    errors += _errors([lambda: dispatch(x, idx, w), lambda: ep.dispatch(x, idx, w),
                       lambda: ep.combine(y, out.handle)])
    return errors


def test_keyword_calls_and_argument_errors():
    for errors in run_threads(keyword_calls, 2):
        assert errors == [
            "TypeError: EpDispatchCombine.dispatch() missing 1 required argument: 'topk_weights'",
            "TypeError: EpDispatchCombine.dispatch() takes from 4 to 5 positional arguments but 6 "
            "were given",
            "TypeError: EpDispatchCombine.dispatch() got an unexpected keyword argument 'bogus'",
            "TypeError: EpDispatchCombine.dispatch() got multiple values for argument 'x'",
            "TypeError: EpDispatchCombine.combine() missing 1 required argument: 'handle'",
            "TypeError: stream must be a stream object or a raw handle, not a bool",
            "ValueError: a raw stream handle cannot be negative, got -1",
            "SymheapError: this EpDispatchCombine is closed",
            "SymheapError: this EpDispatchCombine is closed",
            "SymheapError: this EpDispatchCombine is closed"]


class CountingOp(EpDispatchCombine):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.calls = []

    def dispatch(self, *args, **kwargs):
        self.calls.append("dispatch")
        return super().dispatch(*args, **kwargs)

    def combine(self, *args, **kwargs):
        self.calls.append("combine")
        return super().combine(*args, **kwargs)


def overridden_calls():
    with CountingOp(_config()) as ep:
        progs.run_once(ep.config, ep, 13)
        return ep.calls


def test_subclass_methods_are_called():
    assert run_threads(overridden_calls, 2) == [["dispatch", "combine"]] * 2


class TaggedTensor(torch.Tensor):
    """A tensor subclass: the ops read it the Python way, not through torch's C++ API."""


def _strided(t):
    """``t`` as a non-contiguous view (every other column of a wider tensor)."""
    wide = torch.full((t.shape[0], 2 * t.shape[1]), float("nan") if t.is_floating_point() else -7,
                      dtype=t.dtype)
    wide[:, ::2] = t
    view = wide[:, ::2]
    assert not view.is_contiguous()
    return view


def fallback_reads(layout):
    """Arguments a call reads with the GIL taken back part-way: non-contiguous
    tensors (copied) and a tensor subclass, in dispatch and combine; a
    non-contiguous ``out`` is refused, not copied."""
    cfg = EpConfig(hidden=16, max_tokens_per_rank=5, num_experts=8, topk=2, dtype="float32",
                   layout=layout)
    me, n = symheap.my_pe(), symheap.n_pes()
    inputs = [progs.make_inputs(cfg, n, r, 17, "random", "full") for r in range(n)]
    x, idx, w, scales = inputs[me]
    with EpDispatchCombine(cfg) as ep:
        out = ep.dispatch(_strided(x), _strided(idx), w.as_subclass(TaggedTensor))
        progs.check_dispatch(cfg, ep, out, inputs, me, n)
        y = progs.identity_experts(cfg, out, x.device)
        y_arg = (y.as_subclass(TaggedTensor) if me == 0
                 else y.transpose(0, -1).contiguous().transpose(0, -1))
        if layout == "expert_major":
            got = ep.combine(y_arg, out.handle, _strided(w))
        else:
            got = ep.combine(y_arg, out.handle)
        progs.check_combine(cfg, got, x, idx, w, scales, me)
        bad_out = torch.empty(cfg.hidden, x.shape[0]).t()
        try:
            ep.combine(y, out.handle, out=bad_out)
            error = None
        except ValueError as e:
            error = str(e)
        progs.run_once(cfg, ep, 18)  # still in step with the other PEs
        return error


@pytest.mark.parametrize("layout", ["token_major", "expert_major"])
def test_non_contiguous_and_subclass_arguments(layout):
    for error in run_threads(fallback_reads, 2, args=(layout,)):
        assert error is not None and error.startswith("out must be a contiguous float32 tensor")


def calls_after_finalize():
    """An op whose PE was finalized refuses calls (the op holds its PE weakly:
    no per-call look-up in the runtime's map); close() then says why it cannot
    free the op's buffers."""
    cfg = _config()
    ep = EpDispatchCombine(cfg)
    progs.run_once(cfg, ep, 19)
    me, n = symheap.my_pe(), symheap.n_pes()
    x, idx, w, _ = progs.make_inputs(cfg, n, me, 19, "random", "full")
    symheap.finalize()
    return _errors([lambda: ep.dispatch(x, idx, w), lambda: ep.check(), ep.close])


def test_calls_after_finalize_are_refused():
    for errors in run_threads(calls_after_finalize, 2, finalize=False):
        assert errors[:2] == ["SymheapError: this EpDispatchCombine's PE was finalized"] * 2
        assert errors[2].startswith("SymheapError: ")
