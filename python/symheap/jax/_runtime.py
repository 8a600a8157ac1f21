"""symheap.jax init and finalize: every given local JAX device becomes a PE.

Init is collective over the PEs, so it runs each local PE's init on its own
thread. Under jax.distributed the unique id and every process's device count
travel through JAX's key-value store; ranks follow (process index, local
device order).
"""
from __future__ import annotations

import base64
import json
import threading
import weakref
from dataclasses import dataclass, field

from .. import _core
from .. import _runtime as _rt
from .._errors import SymheapError
from ._ffi import register_targets


@dataclass
class LocalPe:
    device: object  # the jax.Device
    rank: int
    slot: int       # symheap device slot (cpu virtual device or CUDA ordinal)
    ordinal: int    # XLA's DeviceOrdinal of the device


@dataclass
class Job:
    platform: str              # "cpu" or "gpu"
    world: int
    local: list                # LocalPe in rank order
    mesh_devices: list         # every PE's jax.Device in rank order
    timeout: float
    ops: weakref.WeakSet = field(default_factory=weakref.WeakSet)

    def pe_of(self, device) -> LocalPe:
        for pe in self.local:
            if pe.device == device:
                return pe
        raise ValueError(f"{device} is not a PE of symheap.jax.init (PEs of this process: "
                         f"{[p.device for p in self.local]})")


_job: Job | None = None
_lock = threading.Lock()
_init_count = 0  # names this init's keys in the key-value store (init is collective)


def job() -> Job:
    if _job is None:
        raise SymheapError("symheap.jax is not initialised: call symheap.jax.init() first")
    return _job


def is_initialized() -> bool:
    return _job is not None


def on_every_pe(fn, timeout: float) -> list:
    """Runs fn(local_pe) on one thread per local PE (each with its device current),
    returns the results in rank order and raises the first failure."""
    pes = job().local
    results, errors = [None] * len(pes), [None] * len(pes)

    def run(i):
        try:
            _core.set_device(pes[i].slot)
            results[i] = fn(pes[i])
        except BaseException as e:  # re-raised below, on the caller's thread
            errors[i] = e

    threads = [threading.Thread(target=run, args=(i,), name=f"symheap-jax-pe{p.rank}")
               for i, p in enumerate(pes)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 30.0)
    if any(t.is_alive() for t in threads):
        raise TimeoutError("symheap.jax: a PE thread did not finish within "
                           f"{timeout + 30:g} s")
    for e in errors:
        if e is not None:
            raise e
    return results


def _local_devices(devices):
    import jax
    if devices is None:
        devices = jax.local_devices()
    devices = list(devices)
    if not devices:
        raise ValueError("devices must name at least one local JAX device")
    me = jax.process_index()
    platforms = {d.platform for d in devices}
    if len(platforms) != 1:
        raise ValueError(f"devices must share one platform, got {sorted(platforms)}")
    platform = platforms.pop()
    if platform not in ("cpu", "gpu"):
        raise ValueError(f"symheap.jax supports the cpu and gpu (CUDA) platforms, got {platform}")
    for d in devices:
        if d.process_index != me:
            raise ValueError(f"{d} belongs to process {d.process_index}; each process passes "
                             f"its own local devices")
    if len(set(devices)) != len(devices):
        raise ValueError("devices lists a device twice")
    order = sorted(jax.local_devices(backend=platform), key=lambda d: d.id)
    slots = {d: (order.index(d) if platform == "cpu" else d.local_hardware_id) for d in order}
    devices.sort(key=lambda d: slots[d])
    return platform, devices, slots


def _exchange(platform, devices, timeout):
    """(uid, world, first rank, every PE's device id in rank order), shared by the
    processes of jax.distributed (or made here for one process)."""
    import jax
    ids = [d.id for d in devices]
    if jax.process_count() == 1:
        return _rt.get_unique_id(), len(devices), 0, ids
    from jax._src import distributed
    client = distributed.global_state.client
    if client is None:
        raise SymheapError("jax.process_count() > 1 but jax.distributed has no client; call "
                           "jax.distributed.initialize() first")
    me, n = jax.process_index(), jax.process_count()
    prefix = f"symheap/jax/init/{_init_count}"
    ms = int(timeout * 1000)
    client.key_value_set(f"{prefix}/devices/{me}", json.dumps(ids))
    if me == 0:
        client.key_value_set(f"{prefix}/uid", base64.b64encode(_rt.get_unique_id()).decode())
    per_process = [json.loads(client.blocking_key_value_get(f"{prefix}/devices/{p}", ms))
                   for p in range(n)]
    uid = base64.b64decode(client.blocking_key_value_get(f"{prefix}/uid", ms))
    first = sum(len(x) for x in per_process[:me])
    return uid, sum(len(x) for x in per_process), first, [i for x in per_process for i in x]


