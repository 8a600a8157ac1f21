"""A mixture-of-experts transformer block, trained over N PEs with symheap.

    python examples/moe_block.py                              # 4 PEs as threads, cpu backend
    python examples/moe_block.py --launch threads,processes,mixed,torchrun,mpirun --plot split.png
    python examples/moe_block.py --backend cuda --size large --launch threads
    python examples/moe_block.py --backend cuda --size large --launch processes --baseline
    python examples/moe_block.py --launch jax --jax-mode threads,shard_map   # moe_block_jax.py

The block: x + attention(norm(x)) (causal, grouped-query, symheap.attention), then
h + MoE(norm(h)): a softmax router picks the top-k experts of every token,
symheap.ep.dispatch moves the tokens to the PEs hosting those experts (expert-major rows),
each PE runs its experts as grouped matmuls (SwiGLU), symheap.ep.combine brings the
weighted outputs back. Attention and router weights are replicated (their gradients
are summed over PEs through the symmetric heap); experts are split over PEs. Every
piece is differentiable; each step runs forward, backward and an SGD step.

The run checks itself: every PE also computes the same steps on one device with the
whole batch and all experts (plain torch for the MoE), and the last step's outputs and
gradients and the final parameters must match within the stated tolerance.
``--baseline`` runs the same block with plain torch.distributed (all_to_all_single for
the token exchange, torch SDPA for attention) under torchrun, for comparison.
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager

import torch
import torch.nn.functional as F

PRESETS = {  # tokens per PE = batch * seq
    "tiny": dict(hidden=64, heads=4, kv_heads=2, ffn=64, experts=8, topk=2, batch=2, seq=32),
    "small": dict(hidden=512, heads=8, kv_heads=2, ffn=512, experts=16, topk=2, batch=4,
                  seq=256),
    "large": dict(hidden=4096, heads=32, kv_heads=8, ffn=1024, experts=64, topk=4, batch=2,
                  seq=2048),
}
PHASES = ("attention", "dispatch", "experts", "combine", "backward", "other")
# Relative error (||a - b|| / ||b||) allowed against the one-device reference.
TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2}
LR, MOMENTUM = 0.05, 0.9
LAUNCHES = ("threads", "processes", "mixed", "torchrun", "mpirun", "jax")
JAX_MODES = ("threads", "shard_map")


# ----------------------------------------------------------------- the model

def model_config(args) -> dict:
    c = dict(PRESETS[args.size])
    c.update(n_pes=args.pes, steps=args.steps, backend=args.backend, seed=args.seed,
             dtype="bfloat16" if args.backend == "cuda" else "float32")
    if c["experts"] % c["n_pes"]:
        raise SystemExit(f"--pes {c['n_pes']} must divide the {c['experts']} experts of "
                         f"--size {args.size}")
    # Rows per expert: the mean times a margin (a token above it makes dispatch raise).
    rows = c["n_pes"] * c["batch"] * c["seq"] * c["topk"] / c["experts"]
    c["capacity"] = min(c["n_pes"] * c["batch"] * c["seq"],
                        64 * math.ceil(args.capacity_factor * rows / 64))
    return c


def _randn(shape, seed, dev, scale):
    g = torch.Generator(device=dev).manual_seed(seed)
    return torch.randn(shape, generator=g, device=dev) * scale


def replicated_params(c, dev) -> dict:
    """Attention, norms and router: the same on every PE (same seeds)."""
    h, hd = c["hidden"], c["hidden"] // c["heads"]
    kv, s = c["kv_heads"] * hd, c["seed"]
    return {"ln1": torch.ones(h, device=dev), "ln2": torch.ones(h, device=dev),
            "wq": _randn((h, h), s + 1, dev, h ** -0.5),
            "wk": _randn((h, kv), s + 2, dev, h ** -0.5),
            "wv": _randn((h, kv), s + 3, dev, h ** -0.5),
            "wo": _randn((h, h), s + 4, dev, h ** -0.5),
            "wr": _randn((h, c["experts"]), s + 5, dev, h ** -0.5)}


def expert_params(c, first, count, dev) -> dict:
    """Experts first .. first + count - 1 (each from its own seed, so any PE can build
    any slice): SwiGLU matrices w1, w3 [E, hidden, ffn] and w2 [E, ffn, hidden]."""
    h, f, s = c["hidden"], c["ffn"], c["seed"] + 1000
    out = {}
    for name, shape, scale, k in (("w1", (h, f), h ** -0.5, 0), ("w3", (h, f), h ** -0.5, 1),
                                  ("w2", (f, h), f ** -0.5, 2)):
        out[name] = torch.stack([_randn(shape, s + 3 * e + k, dev, scale)
                                 for e in range(first, first + count)])
    return out


def batch(c, step, pe, dev):
    """PE ``pe``'s inputs and regression targets at ``step``."""
    shape = (c["batch"], c["seq"], c["hidden"])
    s = c["seed"] + 10_000 + 2 * (step * c["n_pes"] + pe)
    return _randn(shape, s, dev, 1.0), _randn(shape, s + 1, dev, 1.0)


