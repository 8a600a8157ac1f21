"""symheap.jax attention over KV caches on the cpu platform: the decode call
(flash_attn_with_kvcache: dense and paged caches, with and without appended
rows, every feature) and the paged varlen call, against a dense fp32 reference
gathered from the cache; the append in place under jit with donated caches,
also under shard_map over 2 devices; bad input raising the torch front end's
messages; no gradient."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

pytest.importorskip("symheap._core")
from symheap import _core  # noqa: E402

if not getattr(_core, "built_with_xla_ffi", False):
    raise RuntimeError("symheap was built without the XLA FFI handlers (jaxlib's FFI headers "
                       "were not found at build time), so symheap.jax cannot run: rebuild "
                       "with jax installed")

import symheap.attention as sha  # noqa: E402
import symheap.jax as shj  # noqa: E402

ATTENTION_TESTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "attention")
sys.path.insert(0, ATTENTION_TESTS)  # the torch KV-cache tests' helpers
from attention_kvcache_common import FEATURES, Cache, reference  # noqa: E402
from jax_kvcache_common import (DecodeCase, PagedVarlenCase, same_values, to_jax,  # noqa: E402
                                to_torch32)

TOL = 2e-5


# ---------------------------------------------------------------- decode

@pytest.mark.parametrize("layout", [None, 16], ids=["dense", "paged16"])
@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("s_new", [0, 2])
def test_decode(layout, feature, s_new):
    case = DecodeCase(layout=layout, feature=feature, s_new=s_new,
                      seed=hash((layout, feature, s_new)) % 1000)
    case.check(*case.run(), TOL)


def test_decode_more_queries_than_new_rows_block_256():
    # Speculative decoding: 4 queries, 2 appended rows, causal aligned bottom-right.
    case = DecodeCase(layout=256, feature="all", s_new=2, Sq=4, seed=7)
    case.check(*case.run(), TOL)


def test_decode_bfloat16():
    case = DecodeCase(layout=16, feature="all", s_new=1, dtype=torch.bfloat16, seed=3)
    out, lse, k_cache, v_cache = case.run()
    assert out.dtype == jnp.bfloat16 and k_cache.dtype == jnp.bfloat16
    case.check(out, lse, k_cache, v_cache, 2e-2)


def test_int_seqlens_and_defaults():
    case = DecodeCase(layout=16, feature="gqa", s_new=0, B=2, seed=11, lengths=[20, 20])
    a = case.args()
    out = shj.flash_attn_with_kvcache(a["q"], a["k_cache"], a["v_cache"], cache_seqlens=20,
                                      block_table=a["block_table"])
    lse = shj.flash_attn_with_kvcache(a["q"], a["k_cache"], a["v_cache"], cache_seqlens=20,
                                      block_table=a["block_table"], return_lse=True)[1]
    case.check(out, lse, None, None, TOL)


def test_integers_past_their_ranges():
    """An int cache_seqlens past int32 (once taken mod 2^32: 2^32 + 5 ran as 5),
    num_splits and max_seqlen_q past the core's ranges: ValueError, as in torch."""
    case = DecodeCase(layout=16, feature="gqa", s_new=0, B=2, seed=12, lengths=[20, 20])
    a = case.args()
    for seqlens in (2 ** 32 + 5, 2 ** 40, -2 ** 31 - 1):
        with pytest.raises(ValueError, match="cache_seqlens must fit in an int32"):
            shj.flash_attn_with_kvcache(a["q"], a["k_cache"], a["v_cache"], cache_seqlens=seqlens,
                                        block_table=a["block_table"])
    with pytest.raises(ValueError, match="num_splits must fit in 32 bits"):
        jax.block_until_ready(shj.flash_attn_with_kvcache(
            a["q"], a["k_cache"], a["v_cache"], cache_seqlens=20, block_table=a["block_table"],
            num_splits=2 ** 31))
    B, Sq, Hq, D = a["q"].shape
    q = a["q"].reshape(B * Sq, Hq, D)
    cu_q = jnp.asarray([0, Sq, 2 * Sq], jnp.int32)
    cu_k = jnp.asarray([0, 20, 40], jnp.int32)
    with pytest.raises(ValueError, match="max_seqlen_q must fit in 64 bits"):
        shj.flash_attn_varlen_func(q, a["k_cache"], a["v_cache"], cu_q, cu_k, 2 ** 70, 20,
                                   block_table=a["block_table"])
    want = shj.flash_attn_varlen_func(q, a["k_cache"], a["v_cache"], cu_q, cu_k, Sq, 20,
                                      block_table=a["block_table"])
    got = shj.flash_attn_varlen_func(q, a["k_cache"], a["v_cache"], cu_q, cu_k, 2 ** 31 - 15, 20,
                                     block_table=a["block_table"])
    assert np.array_equal(np.asarray(got), np.asarray(want))  # (once all zeros)


