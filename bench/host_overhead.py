"""Host overhead of eager calls in both launch models, side by side.

For each case, the same PE program runs once with one process per PE and once
with PE threads in one process, with 2 PEs and with 8 PE threads (8 virtual
devices on the cpu backend; on cuda, as many as there are GPUs, up to 8).

Figures, per PE (the slowest PE reported):
  host      mean time until the Python call returns (dispatch, combine), from a
            loop that reads the clock around every call;
  pair      mean wall time of one dispatch + combine in a plain loop of --iters
            (the clock read once per block of 10 pairs: per-call clock reads
            cost a PE thread more than a process, each making a float object
            under the GIL); "pair with per-call clocks" is the other loop's;
  median    the same over the median block of 10 pairs (robust to the bursts a
            shared machine adds to the mean);
  best      the same over the fastest block of 10 pairs (what an idle machine
            gives; on a loaded one the mean includes time the PEs were not running);
  gpu b2b   (cuda) CUDA events over 30 back-to-back dispatch + combine pairs.
With --gil, also the time each call holds the GIL (a separate pass after the
timed loop): the call's wall time less the time the core spent in it with the
GIL released (its wait for the GIL back counted as released), per dispatch, per
combine, and per pair of the loop (the loop's own Python work included). In
threads the PEs' GIL-held parts run one at a time, so a pair takes about
2G + C there against G + C in processes (G held, C released).

Cases. cuda: EP low_latency 128 tokens and intranode 4096 tokens with
max_recv_tokens given (7168 bf16, top-8 of 256), and attention forward
(B=1, S=128, H=8, D=64 bf16, causal) and attention decode (flash_attn_with_kvcache,
one query row over 128 cached rows) against torch SDPA in the same run, in one
thread and in one thread per GPU at once. cpu: a dispatch + combine pair of 8
tokens x 16 float32 (top-2 of 8 experts), i.e. the per-call overhead, in each
layout (token_major as intranode and as low_latency, token_slots,
expert_major), and
attention forward (B=1, S=4, H=8, D=64 float32, causal) and decode (16 cached
rows) against SDPA, in one thread and in 2 threads at once.

    python bench/host_overhead.py [--iters 200] [--pes 2] [--skip-8] [--backend cpu]
                                  [--gil] [--cases low_latency,...] [--rounds 1]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time

try:  # the installed package; else the source tree (with its built extension)
    import symheap  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

CUDA_CASES = [  # (name, tokens, hidden, experts, topk, dtype, kernel, max_recv given, layout)
    ("low_latency 128", 128, 7168, 256, 8, "bfloat16", "low_latency", False, "token_major"),
    ("intranode 4096", 4096, 7168, 256, 8, "bfloat16", "intranode", True, "token_major"),
]
CPU_CASES = [("cpu pair 8x16 intranode", 8, 16, 8, 2, "float32", "intranode", False, "token_major"),
             ("cpu pair 8x16 low_latency", 8, 16, 8, 2, "float32", "low_latency", False,
              "token_major"),
             ("cpu pair 8x16 token_slots", 8, 16, 8, 2, "float32", "intranode", False,
              "token_slots"),
             ("cpu pair 8x16 expert_major", 8, 16, 8, 2, "float32", "intranode", False,
              "expert_major")]
GPU_B2B_CALLS = 30
CPU_WARMUP_PAIRS = 5000
BLOCK = 10  # pairs per timed block; "best" is the fastest block (a loaded machine's floor)


def ep_program(case, iters, gil=False):
    """One PE's measurement; returns a dict of microseconds."""
    import torch

    import symheap
    from symheap import ep as ep_mod

    _, tokens, hidden, experts, topk, dtype, kernel, bounded, layout = case
    rank, world = symheap.my_pe(), symheap.n_pes()
    on_cuda = symheap.backend() == "cuda"
    device = torch.device("cuda", symheap.current_device()) if on_cuda else torch.device("cpu")
    if on_cuda:
        torch.cuda.set_device(device)
    g = torch.Generator(device="cpu").manual_seed(1234 + rank)
    idx = torch.rand(tokens, experts, generator=g).topk(topk, dim=1).indices.to(device)
    w = (torch.rand(tokens, topk, generator=g) + 0.1).to(device)
    x = torch.randn(tokens, hidden, generator=g).to(getattr(torch, dtype)).to(device)
    cfg = ep_mod.EpConfig(hidden=hidden, max_tokens_per_rank=tokens, num_experts=experts,
                          topk=topk, dtype=dtype, kernel=kernel, layout=layout,
                          max_recv_tokens=world * tokens if bounded else None)
    with ep_mod.EpDispatchCombine(cfg) as ep:
        out = ep.dispatch(x, idx, w)
        y = torch.zeros(out.handle.rows_shape, dtype=getattr(torch, cfg.combine_dtype),
                        device=device)
        ep.combine(y, out.handle)
        ep.check()

        def pair():
            o = ep.dispatch(x, idx, w)
            ep.combine(y, o.handle)

        # Warm-up. On the cpu backend, thousands of pairs (20-30 ms): PE threads that
        # ended up on one core (a wake-up during init or the op's creation can put
        # them there) run there until Linux's balancer moves one, which leaves a
        # task that ran within the last 0.5 ms alone for a few ms; a 500-pair loop
        # (3-4 ms) run there measures two threads sharing one core (about 7.4 us a
        # pair against 5.3 on two cores, on the 2-core dev VM).
        for _ in range(10 if on_cuda else CPU_WARMUP_PAIRS):
            pair()
        ep.check()
        clock = time.perf_counter
        blocks = max(1, iters // BLOCK)
        calls = blocks * BLOCK
        # Pairs in a plain loop, a clock read per block of BLOCK pairs only: per-call
        # clocks cost a PE thread more than a process (each read makes a float object
        # and holds the GIL), so they would inflate the threads' figure.
        symheap.barrier_all()
        block_times = []
        start = clock()
        for _ in range(blocks):
            b0 = clock()
            for _ in range(BLOCK):
                o = ep.dispatch(x, idx, w)
                ep.combine(y, o.handle)
            block_times.append(clock() - b0)
        loop = clock() - start
        block_times.sort()
        # Then each call timed on its own (the dispatch / combine split).
        symheap.barrier_all()
        t_disp = t_comb = 0.0
        start = clock()
        for _ in range(calls):
            t0 = clock()
            o = ep.dispatch(x, idx, w)
            t1 = clock()
            ep.combine(y, o.handle)
            t2 = clock()
            t_disp += t1 - t0
            t_comb += t2 - t1
        clocked = clock() - start
        ep.check()
        res = {"dispatch": t_disp / calls * 1e6, "combine": t_comb / calls * 1e6,
               "pair": loop / calls * 1e6, "median": block_times[len(block_times) // 2] / BLOCK * 1e6,
               "best": block_times[0] / BLOCK * 1e6, "clocked": clocked / calls * 1e6}
        if gil:
            res.update(gil_held_times(ep, x, idx, w, y, calls))
        if on_cuda:
            symheap.barrier_all()
            torch.cuda.synchronize()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            for _ in range(GPU_B2B_CALLS):
                pair()
            e1.record()
            e1.synchronize()
            res["gpu_b2b"] = e0.elapsed_time(e1) * 1e3 / GPU_B2B_CALLS
            ep.check()
        symheap.barrier_all()
    return res


def gil_held_times(ep, x, idx, w, y, calls):
    """GIL-held time (us): wall time less the core's GIL-free time, per pair
    over a plain loop, then per call (each call's timestamps taken outside it)."""
    import symheap
    from symheap import _core

    released, clock = _core.pe_call_released_ns, time.perf_counter
    symheap.barrier_all()
    start, r_start = clock(), released()
    for _ in range(calls):
        o = ep.dispatch(x, idx, w)
        ep.combine(y, o.handle)
    loop, r_loop = clock() - start, (released() - r_start) * 1e-9
    symheap.barrier_all()
    held_d = held_c = 0.0
    for _ in range(calls):
        r0 = released()
        t0 = clock()
        o = ep.dispatch(x, idx, w)
        t1 = clock()
        r1 = released()
        t1b = clock()  # the combine's interval starts here
        ep.combine(y, o.handle)
        t2 = clock()
        r2 = released()
        held_d += (t1 - t0) - (r1 - r0) * 1e-9
        held_c += (t2 - t1b) - (r2 - r1) * 1e-9
    ep.check()
    return {"gil_dispatch": held_d / calls * 1e6, "gil_combine": held_c / calls * 1e6,
            "gil_pair": (loop - r_loop) / calls * 1e6, "free_pair": r_loop / calls * 1e6}


def attention_calls(kind, dev, seq, dtype):
    """symheap's call and SDPA's over the same data: "forward" (B=1, S=seq, H=8,
    D=64, causal) or "decode" (one query row of 8 heads over a dense cache of
    `seq` rows and 2 kv heads, D=64; SDPA over the cache as (B, Hkv, L, D))."""
    import torch
    import torch.nn.functional as F

    from symheap.attention import flash_attn_func, flash_attn_with_kvcache

    if kind == "forward":
        q, k, v = (torch.randn(1, seq, 8, 64, device=dev, dtype=dtype) for _ in range(3))
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        return {"symheap": lambda: flash_attn_func(q, k, v, causal=True),
                "sdpa": lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)}
    q = torch.randn(1, 1, 8, 64, device=dev, dtype=dtype)
    k, v = (torch.randn(1, seq, 2, 64, device=dev, dtype=dtype) for _ in range(2))
    lengths = torch.full((1,), seq, dtype=torch.int32, device=dev)
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    return {"symheap": lambda: flash_attn_with_kvcache(q, k, v, cache_seqlens=lengths),
            "sdpa": lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)}