def rms_norm(x, g):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * g


def mm(a, w, cd):
    return (a.to(cd) @ w.to(cd)).float()


def experts_forward(rows, e, cd):
    """SwiGLU over expert-major rows [L, capacity, hidden] as grouped (batched) matmuls."""
    a = torch.bmm(rows, e["w1"].to(cd))
    b = torch.bmm(rows, e["w3"].to(cd))
    return torch.bmm(F.silu(a) * b, e["w2"].to(cd))


def attention_forward(p, x, c, cd, attn):
    B, S, h = x.shape
    H, KV, hd = c["heads"], c["kv_heads"], h // c["heads"]
    a = rms_norm(x, p["ln1"])
    q = mm(a, p["wq"], cd).view(B, S, H, hd).to(cd)
    k = mm(a, p["wk"], cd).view(B, S, KV, hd).to(cd)
    v = mm(a, p["wv"], cd).view(B, S, KV, hd).to(cd)
    return x + mm(attn(q, k, v).reshape(B, S, h), p["wo"], cd)


def route(p, h1, c):
    hn = rms_norm(h1, p["ln2"]).reshape(-1, c["hidden"])
    probs = (hn @ p["wr"]).softmax(-1)
    w, idx = probs.topk(c["topk"], dim=-1)
    return hn, idx, w / w.sum(-1, keepdim=True)


def symheap_attention(q, k, v):
    from symheap.attention import flash_attn_func
    return flash_attn_func(q, k, v, causal=True)


def sdpa_attention(q, k, v):
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                       is_causal=True, enable_gqa=True)
    return o.transpose(1, 2)


# ----------------------------------------------------------------- timing

class Timer:
    """Time per phase: CUDA events on the current stream (read after the step), or wall
    time on the cpu. ``flush(keep=False)`` drops a step (the warm-up)."""

    def __init__(self, dev):
        self.cuda = dev.type == "cuda"
        self.total = dict.fromkeys(PHASES, 0.0)
        self.pending = []

    @contextmanager
    def __call__(self, phase):
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self.pending.append((phase, start, end))
        else:
            t = time.perf_counter()
            yield
            self.pending.append((phase, time.perf_counter() - t, None))

    def flush(self, keep: bool):
        if self.cuda:
            torch.cuda.current_stream().synchronize()
        for phase, a, b in self.pending:
            if keep:
                self.total[phase] += a.elapsed_time(b) / 1e3 if self.cuda else a
        self.pending = []


# ----------------------------------------------------------------- one PE's run

