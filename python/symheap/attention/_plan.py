"""Checks the arguments of an attention call and turns tensors into the op
core's ``AttentionArgs`` (raw addresses, element strides, options).

Nothing here launches work; ``_function.py`` allocates outputs and calls the
core through these plans.
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from typing import Optional

import torch

from .. import _core
from .._attention_args import as_int as _as_int, fail as _fail, seed_pair, window_pair

_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}

# Filling fresh outputs with NaN before each call shows any element the op
# forgot to write (tests turn this on).
poison_outputs = os.environ.get("SYMHEAP_ATTN_POISON", "") not in ("", "0")


def new_output(shape, dtype, device, zero: bool = False) -> torch.Tensor:
    """A fresh output. Packed (varlen) outputs start at zero: rows outside every
    sequence are never written, and finding them would need cu_seqlens on the host."""
    if zero:
        return torch.zeros(shape, dtype=dtype, device=device)
    t = torch.empty(shape, dtype=dtype, device=device)
    if poison_outputs:
        t.fill_(float("nan"))
    return t


@dataclass
class BroadcastSpec:
    """bias or mask seen as (B or 1, Hq or Hkv or 1, Sq or 1, Sk)."""
    tensor: torch.Tensor      # the 4-D view handed to the core
    shape: tuple              # the caller's original shape (dbias gets it back)
    kv_heads: bool
    per_row: bool             # has a query-row dimension (not broadcast over Sq)

    def strides(self):
        t = self.tensor
        s = [0 if t.shape[d] == 1 else t.stride(d) for d in range(4)]
        return s[0], s[1], s[2], t.stride(3)


@dataclass
class Plan:
    """Everything one call needs besides q, k, v: shapes and options."""
    batch: int
    heads_q: int
    heads_kv: int
    head_dim: int            # the caller's head dim
    head_dim_run: int        # after padding (CUDA pads to a multiple of 8)
    seqlen_q: int            # fixed length, or max_seqlen for varlen
    seqlen_k: int
    varlen: bool
    cu_seqlens_q: Optional[torch.Tensor]
    cu_seqlens_k: Optional[torch.Tensor]
    scale: float
    softcap: float
    window: tuple
    bias: Optional[BroadcastSpec]
    mask: Optional[BroadcastSpec]
    alibi: Optional[torch.Tensor]
    dropout_p: float
    seed: int
    offset: int
    deterministic: bool
    on_cuda: bool
    backend: str             # "auto", "cudnn" or "own" (see resolve_backend)
    # cuDNN argument blocks of earlier calls with this plan, by direction and
    # strides (see _function._run_cudnn); only plans from cached_plan are reused.
    cudnn_calls: dict = field(default_factory=dict, compare=False, repr=False)
    core_template: object = None  # fixed-length plans: the core's arguments without addresses
    # Fixed-length plans without head-dim padding: the core's one-call eager
    # entry (_core.AttentionEager: pooled outputs, stream, cuDNN or own kernels).
    eager: object = None


def _dtype_name(dtype) -> str:
    return _DTYPE_NAMES.get(dtype) or str(dtype).replace("torch.", "")


def _spec(x):
    """(shape, dtype name) as the C++ checks take it, or None."""
    return None if x is None else (tuple(x.shape), _dtype_name(x.dtype))


def _check_devices(q, k, v):
    """What only torch knows (tensor types, devices); shapes, dtypes and options
    are checked in C++ (_core.attention_plan_call), shared with symheap.jax."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"attention: {name} must be a torch.Tensor, got {type(t).__name__}")
    if not (q.device == k.device == v.device):
        _fail(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if q.device.type not in ("cpu", "cuda"):
        _fail(f"device type {q.device.type} is not supported (cpu or cuda)")
    if q.device.type == "cuda" and not getattr(_core, "attention_has_cuda", False):
        _fail("q is on a CUDA device but symheap was built without CUDA; rebuild with nvcc "
              "available (SYMHEAP_CUDA=ON) or move the tensors to the cpu")


def _check_optional(x, name, device, what):
    if x is None:
        return
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"attention: {name} must be {what}")
    if x.device != device:
        _fail(f"{name} is on {x.device} but q is on {device}")


