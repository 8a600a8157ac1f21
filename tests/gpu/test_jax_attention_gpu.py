"""symheap.jax attention on one CUDA GPU: the cpu test grid in bf16 and fp16
(outputs, lse, dq, dk, dv, dbias against an fp32 reference on the GPU), head
dims that need padding, varlen, the CUDA-only checks, and the handlers
recorded in XLA command buffers."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "jax"))


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
from jax_attention_common import FEATURE_CASES, check_varlen, compare, make_case  # noqa: E402

DTYPES = [jnp.bfloat16, jnp.float16]


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("name,case_kw,options", FEATURE_CASES, ids=[c[0] for c in FEATURE_CASES])
def test_features_cuda(dtype, name, case_kw, options):
    compare(make_case(hash(name) % 1000, dtype=dtype, **case_kw), dtype, **options)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("D", [64, 72, 128, 100, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_larger_shapes_cuda(dtype, D, causal):
    """Several tiles per sequence, and head dims with and without padding."""
    case = make_case(D, B=2, Sq=197, Sk=333, Hq=6, Hkv=2, D=D, dtype=dtype,
                     bias_shape=(1, 6, 197, 333))
    compare(case, dtype, causal=causal)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_pipelined_backward_dq_fused_xla(dtype, D, causal):
    """The own backward at head dims 64 and 128 without logit features fuses
    dQ into the dK/dV kernel: its fp32 accumulator is the scratch result's tail."""
    case = make_case(D, B=2, Sq=197, Sk=333, Hq=6, Hkv=2, D=D, dtype=dtype)
    compare(case, dtype, causal=causal, backend="own")


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("D", [24, 20, 64])
@pytest.mark.parametrize("options", [
    {"causal": True},
    {"window_size": (4, 2), "softcap": 3.0},
    {"bias": "per_row", "alibi": True},
    {"bias": "rowless", "mask": True, "dropout_p": 0.25, "seed": 3},
])
def test_varlen_cuda(dtype, D, options):
    check_varlen(dtype, options, D=D)


def test_float32_is_refused_on_cuda():
    x = jnp.zeros((1, 8, 2, 32), jnp.float32)
    with pytest.raises(Exception, match="the CUDA path takes float16 or bfloat16"):
        jax.block_until_ready(shj.flash_attn_func(x, x, x))


COMMAND_BUFFER_PROGRAM = textwrap.dedent("""
    import os, sys, json
    import jax, jax.numpy as jnp, numpy as np
    import symheap.jax as shj
    from jax_attention_common import randn, with_grads
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    q = randn(keys[0], (2, 300, 8, 20), jnp.bfloat16)   # head dim 20: padded copies too
    k = randn(keys[1], (2, 280, 4, 20), jnp.bfloat16)
    v = randn(keys[2], (2, 280, 4, 20), jnp.bfloat16)
    bias = randn(keys[3], (1, 8, 1, 280), jnp.bfloat16)
    dout = randn(keys[0], q.shape, jnp.float32)
    fn = lambda *a: shj.flash_attn_func(*a[:3], bias=a[3], causal=True, return_lse=True,
                                        dropout_p=0.1, seed=7)
    run = with_grads(fn, dout)
    text = run.lower(q, k, v, bias).compile().as_text()
    results = [run(q, k, v, bias) for _ in range(3)]   # replays
    leaves = [np.asarray(x, np.float32) for x in jax.tree_util.tree_leaves(results[-1])]
    for r in results[:-1]:
        for a, b in zip(jax.tree_util.tree_leaves(r), leaves):
            assert np.array_equal(np.asarray(a, np.float32), b), "replays differ"
    np.savez(sys.argv[1], *leaves)
    in_buffer = [c for c in text.split("\\n\\n") if "command_buffer" in c and "symheap_attention" in c]
    print(json.dumps({"attention_in_command_buffer": bool(in_buffer)}))
""")


def test_command_buffers(tmp_path):
    """With custom calls in command buffers (the handlers do not claim
    compatibility yet, so XLA runs them outside), fwd+bwd equals the run without."""
    outs = {}
    for mode, flags in (("off", "--xla_gpu_enable_command_buffer="),
                        ("on", "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL "
                               "--xla_gpu_graph_min_graph_size=1")):
        env = dict(os.environ, XLA_FLAGS=flags,
                   PYTHONPATH=os.pathsep.join([os.path.join(HERE, "..", "jax")] + sys.path))
        path = tmp_path / f"{mode}.npz"
        r = subprocess.run([sys.executable, "-c", COMMAND_BUFFER_PROGRAM, str(path)], env=env,
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
        outs[mode] = (dict(np.load(path)), r.stdout)
    for key, a in outs["off"][0].items():
        assert np.array_equal(a, outs["on"][0][key]), key
