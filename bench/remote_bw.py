"""Remote put bandwidth through the NCCL engine against NCCL send/recv of the
same bytes, 1 MiB to 1 GiB, on 2 GPUs of one host made two nodes with every
byte forced onto NCCL's socket transport over loopback (the setup of
docs/transports.md, tests/gpu/remote_nccl_program.py).

    python bench/remote_bw.py [--max-mib 1024] [--iters 20]

Prints one row per size and a summary line: the ratio symheap / NCCL at each
size (the target is >= 0.9).
"""
import argparse
import os
import socket
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "gpu"))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-mib", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    import torch
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        print("summary: remote_bw needs 2 CUDA GPUs; skipped")
        return
    import remote_nccl_program as prog
    sizes, nb = [], 1 << 20
    while nb <= args.max_mib << 20:
        sizes.append(nb)
        nb *= 4
    heap = f"{max(sizes) // (1 << 20) + 64}M"
    results = prog.run_two_nodes([("bandwidth", (sizes, args.iters, free_port()), True)],
                                 timeout=120.0, heap_size=heap, wait_s=540.0)
    rows = results[0][0]
    print(f"{'bytes':>12} {'iters':>6} {'symheap put GB/s':>17} {'NCCL send/recv GB/s':>20} "
          f"{'ratio':>6}")
    ratios = []
    for nb, n_it, sym, nccl in rows:
        ratios.append(sym / nccl)
        print(f"{nb:>12} {n_it:>6} {sym:>17.2f} {nccl:>20.2f} {sym / nccl:>6.2f}")
    print("summary: remote put / NCCL send-recv (forced socket network, loopback): " +
          ", ".join(f"{nb >> 20} MiB {r:.2f}x" for (nb, *_), r in zip(rows, ratios)))


if __name__ == "__main__":
    main()
