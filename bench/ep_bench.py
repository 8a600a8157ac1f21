"""Expert-parallel dispatch/combine benchmark, with an NCCL reference in the same run.

DeepSeek-V3 shape: hidden 7168, top-8 of 256 experts, 4096 and 128 tokens per
rank, bf16 and fp8 (e4m3 with one fp32 scale per 128 values). One process per
GPU (spawned here); symheap joins through torch.distributed, which also runs
the reference: all_to_all_single for dispatch and for combine with the same
routing, including the permutation into destination order, the count
exchange, and the weighted scatter-add back into token order.

Figures (per rank, slowest rank reported):
  time        mean of back-to-back calls, CUDA events;
  logical     received rows x row bytes / time, self traffic included
              (DeepEP's convention; can exceed the link on 2 GPUs);
  nvlink      the same without rows a rank sends to itself.

    python bench/ep_bench.py [--gpus 2] [--iters 20] [--quick] [--profile] [--cases 0,1] [--chain]

--profile adds, per case, each GPU kernel's mean time on rank 0 (torch
profiler, over the same calls as the timing: graph replays for low_latency).
--chain adds, per bf16 case, the time of a pair within 8 dependent pairs (one CUDA
graph for low_latency; iters / 8 timed chains, checked against x times each token's
destination-PE count to the 8th): each dispatch sends the rows the previous combine
returned, so no call overlaps the one before it (the independent calls above may). This
is the reference for bench/jax_ep_bench.py's chained pairs.
--cases picks cases by their index in cases() (0: 4096 bf16 intranode,
1: 128 bf16 low_latency token-major, ..., 9: 128 bf16 intranode with max_recv_tokens).
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
import time

HIDDEN, EXPERTS, TOPK, SCALE_DIM = 7168, 256, 8, 128
CHAIN = 8  # --chain: dependent pairs per timed call


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cases(quick: bool, only=None):
    """(tokens, kernel, dtype, layout, max_recv_tokens given), most telling first;
    `only`: indices into the full list."""
    out = [(4096, "intranode", "bfloat16", "token_major", True),
           (128, "low_latency", "bfloat16", "token_major", False),
           (128, "low_latency", "float8_e4m3fn", "expert_major", False),
           (4096, "intranode", "float8_e4m3fn", "token_major", True),
           (4096, "copy_engine", "bfloat16", "token_major", False),
           (4096, "intranode", "bfloat16", "token_major", False),
           (128, "low_latency", "bfloat16", "expert_major", False),
           (128, "low_latency", "bfloat16", "token_slots", False),
           (4096, "intranode", "bfloat16", "token_slots", False),
           (128, "intranode", "bfloat16", "token_major", True)]
    if only is not None:
        bad = [i for i in only if not 0 <= i < len(out)]
        if bad:
            raise SystemExit(f"--cases: no case {bad[0]} (0 to {len(out) - 1})")
        return [out[i] for i in only]
    return out[:2] if quick else out


def routing(torch, tokens, rank, device):
    g = torch.Generator(device="cpu").manual_seed(1234 + rank)
    scores = torch.rand(tokens, EXPERTS, generator=g)
    idx = scores.topk(TOPK, dim=1).indices.to(torch.int64)
    w = torch.rand(tokens, TOPK, generator=g) + 0.1
    x = torch.randn(tokens, HIDDEN, generator=g)
    return x.to(device), idx.to(device), w.to(device)


def as_graph(torch, fn):
    """Captures fn (after a warm-up call) and returns the graph's replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def kernel_profile(torch, dist, fns, iters):
    """Mean GPU time of every kernel that fns launch, as short text lines."""
    from torch.profiler import ProfilerActivity, profile
    for fn in fns:
        fn()
    dist.barrier()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        dist.barrier()  # every rank's profiler is up before the timed calls
        torch.cuda.synchronize()
        for _ in range(iters):
            for fn in fns:
                fn()
        torch.cuda.synchronize()
    lines = []
    for e in sorted(prof.key_averages(), key=lambda e: -e.device_time_total):
        if e.device_time_total <= 0 or e.count < iters:  # (the barrier's kernel)
            continue
        name = e.key.split("(")[0].split("::")[-1][:48]
        lines.append(f"  {name:<48} {e.device_time_total / max(e.count, 1):9.1f} us x "
                     f"{e.count // iters}/call")
    return lines[:8]


