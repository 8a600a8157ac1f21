"""PE programs and references for the expert-parallel tests (cpu and cuda).

Every PE regenerates every PE's routing and payload from per-(iteration,
rank) seeds, which is the all-gathered routing the references need. Payload
rows encode (source PE, token index) in their first two values, and are
otherwise random; every received row, scale, weight and index is compared
bit for bit with the sender's, and combine with identity experts against an
fp32 reference. Importable by spawned processes (no tests in here).
"""
from __future__ import annotations

import hashlib

import torch

import symheap
from symheap.ep import EpConfig, EpDispatchCombine, dequantize_fp8

# Unit roundoff of each combine dtype.
_UNIT = {"float32": 2.0 ** -24, "float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}
# Spacing of each combine dtype's subnormal numbers: below the smallest normal
# number a rounding errs by up to half of it, however small the value.
_TINY = {"float32": 2.0 ** -149, "float16": 2.0 ** -24, "bfloat16": 2.0 ** -133}


# ------------------------------------------------------------------ inputs

def pe_device():
    """The torch device of the calling PE (cpu on the cpu backend)."""
    if symheap.backend() == "cuda":
        return torch.device("cuda", symheap.current_device())
    return torch.device("cpu")


def on_device(inputs, device=None):
    device = device or pe_device()
    return tuple(t.to(device) if t is not None else None for t in inputs)


def routing(pattern: str, n_tokens: int, cfg: EpConfig, n_pes: int, rank: int,
            gen: torch.Generator) -> torch.Tensor:
    """topk_idx [n_tokens, topk] int64 for one PE."""
    E, K = cfg.num_experts, cfg.topk
    L = E // n_pes
    if pattern in ("random", "random_drop"):
        idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(n_tokens)]) \
            if n_tokens else torch.empty(0, K, dtype=torch.int64)
        if pattern == "random_drop" and n_tokens:
            drop = torch.rand(n_tokens, K, generator=gen) < 0.3
            drop[0] = True  # a token with every slot dropped
            idx[drop] = -1
        return idx.to(torch.int64)
    if pattern == "all_to_one":  # every token of every PE to experts of PE 0
        assert K <= L
        rows = [torch.randperm(L, generator=gen)[:K] for _ in range(n_tokens)]
        return torch.stack(rows).to(torch.int64) if rows else torch.empty(0, K, dtype=torch.int64)
    if pattern == "round_robin":  # token t to experts t*K .. t*K+K-1 (mod E), shifted by rank
        t = torch.arange(n_tokens).unsqueeze(1)
        return ((t * K + torch.arange(K) + rank * L) % E).to(torch.int64)
    raise ValueError(pattern)


def token_count(spec, cfg: EpConfig, rank: int, gen: torch.Generator) -> int:
    if spec == "full":
        return cfg.max_tokens_per_rank
    if spec == "random":
        return int(torch.randint(0, cfg.max_tokens_per_rank + 1, (1,), generator=gen))
    if spec == "zero_on_odd":
        return 0 if rank % 2 else cfg.max_tokens_per_rank
    return int(spec)


