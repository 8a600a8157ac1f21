"""Attention over KV caches on CUDA, float16 and bfloat16: the cpu test grid
(dense and paged caches, appended rows, every feature), forced key-length
splits (merged in a thread-block cluster or by the combine kernel), a long
cache, device-recorded errors, and a decode step captured in a CUDA graph;
every test through both attention kernels (SYMHEAP_DECODE_KERNEL = keys_major
and previous) and the keys-major one with both split merges
(SYMHEAP_DECODE_MERGE = auto and kernel)."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "attention"))

from symheap import _core  # noqa: E402
from symheap.attention import (flash_attn_varlen_func, flash_attn_with_kvcache,  # noqa: E402
                               kvcache_check)

from attention_kvcache_common import (FEATURES, Cache, bits, call_options, reference,  # noqa: E402
                                      threads_with_other_outputs)

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or not getattr(_core, "attention_has_cuda", False),
    reason="needs a CUDA device and a CUDA build of symheap")

DTYPES = [torch.bfloat16, torch.float16]
TOL = {torch.bfloat16: 2.5e-2, torch.float16: 4e-3}


@pytest.fixture(autouse=True, params=["keys_major", "keys_major/kernel_merge", "previous",
                                        "keys_major_x2"])
def decode_kernel(request, monkeypatch):
    """The attention kernel of every call in the test ($SYMHEAP_DECODE_KERNEL) and,
    after a slash, the split merge ($SYMHEAP_DECODE_MERGE=kernel: the combine kernel)."""
    kernel, _, merge = request.param.partition("/")
    monkeypatch.setenv("SYMHEAP_DECODE_KERNEL", kernel)
    if merge:
        monkeypatch.setenv("SYMHEAP_DECODE_MERGE", "kernel")
    else:
        monkeypatch.delenv("SYMHEAP_DECODE_MERGE", raising=False)
    return request.param


def max_err(x, ref):
    return (x.float().cpu() - ref.float()).abs().max().item() if x.numel() else 0.0


def setup_decode(*, layout, feature, s_new, dtype, D=128, B=3, Sq=None, capacity=300, seed=0):
    gen = torch.Generator().manual_seed(seed)
    Hq, Hkv, opts = FEATURES[feature]
    cap = Cache(B=1, capacity=capacity, Hkv=1, D=8, dtype=dtype, device="cuda", gen=gen,
                lengths=[0], block_size=layout).capacity
    lengths = [0, cap - s_new, int(torch.randint(1, cap - s_new, (1,), generator=gen))][:B]
    cache = Cache(B=B, capacity=capacity, Hkv=Hkv, D=D, dtype=dtype, device="cuda", gen=gen,
                  lengths=lengths, block_size=layout)
    Sq = Sq if Sq is not None else max(1, s_new)
    q = torch.randn((B, Sq, Hq, D), generator=gen).to(device="cuda", dtype=dtype)
    new = None
    if s_new:
        new = tuple(torch.randn((B, s_new, Hkv, D), generator=gen).to(device="cuda", dtype=dtype)
                    for _ in range(2))
    return cache, lengths, q, new, Hq, opts


def run_and_check(cache, lengths, q, new, Hq, opts, *, tol, **extra):
    before = cache.snapshot()
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    k, v = new if new is not None else (None, None)
    out, lse = flash_attn_with_kvcache(q, cache.k, cache.v, k, v, cache_seqlens=seqlens,
                                       block_table=cache.block_table, return_lse=True,
                                       **call_options(opts, Hq, "cuda"), **extra)
    kvcache_check()
    s_new = 0 if new is None else new[0].shape[1]
    want = Cache.__new__(Cache)
    want.__dict__.update(cache.__dict__)
    want.k, want.v = before
    for b, n in enumerate(lengths):
        if s_new:
            want.write(b, n, new[0][b], new[1][b])
    assert torch.equal(bits(cache.k), bits(want.k)), "k_cache differs outside the appended rows"
    assert torch.equal(bits(cache.v), bits(want.v)), "v_cache differs outside the appended rows"
    for b, n in enumerate(lengths):
        ref, ref_lse = reference(q[b:b + 1], cache, b, n + s_new, opts, Hq)
        assert not torch.isnan(out[b]).any(), f"NaN in sequence {b}"
        assert max_err(out[b:b + 1], ref) <= tol, f"sequence {b}: error {max_err(out[b:b + 1], ref):.3g}"
        finite = torch.isfinite(ref_lse)
        got = lse[b:b + 1].cpu()
        assert torch.equal(torch.isfinite(got), finite)
        if finite.any():
            assert (got[finite] - ref_lse[finite]).abs().max().item() <= 2e-3
    return out, lse


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", [None, 16, 256, 512])
@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("s_new", [0, 1, 3])
def test_decode(dtype, layout, feature, s_new):
    setup = setup_decode(layout=layout, feature=feature, s_new=s_new, dtype=dtype,
                         seed=hash((layout, feature, s_new)) % 1000)
    run_and_check(*setup, tol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [32, 64, 96, 256])
@pytest.mark.parametrize("num_splits", [1, 3, 7])
def test_decode_head_dims_and_splits(dtype, D, num_splits):
    setup = setup_decode(layout=16, feature="all", s_new=2, Sq=4, dtype=dtype, D=D, seed=D)
    run_and_check(*setup, tol=TOL[dtype], num_splits=num_splits)


@pytest.mark.parametrize("Sq", [2, 3, 5])
def test_query_tiles_and_tile_edges(Sq):
    """Several query rows of a GQA group (8, 12, 20 vectors per kv head: one or two
    n8 blocks, one or two CTAs of them), with cache lengths on, before and after
    key-tile edges, causal and windowed."""
    dtype = torch.bfloat16
    gen = torch.Generator().manual_seed(Sq)
    Hq, Hkv, D = 8, 2, 128
    lengths = [127, 128, 129, 255, 256 + 7]
    cache = Cache(B=len(lengths), capacity=600, Hkv=Hkv, D=D, dtype=dtype, device="cuda", gen=gen,
                  lengths=lengths, block_size=16)
    q = torch.randn((len(lengths), Sq, Hq, D), generator=gen).to(device="cuda", dtype=dtype)
    new = tuple(torch.randn((len(lengths), Sq, Hkv, D), generator=gen).to(device="cuda", dtype=dtype)
                for _ in range(2))
    for opts in (dict(causal=True), dict(causal=True, window_size=(100, 0))):
        run_and_check(cache, lengths, q, new, Hq, opts, tol=TOL[dtype])
        lengths = [n + Sq for n in lengths]


def test_unknown_kernel_name_is_rejected(monkeypatch):
    setup = setup_decode(layout=16, feature="plain", s_new=0, dtype=torch.bfloat16, seed=3)
    monkeypatch.setenv("SYMHEAP_DECODE_KERNEL", "fastest")
    with pytest.raises(ValueError, match="SYMHEAP_DECODE_KERNEL"):
        run_and_check(*setup, tol=TOL[torch.bfloat16])


def test_unknown_merge_name_is_rejected(monkeypatch):
    setup = setup_decode(layout=16, feature="plain", s_new=0, dtype=torch.bfloat16, seed=3)
    monkeypatch.setenv("SYMHEAP_DECODE_MERGE", "fastest")
    with pytest.raises(ValueError, match="SYMHEAP_DECODE_MERGE"):
        run_and_check(*setup, tol=TOL[torch.bfloat16], num_splits=2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_long_cache_batch_one(dtype):
    """Batch 1 over a 32k-row paged cache: the automatic split count fills the GPU."""
    setup = setup_decode(layout=256, feature="gqa", s_new=1, B=1, capacity=32768, dtype=dtype, seed=4)
    run_and_check(*setup, tol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("feature", list(FEATURES))
def test_paged_varlen(dtype, block_size, feature):
    gen = torch.Generator().manual_seed(hash((block_size, feature)) % 1000)
    Hq, Hkv, opts = FEATURES[feature]
    q_lens, k_lens = [1, 37, 0, 20], [290, 130, 9, 0]
    cache = Cache(B=4, capacity=300, Hkv=Hkv, D=128, dtype=dtype, device="cuda", gen=gen,
                  lengths=k_lens, block_size=block_size)
    cu_q = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0] + torch.tensor(k_lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    q = torch.randn((sum(q_lens), Hq, 128), generator=gen).to(device="cuda", dtype=dtype)
    before = cache.snapshot()
    out, lse = flash_attn_varlen_func(q, cache.k, cache.v, cu_q, cu_k, max(q_lens), max(k_lens),
                                      block_table=cache.block_table, return_lse=True,
                                      **call_options(opts, Hq, "cuda"))
    kvcache_check()
    assert torch.equal(bits(cache.k), bits(before[0])) and torch.equal(bits(cache.v), bits(before[1]))
    cu = cu_q.tolist()
    for b, nk in enumerate(k_lens):
        rows = slice(cu[b], cu[b + 1])
        ref, ref_lse = reference(q[rows][None], cache, b, nk, opts, Hq)
        assert max_err(out[rows][None], ref) <= TOL[dtype], f"sequence {b}"
        got = lse[:, rows][None].cpu()
        finite = torch.isfinite(ref_lse)
        assert torch.equal(torch.isfinite(got), finite)
        if finite.any():
            assert (got[finite] - ref_lse[finite]).abs().max().item() <= 2e-3


# ---------------------------------------------------------------- device-side errors

@pytest.mark.parametrize("problem", ["block_id", "no_room", "negative"])
def test_device_errors_are_recorded(problem):
    setup = setup_decode(layout=16, feature="gqa", s_new=2, dtype=torch.bfloat16, seed=8)
    cache, lengths, q, new, Hq, opts = setup
    kvcache_check()  # nothing pending
    table = cache.block_table.clone()
    lengths = [0, 5, 10]
    if problem == "block_id":
        table[1, 0] = cache.k.shape[0]
    elif problem == "no_room":
        lengths[1] = cache.capacity - 1
    else:
        lengths[1] = -4
    before = cache.snapshot()
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    out = flash_attn_with_kvcache(q, cache.k, cache.v, *new, cache_seqlens=seqlens, block_table=table,
                                  num_splits=2)
    with pytest.raises(ValueError, match=r"an earlier call on CUDA device \d+ found that sequence 1"):
        kvcache_check()
    kvcache_check()  # raised once, then cleared
    assert torch.isnan(out[1]).all(), "the bad sequence's output must be NaN"
    # Sequence 1 wrote nothing; the good sequences appended their rows.
    want = Cache.__new__(Cache)
    want.__dict__.update(cache.__dict__)
    want.k, want.v = before
    for b in (0, 2):
        want.write(b, lengths[b], new[0][b], new[1][b])
    assert torch.equal(bits(cache.k), bits(want.k))
    assert torch.equal(bits(cache.v), bits(want.v))
    for b in (0, 2):
        ref, _ = reference(q[b:b + 1], cache, b, lengths[b] + 2, opts, Hq)
        assert max_err(out[b:b + 1], ref) <= TOL[torch.bfloat16]
    # Without a check, the next call raises it.
    flash_attn_with_kvcache(q, cache.k, cache.v, *new, cache_seqlens=seqlens, block_table=table)
    torch.cuda.synchronize()
    with pytest.raises(ValueError, match="an earlier call"):
        flash_attn_with_kvcache(q, cache.k, cache.v, cache_seqlens=0, block_table=table)


def test_host_side_shape_errors():
    setup = setup_decode(layout=16, feature="gqa", s_new=1, dtype=torch.bfloat16, seed=9)
    cache, lengths, q, new, Hq, opts = setup
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        flash_attn_with_kvcache(q.float(), cache.k.float(), cache.v.float(), cache_seqlens=seqlens,
                                block_table=cache.block_table)
    with pytest.raises(ValueError, match="head_dim must be a multiple of 8"):
        flash_attn_with_kvcache(q[..., :12], cache.k[..., :12], cache.v[..., :12],
                                cache_seqlens=seqlens, block_table=cache.block_table)
    with pytest.raises(ValueError, match="cache_seqlens is on cpu"):
        flash_attn_with_kvcache(q, cache.k, cache.v, cache_seqlens=seqlens.cpu(),
                                block_table=cache.block_table)


# ---------------------------------------------------------------- CUDA graphs

@pytest.mark.parametrize("layout", [None, 16])
def test_decode_step_in_a_cuda_graph(layout):
    """A decode step (append one row, attend) captured once and replayed with new
    lengths and new rows written into the static inputs."""
    dtype = torch.bfloat16
    gen = torch.Generator().manual_seed(21)
    B, Hq, Hkv, D, capacity = 4, 8, 2, 128, 4096
    lengths = [100, 2000, 7, 4000]
    cache = Cache(B=B, capacity=capacity, Hkv=Hkv, D=D, dtype=dtype, device="cuda", gen=gen,
                  lengths=lengths, block_size=layout)
    q = torch.zeros((B, 1, Hq, D), dtype=dtype, device="cuda")
    k_new = torch.zeros((B, 1, Hkv, D), dtype=dtype, device="cuda")
    v_new = torch.zeros_like(k_new)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")

    def step():
        return flash_attn_with_kvcache(q, cache.k, cache.v, k_new, v_new, cache_seqlens=seqlens,
                                       block_table=cache.block_table, causal=True, return_lse=True)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: per-device state is made outside the capture
        step()
    torch.cuda.current_stream().wait_stream(side)
    # The warm-up appended zero rows at `lengths`; the replays overwrite them.
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = step()
    for it in range(3):
        q.copy_(torch.randn(q.shape, generator=gen).to(dtype))
        kn, vn = (torch.randn(k_new.shape, generator=gen).to(dtype) for _ in range(2))
        k_new.copy_(kn)
        v_new.copy_(vn)
        graph.replay()
        torch.cuda.synchronize()
        kvcache_check()
        for b in range(B):
            cache_k, cache_v = cache.gather(b, lengths[b] + 1)
            assert torch.equal(cache_k[0, -1], kn[b, 0].float()), "appended key not at cache_seqlens"
            assert torch.equal(cache_v[0, -1], vn[b, 0].float())
            ref, ref_lse = reference(q[b:b + 1], cache, b, lengths[b] + 1, dict(causal=True), Hq)
            assert max_err(out[b:b + 1], ref) <= TOL[dtype]
            assert (lse[b].cpu() - ref_lse[0]).abs().max().item() <= 2e-3
        lengths = [n + 1 for n in lengths]
        seqlens.copy_(torch.tensor(lengths, dtype=torch.int32))


def test_graph_outputs_are_not_recycled_for_eager_calls():
    """Outputs a captured call made belong to the graph: after the capture, with
    the graph's outputs dropped, eager calls on the capture's stream get other
    memory, so a replay does not overwrite what they returned."""
    dtype = torch.bfloat16
    gen = torch.Generator().manual_seed(22)
    B, Hq, Hkv, D = 1, 32, 8, 128
    cache = Cache(B=B, capacity=16384, Hkv=Hkv, D=D, dtype=dtype, device="cuda", gen=gen,
                  lengths=[16000], block_size=256)
    seqlens = torch.tensor([16000], dtype=torch.int32, device="cuda")
    q = torch.randn((B, 1, Hq, D), generator=gen).to(device="cuda", dtype=dtype)

    def step(x):
        return flash_attn_with_kvcache(x, cache.k, cache.v, cache_seqlens=seqlens,
                                       block_table=cache.block_table, return_lse=True)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step(q)  # fills the pools of this stream
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        out, lse = step(q)
    graph_memory = {out.data_ptr(), lse.data_ptr()}
    del out, lse
    with torch.cuda.stream(side):
        other = torch.randn(q.shape, generator=gen).to(device="cuda", dtype=dtype)
        eager = [step(other) for _ in range(3)]
        side.synchronize()
        kept = [(o.clone(), l.clone()) for o, l in eager]
        graph.replay()
        side.synchronize()
    for (o, l), (ko, kl) in zip(eager, kept):
        assert not {o.data_ptr(), l.data_ptr()} & graph_memory, "an eager call got the graph's output"
        assert torch.equal(o, ko) and torch.equal(l, kl), "a replay overwrote an eager output"
    ref, _ = reference(other, cache, 0, 16000, {}, Hq)
    assert max_err(eager[0][0], ref) <= TOL[dtype]


def test_threads_sharing_the_pools_get_their_own_outputs():
    """Six threads on one GPU call at once, four shapes among them (two pairs share
    a shape; the 16k rows split, so the workspace pool is shared too): each
    result equals the same call made alone."""
    dtype = torch.bfloat16
    shapes = [(1, 16384), (2, 1024), (3, 512), (4, 4096), (1, 16384), (2, 1024)]  # batch, capacity
    cases = []
    for i, (B, capacity) in enumerate(shapes):
        gen = torch.Generator().manual_seed(30 + i)
        lengths = [int(x) for x in torch.randint(1, capacity + 1, (B,), generator=gen)]
        cache = Cache(B=B, capacity=capacity, Hkv=8, D=128, dtype=dtype, device="cuda", gen=gen,
                      lengths=lengths, block_size=256)
        q = torch.randn((B, 1, 32, 128), generator=gen).to(device="cuda", dtype=dtype)
        cases.append((cache, q, torch.tensor(lengths, dtype=torch.int32, device="cuda")))

    def call(cache, q, seqlens):
        return flash_attn_with_kvcache(q, cache.k, cache.v, cache_seqlens=seqlens,
                                       block_table=cache.block_table, return_lse=True)

    bad = threads_with_other_outputs(cases, call, calls=100)
    kvcache_check()
    assert not bad, f"threads {bad} got another call's output"


@pytest.mark.parametrize("D, waves, more, expected", [
    (128, 1, False, "keys_major"), (128, 1, True, "keys_major_x2"), (128, 2, False, "keys_major_x2"),
    (128, 2, True, "keys_major"), (64, None, False, "keys_major"), (64, None, True, "previous")])
def test_auto_kernel_choice(D, waves, more, expected, monkeypatch):
    """Unforced, a call's (sequence, kv head) pairs pick its kernel: at head dim
    128 the keys-major kernel, two CTAs an SM when the pairs over the SMs,
    rounded up, are even (the wide shape's waves), else the wide shape; at
    other head dims the query-major kernel from 3 pairs an SM, the keys-major
    one below. Each case sits at or just past its threshold. The output is bit
    for bit the forced kernel's, and right against the reference."""
    dtype = torch.bfloat16
    gen = torch.Generator().manual_seed(D + more + 10 * (waves or 0))
    Hq, Hkv = 32, 8
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    if D == 128:
        B = waves * sms // Hkv + (1 if more else 0)  # B * Hkv pairs: at most waves * sms, or more
    else:
        B = -(-(6 if more else 5) * sms // (2 * Hkv))  # 3 pairs an SM, or 2.5
    lengths = [int(n) for n in torch.randint(1, 200, (B,), generator=gen)]
    cache = Cache(B=B, capacity=256, Hkv=Hkv, D=D, dtype=dtype, device="cuda", gen=gen,
                  lengths=lengths, block_size=16)
    q = torch.randn((B, 1, Hq, D), generator=gen).to(device="cuda", dtype=dtype)
    names = ("keys_major", "keys_major_x2", "previous") if D == 128 else ("keys_major", "previous")
    outs = {}
    for name in names + ("auto",):
        monkeypatch.setenv("SYMHEAP_DECODE_KERNEL", name)
        outs[name], _ = run_and_check(cache, lengths, q, None, Hq, {}, tol=TOL[dtype])
    for other in names:
        if other != expected:
            assert not torch.equal(bits(outs[expected]), bits(outs[other])), \
                f"{expected} and {other} gave the same bits: this case cannot tell which one ran"
    assert torch.equal(bits(outs["auto"]), bits(outs[expected])), f"auto did not run {expected}"


def balanced_split_count(pairs, sms):
    """The split rule of decode_cuda.cu's balanced_splits: the fewest splits (at
    most 8) whose CTAs fill their last round of SMs to within 1/1.15, else the
    fullest."""
    best, best_fill = 1, 0.0
    for s in range(1, 9):
        ctas = pairs * s
        fill = ctas / (-(-ctas // sms) * sms)
        if fill * 1.15 >= 1.0:
            return s
        if fill > best_fill:
            best, best_fill = s, fill
    return best


@pytest.mark.parametrize("extra", [1, 4])
def test_long_cache_balanced_splits(extra, monkeypatch):
    """Unforced, a cache of at least 16k keys whose (sequence, kv head) pairs
    pass one round of SMs runs the wide keys-major kernel split by the balanced
    rule: bit for bit the forced wide kernel with that split count, not with one
    split, and right against the reference."""
    dtype = torch.bfloat16
    gen = torch.Generator().manual_seed(100 + extra)
    Hq, Hkv, D = 32, 8, 128
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    B = sms // Hkv + extra
    splits = balanced_split_count(B * Hkv, sms)
    assert splits > 1, "the case must pick a split count other than one"
    capacity = 16384
    lengths = [int(n) for n in torch.randint(capacity // 2, capacity + 1, (B,), generator=gen)]
    cache = Cache(B=B, capacity=capacity, Hkv=Hkv, D=D, dtype=dtype, device="cuda", gen=gen,
                  lengths=lengths, block_size=256)
    q = torch.randn((B, 1, Hq, D), generator=gen).to(device="cuda", dtype=dtype)
    monkeypatch.setenv("SYMHEAP_DECODE_KERNEL", "auto")
    auto, _ = run_and_check(cache, lengths, q, None, Hq, {}, tol=TOL[dtype])
    monkeypatch.setenv("SYMHEAP_DECODE_KERNEL", "keys_major")
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")

    def forced_run(num_splits):  # (its result is auto's if the bits match; auto's met the reference)
        out = flash_attn_with_kvcache(q, cache.k, cache.v, cache_seqlens=seqlens,
                                      block_table=cache.block_table, num_splits=num_splits)
        kvcache_check()
        return out

    forced, unsplit = forced_run(splits), forced_run(1)
    assert not torch.equal(bits(forced), bits(unsplit)), "one split gave the same bits: the case cannot tell"
    assert torch.equal(bits(auto), bits(forced)), f"auto did not run the wide kernel with {splits} splits"
