"""Attention over a KV cache for JAX (inference, forward only): the decode call
``flash_attn_with_kvcache`` and the paged path of ``flash_attn_varlen_func``,
through the XLA FFI handler of src/xla_ffi/attention_kvcache_ffi.cpp. See
docs/jax_attention.md, "KV caches".

Every check is the C++ one (src/ops/attention/decode_args.cpp): at trace time
on the shapes (ValueError, the torch front end's message), and again by the
handler on the buffers; the cpu handler also checks every length and block id
before it writes (an error of the compiled call, same message).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .. import _core
from .._attention_args import as_int, cache_options, fail as _fail, int32_value
from . import _ffi
from ._attention import _spec, _union_axes, _vary

_TARGET = "symheap_attention_kvcache"
# Trace-time descriptors carry this non-null, 16-byte aligned address: the
# checks read shapes, dtypes and strides, never data.
_PLACEHOLDER = 256


def _row_major(shape) -> list:
    strides, step = [], 1
    for d in reversed(shape):
        strides.append(step)
        step *= max(int(d), 1)
    return strides[::-1]


def _describe(call, name: str, x):
    if x is None:
        return
    shape, dtype = _spec(x, name)
    call.set_tensor(name, _PLACEHOLDER, dtype, list(shape), _row_major(shape))


def _int_array(x, name: str):
    if x is None or not (hasattr(x, "shape") and hasattr(x, "dtype")):
        raise TypeError(f"attention: {name} must be an int32 jax array")
    return x


def _forward_only(fn):
    """``fn`` with a reverse-mode rule that refuses: attention over a KV cache
    has no gradient (as in torch, where inputs requiring grad raise)."""
    f = jax.custom_vjp(fn)

    def fwd(*args):
        _fail("attention over a KV cache is forward only; it has no gradient (wrap its "
              "inputs in jax.lax.stop_gradient to differentiate around it)")

    f.defvjp(fwd, lambda res, g: None)
    return f


def _gpu_of(q):
    """The CUDA ordinal the call will run on: q's device when q is a concrete
    array, else (under jit) the first local GPU when GPUs are JAX's default
    backend; None for the cpu."""
    if isinstance(q, jax.Array) and not isinstance(q, jax.core.Tracer):
        try:
            device = next(iter(q.devices()))
        except Exception:  # noqa: BLE001 - a deleted or otherwise unplaced array
            device = None
        if device is not None:
            return device.local_hardware_id if device.platform == "gpu" else None
    if jax.default_backend() == "gpu":
        return jax.local_devices(backend="gpu")[0].local_hardware_id
    return None


def _run(operands: dict, *, varlen: bool, appends: bool, max_seqlen_q: int, options: dict,
         num_splits: int):
    """Checks the call at trace time, sizes its scratch and runs the handler.
    ``operands``: name -> array or None, in the handler's operand order."""
    call = _core.AttentionCacheCall()
    for name, x in operands.items():
        _describe(call, name, x)
    q = operands["q"]
    out_shape, dtype = _spec(q, "q")
    if varlen:
        lse_shape = (out_shape[1], out_shape[0]) if len(out_shape) == 3 else (0, 0)
    else:
        lse_shape = (out_shape[0], out_shape[2], out_shape[1]) if len(out_shape) == 4 else (0, 0, 0)
    _describe(call, "out", q)
    call.set_tensor("lse", _PLACEHOLDER, "float32", list(lse_shape), _row_major(lse_shape))
    call.max_seqlen_q = max_seqlen_q
    call.scale, call.softcap = options["scale"], options["softcap"]
    call.window_left, call.window_right = options["window_left"], options["window_right"]
    call.num_splits = num_splits
    _core.xla_attention_kvcache_validate(call)  # ValueError at trace time, torch's message

    scratch = 1
    device = _gpu_of(q)
    if device is not None:
        if not hasattr(_core, "xla_attention_kvcache_cuda_plan"):
            _fail("q is on a GPU but symheap was built without CUDA")
        # The split count is chosen here and pinned, so the scratch (the split
        # partials) has the right size on every device the program runs on.
        num_splits, nbytes = _core.xla_attention_kvcache_cuda_plan(call, device)
        scratch = max(int(nbytes), 1)

    cache_shape, cache_dtype = _spec(operands["k_cache"], "k_cache")
    results = [(out_shape, dtype), (lse_shape, "float32")]
    aliases = ()
    if appends:
        results += [(cache_shape, cache_dtype), (cache_shape, cache_dtype)]
        aliases = ((1, 2), (2, 3))  # k_cache, v_cache -> the updated caches
    results.append(((scratch,), "uint8"))
    arrays = [x for x in operands.values() if x is not None]
    axes = _union_axes(arrays)
    attrs = dict(varlen=varlen, appends=appends, paged=operands.get("block_table") is not None,
                 has_alibi=operands.get("alibi_slopes") is not None,
                 max_seqlen_q=np.int64(max_seqlen_q), scale=np.float32(options["scale"]),
                 softcap=np.float32(options["softcap"]),
                 window_left=np.int64(options["window_left"]),
                 window_right=np.int64(options["window_right"]), num_splits=np.int64(num_splits))
    fn = _ffi.ffi_call(_TARGET, tuple(results), aliases)
    got = _vary(fn(*_vary(arrays, axes), **attrs)[:-1], axes)
    return tuple(got)