def init(devices=None, *, heap_size=None, timeout: float | None = None) -> None:
    """Makes every device in ``devices`` (local JAX devices, default all) a PE.

    Collective over every process of jax.distributed. Ranks follow (process
    index, local device order); ``make_mesh()`` lists the devices in that
    order. ``heap_size`` and ``timeout`` as in ``symheap.init``.
    """
    global _job, _init_count
    import jax
    with _lock:
        if _job is not None:
            raise SymheapError("symheap.jax is already initialised; call finalize() first")
        register_targets()
        timeout = _rt.resolve_timeout(timeout)
        platform, devices, slots = _local_devices(devices)
        want = "cpu" if platform == "cpu" else "cuda"
        if _core.backend_name() != want:
            _core.select_backend(want)
        uid, world, first, all_ids = _exchange(platform, devices, timeout)
        _init_count += 1
        by_id = {d.id: d for d in jax.devices(platform)}
        local = [LocalPe(d, first + i, slots[d],
                         d.id if platform == "cpu" else d.local_hardware_id)
                 for i, d in enumerate(devices)]
        new = Job(platform, world, local, [by_id[i] for i in all_ids], timeout)
        _job = new
        try:
            on_every_pe(lambda pe: _rt.join(pe.rank, world, uid, device=pe.slot,
                                            heap_size=heap_size, timeout=timeout,
                                            xla_ordinal=pe.ordinal), timeout)
        except BaseException:
            for pe in local:  # PEs whose init succeeded, without a collective
                _rt.release_local(pe.slot)
            _job = None
            raise


def finalize() -> None:
    """Collective: closes every open EpDispatchCombine, then releases every local PE.
    Executables that still use them raise when run; init may be called again."""
    global _job
    with _lock:
        current = job()
        try:
            for op in list(current.ops):
                op.close()
        finally:
            try:
                on_every_pe(lambda pe: _rt.finalize(), current.timeout)
            finally:
                for pe in current.local:  # the PEs a failed finalize left (the map goes with each)
                    _rt.release_local(pe.slot)
                _job = None


def make_mesh(axis_name: str = "pe"):
    """A 1-d jax.sharding.Mesh of every PE's device, in PE rank order."""
    import numpy as np
    from jax.sharding import Mesh
    return Mesh(np.array(job().mesh_devices), (axis_name,))


def num_pes() -> int:
    return job().world


def rank_of(device) -> int:
    """The PE rank of a local JAX device."""
    return job().pe_of(device).rank


def check_mesh(mesh, axis_name: str = "pe") -> None:
    """Raises ValueError unless position i along ``axis_name`` of ``mesh`` holds
    PE rank i (for every index of the other axes), so that
    ``jax.lax.axis_index(axis_name)`` inside shard_map is the PE rank."""
    import numpy as np
    current = job()
    if axis_name not in mesh.axis_names:
        raise ValueError(f"mesh has no axis {axis_name!r} (axes: {mesh.axis_names})")
    rank = {d: r for r, d in enumerate(current.mesh_devices)}
    devices = np.moveaxis(np.asarray(mesh.devices), mesh.axis_names.index(axis_name), -1)
    size = devices.shape[-1]
    if size != current.world:
        raise ValueError(f"mesh axis {axis_name!r} has {size} devices, but there are "
                         f"{current.world} PEs")
    for line in devices.reshape(-1, size):
        got = [rank.get(d, -1) for d in line]
        if got != list(range(size)):
            raise ValueError(f"mesh axis {axis_name!r} lists the devices of PE ranks {got}, not "
                             f"in PE rank order: build the mesh with symheap.jax.make_mesh() "
                             f"(or order its devices by symheap.jax.rank_of)")


def shard_map(f, *, mesh, in_specs, out_specs, axis_name: str = "pe", **kwargs):
    """jax.shard_map over ``mesh`` after check_mesh(mesh, axis_name)."""
    import jax
    check_mesh(mesh, axis_name)
    if hasattr(jax, "shard_map"):
        return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, **kwargs)
    from jax.experimental.shard_map import shard_map as legacy
    return legacy(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, **kwargs)