class HeapGather:
    """All-gather of a float32 vector through the symmetric heap (put to every PE, then
    a barrier); summing the rows in PE order gives the same bits on every PE."""

    def __init__(self, numel, n):
        import symheap
        self.sh, self.n, self.me = symheap, n, symheap.my_pe()
        self.buf = symheap.empty((n, numel), "float32")

    def __call__(self, vec):
        self.sh.barrier_all()  # every PE is done reading the previous round
        for pe in range(self.n):
            self.sh.put(self.buf[self.me, :vec.numel()], vec.contiguous(), pe)
        self.sh.barrier_all()
        return self.buf[:, :vec.numel()]

    def sum(self, vec):
        rows = self(vec)
        acc = rows[0].clone()
        for r in range(1, self.n):
            acc += rows[r]
        return acc

    def close(self):
        self.sh.free(self.buf)


def pe_device():
    import symheap
    if symheap.backend() == "cuda":
        return torch.device("cuda", symheap.current_device())
    return torch.device("cpu")


def heap_size(c) -> str:
    h, kv = c["hidden"], c["kv_heads"] * c["hidden"] // c["heads"]
    n_rep = 2 * h + 2 * h * h + 2 * h * kv + h * c["experts"]  # replicated_params' sizes
    # EP op: the expert-major receive rows and two sets of combine rows (with a margin)
    rows = c["experts"] // c["n_pes"] * c["capacity"] + 2 * c["batch"] * c["seq"] * c["topk"]
    ep_bytes = rows * c["hidden"] * (2 if c["dtype"] == "bfloat16" else 4) * 3 // 2
    need = c["n_pes"] * n_rep * 4 + ep_bytes + (64 << 20)  # gather buffer, EP op, slack
    return f"{need >> 20}M"


def ep_config(c):
    """The EP op of the block: expert-major rows, ``capacity`` per expert."""
    from symheap.ep import EpConfig
    return EpConfig(hidden=c["hidden"], max_tokens_per_rank=c["batch"] * c["seq"],
                    num_experts=c["experts"], topk=c["topk"], dtype=c["dtype"],
                    layout="expert_major", expert_capacity=c["capacity"], kernel="intranode")


def pe_main(c: dict) -> dict:
    """Runs the training steps on this PE, checks them against the one-device
    reference; returns (on every PE) the run's summary."""
    import symheap
    import symheap.ep as ep
    me, n = symheap.my_pe(), symheap.n_pes()
    dev = pe_device()
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    cd = getattr(torch, c["dtype"])
    L = c["experts"] // n
    rep = {k: v.requires_grad_(True) for k, v in replicated_params(c, dev).items()}
    exp = {k: v.requires_grad_(True) for k, v in expert_params(c, me * L, L, dev).items()}
    params = [*rep.values(), *exp.values()]
    opt = torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)
    timer = Timer(dev)
    gather = HeapGather(sum(t.numel() for t in rep.values()), n)
    tokens = c["batch"] * c["seq"]
    wall = 0.0
    with ep.EpDispatchCombine(ep_config(c)) as op:
        for step in range(c["steps"]):
            symheap.barrier_all()
            t0 = time.perf_counter()
            x, target = batch(c, step, me, dev)
            with timer("attention"):
                h1 = attention_forward(rep, x, c, cd, symheap_attention)
            with timer("other"):
                hn, idx, w = route(rep, h1, c)
            with timer("dispatch"):
                d = ep.dispatch(op, hn.to(cd), idx, w)
            with timer("experts"):
                y = experts_forward(d.x, exp, cd)
            with timer("combine"):
                moe = ep.combine(op, y, d.handle)
            with timer("other"):
                out = h1 + moe.float().view_as(h1)
                loss = (out - target).pow(2).sum() / (n * out.numel())
            with timer("backward"):
                opt.zero_grad(set_to_none=True)
                loss.backward()
            with timer("other"):
                flat = torch.cat([t.grad.flatten() for t in rep.values()])
                flat = gather.sum(flat)
                offset = 0
                for t in rep.values():
                    t.grad.copy_(flat[offset:offset + t.numel()].view_as(t))
                    offset += t.numel()
                grads = [t.grad.clone() for t in params]
                opt.step()
            timer.flush(keep=step > 0 or c["steps"] == 1)
            if dev.type == "cuda":
                torch.cuda.current_stream().synchronize()
            dt = time.perf_counter() - t0
            if step > 0 or c["steps"] == 1:
                wall += dt
            if me == 0:
                progress(step + 1, c["steps"], n * tokens / dt)
        op.check()
    timed_steps = max(1, c["steps"] - 1)
    errors = check_against_reference(c, me, n, dev, out.detach(), grads, params)
    # Every PE's verdict and times, gathered so that any PE can report the whole run.
    mine = torch.tensor([errors[k] for k in ("outputs", "gradients", "parameters")] +
                        [timer.total[p] / timed_steps for p in PHASES] + [wall / timed_steps],
                        dtype=torch.float32, device=dev)
    everyone = gather(mine).cpu()
    gather.close()
    worst = everyone[:, :3].max(0).values.tolist()
    split = everyone[:, 3:3 + len(PHASES)].mean(0).tolist()
    step_time = everyone[:, -1].max().item()
    return {"errors": dict(zip(("outputs", "gradients", "parameters"), worst)),
            "tolerance": TOLERANCE[c["dtype"]], "split_s": dict(zip(PHASES, split)),
            "step_s": step_time, "tokens_per_s": n * tokens / step_time}


