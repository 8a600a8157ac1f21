"""EP dispatch + combine inside jit (symheap.jax: shard_map over every GPU, and one
Python thread per GPU each running its own jit) against what JAX offers without it:
jax.lax.all_to_all of padded per-destination buffers inside shard_map (dispatch) and
the reverse all_to_all plus a sum (combine), in two forms: one row per (token,
destination PE), as symheap sends, and one row per (token, chosen expert), as a usual
JAX MoE layer sends. Every program's output is checked against numpy first.

DeepSeek-V3 shape: hidden 7168 bf16, top-8 of 256 experts; 4096 tokens per GPU
(kernel intranode, max_recv_tokens set) and 128 (kernel low_latency). Times are
per dispatch+combine pair, mean over back-to-back calls of one jitted program.

    python bench/jax_ep_bench.py [--iters 20] [--gpus N] [--parts] [--sizes 128:intranode,...]
    python bench/jax_ep_bench.py --smoke     # tiny shapes on the cpu platform (a check)

--parts adds, per size, both baselines as a pair within one call of 8 chained pairs, the
device operations one pair issues on each PE (kernel launches and any memset, copy, stream
wait or host sync; None on the cpu platform), and a `parts` line for each program shape:
dispatch alone (it returns the handle; the received rows stay inside the program), combine
alone (of one dispatch's rows and handle, again and again), the pair, and a pair within
one call of 8 chained pairs (per pair: what the device takes once per-call costs are
spread), each with the host time per call (the time to enqueue the calls, before waiting
for the device: a host time close to the total says the host, not the GPU, sets the pace)
and the mean host time of one symheap handler call (none where XLA replays its graphs; the
handlers' initialize stage, which XLA calls before every run, is not in it). The torch
reference for the chained pair is `python bench/ep_bench.py --cases 1,0 --chain`.
"""
from __future__ import annotations

import argparse
import os
import time

import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")

HIDDEN, EXPERTS, TOPK = (256, 16, 4) if SMOKE else (7168, 256, 8)
WARMUP_CALLS = 2 if SMOKE else 200  # back-to-back calls before each timing
CHAIN = 8  # --parts: pairs per call in the chained program (per-call host costs amortized)
CHAINED = f"pair in a chain of {CHAIN}"


def shard_map(f, mesh, in_specs, out_specs):
    import jax
    if hasattr(jax, "shard_map"):
        return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                             check_vma=False)
    from jax.experimental.shard_map import shard_map as legacy
    return legacy(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False)


def routing(n, tokens, seed=0):
    """Random top-k of distinct experts per token, per PE: [n, tokens, topk] int32."""
    import numpy as np
    rng = np.random.default_rng(seed)
    idx = np.argsort(rng.random((n, tokens, EXPERTS)), axis=-1)[..., :TOPK].astype(np.int32)
    w = rng.random((n, tokens, TOPK), dtype=np.float32)
    return idx, w


def time_it(f, args, iters, host=None):
    """Mean us per call of back-to-back calls; ``host`` (a list) gets the mean us
    per call spent enqueuing them."""
    import jax
    # Warm up with many calls, not one or two: after compiling, the GPU sits idle long
    # enough to drop its clocks, and the first milliseconds of calls run slower. (A
    # count, not a time: threads must make the same number of collective calls.)
    for _ in range(WARMUP_CALLS):
        out = f(*args)
    jax.block_until_ready(out)
    t0 = time.perf_counter()
    for _ in range(iters):
        out = f(*args)
    t1 = time.perf_counter()
    jax.block_until_ready(out)
    t2 = time.perf_counter()
    if host is not None:
        host.append((t1 - t0) / iters * 1e6)
    return (t2 - t0) / iters * 1e6


def per_device(*arrays):
    """[device][argument]: each argument's shards in device (PE) order."""
    def shards(a):
        return [s.data for s in sorted(a.addressable_shards, key=lambda s: s.index[0].start)]
    return [list(args) for args in zip(*[shards(a) for a in arrays])]


