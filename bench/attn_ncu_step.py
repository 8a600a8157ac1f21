"""Three forward+backward calls of one attention shape, for a profiler: ncu
with --launch-skip over the first two picks the third's kernels.

    python bench/attn_ncu_step.py own|cudnn HEAD_DIM CAUSAL(0|1) SEQLEN
    ncu --kernel-name regex:dkdv --launch-skip 2 --launch-count 1 \\
        --section WarpStateStats --section SourceCounters \\
        python bench/attn_ncu_step.py own 64 0 4096

bf16, B x S = 16k tokens, H x D = 2048 (bench/attn_bench.py's shapes). `own`:
symheap.attention's own kernels; `cudnn`: torch SDPA's cuDNN backend (its
backward runs on autograd's thread: select its kernels by name, not by an
NVTX range of this thread).
"""
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from symheap.attention import flash_attn_func


def main():
    which, D, causal, S = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1", int(sys.argv[4])
    if which not in ("own", "cudnn"):
        raise SystemExit("usage: attn_ncu_step.py own|cudnn HEAD_DIM CAUSAL(0|1) SEQLEN")
    H, B = 2048 // D, 16384 // S
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
               for _ in range(3))
    dout = torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    for _ in range(3):
        if which == "own":
            out = flash_attn_func(q, k, v, causal=causal, backend="own")
        else:
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                     is_causal=causal).transpose(1, 2)
        out.backward(dout)
    torch.cuda.synchronize()
    print(f"done: {which}, head dim {D}, causal {causal}, S {S}")


if __name__ == "__main__":
    main()
