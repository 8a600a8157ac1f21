"""The backward with a bias gradient over chunks of batch entries (when its
float32 workspace would pass _function.DBIAS_WORKSPACE_LIMIT): every gradient
equal to the one-launch run and within the rule against the fp32 reference,
for biases broadcast over the batch, the heads, the query rows or none, with
a batched mask, batched ALiBi slopes and GQA."""
import pytest
import torch

from symheap.attention import _function, flash_attn_func

from test_attention_common import check_case, make_case, max_err

CASES = {
    "batch_broadcast": dict(bias_shape=(1, 4, 37, 51)),
    "all_broadcast": dict(bias_shape=(37, 51)),
    "heads_broadcast": dict(bias_shape=(5, 1, 37, 51)),
    "rows_broadcast": dict(bias_shape=(1, 4, 1, 51)),
    "kv_heads": dict(bias_shape=(1, 2, 37, 51), Hkv=2),
    "mask_alibi": dict(bias_shape=(1, 1, 37, 51), mask_shape=(5, 1, 37, 51), alibi=True),
}


def _grads(case, opts):
    q, k, v, bias = case["q"], case["k"], case["v"], case["kwargs"]["bias"]
    out = flash_attn_func(q, k, v, **dict(case["kwargs"], **opts))
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(out.dtype)
    return torch.autograd.grad(out, (q, k, v, bias), dout)


def _counting_launches(monkeypatch):
    launches = []
    real = _function._launch_backward

    def counted(plan, tensors, use_cudnn):
        launches.append(plan.batch)
        return real(plan, tensors, use_cudnn)
    monkeypatch.setattr(_function, "_launch_backward", counted)
    return launches


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("opts", [dict(), dict(causal=True)])
def test_chunks_match_one_launch(name, opts, monkeypatch):
    kw = dict(CASES[name])
    Hkv = kw.pop("Hkv", 4)
    case = make_case(B=5, Sq=37, Sk=51, Hq=4, Hkv=Hkv, D=16, dtype=torch.float32, seed=11, **kw)
    for t in (case["q"], case["k"], case["v"]):
        t.requires_grad_()
    launches = _counting_launches(monkeypatch)
    whole = _grads(case, opts)
    assert launches == [5]
    rows = 37 if case["kwargs"]["bias"].shape[-2] != 1 else 1
    per_entry = 4 * rows * 51 * 4
    monkeypatch.setattr(_function, "DBIAS_WORKSPACE_LIMIT", 2 * per_entry)  # 2 entries a launch
    launches.clear()
    chunked = _grads(case, opts)
    assert launches == [2, 2, 1]
    for n, (a, b) in enumerate(zip(whole, chunked)):
        assert a.shape == b.shape and a.dtype == b.dtype, n
        assert max_err(a, b) <= 1e-6 * max(1.0, a.abs().max().item()), (n, max_err(a, b))
    check_case(case, **opts)  # and the chunked gradients within the rule against the fp32 reference


def test_dropout_and_small_workspaces_stay_whole(monkeypatch):
    """With dropout (the random stream depends on the batch index) and under
    the limit: one launch."""
    case = make_case(B=3, Sq=20, Sk=24, Hq=2, D=16, dtype=torch.float32, seed=2, bias_shape=(1, 2, 20, 24))
    for t in (case["q"], case["k"], case["v"]):
        t.requires_grad_()
    launches = _counting_launches(monkeypatch)
    monkeypatch.setattr(_function, "DBIAS_WORKSPACE_LIMIT", 1)
    _grads(case, dict(dropout_p=0.2, seed=7))
    assert launches == [3]
    launches.clear()
    _grads(case, dict())
    assert launches == [1, 1, 1]
    monkeypatch.setattr(_function, "DBIAS_WORKSPACE_LIMIT", 1 << 30)
    launches.clear()
    _grads(case, dict())
    assert launches == [3]
