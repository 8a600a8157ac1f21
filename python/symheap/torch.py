"""PyTorch front end: process-group init and tensors on the symmetric heap.

``symheap.torch.init(group)`` is ``symheap.init_torch``; ``empty`` returns torch
tensors (CUDA tensors on the cuda backend); ``peer_tensor`` aliases a peer's copy.
"""
from ._memory import peer_tensor
from ._memory import empty as _empty
from ._runtime import init_torch as init


def empty(shape, dtype="float32"):
    """Collective: a torch tensor on the symmetric heap (see ``symheap.empty``)."""
    return _empty(shape, dtype, like="torch")


__all__ = ["init", "empty", "peer_tensor"]
