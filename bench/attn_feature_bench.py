"""Attention with features, in one run: a bias with its gradient, a causal sliding
window, softcap, GQA, varlen, a boolean mask, ALiBi, dropout and varlen with softcap
(the packed kernels' feature forms). For each row:
symheap's forward and forward+backward, optionally the own forward with
SYMHEAP_ATTN_OWN_FORWARD=V (--compare-forward V, e.g. pipelined against the
default Hopper kernel) and the own forward+backward with SYMHEAP_ATTN_OWN_BACKWARD=V
(--compare-backward V, e.g. pipelined_dq_separate: the pipelined feature
kernels against the Hopper one), and torch SDPA computing the same function where an explicit
mask can say it (bias: a float mask; window and mask: a boolean one; GQA:
enable_gqa), and SDPA with its own dropout on the dropout row (a timing only: its
random stream is not ours). bf16 on CUDA, B*S = 16k tokens, H*D = 2048; TFLOP/s count the
visible (query, key) pairs only.

    python bench/attn_feature_bench.py [--backend own] [--hdim 128] [--seqlen 4096]
                                       [--compare-forward pipelined] [--compare-backward pipelined_dq_separate]
                                       [--fwd-only] [--features bias,softcap]
    python bench/attn_feature_bench.py --smoke          (cpu, tiny shapes: the rows run and agree)

Every symheap output is compared with the fp32 reference of
symheap.attention.attention_reference in the same run (max abs difference printed);
with --smoke a difference over 1e-3 exits non-zero.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from symheap.attention import attention_reference, dropout_keep_mask, flash_attn_func, flash_attn_varlen_func

FEATURES = ["bias", "window", "softcap", "gqa", "varlen", "mask", "alibi", "dropout", "varlen_softcap"]


def timer(device):
    """Median ms per call of fn: CUDA events on cuda, the wall clock on cpu."""
    def time_ms(fn, warmup=2, reps=8):
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(reps):
            if device == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t) * 1e3)
        return statistics.median(times)
    return time_ms


class env_value:
    """Environment variable `name` = value while active (the kernels' choice
    reads it per call)."""

    def __init__(self, name, value):
        self.name, self.value = name, value

    def __enter__(self):
        self.saved = os.environ.get(self.name)
        os.environ[self.name] = self.value

    def __exit__(self, *exc):
        if self.saved is None:
            os.environ.pop(self.name, None)
        else:
            os.environ[self.name] = self.saved


def make_row(feature, D, S, device, dtype, gen):
    """The call's inputs and options, its SDPA equivalent (or None) and its
    visible (query, key) pairs."""
    B, H = max(1, 16384 // S), max(1, 2048 // D)
    if device == "cpu":
        B, H = 2, 2
    Hkv = max(1, H // 4) if feature == "gqa" else H
    rnd = lambda *shape: torch.randn(*shape, device=device, dtype=dtype, generator=gen)  # noqa: E731
    q, k, v = rnd(B, S, H, D), rnd(B, S, Hkv, D), rnd(B, S, Hkv, D)
    row = dict(feature=feature, hdim=D, seqlen=S, batch=B, heads=H, kv_heads=Hkv, q=q, k=k, v=v,
               opts={}, sdpa=None, pairs=B * H * S * S, varlen=None)
    if feature == "bias":
        bias = (0.5 * rnd(1, 1, S, S)).requires_grad_()
        row["opts"] = dict(bias=bias)
        row["sdpa"] = dict(attn_mask=bias)
    elif feature == "window":
        left = S // 8
        row["opts"] = dict(causal=True, window_size=(left, 0))
        i = torch.arange(S, device=device)
        mask = (i[None, :] <= i[:, None]) & (i[None, :] >= i[:, None] - left)
        row["sdpa"] = dict(attn_mask=mask)
        row["pairs"] = B * H * int(mask.sum())
    elif feature == "softcap":
        row["opts"] = dict(softcap=30.0)
    elif feature == "gqa":
        row["opts"] = dict(causal=True)
        row["sdpa"] = dict(is_causal=True, enable_gqa=True)
        row["pairs"] = B * H * S * (S + 1) // 2
    elif feature in ("varlen", "varlen_softcap"):
        # B * S tokens packed as sequences of random lengths (S / 4 .. 2 S, truncated);
        # varlen_softcap: the same with softcap (the packed kernels' feature forms).
        lens, total, lengths = [], B * S, torch.Generator().manual_seed(1)
        while total > 0:
            n = min(total, int(torch.randint(S // 4, 2 * S + 1, (1,), generator=lengths)))
            lens.append(n)
            total -= n
        cu = torch.tensor([0] + lens, device=device).cumsum(0).to(torch.int32)
        row["varlen"] = dict(cu=cu, max_len=max(lens), lens=lens)
        row["q"], row["k"], row["v"] = (x.reshape(B * S, -1, D) for x in (q, k, v))
        row["pairs"] = H * sum(n * n for n in lens)
        if feature == "varlen_softcap":
            row["opts"] = dict(softcap=30.0)
    elif feature == "mask":
        # Each query row sees a random half of the keys (its first key always).
        mask = torch.rand(1, 1, S, S, device=device, generator=gen) < 0.5
        mask[..., 0] = True
        row["opts"] = dict(mask=mask)
        row["sdpa"] = dict(attn_mask=mask)
    elif feature == "alibi":
        row["opts"] = dict(causal=True, alibi_slopes=torch.rand(H, device=device, generator=gen) / 8)
        row["pairs"] = B * H * S * (S + 1) // 2
    elif feature == "dropout":
        row["opts"] = dict(dropout_p=0.1, seed=7)
        # SDPA's own random stream: its figure is timing only (the diff column is ours).
        row["sdpa"] = dict(dropout_p=0.1)
    return row


BACKEND = None  # flash_attn_func's backend= (--backend)


def call(row):
    q, k, v = row["q"], row["k"], row["v"]
    if row["varlen"]:
        vl = row["varlen"]
        return flash_attn_varlen_func(q, k, v, vl["cu"], vl["cu"], vl["max_len"], vl["max_len"],
                                      backend=BACKEND, **row["opts"])
    return flash_attn_func(q, k, v, backend=BACKEND, **row["opts"])


@torch.no_grad()
def reference(row):
    """fp32 reference output of the row's call."""
    q, k, v = row["q"], row["k"], row["v"]
    opts = {key: (val.detach() if torch.is_tensor(val) else val) for key, val in row["opts"].items()}
    if opts.get("dropout_p", 0) > 0:  # the keep mask the call's seed gives
        B, S, H, _ = q.shape
        opts["dropout_keep"] = dropout_keep_mask(opts.pop("seed"), 0, B, H, S, S, opts["dropout_p"]).to(q.device)
    if row["varlen"]:
        outs, cu = [], row["varlen"]["cu"].tolist()
        for a, b in zip(cu[:-1], cu[1:]):
            out, _ = attention_reference(q[None, a:b], k[None, a:b], v[None, a:b], upcast=True, **opts)
            outs.append(out[0])
        return torch.cat(outs)
    out, _ = attention_reference(q, k, v, upcast=True, **opts)
    return out


