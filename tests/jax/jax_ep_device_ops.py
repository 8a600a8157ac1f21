"""Device operations (kernel launches, memsets, copies, stream waits, host syncs) that one
dispatch and one combine issue, per layout, through symheap.jax (inside jit) and through
the torch front end: the core counts them in both runtimes, so the CUDA kernels' host
emulation (SYMHEAP_EP_EMULATE_DEVICE=1, one PE) gives the numbers a GPU run issues.

    python jax_ep_device_ops.py jax '{"seed": 1}'   # prints one JSON line: {layout: counts}
    python jax_ep_device_ops.py shard_map '{"seed": 1, "n": 2}'   # n devices, one process

(the torch side is ``torch_counts``, run through symheap.testing.run_processes). The jax
side also checks every result against a numpy reference, twice: a call where every token
is kept, then one with dropped slots (fewer rows: what lies past the counts must read as
empty even where XLA hands over the buffers of the first call).
"""
from __future__ import annotations

import json
import sys

import numpy as np

HIDDEN, TOKENS, EXPERTS, TOPK = 64, 40, 8, 3
LAYOUTS = {
    "intranode": dict(kernel="intranode"),  # max_recv_tokens: every row of every PE
    "low_latency": dict(kernel="low_latency"),
    "expert_major": dict(kernel="low_latency", layout="expert_major"),
}


def config(layout: str, n: int = 1):
    from symheap.ep import EpConfig
    kw = dict(LAYOUTS[layout])
    if kw["kernel"] == "intranode":
        kw["max_recv_tokens"] = n * TOKENS
    return EpConfig(hidden=HIDDEN, max_tokens_per_rank=TOKENS, num_experts=EXPERTS, topk=TOPK,
                    dtype="bfloat16", **kw)


def routing(rng, drops: bool):
    idx = np.argsort(rng.random((TOKENS, EXPERTS)), axis=-1)[:, :TOPK].astype(np.int32)
    if drops:  # some slots dropped, some tokens dropped whole
        idx[rng.random((TOKENS, TOPK)) < 0.3] = -1
        idx[rng.random(TOKENS) < 0.2] = -1
    w = rng.random((TOKENS, TOPK), dtype=np.float32)
    return idx, w


def delta(after, before):
    """after - before per kind (None: the cpu implementation, which counts none)."""
    return None if after is None else {k: after[k] - before[k] for k in after}


def check_jax(layout, x, idx, w, d, y):
    """One PE holds every expert: each kept token comes back to itself."""
    xf = x.astype(np.float32)
    kept = (idx >= 0).any(axis=1)
    if layout == "expert_major":
        counts = np.asarray(d.expert_counts)
        want = np.bincount(idx[idx >= 0], minlength=EXPERTS)
        assert (counts == want).all(), (counts, want)
        rw = np.asarray(d.topk_weights)
        rx = np.asarray(d.x).astype(np.float32)
        for e in range(EXPERTS):
            toks, slots = np.nonzero(idx == e)  # source order: by token
            assert np.array_equal(rx[e, :len(toks)], xf[toks]), e
            assert np.array_equal(rw[e, :len(toks)], w[toks, slots]), e
            assert (rw[e, len(toks):] == 0).all(), e
        ref = xf * np.where(idx >= 0, w, 0).sum(axis=1, keepdims=True)
    else:
        n = int(d.num_recv_tokens)
        toks = np.nonzero(kept)[0]
        assert n == len(toks), (n, len(toks))
        rx = np.asarray(d.x).astype(np.float32)
        assert np.array_equal(rx[:n], xf[toks])
        ridx, rw = np.asarray(d.topk_idx), np.asarray(d.topk_weights)
        assert np.array_equal(ridx[:n], idx[toks])
        assert np.array_equal(rw[:n], np.where(idx[toks] >= 0, w[toks], 0))
        src = np.asarray(d.src_info)
        assert np.array_equal(src[:n], np.stack([np.zeros_like(toks), toks], axis=1))
        assert (ridx[n:] == -1).all() and (rw[n:] == 0).all() and (src[n:] == -1).all()
        ref = np.where(kept[:, None], xf, 0)
    got = np.asarray(y).astype(np.float32)
    assert np.allclose(got, ref, rtol=2e-2, atol=2e-2), np.abs(got - ref).max()


def jax_counts(seed: int) -> dict:
    import jax
    import jax.numpy as jnp
    import symheap.jax as shj
    from symheap import _core
    shj.init(jax.devices()[:1])
    rng = np.random.default_rng(seed)
    out = {}
    try:
        for layout in LAYOUTS:
            op = shj.EpDispatchCombine(config(layout))
            job, op_id = op._key
            dispatch = jax.jit(lambda x, i, w: op.dispatch(x, i, w))
            combine = jax.jit(lambda rows, h: op.combine(rows, h))
            ops = {}
            for drops in (False, True):
                x = rng.standard_normal((TOKENS, HIDDEN), dtype=np.float32).astype(jnp.bfloat16)
                idx, w = routing(rng, drops)
                c0 = _core.ep_device_ops(job, 0, op_id)
                d = jax.block_until_ready(dispatch(x, idx, w))
                c1 = _core.ep_device_ops(job, 0, op_id)
                y = jax.block_until_ready(combine(d.x, d.handle))
                c2 = _core.ep_device_ops(job, 0, op_id)
                check_jax(layout, np.asarray(x), idx, w, d, y)
                ops = {"dispatch": delta(c1, c0), "combine": delta(c2, c1)}
            out[layout] = ops
            op.close()
    finally:
        shj.finalize()
    return out


