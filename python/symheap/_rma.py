"""Host-initiated RMA, signals, atomics and synchronisation."""
from __future__ import annotations

from . import _core
from ._backend_views import check_device_errors, stream_handle
from ._memory import resolve
from ._runtime import UINT64, _as_int, current_pe, resolve_timeout

_COMPARES = ("eq", "ne", "gt", "ge", "lt", "le", "==", "!=", ">", ">=", "<", "<=")


def _nbytes(nbytes, limit: int, what: str) -> int:
    if nbytes is None:
        return limit
    nbytes = _as_int(nbytes, "nbytes")
    if not 0 <= nbytes <= limit:
        raise ValueError(f"nbytes={nbytes} exceeds the {limit} bytes of the {what}")
    return nbytes


# Words are integers: a float or complex array is refused outright (integer
# views of other widths go to the size and alignment checks).
_NOT_WORD_KINDS = ("float", "bfloat", "complex", "bool")


def _dtype_name(obj) -> str | None:
    """numpy/torch dtype name of an array or tensor; None for untyped bytes."""
    dtype = getattr(obj, "dtype", None)
    if dtype is None or obj.__class__.__name__ == "SymBuffer":
        return None
    return str(dtype).replace("torch.", "")


def _same_dtype(dst, src, call: str) -> None:
    d, s = _dtype_name(dst), _dtype_name(src)
    if d is not None and s is not None and d != s:
        raise TypeError(f"{call}: dst has dtype {d} but src has dtype {s}; convert one of them "
                        f"first (or pass byte views to copy raw bytes)")


def _size_check(n: int, have: int, what: str) -> None:
    if n > have:
        raise ValueError(f"{what} holds {have} bytes, fewer than the {n} bytes to transfer")


def put(dst, src, pe: int, *, nbytes: int | None = None, stream=None, via: str = "auto") -> None:
    """Copies local ``src`` into PE ``pe``'s copy of symmetric ``dst``.

    Ordered on ``stream`` (default: the current stream); complete after
    ``quiet``. ``via`` is "auto", "load_store" (a copy kernel storing into
    the peer's memory; ``src`` must be GPU memory) or "copy_engine" (the
    copy-engine channel to the peer's GPU, ordered after ``stream``). The cpu
    backend copies on the calling thread whatever ``via`` says.
    """
    current_pe()
    _same_dtype(dst, src, "put")
    d_addr, d_n = resolve(dst)
    s_addr, s_n = resolve(src, writable=False)
    n = _nbytes(nbytes, s_n, "source")
    _size_check(n, d_n, "destination")
    _core.put(d_addr, s_addr, n, _as_int(pe, "pe"), stream_handle(stream), str(via))


def get(dst, src, pe: int, *, nbytes: int | None = None, stream=None) -> None:
    """Copies PE ``pe``'s copy of symmetric ``src`` into local ``dst``."""
    current_pe()
    _same_dtype(dst, src, "get")
    d_addr, d_n = resolve(dst)
    s_addr, s_n = resolve(src, writable=False)
    n = _nbytes(nbytes, d_n, "destination")
    _size_check(n, s_n, "source")
    _core.get(d_addr, s_addr, n, _as_int(pe, "pe"), stream_handle(stream))


def _check_word_dtype(obj, what: str) -> None:
    name = _dtype_name(obj)
    if name is not None and name.startswith(_NOT_WORD_KINDS):
        raise TypeError(f"{what} act on 64-bit integer words (int64 or uint64), got dtype {name}")


def _signal_addr(signal) -> int:
    _check_word_dtype(signal, "signals")
    addr, n = resolve(signal)
    if n < 8:
        raise ValueError(f"a signal needs an 8-byte word, got {n} bytes")
    return addr


def put_signal(dst, src, signal, value: int, pe: int, op: str = "set", *,
               nbytes: int | None = None, stream=None, via: str = "auto") -> None:
    """put, then set or add ``value`` on PE ``pe``'s signal word once the data is visible.

    With ``via="copy_engine"`` the signal is written by the same copy-engine
    channel after the bytes, so the receiver (a host wait or a kernel) learns
    of completion without the sender synchronising.
    """
    current_pe()
    _same_dtype(dst, src, "put_signal")
    d_addr, d_n = resolve(dst)
    s_addr, s_n = resolve(src, writable=False)
    n = _nbytes(nbytes, s_n, "source")
    _size_check(n, d_n, "destination")
    if op not in ("set", "add"):
        raise ValueError(f"signal op must be 'set' or 'add', got {op!r}")
    sig, value, pe = _signal_addr(signal), _as_int(value, "value", *UINT64), _as_int(pe, "pe")
    _core.put_signal(d_addr, s_addr, n, sig, value, op, pe, stream_handle(stream), str(via))


def signal_op(signal, value: int, pe: int, op: str = "set", *, stream=None) -> None:
    """Sets or adds ``value`` to PE ``pe``'s copy of the signal word."""
    current_pe()
    _core.signal_op(_signal_addr(signal), _as_int(value, "value", *UINT64), op,
                    _as_int(pe, "pe"),
                    stream_handle(stream))


def _timeout(pe, timeout) -> float:
    return pe.timeout if timeout is None else resolve_timeout(timeout)


def signal_wait_until(signal, cmp: str, value: int, timeout: float | None = None) -> int:
    """Waits until the local signal word satisfies ``cmp`` ("eq", "ge", ...) against
    ``value``; returns the word. TimeoutError after ``timeout`` s (default: init's)."""
    pe = current_pe()
    if cmp not in _COMPARES:
        raise ValueError(f"cmp must be one of {', '.join(_COMPARES[:6])}, got {cmp!r}")
    t = _timeout(pe, timeout)
    value = _as_int(value, "value", *UINT64)
    return _core.signal_wait_until(_signal_addr(signal), cmp, value, t)


def _word(dst) -> int:
    _check_word_dtype(dst, "atomics")
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
    """Completes every put/get/signal this PE issued (on ``stream``, and on its
    copy-engine channels); raises what a kernel of this PE reported through
    the device API (a wait that timed out, ...)."""
    current_pe()
    _core.quiet(stream_handle(stream))
    check_device_errors()


def fence(stream=None) -> None:
    """Orders this PE's operations: earlier ones to a peer land before later ones."""
    current_pe()
    _core.fence(stream_handle(stream))


def barrier_all(stream=None, timeout: float | None = None) -> None:
    """All PEs wait for each other; completes this PE's outstanding operations first."""
    pe = current_pe()
    t = _timeout(pe, timeout)
    _core.quiet(stream_handle(stream))
    check_device_errors()
    if _core.all_peers_load_store():
        _core.heap_barrier(t)
    else:
        pe.bootstrap.barrier("barrier_all", timeout=t)
