"""Put bandwidth and latency between two GPUs, against message size.

PE 0 (GPU 0) writes into PE 1's heap (GPU 1) with
  sm_put      symheap's SM put (the device API's block-scope copy, one slice
              per block, grid from the cached occupancy; put(via="load_store"))
  ce_put      symheap's copy-engine channel (put(via="copy_engine"))
and, measured in the same run as references,
  memcpy_peer cudaMemcpyPeerAsync
  sm_copy     a plain 16-byte grid-stride copy kernel storing into peer memory
Every transfer is checked against its source (poisoned destination first).
Latency: 8-byte put_signal ping-pong between kernels on the two GPUs
(device API); one-way time = round trip / 2.

    python bench/shmem_bw.py [--max-size 1G] [--json out.json]
    python bench/shmem_bw.py --all-pairs 256M   # every ordered pair of all GPUs
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import os
import sys
import time

os.environ.setdefault("SYMHEAP_BACKEND", "cuda")
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

import torch  # noqa: E402

import symheap  # noqa: E402
from symheap import _core, _devtest  # noqa: E402
from symheap.testing import run_threads  # noqa: E402

METHODS = ("sm_put", "ce_put", "memcpy_peer", "sm_copy")


def sizes_between(lo: int, hi: int):
    s = lo
    while s <= hi:
        yield s
        s *= 2


def time_per_op(issue, finish, budget_s: float = 0.02) -> float:
    """Seconds per operation: back-to-back asynchronous issues, then one
    completion wait, timed on the host (the same clock for every method, and
    the only one that sees the copy-engine channel's stream)."""
    for _ in range(2):
        issue()
    finish()
    t0 = time.perf_counter()
    issue()
    finish()
    one = max(time.perf_counter() - t0, 1e-6)
    iters = int(min(max(budget_s / one, 5), 2000))
    t0 = time.perf_counter()
    for _ in range(iters):
        issue()
    finish()
    return (time.perf_counter() - t0) / iters


def bandwidth_sweep(max_size: int):
    me = symheap.my_pe()
    rows = []
    dst = symheap.empty((max_size,), "uint8")  # collective: every PE allocates
    try:
        if me == 0:
            rows = _measure(dst, list(sizes_between(8, max_size)), peer=1)
    finally:
        symheap.barrier_all()  # PE 1 waits here while PE 0 measures (or fails)
    symheap.free(dst)
    return rows


def all_pairs(size: int):
    """Every ordered pair (source PE, destination PE) in turn, one size."""
    me, n = symheap.my_pe(), symheap.n_pes()
    dst = symheap.empty((size,), "uint8")
    rows = []
    try:
        for src_pe in range(n):
            for dst_pe in range(n):
                if src_pe == dst_pe:
                    continue
                try:
                    if me == src_pe:
                        row = _measure(dst, [size], peer=dst_pe, quiet=True)[0]
                        rows.append(dict(row, src=src_pe, dst=dst_pe))
                finally:
                    symheap.barrier_all()  # one pair at a time
    finally:
        symheap.free(dst)
    return rows


def _measure(dst, sizes, peer: int, quiet: bool = False):
    rows = []
    dev = torch.device("cuda", symheap.current_device())
    peer_dev = symheap.device_of(peer)
    stream = torch.cuda.current_stream(dev)
    h = stream.cuda_stream
    peer_dst = symheap.peer_tensor(dst, peer)  # the peer's copy, as seen from this GPU
    src = torch.randint(0, 256, (max(sizes),), dtype=torch.uint8, device=dev)
    sm_count = torch.cuda.get_device_properties(dev).multi_processor_count
    peer_ptr, src_ptr = peer_dst.data_ptr(), src.data_ptr()
    for n in sizes:
        row = {"bytes": n}
        for method in METHODS:
            if method == "sm_copy" and n % 16:
                continue
            issue = {
                "sm_put": lambda: _core.bench_sm_put(dst.data_ptr(), src_ptr, n, peer, 0, h),
                "ce_put": lambda: _core.put(dst.data_ptr(), src_ptr, n, peer, h, "copy_engine"),
                "memcpy_peer": lambda: _devtest.memcpy_peer(peer_ptr, peer_dev, src_ptr,
                                                            dev.index, n, h),
                "sm_copy": lambda: _devtest.plain_copy(peer_ptr, src_ptr, n,
                                                       4 * sm_count, dev.index, h),
            }[method]
            torch.bitwise_not(src[:n], out=peer_dst[:n])  # poison: every byte differs
            torch.cuda.synchronize(dev)
            t = time_per_op(issue, lambda: symheap.quiet(stream))
            row[method] = {"us": t * 1e6, "GBps": n / t / 1e9,
                           "ok": bool(torch.equal(peer_dst[:n], src[:n]))}
        rows.append(row)
        if quiet:
            continue
        print("  measured", fmt_size(n), " ".join(
            f"{m} {row[m]['GBps']:.2f}" for m in METHODS if m in row), flush=True)
    return rows


def ping_pong(iters: int = 2000, variant: int = 0, runs: int = 3):
    me = symheap.my_pe()
    dev = torch.device("cuda", symheap.current_device())
    data = symheap.empty((1,), "uint64")
    sig = symheap.empty((1,), "uint64")
    out = []
    for _ in range(runs):
        data.zero_()
        sig.zero_()
        torch.cuda.synchronize(dev)
        symheap.barrier_all()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        stream = torch.cuda.current_stream(dev)
        start.record(stream)
        _devtest.ping_pong(symheap.device_context(), dev.index, data.data_ptr(), sig.data_ptr(),
                           1 - me, me == 0, iters, stream.cuda_stream, variant)
        end.record(stream)
        symheap.quiet(stream)
        ok = int(sig.item()) == iters and (variant >= 4 or int(data.item()) == iters)
        out.append({"one_way_us": start.elapsed_time(end) * 1e3 / (2 * iters), "ok": ok})
        symheap.barrier_all()
    symheap.free(data)
    symheap.free(sig)
    return out


# What each diagnostic variant of the ping-pong kernel keeps (src/devtest/devtest_kernels.cu).
LATENCY_VARIANTS = {
    1: "payload + release signal, acquire poll (peer pointers hoisted)",
    2: "payload + fence.acq_rel + relaxed signal, acquire poll",
    3: "payload + release signal, relaxed poll + one fence",
    4: "release signal only",
    5: "relaxed signal only (no ordering; lower bound)",
}


def pe_main(max_size: int, variants: bool):
    res = {"bw": bandwidth_sweep(max_size), "latency": ping_pong()}
    if variants:
        # Variant 0 (the library) ran first: both PEs are known to be live.
        res["variants"] = {v: ping_pong(variant=v) for v in LATENCY_VARIANTS}
    return res


def fmt_size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-size", default="1G")
    ap.add_argument("--json", default=None)
    ap.add_argument("--watchdog", type=float, default=300.0,
                    help="seconds after which stacks are dumped and the run stops")
    ap.add_argument("--latency-variants", action="store_true",
                    help="also time the ping-pong with parts of put_signal taken out")
    ap.add_argument("--all-pairs", default=None, metavar="SIZE",
                    help="instead of the sweep: every ordered GPU pair at this size, all GPUs")
    args = ap.parse_args()
    if symheap.backend() != "cuda" or symheap.device_count() < 2:
        sys.exit("shmem_bw needs the cuda backend and two GPUs")
    faulthandler.dump_traceback_later(args.watchdog, exit=True)  # never hang silently
    if args.all_pairs:
        sys.exit(report_all_pairs(_core.parse_size(args.all_pairs), args.json))
    max_size = _core.parse_size(args.max_size)
    heap = max_size + (16 << 20)  # the sweep buffer plus two signal words
    results = run_threads(pe_main, 2, args=(max_size, args.latency_variants),
                          init_kwargs={"heap_size": heap, "timeout": 600})
    rows, lat = results[0]["bw"], results[0]["latency"]
    print(f"device: {torch.cuda.get_device_name(0)} x2, torch {torch.__version__}")
    print("bandwidth GPU0 -> GPU1 (GB/s = 1e9 bytes/s), ratios vs the references of this run")
    print(f"{'size':>8} | " + " | ".join(f"{m:>11}" for m in METHODS) + " | sm/copy | ce/peer")
    all_ok = True
    for row in rows:
        cells = []
        for m in METHODS:
            c = row.get(m)
            if c is None:
                cells.append(f"{'n/a':>11}")
                continue
            all_ok &= c["ok"]
            cells.append(f"{c['GBps']:>9.2f}{'' if c['ok'] else ' !'}  ")
        r1 = row["sm_put"]["GBps"] / row["sm_copy"]["GBps"] if "sm_copy" in row else float("nan")
        r2 = row["ce_put"]["GBps"] / row["memcpy_peer"]["GBps"]
        print(f"{fmt_size(row['bytes']):>8} | " + " | ".join(cells) + f" | {r1:7.3f} | {r2:7.3f}")
    small = rows[0]
    print("8-byte issue-to-completion time (us): " +
          ", ".join(f"{m} {small[m]['us']:.2f}" for m in METHODS if m in small))
    best = min(x["one_way_us"] for x in lat)
    # A "summary" line, so that bench/ab.sh reports it.
    print("summary: 8-byte put_signal one-way latency (device ping-pong): "
          f"best {best:.2f} us, runs " +
          ", ".join(f"{x['one_way_us']:.2f}" for x in lat) +
          ("" if all(x["ok"] for x in lat) else "  (WRONG DATA)"))
    for v, runs in results[0].get("variants", {}).items():
        print(f"  ping-pong variant {v} ({LATENCY_VARIANTS[v]}): best "
              f"{min(x['one_way_us'] for x in runs):.2f} us" +
              ("" if all(x["ok"] for x in runs) else "  (WRONG DATA)"))
    big = [r for r in rows if r["bytes"] >= 64 << 20]
    if big:
        last = rows[-1]
        print(f"summary @ {fmt_size(last['bytes'])}: sm_put {last['sm_put']['GBps']:.1f} GB/s "
              f"({last['sm_put']['GBps'] / last['sm_copy']['GBps']:.3f} of sm_copy), ce_put "
              f"{last['ce_put']['GBps']:.1f} GB/s "
              f"({last['ce_put']['GBps'] / last['memcpy_peer']['GBps']:.3f} of memcpy_peer); "
              f"min ce/peer ratio from 64 MiB: "
              f"{min(r['ce_put']['GBps'] / r['memcpy_peer']['GBps'] for r in big):.3f}")
    print("all transfers verified" if all_ok else "SOME TRANSFERS DELIVERED WRONG DATA (!)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "latency": lat,
                       "device": torch.cuda.get_device_name(0)}, f, indent=1)
    sys.exit(0 if all_ok and all(x["ok"] for x in lat) else 1)


