"""Attention on the cpu path: the issue's grid against an fp32 reference with
FlashAttention's accuracy rule, every feature, varlen, dropout, errors, and
concurrent callers. Sizes are small in batch and heads so CI stays fast."""
import threading

import pytest
import torch

import symheap.attention as attn
from symheap.attention import _plan, dropout_keep_mask, flash_attn_func, flash_attn_varlen_func

from attention_arg_forms import BAD_FORMS
from test_attention_common import check_case, make_case, max_err

HEAD_DIMS = [40, 59, 111, 256]
SHAPES = [(113, 203), (128, 217), (1023, 1024), (1024, 1023)]
SMALL_SHAPES = SHAPES[:2]


@pytest.fixture(autouse=True)
def poison_outputs(monkeypatch):
    """Fresh outputs start as NaN, so an element the op never writes fails."""
    monkeypatch.setattr(_plan, "poison_outputs", True)


# ---------------------------------------------------------------- the grid

@pytest.mark.parametrize("D", HEAD_DIMS)
@pytest.mark.parametrize("Sq,Sk", SHAPES)
@pytest.mark.parametrize("causal", [False, True])
def test_grid(D, Sq, Sk, causal):
    big = Sq > 512
    case = make_case(Sq=Sq, Sk=Sk, Hq=2 if big else 4, Hkv=1 if big else 2, D=D, seed=D + Sq)
    check_case(case, causal=causal)


# Each feature over every head dim and the two small shapes, causal or not.
FEATURES = {
    "window": dict(window_size=(37, 11)),
    "window_left_only": dict(window_size=(50, -1)),
    "gqa": dict(),
    "mqa": dict(),
    "bias": dict(),
    "bias_broadcast": dict(),
    "mask": dict(),
    "softcap": dict(softcap=3.0),
    "alibi": dict(),
    "dropout": dict(dropout_p=0.17, seed=(1234, 5)),
}


def feature_case(name, Sq, Sk, D, seed):
    B, Hq, Hkv = 2, 4, 4
    extra = {}
    if name == "gqa":
        Hkv = 2
    elif name == "mqa":
        Hkv = 1
    elif name == "bias":
        extra["bias_shape"] = (B, Hq, Sq, Sk)
    elif name == "bias_broadcast":
        Hkv = 2
        extra["bias_shape"] = (1, Hkv, 1, Sk)
    elif name == "mask":
        extra["mask_shape"] = (B, 1, Sq, Sk)
    elif name == "alibi":
        extra["alibi"] = True
    return make_case(B=B, Sq=Sq, Sk=Sk, Hq=Hq, Hkv=Hkv, D=D, seed=seed, **extra)


@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("D", HEAD_DIMS)
@pytest.mark.parametrize("Sq,Sk", SMALL_SHAPES)
@pytest.mark.parametrize("causal", [False, True])
def test_features(feature, D, Sq, Sk, causal):
    case = feature_case(feature, Sq, Sk, D, seed=hash((feature, D, Sq)) % 1000)
    check_case(case, causal=causal, **FEATURES[feature])


# Features together at the large shapes, a few combinations.
@pytest.mark.parametrize("D,Sq,Sk,combo", [
    (256, 1023, 1024, "gqa_bias_softcap"),
    (111, 1024, 1023, "mqa_mask_window_alibi"),
    (59, 1023, 1024, "dropout_causal"),
    (40, 1024, 1023, "bias_broadcast_dropout_window"),
])
def test_combined_large(D, Sq, Sk, combo):
    if combo == "gqa_bias_softcap":
        case = make_case(Sq=Sq, Sk=Sk, Hq=2, Hkv=1, D=D, bias_shape=(1, 2, Sq, Sk))
        check_case(case, softcap=5.0)
    elif combo == "mqa_mask_window_alibi":
        case = make_case(Sq=Sq, Sk=Sk, Hq=2, Hkv=1, D=D, mask_shape=(1, 1, Sq, Sk), alibi=True)
        check_case(case, window_size=(300, 40))
    elif combo == "dropout_causal":
        case = make_case(Sq=Sq, Sk=Sk, Hq=2, D=D)
        check_case(case, causal=True, dropout_p=0.1, seed=77)
    else:
        case = make_case(Sq=Sq, Sk=Sk, Hq=2, Hkv=2, D=D, bias_shape=(1, 1, 1, Sk))
        check_case(case, dropout_p=0.05, seed=(9, 3), window_size=(128, 128))


