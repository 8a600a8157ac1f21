"""A library call never kills the process: finalize racing a put, a heap that
does not fit in /dev/shm."""
import os

from faultproc import finish, run_py, start

import symheap

_PE = """
import sys, threading, time
import numpy as np
import symheap
rank, uid = int(sys.argv[1]), bytes.fromhex(sys.argv[2])
symheap.init(rank, 2, uid, device=0, heap_size="48M", timeout=20)
dst = symheap.empty((4 << 20,), "float32", like="numpy")  # 16 MiB
src = np.random.rand(4 << 20).astype(np.float32)
done, errors, stop = [0], [], threading.Event()

def pound():
    symheap.set_device(0)
    while not stop.is_set():
        try:
            symheap.put(dst, src, 1 - rank)
            done[0] += 1
        except (symheap.SymheapError, ValueError) as e:
            errors.append(type(e).__name__)
            if len(errors) > 3:
                return

t = threading.Thread(target=pound)
t.start()
time.sleep(0.2)
symheap.finalize()          # the other thread is (most likely) inside a put
stop.set()
t.join(20)
assert not t.is_alive()
print("OK", done[0], len(errors), flush=True)
"""


def test_finalize_while_another_thread_puts():
    # Each PE process keeps putting 16 MiB to the other while its main thread
    # finalizes: peer mappings must not go away under a running copy.
    for _ in range(3):
        uid = symheap.get_unique_id().hex()
        procs = [start(_PE, args=(r, uid)) for r in range(2)]
        runs = [finish(p, 60) for p in procs]
        for run in runs:
            assert run.rc == 0 and run.out.startswith("OK"), run.describe()
            assert int(run.out.split()[1]) > 0  # the puts did run before finalize


def test_heap_larger_than_shm_free_space():
    st = os.statvfs("/dev/shm")
    free = st.f_bavail * st.f_frsize
    run = run_py(f"""
        import symheap
        try:
            symheap.init(0, 1, symheap.get_unique_id(), heap_size={free + (1 << 30)})
        except MemoryError as e:
            print("MemoryError:", e)
        else:
            print("init succeeded")
        """, timeout=60)
    assert run.rc == 0, run.describe()
    msg = run.out
    assert msg.startswith("MemoryError:"), run.describe()
    assert "/dev/shm has" in msg and "free of" in msg  # the free space
    assert "SYMHEAP_HEAP_SIZE" in msg and "--shm-size" in msg  # the remedies
    assert symheap._core.format_size(free + (1 << 30)) in msg  # the size asked for
