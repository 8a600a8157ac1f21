"""Symmetric buffers: collective malloc/free, arrays and tensors on the heap."""
from __future__ import annotations

import math

import numpy as np

from . import _core
from ._errors import SymheapError
from ._runtime import PE, _as_int, collective_check, current_pe


class SymBuffer:
    """A block of the symmetric heap: the same offset on every PE.

    ``ptr`` is its address on this PE. Free it collectively with ``free()``,
    ``symheap.free(buf)`` or a ``with`` block.
    """

    __slots__ = ("_heap", "offset", "nbytes", "device", "generation", "_live", "__weakref__")

    def __init__(self, heap, offset: int, nbytes: int, device: int, generation: int):
        if not isinstance(heap, _core.HeapRef):
            raise TypeError("SymBuffer objects come from symheap.malloc; they cannot be built "
                            "from a raw address")
        if not 0 <= offset <= offset + nbytes <= heap.size:
            raise ValueError(f"[{offset}, {offset + nbytes}) is outside the heap")
        self._heap, self.offset, self.nbytes = heap, offset, nbytes
        self.device, self.generation = device, generation
        self._live = True

    @property
    def ptr(self) -> int:
        if not self._live:
            raise ValueError("this symmetric buffer was freed (or its PE finalized)")
        return self._heap.base + self.offset

    @property
    def alive(self) -> bool:
        return self._live

    def _invalidate(self) -> None:
        self._live = False

    def free(self) -> None:
        free(self)

    def __enter__(self) -> "SymBuffer":
        return self

    def __exit__(self, *exc) -> None:
        if self._live:
            free(self)

    def numpy(self, dtype=np.uint8, shape=None) -> np.ndarray:
        """A numpy view of the buffer (host-visible backends only)."""
        return _numpy_view(self, self.ptr, self.nbytes, dtype, shape, keep=self)

    def __repr__(self) -> str:
        state = "" if self._live else ", freed"
        return f"SymBuffer(offset={self.offset}, nbytes={self.nbytes}, device={self.device}{state})"


class _ArrayInterface:
    """Exposes raw host memory to numpy while keeping its owner alive."""

    def __init__(self, ptr: int, shape, typestr: str, keep):
        self.keep = keep
        self.__array_interface__ = {"shape": tuple(shape), "typestr": typestr,
                                    "data": (ptr, False), "version": 3}


def _numpy_view(owner, ptr: int, nbytes: int, dtype, shape, keep) -> np.ndarray:
    if _core.backend_name() != "cpu":
        raise SymheapError("numpy views need host-visible memory; on the cuda backend use "
                           "like='torch'")
    dtype = np.dtype(dtype)
    if shape is None:
        shape = (nbytes // dtype.itemsize,)
    count = int(np.prod(shape, dtype=np.int64))
    if count * dtype.itemsize > nbytes:
        raise ValueError(f"shape {tuple(shape)} of {dtype} needs {count * dtype.itemsize} bytes, "
                         f"the buffer has {nbytes}")
    arr = np.asarray(_ArrayInterface(ptr, (count * dtype.itemsize,), "|u1", keep))
    return arr.view(dtype).reshape(shape)


def _check_owned(pe: PE, buf: SymBuffer, what: str) -> None:
    if not buf._live:
        raise ValueError(f"{what}: the buffer was already freed (or its PE finalized)")
    if buf.device != pe.device or buf.generation != pe.generation:
        raise ValueError(f"{what}: the buffer belongs to another PE or to an earlier init "
                         f"(device {buf.device}), not to PE {pe.rank} on device {pe.device}")


def malloc(nbytes: int, align: int = 256) -> SymBuffer:
    """Collective: allocates ``nbytes`` at the same heap offset on every PE.

    Every PE must pass the same size and alignment; otherwise every PE gets a
    ValueError. MemoryError when the heap is full (SYMHEAP_HEAP_SIZE raises it).
    """
    nbytes, align = _as_int(nbytes, "nbytes", 0), _as_int(align, "align")
    if align <= 0 or align & (align - 1):
        raise ValueError(f"align must be a power of two, got {align}")
    pe = current_pe()
    collective_check(pe, "malloc", [nbytes, align])
    offset = _core.malloc(nbytes, align)
    buf = SymBuffer(_core.heap_ref(), offset, nbytes, pe.device, pe.generation)
    with pe.lock:
        pe.buffers[offset] = buf
    return buf


def _buffer_of(pe: PE, obj, what: str) -> SymBuffer:
    if isinstance(obj, SymBuffer):
        return obj
    addr, _ = resolve(obj, writable=False)
    heap = _core.heap_ref()
    with pe.lock:
        buf = pe.buffers.get(addr - heap.base)
    if buf is None:
        raise ValueError(f"{what}: object is not the start of a live symmetric allocation of "
                         f"this PE (created by symheap.malloc/empty)")
    return buf


def free(buf) -> None:
    """Collective: frees a buffer from malloc, or an array/tensor from empty."""
    pe = current_pe()
    buf = _buffer_of(pe, buf, "free")
    _check_owned(pe, buf, "free")
    collective_check(pe, "free", [buf.offset])  # also a barrier: no peer still uses it
    with pe.lock:
        _core.free(buf.offset)
        pe.buffers.pop(buf.offset, None)
    buf._invalidate()


def heap_usage() -> dict:
    in_use, capacity, blocks, heap = _core.heap_usage()
    return {"bytes_in_use": in_use, "capacity": capacity, "live_buffers": blocks,
            "heap_size": heap}


# ----------------------------------------------------------------- dtypes

def _torch():
    import torch
    return torch


def _is_torch(obj) -> bool:
    mod = type(obj).__module__
    return mod.startswith("torch") and hasattr(obj, "data_ptr")


def _torch_dtype(dtype):
    torch = _torch()
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str) and hasattr(torch, dtype):
        return getattr(torch, dtype)
    return torch.from_numpy(np.empty(0, dtype=np.dtype(dtype))).dtype