def report_all_pairs(size: int, json_path) -> int:
    n = symheap.device_count()
    results = run_threads(all_pairs, n, args=(size,),
                          init_kwargs={"heap_size": size + (16 << 20), "timeout": 600})
    rows = [r for pe in results for r in pe]
    print(f"device: {torch.cuda.get_device_name(0)} x{n}, torch {torch.__version__}")
    print(f"bandwidth of every ordered pair at {fmt_size(size)} (GB/s), references of this run")
    print(f"{'pair':>6} | " + " | ".join(f"{m:>11}" for m in METHODS) + " | sm/copy | ce/peer")
    ok = True
    for r in rows:
        ok &= all(r[m]["ok"] for m in METHODS if m in r)
        cells = [f"{r[m]['GBps']:>9.2f}{'' if r[m]['ok'] else ' !'}  " for m in METHODS]
        print(f"{r['src']:>2}->{r['dst']:<2} | " + " | ".join(cells) +
              f" | {r['sm_put']['GBps'] / r['sm_copy']['GBps']:7.3f}"
              f" | {r['ce_put']['GBps'] / r['memcpy_peer']['GBps']:7.3f}")

    def span(m):
        v = [r[m]["GBps"] for r in rows]
        return f"{m} {min(v):.1f}-{max(v):.1f} GB/s"
    print(f"summary all-pairs @ {fmt_size(size)} over {len(rows)} pairs: " +
          ", ".join(span(m) for m in METHODS) +
          f"; min sm/copy {min(r['sm_put']['GBps'] / r['sm_copy']['GBps'] for r in rows):.3f}"
          f", min ce/peer {min(r['ce_put']['GBps'] / r['memcpy_peer']['GBps'] for r in rows):.3f}")
    print("all transfers verified" if ok else "SOME TRANSFERS DELIVERED WRONG DATA (!)")
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"pairs": rows, "device": torch.cuda.get_device_name(0)}, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    main()
