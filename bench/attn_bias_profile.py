"""Where the bias row's forward+backward goes (the "bias" row of
bench/attn_feature_bench.py: a bias (1, 1, S, S) with its gradient): the
kernels of symheap's own path against those of SDPA's efficient-attention
backend given the same float mask requiring grad; device time per call
(torch profiler).

    PYTHONPATH=bench python bench/attn_bias_profile.py [HEAD_DIM [SEQLEN]]    (default 128 4096)
"""
import sys
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from attn_bench import profiled_kernels_us
from symheap.attention import flash_attn_func

D, S = int(sys.argv[1]) if len(sys.argv) > 1 else 128, int(sys.argv[2]) if len(sys.argv) > 2 else 4096
B, H = 16384 // S, 2048 // D
gen = torch.Generator(device="cuda").manual_seed(0)
mk = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=gen)  # noqa: E731
q, k, v = (mk(B, S, H, D).requires_grad_() for _ in range(3))
bias = mk(1, 1, S, S).requires_grad_()
dout = mk(B, S, H, D)
qt, kt, vt = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v))
bt = bias.detach().requires_grad_()

def ours():
    out = flash_attn_func(q, k, v, bias=bias, backend="own")
    torch.autograd.grad(out, (q, k, v, bias), dout)

def sdpa():
    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=bt)
        torch.autograd.grad(out, (qt, kt, vt, bt), dout.transpose(1, 2))

for name, fn in (("own", ours), ("SDPA efficient", sdpa)):
    rows = profiled_kernels_us(fn, 3)
    print(f"-- {name}: kernels {sum(r[0] for r in rows):.1f} us per call")
    for us, n, key in rows:
        print(f"   {us:9.1f} us  x{n}  {key[:110]}")
