"""Attention forward and backward with symheap.attention (cpu, or CUDA when a
GPU is present): causal GQA with a per-key bias, checked against plain PyTorch."""
import torch

from symheap.attention import attention_reference, flash_attn_func, flash_attn_varlen_func

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
B, S, Hq, Hkv, D = 2, 300, 8, 2, 96
q = torch.randn(B, S, Hq, D, device=device, dtype=torch.bfloat16, requires_grad=True)
k = torch.randn(B, S, Hkv, D, device=device, dtype=torch.bfloat16, requires_grad=True)
v = torch.randn(B, S, Hkv, D, device=device, dtype=torch.bfloat16, requires_grad=True)
bias = torch.randn(1, 1, 1, S, device=device, dtype=torch.bfloat16, requires_grad=True)

out, lse = flash_attn_func(q, k, v, causal=True, bias=bias, return_lse=True)
out.sum().backward()
ref, ref_lse = attention_reference(q, k, v, causal=True, bias=bias)
assert (out.float() - ref.float()).abs().max().item() < 2e-2
print(f"device {device}: out {tuple(out.shape)}, max |out - ref| = "
      f"{(out.float() - ref.float()).abs().max().item():.2e}, "
      f"max |lse - ref| = {(lse - ref_lse).abs().max().item():.2e}, "
      f"dbias shape {tuple(bias.grad.shape)}")

# Two packed sequences of lengths 100 and 250.
cu = torch.tensor([0, 100, 350], dtype=torch.int32, device=device)
packed = torch.randn(350, Hq, D, device=device, dtype=torch.bfloat16)
out_varlen = flash_attn_varlen_func(packed, packed, packed, cu, cu, 250, 250, causal=True)
first = flash_attn_func(packed[None, :100], packed[None, :100], packed[None, :100], causal=True)
assert torch.allclose(out_varlen[:100].float(), first[0].float(), atol=1e-2)
print(f"varlen out {tuple(out_varlen.shape)}, first sequence matches flash_attn_func")
