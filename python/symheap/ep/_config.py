"""EpConfig: the shape of one expert-parallel dispatch/combine."""
from __future__ import annotations

from dataclasses import dataclass

from .. import _core

# The kernels, layouts, dtype aliases and value checks are the core's.
KERNELS = tuple(_core.ep_kernels)
LAYOUTS = tuple(_core.ep_layouts)


def dtype_name(dtype) -> str:
    """Canonical name ("bfloat16", ...) of a torch dtype, numpy dtype or string."""
    if isinstance(dtype, str):
        name = dtype
    else:
        name = str(dtype)
        if name.startswith("torch."):
            name = name[len("torch."):]
        elif name.startswith("<class 'numpy."):
            name = name[len("<class 'numpy."):-2]
    return _core.ep_dtype_name(name)


def _int(name: str, value, allow_none: bool = False):
    if value is None and allow_none:
        return None
    if isinstance(value, bool):
        raise TypeError(f"EpConfig.{name} must be an int, got bool")
    if not isinstance(value, int):
        try:
            import operator
            value = operator.index(value)
        except TypeError:
            raise TypeError(f"EpConfig.{name} must be an int, got {type(value).__name__}") from None
    return value


@dataclass(frozen=True)
class EpConfig:
    """Shape of an expert-parallel dispatch/combine (the same on every PE).

    hidden: row width. max_tokens_per_rank: the most tokens one PE passes to a
    dispatch. num_experts: total experts, a multiple of the number of PEs; PE
    p hosts experts [p * L, (p + 1) * L) with L = num_experts / n_pes.
    topk: experts per token. dtype: payload of dispatch (bfloat16, float16,
    float32 or float8_e4m3fn); combine works in the same dtype, or in
    bfloat16 for float8_e4m3fn. scale_dim: when > 0, dispatch also carries
    hidden / scale_dim scales of scale_dtype (float32 by default) per row,
    e.g. the per-block scales of fp8 rows.

    kernel (cuda; the cpu backend runs one implementation for all three):
    "intranode" (SM stores over NVLink, high throughput), "low_latency"
    (fixed capacity, no host synchronisation, CUDA-graph capturable),
    "copy_engine" (rows packed by a kernel, moved by copy engines; waits on
    the host for the counts, and for the other PEs of this process to queue
    their copies). See docs/ep.md.

    layout: "token_major" (one received row per (token, destination PE),
    packed), "token_slots" (the same rows in fixed places: token t of PE s
    at row s * max_tokens_per_rank + t, empty slots marked; no PE waits for
    another's counts before its rows leave, the lowest dispatch latency; not
    with copy_engine) or "expert_major" ([local_experts, expert_capacity,
    hidden] plus per-expert counts, for grouped GEMMs). max_recv_tokens
    (token_major) bounds the rows a PE receives; given, intranode needs no
    host synchronisation and outputs keep max_recv_tokens rows. expert_capacity (expert-major) bounds
    the rows per local expert. Both default to n_pes * max_tokens_per_rank
    (never overflows); a dispatch that would overflow raises on every PE.
    """

    hidden: int
    max_tokens_per_rank: int
    num_experts: int
    topk: int
    dtype: object = "bfloat16"
    scale_dim: int = 0
    scale_dtype: object = None
    kernel: str = "intranode"
    max_recv_tokens: int | None = None
    layout: str = "token_major"
    expert_capacity: int | None = None

    def __post_init__(self):
        for name in ("hidden", "max_tokens_per_rank", "num_experts", "topk", "scale_dim"):
            object.__setattr__(self, name, _int(name, getattr(self, name)))
        for name in ("max_recv_tokens", "expert_capacity"):
            object.__setattr__(self, name, _int(name, getattr(self, name), True))
        object.__setattr__(self, "dtype", dtype_name(self.dtype))
        object.__setattr__(self, "scale_dtype",
                           "float32" if self.scale_dtype is None else dtype_name(self.scale_dtype))
        if not isinstance(self.kernel, str) or not isinstance(self.layout, str):
            raise TypeError("EpConfig.kernel and EpConfig.layout must be strings")
        _core.ep_validate_config(self.core_dict())

    @property
    def combine_dtype(self) -> str:
        """dtype of expert outputs and of combine's result."""
        return _core.ep_combine_dtype(self.dtype)

    def core_dict(self) -> dict:
        """The config as the C++ core takes it."""
        return {"hidden": self.hidden, "max_tokens_per_rank": self.max_tokens_per_rank,
                "num_experts": self.num_experts, "topk": self.topk, "dtype": self.dtype,
                "scale_dim": self.scale_dim, "scale_dtype": self.scale_dtype,
                "kernel": self.kernel, "layout": self.layout,
                "max_recv_tokens": self.max_recv_tokens,
                "expert_capacity": self.expert_capacity}
