"""JAX front end of symheap: XLA FFI custom calls (see docs/jax.md)."""
from ._attention import flash_attn_func, flash_attn_varlen_func

__all__ = ["flash_attn_func", "flash_attn_varlen_func"]