def progress(done, total, rate):
    bar = "#" * (20 * done // total)
    line = f"  [{bar:<20}] step {done}/{total}  {rate:,.0f} tokens/s"
    if sys.stdout.isatty():
        print("\r" + line, end="\n" if done == total else "", flush=True)
    else:
        print(line, flush=True)


# ----------------------------------------------------------------- the reference

def reference_run(c, dev):
    """The same steps on one device: the whole batch, every expert, plain torch for the
    MoE (a loop over experts). Returns the last step's outputs, the gradients and the
    final parameters."""
    n, cd = c["n_pes"], getattr(torch, c["dtype"])
    rep = {k: v.requires_grad_(True) for k, v in replicated_params(c, dev).items()}
    exp = {k: v.requires_grad_(True) for k, v in expert_params(c, 0, c["experts"], dev).items()}
    params = [*rep.values(), *exp.values()]
    opt = torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)
    for step in range(c["steps"]):
        outs, loss = [], 0.0
        routed = []
        for pe in range(n):  # attention and router per PE: the same shapes as the PEs use
            x, target = batch(c, step, pe, dev)
            h1 = attention_forward(rep, x, c, cd, symheap_attention)
            routed.append((h1, target) + route(rep, h1, c))
        hn = torch.cat([r[2] for r in routed]).to(cd)
        idx = torch.cat([r[3] for r in routed])
        w = torch.cat([r[4] for r in routed])
        moe = torch.zeros(hn.shape, dtype=torch.float32, device=dev)
        for e in range(c["experts"]):
            tok, slot = (idx == e).nonzero(as_tuple=True)
            one = {k: v[e:e + 1] for k, v in exp.items()}
            y = experts_forward(hn[tok][None], one, cd)[0].float()
            moe = moe.index_add(0, tok, y * w[tok, slot][:, None])
        rows = c["batch"] * c["seq"]
        for pe, (h1, target, *_rest) in enumerate(routed):
            out = h1 + moe[pe * rows:(pe + 1) * rows].to(cd).float().view_as(h1)
            outs.append(out)
            loss = loss + (out - target).pow(2).sum() / (n * out.numel())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grads = [t.grad.clone() for t in params]
        opt.step()
    return [o.detach() for o in outs], grads, params


def rel_err(a, b) -> float:
    a, b = a.detach().float(), b.detach().float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def check_against_reference(c, me, n, dev, out, grads, params) -> dict:
    ref_out, ref_grads, ref_params = reference_run(c, dev)
    L, n_rep = c["experts"] // n, 7

    def mine(ref_list):  # the reference's tensors this PE holds (its expert slice)
        return [*ref_list[:n_rep], *(t[me * L:(me + 1) * L] for t in ref_list[n_rep:])]

    return {"outputs": rel_err(out, ref_out[me]),
            "gradients": max(rel_err(a, b) for a, b in zip(grads, mine(ref_grads))),
            "parameters": max(rel_err(a, b) for a, b in zip(params, mine(ref_params)))}


