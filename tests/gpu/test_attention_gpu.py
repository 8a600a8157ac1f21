"""Attention on CUDA: the issue's grid in float16 and bfloat16 against an fp32
reference (FlashAttention's rule) with each path forced (own kernels, cuDNN,
auto), every feature, varlen and dropout checked against the cpu path, and
concurrent threads over all devices."""
import os
import re
import sys
import threading

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "attention"))

from symheap import _core  # noqa: E402
from symheap.attention import (_plan, attention_reference, dropout_keep_mask, flash_attn_func,  # noqa: E402
                                flash_attn_varlen_func)

from test_attention_common import check_case, make_case, max_err  # noqa: E402

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or not getattr(_core, "attention_has_cuda", False),
    reason="needs a CUDA device and a CUDA build of symheap")

HEAD_DIMS = [40, 59, 111, 256]
SHAPES = [(113, 203), (128, 217), (1023, 1024), (1024, 1023)]
DTYPES = [torch.bfloat16, torch.float16]


@pytest.fixture(autouse=True)
def poison_outputs(monkeypatch):
    monkeypatch.setattr(_plan, "poison_outputs", True)


# "own" and "cudnn" force a path (SYMHEAP_ATTN_BACKEND); "auto" takes cuDNN
# for what it supports and the own kernels for the rest.
PATHS = ["own", "cudnn", "auto"]


def require_cudnn():
    """Fails when the cuDNN path cannot run: left out of this build (no cuDNN
    headers at build time, or SYMHEAP_CUDNN=OFF; see docs/attention.md) or unusable."""
    ok, why = _core.attention_cudnn_status()
    if not ok:
        pytest.fail(f"the cuDNN path cannot run here: {why}")


def cudnn_expected(case, opts) -> bool:
    """The calls the cuDNN path takes (docs/attention.md, "The cuDNN path"):
    no bias, mask, ALiBi, softcap or dropout; masking none, causal, or causal
    with a left window; and causal only with seqlen_q <= seqlen_k."""
    kw = dict(case["kwargs"], **opts)
    if any(kw.get(n) is not None for n in ("bias", "mask", "alibi_slopes")):
        return False
    if kw.get("softcap", 0) or kw.get("dropout_p", 0):
        return False
    left, right = kw.get("window_size", (-1, -1))
    if kw.get("causal"):
        right = 0
    if right > 0 or (left >= 0 and right != 0):
        return False
    return not (right == 0 and case["q"].shape[1] > case["k"].shape[1])


def check_on_path(path, monkeypatch, case, **opts):
    """check_case with `path` forced through SYMHEAP_ATTN_BACKEND; a call that
    cuDNN must not take raises UnsupportedError when cudnn is forced."""
    monkeypatch.setenv("SYMHEAP_ATTN_BACKEND", path)
    if path == "cudnn":
        require_cudnn()
        if not cudnn_expected(case, opts):
            with pytest.raises(_core.UnsupportedError, match="backend='cudnn' cannot run this call"):
                flash_attn_func(case["q"], case["k"], case["v"], **dict(case["kwargs"], **opts))
            return None
    return check_case(case, **opts)


def on_gpu(case):
    return {key: (val.detach().cuda().requires_grad_(val.requires_grad)
                  if isinstance(val, torch.Tensor) else val) for key, val in case.items()}


def gpu_case(**kw):
    return make_case(device="cuda", **kw)


