"""symheap.jax attention on the cpu platform: outputs, lse and gradients against
jax.nn.dot_product_attention (xla) and an fp32 jnp reference, inside jit,
under shard_map over 2 devices, and bad input."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import pytest

pytest.importorskip("symheap._core")
from symheap import _core  # noqa: E402

if not getattr(_core, "built_with_xla_ffi", False):
    raise RuntimeError("symheap was built without the XLA FFI handlers (jaxlib's FFI headers "
                       "were not found at build time), so symheap.jax cannot run: rebuild "
                       "with jax installed")

import symheap.jax as shj  # noqa: E402
from attention_arg_forms import BAD_FORMS  # noqa: E402
from jax_attention_common import (FEATURE_CASES, check_varlen, compare, err,  # noqa: E402
                                  make_case, randn, scale_of, varlen_case, with_grads)

# ------------------------------------------------------------ against jax.nn.dot_product_attention

@pytest.mark.parametrize("causal,gqa", [(False, True), (True, False)])
def test_matches_jax_dot_product_attention(causal, gqa):
    """fp32 output and gradients (dq, dk, dv, dbias) equal jax's xla attention."""
    B, S, Hq, D = 2, 32, 4, 32
    Hkv = 2 if gqa else Hq
    keys = jax.random.split(jax.random.PRNGKey(int(causal) + 2 * int(gqa)), 5)
    q, k, v = (randn(keys[0], (B, S, Hq, D), jnp.float32), randn(keys[1], (B, S, Hkv, D), jnp.float32),
               randn(keys[2], (B, S, Hkv, D), jnp.float32))
    bias = 0.5 * randn(keys[3], (1, Hq, S, S), jnp.float32)
    mask = jax.random.uniform(keys[4], (B, 1, S, S)) > 0.2
    mask = mask.at[..., jnp.arange(S), jnp.arange(S)].set(True)  # no empty row (jax gives NaN-free mean there)

    def ours(q, k, v, bias):
        return shj.flash_attn_func(q, k, v, bias=bias, mask=mask, causal=causal)

    def theirs(q, k, v, bias):
        return jax.nn.dot_product_attention(q, k, v, bias=bias, mask=mask, is_causal=causal,
                                            implementation="xla")

    args = (q, k, v, bias)
    dout = randn(jax.random.PRNGKey(7), q.shape, jnp.float32)

    def both(fn):
        return with_grads(lambda *a: (fn(*a), jnp.zeros(())), dout)

    out, _, got = both(ours)(*args)
    ref, _, want = both(theirs)(*args)
    assert err(out, ref) < 2e-5
    for name, g, r in zip(("dq", "dk", "dv", "dbias"), got, want):
        assert err(g, r) < 5e-5 * scale_of(r), (name, err(g, r))


# ------------------------------------------------------------ every feature against the fp32 reference

# Every case in fp32; the ones that change the kernels' arithmetic in bf16 too.
BF16_CASES = ("plain", "window_softcap_scale_bias_kv_rowless", "bias_full_mask_kv_heads",
              "bias_3d_softcap_dropout_offset", "bias_1d_head_dim_20_causal")
FEATURE_GRID = [pytest.param(jnp.float32, *c, id=f"float32-{c[0]}") for c in FEATURE_CASES] + [
    pytest.param(jnp.bfloat16, *c, id=f"bfloat16-{c[0]}") for c in FEATURE_CASES if c[0] in BF16_CASES]


@pytest.mark.parametrize("dtype,name,case_kw,options", FEATURE_GRID)
def test_features(dtype, name, case_kw, options):
    case = make_case(hash(name) % 1000, dtype=dtype, **case_kw)
    compare(case, dtype, **options)


def test_check_grads():
    """jax.test_util.check_grads (reverse mode, finite differences in fp32)."""
    case = make_case(3, B=1, Sq=6, Sk=8, Hq=2, Hkv=1, D=8, bias_shape=(1, 2, 6, 8))
    q, k, v, bias = case["q"], case["k"], case["v"], case["kw"]["bias"]

    def f(q, k, v, bias):
        return shj.flash_attn_func(q, k, v, bias=bias, causal=True, softcap=3.0)

    from jax.test_util import check_grads
    check_grads(f, (q, k, v, bias), order=1, modes=["rev"], eps=1e-2, atol=2e-2,
                              rtol=2e-2)


def test_wrappers_are_memoized():
    from symheap.jax import _attention
    case = make_case(4)
    before = _attention._ffi.cache_info()
    for _ in range(3):
        shj.flash_attn_func(case["q"], case["k"], case["v"], causal=True)
    after = _attention._ffi.cache_info()
    assert after.misses - before.misses <= 1
    assert after.hits - before.hits >= 2


