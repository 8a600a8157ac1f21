"""The split merge of the keys-major decode kernel on CUDA: by the CTAs of a
thread-block cluster (the default where the cluster fits) against the combine
kernel (SYMHEAP_DECODE_MERGE=kernel)."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "attention"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from symheap import _core  # noqa: E402
from symheap.attention import flash_attn_with_kvcache  # noqa: E402

from attention_kvcache_common import Cache, bits, call_options  # noqa: E402
from test_attention_kvcache_gpu import TOL, run_and_check, setup_decode  # noqa: E402

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or not getattr(_core, "attention_has_cuda", False),
    reason="needs a CUDA device and a CUDA build of symheap")


def kernels_launched(fn):
    """Names of the CUDA kernels fn() launches (torch's profiler)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("Sq", [1, 3])
@pytest.mark.parametrize("num_splits", [2, 5, 8, 12, 16])
def test_cluster_merge_equals_combine_kernel(D, Sq, num_splits, monkeypatch):
    """The splits merged by the CTAs of a cluster give the combine kernel's bits
    (same order, same formula), both right against the reference; with at most 8
    splits (a portable cluster) the call launches no combine kernel, with
    SYMHEAP_DECODE_MERGE=kernel it does."""
    monkeypatch.setenv("SYMHEAP_DECODE_KERNEL", "keys_major")
    setup = setup_decode(layout=16, feature="gqa", s_new=0, Sq=Sq, dtype=torch.bfloat16, D=D,
                         seed=100 + num_splits, capacity=2048)
    cache, lengths, q, new, Hq, opts = setup
    runs = {}
    for merge in ("auto", "kernel"):
        monkeypatch.setenv("SYMHEAP_DECODE_MERGE", merge)
        runs[merge] = run_and_check(*setup, tol=TOL[torch.bfloat16], num_splits=num_splits)
        seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
        names = kernels_launched(lambda: flash_attn_with_kvcache(
            q, cache.k, cache.v, cache_seqlens=seqlens, block_table=cache.block_table,
            num_splits=num_splits, **call_options(opts, Hq, "cuda")))
        combined = any("combine_kernel" in n for n in names)
        assert any("keys_major_kernel" in n for n in names), names
        if merge == "kernel":
            assert combined, f"SYMHEAP_DECODE_MERGE=kernel launched no combine kernel: {names}"
        elif num_splits <= 8:
            assert not combined, f"{num_splits} splits were not merged in a cluster: {names}"
    for a, b in zip(runs["auto"], runs["kernel"]):
        assert torch.equal(bits(a), bits(b)), "the cluster merge and the combine kernel differ"


def test_automatic_splits_fall_back_to_a_cluster_that_fits(monkeypatch):
    """Left to the library, a first choice of 9-16 splits whose clusters do not
    all fit at once (3 sequences x 4 kv heads on an H100: 11 splits, 12 clusters
    of 11 CTAs) over a short cache gives way to 8 splits merged in a cluster: no
    combine kernel, and the result right against the reference."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    first = min(4096 // 128, sms // 12)
    if not 8 < first <= 16:
        pytest.skip(f"{sms} SMs: the first split choice ({first}) is not between 9 and 16")
    monkeypatch.setenv("SYMHEAP_DECODE_KERNEL", "keys_major")
    monkeypatch.delenv("SYMHEAP_DECODE_MERGE", raising=False)
    setup = setup_decode(layout=16, feature="plain", s_new=0, Sq=1, dtype=torch.bfloat16, D=128,
                         B=3, seed=11, capacity=4096)
    cache, lengths, q, new, Hq, opts = setup
    run_and_check(*setup, tol=TOL[torch.bfloat16])
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    names = kernels_launched(lambda: flash_attn_with_kvcache(
        q, cache.k, cache.v, cache_seqlens=seqlens, block_table=cache.block_table,
        **call_options(opts, Hq, "cuda")))
    assert any("keys_major_kernel" in n for n in names), names
    assert not any("combine_kernel" in n for n in names), (
        f"the automatic split count was not merged in a cluster: {names}")


def test_one_tile_splits_merge_in_two_ctas_an_sm_clusters(monkeypatch):
    """Left to the library, a call whose splits each walk one 128-key tile (2
    sequences x 8 kv heads over 1024 keys: 8 splits) and whose wide-shape
    clusters do not all fit at once runs the two-CTAs-an-SM shape merged in its
    clusters: no combine kernel, the bits of that shape forced, and the result
    right against the reference. Where the wide clusters fit (another device),
    the case does not arise and is skipped."""
    monkeypatch.delenv("SYMHEAP_DECODE_MERGE", raising=False)
    dtype = torch.bfloat16
    gen = torch.Generator().manual_seed(21)
    B, Hq, Hkv, D, capacity = 2, 32, 8, 128, 1024
    lengths = [int(n) for n in torch.randint(capacity // 2, capacity + 1, (B,), generator=gen)]
    cache = Cache(B=B, capacity=capacity, Hkv=Hkv, D=D, dtype=dtype, device="cuda", gen=gen,
                  lengths=lengths, block_size=16)
    q = torch.randn((B, 1, Hq, D), generator=gen).to(device="cuda", dtype=dtype)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")

    def call():
        return flash_attn_with_kvcache(q, cache.k, cache.v, cache_seqlens=seqlens,
                                       block_table=cache.block_table)

    monkeypatch.setenv("SYMHEAP_DECODE_KERNEL", "keys_major")
    if not any("combine_kernel" in n for n in kernels_launched(call)):
        pytest.skip("the wide shape's clusters fit on this device: its plan merges there")
    wide = call()
    monkeypatch.setenv("SYMHEAP_DECODE_KERNEL", "keys_major_x2")
    two = call()
    monkeypatch.setenv("SYMHEAP_DECODE_KERNEL", "auto")
    run_and_check(cache, lengths, q, None, Hq, {}, tol=TOL[dtype])
    names = kernels_launched(call)
    assert any("keys_major_kernel" in n for n in names), names
    assert not any("combine_kernel" in n for n in names), f"the splits were not merged in a cluster: {names}"
    auto = call()
    assert not torch.equal(bits(wide), bits(two)), "the two shapes gave the same bits: the case cannot tell"
    assert torch.equal(bits(auto), bits(two)), "auto did not run the two-CTAs shape"
