"""Attention throughput (TFLOP/s) on CUDA, with torch SDPA's flash and cuDNN
backends measured in the same run.

bf16 (or --dtype float16), B*S = 16k tokens, H*D = 2048. FLOPs: forward
4*B*H*S*S*D (halved when causal), fwd+bwd 3.5x the forward. Times are CUDA-event
medians.

    python bench/attn_bench.py [--backend auto|cudnn|own] [--grid reference|full]
                               [--json out.json] [--quick]
                               [--hdims 64,128] [--seqlens 1024,2048,4096,8192]
                               [--fwd-only] [--compare-basic] [--group 4] [--kernel-times]
                               [--compare-backward pipelined_dq16]
                               [--compare-forward pipelined_previous] [--dtype float16]
    python bench/attn_bench.py --decode [--json out.json] [--quick] [--decode-compare previous]   (KV-cache decode)

Rows with features (bias with its gradient, window, softcap, GQA, varlen): bench/attn_feature_bench.py.

--backend picks symheap's path (as flash_attn_func's backend=); --grid full
runs head dims 64, 128, 256 x S 512 .. 16k x causal or not; --hdims/--seqlens
replace the grid by their product x causal or not (--group: query heads per
kv head in those rows). --fwd-only skips the
backward timings; --compare-basic adds the own basic kernels
(SYMHEAP_ATTN_OWN_FORWARD=basic and SYMHEAP_ATTN_OWN_BACKWARD=basic), forward
and forward+backward, as a column next to symheap's path; --compare-backward V
adds forward+backward with SYMHEAP_ATTN_OWN_BACKWARD=V on the own path (e.g.
pipelined_dq16: the dQ kernel of 16-row warps; pipelined_dkdv32: the dK/dV
kernel of 32-row query tiles at head dim 128; pipelined_dkdv_unshared: the
dK/dV kernel of 64-row tiles without shared Q/dO fragments, head dims 64 and
128; pipelined_dq_separate: dQ by its own kernel instead of fused into the
dK/dV kernel, head dims 64 and 128) as a column; --compare-forward V adds the forward with
SYMHEAP_ATTN_OWN_FORWARD=V on the own path (e.g. pipelined_previous: the
pipelined forward with the softmax before the lean one) as a column, with its
output's max difference from symheap's; --kernel-times lists
the device time of each attention kernel per call (torch profiler), of the
--compare-backward variant too.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from symheap.attention import backends, flash_attn_func

SHAPES = [  # (head dim, causal, seqlen)
    (64, False, 4096), (64, True, 4096), (128, False, 1024), (128, False, 4096),
    (128, True, 4096), (128, False, 16384), (128, True, 16384),
]
FULL_SHAPES = [(D, causal, S) for D in (64, 128, 256) for causal in (False, True)
               for S in (512, 1024, 2048, 4096, 8192, 16384)]
GQA_SHAPES = [(128, False, 4096), (128, True, 4096)]  # with 8 query heads per kv head


INNER = 1  # calls per timed sample (--inner); 1 = each call alone on an idle stream


def time_ms(fn, warmup=3, reps=10):
    """Median per-call time. With INNER = 1 a call's host overhead counts in
    full (the stream idles while it launches); with INNER > 1 the calls queue
    back to back and only host overhead beyond the GPU time shows."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(INNER):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / INNER)
    return statistics.median(times)


def host_overhead_us(backend, n=200):
    """Host time per forward call on a tiny problem (the GPU work is a few us),
    for symheap's path (head dims 64 and 128) and for SDPA's flash and cuDNN
    backends (head dim 64)."""
    import time
    q = torch.randn(1, 128, 2, 64, device="cuda", dtype=torch.bfloat16)
    qt = q.transpose(1, 2)
    q128 = torch.randn(1, 128, 2, 128, device="cuda", dtype=torch.bfloat16)
    # head dim 128: the Hopper kernel fed by TMA, its tensor maps encoded per call
    runs = {"symheap": lambda: flash_attn_func(q, q, q, causal=True, backend=backend),
            "symheap_d128": lambda: flash_attn_func(q128, q128, q128, causal=True, backend=backend)}
    for name, sdpa_backend in (("sdpa_flash", SDPBackend.FLASH_ATTENTION),
                               ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)):
        def run(b=sdpa_backend):
            with sdpa_kernel(b):
                F.scaled_dot_product_attention(qt, qt, qt, is_causal=True)
        runs[name] = run
    result = {}
    for name, fn in runs.items():
        try:
            for _ in range(10):
                fn()
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(n):
                fn()
            result[name] = (time.perf_counter() - t) / n * 1e6
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - reported
            result[name] = f"{type(e).__name__}: {e}"[:120]
    return result


