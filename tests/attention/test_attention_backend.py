"""The attention path selector (backend= / SYMHEAP_ATTN_BACKEND) on the cpu:
clear errors for impossible or misspelt choices, and backends() reporting."""
import pytest
import torch

from symheap import _core
from symheap.attention import _plan, attention_reference, backends, flash_attn_func


def small(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(1, 37, 2, 16, generator=gen) for _ in range(3)]


def test_cudnn_on_cpu_tensors_is_a_clear_error():
    q, k, v = small()
    with pytest.raises(ValueError, match="backend='cudnn' needs CUDA tensors"):
        flash_attn_func(q, k, v, backend="cudnn")


@pytest.mark.parametrize("bad", ["cuDNN", "flash", "", 3])
def test_bad_backend_value(bad):
    q, k, v = small()
    with pytest.raises(ValueError, match="backend must be one of 'auto', 'cudnn', 'own'"):
        flash_attn_func(q, k, v, backend=bad)


def test_bad_env_value_names_the_variable(monkeypatch):
    monkeypatch.setenv("SYMHEAP_ATTN_BACKEND", "fast")
    q, k, v = small()
    with pytest.raises(ValueError, match="SYMHEAP_ATTN_BACKEND must be one of"):
        flash_attn_func(q, k, v)


@pytest.mark.parametrize("env", ["cudnn", "own", "auto"])
@pytest.mark.parametrize("arg", [None, "own", "auto"])
def test_cpu_calls_run_the_cpu_path(monkeypatch, env, arg):
    """The variable only steers CUDA calls; cpu results match the reference."""
    monkeypatch.setenv("SYMHEAP_ATTN_BACKEND", env)
    monkeypatch.setattr(_plan, "poison_outputs", True)
    q, k, v = small(1)
    out = flash_attn_func(q, k, v, causal=True, backend=arg)
    ref, _ = attention_reference(q, k, v, causal=True)
    assert (out - ref).abs().max().item() < 1e-5


def test_backends_reports_every_path():
    info = backends()
    assert set(info) == {"cpu", "own", "cudnn"}
    for name, (usable, detail) in info.items():
        assert isinstance(usable, bool) and isinstance(detail, str) and detail, name
    assert info["cpu"][0]
    hopper, why = _core.attention_hopper_forward_status()
    if not hopper:  # says what is missing, and the own path's line repeats it
        assert "Hopper forward kernel" in why and "not built" in why
        assert not info["own"][0] or why in info["own"][1]
    if not info["cudnn"][0]:  # the reason says what is missing
        assert "cuDNN" in info["cudnn"][1] or "cudnn" in info["cudnn"][1]


def test_repeat_calls_with_changing_options_match_the_reference(monkeypatch):
    """Plans are remembered by every input they depend on: the same tensors
    called with each option in turn (twice) give each option's result."""
    monkeypatch.setattr(_plan, "poison_outputs", True)
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 45, 4, 24, generator=gen)
    k = torch.randn(2, 61, 2, 24, generator=gen)
    v = torch.randn(2, 61, 2, 24, generator=gen)
    variants = [dict(), dict(causal=True), dict(window_size=(5, 3)), dict(softmax_scale=0.3),
                dict(softcap=2.0), dict(causal=True, window_size=(7, -1)), dict(deterministic=True),
                dict(backend="own")]
    for _ in range(2):
        for opts in variants:
            out, lse = flash_attn_func(q, k, v, return_lse=True, **opts)
            ref_opts = {key: val for key, val in opts.items() if key not in ("deterministic", "backend")}
            ref, ref_lse = attention_reference(q, k, v, **ref_opts)
            assert (out - ref).abs().max().item() < 1e-4, opts
            assert (lse - ref_lse).abs().max().item() < 1e-4, opts
    # Other shapes through the same function are planned afresh.
    q2 = torch.randn(1, 45, 4, 24, generator=gen)
    out = flash_attn_func(q2, k[:1], v[:1], causal=True)
    assert (out - attention_reference(q2, k[:1], v[:1], causal=True)[0]).abs().max().item() < 1e-4


@pytest.mark.parametrize("env", [None, "", "auto", "basic", "pipelined_previous", "hopper", "hopper_lockstep",
                                 "hopper_pingpong", "pipelined"])
