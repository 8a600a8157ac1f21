"""TCP bootstrap: rank discovery and small all-gathers at init time.

The unique id carries the root's address and a random secret. The PE with rank
0 hosts the root (threads of its process); every PE, whether a thread or a
process, connects to it as a client and takes part in all-gathers.

Authentication never reveals the secret: the client and the root each prove
knowledge of it with an HMAC over both sides' fresh nonces, the root first, so
whoever sits on the port learns nothing usable. The port is also held from
``get_unique_id()`` on (a bound, not listening, SO_REUSEADDR socket that the
root takes over when it runs in the same process), so ids of one process never
share a port and a casual bind cannot take it in between.

The root notices at once when a PE's connection drops without a goodbye (its
process died) and tells every other PE, whose waits then fail naming it.
Every wait has a deadline; a timeout names the PEs that are late.
"""
from __future__ import annotations

import base64
import fcntl
import hashlib
import hmac
import json
import os
import queue
import socket
import struct
import threading
import time
from collections import OrderedDict

from ._errors import SymheapError

_MAGIC = b"SYMHEAP\x01"
_SECRET_BYTES = 32
_MAX_FRAME = 16 << 20  # larger frames are refused and the connection dropped
_HELLO_DEADLINE_S = 10.0  # total time an unauthenticated connection gets to prove itself
_MAX_PENDING = 64  # unauthenticated connections held at once; more are dropped at once
_NONCE_BYTES = 32
_MAX_RESERVED = 256  # port reservations kept per process (oldest released first)


class UniqueId:
    """Address of the bootstrap root plus the secret peers must present."""

    __slots__ = ("host", "port", "secret")

    def __init__(self, host: str, port: int, secret: bytes):
        self.host, self.port, self.secret = host, port, secret

    def to_bytes(self) -> bytes:
        host = self.host.encode()
        return _MAGIC + self.secret + struct.pack(">HB", self.port, len(host)) + host

    @classmethod
    def parse(cls, raw) -> "UniqueId":
        if isinstance(raw, UniqueId):
            return raw
        if isinstance(raw, (bytearray, memoryview)):
            raw = bytes(raw)
        if not isinstance(raw, bytes):
            raise TypeError(f"unique_id must be the bytes returned by symheap.get_unique_id(), "
                            f"got {type(raw).__name__}")
        fixed = len(_MAGIC) + _SECRET_BYTES + 3
        if len(raw) < fixed or not raw.startswith(_MAGIC):
            raise ValueError("malformed unique_id: it must be the exact bytes returned by "
                             "symheap.get_unique_id() (wrong magic or too short)")
        secret = raw[len(_MAGIC):len(_MAGIC) + _SECRET_BYTES]
        port, host_len = struct.unpack(">HB", raw[len(_MAGIC) + _SECRET_BYTES:fixed])
        if len(raw) != fixed + host_len or port == 0:
            raise ValueError("malformed unique_id: bad length or port")
        try:
            host = raw[fixed:].decode()
            socket.inet_pton(socket.AF_INET6 if ":" in host else socket.AF_INET, host)
        except (UnicodeDecodeError, OSError):
            raise ValueError("malformed unique_id: the root address is not an IP address") from None
        return cls(host, port, secret)

    @property
    def job(self) -> int:
        """A 63-bit job key derived from the secret (names shared-memory segments)."""
        return int.from_bytes(hashlib.sha256(self.secret).digest()[:8], "little") >> 1


def _interface_address(name: str) -> str:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        packed = fcntl.ioctl(sock.fileno(), 0x8915,  # SIOCGIFADDR
                             struct.pack("256s", name.encode()[:15]))
        return socket.inet_ntoa(packed[20:24])
    except OSError as e:
        raise ValueError(f"SYMHEAP_BOOTSTRAP_IFACE={name!r}: no IPv4 address on that "
                         f"interface ({e})") from None
    finally:
        sock.close()


def bootstrap_host() -> str:
    """Loopback unless SYMHEAP_BOOTSTRAP_ADDR or SYMHEAP_BOOTSTRAP_IFACE says otherwise."""
    addr = os.environ.get("SYMHEAP_BOOTSTRAP_ADDR")
    if addr:
        return addr
    iface = os.environ.get("SYMHEAP_BOOTSTRAP_IFACE")
    if iface:
        return _interface_address(iface)
    return "127.0.0.1"


_reserved: "OrderedDict[tuple, socket.socket]" = OrderedDict()
_reserved_lock = threading.Lock()


