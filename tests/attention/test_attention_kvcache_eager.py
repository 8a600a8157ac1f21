"""The decode call's eager path (flash_attn_with_kvcache in one C++ call, its
outputs from pools), on the cpu: the same outputs as the general path that
converts arguments in Python; an output its caller keeps is never handed out
again; outputs made in inference mode stay apart from the others; an output
made to require grad is not handed out again; the options as the core sets
them (the default scale, a causal call's window)."""
import math

import pytest
import torch

from symheap import _core
from symheap.attention import flash_attn_with_kvcache

from attention_kvcache_common import Cache, reference, threads_with_other_outputs

D = 32
TOL = 2e-5


def setup(seed, B=2, Hq=4, Hkv=2, lengths=(20, 37), block_size=16):
    gen = torch.Generator().manual_seed(seed)
    cache = Cache(B=B, capacity=64, Hkv=Hkv, D=D, dtype=torch.float32, device="cpu", gen=gen,
                  lengths=list(lengths), block_size=block_size)
    q = torch.randn((B, 1, Hq, D), generator=gen)
    seqlens = torch.tensor(lengths, dtype=torch.int32)
    return cache, q, seqlens


def fast(q, cache, seqlens, *, causal=False, window=(-1, -1), scale=None, softcap=0.0,
         return_lse=False):
    """The C++ entry itself: None where it leaves the call to the general path."""
    return _core.attention_kvcache_eager(q, cache.k, cache.v, None, None, seqlens,
                                         cache.block_table, causal, window, scale, softcap, None, 0,
                                         return_lse)


def test_plain_arguments_take_the_entry_and_others_the_general_path():
    cache, q, seqlens = setup(1)
    assert fast(q, cache, seqlens) is not None
    # Arguments that need a conversion first: the entry declines them.
    assert fast(q, cache, seqlens, window=[-1, -1]) is None
    assert fast(q, cache, seqlens, causal=1) is None
    assert fast(q, cache, seqlens, scale=torch.tensor(0.1)) is None
    assert fast(q, cache, 20) is None
    assert fast(q, cache, torch.tensor([[20, 0], [37, 0]], dtype=torch.int32)[:, 0]) is None
    assert fast(q.transpose(2, 3).contiguous().transpose(2, 3), cache, seqlens) is None
    with torch.enable_grad():
        assert fast(q.clone().requires_grad_(), cache, seqlens) is None


@pytest.mark.parametrize("options", [dict(), dict(causal=True), dict(window=(5, 0)),
                                     dict(scale=0.3, softcap=2.0)])
def test_entry_and_general_path_agree(options):
    cache, q, seqlens = setup(2)
    out, lse = fast(q, cache, seqlens, return_lse=True, **options)
    # The same call through the general path (a list window is converted in Python).
    window = list(options.get("window", (-1, -1)))
    want, want_lse = flash_attn_with_kvcache(
        q, cache.k, cache.v, cache_seqlens=seqlens, block_table=cache.block_table,
        causal=options.get("causal", False), window_size=window,
        softmax_scale=options.get("scale"), softcap=options.get("softcap", 0.0), return_lse=True)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    opts = {"causal": options.get("causal", False), "window_size": tuple(window),
            "softmax_scale": options.get("scale"), "softcap": options.get("softcap", 0.0)}
    for b, n in enumerate(seqlens.tolist()):
        ref, ref_lse = reference(q[b:b + 1], cache, b, n, opts, q.shape[2])
        assert (out[b:b + 1] - ref).abs().max().item() <= TOL
        assert (lse[b:b + 1] - ref_lse).abs().max().item() <= TOL


def test_kept_outputs_are_not_handed_out_again():
    cache, q, seqlens = setup(3)
    kept = [flash_attn_with_kvcache(q * (i + 1), cache.k, cache.v, cache_seqlens=seqlens,
                                    block_table=cache.block_table, return_lse=True)
            for i in range(10)]  # more than a pool holds
    copies = [(o.clone(), l.clone()) for o, l in kept]
    pointers = {o.data_ptr() for o, _ in kept} | {l.data_ptr() for _, l in kept}
    assert len(pointers) == 20, "two kept outputs share memory"
    for _ in range(3):  # dropped outputs are recycled; kept ones never
        flash_attn_with_kvcache(-q, cache.k, cache.v, cache_seqlens=seqlens,
                                block_table=cache.block_table, return_lse=True)
    for (o, l), (co, cl) in zip(kept, copies):
        assert torch.equal(o, co) and torch.equal(l, cl)


