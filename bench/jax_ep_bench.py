"""EP dispatch + combine inside jit (symheap.jax: shard_map over every GPU, and one
Python thread per GPU each running its own jit) against what JAX offers without it:
jax.lax.all_to_all of padded per-destination buffers inside shard_map (dispatch) and
the reverse all_to_all plus a sum (combine).

DeepSeek-V3 shape: hidden 7168 bf16, top-8 of 256 experts; 4096 tokens per GPU
(kernel intranode, max_recv_tokens set) and 128 (kernel low_latency). Times are
per dispatch+combine pair, mean over back-to-back calls of one jitted program.

    python bench/jax_ep_bench.py [--iters 20] [--gpus N]
    python bench/jax_ep_bench.py --smoke     # tiny shapes on the cpu platform (a check)
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


def time_it(f, args, iters):
    import jax
    jax.block_until_ready(f(*args))  # compile and warm up
    jax.block_until_ready(f(*args))
    t0 = time.perf_counter()
    for _ in range(iters):
        out = f(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / iters * 1e6


def time_threads(f, x, idx, w, iters):
    """One thread per device, each timing f on its own shard; the slowest thread's mean."""
    import threading
    import jax
    shards = [[s.data for s in sorted(a.addressable_shards, key=lambda s: s.index[0].start)]
              for a in (x, idx, w)]
    times = [0.0] * len(shards[0])
    start = threading.Barrier(len(times))

    def run(i):
        args = [s[i] for s in shards]
        jax.block_until_ready(f(*args))
        start.wait()
        times[i] = time_it(f, args, iters)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(times))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return max(times)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--gpus", type=int, default=0, help="GPUs to use (default: all)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the cpu platform")
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
    sizes = ((64, "intranode"), (8, "low_latency")) if a.smoke else \
        ((4096, "intranode"), (128, "low_latency"))
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
            # send[d, t] = x[t] when token t has an expert on PE d, else zeros
            dest = (idx // L)[None, :, :] == jnp.arange(n)[:, None, None]  # [n, T, K]
            goes = jnp.any(dest, axis=-1)                                   # [n, T]
            send = jnp.where(goes[..., None], x[None], jnp.zeros((), x.dtype))
            recv = jax.lax.all_to_all(send, "pe", 0, 0, tiled=False)
            back = jax.lax.all_to_all(recv, "pe", 0, 0, tiled=False)
            return jnp.sum(back.astype(jnp.float32), axis=0).astype(x.dtype)

        f_ours = jax.jit(shard_map(ours, mesh, P("pe"), P("pe")))
        f_ref = jax.jit(shard_map(padded_all_to_all, mesh, P("pe"), P("pe")))
        t_ours = time_it(f_ours, (x, idx_s, w_s), a.iters)
        t_threads = time_threads(jax.jit(ours), x, idx_s, w_s, a.iters)
        t_ref = time_it(f_ref, (x, idx_s, w_s), a.iters)
        print(f"summary {tokens} tokens {kernel}: symheap.jax dispatch+combine "
              f"{t_ours:.1f} us (shard_map), {t_threads:.1f} us (threads); all_to_all padded "
              f"{t_ref:.1f} us; speedup {t_ref / t_ours:.2f}x")
        op.close()
    shj.finalize()


if __name__ == "__main__":
    main()
