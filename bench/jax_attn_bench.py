"""Attention inside jax.jit on one CUDA GPU: symheap.jax.flash_attn_func against
jax.nn.dot_product_attention with implementation="cudnn" and "xla", forward
and forward+backward TFLOP/s side by side.

bf16 (B, S, H, D) = (4, 4096, 16, 128) by default. FLOPs: forward
4*B*H*S*S*D (halved when causal), fwd+bwd 3.5x the forward. Times are medians
of wall-clock runs of the compiled program, each ended by block_until_ready.

    python bench/jax_attn_bench.py [--json out.json] [--reps 20]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp

import symheap.jax as shj

SHAPES = [  # (B, S, H, D, causal)
    (4, 4096, 16, 128, False), (4, 4096, 16, 128, True),
]


def time_ms(fn, args, warmup=3, reps=20):
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def implementations(causal):
    def ours(q, k, v):
        return shj.flash_attn_func(q, k, v, causal=causal)

    def jax_impl(name):
        def run(q, k, v):
            return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation=name)
        return run

    return {"symheap": ours, "jax_cudnn": jax_impl("cudnn"), "jax_xla": jax_impl("xla")}


def bench_shape(B, S, H, D, causal, reps):
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    q, k, v, dout = (jax.random.normal(key, (B, S, H, D), jnp.bfloat16) for key in keys)
    flops_fwd = 4 * B * H * S * S * D / (2 if causal else 1)
    row = {"batch": B, "seqlen": S, "heads": H, "hdim": D, "causal": causal}
    outputs = {}
    for name, fn in implementations(causal).items():
        fwd = jax.jit(fn)

        @jax.jit
        def fwd_bwd(q, k, v, fn=fn):
            out, pullback = jax.vjp(fn, q, k, v)
            return pullback(dout)

        try:
            outputs[name] = fwd(q, k, v)
            t_f = time_ms(fwd, (q, k, v), reps=reps)
            t_fb = time_ms(fwd_bwd, (q, k, v), reps=reps)
            row[name] = {"fwd_ms": t_f, "fwd_bwd_ms": t_fb, "fwd_tflops": flops_fwd / t_f / 1e9,
                         "fwd_bwd_tflops": 3.5 * flops_fwd / t_fb / 1e9}
        except Exception as e:  # an implementation may be unavailable here
            row[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
    if "symheap" in outputs and "jax_xla" in outputs:
        diff = jnp.abs(outputs["symheap"].astype(jnp.float32) - outputs["jax_xla"].astype(jnp.float32))
        row["max_abs_diff_vs_xla"] = float(jnp.max(diff))
    return row


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    if jax.default_backend() != "gpu":
        print(f"summary: skipped, jax's default backend is {jax.default_backend()} (needs a CUDA GPU)")
        return
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}")
    rows = [bench_shape(*shape, reps=args.reps) for shape in SHAPES]
    names = ("symheap", "jax_cudnn", "jax_xla")

    def cell(r, n):
        if "fwd_tflops" not in r[n]:
            return "        n/a"
        return f"{r[n]['fwd_tflops']:5.0f} /{r[n]['fwd_bwd_tflops']:5.0f}"

    print("TFLOP/s, forward / forward+backward")
    print(f"{'B':>2} {'S':>5} {'H':>3} {'D':>4} {'causal':>6} | " +
          " | ".join(f"{n:>11}" for n in names) + " | max|diff| vs xla")
    for r in rows:
        print(f"{r['batch']:>2} {r['seqlen']:>5} {r['heads']:>3} {r['hdim']:>4} {str(r['causal']):>6} | " +
              " | ".join(f"{cell(r, n):>11}" for n in names) +
              f" | {r.get('max_abs_diff_vs_xla', float('nan')):.2e}")
        for n in names:
            if "error" in r[n]:
                print(f"   {n}: {r[n]['error']}")
    summary = " ".join(f"{n}={r[n].get('fwd_tflops', 0):.0f}/{r[n].get('fwd_bwd_tflops', 0):.0f}"
                       for r in rows[:1] for n in names)
    print(f"summary (hdim 128, S 4096, non-causal, fwd/fwd+bwd TFLOP/s): {summary}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
