"""The bootstrap under abuse: slow and numerous unauthenticated clients, a
process squatting on the port, stale-segment reaping across PID namespaces."""
import os
import socket
import subprocess
import threading
import time

import pytest

import symheap
from faultproc import finish, start
from symheap import _bootstrap
from symheap._bootstrap import BootstrapRoot, TcpBootstrap, UniqueId, take_reservation
from symheap.testing import run_threads


def _drip(uid, stop, held):
    """A client that sends one byte every 0.2 s and never finishes its hello."""
    try:
        s = socket.create_connection((uid.host, uid.port), timeout=5)
    except OSError:
        return
    try:
        while not stop.is_set():
            s.sendall(b"\x00")
            time.sleep(0.2)
    except OSError:
        held.append(False)  # dropped by the root
    finally:
        s.close()


def test_slow_clients_get_a_total_deadline_and_a_bounded_queue(monkeypatch):
    monkeypatch.setattr(_bootstrap, "_HELLO_DEADLINE_S", 1.0)
    uid = UniqueId.parse(symheap.get_unique_id())
    root = BootstrapRoot(uid, 2)
    stop, held = threading.Event(), []
    drips = [threading.Thread(target=_drip, args=(uid, stop, held), daemon=True)
             for _ in range(150)]
    try:
        for t in drips:
            t.start()
        peak = 0
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            peak = max(peak, root.pending)
            time.sleep(0.01)
        assert peak <= _bootstrap._MAX_PENDING
        time.sleep(1.5)  # past the total deadline, though every client kept sending
        alive = [t for t in root.threads if t.is_alive()]
        assert root.pending == 0 and not alive, (root.pending, len(alive))
        # A real PE still gets in.
        pe = TcpBootstrap(uid, 1, 2, timeout=5)
        pe.close(grace_s=0)
    finally:
        stop.set()
        root.close(grace_s=0)
        for t in drips:
            t.join(5)
    assert not root.accept_thread.is_alive()
    assert not any(t.is_alive() for t in root.threads)


def test_the_port_is_held_from_id_creation():
    uid = UniqueId.parse(symheap.get_unique_id())
    squatter = socket.socket()
    with pytest.raises(OSError):
        squatter.bind((uid.host, uid.port))  # a plain bind cannot take it
    squatter.close()
    sock = take_reservation(uid)
    assert sock is not None
    sock.close()


def _fake_root(listener, seen, stop):
    """Listens where the root should be and records everything a PE sends."""
    listener.settimeout(0.2)
    while not stop.is_set():
        try:
            conn, _ = listener.accept()
        except OSError:
            continue
        with conn:
            conn.settimeout(2)
            try:
                seen.append(conn.recv(65536))
                # answer the challenge with a forged proof
                _bootstrap._send(conn, {"nonce": "ab" * 32, "proof": "00" * 32})
                seen.append(conn.recv(65536))
            except OSError:
                pass


def test_a_squatter_on_the_port_learns_nothing():
    raw = symheap.get_unique_id()
    uid = UniqueId.parse(raw)
    take_reservation(uid).close()  # the worst case: a squatter got the port anyway
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((uid.host, uid.port))
    listener.listen(4)
    seen, stop = [], threading.Event()
    t = threading.Thread(target=_fake_root, args=(listener, seen, stop), daemon=True)
    t.start()
    try:
        with pytest.raises(symheap.SymheapError, match="not this job's bootstrap root"):
            symheap.init(1, 2, raw, device=1, heap_size="1M", timeout=3)
    finally:
        stop.set()
        t.join(5)
        listener.close()
    sent = b"".join(seen)
    assert sent, "the PE never spoke to the squatter"
    assert uid.secret not in sent and uid.secret.hex().encode() not in sent
    assert not symheap.is_initialized()


_LIVE_OWNER = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_CREAT | os.O_RDWR, 0o600)
os.ftruncate(fd, 4096)
fcntl.flock(fd, fcntl.LOCK_SH)
print("holding", flush=True)
sys.stdin.readline()
"""


def test_reaper_spares_a_live_segment_whose_pid_is_foreign():
    # A pid that does not exist here, as a process of another PID namespace
    # sharing /dev/shm would look: its segment must survive while it holds it.
    fake_pid = 4_000_000 + os.getpid() % 100_000
    live = f"/dev/shm/symheap.{fake_pid}.00000000000000aa.0.1"
    stale = f"/dev/shm/symheap.{fake_pid}.00000000000000bb.0.1"
    owner = start(_LIVE_OWNER, args=(live,), stdin=subprocess.PIPE)
    try:
        assert owner.stdout.readline().strip() == "holding"
        fd = os.open(stale, os.O_CREAT | os.O_RDWR, 0o600)
        os.ftruncate(fd, 4096)
        os.close(fd)  # its owner is gone: nobody holds the lock
        run = run_threads(lambda: symheap.n_pes(), 1, init_kwargs={"heap_size": "1M"})
        assert run == [1]
        assert os.path.exists(live), "the reaper removed a live job's heap"
        assert not os.path.exists(stale), "the reaper left a stale heap"
    finally:
        owner.stdin.write("done\n")
        owner.stdin.flush()
        finish(owner, 10)
        for path in (live, stale):
            if os.path.exists(path):
                os.unlink(path)
