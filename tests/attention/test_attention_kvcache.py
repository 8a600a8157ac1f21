"""Attention over KV caches on the cpu path: the decode call
(flash_attn_with_kvcache, dense and paged caches, with and without appended
rows) and the paged varlen call, against a dense fp32 reference built by
gathering the cache; appended rows land exactly at cache_seqlens and nothing
else in the cache changes; bad input raises ValueError and writes nothing."""
import pytest
import torch

from symheap.attention import flash_attn_varlen_func, flash_attn_with_kvcache

from attention_kvcache_common import FEATURES, Cache, bits, call_options, reference

LAYOUTS = [None, 16, 256]  # dense, then paged block sizes
D = 32
TOL = 2e-5


def max_err(x, ref):
    return (x.float().cpu() - ref.float()).abs().max().item() if x.numel() else 0.0


def decode_setup(*, layout, feature, s_new, B=3, Sq=None, capacity=300, dtype=torch.float32,
                 seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    Hq, Hkv, opts = FEATURES[feature]
    # Lengths before the call: empty, full to the brim, and one in between.
    cap = Cache(B=1, capacity=capacity, Hkv=1, D=1, dtype=dtype, device="cpu", gen=gen,
                lengths=[0], block_size=layout).capacity
    lengths = [0, cap - s_new, int(torch.randint(1, cap - s_new, (1,), generator=gen))][:B]
    cache = Cache(B=B, capacity=capacity, Hkv=Hkv, D=D, dtype=dtype, device=device, gen=gen,
                  lengths=lengths, block_size=layout)
    Sq = Sq if Sq is not None else max(1, s_new)
    q = torch.randn((B, Sq, Hq, D), generator=gen).to(device=device, dtype=dtype)
    new = None
    if s_new:
        new = tuple(torch.randn((B, s_new, Hkv, D), generator=gen).to(device=device, dtype=dtype)
                    for _ in range(2))
    return cache, lengths, q, new, Hq, opts


def run_decode(cache, lengths, q, new, Hq, opts, **extra):
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=q.device)
    k, v = new if new is not None else (None, None)
    out, lse = flash_attn_with_kvcache(
        q, cache.k, cache.v, k, v, cache_seqlens=seqlens, block_table=cache.block_table,
        return_lse=True, **call_options(opts, Hq, q.device), **extra)
    assert seqlens.tolist() == lengths, "cache_seqlens must not change"
    return out, lse


def check_decode(cache, lengths, q, new, Hq, opts, out, lse, before, tol):
    s_new = 0 if new is None else new[0].shape[1]
    # The appended rows, and nothing else, changed in the caches.
    want = Cache.__new__(Cache)
    want.__dict__.update(cache.__dict__)
    want.k, want.v = before[0].clone(), before[1].clone()
    for b, n in enumerate(lengths):
        if s_new:
            want.write(b, n, new[0][b], new[1][b])
    assert torch.equal(bits(cache.k), bits(want.k)), "k_cache differs outside the appended rows"
    assert torch.equal(bits(cache.v), bits(want.v)), "v_cache differs outside the appended rows"
    for b, n in enumerate(lengths):
        ref, ref_lse = reference(q[b:b + 1], cache, b, n + s_new, opts, Hq)
        assert not torch.isnan(out[b]).any(), f"NaN in sequence {b}'s output"
        assert max_err(out[b:b + 1], ref) <= tol, f"sequence {b}: error {max_err(out[b:b + 1], ref):.3g}"
        finite = torch.isfinite(ref_lse)
        assert torch.equal(torch.isfinite(lse[b:b + 1].cpu()), finite)
        if finite.any():
            assert (lse[b:b + 1].cpu()[finite] - ref_lse[finite]).abs().max().item() <= 1e-4


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("s_new", [0, 1, 3])
def test_decode(layout, feature, s_new):
    setup = decode_setup(layout=layout, feature=feature, s_new=s_new,
                         seed=hash((layout, feature, s_new)) % 1000)
    before = setup[0].snapshot()
    out, lse = run_decode(*setup)
    check_decode(*setup, out, lse, before, TOL)