def case_shapes(make_kw, Sq, Sk):
    """A feature table's case arguments with the "Sq" / "Sk" placeholders in its shapes
    replaced by the row's lengths, and 4 kv heads unless the entry names its own."""
    kw = {k: (tuple(Sq if x == "Sq" else Sk if x == "Sk" else x for x in v)
              if isinstance(v, tuple) else v) for k, v in make_kw.items()}
    kw.setdefault("Hkv", 4)
    return kw


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", HEAD_DIMS + [32, 64, 96, 128, 160, 192])
@pytest.mark.parametrize("Sq,Sk", SHAPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("path", PATHS)
def test_grid(path, dtype, D, Sq, Sk, causal, monkeypatch):
    case = gpu_case(B=2, Sq=Sq, Sk=Sk, Hq=4, Hkv=2, D=D, dtype=dtype, seed=D + Sq)
    check_on_path(path, monkeypatch, case, causal=causal)


FEATURES = {
    "window": (dict(), dict(window_size=(37, 11))),
    "mqa": (dict(Hkv=1), dict()),
    "bias": (dict(bias_shape=(2, 4, "Sq", "Sk")), dict()),
    "bias_broadcast": (dict(Hkv=2, bias_shape=(1, 2, 1, "Sk")), dict()),
    "mask": (dict(mask_shape=(2, 1, "Sq", "Sk")), dict()),
    "softcap": (dict(), dict(softcap=3.0)),
    "alibi": (dict(alibi=True), dict()),
    "dropout": (dict(), dict(dropout_p=0.17, seed=(1234, 5))),
    "all": (dict(Hkv=2, bias_shape=(1, 4, "Sq", "Sk"), mask_shape=(2, 1, 1, "Sk"), alibi=True),
            dict(softcap=4.0, window_size=(90, 30), dropout_p=0.1, seed=3)),
}


@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", HEAD_DIMS)
@pytest.mark.parametrize("Sq,Sk", [(113, 203), (1024, 1023)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("path", PATHS)
def test_features(path, feature, dtype, D, Sq, Sk, causal, monkeypatch):
    make_kw, opts = FEATURES[feature]
    make_kw = case_shapes(make_kw, Sq, Sk)
    case = gpu_case(B=2, Sq=Sq, Sk=Sk, Hq=4, D=D, dtype=dtype, seed=D * 7 + Sq, **make_kw)
    check_on_path(path, monkeypatch, case, causal=causal, **opts)


@pytest.mark.parametrize("opts", [
    dict(causal=True), dict(dropout_p=0.2, seed=(5, 6)), dict(softcap=2.0, window_size=(40, 8)),
])
@pytest.mark.parametrize("D", [40, 128, 256])
def test_matches_cpu_path(opts, D):
    """Same inputs on cpu and CUDA: same function (dropout masks included)."""
    case = make_case(B=2, Sq=257, Sk=300, Hq=4, Hkv=2, D=D, dtype=torch.bfloat16, seed=D,
                     bias_shape=(1, 1, 1, 300))
    q, k, v, bias = case["q"], case["k"], case["v"], case["kwargs"]["bias"]
    outs = []
    for dev in ("cpu", "cuda"):
        xs = [x.detach().to(dev).requires_grad_() for x in (q, k, v, bias)]
        out = flash_attn_func(*xs[:3], bias=xs[3], **opts)
        grads = torch.autograd.grad(out, xs, torch.ones_like(out))
        outs.append([out.float().cpu()] + [g.float().cpu() for g in grads])
    for name, a, b in zip(["out", "dq", "dk", "dv", "dbias"], *outs):
        scale = max(1.0, a.abs().max().item())
        assert max_err(a, b) <= 0.02 * scale, (name, max_err(a, b))


def packed_inputs(lq, lk, Hq, Hkv, D, gen):
    """cu_seqlens of both sides and random packed bf16 q, k, v for lengths lq, lk."""
    cu_q = torch.cat([torch.zeros(1, dtype=torch.int64), lq.cumsum(0)]).to(torch.int32)
    cu_k = torch.cat([torch.zeros(1, dtype=torch.int64), lk.cumsum(0)]).to(torch.int32)
    q = torch.randn(int(cu_q[-1]), Hq, D, generator=gen).bfloat16()
    k = torch.randn(int(cu_k[-1]), Hkv, D, generator=gen).bfloat16()
    v = torch.randn(int(cu_k[-1]), Hkv, D, generator=gen).bfloat16()
    return cu_q, cu_k, q, k, v


def test_varlen_matches_cpu_path():
    gen = torch.Generator().manual_seed(0)
    B, Hq, Hkv, D = 5, 4, 2, 72
    lq = torch.randint(1, 700, (B,), generator=gen)
    lk = torch.randint(1, 700, (B,), generator=gen)
    cu_q, cu_k, q, k, v = packed_inputs(lq, lk, Hq, Hkv, D, gen)
    mq, mk = int(lq.max()), int(lk.max())
    bias = (torch.randn(1, Hkv, 1, mk, generator=gen) * 0.3).bfloat16()
    for opts in (dict(causal=True), dict(dropout_p=0.15, seed=(8, 1), window_size=(64, 64))):
        results = []
        for dev in ("cpu", "cuda"):
            xs = [x.to(dev).requires_grad_() for x in (q, k, v, bias)]
            out, lse = flash_attn_varlen_func(xs[0], xs[1], xs[2], cu_q.to(dev), cu_k.to(dev), mq, mk,
                                              bias=xs[3], return_lse=True, **opts)
            grads = torch.autograd.grad(out, xs, torch.ones_like(out))
            results.append([out.float().cpu(), lse.cpu()] + [g.float().cpu() for g in grads])
        for name, a, b in zip(["out", "lse", "dq", "dk", "dv", "dbias"], *results):
            fin = torch.isfinite(a)
            assert torch.equal(fin, torch.isfinite(b)), name
            assert max_err(a[fin], b[fin]) <= 0.02 * max(1.0, a[fin].abs().max().item()), name


def test_fully_masked_rows_and_lse():
    case = gpu_case(Sq=300, Sk=100, Hq=2, D=64)
    out = check_case(case, causal=True)
    assert torch.count_nonzero(out[:, :200]) == 0


def test_deterministic_backward():
    case = gpu_case(B=2, Sq=513, Sk=700, Hq=8, Hkv=2, D=128, bias_shape=(1, 8, 1, 700))
    q, k, v, bias = case["q"], case["k"], case["v"], case["kwargs"]["bias"]
    runs = []
    for _ in range(2):
        out = flash_attn_func(q, k, v, bias=bias, causal=True, deterministic=True)
        runs.append(torch.autograd.grad(out, (q, k, v, bias), torch.ones_like(out)))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_no_host_sync_and_no_new_device_memory():
    case = gpu_case(B=2, Sq=512, Sk=512, Hq=4, Hkv=2, D=64, bias_shape=(1, 4, 1, 512))
    q, k, v, bias = case["q"], case["k"], case["v"], case["kwargs"]["bias"]
    cu = torch.tensor([0, 300, 512], dtype=torch.int32, device="cuda")

    def step():
        out = flash_attn_func(q, k, v, bias=bias, causal=True, dropout_p=0.1, seed=1)
        g = torch.autograd.grad(out, (q, k, v, bias), torch.ones_like(out))
        outv = flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 300, 300, causal=True)
        gv = torch.autograd.grad(outv, (q, k, v), torch.ones_like(outv))
        return g, gv

    step()
    torch.cuda.synchronize()
    segments = torch.cuda.memory_stats()["segment.all.allocated"]
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert torch.cuda.memory_stats()["segment.all.allocated"] == segments


def test_threads_over_all_devices():
    """8 threads over every device, each on its own stream, call forward and
    backward at once. With deterministic=True the results equal the single-thread
    results bit for bit; the default backward (dQ summed with atomics where it is
    fused into the dK/dV kernel, in no fixed order) agrees to rounding."""
    n_dev = torch.cuda.device_count()

    def work(i):
        dev = torch.device("cuda", i % n_dev)
        case = make_case(B=1, Sq=200 + 16 * i, Sk=333, Hq=4, Hkv=2, D=[40, 64, 111, 128][i % 4],
                         seed=i, bias_shape=(1, 4, 1, 333))
        xs = [case[n].detach().to(dev).requires_grad_() for n in ("q", "k", "v")]
        bias = case["kwargs"]["bias"].detach().to(dev).requires_grad_()
        res = {}
        for deterministic in (True, False):
            out = flash_attn_func(*xs, bias=bias, causal=i % 2 == 0, dropout_p=0.1 * (i % 3), seed=(i, i),
                                  deterministic=deterministic)
            grads = torch.autograd.grad(out, xs + [bias], torch.ones_like(out))
            res[deterministic] = [t.cpu() for t in (out,) + grads]
        return res

    single = [work(i) for i in range(8)]
    results, errors = [None] * 8, []

    def body(i):
        try:
            dev = torch.device("cuda", i % n_dev)
            with torch.cuda.device(dev), torch.cuda.stream(torch.cuda.Stream(dev)):
                for _ in range(3):
                    results[i] = work(i)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=body, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    names = ("out", "dq", "dk", "dv", "dbias")
    for i in range(8):
        for name, a, b in zip(names, single[i][True], results[i][True]):
            assert torch.equal(a, b), f"thread {i}: deterministic {name} differs"
        for name, a, b in zip(names, single[i][False], results[i][False]):
            torch.testing.assert_close(b.float(), a.float(), atol=2e-2, rtol=2e-2,
                                       msg=lambda m: f"thread {i}: {name}: {m}")


@pytest.mark.parametrize("D", [64, 128])
def test_cudnn_auto_takes_cudnn_when_supported(D):
    """auto gives cuDNN's bits on a call it supports and the own kernels' bits
    on one it does not (a bias)."""
    require_cudnn()
    case = gpu_case(B=2, Sq=256, Sk=320, Hq=4, Hkv=2, D=D, bias_shape=(1, 4, 1, 320))
    q, k, v, bias = case["q"], case["k"], case["v"], case["kwargs"]["bias"]
    run = {p: flash_attn_func(q, k, v, causal=True, return_lse=True, backend=p) for p in PATHS}
    for a, b in zip(run["auto"], run["cudnn"]):
        assert torch.equal(a, b)
    own = flash_attn_func(q, k, v, bias=bias, causal=True, backend="own")
    auto = flash_attn_func(q, k, v, bias=bias, causal=True, backend="auto")
    assert torch.equal(own, auto)
    with pytest.raises(_core.UnsupportedError, match="bias"):
        flash_attn_func(q, k, v, bias=bias, backend="cudnn")


def test_cudnn_lse_matches_own_kernels():
    """Backward and return_lse rely on one lse convention (natural log, (B, Hq, Sq))."""
    require_cudnn()
    case = gpu_case(B=2, Sq=300, Sk=300, Hq=8, Hkv=2, D=128)
    _, lse_own = flash_attn_func(case["q"], case["k"], case["v"], causal=True, return_lse=True,
                                 backend="own")
    _, lse_cudnn = flash_attn_func(case["q"], case["k"], case["v"], causal=True, return_lse=True,
                                   backend="cudnn")
    assert lse_own.shape == lse_cudnn.shape == (2, 8, 300)
    assert (lse_own - lse_cudnn).abs().max().item() < 1e-3


def test_cudnn_no_host_sync_and_no_new_device_memory():
    require_cudnn()
    case = gpu_case(B=2, Sq=512, Sk=512, Hq=8, Hkv=2, D=128)
    q, k, v = case["q"], case["k"], case["v"]

    def step():
        out = flash_attn_func(q, k, v, causal=True, backend="cudnn")
        return torch.autograd.grad(out, (q, k, v), torch.ones_like(out))

    step()  # builds the graphs
    torch.cuda.synchronize()
    segments = torch.cuda.memory_stats()["segment.all.allocated"]
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert torch.cuda.memory_stats()["segment.all.allocated"] == segments


def test_cudnn_threads_mixed_paths():
    """8 threads over every device run mixed shapes through cuDNN and the own
    kernels at once, each on its own stream: results equal the serial ones
    (deterministic=True, so cuDNN's backward has a fixed summation order)."""
    require_cudnn()
    n_dev = torch.cuda.device_count()

    def work(i):
        dev = torch.device("cuda", i % n_dev)
        case = make_case(B=2, Sq=256 + 64 * (i % 3), Sk=384, Hq=8, Hkv=[8, 2, 1][i % 3],
                         D=[64, 128][i % 2], seed=100 + i)
        xs = [case[n].detach().to(dev).requires_grad_() for n in ("q", "k", "v")]
        path = "cudnn" if i % 2 == 0 else "own"
        out, lse = flash_attn_func(*xs, causal=i % 4 < 2, return_lse=True, deterministic=True,
                                   backend=path)
        grads = torch.autograd.grad(out, xs, torch.ones_like(out))
        return [t.cpu() for t in (out, lse) + grads]

    serial = [work(i) for i in range(8)]
    results, errors = [None] * 8, []

    def body(i):
        try:
            dev = torch.device("cuda", i % n_dev)
            with torch.cuda.device(dev), torch.cuda.stream(torch.cuda.Stream(dev)):
                for _ in range(3):
                    results[i] = work(i)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=body, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not any(t.is_alive() for t in threads), "a thread did not finish in 300 s"
    assert not errors, errors
    for i in range(8):
        for a, b in zip(serial[i], results[i]):
            assert torch.equal(a, b), f"thread {i} differs"


def test_cuda_rejects_float32():
    q = torch.randn(1, 8, 2, 32, device="cuda")
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        flash_attn_func(q, q, q)


def diagnose():
    """A compact table, one line per configuration, for a first look at a new
    device or build: `python tests/gpu/test_attention_gpu.py`."""
    import time
    configs = [(dtype, D, feature) for dtype in DTYPES for D in (64, 40, 59, 111, 128, 256)
               for feature in ("plain",)]
    configs += [(torch.bfloat16, 64, f) for f in FEATURES] + [(torch.bfloat16, 256, f) for f in FEATURES]
    _plan.poison_outputs = True
    for dtype, D, feature in configs:
        make_kw, opts = FEATURES.get(feature, (dict(), dict()))
        Sq, Sk = 113, 203
        make_kw = case_shapes(make_kw, Sq, Sk)
        t0 = time.time()
        try:
            check_case(gpu_case(B=2, Sq=Sq, Sk=Sk, Hq=4, D=D, dtype=dtype, seed=1, **make_kw), **opts)
            torch.cuda.synchronize()
            status = "ok"
        except AssertionError as e:
            status = f"FAIL {e}"
        except Exception as e:  # noqa: BLE001 - reported, then continue
            status = f"ERROR {type(e).__name__}: {e}"
        print(f"{str(dtype)[6:]:>9} D={D:<3} {feature:<15} {time.time() - t0:5.2f}s {status}"[:300],
              flush=True)


if __name__ == "__main__":
    diagnose()


@pytest.mark.parametrize("path", ["own", "auto"])
def test_pooled_outputs_are_not_reused_while_held(path, monkeypatch):
    """No-grad calls recycle released outputs on the stream they ran on, and
    never hand out one still held: every result keeps its own answer."""
    from symheap.attention import attention_reference
    monkeypatch.setenv("SYMHEAP_ATTN_BACKEND", path)
    g = torch.Generator().manual_seed(23)
    side = torch.cuda.Stream()

    def call(stream=None):
        q, k, v = (torch.randn(1, 128, 8, 64, generator=g).to(torch.bfloat16) for _ in range(3))
        ref, ref_lse = attention_reference(q.float(), k.float(), v.float(), causal=True)
        q, k, v = (t.to("cuda") for t in (q, k, v))
        stream = torch.cuda.current_stream() if stream is None else stream
        stream.wait_stream(torch.cuda.current_stream())  # q, k, v were copied on this one
        with torch.cuda.stream(stream):
            out, lse = flash_attn_func(q, k, v, causal=True, return_lse=True)
        return out, lse, ref, ref_lse

    def storage(t):
        return t.untyped_storage().data_ptr()

    held = [call() for _ in range(6)] + [call(side) for _ in range(3)]
    taken = {storage(t) for r in held for t in r[:2]}
    later = [call(s) for s in (None, side) * 3]
    torch.cuda.synchronize()
    for out, lse, _, _ in later:
        assert storage(out) not in taken and storage(lse) not in taken
    for out, lse, ref, ref_lse in held + later:
        assert max_err(out.cpu(), ref) < 2e-2 and max_err(lse.cpu(), ref_lse) < 1e-2
    released = [storage(call()[0]) for _ in range(4)]
    assert len(set(released)) < len(released)


# ---- the pipelined forward kernel (head dims 64, 128 and 256 on the own path;
# cuda_forward_pipelined.cuh). Lengths that are not multiples of its tiles
# (128 query rows, 32 or 64 keys), causal with Sq != Sk, GQA, windows, every logit
# feature, varlen with empty sequences, and the basic kernel on the same calls.
# Without logit features and for a positive scale the kernel runs its lean
# softmax; "pipelined_previous" forces the softmax before it (checked too).

PIPELINED_DIMS = [64, 128, 256]
RAGGED = [(1, 1), (17, 17), (1, 1000), (17, 129), (127, 129), (129, 127), (1000, 1000),
          (1000, 17), (257, 1000)]


# The forward kernels of those head dims: the Hopper one (wgmma;
# cuda_forward_hopper.cuh; the default where built) and the pipelined one.
# "hopper_pingpong" and "hopper_lockstep" differ from "hopper" at head dim 128 without logit
# features only.
FORWARDS = ["hopper", "hopper_pingpong", "hopper_lockstep", "pipelined"]
# (head dim, forward) pairs: those two only at head dim 128, where they are other kernels.
FWD_BY_DIM = [(d, f) for d in PIPELINED_DIMS for f in FORWARDS
              if f not in ("hopper_pingpong", "hopper_lockstep") or d == 128]
DEFAULT_FORWARD = "hopper" if _core.attention_hopper_forward_status()[0] else "pipelined"


def own_forward(monkeypatch, kernel):
    """Forces the own kernels and the forward kernel ("auto" = the Hopper
    kernel where built, else the pipelined one, "hopper", "pipelined", "basic",
    "pipelined_previous" = pipelined with the softmax before the lean one), and
    checks the choice is what the test expects."""
    monkeypatch.setenv("SYMHEAP_ATTN_BACKEND", "own")
    monkeypatch.setenv(_core.attention_own_forward_env, kernel)
    for d in PIPELINED_DIMS:
        assert _core.attention_own_forward_kernel(d) == (DEFAULT_FORWARD if kernel == "auto" else kernel)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("Sq,Sk", RAGGED)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("D,fwd", FWD_BY_DIM)
def test_pipelined_lengths(dtype, D, Sq, Sk, causal, monkeypatch, fwd):
    own_forward(monkeypatch, fwd)
    case = gpu_case(B=2, Sq=Sq, Sk=Sk, Hq=4, Hkv=4, D=D, dtype=dtype, seed=Sq * 3 + Sk + D)
    check_case(case, causal=causal)


@pytest.mark.parametrize("Sq,Sk", [(128, 128), (300, 257), (1000, 1000), (129, 4099), (2048, 2048)])
@pytest.mark.parametrize("opts", [dict(), dict(causal=True), dict(window_size=(300, 40)),
                                  dict(softmax_scale=-0.25)])
def test_hopper_pingpong_matches_lockstep(Sq, Sk, opts, monkeypatch):
    """At head dim 128 the pingpong kernel fed by TMA (the default), its persistent
    form (the default in the batch layout; forced on and off here) and the pingpong kernel
    fed by its own copies do each warpgroup's arithmetic in the same order as the
    lockstep one: outputs and lse bit for bit equal, over 1 to 33 key tiles (the three
    buffers reused many times), causal, a window and the softmax for a negative scale."""
    case = gpu_case(B=2, Sq=Sq, Sk=Sk, Hq=4, Hkv=2, D=128, dtype=torch.bfloat16, seed=Sq + 7 * Sk)
    runs = {}
    for fwd, persistent in (("hopper_lockstep", ""), ("hopper_pingpong", ""), ("hopper", ""),
                            ("hopper", "0"), ("hopper", "1")):
        own_forward(monkeypatch, fwd)
        monkeypatch.setenv("SYMHEAP_ATTN_FWD_PERSISTENT", persistent)
        runs[fwd, persistent] = flash_attn_func(case["q"], case["k"], case["v"], return_lse=True, **opts)
    (out0, lse0), *_ = runs.values()
    for name, (out, lse) in runs.items():
        assert torch.equal(out0, out), name
        assert torch.equal(lse0, lse), (name, (lse0 - lse).abs().max().item())


@pytest.mark.parametrize("fwd", ["hopper", "hopper_pingpong", "hopper_lockstep"])
def test_packed_tile_past_a_sequence_takes_nothing_of_the_next(fwd, monkeypatch, D=128):
    """Packed sequences at head dim 128: sequence 0 (200 rows) ends inside a key tile whose
    other rows are sequence 1's, and sequence 1's values there are inf. Sequence 0's
    outputs stay finite and equal those of the same sequence alone (0 x inf would be NaN
    if a kernel let those rows into P V)."""
    own_forward(monkeypatch, fwd)
    gen = torch.Generator(device="cuda").manual_seed(11)
    q = torch.randn(500, 4, D, generator=gen, device="cuda").to(torch.bfloat16)
    k = torch.randn(500, 2, D, generator=gen, device="cuda").to(torch.bfloat16)
    v = torch.randn(500, 2, D, generator=gen, device="cuda").to(torch.bfloat16)
    v[200:260] = float("inf")
    cu = torch.tensor([0, 200, 500], dtype=torch.int32, device="cuda")
    for causal in (False, True):
        out = flash_attn_varlen_func(q, k, v, cu, cu, 300, 300, causal=causal)
        alone = flash_attn_func(q[None, :200], k[None, :200], v[None, :200], causal=causal)[0]
        assert torch.isfinite(out[:200]).all()
        assert max_err(out[:200], alone) < 1e-2


@pytest.mark.parametrize("D", PIPELINED_DIMS)
@pytest.mark.parametrize("Sq,Sk", [(1, 1000), (127, 129), (1000, 1000), (1000, 17), (257, 1000)])
@pytest.mark.parametrize("opts", [dict(), dict(causal=True), dict(window_size=(37, 11)),
                                  dict(softmax_scale=0.31)])
def test_pipelined_previous_softmax(D, Sq, Sk, opts, monkeypatch):
    """The forward with the softmax before the lean one, forced, against the
    fp32 reference (the default runs the lean one in the tests above)."""
    own_forward(monkeypatch, "pipelined_previous")
    case = gpu_case(B=2, Sq=Sq, Sk=Sk, Hq=4, Hkv=2, D=D, dtype=torch.bfloat16, seed=Sq * 5 + Sk + D)
    check_case(case, check_grads=False, **opts)


PIPELINED_OPTS = {
    "gqa": (dict(Hkv=1), dict()),
    "gqa2": (dict(Hkv=2), dict(causal=True)),
    "window": (dict(), dict(window_size=(37, 11))),
    "window_left_causal": (dict(), dict(window_size=(200, 0))),
    "window_right": (dict(), dict(window_size=(-1, 70))),
    "scale": (dict(), dict(softmax_scale=0.31)),
    "scale_negative": (dict(), dict(softmax_scale=-0.25)),  # not the lean softmax
    # Every feature but a bias: the Hopper backward's form without a bias, softcap's
    # derivative recomputed from P less the ALiBi term.
    "all_but_bias": (dict(Hkv=2, mask_shape=(2, 1, 1, "Sk"), alibi=True),
                     dict(softcap=2.5, window_size=(90, 30), dropout_p=0.1, seed=11)),
}
PIPELINED_FEATURES = {**{k: v for k, v in FEATURES.items() if k not in ("window", "mqa")},
                      **PIPELINED_OPTS}


@pytest.mark.parametrize("feature", list(PIPELINED_FEATURES))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("Sq,Sk", [(127, 129), (1000, 300), (300, 1000)])
@pytest.mark.parametrize("D,fwd", FWD_BY_DIM)
def test_pipelined_features(feature, dtype, D, Sq, Sk, monkeypatch, fwd):
    own_forward(monkeypatch, fwd)
    make_kw, opts = PIPELINED_FEATURES[feature]
    make_kw = case_shapes(make_kw, Sq, Sk)
    case = gpu_case(B=2, Sq=Sq, Sk=Sk, Hq=4, D=D, dtype=dtype, seed=D * 11 + Sq, **make_kw)
    check_case(case, **opts)
    if feature not in FEATURES or "causal" in opts:
        return
    check_case(case, causal=True, **opts)


@pytest.mark.parametrize("opts", [dict(), dict(causal=True), dict(window_size=(50, 20)),
                                  dict(softcap=3.0, dropout_p=0.1, seed=(2, 3))])
@pytest.mark.parametrize("D,fwd", FWD_BY_DIM)
def test_pipelined_varlen_with_empty_sequences(D, opts, monkeypatch, fwd):
    """Packed sequences (some empty on the query or the key side) against
    each sequence alone through the fp32 reference."""
    own_forward(monkeypatch, fwd)
    gen = torch.Generator().manual_seed(D)
    lq = torch.tensor([0, 130, 1, 257, 64, 0, 999])
    lk = torch.tensor([5, 129, 0, 300, 64, 7, 1000])
    B, Hq, Hkv = lq.numel(), 4, 2
    cu_q, cu_k, q, k, v = packed_inputs(lq, lk, Hq, Hkv, D, gen)
    mq, mk = int(lq.max()), int(lk.max())
    out, lse = flash_attn_varlen_func(q.cuda(), k.cuda(), v.cuda(), cu_q.cuda(), cu_k.cuda(), mq, mk,
                                      return_lse=True, **opts)
    keep = None
    if opts.get("dropout_p", 0) > 0:
        keep = dropout_keep_mask(*opts["seed"], B, Hq, mq, mk, opts["dropout_p"])
    ref_kw = {key: val for key, val in opts.items() if key != "seed"}
    check_packed_forward(out, lse, q, k, v, cu_q, cu_k, ref_kw, keep=keep)


def check_packed_forward(out, lse, q, k, v, cu_q, cu_k, ref_kw, keep=None, bias=None):
    """A packed call's outputs and lse, each sequence against itself alone through the
    fp32 reference (`keep`, `bias`: (B, H, max_seqlen_q, max_seqlen_k), indexed by
    positions inside a sequence)."""
    out, lse = out.float().cpu(), lse.cpu()
    for b in range(cu_q.numel() - 1):
        q0, q1, k0, k1 = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        if q1 == q0:
            continue
        kb = dict(ref_kw)
        if keep is not None:
            kb["dropout_keep"] = keep[b:b + 1, :, : q1 - q0, : k1 - k0]
        if bias is not None:
            kb["bias"] = bias[b:b + 1, :, : q1 - q0, : k1 - k0]
        ref, ref_lse = attention_reference(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1],
                                           upcast=True, **kb)
        low, _ = attention_reference(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], upcast=False, **kb)
        slack = 1e-5 * max(1.0, ref.abs().max().item())
        assert max_err(out[q0:q1], ref[0]) <= 2 * max_err(low, ref) + slack, b
        fin = torch.isfinite(ref_lse[0])
        assert torch.equal(torch.isfinite(lse[:, q0:q1]), fin), b
        assert (lse[:, q0:q1][~fin] == float("-inf")).all(), b
        assert (out[q0:q1].transpose(0, 1)[~fin] == 0).all(), b
        if fin.any():
            assert (lse[:, q0:q1][fin] - ref_lse[0][fin]).abs().max().item() < 1e-3 * max(
                1.0, ref_lse[0][fin].abs().max().item()), b