# ---------------------------------------------------------------- dtypes, layouts

@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_other_dtypes(dtype):
    check_case(make_case(Sq=113, Sk=203, Hq=4, Hkv=2, D=64, dtype=dtype), causal=True)
    check_case(make_case(Sq=128, Sk=217, D=59, dtype=dtype, bias_shape=(1, 2, 128, 217)),
               softcap=4.0)


def test_strided_inputs():
    """q, k, v as views of one packed (B, S, 3, H, D) tensor."""
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(2, 150, 3, 4, 72, generator=gen).to(torch.bfloat16)
    q, k, v = qkv.unbind(2)
    out = flash_attn_func(q, k, v, causal=True)
    ref = flash_attn_func(q.contiguous(), k.contiguous(), v.contiguous(), causal=True)
    assert torch.equal(out, ref)
    # A head dim with a non-unit stride is copied, not misread.
    qt = q.contiguous().transpose(-1, -2).contiguous().transpose(-1, -2)
    assert torch.equal(flash_attn_func(qt, k, v, causal=True), ref)


@pytest.mark.parametrize("bias_shape", [
    (2, 4, 64, 80), (1, 4, 64, 80), (2, 1, 1, 80), (1, 2, 64, 80), (2, 2, 1, 80), (80,), (64, 80),
])
def test_bias_broadcast_grad_shapes(bias_shape):
    case = make_case(B=2, Sq=64, Sk=80, Hq=4, Hkv=2, D=48, bias_shape=bias_shape)
    check_case(case, causal=False)


def test_mask_shapes_and_kv_heads():
    case = make_case(B=2, Sq=70, Sk=91, Hq=4, Hkv=2, D=32, mask_shape=(1, 2, 70, 91))
    check_case(case)
    case = make_case(B=2, Sq=70, Sk=91, Hq=4, Hkv=2, D=32, mask_shape=(2, 4, 1, 91))
    check_case(case, causal=True)


# ---------------------------------------------------------------- edge rows

def test_fully_masked_rows_give_zeros():
    # Sq > Sk with causal: the first Sq - Sk rows see no key (bottom-right alignment).
    case = make_case(Sq=150, Sk=100, Hq=2, D=64)
    out = check_case(case, causal=True)
    assert torch.count_nonzero(out[:, :50]) == 0
    assert out[:, 50:].abs().sum() > 0
    _, lse = flash_attn_func(case["q"], case["k"], case["v"], causal=True, return_lse=True)
    assert torch.isinf(lse[:, :, :50]).all() and torch.isfinite(lse[:, :, 50:]).all()
    # A boolean mask that hides whole rows.
    case = make_case(Sq=64, Sk=64, Hq=2, D=32, mask_shape=(1, 1, 64, 64))
    out = check_case(case)
    assert torch.count_nonzero(out[:, 3]) == 0


def test_empty_key_sequence():
    q = torch.randn(1, 5, 2, 32, dtype=torch.bfloat16)
    k = torch.randn(1, 0, 2, 32, dtype=torch.bfloat16)
    out, lse = flash_attn_func(q, k, k.clone(), return_lse=True)
    assert torch.count_nonzero(out) == 0 and torch.isinf(lse).all()


# ---------------------------------------------------------------- dropout

def test_dropout_fraction_and_reproducibility():
    p = 0.3
    keep = dropout_keep_mask(42, 7, 1, 2, 1024, 1023, p)
    assert abs((1 - keep.float().mean().item()) - p) <= 0.01
    case = make_case(Sq=256, Sk=300, Hq=2, D=64)
    q, k, v = case["q"], case["k"], case["v"]
    a = flash_attn_func(q, k, v, dropout_p=p, seed=(42, 7))
    b = flash_attn_func(q, k, v, dropout_p=p, seed=(42, 7))
    c = flash_attn_func(q, k, v, dropout_p=p, seed=(42, 8))
    assert torch.equal(a, b) and not torch.equal(a, c)
    torch.manual_seed(5)
    d = flash_attn_func(q, k, v, dropout_p=p)
    torch.manual_seed(5)
    e = flash_attn_func(q, k, v, dropout_p=p)
    f = flash_attn_func(q, k, v, dropout_p=p)
    assert torch.equal(d, e) and not torch.equal(d, f)


