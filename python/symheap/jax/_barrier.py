"""symheap.jax.barrier: a barrier over every PE that XLA keeps in program order."""
from __future__ import annotations

from ._ffi import ffi_call


def barrier(token):
    """Waits until every PE reached this barrier; returns ``token`` (any array).

    Thread the result into what must run after the barrier (and the input
    from what must run before it): the token is aliased through the call and
    the call has a side effect, so XLA neither reorders nor drops it. On cpu
    the barrier completes before the call returns; on CUDA it is a device
    barrier ordered on XLA's stream.
    """
    import jax.numpy as jnp
    token = jnp.asarray(token)
    call = ffi_call("symheap_barrier", ((tuple(token.shape), token.dtype.name),), ((0, 0),), True)
    return call(token)[0]
