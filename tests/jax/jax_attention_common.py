"""Shared by the jax attention tests (cpu in tests/jax, CUDA in tests/gpu): an fp32 jnp attention with the semantics of symheap's attention (bottom-right
aligned window, bias, bool mask, alibi, softcap, dropout keep mask), and the
random cases, and the comparisons. No tests here."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

import symheap.jax as shj

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
              bias=None, mask=None, alibi_slopes=None, dropout_p=0.0, keep=None, lengths=None):
    """(out, lse) in fp32 for (B, S, H, D) inputs (rows with no visible key: 0, -inf).
    ``lengths`` = (lens_q, lens_k) of shape (B,): sequence b has only its first
    lens_q[b] queries and lens_k[b] keys (the padded form of a varlen batch)."""
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
    i = jnp.arange(Sq)[None, :, None]
    j = jnp.arange(Sk)[None, None, :]
    if lengths is None:
        lq, lk = jnp.full((1, 1, 1), Sq), jnp.full((1, 1, 1), Sk)
    else:
        lq, lk = (jnp.asarray(x).reshape(-1, 1, 1) for x in lengths)
    diag = (i + (lk - lq))[:, None]  # (B or 1, 1, Sq, 1)
    j = j[:, None]
    if alibi_slopes is not None:
        slopes = jnp.asarray(alibi_slopes, jnp.float32).reshape(-1, Hq, 1, 1)
        s = s - slopes * jnp.abs(diag - j)
    left, right = window_size
    if causal:
        right = 0
    visible = ((i < lq) & (j[:, 0] < lk))[:, None]
    if left >= 0:
        visible &= j >= diag - left
    if right >= 0:
        visible &= j <= diag + right
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


# Each case combines a few features; together they cover every option.
FEATURE_CASES = [
    ("plain", {}, {}),
    ("causal_alibi", {"alibi_shape": (4,)}, {"causal": True}),
    ("window_softcap_scale_bias_kv_rowless", {"bias_shape": (2, 2, 1, 40)},
     {"window_size": (5, 3), "softcap": 2.5, "softmax_scale": 0.3}),
    ("window_left_causal_alibi_per_batch_mask", {"alibi_shape": (2, 4), "mask_shape": (2, 1, 24, 40)},
     {"window_size": (7, -1), "causal": True}),
    ("bias_full_mask_kv_heads", {"bias_shape": (2, 4, 24, 40), "mask_shape": (1, 2, 24, 40)}, {}),
    ("bias_2d_dropout", {"bias_shape": (24, 40)}, {"dropout_p": 0.2, "seed": 11}),
    ("bias_1d_head_dim_20_causal", {"bias_shape": (40,), "D": 20}, {"causal": True}),
    ("bias_3d_softcap_dropout_offset", {"bias_shape": (4, 24, 40)},
     {"softcap": 4.0, "dropout_p": 0.3, "seed": (5, 9)}),
    ("mqa_head_dim_1_bias", {"Hkv": 1, "D": 1, "bias_shape": (1, 1, 24, 40)}, {}),
]

TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2, jnp.float16: 4e-3}


def err(x, ref):
    return float(jnp.max(jnp.abs(x.astype(jnp.float32) - ref.astype(jnp.float32))))


def scale_of(ref):
    return max(1.0, float(jnp.max(jnp.abs(ref))))


def grads(fn, args, dout):
    """Gradients of sum(fn(*args) * dout) with respect to every arg."""
    return jax.grad(lambda *a: jnp.sum(fn(*a).astype(jnp.float32) * dout),
                    argnums=tuple(range(len(args))))(*args)


def with_grads(fn, dout):
    """One jitted program: (out, lse) = fn(*args) and the gradients of
    sum(out * dout) with respect to every arg (one compile per case)."""
    def run(*args):
        (out, lse), pullback = jax.vjp(fn, *args)
        return out, lse, pullback((dout.astype(out.dtype), jnp.zeros_like(lse)))
    return jax.jit(run)


def compare(case, dtype, **options):
    """Runs the op inside jit; checks out, lse and dq, dk, dv (and dbias) against
    the fp32 reference on the same (rounded) inputs."""
    q, k, v, kw = case["q"], case["k"], case["v"], dict(case["kw"])
    bias = kw.pop("bias", None)
    ref_kw = dict(kw, **options)
    if options.get("dropout_p", 0) > 0:
        s, o = options["seed"] if isinstance(options["seed"], tuple) else (options["seed"], 0)
        ref_kw["keep"] = dropout_keep(s, o, q.shape[0], q.shape[2], q.shape[1], k.shape[1],
                                      options["dropout_p"])
    for name in ("seed", "backend", "deterministic"):  # how ours runs, not what it computes
        ref_kw.pop(name, None)

    def ours(q, k, v, *b):
        return shj.flash_attn_func(q, k, v, bias=b[0] if b else None, return_lse=True, **kw,
                                   **options)

    args = (q, k, v) + ((bias,) if bias is not None else ())
    # dout in the input dtype, so the reference sees the same rounded values.
    dout = randn(jax.random.PRNGKey(99), q.shape[:3] + (v.shape[-1],), dtype).astype(jnp.float32)
    out, lse, got = with_grads(ours, dout)(*args)

    def ref_fn(q, k, v, *b):
        return reference(q, k, v, bias=b[0] if b else None, **ref_kw)

    ref, ref_lse, want = with_grads(ref_fn, dout)(*[a.astype(jnp.float32) for a in args])
    tol = TOL[dtype]
    assert out.shape == q.shape[:3] + (v.shape[-1],) and out.dtype == q.dtype
    assert not bool(jnp.isnan(out).any())
    assert err(out, ref) <= tol * scale_of(ref), err(out, ref)
    fin = jnp.isfinite(ref_lse)
    assert bool(jnp.array_equal(jnp.isfinite(lse), fin))
    assert bool((lse[~fin] == -jnp.inf).all())
    assert float(jnp.max(jnp.abs(jnp.where(fin, lse - ref_lse, 0.0)))) < 1e-3
    for name, g, r, a in zip(("dq", "dk", "dv", "dbias"), got, want, args):
        assert g.shape == a.shape and g.dtype == a.dtype, name
        assert not bool(jnp.isnan(g).any()), name
        assert err(g, r) <= 3 * tol * scale_of(r), (name, err(g, r))
    return out


def varlen_case(dtype, seed=0, Hq=4, Hkv=2, D=24):
    lens_q, lens_k = [5, 0, 17, 9], [7, 3, 17, 20]
    pad_q, pad_k = 3, 2  # rows after the last sequence: outside every sequence
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    keys = jax.random.split(jax.random.PRNGKey(seed), 3)
    q = randn(keys[0], (int(cu_q[-1]) + pad_q, Hq, D), dtype)
    k = randn(keys[1], (int(cu_k[-1]) + pad_k, Hkv, D), dtype)
    v = randn(keys[2], (int(cu_k[-1]) + pad_k, Hkv, D), dtype)
    return q, k, v, cu_q, cu_k, max(lens_q), max(lens_k)


def to_padded(x, cu, m):
    """(total, H, D) packed rows -> (B, m, H, D), zero past each sequence's end."""
    cu = jnp.asarray(cu)
    lens = cu[1:] - cu[:-1]
    pos = jnp.arange(m)[None, :]
    idx = jnp.clip(cu[:-1, None] + pos, 0, x.shape[0] - 1)
    valid = pos < lens[:, None]
    return jnp.where(valid[..., None, None], x[idx], 0)


