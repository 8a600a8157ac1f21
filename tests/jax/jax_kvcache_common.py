"""Shared by the JAX KV-cache tests (cpu in tests/jax, CUDA in tests/gpu): cases
built with the torch helpers of tests/attention/attention_kvcache_common.py (caches
poisoned with NaN beyond the valid rows, a dense fp32 reference gathered from
the cache), run through symheap.jax, and the checks. No tests here."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import torch

import symheap.jax as shj

from attention_kvcache_common import FEATURES, Cache, alibi_slopes, reference

JAX_DTYPE = {torch.float32: jnp.float32, torch.float16: jnp.float16, torch.bfloat16: jnp.bfloat16}


def to_jax(t: torch.Tensor):
    """A torch tensor as a jax array of the same dtype (exact: through fp32)."""
    if t.dtype == torch.int32:
        return jnp.asarray(t.cpu().numpy())
    return jnp.asarray(t.detach().float().cpu().numpy()).astype(JAX_DTYPE[t.dtype])


def to_torch32(x) -> torch.Tensor:
    return torch.from_numpy(np.array(jnp.asarray(x, jnp.float32)))


def jax_options(opts: dict, Hq: int) -> dict:
    kw = dict(opts)
    if kw.pop("alibi", False):
        kw["alibi_slopes"] = jnp.asarray(alibi_slopes(Hq).numpy())
    return kw


def same_values(x, want: torch.Tensor) -> bool:
    """Exact equality in fp32, NaN poison equal to itself."""
    return np.array_equal(np.asarray(jnp.asarray(x, jnp.float32)), want.float().numpy(),
                          equal_nan=True)


class DecodeCase:
    """A decode call: B sequences whose caches hold 0, capacity - s_new and a
    random number of rows, q (B, Sq, Hq, D) and, with s_new, rows to append."""

    def __init__(self, *, layout, feature, s_new, dtype=torch.float32, D=32, B=3, Sq=None,
                 capacity=300, seed=0, lengths=None):
        gen = torch.Generator().manual_seed(seed)
        self.Hq, Hkv, self.opts = FEATURES[feature]
        cap = Cache(B=1, capacity=capacity, Hkv=1, D=1, dtype=dtype, device="cpu", gen=gen,
                    lengths=[0], block_size=layout).capacity
        if lengths is None:
            lengths = [0, cap - s_new, int(torch.randint(1, cap - s_new, (1,), generator=gen))][:B]
        self.lengths = list(lengths)
        self.cache = Cache(B=B, capacity=capacity, Hkv=Hkv, D=D, dtype=dtype, device="cpu",
                           gen=gen, lengths=self.lengths, block_size=layout)
        Sq = Sq if Sq is not None else max(1, s_new)
        self.q = torch.randn((B, Sq, self.Hq, D), generator=gen).to(dtype)
        self.new = None
        if s_new:
            self.new = tuple(torch.randn((B, s_new, Hkv, D), generator=gen).to(dtype)
                             for _ in range(2))
        self.s_new = s_new

    def args(self) -> dict:
        """The call's arguments as jax arrays (fresh copies each time)."""
        c = self.cache
        return dict(q=to_jax(self.q), k_cache=to_jax(c.k), v_cache=to_jax(c.v),
                    k=None if self.new is None else to_jax(self.new[0]),
                    v=None if self.new is None else to_jax(self.new[1]),
                    cache_seqlens=jnp.asarray(np.array(self.lengths, np.int32)),
                    block_table=None if c.block_table is None else to_jax(c.block_table))

    def options(self) -> dict:
        return jax_options(self.opts, self.Hq)

    def run(self, **extra):
        """(out, lse, k_cache, v_cache) of the call (caches None without append)."""
        a = self.args()
        got = shj.flash_attn_with_kvcache(a["q"], a["k_cache"], a["v_cache"], a["k"], a["v"],
                                          cache_seqlens=a["cache_seqlens"],
                                          block_table=a["block_table"], return_lse=True,
                                          **self.options(), **extra)
        return got if self.new is not None else (got[0], got[1], None, None)

    def expected_cache(self) -> Cache:
        """The torch cache after the append: the new rows at cache_seqlens, nothing else changed."""
        want = Cache.__new__(Cache)
        want.__dict__.update(self.cache.__dict__)
        want.k, want.v = self.cache.snapshot()
        if self.new is not None:
            for b, n in enumerate(self.lengths):
                want.write(b, n, self.new[0][b], self.new[1][b])
        return want

    def check(self, out, lse, k_cache, v_cache, tol):
        want = self.expected_cache()
        if self.new is not None:
            assert same_values(k_cache, want.k), "k_cache differs outside/inside the appended rows"
            assert same_values(v_cache, want.v), "v_cache differs outside/inside the appended rows"
        out, lse = to_torch32(out), to_torch32(lse)
        assert out.shape == self.q.shape and lse.shape == (self.q.shape[0], self.Hq, self.q.shape[1])
        for b, n in enumerate(self.lengths):
            ref, ref_lse = reference(self.q[b:b + 1], want, b, n + self.s_new, self.opts, self.Hq)
            check_rows(out[b:b + 1], lse[b:b + 1], ref, ref_lse, tol, f"sequence {b}")


