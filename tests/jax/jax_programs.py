"""Programs of the symheap.jax tests, each run in its own process so that
XLA_FLAGS (the number of cpu devices) applies: python jax_programs.py NAME JSON.
Prints "OK <detail>" on success; any failure is an exception (non-zero exit)."""
from __future__ import annotations

import json
import os
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import symheap.jax as shj  # noqa: E402
from symheap.ep import EpConfig  # noqa: E402

import jax_ep_reference as ref  # noqa: E402

HEAP = "32M"


def shard_map(f, mesh, in_specs, out_specs):
    """shj.shard_map (the mesh checked against PE order), replication checks off."""
    check = {"check_vma": False} if hasattr(jax, "shard_map") else {"check_rep": False}
    return shj.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, **check)


def on_threads(fn, n):
    """fn(i) on one thread per device; re-raises the first failure."""
    results, errors = [None] * n, [None] * n

    def run(i):
        try:
            results[i] = fn(i)
        except BaseException as e:
            errors[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a device thread hung"
    for e in errors:
        if e is not None:
            raise e
    return results


def raises(fn, exc, text):
    """fn() must raise exc with `text` in its message; returns the message."""
    try:
        fn()
    except exc as e:
        assert text in str(e), f"{text!r} not in {e}"
        return str(e)
    raise AssertionError(f"no {exc.__name__} ({text})")


# ------------------------------------------------------------ EP step

def expert(cfg: EpConfig, n_pes: int, d):
    """The test's experts: local expert l scales its rows by 1 + l / 4; token-major rows
    come back already weighted by the token's local top-k weights."""
    L = cfg.num_experts // n_pes
    x = d.x.astype(jnp.float32)
    f = 1.0 + jnp.arange(L, dtype=jnp.float32) / 4.0
    if cfg.layout == "expert_major":
        y = x * f[:, None, None]
    else:
        coef = jnp.sum(jnp.where(d.topk_idx >= 0,
                                 d.topk_weights * f[jnp.maximum(d.topk_idx, 0)], 0.0), axis=1)
        y = x * coef[:, None]
    return y.astype(cfg.combine_dtype)


def make_step(op, cfg, n_pes, grad=True):
    """dispatch -> experts -> combine, and d(sum(out * r))/d(x, topk_weights) through both
    custom_vjps (grad=False: the forward only, gx None)."""
    def step(x, idx, w, r, scales=None):
        def loss(x, w):
            d = op.dispatch(x, idx, w, scales)
            out = op.combine(expert(cfg, n_pes, d), d.handle)
            return jnp.sum(out.astype(jnp.float32) * r), (d, out)
        if grad:
            (_, (d, out)), gx = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x, w)
        else:
            (_, (d, out)), gx = loss(x, w), None
        fields = dict(x=d.x, topk_idx=d.topk_idx, topk_weights=d.topk_weights,
                      num_recv_tokens=d.num_recv_tokens, src_info=d.src_info,
                      expert_counts=d.expert_counts, scales=d.scales)
        return {k: v for k, v in fields.items() if v is not None}, out, gx
    return step


def pe_inputs(cfg, n_pes, seed):
    inputs = [ref.make_inputs(cfg, n_pes, s, seed) for s in range(n_pes)]
    dt = jnp.dtype(cfg.dtype)
    xs = [jnp.asarray(x, dt) for x, _, _ in inputs]
    rs = [np.random.default_rng([seed, 99, s]).standard_normal(
        (cfg.max_tokens_per_rank, cfg.hidden), dtype=np.float32) for s in range(n_pes)]
    return inputs, xs, rs


def check_pe(cfg, n_pes, me, inputs, xs, rs, d, out, gx):
    xs_cast = [ref.to_f32(x) for x in xs]
    ref.check_dispatch(cfg, n_pes, me, inputs, {k: np.asarray(v) for k, v in d.items()}, xs_cast)
    check_combine(cfg, n_pes, me, inputs, xs, rs, out, gx)


