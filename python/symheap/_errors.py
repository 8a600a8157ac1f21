"""Exception classes (defined by the C++ core so both layers raise the same types)."""
from ._core import RemoteError, SymheapError, UnsupportedError

__all__ = ["SymheapError", "UnsupportedError", "RemoteError"]