def timed(torch, dist, fn, iters):
    fn()  # warm-up
    dist.barrier()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / iters  # us


# ------------------------------------------------------------ NCCL reference

def nccl_reference(torch, dist, x, scales, idx, w, world):
    """dispatch: permute rows into destination order, exchange counts, then
    all_to_all_single of rows (and scales); combine: all_to_all_single back,
    then a scatter-add into token order. Returns (dispatch fn, combine fn,
    rows received)."""
    L = EXPERTS // world
    dest = idx // L  # [T, K]
    hit = torch.zeros(x.shape[0], world, dtype=torch.bool, device=x.device)
    hit.scatter_(1, dest, True)
    state = {}

    def dispatch():
        dests, toks = hit.t().nonzero(as_tuple=True)  # ordered by destination, then token
        send_counts = torch.bincount(dests, minlength=world)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts)
        sc, rc = send_counts.tolist(), recv_counts.tolist()
        rows = x.index_select(0, toks)
        recv = torch.empty(sum(rc), x.shape[1], dtype=x.dtype, device=x.device)
        dist.all_to_all_single(recv.view(torch.uint8) if x.element_size() == 1 else recv,
                               rows.view(torch.uint8) if x.element_size() == 1 else rows, rc, sc)
        if scales is not None:
            rs = torch.empty(sum(rc), scales.shape[1], dtype=scales.dtype, device=x.device)
            dist.all_to_all_single(rs, scales.index_select(0, toks), rc, sc)
        state.update(sc=sc, rc=rc, toks=toks, recv=recv)

    dispatch()
    n_recv = state["recv"].shape[0]
    expert_out = torch.randn(n_recv, x.shape[1], device=x.device).to(torch.bfloat16)

    def combine():
        back = torch.empty(sum(state["sc"]), x.shape[1], dtype=torch.bfloat16, device=x.device)
        dist.all_to_all_single(back, expert_out, state["sc"], state["rc"])
        out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
        out.index_add_(0, state["toks"], back.float())
        return out.to(torch.bfloat16)

    return dispatch, combine, n_recv


# ------------------------------------------------------------ one case