def _broadcast(x, kv_heads: bool, per_row: bool) -> Optional[BroadcastSpec]:
    if x is None:
        return None
    view = x[(None,) * (4 - x.dim())] if x.dim() < 4 else x
    return BroadcastSpec(view, tuple(x.shape), kv_heads=kv_heads, per_row=per_row)


BACKEND_ENV = _core.attention_path_env  # read by the core when backend is None


def cudnn_status():
    """(usable, version or the reason it is not) of the cuDNN path, from the core."""
    return _core.attention_cudnn_status()


def resolve_backend(backend, on_cuda: bool) -> str:
    """The path a CUDA call may take: ``backend`` if given, else $SYMHEAP_ATTN_BACKEND,
    else "auto" (cuDNN for every call it supports, the own kernels for the rest).
    cpu calls always run the cpu path ("own"); the rule and its errors are the core's."""
    return _core.attention_choose_path(backend, on_cuda)


_offset_lock = threading.Lock()


def _dropout_seed(seed, dropout_p: float):
    """(seed, offset) of one call. Without a seed, 64 bits come from torch's cpu
    generator (so torch.manual_seed reproduces them; the generator's lock gives
    concurrent calls distinct draws)."""
    if dropout_p == 0:
        return 0, 0
    if seed is None:
        words = torch.randint(0, 2 ** 32, (2,), dtype=torch.int64)
        return int(words[0]) << 32 | int(words[1]), 0
    return seed_pair(seed)


def make_plan(q, k, v, *, varlen, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
              max_seqlen_k=None, causal=False, window_size=(-1, -1), softmax_scale=None,
              softcap=0.0, bias=None, mask=None, alibi_slopes=None, dropout_p=0.0, seed=None,
              deterministic=False, backend=None) -> Plan:
    _check_devices(q, k, v)
    device = q.device
    backend = resolve_backend(backend, device.type == "cuda")
    if varlen:
        for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
            if not isinstance(cu, torch.Tensor):
                _fail(f"{name} must be a 1-D int32 tensor of sequence starts (length batch + 1)")
            if cu.device != device:
                _fail(f"{name} is on {cu.device} but q is on {device}")
        max_seqlen_q = _as_int(max_seqlen_q, "max_seqlen_q")
        max_seqlen_k = _as_int(max_seqlen_k, "max_seqlen_k")
    _check_optional(bias, "bias", device, "a torch.Tensor or None")
    _check_optional(mask, "mask", device, "a torch.Tensor or None")
    _check_optional(alibi_slopes, "alibi_slopes", device, "a tensor of shape (Hq,) or (B, Hq)")
    left, right = window_pair(window_size)
    on_cuda = device.type == "cuda"
    info = _core.attention_plan_call(
        varlen, on_cuda, _spec(q), _spec(k), _spec(v), _spec(bias), _spec(mask),
        _spec(alibi_slopes), _spec(cu_seqlens_q) if varlen else None,
        _spec(cu_seqlens_k) if varlen else None, max_seqlen_q if varlen else 0,
        max_seqlen_k if varlen else 0, bool(causal), left, right,
        None if softmax_scale is None else float(softmax_scale), float(softcap), float(dropout_p))
    B, Hq, Hkv, D = info["batch"], info["heads_q"], info["heads_kv"], info["head_dim"]
    Sq, Sk = info["seqlen_q"], info["seqlen_k"]
    if varlen:
        cu_seqlens_q, cu_seqlens_k = cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()
    bias_spec = _broadcast(bias, info["bias_kv_heads"], info["bias_per_row"])
    mask_spec = _broadcast(mask, info["mask_kv_heads"], True)
    alibi = None
    if alibi_slopes is not None:
        alibi = alibi_slopes.detach().to(torch.float32).contiguous()
        if alibi.dim() == 1 or alibi.shape[0] == 1:
            alibi = alibi.reshape(1, Hq)
    dropout_p = float(dropout_p)

    seed_value, offset = _dropout_seed(seed, dropout_p)
    return Plan(B, Hq, Hkv, D, info["head_dim_run"], Sq, Sk, varlen, cu_seqlens_q, cu_seqlens_k,
                info["scale"], float(softcap), info["window"], bias_spec, mask_spec, alibi,
                dropout_p, seed_value, offset, bool(deterministic), on_cuda, backend)