def test_dropout_fraction_seen_by_kernel():
    """With v = one-hot rows and uniform attention, out[i, j] * Sk * (1-p) is
    the kernel's keep bit of (i, j): its drop rate must be p."""
    p, S = 0.25, 256
    q = torch.zeros(1, S, 1, 256)
    k = torch.zeros(1, S, 1, 256)
    v = torch.eye(S, 256).view(1, S, 1, 256)
    out = flash_attn_func(q, k, v, dropout_p=p, seed=11)
    kept = (out[0, :, 0, :S] * S * (1 - p)).round()
    assert set(kept.unique().tolist()) <= {0.0, 1.0}
    assert abs((1 - kept.mean().item()) - p) <= 0.01
    assert torch.equal(kept.bool(), dropout_keep_mask(11, 0, 1, 1, S, S, p)[0, 0])


# ---------------------------------------------------------------- varlen

def varlen_case(seed, Hq, Hkv, D, max_len=160, B=4, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    lq = torch.randint(1, max_len, (B,), generator=gen)
    lk = torch.randint(1, max_len, (B,), generator=gen)
    lq[1] = 0  # an empty query sequence
    cu_q = torch.cat([torch.zeros(1, dtype=torch.int64), lq.cumsum(0)]).to(torch.int32)
    cu_k = torch.cat([torch.zeros(1, dtype=torch.int64), lk.cumsum(0)]).to(torch.int32)
    q = torch.randn(int(cu_q[-1]), Hq, D, generator=gen).to(dtype).requires_grad_()
    k = torch.randn(int(cu_k[-1]), Hkv, D, generator=gen).to(dtype).requires_grad_()
    v = torch.randn(int(cu_k[-1]), Hkv, D, generator=gen).to(dtype).requires_grad_()
    return q, k, v, cu_q, cu_k, int(lq.max()), int(lk.max())


@pytest.mark.parametrize("D,Hq,Hkv,opts", [
    (40, 4, 2, dict(causal=True)),
    (59, 2, 2, dict(window_size=(20, 5), softcap=2.0)),
    (111, 3, 1, dict(dropout_p=0.2, seed=(3, 1))),
    (256, 2, 1, dict(alibi=True, causal=True)),
    (64, 4, 2, dict(bias=(1, 2, "q", "k"))),
    (64, 2, 2, dict(mask=True, causal=True)),
])
def test_varlen_matches_per_sequence(D, Hq, Hkv, opts):
    q, k, v, cu_q, cu_k, mq, mk = varlen_case(D + Hq, Hq, Hkv, D)
    B = cu_q.numel() - 1
    kw = {key: val for key, val in opts.items() if key not in ("alibi", "bias", "mask")}
    gen = torch.Generator().manual_seed(99)
    if opts.get("alibi"):
        kw["alibi_slopes"] = torch.rand(B, Hq, generator=gen)
    if "bias" in opts:
        kw["bias"] = (torch.randn(1, 2, mq, mk, generator=gen) * 0.5).to(q.dtype).requires_grad_()
    if opts.get("mask"):
        kw["mask"] = torch.rand(B, 1, mq, mk, generator=gen) > 0.2
    out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, return_lse=True, **kw)
    assert out.shape == q.shape and lse.shape == (Hq, q.shape[0])
    dout = torch.randn(out.shape, generator=gen).to(out.dtype)
    inputs = [q, k, v] + ([kw["bias"]] if "bias" in kw else [])
    grads = torch.autograd.grad(out, inputs, dout)
    # Each sequence alone through the fixed-length API with the same options.
    ref_grads = [torch.zeros_like(x, dtype=torch.float32) for x in inputs]
    for b in range(B):
        q0, q1, k0, k1 = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        if q1 == q0:
            continue
        qs, ks, vs = (x.detach()[None, s0:s1].clone().requires_grad_()
                      for x, s0, s1 in ((q, q0, q1), (k, k0, k1), (v, k0, k1)))
        kb = dict(kw)
        if "alibi_slopes" in kw:
            kb["alibi_slopes"] = kw["alibi_slopes"][b]
        if "bias" in kw:
            kb["bias"] = kw["bias"].detach()[:, :, : q1 - q0, : k1 - k0].clone().requires_grad_()
        if "mask" in kw:
            kb["mask"] = kw["mask"][b: b + 1, :, : q1 - q0, : k1 - k0]
        if kw.get("dropout_p", 0) > 0:
            # The same per-sequence generator positions: varlen's (b, h) -> a
            # one-sequence call whose keep mask is b's slice.
            keep = dropout_keep_mask(*kw["seed"], B, Hq, mq, mk, kw["dropout_p"])
            kb.pop("seed")
            ref, ref_lse = attn.attention_reference(qs, ks, vs, upcast=True, dropout_keep=keep[b:b + 1, :, : q1 - q0, : k1 - k0], **kb)
        else:
            ref, ref_lse = attn.attention_reference(qs, ks, vs, upcast=True, **kb)
        assert max_err(out[q0:q1], ref[0]) <= 0.02 * max(1.0, ref.abs().max().item())
        fin = torch.isfinite(ref_lse[0])
        assert torch.equal(torch.isfinite(lse[:, q0:q1]), fin)
        assert torch.allclose(lse[:, q0:q1][fin], ref_lse[0][fin], atol=1e-3)
        sub_in = [qs, ks, vs] + ([kb["bias"]] if "bias" in kb else [])
        sub = torch.autograd.grad(ref, sub_in, dout[None, q0:q1])
        ref_grads[0][q0:q1] += sub[0][0]
        ref_grads[1][k0:k1] += sub[1][0]
        ref_grads[2][k0:k1] += sub[2][0]
        if "bias" in kb:
            ref_grads[3][:, :, : q1 - q0, : k1 - k0] += sub[3]
    for g, r in zip(grads, ref_grads):
        assert not torch.isnan(g).any()
        assert max_err(g, r) <= 0.03 * max(1.0, r.abs().max().item()), max_err(g, r)


