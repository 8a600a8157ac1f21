"""FlashAttention-style multi-head attention, forward and backward.

``flash_attn_func`` and ``flash_attn_varlen_func`` take plain torch tensors on
the cpu or a CUDA device (no ``symheap.init`` needed) and are differentiable in
q, k, v and bias. See docs/attention.md.
"""
from ._function import backends, flash_attn_func, flash_attn_varlen_func
from ._kvcache import flash_attn_with_kvcache, kvcache_check
from .reference import attention_reference, dropout_keep_mask

__all__ = ["backends", "flash_attn_func", "flash_attn_varlen_func", "attention_reference",
           "dropout_keep_mask", "flash_attn_with_kvcache", "kvcache_check"]
