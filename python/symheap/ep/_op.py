"""EpDispatchCombine: route tokens to the PEs of their top-k experts and back."""
from __future__ import annotations

from dataclasses import dataclass

from .. import _core
from .._errors import SymheapError
from .._memory import free, malloc, tensor_view
from .._rma import barrier_all, stream_handle
from .._runtime import collective_check, current_pe
from ._config import EpConfig

_BAD_ARGUMENT = 3  # status code of the core: this PE aborts the call on every PE


def _torch():
    import torch
    return torch


@dataclass
class EpHandle:
    """What combine needs from one dispatch. It owns its storage, so it stays
    valid after later dispatches (unlike DispatchOutput's row views)."""

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

    x: object
    topk_idx: object
    topk_weights: object
    scales: object
    num_recv_tokens: object
    src_info: object
    expert_counts: object
    handle: EpHandle


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
        self._geo = _core.ep_geometry(core_cfg, pe.world)
        self._pe = pe
        self._job, self._rank = pe.job, pe.rank
        self._buf = malloc(self._geo["total"], align=4096)
        error = ""
        try:
            self._id = _core.ep_create(core_cfg, self._buf.offset, self._buf.nbytes)
        except Exception as e:  # every PE learns it, so none waits on this one
            error = f"PE {pe.rank}: {type(e).__name__}: {e}"
        errors = [e for e in pe.bootstrap.allgather_json(error, "ep.create") if e]
        if errors:
            if not error:
                _core.ep_destroy(self._job, self._rank, self._id)
            free(self._buf)
            raise SymheapError("EpDispatchCombine failed: " + "; ".join(errors))
        barrier_all()  # every PE zeroed its sync words before anyone writes them
        self._closed = False
        self._torch_device = self._make_device()
        self._views = self._make_views()

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
        Runs on ``stream`` (default: the current stream). See DispatchOutput.
        """
        torch = _torch()
        self._check_open()
        cfg, geo = self.config, self._geo
        problem = None
        try:
            x, topk_idx, topk_weights, scales = self._validate_dispatch(x, topk_idx,
                                                                        topk_weights, scales)
            num_tokens = x.shape[0]
        except (TypeError, ValueError) as e:
            problem, num_tokens = e, 0
        dev = self._torch_device
        i32 = torch.int32
        num_recv = torch.empty((), dtype=i32, device=dev)
        expert_counts = torch.empty(geo["local_experts"], dtype=i32, device=dev)
        send_rows = torch.empty(cfg.max_tokens_per_rank, geo["send_cols"], dtype=i32, device=dev)
        recv_meta = (torch.empty(geo["recv_rows"], 4, dtype=i32, device=dev)
                     if cfg.layout == "expert_major" else None)
        summary = torch.empty(geo["summary_words"], dtype=i32, device=dev)
        weights = (torch.empty(cfg.max_tokens_per_rank, cfg.topk, dtype=torch.float32, device=dev)
                   if cfg.layout == "expert_major" else None)
        ptr = _data_ptr
        try:
            n = _core.ep_dispatch(
                self._job, self._rank, self._id,
                0 if problem else ptr(x), 0 if problem else ptr(scales),
                0 if problem else ptr(topk_idx),
                bool(problem is None and topk_idx.dtype == torch.int64),
                0 if problem else ptr(topk_weights), num_tokens,
                _BAD_ARGUMENT if problem else 0,
                ptr(num_recv), ptr(expert_counts), ptr(send_rows), ptr(recv_meta),
                ptr(summary), ptr(weights),
                self._stream(stream))
        except ValueError as e:
            if problem is not None:
                raise type(problem)(f"{problem} (dispatch aborted on every PE)") from e
            raise
        if problem is not None:  # only reached if the core did not raise
            raise problem
        return self._output(n, num_tokens, num_recv, expert_counts, send_rows, recv_meta, summary,
                            weights)

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
        torch = _torch()
        self._check_open()
        problem = None
        try:
            expert_out, weights, out = self._validate_combine(expert_out, handle, topk_weights,
                                                              out)
        except (TypeError, ValueError) as e:
            problem = e
        ok = problem is None
        try:
            _core.ep_combine(
                self._job, self._rank, self._id,
                _data_ptr(expert_out) if ok else 0,
                int(expert_out.numel() // self.config.hidden) if ok else 0,
                _data_ptr(handle.send_rows) if ok else 0,
                _data_ptr(handle.recv_meta) if ok and self.config.layout == "expert_major"
                else 0,
                _data_ptr(handle.summary) if ok else 0,
                _data_ptr(weights) if ok else 0,
                handle.num_tokens if ok else 0,
                _data_ptr(out) if ok else 0,
                0 if ok else _BAD_ARGUMENT, self._stream(stream))
        except ValueError as e:
            if problem is not None:
                raise type(problem)(f"{problem} (combine aborted on every PE)") from e
            raise
        if problem is not None:
            raise problem
        del torch
        return out

    def check(self, stream=None) -> None:
        """Waits for ``stream`` and raises any error a device-side check recorded
        (cuda); returns at once on the cpu backend."""
        self._check_open()
        _core.ep_check(self._job, self._rank, self._id, self._stream(stream), True)

    def close(self) -> None:
        """Collective: frees the symmetric buffers. Idempotent."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        try:
            _core.ep_check(self._job, self._rank, self._id, self._stream(None), True)
        finally:
            _core.ep_destroy(self._job, self._rank, self._id)
            self._views = None
            free(self._buf)

    def __enter__(self) -> "EpDispatchCombine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ----------------------------------------------------------- internals

    def _check_open(self) -> None:
        if getattr(self, "_closed", True):
            raise SymheapError("this EpDispatchCombine is closed")
        if not self._buf.alive:
            raise SymheapError("this EpDispatchCombine's PE was finalized")

    def _make_device(self):
        torch = _torch()
        if _core.backend_name() == "cpu":
            return torch.device("cpu")
        return torch.device("cuda", self._pe.device)

    def _stream(self, stream) -> int:
        if stream is not None:
            return stream_handle(stream)
        if self._torch_device.type == "cuda":
            torch = _torch()
            return torch.cuda.current_stream(self._torch_device).cuda_stream
        return 0

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

    def _output(self, n, num_tokens, num_recv, expert_counts, send_rows, recv_meta, summary,
                weights):
        cfg, g, v = self.config, self._geo, self._views
        if cfg.layout != "expert_major":
            rows = g["recv_rows"] if g["padded_output"] or n < 0 else n
            x = v["x"][:rows]
            scales = v["scales"][:rows] if v["scales"] is not None else None
            idx, w = v["topk_idx"][:rows], v["topk_weights"][:rows]
            src_info = v["meta"][:rows, :2]
        else:
            x, scales, idx, w = v["x"], v["scales"], None, v["topk_weights"]
            src_info = recv_meta.view(g["local_experts"], g["expert_cap"], 4)[..., :3]
        handle = EpHandle(self._id, cfg.layout, num_tokens, tuple(x.shape), send_rows, recv_meta,
                          summary, weights, self._torch_device)
        return DispatchOutput(x, idx, w, scales, num_recv, src_info, expert_counts, handle)

    def _tensor(self, name, t, dtypes, shape):
        torch = _torch()
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in dtypes:
            want = " or ".join(str(d).replace("torch.", "") for d in dtypes)
            raise ValueError(f"{name} must have dtype {want}, got {str(t.dtype).replace('torch.', '')}")
        if tuple(t.shape) != tuple(shape):
            raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
        dev = self._torch_device
        if t.device.type != dev.type or (dev.type == "cuda" and t.device.index != dev.index):
            raise ValueError(f"{name} is on {t.device}, but this PE runs on {dev}")
        return t.contiguous()

    def _validate_dispatch(self, x, topk_idx, topk_weights, scales):
        torch = _torch()
        cfg = self.config
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 2 or x.shape[1] != cfg.hidden:
            raise ValueError(f"x must have shape [num_tokens, {cfg.hidden}], got {tuple(x.shape)}")
        t = x.shape[0]
        x = self._tensor("x", x, (getattr(torch, cfg.dtype),), (t, cfg.hidden))
        topk_idx = self._tensor("topk_idx", topk_idx, (torch.int64, torch.int32), (t, cfg.topk))
        topk_weights = self._tensor("topk_weights", topk_weights, (torch.float32,), (t, cfg.topk))
        if cfg.scale_dim:
            if scales is None:
                raise ValueError(f"scales are required: the config has scale_dim={cfg.scale_dim}")
            scales = self._tensor("scales", scales, (getattr(torch, cfg.scale_dtype),),
                                  (t, cfg.hidden // cfg.scale_dim))
        elif scales is not None:
            raise ValueError("scales given, but the config has scale_dim=0")
        return x, topk_idx, topk_weights, scales

    def _validate_combine(self, expert_out, handle, topk_weights, out):
        torch = _torch()
        cfg = self.config
        if not isinstance(handle, EpHandle):
            raise TypeError(f"handle must be the EpHandle of a dispatch, got {type(handle).__name__}")
        if handle.op_id != self._id:
            raise ValueError("handle comes from another EpDispatchCombine")
        # The handle is a plain dataclass: check what it holds, not only where it came from.
        geo, i32 = self._geo, torch.int32
        if handle.layout != cfg.layout or isinstance(handle.num_tokens, bool) or \
                not isinstance(handle.num_tokens, int) or \
                not 0 <= handle.num_tokens <= cfg.max_tokens_per_rank:
            raise ValueError("handle was modified: its layout or num_tokens no longer match "
                             "this op")
        self._tensor("handle.send_rows", handle.send_rows, (i32,),
                     (cfg.max_tokens_per_rank, geo["send_cols"]))
        if cfg.layout == "expert_major":
            self._tensor("handle.recv_meta", handle.recv_meta, (i32,), (geo["recv_rows"], 4))
        self._tensor("handle.summary", handle.summary, (i32,), (geo["summary_words"],))
        if cfg.layout == "expert_major" and topk_weights is None:
            self._tensor("handle.weights", handle.weights, (torch.float32,),
                         (cfg.max_tokens_per_rank, cfg.topk))
        cdt = getattr(torch, cfg.combine_dtype)
        expert_out = self._tensor("expert_out", expert_out, (cdt,), handle.rows_shape)
        if cfg.layout != "expert_major":
            if topk_weights is not None:
                raise ValueError("token_major combine sums rows the expert side already weighted: "
                                 "topk_weights applies to layout='expert_major' only")
            weights = None
        elif topk_weights is None:
            weights = handle.weights
        else:
            weights = self._tensor("topk_weights", topk_weights, (torch.float32,),
                                   (handle.num_tokens, cfg.topk))
        shape = (handle.num_tokens, cfg.hidden)
        if out is None:
            out = torch.empty(shape, dtype=cdt, device=self._torch_device)
        else:
            dev = self._torch_device
            if not isinstance(out, torch.Tensor) or out.dtype != cdt or tuple(out.shape) != shape \
                    or not out.is_contiguous() or out.device.type != dev.type:
                raise ValueError(f"out must be a contiguous {cfg.combine_dtype} tensor of shape "
                                 f"{shape} on {dev}")
        return expert_out, weights, out


def _data_ptr(t) -> int:
    return 0 if t is None else t.data_ptr()