# ----------------------------------------------------------------- launch models

def _share_cores(c):
    """The cpu backend's PEs share this machine's cores: torch threads per process
    accordingly (spinning waits on oversubscribed cores slow every PE down)."""
    if c["backend"] == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // c["n_pes"]))


def launch_threads(c):
    from symheap.testing import run_threads
    _share_cores(c)
    return run_threads(pe_main, c["n_pes"], (c,), init_kwargs={"heap_size": heap_size(c)},
                       join_timeout=3600)[0]


def _pe_main_in_process(c):
    _share_cores(c)
    return pe_main(c)


def launch_processes(c, threads_per_proc=1):
    from symheap.testing import run_processes
    if c["n_pes"] % threads_per_proc:
        raise SystemExit("--launch mixed runs 2 PE threads per process: --pes must be even")
    return run_processes(_pe_main_in_process, c["n_pes"] // threads_per_proc,
                         (c,), threads_per_proc=threads_per_proc,
                         init_kwargs={"heap_size": heap_size(c)}, spread_devices=True,
                         timeout=3600)[0]


def launch_mixed(c):
    return launch_processes(c, threads_per_proc=2)


def _relaunch(c, launcher_cmd, mode):
    """Starts this script under torchrun / mpirun and reads PE 0's report."""
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.json")
        cmd = [*launcher_cmd, os.path.abspath(__file__), "--worker", mode,
               "--config-json", json.dumps(c), "--report-json", report]
        proc = subprocess.run(cmd, timeout=3600)
        if proc.returncode != 0 or not os.path.exists(report):
            raise SystemExit(f"{mode} run failed (exit code {proc.returncode}): {' '.join(cmd)}")
        with open(report) as f:
            return json.load(f)


def launch_torchrun(c):
    return _relaunch(c, [sys.executable, "-m", "torch.distributed.run", "--standalone",
                         "--nproc-per-node", str(c["n_pes"])], "torchrun")


def launch_mpirun(c):
    import shutil
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        raise SystemExit("--launch mpirun needs mpirun on PATH (scripts/setup.sh installs OpenMPI)")
    # Containers often run as root, which OpenMPI refuses unless told to allow it.
    root = ["--allow-run-as-root"] if hasattr(os, "geteuid") and os.geteuid() == 0 else []
    return _relaunch(c, [mpirun, *root, "-np", str(c["n_pes"]), "--oversubscribe",
                         sys.executable], "mpirun")


def launch_jax(c, mode):
    """The block in JAX over symheap.jax (moe_block_jax.py): one thread per device
    (mode "threads") or one jit with shard_map (mode "shard_map"), in a child process,
    so that JAX's and XLA's state (and any failure of theirs) stays out of this one."""
    if c["backend"] == "cuda" and torch.cuda.is_initialized():
        torch.cuda.empty_cache()  # leave the GPUs' memory to the child
    return _relaunch(c, [sys.executable], f"jax-{mode}")


def _run_jax(c, mode):
    """launch_jax's child: sets JAX up for the backend, then runs moe_block_jax."""
    if c["backend"] == "cpu":  # before jax is imported: n cpu devices
        import re
        os.environ["JAX_PLATFORMS"] = "cpu"
        flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "",
                       os.environ.get("XLA_FLAGS", ""))
        os.environ["XLA_FLAGS"] = (f"{flags} --xla_force_host_platform_device_count="
                                   f"{c['n_pes']}").strip()
    else:  # the symmetric heap needs GPU memory that XLA would otherwise preallocate
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    try:
        import moe_block_jax
    except ImportError as e:
        raise SystemExit(f"--launch jax is not available in this build: symheap.jax cannot be "
                         f"imported ({e}); see docs/jax.md") from None
    return moe_block_jax.run(c, mode)


