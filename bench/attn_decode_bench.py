"""Decode attention over a paged KV cache on CUDA: bytes of K and V read per
second against the device-to-device copy bandwidth measured in the same run
(the memory bound), and torch SDPA over the same cache gathered dense.

bf16, Hq 32 over Hkv 8, D 128, one query row per sequence, every sequence
holding `cache` rows, paged in 256-row blocks in a shuffled order. Times are
medians of CUDA-event timed CUDA-graph replays (launch overhead excluded for
both sides). Copy bandwidth counts the bytes read plus the bytes written.

    python bench/attn_bench.py --decode [--json out.json] [--quick]
    python bench/attn_bench.py --decode --decode-splits 0,1,2,4,8,16,32   (split sweep)
    python bench/attn_bench.py --decode --decode-compare previous   (also the previous kernel)
    python bench/attn_bench.py --decode --decode-cold   (L2 warm against cold, ours and SDPA)
    python bench/attn_bench.py --decode --decode-layouts   (our call over four layouts of one cache)
    python bench/attn_bench.py --decode --decode-kernels [--decode-query-rows 4]   (every kernel, forced)
    python bench/attn_bench.py --decode --decode-eager   (eager calls: host time and back to back)

--decode-batches and --decode-caches pick the rows of the split sweep, of
--decode-cold, of --decode-layouts, of --decode-kernels and of --decode-eager. Warm: a graph of 20 calls on one cache
(as the table rows; small caches then partly stay in L2 between calls). Cold:
each call of the graph on its own copy, 256-512 MB in all, as a model's layers
read their caches.

--decode-compare NAME also times each row (each split count in the sweep) with
SYMHEAP_DECODE_KERNEL=NAME, in the same process: the kernel is chosen when a
call's graph is captured. NAME `kernel_merge` instead sets
SYMHEAP_DECODE_MERGE=kernel (the splits merged by the combine kernel, not in a
thread-block cluster).
"""
from __future__ import annotations

import contextlib
import json
import os
import statistics
import time

import torch
import torch.nn.functional as F

from symheap.attention import flash_attn_with_kvcache, kvcache_check

HQ, HKV, D, BLOCK = 32, 8, 128, 256
BATCHES = [1, 4, 16, 64, 128]
CACHES = [1024, 4096, 16384, 65536, 131072]
MAX_CACHE_BYTES = 12 << 30  # K+V of one layout; SDPA's dense copy needs as much again


def graph_time_us(fn, calls=20, reps=7):
    """Median time of one call, from replays of a graph of `calls` calls."""
    return graph_calls_us([fn] * calls, reps)


@contextlib.contextmanager
def decode_kernel(name):
    """Calls made (graphs captured) inside run SYMHEAP_DECODE_KERNEL=name, or with
    name "kernel_merge" SYMHEAP_DECODE_MERGE=kernel (None: as set)."""
    if name is None:
        yield
        return
    var, value = ("SYMHEAP_DECODE_MERGE", "kernel") if name == "kernel_merge" else \
        ("SYMHEAP_DECODE_KERNEL", name)
    old = os.environ.get(var)
    os.environ[var] = value
    try:
        yield
    finally:
        if old is None:
            del os.environ[var]
        else:
            os.environ[var] = old


def copy_bandwidth(nbytes=2 << 30):
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = graph_time_us(lambda: dst.copy_(src), calls=5)
    return 2 * nbytes / (us * 1e-6)  # read + write


def make_case(B, L, query_rows=1):
    gen = torch.Generator(device="cuda").manual_seed(0)
    blocks_per_seq = L // BLOCK
    num_blocks = B * blocks_per_seq
    k_cache = torch.randn((num_blocks, BLOCK, HKV, D), device="cuda", dtype=torch.bfloat16, generator=gen)
    v_cache = torch.randn_like(k_cache)
    table = torch.randperm(num_blocks, device="cuda", generator=gen).to(torch.int32).view(B, blocks_per_seq)
    q = torch.randn((B, query_rows, HQ, D), device="cuda", dtype=torch.bfloat16, generator=gen)
    seqlens = torch.full((B,), L, dtype=torch.int32, device="cuda")
    return q, k_cache, v_cache, table, seqlens


