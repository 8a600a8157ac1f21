"""Demo: a ring of PEs passing data with put + signal, as threads in one process."""
import numpy as np

import symheap
from symheap.testing import run_threads


def ring():
    me, n = symheap.my_pe(), symheap.n_pes()
    box = symheap.empty((4,), "float32", like="numpy")
    sig = symheap.empty((1,), "uint64", like="numpy")
    sig[:] = 0
    symheap.barrier_all()
    symheap.put_signal(box, np.full(4, me, np.float32), sig, 1, (me + 1) % n)
    symheap.signal_wait_until(sig, "eq", 1)
    return f"PE {me}/{n} on device {symheap.current_device()} got {box.tolist()} from PE {(me - 1) % n}"


if __name__ == "__main__":
    print(f"backend: {symheap.backend()}")
    for line in run_threads(ring, 4):
        print(line)
