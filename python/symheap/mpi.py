"""mpi4py front end: ``symheap.mpi.init(comm)`` is ``symheap.init_mpi``."""
from ._runtime import init_mpi as init

__all__ = ["init"]