def test_matches_torch_front_end():
    """The same call through torch and through JAX gives the same numbers."""
    case = DecodeCase(layout=16, feature="all", s_new=3, seed=21)
    out, lse, k_cache, v_cache = case.run()
    t_k, t_v = case.cache.snapshot()  # torch appends in place into these copies
    t_out, t_lse = sha.flash_attn_with_kvcache(
        case.q, t_k, t_v, *case.new, cache_seqlens=torch.tensor(case.lengths, dtype=torch.int32),
        block_table=case.cache.block_table, return_lse=True, causal=True, window_size=(60, 0),
        softcap=3.0, alibi_slopes=torch.tensor(np.asarray(case.options()["alibi_slopes"])))
    assert torch.equal(to_torch32(out), t_out) and torch.equal(to_torch32(lse), t_lse)
    assert same_values(k_cache, t_k) and same_values(v_cache, t_v)


# ---------------------------------------------------------------- in place under jit

def _step(q, k_cache, v_cache, k, v, seqlens, table):
    return shj.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens,
                                       block_table=table, causal=True, return_lse=True)


@pytest.mark.parametrize("layout", [None, 16], ids=["dense", "paged16"])
def test_donated_append_is_in_place(layout):
    """With the caches donated, the updated caches are the input buffers: the
    new rows land there and every other row keeps its bits."""
    case = DecodeCase(layout=layout, feature="causal", s_new=2, seed=5)
    a = case.args()
    step = jax.jit(_step, donate_argnums=(1, 2))
    k_ptr = a["k_cache"].unsafe_buffer_pointer()
    v_ptr = a["v_cache"].unsafe_buffer_pointer()
    out, lse, k_cache, v_cache = step(a["q"], a["k_cache"], a["v_cache"], a["k"], a["v"],
                                      a["cache_seqlens"], a["block_table"])
    assert a["k_cache"].is_deleted() and a["v_cache"].is_deleted(), "the caches were not donated"
    assert k_cache.unsafe_buffer_pointer() == k_ptr, "the k cache was copied, not updated in place"
    assert v_cache.unsafe_buffer_pointer() == v_ptr, "the v cache was copied, not updated in place"
    case.check(out, lse, k_cache, v_cache, TOL)
    hlo = step.lower(*case.args().values()).compile().as_text()
    dims = "[" + ",".join(map(str, k_cache.shape)) + "]"
    assert not any(" copy(" in line and dims in line for line in hlo.splitlines()), \
        "XLA inserted a copy of a donated cache"


def test_without_donation_the_inputs_stay():
    case = DecodeCase(layout=16, feature="plain", s_new=1, seed=6)
    a = case.args()
    out, lse, k_cache, v_cache = jax.jit(_step)(*a.values())
    assert same_values(a["k_cache"], case.cache.k) and same_values(a["v_cache"], case.cache.v)
    want = case.expected_cache()
    assert same_values(k_cache, want.k) and same_values(v_cache, want.v)


def test_decode_loop():
    """Three decode steps under one jitted, donating step function."""
    gen = torch.Generator().manual_seed(8)
    B, Hq, Hkv, D = 2, 4, 2, 32
    cache = Cache(B=B, capacity=40, Hkv=Hkv, D=D, dtype=torch.float32, device="cpu", gen=gen,
                  lengths=[5, 17], block_size=8)
    lengths = [5, 17]
    k_cache, v_cache = to_jax(cache.k), to_jax(cache.v)
    table = to_jax(cache.block_table)
    step = jax.jit(_step, donate_argnums=(1, 2))
    for _ in range(3):
        q = torch.randn((B, 1, Hq, D), generator=gen)
        k, v = (torch.randn((B, 1, Hkv, D), generator=gen) for _ in range(2))
        out, _, k_cache, v_cache = step(to_jax(q), k_cache, v_cache, to_jax(k), to_jax(v),
                                        jnp.asarray(np.array(lengths, np.int32)), table)
        for b in range(B):
            cache.write(b, lengths[b], k[b], v[b])
            lengths[b] += 1
            ref, _ = reference(q[b:b + 1], cache, b, lengths[b], dict(causal=True), Hq)
            assert (to_torch32(out[b:b + 1]) - ref).abs().max().item() <= TOL
    assert same_values(k_cache, cache.k) and same_values(v_cache, cache.v)


