"""Decode attention over a paged KV cache on CUDA: bytes of K and V read per
second against the device-to-device copy bandwidth measured in the same run
(the memory bound), and torch SDPA over the same cache gathered dense.

bf16, Hq 32 over Hkv 8, D 128, one query row per sequence, every sequence
holding `cache` rows, paged in 256-row blocks in a shuffled order. Times are
medians of CUDA-event timed CUDA-graph replays (launch overhead excluded for
both sides). Copy bandwidth counts the bytes read plus the bytes written.
With several CUDA decode kernels ("fused": one launch, at most 16 splits merged
in a cluster; "fused-tickets": one launch, splits merged through workspace tickets;
"split": append, attention and combine kernels), each is timed on the same
data and the table gets a column group per kernel.

    python bench/attn_bench.py --decode [--decode-kernels fused,fused-tickets,split]
                                        [--json out.json] [--quick]
"""
from __future__ import annotations

import json
import statistics

import torch
import torch.nn.functional as F

from symheap import _core
from symheap.attention import flash_attn_with_kvcache, kvcache_check

HQ, HKV, D, BLOCK = 32, 8, 128, 256
BATCHES = [1, 4, 16, 64, 128]
CACHES = [1024, 4096, 16384, 65536, 131072]
MAX_CACHE_BYTES = 12 << 30  # K+V of one layout; SDPA's dense copy needs as much again