def check_combine(cfg, n_pes, me, inputs, xs, rs, out, gx):
    """PE me's combine output, and (unless gx is None) d(sum(out * r))/d(x, topk_weights),
    against the single-PE fp32 reference."""
    xs_cast = [ref.to_f32(x) for x in xs]
    want, factor = ref.combine_reference(cfg, n_pes, inputs[me], xs_cast[me])
    tol = 2e-2 if cfg.combine_dtype != "float32" else 1e-5
    np.testing.assert_allclose(ref.to_f32(out), want, rtol=tol, atol=tol)
    if gx is None:
        return
    gx, gw = gx
    # single-PE reference of the gradients: out[t] = x[t] * sum_k w[t, k] * f(expert k)
    _, idx, w = inputs[me]
    f = np.array([[ref.expert_factor(cfg, n_pes, e) if e >= 0 else 0.0 for e in row]
                  for row in idx], np.float32).reshape(idx.shape)

    def single_pe(x, w):
        return jnp.sum(x * jnp.sum(w * f, axis=1, keepdims=True) * rs[me])

    want_x, want_w = jax.grad(single_pe, argnums=(0, 1))(jnp.asarray(xs_cast[me]), jnp.asarray(w))
    np.testing.assert_allclose(ref.to_f32(gx), np.asarray(want_x), rtol=tol, atol=tol)
    scale = float(np.abs(np.asarray(want_w)).max()) + 1.0  # bf16 transport of the sums
    np.testing.assert_allclose(np.asarray(gw), np.asarray(want_w), rtol=tol, atol=tol * scale)


CONFIGS = {
    "token_slots": dict(layout="token_slots"),
    "expert_major": dict(layout="expert_major"),
    "low_latency": dict(kernel="low_latency"),
    "intranode": dict(kernel="intranode", max_recv_tokens=None),  # max_recv_tokens set below
    "fp8": dict(layout="token_slots", dtype="float8_e4m3fn", scale_dim=8),  # forward only
    "fp8_low_latency": dict(kernel="low_latency", dtype="float8_e4m3fn", scale_dim=8),
}


def config(n_pes, name, dtype="bfloat16", tokens=6):
    kw = dict(CONFIGS[name])
    if name == "intranode":
        kw["max_recv_tokens"] = n_pes * tokens
    kw.setdefault("dtype", dtype)
    return EpConfig(hidden=32, max_tokens_per_rank=tokens, num_experts=2 * n_pes, topk=3, **kw)


# ------------------------------------------------------------ programs

def threads(n, layouts, seed, iters=2, grad=True, tokens=6, heap_size=HEAP):
    """One Python thread per device, each jitting on its own device."""
    devs = jax.devices()[:n]
    shj.init(devs, heap_size=heap_size, timeout=20)
    try:
        for name in layouts:
            cfg = config(n, name, dtype="float32" if name == "intranode" else "bfloat16",
                         tokens=tokens)
            op = shj.EpDispatchCombine(cfg)
            step = jax.jit(make_step(op, cfg, n, grad and not cfg.scale_dim))
            for it in range(iters):
                inputs, xs, rs = pe_inputs(cfg, n, seed + it)

                def run(i):
                    put = lambda a: jax.device_put(a, devs[i])  # noqa: E731
                    scales = put(ref.scales_of(cfg, i)) if cfg.scale_dim else None
                    return step(put(xs[i]), put(inputs[i][1]), put(inputs[i][2]), put(rs[i]),
                                scales)

                got = on_threads(run, n)
                for i, (d, out, gx) in enumerate(got):
                    check_pe(cfg, n, i, inputs, xs, rs, d, out, gx)
            op.close()
        tok = on_threads(lambda i: np.asarray(jax.jit(shj.barrier)(
            jax.device_put(jnp.full((2,), i, jnp.int32), devs[i]))), n)
        assert [t.tolist() for t in tok] == [[i, i] for i in range(n)]
    finally:
        shj.finalize()
    print("OK threads", n, layouts)


def stacked(per_pe):
    return np.concatenate([np.asarray(a)[None] for a in per_pe])


