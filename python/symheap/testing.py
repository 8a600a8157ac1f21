"""Launch helpers for tests and examples: run a function as N PEs.

``run_threads`` puts every PE in this process (one thread per device);
``run_processes`` starts processes (optionally several PE threads each). Each
PE calls ``init``, runs ``fn(*args)``, and ``finalize``. Results come back in
rank order; an exception in any PE is re-raised here naming the PE.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import queue
import threading
import time
import traceback

import symheap


class PeFailure(RuntimeError):
    """One or more PEs raised; ``errors`` maps rank -> (exception type name, message)."""

    def __init__(self, errors: dict):
        self.errors = errors
        lines = [f"PE {r}: {t}: {m}" for r, (t, m, _) in sorted(errors.items())]
        super().__init__("; ".join(lines))


def _with_origin(e: BaseException) -> str:
    """The message, plus the first exception of the chain when a later one (a
    cleanup that failed too) hid it."""
    root = e
    while (root.__cause__ or root.__context__) is not None:
        root = root.__cause__ or root.__context__
    if root is e:
        return str(e)
    return f"{e} [first error: {type(root).__name__}: {str(root)[:2000]}]"


def _run_pe(fn, args, rank, world, uid, device, init_kwargs, finalize):
    symheap.init(rank, world, uid, device=device, **init_kwargs)
    try:
        return fn(*args)
    finally:
        if finalize:
            symheap.set_device(device)  # fn may have left another device current
            if symheap.is_initialized():
                symheap.finalize()


def _thread_group(fn, args, ranks, world, uid, devices, init_kwargs, finalize, join_timeout):
    results, errors = {}, {}

    def body(rank, device):
        try:
            results[rank] = _run_pe(fn, args, rank, world, uid, device, init_kwargs, finalize)
        except BaseException as e:  # reported to the caller with the PE's rank
            errors[rank] = (type(e).__name__, _with_origin(e), traceback.format_exc())

    threads = [threading.Thread(target=body, args=(r, d), name=f"pe{r}", daemon=True)
               for r, d in zip(ranks, devices)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(join_timeout)
    for r, t in zip(ranks, threads):
        if t.is_alive():
            errors.setdefault(r, ("TimeoutError", f"PE {r} thread still running after "
                                  f"{join_timeout} s", ""))
    return results, errors


def run_threads(fn, n_pes: int, args=(), *, devices=None, init_kwargs=None, finalize=True,
                join_timeout: float = 300.0):
    """Runs ``fn(*args)`` as ``n_pes`` PEs, one thread per device, in this process."""
    uid = symheap.get_unique_id()
    devices = list(range(n_pes)) if devices is None else list(devices)
    results, errors = _thread_group(fn, args, list(range(n_pes)), n_pes, uid, devices,
                                    init_kwargs or {}, finalize, join_timeout)
    if errors:
        raise PeFailure(errors)
    return [results[r] for r in range(n_pes)]


def _process_main(fn, args, first_rank, devices, world, uid, init_kwargs, finalize, env, out):
    os.environ.update(env)
    ranks = list(range(first_rank, first_rank + len(devices)))
    results, errors = _thread_group(fn, args, ranks, world, uid, devices,
                                    init_kwargs, finalize, 300.0)
    out.put((results, errors))


def run_processes(fn, n_procs: int, args=(), *, threads_per_proc: int = 1, init_kwargs=None,
                  finalize=True, env=None, env_per_proc=None, timeout: float = 300.0,
                  spread_devices: bool = False):
    """Runs ``fn(*args)`` as ``n_procs * threads_per_proc`` PEs: processes started
    with the spawn method, each driving ``threads_per_proc`` devices from threads
    (devices 0, 1, ... in every process; with ``spread_devices``, process i
    takes devices i * threads_per_proc onwards, so no two PEs share one).
    ``fn`` must be importable (defined at module level). ``env`` is added to every
    process's environment, ``env_per_proc[i]`` to process i's."""
    ctx = mp.get_context("spawn")
    uid = symheap.get_unique_id()
    world = n_procs * threads_per_proc

    def devices(p):
        first = p * threads_per_proc if spread_devices else 0
        return list(range(first, first + threads_per_proc))

    out = ctx.Queue()
    procs = [ctx.Process(target=_process_main,
                         args=(fn, args, p * threads_per_proc, devices(p), world, uid,
                               init_kwargs or {}, finalize,
                               {**(env or {}), **((env_per_proc or [{}] * n_procs)[p])}, out))
             for p in range(n_procs)]
    for p in procs:
        p.start()
    results, errors = {}, {}
    deadline, reports = time.monotonic() + timeout, 0
    while reports < len(procs) and time.monotonic() < deadline:
        try:
            r, e = out.get(timeout=0.2)
        except queue.Empty:
            if not any(p.is_alive() for p in procs) and out.empty():
                break  # a process died without reporting
            continue
        reports += 1
        results.update(r)
        errors.update(e)
    for p in procs:
        p.join(10)
        if p.is_alive():
            p.kill()
    for i, p in enumerate(procs):
        for t in range(threads_per_proc):
            rank = i * threads_per_proc + t
            if rank not in results and rank not in errors:
                errors[rank] = ("ProcessError", f"process {i} exited with code {p.exitcode} "
                                "before reporting", "")
    if errors:
        raise PeFailure(errors)
    return [results[r] for r in range(world)]
