"""The TCP bootstrap: loopback by default, secret required, robust to junk."""
import json
import socket
import struct
import threading
import time

import pytest

import symheap
from symheap._bootstrap import UniqueId
from symheap.testing import run_threads


def test_binds_loopback_by_default(monkeypatch):
    monkeypatch.delenv("SYMHEAP_BOOTSTRAP_ADDR", raising=False)
    monkeypatch.delenv("SYMHEAP_BOOTSTRAP_IFACE", raising=False)
    assert UniqueId.parse(symheap.get_unique_id()).host == "127.0.0.1"


def test_interface_from_env(monkeypatch):
    monkeypatch.setenv("SYMHEAP_BOOTSTRAP_IFACE", "lo")
    assert UniqueId.parse(symheap.get_unique_id()).host == "127.0.0.1"
    monkeypatch.setenv("SYMHEAP_BOOTSTRAP_IFACE", "no-such-if0")
    with pytest.raises(ValueError, match="SYMHEAP_BOOTSTRAP_IFACE"):
        symheap.get_unique_id()


def test_unique_ids_carry_fresh_secrets():
    a, b = (UniqueId.parse(symheap.get_unique_id()) for _ in range(2))
    assert a.secret != b.secret and len(a.secret) == 32


def _frame(obj) -> bytes:
    payload = json.dumps(obj).encode()
    return struct.pack(">I", len(payload)) + payload


def _intrude(uid: UniqueId, attempts: list):
    """Hits the root with bad traffic; records whether any bad client was admitted."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection((uid.host, uid.port), timeout=1).close()
            break
        except OSError:
            time.sleep(0.02)
    bad = [
        _frame({"op": "hello", "secret": "00" * 32, "rank": 1, "world": 2}),  # wrong secret
        b"\x00\x00\x00\x05hello",  # not JSON
        struct.pack(">I", 1 << 30) + b"x" * 1024,  # oversized length
        b"\xff" * 64,  # garbage
        _frame(["not", "an", "object"]),
    ]
    for payload in bad:
        with socket.create_connection((uid.host, uid.port), timeout=5) as s:
            try:
                s.sendall(payload)
                s.settimeout(2)
                reply = s.recv(4096)  # the root must close without admitting us
            except OSError:
                reply = b""
            attempts.append(reply)


def test_root_rejects_intruders_and_survives_junk():
    raw = symheap.get_unique_id()
    uid = UniqueId.parse(raw)
    attempts: list = []
    intruder = threading.Thread(target=_intrude, args=(uid, attempts))
    errors, done = {}, {}

    def pe(rank):
        try:
            if rank == 1:
                intruder.join(30)  # join only after the junk has been thrown at the root
            symheap.init(rank, 2, raw, device=rank, timeout=30)
            symheap.barrier_all()
            done[rank] = symheap.n_pes()
            symheap.finalize()
        except Exception as e:  # collected for the assertions below
            errors[rank] = e

    threads = [threading.Thread(target=pe, args=(r,)) for r in range(2)]
    threads[0].start()
    intruder.start()
    threads[1].start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert done == {0: 2, 1: 2}
    assert len(attempts) == 5 and all(r == b"" for r in attempts), attempts


def test_wrong_secret_cannot_join():
    uid = UniqueId.parse(symheap.get_unique_id())
    forged = UniqueId(uid.host, uid.port, bytes(32)).to_bytes()
    errors = {}

    def pe(rank, raw):
        try:
            symheap.init(rank, 2, raw, device=rank, timeout=2)
            symheap.finalize()
        except Exception as e:  # collected for the assertions below
            errors[rank] = e

    ts = [threading.Thread(target=pe, args=(0, uid.to_bytes())),
          threading.Thread(target=pe, args=(1, forged))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert isinstance(errors.get(0), TimeoutError) and "[1]" in str(errors[0])
    assert 1 in errors  # the forger was never admitted
