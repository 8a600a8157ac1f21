"""Backend-specific pieces of the Python layer: tensors over heap memory,
stream handles, the device context for user kernels."""
from __future__ import annotations

import sys

import numpy as np

from . import _core

_DL_CPU, _DL_CUDA = 1, 2


def tensor_view(torch, owner, ptr: int, nbytes: int, shape, dtype):
    itemsize = torch.empty(0, dtype=dtype).element_size()
    count = int(np.prod(shape, dtype=np.int64))
    if count * itemsize > nbytes:
        raise ValueError(f"shape {tuple(shape)} of {dtype} needs {count * itemsize} bytes, "
                         f"the buffer has {nbytes}")
    if _core.backend_name() == "cpu":
        from ._memory import _ArrayInterface
        raw = np.asarray(_ArrayInterface(ptr, (count * itemsize,), "|u1", owner))
        return torch.from_numpy(raw).view(dtype).reshape(shape)
    return _cuda_tensor_view(torch, owner, ptr, count * itemsize, shape, dtype)


def _cuda_tensor_view(torch, owner, ptr: int, nbytes: int, shape, dtype):
    # The tensor lives on the calling PE's device even when the memory is a
    # same-process peer's (reached through peer access) or a same-node
    # peer's (IPC mapping): DLPack names the device explicitly, where
    # __cuda_array_interface__ would make torch copy it to the owner's device.
    device = _core.current_device()
    capsule = _core.byte_capsule(ptr, nbytes, _DL_CUDA, device, owner)
    raw = torch.utils.dlpack.from_dlpack(capsule)
    return raw.view(dtype).reshape(shape)


def stream_handle(stream) -> int:
    """Raw CUDA stream handle from None, an int, a torch or CuPy stream.

    None means the current stream: torch's current stream of the calling
    PE's device when torch is imported and the backend is cuda, else 0 (the
    legacy default stream).
    """
    if stream is None:
        torch = sys.modules.get("torch")
        if torch is None or _core.backend_name() != "cuda":
            return 0
        return int(torch.cuda.current_stream(_core.current_device()).cuda_stream)
    if isinstance(stream, bool):
        raise TypeError("stream must be a stream object or a raw handle, not a bool")
    if isinstance(stream, int):
        if stream < 0:
            raise ValueError(f"a raw stream handle cannot be negative, got {stream}")
        return stream
    for attr in ("cuda_stream", "ptr", "handle"):
        h = getattr(stream, attr, None)
        if isinstance(h, int):
            return h
    raise TypeError(f"cannot take a CUDA stream handle from {type(stream).__name__}: pass a "
                    f"torch.cuda.Stream, a cupy Stream, a raw int handle or None")


def check_device_errors() -> None:
    """Raises what a kernel of this PE recorded through the device API (a wait
    or barrier that timed out, a peer without a load/store path) and clears it."""
    if _core.backend_name() == "cuda":
        _core.check_device_errors()


def device_context() -> bytes:
    """The calling PE's ``symheap::DeviceContext`` as bytes.

    Pass it by value to a kernel that includes ``symheap/device.cuh``: for
    example as a NumPy structured scalar to a CuPy RawKernel
    (``np.frombuffer(ctx, dtype=device_context_dtype())[0]``), or copy it into
    a ctypes structure. Valid until this PE is finalized.
    """
    from ._runtime import current_pe
    current_pe()
    return _core.device_context()


def device_context_dtype() -> np.dtype:
    """A NumPy structured dtype with the size and alignment of DeviceContext."""
    n = _core.device_context_size
    return np.dtype({"names": ["words"], "formats": [(np.uint64, (n // 8,))]}, align=True)