def gathered(cache, table):
    """The paged cache gathered dense, (B, L, Hkv, D) in the order the table gives."""
    B = table.shape[0]
    return cache[table.long()].reshape(B, -1, HKV, D)


def gathered_head_major(cache, table):
    """The paged cache gathered dense as SDPA reads it: a contiguous (B, Hkv, L, D)."""
    return gathered(cache, table).transpose(1, 2).contiguous()


def bench_case(B, L, copy_bw, reps, compare=None):
    q, k_cache, v_cache, table, seqlens = make_case(B, L)

    def ours():
        return flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, block_table=table)

    kv_bytes = 2 * B * L * HKV * D * 2
    row = {"batch": B, "cache": L, "kv_bytes": kv_bytes}
    t = graph_time_us(ours, reps=reps)
    kvcache_check()
    out = ours()
    if compare:
        with decode_kernel(compare):
            row["compare_us"] = graph_time_us(ours, reps=reps)
            kvcache_check()
            row["compare_max_abs_diff"] = (ours().float() - out.float()).abs().max().item()
    row["symheap_us"] = t
    row["symheap_GBps"] = kv_bytes / (t * 1e-6) / 1e9
    row["fraction_of_copy_bw"] = kv_bytes / (t * 1e-6) / copy_bw
    # SDPA over the same cache gathered dense: (B, Hkv, L, D), GQA inside SDPA.
    kd, vd = gathered_head_major(k_cache, table), gathered_head_major(v_cache, table)
    del k_cache, v_cache
    qt = q.transpose(1, 2)

    def sdpa():
        return F.scaled_dot_product_attention(qt, kd, vd, enable_gqa=True)

    try:
        row["sdpa_us"] = graph_time_us(sdpa, reps=reps)
        row["speedup_vs_sdpa"] = row["sdpa_us"] / t
        row["max_abs_diff_vs_sdpa"] = (out.float() - sdpa().transpose(1, 2).float()).abs().max().item()
    except Exception as e:  # a backend may be unavailable for a shape
        row["sdpa_error"] = f"{type(e).__name__}: {e}"[:200]
    return row


def main(json_path=None, quick=False, compare=None):
    torch.backends.cuda.matmul.allow_tf32 = False
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    copy_bw = copy_bandwidth()
    print(f"device-to-device copy: {copy_bw / 1e9:.0f} GB/s (read + write)")
    rows = []
    for B in BATCHES:
        for L in CACHES:
            if quick and (B not in (1, 16, 128) or L not in (1024, 16384, 131072)):
                continue
            kv_bytes = 2 * B * L * HKV * D * 2
            if kv_bytes > MAX_CACHE_BYTES:
                rows.append({"batch": B, "cache": L, "skipped": f"K+V {kv_bytes >> 30} GiB"})
                continue
            rows.append(bench_case(B, L, copy_bw, reps=3 if quick else 7, compare=compare))
            torch.cuda.empty_cache()
    cmp_head = f" | {compare + ' us':>12} {'ours/' + compare:>8}" if compare else ""
    print(f"{'batch':>5} {'cache':>7} | {'symheap us':>10} {'GB/s':>6} {'of copy':>7} | "
          f"{'SDPA us':>8} {'speedup':>7} | max|diff|" + cmp_head)
    worst = None
    for r in rows:
        if "skipped" in r:
            print(f"{r['batch']:>5} {r['cache']:>7} | skipped ({r['skipped']} > the limit)")
            continue
        sd = f"{r['sdpa_us']:8.1f} {r['speedup_vs_sdpa']:6.2f}x" if "sdpa_us" in r else "     n/a        "
        diff = f"{r['max_abs_diff_vs_sdpa']:.2e}" if "max_abs_diff_vs_sdpa" in r else "n/a"
        cmp = ""
        if "compare_us" in r:
            cmp = f" | {r['compare_us']:12.1f} {r['symheap_us'] / r['compare_us']:7.2f}x"
        print(f"{r['batch']:>5} {r['cache']:>7} | {r['symheap_us']:10.1f} {r['symheap_GBps']:6.0f} "
              f"{100 * r['fraction_of_copy_bw']:6.1f}% | {sd} | {diff}" + cmp)
        if r["cache"] * r["batch"] >= 65536:  # large enough to be bandwidth-bound
            worst = r if worst is None or r["fraction_of_copy_bw"] < worst["fraction_of_copy_bw"] else worst
    if worst:
        print(f"summary: decode min {100 * worst['fraction_of_copy_bw']:.1f}% of copy bandwidth "
              f"over cases with >= 64k cached rows in all (batch {worst['batch']}, cache {worst['cache']})")
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"copy_bw": copy_bw, "rows": rows}, f, indent=1)