def bench_row(row, time_ms, compare_forward, compare_backward, fwd_only, unit):
    q, k, v = (x.requires_grad_() for x in (row["q"], row["k"], row["v"]))
    grads_of = [q, k, v] + [t for t in row["opts"].values() if torch.is_tensor(t) and t.requires_grad]
    dout = torch.randn_like(q)
    flops = 4 * row["pairs"] * row["hdim"]
    result = {}

    def fwd():
        with torch.no_grad():
            return call(row)

    def fwd_bwd():
        torch.autograd.grad(call(row), grads_of, dout)

    cases = {"symheap": (fwd, fwd_bwd)}
    if compare_forward:
        def variant():
            with env_value("SYMHEAP_ATTN_OWN_FORWARD", compare_forward), torch.no_grad():
                return call(row)
        cases["variant"] = (variant, None)
    if compare_backward and not fwd_only:
        def variant_bwd():
            with env_value("SYMHEAP_ATTN_OWN_BACKWARD", compare_backward):
                fwd_bwd()
        cases["variant_bwd"] = (None, variant_bwd)
    if row["sdpa"] is not None:
        qt, kt, vt = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v))
        sdpa_opts = dict(row["sdpa"])
        extra = [sdpa_opts["attn_mask"]] if torch.is_tensor(sdpa_opts.get("attn_mask")) and \
            sdpa_opts["attn_mask"].requires_grad else []

        def sdpa_fwd():
            with torch.no_grad():
                return F.scaled_dot_product_attention(qt, kt, vt, **sdpa_opts)

        def sdpa_fwd_bwd():
            out = F.scaled_dot_product_attention(qt, kt, vt, **sdpa_opts)
            torch.autograd.grad(out, [qt, kt, vt] + extra, dout.transpose(1, 2))
        cases["sdpa"] = (sdpa_fwd, sdpa_fwd_bwd)
    for name, (f, fb) in cases.items():
        try:
            result[name] = {} if f is None else {"fwd_tflops": flops / time_ms(f) / unit}
            if fb is not None and not fwd_only:
                result[name]["fwd_bwd_tflops"] = 3.5 * flops / time_ms(fb) / unit
        except Exception as e:  # noqa: BLE001 - a path may not serve a row: reported
            result[name] = {"error": f"{type(e).__name__}: {e}"[:160]}
    ref = reference(row).float()
    result["diff"] = (fwd().float() - ref).abs().max().item()
    if compare_forward and "error" not in result["variant"]:
        result["variant_diff"] = (cases["variant"][0]().float() - ref).abs().max().item()
    return result


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=["auto", "cudnn", "own"], default=None,
                   help="symheap's path (flash_attn_func's backend=; default $SYMHEAP_ATTN_BACKEND, else auto)")
    p.add_argument("--hdim", type=int, default=128)
    p.add_argument("--seqlen", type=int, default=4096)
    p.add_argument("--features", default=",".join(FEATURES), help="comma-separated rows of " + ", ".join(FEATURES))
    p.add_argument("--compare-forward", metavar="VALUE",
                   help="also time the own forward with SYMHEAP_ATTN_OWN_FORWARD=VALUE (e.g. pipelined)")
    p.add_argument("--compare-backward", metavar="VALUE",
                   help="also time the own forward+backward with SYMHEAP_ATTN_OWN_BACKWARD=VALUE (e.g. pipelined_dq_separate)")
    p.add_argument("--fwd-only", action="store_true")
    p.add_argument("--smoke", action="store_true", help="cpu, tiny shapes, float32; exits non-zero on a wrong row")
    a = p.parse_args(argv)
    global BACKEND
    BACKEND = a.backend
    device = "cpu" if a.smoke else "cuda"
    unit, unit_name = (1e6, "GFLOP/s") if a.smoke else (1e9, "TFLOP/s")  # FLOP per ms
    dtype = torch.float32 if a.smoke else torch.bfloat16
    D, S = (32, 48) if a.smoke else (a.hdim, a.seqlen)
    time_ms = timer(device)
    gen = torch.Generator(device=device)
    print(f"device {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}, {dtype}, hdim {D}, "
          f"seqlen {S}, symheap backend {a.backend or os.environ.get('SYMHEAP_ATTN_BACKEND') or 'auto'}; "
          f"{unit_name} of the visible (query, key) pairs", flush=True)
    head = (f"{'feature':>8} | {'symheap fwd / fwd+bwd':>21} | "
            + (f"{'variant fwd':>11} | " if a.compare_forward else "")
            + (f"{'variant fwd+bwd':>15} | " if a.compare_backward else "")
            + f"{'SDPA fwd / fwd+bwd':>18} | max|diff| vs fp32")
    print(head)
    features = a.features.split(",")
    unknown = [f for f in features if f not in FEATURES]
    if unknown:
        sys.exit(f"unknown feature(s) {', '.join(unknown)}; choose from {', '.join(FEATURES)}")
    bad = []
    for feature in features:
        # Each row's data from its own seed: the same whichever rows run before it.
        row = make_row(feature, D, S, device, dtype, gen.manual_seed(FEATURES.index(feature)))
        r = bench_row(row, time_ms, a.compare_forward, a.compare_backward, a.fwd_only, unit)
        fmt = lambda n, key: (f"{r[n][key]:7.1f}" if key in r.get(n, {}) else  # noqa: E731
                              ("  error" if "error" in r.get(n, {}) else "    n/a"))
        line = (f"{feature:>8} | {fmt('symheap', 'fwd_tflops')} / {fmt('symheap', 'fwd_bwd_tflops')}      | "
                + (f"{fmt('variant', 'fwd_tflops'):>11} | " if a.compare_forward else "")
                + (f"{fmt('variant_bwd', 'fwd_bwd_tflops'):>15} | " if a.compare_backward else "")
                + f"{fmt('sdpa', 'fwd_tflops')} / {fmt('sdpa', 'fwd_bwd_tflops')} | {r['diff']:.2e}"
                + (f" (variant {r['variant_diff']:.2e})" if "variant_diff" in r else ""))
        print(line, flush=True)
        for name in ("symheap", "variant", "variant_bwd", "sdpa"):
            if "error" in r.get(name, {}):
                print(f"  {name}: {r[name]['error']}")
                if name == "symheap":
                    bad.append(feature)
        if a.smoke and not r["diff"] < 1e-3:
            bad.append(feature)
    if bad:
        sys.exit(f"rows failed: {', '.join(bad)}")


if __name__ == "__main__":
    main()
