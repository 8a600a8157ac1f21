"""Two processes x two threads each (4 PEs): a ring with put + signal.

    python examples/processes.py
"""
import numpy as np

import symheap
from symheap.testing import run_processes


def ring():
    me, n = symheap.my_pe(), symheap.n_pes()
    box = symheap.empty((4,), "float32", like="numpy")
    sig = symheap.empty((1,), "uint64", like="numpy")
    sig[:] = 0
    symheap.barrier_all()
    symheap.put_signal(box, np.full(4, me, np.float32), sig, 1, (me + 1) % n)
    symheap.signal_wait_until(sig, "eq", 1)
    kinds = [symheap.peer_kind(p) for p in range(n)]
    return f"PE {me}: got {box.tolist()}; peers {kinds}"


if __name__ == "__main__":
    for line in run_processes(ring, 2, threads_per_proc=2):
        print(line)