def test_vmap_runs_each_element():
    """jax.vmap over a leading axis: each element's output and gradient are those
    of its own call, and right against jax's xla attention."""
    keys = jax.random.split(jax.random.PRNGKey(7), 3)
    q, k, v = (randn(keys[i], (3, 1, 16, 2, 32), jnp.float32) for i in range(3))

    def f(q, k, v):
        return shj.flash_attn_func(q, k, v, causal=True)

    got = jax.vmap(f)(q, k, v)
    for i in range(3):
        assert err(got[i], f(q[i], k[i], v[i])) == 0.0
        ref = jax.nn.dot_product_attention(q[i], k[i], v[i], is_causal=True, implementation="xla")
        assert err(got[i], ref) < 1e-5
    dq = jax.grad(lambda q: jax.vmap(f)(q, k, v).sum())(q)
    for i in range(3):
        assert err(dq[i], jax.grad(lambda qi: f(qi, k[i], v[i]).sum())(q[i])) == 0.0


# ------------------------------------------------------------ varlen

VARLEN_OPTIONS = [
    ("causal", {"causal": True}),
    ("window_softcap", {"window_size": (4, 2), "softcap": 3.0}),
    ("bias_alibi", {"bias": "per_row", "alibi": True}),
    ("rowless_bias_mask_dropout", {"bias": "rowless", "mask": True, "dropout_p": 0.25, "seed": 3}),
]
VARLEN_GRID = [pytest.param(jnp.float32, o, id=f"float32-{n}") for n, o in VARLEN_OPTIONS] + [
    pytest.param(jnp.bfloat16, o, id=f"bfloat16-{n}") for n, o in VARLEN_OPTIONS[2:]]


@pytest.mark.parametrize("dtype,options", VARLEN_GRID)
def test_varlen(dtype, options):
    check_varlen(dtype, options)


# ------------------------------------------------------------ shard_map over 2 cpu devices

SHARD_MAP_PROGRAM = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, PartitionSpec as P
    import symheap.jax as shj
    from jax_attention_common import reference, randn, with_grads
    assert len(jax.devices()) == 2, jax.devices()
    shard_map = getattr(jax, "shard_map", None)
    if shard_map is None:
        from jax.experimental.shard_map import shard_map
    mesh = Mesh(np.array(jax.devices()), ("x",))
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    q = randn(keys[0], (4, 16, 4, 32), jnp.float32)
    k = randn(keys[1], (4, 24, 2, 32), jnp.float32)
    v = randn(keys[2], (4, 24, 2, 32), jnp.float32)
    bias = 0.5 * randn(keys[3], (4, 1, 16, 24), jnp.float32)
    spec = P("x")

    def local(q, k, v, bias):
        return shj.flash_attn_func(q, k, v, bias=bias, causal=True)

    f = shard_map(local, mesh=mesh, in_specs=(spec,) * 4, out_specs=spec)
    dout = randn(keys[0], q.shape, jnp.float32)
    ref_fn = lambda *a: reference(*a[:3], bias=a[3], causal=True)
    out, _, g = with_grads(lambda *a: (f(*a), jnp.zeros(())), dout)(q, k, v, bias)
    ref, _, r = with_grads(ref_fn, dout)(q, k, v, bias)
    assert float(jnp.max(jnp.abs(out - ref))) < 2e-5
    for x, y in zip(g, r):
        assert float(jnp.max(jnp.abs(x - y))) < 1e-4 * max(1.0, float(jnp.max(jnp.abs(y))))
    # A bias shared by every shard: its gradient is the sum over the shards.
    shared = 0.5 * randn(keys[3], (1, 4, 16, 24), jnp.float32)
    f2 = shard_map(local, mesh=mesh, in_specs=(spec,) * 3 + (P(),), out_specs=spec)
    _, _, g2 = with_grads(lambda *a: (f2(*a), jnp.zeros(())), dout)(q, k, v, shared)
    _, _, r2 = with_grads(ref_fn, dout)(q, k, v, shared)
    g2, r2 = g2[3], r2[3]
    assert g2.shape == shared.shape
    assert float(jnp.max(jnp.abs(g2 - r2))) < 1e-4 * max(1.0, float(jnp.max(jnp.abs(r2))))
    print("SHARD_MAP_OK")
