"""Attention for JAX: the op core behind XLA FFI custom calls, differentiable
through ``jax.custom_vjp``. See docs/jax_attention.md.

The arguments are checked at trace time by the same C++ code as the torch
front end (``_core.attention_plan_call``); the handlers check them again
from the buffers. Options (causal, window, scale, softcap, dropout and its
seed) are static: a new value compiles a new program.
"""
from __future__ import annotations

import functools
import threading
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from .. import _core
from .._attention_args import as_int as _as_int, fail as _fail, seed_pair, window_pair

_FWD = "symheap_attention_fwd"
_BWD = "symheap_attention_bwd"

_register_lock = threading.Lock()
_registered = False


def _has_backend(platform: str) -> bool:
    try:
        return bool(jax.devices("gpu" if platform == "CUDA" else platform))
    except RuntimeError:
        return False


def _register_targets():
    """Registers the handlers with XLA once per process, after the backends
    exist (registering before jax.devices() is lost on cpu)."""
    global _registered
    if _registered:
        return
    with _register_lock:
        if _registered:
            return
        if not hasattr(_core, "xla_attention_targets"):
            raise RuntimeError("symheap was built without the XLA FFI handlers (no jaxlib FFI headers "
                               "at build time); reinstall symheap with jax installed")
        jax.devices()
        for platform, targets in _core.xla_attention_targets().items():
            if targets and not _has_backend(platform):
                continue  # e.g. a CUDA build of symheap under a cpu-only jax
            for name, capsule in targets.items():
                jax.ffi.register_ffi_target(name, capsule, platform=platform)
        _registered = True


def _spec(x, name: str):
    """(shape, dtype name) of an array argument, or None."""
    if x is None:
        return None
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        raise TypeError(f"attention: {name} must be a jax array, got {type(x).__name__}")
    return tuple(int(d) for d in x.shape), np.dtype(x.dtype).name


def _seed(seed, dropout_p: float):
    """(seed, offset) of a call; dropout needs an explicit, static seed (JAX
    has no global generator)."""
    if dropout_p == 0:
        return 0, 0
    if seed is None:
        _fail("dropout_p > 0 needs seed= (an int or a (seed, offset) pair of Python ints)")
    return seed_pair(seed)


class _Options(NamedTuple):
    """The static part of a call: one compiled custom_vjp per distinct value."""
    varlen: bool
    max_seqlen_q: int
    max_seqlen_k: int
    causal: bool
    window: tuple
    softmax_scale: Optional[float]
    softcap: float
    dropout_p: float
    seed: int
    offset: int
    deterministic: bool
    backend: str        # "auto", "cudnn", "own"; "" = $SYMHEAP_ATTN_BACKEND when the call runs
    has_bias: bool
    has_mask: bool
    has_alibi: bool
    # The scratch result sets aside cuDNN's workspace (on CUDA; the own backward
    # takes its fused dQ's fp32 accumulator from it).
    cudnn_scratch: bool


def _attrs(o: _Options) -> dict:
    return dict(
        varlen=o.varlen, has_bias=o.has_bias, has_mask=o.has_mask, has_alibi=o.has_alibi,
        max_seqlen_q=np.int64(o.max_seqlen_q), max_seqlen_k=np.int64(o.max_seqlen_k),
        causal=o.causal, window_left=np.int64(o.window[0]), window_right=np.int64(o.window[1]),
        has_scale=o.softmax_scale is not None,
        softmax_scale=np.float32(0.0 if o.softmax_scale is None else o.softmax_scale),
        softcap=np.float32(o.softcap), dropout_p=np.float32(o.dropout_p),
        seed=np.uint64(o.seed), offset=np.uint64(o.offset), deterministic=o.deterministic,
        backend=o.backend)


@functools.lru_cache(maxsize=None)
def _ffi(target: str, results: tuple):
    """One ffi_call wrapper per (target, result shapes and dtypes). Under
    jax.vmap it runs once per mapped element (the handlers take one call's
    shapes)."""
    shapes = [jax.ShapeDtypeStruct(shape, np.dtype(dtype)) for shape, dtype in results]
    return jax.ffi.ffi_call(target, shapes, vmap_method="sequential")


def _varying_axes(x) -> frozenset:
    """The shard_map mesh axes `x` varies over (empty outside shard_map)."""
    typeof = getattr(jax, "typeof", None)
    if typeof is None:
        return frozenset()
    t = typeof(x)
    mat = getattr(t, "manual_axis_type", None)
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(t, "vma", None) or ())


def _vary(xs, axes: frozenset):
    """Marks each array as varying over `axes` (an FFI call wants its operands
    to agree, and custom_vjp wants gradients typed like the primals)."""
    out = []
    for x in xs:
        missing = tuple(sorted(axes - _varying_axes(x)))
        out.append(jax.lax.pcast(x, missing, to="varying") if missing else x)
    return out