def _alibi(slopes):
    if slopes is None:
        return None
    _spec(slopes, "alibi_slopes")
    return jnp.asarray(slopes, jnp.float32)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, *, cache_seqlens,
                            block_table=None, causal=False, window_size=(-1, -1),
                            softmax_scale=None, softcap=0.0, alibi_slopes=None, num_splits=0,
                            return_lse=False):
    """One decode step over a KV cache, as ``symheap.attention.flash_attn_with_kvcache``.

    q (B, Sq, Hq, D). k_cache, v_cache: dense (B, capacity, Hkv, D), or paged
    (num_blocks, block_size, Hkv, D) with ``block_table`` (B, max_blocks) int32.
    ``cache_seqlens``: int or (B,) int32 array, rows already cached. k, v
    (B, S_new, Hkv, D), when given, are written at rows ``cache_seqlens[b] ...``
    of each sequence's cache before the attention, which then covers
    ``cache_seqlens[b] + S_new`` keys.

    JAX arrays are immutable, so the updated caches are returned:
    ``(out, k_cache, v_cache)`` when k, v are given, else ``out``; with
    ``return_lse``, ``out`` is followed by ``lse`` (B, Hq, Sq) float32. The
    updated caches are aliased to the input caches: under
    ``jax.jit(..., donate_argnums=...)`` donating the caches, the append happens
    in place with no copy (without donation XLA copies each cache first).
    Forward only: differentiating through it raises ValueError.
    """
    _spec(q, "q")
    if isinstance(cache_seqlens, (int, np.integer)) and not isinstance(cache_seqlens, bool):
        cache_seqlens = jnp.full((q.shape[0] if q.ndim == 4 else 1,),
                                 int32_value(cache_seqlens, "cache_seqlens"), jnp.int32)
    cache_seqlens = _int_array(cache_seqlens, "cache_seqlens")
    if block_table is not None:
        block_table = _int_array(block_table, "block_table")
    options = cache_options(q.shape[-1], causal, window_size, softmax_scale, softcap)
    appends = k is not None or v is not None
    splits = as_int(num_splits, "num_splits")

    def call(q, k_cache, v_cache, k, v, cache_seqlens, block_table, alibi):
        operands = dict(q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v,
                        cache_seqlens=cache_seqlens, block_table=block_table, alibi_slopes=alibi)
        return _run(operands, varlen=False, appends=appends, max_seqlen_q=0, options=options,
                    num_splits=splits)

    got = _forward_only(call)(q, k_cache, v_cache, k, v, cache_seqlens, block_table,
                              _alibi(alibi_slopes))
    out, lse = got[0], got[1]
    head = (out, lse) if return_lse else (out,)
    if appends:
        return head + (got[2], got[3])
    return head if return_lse else out


def paged_varlen(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, block_table, *,
                 bias, mask, dropout_p, causal, window_size, softmax_scale, softcap, alibi_slopes,
                 return_lse):
    """``flash_attn_varlen_func`` over a paged cache: sequence b has the queries
    q[cu_seqlens_q[b]:cu_seqlens_q[b+1]] and the keys of cache rows
    0 .. cu_seqlens_k[b+1] - cu_seqlens_k[b] - 1, found through block_table.
    Rows outside every sequence get zeros (lse -inf)."""
    for name, given in (("bias", bias is not None), ("mask", mask is not None),
                        ("dropout_p", dropout_p != 0)):
        if given:
            _fail(f"{name} is not supported with block_table (paged KV supports causal, "
                  "window_size, softcap, alibi_slopes and GQA)")
    _spec(q, "q")
    cu_seqlens_q = _int_array(cu_seqlens_q, "cu_seqlens_q")
    cu_seqlens_k = _int_array(cu_seqlens_k, "cu_seqlens_k")
    block_table = _int_array(block_table, "block_table")
    max_q = as_int(max_seqlen_q, "max_seqlen_q")
    options = cache_options(q.shape[-1], causal, window_size, softmax_scale, softcap)

    def call(q, k_cache, v_cache, cu_q, cu_k, block_table, alibi):
        operands = dict(q=q, k_cache=k_cache, v_cache=v_cache, cu_seqlens_q=cu_q,
                        cu_seqlens_k=cu_k, block_table=block_table, alibi_slopes=alibi)
        return _run(operands, varlen=True, appends=False, max_seqlen_q=max_q, options=options,
                    num_splits=0)

    out, lse = _forward_only(call)(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, block_table,
                                   _alibi(alibi_slopes))
    return (out, lse) if return_lse else out


def kvcache_check(*wait_for) -> None:
    """CUDA: waits for ``wait_for`` (arrays or pytrees of arrays, e.g. the last
    call's outputs), then raises the error a KV-cache call recorded on any local
    GPU (a block id out of range, a cache too small for the appended rows) as
    ValueError, and clears it. A later call on that device raises it too (as an
    error of that call). Nothing to do on the cpu, whose handler raises at once."""
    jax.block_until_ready(wait_for)
    if not hasattr(_core, "attention_cache_check_cuda"):
        return
    try:
        gpus = jax.local_devices(backend="gpu")
    except RuntimeError:
        return
    for d in gpus:
        _core.attention_cache_check_cuda(d.local_hardware_id, 0, False)
