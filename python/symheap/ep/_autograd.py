"""Differentiable dispatch and combine (torch autograd) over EpDispatchCombine.

    d = symheap.ep.dispatch(op, x, topk_idx, topk_weights)   # x, topk_weights may need grad
    y = experts(d.x)                                           # any differentiable code
    out = symheap.ep.combine(op, y, d.handle)                  # differentiable in y (and weights)
    out.sum().backward()

The backward of dispatch is a combine of the received rows' gradients through the
same handle (each token's gradient is the sum over the rows it became); the backward
of combine is a redispatch of the output gradient through the same handle (no new
routing: every token's gradient goes to exactly the rows its outputs came from).
Where the op has no redispatch (kernel='copy_engine'), and for expert-major combines
given weights other than dispatch's (whose row weights only a dispatch carries), it
dispatches the output gradient with the same routing instead, which places the rows
alike (by source PE, then token, then slot: a function of the routing alone). Every
backward call is a collective, as the forward ones are: every PE must run backward
through the same ops.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ._op import DispatchOutput, EpDispatchCombine, EpHandle


@dataclass
class RoutedHandle:
    """What combine and both backwards need: the op's handle plus the routing it came
    from (``topk_weights`` is the caller's tensor, so weight gradients reach it)."""

    handle: EpHandle
    topk_idx: torch.Tensor
    topk_weights: torch.Tensor
    num_tokens: int
    # The received rows: which hold a row (shaped to broadcast against d.x), and
    # expert-major their slot and weight (what combine's gradient needs).
    valid: torch.Tensor = None
    slot: torch.Tensor = None
    row_weights: torch.Tensor = None


# ----------------------------------------------------------------- helpers

def _check_op(op, where: str) -> None:
    if not isinstance(op, EpDispatchCombine):
        raise TypeError(f"{where}: op must be an EpDispatchCombine, got {type(op).__name__}")
    cfg = op.config
    if cfg.scale_dim or cfg.dtype == "float8_e4m3fn":
        raise ValueError(f"{where}: autograd needs a bfloat16, float16 or float32 config without "
                         f"scales (got dtype={cfg.dtype!r}, scale_dim={cfg.scale_dim}); call "
                         f"op.dispatch / op.combine directly for fp8")


def _refuse_together(error: Exception, collective) -> None:
    """Raises `error` for an argument only this PE got wrong, after making the
    op's own call with it (`collective`): the core refuses that argument on
    every PE together, so the other PEs raise at once instead of waiting for
    this one until their timeout."""
    try:
        collective()
    except Exception as refused:
        raise error from refused
    raise error


def _expert_major(op) -> bool:
    return op.config.layout == "expert_major"


def _valid_rows(op, d: DispatchOutput) -> torch.Tensor:
    """A bool mask over the received rows, shaped to broadcast against ``d.x``: rows
    past the valid count (or token_slots slots no token filled) are stale memory."""
    if _expert_major(op):
        cap = d.x.shape[1]
        rows = torch.arange(cap, device=d.x.device)
        return (rows[None, :] < d.expert_counts[:, None])[..., None]
    if op.config.layout == "token_slots":
        return (d.src_info[:, 0] >= 0)[:, None]
    rows = torch.arange(d.x.shape[0], device=d.x.device)
    return (rows < d.num_recv_tokens)[:, None]


def _ones_weights(handle: RoutedHandle, op) -> torch.Tensor:
    return torch.ones(handle.num_tokens, op.config.topk, dtype=torch.float32,
                      device=handle.topk_idx.device)


def _send_back_per_slot(op, handle: RoutedHandle, values: torch.Tensor, slot_of_row) -> torch.Tensor:
    """Returns per (token, slot) float values that live on the received rows to their
    source tokens: [num_tokens, topk]. ``values`` is [R, topk] (token-major, zero where
    the slot is not local) or [L, capacity] with ``slot_of_row`` [L, capacity]
    (expert-major). Each value sits in its slot's column of an otherwise zero row, so
    combine's per-token sum keeps the slots apart."""
    cfg = op.config
    dt = getattr(torch, cfg.combine_dtype)
    if _expert_major(op):
        rows = torch.zeros(*values.shape, cfg.hidden, dtype=dt, device=values.device)
        # Rows past a run's count hold stale slots (and zero values): any column will do.
        slot = slot_of_row.long().clamp(0, cfg.topk - 1)
        rows.scatter_(2, slot[..., None], values.to(dt)[..., None])
        out = op.combine(rows, handle.handle, _ones_weights(handle, op))
    else:
        rows = torch.zeros(values.shape[0], cfg.hidden, dtype=dt, device=values.device)
        rows[:, :cfg.topk] = values.to(dt)
        out = op.combine(rows, handle.handle)
    return out[:, :cfg.topk].float()


# ----------------------------------------------------------------- the functions

class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, op, x, topk_weights, topk_idx, box):
        d = op.dispatch(x.detach(), topk_idx, topk_weights.detach())
        valid = _valid_rows(op, d)
        # Out of the symmetric buffer: the next dispatch (forward or backward) rewrites it,
        # and autograd may still hold these rows.
        rx = torch.where(valid, d.x, 0)
        rw = torch.where(valid[..., 0] if _expert_major(op) else valid, d.topk_weights, 0.0)
        handle = RoutedHandle(d.handle, topk_idx, topk_weights, x.shape[0], valid)
        if _expert_major(op):
            idx, src_info = None, d.src_info
            handle.slot = torch.where(valid[..., 0], src_info[..., 2], -1)
            handle.row_weights = rw.detach()
        else:
            idx = torch.where(valid, d.topk_idx, -1)
            src_info = d.src_info.clone()
        box.append(DispatchOutput(x=rx, topk_idx=idx, topk_weights=rw, scales=None,
                                  num_recv_tokens=d.num_recv_tokens.clone(), src_info=src_info,
                                  expert_counts=d.expert_counts.clone(), handle=handle))
        ctx.op, ctx.handle = op, handle
        ctx.recv_idx, ctx.slot = idx, (src_info[..., 2] if _expert_major(op) else None)
        return rx, rw

    @staticmethod
    def backward(ctx, g_rows, g_w):
        op, handle = ctx.op, ctx.handle
        g_x = g_w_src = None
        if ctx.needs_input_grad[1]:
            extra = (_ones_weights(handle, op),) if _expert_major(op) else ()
            g_x = op.combine(g_rows.contiguous(), handle.handle, *extra)
        if ctx.needs_input_grad[2]:
            if _expert_major(op):
                g_w_src = _send_back_per_slot(op, handle, g_w, ctx.slot)
            else:
                g_w_src = _send_back_per_slot(op, handle, g_w * (ctx.recv_idx >= 0), None)
        return None, g_x, g_w_src, None, None