def shard_map_ep(n, layouts, seed, grad=True, tokens=6, heap_size=HEAP):
    """One jit over a mesh of the first n devices in PE order, shard_map over the PE axis."""
    shj.init(jax.devices()[:n], heap_size=heap_size, timeout=20)
    try:
        mesh = shj.make_mesh("pe")
        for name in layouts:
            cfg = config(n, name, tokens=tokens)
            op = shj.EpDispatchCombine(cfg)
            step = make_step(op, cfg, n, grad)

            def body(x, idx, w, r):
                d, out, gx = step(x[0], idx[0], w[0], r[0])
                return jax.tree_util.tree_map(lambda a: a[None], (d, out, gx))  # None stays

            f = jax.jit(shard_map(body, mesh, in_specs=P("pe"), out_specs=P("pe")))
            inputs, xs, rs = pe_inputs(cfg, n, seed)
            sh = NamedSharding(mesh, P("pe"))
            args = [jax.device_put(stacked(a), sh) for a in
                    (xs, [i[1] for i in inputs], [i[2] for i in inputs], rs)]
            d, out, gx = f(*args)
            for i in range(n):
                check_pe(cfg, n, i, inputs, xs, rs, {k: v[i] for k, v in d.items()}, out[i],
                         None if gx is None else (gx[0][i], gx[1][i]))
            op.close()
            print("OK shard_map", name, flush=True)
        # the barrier inside shard_map, on every device at once
        tok = jax.jit(shard_map(lambda t: shj.barrier(t), mesh, P("pe"), P("pe")))(
            jax.device_put(np.arange(n, dtype=np.int32), NamedSharding(mesh, P("pe"))))
        assert np.asarray(tok).tolist() == list(range(n))
        # a mesh whose device order is not PE rank order is refused
        from jax.sharding import Mesh
        permuted = Mesh(np.array(mesh.devices[::-1]), ("pe",))
        try:
            shard_map(lambda t: shj.barrier(t), permuted, P("pe"), P("pe"))
        except ValueError as e:
            assert "not in PE rank order" in str(e), e
        else:
            raise AssertionError("a permuted mesh was accepted")
    finally:
        shj.finalize()
    print("OK shard_map", n, layouts)


# (layout, dispatches) of each op, created in turn (each closed before the next): every
# op's first dispatch runs at the epoch where the previous op's words ended, on the heap
# range that op had, except after the two-call op (a control: its words carry epoch 2).
IN_TURN = [("intranode", 1), ("low_latency", 1), ("intranode", 1), ("intranode", 1),
           ("expert_major", 1), ("expert_major", 1), ("low_latency", 2), ("intranode", 1)]


def ops_in_turn(n, seed, tokens=1500, sequence=IN_TURN, heap_size=HEAP):
    """EP ops created one after another in one process, each dispatch and combine a
    shard_map over the PE axis. Prints every PE's receive counts against the reference
    for every dispatch (all of them, even after a wrong one), then raises if any was
    wrong or any check failed."""
    shj.init(jax.devices()[:n], heap_size=heap_size, timeout=20)
    wrong, offsets = [], []
    try:
        mesh = shj.make_mesh("pe")
        sh = NamedSharding(mesh, P("pe"))
        for k, (name, calls) in enumerate(sequence):
            cfg = config(n, name, tokens=tokens)
            op = shj.EpDispatchCombine(cfg)
            offsets.append(op._bufs[0].offset)
            em = cfg.layout == "expert_major"

            def dispatch_body(x, idx, w):
                d = op.dispatch(x[0], idx[0], w[0])
                return jax.tree_util.tree_map(lambda a: a[None], d)

            def combine_body(d):
                d = jax.tree_util.tree_map(lambda a: a[0], d)
                return op.combine(expert(cfg, n, d), d.handle)[None]

            f_dispatch = jax.jit(shard_map(dispatch_body, mesh, P("pe"), P("pe")))
            f_combine = jax.jit(shard_map(combine_body, mesh, P("pe"), P("pe")))
            try:
                for c in range(calls):
                    inputs, xs, rs = pe_inputs(cfg, n, seed + 10 * k + c)
                    args = [jax.device_put(stacked(a), sh) for a in
                            (xs, [i[1] for i in inputs], [i[2] for i in inputs])]
                    d = f_dispatch(*args)
                    right = True
                    for i in range(n):
                        rows = ref.rows_of(cfg, n, i, inputs)
                        want = [len(r) for _, r in sorted(rows.items())] if em else len(rows)
                        got = (np.asarray(d.expert_counts[i]).tolist() if em
                               else int(d.num_recv_tokens[i]))
                        print(f"op {k} {name} call {c} at heap offset {offsets[-1]}: PE {i} "
                              f"{'expert_counts' if em else 'num_recv_tokens'} {got}, want "
                              f"{want}", flush=True)
                        if got != want:
                            right = False
                            wrong.append((k, name, c, i, got, want))
                    if not right:
                        continue  # combine would refuse the handle's rows
                    out = f_combine(d)
                    fields = dict(x=d.x, topk_idx=d.topk_idx, topk_weights=d.topk_weights,
                                  num_recv_tokens=d.num_recv_tokens, src_info=d.src_info,
                                  expert_counts=d.expert_counts)
                    for i in range(n):
                        check_pe(cfg, n, i, inputs, xs, rs,
                                 {f: v[i] for f, v in fields.items() if v is not None}, out[i],
                                 None)
            finally:
                op.close()
    finally:
        shj.finalize()
    assert not wrong, f"wrong receive counts (op, layout, call, PE, got, want): {wrong}"
    print("OK ops_in_turn", n, tokens, "heap offsets", offsets)