def shard_map_counts(seed: int, n: int) -> dict:
    """Every local device a PE (n of them, one process), dispatch then combine under
    shard_map: each PE's device operations per call, and combine(dispatch(x).x) checked
    (token-major: each token's row once per PE it reached; expert-major: weighted)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P
    import symheap.jax as shj
    from symheap import _core
    shj.init(jax.devices()[:n])
    mesh = shj.make_mesh("pe")
    sharded = NamedSharding(mesh, P("pe"))
    rng = np.random.default_rng(seed)

    def smap(f):
        if hasattr(jax, "shard_map"):
            return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("pe"), out_specs=P("pe"),
                                         check_vma=False))
        from jax.experimental.shard_map import shard_map
        return jax.jit(shard_map(f, mesh=mesh, in_specs=P("pe"), out_specs=P("pe"),
                                 check_rep=False))

    out = {}
    try:
        for layout in LAYOUTS:
            op = shj.EpDispatchCombine(config(layout, n))
            job, op_id = op._key

            def rows_and_handle(x, i, w, op=op):
                d = op.dispatch(x, i, w)
                return d.x, d.handle

            dispatch = smap(rows_and_handle)
            combine = smap(lambda rows, h, op=op: op.combine(rows, h))
            x = rng.standard_normal((n * TOKENS, HIDDEN), dtype=np.float32).astype(jnp.bfloat16)
            routes = [routing(rng, drops=True) for _ in range(n)]
            idx = np.concatenate([r[0] for r in routes])
            w = np.concatenate([r[1] for r in routes])
            args = [jax.device_put(a, sharded) for a in (x, idx, w)]
            jax.block_until_ready(combine(*dispatch(*args)))  # (compiled before counting)
            counts = lambda: [_core.ep_device_ops(job, pe, op_id) for pe in range(n)]  # noqa
            c0 = counts()
            rows, handle = jax.block_until_ready(dispatch(*args))
            c1 = counts()
            y = jax.block_until_ready(combine(rows, handle))
            c2 = counts()
            xf = np.asarray(x).astype(np.float32)
            if layout == "expert_major":
                ref = xf * np.where(idx >= 0, w, 0).sum(axis=1, keepdims=True)
            else:
                L = EXPERTS // n
                reached = [(np.where(idx >= 0, idx // L, -1) == pe).any(axis=1) for pe in range(n)]
                ref = xf * np.sum(reached, axis=0)[:, None]
            got = np.asarray(y).astype(np.float32)
            assert np.allclose(got, ref, rtol=2e-2, atol=5e-2), (layout, np.abs(got - ref).max())
            out[layout] = [{"dispatch": delta(c1[pe], c0[pe]), "combine": delta(c2[pe], c1[pe])}
                           for pe in range(n)]
            op.close()
    finally:
        shj.finalize()
    return out


def torch_counts() -> dict:
    """One PE of symheap.testing.run_processes: the torch front end's counts."""
    import torch
    from symheap import _core
    from symheap._runtime import current_pe
    from symheap.ep import EpDispatchCombine
    pe = current_pe()
    g = torch.Generator().manual_seed(7)
    out = {}
    for layout in LAYOUTS:
        with EpDispatchCombine(config(layout)) as ep:
            x = torch.randn(TOKENS, HIDDEN, generator=g).to(torch.bfloat16)
            idx = torch.argsort(torch.rand(TOKENS, EXPERTS, generator=g), dim=1)[:, :TOPK]
            w = torch.rand(TOKENS, TOPK, generator=g)
            c0 = _core.ep_device_ops(pe.job, pe.rank, ep._op.id)
            d = ep.dispatch(x, idx, w)
            c1 = _core.ep_device_ops(pe.job, pe.rank, ep._op.id)
            ep.combine(d.x, d.handle)
            c2 = _core.ep_device_ops(pe.job, pe.rank, ep._op.id)
            ep.check()
            out[layout] = {"dispatch": delta(c1, c0), "combine": delta(c2, c1)}
    return out


if __name__ == "__main__":
    args = json.loads(sys.argv[2])
    if sys.argv[1] == "jax":
        print("COUNTS " + json.dumps(jax_counts(args["seed"])))
    elif sys.argv[1] == "shard_map":
        print("COUNTS " + json.dumps(shard_map_counts(args["seed"], args["n"])))
    print("OK device ops")