def make_inputs(cfg: EpConfig, n_pes: int, rank: int, seed: int, pattern: str, tokens):
    """(x, topk_idx, topk_weights, scales) of PE ``rank`` for one iteration."""
    gen = torch.Generator().manual_seed(seed * 1009 + rank)
    T = token_count(tokens, cfg, rank, gen)
    idx = routing(pattern, T, cfg, n_pes, rank, gen)
    w = torch.rand(T, cfg.topk, generator=gen) + 0.25
    base = torch.randn(T, cfg.hidden, generator=gen)
    base[:, 0] = rank  # the (source PE, token) encoding
    base[:, 1] = torch.arange(T)
    scales = None
    if cfg.dtype == "float8_e4m3fn":
        x = base.clamp(-400, 400).to(torch.float8_e4m3fn)
    else:
        x = base.to(getattr(torch, cfg.dtype))
    if cfg.scale_dim:
        scales = (torch.rand(T, cfg.hidden // cfg.scale_dim, generator=gen) + 0.5).to(
            getattr(torch, cfg.scale_dtype))
    return x, idx, w, scales


def as_float(x, scales):
    """Value of payload rows in fp32 (fp8 rows times their block scales)."""
    if x.dtype == torch.float8_e4m3fn:
        return dequantize_fp8(x, scales)
    return x.float()


def bits(t: torch.Tensor) -> torch.Tensor:
    """Exact-comparison view of a tensor (NaN-safe)."""
    t = t.contiguous()
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(
        {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def assert_same_bits(got, want, what):
    if got.shape != want.shape or not torch.equal(bits(got.cpu()), bits(want.cpu())):
        raise AssertionError(f"{what}: received data differs from the sender's "
                             f"(shape {tuple(got.shape)} vs {tuple(want.shape)})")


def poison(out) -> None:
    """Overwrites a previous DispatchOutput's views (they alias the receive buffer)."""
    for t in (out.x, out.scales, out.topk_weights):
        if t is not None:
            bits(t).fill_(-1 if t.element_size() > 1 else 0x7F)  # NaN patterns
    if out.topk_idx is not None:
        out.topk_idx.fill_(-7)


# ------------------------------------------------------------------ checks

def check_dispatch(cfg, ep, out, inputs, me, n_pes):
    """Compares one PE's DispatchOutput with the reference from every PE's inputs."""
    L = cfg.num_experts // n_pes
    lo, hi = me * L, (me + 1) * L
    num_recv = int(out.num_recv_tokens)
    counts = torch.zeros(L, dtype=torch.int64)
    for s, (x, idx, w, sc) in enumerate(inputs):
        kept = idx[idx >= 0]
        counts += torch.bincount(kept[(kept >= lo) & (kept < hi)] - lo, minlength=L)
    got_counts = out.expert_counts.cpu().to(torch.int64)
    if not torch.equal(got_counts, counts):
        raise AssertionError(f"PE {me}: expert_counts {got_counts.tolist()} != {counts.tolist()}")
    if cfg.layout == "token_slots":
        check_slots(cfg, out, inputs, me, n_pes, lo, hi)
    elif cfg.layout == "token_major":
        rows = [(s, t) for s, (x, idx, w, sc) in enumerate(inputs) for t in range(idx.shape[0])
                if bool(((idx[t] >= lo) & (idx[t] < hi)).any())]
        if num_recv != len(rows):
            raise AssertionError(f"PE {me}: num_recv_tokens {num_recv} != reference {len(rows)}")
        if out.x.shape[0] < num_recv or out.x.shape[1] != cfg.hidden:
            raise AssertionError(f"PE {me}: x has shape {tuple(out.x.shape)}")
        got_src = out.src_info[:num_recv].cpu().tolist()
        if got_src != [list(r) for r in rows]:
            raise AssertionError(f"PE {me}: src_info {got_src} != reference {rows}")
        if not rows:
            return
        want_x = torch.stack([inputs[s][0][t] for s, t in rows])
        assert_same_bits(out.x[:num_recv], want_x, f"PE {me} x")
        want_idx = torch.stack([inputs[s][1][t] for s, t in rows])
        local = (want_idx >= lo) & (want_idx < hi)
        want_local = torch.where(local, want_idx - lo, torch.full_like(want_idx, -1))
        if not torch.equal(out.topk_idx[:num_recv].cpu().to(torch.int64), want_local):
            raise AssertionError(f"PE {me}: topk_idx differs from the localised reference")
        want_w = torch.stack([inputs[s][2][t] for s, t in rows]) * local
        assert_same_bits(out.topk_weights[:num_recv], want_w, f"PE {me} topk_weights")
        # the payload's own (source PE, token) encoding agrees with src_info
        enc = as_float(out.x[:num_recv], out.scales[:num_recv] if out.scales is not None else None)
        if cfg.dtype != "float8_e4m3fn":
            # (rounded to the payload's dtype: bf16 holds integers exactly up to 256)
            want_enc = torch.tensor(rows, dtype=torch.float32).to(out.x.dtype).float()
            if not torch.equal(enc[:, :2].cpu(), want_enc):
                raise AssertionError(f"PE {me}: payload encoding disagrees with src_info")
        if cfg.scale_dim:
            want_sc = torch.stack([inputs[s][3][t] for s, t in rows])
            assert_same_bits(out.scales[:num_recv], want_sc, f"PE {me} scales")
    else:
        total = int(counts.sum())
        if num_recv != total:
            raise AssertionError(f"PE {me}: num_recv_tokens {num_recv} != reference {total}")
        cap = out.x.shape[1]
        for l in range(L):
            e = lo + l
            rows = [(s, t, k) for s, (x, idx, w, sc) in enumerate(inputs)
                    for t in range(idx.shape[0]) for k in range(idx.shape[1]) if idx[t, k] == e]
            c = len(rows)
            if c > cap:
                raise AssertionError("reference overflows the capacity: test bug")
            got_src = out.src_info[l, :c].cpu().tolist()
            if got_src != [list(r) for r in rows]:
                raise AssertionError(f"PE {me} expert {l}: src_info {got_src} != {rows}")
            if not rows:
                continue
            assert_same_bits(out.x[l, :c], torch.stack([inputs[s][0][t] for s, t, _ in rows]),
                             f"PE {me} expert {l} x")
            assert_same_bits(out.topk_weights[l, :c],
                             torch.tensor([float(inputs[s][2][t, k]) for s, t, k in rows]),
                             f"PE {me} expert {l} weights")
            if cfg.scale_dim:
                assert_same_bits(out.scales[l, :c],
                                 torch.stack([inputs[s][3][t] for s, t, _ in rows]),
                                 f"PE {me} expert {l} scales")


def check_slots(cfg, out, inputs, me, n_pes, lo, hi):
    """token_slots: token t of PE s in row s * max_tokens + t when it routes
    here; every other slot marked empty (src -1, ids -1, weights 0)."""
    M = cfg.max_tokens_per_rank
    if tuple(out.x.shape) != (n_pes * M, cfg.hidden):
        raise AssertionError(f"PE {me}: x has shape {tuple(out.x.shape)}")
    want_src = torch.full((n_pes * M, 2), -1, dtype=torch.int64)
    want_idx = torch.full((n_pes * M, cfg.topk), -1, dtype=torch.int64)
    want_w = torch.zeros(n_pes * M, cfg.topk)
    for s, (x, idx, w, sc) in enumerate(inputs):
        for t in range(idx.shape[0]):
            local = (idx[t] >= lo) & (idx[t] < hi)
            if bool(local.any()):
                r = s * M + t
                want_src[r] = torch.tensor([s, t])
                want_idx[r] = torch.where(local, idx[t] - lo, torch.full_like(idx[t], -1))
                want_w[r] = w[t] * local
    filled = want_src[:, 0] >= 0
    num_recv = int(out.num_recv_tokens)
    if num_recv != int(filled.sum()):
        raise AssertionError(f"PE {me}: num_recv_tokens {num_recv} != reference "
                             f"{int(filled.sum())}")
    if not torch.equal(out.src_info.cpu().to(torch.int64), want_src):
        raise AssertionError(f"PE {me}: src_info {out.src_info.cpu().tolist()} != slot "
                             f"reference {want_src.tolist()}")
    if not torch.equal(out.topk_idx.cpu().to(torch.int64), want_idx):
        raise AssertionError(f"PE {me}: topk_idx differs from the slot reference")
    assert_same_bits(out.topk_weights, want_w, f"PE {me} topk_weights")
    rows = [(int(a), int(b)) for a, b in want_src[filled].tolist()]
    if not rows:
        return
    got_x = out.x[filled.to(out.x.device)]
    assert_same_bits(got_x, torch.stack([inputs[s][0][t] for s, t in rows]), f"PE {me} x")
    if cfg.scale_dim:
        assert_same_bits(out.scales[filled.to(out.x.device)],
                         torch.stack([inputs[s][3][t] for s, t in rows]), f"PE {me} scales")


def filled_rows(cfg, out):
    """Token-major layouts: which received rows hold a token."""
    if cfg.layout == "token_slots":
        return out.src_info[:, 0] >= 0
    return torch.arange(out.x.shape[0], device=out.x.device) < out.num_recv_tokens


def identity_experts(cfg, out, device):
    """Expert outputs of identity experts: token-major rows weighted by the
    local top-k weights (the expert side's reduction), expert-major rows as
    they are. Rows past the valid count are NaN: combine must not read them."""
    cdt = getattr(torch, cfg.combine_dtype)
    val = as_float(out.x, out.scales)
    if cfg.layout != "expert_major":
        y = val * out.topk_weights.sum(dim=-1, keepdim=True)
        valid = filled_rows(cfg, out)
        y = torch.where(valid.unsqueeze(1), y, torch.full_like(y, float("nan")))
    else:
        valid = torch.arange(val.shape[1], device=val.device).unsqueeze(0) < \
            out.expert_counts.unsqueeze(1)
        y = torch.where(valid.unsqueeze(-1), val, torch.full_like(val, float("nan")))
    return y.to(cdt).to(device)


def check_combine(cfg, got, x, idx, w, scales, me, weight_scale=1.0, n_pes=None):
    """combine of identity experts == x * (sum of the token's kept weights).

    Error bound: two roundings to the combine dtype (expert output, result)
    plus fp32 roundings of the weight sums and of the sum over PEs / slots.
    Those roundings are relative only for normal numbers: a value rounded into
    the subnormal range errs by up to half the subnormal spacing, so the bound
    also allows that much for each rounded row (up to n_pes rows, or topk
    rows times their weight) and for the result, again with a factor 2."""
    kept_w = (w.double() * (idx >= 0)).sum(dim=1, keepdim=True) * weight_scale
    want = as_float(x, scales).double() * kept_w
    got = got.double().cpu()
    if got.shape != want.shape:
        raise AssertionError(f"PE {me}: combine returned {tuple(got.shape)}, "
                             f"want {tuple(want.shape)}")
    n_pes = symheap.n_pes() if n_pes is None else n_pes
    terms = cfg.topk + n_pes + 2
    rel = 2 * (2 * _UNIT[cfg.combine_dtype] + terms * 2.0 ** -24)
    w_max = max(1.0, float(w.abs().max()) * weight_scale) if w.numel() else 1.0
    subnormal = (max(n_pes, cfg.topk) * w_max + 1) * _TINY[cfg.combine_dtype]
    err = (got - want).abs()
    bound = rel * want.abs() + subnormal + 1e-30
    if not bool((err <= bound).all()):
        i = int((err - bound).argmax())
        raise AssertionError(f"PE {me}: combine off by {err.view(-1)[i]:.3g} at element {i} "
                             f"(value {want.view(-1)[i]:.6g}, tolerance {bound.view(-1)[i]:.3g})")


def redispatch_rows(cfg, n_pes: int, rank: int, seed: int, num_tokens: int):
    """Fresh rows of PE ``rank`` for a redispatch (an output gradient), of the combine dtype."""
    gen = torch.Generator().manual_seed(seed * 7919 + rank)
    return torch.randn(num_tokens, cfg.hidden, generator=gen).to(getattr(torch, cfg.combine_dtype))


def check_redispatch(cfg, got, out, grads, me):
    """Every row the dispatch ``out`` received holds its token's row of ``grads``
    (every PE's redispatch rows) bit for bit; every other row is zero."""
    shape = tuple(out.x.shape)
    if tuple(got.shape) != shape or got.dtype != getattr(torch, cfg.combine_dtype):
        raise AssertionError(f"PE {me}: redispatch returned {tuple(got.shape)} {got.dtype}, "
                             f"want {shape} {cfg.combine_dtype}")
    want = torch.zeros(shape, dtype=got.dtype)
    if cfg.layout == "expert_major":
        counts = out.expert_counts.cpu()
        info = out.src_info.cpu()
        for l in range(shape[0]):
            for i in range(int(counts[l])):
                want[l, i] = grads[int(info[l, i, 0])][int(info[l, i, 1])]
    else:
        filled = filled_rows(cfg, out).cpu()
        info = out.src_info.cpu()
        for r in torch.nonzero(filled).view(-1).tolist():
            want[r] = grads[int(info[r, 0])][int(info[r, 1])]
    assert_same_bits(got, want, f"PE {me} redispatch")


# ------------------------------------------------------------------ programs

DEFAULT_PLAN = [("random", "full"), ("all_to_one", "full"), ("round_robin", "random"),
                ("random_drop", "zero_on_odd"), ("random", "random"), ("random_drop", "full")]


def run_iterations(cfg: EpConfig, plan=DEFAULT_PLAN, seed: int = 1, device=None,
                   combine_weight_override: bool = False, redispatch: bool = False,
                   combine_digest: bool = True):
    """Runs ``plan`` [(pattern, tokens)] through one op, checking every output.
    With ``redispatch``, each iteration also redispatches fresh rows through the
    dispatch's handle (before combine in odd iterations, after it in even ones:
    both share combine's epochs). Returns a digest of everything received,
    combined (unless not ``combine_digest``: sums whose order may differ) and
    redispatched (equal across launch models)."""
    me, n = symheap.my_pe(), symheap.n_pes()
    device = device or pe_device()
    digest = hashlib.sha256()
    with EpDispatchCombine(cfg) as ep:
        prev = None
        for it, (pattern, tokens) in enumerate(plan):
            inputs = [make_inputs(cfg, n, r, seed * 100 + it, pattern, tokens) for r in range(n)]
            x, idx, w, sc = on_device(inputs[me], device)
            if it % 2:
                idx = idx.to(torch.int32)  # both index dtypes
            if prev is not None:
                poison(prev)
            out = ep.dispatch(x, idx, w, sc)
            check_dispatch(cfg, ep, out, inputs, me, n)
            y = identity_experts(cfg, out, device)
            if redispatch:
                assert ep.has_redispatch
                grads = [redispatch_rows(cfg, n, r, seed * 100 + it,
                                         inputs[r][0].shape[0]) for r in range(n)]
                back = None
                if it % 2:
                    back = ep.redispatch(grads[me].to(device), out.handle)
                    check_redispatch(cfg, back, out, grads, me)
            poisoned = torch.full((x.shape[0], cfg.hidden), float("nan"),
                                  dtype=getattr(torch, cfg.combine_dtype), device=device)
            scale = 1.0
            if combine_weight_override and cfg.layout == "expert_major" and it % 2:
                scale = 2.0
                res = ep.combine(y, out.handle, topk_weights=w * 2.0, out=poisoned)
            else:
                res = ep.combine(y, out.handle, out=poisoned)
            check_combine(cfg, res, *inputs[me], me, weight_scale=scale)
            if redispatch:
                if back is None:
                    back = ep.redispatch(grads[me].to(device), out.handle)
                    check_redispatch(cfg, back, out, grads, me)
                digest.update(bits(back.cpu()).numpy().tobytes())
            nrecv = int(out.num_recv_tokens)
            if cfg.layout != "expert_major":
                digest.update(bits(out.x[filled_rows(cfg, out)][:nrecv].cpu()).numpy().tobytes())
            else:
                for l in range(out.x.shape[0]):
                    digest.update(bits(out.x[l, :int(out.expert_counts[l])].cpu()).numpy().tobytes())
            if combine_digest:
                digest.update(bits(res.cpu()).numpy().tobytes())
            prev = out
    return digest.hexdigest()


def many_configs(configs: list, plan=DEFAULT_PLAN, device=None, redispatch: bool = False,
                 combine_digest: bool = True):
    """run_iterations for each config (dicts of EpConfig arguments)."""
    return [run_iterations(EpConfig(**c), plan, seed=i + 1, device=device, redispatch=redispatch,
                           combine_digest=combine_digest)
            for i, c in enumerate(configs)]


def redispatch_configs(configs: list, plan=DEFAULT_PLAN, combine_digest: bool = True):
    """many_configs with a redispatch in every iteration."""
    return many_configs(configs, plan, redispatch=True, combine_digest=combine_digest)


def tampered_redispatch(layout: str):
    """PE 0 edits its handle before two redispatches (a received row's place past the
    combine buffer, then a send-table row past it), then passes rows of the wrong
    shape. Every PE raises (the culprit ValueError, its peer SymheapError) and later
    redispatches and combines are right."""
    me, n = symheap.my_pe(), symheap.n_pes()
    dev = pe_device()
    cfg = EpConfig(hidden=32, max_tokens_per_rank=4, num_experts=2 * n, topk=2,
                   dtype="float32", layout=layout)
    g = torch.Generator().manual_seed(me)
    x = torch.randn(4, 32, generator=g).to(dev)
    idx = torch.tensor([[0, 2], [1, 3], [0, 3], [2, 1]], dtype=torch.int64).to(dev)
    w = torch.rand(4, 2, generator=g).to(dev)
    grads = [redispatch_rows(cfg, n, r, 3, 4) for r in range(n)]
    outcome = []
    with EpDispatchCombine(cfg) as ep:
        for edit in ("receive", "send", "shape", None, None):
            d = ep.dispatch(x, idx, w)
            h = d.handle
            if me == 0 and edit == "send":
                h.send_rows[1, 0] = 10 ** 8
            elif me == 0 and edit == "receive" and layout == "expert_major":
                h.recv_meta[0, 3] = 10 ** 8  # expert 0 holds rows from every PE
            elif me == 0 and edit == "receive":
                h.summary[4 * 1] = 10 ** 8  # PE 1's rows come from past its buffer
            rows = grads[me][:, :16] if me == 0 and edit == "shape" else grads[me]
            try:
                back = ep.redispatch(rows.to(dev), h)
                ep.check()  # cuda: a kernel found it; raised at the next call or here
            except (ValueError, symheap.SymheapError) as e:
                outcome.append(type(e).__name__)
                continue
            check_redispatch(cfg, back, d, grads, me)
            y = identity_experts(cfg, d, dev)
            check_combine(cfg, ep.combine(y, d.handle), x.cpu(), idx.cpu(), w.cpu(), None, me)
            outcome.append("ok")
    return outcome


def bad_input_then_recover(cfg_kwargs: dict, culprit: int, fault: str):
    """PE ``culprit`` passes bad input; every PE must raise (the culprit a
    ValueError), and the op must work afterwards. Returns (type name, message)."""
    cfg = EpConfig(**cfg_kwargs)
    me, n = symheap.my_pe(), symheap.n_pes()
    with EpDispatchCombine(cfg) as ep:
        x, idx, w, sc = make_inputs(cfg, n, me, 7, "random", "full")
        if me == culprit:
            if fault == "too_many_tokens":
                T = cfg.max_tokens_per_rank + 1
                x = torch.cat([x, x[:1]])
                idx, w = torch.cat([idx, idx[:1]]), torch.cat([w, w[:1]])
                sc = torch.cat([sc, sc[:1]]) if sc is not None else None
                assert x.shape[0] == T
            elif fault == "expert_too_large":
                idx[-1, 0] = cfg.num_experts
            elif fault == "expert_negative":
                idx[0, 0] = -2
            elif fault == "wrong_dtype":
                x = x.float() if cfg.dtype != "float32" else x.half()
            elif fault == "wrong_shape":
                w = w[:, :1].contiguous()
            elif fault == "int_weights":
                w = (w * 10).to(torch.int32)
        caught = None
        try:
            ep.dispatch(*on_device((x, idx, w, sc)))
            ep.check()  # device-side checks without host sync report here
        except Exception as e:  # the fault is reported on every PE
            caught = (type(e).__name__, str(e))
        if caught is None:
            raise AssertionError(f"PE {me}: dispatch with {fault} on PE {culprit} did not raise")
        run_ok = run_once(cfg, ep, seed=11)
    return caught, run_ok


def run_once(cfg, ep, seed, pattern="random", tokens="full", me=None, device=None, n_pes=None):
    """One checked dispatch + combine; ``me``, ``n_pes`` and ``device``
    default to the calling thread's PE."""
    n = symheap.n_pes() if me is None else n_pes
    me = symheap.my_pe() if me is None else me
    device = device or pe_device()
    inputs = [make_inputs(cfg, n, r, seed, pattern, tokens) for r in range(n)]
    out = ep.dispatch(*on_device(inputs[me], device))
    check_dispatch(cfg, ep, out, inputs, me, n)
    res = ep.combine(identity_experts(cfg, out, device), out.handle)
    ep.check()
    check_combine(cfg, res, *inputs[me], me, n_pes=n)
    return True


def ops_in_turn(configs: list, seed: int = 60):
    """Ops created one after another, each closed before the next: they get the same
    heap range, and each makes one checked dispatch + combine, so a new op's first
    call runs at the epoch the previous op's words ended on. Returns the workspace
    offsets (equal: the range really was reused)."""
    offsets = []
    for i, kw in enumerate(configs):
        with EpDispatchCombine(EpConfig(**kw)) as ep:
            offsets.append(ep._buf.offset)
            run_once(ep.config, ep, seed=seed + i)
    return offsets


def overflow(cfg_kwargs: dict):
    """all_to_one routing past max_recv_tokens / expert_capacity: every PE raises
    ValueError; the op stays usable."""
    cfg = EpConfig(**cfg_kwargs)
    me, n = symheap.my_pe(), symheap.n_pes()
    with EpDispatchCombine(cfg) as ep:
        x, idx, w, sc = make_inputs(cfg, n, me, 5, "all_to_one", "full")
        caught = None
        try:
            ep.dispatch(*on_device((x, idx, w, sc)))
            ep.check()
        except ValueError as e:
            caught = str(e)
        if caught is None:
            raise AssertionError(f"PE {me}: overflowing dispatch did not raise")
        # A routing that fits still works: few tokens, spread out.
        run_once(cfg, ep, seed=3, pattern="round_robin", tokens=1)
    return caught


def combine_misuse():
    """Errors of combine: token-major weights, wrong shape, foreign handle."""
    me, n = symheap.my_pe(), symheap.n_pes()
    cfg = EpConfig(hidden=16, max_tokens_per_rank=4, num_experts=2 * n, topk=2, dtype="float32")
    errors = []
    with EpDispatchCombine(cfg) as a, EpDispatchCombine(cfg) as b:
        x, idx, w, sc = make_inputs(cfg, n, me, 2, "random", "full")
        out = a.dispatch(*on_device((x, idx, w)))
        y = identity_experts(cfg, out, pe_device())
        for bad in ("weights", "shape", "foreign"):
            try:
                if bad == "weights":
                    a.combine(y, out.handle, topk_weights=w.to(y.device))
                elif bad == "shape":
                    a.combine(y[:-1], out.handle)
                else:
                    b.combine(y, out.handle)
            except ValueError as e:
                errors.append(str(e))
            else:
                raise AssertionError(f"combine misuse '{bad}' did not raise")
        res = a.combine(y, out.handle)  # still in step on every PE
        check_combine(cfg, res, x, idx, w, sc, me)
    return errors


def interleaved_ops():
    """Two ops alive at once, dispatches of one between dispatch and combine of
    the other; and a handle used after a later dispatch of its own op."""
    me, n = symheap.my_pe(), symheap.n_pes()
    ca = EpConfig(hidden=32, max_tokens_per_rank=6, num_experts=2 * n, topk=2, dtype="bfloat16")
    cb = EpConfig(hidden=16, max_tokens_per_rank=5, num_experts=4 * n, topk=3, dtype="float32",
                  layout="expert_major")
    cpu = pe_device()
    with EpDispatchCombine(ca) as a, EpDispatchCombine(cb) as b:
        ia = [make_inputs(ca, n, r, 21, "random", "full") for r in range(n)]
        ib = [make_inputs(cb, n, r, 22, "random_drop", "full") for r in range(n)]
        oa = a.dispatch(*on_device(ia[me]))
        ya = identity_experts(ca, oa, cpu)  # computed before the next dispatch
        ob = b.dispatch(*on_device(ib[me]))
        check_dispatch(cb, b, ob, ib, me, n)
        ia2 = [make_inputs(ca, n, r, 23, "round_robin", "full") for r in range(n)]
        oa2 = a.dispatch(*on_device(ia2[me]))  # overwrites oa's views, not oa's handle
        check_dispatch(ca, a, oa2, ia2, me, n)
        check_combine(ca, a.combine(ya, oa.handle), *ia[me], me)
        check_combine(cb, b.combine(identity_experts(cb, ob, cpu), ob.handle), *ib[me], me)
        check_combine(ca, a.combine(identity_experts(ca, oa2, cpu), oa2.handle), *ia2[me], me)
    return True


def heap_after_ops(cfg_kwargs: dict, rounds: int = 3):
    """Creating and closing ops leaves the heap as it was."""
    before = symheap.heap_usage()["bytes_in_use"]
    for i in range(rounds):
        with EpDispatchCombine(EpConfig(**cfg_kwargs)) as ep:
            run_once(ep.config, ep, seed=40 + i)
    return before, symheap.heap_usage()["bytes_in_use"]


def absent_peer(culprit: int):
    """PE ``culprit`` never calls dispatch: the others time out naming it."""
    me, n = symheap.my_pe(), symheap.n_pes()
    cfg = EpConfig(hidden=16, max_tokens_per_rank=4, num_experts=2 * n, topk=2, dtype="float32")
    ep = EpDispatchCombine(cfg)
    result = None
    if me != culprit:
        try:
            ep.dispatch(*on_device(make_inputs(cfg, n, me, 1, "random", "full")))
            ep.check()
        except TimeoutError as e:
            result = str(e)
    symheap.barrier_all(timeout=60)  # the culprit waits out the others' timeout here
    ep.close()
    return result


def graph_replay(cfg_kwargs: dict, replays: int = 10):
    """CUDA graph of dispatch -> identity experts -> combine, captured once and
    replayed with fresh routing and payload each time (cuda only)."""
    cfg = EpConfig(**cfg_kwargs)
    me, n = symheap.my_pe(), symheap.n_pes()
    dev = pe_device()
    patterns = ["random", "random_drop", "round_robin", "all_to_one"]
    with EpDispatchCombine(cfg) as ep:
        static = list(on_device(make_inputs(cfg, n, me, 500, "random", "full")))
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):  # warm-up outside the graph
            out = ep.dispatch(*static)
            ep.combine(identity_experts(cfg, out, dev), out.handle)
        torch.cuda.current_stream(dev).wait_stream(side)
        ep.check()
        graph = torch.cuda.CUDAGraph()
        # One capture at a time: entering torch.cuda.graph() empties the allocator cache of
        # every device, which would invalidate a capture running in another thread. The
        # capture stream is this device's: torch's default one is shared by the process.
        for turn in range(n):
            if turn == me:
                with torch.cuda.graph(graph, stream=side, capture_error_mode="thread_local"):
                    out = ep.dispatch(*static)
                    res = ep.combine(identity_experts(cfg, out, dev), out.handle)
            symheap.barrier_all()
        for i in range(replays):
            inputs = [make_inputs(cfg, n, r, 600 + i, patterns[i % len(patterns)], "full")
                      for r in range(n)]
            for dst, src in zip(static, on_device(inputs[me])):
                if dst is not None:
                    dst.copy_(src)
            poison(out)
            res.fill_(float("nan"))
            graph.replay()
            ep.check()
            check_dispatch(cfg, ep, out, inputs, me, n)
            check_combine(cfg, res, *inputs[me], me)
    return replays


def from_other_thread(cfg_kwargs: dict, helper_devices=(0, 7)):
    """PE 1's dispatch and combine run on a helper thread whose current device
    is another one (by default PE 0's, then one with no PE): the op runs on
    PE 1 and the helper's current device is left as it was. Returns, per
    round, the helper's current device before and after."""
    import threading
    cfg = EpConfig(**cfg_kwargs)
    me, n = symheap.my_pe(), symheap.n_pes()
    seen = []
    with EpDispatchCombine(cfg) as ep:
        for r, helper_device in enumerate(helper_devices):
            if me != 1:
                run_once(cfg, ep, seed=20 + r)
                continue
            box, device = {}, pe_device()

            def helper():
                try:
                    symheap.set_device(helper_device)
                    before = symheap.current_device()
                    run_once(cfg, ep, seed=20 + r, me=1, device=device, n_pes=n)
                    box["devices"] = (before, symheap.current_device())
                except BaseException as e:  # reported to the PE thread
                    box["error"] = f"{type(e).__name__}: {e}"

            t = threading.Thread(target=helper, name=f"helper{r}")
            t.start()
            t.join(120)
            if t.is_alive():
                raise AssertionError("helper thread still running after 120 s")
            if "error" in box:
                raise AssertionError(box["error"])
            seen.append(box["devices"])
    return seen


def tampered_handle(layout="token_major"):
    """Edited combine handles on one PE (cpu; cuda and its emulation reuse it)."""
    me, n = symheap.my_pe(), symheap.n_pes()
    cfg = EpConfig(hidden=32, max_tokens_per_rank=4, num_experts=4, topk=2, dtype="float32",
                   layout=layout)
    g = torch.Generator().manual_seed(me)
    dev = pe_device()
    x = torch.randn(4, 32, generator=g).to(dev)
    idx = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(4)]).to(dev, torch.int64)
    w = torch.rand(4, 2, generator=g).to(dev)
    outcome = []
    with EpDispatchCombine(cfg) as ep:
        d = ep.dispatch(x, idx, w)
        if me == 0 and layout == "token_major":  # PE 1's rows go back past the buffer
            d.handle.summary[4 * 1] = 10 ** 8
        elif me == 0:
            d.handle.recv_meta[0, 3] = 10 ** 8
            d.handle.recv_meta[0, 0] = 0
        try:
            ep.combine(d.x.clone(), d.handle)
            ep.check()  # cuda: a kernel found it; raised at the next call or here
        except (ValueError, symheap.SymheapError) as e:
            outcome.append(type(e).__name__)
        d2 = ep.dispatch(x, idx, w)  # the op still works afterwards
        bad = d2.handle
        if me == 0:
            bad.send_rows = bad.send_rows[:1]
        try:
            ep.combine(d2.x.clone(), bad)
            ep.check()
        except (ValueError, symheap.SymheapError) as e:
            outcome.append(type(e).__name__)
        # Then right results again, from calls that reuse the failed calls'
        # buffers and statuses (the kernels alternate between two sets).
        for _ in range(2):
            d3 = ep.dispatch(x, idx, w)
            if layout == "token_major":
                out = ep.combine(d3.x * d3.topk_weights.sum(1, keepdim=True), d3.handle)
            else:
                out = ep.combine(d3.x, d3.handle)
            ep.check()
            ref = x * w.sum(1, keepdim=True)
            outcome.append("ok" if torch.allclose(out, ref, rtol=1e-5, atol=1e-5) else "wrong")
    return outcome
