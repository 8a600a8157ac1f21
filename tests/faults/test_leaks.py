"""Init/finalize cycles leave nothing behind: threads, fds, listening sockets,
virtual memory, RSS; ports can be reused and ids of one batch never collide."""
import os
import socket

import symheap
from faultproc import finish, run_py, start
from symheap._bootstrap import UniqueId, take_reservation
from symheap.testing import run_threads

# Reads this process's resource figures (shared with the subprocess below).
_PROBE = r'''
import os, threading
def _listening_inodes():
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    cols = line.split()
                    if cols[3] == "0A":  # TCP_LISTEN
                        inodes.add(cols[9])
        except OSError:
            pass
    return inodes

def probe():
    fds = os.listdir("/proc/self/fd")
    socks = set()
    for fd in fds:
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            socks.add(link[8:-1])
    status = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return {"threads": int(status["Threads"]), "fds": len(fds),
            "listening": len(socks & _listening_inodes()),
            "vm_mb": int(status["VmSize"].split()[0]) / 1024,
            "rss_mb": int(status["VmRSS"].split()[0]) / 1024}

def _settled_probe(before):
    """probe(), given up to 1 s for threads that are just exiting to finish
    (a leak is permanent)."""
    import time
    for _ in range(20):
        after = probe()
        if after["threads"] <= before["threads"] and after["fds"] <= before["fds"] + 1:
            break
        time.sleep(0.05)
    return after
'''
exec(_PROBE)


def _assert_flat(before, after, cycles):
    assert after["threads"] <= before["threads"], (before, after)
    assert after["fds"] <= before["fds"] + 1, (before, after)
    assert after["listening"] <= before["listening"], (before, after)
    # A leaked thread costs ~8 MiB of virtual memory per cycle; the slack is for
    # one more malloc arena (64 MiB reserved), not for a thread per cycle.
    assert after["vm_mb"] - before["vm_mb"] < 128, (cycles, before, after)
    assert after["rss_mb"] - before["rss_mb"] < 32, (cycles, before, after)


def _one_job():
    return symheap.n_pes()


def test_init_finalize_cycles_in_threads_leave_nothing():
    kw = {"init_kwargs": {"heap_size": "1M"}}
    for _ in range(20):  # warm-up: caches, allocator arenas, thread stacks
        run_threads(_one_job, 2, **kw)
    before = probe()
    cycles = 200
    for _ in range(cycles):
        assert run_threads(_one_job, 2, **kw) == [2, 2]
    _assert_flat(before, _settled_probe(before), cycles)


_PARENT = _PROBE + r'''
import json, subprocess, sys
import symheap
child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
figures = []
for cycle in range(CYCLES):
    uid = symheap.get_unique_id()
    child.stdin.write(uid.hex() + "\n"); child.stdin.flush()
    symheap.init(0, 2, uid, device=0, heap_size="1M", timeout=20)
    symheap.barrier_all()
    symheap.finalize()
    assert child.stdout.readline().strip() == "ok"
    if cycle == 4:
        figures.append(probe())
figures.append(_settled_probe(figures[0]))
child.stdin.close()
assert child.wait(20) == 0
print(json.dumps(figures))
'''
_CHILD = r'''
import sys, symheap
for line in sys.stdin:
    symheap.init(1, 2, bytes.fromhex(line.strip()), device=0, heap_size="1M", timeout=20)
    symheap.barrier_all()
    symheap.finalize()
    print("ok", flush=True)
'''


def test_init_finalize_cycles_in_processes_leave_nothing():
    import json
    cycles = 24
    run = run_py(_PARENT.replace("CYCLES", str(cycles)).replace("CHILD", repr(_CHILD)),
                 timeout=120)
    assert run.rc == 0, run.describe()
    before, after = json.loads(run.out.strip().splitlines()[-1])
    _assert_flat(before, after, cycles)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_fixed_port_serves_consecutive_jobs(monkeypatch):
    monkeypatch.setenv("SYMHEAP_BOOTSTRAP_PORT", str(_free_port()))
    for _ in range(4):
        assert run_threads(_one_job, 2, init_kwargs={"heap_size": "1M"}) == [2, 2]


def test_unique_ids_of_one_batch_never_share_a_port():
    for _ in range(8):
        ids = [UniqueId.parse(symheap.get_unique_id()) for _ in range(200)]
        ports = [u.port for u in ids]
        assert len(set(ports)) == len(ports), sorted(p for p in ports if ports.count(p) > 1)
        for u in ids:  # release what get_unique_id reserved
            sock = take_reservation(u)
            if sock is not None:
                sock.close()
    # An id whose port another process holds still serves: the reservation
    # does not keep a root in another process from binding it.
    raw = symheap.get_unique_id()
    run = run_py(f"""
        import symheap
        symheap.init(0, 1, bytes.fromhex('{raw.hex()}'), heap_size="1M", timeout=20)
        symheap.barrier_all()
        symheap.finalize()
        print("ok")
        """, timeout=60)
    assert run.rc == 0 and run.out.strip() == "ok", run.describe()
    sock = take_reservation(UniqueId.parse(raw))
    assert sock is not None
    sock.close()