def launch_baseline(c):
    return _relaunch(c, [sys.executable, "-m", "torch.distributed.run", "--standalone",
                         "--nproc-per-node", str(c["n_pes"])], "baseline")


LAUNCHERS = {"threads": launch_threads, "processes": launch_processes, "mixed": launch_mixed,
             "torchrun": launch_torchrun, "mpirun": launch_mpirun}


def worker(mode, c, report):
    """The body of one process under torchrun / mpirun, or of a JAX run's process."""
    if mode.startswith("jax-"):
        result = _run_jax(c, mode[len("jax-"):])
        with open(report, "w") as f:
            json.dump(result, f)
        return
    import symheap
    heap = heap_size(c)
    if mode == "mpirun":
        symheap.init_mpi(heap_size=heap)
        rank, close = symheap.my_pe(), None
    else:
        import torch.distributed as dist
        cuda = c["backend"] == "cuda"
        if cuda:
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl" if cuda else "gloo")
        rank, close = dist.get_rank(), dist.destroy_process_group
        if mode == "torchrun":
            symheap.init_torch(heap_size=heap)
    _share_cores(c)
    try:
        if mode == "baseline":
            from moe_block_baseline import baseline_main
            result = baseline_main(c)
        else:
            result = pe_main(c)
    except BaseException:
        if mode != "baseline":
            symheap.finalize()
        if close:
            close()
        raise
    if mode != "baseline":
        symheap.finalize()
    if rank == 0:
        with open(report, "w") as f:
            json.dump(result, f)
    if close is None:
        return
    # Every rank is done and the report is written. The interpreter's teardown is
    # skipped: gloo's worker threads can abort it (SIGABRT, "terminate called without
    # an active exception"), which would fail a run that finished.
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ----------------------------------------------------------------- reporting

def print_config(c, launches):
    print(f"MoE block: hidden {c['hidden']}, {c['heads']} heads ({c['kv_heads']} kv), "
          f"{c['experts']} experts (top-{c['topk']}, ffn {c['ffn']}, capacity {c['capacity']} "
          f"rows each), {c['batch']}x{c['seq']} tokens per PE, {c['dtype']}")
    print(f"{c['n_pes']} PEs on the {c['backend']} backend, {c['steps']} steps; "
          f"launch: {', '.join(launches)}")


def print_result(name, r) -> bool:
    ok = all(v <= r["tolerance"] for v in r["errors"].values())
    split = r["split_s"]
    total = sum(split.values()) or 1.0
    parts = "  ".join(f"{p} {1e3 * t:.1f} ms ({100 * t / total:.0f}%)" for p, t in split.items())
    e = r["errors"]
    print(f"{name}: {r['tokens_per_s']:,.0f} tokens/s, {1e3 * r['step_s']:.1f} ms per step")
    print(f"  time split per step: {parts}")
    if r.get("note"):
        print(f"  ({r['note']})")
    verdict = "match" if ok else "DO NOT match"
    print(f"  check: outputs, gradients and parameters {verdict} the one-device reference "
          f"(relative errors {e['outputs']:.1e}, {e['gradients']:.1e}, {e['parameters']:.1e}; "
          f"tolerance {r['tolerance']:.0e})")
    return ok


def plot(results, path, title):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"--plot {path}: matplotlib is not installed (pip install matplotlib); "
              "no plot written")
        return
    names = list(results)
    fig, ax = plt.subplots(figsize=(1.6 * len(names) + 3, 4))
    bottom = [0.0] * len(names)
    phases = list(PHASES)  # then the phases of launches that split their steps otherwise
    phases += [p for k in names for p in results[k]["split_s"] if p not in phases]
    for phase in phases:
        vals = [1e3 * results[k]["split_s"].get(phase, 0.0) for k in names]
        ax.bar(names, vals, bottom=bottom, label=phase)
        bottom = [b + v for b, v in zip(bottom, vals)]
    for i, k in enumerate(names):
        ax.text(i, bottom[i], f"{results[k]['tokens_per_s']:,.0f} tok/s", ha="center",
                va="bottom", fontsize=8)
    ax.set_ylabel("ms per step (mean over PEs)")
    ax.set_title(title)
    ax.legend(loc="upper left", bbox_to_anchor=(1, 1))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}")


