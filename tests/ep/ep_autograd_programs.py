"""PE programs for the EP autograd tests (module level, so processes can import them).

A small MoE layer (per-expert matrices, top-k routing with dropped slots, applied
twice with the same op) runs over N PEs through symheap.ep.dispatch/combine; the
same layer in plain torch on one PE is the reference."""
import torch

import symheap
import symheap.ep as ep


def make_data(seed, n_pes, tokens, hidden, num_experts, topk):
    """Every PE's inputs, drawn from one generator (identical on every PE and in the reference)."""
    g = torch.Generator().manual_seed(seed)
    T = max(tokens)
    x = torch.randn(n_pes, T, hidden, generator=g)
    logits = torch.randn(n_pes, T, num_experts, generator=g)
    w, idx = logits.softmax(-1).topk(topk, dim=-1)
    drop = torch.rand(n_pes, T, topk, generator=g) < 0.2
    idx = torch.where(drop, torch.full_like(idx, -1), idx)
    w = torch.where(drop, torch.zeros_like(w), w)
    experts = torch.randn(num_experts, hidden, hidden, generator=g) / hidden ** 0.5
    upstream = torch.randn(n_pes, T, hidden, generator=g)
    return x, idx, w, experts, upstream


def reference(x, idx, w, experts, upstream, tokens, layers):
    """The layer on one PE in plain torch: out[t] = sum_k w[t,k] * x[t] @ E[idx[t,k]]."""
    x = x.clone().requires_grad_(True)
    w = w.clone().requires_grad_(True)
    experts = experts.clone().requires_grad_(True)
    h = x
    for _ in range(layers):
        per_slot = torch.einsum("pth,ptkhf->ptkf", h, experts[idx.clamp(min=0)])
        h = (per_slot * (w * (idx >= 0))[..., None]).sum(2)
    mask = (torch.arange(x.shape[1])[None, :] < torch.tensor(tokens)[:, None])[..., None]
    (h * upstream * mask).sum().backward()
    return h.detach(), x.grad, w.grad, experts.grad


def _expert_side(d, local_w, layout, weight_on_expert_side):
    if layout == "expert_major":
        y = torch.bmm(d.x, local_w)                       # grouped matmul, [L, cap, hidden]
        if weight_on_expert_side:
            y = y * d.topk_weights[..., None]
        return y
    # token-major: each row carries the token's local experts in topk_idx
    sel = local_w[d.topk_idx.clamp(min=0).long()]          # [R, k, hidden, hidden]
    per_slot = torch.einsum("rh,rkhf->rkf", d.x, sel)
    return (per_slot * d.topk_weights[..., None]).sum(1)


def pe_device():
    if symheap.backend() == "cuda":
        return torch.device("cuda", symheap.current_device())
    return torch.device("cpu")


def _pe_inputs(cfg, seed, tokens):
    """This PE's leaves (x, w, local experts; x and w padded to max(tokens) rows are
    sliced), its routing and upstream gradient, on its device."""
    me, n = symheap.my_pe(), symheap.n_pes()
    dev = pe_device()
    x_all, idx_all, w_all, experts, upstream = make_data(seed, n, tokens, cfg.hidden,
                                                         cfg.num_experts, cfg.topk)
    T, L = tokens[me], cfg.num_experts // n
    x = x_all[me, :T].to(dev).requires_grad_(True)
    w = w_all[me, :T].to(dev).requires_grad_(True)
    local_w = experts[me * L:(me + 1) * L].to(dev).requires_grad_(True)
    return x, w, local_w, idx_all[me, :T].to(dev), upstream[me, :T].to(dev)


def _forward(op, cfg, x, idx, w, local_w, layers, weight_on_expert_side):
    h = x
    for _ in range(layers):
        d = ep.dispatch(op, h, idx, w)
        y = _expert_side(d, local_w, cfg.layout, weight_on_expert_side)
        if cfg.layout == "expert_major" and weight_on_expert_side:
            ones = torch.ones(x.shape[0], cfg.topk, device=x.device)
            h = ep.combine(op, y, d.handle, topk_weights=ones)
        else:
            h = ep.combine(op, y, d.handle)
    return h


def _numpy(*tensors):
    # numpy: torch tensors would travel between processes as shared memory the sender frees
    return tuple(t.detach().cpu().numpy() for t in tensors)


def layer_grads(cfg_kw, seed, tokens, layers=2, weight_on_expert_side=False):
    """Runs the layer on this PE; returns (out, x.grad, w.grad, local experts' grad)."""
    cfg = ep.EpConfig(**cfg_kw)
    x, w, local_w, idx, upstream = _pe_inputs(cfg, seed, tokens)
    with ep.EpDispatchCombine(cfg) as op:
        h = _forward(op, cfg, x, idx, w, local_w, layers, weight_on_expert_side)
        (h * upstream).sum().backward()
        op.check()
    return _numpy(h, x.grad, w.grad, local_w.grad)


def graph_layer_grads(cfg_kw, seeds, tokens, layers=2):
    """CUDA only: forward + backward captured once in a CUDA graph, then replayed with
    the data of each seed (same routing shapes, new values and routing). Returns one
    (out, x.grad, w.grad, experts' grad) per seed."""
    cfg = ep.EpConfig(**cfg_kw)
    dev = pe_device()
    x, w, local_w, idx, upstream = _pe_inputs(cfg, seeds[0], tokens)
    leaves = (x, w, local_w)
    with ep.EpDispatchCombine(cfg) as op:
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):  # warm-up outside the graph
            for _ in range(2):
                h = _forward(op, cfg, x, idx, w, local_w, layers, False)
                (h * upstream).sum().backward()
        torch.cuda.current_stream(dev).wait_stream(side)
        op.check()
        for t in leaves:
            t.grad = None
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):
            h = _forward(op, cfg, x, idx, w, local_w, layers, False)
            (h * upstream).sum().backward()
        results = []
        for seed in seeds:
            new = _pe_inputs(cfg, seed, tokens)
            with torch.no_grad():
                for dst, src in zip((x, w, local_w, idx, upstream), new):
                    dst.copy_(src)
                for t in (h, *(t.grad for t in leaves)):
                    t.fill_(float("nan"))
            graph.replay()
            op.check()
            results.append(_numpy(h, x.grad, w.grad, local_w.grad))
    return results


def check_against_reference(results, cfg_kw, seed, tokens, layers=2):
    """Asserts every PE's outputs and gradients equal the single-PE reference."""
    n = len(results)
    x, idx, w, experts, upstream = make_data(seed, n, tokens, cfg_kw["hidden"],
                                             cfg_kw["num_experts"], cfg_kw["topk"])
    out, gx, gw, ge = reference(x, idx, w, experts, upstream, tokens, layers)
    L = cfg_kw["num_experts"] // n
    tol = dict(rtol=1e-4, atol=1e-5)
    for p, arrays in enumerate(results):
        o, a, b, c = (torch.from_numpy(t) for t in arrays)
        T = tokens[p]
        torch.testing.assert_close(o, out[p, :T], **tol, msg=lambda m: f"PE {p} out: {m}")
        torch.testing.assert_close(a, gx[p, :T], **tol, msg=lambda m: f"PE {p} x.grad: {m}")
        torch.testing.assert_close(b, gw[p, :T], **tol, msg=lambda m: f"PE {p} w.grad: {m}")
        torch.testing.assert_close(c, ge[p * L:(p + 1) * L], **tol,
                                   msg=lambda m: f"PE {p} expert grad: {m}")