def _grad_rows(op, g_out, handle: RoutedHandle, weights, dispatch_weights: bool):
    """Combine's output gradient on the rows its outputs came from: (rows, which rows
    hold one, and expert-major each row's slot and weight). A redispatch through the
    forward's handle, unless the op has none or an expert-major combine was given other
    weights than dispatch's (a dispatch with the same routing carries those)."""
    if op.has_redispatch and (dispatch_weights or not _expert_major(op)):
        rows = op.redispatch(g_out, handle.handle)  # zeros where no row landed
        return rows, handle.valid, handle.slot, handle.row_weights
    send_w = (weights if _expert_major(op) else handle.topk_weights).detach()
    d = op.dispatch(g_out, handle.topk_idx, send_w)
    valid = _valid_rows(op, d)
    rows = torch.where(valid, d.x, 0)  # a copy: later calls rewrite the buffer
    if not _expert_major(op):
        return rows, valid, None, None
    return rows, valid, d.src_info[..., 2], torch.where(valid[..., 0], d.topk_weights, 0.0)


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, op, expert_out, weights, handle, dispatch_weights):
        out = op.combine(expert_out.detach().contiguous(), handle.handle,
                         weights.detach() if weights is not None else None)
        ctx.op, ctx.handle, ctx.dispatch_weights = op, handle, dispatch_weights
        ctx.eo_dtype = expert_out.dtype
        # expert_out is needed only for the weights' gradient
        ctx.save_for_backward(expert_out if ctx.needs_input_grad[2] else None, weights)
        return out

    @staticmethod
    def backward(ctx, g_out):
        op, handle = ctx.op, ctx.handle
        expert_out, weights = ctx.saved_tensors
        g_rows, valid, slot, row_w = _grad_rows(op, g_out.to(ctx.eo_dtype).contiguous(), handle,
                                                weights, ctx.dispatch_weights)
        g_eo = g_w = None
        if ctx.needs_input_grad[2]:
            # row dot products as batched matmuls: fp32 accumulation, no fp32 copy of the rows
            dots = torch.einsum("...h,...h->...", g_rows, expert_out.detach()).float()
            dots = dots * valid[..., 0]
            g_w = _send_back_per_slot(op, handle, dots, slot)
        if ctx.needs_input_grad[1]:
            if _expert_major(op):
                g_eo = (g_rows.float() * row_w[..., None]).to(ctx.eo_dtype)
            else:
                g_eo = g_rows
        return None, g_eo, g_w, None, None