# ---- head dims 64 and 256 on the TMA-fed pingpong kernel and its persistent form, the
# default there (SYMHEAP_ATTN_FWD_D64_TMA=0 / SYMHEAP_ATTN_FWD_D256_TMA=0 keep the lockstep
# kernel). At 64: 128-key tiles in four stages; its softmax sees 128 keys a tile where the
# lockstep one sees 64, so the two differ in rounding and both are held to the fp32
# reference. At 256: two stages of the lockstep kernel's tiles (128 query rows, 64 keys),
# each warpgroup doing the same arithmetic in the same order, so besides the reference
# the TMA forms are held to the lockstep kernel's bits (as at head dim 128). At both, the
# persistent form and the one-CTA-a-block form do the same arithmetic, bit for bit.

TMA_FORWARD_DIMS = [64, 256]
TMA_FORWARD_ENV = {64: "SYMHEAP_ATTN_FWD_D64_TMA", 256: "SYMHEAP_ATTN_FWD_D256_TMA"}


def tma_forward(monkeypatch, D, tma, persistent=""):
    """Head dim D (64 or 256) on the TMA kernel (`tma`; `persistent`: "1" its persistent
    form forced, "0" never, "" the default rule) or on the lockstep one."""
    own_forward(monkeypatch, "hopper" if tma else "hopper_lockstep")
    monkeypatch.setenv(TMA_FORWARD_ENV[D], "1" if tma else "0")
    monkeypatch.setenv("SYMHEAP_ATTN_FWD_PERSISTENT", persistent)


def launched_kernel_names(fn, part):
    """Names of the kernels `fn` launches whose name holds `part` (torch profiler;
    a first call outside the profile readies them)."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return {e.key for e in prof.key_averages() if part in e.key}


def forward_kernel_names(fn):
    """Names of the attention forward kernels `fn` launches."""
    return launched_kernel_names(fn, "attention_fwd")


# The forward kernel's last template arguments (kMaskRows; kServes, the LogitFeatures set
# of its form), when the name shows them.
LAST = r"(, ?(true|false))?(, ?\([\w:]*LogitFeatures\)\d+)?>"
# LogitFeatures, as the forms' kServes values (cuda_common.cuh).
SERVES = {"all": 31, "bias": 1, "mask_alibi": 6, "softcap": 8, "dropout": 16, "all_but_bias": 30}


def forward_form(D, tma, mask_rows, serves):
    """A feature forward form's name at head dim D, demangled and mangled: the TMA-fed
    kernel or the lockstep one, kMaskRows (None: either), kServes = SERVES[serves]."""
    v, rows = SERVES[serves], "(true|false)" if mask_rows is None else str(mask_rows).lower()
    b = "1" if tma else "0"
    rows_bit = "[01]" if mask_rows is None else ("1" if mask_rows else "0")
    return (rf"attention_fwd_hopper_kernel<[^,<>]*, ?{D}, ?true, ?false, ?{str(tma).lower()}, ?{str(tma).lower()}, "
            rf"?{rows}, ?\([\w:]*LogitFeatures\){v}>",
            rf"attention_fwd_hopper_kernelI\w*?Li{D}ELb1ELb0ELb{b}ELb{b}ELb{rows_bit}EL(?:N\w+?E|S\w*?_){v}E")


def forward_kernels(D):
    """The head-dim-D kernels' names, demangled (the profiler's) or mangled."""
    return {
        "lockstep": (rf"attention_fwd_hopper_kernel<[^,<>]*, ?{D}, ?false, ?(true|false), ?false, ?false{LAST}",
                     rf"attention_fwd_hopper_kernelI\w*?Li{D}ELb0ELb[01]ELb0ELb0E"),
        "tma": (rf"attention_fwd_hopper_kernel<[^,<>]*, ?{D}, ?false, ?(true|false), ?true, ?true{LAST}",
                rf"attention_fwd_hopper_kernelI\w*?Li{D}ELb0ELb[01]ELb1ELb1E"),
        "persistent": (rf"attention_fwd_hopper_persistent_kernel<[^,<>]*, ?{D}, ?(true|false), ?(true|false)>",
                       rf"attention_fwd_hopper_persistent_kernelI\w*?Li{D}ELb[01]ELb[01]E"),
        # (its wide form at head dim 64: three consumer warpgroups)
        "persistent_wide": (rf"attention_fwd_hopper_persistent_kernel<[^,<>]*, ?{D}, ?(true|false), ?true>",
                            rf"attention_fwd_hopper_persistent_kernelI\w*?Li{D}ELb[01]ELb1E"),
    }


def ran(names, kind, kernels):
    return any(re.search(p, n) for n in names for p in kernels[kind])


def bias_only_forward_ran(names, D):
    """Whether `names` hold the lockstep Hopper forward's bias-only form (kServes = the
    bias) at head dim D, the form for calls whose only logit feature is a bias."""
    return any(re.search(x, n) for n in names for x in forward_form(D, False, False, "bias"))


@pytest.mark.parametrize("D", TMA_FORWARD_DIMS)
@pytest.mark.parametrize("varlen", [False, True])
def test_tma_forward_switch_selects_the_kernel(D, varlen, monkeypatch):
    """At head dims 64 and 256 "hopper" runs the TMA kernel (its switch unset or 1), its
    persistent form in the batch layout where SYMHEAP_ATTN_FWD_PERSISTENT asks; the
    switch at 0 the lockstep kernel, as "hopper_lockstep" always."""
    kernels = forward_kernels(D)
    case = gpu_case(B=2, Sq=300, Sk=300, Hq=4, Hkv=2, D=D, seed=5)
    q, k, v = case["q"].detach(), case["k"].detach(), case["v"].detach()
    if varlen:
        cu = torch.tensor([0, 300, 600], dtype=torch.int32, device="cuda")
        call = lambda: flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1),  # noqa: E731
                                              cu, cu, 300, 300)
    else:
        call = lambda: flash_attn_func(q, k, v)  # noqa: E731
    monkeypatch.setenv("SYMHEAP_ATTN_BACKEND", "own")
    monkeypatch.setenv(_core.attention_own_forward_env, "hopper")
    monkeypatch.delenv(TMA_FORWARD_ENV[D], raising=False)
    monkeypatch.delenv("SYMHEAP_ATTN_FWD_PERSISTENT", raising=False)
    names = forward_kernel_names(call)
    assert not ran(names, "lockstep", kernels) and (ran(names, "tma", kernels)
                                                    or ran(names, "persistent", kernels)), names
    monkeypatch.setenv(TMA_FORWARD_ENV[D], "0")
    names = forward_kernel_names(call)
    assert (ran(names, "lockstep", kernels) and not ran(names, "tma", kernels)
            and not ran(names, "persistent", kernels)), names
    for persistent in ("0", "1"):
        tma_forward(monkeypatch, D, True, persistent)
        names = forward_kernel_names(call)
        want = "persistent" if persistent == "1" and not varlen else "tma"
        assert ran(names, want, kernels) and not ran(names, "lockstep", kernels), (persistent, names)
    tma_forward(monkeypatch, D, False)
    names = forward_kernel_names(call)
    assert ran(names, "lockstep", kernels) and not ran(names, "tma", kernels), names


@pytest.mark.parametrize("D", TMA_FORWARD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("Sq,Sk", RAGGED)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("persistent", ["0", "1"])
def test_tma_forward_lengths(D, dtype, Sq, Sk, causal, persistent, monkeypatch):
    tma_forward(monkeypatch, D, True, persistent)
    case = gpu_case(B=2, Sq=Sq, Sk=Sk, Hq=4, Hkv=4, D=D, dtype=dtype, seed=Sq * 3 + Sk + D)
    check_case(case, check_grads=False, causal=causal)


WIDE_OPTS = {"plain": dict(), "causal": dict(causal=True), "window": dict(window_size=(300, 40)),
             "scale_negative": dict(softmax_scale=-0.25), "gqa": dict(causal=True)}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("opts", list(WIDE_OPTS))
@pytest.mark.parametrize("Sq,Sk", [(1, 300), (191, 193), (1000, 1000), (2049, 700), (300, 4099)])
def test_persistent_forward_wide_form_same_bits(dtype, opts, Sq, Sk, monkeypatch):
    """The persistent forward's wide form at head dim 64 (three consumer warpgroups,
    192-row blocks; SYMHEAP_ATTN_FWD_D64_WIDE=1) gives the two-warpgroup form's bits,
    output and lse: each row's arithmetic is the same. Both against the fp32 reference."""
    tma_forward(monkeypatch, 64, True, "1")
    kernels = forward_kernels(64)
    case = gpu_case(B=2, Sq=Sq, Sk=Sk, Hq=4, Hkv=2 if opts == "gqa" else 4, D=64, dtype=dtype,
                    seed=Sq + 7 * Sk)
    call = lambda: flash_attn_func(case["q"], case["k"], case["v"], return_lse=True, **WIDE_OPTS[opts])  # noqa: E731
    runs = {}
    for wide in ("0", "1"):
        monkeypatch.setenv("SYMHEAP_ATTN_FWD_D64_WIDE", wide)
        names = forward_kernel_names(call)
        assert ran(names, "persistent", kernels) and ran(names, "persistent_wide", kernels) == (wide == "1"), names
        runs[wide] = call()
        check_case(case, check_grads=False, **WIDE_OPTS[opts])
    for a, b in zip(runs["0"], runs["1"]):
        assert torch.equal(a, b), opts


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_persistent_forward_wide_form_by_length(causal, dtype, monkeypatch):
    """Unforced, the wide form takes head-dim-64 calls (either dtype) from 768 query
    rows on, from 4096 under a mask."""
    tma_forward(monkeypatch, 64, True, "1")
    monkeypatch.delenv("SYMHEAP_ATTN_FWD_D64_WIDE", raising=False)
    kernels = forward_kernels(64)
    first = 4096 if causal else 768
    for Sq, wide in ((first - 1, False), (first, True)):
        case = gpu_case(B=1, Sq=Sq, Sk=256, Hq=2, D=64, dtype=dtype, seed=Sq)
        names = forward_kernel_names(lambda: flash_attn_func(case["q"], case["k"], case["v"], causal=causal))
        assert ran(names, "persistent", kernels) and ran(names, "persistent_wide", kernels) == wide, (Sq, names)
        check_case(case, check_grads=False, causal=causal)