class own_kernels:
    """Sets the own kernels' variables (SYMHEAP_ATTN_OWN_FORWARD and
    SYMHEAP_ATTN_OWN_BACKWARD, read per call) while active."""

    def __init__(self, forward=None, backward=None):
        self.values = {name: value for name, value in (("SYMHEAP_ATTN_OWN_FORWARD", forward),
                                                       ("SYMHEAP_ATTN_OWN_BACKWARD", backward))
                       if value is not None}

    def __enter__(self):
        self.saved = {name: os.environ.get(name) for name in self.values}
        os.environ.update(self.values)

    def __exit__(self, *exc):
        for name, value in self.saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def profiled_kernels_us(fn, reps=3):
    """Every kernel `fn` launches (torch profiler): [(us per call, launches per
    call, name)], slowest first."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    # acc_events: the one cycle keeps its events without torch's warning that it clears them.
    with profile(activities=[ProfilerActivity.CUDA], acc_events=True) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if us > 0:
            rows.append((us / reps, e.count // reps, e.key))
    return sorted(rows, reverse=True)


def kernel_times_ms(fn, reps=3):
    """Device time per call of each attention kernel `fn` launches, by kernel
    name without its namespace and parameters."""
    times = {}
    for us, _, key in profiled_kernels_us(fn, reps):
        if "attention" in key and "_kernel" in key:  # kernels only
            name = key.split("(")[0].replace("void ", "").replace("symheap::attention::cuda::", "")
            times[name] = times.get(name, 0.0) + us / 1e3
    return times


def bench_shape(D, causal, S, reps, backend, group=1, fwd_only=False, compare_basic=False,
                kernel_times=False, compare_backward=None, compare_forward=None, dtype=torch.bfloat16):
    B, H = 16384 // S, 2048 // D
    gen = torch.Generator(device="cuda").manual_seed(0)
    mk = lambda h=H: torch.randn(B, S, h, D, device="cuda", dtype=dtype, generator=gen)  # noqa: E731
    q = mk().requires_grad_()
    k, v = (mk(H // group).requires_grad_() for _ in range(2))
    dout = mk()
    gqa = {"enable_gqa": True} if group > 1 else {}
    flops_fwd = 4 * B * H * S * S * D / (2 if causal else 1)

    def ours_fwd():
        return flash_attn_func(q, k, v, causal=causal, backend=backend)

    def ours_fwd_bwd():
        out = flash_attn_func(q, k, v, causal=causal, backend=backend)
        torch.autograd.grad(out, (q, k, v), dout)

    # SDPA takes (B, H, S, D).
    qt, kt, vt = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v))
    doutt = dout.transpose(1, 2)

    def sdpa(backend, backward):
        def run():
            with sdpa_kernel(backend):
                out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, **gqa)
                if backward:
                    torch.autograd.grad(out, (qt, kt, vt), doutt)
        return run

    row = {"hdim": D, "causal": causal, "seqlen": S, "batch": B, "heads": H, "kv_heads": H // group,
           "backend": backend}
    def ours_basic_fwd():
        with own_kernels("basic", "basic"):
            return flash_attn_func(q, k, v, causal=causal, backend="own")

    def ours_basic_fwd_bwd():
        with own_kernels("basic", "basic"):
            out = flash_attn_func(q, k, v, causal=causal, backend="own")
            torch.autograd.grad(out, (q, k, v), dout)

    def ours_variant_fwd():
        return flash_attn_func(q, k, v, causal=causal, backend="own")

    def ours_variant_fwd_bwd():
        with own_kernels(backward=compare_backward):
            out = flash_attn_func(q, k, v, causal=causal, backend="own")
            torch.autograd.grad(out, (q, k, v), dout)

    def ours_forward_variant():
        with own_kernels(forward=compare_forward):
            return flash_attn_func(q, k, v, causal=causal, backend="own")

    cases = {"symheap": (ours_fwd, ours_fwd_bwd),
             "sdpa_flash": (sdpa(SDPBackend.FLASH_ATTENTION, False), sdpa(SDPBackend.FLASH_ATTENTION, True)),
             "sdpa_cudnn": (sdpa(SDPBackend.CUDNN_ATTENTION, False), sdpa(SDPBackend.CUDNN_ATTENTION, True))}
    if compare_basic:
        cases["own_basic"] = (ours_basic_fwd, ours_basic_fwd_bwd)
    if compare_backward and not fwd_only:
        cases["own_variant"] = (ours_variant_fwd, ours_variant_fwd_bwd)
    if compare_forward:
        cases["own_fwd_variant"] = (ours_forward_variant, None)
    for name, (fwd, fwd_bwd) in cases.items():
        try:
            t_f = time_ms(fwd, reps=reps)
            row[name] = {"fwd_ms": t_f, "fwd_tflops": flops_fwd / t_f / 1e9}
            if not fwd_only and fwd_bwd is not None:
                t_fb = time_ms(fwd_bwd, reps=reps)
                row[name].update(fwd_bwd_ms=t_fb, fwd_bwd_tflops=3.5 * flops_fwd / t_fb / 1e9)
        except Exception as e:  # a backend may be unavailable for a shape
            row[name] = {"error": f"{type(e).__name__}: {e}"[:200]}
    # Accuracy of our output in the same run, against SDPA (flash).
    with torch.no_grad(), sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        ref = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, **gqa).transpose(1, 2)
        out = flash_attn_func(q, k, v, causal=causal, backend=backend)
        row["max_abs_diff_vs_sdpa"] = (out.float() - ref.float()).abs().max().item()
        if compare_forward:
            row["max_abs_diff_fwd_variant"] = (ours_forward_variant().float() - out.float()).abs().max().item()
    if kernel_times:
        row["kernel_ms"] = kernel_times_ms(ours_fwd if fwd_only else ours_fwd_bwd)
        if "own_variant" in cases:
            row["kernel_ms_variant"] = kernel_times_ms(ours_variant_fwd_bwd)
    if not fwd_only:  # and of the gradients (dq, dk, dv)
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            ref_out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, **gqa)
            want = [g.transpose(1, 2) for g in torch.autograd.grad(ref_out, (qt, kt, vt), doutt)]
        got = torch.autograd.grad(flash_attn_func(q, k, v, causal=causal, backend=backend), (q, k, v), dout)
        row["max_abs_grad_diff_vs_sdpa"] = max((a.float() - b.float()).abs().max().item()
                                               for a, b in zip(got, want))
    return row


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions, skip S=16384")
    parser.add_argument("--backend", default=None, choices=["auto", "cudnn", "own"],
                        help="symheap's path (flash_attn_func's backend=; default: "
                             "$SYMHEAP_ATTN_BACKEND, else auto)")
    parser.add_argument("--grid", default="reference", choices=["reference", "full"],
                        help="reference: the rows of the reference table (SHAPES: hdim 64 and 128, S 1024 to 16k); full: hdim 64/128/256 x S 512..16k x causal")
    parser.add_argument("--decode", action="store_true",
                        help="decode over a paged KV cache instead (bench/attn_decode_bench.py)")
    parser.add_argument("--hdims", help="comma-separated head dims (with --seqlens: their product "
                        "x causal or not replaces --grid)")
    parser.add_argument("--seqlens", help="comma-separated sequence lengths (see --hdims)")
    parser.add_argument("--fwd-only", action="store_true", help="time the forward only")
    parser.add_argument("--kernel-times", action="store_true",
                        help="print the device time of each own kernel per call (torch profiler)")
    parser.add_argument("--group", type=int, default=1,
                        help="query heads per kv head for the --hdims/--seqlens rows (GQA)")
    parser.add_argument("--compare-basic", action="store_true",
                        help="add the own basic kernels, forward and backward "
                             "(SYMHEAP_ATTN_OWN_FORWARD=basic, SYMHEAP_ATTN_OWN_BACKWARD=basic)")
    parser.add_argument("--compare-backward", metavar="VALUE",
                        help="add forward+backward on the own path with SYMHEAP_ATTN_OWN_BACKWARD=VALUE "
                             "(e.g. pipelined_dq16)")
    parser.add_argument("--compare-forward", metavar="VALUE",
                        help="add the forward on the own path with SYMHEAP_ATTN_OWN_FORWARD=VALUE "
                             "(e.g. pipelined_previous)")
    parser.add_argument("--decode-splits", metavar="LIST",
                        help="with --decode: time the small-cache rows with each of these key-length "
                             "splits instead (e.g. 0,1,2,4,8,16,32; 0 = the automatic choice)")
    parser.add_argument("--decode-compare", metavar="NAME",
                        help="with --decode: also time each row with SYMHEAP_DECODE_KERNEL=NAME "
                             "(e.g. previous), or with NAME kernel_merge SYMHEAP_DECODE_MERGE=kernel, "
                             "in the same process")
    parser.add_argument("--decode-batches", metavar="LIST",
                        help="with --decode-splits, --decode-cold, --decode-layouts or --decode-kernels: "
                             "these batch sizes")
    parser.add_argument("--decode-caches", metavar="LIST",
                        help="with --decode-splits, --decode-cold, --decode-layouts or --decode-kernels: "
                             "these cache lengths "
                             "(multiples of 256)")
    parser.add_argument("--decode-layouts", action="store_true",
                        help="with --decode: our call over four layouts of one cache (paged and dense, "
                             "kv-head-minor and head-major) next to SDPA")
    parser.add_argument("--decode-kernels", action="store_true",
                        help="with --decode: our call with each attention kernel forced "
                             "(SYMHEAP_DECODE_KERNEL) next to SDPA, in one process")
    parser.add_argument("--decode-query-rows", type=int, default=1, metavar="N",
                        help="with --decode-kernels: query rows per sequence (default 1)")
    parser.add_argument("--decode-eager", action="store_true",
                        help="with --decode: eager calls, ours and SDPA: the host time of a call and "
                             "the time of calls back to back")
    parser.add_argument("--decode-cold", action="store_true",
                        help="with --decode: time each row with the L2 warm (every call on one cache) "
                             "and cold (each call on its own copy), ours and SDPA")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"],
                        help="the rows' dtype (ours and SDPA's alike; not --decode)")
    parser.add_argument("--inner", type=int, default=1,
                        help="calls per timed sample (1: each alone, host overhead counted in full)")
    args = parser.parse_args()
    if args.decode:
        import attn_decode_bench
        shapes = {}
        if args.decode_batches:
            shapes["batches"] = [int(x) for x in args.decode_batches.split(",")]
        if args.decode_caches:
            shapes["caches"] = [int(x) for x in args.decode_caches.split(",")]
        if args.decode_cold:
            return attn_decode_bench.warm_and_cold(**shapes)
        if args.decode_eager:
            return attn_decode_bench.eager(**shapes)
        if args.decode_layouts:
            return attn_decode_bench.layouts(**shapes)
        if args.decode_kernels:
            return attn_decode_bench.kernels_sweep(query_rows=args.decode_query_rows, **shapes)
        if args.decode_splits:
            return attn_decode_bench.splits_sweep([int(x) for x in args.decode_splits.split(",")],
                                                  compare=args.decode_compare, **shapes)
        return attn_decode_bench.main(args.json, args.quick, compare=args.decode_compare)
    global INNER
    INNER = max(1, args.inner)
    torch.backends.cuda.matmul.allow_tf32 = False
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, {args.dtype}, "
          f"symheap backend {args.backend or os.environ.get('SYMHEAP_ATTN_BACKEND') or 'auto'}, "
          f"paths {backends()}")
    overhead = host_overhead_us(args.backend)
    print("host us per forward call (tiny shape): " +
          ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in overhead.items()),
          flush=True)
    rows = []
    shapes = [(D, causal, S, 1) for D, causal, S in (FULL_SHAPES if args.grid == "full" else SHAPES)]
    shapes += [(D, causal, S, 8) for D, causal, S in GQA_SHAPES] if args.grid == "full" else []
    if args.hdims or args.seqlens:
        hdims = [int(x) for x in (args.hdims or "64,128").split(",")]
        seqlens = [int(x) for x in (args.seqlens or "1024,2048,4096,8192").split(",")]
        shapes = [(D, causal, S, args.group) for D in hdims for causal in (False, True) for S in seqlens]
    for D, causal, S, group in shapes:
        if args.quick and S > 4096:
            continue
        try:
            rows.append(bench_shape(D, causal, S, reps=5 if args.quick else 10, backend=args.backend,
                                    group=group, fwd_only=args.fwd_only,
                                    compare_basic=args.compare_basic, kernel_times=args.kernel_times,
                                    compare_backward=args.compare_backward,
                                    compare_forward=args.compare_forward,
                                    dtype=getattr(torch, args.dtype)))
        except Exception as e:  # noqa: BLE001 - e.g. out of memory: report and go on
            print(f"hdim {D} causal {causal} S {S}: {type(e).__name__}: {e}"[:300], flush=True)
        torch.cuda.empty_cache()
    fmt = lambda r, n, key: f"{r[n][key]:6.0f}" if key in r[n] else "   n/a"  # noqa: E731

    def basic(r):
        if "own_basic" not in r:
            return "n/a"
        return f"{fmt(r, 'own_basic', 'fwd_tflops')} / {fmt(r, 'own_basic', 'fwd_bwd_tflops')}"

    def variant(r):
        return fmt(r, "own_variant", "fwd_bwd_tflops") if "own_variant" in r else "   n/a"

    def ratio(r, key):
        if key in r["symheap"] and key in r["sdpa_cudnn"]:
            return f"{r['symheap'][key] / r['sdpa_cudnn'][key]:5.2f}"
        return "  n/a"
    print(f"{'hdim':>4} {'causal':>6} {'seq':>6} {'kvh':>4} | {'symheap fwd/fwd+bwd':>20} | "
          f"{'SDPA flash':>14} | {'SDPA cuDNN':>14} | {'symheap/cuDNN':>13} | "
          f"{'own basic fwd/fwd+bwd':>21} | {'variant fwd+bwd':>15} | max|diff| out / grads vs SDPA")
    for r in rows:
        print(f"{r['hdim']:>4} {str(r['causal']):>6} {r['seqlen']:>6} {r['kv_heads']:>4} | "
              f"{fmt(r, 'symheap', 'fwd_tflops')} / {fmt(r, 'symheap', 'fwd_bwd_tflops')}      | "
              f"{fmt(r, 'sdpa_flash', 'fwd_tflops')} / {fmt(r, 'sdpa_flash', 'fwd_bwd_tflops')} | "
              f"{fmt(r, 'sdpa_cudnn', 'fwd_tflops')} / {fmt(r, 'sdpa_cudnn', 'fwd_bwd_tflops')} | "
              f"{ratio(r, 'fwd_tflops')} / {ratio(r, 'fwd_bwd_tflops')} | "
              f"{basic(r):>21} | {variant(r):>15} | "
              f"{r['max_abs_diff_vs_sdpa']:.2e} / {r.get('max_abs_grad_diff_vs_sdpa', float('nan')):.2e}")
    if args.compare_forward:
        print(f"forward with SYMHEAP_ATTN_OWN_FORWARD={args.compare_forward} (own path), TFLOP/s:")
        print(f"{'hdim':>4} {'causal':>6} {'seq':>6} {'kvh':>4} | {'symheap':>7} | {'variant':>7} | "
              f"{'symheap/variant':>15} | {'symheap/flash':>13} | max|diff| variant vs symheap")
        for r in rows:
            ok = "fwd_tflops" in r["symheap"] and "fwd_tflops" in r.get("own_fwd_variant", {})
            speedup = f"{r['symheap']['fwd_tflops'] / r['own_fwd_variant']['fwd_tflops']:15.2f}" if ok else "            n/a"
            vs_flash = (f"{r['symheap']['fwd_tflops'] / r['sdpa_flash']['fwd_tflops']:13.2f}"
                        if "fwd_tflops" in r["symheap"] and "fwd_tflops" in r["sdpa_flash"] else "          n/a")
            print(f"{r['hdim']:>4} {str(r['causal']):>6} {r['seqlen']:>6} {r['kv_heads']:>4} | "
                  f"{fmt(r, 'symheap', 'fwd_tflops'):>7} | {fmt(r, 'own_fwd_variant', 'fwd_tflops'):>7} | "
                  f"{speedup} | {vs_flash} | {r.get('max_abs_diff_fwd_variant', float('nan')):.2e}")
    for r in rows:
        if r.get("kernel_ms"):
            print(f"kernels, hdim {r['hdim']} causal {r['causal']} seq {r['seqlen']} (ms per call): " +
                  ", ".join(f"{name} {ms:.3f}" for name, ms in sorted(r["kernel_ms"].items())))
        if r.get("kernel_ms_variant"):
            print(f"  with SYMHEAP_ATTN_OWN_BACKWARD={args.compare_backward}: " +
                  ", ".join(f"{name} {ms:.3f}" for name, ms in sorted(r["kernel_ms_variant"].items())))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"inner": INNER, "host_overhead_us": overhead, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
