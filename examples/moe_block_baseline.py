"""The block of moe_block.py written with plain torch.distributed, for comparison: tokens
move with all_to_all_single (a count exchange, then the rows, one per (token, expert)),
attention is torch's scaled_dot_product_attention, replicated gradients are summed with
all_reduce. Run through ``python examples/moe_block.py --baseline`` (under torchrun)."""
from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single_autograd

from moe_block import (PHASES, TOLERANCE, LR, MOMENTUM, Timer, attention_forward, batch,
                       check_against_reference, expert_params, experts_forward, progress,
                       replicated_params, route, sdpa_attention)


def exchange(rows, recv_splits, send_splits):
    """all_to_all_single of rows, differentiable (its backward is the reverse exchange)."""
    return all_to_all_single_autograd(rows.contiguous(), recv_splits, send_splits,
                                      dist.group.WORLD)


def send_tokens(hn, idx, n, L):
    """One row per (token, expert), grouped by destination rank. Returns the received rows,
    their local expert ids, and what the way back needs."""
    k = idx.shape[1]
    flat = idx.reshape(-1)
    order = torch.argsort(flat // L, stable=True)
    send_counts = torch.bincount(flat // L, minlength=n)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts)
    sc, rc = send_counts.tolist(), recv_counts.tolist()
    rows = exchange(hn[order // k], rc, sc)
    local = torch.empty(sum(rc), dtype=flat.dtype, device=flat.device)
    dist.all_to_all_single(local, (flat[order] % L).contiguous(), rc, sc)
    return rows, local, order, sc, rc


def run_experts(rows, local, exp, L, cd):
    """Pads the received rows into expert-major [L, max rows, hidden], runs the same
    grouped matmuls as the symheap block, and returns one output row per received row."""
    counts = torch.bincount(local, minlength=L)
    cap = int(counts.max()) if rows.shape[0] else 0
    perm = torch.argsort(local, stable=True)
    expert = local[perm]
    slot = torch.arange(len(perm), device=rows.device) - (counts.cumsum(0) - counts)[expert]
    padded = rows.new_zeros(L, cap, rows.shape[1]).index_put((expert, slot), rows[perm])
    y = experts_forward(padded, exp, cd)[expert, slot]
    return y[torch.argsort(perm)]


def baseline_main(c: dict) -> dict:
    rank, n = dist.get_rank(), dist.get_world_size()
    dev = (torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if c["backend"] == "cuda"
           else torch.device("cpu"))
    cd = getattr(torch, c["dtype"])
    L = c["experts"] // n
    rep = {k: v.requires_grad_(True) for k, v in replicated_params(c, dev).items()}
    exp = {k: v.requires_grad_(True) for k, v in expert_params(c, rank * L, L, dev).items()}
    params = [*rep.values(), *exp.values()]
    opt = torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)
    timer = Timer(dev)
    tokens, wall = c["batch"] * c["seq"], 0.0
    for step in range(c["steps"]):
        dist.barrier()
        t0 = time.perf_counter()
        x, target = batch(c, step, rank, dev)
        with timer("attention"):
            h1 = attention_forward(rep, x, c, cd, sdpa_attention)
        with timer("other"):
            hn, idx, w = route(rep, h1, c)
        with timer("dispatch"):
            rows, local, order, sc, rc = send_tokens(hn.to(cd), idx, n, L)
        with timer("experts"):
            y = run_experts(rows, local, exp, L, cd)
        with timer("combine"):
            back = exchange(y, sc, rc)
            per_slot = back[torch.argsort(order)].view(*idx.shape, -1)
            moe = (per_slot.float() * w[..., None]).sum(1).to(cd)
        with timer("other"):
            out = h1 + moe.float().view_as(h1)
            loss = (out - target).pow(2).sum() / (n * out.numel())
        with timer("backward"):
            opt.zero_grad(set_to_none=True)
            loss.backward()
        with timer("other"):
            flat = torch.cat([t.grad.flatten() for t in rep.values()])
            dist.all_reduce(flat)
            offset = 0
            for t in rep.values():
                t.grad.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()
            grads = [t.grad.clone() for t in params]
            opt.step()
        keep = step > 0 or c["steps"] == 1
        timer.flush(keep)
        dt = time.perf_counter() - t0
        wall += dt if keep else 0.0
        if rank == 0:
            progress(step + 1, c["steps"], n * tokens / dt)
    timed = max(1, c["steps"] - 1)
    errors = check_against_reference(c, rank, n, dev, out.detach(), grads, params)
    mine = torch.tensor([errors[k] for k in ("outputs", "gradients", "parameters")] +
                        [timer.total[p] / timed for p in PHASES] + [wall / timed],
                        dtype=torch.float32, device=dev)
    everyone = [torch.empty_like(mine) for _ in range(n)]
    dist.all_gather(everyone, mine)
    everyone = torch.stack(everyone).cpu()
    step_time = everyone[:, -1].max().item()
    return {"errors": dict(zip(("outputs", "gradients", "parameters"),
                               everyone[:, :3].max(0).values.tolist())),
            "tolerance": TOLERANCE[c["dtype"]],
            "split_s": dict(zip(PHASES, everyone[:, 3:3 + len(PHASES)].mean(0).tolist())),
            "step_s": step_time, "tokens_per_s": n * tokens / step_time}
