"""Init, finalize and the per-device PE registry of the Python layer."""
from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass, field

from . import _core
from ._bootstrap import TcpBootstrap, UniqueId, new_unique_id
from ._errors import SymheapError

_DEFAULT_HEAP = {"cpu": "128M", "cuda": "1G"}


@dataclass
class PE:
    """Python-side state of one PE (one device slot of this process)."""
    rank: int
    world: int
    device: int
    job: int
    generation: int
    bootstrap: TcpBootstrap
    timeout: float
    buffers: dict = field(default_factory=dict)  # heap offset -> SymBuffer
    lock: threading.Lock = field(default_factory=threading.Lock)


_pes: dict[int, PE] = {}
_pes_lock = threading.Lock()


def get_unique_id() -> bytes:
    """A fresh id for one job: the bootstrap root address and a random secret.

    Create it once (in a launcher, or on rank 0) and hand the same bytes to
    every PE's ``init``. The root listens on loopback unless
    SYMHEAP_BOOTSTRAP_ADDR or SYMHEAP_BOOTSTRAP_IFACE names another address.
    """
    return new_unique_id().to_bytes()


def backend() -> str:
    """Name of the active backend: "cpu" or "cuda" (SYMHEAP_BACKEND forces one)."""
    return _core.backend_name()


def device_count() -> int:
    return _core.device_count()


def set_device(device: int) -> None:
    """Sets the calling thread's current device (per thread, like CUDA's)."""
    _core.set_device(_as_int(device, "device", *INT32))


def current_device() -> int:
    return _core.current_device()


INT32 = (-(1 << 31), (1 << 31) - 1)
INT64 = (-(1 << 63), (1 << 63) - 1)
UINT64 = (0, (1 << 64) - 1)


def _as_int(value, name: str, lo: int = INT64[0], hi: int = INT64[1]) -> int:
    """``value`` as an int in [lo, hi] (by default what the core's int64 takes);
    TypeError for a bool or a non-integer, ValueError naming the range."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got bool ({value})")
    if not isinstance(value, int):
        try:
            import operator
            value = operator.index(value)
        except TypeError:
            raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None
    if not lo <= value <= hi:
        raise ValueError(f"{name}={value} is outside the allowed range [{lo}, {hi}]")
    return value


def resolve_timeout(timeout, what: str = "timeout") -> float:
    """Seconds for a wait: ``timeout``, else SYMHEAP_TIMEOUT, else the core's default.
    Every source is checked against the same range, by the core."""
    if timeout is None:
        text = os.environ.get("SYMHEAP_TIMEOUT")
        if not text:
            return _core.default_timeout_s
        try:
            timeout, what = float(text), "SYMHEAP_TIMEOUT"
        except ValueError:
            raise ValueError(f"SYMHEAP_TIMEOUT={text!r} is not a number of seconds") from None
    if isinstance(timeout, bool):
        raise TypeError(f"{what} must be a number of seconds, got bool")
    try:
        timeout = float(timeout)
    except OverflowError:  # an int beyond float's range: as refused as inf
        timeout = float("inf")
    except (TypeError, ValueError):
        raise TypeError(f"{what} must be a number of seconds, got "
                        f"{type(timeout).__name__}") from None
    return _core.check_timeout(timeout, what)


def resolve_heap_size(heap_size) -> int:
    if heap_size is None:
        heap_size = os.environ.get("SYMHEAP_HEAP_SIZE") or _DEFAULT_HEAP.get(backend(), "128M")
    if isinstance(heap_size, str):
        return _core.parse_size(heap_size)
    heap_size = _as_int(heap_size, "heap_size", 0)
    if heap_size <= 0:
        raise ValueError(f"heap_size must be positive, got {heap_size}")
    return heap_size


def current_pe() -> PE:
    """The PE of the calling thread's current device; raises before init."""
    device = _core.acting_device()
    pe = _pes.get(device)
    if pe is None:
        raise SymheapError(f"symheap is not initialised on device {device} of this thread: "
                           f"call symheap.init(...) first (or set_device to a device that "
                           f"hosts a PE)")
    return pe


def is_initialized() -> bool:
    """True when the calling thread's current device hosts a PE."""
    return _core.current_device() in _pes


def init(rank: int, world_size: int, unique_id: bytes, *, device: int | None = None,
         heap_size=None, timeout: float | None = None) -> None:
    """Joins the job named by ``unique_id`` as PE ``rank`` on ``device``.

    Collective over all ``world_size`` PEs. ``device`` defaults to the calling
    thread's current device, and becomes the thread's current device. The heap
    size comes from ``heap_size`` (bytes or a string such as "512M"), else
    SYMHEAP_HEAP_SIZE, else the backend default. Waits give up after
    ``timeout`` seconds (default SYMHEAP_TIMEOUT, else 120) and name the PEs
    that never arrived.
    """
    join(rank, world_size, unique_id, device=device, heap_size=heap_size, timeout=timeout)