def parse_args(argv=None):
    has_gpu = torch.cuda.is_available() and torch.cuda.device_count() > 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--launch", default="threads",
                   help=f"comma-separated launch models among {', '.join(LAUNCHES)}")
    p.add_argument("--backend", choices=("cpu", "cuda"), default="cuda" if has_gpu else "cpu")
    p.add_argument("--jax-mode", default="shard_map",
                   help="for --launch jax, comma-separated among threads (one thread per "
                        "device, each jitting its step) and shard_map (one jit over the mesh)")
    p.add_argument("--size", choices=tuple(PRESETS), default="tiny")
    p.add_argument("--pes", type=int, default=None,
                   help="number of PEs (default: 4 on cpu, every GPU on cuda)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--capacity-factor", type=float, default=None,
                   help="receive rows per expert as a multiple of the mean (default 3, large "
                        "1.5); dispatch raises if routing sends an expert more")
    p.add_argument("--plot", metavar="FILE", help="write a PNG of the time split per launch")
    p.add_argument("--baseline", action="store_true",
                   help="also run the block with plain torch.distributed (torchrun)")
    p.add_argument("--worker", choices=("torchrun", "mpirun", "baseline",
                                        *(f"jax-{m}" for m in JAX_MODES)), help=argparse.SUPPRESS)
    p.add_argument("--config-json", help=argparse.SUPPRESS)
    p.add_argument("--report-json", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.pes is None:
        args.pes = torch.cuda.device_count() if args.backend == "cuda" else 4
    if args.capacity_factor is None:
        args.capacity_factor = 1.5 if args.size == "large" else 3.0
    if args.pes < 1 or args.steps < 1:
        p.error("--pes and --steps must be at least 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        os.environ["SYMHEAP_BACKEND"] = json.loads(args.config_json)["backend"]
        worker(args.worker, json.loads(args.config_json), args.report_json)
        return 0
    os.environ["SYMHEAP_BACKEND"] = args.backend  # before symheap is imported
    if args.backend == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--backend cuda: torch sees no CUDA device")
    launches = [s.strip() for s in args.launch.split(",") if s.strip()]
    bad = [s for s in launches if s not in LAUNCHES]
    if bad:
        raise SystemExit(f"--launch: unknown {', '.join(bad)}; choose among {', '.join(LAUNCHES)}")
    jax_modes = [s.strip() for s in args.jax_mode.split(",") if s.strip()]
    bad = [s for s in jax_modes if s not in JAX_MODES]
    if bad or not jax_modes:
        raise SystemExit(f"--jax-mode: unknown {', '.join(bad) or '(none)'}; choose among "
                         f"{', '.join(JAX_MODES)}")
    c = model_config(args)
    runs = []
    for name in launches:
        if name == "jax":
            runs += [(f"jax/{m}", functools.partial(launch_jax, mode=m)) for m in jax_modes]
        else:
            runs.append((name, LAUNCHERS[name]))
    print_config(c, [r[0] for r in runs] +
                 (["baseline (torch.distributed)"] if args.baseline else []))
    results, ok = {}, True
    if args.baseline:
        runs.append(("baseline", launch_baseline))
    for name, launch in runs:
        print(f"{name}:" if name != "baseline" else
              "baseline (torch.distributed: all_to_all_single + SDPA, under torchrun):", flush=True)
        try:
            results[name] = launch(c)
        except (Exception, SystemExit) as e:  # report it, and go on with the other launches
            print(f"{name}: FAILED: {e}", flush=True)
            ok = False
            continue
        ok &= print_result(name, results[name])
    if args.plot and results:
        plot(results, args.plot, f"MoE block, --size {args.size}, {c['n_pes']} PEs on "
             f"{args.backend}: time split per launch model")
    print("all checks passed" if ok else "FAILED: a run failed or did not match its reference (see above)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
