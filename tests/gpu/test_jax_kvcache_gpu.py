"""symheap.jax attention over KV caches on one CUDA GPU, float16 and bfloat16:
the cpu test grid (dense and paged caches, appended rows, every feature, the
paged varlen call) against a dense fp32 reference gathered from the cache,
head dims and forced key-length splits (the log-sum-exp combine over XLA's
scratch result), a long cache with automatic splits, the append in place
under jit with donated caches, device-recorded errors, and the CUDA-only
checks at trace time."""
from __future__ import annotations

import os
import sys

import pytest

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave memory to other tests
jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "jax"))
sys.path.insert(0, os.path.join(HERE, "..", "attention"))


def _jax_gpus():
    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


pytestmark = pytest.mark.skipif(not _jax_gpus(), reason="jax has no CUDA backend here")

from symheap import _core  # noqa: E402

if not getattr(_core, "built_with_xla_ffi", False):
    raise RuntimeError("symheap was built without the XLA FFI handlers (jaxlib's FFI headers "
                       "were not found at build time), so symheap.jax cannot run: rebuild "
                       "with jax installed")

import symheap.jax as shj  # noqa: E402
from attention_kvcache_common import FEATURES, reference  # noqa: E402
from jax_kvcache_common import (DecodeCase, PagedVarlenCase, same_values, to_jax,  # noqa: E402
                                to_torch32)
from symheap.jax import _kvcache  # noqa: E402

DTYPES = [torch.bfloat16, torch.float16]
TOL = {torch.bfloat16: 2.5e-2, torch.float16: 4e-3}
RUN_ERRORS = (ValueError, jax.errors.JaxRuntimeError)


def on_gpu(x):
    return jax.device_put(x, _jax_gpus()[0]) if x is not None else None


def run_on_gpu(case, **extra):
    """The case's call with every argument on the GPU; (out, lse, k_cache, v_cache)."""
    a = {k: on_gpu(v) for k, v in case.args().items()}
    got = shj.flash_attn_with_kvcache(a["q"], a["k_cache"], a["v_cache"], a["k"], a["v"],
                                      cache_seqlens=a["cache_seqlens"], block_table=a["block_table"],
                                      return_lse=True, **case.options(), **extra)
    assert list(got[0].devices())[0].platform == "gpu"
    shj.kvcache_check(got)
    return got if case.new is not None else (got[0], got[1], None, None)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("layout", [None, 16, 256, 512], ids=["dense", "paged16", "paged256", "paged512"])