def graph_time_us(fn, calls=20, reps=7):
    """Median time of one call, from replays of a graph of `calls` calls."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def copy_bandwidth(nbytes=2 << 30):
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = graph_time_us(lambda: dst.copy_(src), calls=5)
    return 2 * nbytes / (us * 1e-6)  # read + write


def bench_case(B, L, copy_bw, reps, kernels):
    gen = torch.Generator(device="cuda").manual_seed(0)
    blocks_per_seq = L // BLOCK
    num_blocks = B * blocks_per_seq
    k_cache = torch.randn((num_blocks, BLOCK, HKV, D), device="cuda", dtype=torch.bfloat16, generator=gen)
    v_cache = torch.randn_like(k_cache)
    table = torch.randperm(num_blocks, device="cuda", generator=gen).to(torch.int32).view(B, blocks_per_seq)
    q = torch.randn((B, 1, HQ, D), device="cuda", dtype=torch.bfloat16, generator=gen)
    seqlens = torch.full((B,), L, dtype=torch.int32, device="cuda")

    def ours():
        return flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, block_table=table)

    kv_bytes = 2 * B * L * HKV * D * 2
    row = {"batch": B, "cache": L, "kv_bytes": kv_bytes, "kernels": {}}
    outs = {}
    for name in kernels:
        _core.attention_decode_kernel(name)  # a graph keeps the kernels of its capture
        t = graph_time_us(ours, reps=reps)
        kvcache_check()
        row["kernels"][name] = {"us": t, "GBps": kv_bytes / (t * 1e-6) / 1e9,
                                "fraction_of_copy_bw": kv_bytes / (t * 1e-6) / copy_bw}
        outs[name] = ours()
    first = row["kernels"][kernels[0]]
    # The first kernel's numbers also under the keys of earlier runs' JSON.
    row.update(symheap_us=first["us"], symheap_GBps=first["GBps"],
               fraction_of_copy_bw=first["fraction_of_copy_bw"])
    # SDPA over the same cache gathered dense: (B, Hkv, L, D), GQA inside SDPA.
    kd = k_cache[table.long()].reshape(B, L, HKV, D).transpose(1, 2).contiguous()
    vd = v_cache[table.long()].reshape(B, L, HKV, D).transpose(1, 2).contiguous()
    del k_cache, v_cache
    qt = q.transpose(1, 2)

    def sdpa():
        return F.scaled_dot_product_attention(qt, kd, vd, enable_gqa=True)

    try:
        row["sdpa_us"] = graph_time_us(sdpa, reps=reps)
        ref = sdpa().transpose(1, 2).float()
        for name in kernels:
            k = row["kernels"][name]
            k["speedup_vs_sdpa"] = row["sdpa_us"] / k["us"]
            k["max_abs_diff_vs_sdpa"] = (outs[name].float() - ref).abs().max().item()
        row["speedup_vs_sdpa"] = first["speedup_vs_sdpa"]
        row["max_abs_diff_vs_sdpa"] = first["max_abs_diff_vs_sdpa"]
    except Exception as e:  # a backend may be unavailable for a shape
        row["sdpa_error"] = f"{type(e).__name__}: {e}"[:200]
    return row


def main(json_path=None, quick=False, kernels=None):
    torch.backends.cuda.matmul.allow_tf32 = False
    initial = _core.attention_decode_kernel()
    kernels = kernels or [initial]
    for name in kernels:
        _core.attention_decode_kernel(name)  # raises ValueError for an unknown name
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"decode kernels {', '.join(kernels)}")
    copy_bw = copy_bandwidth()
    print(f"device-to-device copy: {copy_bw / 1e9:.0f} GB/s (read + write)")
    rows = []
    try:
        for B in BATCHES:
            for L in CACHES:
                if quick and (B not in (1, 16, 128) or L not in (1024, 16384, 131072)):
                    continue
                kv_bytes = 2 * B * L * HKV * D * 2
                if kv_bytes > MAX_CACHE_BYTES:
                    rows.append({"batch": B, "cache": L, "skipped": f"K+V {kv_bytes >> 30} GiB"})
                    continue
                rows.append(bench_case(B, L, copy_bw, 3 if quick else 7, kernels))
                torch.cuda.empty_cache()
    finally:
        _core.attention_decode_kernel(initial)
    head = " | ".join(f"{name + ' us':>10} {'GB/s':>6} {'of copy':>7} {'vs SDPA':>7}" for name in kernels)
    print(f"{'batch':>5} {'cache':>7} | {head} | {'SDPA us':>8} | max|diff|")
    worst = {}
    for r in rows:
        if "skipped" in r:
            print(f"{r['batch']:>5} {r['cache']:>7} | skipped ({r['skipped']} > the limit)")
            continue
        cells, diffs = [], []
        for name in kernels:
            k = r["kernels"][name]
            sp = f"{k['speedup_vs_sdpa']:6.2f}x" if "speedup_vs_sdpa" in k else "    n/a"
            cells.append(f"{k['us']:10.1f} {k['GBps']:6.0f} {100 * k['fraction_of_copy_bw']:6.1f}% {sp}")
            if "max_abs_diff_vs_sdpa" in k:
                diffs.append(f"{k['max_abs_diff_vs_sdpa']:.2e}")
            if r["cache"] * r["batch"] >= 65536:  # large enough to be bandwidth-bound
                w = worst.get(name)
                if w is None or k["fraction_of_copy_bw"] < w["kernels"][name]["fraction_of_copy_bw"]:
                    worst[name] = r
        sd = f"{r['sdpa_us']:8.1f}" if "sdpa_us" in r else "     n/a"
        print(f"{r['batch']:>5} {r['cache']:>7} | {' | '.join(cells)} | {sd} | {'/'.join(diffs) or 'n/a'}")
    for name, w in worst.items():
        print(f"summary ({name}): decode min {100 * w['kernels'][name]['fraction_of_copy_bw']:.1f}% of copy "
              f"bandwidth over cases with >= 64k cached rows in all (batch {w['batch']}, cache {w['cache']})")
    for name in kernels:
        sp = [r["kernels"][name]["speedup_vs_sdpa"] for r in rows
              if "kernels" in r and "speedup_vs_sdpa" in r["kernels"][name]]
        if sp:
            print(f"summary ({name}): speedup vs SDPA min {min(sp):.2f}x, median {statistics.median(sp):.2f}x")
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"copy_bw": copy_bw, "kernels": kernels, "rows": rows}, f, indent=1)
