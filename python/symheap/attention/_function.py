"""The public attention functions and their torch autograd rule."""
from __future__ import annotations

import dataclasses

import torch
from torch.autograd.function import once_differentiable

from .. import _core
from . import _plan
from ._kvcache import paged_varlen
from ._plan import Plan, cached_plan, core_args, cudnn_status, make_plan, new_output, prepare


_FORWARD = ("q", "k", "v", "out", "lse")
_BACKWARD = _FORWARD + ("dout", "dq", "dk", "dv")


def _run_forward(plan: Plan, q, k, v):
    out = new_output(q.shape, q.dtype, q.device, zero=plan.varlen)
    if plan.varlen:  # rows outside every sequence keep -inf (no visible key)
        lse = torch.full((plan.heads_q, q.shape[0]), float("-inf"), device=q.device)
    else:
        lse = new_output((plan.batch, plan.heads_q, plan.seqlen_q), torch.float32, q.device)
    if plan.on_cuda and plan.backend != "own":
        tensors = dict(q=q, k=k, v=v, out=out, lse=lse)
        stream = torch.cuda.current_stream(q.device).cuda_stream
        if _run_cudnn(plan, tensors, stream, backward=False):
            return out, lse
    if plan.core_template is not None:  # a cached fixed-length plan: one core call
        _core.attention_forward_tensors(plan.core_template, q, k, v, out, lse)
        return out, lse
    args = core_args(plan, q=q, k=k, v=v, out=out, lse=lse)
    if plan.on_cuda:
        stream = torch.cuda.current_stream(q.device).cuda_stream
        _core.attention_forward_cuda(args, q.device.index, stream)
    else:
        _core.attention_forward_cpu(args)
    return out, lse


def _run_cudnn(plan: Plan, tensors: dict, stream, backward: bool) -> bool:
    """Runs the call through cuDNN when the plan allows it and cuDNN takes it.
    Returns False for the own kernels; raises when backend="cudnn" cannot run it.

    The outcome is kept in the plan, by the strides cuDNN's graph bakes in: the
    argument block of a call that ran (a repeat with a cached plan only passes
    new pointers), or the reason cuDNN does not take it."""
    if plan.backend == "own":
        return False
    names = _BACKWARD if backward else _FORWARD
    ts = [tensors[n] for n in names]
    key = (backward,) + tuple(t.stride() for t in ts)
    known = plan.cudnn_calls.get(key)
    if known is None:
        args = core_args(plan, **tensors)
        if hasattr(_core, "attention_cudnn_prepare"):
            ok, nbytes, reason = _core.attention_cudnn_prepare(args, ts[0].device.index, backward)
        else:
            ok, nbytes, reason = False, 0, cudnn_status()[1]
        known = plan.cudnn_calls[key] = (args, nbytes) if ok else reason
    if isinstance(known, str):  # cuDNN does not take this call: the reason
        if plan.backend == "cudnn":
            raise _core.UnsupportedError(f"attention: backend='cudnn' cannot run this call: {known}")
        return False
    args, nbytes = known
    device = ts[0].device
    # From torch's caching allocator on the caller's stream: no cudaMalloc once
    # the pool is warm, and no host synchronisation.
    workspace = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=device)
    run = _core.attention_cudnn_backward if backward else _core.attention_cudnn_forward
    run(args, device.index, stream, workspace.data_ptr(), nbytes, *[t.data_ptr() for t in ts])
    return True


# The bias gradient's float32 workspace holds one slice per (batch entry,
# query head) and is summed over the bias's broadcast dims afterwards: for a
# bias broadcast over the batch or the heads it is that many times the size of
# the gradient. Past this many bytes a call runs its backward over chunks of
# batch entries whose workspace fits, summing as it goes.
DBIAS_WORKSPACE_LIMIT = 1 << 30