SHARD_MAP_PROGRAM = textwrap.dedent("""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P
    import symheap.jax as shj
    from jax_kvcache_common import DecodeCase
    assert len(jax.devices()) == 2, jax.devices()
    mesh = jax.make_mesh((2,), ("x",))
    case = DecodeCase(layout=None, feature="gqa", s_new=1, B=2, seed=3, lengths=[4, 9])
    a = case.args()

    def local(q, k_cache, v_cache, k, v, seqlens):
        return shj.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens,
                                           return_lse=True)

    # Dense caches: each device holds its sequences' rows and appends to them in place.
    f = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("x"),) * 6, out_specs=(P("x"),) * 4),
                donate_argnums=(1, 2))
    sh = NamedSharding(mesh, P("x"))
    args = [jax.device_put(a[n], sh) for n in ("q", "k_cache", "v_cache", "k", "v", "cache_seqlens")]
    case.check(*f(*args), 2e-5)
    print("SHARD_MAP_OK")
""")


def test_shard_map_two_cpu_devices():
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2",
               JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([here, ATTENTION_TESTS] + sys.path))
    r = subprocess.run([sys.executable, "-c", SHARD_MAP_PROGRAM], env=env, capture_output=True,
                       text=True, timeout=240)
    assert r.returncode == 0 and "SHARD_MAP_OK" in r.stdout, r.stdout + r.stderr


# ---------------------------------------------------------------- paged varlen

@pytest.mark.parametrize("feature", ["plain", "causal", "window", "softcap", "alibi", "mqa", "all"])
def test_paged_varlen(feature):
    case = PagedVarlenCase(block_size=16, feature=feature, seed=hash(feature) % 1000)
    case.check(*case.run(), TOL)


def test_paged_varlen_block_256_under_jit():
    case = PagedVarlenCase(block_size=256, feature="all", seed=4)
    f = jax.jit(lambda *a: case.run())
    case.check(*f(), TOL)


def test_paged_varlen_matches_dense_varlen():
    case = PagedVarlenCase(block_size=16, feature="gqa", seed=5, q_lens=(30, 7), k_lens=(100, 250))
    paged = case.run(causal=True, softcap=2.0)[0]
    k = torch.cat([case.cache.gather(b, n)[0][0] for b, n in enumerate(case.k_lens)])
    v = torch.cat([case.cache.gather(b, n)[1][0] for b, n in enumerate(case.k_lens)])
    dense = shj.flash_attn_varlen_func(to_jax(case.q), to_jax(k), to_jax(v), jnp.asarray(case.cu_q),
                                       jnp.asarray(case.cu_k), 30, 250, causal=True, softcap=2.0)
    assert float(jnp.max(jnp.abs(paged - dense))) <= TOL


# ---------------------------------------------------------------- errors

def error_case(layout=16):
    return DecodeCase(layout=layout, feature="gqa", s_new=2, B=3, seed=99)


def call(case, **overrides):
    a = case.args()
    a.update(overrides)
    got = shj.flash_attn_with_kvcache(a.pop("q"), a.pop("k_cache"), a.pop("v_cache"), a.pop("k"),
                                      a.pop("v"), **a)
    return jax.block_until_ready(got)


def torch_message(case, **overrides):
    """The torch front end's error for the same call."""
    c = case.cache
    args = dict(q=case.q, k_cache=c.k.clone(), v_cache=c.v.clone(), k=case.new[0], v=case.new[1],
                cache_seqlens=torch.tensor(case.lengths, dtype=torch.int32),
                block_table=c.block_table)
    args.update(overrides)
    with pytest.raises(ValueError) as e:
        sha.flash_attn_with_kvcache(args.pop("q"), args.pop("k_cache"), args.pop("v_cache"),
                                    args.pop("k"), args.pop("v"), **args)
    return str(e.value)


# What JAX raises for an ffi::Error: ValueError when the call runs eagerly,
# JaxRuntimeError from a jitted program.
RUN_ERRORS = (ValueError, jax.errors.JaxRuntimeError)


def expect_runtime_error(case, match, **overrides):
    """A length or block id the handler finds when it runs, eagerly and under
    jit: an error carrying the torch message."""
    torch_overrides = {k: torch.from_numpy(np.array(v)) for k, v in overrides.items()}
    want = torch_message(case, **torch_overrides)
    with pytest.raises(RUN_ERRORS, match=match) as e:
        call(case, **overrides)
    assert want in str(e.value)
    a = case.args()
    a.update(overrides)
    with pytest.raises(jax.errors.JaxRuntimeError, match=match) as e:
        jax.block_until_ready(jax.jit(_step)(*a.values()))
    assert want in str(e.value)


@pytest.mark.parametrize("bad_id", [-1, "num_blocks"])
def test_block_id_out_of_range(bad_id):
    case = error_case()
    table = case.cache.block_table.clone()
    table[2, 0] = case.cache.k.shape[0] if bad_id == "num_blocks" else bad_id
    expect_runtime_error(case, r"block_table\[2, 0\] = -?\d+ is outside \[0, num_blocks",
                         block_table=to_jax(table))


def test_unused_block_ids_are_not_read():
    case = error_case()
    case.cache.block_table[0, 1:] = -1  # sequence 0 holds 0 + 2 rows: block 0 only
    case.check(*case.run(), TOL)


