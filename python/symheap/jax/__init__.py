"""symheap for JAX: every JAX device a PE, and XLA FFI calls usable inside jit.

    import symheap.jax as shj
    shj.init()                        # every local device becomes a PE
    mesh = shj.make_mesh()            # PE rank order
    op = shj.EpDispatchCombine(symheap.ep.EpConfig(...))
    d = op.dispatch(x, topk_idx, topk_weights)   # inside jit / shard_map
    y = op.combine(expert_out, d.handle)
    token = shj.barrier(token)

See docs/jax.md.
"""
from ._barrier import barrier
from ._ep import DispatchOutput, EpDispatchCombine, EpHandle
from ._runtime import (check_mesh, finalize, init, is_initialized, make_mesh, num_pes, rank_of,
                       shard_map)

from ._attention import flash_attn_func, flash_attn_varlen_func
from ._kvcache import flash_attn_with_kvcache, kvcache_check

__all__ = ["init", "finalize", "is_initialized", "make_mesh", "num_pes", "rank_of", "check_mesh",
           "shard_map", "barrier",
           "EpDispatchCombine", "DispatchOutput", "EpHandle",
           "flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache", "kvcache_check"]