# ----------------------------------------------------------------- public API

def dispatch(op: EpDispatchCombine, x, topk_idx, topk_weights) -> DispatchOutput:
    """Differentiable ``op.dispatch`` (collective, on the current stream).

    Returns a DispatchOutput whose ``x`` and ``topk_weights`` are autograd tensors
    owned by the caller (copies: rows past the valid count, and token_slots slots no
    token filled, are zeros, so grouped matmuls over the whole padded tensor are safe)
    and whose ``handle`` is a RoutedHandle for ``symheap.ep.combine``. Gradients flow
    to ``x`` and to ``topk_weights`` (through the received weights). Needs a bfloat16,
    float16 or float32 config without scales.
    """
    _check_op(op, "symheap.ep.dispatch")
    if not isinstance(x, torch.Tensor) or not isinstance(topk_weights, torch.Tensor):
        _refuse_together(TypeError("symheap.ep.dispatch: x and topk_weights must be torch tensors"),
                         lambda: op.dispatch(x, topk_idx, topk_weights))
    if op.config.hidden < op.config.topk:
        raise ValueError(f"symheap.ep.dispatch: autograd needs hidden >= topk "
                         f"(hidden={op.config.hidden}, topk={op.config.topk})")
    box: list = []
    _Dispatch.apply(op, x, topk_weights, topk_idx, box)
    return box[0]


def combine(op: EpDispatchCombine, expert_out, handle: RoutedHandle, topk_weights=None):
    """Differentiable ``op.combine`` through the RoutedHandle of ``symheap.ep.dispatch``
    (collective, on the current stream). Gradients flow to ``expert_out`` and, in the
    expert-major layout (where combine applies the weights), to ``topk_weights``: the
    ones given here, else the ones given to dispatch."""
    _check_op(op, "symheap.ep.combine")
    if not isinstance(handle, RoutedHandle):
        _refuse_together(TypeError("symheap.ep.combine: handle must be the handle of "
                                   f"symheap.ep.dispatch (a RoutedHandle), got "
                                   f"{type(handle).__name__}; use op.combine for the handle of "
                                   "op.dispatch"),
                         lambda: op.combine(expert_out, None))
    if _expert_major(op):
        weights = handle.topk_weights if topk_weights is None else topk_weights
    else:
        if topk_weights is not None:
            _refuse_together(ValueError("symheap.ep.combine: topk_weights applies to "
                                        "layout='expert_major' only (token-major rows arrive "
                                        "already weighted)"),
                             lambda: op.combine(expert_out, None))
        weights = None
    return _Combine.apply(op, expert_out, weights, handle, topk_weights is None)