def _reserve(host: str, port: int) -> socket.socket | None:
    """A socket bound to (host, port) with SO_REUSEADDR and not listening: no other
    socket can bind the port without SO_REUSEADDR, or listen on it from this
    process's point of view, yet the root (this process or another) can bind it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        if port == 0:
            raise
        return None  # a fixed port still in use: init reports it
    return sock


def new_unique_id() -> UniqueId:
    host = bootstrap_host()
    text = os.environ.get("SYMHEAP_BOOTSTRAP_PORT", "0")
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise ValueError(f"SYMHEAP_BOOTSTRAP_PORT={text!r} must be a port number in "
                         f"[1, 65535] (or 0 to pick a free one)")
    sock = _reserve(host, port)
    if sock is not None:
        port = sock.getsockname()[1]
    uid = UniqueId(host, port, os.urandom(_SECRET_BYTES))
    if sock is not None:
        with _reserved_lock:
            _reserved[(host, port, uid.secret)] = sock
            while len(_reserved) > _MAX_RESERVED:
                _reserved.popitem(last=False)[1].close()
    return uid


def take_reservation(uid: UniqueId) -> socket.socket | None:
    """The socket that holds the id's port in this process, if any (the caller owns it)."""
    with _reserved_lock:
        return _reserved.pop((uid.host, uid.port, uid.secret), None)


def _proof(secret: bytes, role: bytes, *parts) -> str:
    msg = b"|".join([role] + [str(p).encode() if not isinstance(p, bytes) else p
                              for p in parts])
    return hmac.new(secret, msg, hashlib.sha256).hexdigest()


# ----------------------------------------------------------------- framing

def _send(sock: socket.socket, obj) -> None:
    payload = json.dumps(obj).encode()
    sock.sendall(struct.pack(">I", len(payload)) + payload)


def _recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    chunks, got = [], 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise socket.timeout("deadline passed")
            sock.settimeout(left)
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            raise ConnectionError("connection closed")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _recv(sock: socket.socket, limit: int = _MAX_FRAME, deadline: float | None = None):
    (n,) = struct.unpack(">I", _recv_exact(sock, 4, deadline))
    if n > limit:
        raise ValueError(f"frame of {n} bytes exceeds the {limit}-byte limit")
    obj = json.loads(_recv_exact(sock, n, deadline).decode())
    if not isinstance(obj, dict):
        raise ValueError("frame is not a JSON object")
    return obj


# ----------------------------------------------------------------- root

class _Collective:
    def __init__(self, tag: str, deadline: float):
        self.tag, self.deadline = tag, deadline
        self.parts: dict[int, str] = {}
        self.result = None  # ("ok", list) or ("error", kind, message)


