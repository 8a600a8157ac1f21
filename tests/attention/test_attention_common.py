"""Shared pieces of the attention tests (cpu in tests/attention/, CUDA in tests/gpu/): no tests here;
random inputs and FlashAttention's accuracy rule against an fp32 reference."""
from __future__ import annotations

import math

import torch

from symheap.attention import attention_reference, dropout_keep_mask, flash_attn_func


def randn(shape, dtype, device, gen, requires_grad=True):
    t = torch.randn(shape, generator=gen, dtype=torch.float32).to(device=device, dtype=dtype)
    return t.requires_grad_(requires_grad)


def make_case(*, B=1, Sq=113, Sk=203, Hq=2, Hkv=None, D=64, dtype=torch.bfloat16, device="cpu",
              seed=0, bias_shape=None, mask_shape=None, alibi=False, bias_grad=True):
    gen = torch.Generator().manual_seed(seed)
    Hkv = Hq if Hkv is None else Hkv
    case = {
        "q": randn((B, Sq, Hq, D), dtype, device, gen),
        "k": randn((B, Sk, Hkv, D), dtype, device, gen),
        "v": randn((B, Sk, Hkv, D), dtype, device, gen),
        "kwargs": {},
    }
    if bias_shape is not None:
        bias = torch.randn(bias_shape, generator=gen) * 0.5
        case["kwargs"]["bias"] = bias.to(device=device, dtype=dtype).requires_grad_(bias_grad)
    if mask_shape is not None:
        mask = torch.rand(mask_shape, generator=gen) > 0.25
        if mask.dim() >= 2 and mask.shape[-2] > 3:
            mask[..., 3, :] = False  # a row with no visible key
        case["kwargs"]["mask"] = mask.to(device)
    if alibi:
        slopes = torch.tensor([2.0 ** (-8.0 * (h + 1) / Hq) for h in range(Hq)])
        case["kwargs"]["alibi_slopes"] = slopes.to(device)
    return case


def max_err(x, ref):
    return (x.float() - ref.float()).abs().max().item()


def check_case(case, *, fwd_factor=2.0, grad_factor=3.0, check_grads=True, **options):
    """Runs flash_attn_func and the references; asserts FlashAttention's rule:
    the error against the fp32 reference is at most `fwd_factor` (output) and
    `grad_factor` (gradients) times that of the same math done by PyTorch in
    the input dtype."""
    q, k, v = case["q"], case["k"], case["v"]
    kw = dict(case["kwargs"], **options)
    out, lse = flash_attn_func(q, k, v, return_lse=True, **kw)
    ref_kw = {key: val for key, val in kw.items() if key != "seed"}
    if kw.get("dropout_p", 0) > 0:
        seed = kw["seed"]
        s, o = (seed, 0) if isinstance(seed, int) else seed
        ref_kw["dropout_keep"] = dropout_keep_mask(s, o, q.shape[0], q.shape[2], q.shape[1],
                                                   k.shape[1], kw["dropout_p"])
    ref, ref_lse = attention_reference(q, k, v, upcast=True, **ref_kw)
    low, _ = attention_reference(q, k, v, upcast=False, **ref_kw)
    assert out.shape == q.shape[:3] + (v.shape[-1],) and out.dtype == q.dtype
    assert not torch.isnan(out).any(), "NaN in the output"
    slack = 1e-5 * max(1.0, ref.float().abs().max().item())
    assert max_err(out, ref) <= fwd_factor * max_err(low, ref) + slack, (
        f"output error {max_err(out, ref):.3g} > {fwd_factor} x {max_err(low, ref):.3g}")
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite), "lse finiteness differs from the reference"
    assert (lse[~finite] == float("-inf")).all(), "rows with no visible key must have lse -inf"
    if finite.any():
        assert (lse[finite] - ref_lse[finite]).abs().max().item() < 1e-3 * max(1.0, ref_lse[finite].abs().max().item())
    if not check_grads:
        return out
    gen = torch.Generator().manual_seed(1234)
    dout = torch.randn(out.shape, generator=gen).to(device=out.device, dtype=out.dtype)
    inputs = [q, k, v]
    names = ["dq", "dk", "dv"]
    bias = kw.get("bias")
    if bias is not None and bias.requires_grad:
        inputs.append(bias)
        names.append("dbias")
    got = torch.autograd.grad(out, inputs, dout)
    want = torch.autograd.grad(ref, inputs, dout)
    base = torch.autograd.grad(low, inputs, dout)
    for name, g, w, b, x in zip(names, got, want, base, inputs):
        assert g.shape == x.shape and g.dtype == x.dtype, name
        assert not torch.isnan(g).any(), f"NaN in {name}"
        gslack = 1e-5 * max(1.0, w.float().abs().max().item())
        assert max_err(g, w) <= grad_factor * max_err(b, w) + gslack, (
            f"{name} error {max_err(g, w):.3g} > {grad_factor} x {max_err(b, w):.3g}")
    return out


def alibi_slopes(H):
    return torch.tensor([2.0 ** (-8.0 * (h + 1) / H) for h in range(H)])


def softmax_scale(D):
    return 1.0 / math.sqrt(D)
