"""Backend-independent parts of the CUDA front end, checked on the cpu backend:
stream handles, the device context bytes, transport selection arguments."""
import ctypes
import struct

import numpy as np
import pytest

import symheap
from symheap import _core
from symheap._backend_views import stream_handle
from symheap.testing import run_threads


class _TorchLikeStream:
    cuda_stream = 0x1234


class _CupyLikeStream:
    ptr = 0x5678


def test_stream_handles():
    assert stream_handle(None) == 0  # cpu backend: no current stream
    assert stream_handle(77) == 77
    assert stream_handle(_TorchLikeStream()) == 0x1234
    assert stream_handle(_CupyLikeStream()) == 0x5678
    with pytest.raises(TypeError):
        stream_handle(True)
    with pytest.raises(TypeError):
        stream_handle("stream")
    with pytest.raises(ValueError):
        stream_handle(-1)


def _context_fields():
    ctx = symheap.device_context()
    assert len(ctx) == _core.device_context_size == symheap.device_context_dtype().itemsize
    peer_bases, my_base, my_pe, n_pes, heap_size = struct.unpack_from("<QQiiQ", ctx)
    buf = symheap.malloc(64)
    ok = my_base <= buf.ptr < my_base + heap_size
    symheap.free(buf)
    # The context's copy of the first table entries (DeviceContext::first_peer_bases, after
    # the eight 8-byte words above) matches the table, and is null past n_pes.
    first = struct.unpack_from("<8Q", ctx, 56)
    table = (ctypes.c_uint64 * n_pes).from_address(peer_bases)
    ok &= list(first[:min(n_pes, 8)]) == list(table[:8]) and not any(first[n_pes:])
    ok &= first[my_pe] == my_base
    return my_pe, n_pes, heap_size, ok, peer_bases != 0


def test_device_context_describes_the_pe():
    results = run_threads(_context_fields, 3, init_kwargs={"heap_size": "16M"})
    for rank, (my_pe, n_pes, heap_size, ok, has_table) in enumerate(results):
        assert (my_pe, n_pes, heap_size) == (rank, 3, 16 << 20)
        assert ok and has_table


def test_device_context_needs_init():
    with pytest.raises(symheap.SymheapError):
        symheap.device_context()


def _bad_transport_arguments():
    buf = symheap.empty((16,), "float32", like="numpy")
    sig = symheap.empty((1,), "uint64", like="numpy")
    buf[:] = -1.0
    sig[:] = 0
    symheap.barrier_all()
    errors = []
    for call in (lambda: symheap.put(buf, np.ones(16, np.float32), 1 - symheap.my_pe(),
                                     via="sdma"),
                 lambda: symheap.put_signal(buf, np.ones(16, np.float32), sig, 1,
                                            1 - symheap.my_pe(), op="xor")):
        try:
            call()
        except ValueError as e:
            errors.append(str(e))
    symheap.barrier_all()
    untouched = bool((buf == -1.0).all()) and int(sig[0]) == 0  # nothing moved
    symheap.barrier_all()  # everyone looked before anyone writes again
    # every transport name is accepted on cpu and moves the bytes
    for i, via in enumerate(("auto", "load_store", "copy_engine")):
        symheap.put_signal(buf, np.full(16, float(i), np.float32), sig, i + 1,
                           1 - symheap.my_pe(), via=via)
        symheap.signal_wait_until(sig, "eq", i + 1)
        assert (buf == float(i)).all()
        symheap.barrier_all()
    symheap.free(buf)
    symheap.free(sig)
    return errors, untouched


def test_transport_arguments():
    for errors, untouched in run_threads(_bad_transport_arguments, 2):
        assert len(errors) == 2 and "via must be" in errors[0] and "signal op" in errors[1]
        assert untouched
