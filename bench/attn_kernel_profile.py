"""Every kernel one attention call launches, ours against SDPA's cuDNN backend
(torch profiler; us per call), with the call's CUDA-event time: where a
forward+backward's time goes beyond the main kernels (delta, workspace
memsets, dQ conversion).

    python bench/attn_kernel_profile.py [--hdims 64,128] [--seqlens 1024,16384] [--causal] [--fwd-only]

bf16, B x S = 16k tokens, H x D = 2048, as bench/attn_bench.py.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from attn_bench import profiled_kernels_us
from symheap.attention import flash_attn_func


def kernels_us(fn, reps=5):
    """profiled_kernels_us's rows, and the call's CUDA-event time (us, mean of 10)."""
    rows = profiled_kernels_us(fn, reps)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        fn()
    end.record()
    end.synchronize()
    return rows, start.elapsed_time(end) * 100


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hdims", default="64,128")
    parser.add_argument("--seqlens", default="1024,16384")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--fwd-only", action="store_true")
    args = parser.parse_args()
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    for D in (int(x) for x in args.hdims.split(",")):
        for S in (int(x) for x in args.seqlens.split(",")):
            B, H = 16384 // S, 2048 // D
            gen = torch.Generator(device="cuda").manual_seed(0)
            mk = lambda: torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, generator=gen)  # noqa: E731
            q, k, v = (mk().requires_grad_() for _ in range(3))
            dout = mk()
            qt, kt, vt = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v))

            def ours():
                out = flash_attn_func(q, k, v, causal=args.causal, backend="own")
                if not args.fwd_only:
                    torch.autograd.grad(out, (q, k, v), dout)

            def cudnn():
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=args.causal)
                    if not args.fwd_only:
                        torch.autograd.grad(out, (qt, kt, vt), dout.transpose(1, 2))

            print(f"== head dim {D}, S {S} (B {B}, H {H}), causal {args.causal}, "
                  f"{'forward' if args.fwd_only else 'forward+backward'}")
            for name, fn in (("own", ours), ("SDPA cuDNN", cudnn)):
                rows, event_us = kernels_us(fn)
                print(f"-- {name}: {event_us:.1f} us per call (CUDA events), kernels "
                      f"{sum(r[0] for r in rows):.1f}")
                for us, n, key in rows:
                    print(f"   {us:9.1f} us  x{n}  {key[:100]}")


if __name__ == "__main__":
    main()