def test_own_forward_kernel_choice(monkeypatch, env):
    """The own CUDA forward kernel per (padded) head dim: for 64, 128 and 256
    the Hopper kernel where it is built, else the pipelined one, or the one
    the variable names (the pipelined kernel with the softmax before the lean
    one, the Hopper or the pipelined kernel); the basic one elsewhere or when
    the variable forces it."""
    from symheap import _core
    name = _core.attention_own_forward_env
    assert name == "SYMHEAP_ATTN_OWN_FORWARD"
    if env is None:
        monkeypatch.delenv(name, raising=False)
    else:
        monkeypatch.setenv(name, env)
    for d in (8, 32, 56, 64, 72, 96, 120, 128, 136, 192, 256):
        default = "hopper" if _core.attention_hopper_forward_status()[0] else "pipelined"
        pipelined = env if env in ("pipelined_previous", "hopper", "hopper_lockstep", "hopper_pingpong",
                                   "pipelined") else default
        want = pipelined if d in (64, 128, 256) and env != "basic" else "basic"
        assert _core.attention_own_forward_kernel(d) == want, d


@pytest.mark.parametrize("env", [None, "auto", "hopper", "hopper_cp_async", "pipelined_dq_fused"])
def test_backward_kernel_for_call(monkeypatch, env):
    """A call that cannot fuse dQ (deterministic, logit features) runs the
    pipelined kernels where the default would take the Hopper dK/dV kernel
    (at head dim 256 that kernel without dQ); a kernel the variable forces
    stays."""
    from symheap import _core
    name = _core.attention_own_backward_env
    if env is None:
        monkeypatch.delenv(name, raising=False)
    else:
        monkeypatch.setenv(name, env)
    for d in (64, 128, 256):
        chosen = _core.attention_own_backward_kernel(d)
        assert _core.attention_backward_kernel_for_call(d, True) == chosen
        by_default = chosen == "hopper" and env in (None, "auto")
        unfused = ("hopper_dq_separate" if d == 256 else "pipelined") if by_default else chosen
        assert _core.attention_backward_kernel_for_call(d, False) == unfused
    if env == "hopper":
        assert _core.attention_backward_kernel_for_call(128, False) == "hopper"


def test_own_forward_kernel_bad_env_names_the_variable(monkeypatch):
    from symheap import _core
    monkeypatch.setenv("SYMHEAP_ATTN_OWN_FORWARD", "fast")
    with pytest.raises(ValueError, match="SYMHEAP_ATTN_OWN_FORWARD must be 'auto', 'basic', 'pipelined_previous', 'hopper', "
                       "'hopper_pingpong', 'hopper_lockstep' or 'pipelined'"):
        _core.attention_own_forward_kernel(64)


@pytest.mark.parametrize("env", [None, "auto", "basic", "pipelined_dq16", "pipelined_dkdv32",
                                 "pipelined_dkdv_unshared", "pipelined_dq_fused", "pipelined_dq_separate",
                                 "hopper", "hopper_dq_separate", "hopper_cp_async"])
def test_own_backward_kernel_choice(monkeypatch, env):
    """The backward's kernels (dQ and dK/dV): pipelined for head dims 64, 128
    and 256 (where they are built, the Hopper dK/dV kernels with dQ fused)
    unless
    SYMHEAP_ATTN_OWN_BACKWARD forces the basic ones (or the pipelined ones
    with the 16-row dQ kernel, the 32-row dK/dV kernel, the 64-row dK/dV
    kernel without shared fragments, dQ fused into the dK/dV kernel or
    computed by its own kernel, or the Hopper ones); a bad value names the
    variable."""
    from symheap import _core
    name = _core.attention_own_backward_env
    assert name == "SYMHEAP_ATTN_OWN_BACKWARD"
    if env is None:
        monkeypatch.delenv(name, raising=False)
    else:
        monkeypatch.setenv(name, env)
    for d in (32, 64, 96, 128, 192, 256):
        variants = ("pipelined_dq16", "pipelined_dkdv32", "pipelined_dkdv_unshared",
                    "pipelined_dq_fused", "pipelined_dq_separate", "hopper", "hopper_dq_separate",
                    "hopper_cp_async")
        hopper_default = (_core.attention_hopper_backward_defaults.get(d, (None,))[0]
                          if _core.attention_hopper_forward_status()[0] else None)
        pipelined = env if env in variants else hopper_default or "pipelined"
        want = pipelined if d in (64, 128, 256) and env != "basic" else "basic"
        assert _core.attention_own_backward_kernel(d) == want, d
    assert _core.attention_hopper_backward_defaults == {
        64: ("hopper", "pipelined"), 128: ("hopper", "pipelined"), 256: ("hopper", "hopper_dq_separate")}
    monkeypatch.setenv(name, "fast")
    with pytest.raises(ValueError, match="SYMHEAP_ATTN_OWN_BACKWARD must be 'auto', 'basic', "
                       "'pipelined_dq16', 'pipelined_dkdv32', 'pipelined_dkdv_unshared', "
                       "'pipelined_dq_fused', 'pipelined_dq_separate', 'hopper', 'hopper_dq_separate' or "
                       "'hopper_cp_async'"):
        _core.attention_own_backward_kernel(64)