def test_cache_too_small_for_appended_rows():
    case = error_case()
    expect_runtime_error(case, r"sequence 1 needs \d+ cache rows .* but the cache holds",
                         cache_seqlens=jnp.asarray([0, case.cache.capacity - 1, 5], jnp.int32))
    expect_runtime_error(case, r"cache_seqlens gives sequence 0 the length -3",
                         cache_seqlens=jnp.asarray([-3, 0, 0], jnp.int32))
    dense = error_case(layout=None)
    expect_runtime_error(dense, r"sequence 2 needs",
                         cache_seqlens=jnp.asarray([0, 0, dense.cache.capacity], jnp.int32))


def test_mismatched_shapes_and_dtypes():
    """Found at trace time from the shapes: ValueError, the torch message."""
    case = error_case()
    a = case.args()
    Hq, D = case.Hq, case.q.shape[-1]
    t = case.cache
    bad = [  # (jax overrides, torch overrides, pattern)
        (dict(v_cache=a["v_cache"][:-1]), dict(v_cache=t.v[:-1]), r"k_cache and v_cache must have one shape"),
        (dict(q=jnp.zeros((3, 2, Hq, D + 8))), dict(q=torch.zeros(3, 2, Hq, D + 8)), r"head dim"),
        (dict(q=jnp.zeros((3, 2, 3, D))), dict(q=torch.zeros(3, 2, 3, D)),
         r"multiple of the caches' key/value heads"),
        (dict(block_table=a["block_table"][:2]), dict(block_table=t.block_table[:2]),
         r"block_table must have shape \(3, "),
        (dict(k=a["k"][:, :, :1], v=a["v"][:, :, :1]),
         dict(k=case.new[0][:, :, :1], v=case.new[1][:, :, :1]), r"k and v must have shape"),
        (dict(v=a["v"][:, :1]), dict(v=case.new[1][:, :1]), r"k and v must have one shape"),
        (dict(cache_seqlens=jnp.zeros(2, jnp.int32)), dict(cache_seqlens=torch.zeros(2, dtype=torch.int32)),
         r"cache_seqlens must have shape \(3,\)"),
        (dict(cache_seqlens=jnp.zeros(3, jnp.float32)),
         dict(cache_seqlens=torch.zeros(3, dtype=torch.float32)), r"cache_seqlens must be int32"),
        (dict(q=a["q"].astype(jnp.bfloat16)), dict(q=case.q.bfloat16()),
         r"k_cache and v_cache must have q's dtype"),
        (dict(k=a["k"].astype(jnp.bfloat16), v=a["v"].astype(jnp.bfloat16)),
         dict(k=case.new[0].bfloat16(), v=case.new[1].bfloat16()), r"k and v must have q's dtype"),
        (dict(v=None), dict(v=None), r"give both k and v"),
        (dict(block_table=None), dict(block_table=None), r"dense caches must have batch 3"),
    ]
    for jax_over, torch_over, pattern in bad:
        want = torch_message(case, **torch_over)
        with pytest.raises(ValueError, match=pattern) as e:
            call(case, **jax_over)
        if want.startswith("attention (kv cache)"):  # the C++ check: the same message
            assert str(e.value) == want, (pattern, str(e.value), want)
    with pytest.raises(ValueError, match="window_size must be a pair"):
        call(case, window_size=3)


def test_forward_only_and_unsupported_options():
    case = error_case()
    a = case.args()

    def loss(q):
        return jnp.sum(shj.flash_attn_with_kvcache(q, a["k_cache"], a["v_cache"],
                                                   cache_seqlens=a["cache_seqlens"],
                                                   block_table=a["block_table"]))
    with pytest.raises(ValueError, match="forward only"):
        jax.grad(loss)(a["q"])
    q = a["q"].reshape(6, case.Hq, -1)
    cu = jnp.asarray([0, 2, 4, 6], jnp.int32)
    with pytest.raises(ValueError, match="bias is not supported with block_table"):
        shj.flash_attn_varlen_func(q, a["k_cache"], a["v_cache"], cu, cu, 2, 2,
                                   block_table=a["block_table"], bias=jnp.zeros((1, 1, 2, 2)))
    with pytest.raises(ValueError, match="dropout_p is not supported with block_table"):
        shj.flash_attn_varlen_func(q, a["k_cache"], a["v_cache"], cu, cu, 2, 2,
                                   block_table=a["block_table"], dropout_p=0.1, seed=1)
    with pytest.raises(RUN_ERRORS, match=r"sequence 1 needs 400 cache rows"):
        jax.block_until_ready(shj.flash_attn_varlen_func(
            q, a["k_cache"], a["v_cache"], cu, jnp.asarray([0, 2, 402, 404], jnp.int32), 2, 400,
            block_table=a["block_table"]))
