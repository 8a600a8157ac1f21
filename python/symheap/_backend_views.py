"""Backend-specific construction of tensors over heap memory."""
from __future__ import annotations

import numpy as np

from . import _core


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


class _CudaArrayInterface:
    def __init__(self, ptr: int, nbytes: int, keep):
        self.keep = keep
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1",
                                         "data": (ptr, False), "version": 3, "strides": None}


def _cuda_tensor_view(torch, owner, ptr: int, nbytes: int, shape, dtype):
    device = _core.current_device()
    raw = torch.as_tensor(_CudaArrayInterface(ptr, nbytes, owner), device=f"cuda:{device}")
    return raw.view(dtype).reshape(shape)
