"""Per-block fp8 (e4m3) quantisation helpers for dispatch payloads."""
from __future__ import annotations

FP8_E4M3_MAX = 448.0


def quantize_fp8(x, scale_dim: int):
    """Splits each row of ``x`` [T, H] into blocks of ``scale_dim`` values and
    scales each block into the e4m3 range. Returns (x_fp8 [T, H], scales
    [T, H / scale_dim] float32) with x ~= x_fp8 * scales (per block)."""
    import torch
    t, h = x.shape
    if scale_dim <= 0 or h % scale_dim:
        raise ValueError(f"scale_dim={scale_dim} must be positive and divide hidden={h}")
    blocks = x.float().reshape(t, h // scale_dim, scale_dim)
    amax = blocks.abs().amax(dim=-1).clamp(min=1e-12)
    scales = amax / FP8_E4M3_MAX
    q = (blocks / scales.unsqueeze(-1)).to(torch.float8_e4m3fn)
    return q.reshape(t, h), scales.contiguous()


def dequantize_fp8(x_fp8, scales, dtype=None):
    """Inverse of quantize_fp8: x_fp8 [..., H] times its block scales."""
    import torch
    h = x_fp8.shape[-1]
    s = scales.shape[-1]
    blocks = x_fp8.float().reshape(*x_fp8.shape[:-1], s, h // s) * scales.float().unsqueeze(-1)
    out = blocks.reshape(x_fp8.shape)
    return out if dtype is None else out.to(dtype if not isinstance(dtype, str)
                                             else getattr(torch, dtype))