@pytest.mark.parametrize("D", TMA_FORWARD_DIMS)
@pytest.mark.parametrize("feature", list(PIPELINED_OPTS))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("Sq,Sk", [(127, 129), (1000, 300), (300, 1000), (129, 4099)])
@pytest.mark.parametrize("persistent", ["0", "1"])
def test_tma_forward_features(D, feature, dtype, Sq, Sk, persistent, monkeypatch):
    """GQA, windows, scales (a negative one: not the lean softmax) on the TMA kernel,
    with and without causal."""
    tma_forward(monkeypatch, D, True, persistent)
    make_kw, opts = PIPELINED_OPTS[feature]
    make_kw = case_shapes(make_kw, Sq, Sk)
    case = gpu_case(B=2, Sq=Sq, Sk=Sk, Hq=4, D=D, dtype=dtype, seed=D * 11 + Sq + Sk, **make_kw)
    check_case(case, check_grads=False, **opts)
    if "causal" not in opts and "window_size" not in opts:
        check_case(case, check_grads=False, causal=True, **opts)


@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("feature", ["bias", "bias_broadcast", "mask", "softcap", "alibi", "dropout", "all"])
@pytest.mark.parametrize("Sq,Sk", [(127, 129), (1000, 300), (300, 1000)])
def test_tma_forward_logit_features(D, feature, Sq, Sk, monkeypatch):
    """The logit features under "hopper" (the default): the TMA-fed kernel's
    feature form runs without a bias, the lockstep kernel's (bias tiles through
    shared memory) with one; outputs and lse meet the fp32 reference's rule,
    causal and not."""
    if D != 128:
        tma_forward(monkeypatch, D, True)
    else:
        own_forward(monkeypatch, "hopper")
    make_kw, opts = FEATURES[feature]
    make_kw = case_shapes(make_kw, Sq, Sk)
    case = gpu_case(B=2, Sq=Sq, Sk=Sk, Hq=4, D=D, seed=D * 3 + Sq + Sk, **make_kw)
    names = forward_kernel_names(lambda: flash_attn_func(case["q"], case["k"], case["v"],
                                                         **dict(case["kwargs"], **opts)))
    features_tma = (rf"attention_fwd_hopper_kernel<[^,<>]*, ?{D}, ?true, ?false, ?true, ?true{LAST}",
                    rf"attention_fwd_hopper_kernelI\w*?Li{D}ELb1ELb0ELb1ELb1E")
    features_lockstep = (rf"attention_fwd_hopper_kernel<[^,<>]*, ?{D}, ?true, ?false, ?false, ?false{LAST}",
                         rf"attention_fwd_hopper_kernelI\w*?Li{D}ELb1ELb0ELb0ELb0E")
    want_tma = not feature.startswith("bias") and feature != "all"
    assert any(re.search(x, n) for n in names for x in (features_tma if want_tma else features_lockstep)), names
    assert not any(re.search(x, n) for n in names for x in (features_lockstep if want_tma else features_tma)), names
    # A mask or ALiBi alone: a mask-and-ALiBi form (the mask staged by rows or not).
    mask_alibi = forward_form(D, True, None, "mask_alibi")
    assert any(re.search(x, n) for n in names for x in mask_alibi) == (feature in ("mask", "alibi")), names
    # A bias alone: the lockstep kernel's bias-only form (with other features, the form for every one).
    assert bias_only_forward_ran(names, D) == feature.startswith("bias"), names
    # Softcap or dropout alone: the TMA-fed kernel's form for that feature.
    for alone in ("softcap", "dropout"):
        form = forward_form(D, True, False, alone)
        assert any(re.search(x, n) for n in names for x in form) == (feature == alone), (alone, names)
    check_case(case, check_grads=False, **opts)
    if "window_size" not in opts:
        check_case(case, check_grads=False, causal=True, **opts)


@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("layout", ["dense", "rows_broadcast", "padded_rows"])
@pytest.mark.parametrize("Sq,Sk", [(333, 400), (200, 300)])
def test_tma_forward_mask_by_rows(D, layout, Sq, Sk, monkeypatch):
    """Masks the TMA-fed feature kernel can copy by rows (keys contiguous, rows
    16-byte aligned; staged in shared memory at head dims 64 and 256): rows
    past the sequence, a last key chunk cut by Sk (300 keys in rows of 320
    bytes), rows broadcast, a row with no visible key; with softcap and
    causal too. Outputs and lse against the fp32 reference."""
    if D != 128:
        tma_forward(monkeypatch, D, True)
    else:
        own_forward(monkeypatch, "hopper")
    case = gpu_case(B=2, Sq=Sq, Sk=Sk, Hq=4, Hkv=2, D=D, seed=D + Sq + len(layout))
    gen = torch.Generator().manual_seed(Sq + Sk)
    if layout == "rows_broadcast":
        mask = (torch.rand(2, 1, 1, Sk, generator=gen) > 0.3).to("cuda")
    else:  # padded_rows: a view of the first Sk keys of 16-byte aligned rows
        width = Sk if layout == "dense" else (Sk + 15) // 16 * 16 + 16
        full = torch.rand(2, 1, Sq, width, generator=gen) > 0.3
        full[:, :, 3, :] = False
        mask = full.to("cuda")[..., :Sk]
    case["kwargs"]["mask"] = mask
    names = forward_kernel_names(lambda: flash_attn_func(case["q"], case["k"], case["v"], mask=mask))
    features_tma = (rf"attention_fwd_hopper_kernel<[^,<>]*, ?{D}, ?true, ?false, ?true, ?true{LAST}",
                    rf"attention_fwd_hopper_kernelI\w*?Li{D}ELb1ELb0ELb1ELb1E")
    assert any(re.search(x, n) for n in names for x in features_tma), names
    # Its kMaskRows form where the rows are 16-byte aligned and shared memory has room.
    by_rows = (rf"attention_fwd_hopper_kernel<[^,<>]*, ?{D}, ?true, ?false, ?true, ?true, ?true[,>]",
               rf"attention_fwd_hopper_kernelI\w*?Li{D}ELb1ELb0ELb1ELb1ELb1E")
    staged = D != 128 and (layout == "padded_rows" or Sk % 16 == 0)
    assert any(re.search(x, n) for n in names for x in by_rows) == staged, names
    # A mask alone: the mask-and-ALiBi form of whichever kernel (softcap, below, takes the other).
    mask_alibi = forward_form(D, True, None, "mask_alibi")
    assert any(re.search(x, n) for n in names for x in mask_alibi), names
    for opts in (dict(), dict(causal=True), dict(softcap=3.0)):
        check_case(case, check_grads=False, **opts)


TMA_FORWARD_SHAPES = [(128, 128), (300, 257), (1000, 1000), (129, 4099), (2048, 2048)]
TMA_FORWARD_OPTS = [dict(), dict(causal=True), dict(window_size=(300, 40)),
                    dict(softmax_scale=-0.25), dict(causal=True, softmax_scale=-0.25)]
TMA_FORWARD_FORMS = (("lockstep", False, ""), ("tma", True, "0"), ("tma_persistent", True, "1"),
                     ("tma_default", True, ""))


def tma_forward_runs(D, q, k, v, opts, monkeypatch):
    """Outputs (fp32) and lse of each form of TMA_FORWARD_FORMS on one call."""
    runs = {}
    for name, tma, persistent in TMA_FORWARD_FORMS:
        tma_forward(monkeypatch, D, tma, persistent)
        out, lse = flash_attn_func(q, k, v, return_lse=True, **opts)
        runs[name] = (out.float(), lse)
    return runs