def empty(shape, dtype="float32", like: str = "torch"):
    """Collective: an uninitialised tensor (``like="torch"``) or numpy array
    (``like="numpy"``) living on the symmetric heap; free it with ``symheap.free``.
    """
    if isinstance(shape, int):
        shape = (shape,)
    shape = tuple(_as_int(s, "shape") for s in shape)
    if any(s < 0 for s in shape):
        raise ValueError(f"negative dimension in shape {shape}")
    count = math.prod(shape)
    if like == "numpy":
        if _core.backend_name() != "cpu":
            raise SymheapError("numpy arrays need host-visible memory; on the cuda backend use "
                               "like='torch'")
        dt = np.dtype(dtype)
        itemsize = dt.itemsize

        def view(buf):
            return _numpy_view(buf, buf.ptr, buf.nbytes, dt, shape, keep=buf)
    elif like == "torch":
        torch = _torch()
        tdt = _torch_dtype(dtype)
        itemsize = torch.empty(0, dtype=tdt).element_size()

        def view(buf):
            return tensor_view(buf, buf.ptr, buf.nbytes, shape, tdt)
    else:
        raise ValueError(f"like must be 'torch' or 'numpy', got {like!r}")
    nbytes = count * itemsize
    if nbytes >= 1 << 63:
        raise ValueError(f"shape {shape} of {dtype} needs {nbytes} bytes, beyond the 2**63 - 1 "
                         f"a heap can hold")
    # Everything that can be refused is refused above; should the view still
    # fail, the block is freed (collectively: every PE fails alike).
    buf = malloc(nbytes)
    try:
        return view(buf)
    except BaseException:
        free(buf)
        raise


def tensor_view(owner, ptr: int, nbytes: int, shape, dtype):
    """A torch tensor over heap memory at ``ptr`` (keeps ``owner`` alive)."""
    torch = _torch()
    from . import _backend_views
    return _backend_views.tensor_view(torch, owner, ptr, nbytes, shape, dtype)


# ----------------------------------------------------------------- addresses

def resolve(obj, writable: bool = True) -> tuple[int, int]:
    """(address, nbytes) of a contiguous buffer: SymBuffer, numpy, torch, bytes."""
    if isinstance(obj, SymBuffer):
        return obj.ptr, obj.nbytes
    host_only = _core.backend_name() == "cpu"
    if _is_torch(obj):
        if not obj.is_contiguous():
            raise ValueError("tensor must be contiguous")
        if obj.device.type not in ("cpu", "cuda"):
            raise ValueError(f"a tensor on {obj.device} has no memory to move; give a cpu or "
                             f"CUDA tensor")
        if host_only and obj.device.type != "cpu":
            raise ValueError(f"the cpu backend moves host memory only; got a tensor on "
                             f"{obj.device}")
        return obj.data_ptr(), obj.numel() * obj.element_size()
    if isinstance(obj, np.ndarray):
        if not obj.flags.c_contiguous:
            raise ValueError("array must be C-contiguous")
        if writable and not obj.flags.writeable:
            raise ValueError("array is read-only")
        return obj.__array_interface__["data"][0], obj.nbytes
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is not None:
        if host_only:
            raise ValueError("the cpu backend moves host memory only; got a device array "
                             "(__cuda_array_interface__)")
        shape, itemsize = cai["shape"], np.dtype(cai["typestr"]).itemsize
        if cai.get("strides") not in (None, ()):
            raise ValueError("device array must be contiguous")
        return cai["data"][0], int(np.prod(shape, dtype=np.int64)) * itemsize
    if isinstance(obj, (bytes, bytearray, memoryview)):
        if writable and isinstance(obj, bytes):
            raise ValueError("bytes are read-only; pass a bytearray or an array")
        arr = np.frombuffer(obj, dtype=np.uint8)
        return arr.__array_interface__["data"][0], arr.nbytes
    raise TypeError(f"expected a SymBuffer, numpy array, torch tensor or bytes-like object, "
                    f"got {type(obj).__name__}")


def peer_tensor(t, pe: int):
    """A view of PE ``pe``'s copy of heap tensor/array ``t`` (load/store peers only).

    Works for "self", "same_process" and "same_node" peers; raises
    UnsupportedError for "remote" ones.
    """
    me = current_pe()
    pe = _as_int(pe, "pe")
    addr, nbytes = resolve(t, writable=False)
    heap = _core.heap_ref()
    offset = addr - heap.base
    if not 0 <= offset < heap.size:
        raise ValueError("peer_tensor: the tensor is not on this PE's symmetric heap")
    peer_heap = _core.peer_heap_ref(pe)
    ptr = peer_heap.base + offset
    if _is_torch(t):
        return tensor_view(peer_heap, ptr, nbytes, tuple(t.shape), t.dtype)
    if isinstance(t, np.ndarray):
        return _numpy_view(peer_heap, ptr, nbytes, t.dtype, t.shape, keep=peer_heap)
    if isinstance(t, SymBuffer):
        return SymBuffer(peer_heap, offset, nbytes, me.device, -1)
    raise TypeError(f"peer_tensor expects a tensor or array from symheap.empty, "
                    f"got {type(t).__name__}")
