"""symheap: symmetric-memory (SHMEM) communication where a PE is a (process, device) pair.

One process may drive many devices with one thread each, or one device per
process (torchrun, mpirun), or any mix; the same program runs in all of them.
See docs/shmem.md.
"""
from ._errors import RemoteError, SymheapError, UnsupportedError
from ._runtime import (
    backend,
    current_device,
    device_count,
    device_of,
    finalize,
    get_unique_id,
    init,
    init_mpi,
    init_torch,
    is_initialized,
    my_pe,
    n_pes,
    peer_kind,
    set_device,
)
from ._backend_views import device_context, device_context_dtype
from ._memory import SymBuffer, empty, free, heap_usage, malloc, peer_tensor
from ._rma import (
    atomic_compare_swap,
    atomic_fetch_add,
    atomic_swap,
    barrier_all,
    fence,
    get,
    put,
    put_signal,
    quiet,
    signal_op,
    signal_wait_until,
)

__version__ = "0.1.0"


def get_include() -> str:
    """The folder to put on a compiler's include path for ``#include <symheap/device.cuh>``
    (and the public C++ headers): installed with the package, else the source tree's."""
    import os
    here = os.path.dirname(os.path.abspath(__file__))
    for candidate in (os.path.join(here, "include"),
                      os.path.join(here, os.pardir, os.pardir, "include")):
        if os.path.isfile(os.path.join(candidate, "symheap", "device.cuh")):
            return os.path.normpath(candidate)
    raise FileNotFoundError(f"symheap's headers are not installed next to {here}")

__all__ = [
    "SymheapError", "UnsupportedError", "RemoteError", "SymBuffer",
    "get_unique_id", "init", "init_torch", "init_mpi", "finalize", "is_initialized",
    "my_pe", "n_pes", "backend", "device_count", "set_device", "current_device",
    "peer_kind", "device_of",
    "malloc", "free", "empty", "peer_tensor", "heap_usage",
    "put", "get", "put_signal", "signal_op", "signal_wait_until",
    "atomic_fetch_add", "atomic_compare_swap", "atomic_swap", "quiet", "fence", "barrier_all",
    "device_context", "device_context_dtype", "get_include",
]