class _DeviceCache:
    """Plans of one device, shared by every thread that calls on it."""

    def __init__(self):
        self.lock = threading.Lock()
        self.plans = {}


_MAX_PLANS_PER_DEVICE = 256
_device_caches: dict = {}
_device_caches_lock = threading.Lock()


def cached_plan(q, k, v, causal, window_size, softmax_scale, softcap, deterministic,
                backend) -> Plan:
    """make_plan(q, k, v, varlen=False, ...) of a call that holds no tensor
    option (no bias, mask, ALiBi or dropout). Plans are kept in their device's
    cache, shared by every thread calling on it and keyed by every input
    make_plan reads: a repeat call skips the checks and the argument block.
    The key is built from few, cheap values (torch's shape, dtype and device
    objects, the backend variable read from the C environment): a hit costs
    1-2 us on the cpu backend."""
    try:
        key = (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, k.device, v.device, causal,
               window_size, softmax_scale, softcap, deterministic,
               _core.attention_env(BACKEND_ENV) if backend is None else backend)
        cache = _device_caches.get(q.device)
        plan = cache.plans.get(key) if cache is not None else None  # dict reads are atomic
    except (AttributeError, TypeError):  # not tensors, or an unhashable option: no caching
        key = plan = None
    if plan is not None:
        return plan
    plan = make_plan(q, k, v, varlen=False, causal=causal, window_size=window_size,
                     softmax_scale=softmax_scale, softcap=softcap, deterministic=deterministic,
                     backend=backend)
    plan.core_template = core_template(plan, q.dtype)
    if plan.head_dim_run == plan.head_dim:  # else prepare() pads every call
        plan.eager = _core.AttentionEager(plan.core_template, plan.backend)
    if key is None:
        return plan
    with _device_caches_lock:
        cache = _device_caches.setdefault(q.device, _DeviceCache())
    with cache.lock:
        if len(cache.plans) >= _MAX_PLANS_PER_DEVICE:
            cache.plans.clear()
        try:
            return cache.plans.setdefault(key, plan)
        except TypeError:  # an unhashable option (a list window): no caching
            return plan


def clear_plan_caches() -> None:
    """Forgets every cached plan: the per-device caches and the core's table of
    their eager entries (the one-call path of repeat no-grad calls)."""
    with _device_caches_lock:
        _device_caches.clear()
    _core.attention_eager_forget()


def core_template(plan: Plan, dtype) -> "_core.AttentionArgs":
    """A fixed-length plan's core arguments: shapes, options and dtypes; the
    core's attention_forward_tensors adds each call's addresses and strides."""
    a = _core.AttentionArgs()
    a.batch, a.heads_q, a.heads_kv = plan.batch, plan.heads_q, plan.heads_kv
    a.head_dim = plan.head_dim_run
    a.seqlen_q, a.seqlen_k = plan.seqlen_q, plan.seqlen_k
    a.scale, a.softcap = plan.scale, plan.softcap
    a.window_left, a.window_right = plan.window
    a.deterministic = plan.deterministic
    name = _DTYPE_NAMES[dtype]
    for t in ("q", "k", "v", "out"):
        a.set_tensor(t, 0, name, 0, 0, 0)
    return a