class BootstrapRoot:
    """Serves all-gathers for one job from threads of rank 0's process; close()
    stops and joins every one of them and releases the port."""

    def __init__(self, uid: UniqueId, world: int):
        self.uid, self.world = uid, world
        listener = take_reservation(uid)
        try:
            if listener is None:
                listener = _reserve(uid.host, uid.port)
                if listener is None:
                    raise OSError("address already in use")
            listener.listen(max(16, world))
        except OSError as e:
            if listener is not None:
                listener.close()
            raise SymheapError(f"bootstrap root cannot listen on {uid.host}:{uid.port} ({e}); "
                               f"create a fresh id with symheap.get_unique_id()") from None
        self.listener = listener
        self.cond = threading.Condition()
        self.ranks: dict[int, socket.socket] = {}
        self.send_locks: dict[socket.socket, threading.Lock] = {}
        self.conns: set[socket.socket] = set()  # every open connection, for close()
        self.threads: set[threading.Thread] = set()
        self.pending = 0  # connections not yet authenticated
        self.collectives: dict[int, _Collective] = {}
        self.fatal: str | None = None
        self.fatal_kind = "state"
        self.closed = False
        self.accept_thread = threading.Thread(target=self._accept_loop, daemon=True,
                                              name="symheap-bootstrap-root")
        self.accept_thread.start()

    def close(self, grace_s: float = 5.0) -> None:
        """Waits (briefly, unless the job failed) for the clients to say goodbye,
        then stops every thread and closes every socket."""
        end = time.monotonic() + grace_s
        with self.cond:
            while self.ranks and self.fatal is None and time.monotonic() < end:
                self.cond.wait(0.05)
            self.closed = True
            self.cond.notify_all()
            conns = list(self.conns)
        for sock in [self.listener] + conns:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in accept/recv
            except OSError:
                pass
        self.accept_thread.join(10)
        with self.cond:
            threads = list(self.threads)
        for t in threads:
            t.join(10)
        self.listener.close()

    def _accept_loop(self) -> None:
        while not self.closed:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            with self.cond:
                if self.closed or self.pending >= _MAX_PENDING:
                    conn.close()
                    continue
                self.pending += 1
                self.conns.add(conn)
                self.threads = {t for t in self.threads if t.is_alive()}
                t = threading.Thread(target=self._serve, args=(conn,), daemon=True,
                                     name="symheap-bootstrap-conn")
                self.threads.add(t)
            t.start()

    def _fail_all(self, message: str, kind: str = "value") -> None:
        # Caller holds self.cond. Every PE, waiting now or calling later, gets it.
        if self.fatal is None:
            self.fatal, self.fatal_kind = message, kind
        for c in self.collectives.values():
            if c.result is None:
                c.result = ("error", self.fatal_kind, self.fatal)
        self.cond.notify_all()

    def _send(self, conn: socket.socket, obj) -> None:
        with self.send_locks[conn]:
            _send(conn, obj)

    def _authenticate(self, conn: socket.socket):
        """Challenge and response within one total deadline; (rank, world) or None."""
        deadline = time.monotonic() + _HELLO_DEADLINE_S
        hello = _recv(conn, limit=4096, deadline=deadline)
        client_nonce = hello.get("nonce")
        if hello.get("op") != "hello" or not isinstance(client_nonce, str) \
                or len(client_nonce) != 2 * _NONCE_BYTES:
            return None
        nonce = os.urandom(_NONCE_BYTES).hex()
        _send(conn, {"nonce": nonce,
                     "proof": _proof(self.uid.secret, b"root", client_nonce, nonce)})
        answer = _recv(conn, limit=4096, deadline=deadline)
        rank, world, proof = answer.get("rank"), answer.get("world"), answer.get("proof")
        if not isinstance(rank, int) or not isinstance(world, int) or \
                not isinstance(proof, str) or not hmac.compare_digest(
                    proof.encode(), _proof(self.uid.secret, b"client", nonce, client_nonce,
                                           rank, world).encode()):
            return None  # not one of ours: drop silently
        return rank, world

    def _serve(self, conn: socket.socket) -> None:
        rank, said_bye, authenticated = None, False, False
        self.send_locks[conn] = threading.Lock()
        try:
            try:
                who = self._authenticate(conn)
            finally:
                with self.cond:
                    self.pending -= 1
            if who is None:
                return
            rank, world = who
            authenticated = True
            conn.settimeout(None)
            with self.cond:
                if world != self.world:
                    self._fail_all(f"world_size mismatch: PE 0 (bootstrap root) has "
                                   f"world_size={self.world} but PE {rank} passed "
                                   f"world_size={world}; every PE must pass the same value")
                elif not 0 <= rank < self.world:
                    self._fail_all(f"PE rank {rank} outside [0, {self.world})")
                elif rank in self.ranks:
                    self._fail_all(f"rank {rank} was claimed by two PEs; ranks must be unique")
                if self.fatal:
                    self._send(conn, {"error": self.fatal, "kind": self.fatal_kind})
                    rank = None
                    return
                self.ranks[rank] = conn
            self._send(conn, {"ok": True})
            while True:
                msg = _recv(conn)
                op = msg.get("op")
                if op == "bye":
                    said_bye = True
                    return
                if op != "allgather":
                    raise ValueError(f"unknown op {op!r}")
                reply = self._allgather(rank, msg)
                reply["seq"] = msg.get("seq")
                self._send(conn, reply)
        except (OSError, ValueError, ConnectionError, UnicodeDecodeError, json.JSONDecodeError,
                struct.error, AttributeError, TypeError):
            return  # malformed traffic or a vanished peer: drop this connection only
        finally:
            self._drop(conn, rank, authenticated and not said_bye)

    def _drop(self, conn: socket.socket, rank, died: bool) -> None:
        """Forgets a connection; a PE that vanished without saying goodbye fails the job."""
        with self.cond:
            if rank is not None and self.ranks.get(rank) is conn:
                del self.ranks[rank]
                if died and not self.closed:
                    self._fail_all(f"PE {rank} died (its process exited or was killed: its "
                                   f"bootstrap connection closed without finalize)", "dead")
                    event = {"event": "failed", "error": self.fatal}
                    for other in list(self.ranks.values()):
                        try:
                            self._send(other, event)
                        except OSError:
                            pass
                self.cond.notify_all()
            self.conns.discard(conn)  # the thread stays in self.threads: close() joins it
        conn.close()
        self.send_locks.pop(conn, None)

    def _allgather(self, rank: int, msg: dict) -> dict:
        seq, data = msg.get("seq"), msg.get("data")
        tag, timeout = str(msg.get("tag", "")), float(msg.get("timeout", 60.0))
        if not isinstance(seq, int) or not isinstance(data, str):
            raise ValueError("malformed allgather")
        with self.cond:
            if self.fatal:  # a later call: say it is refused for the earlier failure
                return {"error": f"'{tag}' refused: the job failed earlier ({self.fatal}); "
                                 f"finalize (it releases this PE all the same) and init again",
                        "kind": "state"}
            c = self.collectives.get(seq)
            if c is None:
                c = self.collectives[seq] = _Collective(tag, time.monotonic() + timeout)
            if c.tag != tag:
                self._fail_all(f"PEs disagree on the collective call sequence: PE {rank} called "
                               f"'{tag}' while others called '{c.tag}' (call #{seq})")
            c.parts[rank] = data
            if len(c.parts) == self.world and c.result is None:
                c.result = ("ok", [c.parts[r] for r in range(self.world)])
                self.cond.notify_all()
            while c.result is None and not self.closed:
                left = c.deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(set(range(self.world)) - set(c.parts))
                    never = [r for r in missing if r not in self.ranks]
                    detail = (f"; PE(s) {never} never connected (never called init?)"
                              if never else "")
                    c.result = ("error", "timeout",
                                f"bootstrap '{tag}' timed out after {timeout:g} s waiting for "
                                f"PE(s) {missing}{detail}")
                    if self.fatal is None:
                        self.fatal, self.fatal_kind = c.result[2], "timeout"
                    self.cond.notify_all()
                    break
                self.cond.wait(min(left, 0.5))
            if c.result is None:
                return {"error": "bootstrap root shut down", "kind": "state"}
            if c.result[0] == "ok":
                out = {"ok": True, "data": c.result[1]}
            else:
                out = {"error": c.result[2], "kind": c.result[1]}
            c.parts.pop(rank, None)
            if not c.parts:
                self.collectives.pop(seq, None)
            return out