@pytest.mark.parametrize("layout", [None, 16])
def test_decode_more_queries_than_new_rows(layout):
    # Speculative decoding shape: 4 queries, 2 appended rows, causal aligned bottom-right.
    setup = decode_setup(layout=layout, feature="all", s_new=2, Sq=4, seed=7)
    before = setup[0].snapshot()
    out, lse = run_decode(*setup)
    check_decode(*setup, out, lse, before, TOL)


def test_decode_bfloat16():
    setup = decode_setup(layout=16, feature="all", s_new=1, dtype=torch.bfloat16, seed=3)
    before = setup[0].snapshot()
    out, lse = run_decode(*setup)
    assert out.dtype == torch.bfloat16
    check_decode(*setup, out, lse, before, tol=2e-2)


def test_decode_int_seqlens_and_defaults():
    gen = torch.Generator().manual_seed(11)
    cache = Cache(B=2, capacity=64, Hkv=2, D=D, dtype=torch.float32, device="cpu", gen=gen,
                  lengths=[20, 20], block_size=16)
    q = torch.randn((2, 1, 2, D), generator=gen)
    out = flash_attn_with_kvcache(q, cache.k, cache.v, cache_seqlens=20, block_table=cache.block_table)
    for b in range(2):
        ref, _ = reference(q[b:b + 1], cache, b, 20, {}, 2)
        assert max_err(out[b:b + 1], ref) <= TOL


def test_index_tensors_with_strided_rows():
    """A block table (and lengths) whose rows are not unit-stride views give the
    same outputs as their contiguous copies."""
    gen = torch.Generator().manual_seed(12)
    cache = Cache(B=2, capacity=64, Hkv=2, D=D, dtype=torch.float32, device="cpu", gen=gen,
                  lengths=[20, 37], block_size=16)
    q = torch.randn((2, 1, 2, D), generator=gen)
    table = cache.block_table.t().contiguous().t()  # the same values, column-major
    seqlens = torch.tensor([[20, 0], [37, 0]], dtype=torch.int32)[:, 0]  # stride 2
    assert table.stride(-1) != 1 and seqlens.stride(-1) != 1
    want = flash_attn_with_kvcache(q, cache.k, cache.v, cache_seqlens=seqlens.contiguous(),
                                   block_table=cache.block_table)
    got = flash_attn_with_kvcache(q, cache.k, cache.v, cache_seqlens=seqlens, block_table=table)
    assert torch.equal(got, want)
    for b, n in enumerate([20, 37]):
        ref, _ = reference(q[b:b + 1], cache, b, n, {}, 2)
        assert max_err(got[b:b + 1], ref) <= TOL


# ---------------------------------------------------------------- paged varlen

