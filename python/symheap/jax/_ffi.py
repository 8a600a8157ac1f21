"""XLA FFI targets of the _core module, registered once, and memoized ffi_call wrappers."""
from __future__ import annotations

import functools
import threading

from .. import _core
from .._errors import SymheapError

_lock = threading.Lock()
_registered = False


def register_targets() -> None:
    """Registers every handler the module was built with (``_core.xla_*_targets()``:
    {target name: {platform: capsule, or {stage: capsule}}}) for the platforms JAX has.
    Idempotent."""
    global _registered
    if _registered:
        return
    import jax
    if not getattr(_core, "built_with_xla_ffi", False):
        raise SymheapError("symheap was built without the XLA FFI handlers (no jaxlib with FFI "
                           "headers at build time); reinstall symheap with jax installed")
    jax.devices()  # the FFI types must be registered after the backends exist
    platforms = set()
    for name in ("cpu", "gpu"):
        try:
            jax.devices(name)
            platforms.add("CUDA" if name == "gpu" else "cpu")
        except RuntimeError:
            pass
    with _lock:
        if _registered:
            return
        for attr in sorted(dir(_core)):
            if not (attr.startswith("xla_") and attr.endswith("_targets")):
                continue
            for target, by_platform in getattr(_core, attr)().items():
                for platform, capsule in by_platform.items():
                    if platform in platforms:
                        jax.ffi.register_ffi_target(target, capsule, platform=platform)
        _registered = True


@functools.lru_cache(maxsize=None)
def ffi_call(target: str, result_shapes: tuple, aliases: tuple = (), side_effect: bool = False):
    """The jax.ffi.ffi_call wrapper of one signature, built once.

    ``result_shapes``: a tuple of (shape, dtype name); ``aliases``: (operand, result) pairs.
    """
    import jax
    register_targets()
    shapes = [jax.ShapeDtypeStruct(tuple(s), jax.numpy.dtype(d)) for s, d in result_shapes]
    return jax.ffi.ffi_call(target, shapes, input_output_aliases=dict(aliases) or None,
                            has_side_effect=side_effect)