def _dbias_batch_chunk(plan: Plan) -> int:
    """Batch entries per backward launch when the bias gradient is wanted
    (plan.batch: one launch). With dropout the random stream depends on the
    batch index, so such calls stay whole, as do varlen calls."""
    if plan.varlen or plan.dropout_p > 0:
        return plan.batch
    rows = plan.seqlen_q if plan.bias.per_row else 1
    per_entry = plan.heads_q * rows * plan.seqlen_k * 4
    return max(1, min(plan.batch, DBIAS_WORKSPACE_LIMIT // per_entry))


def _batch_slice(plan: Plan, b0: int, b1: int) -> Plan:
    """The plan of batch entries [b0, b1) of a fixed-length call."""
    def rows_of(t):
        return t[b0:b1] if t is not None and t.shape[0] > 1 else t

    def spec_of(spec):
        return None if spec is None else dataclasses.replace(spec, tensor=rows_of(spec.tensor))
    return dataclasses.replace(plan, batch=b1 - b0, bias=spec_of(plan.bias), mask=spec_of(plan.mask),
                               alibi=rows_of(plan.alibi), cudnn_calls={}, core_template=None, eager=None)


def _launch_backward(plan: Plan, tensors: dict, use_cudnn: bool):
    q = tensors["q"]
    if plan.on_cuda:
        stream = torch.cuda.current_stream(q.device).cuda_stream
        if not use_cudnn or not _run_cudnn(plan, tensors, stream, backward=True):
            args = core_args(plan, **tensors)
            nbytes = _core.attention_backward_cuda_workspace_bytes(args)
            # From torch's caching allocator on the caller's stream: no cudaMalloc
            # once the pool is warm, and no host synchronisation.
            workspace = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=q.device)
            _core.attention_backward_cuda(args, q.device.index, stream, workspace.data_ptr(), nbytes)
    else:
        _core.attention_backward_cpu(core_args(plan, **tensors))


def _run_backward(plan: Plan, q, k, v, out, lse, dout, want_dbias: bool):
    dq = new_output(q.shape, q.dtype, q.device, zero=plan.varlen)
    dk = new_output(k.shape, k.dtype, k.device, zero=plan.varlen)
    dv = new_output(v.shape, v.dtype, v.device, zero=plan.varlen)
    tensors = dict(q=q, k=k, v=v, out=out, lse=lse, dout=dout, dq=dq, dk=dk, dv=dv)
    if not want_dbias:
        _launch_backward(plan, tensors, use_cudnn=True)
        return dq, dk, dv, None
    rows = plan.seqlen_q if plan.bias.per_row else 1
    chunk = _dbias_batch_chunk(plan)
    dbias = None
    for b0 in range(0, plan.batch, chunk):  # one pass unless the workspace would pass the limit
        b1 = min(plan.batch, b0 + chunk)
        whole = b1 - b0 == plan.batch
        part_plan = plan if whole else _batch_slice(plan, b0, b1)
        part = dict(tensors) if whole else {name: t[b0:b1] for name, t in tensors.items()}
        part["dbias"] = torch.zeros((b1 - b0, plan.heads_q, rows, plan.seqlen_k), dtype=torch.float32,
                                    device=q.device)
        _launch_backward(part_plan, part, use_cudnn=False)
        g = _sum_dbias(part_plan, part["dbias"])
        if whole:
            dbias = g
            continue
        if dbias is None:
            dbias = torch.zeros((plan.bias.tensor.shape[0],) + g.shape[1:], dtype=torch.float32, device=q.device)
        if dbias.shape[0] == 1:  # a bias broadcast over the batch: the chunks' sums add up
            dbias += g
        else:
            dbias[b0:b1] = g
    return dq, dk, dv, dbias.to(plan.bias.tensor.dtype).reshape(plan.bias.shape)


def _sum_dbias(plan: Plan, ws: torch.Tensor) -> torch.Tensor:
    """The per-(batch, query head) gradient summed over the bias's broadcast
    dims, in float32, 4-D."""
    spec = plan.bias
    b, h, _, _ = spec.tensor.shape
    g = ws
    if b == 1 and plan.batch > 1:
        g = g.sum(0, keepdim=True)
    if h == 1 and plan.heads_q > 1:
        g = g.sum(1, keepdim=True)
    elif spec.kv_heads:
        g = g.view(g.shape[0], plan.heads_kv, plan.heads_q // plan.heads_kv, *g.shape[2:]).sum(2)
    return g


def _unpad(t: torch.Tensor, plan: Plan) -> torch.Tensor:
    return t[..., : plan.head_dim] if plan.head_dim_run != plan.head_dim else t


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, bias, plan: Plan):
        # Fresh outputs (autograd saves them): None from the eager entry means
        # an input needs prepare() first.
        r = None if plan.eager is None else plan.eager.forward(q, k, v, False, _plan.poison_outputs)
        if r is None:
            qp, kp, vp = prepare(q, plan), prepare(k, plan), prepare(v, plan)
            out, lse = _run_forward(plan, qp, kp, vp)
        else:
            (qp, kp, vp), (out, lse) = (q, k, v), r
        ctx.plan = plan
        ctx.save_for_backward(qp, kp, vp, out, lse)
        ctx.mark_non_differentiable(lse)
        return _unpad(out, plan), lse

    @staticmethod
    @once_differentiable
    def backward(ctx, dout, _dlse):
        plan: Plan = ctx.plan
        qp, kp, vp, out, lse = ctx.saved_tensors
        want_dbias = plan.bias is not None and ctx.needs_input_grad[3]
        if plan.eager is not None and not want_dbias:  # cached plans hold no bias
            r = plan.eager.backward(qp, kp, vp, out, lse, dout, _plan.poison_outputs)
            if r is None:
                r = plan.eager.backward(qp, kp, vp, out, lse, prepare(dout, plan),
                                        _plan.poison_outputs)
            if r is not None:
                return r[0], r[1], r[2], None, None
        dq, dk, dv, dbias = _run_backward(plan, qp, kp, vp, out, lse, prepare(dout, plan), want_dbias)
        return _unpad(dq, plan), _unpad(dk, plan), _unpad(dv, plan), dbias, None


def _attention(q, k, v, bias, plan: Plan, return_lse: bool):
    if _needs_grad(q, k, v, bias):
        out, lse = _Attention.apply(q, k, v, bias, plan)
    else:  # nothing to differentiate: skip the autograd node
        # Pooled outputs: the eager entry hands out again only tensors their
        # callers released (see docs/attention.md).
        r = None if plan.eager is None else plan.eager.forward(
            q, k, v, True, _plan.poison_outputs, torch.is_inference_mode_enabled())
        if r is None:
            out, lse = _run_forward(plan, prepare(q, plan), prepare(k, plan), prepare(v, plan))
            out = _unpad(out, plan)
        else:
            out, lse = r
    return (out, lse) if return_lse else out


def _needs_grad(q, k, v, bias) -> bool:
    return torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                        or (bias is not None and bias.requires_grad))