@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("feature", list(FEATURES))
def test_paged_varlen(block_size, feature):
    gen = torch.Generator().manual_seed(hash((block_size, feature)) % 1000)
    Hq, Hkv, opts = FEATURES[feature]
    q_lens, k_lens = [1, 37, 0, 20], [290, 130, 9, 0]
    cache = Cache(B=4, capacity=300, Hkv=Hkv, D=D, dtype=torch.float32, device="cpu", gen=gen,
                  lengths=k_lens, block_size=block_size)
    cu_q = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    cu_k = torch.tensor([0] + torch.tensor(k_lens).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn((int(cu_q[-1]), Hq, D), generator=gen)
    before = cache.snapshot()
    out, lse = flash_attn_varlen_func(q, cache.k, cache.v, cu_q, cu_k, max(q_lens), max(k_lens),
                                      block_table=cache.block_table, return_lse=True,
                                      **call_options(opts, Hq, "cpu"))
    assert torch.equal(bits(cache.k), bits(before[0])) and torch.equal(bits(cache.v), bits(before[1]))
    for b, (nq, nk) in enumerate(zip(q_lens, k_lens)):
        rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
        ref, ref_lse = reference(q[rows][None], cache, b, nk, opts, Hq)
        assert max_err(out[rows][None], ref) <= TOL, f"sequence {b}"
        got_lse = lse[:, rows][None]
        finite = torch.isfinite(ref_lse)
        assert torch.equal(torch.isfinite(got_lse), finite)
        if finite.any():
            assert (got_lse[finite] - ref_lse[finite]).abs().max().item() <= 1e-4


def test_paged_varlen_matches_dense_varlen():
    """The paged call equals the plain varlen call over the same keys packed."""
    gen = torch.Generator().manual_seed(5)
    q_lens, k_lens = [30, 7], [100, 250]
    cache = Cache(B=2, capacity=256, Hkv=2, D=D, dtype=torch.float32, device="cpu", gen=gen,
                  lengths=k_lens, block_size=16)
    cu_q = torch.tensor([0, 30, 37], dtype=torch.int32)
    cu_k = torch.tensor([0, 100, 350], dtype=torch.int32)
    q = torch.randn((37, 4, D), generator=gen)
    k = torch.cat([cache.gather(b, n)[0][0] for b, n in enumerate(k_lens)])
    v = torch.cat([cache.gather(b, n)[1][0] for b, n in enumerate(k_lens)])
    paged = flash_attn_varlen_func(q, cache.k, cache.v, cu_q, cu_k, 30, 250,
                                   block_table=cache.block_table, causal=True, softcap=2.0)
    dense = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 30, 250, causal=True, softcap=2.0)
    assert max_err(paged, dense) <= TOL


# ---------------------------------------------------------------- errors

def error_setup(layout=16):
    return decode_setup(layout=layout, feature="gqa", s_new=2, B=3, seed=99)


def expect_error(match, setup, before, **overrides):
    cache, lengths, q, new, Hq, opts = setup
    args = dict(q=q, k_cache=cache.k, v_cache=cache.v, k=new[0], v=new[1],
                cache_seqlens=torch.tensor(lengths, dtype=torch.int32), block_table=cache.block_table)
    args.update(overrides)
    with pytest.raises(ValueError, match=match):
        flash_attn_with_kvcache(args.pop("q"), args.pop("k_cache"), args.pop("v_cache"),
                                args.pop("k"), args.pop("v"), **args)
    assert torch.equal(bits(cache.k), bits(before[0])), "a failed call wrote to k_cache"
    assert torch.equal(bits(cache.v), bits(before[1])), "a failed call wrote to v_cache"


@pytest.mark.parametrize("bad_id", [-1, "num_blocks"])
def test_block_id_out_of_range(bad_id):
    setup = error_setup()
    cache = setup[0]
    before = cache.snapshot()
    table = cache.block_table.clone()
    table[2, 0] = cache.k.shape[0] if bad_id == "num_blocks" else bad_id
    expect_error(r"block_table\[2, 0\] = -?\d+ is outside \[0, num_blocks", setup, before,
                 block_table=table)


def test_unused_block_ids_are_not_read():
    setup = error_setup()
    cache, lengths = setup[0], setup[1]
    table = cache.block_table.clone()
    table[0, 1:] = -1  # sequence 0 holds 0 + 2 rows: block 0 only
    cache.block_table = table
    before = cache.snapshot()
    out, lse = run_decode(*setup)
    check_decode(*setup, out, lse, before, TOL)


def test_cache_too_small_for_appended_rows():
    setup = error_setup()
    cache, lengths = setup[0], setup[1]
    before = cache.snapshot()
    seqlens = torch.tensor([0, cache.capacity - 1, 5], dtype=torch.int32)
    expect_error(r"sequence 1 needs \d+ cache rows .* but the cache holds", setup, before,
                 cache_seqlens=seqlens)
    expect_error(r"cache_seqlens gives sequence 0 the length -3", setup, before,
                 cache_seqlens=torch.tensor([-3, 0, 0], dtype=torch.int32))


def test_dense_cache_too_small():
    setup = error_setup(layout=None)
    before = setup[0].snapshot()
    seqlens = torch.tensor([0, 0, setup[0].capacity], dtype=torch.int32)
    expect_error(r"sequence 2 needs", setup, before, cache_seqlens=seqlens)


