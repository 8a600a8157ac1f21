"""Plain PyTorch attention with the same semantics as ``flash_attn_func``
(materialises the (Sq, Sk) scores; for tests and checks, not for speed)."""
from __future__ import annotations

import math

import numpy as np
import torch

from .. import _core


def dropout_keep_mask(seed: int, offset: int, batch: int, heads_q: int, seqlen_q: int,
                      seqlen_k: int, dropout_p: float) -> torch.Tensor:
    """The keep mask (B, Hq, Sq, Sk), bool, that a call with this (seed, offset)
    and dropout_p uses; element (b, h, i, j) comes from the same counter-based
    generator as the cpu and CUDA kernels (for varlen, i and j are positions
    inside sequence b)."""
    out = np.empty((batch, heads_q, seqlen_q, seqlen_k), dtype=np.bool_)
    for b in range(batch):
        for h in range(heads_q):
            raw = _core.attention_dropout_keep(seed, offset, b * heads_q + h, seqlen_q, seqlen_k,
                                               float(dropout_p))
            out[b, h] = np.frombuffer(raw, dtype=np.uint8).reshape(seqlen_q, seqlen_k) != 0
    return torch.from_numpy(out)


def _heads_to_q(x: torch.Tensor, heads_q: int) -> torch.Tensor:
    """(B, H, Sq, Sk) with H in {1, Hkv, Hq} -> broadcastable over Hq."""
    h = x.shape[1]
    if h in (1, heads_q):
        return x
    return x.repeat_interleave(heads_q // h, dim=1)


def attention_reference(q, k, v, *, causal=False, window_size=(-1, -1), softmax_scale=None,
                        softcap=0.0, bias=None, mask=None, alibi_slopes=None, dropout_p=0.0,
                        dropout_keep=None, upcast=True):
    """Returns (out, lse) for (B, S, H, D) inputs. With ``upcast`` the math runs
    in float32 and ``out`` is cast back to q's dtype at the end; otherwise it
    runs in the input dtype (the precision baseline of the tests)."""
    dtype = q.dtype
    if upcast:
        q, k, v = q.float(), k.float(), v.float()
        bias = bias.float() if bias is not None else None
    B, Sq, Hq, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(D) if softmax_scale is None else softmax_scale
    k = k.repeat_interleave(Hq // Hkv, dim=2)
    v = v.repeat_interleave(Hq // Hkv, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    if bias is not None:
        b4 = bias[(None,) * (4 - bias.dim())] if bias.dim() < 4 else bias
        scores = scores + _heads_to_q(b4, Hq).to(scores.dtype)
    i = torch.arange(Sq).view(Sq, 1)
    j = torch.arange(Sk).view(1, Sk)
    diag = i + (Sk - Sq)
    if alibi_slopes is not None:
        slopes = alibi_slopes.float().reshape(-1, Hq, 1, 1).to(scores.device)
        scores = scores - (slopes * (diag - j).abs().to(scores.device)).to(scores.dtype)
    left, right = window_size
    if causal:
        right = 0
    visible = torch.ones(Sq, Sk, dtype=torch.bool)
    if left >= 0:
        visible &= j >= diag - left
    if right >= 0:
        visible &= j <= diag + right
    visible = visible.to(scores.device).view(1, 1, Sq, Sk)
    if mask is not None:
        m4 = mask[(None,) * (4 - mask.dim())] if mask.dim() < 4 else mask
        visible = visible & _heads_to_q(m4, Hq)
    visible = visible.expand(B, Hq, Sq, Sk)
    any_visible = visible.any(-1, keepdim=True)
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores.float(), dim=-1)
    # Rows with no visible key: finite scores so the softmax (and its gradient)
    # stays free of NaN, then zero probabilities.
    scores = scores.masked_fill(~any_visible, 0.0)
    attn = torch.softmax(scores, dim=-1).masked_fill(~any_visible, 0.0)
    if dropout_p > 0:
        attn = attn.masked_fill(~dropout_keep.to(attn.device), 0.0) / (1.0 - dropout_p)
    out = torch.einsum("bhqk,bkhd->bqhd", attn.to(v.dtype), v)
    return out.to(dtype), lse