def attention_host_times(device_index, iters, barrier=None, kind="forward"):
    """Host time of symheap's and SDPA's eager call (attention_calls) on one GPU
    (us); on the cpu (device_index None) with S=4 (decode: 16 cached rows)
    float32, so the kernel is negligible."""
    import torch

    if device_index is None:  # one intra-op thread: SDPA is not charged for waking workers
        dev, seq, dtype = torch.device("cpu"), 4 if kind == "forward" else 16, torch.float32
        torch.set_num_threads(1)
        # A call takes a few us: a loop of 200 is shorter than the interpreter's
        # switch interval (5 ms), so in 2 threads one thread's whole loop could
        # run while the other waited for the GIL, charging that wait to a few
        # calls. Loops of tens of ms average over many switches.
        iters = max(iters, 5000)
    else:
        dev, seq, dtype = torch.device("cuda", device_index), 128, torch.bfloat16
        torch.cuda.set_device(dev)
    fns = attention_calls(kind, dev, seq, dtype)
    res = {}
    for name, fn in fns.items():
        sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda d: None)
        for _ in range(20):
            fn()
        sync(dev)
        if barrier is not None:
            barrier.wait(60)
        clock, total = time.perf_counter, 0.0
        for _ in range(iters):
            t0 = clock()
            fn()
            total += clock() - t0
            if _ % 50 == 49:
                sync(dev)  # keep the launch queue from filling
        sync(dev)
        res[name] = total / iters * 1e6
    return res