def splits_sweep(splits, batches=(1, 4, 16), caches=(1024, 4096, 16384), compare=None):
    """Our time per call for each key-length split count (0: the automatic
    choice) on the latency-bound rows, next to SDPA over the dense cache; with
    `compare`, a second line per row with SYMHEAP_DECODE_KERNEL=compare."""
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"{'batch':>5} {'cache':>6} {'kernel':>8} | " +
          " ".join(f"{'auto' if n == 0 else n:>7}" for n in splits) + f" | {'SDPA':>7}   (us per call)")
    for B in batches:
        for L in caches:
            q, k_cache, v_cache, table, seqlens = make_case(B, L)
            lines = []
            for kernel in [None] + ([compare] if compare else []):
                times = []
                with decode_kernel(kernel):
                    for n in splits:
                        times.append(graph_time_us(lambda: flash_attn_with_kvcache(
                            q, k_cache, v_cache, cache_seqlens=seqlens, block_table=table, num_splits=n)))
                    kvcache_check()
                lines.append((kernel or "default", times))
            kd, vd = gathered_head_major(k_cache, table), gathered_head_major(v_cache, table)
            qt = q.transpose(1, 2)
            t_sdpa = graph_time_us(lambda: F.scaled_dot_product_attention(qt, kd, vd, enable_gqa=True))
            for kernel, times in lines:
                print(f"{B:>5} {L:>6} {kernel:>8} | " + " ".join(f"{t:7.1f}" for t in times) +
                      f" | {t_sdpa:7.1f}")


