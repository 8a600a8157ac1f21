"""Expert-parallel (MoE) dispatch and combine over the symmetric heap.

    cfg = EpConfig(hidden=7168, max_tokens_per_rank=4096, num_experts=256, topk=8,
                   dtype="bfloat16")
    with EpDispatchCombine(cfg) as ep:          # collective
        d = ep.dispatch(x, topk_idx, topk_weights)
        y = expert_side(d)                      # one row per received row
        out = ep.combine(y, d.handle)           # [num_tokens, hidden], input order

See EpDispatchCombine for the semantics and docs/ep.md for the kernels.
``symheap.ep.dispatch(op, x, topk_idx, topk_weights)`` and
``symheap.ep.combine(op, expert_out, handle)`` are the differentiable forms (torch
autograd; imported on first use, so this package does not need torch).
"""
from ._config import KERNELS, LAYOUTS, EpConfig
from ._fp8 import FP8_E4M3_MAX, dequantize_fp8, quantize_fp8
from ._op import DispatchOutput, EpDispatchCombine, EpHandle

__all__ = ["EpConfig", "EpDispatchCombine", "DispatchOutput", "EpHandle", "KERNELS", "LAYOUTS",
           "quantize_fp8", "dequantize_fp8", "FP8_E4M3_MAX", "dispatch", "combine", "RoutedHandle"]

_AUTOGRAD = ("dispatch", "combine", "RoutedHandle")


def __getattr__(name):
    if name in _AUTOGRAD:
        from . import _autograd
        return getattr(_autograd, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
