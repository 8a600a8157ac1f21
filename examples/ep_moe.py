"""A toy mixture-of-experts layer on symheap.ep: route, run the local experts, combine.

    python examples/ep_moe.py                              # 2 PEs, threads of one process
    torchrun --nproc-per-node 2 examples/ep_moe.py torch   # one PE per process

Each PE hosts num_experts / n_pes experts (small linear maps). The result is
checked against a dense computation of every token's top-k experts.
"""
import sys

import torch

import symheap
from symheap.ep import EpConfig, EpDispatchCombine

HIDDEN, EXPERTS, TOPK, TOKENS = 64, 8, 2, 32


def expert_weight(e: int) -> torch.Tensor:
    """Expert e's weight; any PE can rebuild it (for the reference)."""
    g = torch.Generator().manual_seed(e)
    return torch.randn(HIDDEN, HIDDEN, generator=g) / HIDDEN ** 0.5


def moe_layer():
    me, n = symheap.my_pe(), symheap.n_pes()
    dev = (torch.device("cuda", symheap.current_device()) if symheap.backend() == "cuda"
           else torch.device("cpu"))
    L = EXPERTS // n
    local_experts = torch.stack([expert_weight(me * L + l) for l in range(L)]).to(dev)

    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(100 + me))
    router = torch.randn(HIDDEN, EXPERTS, generator=torch.Generator().manual_seed(7))
    weights, experts = (x @ router).softmax(dim=-1).topk(TOPK, dim=-1)

    cfg = EpConfig(hidden=HIDDEN, max_tokens_per_rank=TOKENS, num_experts=EXPERTS, topk=TOPK,
                   dtype="float32")
    with EpDispatchCombine(cfg) as ep:  # collective: every PE builds it
        d = ep.dispatch(x.to(dev), experts.to(dev), weights.to(dev))
        rows = int(d.num_recv_tokens)
        # Expert side (token-major): one output row per received row, already
        # reduced over the token's experts on this PE.
        y = torch.zeros_like(d.x)
        for l in range(L):
            w = (d.topk_weights[:rows] * (d.topk_idx[:rows] == l)).sum(dim=-1, keepdim=True)
            y[:rows] += w * (d.x[:rows] @ local_experts[l])
        out = ep.combine(y, d.handle).cpu()  # [TOKENS, HIDDEN], in x's order

    ref = torch.zeros_like(x)
    for t in range(TOKENS):
        for k in range(TOPK):
            ref[t] += weights[t, k] * (x[t] @ expert_weight(int(experts[t, k])))
    err = (out - ref).abs().max().item()
    assert err < 1e-4, f"PE {me}: MoE output off by {err}"
    return f"PE {me}/{n}: {rows} rows received, {TOKENS} tokens combined, max error {err:.2e}"


if __name__ == "__main__":
    if sys.argv[1:] == ["torch"]:
        import torch.distributed as dist
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        symheap.init_torch()
        print(moe_layer(), flush=True)
        symheap.finalize()
        dist.destroy_process_group()
    else:
        from symheap.testing import run_threads
        print(f"backend: {symheap.backend()}")
        for line in run_threads(moe_layer, 2):
            print(line)