def prepare(t: torch.Tensor, plan: Plan) -> torch.Tensor:
    """q/k/v/dout as the core reads them: unit stride on the head dim and, on
    CUDA, the head dim padded with zeros to a multiple of 8 and 16-byte rows."""
    if plan.head_dim_run != plan.head_dim:
        return torch.nn.functional.pad(t, (0, plan.head_dim_run - plan.head_dim))
    if t.stride(-1) != 1:
        return t.contiguous()
    if plan.on_cuda:
        aligned = t.data_ptr() % 16 == 0 and all(s % 8 == 0 for s in t.stride()[:-1])
        if not aligned:  # clone: contiguous() keeps a misaligned storage offset
            return t.clone(memory_format=torch.contiguous_format)
    return t


def _strides(t: torch.Tensor, varlen: bool):
    """(batch, row, head) element strides of a (B, S, H, D) or (total, H, D) tensor."""
    if varlen:
        return 0, t.stride(0), t.stride(1)
    return t.stride(0), t.stride(1), t.stride(2)


def core_args(plan: Plan, **tensors) -> "_core.AttentionArgs":
    """Fills the core's arguments; `tensors` names q, k, v, out, lse, and for
    the backward dout, dq, dk, dv and dbias (a float32 workspace)."""
    a = _core.AttentionArgs()
    a.batch, a.heads_q, a.heads_kv = plan.batch, plan.heads_q, plan.heads_kv
    a.head_dim = plan.head_dim_run
    a.seqlen_q, a.seqlen_k = plan.seqlen_q, plan.seqlen_k
    q, k = tensors["q"], tensors["k"]
    if plan.varlen:
        a.total_q, a.total_k = q.shape[0], k.shape[0]
        a.set_pointer("cu_seqlens_q", plan.cu_seqlens_q.data_ptr())
        a.set_pointer("cu_seqlens_k", plan.cu_seqlens_k.data_ptr())
    a.scale, a.softcap = plan.scale, plan.softcap
    a.window_left, a.window_right = plan.window
    a.dropout_p, a.seed, a.offset = plan.dropout_p, plan.seed, plan.offset
    a.deterministic = plan.deterministic
    for name in ("q", "k", "v", "out", "dout", "dq", "dk", "dv"):
        t = tensors.get(name)
        if t is not None:
            a.set_tensor(name, t.data_ptr(), _DTYPE_NAMES[t.dtype], *_strides(t, plan.varlen))
    lse = tensors["lse"]
    a.set_pointer("lse", lse.data_ptr())
    if plan.varlen:  # (Hq, total_q)
        a.lse_batch_stride, a.lse_head_stride = 0, lse.stride(0)
    else:            # (B, Hq, Sq)
        a.lse_batch_stride, a.lse_head_stride = lse.stride(0), lse.stride(1)
    if plan.bias is not None:
        a.set_broadcast("bias", plan.bias.tensor.data_ptr(), _DTYPE_NAMES[plan.bias.tensor.dtype],
                        *plan.bias.strides(), plan.bias.kv_heads)
    if plan.mask is not None:
        a.set_broadcast("mask", plan.mask.tensor.data_ptr(), "float32", *plan.mask.strides(),
                        plan.mask.kv_heads)
    if plan.alibi is not None:
        a.set_pointer("alibi_slopes", plan.alibi.data_ptr())
        a.alibi_batch_stride = plan.alibi.stride(0) if plan.alibi.shape[0] > 1 else 0
    dbias = tensors.get("dbias")
    if dbias is not None:  # (B, Hq, Sq or 1, Sk) float32
        sq = dbias.stride(2) if plan.bias.per_row else 0
        a.set_broadcast("dbias", dbias.data_ptr(), "float32", dbias.stride(0), dbias.stride(1), sq,
                        dbias.stride(3), False)
    return a
