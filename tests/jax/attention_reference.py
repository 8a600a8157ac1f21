"""An fp32 jnp attention with the semantics of symheap's attention (bottom-right
aligned window, bias, bool mask, alibi, softcap, dropout keep mask), and the
random cases the jax attention tests share. No tests here."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from symheap import _core


def dropout_keep(seed, offset, B, Hq, Sq, Sk, p):
    """(B, Hq, Sq, Sk) bool: the keep mask of the counter-based generator."""
    out = np.empty((B, Hq, Sq, Sk), dtype=bool)
    for b in range(B):
        for h in range(Hq):
            raw = _core.attention_dropout_keep(seed, offset, b * Hq + h, Sq, Sk, float(p))
            out[b, h] = np.frombuffer(raw, dtype=np.uint8).reshape(Sq, Sk) != 0
    return jnp.asarray(out)


def _to4(x):
    return None if x is None else x.reshape((1,) * (4 - x.ndim) + x.shape)


def _heads_to_q(x, hq):
    h = x.shape[1]
    return x if h in (1, hq) else jnp.repeat(x, hq // h, axis=1)


def reference(q, k, v, *, causal=False, window_size=(-1, -1), softmax_scale=None, softcap=0.0,
              bias=None, mask=None, alibi_slopes=None, dropout_p=0.0, keep=None):
    """(out, lse) in fp32 for (B, S, H, D) inputs (rows with no visible key: 0, -inf)."""
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    B, Sq, Hq, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(D) if softmax_scale is None else softmax_scale
    k = jnp.repeat(k, Hq // Hkv, axis=2)
    v = jnp.repeat(v, Hq // Hkv, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision="highest") * scale
    if softcap > 0:
        s = softcap * jnp.tanh(s / softcap)
    if bias is not None:
        s = s + _heads_to_q(_to4(bias.astype(jnp.float32)), Hq)
    i = jnp.arange(Sq)[:, None]
    j = jnp.arange(Sk)[None, :]
    diag = i + (Sk - Sq)
    if alibi_slopes is not None:
        slopes = jnp.asarray(alibi_slopes, jnp.float32).reshape(-1, Hq, 1, 1)
        s = s - slopes * jnp.abs(diag - j)
    left, right = window_size
    if causal:
        right = 0
    visible = jnp.ones((Sq, Sk), bool)
    if left >= 0:
        visible &= j >= diag - left
    if right >= 0:
        visible &= j <= diag + right
    visible = visible[None, None]
    if mask is not None:
        visible = visible & _heads_to_q(_to4(mask), Hq)
    visible = jnp.broadcast_to(visible, s.shape)
    s = jnp.where(visible, s, -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1)
    any_visible = visible.any(-1, keepdims=True)
    p = jnp.where(any_visible, jnp.exp(jnp.where(any_visible, s, 0.0) - jnp.where(
        jnp.isfinite(lse), lse, 0.0)[..., None]), 0.0)
    if dropout_p > 0:
        p = jnp.where(keep, p, 0.0) / (1.0 - dropout_p)
    out = jnp.einsum("bhqk,bkhd->bqhd", p, v, precision="highest")
    return out, lse


def randn(key, shape, dtype):
    return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def make_case(seed, *, B=2, Sq=24, Sk=40, Hq=4, Hkv=2, D=32, dtype=jnp.float32, bias_shape=None,
              mask_shape=None, alibi_shape=None):
    keys = jax.random.split(jax.random.PRNGKey(seed), 6)
    case = {"q": randn(keys[0], (B, Sq, Hq, D), dtype), "k": randn(keys[1], (B, Sk, Hkv, D), dtype),
            "v": randn(keys[2], (B, Sk, Hkv, D), dtype), "kw": {}}
    if bias_shape is not None:
        case["kw"]["bias"] = (0.5 * randn(keys[3], bias_shape, jnp.float32)).astype(dtype)
    if mask_shape is not None:
        m = jax.random.uniform(keys[4], mask_shape) > 0.25
        if len(mask_shape) >= 2 and mask_shape[-2] > 3:
            m = m.at[..., 3, :].set(False)  # a row with no visible key
        case["kw"]["mask"] = m
    if alibi_shape is not None:
        slopes = np.array([2.0 ** (-8.0 * (h + 1) / Hq) for h in range(Hq)], np.float32)
        case["kw"]["alibi_slopes"] = jnp.asarray(np.broadcast_to(slopes, alibi_shape).copy())
    return case
