"""Attention over a KV cache (inference, forward only): the decode call
``flash_attn_with_kvcache`` and the paged path of ``flash_attn_varlen_func``.

A decode call whose arguments need no conversion runs in one C++ call
(``attention_kvcache_eager``); otherwise this module converts them, allocates
the outputs and sets the options. Either way the core reads the
tensors (``attention_cache_torch``), checks every shape, dtype, device, length
and block id in C++ (src/ops/attention/decode_args.cpp and decode_cpu.cpp) and
raises ValueError.
"""
from __future__ import annotations

import torch

from .. import _core
from .._attention_args import as_int, cache_options, int32_value


def _no_grad_needed(*tensors):
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad
                                       for t in tensors):
        raise ValueError("attention: attention over a KV cache is forward only; call it under "
                         "torch.no_grad() (or torch.inference_mode()) or detach the inputs")


def _options(call, head_dim: int, causal, window_size, softmax_scale, softcap):
    for name, value in cache_options(head_dim, causal, window_size, softmax_scale, softcap).items():
        setattr(call, name, value)


def _alibi(slopes):
    if slopes is None:
        return None
    if not isinstance(slopes, torch.Tensor):
        raise TypeError("attention: alibi_slopes must be a tensor of shape (Hq,) or (B, Hq)")
    return slopes.detach().to(torch.float32).contiguous()


def _unit_rows(t):
    """An index tensor with unit-stride rows, as the core reads it (anything else
    goes on to the core's checks as given)."""
    if isinstance(t, torch.Tensor) and t.dim() > 0 and t.stride(-1) != 1:
        return t.contiguous()
    return t


def _run(call, q, k_cache, v_cache, k=None, v=None, out=None, lse=None, cache_seqlens=None,
         cu_seqlens_q=None, cu_seqlens_k=None, block_table=None, alibi_slopes=None):
    if not (q.is_cuda or q.is_cpu):
        raise ValueError(f"attention: device type {q.device.type} is not supported (cpu or cuda)")
    _core.attention_cache_torch(call, q, k_cache, v_cache, k, v, out, lse, cache_seqlens,
                                cu_seqlens_q, cu_seqlens_k, block_table, alibi_slopes)


def _query(q: torch.Tensor) -> torch.Tensor:
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"attention: q must be a torch.Tensor, got {type(q).__name__}")
    return q if q.dim() == 0 or q.stride(-1) == 1 else q.contiguous()  # (the core checks ranks)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, *, cache_seqlens,
                            block_table=None, causal=False, window_size=(-1, -1),
                            softmax_scale=None, softcap=0.0, alibi_slopes=None, num_splits=0,
                            return_lse=False):
    """One decode step over a KV cache; see docs/attention.md.

    q (B, Sq, Hq, D). k_cache, v_cache: dense (B, capacity, Hkv, D), or paged
    (num_blocks, block_size, Hkv, D) with ``block_table`` (B, max_blocks) int32.
    ``cache_seqlens``: int or (B,) int32 tensor, rows already cached. k, v
    (B, S_new, Hkv, D), when given, are written in place at rows
    ``cache_seqlens[b] ...`` of each sequence's cache before the attention,
    which then covers ``cache_seqlens[b] + S_new`` keys (``cache_seqlens`` is
    not updated). Returns ``out`` (B, Sq, Hq, D), or ``(out, lse)`` with
    ``lse`` (B, Hq, Sq) float32. Forward only.
    """
    done = _core.attention_kvcache_eager(q, k_cache, v_cache, k, v, cache_seqlens, block_table,
                                         causal, window_size, softmax_scale, softcap,
                                         alibi_slopes, num_splits, return_lse)
    if done is not None:  # the whole call in C++ (outputs from its pools)
        return done
    q = _query(q)
    _no_grad_needed(q, k_cache, v_cache, k, v)
    if isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        cache_seqlens = torch.full((q.shape[0] if q.dim() == 4 else 1,),
                                   int32_value(cache_seqlens, "cache_seqlens"),
                                   dtype=torch.int32, device=q.device)
    cache_seqlens, block_table = _unit_rows(cache_seqlens), _unit_rows(block_table)
    k = k.contiguous() if isinstance(k, torch.Tensor) and k.stride(-1) != 1 else k
    v = v.contiguous() if isinstance(v, torch.Tensor) and v.stride(-1) != 1 else v
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse_shape = (q.shape[0], q.shape[2], q.shape[1]) if q.dim() == 4 else (0, 0, 0)
    lse = torch.empty(lse_shape, dtype=torch.float32, device=q.device)
    call = _core.AttentionCacheCall()
    _options(call, q.shape[-1] if q.dim() else 1, causal, window_size, softmax_scale, softcap)
    call.num_splits = as_int(num_splits, "num_splits")
    _run(call, q, k_cache, v_cache, k, v, out, lse, cache_seqlens=cache_seqlens,
         block_table=block_table, alibi_slopes=_alibi(alibi_slopes))
    return (out, lse) if return_lse else out


def paged_varlen(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, block_table, *,
                 bias, mask, dropout_p, causal, window_size, softmax_scale, softcap, alibi_slopes,
                 return_lse):
    """``flash_attn_varlen_func`` over a paged cache: sequence b has the queries
    q[cu_seqlens_q[b]:cu_seqlens_q[b+1]] and the keys of cache rows
    0 .. cu_seqlens_k[b+1] - cu_seqlens_k[b] - 1, found through block_table."""
    for name, given in (("bias", bias is not None), ("mask", mask is not None),
                        ("dropout_p", dropout_p != 0)):
        if given:
            raise ValueError(f"attention: {name} is not supported with block_table (paged KV "
                             "supports causal, window_size, softcap, alibi_slopes and GQA)")
    q = _query(q)
    _no_grad_needed(q, k_cache, v_cache)
    cu_seqlens_q, cu_seqlens_k = _unit_rows(cu_seqlens_q), _unit_rows(cu_seqlens_k)
    block_table = _unit_rows(block_table)
    # Rows outside every sequence are never written: zero output, lse -inf.
    out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]) if q.dim() == 3 else (0, 0), float("-inf"),
                     dtype=torch.float32, device=q.device)
    call = _core.AttentionCacheCall()
    call.max_seqlen_q = as_int(max_seqlen_q, "max_seqlen_q")
    _options(call, q.shape[-1] if q.dim() else 1, causal, window_size, softmax_scale, softcap)
    _run(call, q, k_cache, v_cache, out=out, lse=lse, cu_seqlens_q=cu_seqlens_q,
         cu_seqlens_k=cu_seqlens_k, block_table=block_table, alibi_slopes=_alibi(alibi_slopes))
    return (out, lse) if return_lse else out


def kvcache_check(device=None) -> None:
    """Waits for the current stream of ``device`` (a CUDA device; default the
    current one) and raises the error a KV-cache call recorded there (a block
    id out of range or a cache too small for the appended rows), then clears
    it. A later call on the device raises it too, without waiting."""
    if not getattr(_core, "attention_has_cuda", False) or not torch.cuda.is_available():
        return
    dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    if dev.type != "cuda":
        return
    index = torch.cuda.current_device() if dev.index is None else dev.index
    stream = torch.cuda.current_stream(index).cuda_stream
    _core.attention_cache_check_cuda(index, stream, True)
