"""numpy references for the symheap.jax EP tests: every received row traced to
its source, combine against fp32. Importable by the test programs (no tests here)."""
from __future__ import annotations

import numpy as np

from symheap.ep import EpConfig


def make_inputs(cfg: EpConfig, n_pes: int, rank: int, seed: int, tokens: int | None = None):
    """Fresh random inputs of PE ``rank`` (all PEs can rebuild every PE's inputs from seed).
    Some slots are dropped (-1) and some tokens route nowhere."""
    rng = np.random.default_rng([seed, rank])
    t = cfg.max_tokens_per_rank if tokens is None else tokens
    x = rng.standard_normal((t, cfg.hidden), dtype=np.float32)
    idx = np.stack([rng.choice(cfg.num_experts, cfg.topk, replace=False) for _ in range(t)]) \
        if t else np.zeros((0, cfg.topk), np.int64)
    idx = idx.astype(np.int64)
    idx[rng.random(idx.shape) < 0.15] = -1
    if t > 1:
        idx[t // 2] = -1  # a token that goes nowhere
    w = rng.random((t, cfg.topk), dtype=np.float32) + 0.1
    return x, idx, w


def scales_of(cfg: EpConfig, rank: int) -> np.ndarray:
    """PE ``rank``'s dispatch scales: a value that names (PE, token, column)."""
    t = np.arange(cfg.max_tokens_per_rank, dtype=np.float32)[:, None]
    j = np.arange(cfg.hidden // cfg.scale_dim, dtype=np.float32)[None, :]
    return (1 + rank + t / 64 + j / 4096).astype(np.float32)


def rows_of(cfg: EpConfig, n_pes: int, me: int, inputs):
    """Reference received rows on PE ``me``: token-major [(src, token)]; expert-major
    {local expert: [(src, token, slot)]}, each in (source PE, token) order."""
    L = cfg.num_experts // n_pes
    if cfg.layout != "expert_major":
        return [(s, t) for s, (_, idx, _) in enumerate(inputs) for t in range(idx.shape[0])
                if any(e >= 0 and e // L == me for e in idx[t])]
    runs = {l: [] for l in range(L)}
    for s, (_, idx, _) in enumerate(inputs):
        for t in range(idx.shape[0]):
            for k, e in enumerate(idx[t]):
                if e >= 0 and e // L == me:
                    runs[e % L].append((s, t, k))
    return runs


def to_f32(a) -> np.ndarray:
    return np.asarray(a).astype(np.float32)


def check_dispatch(cfg: EpConfig, n_pes: int, me: int, inputs, out, xs_cast):
    """Asserts one PE's dispatch outputs (numpy) against the reference.
    ``xs_cast[s]``: PE s's x as dispatched (in the config dtype, as float32)."""
    L = cfg.num_experts // n_pes
    ref = rows_of(cfg, n_pes, me, inputs)
    got_x = to_f32(out["x"])
    if cfg.layout == "expert_major":
        counts = np.asarray(out["expert_counts"])
        assert counts.tolist() == [len(ref[l]) for l in range(L)], (me, counts, ref)
        assert int(out["num_recv_tokens"]) == sum(len(v) for v in ref.values())
        src = np.asarray(out["src_info"])
        for l in range(L):
            for i, (s, t, k) in enumerate(ref[l]):
                assert tuple(src[l, i]) == (s, t, k), (me, l, i, src[l, i], (s, t, k))
                np.testing.assert_array_equal(got_x[l, i], xs_cast[s][t])
                assert np.asarray(out["topk_weights"])[l, i] == inputs[s][2][t, k]
            # past the count: weight 0 (x there is undefined)
            assert (np.asarray(out["topk_weights"])[l, len(ref[l]):] == 0).all(), (me, l)
        return
    src = np.asarray(out["src_info"])
    idx_out, w_out = np.asarray(out["topk_idx"]), np.asarray(out["topk_weights"])
    M = cfg.max_tokens_per_rank
    if cfg.layout == "token_slots":
        placed = {s * M + t: (s, t) for s, t in ref}
        assert int(out["num_recv_tokens"]) == len(ref)
        for r in range(n_pes * M):
            if r not in placed:
                assert tuple(src[r]) == (-1, -1), (me, r, src[r])
                assert (idx_out[r] == -1).all() and (w_out[r] == 0).all()
    else:
        placed = dict(enumerate(ref))
        assert int(out["num_recv_tokens"]) == len(ref), (me, int(out["num_recv_tokens"]), len(ref))
        # past num_recv_tokens: no source, no experts (x there is undefined)
        n = len(ref)
        assert (src[n:] == -1).all() and (idx_out[n:] == -1).all() and (w_out[n:] == 0).all(), me
    for r, (s, t) in placed.items():
        assert tuple(src[r]) == (s, t), (me, r, src[r], (s, t))
        if cfg.scale_dim:
            np.testing.assert_array_equal(np.asarray(out["scales"])[r], scales_of(cfg, s)[t])
        np.testing.assert_array_equal(got_x[r], xs_cast[s][t])
        idx = inputs[s][1][t]
        local = (idx >= 0) & (idx // L == me)
        np.testing.assert_array_equal(idx_out[r], np.where(local, idx - me * L, -1))
        np.testing.assert_array_equal(w_out[r], np.where(local, inputs[s][2][t], 0))


def expert_factor(cfg: EpConfig, n_pes: int, e: int) -> float:
    """The test's expert e multiplies its rows by this."""
    return 1.0 + (e % (cfg.num_experts // n_pes)) / 4.0


def combine_reference(cfg: EpConfig, n_pes: int, inputs_me, x_cast) -> np.ndarray:
    """fp32 reference of combine after the test's experts, for one PE's tokens, and the
    per-token factor (d out / d x)."""
    _, idx, w = inputs_me
    L = cfg.num_experts // n_pes
    factor = np.zeros(idx.shape[0], np.float32)
    for t in range(idx.shape[0]):
        for k, e in enumerate(idx[t]):
            if e >= 0:
                factor[t] += w[t, k] * expert_factor(cfg, n_pes, e)
    return x_cast * factor[:, None], factor
