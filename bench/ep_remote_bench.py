"""Expert-parallel dispatch + combine across two nodes against NCCL on the
same network path: 2 GPUs of one host made two nodes, every byte between
them forced onto NCCL's socket transport over loopback (the setup of
docs/transports.md, tests/gpu/remote_nccl_program.py). symheap runs
kernel='copy_engine' (rows for the other node go through the NCCL engine);
the reference is bench/ep_bench.py's (all_to_all_single of the same rows for
dispatch and back for combine, with the permutation, the count exchange and
the scatter-add), and the bare all_to_all_single pair alone.

    python bench/ep_remote_bench.py [--tokens 4096] [--iters 10]

DeepSeek-V3 shape: hidden 7168 bf16, top-8 of 256 experts. Prints ep_bench's
summary line (its "end-to-end speedup" is NCCL time / symheap time) and the
ratio against the bare all_to_all_single pair; the target is >= 1.0x.
"""
import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "gpu"))
sys.path.insert(0, HERE)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
    import torch
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        print("summary: ep_remote_bench needs 2 CUDA GPUs; skipped")
        return
    import ep_bench
    import remote_nccl_program as prog
    port = ep_bench.free_port()
    results = prog.run_two_nodes([("ep_remote_bench", (port, args.iters, args.tokens),
                                   True)], timeout=120.0, heap_size="3G", wait_s=200.0)
    per = [results[r][0] for r in range(2)]
    line = ep_bench.report(per).replace("summary ep ", "summary ep across 2 nodes ")
    print(line.replace("nvlink", "network"))
    ep_us = max(p["dispatch_us"] + p["combine_us"] for p in per)
    a2a_us = max(p["a2a_only_us"] for p in per)
    cross = min(p["cross_rows"] for p in per)
    print(f"summary ep across 2 nodes vs bare all_to_all_single pair: symheap dispatch+combine "
          f"{ep_us:.0f} us, NCCL all_to_all_single there and back {a2a_us:.0f} us "
          f"({cross} rows of {ep_bench.HIDDEN * 2} B each way across the network): "
          f"{a2a_us / ep_us:.2f}x (target >= 1.0x)")


if __name__ == "__main__":
    main()
