"""Host-initiated RMA, signals, atomics and synchronisation."""
from __future__ import annotations

from . import _core
from ._memory import resolve
from ._runtime import _as_int, current_pe

_COMPARES = ("eq", "ne", "gt", "ge", "lt", "le", "==", "!=", ">", ">=", "<", "<=")


def stream_handle(stream) -> int:
    """Raw stream handle from None, an int, a torch or CuPy stream."""
    if stream is None:
        return 0
    if isinstance(stream, int):
        return stream
    for attr in ("cuda_stream", "ptr", "handle"):
        h = getattr(stream, attr, None)
        if isinstance(h, int):
            return h
    raise TypeError(f"cannot take a CUDA stream handle from {type(stream).__name__}")


def _nbytes(nbytes, limit: int, what: str) -> int:
    if nbytes is None:
        return limit
    nbytes = _as_int(nbytes, "nbytes")
    if not 0 <= nbytes <= limit:
        raise ValueError(f"nbytes={nbytes} exceeds the {limit} bytes of the {what}")
    return nbytes


def _size_check(n: int, have: int, what: str) -> None:
    if n > have:
        raise ValueError(f"{what} holds {have} bytes, fewer than the {n} bytes to transfer")


def put(dst, src, pe: int, *, nbytes: int | None = None, stream=None, via: str = "auto") -> None:
    """Copies local ``src`` into PE ``pe``'s copy of symmetric ``dst``.

    ``via`` is "auto", "load_store" or "copy_engine" (the cuda backend's
    copy-engine channels; the cpu backend copies on the calling thread).
    """
    current_pe()
    d_addr, d_n = resolve(dst)
    s_addr, s_n = resolve(src, writable=False)
    n = _nbytes(nbytes, s_n, "source")
    _size_check(n, d_n, "destination")
    if via not in ("auto", "load_store", "copy_engine"):
        raise ValueError(f"via must be 'auto', 'load_store' or 'copy_engine', got {via!r}")
    _core.put(d_addr, s_addr, n, _as_int(pe, "pe"), stream_handle(stream))


def get(dst, src, pe: int, *, nbytes: int | None = None, stream=None) -> None:
    """Copies PE ``pe``'s copy of symmetric ``src`` into local ``dst``."""
    current_pe()
    d_addr, d_n = resolve(dst)
    s_addr, s_n = resolve(src, writable=False)
    n = _nbytes(nbytes, d_n, "destination")
    _size_check(n, s_n, "source")
    _core.get(d_addr, s_addr, n, _as_int(pe, "pe"), stream_handle(stream))


def _signal_addr(signal) -> int:
    addr, n = resolve(signal)
    if n < 8:
        raise ValueError(f"a signal needs an 8-byte word, got {n} bytes")
    return addr


def put_signal(dst, src, signal, value: int, pe: int, op: str = "set", *,
               nbytes: int | None = None, stream=None) -> None:
    """put, then set or add ``value`` on PE ``pe``'s signal word once the data is visible."""
    current_pe()
    d_addr, d_n = resolve(dst)
    s_addr, s_n = resolve(src, writable=False)
    n = _nbytes(nbytes, s_n, "source")
    _size_check(n, d_n, "destination")
    _core.put_signal(d_addr, s_addr, n, _signal_addr(signal), _as_int(value, "value"), op,
                     _as_int(pe, "pe"), stream_handle(stream))


def signal_op(signal, value: int, pe: int, op: str = "set", *, stream=None) -> None:
    """Sets or adds ``value`` to PE ``pe``'s copy of the signal word."""
    current_pe()
    _core.signal_op(_signal_addr(signal), _as_int(value, "value"), op, _as_int(pe, "pe"),
                    stream_handle(stream))


def signal_wait_until(signal, cmp: str, value: int, timeout: float | None = None) -> int:
    """Waits until the local signal word satisfies ``cmp`` ("eq", "ge", ...) against
    ``value``; returns the word. TimeoutError after ``timeout`` s (default: init's)."""
    pe = current_pe()
    if cmp not in _COMPARES:
        raise ValueError(f"cmp must be one of {', '.join(_COMPARES[:6])}, got {cmp!r}")
    t = pe.timeout if timeout is None else float(timeout)
    if not t > 0:
        raise ValueError("timeout must be positive")
    return _core.signal_wait_until(_signal_addr(signal), cmp, _as_int(value, "value"), t)


def _word(dst) -> int:
    addr, n = resolve(dst)
    if n < 8:
        raise ValueError(f"atomics act on an int64 word, got {n} bytes")
    return addr


def atomic_fetch_add(dst, value: int, pe: int) -> int:
    current_pe()
    return _core.atomic_fetch_add(_word(dst), _as_int(value, "value"), _as_int(pe, "pe"))


def atomic_compare_swap(dst, cond: int, value: int, pe: int) -> int:
    """Writes ``value`` if the word equals ``cond``; returns the old word."""
    current_pe()
    return _core.atomic_compare_swap(_word(dst), _as_int(cond, "cond"), _as_int(value, "value"),
                                     _as_int(pe, "pe"))


def atomic_swap(dst, value: int, pe: int) -> int:
    current_pe()
    return _core.atomic_swap(_word(dst), _as_int(value, "value"), _as_int(pe, "pe"))


def quiet(stream=None) -> None:
    """Completes every put/get/signal this PE issued (on ``stream``)."""
    current_pe()
    _core.quiet(stream_handle(stream))


def fence(stream=None) -> None:
    """Orders this PE's operations: earlier ones to a peer land before later ones."""
    current_pe()
    _core.fence(stream_handle(stream))


def barrier_all(stream=None, timeout: float | None = None) -> None:
    """All PEs wait for each other; completes this PE's outstanding operations first."""
    pe = current_pe()
    t = pe.timeout if timeout is None else float(timeout)
    _core.quiet(stream_handle(stream))
    if _core.all_peers_load_store():
        _core.heap_barrier(t)
    else:
        pe.bootstrap.barrier("barrier_all", timeout=t)