def time_threads(f, per_device_args, iters, host=None):
    """One thread per device, each timing f on its own arguments; the slowest thread's
    mean (and into ``host``, the slowest thread's enqueue time per call)."""
    import threading
    import jax
    n = len(per_device_args)
    times, hosts = [0.0] * n, [[] for _ in range(n)]
    start = threading.Barrier(n)

    def run(i):
        args = per_device_args[i]
        jax.block_until_ready(f(*args))
        start.wait()
        times[i] = time_it(f, args, iters, hosts[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if host is not None:
        host.append(max(h[0] for h in hosts))
    return max(times)


def handler_clock():
    """(calls, host seconds) of the symheap EP execute handlers since the first read (it
    starts the clocks), all threads (their initialize stage is counted apart)."""
    from symheap import _core
    clocks = [v for k, v in _core.xla_ep_handler_clocks().items() if k != "initialize"]
    return sum(c for c, _ in clocks), sum(t for _, t in clocks)


def handler_us(before):
    """Mean host us per handler call since ``before`` (a handler_clock()); None when
    no handler was called (every run a graph replay)."""
    calls, secs = handler_clock()
    return (secs - before[1]) / (calls - before[0]) * 1e6 if calls > before[0] else None


def time_parts(op, mesh, x, idx, w, iters):
    """Dispatch alone, combine alone and the pair, as shard_map and as one thread per
    device: {shape: [(name, total us, host us, handler us per call)]}."""
    import jax
    from jax.sharding import PartitionSpec as P

    def rows_and_handle(x, idx, w):
        d = op.dispatch(x, idx, w)
        return d.x, d.handle

    def dispatch(x, idx, w):  # the received rows stay inside the program (as in a model)
        return op.dispatch(x, idx, w).handle

    def combine(rows, handle):
        return op.combine(rows, handle)

    def pair(x, idx, w):
        d = op.dispatch(x, idx, w)
        return op.combine(d.x, d.handle)

    def chain(x, idx, w):  # CHAIN pairs in one call, each feeding the next
        for _ in range(CHAIN):
            x = pair(x, idx, w).astype(x.dtype)
        return x

    out = {}
    f_d = jax.jit(shard_map(dispatch, mesh, P("pe"), P("pe")))
    f_c = jax.jit(shard_map(combine, mesh, P("pe"), P("pe")))
    f_p = jax.jit(shard_map(pair, mesh, P("pe"), P("pe")))
    f_k = jax.jit(shard_map(chain, mesh, P("pe"), P("pe")))
    rows, handle = jax.jit(shard_map(rows_and_handle, mesh, P("pe"), P("pe")))(x, idx, w)
    res = []
    for name, f, args in (("dispatch", f_d, (x, idx, w)), ("combine", f_c, (rows, handle)),
                          ("pair", f_p, (x, idx, w)), (CHAINED, f_k, (x, idx, w))):
        host, clock = [], handler_clock()
        res.append((name, time_it(f, args, iters, host), host[0], handler_us(clock)))
    out["shard_map"] = res
    inputs = per_device(x, idx, w)
    j_d, j_c, j_p, j_k = jax.jit(dispatch), jax.jit(combine), jax.jit(pair), jax.jit(chain)
    import threading
    got = [None] * len(inputs)

    def first(i):
        got[i] = jax.jit(rows_and_handle)(*inputs[i])

    threads = [threading.Thread(target=first, args=(i,)) for i in range(len(inputs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    res = []
    for name, f, args in (("dispatch", j_d, inputs), ("combine", j_c, [list(g) for g in got]),
                          ("pair", j_p, inputs), (CHAINED, j_k, inputs)):
        host, clock = [], handler_clock()
        res.append((name, time_threads(f, args, iters, host), host[0], handler_us(clock)))
    out["threads"] = res
    # per pair in the chain
    return {shape: [(name, t / CHAIN, h / CHAIN, k) if name == CHAINED else (name, t, h, k)
                    for name, t, h, k in res] for shape, res in out.items()}


def parse_sizes(text):
    """'4096:intranode,128:low_latency' -> ((4096, 'intranode'), (128, 'low_latency'))."""
    sizes = []
    for item in text.split(","):
        tokens, sep, kernel = item.partition(":")
        if not sep or not tokens.strip().isdigit() or int(tokens) <= 0 or \
                kernel not in ("intranode", "low_latency"):
            raise SystemExit(f"--sizes: bad item {item!r}: want tokens:kernel, tokens > 0 and "
                             "kernel intranode or low_latency")
        sizes.append((int(tokens), kernel))
    return tuple(sizes)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--gpus", type=int, default=0, help="GPUs to use (default: all)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the cpu platform")
    p.add_argument("--parts", action="store_true",
                   help="also time dispatch alone, combine alone and the pair (parts lines)")
    p.add_argument("--sizes", default=None,
                   help="tokens:kernel pairs, comma-separated (default "
                        "4096:intranode,128:low_latency; the smoke run 64:intranode,8:low_latency)")
    a = p.parse_args()
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    import symheap.jax as shj
    from symheap.ep import EpConfig

    devs = jax.devices("cpu" if a.smoke else "gpu")
    devs = devs[:a.gpus] if a.gpus else devs
    n = len(devs)
    shj.init(devs, heap_size="64M" if a.smoke else "4G")
    mesh = shj.make_mesh("pe")
    sh = NamedSharding(mesh, P("pe"))
    L = EXPERTS // n
    print(f"{n} x {devs[0].device_kind}, jax {jax.__version__}, hidden {HIDDEN} bf16, "
          f"top-{TOPK} of {EXPERTS}")
    sizes = parse_sizes(a.sizes or ("64:intranode,8:low_latency" if a.smoke else
                                    "4096:intranode,128:low_latency"))
    for tokens, kernel in sizes:
        kw = dict(max_recv_tokens=n * tokens) if kernel == "intranode" else {}
        cfg = EpConfig(hidden=HIDDEN, max_tokens_per_rank=tokens, num_experts=EXPERTS, topk=TOPK,
                       dtype="bfloat16", kernel=kernel, **kw)
        op = shj.EpDispatchCombine(cfg)
        idx, w = routing(n, tokens)
        x = jax.device_put(jnp.asarray(np.random.default_rng(1).standard_normal(
            (n * tokens, HIDDEN), dtype=np.float32), jnp.bfloat16), sh)
        idx_s = jax.device_put(idx.reshape(n * tokens, TOPK), sh)
        w_s = jax.device_put(w.reshape(n * tokens, TOPK), sh)

        def ours(x, idx, w):
            d = op.dispatch(x, idx, w)
            return op.combine(d.x, d.handle)

        def padded_all_to_all(x, idx, w):
            # one row per (token, destination PE): send[d, t] = x[t] when token t has an
            # expert on PE d, else zeros
            dest = (idx // L)[None, :, :] == jnp.arange(n)[:, None, None]  # [n, T, K]
            goes = jnp.any(dest, axis=-1)                                   # [n, T]
            send = jnp.where(goes[..., None], x[None], jnp.zeros((), x.dtype))
            recv = jax.lax.all_to_all(send, "pe", 0, 0, tiled=False)
            back = jax.lax.all_to_all(recv, "pe", 0, 0, tiled=False)
            return jnp.sum(back.astype(jnp.float32), axis=0).astype(x.dtype)

        # The usual MoE layer in JAX sends one row per (token, chosen expert), not one per
        # (token, PE). Its static capacity per destination is this batch's largest count,
        # so no row is dropped (a real layer picks a capacity factor and drops overflow).
        cap = int(max(np.sum(idx[s] // L == d) for s in range(n) for d in range(n)))

        def per_choice_all_to_all(x, idx, w):
            t = x.shape[0]
            dest = (idx // L).reshape(-1)                        # [T*K] each choice's PE
            order = jnp.argsort(dest, stable=True)               # choices grouped by PE
            count = jnp.bincount(dest, length=n)
            start = jnp.cumsum(count) - count
            j = jnp.arange(cap)
            choice = order[jnp.minimum(start[:, None] + j, t * TOPK - 1)]  # [n, cap]
            valid = (j < count[:, None])[..., None]
            # gathers only: XLA's row scatter on GPU is far slower than the exchange
            send = jnp.where(valid, x[choice // TOPK], jnp.zeros((), x.dtype))
            recv = jax.lax.all_to_all(send, "pe", 0, 0, tiled=False)  # identity experts
            back = jax.lax.all_to_all(recv, "pe", 0, 0, tiled=False)
            slot = jnp.argsort(order) - start[dest]              # each choice's row at its PE
            rows = back[dest, slot].reshape(t, TOPK, HIDDEN).astype(jnp.float32)
            return jnp.sum(rows * w[..., None], axis=1).astype(x.dtype)

        f_ours = jax.jit(shard_map(ours, mesh, P("pe"), P("pe")))
        f_ref = jax.jit(shard_map(padded_all_to_all, mesh, P("pe"), P("pe")))
        f_choice = jax.jit(shard_map(per_choice_all_to_all, mesh, P("pe"), P("pe")))
        # each program against numpy (identity experts): ours and the per-PE baseline give
        # x times the number of PEs the token reaches, the per-choice one sum_k w_k x
        x32 = np.asarray(x.astype(jnp.float32))
        reach = sum(np.any(idx.reshape(-1, TOPK) // L == d, axis=-1) for d in range(n))
        for name, f, want in (("symheap.jax", f_ours, x32 * reach[:, None]),
                              ("all_to_all per PE", f_ref, x32 * reach[:, None]),
                              ("all_to_all per choice", f_choice,
                               x32 * w.reshape(-1, TOPK).sum(-1)[:, None])):
            got = np.asarray(f(x, idx_s, w_s).astype(jnp.float32))
            err = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
            if not err < 2e-2:
                raise SystemExit(f"{name} output is wrong: max relative error {err:.3g}")
        t_ours = time_it(f_ours, (x, idx_s, w_s), a.iters)
        t_threads = time_threads(jax.jit(ours), per_device(x, idx_s, w_s), a.iters)
        t_ref = time_it(f_ref, (x, idx_s, w_s), a.iters)
        t_choice = time_it(f_choice, (x, idx_s, w_s), a.iters)
        print(f"summary {tokens} tokens {kernel}: symheap.jax dispatch+combine "
              f"{t_ours:.1f} us (shard_map), {t_threads:.1f} us (threads); all_to_all padded "
              f"one row per PE {t_ref:.1f} us, speedup {t_ref / t_ours:.2f}x (shard_map) "
              f"{t_ref / t_threads:.2f}x (threads); one row per expert choice (capacity "
              f"{cap}) {t_choice:.1f} us, speedup {t_choice / t_ours:.2f}x (shard_map) "
              f"{t_choice / t_threads:.2f}x (threads)")
        if a.parts:
            # the baselines chained as time_parts chains ours: CHAIN pairs in one
            # program, each taking the previous pair's output (per-call costs spread)
            def chained(f):
                def run(x, idx, w):
                    for _ in range(CHAIN):
                        x = f(x, idx, w)
                    return x
                return jax.jit(shard_map(run, mesh, P("pe"), P("pe")))

            c_ref = time_it(chained(padded_all_to_all), (x, idx_s, w_s), a.iters) / CHAIN
            c_choice = time_it(chained(per_choice_all_to_all), (x, idx_s, w_s), a.iters) / CHAIN
            print(f"baselines {tokens} tokens {kernel}, {CHAINED}, us per pair: all_to_all "
                  f"one row per PE {c_ref:.1f}, one row per expert choice {c_choice:.1f}")
            # what one pair issues on each device (kernels, memsets, copies, ...): the
            # torch path's graph replays two kernels per pair
            from symheap import _core
            job, op_id = op._key
            ops = lambda: [_core.ep_device_ops(job, pe, op_id) for pe in range(n)]  # noqa: E731
            before = ops()
            jax.block_until_ready(f_ours(x, idx_s, w_s))
            per_pe = [None if b is None else {k: c[k] - b[k] for k in c if c[k] != b[k]}
                      for b, c in zip(before, ops())]
            print(f"device ops {tokens} tokens {kernel}, one pair, per PE: {per_pe}")
            for shape, res in time_parts(op, mesh, x, idx_s, w_s, a.iters).items():
                print(f"parts {tokens} tokens {kernel} {shape}: " + ", ".join(
                    f"{name} {t:.1f} us (host {h:.1f}, " +
                    ("no handler call)" if k is None else f"{k:.1f} per handler call)")
                    for name, t, h, k in res))
        op.close()
    shj.finalize()


if __name__ == "__main__":
    main()