def graph_calls_us(fns, reps=7):
    """Median time of one call, from replays of a graph making each call of `fns` once."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for fn in fns[:2]:
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(fns))
    return statistics.median(times)


def eager(batches=(1, 4, 16, 128), caches=(1024, 16384), calls=200, rounds=3):
    """What an eager caller sees, ours and SDPA in alternate rounds (medians): the
    host time of a call (the Python call's own time; the GPU's queue is not
    drained, so a call that launches its kernels and returns costs only that) and
    the time a call takes back to back (CUDA events over `calls` calls: the larger
    of the host's and the GPU's time)."""
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}; {calls} calls a "
          f"round, {rounds} rounds, medians")
    print(f"{'batch':>5} {'cache':>6} | {'ours host':>9} {'SDPA host':>9} {'ratio':>6} | "
          f"{'ours b2b':>9} {'SDPA b2b':>9} {'ratio':>6}   (us per call; ratio: SDPA / ours)")
    for B in batches:
        for L in caches:
            if 2 * B * L * HKV * D * 2 > MAX_CACHE_BYTES:
                continue
            q, k_cache, v_cache, table, seqlens = make_case(B, L)
            kd, vd = gathered_head_major(k_cache, table), gathered_head_major(v_cache, table)
            qt = q.transpose(1, 2)
            fns = {"ours": lambda: flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens,
                                                           block_table=table),
                   "SDPA": lambda: F.scaled_dot_product_attention(qt, kd, vd, enable_gqa=True)}
            host, b2b = {k: [] for k in fns}, {k: [] for k in fns}
            for fn in fns.values():
                for _ in range(10):
                    fn()
            for _ in range(rounds):
                for name, fn in fns.items():
                    torch.cuda.synchronize()
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    t0 = time.perf_counter()
                    for _ in range(calls):
                        fn()
                    t1 = time.perf_counter()
                    end.record()
                    end.synchronize()
                    host[name].append((t1 - t0) * 1e6 / calls)
                    b2b[name].append(start.elapsed_time(end) * 1e3 / calls)
            kvcache_check()
            h = {k: statistics.median(v) for k, v in host.items()}
            g = {k: statistics.median(v) for k, v in b2b.items()}
            print(f"{B:>5} {L:>6} | {h['ours']:9.1f} {h['SDPA']:9.1f} {h['SDPA'] / h['ours']:5.2f}x | "
                  f"{g['ours']:9.1f} {g['SDPA']:9.1f} {g['SDPA'] / g['ours']:5.2f}x")
            del q, k_cache, v_cache, kd, vd, qt, fns
            torch.cuda.empty_cache()


def warm_and_cold(batches=(1, 4, 16), caches=(1024, 4096, 16384)):
    """Ours (automatic choices) and SDPA with the L2 warm and cold, best of two rounds each."""
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"{'batch':>5} {'cache':>6} | {'ours warm':>9} {'SDPA warm':>9} | {'ours cold':>9} "
          f"{'SDPA cold':>9} | cold: ours/SDPA speed, copies   (us per call)")
    for B in batches:
        for L in caches:
            kv_bytes = 2 * B * L * HKV * D * 2
            copies = max(20, min(64, (512 << 20) // kv_bytes))
            ours, sdpa = [], []
            for _ in range(copies):
                q, k_cache, v_cache, table, seqlens = make_case(B, L)
                kd, vd = gathered_head_major(k_cache, table), gathered_head_major(v_cache, table)
                ours.append(lambda a=(q, k_cache, v_cache, seqlens, table): flash_attn_with_kvcache(
                    a[0], a[1], a[2], cache_seqlens=a[3], block_table=a[4]))
                sdpa.append(lambda a=(q.transpose(1, 2), kd, vd):
                            F.scaled_dot_product_attention(*a, enable_gqa=True))
            err = (ours[0]().float() - sdpa[0]().transpose(1, 2).float()).abs().max().item()
            warm = [min(graph_time_us(f[0]) for _ in range(2)) for f in (ours, sdpa)]
            cold = [min(graph_calls_us(f) for _ in range(2)) for f in (ours, sdpa)]
            kvcache_check()
            print(f"{B:>5} {L:>6} | {warm[0]:9.1f} {warm[1]:9.1f} | {cold[0]:9.1f} {cold[1]:9.1f} | "
                  f"{cold[1] / cold[0]:.2f}x, {copies}   max|diff| {err:.1e}")
            del ours, sdpa
            torch.cuda.empty_cache()


def layouts(batches=(1, 4, 16), caches=(1024, 4096, 16384)):
    """Our call over one cache in four layouts, next to SDPA: paged blocks as the
    bench stores them [blocks, 256, Hkv, D], head-major paged blocks (a permuted
    view of [blocks, Hkv, 256, D]; the call takes any strides), dense (B, L, Hkv,
    D), and dense head-major (a view of SDPA's own (B, Hkv, L, D) copy: the bytes
    SDPA reads). Best of two rounds, us per call."""
    names = ["paged", "paged_hnd", "dense", "dense_hnd"]
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"{'batch':>5} {'cache':>6} | " + " ".join(f"{n:>9}" for n in names) +
          f" | {'SDPA':>7} | dense_hnd / SDPA speed, max|diff|   (us per call)")
    for B in batches:
        for L in caches:
            q, k_cache, v_cache, table, seqlens = make_case(B, L)
            head_major = lambda c: c.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)  # noqa: E731
            kh, vh = head_major(k_cache), head_major(v_cache)
            kd, vd = gathered(k_cache, table), gathered(v_cache, table)
            kt, vt = kd.transpose(1, 2).contiguous(), vd.transpose(1, 2).contiguous()
            qt = q.transpose(1, 2)
            calls = {
                "paged": lambda: flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens,
                                                         block_table=table),
                "paged_hnd": lambda: flash_attn_with_kvcache(q, kh, vh, cache_seqlens=seqlens, block_table=table),
                "dense": lambda: flash_attn_with_kvcache(q, kd, vd, cache_seqlens=seqlens),
                "dense_hnd": lambda: flash_attn_with_kvcache(q, kt.transpose(1, 2), vt.transpose(1, 2),
                                                             cache_seqlens=seqlens),
            }
            sdpa = lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)  # noqa: E731
            ref = sdpa().transpose(1, 2).float()
            err = max((calls[n]().float() - ref).abs().max().item() for n in names)
            t = {n: min(graph_time_us(calls[n]) for _ in range(2)) for n in names}
            t_sdpa = min(graph_time_us(sdpa) for _ in range(2))
            kvcache_check()
            print(f"{B:>5} {L:>6} | " + " ".join(f"{t[n]:9.1f}" for n in names) +
                  f" | {t_sdpa:7.1f} | {t_sdpa / t['dense_hnd']:.2f}x, {err:.1e}")
            del k_cache, v_cache, kh, vh, kd, vd, kt, vt
            torch.cuda.empty_cache()


KERNELS = ["auto", "previous", "keys_major", "keys_major_x2"]


def kernels_sweep(batches=(4, 16, 32, 64, 128, 256), caches=(1024, 4096, 8192), query_rows=1):
    """Our call with each attention kernel forced (SYMHEAP_DECODE_KERNEL; "auto" is
    the automatic choice), next to SDPA, all in one process: where the rules that
    pick a kernel stand. Best of two rounds (the second in reverse order), us per call."""
    if query_rows < 1:
        raise ValueError(f"--decode-query-rows must be at least 1, got {query_rows}")
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"{query_rows} query row(s) per sequence")
    print(f"{'batch':>5} {'cache':>6} | " + " ".join(f"{k:>13}" for k in KERNELS) +
          f" | {'SDPA':>7}   (us per call; max|diff| against SDPA over every kernel)")
    for B in batches:
        for L in caches:
            q, k_cache, v_cache, table, seqlens = make_case(B, L, query_rows)
            kt, vt = gathered_head_major(k_cache, table), gathered_head_major(v_cache, table)
            qt = q.transpose(1, 2)
            sdpa = lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)  # noqa: E731
            ours = lambda: flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens,  # noqa: E731
                                                   block_table=table)
            ref = sdpa().transpose(1, 2).float()
            times, err = {k: [] for k in KERNELS + ["SDPA"]}, 0.0
            for order in (KERNELS, KERNELS[::-1]):
                for k in order:
                    with decode_kernel(k):
                        times[k].append(graph_time_us(ours))
                        err = max(err, (ours().float() - ref).abs().max().item())
                times["SDPA"].append(graph_time_us(sdpa))
            kvcache_check()
            print(f"{B:>5} {L:>6} | " + " ".join(f"{min(times[k]):13.1f}" for k in KERNELS) +
                  f" | {min(times['SDPA']):7.1f}   {err:.1e}")
            del q, k_cache, v_cache, kt, vt
            torch.cuda.empty_cache()
