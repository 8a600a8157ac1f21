"""EpDispatchCombine for JAX: dispatch and combine as XLA FFI calls.

The op is created collectively outside jit, for every local PE at once; its
dispatch and combine run inside jit on one device's arrays, or inside
shard_map on per-device shards, and find their PE from the device XLA runs
them on. Only layouts with fixed output shapes are served.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import _core
from .._errors import SymheapError
from .._memory import free, malloc
from .._rma import barrier_all
from .._runtime import collective_check, current_pe
from ..ep._config import EpConfig
from . import _runtime as _rt
from ._ffi import ffi_call

_I32, _F32 = "int32", "float32"

def _tree_util():
    import jax
    return jax.tree_util


def _pytree(cls):
    """Registers a dataclass as a pytree: array fields are children, ``_static`` fields aux."""
    static = cls._static
    names = [n for n in cls.__dataclass_fields__ if n not in static]

    def flatten(obj):
        return [getattr(obj, n) for n in names], tuple(getattr(obj, n) for n in static)

    def unflatten(aux, children):
        return cls(**dict(zip(names, children)), **dict(zip(static, aux)))

    _tree_util().register_pytree_node(cls, flatten, unflatten)
    return cls


@dataclass
class EpHandle:
    """What combine needs from one dispatch (a pytree of arrays).

    ``send_rows`` [max_tokens, n_pes | topk] int32, ``summary`` int32;
    expert-major also ``recv_meta`` [recv_rows, 4] int32 (source PE, token,
    slot, combine row), ``weights`` [max_tokens, topk] float32 (dispatch's
    weights) and ``row_weights`` [local_experts, capacity] float32 (each
    received row's weight, for combine's gradient).
    """

    send_rows: object
    summary: object
    recv_meta: object = None
    weights: object = None
    row_weights: object = None
    op_key: tuple = ()      # (job, op id)
    num_tokens: int = 0
    _static = ("op_key", "num_tokens")


@dataclass
class DispatchOutput:
    """Rows received by this PE; the fields of symheap.ep.DispatchOutput.

    Shapes are fixed: token-major (and token_slots) outputs have recv_rows
    rows, of which ``num_recv_tokens`` (token_slots: the filled slots) are
    valid; expert-major ``x`` is [local_experts, capacity, hidden] with
    ``expert_counts`` valid rows per expert. Unlike the torch op, every field
    is a fresh array (XLA owns it). Past the counts ``topk_idx`` is -1,
    ``topk_weights`` 0 and token-major ``src_info`` -1; ``x`` and ``scales``
    there are undefined (see docs/jax.md).
    """

    x: object
    topk_idx: object
    topk_weights: object
    scales: object
    num_recv_tokens: object
    src_info: object
    expert_counts: object
    handle: EpHandle
    _static = ()


_pytree(EpHandle)
_pytree(DispatchOutput)


class EpDispatchCombine:
    """Expert-parallel dispatch/combine over every PE of symheap.jax.init.

    Collective: every process constructs it with the same EpConfig, outside
    jit; it serves all local PEs. ``close()`` (collective; finalize closes
    what is left) waits for the work in flight on every local PE's device, then
    frees its symmetric memory; an executable that still uses it then fails
    with an error. Semantics as symheap.ep.EpDispatchCombine.
    """

    def __init__(self, config: EpConfig):
        if not isinstance(config, EpConfig):
            raise TypeError(f"EpDispatchCombine expects an EpConfig, got {type(config).__name__}")
        job = _rt.job()
        self.config = config
        core_cfg = config.core_dict()
        self._geo = geo = _core.ep_geometry(core_cfg, job.world)
        if config.kernel == "copy_engine":
            raise ValueError("EpConfig.kernel='copy_engine' waits on the host for the routing "
                             "counts, which an XLA call cannot do; use 'intranode' or "
                             "'low_latency'")
        if not geo["padded_output"]:
            raise ValueError("this EpConfig gives dispatch outputs whose row count only the host "
                             "learns (token_major intranode without max_recv_tokens); XLA "
                             "needs fixed shapes: set max_recv_tokens, or use "
                             "layout='token_slots', layout='expert_major' or "
                             "kernel='low_latency'")
        self._job = job
        self._closed = False
        per_pe = _rt.on_every_pe(lambda pe: _create_on_pe(core_cfg, geo), job.timeout)
        self._bufs = [b for b, _, _ in per_pe]
        self._id = per_pe[0][1]
        self._key = (per_pe[0][2], self._id)
        job.ops.add(self)

    @property
    def num_local_experts(self) -> int:
        return self._geo["local_experts"]

    @property
    def recv_capacity(self) -> int:
        g = self._geo
        return g["expert_cap"] if self.config.layout == "expert_major" else g["recv_rows"]

    # ----------------------------------------------------------- public API

    def dispatch(self, x, topk_idx, topk_weights, scales=None) -> DispatchOutput:
        """Sends each token's row to the PEs of its top-k experts (inside jit or
        shard_map, on one device's arrays). Gradients: to ``x`` (a combine of the
        row gradients through the same handle) and to ``topk_weights`` (a combine
        of the received weights' gradients); scales get none (see docs/jax.md)."""
        self._check_open()
        x, topk_idx, topk_weights, scales = self._check_dispatch(x, topk_idx, topk_weights, scales)
        return self._dispatch_vjp(x, scales, topk_idx, topk_weights)

    def combine(self, expert_out, handle: EpHandle):
        """Returns [num_tokens, hidden] of config.combine_dtype: each token's rows
        summed (expert-major: weighted by dispatch's topk_weights). Gradients:
        to ``expert_out`` (the output gradient redispatched through the handle: to
        the rows its dispatch placed, with no new routing) and, expert-major, to the
        weights."""
        self._check_open()
        expert_out = self._check_combine(expert_out, handle)
        return self._combine_vjp(expert_out, handle)

    def check(self) -> None:
        """Waits for the work in flight on every local PE's device, then raises the first
        error a device-side call of this op recorded there (a late PE, a bad expert id).
        A call XLA replays from its command buffers raises nothing itself: this is where its
        error shows (also at close()). Raises too if the op failed earlier."""
        self._check_open()

        def check_pe(pe):
            s = current_pe()
            self._drain_and_check(s)
            _core.ep_ready(s.job, s.rank, self._id)  # an op that failed earlier

        _rt.on_every_pe(check_pe, self._job.timeout)

    def close(self) -> None:
        """Collective: waits for the devices' work in flight (the op's last calls),
        then frees the symmetric buffers on every local PE. Idempotent."""
        if self._closed:
            return
        self._closed = True
        job = self._job
        job.ops.discard(self)
        if _rt._job is not job:
            return  # finalized: the PEs took the buffers with them

        def close_pe(pe):
            s = current_pe()
            try:
                # XLA may still run this op's calls on its streams: every PE waits for
                # its device before free's barrier, so no kernel of the op outlives
                # its memory (a later op gets the same heap range).
                self._drain_and_check(s)
            finally:
                _core.ep_destroy(s.job, s.rank, self._id)
                free(self._bufs[job.local.index(pe)])

        _rt.on_every_pe(close_pe, job.timeout)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ----------------------------------------------------------- internals

    def _drain_and_check(self, s) -> None:
        """PE s (current_pe()): waits for its device, then raises what this op's
        device-side calls recorded there."""
        _core.ep_wait_device(s.job, s.rank)
        _core.ep_check(s.job, s.rank, self._id, 0, True)

    def _check_open(self) -> None:
        if self._closed or _rt._job is not self._job:
            raise SymheapError("this EpDispatchCombine is closed (or symheap.jax was finalized)")

    def _attrs(self):
        return {"job": np.uint64(self._key[0]), "op": np.int64(self._key[1])}

    def _em(self) -> bool:
        return self.config.layout == "expert_major"

    def _rows(self) -> tuple:
        g = self._geo
        return (g["local_experts"], g["expert_cap"]) if self._em() else (g["recv_rows"],)

    def _check_dispatch(self, x, topk_idx, topk_weights, scales):
        import jax.numpy as jnp
        cfg = self.config
        x, topk_idx, topk_weights = jnp.asarray(x), jnp.asarray(topk_idx), jnp.asarray(topk_weights)
        if x.ndim != 2 or x.shape[1] != cfg.hidden:
            raise ValueError(f"x must have shape [num_tokens, {cfg.hidden}], got {x.shape}")
        t = x.shape[0]
        if t > cfg.max_tokens_per_rank:
            raise ValueError(f"x has {t} tokens, more than max_tokens_per_rank="
                             f"{cfg.max_tokens_per_rank}")
        _expect("x", x, (cfg.dtype,), (t, cfg.hidden))
        _expect("topk_idx", topk_idx, ("int64", "int32"), (t, cfg.topk))
        _expect("topk_weights", topk_weights, (_F32,), (t, cfg.topk))
        s = self._geo["scales_per_row"]
        if cfg.scale_dim:
            if scales is None:
                raise ValueError(f"scales are required: the config has scale_dim={cfg.scale_dim}")
            scales = jnp.asarray(scales)
            _expect("scales", scales, (cfg.scale_dtype,), (t, s))
        elif scales is not None:
            raise ValueError("scales given, but the config has scale_dim=0")
        else:
            scales = jnp.zeros((t, 0), jnp.dtype(cfg.scale_dtype))
        return x, topk_idx, topk_weights, scales

    def _check_combine(self, expert_out, handle):
        import jax.numpy as jnp
        cfg = self.config
        if not isinstance(handle, EpHandle):
            raise TypeError(f"handle must be the EpHandle of a dispatch, got "
                            f"{type(handle).__name__}")
        if handle.op_key != self._key:
            raise ValueError("handle comes from another EpDispatchCombine")
        expert_out = jnp.asarray(expert_out)
        _expect("expert_out", expert_out, (cfg.combine_dtype,), self._rows() + (cfg.hidden,))
        return expert_out

    # The custom_vjp functions of this op (built once per op).
    @property
    def _dispatch_vjp(self):
        fn = self.__dict__.get("_dispatch_fn")
        if fn is None:
            fn = self.__dict__["_dispatch_fn"] = _make_dispatch_vjp(self)
        return fn

    @property
    def _combine_vjp(self):
        fn = self.__dict__.get("_combine_fn")
        if fn is None:
            fn = self.__dict__["_combine_fn"] = _make_combine_vjp(self)
        return fn

    def _dispatch_call(self, x, scales, topk_idx, topk_weights) -> DispatchOutput:
        cfg, g, em = self.config, self._geo, self._em()
        rows, t = self._rows(), x.shape[0]
        m, k, h, L = cfg.max_tokens_per_rank, cfg.topk, cfg.hidden, g["local_experts"]
        shapes = (
            (rows + (h,), cfg.dtype),
            (rows + (g["scales_per_row"],), cfg.scale_dtype),
            ((0,) if em else rows + (k,), _I32),
            (rows if em else rows + (k,), _F32),
            ((g["recv_rows"], 4), _I32),
            ((), _I32),
            ((L,), _I32),
            ((m, g["send_cols"]), _I32),
            ((g["summary_words"],), _I32),
            ((m, k) if em else (0,), _F32),
        )
        (rx, rs, ridx, rw, meta, n, counts, send_rows, summary, saved) = ffi_call(
            "symheap_ep_dispatch", shapes)(x, scales, topk_idx, topk_weights, **self._attrs())
        if em:
            handle = EpHandle(send_rows, summary, meta, saved, rw, self._key, t)
            src_info = meta.reshape(L, g["expert_cap"], 4)[..., :3]
            ridx = None
        else:
            handle = EpHandle(send_rows, summary, op_key=self._key, num_tokens=t)
            src_info = meta[:, :2]
        return DispatchOutput(rx, ridx, rw, rs if cfg.scale_dim else None, n, src_info, counts,
                              handle)

    def _combine_call(self, expert_out, handle: EpHandle, weights=None, after=None):
        """``weights`` replaces the handle's (expert-major); ``after`` (unread by the
        handler) orders this collective call after the one that produced it."""
        import jax.numpy as jnp
        cfg, em = self.config, self._em()
        empty_i, empty_f = jnp.zeros((0,), jnp.int32), jnp.zeros((0,), jnp.float32)
        if em and weights is None:
            weights = handle.weights
        extra = () if after is None else (after,)
        (out,) = ffi_call("symheap_ep_combine",
                          (((handle.num_tokens, cfg.hidden), cfg.combine_dtype),))(
            expert_out, handle.send_rows, handle.recv_meta if em else empty_i, handle.summary,
            weights if em else empty_f, *extra, **self._attrs())
        return out

    def _redispatch_call(self, rows, handle: EpHandle, after):
        """``after`` (unread by the handler) orders this collective call after the
        one that produced it, the same way on every PE."""
        import jax.numpy as jnp
        cfg, em = self.config, self._em()
        empty_i = jnp.zeros((0,), jnp.int32)
        (out,) = ffi_call("symheap_ep_redispatch",
                          ((self._rows() + (cfg.hidden,), cfg.combine_dtype),))(
            rows, handle.send_rows, handle.recv_meta if em else empty_i, handle.summary, after,
            **self._attrs())
        return out


def _create_on_pe(core_cfg, geo):
    """One PE's share of the collective creation (runs on that PE's thread)."""
    pe = current_pe()
    collective_check(pe, "ep.create", core_cfg)
    buf = malloc(geo["total"], align=4096)
    error, op_id = "", None
    try:
        # every dispatch hands the core XLA's result buffers (see ep_ffi.cpp)
        op_id = _core.ep_create(core_cfg, buf.offset, buf.nbytes, caller_outputs=True)
    except Exception as e:  # every PE learns it, so none waits on this one
        error = f"PE {pe.rank}: {type(e).__name__}: {e}"
    got = pe.bootstrap.allgather_json([error, op_id], "ep.create")
    errors = [e for e, _ in got if e]
    if not errors and len({i for _, i in got}) != 1:
        errors = ["the PEs numbered this op differently (ops were created on some PEs only); "
                  "create every EpDispatchCombine through symheap.jax on every PE"]
    if errors:
        if op_id is not None:
            _core.ep_destroy(pe.job, pe.rank, op_id)
        free(buf)
        raise SymheapError("EpDispatchCombine failed: " + "; ".join(errors))
    barrier_all()  # every PE zeroed its sync words before anyone writes them
    return buf, op_id, pe.job


def _expect(name, a, dtypes, shape):
    if a.dtype.name not in dtypes:
        raise ValueError(f"{name} must have dtype {' or '.join(dtypes)}, got {a.dtype.name}")
    if tuple(a.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(a.shape)}")


def _pack_columns(values, columns, width, dtype):
    """Rows of ``width`` zeros with values[..., j] at column columns[..., j] (-1: none):
    small per-row numbers carried by a combine (each lands at one column of its token)."""
    import jax
    import jax.numpy as jnp
    hot = jax.nn.one_hot(columns, width, dtype=jnp.float32)  # -1 gives a zero row
    return jnp.einsum("...j,...jh->...h", values.astype(jnp.float32), hot).astype(dtype)


def _check_weight_columns(op):
    cfg = op.config
    if cfg.topk > cfg.hidden:
        raise ValueError(f"the gradient of topk_weights travels in the columns of a row: it "
                         f"needs topk={cfg.topk} <= hidden={cfg.hidden}")


def _make_dispatch_vjp(op: EpDispatchCombine):
    import jax
    import jax.numpy as jnp

    @jax.custom_vjp
    def dispatch(x, scales, topk_idx, topk_weights):
        return op._dispatch_call(x, scales, topk_idx, topk_weights)

    def fwd(x, scales, topk_idx, topk_weights):
        out = op._dispatch_call(x, scales, topk_idx, topk_weights)
        return out, (out.handle, out.topk_idx)

    def bwd(res, ct):
        handle, recv_idx = res
        cfg, geo, em = op.config, op._geo, op._em()
        if cfg.dtype != cfg.combine_dtype:
            raise ValueError(f"dispatch of {cfg.dtype} rows has no gradient")
        _check_weight_columns(op)
        cdt, K, T = jnp.dtype(cfg.combine_dtype), cfg.topk, handle.num_tokens
        ones = jnp.ones_like(handle.weights) if em else None
        # The gradient of handle.weights comes from combine's backward: ordering this
        # call after it keeps every PE's sequence of collective calls the same.
        after = ct.handle.weights if em else None
        # x: every received row's gradient back to its token, summed (unweighted)
        gx = op._combine_call(ct.x.astype(cdt), handle, ones, after)
        # topk_weights: each received row's weight gradient, in the column of its slot
        if em:
            slot = handle.recv_meta[:, 2].reshape(geo["local_experts"], geo["expert_cap"])
            ctw = ct.topk_weights + ct.handle.row_weights
            packed = _pack_columns(jnp.where(slot >= 0, ctw, 0.0)[..., None], slot[..., None],
                                   cfg.hidden, cdt)
        else:
            cols = jnp.where(recv_idx >= 0, jnp.arange(K), -1)
            packed = _pack_columns(ct.topk_weights, cols, cfg.hidden, cdt)
        gw = op._combine_call(packed, handle, ones, gx)[:, :K].astype(jnp.float32)
        if em:
            gw = gw + ct.handle.weights[:T]
        return gx.astype(cfg.dtype), None, None, gw

    dispatch.defvjp(fwd, bwd)
    return dispatch


def _make_combine_vjp(op: EpDispatchCombine):
    import jax
    import jax.numpy as jnp

    @jax.custom_vjp
    def combine(expert_out, handle):
        return op._combine_call(expert_out, handle)

    def fwd(expert_out, handle):
        out = op._combine_call(expert_out, handle)
        return out, (expert_out, handle, out)

    def bwd(res, g):
        expert_out, handle, out = res
        cotangent = jax.tree_util.tree_map(
            lambda a: np.zeros(a.shape, jax.dtypes.float0)
            if not jnp.issubdtype(a.dtype, jnp.floating) else jnp.zeros_like(a), handle)
        # The output gradient on every row the handle's dispatch placed (zeros elsewhere).
        rows = op._redispatch_call(g.astype(op.config.combine_dtype), handle, out)
        if op._em():
            # Row (token, slot) was weighted by weights[token, slot]: its gradient is
            # that weight times the token's; the weight's is <row, token's gradient>,
            # carried back to the token in the column of its slot.
            cfg, geo = op.config, op._geo
            _check_weight_columns(op)
            # Rows past an expert's count hold stale metadata and weights.
            L, cap = geo["local_experts"], geo["expert_cap"]
            at = geo["summary_counts_at"]
            counts = handle.summary[at:at + L]
            valid = jnp.arange(cap)[None, :] < counts[:, None]
            slot = jnp.where(valid, handle.recv_meta[:, 2].reshape(L, cap), -1)
            w = jnp.where(valid, handle.row_weights, 0.0)
            dots = jnp.sum(rows.astype(jnp.float32) * expert_out.astype(jnp.float32), axis=-1)
            packed = _pack_columns(jnp.where(valid, dots, 0.0)[..., None], slot[..., None],
                                   cfg.hidden, rows.dtype)
            gw = op._combine_call(packed, handle, jnp.ones_like(handle.weights), rows)
            gw = gw[:, :cfg.topk].astype(jnp.float32)
            # jnp.pad, not .at[:T].set: XLA GPU's Shardy export (jax 0.11) crashes on
            # that update inside shard_map (tests/gpu/test_jax_gpu.py::test_shard_map_two_gpus).
            cotangent.weights = jnp.pad(gw, ((0, handle.weights.shape[0] - handle.num_tokens),
                                             (0, 0)))
            rows = (rows.astype(jnp.float32) * w[..., None]).astype(rows.dtype)
        return rows, cotangent

    combine.defvjp(fwd, bwd)
    return combine