def join(rank: int, world_size: int, unique_id: bytes, *, device: int | None = None,
         heap_size=None, timeout: float | None = None, xla_ordinal: int = -1) -> None:
    """``init``, for front ends: with ``xla_ordinal`` >= 0 the PE also serves
    that XLA device (symheap.jax). Every step and its order are the core's
    (Runtime::init_pe); this layer checks the arguments and records the PE."""
    rank = _as_int(rank, "rank", *INT32)
    world_size = _as_int(world_size, "world_size", *INT32)
    uid = UniqueId.parse(unique_id)
    timeout = resolve_timeout(timeout)
    heap_bytes = resolve_heap_size(heap_size)
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside [0, world_size={world_size})")
    if device is None:
        device = _core.current_device()
    device = _as_int(device, "device", *INT32)
    _core.set_device(device)  # the core refuses a device slot already in use

    def connect():
        return TcpBootstrap(uid, rank, world_size, timeout,
                            on_failure=lambda why: _core.mark_failed(device, why))

    boot = _core.init_pe(uid.job, device, rank, world_size, heap_bytes, timeout, connect,
                         xla_ordinal=xla_ordinal)
    _, _, generation, job, _ = _core.slot_identity(device)
    with _pes_lock:
        _pes[device] = PE(rank, world_size, device, job, generation, boot, timeout)


def finalize() -> None:
    """Collective: waits for every PE, then releases this PE's heap and mappings.

    Buffers still referenced by Python objects keep their memory mapped but
    can no longer be used for communication. init may be called again.
    """
    pe = current_pe()
    try:
        _core.finalize_pe(pe.device, pe.bootstrap)  # every step and its order: C++
    finally:
        with _pes_lock:
            _pes.pop(pe.device, None)
        for buf in list(pe.buffers.values()):
            buf._invalidate()


def my_pe() -> int:
    return current_pe().rank


def n_pes() -> int:
    return current_pe().world


def peer_kind(pe: int) -> str:
    """"self", "same_process", "same_node" or "remote"."""
    current_pe()
    return _core.peer_kind(_as_int(pe, "pe"))


def device_of(pe: int) -> int:
    """Local device of PE ``pe`` when it lives in this process."""
    current_pe()
    pe = _as_int(pe, "pe")
    kind = _core.peer_kind(pe)
    if kind not in ("self", "same_process"):
        raise ValueError(f"PE {pe} is {kind}: it has no device in this process")
    return _core.peer_device(pe)


def _bcast_unique_id(is_root: bool, share) -> bytes:
    uid = get_unique_id() if is_root else None
    uid = share(uid)
    if not isinstance(uid, (bytes, bytearray)):
        raise SymheapError("the launcher did not deliver a unique id from rank 0")
    return bytes(uid)


def init_torch(group=None, *, device: int | None = None, heap_size=None,
               timeout: float | None = None) -> None:
    """Init with one PE per process of a torch.distributed group (torchrun).

    Rank 0 of the group creates the unique id and broadcasts it through the
    group; the rest goes through symheap's own bootstrap. ``device`` defaults
    to LOCAL_RANK (or the group rank modulo the device count).
    """
    import torch.distributed as dist
    if not dist.is_available() or not dist.is_initialized():
        raise SymheapError("init_torch needs torch.distributed initialised first "
                           "(torch.distributed.init_process_group)")
    group = group or dist.group.WORLD
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    src = dist.get_global_rank(group, 0) if group is not dist.group.WORLD else 0

    def share(uid):
        box = [uid]
        dist.broadcast_object_list(box, src=src, group=group)
        return box[0]

    if device is None:
        local = os.environ.get("LOCAL_RANK")
        device = int(local) if local is not None else rank % device_count()
    init(rank, world, _bcast_unique_id(rank == 0, share), device=device, heap_size=heap_size,
         timeout=timeout)


def init_mpi(comm=None, *, device: int | None = None, heap_size=None,
             timeout: float | None = None) -> None:
    """Init with one PE per MPI process (mpirun); ``comm`` defaults to COMM_WORLD.

    ``device`` defaults to the process's rank among the processes of its node.
    """
    from mpi4py import MPI
    comm = comm or MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    if device is None:
        node = comm.Split_type(MPI.COMM_TYPE_SHARED)
        device = node.Get_rank() % device_count()
        node.Free()
    uid = _bcast_unique_id(rank == 0, lambda u: comm.bcast(u, root=0))
    init(rank, world, uid, device=device, heap_size=heap_size, timeout=timeout)


def collective_check(pe: PE, tag: str, value) -> list:
    """All-gathers ``value`` and raises the same ValueError on every PE if they differ."""
    values = pe.bootstrap.allgather_json(value, tag)
    if any(v != values[0] for v in values):
        detail = ", ".join(f"PE {r}: {json.dumps(v)}" for r, v in enumerate(values))
        raise ValueError(f"collective {tag} called with different arguments on different PEs "
                         f"({detail}); every PE must pass the same values")
    return values


def release_local(device: int) -> None:
    """Drops this process's PE on ``device`` without a collective (after a
    collective init failed part-way); nothing if the device hosts none."""
    with _pes_lock:
        pe = _pes.pop(device, None)
    if pe is None:
        return
    for buf in list(pe.buffers.values()):
        buf._invalidate()
    _core.destroy_pe(device)
    pe.bootstrap.close()