def run_case(torch, dist, symheap, ep_mod, case, iters, rank, world, device, profile=False,
             chain=False):
    tokens, kernel, dtype, layout, bounded = case
    x32, idx, w = routing(torch, tokens, rank, device)
    fp8 = dtype == "float8_e4m3fn"
    if fp8:
        x, scales = ep_mod.quantize_fp8(x32, SCALE_DIM)
    else:
        x, scales = x32.to(getattr(torch, dtype)), None
    cfg = ep_mod.EpConfig(hidden=HIDDEN, max_tokens_per_rank=tokens, num_experts=EXPERTS,
                          topk=TOPK, dtype=dtype, scale_dim=SCALE_DIM if fp8 else 0,
                          kernel=kernel, layout=layout,
                          max_recv_tokens=world * tokens if bounded else None)
    with ep_mod.EpDispatchCombine(cfg) as ep:
        out = ep.dispatch(x, idx, w, scales)
        ep.check()
        n_recv = int(out.num_recv_tokens)
        if layout == "token_slots":  # empty slots have zero weights (and are never read)
            src = out.src_info[out.src_info[:, 0] >= 0, 0]
            vals = ep_mod.dequantize_fp8(out.x, out.scales) if fp8 else out.x.float()
            y = (vals * out.topk_weights.sum(1, keepdim=True)).to(torch.bfloat16)
        elif layout == "token_major":
            src = out.src_info[:n_recv, 0]
            vals = ep_mod.dequantize_fp8(out.x[:n_recv], out.scales[:n_recv]) if fp8 else \
                out.x[:n_recv].float()
            y = (vals * out.topk_weights[:n_recv].sum(1, keepdim=True)).to(torch.bfloat16)
            if y.shape[0] != out.x.shape[0]:
                y = torch.cat([y, torch.zeros(out.x.shape[0] - n_recv, HIDDEN, dtype=y.dtype,
                                              device=device)])
        else:
            counts = out.expert_counts.tolist()
            src = torch.cat([out.src_info[l, :c, 0] for l, c in enumerate(counts)])
            y = (ep_mod.dequantize_fp8(out.x, out.scales) if fp8 else out.x.float()).to(
                torch.bfloat16)
        self_rows = int((src == rank).sum())
        res = ep.combine(y, out.handle)
        ep.check()
        # Correctness at full size: identity experts give x times the kept weight sum.
        ref = (ep_mod.dequantize_fp8(x, scales) if fp8 else x.float()) * w.sum(1, keepdim=True)
        err = ((res.float() - ref).abs() / (ref.abs() + 1e-2)).max().item()
        ok = err < 0.05

        do_dispatch = lambda: ep.dispatch(x, idx, w, scales)  # noqa: E731
        do_combine = lambda: ep.combine(y, out.handle)  # noqa: E731
        if kernel == "low_latency":  # latency of the kernels, not of Python: CUDA graphs
            do_dispatch, do_combine = as_graph(torch, do_dispatch), as_graph(torch, do_combine)
        prof = kernel_profile(torch, dist, [do_dispatch, do_combine], iters) if profile else []
        d_us = timed(torch, dist, do_dispatch, iters)
        c_us = timed(torch, dist, do_combine, iters)
        ep.check()
        chain_us = None
        if chain and not fp8:
            def do_chain():  # CHAIN dependent pairs: each dispatch sends the last combine's rows
                rows = x
                for _ in range(CHAIN):
                    d = ep.dispatch(rows, idx, w)
                    rows = ep.combine(d.x, d.handle)
                return rows
            # identity experts: each pair multiplies a row by its destination PEs' count
            hit = torch.zeros(tokens, world, dtype=torch.bool, device=device)
            hit.scatter_(1, idx // (EXPERTS // world), True)
            want = x.float() * hit.sum(1, keepdim=True).float() ** CHAIN
            got = do_chain().float()
            chain_err = ((got - want).abs() / (want.abs() + 1e-2)).max().item()
            ok = ok and chain_err < 0.05
            err = max(err, chain_err)
            if kernel == "low_latency":
                do_chain = as_graph(torch, do_chain)
            chain_us = timed(torch, dist, do_chain, max(2, iters // CHAIN)) / CHAIN
            ep.check()
    row_bytes = HIDDEN * x.element_size() + (scales.shape[1] * 4 if fp8 else 0)
    nccl_d, nccl_c, _ = nccl_reference(torch, dist, x, scales, idx, w, world)
    nd_us = timed(torch, dist, nccl_d, iters)
    nc_us = timed(torch, dist, nccl_c, iters)
    return dict(case=case, rows=n_recv, self_rows=self_rows, row_bytes=row_bytes,
                combine_row_bytes=HIDDEN * 2, dispatch_us=d_us, combine_us=c_us,
                nccl_dispatch_us=nd_us, nccl_combine_us=nc_us, max_rel_err=err, ok=ok,
                chain_us=chain_us,
                profile=prof)


def report(per):
    """One summary line from every rank's result of one case."""
    slow = lambda k: max(p[k] for p in per)  # noqa: E731
    rows = min(p["rows"] for p in per)
    cross = min(p["rows"] - p["self_rows"] for p in per)
    tokens, kernel, dtype, layout, bounded = per[0]["case"]
    d, c = slow("dispatch_us"), slow("combine_us")
    nd, nc = slow("nccl_dispatch_us"), slow("nccl_combine_us")
    rb, crb = per[0]["row_bytes"], per[0]["combine_row_bytes"]
    name = f"{tokens}tok {dtype} {kernel} {layout}" + (" max_recv" if bounded else "") + \
        (" (cuda graph)" if kernel == "low_latency" else "")
    chain = (f"; chained pair {slow('chain_us'):.1f} us" if per[0].get("chain_us") is not None
             else "")
    return (f"summary ep {name}: dispatch {d:.1f} us (logical {rows * rb / d / 1e3:.0f} GB/s, "
            f"nvlink {cross * rb / d / 1e3:.0f} GB/s), combine {c:.1f} us (logical "
            f"{rows * crb / c / 1e3:.0f} GB/s, nvlink {cross * crb / c / 1e3:.0f} GB/s); "
            f"NCCL dispatch {nd:.1f} us, combine {nc:.1f} us; end-to-end speedup "
            f"{(nd + nc) / (d + c):.2f}x; rows/rank {rows}; check "
            f"{'ok' if all(p['ok'] for p in per) else 'FAILED'} "
            f"(max rel err {max(p['max_rel_err'] for p in per):.3g}){chain}")


def worker(rank, world, port, args, queue):
    import torch
    import torch.distributed as dist
    torch.cuda.set_device(rank)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, device_id=torch.device("cuda", rank))
    import symheap
    import symheap.ep as ep_mod
    symheap.init_torch(device=rank, heap_size=args.heap)
    lines = []
    try:
        for case in cases(args.quick, args.cases):
            t = time.time()
            try:
                result = run_case(torch, dist, symheap, ep_mod, case, args.iters, rank, world,
                                  torch.device("cuda", rank), args.profile, args.chain)
            except Exception as e:  # reported, then the remaining cases are skipped
                result = dict(case=case, error=f"{type(e).__name__}: {e}")
            gathered = [None] * world
            dist.all_gather_object(gathered, result)
            errors = [g["error"] for g in gathered if "error" in g]
            line = (f"summary ep {case}: FAILED: {errors[0]}" if errors else report(gathered))
            if rank == 0:
                print(line, f"[{time.time() - t:.1f} s]", flush=True)
                if result.get("profile"):
                    print("\n".join(["kernels on rank 0 (mean per launch):"] + result["profile"]),
                          flush=True)
            lines.append(line)
            if errors:
                break
        if rank == 0:
            queue.put(lines)
    finally:
        symheap.finalize()
        dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--heap", default="3G")
    ap.add_argument("--quick", action="store_true", help="one large and one small case")
    ap.add_argument("--profile", action="store_true", help="each kernel's time on rank 0")
    ap.add_argument("--chain", action="store_true",
                    help=f"also time a pair within {CHAIN} dependent pairs (each dispatch sends "
                         "the previous combine's output), as a model's layers do")
    ap.add_argument("--cases", type=lambda v: [int(i) for i in v.split(",")], default=None,
                    help="comma-separated indices into the case list (e.g. 1,2)")
    args = ap.parse_args()
    cases(args.quick, args.cases)  # a bad index fails here, before any process starts
    import torch
    import torch.multiprocessing as mp
    if torch.cuda.device_count() < args.gpus:
        print(f"ep_bench needs {args.gpus} GPUs, found {torch.cuda.device_count()}")
        return 1
    os.environ["SYMHEAP_BACKEND"] = "cuda"
    os.environ.setdefault("SYMHEAP_TIMEOUT", "20")  # a broken case fails, not hangs
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    print(f"ep_bench: {args.gpus} x {torch.cuda.get_device_name(0)}, iters {args.iters}",
          flush=True)
    procs = [ctx.Process(target=worker, args=(r, args.gpus, port, args, queue))
             for r in range(args.gpus)]
    for p in procs:
        p.start()
    lines = None
    try:
        lines = queue.get(timeout=600)
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
    print("targets (2 x H200): 4096 tok intranode nvlink >= 330 GB/s dispatch and combine, "
          ">= 1.5x NCCL end to end; 128 tok low_latency dispatch <= 15 us, combine <= 20 us")
    return 0 if lines and all("check ok" in line for line in lines) else 1


if __name__ == "__main__":
    sys.exit(main())
