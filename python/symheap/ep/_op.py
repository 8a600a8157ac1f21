"""EpDispatchCombine: route tokens to the PEs of their top-k experts and back."""
from __future__ import annotations

from dataclasses import dataclass

from .. import _core
from .._errors import SymheapError
from .._memory import free, malloc, tensor_view
from .._rma import barrier_all, stream_handle
from .._runtime import collective_check, current_pe
from ._config import EpConfig

_HANDLE_PARTS = ("send_rows", "recv_meta", "summary", "weights")
_OUTPUT_FIELDS = ("x", "topk_idx", "topk_weights", "scales", "num_recv_tokens", "src_info",
                  "expert_counts")


def _torch():
    import torch
    return torch


@dataclass
class EpHandle:
    """What combine needs from one dispatch. It owns its storage, so it stays
    valid after later dispatches (unlike DispatchOutput's row views)."""

    # Slots, no __dict__: dispatch builds a handle in C++ by filling them, and
    # combine reads them there, with no dict per handle.
    __slots__ = ("op_id", "layout", "num_tokens", "rows_shape", "send_rows", "recv_meta",
                 "summary", "weights", "device", "_storage", "_views", "_op")

    op_id: int
    layout: str
    num_tokens: int
    rows_shape: tuple       # shape combine expects for expert_out
    send_rows: object       # [max_tokens, n_pes | topk] int32: combine row or -1
    recv_meta: object       # expert-major: [recv_rows, 4] int32 (src pe, token, slot,
                            # combine row); None for token-major (the summary places rows)
    summary: object         # int32 per-source and per-expert counts (see ep_config.hpp)
    weights: object         # [max_tokens, topk] float32 (expert-major), else None
    device: object

    # A dispatch fills its handle with one int32 storage tensor (the core's
    # HandleLayout) and leaves the four tensors above unset: each is a view of
    # the storage, made on first use. Assigning one replaces it: combine then
    # reads and checks that one.
    def __getattr__(self, name):
        if name not in _HANDLE_PARTS:
            raise AttributeError(f"'EpHandle' object has no attribute '{name}'")
        try:
            storage, op = self._storage, self._op
        except AttributeError:
            raise AttributeError(f"'EpHandle' object has no attribute '{name}'") from None
        try:
            views = self._views
        except AttributeError:
            views = self._views = {}
        if name not in views:
            views[name] = op._handle_part(storage, name)
        return views[name]


@dataclass
class DispatchOutput:
    """Rows received by this PE.

    token_major: ``x`` [R, hidden]: one row per (source token, this PE), ordered
    by source PE, then token index. token_slots: the same rows, but row
    s * max_tokens_per_rank + t holds token t of PE s (R = n_pes *
    max_tokens_per_rank); a slot that token does not fill has ``src_info``
    (-1, -1), ``topk_idx`` -1 and ``topk_weights`` 0 (its ``x`` is stale).
    ``topk_idx`` [R, topk] int32: the token's experts as local ids (expert e
    -> e - my_pe * local_experts), -1 where the expert is elsewhere or the
    slot was dropped. ``topk_weights`` [R, topk]
    float32, 0 where ``topk_idx`` is -1. ``src_info`` [R, 2] int32: (source
    PE, token index). ``scales`` [R, hidden / scale_dim] or None.

    expert_major: ``x`` [local_experts, capacity, hidden]; row i of expert l is
    valid for i < expert_counts[l], ordered by source PE, then token.
    ``topk_idx`` is None; ``topk_weights`` [local_experts, capacity] float32
    (the token's weight for that expert); ``src_info`` [local_experts,
    capacity, 3] int32: (source PE, token index, top-k slot); ``scales``
    [local_experts, capacity, hidden / scale_dim] or None.

    ``num_recv_tokens``: a 0-d int32 tensor on the device, the number of valid
    rows. ``expert_counts`` [local_experts] int32: received (row, slot) pairs
    per local expert. R is that count when the host knows it (cpu backend,
    copy_engine, intranode without max_recv_tokens), else the capacity, with
    rows past ``num_recv_tokens`` undefined.

    ``x``, ``topk_idx``, ``topk_weights`` and ``scales`` (and, token-major,
    ``src_info``) view the op's symmetric receive buffer: valid until the next
    dispatch of the same op (``clone()`` them to keep them). Expert-major
    ``src_info`` belongs to ``handle``. The handle stays valid either way.
    """

    # Slots, no __dict__ (see EpHandle); the fields are set on first use.
    __slots__ = _OUTPUT_FIELDS + ("handle", "_owner", "_rows")

    x: object
    topk_idx: object
    topk_weights: object
    scales: object
    num_recv_tokens: object
    src_info: object
    expert_counts: object
    handle: EpHandle

    # A dispatch makes each field on first use (a view of the op's receive
    # buffer or of the handle's storage), so a call pays only for what is read;
    # _owner is the EpDispatchCombine, _rows the rows the core received. Each
    # such field is a _LazyField (set below), not a __getattr__: a class with
    # __getattr__ sends every attribute read (``out.handle`` too) through
    # CPython's slot hook, which writes the reference counts of the class's
    # __getattr__, the slot's descriptor and the name, objects every PE thread
    # shares (their cache lines then move between the threads' cores).