def _union_axes(xs) -> frozenset:
    axes = frozenset()
    for x in xs:
        axes |= _varying_axes(x)
    return axes


def _plan(o: _Options, q, k, v, bias, mask, alibi, cu_q, cu_k) -> dict:
    return _core.attention_plan_call(
        o.varlen, False, _spec(q, "q"), _spec(k, "k"), _spec(v, "v"), _spec(bias, "bias"),
        _spec(mask, "mask"), _spec(alibi, "alibi_slopes"), _spec(cu_q, "cu_seqlens_q"),
        _spec(cu_k, "cu_seqlens_k"), o.max_seqlen_q, o.max_seqlen_k, o.causal, o.window[0],
        o.window[1], o.softmax_scale, o.softcap, o.dropout_p)


def _operands(o: _Options, bias, mask, alibi, cu_q, cu_k):
    extra = []
    if o.has_bias:
        extra.append(bias)
    if o.has_mask:
        extra.append(mask)
    if o.has_alibi:
        extra.append(alibi)
    if o.varlen:
        extra += [cu_q, cu_k]
    return extra


def _forward(o: _Options, q, k, v, bias, mask, alibi, cu_q, cu_k):
    plan = _plan(o, q, k, v, bias, mask, alibi, cu_q, cu_k)
    hq = plan["heads_q"]
    lse_shape = (hq, q.shape[0]) if o.varlen else (plan["batch"], hq, plan["seqlen_q"])
    scratch = plan["scratch_forward"] + (plan["cudnn_reserve_forward"] if o.cudnn_scratch else 0)
    results = ((tuple(q.shape), np.dtype(q.dtype).name), (lse_shape, "float32"),
               ((max(scratch, 1),), "uint8"))
    operands = [q, k, v, *_operands(o, bias, mask, alibi, cu_q, cu_k)]
    axes = _union_axes(operands)
    out, lse, _ = _ffi(_FWD, results)(*_vary(operands, axes), **_attrs(o))
    out, lse = _vary((out, lse), axes)
    return out, lse


def _backward(o: _Options, q, k, v, bias, mask, alibi, cu_q, cu_k, out, lse, dout):
    plan = _plan(o, q, k, v, bias, mask, alibi, cu_q, cu_k)
    results = [(tuple(q.shape), np.dtype(q.dtype).name), (tuple(k.shape), np.dtype(k.dtype).name),
               (tuple(v.shape), np.dtype(v.dtype).name)]
    if o.has_bias:
        results.append((tuple(bias.shape), np.dtype(bias.dtype).name))
    scratch = plan["scratch_backward"] + (plan["cudnn_reserve_backward"] if o.cudnn_scratch else 0)
    results.append(((max(scratch, 1),), "uint8"))
    operands = [q, k, v, out, lse, dout.astype(q.dtype),
                *_operands(o, bias, mask, alibi, cu_q, cu_k)]
    axes = _union_axes(operands)
    grads = _ffi(_BWD, tuple(results))(*_vary(operands, axes), want_dbias=o.has_bias, **_attrs(o))
    grads = _vary(grads[:-1], axes)
    dq, dk, dv = grads[:3]
    dbias = grads[3] if o.has_bias else None
    return dq, dk, dv, dbias


@functools.lru_cache(maxsize=None)
def _differentiable(o: _Options):
    """The custom_vjp function of one set of static options."""

    @jax.custom_vjp
    def attention(q, k, v, bias, mask, alibi, cu_q, cu_k):
        return _forward(o, q, k, v, bias, mask, alibi, cu_q, cu_k)

    def fwd(q, k, v, bias, mask, alibi, cu_q, cu_k):
        out, lse = _forward(o, q, k, v, bias, mask, alibi, cu_q, cu_k)
        return (out, lse), (q, k, v, bias, mask, alibi, cu_q, cu_k, out, lse)

    def bwd(res, cotangents):
        q, k, v, bias, mask, alibi, cu_q, cu_k, out, lse = res
        dout, _ = cotangents  # lse is returned under stop_gradient: its cotangent is zero
        dq, dk, dv, dbias = _backward(o, q, k, v, bias, mask, alibi, cu_q, cu_k, out, lse, dout)
        return dq, dk, dv, dbias, None, None, None, None

    attention.defvjp(fwd, bwd)
    return attention


