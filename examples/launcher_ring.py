"""One PE per process under torchrun or mpirun.

    torchrun --nproc-per-node 2 examples/launcher_ring.py torch
    mpirun -np 2 python examples/launcher_ring.py mpi
"""
import sys

import numpy as np

import symheap

if sys.argv[1:] == ["mpi"]:
    symheap.init_mpi()
else:
    import torch.distributed as dist
    dist.init_process_group("gloo")
    symheap.init_torch()

me, n = symheap.my_pe(), symheap.n_pes()
box = symheap.empty((4,), "int64", like="numpy")
sig = symheap.empty((1,), "uint64", like="numpy")
sig[:] = 0
symheap.barrier_all()
symheap.put_signal(box, np.full(4, me), sig, 1, (me + 1) % n)
symheap.signal_wait_until(sig, "eq", 1)
print(f"PE {me}/{n} on device {symheap.current_device()} got {box.tolist()}", flush=True)
symheap.finalize()