def test_varlen_rejects_lengths_over_max():
    q, k, v, cu_q, cu_k, mq, mk = varlen_case(1, 2, 2, 32)
    with pytest.raises(ValueError, match="max_seqlen"):
        flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq - 1, mk)
    bad = cu_q.clone()
    bad[-1] += 5
    with pytest.raises(ValueError, match="packed row count"):
        flash_attn_varlen_func(q, k, v, bad, cu_k, mq + 5, mk)


# ---------------------------------------------------------------- determinism, threads

def test_backward_is_deterministic():
    case = make_case(B=2, Sq=200, Sk=190, Hq=4, Hkv=1, D=80, bias_shape=(1, 1, 200, 190))
    q, k, v, bias = case["q"], case["k"], case["v"], case["kwargs"]["bias"]
    runs = []
    for threads in ("1", "3"):
        import os
        os.environ["SYMHEAP_ATTN_THREADS"] = threads
        try:
            out = flash_attn_func(q, k, v, bias=bias, deterministic=True, dropout_p=0.1, seed=4)
            runs.append((out,) + torch.autograd.grad(out, (q, k, v, bias), torch.ones_like(out)))
        finally:
            del os.environ["SYMHEAP_ATTN_THREADS"]
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_concurrent_threads_match_single_thread():
    """8 threads call forward and backward at once; each result equals the
    result of the same call made alone."""
    def work(i):
        case = make_case(B=1, Sq=96 + i, Sk=130, Hq=4, Hkv=2, D=40 + 8 * i, seed=i,
                         bias_shape=(1, 4, 1, 130))
        q, k, v, bias = case["q"], case["k"], case["v"], case["kwargs"]["bias"]
        out = flash_attn_func(q, k, v, bias=bias, causal=i % 2 == 0, dropout_p=0.1 * (i % 3),
                              seed=(i, i))
        return (out,) + torch.autograd.grad(out, (q, k, v, bias), torch.ones_like(out))

    single = [work(i) for i in range(8)]
    results, errors = [None] * 8, []

    def body(i):
        try:
            for _ in range(3):
                results[i] = work(i)
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=body, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    for i in range(8):
        for a, b in zip(single[i], results[i]):
            assert torch.equal(a, b), f"thread {i} differs"