def test_mismatched_shapes():
    setup = error_setup()
    cache, lengths, q, new, Hq, opts = setup
    before = cache.snapshot()
    expect_error(r"k_cache and v_cache must have one shape", setup, before, v_cache=cache.v[:-1])
    expect_error(r"head dim", setup, before, q=torch.randn(3, 2, Hq, D + 8))
    expect_error(r"multiple of the caches' key/value heads", setup, before, q=torch.randn(3, 2, 3, D))
    expect_error(r"block_table must have shape \(3, ", setup, before, block_table=cache.block_table[:2])
    expect_error(r"k and v must have shape", setup, before, k=new[0][:, :, :1], v=new[1][:, :, :1])
    expect_error(r"k and v must have one shape", setup, before, v=new[1][:, :1])
    expect_error(r"cache_seqlens must have shape \(3,\)", setup, before,
                 cache_seqlens=torch.zeros(2, dtype=torch.int32))
    expect_error(r"cache_seqlens must be int32", setup, before,
                 cache_seqlens=torch.zeros(3, dtype=torch.int64))
    expect_error(r"k_cache and v_cache must have q's dtype", setup, before, q=q.bfloat16())
    expect_error(r"give both k and v", setup, before, v=None)
    expect_error(r"dense caches must have batch 3", setup, before, block_table=None)


def test_arguments_that_are_not_tensors_or_of_another_dtype():
    setup = error_setup()
    cache, lengths, q, new, Hq, opts = setup
    before = cache.snapshot()
    seqlens = torch.tensor(lengths, dtype=torch.int32)
    for name, value, typename in (("k_cache", cache.k.numpy(), "ndarray"), ("k", [1.0], "list")):
        args = dict(k_cache=cache.k, v_cache=cache.v, k=new[0], v=new[1])
        args[name] = value
        with pytest.raises(TypeError, match=rf"attention: {name} must be a torch.Tensor, got {typename}"):
            flash_attn_with_kvcache(q, args["k_cache"], args["v_cache"], args["k"], args["v"],
                                    cache_seqlens=seqlens, block_table=cache.block_table)
    with pytest.raises(TypeError, match=r"attention: cache_seqlens must be a torch.Tensor, got list"):
        flash_attn_with_kvcache(q, cache.k, cache.v, new[0], new[1], cache_seqlens=list(lengths),
                                block_table=cache.block_table)
    expect_error(r"q has dtype float64", setup, before, q=q.double())
    expect_error(r"k and v must have q's dtype float32", setup, before,
                 k=new[0].double(), v=new[1].double())
    assert torch.equal(bits(cache.k), bits(before[0]))


def test_forward_only_and_unsupported_options():
    setup = error_setup()
    cache, lengths, q, new, Hq, opts = setup
    before = cache.snapshot()
    expect_error(r"forward only", setup, before, q=q.clone().requires_grad_())
    cu = torch.tensor([0, 2, 4, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match="bias is not supported with block_table"):
        flash_attn_varlen_func(q.reshape(6, Hq, D), cache.k, cache.v, cu, cu, 2, 2,
                               block_table=cache.block_table, bias=torch.zeros(1, 1, 2, 2))
    with pytest.raises(ValueError, match=r"sequence 1 needs 400 cache rows"):
        flash_attn_varlen_func(q.reshape(6, Hq, D), cache.k, cache.v, cu,
                               torch.tensor([0, 2, 402, 404], dtype=torch.int32), 2, 400,
                               block_table=cache.block_table)
    with pytest.raises(ValueError, match=r"cu_seqlens_k gives sequence 0 the length -2"):
        flash_attn_varlen_func(q.reshape(6, Hq, D), cache.k, cache.v, cu,
                               torch.tensor([2, 0, 2, 4], dtype=torch.int32), 2, 2,
                               block_table=cache.block_table)
    assert torch.equal(bits(cache.k), bits(before[0]))
