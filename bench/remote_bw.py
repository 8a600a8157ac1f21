"""Remote put bandwidth through the NCCL engine against NCCL send/recv of the
same bytes, 1 MiB to 1 GiB, on 2 GPUs of one host made two nodes with every
byte forced onto NCCL's socket transport over loopback (the setup of
docs/transports.md, tests/gpu/remote_nccl_program.py).

    python bench/remote_bw.py [--max-mib 1024] [--iters 20] [--rounds 5]
                              [--min-round-mib 256] [--no-pin]

The two are timed in alternating rounds (symheap, NCCL, symheap, ...) of
--iters transfers each, more at small sizes so that a round moves at least
--min-round-mib (a round of 20 MiB lasts ~6 ms on loopback, where one stall of
the socket threads moves it by 10-20%; 0 keeps --iters at every size). Prints one row per size (best and median round of
each) and a summary line: the ratio of the best rounds symheap / NCCL at
each size (the target is >= 0.9), and the ratio of the medians. Each
process (its NCCL threads included) runs on its own half of the physical cores
unless --no-pin: on loopback the network is the CPUs, and two nodes' socket
threads sharing cores made single rounds swing by 2x.
"""
import argparse
import os
import socket
import statistics
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
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--min-round-mib", type=int, default=256,
                    help="transfers per round raised so a round moves at least this many MiB "
                         "(0: --iters at every size)")
    ap.add_argument("--no-pin", action="store_true",
                    help="let both processes run on every CPU (default: each on its own half of the "
                         "physical cores)")
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
    if args.min_round_mib < 0:
        ap.error("--min-round-mib must be >= 0")
    task = ("bandwidth", (sizes, args.iters, free_port(), args.rounds, args.min_round_mib << 20),
            True)
    results = prog.run_two_nodes([task], timeout=120.0, heap_size=heap, wait_s=540.0,
                                 pin=not args.no_pin)
    rows = results[0][0]
    cpus = "every CPU" if args.no_pin else "each process on its own half of the cores"
    print(f"{args.rounds} alternating rounds per size, at least {args.min_round_mib} MiB a round, "
          f"{cpus}; GB/s of the best round (median round)")
    print(f"{'bytes':>12} {'iters':>6} {'symheap put GB/s':>20} {'NCCL send/recv GB/s':>20} "
          f"{'ratio':>6} {'(medians)':>9}")
    best, medians = [], []
    for nb, n_it, sym, nccl in rows:
        best.append(max(sym) / max(nccl))
        medians.append(statistics.median(sym) / statistics.median(nccl))
        print(f"{nb:>12} {n_it:>6} {max(sym):>10.2f} ({statistics.median(sym):>6.2f}) "
              f"{max(nccl):>10.2f} ({statistics.median(nccl):>6.2f}) {best[-1]:>6.2f} "
              f"({medians[-1]:>6.2f})")
    print("summary: remote put / NCCL send-recv (forced socket network, loopback), "
          "best rounds: " +
          ", ".join(f"{nb >> 20} MiB {r:.2f}x" for (nb, *_), r in zip(rows, best)) +
          "; medians: " + ", ".join(f"{r:.2f}x" for r in medians))


if __name__ == "__main__":
    main()