def check_rows(out, lse, ref, ref_lse, tol, what):
    assert not torch.isnan(out).any(), f"{what}: NaN in the output"
    e = (out - ref.float()).abs().max().item() if out.numel() else 0.0
    assert e <= tol, f"{what}: error {e:.3g} > {tol}"
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite), f"{what}: lse finiteness differs"
    if finite.any():
        lse_tol = 1e-4 if tol < 1e-3 else 2e-3  # fp32, else float16/bfloat16 inputs
        assert (lse[finite] - ref_lse[finite]).abs().max().item() <= lse_tol, f"{what}: lse"


class PagedVarlenCase:
    """A paged varlen call: packed queries, key lengths from cu_seqlens_k, the
    keys in a paged cache (sequences with no queries or no keys included)."""

    def __init__(self, *, block_size, feature, dtype=torch.float32, D=32, seed=0,
                 q_lens=(1, 37, 0, 20), k_lens=(290, 130, 9, 0)):
        gen = torch.Generator().manual_seed(seed)
        self.Hq, Hkv, self.opts = FEATURES[feature]
        self.q_lens, self.k_lens = list(q_lens), list(k_lens)
        self.cache = Cache(B=len(q_lens), capacity=max(k_lens) + 10, Hkv=Hkv, D=D, dtype=dtype,
                           device="cpu", gen=gen, lengths=self.k_lens, block_size=block_size)
        self.cu_q = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        self.cu_k = np.concatenate([[0], np.cumsum(k_lens)]).astype(np.int32)
        # Two packed rows past the last sequence: no sequence owns them.
        self.q = torch.randn((int(self.cu_q[-1]) + 2, self.Hq, D), generator=gen).to(dtype)

    def run(self, **extra):
        c = self.cache
        return shj.flash_attn_varlen_func(
            to_jax(self.q), to_jax(c.k), to_jax(c.v), jnp.asarray(self.cu_q),
            jnp.asarray(self.cu_k), max(self.q_lens), max(self.k_lens),
            block_table=to_jax(c.block_table), return_lse=True,
            **jax_options(self.opts, self.Hq), **extra)

    def check(self, out, lse, tol):
        out, lse = to_torch32(out), to_torch32(lse)
        for b, (nq, nk) in enumerate(zip(self.q_lens, self.k_lens)):
            rows = slice(int(self.cu_q[b]), int(self.cu_q[b + 1]))
            ref, ref_lse = reference(self.q[rows][None], self.cache, b, nk, self.opts, self.Hq)
            check_rows(out[rows][None], lse[:, rows][None], ref, ref_lse, tol, f"sequence {b}")
        tail = slice(int(self.cu_q[-1]), None)
        assert torch.equal(out[tail], torch.zeros_like(out[tail])), "rows of no sequence must be 0"
        assert torch.isneginf(lse[:, tail]).all(), "rows of no sequence must have lse -inf"