""")


def test_shard_map_two_cpu_devices():
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2",
               JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([here] + sys.path))
    r = subprocess.run([sys.executable, "-c", SHARD_MAP_PROGRAM], env=env, capture_output=True,
                       text=True, timeout=240)
    assert r.returncode == 0 and "SHARD_MAP_OK" in r.stdout, r.stdout + r.stderr


# ------------------------------------------------------------ bad input

@pytest.mark.parametrize("kwargs, message", BAD_FORMS)
def test_bad_argument_forms_raise(kwargs, message):
    q = jnp.ones((1, 8, 4, 32), jnp.float32)
    with pytest.raises(ValueError, match=message):
        shj.flash_attn_func(q, q, q, **kwargs)


def test_bad_arguments_raise():
    q = jnp.zeros((1, 8, 4, 32), jnp.bfloat16)
    k = jnp.zeros((1, 8, 2, 32), jnp.bfloat16)
    k3 = jnp.zeros((1, 8, 3, 32), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"query heads \(4\) must be a multiple"):
        shj.flash_attn_func(q, k3, k3)
    with pytest.raises(ValueError, match="must share a dtype"):
        shj.flash_attn_func(q, k.astype(jnp.float16), k.astype(jnp.float16))
    with pytest.raises(ValueError, match="dtype int32 is not supported"):
        shj.flash_attn_func(q.astype(jnp.int32), k.astype(jnp.int32), k.astype(jnp.int32))
    with pytest.raises(ValueError, match=r"q must be \(B, S, H, D\)"):
        shj.flash_attn_func(q[0], k[0], k[0])
    with pytest.raises(ValueError, match=r"dropout_p must be in \[0, 1\)"):
        shj.flash_attn_func(q, k, k, dropout_p=1.0)
    with pytest.raises(ValueError, match="needs seed="):
        shj.flash_attn_func(q, k, k, dropout_p=0.1)
    with pytest.raises(ValueError, match="does not broadcast"):
        shj.flash_attn_func(q, k, k, bias=jnp.zeros((1, 3, 8, 8)))
    with pytest.raises(ValueError, match="mask must be a bool"):
        shj.flash_attn_func(q, k, k, mask=jnp.ones((8, 8)))
    with pytest.raises(ValueError, match=r"head dim 300 is outside \[1, 256\]"):
        x = jnp.zeros((1, 4, 1, 300))
        shj.flash_attn_func(x, x, x)
    with pytest.raises(ValueError, match="window_size"):
        shj.flash_attn_func(q, k, k, window_size=(-2, 0))
    with pytest.raises(ValueError, match="softcap must be >= 0"):
        shj.flash_attn_func(q, k, k, softcap=-1.0)
    with pytest.raises(ValueError, match=r"alibi_slopes must have shape \(4,\)"):
        shj.flash_attn_func(q, k, k, alibi_slopes=jnp.ones(3))
    with pytest.raises(ValueError, match="int32"):
        shj.flash_attn_varlen_func(q[0], k[0], k[0], jnp.array([0.0, 8.0]), jnp.array([0.0, 8.0]),
                                   8, 8)
    with pytest.raises(ValueError, match="offset"):
        shj.flash_attn_func(q, k, k, dropout_p=0.1, seed=(1, 2 ** 32))
    with pytest.raises(TypeError, match="q must be a jax array"):
        shj.flash_attn_func(q.tolist(), k, k)
    # The same messages as the torch front end (one C++ check serves both).
    torch = pytest.importorskip("torch")
    import symheap.attention as tattn
    with pytest.raises(ValueError) as jax_err:
        shj.flash_attn_func(q, k, k, bias=jnp.zeros((1, 3, 8, 8), jnp.bfloat16))
    with pytest.raises(ValueError) as torch_err:
        tq = torch.zeros(1, 8, 4, 32, dtype=torch.bfloat16)
        tk = torch.zeros(1, 8, 2, 32, dtype=torch.bfloat16)
        tattn.flash_attn_func(tq, tk, tk, bias=torch.zeros(1, 3, 8, 8, dtype=torch.bfloat16))
    assert str(jax_err.value) == str(torch_err.value)


@pytest.mark.parametrize("bad", ["cuDNN", "", 3])
def test_bad_backend_raises(bad):
    q = jnp.zeros((1, 8, 2, 16), jnp.float32)
    with pytest.raises(ValueError, match="backend must be one of 'auto', 'cudnn', 'own'"):
        shj.flash_attn_func(q, q, q, backend=bad)


def test_cudnn_backend_on_cpu_platform_raises():
    q = jnp.zeros((1, 8, 2, 16), jnp.float32)
    with pytest.raises(ValueError, match="backend='cudnn' needs CUDA"):
        shj.flash_attn_func(q, q, q, backend="cudnn")


@pytest.mark.parametrize("env", ["cudnn", "own"])
def test_backend_env_is_ignored_on_cpu(monkeypatch, env):
    """$SYMHEAP_ATTN_BACKEND steers CUDA calls only: cpu results match the reference."""
    monkeypatch.setenv("SYMHEAP_ATTN_BACKEND", env)
    q, k, v = (randn(jax.random.PRNGKey(i), (1, 16, 2, 16), jnp.float32) for i in range(3))
    out = jax.jit(lambda q, k, v: shj.flash_attn_func(q, k, v, causal=True, backend="own"))(q, k, v)
    ref = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
    assert err(out, ref) < 2e-5
    out = jax.jit(lambda q, k, v: shj.flash_attn_func(q, k, v, causal=True))(q, k, v)
    assert err(out, ref) < 2e-5


def test_varlen_lengths_over_max_raise_at_run():
    """cu_seqlens live in device memory: the cpu handler checks them when it runs."""
    q, k, v, cu_q, cu_k, mq, mk = varlen_case(jnp.float32)
    with pytest.raises(Exception, match="max_seqlen"):
        jax.block_until_ready(shj.flash_attn_varlen_func(q, k, v, jnp.asarray(cu_q), jnp.asarray(cu_k),
                                                         mq - 1, mk))