@pytest.mark.parametrize("D", TMA_FORWARD_DIMS)
@pytest.mark.parametrize("Sq,Sk", TMA_FORWARD_SHAPES)
@pytest.mark.parametrize("opts", TMA_FORWARD_OPTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_tma_forward_matches_lockstep(D, Sq, Sk, opts, dtype, monkeypatch):
    """The TMA kernel (one CTA a block, and its persistent form forced and by the default
    rule) and the lockstep kernel on the same call: each within the usual bound of the
    fp32 reference (outputs and lse), so within twice it of each other; the TMA forms bit
    for bit equal among themselves. 1 to 33 key tiles at head dim 64, 65 at 256: the
    stages wrap many times."""
    case = gpu_case(B=2, Sq=Sq, Sk=Sk, Hq=4, Hkv=2, D=D, dtype=dtype, seed=Sq + 7 * Sk)
    q, k, v = case["q"].detach(), case["k"].detach(), case["v"].detach()
    runs = tma_forward_runs(D, q, k, v, opts, monkeypatch)
    ref, ref_lse = attention_reference(q, k, v, upcast=True, **opts)
    low, _ = attention_reference(q, k, v, upcast=False, **opts)
    tol = 2 * max_err(low, ref) + 1e-5 * max(1.0, ref.float().abs().max().item())
    fin = torch.isfinite(ref_lse)
    for name, (out, lse) in runs.items():
        assert not torch.isnan(out).any(), name
        assert max_err(out, ref) <= tol, (name, max_err(out, ref), tol)
        assert torch.equal(torch.isfinite(lse), fin), name
        assert (lse[~fin] == float("-inf")).all(), name
        if fin.any():
            bound = 1e-3 * max(1.0, ref_lse[fin].abs().max().item())
            assert (lse[fin] - ref_lse[fin]).abs().max().item() < bound, name
    assert max_err(runs["tma"][0], runs["lockstep"][0]) <= 2 * tol
    for name in ("tma_persistent", "tma_default"):
        assert torch.equal(runs["tma"][0], runs[name][0]), name
        assert torch.equal(runs["tma"][1], runs[name][1]), name


@pytest.mark.parametrize("Sq,Sk", TMA_FORWARD_SHAPES)
@pytest.mark.parametrize("opts", TMA_FORWARD_OPTS)
def test_d256_tma_bits_equal_lockstep(Sq, Sk, opts, monkeypatch):
    """Same tiles, same per-warpgroup order of the arithmetic at head dim 256: the TMA
    forms give the lockstep kernel's outputs and lse bit for bit (the head-dim-128 kernels
    do so too). test_tma_forward_matches_lockstep holds each to the reference on its own,
    so a failure here alone is a difference of rounding, not a wrong result."""
    case = gpu_case(B=2, Sq=Sq, Sk=Sk, Hq=4, Hkv=2, D=256, dtype=torch.bfloat16, seed=Sq + 7 * Sk)
    q, k, v = case["q"].detach(), case["k"].detach(), case["v"].detach()
    runs = tma_forward_runs(256, q, k, v, opts, monkeypatch)
    out0, lse0 = runs["lockstep"]
    for name, (out, lse) in runs.items():
        assert torch.equal(out0, out), (name, max_err(out, out0))
        assert torch.equal(lse0, lse), (name, (lse0 - lse).abs().max().item())


@pytest.mark.parametrize("D", TMA_FORWARD_DIMS)
@pytest.mark.parametrize("opts", [dict(), dict(causal=True), dict(window_size=(50, 20))])
def test_tma_forward_varlen_with_empty_sequences(D, opts, monkeypatch):
    """Packed sequences (some empty) on the TMA kernel (one map over all the rows: tiles
    past a sequence read the next one's rows), each against itself alone through the
    fp32 reference."""
    monkeypatch.setenv(TMA_FORWARD_ENV[D], "1")
    test_pipelined_varlen_with_empty_sequences(D, opts, monkeypatch, "hopper")


@pytest.mark.parametrize("D", TMA_FORWARD_DIMS)
def test_tma_forward_packed_tile_past_a_sequence_takes_nothing_of_the_next(D, monkeypatch):
    """As at head dim 128: the TMA kernel's warpgroup 0 zeroes the next sequence's values
    (inf here) in the key tile that sequence 0 ends inside (keys 128-255 at head dim 64,
    192-255 at 256)."""
    monkeypatch.setenv(TMA_FORWARD_ENV[D], "1")
    test_packed_tile_past_a_sequence_takes_nothing_of_the_next("hopper", monkeypatch, D=D)


@pytest.mark.parametrize("D", TMA_FORWARD_DIMS)
def test_tma_forward_large_and_multi_block(D, monkeypatch):
    """Several query blocks and many key tiles, causal with Sq < Sk, GQA, on the TMA
    kernel (persistent form by the default rule and forced off)."""
    for persistent in ("", "0"):
        tma_forward(monkeypatch, D, True, persistent)
        case = gpu_case(B=1, Sq=1531, Sk=4099, Hq=4, Hkv=2, D=D, seed=D)
        check_case(case, causal=True, check_grads=False)
        check_case(case, check_grads=False)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", PIPELINED_DIMS)
@pytest.mark.parametrize("opts", [dict(), dict(causal=True), dict(window_size=(100, 3)),
                                  dict(causal=True, softcap=2.5, dropout_p=0.15, seed=(9, 1)),
                                  dict(bias=True, mask=True)])
def test_pipelined_matches_basic_kernel(dtype, D, opts, monkeypatch):
    """Both own forward kernels on the same call: the same function up to the
    rounding of each (and the same lse), so the backward can read either."""
    case = gpu_case(B=2, Sq=333, Sk=517, Hq=8, Hkv=2, D=D, dtype=dtype, seed=D + 5,
                    bias_shape=(1, 8, 333, 517) if opts.get("bias") else None,
                    mask_shape=(2, 1, 333, 517) if opts.get("mask") else None)
    kw = dict(case["kwargs"], **{k: v for k, v in opts.items() if k not in ("bias", "mask")})
    q, k, v = (case[n].detach() for n in ("q", "k", "v"))
    runs = {}
    for kernel in ("basic", "pipelined", "pipelined_previous", "hopper"):
        own_forward(monkeypatch, kernel)
        out, lse = flash_attn_func(q, k, v, return_lse=True, **kw)
        runs[kernel] = (out.float(), lse)
    ref_kw = {key: val for key, val in kw.items() if key != "seed"}
    if kw.get("dropout_p", 0) > 0:
        ref_kw["dropout_keep"] = dropout_keep_mask(*kw["seed"], 2, 8, 333, 517, kw["dropout_p"])
    ref, _ = attention_reference(q, k, v, upcast=True, **ref_kw)
    low, _ = attention_reference(q, k, v, upcast=False, **ref_kw)
    tol = 4 * max_err(low, ref) + 1e-5 * max(1.0, ref.float().abs().max().item())
    for kernel in ("pipelined", "pipelined_previous", "hopper"):
        assert max_err(runs[kernel][0], runs["basic"][0]) <= tol, kernel
        lse_a, lse_b = runs[kernel][1], runs["basic"][1]
        assert torch.equal(torch.isfinite(lse_a), torch.isfinite(lse_b)), kernel
        fin = torch.isfinite(lse_a)
        assert (lse_a[fin] - lse_b[fin]).abs().max().item() < 1e-3 * max(1.0, lse_a[fin].abs().max().item())


@pytest.mark.parametrize("fwd", FORWARDS)
def test_pipelined_large_and_multi_block(monkeypatch, fwd):
    """Several query blocks and many key tiles (the double buffer wraps many
    times), causal with Sq < Sk, both head dims in one run."""
    own_forward(monkeypatch, fwd)
    for D in PIPELINED_DIMS:
        case = gpu_case(B=1, Sq=1531, Sk=4099, Hq=4, Hkv=2, D=D, seed=D)
        check_case(case, causal=True, check_grads=False)
        check_case(case, check_grads=False)


# Biases in every layout the Hopper forward tells apart: a 16-bit bias
# contiguous along the keys with 16-byte aligned rows goes through shared
# memory in tiles (bias_rows_copyable); any other one is read element by
# element. Lengths that are not multiples of the tiles; a bias broadcast over
# everything but the keys ends rows in a partial 16-byte chunk.
def _bias(layout, B, Hq, Sq, Sk, gen):
    if layout == "rows":
        return torch.randn(B, Hq, Sq, Sk, generator=gen).bfloat16()
    if layout == "keys_only":
        return torch.randn(1, 1, 1, Sk, generator=gen).bfloat16()
    if layout == "f16_bias":
        return torch.randn(B, Hq, Sq, Sk, generator=gen).half()
    if layout == "f32_bias":
        return torch.randn(B, 1, Sq, Sk, generator=gen)
    assert layout == "unaligned_rows"
    return torch.randn(B, Hq, Sq, Sk + 1, generator=gen).bfloat16()[..., 1:]


@pytest.mark.parametrize("layout", ["rows", "keys_only", "f16_bias", "f32_bias", "unaligned_rows"])
@pytest.mark.parametrize("Sq,Sk", [(130, 264), (200, 300), (1, 136), (300, 1000)])
@pytest.mark.parametrize("opts", [dict(), dict(causal=True), dict(window_size=(40, 7), softcap=5.0)])
@pytest.mark.parametrize("D,fwd", FWD_BY_DIM)
def test_forward_bias_layouts(layout, D, Sq, Sk, opts, fwd, monkeypatch):
    own_forward(monkeypatch, fwd)
    case = gpu_case(B=2, Sq=Sq, Sk=Sk, Hq=4, Hkv=2, D=D, dtype=torch.bfloat16, seed=Sq + Sk + D)
    gen = torch.Generator().manual_seed(Sq * 7 + Sk)
    case["kwargs"]["bias"] = (0.5 * _bias(layout, 2, 4, Sq, Sk, gen)).cuda()
    check_case(case, check_grads=False, **opts)


# Calls whose only logit feature is a bias run the lockstep Hopper forward's bias-only
# form under "hopper" at every head dim (the TMA kernels take no bias):
# causal, windows, GQA with a bias broadcast over the query rows, packed sequences.
BIAS_ONLY_CALLS = {
    "causal": (dict(Hq=4, Hkv=4, bias_shape=(2, 4, "Sq", "Sk")), dict(causal=True)),
    "window": (dict(Hq=4, Hkv=4, bias_shape=(1, 4, "Sq", "Sk")), dict(window_size=(90, 30))),
    "gqa": (dict(Hq=8, Hkv=2, bias_shape=(2, 8, "Sq", "Sk")), dict()),
    "gqa_causal_rows_broadcast": (dict(Hq=8, Hkv=2, bias_shape=(2, 8, 1, "Sk")), dict(causal=True)),
}


def hopper_forward(monkeypatch, D):
    """The default Hopper forward ("hopper"; at head dims 64 and 256 with the TMA kernel on)."""
    if D != 128:
        tma_forward(monkeypatch, D, True)
    else:
        own_forward(monkeypatch, "hopper")


@pytest.mark.parametrize("D", PIPELINED_DIMS)
@pytest.mark.parametrize("call", list(BIAS_ONLY_CALLS))
@pytest.mark.parametrize("Sq,Sk", [(127, 129), (1000, 300), (300, 1000)])
def test_hopper_forward_bias_only_form(D, call, Sq, Sk, monkeypatch):
    """A bias alone takes the bias-only form (outputs and lse against the fp32
    reference); the same call with softcap too takes the form for every feature."""
    hopper_forward(monkeypatch, D)
    make_kw, opts = BIAS_ONLY_CALLS[call]
    case = gpu_case(B=2, Sq=Sq, Sk=Sk, D=D, seed=D * 5 + Sq + Sk, **case_shapes(make_kw, Sq, Sk))

    def names(**extra):
        return forward_kernel_names(lambda: flash_attn_func(case["q"], case["k"], case["v"],
                                                            **dict(case["kwargs"], **opts, **extra)))

    assert bias_only_forward_ran(names(), D), names()
    check_case(case, check_grads=False, **opts)
    every = rf"attention_fwd_hopper_kernel<[^,<>]*, ?{D}, ?true, ?false, ?false, ?false{LAST}"
    with_softcap = names(softcap=5.0)
    assert not bias_only_forward_ran(with_softcap, D) and any(re.search(every, n) for n in with_softcap), \
        with_softcap


@pytest.mark.parametrize("D", PIPELINED_DIMS)
@pytest.mark.parametrize("opts", [dict(), dict(causal=True), dict(window_size=(50, 20))])
def test_hopper_forward_bias_only_varlen(D, opts, monkeypatch):
    """Packed sequences (some empty; 4 query heads over 2 kv heads) with a bias alone:
    the bias-only form, each sequence against itself alone through the fp32 reference."""
    hopper_forward(monkeypatch, D)
    gen = torch.Generator().manual_seed(D + 1)
    lq = torch.tensor([0, 130, 1, 257, 64, 0, 999])
    lk = torch.tensor([5, 129, 0, 300, 64, 7, 1000])
    cu_q, cu_k, q, k, v = packed_inputs(lq, lk, 4, 2, D, gen)
    mq, mk = int(lq.max()), int(lk.max())
    bias = (0.5 * torch.randn(lq.numel(), 4, mq, mk, generator=gen)).bfloat16()
    xs = [x.cuda() for x in (q, k, v, cu_q, cu_k)]
    call = lambda: flash_attn_varlen_func(*xs, mq, mk, bias=bias.cuda(), return_lse=True, **opts)  # noqa: E731
    names = forward_kernel_names(call)
    assert bias_only_forward_ran(names, D), names
    out, lse = call()
    check_packed_forward(out, lse, q, k, v, cu_q, cu_k, opts, bias=bias)


@pytest.mark.parametrize("softcap", [0.5, 5.0, 50.0])
@pytest.mark.parametrize("D,fwd", FWD_BY_DIM)
def test_forward_softcap_range(D, softcap, fwd, monkeypatch):
    """Softcaps from one that saturates most logits to one that barely
    bends them, with scores large enough to reach both ends of tanh."""
    own_forward(monkeypatch, fwd)
    case = gpu_case(B=1, Sq=257, Sk=300, Hq=4, Hkv=4, D=D, seed=D + int(softcap))
    case["q"] = (case["q"].float() * 4).to(case["q"].dtype).detach().requires_grad_()
    check_case(case, softcap=softcap)


@pytest.mark.parametrize("bias_shape", [(1, 8, 300, 264), (5, 1, 300, 264), (1, 2, 1, 264)])
def test_dbias_batch_chunks(bias_shape, monkeypatch):
    """The backward over chunks of batch entries (the dbias workspace limit
    set to two entries): every gradient equal to the one-launch run's."""
    from symheap.attention import _function
    monkeypatch.setenv("SYMHEAP_ATTN_BACKEND", "own")
    case = gpu_case(B=5, Sq=300, Sk=264, Hq=8, Hkv=2, D=64, seed=3, bias_shape=bias_shape)
    q, k, v, bias = case["q"], case["k"], case["v"], case["kwargs"]["bias"]
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(4)).to("cuda", q.dtype)
    runs = []
    for limit in (1 << 40, 2 * 8 * (300 if bias_shape[2] > 1 else 1) * 264 * 4):
        monkeypatch.setattr(_function, "DBIAS_WORKSPACE_LIMIT", limit)
        out = flash_attn_func(q, k, v, bias=bias, causal=True)
        runs.append(torch.autograd.grad(out, (q, k, v, bias), dout))
    for n, (a, b) in enumerate(zip(*runs)):
        assert max_err(a, b) <= 1e-2 * max(1.0, a.float().abs().max().item()), n