def _call(q, k, v, *, varlen, cu_q=None, cu_k=None, max_seqlen_q=0, max_seqlen_k=0, causal,
          window_size, softmax_scale, softcap, bias, mask, alibi_slopes, dropout_p, seed,
          return_lse, deterministic, backend):
    for name, x in (("q", q), ("k", k), ("v", v)):
        _spec(x, name)
    # The core's rule, checked now for the default platform (a bad name, or a
    # forced "cudnn" where it cannot run, is an error at trace time); the
    # handler applies it again for the platform the call runs on.
    on_gpu = jax.default_backend() == "gpu"
    _core.attention_choose_path(backend, on_gpu)
    window = window_pair(window_size)
    scale = None if softmax_scale is None else float(softmax_scale)
    dropout_p = float(dropout_p)
    s, off = _seed(seed, dropout_p) if 0 <= dropout_p < 1 else (0, 0)
    if alibi_slopes is not None:
        _spec(alibi_slopes, "alibi_slopes")
        alibi_slopes = jnp.asarray(alibi_slopes, jnp.float32)
    o = _Options(varlen, _as_int(max_seqlen_q, "max_seqlen_q"), _as_int(max_seqlen_k, "max_seqlen_k"),
                 bool(causal), window, scale, float(softcap), dropout_p, s, off, bool(deterministic),
                 "" if backend is None else backend, bias is not None, mask is not None, alibi_slopes is not None,
                 on_gpu)
    _plan(o, q, k, v, bias, mask, alibi_slopes, cu_q, cu_k)  # errors at trace time
    _register_targets()
    # Under shard_map every operand varies over the same mesh axes; marking an
    # invariant one here (outside custom_vjp) lets autodiff sum its gradient.
    arrays = [q, k, v, bias, mask, alibi_slopes, cu_q, cu_k]
    given = [x for x in arrays if x is not None]
    it = iter(_vary(given, _union_axes(given)))
    arrays = [None if x is None else next(it) for x in arrays]
    out, lse = _differentiable(o)(*arrays)
    return (out, jax.lax.stop_gradient(lse)) if return_lse else out


def flash_attn_func(q, k, v, *, causal=False, window_size=(-1, -1), softmax_scale=None, softcap=0.0,
                    bias=None, mask=None, alibi_slopes=None, dropout_p=0.0, seed=None,
                    return_lse=False, deterministic=False, backend=None):
    """Attention over (B, S, H, D) arrays, as ``symheap.attention.flash_attn_func``.

    Returns ``out`` (B, Sq, Hq, D), or ``(out, lse)`` with ``lse`` (B, Hq, Sq)
    float32 (not differentiated) when ``return_lse``. Differentiable in q, k,
    v and bias (dbias has the bias's own shape and dtype). ``seed`` is a Python
    int or (seed, offset) pair and is required when ``dropout_p > 0``. ``backend``
    picks the CUDA path as in the torch function ("auto": cuDNN's fused attention
    for the calls it takes; "cudnn"; "own"; None: $SYMHEAP_ATTN_BACKEND, read when
    the call runs); the cpu platform always runs the cpu kernels.
    """
    return _call(q, k, v, varlen=False, causal=causal, window_size=window_size,
                 softmax_scale=softmax_scale, softcap=softcap, bias=bias, mask=mask,
                 alibi_slopes=alibi_slopes, dropout_p=dropout_p, seed=seed, return_lse=return_lse,
                 deterministic=deterministic, backend=backend)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                           causal=False, window_size=(-1, -1), softmax_scale=None, softcap=0.0,
                           bias=None, mask=None, alibi_slopes=None, dropout_p=0.0, seed=None,
                           return_lse=False, deterministic=False, backend=None, block_table=None):
    """Attention over packed sequences: q (total_q, Hq, D), k and v (total_k,
    Hkv, D), sequence b at rows cu_seqlens[b]:cu_seqlens[b+1] (int32 arrays);
    ``max_seqlen_q``/``max_seqlen_k`` are static Python ints. Rows outside
    every sequence get zeros (lse -inf). Returns ``out`` or ``(out, lse)``
    with ``lse`` (Hq, total_q). With ``block_table`` (B, max_blocks) int32, k
    and v are paged caches (num_blocks, block_size, Hkv, D) instead (forward
    only; see _kvcache.py).
    """
    if block_table is not None:
        from ._kvcache import paged_varlen
        return paged_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, block_table,
                            bias=bias, mask=mask, dropout_p=dropout_p, causal=causal,
                            window_size=window_size, softmax_scale=softmax_scale, softcap=softcap,
                            alibi_slopes=alibi_slopes, return_lse=return_lse)
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        _spec(cu, name)
    return _call(q, k, v, varlen=True, cu_q=cu_seqlens_q, cu_k=cu_seqlens_k,
                 max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, causal=causal,
                 window_size=window_size, softmax_scale=softmax_scale, softcap=softcap, bias=bias,
                 mask=mask, alibi_slopes=alibi_slopes, dropout_p=dropout_p, seed=seed,
                 return_lse=return_lse, deterministic=deterministic, backend=backend)