def test_a_dropped_output_comes_back_for_the_same_shape():
    cache, q, seqlens = setup(4)
    out = flash_attn_with_kvcache(q, cache.k, cache.v, cache_seqlens=seqlens,
                                  block_table=cache.block_table)
    first = out.data_ptr()
    view = out[0]  # a view keeps the storage in use
    del out
    again = flash_attn_with_kvcache(q, cache.k, cache.v, cache_seqlens=seqlens,
                                    block_table=cache.block_table)
    assert again.data_ptr() != first, "handed out while a view of it was alive"
    del view, again
    seen = set()
    for _ in range(4):
        o = flash_attn_with_kvcache(q, cache.k, cache.v, cache_seqlens=seqlens,
                                    block_table=cache.block_table)
        seen.add(o.data_ptr())
        del o
    assert len(seen) == 1, "a dropped output was not recycled"


def test_inference_mode_outputs_stay_apart():
    cache, q, seqlens = setup(5)
    with torch.inference_mode():
        inner = flash_attn_with_kvcache(q, cache.k, cache.v, cache_seqlens=seqlens,
                                        block_table=cache.block_table)
        assert inner.is_inference()
        del inner
    out = flash_attn_with_kvcache(q, cache.k, cache.v, cache_seqlens=seqlens,
                                 block_table=cache.block_table)
    assert not out.is_inference()
    out.add_(1.0)  # an inference tensor would refuse this outside inference mode


def test_an_output_made_to_require_grad_is_dropped():
    cache, q, seqlens = setup(6)
    out = flash_attn_with_kvcache(q, cache.k, cache.v, cache_seqlens=seqlens,
                                  block_table=cache.block_table)
    out.requires_grad_()
    del out
    for _ in range(5):
        assert not flash_attn_with_kvcache(q, cache.k, cache.v, cache_seqlens=seqlens,
                                           block_table=cache.block_table).requires_grad


def test_options_as_the_core_sets_them():
    o = _core.attention_cache_options(64, False, 7, 3, None, 1.5)
    assert o == {"window_left": 7, "window_right": 3, "scale": pytest.approx(1 / math.sqrt(64)),
                 "softcap": 1.5}
    assert _core.attention_cache_options(64, True, -1, -1, 0.25, 0.0)["window_right"] == 0
    assert _core.attention_cache_options(64, True, -1, -1, 0.25, 0.0)["scale"] == 0.25
    with pytest.raises(ValueError, match="head_dim must be >= 1"):
        _core.attention_cache_options(0, False, -1, -1, None, 0.0)
    cache, q, seqlens = setup(7)
    for window in [(2 ** 40, 0), [0, -2 ** 40]]:  # the entry's form, and the general path's
        with pytest.raises(ValueError, match="window sides must fit in 32 bits"):
            flash_attn_with_kvcache(q, cache.k, cache.v, cache_seqlens=seqlens,
                                    block_table=cache.block_table, window_size=window)


def test_threads_calling_at_once_get_their_own_outputs():
    """Six threads call at once, four shapes among them: two pairs share a shape
    (so pool entries) and every thread shares the pools, which then hold more
    shapes than entries and replace them in turn (the core runs without the
    GIL, and torch may run Python code inside a pool's take, so other threads
    take meanwhile): each result equals the same call made alone."""
    shapes = [(1, 4), (2, 2), (3, 2), (4, 4), (1, 4), (2, 2)]  # (batch, kv heads)
    lengths = (20, 37, 5, 64)
    cases = [setup(10 + i, B=B, Hq=4, Hkv=Hkv, lengths=lengths[:B])
             for i, (B, Hkv) in enumerate(shapes)]

    def call(c, q, s):
        return flash_attn_with_kvcache(q, c.k, c.v, cache_seqlens=s, block_table=c.block_table,
                                       return_lse=True)

    bad = threads_with_other_outputs(cases, call, calls=300)
    assert not bad, f"threads {bad} got another call's output"