@pytest.mark.parametrize("fwd", FORWARDS)
def test_pipelined_output_strides(monkeypatch, fwd):
    """q, k, v as views with row and head strides of a packed qkv tensor."""
    own_forward(monkeypatch, fwd)
    gen = torch.Generator().manual_seed(7)
    qkv = torch.randn(2, 300, 3, 4, 128, generator=gen).bfloat16().cuda()
    q, k, v = qkv.unbind(2)
    out = flash_attn_func(q, k, v, causal=True)
    ref, _ = attention_reference(q, k, v, upcast=True, causal=True)
    low, _ = attention_reference(q, k, v, upcast=False, causal=True)
    assert max_err(out, ref) <= 2 * max_err(low, ref) + 1e-5


# ---- the pipelined backward (head dims 64, 128 and 256 on the own path;
# cuda_backward_dq_pipelined.cuh and cuda_backward_dkdv_pipelined.cuh): GQA
# with groups 2 and 4, causal with Sq != Sk both ways, lengths that are not
# multiples of the tiles, every logit feature with dbias, varlen with empty
# sequences, and the basic backward on the same calls.
# `pytest tests/gpu/test_attention_gpu.py -k pipelined_backward` runs them.

def own_backward(monkeypatch, kernel):
    """Forces the own kernels and the backward kernels ("auto" = the default:
    the Hopper dK/dV kernels with dQ fused, "basic", "pipelined_dq16" = pipelined with the 16-row
    dQ kernel, "pipelined_dkdv32" = with the dK/dV kernel of 32-row query
    tiles, "pipelined_dkdv_unshared" = with the dK/dV kernel of 64-row tiles
    whose warps each read every Q/dO fragment, "pipelined_dq_fused" = dQ
    inside the shared-fragment dK/dV kernel at head dims 64 and 128 without
    logit features, "pipelined_dq_separate" = dQ by its own kernel there,
    "hopper" = the Hopper dK/dV kernel with dQ fused there (fed by TMA at head
    dim 128, packed calls too), "hopper_cp_async" = the same fed by its own
    copies, "hopper_dq_separate" = the Hopper dK/dV kernel with dQ by its own
    kernel), and checks the
    choice is what the test expects."""
    monkeypatch.setenv("SYMHEAP_ATTN_BACKEND", "own")
    monkeypatch.setenv(_core.attention_own_backward_env, kernel)
    hopper_defaults = _core.attention_hopper_backward_defaults
    for d in PIPELINED_DIMS:
        built = _core.attention_hopper_forward_status()[0]
        default = hopper_defaults[d][0] if built and d in hopper_defaults else "pipelined"
        assert _core.attention_own_backward_kernel(d) == (default if kernel == "auto" else kernel)
    for d in (40, 96, 192):
        assert _core.attention_own_backward_kernel(d) == "basic"