# ---------------------------------------------------------------- bad input

@pytest.mark.parametrize("kwargs, message", BAD_FORMS)
def test_bad_argument_forms_raise(kwargs, message):
    q = torch.randn(1, 8, 4, 32)
    with pytest.raises(ValueError, match=message):
        flash_attn_func(q, q, q, **kwargs)


def test_bad_arguments_raise():
    q = torch.randn(1, 8, 4, 32, dtype=torch.bfloat16)
    k = torch.randn(1, 8, 2, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="multiple"):
        flash_attn_func(q, torch.randn(1, 8, 3, 32, dtype=torch.bfloat16),
                        torch.randn(1, 8, 3, 32, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="dtype"):
        flash_attn_func(q, k.half(), k.half())
    with pytest.raises(ValueError, match=r"\(B, S, H, D\)"):
        flash_attn_func(q[0], k[0], k[0])
    with pytest.raises(ValueError, match="dropout_p"):
        flash_attn_func(q, k, k, dropout_p=1.0)
    with pytest.raises(ValueError, match="broadcast"):
        flash_attn_func(q, k, k, bias=torch.randn(1, 3, 8, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="bool"):
        flash_attn_func(q, k, k, mask=torch.ones(8, 8))
    with pytest.raises(ValueError, match="head dim"):
        flash_attn_func(torch.randn(1, 4, 1, 300), torch.randn(1, 4, 1, 300),
                        torch.randn(1, 4, 1, 300))
    with pytest.raises(ValueError, match="window_size"):
        flash_attn_func(q, k, k, window_size=(-2, 0))
    with pytest.raises(ValueError, match="softcap"):
        flash_attn_func(q, k, k, softcap=-1.0)
    with pytest.raises(ValueError, match="alibi_slopes"):
        flash_attn_func(q, k, k, alibi_slopes=torch.ones(3))
    with pytest.raises(ValueError, match="int32"):
        flash_attn_varlen_func(q[0], k[0], k[0], torch.tensor([0, 8]), torch.tensor([0, 8]), 8, 8)
    with pytest.raises(ValueError, match="offset"):
        flash_attn_func(q, k, k, dropout_p=0.1, seed=(1, 2 ** 32))
    with pytest.raises(TypeError):
        flash_attn_func(q.tolist(), k, k)


def test_no_grad_and_lse_only():
    case = make_case(Sq=40, Sk=50, D=32)
    with torch.no_grad():
        out, lse = flash_attn_func(case["q"], case["k"], case["v"], return_lse=True)
    assert out.grad_fn is None and lse.dtype == torch.float32 and lse.shape == (1, 2, 40)


def test_dropout_generator_known_answers():
    """The generator is Philox4x32-10 (counter = (j // 8, i, b*Hq + h, offset),
    key = seed), element j taking half j % 2 of word (j % 8) // 2; these are
    the published known-answer vectors, read back 16 bits at a time."""
    from symheap import _core
    def words(seed, offset, bh, i, octet):
        halves = [_core.attention_dropout_bits(seed, offset, bh, i, 8 * octet + e) for e in range(8)]
        assert all(0 <= x < 1 << 16 for x in halves)
        return [halves[2 * w] | halves[2 * w + 1] << 16 for w in range(4)]
    assert words(0, 0, 0, 0, 0) == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    assert words(0xA4093822 | 0x299F31D0 << 32, 0x03707344, 0x13198A2E, 0x85A308D3, 0x243F6A88) == [
        0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]


def test_dropout_threshold_resolution():
    """Kept iff the 16 bits are >= floor(p * 2^16): p = 0 keeps all, p near 1 none."""
    from symheap import _core
    assert _core.attention_dropout_threshold(0.0) == 0
    assert _core.attention_dropout_threshold(0.25) == 16384
    assert _core.attention_dropout_threshold(0.9999999) == 65535
    assert _core.attention_dropout_threshold(1.0) == 65536


def test_varlen_rows_outside_sequences():
    """Packed rows after the last sequence are left out: zero output and grads."""
    q, k, v, cu_q, cu_k, mq, mk = varlen_case(5, 2, 1, 48, B=2)
    extra = lambda x, n: torch.cat([x.detach(), torch.randn(n, *x.shape[1:]).to(x.dtype)]).requires_grad_()  # noqa: E731
    qx, kx, vx = extra(q, 3), extra(k, 2), extra(v, 2)
    out, lse = flash_attn_varlen_func(qx, kx, vx, cu_q, cu_k, mq, mk, causal=True, return_lse=True)
    assert torch.count_nonzero(out[-3:]) == 0 and torch.isinf(lse[:, -3:]).all()
    dq, dk, dv = torch.autograd.grad(out, (qx, kx, vx), torch.ones_like(out))
    assert torch.count_nonzero(dq[-3:]) == 0 and torch.count_nonzero(dk[-2:]) == 0
    assert torch.count_nonzero(dv[-2:]) == 0
    ref = flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, causal=True)
    assert torch.equal(out[:-3], ref)


def test_example_runs():
    import os
    import subprocess
    import sys
    root = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
    proc = subprocess.run([sys.executable, "examples/attention_demo.py"], capture_output=True,
                          text=True, timeout=180, cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "first sequence matches" in proc.stdout


def test_plan_cache_shared_by_threads():
    """Fixed-length calls from several threads share one plan per shape in the
    device's cache; the cached path (with and without autograd) matches the
    fp32 reference, and a new shape gets its own plan."""
    from symheap.attention import attention_reference
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 33, 2, 16, generator=g) for _ in range(3))
    ref, ref_lse = attention_reference(q, k, v, causal=True)
    _plan.clear_plan_caches()
    results, errors = [None] * 4, []

    def body(i):
        try:
            if i % 2:
                qq = q.clone().requires_grad_(True)
                results[i] = flash_attn_func(qq, k, v, causal=True, return_lse=True)
            else:
                results[i] = flash_attn_func(q, k, v, causal=True, return_lse=True)
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=body, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    for out, lse in results:
        assert out.shape == ref.shape and lse.shape == ref_lse.shape
        assert max_err(out, ref) < 1e-5 and max_err(lse, ref_lse) < 1e-5
    assert results[1][0].requires_grad and not results[0][0].requires_grad
    plans = _plan._device_caches[q.device].plans
    assert len(plans) == 1
    flash_attn_func(q[:, :20], k, v, causal=True)
    assert len(plans) == 2