@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("s_new", [0, 1, 3])
def test_decode(dtype, layout, feature, s_new):
    case = DecodeCase(layout=layout, feature=feature, s_new=s_new, dtype=dtype, D=128,
                      seed=hash((layout, feature, s_new)) % 1000)
    case.check(*run_on_gpu(case), TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("D", [32, 64, 96, 256])
@pytest.mark.parametrize("num_splits", [1, 3, 7])
def test_head_dims_and_splits(dtype, D, num_splits):
    case = DecodeCase(layout=16, feature="all", s_new=2, Sq=4, dtype=dtype, D=D, seed=D)
    case.check(*run_on_gpu(case, num_splits=num_splits), TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_long_cache_batch_one(dtype):
    """Batch 1 over a 32k-row paged cache: the split count chosen at trace time
    (more than one) and the partials in XLA's scratch result."""
    case = DecodeCase(layout=256, feature="gqa", s_new=1, B=1, capacity=32768, dtype=dtype,
                      D=128, seed=4, lengths=[32000])
    call = _core.AttentionCacheCall()
    a = case.args()
    for name in ("q", "k_cache", "v_cache", "k", "v", "cache_seqlens", "block_table"):
        _kvcache._describe(call, name, a[name])
    _kvcache._describe(call, "out", a["q"])
    call.set_tensor("lse", 256, "float32", [1, case.Hq, 1], [case.Hq, 1, 1])
    splits, nbytes = _core.xla_attention_kvcache_cuda_plan(call, _jax_gpus()[0].local_hardware_id)
    assert splits > 1 and nbytes > 0, (splits, nbytes)
    case.check(*run_on_gpu(case), TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("feature", list(FEATURES))
def test_paged_varlen(dtype, block_size, feature):
    case = PagedVarlenCase(block_size=block_size, feature=feature, dtype=dtype, D=128,
                           seed=hash((block_size, feature)) % 1000)
    with jax.default_device(_jax_gpus()[0]):
        out, lse = case.run()
    assert list(out.devices())[0].platform == "gpu"
    shj.kvcache_check(out)
    case.check(out, lse, TOL[dtype])


@pytest.mark.parametrize("layout", [None, 16])
def test_donated_append_is_in_place(layout):
    case = DecodeCase(layout=layout, feature="causal", s_new=2, dtype=torch.bfloat16, D=128, seed=5)
    a = {k: on_gpu(v) for k, v in case.args().items()}

    def step(q, k_cache, v_cache, k, v, seqlens, table):
        return shj.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens,
                                           block_table=table, causal=True, return_lse=True)

    jitted = jax.jit(step, donate_argnums=(1, 2))
    ptrs = a["k_cache"].unsafe_buffer_pointer(), a["v_cache"].unsafe_buffer_pointer()
    out, lse, k_cache, v_cache = jitted(*a.values())
    shj.kvcache_check(out)
    assert a["k_cache"].is_deleted() and a["v_cache"].is_deleted()
    assert (k_cache.unsafe_buffer_pointer(), v_cache.unsafe_buffer_pointer()) == ptrs, \
        "the caches were copied, not updated in place"
    case.check(out, lse, k_cache, v_cache, TOL[torch.bfloat16])
    hlo = jitted.lower(*[on_gpu(v) for v in case.args().values()]).compile().as_text()
    dims = "[" + ",".join(map(str, k_cache.shape)) + "]"
    assert not any(" copy(" in line and dims in line for line in hlo.splitlines()), \
        "XLA inserted a copy of a donated cache"


def test_decode_loop_jitted():
    """Several decode steps of one jitted, donating step function on the GPU."""
    case = DecodeCase(layout=16, feature="gqa", s_new=1, B=2, dtype=torch.bfloat16, D=128,
                      seed=12, lengths=[3, 40])
    a = {k: on_gpu(v) for k, v in case.args().items()}
    step = jax.jit(lambda q, kc, vc, k, v, s, t: shj.flash_attn_with_kvcache(
        q, kc, vc, k, v, cache_seqlens=s, block_table=t), donate_argnums=(1, 2))
    k_cache, v_cache, lengths = a["k_cache"], a["v_cache"], list(case.lengths)
    gen = torch.Generator().manual_seed(13)
    Hq, Hkv, D = case.Hq, case.new[0].shape[2], 128
    for _ in range(4):
        q = torch.randn((2, 1, Hq, D), generator=gen).bfloat16()
        k, v = (torch.randn((2, 1, Hkv, D), generator=gen).bfloat16() for _ in range(2))
        out, k_cache, v_cache = step(on_gpu(to_jax(q)), k_cache, v_cache, on_gpu(to_jax(k)),
                                     on_gpu(to_jax(v)), on_gpu(jnp.asarray(np.array(lengths, np.int32))),
                                     a["block_table"])
        shj.kvcache_check(out)
        for b in range(2):
            case.cache.write(b, lengths[b], k[b], v[b])
            lengths[b] += 1
            ref, _ = reference(q[b:b + 1], case.cache, b, lengths[b], {}, Hq)
            err = (to_torch32(out[b:b + 1]) - ref).abs().max().item()
            assert err <= TOL[torch.bfloat16], err
    assert same_values(k_cache, case.cache.k) and same_values(v_cache, case.cache.v)


@pytest.mark.parametrize("problem", ["block_id", "no_room", "negative"])
def test_device_errors_are_recorded(problem):
    """A bad length or block id is found by the kernels: that sequence writes
    nothing and gets NaN; kvcache_check (or the next call) raises the error."""
    case = DecodeCase(layout=16, feature="gqa", s_new=2, dtype=torch.bfloat16, D=128, seed=8,
                      lengths=[0, 5, 10])
    shj.kvcache_check()  # nothing pending
    table = case.cache.block_table.clone()
    lengths = [0, 5, 10]
    if problem == "block_id":
        table[1, 0] = case.cache.k.shape[0]
    elif problem == "no_room":
        lengths[1] = case.cache.capacity - 1
    else:
        lengths[1] = -4
    a = {k: on_gpu(v) for k, v in case.args().items()}
    bad_table = on_gpu(jnp.asarray(table.numpy()))
    bad_lengths = on_gpu(jnp.asarray(np.array(lengths, np.int32)))
    out, k_cache, v_cache = shj.flash_attn_with_kvcache(
        a["q"], a["k_cache"], a["v_cache"], a["k"], a["v"], cache_seqlens=bad_lengths,
        block_table=bad_table, num_splits=2)
    with pytest.raises(ValueError, match=r"an earlier call on CUDA device \d+ found that sequence 1"):
        shj.kvcache_check(out)
    shj.kvcache_check()  # raised once, then cleared
    out32 = to_torch32(out)
    assert torch.isnan(out32[1]).all(), "the bad sequence's output must be NaN"
    want = case.expected_cache()
    want.k, want.v = case.cache.snapshot()
    for b in (0, 2):
        want.write(b, lengths[b], case.new[0][b], case.new[1][b])
    assert same_values(k_cache, want.k) and same_values(v_cache, want.v), \
        "only the good sequences may append"
    for b in (0, 2):
        ref, _ = reference(case.q[b:b + 1], want, b, lengths[b] + 2, case.opts, case.Hq)
        assert (out32[b:b + 1] - ref).abs().max().item() <= TOL[torch.bfloat16]
    # Without a check, the next call on the device raises it.
    jax.block_until_ready(shj.flash_attn_with_kvcache(
        a["q"], a["k_cache"], a["v_cache"], a["k"], a["v"], cache_seqlens=bad_lengths,
        block_table=bad_table))
    with pytest.raises(RUN_ERRORS, match="an earlier call"):
        jax.block_until_ready(shj.flash_attn_with_kvcache(
            a["q"], a["k_cache"], a["v_cache"], cache_seqlens=a["cache_seqlens"],
            block_table=a["block_table"]))
    shj.kvcache_check()


def test_cuda_only_checks_at_trace_time():
    case = DecodeCase(layout=16, feature="gqa", s_new=1, dtype=torch.bfloat16, D=128, seed=9)
    a = {k: on_gpu(v) for k, v in case.args().items()}
    f32 = {k: a[k].astype(jnp.float32) for k in ("q", "k_cache", "v_cache")}
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        shj.flash_attn_with_kvcache(f32["q"], f32["k_cache"], f32["v_cache"],
                                    cache_seqlens=a["cache_seqlens"], block_table=a["block_table"])
    with pytest.raises(ValueError, match="head_dim must be a multiple of 8"):
        shj.flash_attn_with_kvcache(a["q"][..., :12], a["k_cache"][..., :12], a["v_cache"][..., :12],
                                    cache_seqlens=a["cache_seqlens"], block_table=a["block_table"])