@pytest.mark.parametrize("D", PIPELINED_DIMS)
@pytest.mark.parametrize("Sq,Sk", [(1000, 300), (300, 1000), (127, 129), (1, 257)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("group", [2, 4])
def test_pipelined_backward_gqa(group, causal, Sq, Sk, D, monkeypatch):
    """Grouped-query attention (2 kv heads, 2 or 4 query heads each): dq, dk
    and dv against the fp32 reference. Causal with Sq > Sk leaves whole query
    blocks (and with Sq < Sk whole key blocks) seeing nothing."""
    own_backward(monkeypatch, "auto")
    case = gpu_case(B=2, Sq=Sq, Sk=Sk, Hq=2 * group, Hkv=2, D=D, seed=group * 100 + Sq + D)
    check_case(case, causal=causal)


PIPELINED_BACKWARD_OPTS = {
    "plain": (dict(), dict()),
    "causal": (dict(), dict(causal=True)),
    "window": (dict(), dict(window_size=(100, 3))),
    "window_left": (dict(), dict(window_size=(64, -1))),
    "softcap_dropout": (dict(), dict(causal=True, softcap=2.5, dropout_p=0.15, seed=(9, 1))),
    "bias_mask_alibi": (dict(bias_shape=(1, 8, "Sq", "Sk"), mask_shape=(2, 1, "Sq", "Sk"), alibi=True),
                        dict()),
    "bias_rows_broadcast": (dict(bias_shape=(2, 2, 1, "Sk")), dict(causal=True)),
    "bias_softcap": (dict(bias_shape=(2, 8, "Sq", "Sk")), dict(softcap=3.0, window_size=(90, 30))),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", PIPELINED_DIMS)
@pytest.mark.parametrize("Sq,Sk", [(333, 517), (517, 333)])
@pytest.mark.parametrize("name", list(PIPELINED_BACKWARD_OPTS))
def test_pipelined_backward_matches_basic(name, Sq, Sk, dtype, D, monkeypatch):
    """The own backwards on the same call (8 query heads over 2 kv heads):
    basic, pipelined (at head dims 64 and 128 without logit features: the
    dK/dV kernel of shared Q/dO fragments), pipelined with the 16-row dQ
    kernel, with the 32-row dK/dV kernel (head dim 128), with the 64-row one
    without shared fragments, with dQ fused into the dK/dV kernel and with dQ
    by its own kernel (both at head dims 64 and 128 without logit features);
    every gradient (dbias included) of each within the rule against the fp32
    reference, and the pipelined ones close to the basic one."""
    make_kw, opts = PIPELINED_BACKWARD_OPTS[name]
    make_kw = {k: (tuple(Sq if x == "Sq" else Sk if x == "Sk" else x for x in v)
                   if isinstance(v, tuple) else v) for k, v in make_kw.items()}
    case = gpu_case(B=2, Sq=Sq, Sk=Sk, Hq=8, Hkv=2, D=D, dtype=dtype, seed=D + Sq, **make_kw)
    kw = dict(case["kwargs"], **opts)
    inputs = [case["q"], case["k"], case["v"]]
    if "bias" in kw:
        inputs.append(kw["bias"])
    dout = torch.randn(case["q"].shape, generator=torch.Generator().manual_seed(3)).to("cuda", dtype)
    grads = {}
    kernels = ("basic", "auto", "pipelined_dq16", "pipelined_dkdv32", "pipelined_dkdv_unshared",
               "pipelined_dq_fused", "pipelined_dq_separate")
    for kernel in kernels:
        own_backward(monkeypatch, kernel)
        out = flash_attn_func(case["q"], case["k"], case["v"], **kw)
        grads[kernel] = torch.autograd.grad(out, inputs, dout)
    ref_kw = {key: val for key, val in kw.items() if key != "seed"}
    if kw.get("dropout_p", 0) > 0:
        ref_kw["dropout_keep"] = dropout_keep_mask(*kw["seed"], 2, 8, Sq, Sk, kw["dropout_p"])
    ref = attention_reference(*inputs[:3], upcast=True, **ref_kw)[0]
    low = attention_reference(*inputs[:3], upcast=False, **ref_kw)[0]
    want = torch.autograd.grad(ref, inputs, dout)
    base = torch.autograd.grad(low, inputs, dout)
    for n, (name_g, w, lo) in enumerate(zip(["dq", "dk", "dv", "dbias"], want, base)):
        tol = 3 * max_err(lo, w) + 1e-5 * max(1.0, w.float().abs().max().item())
        for kernel in kernels:
            g = grads[kernel][n]
            assert g.shape == w.shape and not torch.isnan(g).any(), (name_g, kernel)
            assert max_err(g, w) <= tol, (name_g, kernel, max_err(g, w), tol)
            assert max_err(g, grads["basic"][n]) <= tol, (name_g, kernel, "vs basic")


@pytest.mark.parametrize("D", PIPELINED_DIMS)
@pytest.mark.parametrize("opts", [dict(), dict(causal=True), dict(window_size=(50, 20)),
                                  dict(softcap=3.0, dropout_p=0.1, seed=(2, 3))])
def test_pipelined_backward_varlen_with_empty_sequences(D, opts, monkeypatch, kernel="auto"):
    """Packed sequences (some empty on the query or the key side), 4 query
    heads over 2 kv heads: dq, dk, dv against each sequence alone through the
    fp32 reference."""
    own_backward(monkeypatch, kernel)
    check_packed_backward([0, 130, 1, 257, 64, 0, 999, 3], [5, 129, 0, 300, 64, 7, 1000, 200], 4, 2, D, opts,
                          seed=D + 1)


def check_packed_backward(lq, lk, Hq, Hkv, D, opts, seed):
    """The packed call of lengths lq, lk (bf16) on the backward kernels forced
    now: dq, dk, dv against each sequence alone through the fp32 reference
    (FlashAttention's rule), zeros where a sequence has no query or no key."""
    gen = torch.Generator().manual_seed(seed)
    lq, lk = torch.tensor(lq), torch.tensor(lk)
    B = lq.numel()
    cu_q, cu_k, q, k, v = packed_inputs(lq, lk, Hq, Hkv, D, gen)
    mq, mk = int(lq.max()), int(lk.max())
    dout = torch.randn(q.shape, generator=gen).bfloat16()
    xs = [x.cuda().requires_grad_() for x in (q, k, v)]
    out = flash_attn_varlen_func(xs[0], xs[1], xs[2], cu_q.cuda(), cu_k.cuda(), mq, mk, **opts)
    got = [g.float().cpu() for g in torch.autograd.grad(out, xs, dout.cuda())]
    keep = None
    if opts.get("dropout_p", 0) > 0:
        keep = dropout_keep_mask(*opts["seed"], B, Hq, mq, mk, opts["dropout_p"])
    ref_kw = {key: val for key, val in opts.items() if key != "seed"}
    for b in range(B):
        q0, q1, k0, k1 = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        if q1 == q0 or k1 == k0:  # no query or no key: zero gradients
            assert (got[0][q0:q1] == 0).all() and (got[1][k0:k1] == 0).all() and (got[2][k0:k1] == 0).all(), b
            continue
        kb = dict(ref_kw)
        if keep is not None:
            kb["dropout_keep"] = keep[b:b + 1, :, : q1 - q0, : k1 - k0]
        seq = [x[None, r0:r1].cuda().requires_grad_()
               for x, r0, r1 in ((q, q0, q1), (k, k0, k1), (v, k0, k1))]
        d_b = dout[None, q0:q1].cuda()
        ref = attention_reference(*seq, upcast=True, **kb)[0]
        low = attention_reference(*seq, upcast=False, **kb)[0]
        want = torch.autograd.grad(ref, seq, d_b)
        base = torch.autograd.grad(low, seq, d_b)
        mine = (got[0][q0:q1], got[1][k0:k1], got[2][k0:k1])
        for name, g, w, lo in zip(["dq", "dk", "dv"], mine, want, base):
            w, lo = w[0].float().cpu(), lo[0].float().cpu()
            tol = 3 * max_err(lo, w) + 1e-5 * max(1.0, w.abs().max().item())
            assert max_err(g, w) <= tol, (b, name, max_err(g, w), tol)


def test_pipelined_backward_deterministic(monkeypatch):
    """deterministic=True with a bias (its gradient summed over the query rows):
    no atomics, two runs of the same GQA call give bit-identical gradients."""
    own_backward(monkeypatch, "auto")
    for D in PIPELINED_DIMS:
        case = gpu_case(B=2, Sq=700, Sk=900, Hq=8, Hkv=2, D=D, seed=D,
                        bias_shape=(2, 8, 1, 900))
        inputs = [case["q"], case["k"], case["v"], case["kwargs"]["bias"]]
        runs = []
        for _ in range(2):
            out = flash_attn_func(case["q"], case["k"], case["v"], causal=True, deterministic=True,
                                  **case["kwargs"])
            runs.append(torch.autograd.grad(out, inputs, torch.ones_like(out)))
        for a, b in zip(*runs):
            assert torch.equal(a, b), D


def test_pipelined_backward_large_and_multi_block(monkeypatch):
    """Many key blocks and query tiles (the double buffers wrap many times,
    across the heads of a group), causal with Sq < Sk."""
    own_backward(monkeypatch, "auto")
    for D in PIPELINED_DIMS:
        case = gpu_case(B=1, Sq=1531, Sk=4099, Hq=4, Hkv=1, D=D, seed=D)
        check_case(case, causal=True)


# ---- the dK/dV kernel whose warps share Q/dO fragments (head dims 64 and 128
# without logit features, cuda_backward_dkdv_shared.cuh; the default there,
# with dQ fused into it unless the call is deterministic): more edges at those
# head dims, each also with dQ fused and by its own kernel whatever the
# default (SYMHEAP_ATTN_OWN_BACKWARD = pipelined_dq_fused,
# pipelined_dq_separate) and on the kernel it replaced (=
# pipelined_dkdv_unshared).
SHARED_DKDV_DIMS = [64, 128]


@pytest.mark.parametrize("D", SHARED_DKDV_DIMS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("Sq,Sk", [(1000, 300), (300, 1000), (127, 129), (1, 257), (1531, 4099)])
@pytest.mark.parametrize("opts", [dict(), dict(causal=True), dict(window_size=(100, 3)),
                                  dict(window_size=(-1, 40)), dict(window_size=(64, -1))])
@pytest.mark.parametrize("kernel", ["auto", "pipelined_dq_fused", "pipelined_dq_separate",
                                    "pipelined_dkdv_unshared", "hopper", "hopper_dq_separate",
                                    "hopper_cp_async"])
def test_pipelined_backward_dkdv_shared(kernel, opts, Sq, Sk, dtype, D, monkeypatch):
    """GQA (4 query heads over 2 kv heads), causal with Sq != Sk both ways
    (whole query and key blocks seeing nothing), windows on either side,
    lengths that are not multiples of the 64-row or 128-key tiles, many tiles
    per CTA: dq, dk, dv against the fp32 reference."""
    own_backward(monkeypatch, kernel)
    case = gpu_case(B=2, Sq=Sq, Sk=Sk, Hq=4, Hkv=2, D=D, dtype=dtype, seed=Sq + 7 * Sk + D)
    check_case(case, **opts)


@pytest.mark.parametrize("D", SHARED_DKDV_DIMS)
@pytest.mark.parametrize("opts", [dict(), dict(causal=True), dict(window_size=(50, 20))])
@pytest.mark.parametrize("kernel", ["pipelined_dkdv_unshared", "pipelined_dq_fused", "pipelined_dq_separate",
                                    "hopper", "hopper_dq_separate"])
def test_pipelined_backward_dkdv_variants_varlen(kernel, opts, D, monkeypatch):
    """Packed sequences, some empty on either side, on the 64-row dK/dV kernel
    without shared fragments, with dQ fused into the shared-fragment kernel
    (atomics into the packed rows of the workspace) and with dQ by its own
    kernel (the default runs in the varlen test of the pipelined backward)."""
    test_pipelined_backward_varlen_with_empty_sequences(D, opts, monkeypatch, kernel=kernel)


@pytest.mark.parametrize("D", SHARED_DKDV_DIMS)
@pytest.mark.parametrize("kernel", ["auto", "pipelined_dq_fused", "pipelined_dq_separate", "hopper",
                                    "hopper_dq_separate"])
def test_pipelined_backward_dkdv_shared_deterministic(kernel, D, monkeypatch):
    """deterministic=True keeps dQ out of the dK/dV kernel (its atomics have
    no fixed order) even where fused dQ is the default or forced: two runs of
    the same GQA call without logit features (test_pipelined_backward_deterministic
    has a bias) give bit-identical gradients, equal to those of the separate
    dQ kernel beside the same dK/dV kernel."""
    own_backward(monkeypatch, kernel)
    case = gpu_case(B=2, Sq=700, Sk=900, Hq=8, Hkv=2, D=D, seed=5)
    inputs = [case["q"], case["k"], case["v"]]
    runs = []
    for _ in range(2):
        out = flash_attn_func(case["q"], case["k"], case["v"], causal=True, deterministic=True,
                              **case["kwargs"])
        runs.append(torch.autograd.grad(out, inputs, torch.ones_like(out)))
    own_backward(monkeypatch, "hopper_dq_separate" if kernel.startswith("hopper") else "pipelined_dq_separate")
    out = flash_attn_func(case["q"], case["k"], case["v"], causal=True, **case["kwargs"])
    runs.append(torch.autograd.grad(out, inputs, torch.ones_like(out)))
    for a, b, c in zip(*runs):
        assert torch.equal(a, b) and torch.equal(a, c)


@pytest.mark.parametrize("Sq,Sk,Hq,Hkv,causal", [(1000, 1000, 4, 2, False), (2048, 2048, 4, 2, True),
                                                (129, 4099, 8, 2, False), (300, 257, 4, 4, True)])
@pytest.mark.parametrize("D", [64, 128])
def test_hopper_backward_tma_matches_cp_async(Sq, Sk, Hq, Hkv, causal, D, monkeypatch):
    """The Hopper dK/dV kernel fed by TMA ("hopper": the default at head dim 128,
    forced at 64) does each warpgroup's arithmetic as the one fed by its own
    copies: dK and dV bit for bit equal; dQ (fp32 atomics, in another order
    from run to run) within rounding."""
    case = gpu_case(B=2, Sq=Sq, Sk=Sk, Hq=Hq, Hkv=Hkv, D=D, dtype=torch.bfloat16, seed=Sq + 3 * Sk + D)
    inputs = [case["q"], case["k"], case["v"]]
    gen = torch.Generator(device="cuda").manual_seed(Sq * 5 + Sk)
    dout = torch.randn(case["q"].shape, generator=gen, device="cuda").to(torch.bfloat16)
    grads = []
    for kernel in ("hopper_cp_async", "hopper"):
        own_backward(monkeypatch, kernel)
        out = flash_attn_func(case["q"], case["k"], case["v"], causal=causal)
        grads.append(torch.autograd.grad(out, inputs, dout))
    (dq0, dk0, dv0), (dq1, dk1, dv1) = grads
    assert torch.equal(dk0, dk1) and torch.equal(dv0, dv1)
    assert (dq0.float() - dq1.float()).abs().max().item() <= 1e-2 * dq0.float().abs().max().item()


# ---- the TMA-fed Hopper dK/dV kernel on packed (varlen) calls (head dims 64 and
# 128, dQ fused; its packed form): one map over all the rows, so a box past a sequence's
# end reads the next sequence's rows, which the kernel zeroes in shared memory
# (K, V, each Q/dO tile crossing the end, the staged dQ rows).
PACKED_TMA_LENGTHS = {
    # ends inside a key block and inside a query tile
    "two": ([200, 300], [200, 300]),
    # lengths around the 64-row tiles and 128-key blocks, one empty query side
    "ragged": ([1, 63, 65, 127, 129, 0, 257, 64, 500], [1, 63, 65, 127, 129, 7, 257, 64, 500]),
    # Sq != Sk, empty on either side, whole tiles that see nothing under causal
    "uneven": ([130, 77, 0, 300, 191, 5, 1000], [129, 300, 5, 0, 64, 200, 999]),
}


@pytest.mark.parametrize("lengths", list(PACKED_TMA_LENGTHS))
@pytest.mark.parametrize("opts", [dict(), dict(causal=True), dict(window_size=(50, 20))])
@pytest.mark.parametrize("Hq,Hkv", [(4, 2), (8, 1), (2, 2)])
@pytest.mark.parametrize("D", [64, 128])
def test_hopper_backward_tma_packed(lengths, opts, Hq, Hkv, D, monkeypatch):
    """Packed sequences on the TMA-fed kernel ("hopper"), GQA and not: dq, dk,
    dv of each sequence against it alone (fp32 reference)."""
    own_backward(monkeypatch, "hopper")
    lq, lk = PACKED_TMA_LENGTHS[lengths]
    check_packed_backward(lq, lk, Hq, Hkv, D, opts, seed=Hq * 10 + Hkv + len(lq) + D)


@pytest.mark.parametrize("lengths", list(PACKED_TMA_LENGTHS))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("D", [64, 128])
def test_hopper_backward_tma_packed_matches_cp_async(lengths, causal, D, monkeypatch):
    """Packed calls: the TMA-fed kernel's tiles, once the rows past each
    sequence are zeroed, are those of the kernel fed by its own copies (which
    read zeros there): dK and dV bit for bit equal, dQ within rounding."""
    gen = torch.Generator().manual_seed(list(PACKED_TMA_LENGTHS).index(lengths))
    lq, lk = (torch.tensor(x) for x in PACKED_TMA_LENGTHS[lengths])
    cu_q, cu_k, q, k, v = packed_inputs(lq, lk, 4, 2, D, gen)
    dout = torch.randn(q.shape, generator=gen).bfloat16().cuda()
    xs = [x.cuda().requires_grad_() for x in (q, k, v)]
    grads = []
    for kernel in ("hopper_cp_async", "hopper"):
        own_backward(monkeypatch, kernel)
        out = flash_attn_varlen_func(*xs, cu_q.cuda(), cu_k.cuda(), int(lq.max()), int(lk.max()), causal=causal)
        grads.append(torch.autograd.grad(out, xs, dout))
    (dq0, dk0, dv0), (dq1, dk1, dv1) = grads
    assert torch.equal(dk0, dk1) and torch.equal(dv0, dv1)
    assert max_err(dq0, dq1) <= 1e-2 * max(1.0, dq0.float().abs().max().item())


@pytest.mark.parametrize("D", [64, 128])
def test_hopper_backward_tma_packed_takes_nothing_of_the_next(D, monkeypatch):
    """Packed sequences of 200 and 300 rows, 4 query heads over 2 kv heads: a
    key block and a query tile of sequence 0 end inside sequence 1, whose first
    rows of q, k, v and dout are inf. Sequence 0's gradients stay finite and
    equal those of the same sequence alone (0 x inf would be NaN if the kernel
    let those rows into a product). Then inf in sequence 0's last key: its NaN
    gradients stay out of sequence 1's dq (the staged dQ rows past sequence 0,
    added to sequence 1's rows of the workspace, are zeros)."""
    own_backward(monkeypatch, "hopper")
    gen = torch.Generator(device="cuda").manual_seed(12)
    rnd = lambda *shape: torch.randn(*shape, generator=gen, device="cuda").to(torch.bfloat16)  # noqa: E731
    cu = torch.tensor([0, 200, 500], dtype=torch.int32, device="cuda")

    def grads(q, k, v, dout, causal, packed):
        xs = [x.clone().requires_grad_() for x in (q, k, v)]
        if packed:
            out = flash_attn_varlen_func(*xs, cu, cu, 300, 300, causal=causal)
        else:
            out = flash_attn_func(*(x[None] for x in xs), causal=causal)[0]
        return torch.autograd.grad(out, xs, dout)

    for causal in (False, True):
        q, k, v, dout = rnd(500, 4, D), rnd(500, 2, D), rnd(500, 2, D), rnd(500, 4, D)
        for x in (q, k, v, dout):
            x[200:260] = float("inf")
        got = grads(q, k, v, dout, causal, True)
        alone = grads(q[:200], k[:200], v[:200], dout[:200], causal, False)
        for name, g, a in zip(["dq", "dk", "dv"], got, alone):
            assert torch.isfinite(g[:200]).all(), (causal, name)
            assert max_err(g[:200], a) <= 1e-2 * max(1.0, a.float().abs().max().item()), (causal, name)

        q, k, v, dout = rnd(500, 4, D), rnd(500, 2, D), rnd(500, 2, D), rnd(500, 4, D)
        k[199] = float("inf")
        got = grads(q, k, v, dout, causal, True)
        alone = grads(q[200:], k[200:], v[200:], dout[200:], causal, False)
        for name, g, a in zip(["dq", "dk", "dv"], got, alone):
            assert torch.isfinite(g[200:]).all(), (causal, name, "sequence 1")
            assert max_err(g[200:], a) <= 1e-2 * max(1.0, a.float().abs().max().item()), (causal, name)


# ---- the logit features on the TMA-fed Hopper dK/dV kernel (head dims 64 and 128, dQ
# fused), the default there.

def hopper_features_backward_form(fn):
    """Which feature form of a Hopper dK/dV kernel `fn`'s backward runs: None
    (none), "every" (kFeatures true, kServes every feature; at head dim 256 its
    own kernel), or at head dims 64 and 128 the forms for calls with only a mask and
    ALiBi ("mask_alibi"), without a bias ("no_bias"), with softcap alone ("softcap")
    or dropout alone ("dropout"); kFeatures and kServes (a LogitFeatures set) are
    the last two template arguments."""
    names = backward_kernel_names(fn)
    assert names, "no dK/dV kernel ran"

    def form(v):
        return (rf"dkdv_hopper_kernel<[^<>]*, ?true, ?\([\w:]*LogitFeatures\){v}>",
                rf"dkdv_hopper_kernelI\w*?Lb1EL(?:N\w+?E|S\w*?_){v}EE")
    every = form(SERVES["all"]) + (r"dkdv_hopper256_kernel<[^<>]*, ?true, ?true>",
                                   r"dkdv_hopper256_kernelI\w*?Lb1ELb1EE")
    forms = (("mask_alibi", form(SERVES["mask_alibi"])), ("no_bias", form(SERVES["all_but_bias"])),
             ("softcap", form(SERVES["softcap"])), ("dropout", form(SERVES["dropout"])), ("every", every))
    for name, patterns in forms:
        if any(re.search(x, n) for n in names for x in patterns):
            return name
    return None


def runs_hopper_features_backward(fn) -> bool:
    """Whether `fn`'s backward runs a feature form of a Hopper dK/dV kernel."""
    return hopper_features_backward_form(fn) is not None


@pytest.mark.parametrize("feature", list(PIPELINED_FEATURES))
@pytest.mark.parametrize("Sq,Sk", [(113, 203), (1000, 300), (300, 1000), (1024, 1023)])
@pytest.mark.parametrize("D", [64, 128, 256])
def test_hopper_backward_features(feature, Sq, Sk, D, monkeypatch):
    """Every logit feature, alone and together, causal and not, through the
    default backward: the Hopper kernel's feature form takes each call with
    one, and dq, dk, dv (and dbias) meet the fp32 reference's rule."""
    own_backward(monkeypatch, "auto")
    make_kw, opts = PIPELINED_FEATURES[feature]
    make_kw = case_shapes(make_kw, Sq, Sk)
    case = gpu_case(B=2, Sq=Sq, Sk=Sk, Hq=4, D=D, dtype=torch.bfloat16, seed=D * 17 + Sq + Sk, **make_kw)
    kw = dict(case["kwargs"], **opts)
    form = hopper_features_backward_form(
        lambda: flash_attn_func(case["q"], case["k"], case["v"], **kw).sum().backward())
    has_features = any(kw.get(n) is not None for n in ("bias", "mask", "alibi_slopes")) or \
        kw.get("softcap", 0) > 0 or kw.get("dropout_p", 0) > 0
    only_mask_alibi = has_features and kw.get("bias") is None and kw.get("softcap", 0) == 0 and \
        kw.get("dropout_p", 0) == 0
    no_bias = kw.get("bias") is None and not (D == 64 and kw.get("softcap", 0) > 0)
    mask_or_alibi = kw.get("mask") is not None or kw.get("alibi_slopes") is not None
    only_softcap = no_bias and not mask_or_alibi and kw.get("dropout_p", 0) == 0
    only_dropout = no_bias and not mask_or_alibi and kw.get("softcap", 0) == 0
    want = (None if not has_features else "every" if D == 256 else "mask_alibi" if only_mask_alibi
            else "softcap" if only_softcap else "dropout" if only_dropout else "no_bias" if no_bias else "every")
    assert form == want, (feature, form, want)
    check_case(case, **opts)
    if feature in FEATURES and "causal" not in opts:
        check_case(case, causal=True, **opts)


@pytest.mark.parametrize("feature", ["softcap", "bias", "bias_broadcast", "mask", "dropout", "all"])
@pytest.mark.parametrize("D", [64, 128, 256])
def test_hopper_backward_features_match_pipelined(feature, D, monkeypatch):
    """The Hopper feature form against the pipelined feature kernels
    ("pipelined_dq_separate" takes them): dq, dk, dv, dbias within rounding
    of each other (fp32 sums of the same products, in other orders)."""
    make_kw, opts = FEATURES[feature]
    make_kw = case_shapes({"Hkv": 2, **make_kw}, 700, 700)
    case = gpu_case(B=2, Sq=700, Sk=700, Hq=4, D=D, dtype=torch.bfloat16, seed=D + 5, **make_kw)
    kw = dict(case["kwargs"], **opts)
    if "window_size" not in opts:
        kw["causal"] = True
    inputs = [case["q"], case["k"], case["v"]] + ([kw["bias"]] if kw.get("bias") is not None else [])
    dout = torch.randn(case["q"].shape, generator=torch.Generator(device="cuda").manual_seed(9),
                       device="cuda").to(torch.bfloat16)
    grads = []
    for kernel in ("auto", "pipelined_dq_separate"):
        own_backward(monkeypatch, kernel)
        forward_and_backward = lambda: flash_attn_func(case["q"], case["k"], case["v"], **kw).sum().backward()  # noqa: E731
        assert runs_hopper_features_backward(forward_and_backward) == (kernel == "auto"), kernel
        out = flash_attn_func(case["q"], case["k"], case["v"], **kw)
        grads.append(torch.autograd.grad(out, inputs, dout))
    for name, a, b in zip(["dq", "dk", "dv", "dbias"], *grads):
        assert max_err(a, b) <= 1e-2 * max(1.0, b.float().abs().max().item()), (name, max_err(a, b))


@pytest.mark.parametrize("lengths", list(PACKED_TMA_LENGTHS))
@pytest.mark.parametrize("opts", [dict(softcap=3.0), dict(causal=True, softcap=2.0, window_size=(60, 0)),
                                  dict(causal=True, alibi=True), dict(window_size=(40, 70), alibi=True)])
@pytest.mark.parametrize("D", [64, 128])
def test_hopper_backward_features_packed(lengths, opts, D, monkeypatch):
    """Packed sequences with softcap (the form for softcap alone), or with ALiBi
    alone (the mask-and-ALiBi form), on the feature forms' packed kernels: each
    sequence's gradients against it alone (fp32 reference)."""
    own_backward(monkeypatch, "auto")
    lq, lk = PACKED_TMA_LENGTHS[lengths]
    opts = dict(opts)
    alibi = opts.pop("alibi", False)
    if alibi:
        opts["alibi_slopes"] = torch.tensor([0.5, 0.25, 0.125, 0.0625], device="cuda")
    form = hopper_features_backward_form(lambda: check_packed_backward(lq, lk, 4, 2, D, opts, seed=len(lq) + D))
    assert form == ("mask_alibi" if alibi else "softcap"), form


# ---- the Hopper dK/dV kernel at head dim 256 (cuda_backward_hopper_d256.cuh), the default
# there and forced with "hopper": dQ fused (fp32 atomics), or from the pipelined dQ kernel
# for deterministic calls and "hopper_dq_separate"; 64 keys a CTA,
# the warpgroups splitting the query rows of S^T and dP^T and the columns of dK, dV and dQ;
# batch layout, the logit features with dQ fused. Packed calls at 256 take the pipelined
# backward.

def backward_kernel_names(fn):
    """Names of the attention dK/dV kernels `fn`'s backward launches."""
    return launched_kernel_names(fn, "dkdv")


@pytest.mark.parametrize("case_kind", ["batch", "varlen", "deterministic", "default",
                                       "default_deterministic"])
def test_hopper256_backward_selects_the_kernel(case_kind, monkeypatch):
    """"hopper" and the default at head dim 256 run the head-dim-256 Hopper kernel on
    batch calls (without dQ when deterministic); a packed call runs the pipelined one."""
    deterministic = case_kind.endswith("deterministic")
    case = gpu_case(B=2, Sq=300, Sk=300, Hq=4, Hkv=2, D=256, seed=7)
    q, k, v = (case[n].detach().requires_grad_() for n in ("q", "k", "v"))
    if case_kind == "varlen":
        cu = torch.tensor([0, 300, 600], dtype=torch.int32, device="cuda")
        fwd = lambda: flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1),  # noqa: E731
                                             cu, cu, 300, 300)
    else:
        fwd = lambda: flash_attn_func(q, k, v, deterministic=deterministic)  # noqa: E731
    own_backward(monkeypatch, "auto" if case_kind.startswith("default") else "hopper")
    names = backward_kernel_names(lambda: fwd().sum().backward())
    # (the template arguments: the type, kFuseDq, kFeatures)
    fused = any(re.search(r"dkdv_hopper256_kernel<[^,<>]*, ?true, ?false>|dkdv_hopper256_kernelI\d+__\w+?16Lb1ELb0E"
                          r"|dkdv_hopper256_kernelI\d+__halfLb1ELb0E", n) for n in names)
    separate = any(re.search(r"dkdv_hopper256_kernel<[^,<>]*, ?false, ?false>|dkdv_hopper256_kernelI\d+__\w+?16Lb0E"
                             r"|dkdv_hopper256_kernelI\d+__halfLb0E", n) for n in names)
    assert fused == (case_kind in ("batch", "default")), names
    assert separate == deterministic, names
    assert names, "no dK/dV kernel ran"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("Sq,Sk", RAGGED)
@pytest.mark.parametrize("causal", [False, True])
def test_hopper256_backward_lengths(dtype, Sq, Sk, causal, monkeypatch):
    own_backward(monkeypatch, "hopper")
    case = gpu_case(B=2, Sq=Sq, Sk=Sk, Hq=4, Hkv=4, D=256, dtype=dtype, seed=Sq * 5 + Sk + 256)
    check_case(case, causal=causal)


@pytest.mark.parametrize("feature", list(PIPELINED_OPTS))
@pytest.mark.parametrize("Sq,Sk", [(127, 129), (1000, 300), (300, 1000), (129, 1031)])
def test_hopper256_backward_features(feature, Sq, Sk, monkeypatch):
    """GQA, windows, scales (a negative one too) on the head-dim-256 Hopper backward,
    with and without causal."""
    own_backward(monkeypatch, "hopper")
    make_kw, opts = PIPELINED_OPTS[feature]
    make_kw = case_shapes(make_kw, Sq, Sk)
    case = gpu_case(B=2, Sq=Sq, Sk=Sk, Hq=4, D=256, seed=256 * 13 + Sq + Sk, **make_kw)
    check_case(case, **opts)
    if "causal" not in opts and "window_size" not in opts:
        check_case(case, causal=True, **opts)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("Sq,Sk", [(127, 129), (1000, 300), (300, 1000)])
def test_hopper256_backward_dq_separate(Sq, Sk, causal, monkeypatch):
    """The head-dim-256 Hopper kernel without dQ ("hopper_dq_separate"; dQ from the
    pipelined dQ kernel), GQA, against the fp32 reference; deterministic calls take the
    same form and give the same bits twice."""
    own_backward(monkeypatch, "hopper_dq_separate")
    case = gpu_case(B=2, Sq=Sq, Sk=Sk, Hq=4, Hkv=2, D=256, seed=Sq + 2 * Sk + 256)
    check_case(case, causal=causal)
    own_backward(monkeypatch, "hopper")
    inputs = [case["q"], case["k"], case["v"]]
    runs = []
    for _ in range(2):
        out = flash_attn_func(case["q"], case["k"], case["v"], causal=causal, deterministic=True)
        runs.append(torch.autograd.grad(out, inputs, torch.ones_like(out)))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_hopper256_backward_large_and_multi_block(monkeypatch):
    """Many key blocks and query tiles, GQA 4 over 1 (the tiles of every query head
    of the group in one CTA), causal with Sq < Sk and not, against the reference and
    close to the pipelined backward."""
    case = gpu_case(B=1, Sq=1531, Sk=2099, Hq=4, Hkv=1, D=256, seed=256)
    inputs = [case["q"], case["k"], case["v"]]
    for causal in (True, False):
        own_backward(monkeypatch, "hopper")
        check_case(case, causal=causal)
        grads = {}
        pipelined = "pipelined_dq_separate"  # the pipelined kernels at 256
        for kernel in ("hopper", pipelined):
            own_backward(monkeypatch, kernel)
            out = flash_attn_func(case["q"], case["k"], case["v"], causal=causal)
            grads[kernel] = torch.autograd.grad(out, inputs, torch.ones_like(out))
        for n, name in enumerate(["dq", "dk", "dv"]):
            scale = grads[pipelined][n].float().abs().max().item()
            assert max_err(grads["hopper"][n], grads[pipelined][n]) <= 2 ** -6 * scale, (causal, name)


@pytest.mark.parametrize("D", SHARED_DKDV_DIMS)
def test_pipelined_backward_dq_fused_many_key_blocks(D, monkeypatch):
    """Fused dQ: 33 key blocks add into each dQ row (fp32 atomics), GQA 4
    query heads over 1 kv head, against the fp32 reference and close to the
    separate dQ kernel (the same products; the sums differ in order)."""
    case = gpu_case(B=1, Sq=700, Sk=4160, Hq=4, Hkv=1, D=D, seed=11)
    inputs = [case["q"], case["k"], case["v"]]
    grads = {}
    for kernel in ("pipelined_dq_separate", "pipelined_dq_fused"):
        own_backward(monkeypatch, kernel)
        out = flash_attn_func(case["q"], case["k"], case["v"], **case["kwargs"])
        grads[kernel] = torch.autograd.grad(out, inputs, torch.ones_like(out))
    check_case(case)  # on the fused kernel
    fused, separate = grads["pipelined_dq_fused"], grads["pipelined_dq_separate"]
    for n, name in enumerate(["dq", "dk", "dv"]):
        scale = separate[n].float().abs().max().item()
        assert max_err(fused[n], separate[n]) <= 2 ** -6 * scale, (name, max_err(fused[n], separate[n]), scale)