def check_varlen(dtype, options, D=24):
    """Varlen inside jit against the reference on the padded batch; rows outside
    every sequence must come back as zeros (lse -inf)."""
    q, k, v, cu_q, cu_k, mq, mk = varlen_case(dtype, D=D)
    B, Hq = len(cu_q) - 1, q.shape[1]
    options = dict(options)
    kw = {}
    gen = np.random.default_rng(1)
    bias_kind = options.pop("bias", None)
    if bias_kind:
        shape = (B, Hq, mq, mk) if bias_kind == "per_row" else (1, Hq, 1, mk)
        kw["bias"] = jnp.asarray(gen.standard_normal(shape) * 0.5, jnp.float32).astype(dtype)
    if options.pop("mask", None):
        kw["mask"] = jnp.asarray(gen.random((B, 1, mq, mk)) > 0.2)
    if options.pop("alibi", None):
        kw["alibi_slopes"] = jnp.asarray([2.0 ** (-h - 1) for h in range(Hq)], jnp.float32)
    cu_qj, cu_kj = jnp.asarray(cu_q), jnp.asarray(cu_k)
    args = (q, k, v) + ((kw["bias"],) if "bias" in kw else ())
    rest = {key: val for key, val in kw.items() if key != "bias"}

    def ours(q, k, v, *b):
        return shj.flash_attn_varlen_func(q, k, v, cu_qj, cu_kj, mq, mk, return_lse=True,
                                          bias=b[0] if b else None, **rest, **options)

    dout = randn(jax.random.PRNGKey(5), q.shape, dtype).astype(jnp.float32)
    out, lse, got = with_grads(ours, dout)(*args)

    ref_kw = dict(rest, **options)
    ref_kw.pop("seed", None)
    if options.get("dropout_p", 0) > 0:
        ref_kw["keep"] = dropout_keep(options["seed"], 0, B, Hq, mq, mk, options["dropout_p"])
    lengths = (cu_qj[1:] - cu_qj[:-1], cu_kj[1:] - cu_kj[:-1])

    def ref_fn(q, k, v, *b):
        return reference(to_padded(q, cu_q, mq), to_padded(k, cu_k, mk), to_padded(v, cu_k, mk),
                         bias=b[0] if b else None, lengths=lengths, **ref_kw)

    def ref_run(*args):
        (ref, ref_lse), pullback = jax.vjp(ref_fn, *args)
        return ref, ref_lse, pullback((to_padded(dout, cu_q, mq), jnp.zeros_like(ref_lse)))

    ref, ref_lse, want = jax.jit(ref_run)(*[a.astype(jnp.float32) for a in args])
    tol = TOL[dtype]
    valid = (jnp.arange(mq)[None, :] < lengths[0][:, None])  # (B, mq)
    out_p = to_padded(out, cu_q, mq)
    assert err(out_p, ref) <= tol * scale_of(ref), err(out_p, ref)
    lse_p = jnp.swapaxes(to_padded(jnp.swapaxes(lse, 0, 1)[..., None], cu_q, mq)[..., 0], 1, 2)
    fin = jnp.isfinite(ref_lse)
    v3 = valid[:, None, :]
    assert bool(jnp.array_equal(jnp.where(v3, jnp.isfinite(lse_p), False), fin))
    assert float(jnp.max(jnp.abs(jnp.where(fin, lse_p - ref_lse, 0.0)))) < 1e-3
    # Rows outside every sequence: zero output, zero gradient, lse -inf.
    tail_q, tail_k = int(cu_q[-1]), int(cu_k[-1])
    assert bool((out[tail_q:] == 0).all()) and bool((lse[:, tail_q:] == -jnp.inf).all())
    assert bool((got[0][tail_q:] == 0).all()) and bool((got[1][tail_k:] == 0).all())
    for name, gv, r in zip(("dq", "dk", "dv", "dbias"), got, want):
        assert not bool(jnp.isnan(gv).any()), name
        assert err(gv, r) <= 3 * tol * scale_of(r), (name, err(gv, r))