def _handler_calls():
    """Calls of the EP execute handlers (not of their initialize stage) since the clocks
    were first read; the first read starts them."""
    from symheap import _core
    return sum(c for name, (c, _) in _core.xla_ep_handler_clocks().items()
               if name != "initialize")


def replayed_chain(n, seed, layouts=("low_latency", "intranode"), pairs=8, runs=5,
                   tokens=6, replayed=False):
    """One shard_map program of `pairs` dependent pairs (each dispatch sends the rows the
    last combine returned; identity experts, so a pair multiplies a token's row by the
    number of PEs it went to, 1 or 2 here: exact in bf16), run `runs` times: every run
    exact. With `replayed` (XLA's command buffers on a GPU) the last runs are graph
    replays that call no handler; else every run calls each handler once per PE. Then the
    cached program of a closed op, and of a finalized runtime, raise."""
    assert n <= 2, "the exact reference needs destination counts that are powers of two"
    shj.init(jax.devices()[:n], heap_size=HEAP, timeout=20)
    mesh = shj.make_mesh("pe")
    sh = NamedSharding(mesh, P("pe"))
    try:
        for name in layouts:
            cfg = config(n, name, tokens=tokens)
            op = shj.EpDispatchCombine(cfg)

            def chain(x, idx, w):
                for _ in range(pairs):
                    d = op.dispatch(x, idx, w)
                    x = op.combine(d.x, d.handle)
                return x

            f = jax.jit(shard_map(chain, mesh, P("pe"), P("pe")))
            inputs, xs, _ = pe_inputs(cfg, n, seed)
            local = cfg.num_experts // n
            want = []
            for (_, idx, _), x in zip(inputs, xs):
                dests = np.array([len({e // local for e in row if e >= 0}) for row in idx],
                                 np.float32)
                want.append(ref.to_f32(x) * dests[:, None] ** pairs)
            want = np.concatenate(want)
            args = [jax.device_put(np.concatenate(a), sh) for a in
                    ([np.asarray(x) for x in xs], [i[1] for i in inputs], [i[2] for i in inputs])]
            per_run = _runs_of(f, args, want, runs, pairs * n, replayed)
            op.check()  # nothing recorded: returns
            last = name == layouts[-1]
            if not last:
                op.close()
                raises(op.check, Exception, "closed")
                msg = raises(lambda: jax.block_until_ready(f(*args)), Exception, "was closed")
                print("OK replayed_chain", name, "handler calls per run", per_run, "closed:",
                      msg[:80], flush=True)
    finally:
        shj.finalize()
    # the last layout's program, replayed up to here: its initialize stage refuses
    raises(lambda: jax.block_until_ready(f(*args)), Exception, "hosts no symheap PE")
    print("OK replayed_chain", n, layouts, "last handler calls per run", per_run)


def _runs_of(f, args, want, runs, calls_per_handler, replayed):
    """Runs f(*args) `runs` times, each exact; returns the handler calls of each run."""
    per_run = []
    for _ in range(runs):
        before = _handler_calls()
        np.testing.assert_array_equal(ref.to_f32(f(*args)), want)
        per_run.append(_handler_calls() - before)
    if replayed:
        assert per_run[-2:] == [0, 0], ("XLA called the handlers at every run: not replayed "
                                        "from its command buffers", per_run)
    else:
        assert per_run == [2 * calls_per_handler] * runs, per_run
    return per_run


PROGRAMS = {"threads": threads, "shard_map_ep": shard_map_ep, "ops_in_turn": ops_in_turn,
            "replayed_chain": replayed_chain}



# ------------------------------------------------------------ gradients

def placements(cfg, n_pes, me, inputs):
    """Reference placement of PE ``me``'s received rows: {row index: (src PE, token,
    slot)}, the row index a tuple into the padded outputs (token-major: slot None)."""
    rows = ref.rows_of(cfg, n_pes, me, inputs)
    if cfg.layout == "expert_major":
        return {(l, i): st for l, run in rows.items() for i, st in enumerate(run)}
    M = cfg.max_tokens_per_rank
    if cfg.layout == "token_slots":
        return {(s * M + t,): (s, t, None) for s, t in rows}
    return {(i,): (s, t, None) for i, (s, t) in enumerate(rows)}


def dispatch_grad_step(op, cfg):
    """d/d(x, topk_weights) of sum(rows * r) + sum(row weights * q) over dispatch alone
    (its custom_vjp: combines of the row gradients), stale rows masked out."""
    em = cfg.layout == "expert_major"

    def loss(x, idx, w, r, q):
        d = op.dispatch(x, idx, w)
        if em:
            valid = jnp.arange(d.x.shape[1])[None, :] < d.expert_counts[:, None]
            vw = valid
        elif cfg.layout == "token_slots":
            valid = vw = d.src_info[:, 0] >= 0
        else:
            valid = vw = jnp.arange(d.x.shape[0]) < d.num_recv_tokens
        if not em:
            vw = vw[:, None] & (d.topk_idx >= 0)
        rows = jnp.where(valid[..., None], d.x.astype(jnp.float32) * r, 0.0)
        return jnp.sum(rows) + jnp.sum(jnp.where(vw, d.topk_weights * q, 0.0))

    return jax.jit(jax.grad(loss, argnums=(0, 2)))


def check_dispatch_grads(cfg, n, inputs, places, rs, qs, got):
    """PE s's gradients: every row its token became brings back that row's r, and every
    (token, local slot) its weight's q."""
    L, em = cfg.num_experts // n, cfg.layout == "expert_major"
    tol = 2e-2 if cfg.dtype != "float32" else 1e-5
    for s in range(n):
        _, idx, w = inputs[s]
        want_x, want_w = np.zeros((idx.shape[0], cfg.hidden), np.float32), np.zeros_like(w)
        for dst in range(n):
            for row, (src, t, k) in places[dst].items():
                if src != s:
                    continue
                want_x[t] += rs[dst][row]
                if em:
                    want_w[t, k] += qs[dst][row]
                else:
                    local = (idx[t] >= 0) & (idx[t] // L == dst)
                    want_w[t] += np.where(local, qs[dst][row], 0.0)
        gx, gw = got[s]
        np.testing.assert_allclose(ref.to_f32(gx), want_x, rtol=tol, atol=tol)
        np.testing.assert_allclose(np.asarray(gw), want_w, rtol=tol, atol=tol)


def combine_grad_step(op, cfg, n_pes):
    """make_step's loss, plus the gradient of expert_out (through a zero added to it)."""
    em = cfg.layout == "expert_major"
    rows = (op.num_local_experts, op.recv_capacity) if em else (op.recv_capacity,)

    def step(x, idx, w, r):
        def loss(x, w, delta):
            d = op.dispatch(x, idx, w)
            out = op.combine(expert(cfg, n_pes, d) + delta, d.handle)
            return jnp.sum(out.astype(jnp.float32) * r), out
        delta = jnp.zeros(rows + (cfg.hidden,), jnp.dtype(cfg.combine_dtype))
        (_, out), (gx, gw, geo) = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(
            x, w, delta)
        return out, gx, gw, geo
    return jax.jit(step)


def check_expert_out_grad(cfg, inputs, places_me, rs, geo):
    """d loss / d expert_out row by row: the source token's output weight r (expert-major:
    times the slot's top-k weight, which combine applies); zero on rows no token filled."""
    tol = 2e-2 if cfg.combine_dtype != "float32" else 1e-5
    geo = ref.to_f32(geo)
    want = np.zeros_like(geo)
    for row, (s, t, k) in places_me.items():
        want[row] = rs[s][t] * (inputs[s][2][t, k] if k is not None else 1.0)
    np.testing.assert_allclose(geo, want, rtol=tol, atol=tol)


def poison_receive_buffers(op, cfg, n, devs):
    """A dispatch that fills the op's receive rows with large values (every token goes to
    topk PEs in turn), so rows a later dispatch leaves unfilled hold stale data, as they
    do on a GPU: gradients must not read them."""
    M, L, E = cfg.max_tokens_per_rank, cfg.num_experts // n, cfg.num_experts
    idx = np.array([[((t + j) % n) * L + (t + j // n) % L for j in range(cfg.topk)]
                    for t in range(M)], np.int32) % E
    x = jnp.full((M, cfg.hidden), 64.0, jnp.dtype(cfg.dtype))
    w = np.full((M, cfg.topk), 8.0, np.float32)
    f = jax.jit(lambda x, idx, w: op.dispatch(x, idx, w).x)
    on_threads(lambda i: jax.block_until_ready(
        f(*[jax.device_put(a, devs[i]) for a in (x, idx, w)])), n)


def gradients(n, layouts, seed):
    """The gradients of dispatch and combine on one thread per device, every layout:
    dispatch's alone against a reference built from the routing; combine's (a
    redispatch of the output gradient through the forward's handle) against the
    single-PE fp32 reference, row by row for expert_out and through both custom_vjps
    for (x, topk_weights). The receive rows hold stale data before each step."""
    devs = jax.devices()[:n]
    shj.init(devs, heap_size=HEAP, timeout=20)
    try:
        for name in layouts:
            cfg = config(n, name, dtype="float32" if name == "intranode" else "bfloat16")
            op = shj.EpDispatchCombine(cfg)
            inputs, xs, rs = pe_inputs(cfg, n, seed)
            places = [placements(cfg, n, i, inputs) for i in range(n)]
            put = lambda i, a: jax.device_put(a, devs[i])  # noqa: E731
            rng = np.random.default_rng([seed, 5])
            shape = ((op.num_local_experts, op.recv_capacity) if cfg.layout == "expert_major"
                     else (op.recv_capacity,))
            r_rows = [rng.standard_normal(shape + (cfg.hidden,), dtype=np.float32)
                      for _ in range(n)]
            q_rows = [rng.standard_normal(shape + (() if cfg.layout == "expert_major"
                                                   else (cfg.topk,)), dtype=np.float32)
                      for _ in range(n)]
            dgrad = dispatch_grad_step(op, cfg)
            got = on_threads(lambda i: dgrad(put(i, xs[i]), put(i, inputs[i][1]),
                                             put(i, inputs[i][2]), put(i, r_rows[i]),
                                             put(i, q_rows[i])), n)
            check_dispatch_grads(cfg, n, inputs, places, r_rows, q_rows, got)
            step = combine_grad_step(op, cfg, n)
            for _ in range(2):  # the second step: redispatch after the first's calls
                poison_receive_buffers(op, cfg, n, devs)
                res = on_threads(lambda i: step(put(i, xs[i]), put(i, inputs[i][1]),
                                                put(i, inputs[i][2]), put(i, rs[i])), n)
                res = [jax.tree_util.tree_map(np.asarray, r) for r in res]
                for i, (out, gx, gw, geo) in enumerate(res):
                    check_combine(cfg, n, i, inputs, xs, rs, out, (gx, gw))
                    check_expert_out_grad(cfg, inputs, places[i], rs, geo)
            print("OK", name, "combine gradient by redispatch", flush=True)
            op.close()
    finally:
        shj.finalize()
    print("OK gradients", n, layouts)


def distributed(process_id, n_processes, port, seed, bad_config=False,
                layouts=("expert_major",), tokens=6, threads_step=True, grad=True):
    """jax.distributed on 127.0.0.1: every process's local devices become PEs; one
    thread per local device, then one shard_map over the global mesh, per layout
    (threads_step=False: the shard_map step alone, one dispatch per op; grad=False:
    forward only)."""
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=n_processes,
                               process_id=process_id, initialization_timeout=60)
    shj.init(heap_size=HEAP, timeout=20)
    try:
        n, local = shj.num_pes(), jax.local_devices()
        assert n == len(jax.devices()), (n, len(jax.devices()))
        ranks = [shj.rank_of(d) for d in local]
        assert ranks == list(range(process_id * len(local), (process_id + 1) * len(local))), ranks
        if bad_config:  # process 1 disagrees on topk: every process must raise
            cfg = config(n, "token_slots")
            if process_id == 1:
                cfg = EpConfig(**{**cfg.__dict__, "topk": 2})
            try:
                shj.EpDispatchCombine(cfg)
            except ValueError as e:
                assert "different arguments" in str(e), e
                print("OK bad config raised:", str(e)[:80])
                return
            raise AssertionError("a mismatched EpConfig was accepted")
        tok = on_threads(lambda i: np.asarray(jax.jit(shj.barrier)(
            jax.device_put(jnp.zeros((1,), jnp.float32), local[i]))), len(local))
        assert all(t.tolist() == [0.0] for t in tok)
        for name in layouts:
            _distributed_ep(config(n, name, tokens=tokens), n, local, ranks, seed, threads_step,
                            grad)
    finally:
        shj.finalize()
    print("OK distributed", process_id, ranks)


def _distributed_ep(cfg, n, local, ranks, seed, threads_step=True, grad=True):
    """One layout under jax.distributed: one thread per local device (unless not
    threads_step), then one shard_map over the global mesh."""
    op = shj.EpDispatchCombine(cfg)
    grad = grad and not cfg.scale_dim  # fp8: forward only
    scales = [ref.scales_of(cfg, r) for r in range(n)] if cfg.scale_dim else []
    if threads_step:
        step = jax.jit(make_step(op, cfg, n, grad))
        inputs, xs, rs = pe_inputs(cfg, n, seed)

        def run(i):
            put = lambda a: jax.device_put(a, local[i])  # noqa: E731
            r = ranks[i]
            return step(put(xs[r]), put(inputs[r][1]), put(inputs[r][2]), put(rs[r]),
                        *[put(scales[r])] if scales else [])

        for i, (d, out, gx) in enumerate(on_threads(run, len(local))):
            check_pe(cfg, n, ranks[i], inputs, xs, rs, d, out, gx)

    # one jit over the global mesh of both processes, shard_map over the PE axis
    mesh = shj.make_mesh("pe")
    inputs, xs, rs = pe_inputs(cfg, n, seed + 1)
    sh = NamedSharding(mesh, P("pe"))

    def global_array(per_pe):
        full = stacked(per_pe)
        return jax.make_array_from_callback(full.shape, sh, lambda index: full[index])

    def body(x, idx, w, r, *sc):
        return jax.tree_util.tree_map(lambda a: a[None], make_step(op, cfg, n, grad)(
            x[0], idx[0], w[0], r[0], *[s[0] for s in sc]))

    f = jax.jit(shard_map(body, mesh, P("pe"), P("pe")))
    d, out, gx = f(*[global_array(a) for a in
                     (xs, [i[1] for i in inputs], [i[2] for i in inputs], rs)
                     + ((scales,) if scales else ())])

    def local_rows(a):
        return {s.index[0].start: np.asarray(s.data)[0] for s in a.addressable_shards}

    d = {k: local_rows(v) for k, v in d.items()}
    out = local_rows(out)
    gx, gw = (local_rows(gx[0]), local_rows(gx[1])) if grad else (None, None)
    assert sorted(out) == ranks, (sorted(out), ranks)
    for r in ranks:
        check_pe(cfg, n, r, inputs, xs, rs, {k: v[r] for k, v in d.items()}, out[r],
                 (gx[r], gw[r]) if grad else None)
    op.close()
    print("OK", cfg.layout, cfg.kernel, flush=True)


def failures(seed):
    """Clean errors: bad shapes and dtypes at trace time, a bad handle inside the handler
    (aborted on every PE), a closed op and a finalized runtime in cached executables,
    and one thread driving every device (a timeout, not a hang)."""
    n = 2
    devs = jax.devices()[:n]
    shj.init(devs, heap_size=HEAP, timeout=3)
    cfg = config(n, "token_slots")
    op = shj.EpDispatchCombine(cfg)
    inputs, xs, rs = pe_inputs(cfg, n, seed)
    x, idx, w = xs[0], inputs[0][1], inputs[0][2]

    raises(lambda: op.dispatch(x[:, :16], idx, w), ValueError, "x must have shape")
    raises(lambda: op.dispatch(x.astype(jnp.float32), idx, w), ValueError, "x must have dtype")
    raises(lambda: op.dispatch(x, idx.astype(np.float32), w), ValueError,
           "topk_idx must have dtype")
    raises(lambda: op.dispatch(x, idx[:, :2], w), ValueError, "topk_idx must have shape")
    raises(lambda: op.dispatch(x, idx, w.astype(np.float16)), ValueError, "topk_weights must")
    raises(lambda: op.dispatch(x, idx, w, scales=w), ValueError, "scale_dim=0")
    big = jnp.zeros((cfg.max_tokens_per_rank + 1, cfg.hidden), jnp.bfloat16)
    raises(lambda: op.dispatch(big, idx, w), ValueError, "max_tokens_per_rank")
    raises(lambda: shj.EpDispatchCombine(EpConfig(hidden=32, max_tokens_per_rank=6,
                                                  num_experts=4, topk=2)),
           ValueError, "fixed shapes")
    raises(lambda: shj.EpDispatchCombine(EpConfig(hidden=32, max_tokens_per_rank=6, num_experts=4,
                                                  topk=2, kernel="copy_engine",
                                                  layout="expert_major")),
           ValueError, "copy_engine")

    # PE 0 hands combine a handle whose summary has the wrong length: the handler
    # refuses it and every PE's combine is aborted together (no hang).
    errors = []

    def run_bad(i):
        try:
            f = jax.jit(lambda x, idx, w: _combine_bad_body(op, i, x, idx, w))
            jax.block_until_ready(f(jax.device_put(xs[i], devs[i]),
                                    jax.device_put(inputs[i][1], devs[i]),
                                    jax.device_put(inputs[i][2], devs[i])))
        except Exception as e:
            errors.append((i, str(e)))

    on_threads(run_bad, n)
    errors.sort()
    assert len(errors) == 2, errors
    assert "handle.summary must have shape" in errors[0][1], errors[0]
    assert "aborted on every PE" in errors[1][1], errors[1]

    # PE 0 edits its handle's row counts before a redispatch (combine's gradient):
    # the core refuses the rows it names, and every PE's call is aborted together.
    errors.clear()

    def run_edited(i):
        def body(x, idx, w):
            d = op.dispatch(x, idx, w)
            h = d.handle
            if i == 0:
                h = shj.EpHandle(h.send_rows, h.summary + (1 << 20), op_key=h.op_key,
                                 num_tokens=h.num_tokens)
            g = jnp.zeros((h.num_tokens, cfg.hidden), jnp.dtype(cfg.combine_dtype))
            return op._redispatch_call(g, h, d.x)
        try:
            jax.block_until_ready(jax.jit(body)(*[jax.device_put(a, devs[i]) for a in
                                                  (xs[i], inputs[i][1], inputs[i][2])]))
        except Exception as e:
            errors.append((i, str(e)))

    on_threads(run_edited, n)
    errors.sort()
    assert len(errors) == 2, errors
    assert "INVALID_ARGUMENT" in errors[0][1] and "aborted on every PE" in errors[0][1], errors
    assert "PE 0 passed a combine handle whose rows lie outside" in errors[1][1], errors

    # cached executables: a closed op, then a finalized runtime
    step = jax.jit(make_step(op, cfg, n))
    put = lambda i, a: jax.device_put(a, devs[i])  # noqa: E731
    on_threads(lambda i: jax.block_until_ready(
        step(put(i, xs[i]), put(i, inputs[i][1]), put(i, inputs[i][2]), put(i, rs[i]))), n)
    op.close()
    raises(lambda: op.dispatch(x, idx, w), Exception, "closed")
    msg = raises(lambda: jax.block_until_ready(
        step(put(0, xs[0]), put(0, inputs[0][1]), put(0, inputs[0][2]), put(0, rs[0]))),
        Exception, "was closed")
    op2 = shj.EpDispatchCombine(cfg)
    step2 = jax.jit(make_step(op2, cfg, n))
    on_threads(lambda i: jax.block_until_ready(
        step2(put(i, xs[i]), put(i, inputs[i][1]), put(i, inputs[i][2]), put(i, rs[i]))), n)
    bar = jax.jit(shj.barrier)
    on_threads(lambda i: jax.block_until_ready(bar(put(i, jnp.zeros(1)))), n)
    shj.finalize()
    raises(lambda: jax.block_until_ready(
        step2(put(0, xs[0]), put(0, inputs[0][1]), put(0, inputs[0][2]), put(0, rs[0]))),
        Exception, "hosts no symheap PE")
    raises(lambda: jax.block_until_ready(bar(put(0, jnp.zeros(1)))), Exception,
           "hosts no symheap PE")
    # init again: the old executable names an op of the earlier init
    shj.init(devs, heap_size=HEAP, timeout=2)
    raises(lambda: jax.block_until_ready(
        step2(put(0, xs[0]), put(0, inputs[0][1]), put(0, inputs[0][2]), put(0, rs[0]))),
        Exception, "earlier symheap.jax.init")
    # one Python thread driving both devices: the first call waits for a PE nobody
    # drives, and gives up with a timeout naming it
    t0 = time.time()
    msg = raises(lambda: [jax.block_until_ready(bar(put(i, jnp.zeros(1)))) for i in range(n)],
                 Exception, "timed out")
    assert time.time() - t0 < 30
    print("OK failures;", msg[:120])
    # PE 1 still sits in nothing; PE 0 gave up: finalize releases both
    shj.finalize()


def _combine_bad_body(op, i, x, idx, w):
    d = op.dispatch(x, idx, w)
    h = d.handle
    if i == 0:
        h = shj.EpHandle(h.send_rows, h.summary[:-1], op_key=h.op_key, num_tokens=h.num_tokens)
    return op._combine_call(d.x, h)


PROGRAMS.update(distributed=distributed, failures=failures, gradients=gradients)


if __name__ == "__main__":
    name, kwargs = sys.argv[1], json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    t0 = time.time()
    PROGRAMS[name](**kwargs)
    print(f"took {time.time() - t0:.1f} s")