def slowest(results):
    keys = results[0].keys()
    return {k: max(r[k] for r in results) for k in keys}


def fmt(r):
    s = (f"dispatch {r['dispatch']:7.1f}  combine {r['combine']:7.1f}  pair {r['pair']:7.1f}"
         f"  median-block pair {r['median']:7.1f}  best-block pair {r['best']:7.1f}"
         f"  pair with per-call clocks {r['clocked']:7.1f}")
    if "gpu_b2b" in r:
        s += f"  gpu b2b/pair {r['gpu_b2b']:7.1f}"
    if "gil_pair" in r:
        s += (f"\n  {'':<12} GIL held: dispatch {r['gil_dispatch']:5.2f}  combine "
              f"{r['gil_combine']:5.2f}  pair (a plain loop) {r['gil_pair']:5.2f}; "
              f"released per pair {r['free_pair']:5.2f}")
    return s


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--pes", type=int, default=2)
    ap.add_argument("--skip-8", action="store_true", help="skip the 8 PE threads row")
    ap.add_argument("--backend", default=None, help="cpu or cuda (default: what is present)")
    ap.add_argument("--no-attention", action="store_true")
    ap.add_argument("--gil", action="store_true",
                    help="also measure the GIL-held time per call (a separate pass)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run each case's rows this many times, processes and threads in turn, "
                         "and report the median of the rounds' ratios (a shared machine's drift "
                         "between the two rows then cancels)")
    ap.add_argument("--cases", default=None,
                    help="comma-separated: only the EP cases whose name has one of these "
                         "words (e.g. low_latency,expert_major)")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.backend:
        os.environ["SYMHEAP_BACKEND"] = args.backend
    import symheap
    from symheap.testing import run_processes, run_threads

    backend = symheap.backend()
    on_cuda = backend == "cuda"
    ndev = symheap.device_count()
    cases = CUDA_CASES if on_cuda else CPU_CASES
    if args.cases:
        wanted = args.cases.split(",")
        cases = [c for c in cases if set(c[0].split()) & set(wanted)]
    wide = min(8, ndev) if on_cuda else 8
    print(f"# backend {backend}, {ndev} device(s), iters {args.iters}; times in us per call "
          f"(slowest PE)", flush=True)
    env = {"SYMHEAP_BACKEND": backend}
    for case in cases:
        print(f"\n## EP {case[0]}")
        rows = [(f"{args.pes} processes", lambda n=args.pes: run_processes(
                    ep_program, n, args=(case, args.iters, args.gil), env=env, spread_devices=True)),
                (f"{args.pes} threads", lambda n=args.pes: run_threads(
                    ep_program, n, args=(case, args.iters, args.gil)))]
        if not args.skip_8 and wide != args.pes:
            rows += [(f"{wide} processes", lambda n=wide: run_processes(
                         ep_program, n, args=(case, args.iters, args.gil), env=env, spread_devices=True)),
                     (f"{wide} threads", lambda n=wide: run_threads(
                         ep_program, n, args=(case, args.iters, args.gil)))]
        ratios = {}  # PEs -> [(pair, median-block) ratio of each round]
        for rnd in range(args.rounds):
            if args.rounds > 1:
                print(f"  round {rnd + 1} of {args.rounds}")
            figures = {}
            for label, fn in rows:
                figures[label] = slowest(fn())
                print(f"  {label:<12} {fmt(figures[label])}", flush=True)
            for n in sorted({args.pes, wide}):
                p, t = figures.get(f"{n} processes"), figures.get(f"{n} threads")
                if p and t:
                    ratios.setdefault(n, []).append((t["pair"] / p["pair"], t["median"] / p["median"]))
                    print(f"  {n} PEs: threads / processes per pair = {t['pair'] / p['pair']:.2f}x "
                          f"(median blocks: {t['median'] / p['median']:.2f}x, "
                          f"best blocks: {t['best'] / p['best']:.2f}x; "
                          f"with per-call clocks: {t['clocked'] / p['clocked']:.2f}x)")
        if args.rounds > 1:
            for n, rs in sorted(ratios.items()):
                pair = sorted(r[0] for r in rs)
                block = sorted(r[1] for r in rs)
                print(f"  {n} PEs over {len(rs)} rounds: threads / processes per pair, median "
                      f"{statistics.median(pair):.2f}x (rounds {' '.join(f'{x:.2f}' for x in pair)}); "
                      f"median blocks, median {statistics.median(block):.2f}x")
    kinds = {"forward": ("S=128 H=8 D=64 bf16, causal" if on_cuda
                         else "S=4 H=8 D=64 float32 (cpu), causal"),
             "decode": ("1 query row, Hq=8 Hkv=2 D=64 bf16, 128 cached rows" if on_cuda
                        else "1 query row, Hq=8 Hkv=2 D=64 float32 (cpu), 16 cached rows")}
    for kind, shape in ({} if args.no_attention else kinds).items():
        print(f"\n## attention {kind} B=1 {shape}: host us per call")
        first = 0 if on_cuda else None
        r = attention_host_times(first, args.iters, kind=kind)
        print(f"  1 thread     symheap {r['symheap']:7.1f}  sdpa {r['sdpa']:7.1f}")
        n = min(2, ndev) if on_cuda else 2
        if n > 1:
            barrier, out = threading.Barrier(n), [None] * n

            def body(i, kind=kind):
                out[i] = attention_host_times(i if on_cuda else None, args.iters, barrier, kind)

            threads = [threading.Thread(target=body, args=(i,)) for i in range(n)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(600)
            for i, r in enumerate(out):
                print(f"  {n} threads, {'GPU' if on_cuda else 'thread'} {i}: symheap {r['symheap']:7.1f}  "
                      f"sdpa {r['sdpa']:7.1f}")


if __name__ == "__main__":
    main()