class _LazyField:
    """A DispatchOutput field made on first use and kept in its slot."""

    __slots__ = ("name", "_member")

    def __init__(self, name, member):
        self.name = name
        self._member = member  # the slot's own descriptor (the core clears it)

    def __get__(self, obj, cls=None):
        if obj is None:
            return self
        try:
            return self._member.__get__(obj, cls)
        except AttributeError:
            pass
        try:
            op, rows, handle = obj._owner, obj._rows, obj.handle
        except AttributeError:
            raise AttributeError(
                f"'DispatchOutput' object has no attribute '{self.name}'") from None
        value = op._output_field(self.name, rows, handle)
        self._member.__set__(obj, value)
        return value

    def __set__(self, obj, value):
        self._member.__set__(obj, value)

    def __delete__(self, obj):
        self._member.__delete__(obj)


for _name in _OUTPUT_FIELDS:
    setattr(DispatchOutput, _name, _LazyField(_name, DispatchOutput.__dict__[_name]))
del _name


class EpDispatchCombine:
    """Expert-parallel dispatch and combine over the symmetric heap.

    Collective: every PE constructs it with the same ``EpConfig``; it
    allocates its symmetric buffers once (``symheap.malloc``, so every PE has
    them at the same offsets) and ``close()`` (also collective) frees them.

    Semantics, token-major (the default layout, and token_slots):
      dispatch sends each token once to every PE that hosts at least one of
      its kept experts (``topk_idx == -1`` drops a slot). The expert side
      returns one row per received row, already reduced over the token's
      local experts (typically sum_k topk_weights[r, k] * expert_k(x[r]));
      combine sums, for each token, the rows returned by all PEs.
    Expert-major (``layout="expert_major"``):
      dispatch places one row per kept (token, slot) in its expert's run; the
      expert side returns one row per received row (unweighted); combine
      multiplies each by the token's top-k weight (those given to dispatch,
      or ``topk_weights`` given to combine) and sums them per token.
    combine returns [num_tokens, hidden] in the token order of dispatch's
    input, in ``config.combine_dtype`` (bfloat16 for fp8 dispatch),
    accumulating in fp32.

    Errors: bad input on any PE (too many tokens, expert id out of range,
    wrong shape or dtype, receive overflow) is detected before rows move; the
    call is aborted on every PE together: the faulty PE raises ValueError,
    the others SymheapError naming it, and the op stays usable. On cuda the
    device-side checks of low_latency and of intranode with max_recv_tokens
    (no host synchronisation) raise at the next call or at ``check()``.
    """

    def __init__(self, config: EpConfig):
        if not isinstance(config, EpConfig):
            raise TypeError(f"EpDispatchCombine expects an EpConfig, got {type(config).__name__}")
        pe = current_pe()
        self.config = config
        core_cfg = config.core_dict()
        collective_check(pe, "ep.create", core_cfg)
        # Grids and workspace regions follow the smallest GPU's SM count: every PE
        # must size them alike.
        core_cfg["grid_blocks"] = min(pe.bootstrap.allgather_json(
            _core.ep_local_grid_blocks(), "ep.grid_blocks"))
        self._geo = _core.ep_geometry(core_cfg, pe.world)
        self._pe = pe
        self._op = self._dispatch_call = self._combine_call = None
        self._buf = malloc(self._geo["total"], align=4096)
        error, op = "", None
        try:
            op = _core.EpOp(core_cfg, self._buf.offset, self._buf.nbytes, EpHandle)
        except Exception as e:  # every PE learns it, so none waits on this one
            error = f"PE {pe.rank}: {type(e).__name__}: {e}"
        errors = [e for e in pe.bootstrap.allgather_json(error, "ep.create") if e]
        if errors:
            if op is not None:
                op.destroy()
            free(self._buf)
            raise SymheapError("EpDispatchCombine failed: " + "; ".join(errors))
        barrier_all()  # every PE zeroed its sync words before anyone writes them
        self._id = op.id
        self._torch_device = self._make_device()
        self._views = self._make_views()
        g = self._geo
        if config.layout == "expert_major":
            self._fixed_rows = (g["local_experts"], g["expert_cap"], config.hidden)
        elif g["padded_output"]:
            self._fixed_rows = (g["recv_rows"], config.hidden)
        else:
            self._fixed_rows = None  # the host knows the count: outputs keep that many rows
        op.set_front_end(DispatchOutput, self._torch_device, self._fixed_rows, stream_handle)
        self._op = op
        # The two hot calls as plain functions of the core with the signatures of
        # dispatch and combine below. Unless a subclass overrides the methods, they
        # become attributes of a class of this object's own (a subclass of its
        # class, same name), so a call goes straight to the core. Not instance
        # attributes: ``ep.dispatch`` on an instance attribute that shadows a
        # method of the class looks the class's function up first and moves its
        # reference count, an object every PE thread of the process shares.
        self._dispatch_call, self._combine_call = op.fast_calls(self)
        fast = {}
        if type(self).dispatch is EpDispatchCombine.dispatch:
            fast["dispatch"] = self._dispatch_call
        if type(self).combine is EpDispatchCombine.combine:
            fast["combine"] = self._combine_call
        if fast:
            base = type(self)
            self.__class__ = type(base.__name__, (base,), {
                "__module__": base.__module__, "__qualname__": base.__qualname__,
                "__doc__": base.__doc__, "_open_class_of": base, **fast})

    # ----------------------------------------------------------- properties

    @property
    def num_local_experts(self) -> int:
        return self._geo["local_experts"]

    @property
    def recv_capacity(self) -> int:
        """Rows of the receive buffer (token-major) or per local expert (expert-major)."""
        g = self._geo
        return g["expert_cap"] if self.config.layout == "expert_major" else g["recv_rows"]

    # ----------------------------------------------------------- public API

    def dispatch(self, x, topk_idx, topk_weights, scales=None, *, stream=None) -> DispatchOutput:
        """Sends each token's row to the PEs of its top-k experts (collective).

        x [num_tokens, hidden] of config.dtype (num_tokens may be 0);
        topk_idx [num_tokens, topk] int64 or int32, -1 drops a slot;
        topk_weights [num_tokens, topk] float32; scales [num_tokens,
        hidden / scale_dim] of config.scale_dtype when config.scale_dim > 0.
        Runs on ``stream`` (default: the current stream of this PE's device).
        Any thread may call it: it runs on this op's PE and leaves the
        thread's current device as it was. See DispatchOutput.
        """
        call = self._dispatch_call
        if call is None:
            raise SymheapError("this EpDispatchCombine is closed")
        # One core call checks the arguments, routes, moves the rows (GIL released)
        # and builds the DispatchOutput: its EpHandle holds op_id, layout,
        # num_tokens, rows_shape, device, the handle's one storage tensor
        # (_storage) and _op (self); the output holds handle, _owner (self) and
        # _rows (rows received, or -1). (Unless a subclass overrides this method,
        # calls on an open op reach that core call directly: see __init__.)
        return call(x, topk_idx, topk_weights, scales, stream=stream)

    def combine(self, expert_out, handle: EpHandle, topk_weights=None, *, out=None,
                stream=None):
        """Returns the expert outputs reduced per token, in dispatch's input order
        (collective).

        expert_out has the shape of the dispatched ``x`` and dtype
        config.combine_dtype. token_major: each row is already reduced over
        the token's local experts; combine sums rows per token, and
        ``topk_weights`` must be None. expert_major: combine weights row
        (token, slot) by ``topk_weights[token, slot]`` (default: dispatch's)
        and sums. ``out`` [num_tokens, hidden] may be given. Tokens with every
        slot dropped get zeros.
        """
        call = self._combine_call
        if call is None:
            raise SymheapError("this EpDispatchCombine is closed")
        return call(expert_out, handle, topk_weights, out=out, stream=stream)

    @property
    def has_redispatch(self) -> bool:
        """Whether ``redispatch`` runs here: the cpu backend, and the intranode and
        low_latency kernels (copy_engine has none)."""
        op = self._op
        if op is None:
            raise SymheapError("this EpDispatchCombine is closed")
        return op.has_redispatch

    def redispatch(self, rows, handle: EpHandle, *, stream=None):
        """Sends each token's row to every row its dispatch (``handle``'s) placed
        for it: the reverse of combine, with no new routing (collective).

        rows [num_tokens, hidden] of config.combine_dtype, in dispatch's token
        order. Returns a tensor shaped like dispatch's ``x`` (in combine_dtype)
        where every received row holds its token's row, unweighted, and rows
        nothing landed in are zeros. It is combine's gradient: the rows of
        ``d(out)/d(expert_out)`` for an output gradient ``rows`` (token-major;
        expert-major rows still need their token's weight).
        """
        op = self._op
        if op is None:
            raise SymheapError("this EpDispatchCombine is closed")
        out = op.redispatch(rows, handle, None if stream is None else stream_handle(stream))
        shape = tuple(handle.rows_shape)
        if len(shape) == 3:
            return out.view(shape)
        return out if shape[0] == out.shape[0] else out[:shape[0]]

    def check(self, stream=None) -> None:
        """Waits for ``stream`` and raises any error a device-side check recorded
        (cuda); returns at once on the cpu backend."""
        op = self._op
        if op is None:
            raise SymheapError("this EpDispatchCombine is closed")
        op.check(None if stream is None else stream_handle(stream), True)

    def close(self) -> None:
        """Collective: frees the symmetric buffers. Idempotent."""
        op = getattr(self, "_op", None)
        if op is None:
            return
        # Checked before anything changes: a close from another PE's thread
        # would free this PE's buffer in that PE's collective sequence.
        if current_pe() is not self._pe:
            raise SymheapError(
                f"close() is collective over the op's PEs: call it from the thread of PE "
                f"{self._pe.rank} (device {self._pe.device}), whose op this is")
        self._op = self._dispatch_call = self._combine_call = None
        base = type(self).__dict__.get("_open_class_of")
        if base is not None:  # the methods now say the op is closed
            self.__class__ = base
        try:
            op.check(None, True)
        finally:
            op.destroy()
            self._views = None
            free(self._buf)

    def __enter__(self) -> "EpDispatchCombine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ----------------------------------------------------------- internals

    def _make_device(self):
        torch = _torch()
        if _core.backend_name() == "cpu":
            return torch.device("cpu")
        return torch.device("cuda", self._pe.device)

    def _make_views(self) -> dict:
        torch = _torch()
        cfg, g = self.config, self._geo
        rows, k = g["recv_rows"], cfg.topk
        base = self._buf.ptr

        def view(off, shape, dtype):
            nbytes = 1
            for s in shape:
                nbytes *= s
            nbytes *= torch.empty(0, dtype=dtype).element_size()
            return tensor_view(self._buf, base + off, max(nbytes, 1), shape, dtype)

        dt = getattr(torch, cfg.dtype)
        sdt = getattr(torch, cfg.scale_dtype)
        s = g["scales_per_row"]
        if cfg.layout != "expert_major":
            return {"x": view(g["off_recv_x"], (rows, cfg.hidden), dt),
                    "scales": view(g["off_recv_scales"], (rows, s), sdt) if s else None,
                    "topk_idx": view(g["off_recv_idx"], (rows, k), torch.int32),
                    "topk_weights": view(g["off_recv_w"], (rows, k), torch.float32),
                    "meta": view(g["off_recv_meta"], (rows, 4), torch.int32)}
        L, cap = g["local_experts"], g["expert_cap"]
        return {"x": view(g["off_recv_x"], (L, cap, cfg.hidden), dt),
                "scales": view(g["off_recv_scales"], (L, cap, s), sdt) if s else None,
                "topk_idx": None,
                "topk_weights": view(g["off_recv_w"], (L, cap), torch.float32)}

    def _handle_part(self, storage, name):
        """A view of a dispatch's handle storage (see the core's HandleLayout)."""
        torch = _torch()
        cfg, g = self.config, self._geo
        off = g["handle"][name]
        if off < 0:
            return None
        shape = {"num_recv": (), "expert_counts": (g["local_experts"],),
                 "send_rows": (cfg.max_tokens_per_rank, g["send_cols"]),
                 "recv_meta": (g["recv_rows"], 4), "summary": (g["summary_words"],),
                 "weights": (cfg.max_tokens_per_rank, cfg.topk)}[name]
        n = 1
        for s in shape:
            n *= s
        op = self._op
        if op is not None:  # the storage returns to the op's pool only once this view is gone
            op.expose_storage(storage)
        part = storage[off:off + n].view(shape)
        return part.view(torch.float32) if name == "weights" else part

    def _output_field(self, name, rows, handle):
        """One field of a DispatchOutput (see there); rows: what the core returned."""
        if name == "num_recv_tokens":
            return self._handle_part(handle._storage, "num_recv")
        if name == "expert_counts":
            return self._handle_part(handle._storage, "expert_counts")
        v, g = self._views, self._geo
        if v is None:
            raise SymheapError("this EpDispatchCombine is closed: its outputs are gone")
        if self.config.layout == "expert_major":
            if name == "src_info":
                meta = self._handle_part(handle._storage, "recv_meta")
                return meta.view(g["local_experts"], g["expert_cap"], 4)[..., :3]
            return v[name]
        n = handle.rows_shape[0]
        if name == "src_info":
            return v["meta"][:n, :2]
        full = v[name]
        if full is None or n == g["recv_rows"]:
            return full
        return full[:n]