# ----------------------------------------------------------------- client

class TcpBootstrap:
    """One PE's connection to the bootstrap root.

    After the handshake a reader thread takes every frame: answers go to the
    waiting call, and a failure the root announces (a PE died), or the loss
    of the root itself, is recorded at once and passed to ``on_failure``.
    """

    def __init__(self, uid: UniqueId, rank: int, world: int, timeout: float,
                 on_failure=None):
        self.uid, self.rank, self.world, self.timeout = uid, rank, world, timeout
        self.on_failure = on_failure
        self.seq = 0
        self.broken = ""  # set when the connection can no longer be trusted
        self.failure = ""  # set when the job failed (first cause)
        self.closing = False
        self.replies: queue.Queue = queue.Queue()
        self.root = BootstrapRoot(uid, world) if rank == 0 else None
        try:
            self.sock = self._connect()
        except BaseException:
            if self.root:
                self.root.close(grace_s=0)
            raise
        self.reader = threading.Thread(target=self._read_loop, daemon=True,
                                       name=f"symheap-bootstrap-pe{rank}")
        self.reader.start()

    def _connect(self) -> socket.socket:
        deadline = time.monotonic() + self.timeout
        family = socket.AF_INET6 if ":" in self.uid.host else socket.AF_INET
        last = None
        while True:
            sock = socket.socket(family, socket.SOCK_STREAM)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(max(0.1, min(2.0, deadline - time.monotonic())))
            try:
                sock.connect((self.uid.host, self.uid.port))
                break
            except OSError as e:
                sock.close()
                last = e
                if time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"PE {self.rank}: could not reach the bootstrap root (PE 0) at "
                        f"{self.uid.host}:{self.uid.port} within {self.timeout:g} s ({last}); "
                        f"PE 0 never called init, or the unique id is stale") from None
                time.sleep(0.05)
        try:
            self._handshake(sock, time.monotonic() + self.timeout)
        except BaseException:
            sock.close()
            raise
        return sock

    def _handshake(self, sock: socket.socket, deadline: float) -> None:
        where = f"{self.uid.host}:{self.uid.port}"
        nonce = os.urandom(_NONCE_BYTES).hex()
        try:
            sock.settimeout(max(0.1, deadline - time.monotonic()))
            _send(sock, {"op": "hello", "nonce": nonce})
            challenge = _recv(sock, limit=4096, deadline=deadline)
            root_nonce, proof = challenge.get("nonce"), challenge.get("proof")
            if not isinstance(root_nonce, str) or not isinstance(proof, str) or \
                    not hmac.compare_digest(proof.encode(), _proof(
                        self.uid.secret, b"root", nonce, root_nonce).encode()):
                raise SymheapError(
                    f"PE {self.rank}: the process listening on {where} is not this job's "
                    f"bootstrap root (it failed to prove it knows the id's secret): a stale "
                    f"unique id, or another process holds the port")
            _send(sock, {"rank": self.rank, "world": self.world,
                         "proof": _proof(self.uid.secret, b"client", root_nonce, nonce,
                                         self.rank, self.world)})
            reply = _recv(sock, limit=1 << 20, deadline=deadline)
        except socket.timeout:
            raise TimeoutError(f"PE {self.rank}: the bootstrap root at {where} did not "
                               f"complete the handshake within {self.timeout:g} s") from None
        except (ConnectionError, OSError, ValueError, struct.error) as e:
            raise SymheapError(f"PE {self.rank}: the bootstrap root at {where} dropped the "
                               f"handshake ({e}): wrong secret, or not this job's root") \
                from None
        if "error" in reply:
            kind = reply.get("kind")
            exc = {"timeout": TimeoutError, "value": ValueError}.get(kind, SymheapError)
            raise exc(f"PE {self.rank}: {reply['error']}")
        sock.settimeout(None)  # the reader thread blocks until the next frame

    def _read_loop(self) -> None:
        try:
            while True:
                msg = _recv(self.sock, limit=1 << 31)
                if "event" in msg:
                    self._failed(str(msg.get("error")))
                else:
                    self.replies.put(msg)
        except Exception as e:  # the connection ended: normal at close, a failure before
            if not self.closing:
                self._failed(f"lost the bootstrap root (PE 0): its process exited or "
                             f"finalized ({e})")
            self.replies.put(None)

    def _failed(self, why: str) -> None:
        if self.failure:
            return
        self.failure = why
        if self.on_failure is not None:
            try:
                self.on_failure(why)
            except Exception:  # noqa: BLE001 - the record above still stands
                pass

    def _reply(self, what: str, waited: float) -> dict:
        try:
            reply = self.replies.get(timeout=waited)
        except queue.Empty:
            self.broken = f"no answer to '{what}'"  # a late answer may still arrive
            raise TimeoutError(f"PE {self.rank}: the bootstrap root did not answer '{what}' "
                               f"within {waited:g} s") from None
        if reply is None:
            self.broken = f"connection lost during '{what}'"
            raise SymheapError(f"PE {self.rank}: '{what}' failed: {self.failure}")
        if "error" in reply:
            kind = reply.get("kind")
            exc = {"timeout": TimeoutError, "value": ValueError}.get(kind, SymheapError)
            raise exc(f"PE {self.rank}: {reply['error']}")
        return reply

    def allgather(self, data: bytes, tag: str, timeout: float | None = None) -> list[bytes]:
        if self.broken:
            raise SymheapError(f"PE {self.rank}: the bootstrap connection is out of step after "
                               f"an earlier failure ({self.broken}); finalize and init again")
        self.seq += 1
        t = self.timeout if timeout is None else timeout
        try:
            _send(self.sock, {"op": "allgather", "seq": self.seq, "tag": tag,
                              "data": base64.b64encode(data).decode(), "timeout": t})
        except OSError as e:
            self.broken = f"send failed: {e}"
            raise SymheapError(f"PE {self.rank}: lost the bootstrap root during '{tag}' ({e})") \
                from None
        reply = self._reply(tag, t + 10.0)  # the root answers within t, or with an error
        if reply.get("seq") != self.seq:
            self.broken = f"reply to call #{reply.get('seq')} while waiting for #{self.seq}"
            raise SymheapError(f"PE {self.rank}: bootstrap {self.broken}")
        return [base64.b64decode(x) for x in reply["data"]]

    def allgather_json(self, obj, tag: str, timeout: float | None = None) -> list:
        return [json.loads(x) for x in self.allgather(json.dumps(obj).encode(), tag, timeout)]

    def barrier(self, tag: str, timeout: float | None = None) -> None:
        self.allgather(b"", tag, timeout)

    def close(self, grace_s: float = 5.0) -> None:
        """Says goodbye; the root (on PE 0) waits up to ``grace_s`` for the others'."""
        self.closing = True
        if not self.failure:
            try:
                _send(self.sock, {"op": "bye"})
            except OSError:
                pass
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the reader
        except OSError:
            pass
        self.reader.join(10)
        self.sock.close()
        if self.root:
            self.root.close(grace_s=0 if self.failure else grace_s)