def flash_attn_func(q, k, v, *, causal=False, window_size=(-1, -1), softmax_scale=None,
                    softcap=0.0, bias=None, mask=None, alibi_slopes=None, dropout_p=0.0, seed=None,
                    return_lse=False, deterministic=False, backend=None):
    """Attention over (B, S, H, D) tensors; see docs/attention.md.

    ``backend`` picks the CUDA path: "auto" (cuDNN's fused attention for every
    call it supports, the own kernels otherwise), "cudnn" (raise if cuDNN cannot
    run the call) or "own"; None reads $SYMHEAP_ATTN_BACKEND (default "auto").

    Returns ``out`` (B, Sq, Hq, D), or ``(out, lse)`` with ``lse`` (B, Hq, Sq)
    float32 when ``return_lse``. Differentiable in q, k, v and bias.
    """
    if bias is None and mask is None and alibi_slopes is None and not dropout_p:
        # A repeat call without autograd: one C++ call finds its plan and runs it.
        r = _core.attention_eager_call(q, k, v, causal, window_size, softmax_scale, softcap,
                                       deterministic, backend, bool(return_lse),
                                       _plan.poison_outputs)
        if r is not None:
            return r
        plan = cached_plan(q, k, v, causal, window_size, softmax_scale, softcap, deterministic,
                           backend)
        if plan.eager is not None and not _needs_grad(q, k, v, None):
            _core.attention_eager_remember(q, k, v, causal, window_size, softmax_scale, softcap,
                                           deterministic, backend, plan.eager)
    else:  # tensor options: planned per call
        plan = make_plan(q, k, v, varlen=False, causal=causal, window_size=window_size,
                         softmax_scale=softmax_scale, softcap=softcap, bias=bias, mask=mask,
                         alibi_slopes=alibi_slopes, dropout_p=dropout_p, seed=seed,
                         deterministic=deterministic, backend=backend)
    return _attention(q, k, v, bias, plan, return_lse)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                           causal=False, window_size=(-1, -1), softmax_scale=None, softcap=0.0,
                           bias=None, mask=None, alibi_slopes=None, dropout_p=0.0, seed=None,
                           return_lse=False, deterministic=False, backend=None, block_table=None):
    """Attention over packed variable-length sequences: q (total_q, Hq, D), k and
    v (total_k, Hkv, D); sequence b spans rows cu_seqlens[b] : cu_seqlens[b+1].
    With ``block_table`` (B, max_blocks) int32, k and v are paged caches
    (num_blocks, block_size, Hkv, D) instead (forward only; see _kvcache.py).

    bias and mask are indexed [b, h, i, j] by positions inside sequence b, so
    they broadcast as (B or 1, H, max_seqlen_q or 1, max_seqlen_k).
    Returns ``out`` (total_q, Hq, D), or ``(out, lse)`` with ``lse`` (Hq, total_q).
    """
    if block_table is not None:
        return paged_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, block_table,
                            bias=bias, mask=mask, dropout_p=dropout_p, causal=causal,
                            window_size=window_size, softmax_scale=softmax_scale, softcap=softcap,
                            alibi_slopes=alibi_slopes, return_lse=return_lse)
    plan = make_plan(q, k, v, varlen=True, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                     max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, causal=causal,
                     window_size=window_size, softmax_scale=softmax_scale, softcap=softcap,
                     bias=bias, mask=mask, alibi_slopes=alibi_slopes, dropout_p=dropout_p,
                     seed=seed, deterministic=deterministic, backend=backend)
    return _attention(q, k, v, bias, plan, return_lse)


def backends() -> dict:
    """Which attention paths this build and process can use:
    {name: (usable, detail)}, detail being a version or the reason it is not."""
    has_cuda = bool(getattr(_core, "attention_has_cuda", False))
    hopper, why = _core.attention_hopper_forward_status()
    own = ("CUDA kernels (sm_90a); Hopper forward kernel: " +
           ("built, the default forward at head dims 64, 128 and 256" if hopper else why)) if has_cuda else \
        "symheap was built without CUDA"
    return {
        "cpu": (True, "C++ kernels, float32/float16/bfloat16"),
        "own": (has_cuda, own),
        "cudnn": tuple(cudnn_status()),
    }
