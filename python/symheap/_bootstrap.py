"""TCP bootstrap: rank discovery and small all-gathers at init time.

The unique id carries the root's address and a random secret. The PE with rank
0 hosts the root (a daemon thread); every PE, whether a thread or a process,
connects to it as a client, presents the secret, and takes part in
all-gathers. Every wait has a deadline; a timeout names the PEs that are late.
"""
from __future__ import annotations

import base64
import fcntl
import hashlib
import hmac
import json
import os
import socket
import struct
import threading
import time

from ._errors import SymheapError

_MAGIC = b"SYMHEAP\x01"
_SECRET_BYTES = 32
_MAX_FRAME = 16 << 20  # larger frames are refused and the connection dropped
_HELLO_DEADLINE_S = 10.0  # an unauthenticated connection must speak within this


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


def new_unique_id() -> UniqueId:
    host = bootstrap_host()
    port = int(os.environ.get("SYMHEAP_BOOTSTRAP_PORT", "0"))
    if port == 0:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
    return UniqueId(host, port, os.urandom(_SECRET_BYTES))


# ----------------------------------------------------------------- framing

def _send(sock: socket.socket, obj) -> None:
    payload = json.dumps(obj).encode()
    sock.sendall(struct.pack(">I", len(payload)) + payload)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            raise ConnectionError("connection closed")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _recv(sock: socket.socket, limit: int = _MAX_FRAME):
    (n,) = struct.unpack(">I", _recv_exact(sock, 4))
    if n > limit:
        raise ValueError(f"frame of {n} bytes exceeds the {limit}-byte limit")
    obj = json.loads(_recv_exact(sock, n).decode())
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
    """Serves all-gathers for one job; runs in daemon threads of rank 0's process."""

    def __init__(self, uid: UniqueId, world: int):
        self.uid, self.world = uid, world
        family = socket.AF_INET6 if ":" in uid.host else socket.AF_INET
        self.listener = socket.socket(family, socket.SOCK_STREAM)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.listener.bind((uid.host, uid.port))
        except OSError as e:
            self.listener.close()
            raise SymheapError(f"bootstrap root cannot listen on {uid.host}:{uid.port} ({e}); "
                               f"create a fresh id with symheap.get_unique_id()") from None
        self.listener.listen(max(16, world))
        self.cond = threading.Condition()
        self.ranks: dict[int, socket.socket] = {}
        self.collectives: dict[int, _Collective] = {}
        self.fatal: str | None = None
        self.fatal_kind = "state"
        self.closed = False
        threading.Thread(target=self._accept_loop, name="symheap-bootstrap-root",
                         daemon=True).start()

    def close(self, grace_s: float = 5.0) -> None:
        """Waits (briefly) for the clients to say goodbye, then stops."""
        end = time.monotonic() + grace_s
        with self.cond:
            while self.ranks and time.monotonic() < end:
                self.cond.wait(0.05)
            self.closed = True
            self.cond.notify_all()
        try:
            self.listener.close()
        except OSError:
            pass

    def _accept_loop(self) -> None:
        while not self.closed:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True,
                             name="symheap-bootstrap-conn").start()

    def _fail_all(self, message: str, kind: str = "value") -> None:
        # Caller holds self.cond. Every PE, waiting now or calling later, gets it.
        if self.fatal is None:
            self.fatal, self.fatal_kind = message, kind
        for c in self.collectives.values():
            if c.result is None:
                c.result = ("error", self.fatal_kind, self.fatal)
        self.cond.notify_all()

    def _serve(self, conn: socket.socket) -> None:
        rank = None
        try:
            conn.settimeout(_HELLO_DEADLINE_S)
            hello = _recv(conn, limit=4096)
            secret = hello.get("secret")
            if not isinstance(secret, str) or not hmac.compare_digest(
                    secret.encode(), self.uid.secret.hex().encode()):
                return  # not one of ours: drop silently
            rank, world = hello.get("rank"), hello.get("world")
            if not isinstance(rank, int) or not isinstance(world, int):
                return
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
                    _send(conn, {"error": self.fatal, "kind": self.fatal_kind})
                    rank = None
                    return
                self.ranks[rank] = conn
            _send(conn, {"ok": True})
            while True:
                msg = _recv(conn)
                op = msg.get("op")
                if op == "bye":
                    return
                if op != "allgather":
                    raise ValueError(f"unknown op {op!r}")
                reply = self._allgather(rank, msg)
                reply["seq"] = msg.get("seq")
                _send(conn, reply)
        except (OSError, ValueError, ConnectionError, UnicodeDecodeError, json.JSONDecodeError,
                struct.error, AttributeError, TypeError):
            return  # malformed traffic or a vanished peer: drop this connection only
        finally:
            with self.cond:
                if rank is not None and self.ranks.get(rank) is conn:
                    del self.ranks[rank]
                    self.cond.notify_all()
            conn.close()

    def _allgather(self, rank: int, msg: dict) -> dict:
        seq, data = msg.get("seq"), msg.get("data")
        tag, timeout = str(msg.get("tag", "")), float(msg.get("timeout", 60.0))
        if not isinstance(seq, int) or not isinstance(data, str):
            raise ValueError("malformed allgather")
        with self.cond:
            if self.fatal:
                return {"error": self.fatal, "kind": self.fatal_kind}
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
    """One PE's connection to the bootstrap root."""

    def __init__(self, uid: UniqueId, rank: int, world: int, timeout: float):
        self.uid, self.rank, self.world, self.timeout = uid, rank, world, timeout
        self.seq = 0
        self.broken = ""  # set when the connection can no longer be trusted
        self.root = BootstrapRoot(uid, world) if rank == 0 else None
        try:
            self.sock = self._connect()
        except BaseException:
            if self.root:
                self.root.close(grace_s=0)
            raise

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
        sock.settimeout(self.timeout + 10.0)
        try:
            _send(sock, {"op": "hello", "secret": self.uid.secret.hex(), "rank": self.rank,
                         "world": self.world})
            reply = self._reply(sock, "hello")
        except BaseException:
            sock.close()
            raise
        del reply
        return sock

    def _reply(self, sock: socket.socket, what: str, waited: float | None = None) -> dict:
        try:
            reply = _recv(sock, limit=1 << 31)
        except socket.timeout:
            waited = self.timeout + 10 if waited is None else waited
            self.broken = f"no answer to '{what}'"  # a late answer may still arrive
            raise TimeoutError(f"PE {self.rank}: the bootstrap root did not answer '{what}' "
                               f"within {waited:g} s") from None
        except (ConnectionError, OSError) as e:
            self.broken = f"connection lost during '{what}'"
            raise SymheapError(f"PE {self.rank}: lost the bootstrap root during '{what}' "
                               f"({e}); PE 0 has exited or finalized") from None
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
        self.sock.settimeout(t + 10.0)  # the root answers within t, or with a timeout error
        try:
            _send(self.sock, {"op": "allgather", "seq": self.seq, "tag": tag,
                              "data": base64.b64encode(data).decode(), "timeout": t})
        except OSError as e:
            self.broken = f"send failed: {e}"
            raise SymheapError(f"PE {self.rank}: lost the bootstrap root during '{tag}' ({e})") \
                from None
        reply = self._reply(self.sock, tag, t + 10.0)
        if reply.get("seq") != self.seq:
            self.broken = f"reply to call #{reply.get('seq')} while waiting for #{self.seq}"
            raise SymheapError(f"PE {self.rank}: bootstrap {self.broken}")
        return [base64.b64decode(x) for x in reply["data"]]

    def allgather_json(self, obj, tag: str, timeout: float | None = None) -> list:
        return [json.loads(x) for x in self.allgather(json.dumps(obj).encode(), tag, timeout)]

    def barrier(self, tag: str, timeout: float | None = None) -> None:
        self.allgather(b"", tag, timeout)

    def close(self) -> None:
        try:
            _send(self.sock, {"op": "bye"})
        except OSError:
            pass
        self.sock.close()
        if self.root:
            self.root.close()