def test_pooled_outputs_are_not_reused_while_held():
    """Repeat no-grad calls recycle outputs their callers released, never one
    still held (directly or through a view), and never one its last holder
    turned into an autograd leaf: every result stays its own inputs' answer."""
    from symheap.attention import attention_reference
    g = torch.Generator().manual_seed(17)

    def call():
        q, k, v = (torch.randn(1, 6, 4, 16, generator=g) for _ in range(3))
        out, lse = flash_attn_func(q, k, v, causal=True, return_lse=True)
        ref, ref_lse = attention_reference(q, k, v, causal=True)
        assert max_err(out, ref) < 1e-5 and max_err(lse, ref_lse) < 1e-5
        return out, lse, ref, ref_lse

    def storage(t):
        return t.untyped_storage().data_ptr()

    held = [call() for _ in range(6)]  # more calls than a pool keeps outputs
    views = [(out[:, 2:], ref[:, 2:]) for out, _, ref, _ in held[:2]]
    leaf = call()[0].requires_grad_(True)
    del held[:2], leaf  # only views of the first two outputs remain
    taken = {storage(t) for t, _ in views} | {storage(t) for r in held for t in r[:2]}
    later = [call() for _ in range(8)]
    for out, lse, _, _ in later:  # nothing held is handed out again
        assert storage(out) not in taken and storage(lse) not in taken
        assert not out.requires_grad and out.grad_fn is None
    for out, lse, ref, ref_lse in held:  # nor overwritten
        assert max_err(out, ref) < 1e-5 and max_err(lse, ref_lse) < 1e-5
    for view, ref in views:
        assert max_err(view, ref) < 1e-5
    # Released outputs do come back (NaN-poisoned first, so every element is rewritten).
    released = []
    for _ in range(4):
        released.append(storage(call()[0]))
    assert len(set(released)) < len(released)
    # Outputs made in inference mode are never handed out outside it.
    with torch.inference_mode():
        for _ in range(3):
            assert call()[0].is_inference()
    for _ in range(3):
        assert not call()[0].is_inference()
