"""One process per GPU: PE r runs in its own process on device devices[r]
(symheap.testing.run_processes puts every process on device 0)."""
from __future__ import annotations

import multiprocessing as mp
import queue
import traceback

import symheap


def _main(fn, args, rank, world, uid, device, init_kwargs, out):
    try:
        symheap.init(rank, world, uid, device=device, **init_kwargs)
        try:
            result = fn(*args)
        finally:
            symheap.finalize()
        out.put((rank, True, result))
    except BaseException as e:  # reported to the parent with the rank
        out.put((rank, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def run_process_per_device(fn, devices, args=(), init_kwargs=None, timeout=240.0):
    ctx = mp.get_context("spawn")
    uid = symheap.get_unique_id()
    out = ctx.Queue()
    world = len(devices)
    procs = [ctx.Process(target=_main, args=(fn, args, r, world, uid, d, init_kwargs or {}, out))
             for r, d in enumerate(devices)]
    for p in procs:
        p.start()
    results, errors = {}, {}
    for _ in procs:
        try:
            rank, ok, value = out.get(timeout=timeout)
        except queue.Empty:
            break
        (results if ok else errors)[rank] = value
    for p in procs:
        p.join(15)
        if p.is_alive():
            p.kill()
    missing = [r for r in range(world) if r not in results and r not in errors]
    if errors or missing:
        lines = [f"PE {r}: {m}" for r, m in sorted(errors.items())]
        lines += [f"PE {r}: no result (process exit code {procs[r].exitcode})" for r in missing]
        raise RuntimeError("\n".join(lines))
    return [results[r] for r in range(world)]
