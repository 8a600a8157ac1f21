"""The block of moe_block.py written in JAX over the PEs of symheap.jax, for
``python examples/moe_block.py --launch jax --jax-mode threads|shard_map``.

The model is the torch one: x + attention(norm(x)) (causal, grouped-query,
symheap.jax.flash_attn_func), then h + MoE(norm(h)): a softmax router picks the top-k
experts of every token, symheap.jax.EpDispatchCombine moves the tokens to the PEs hosting
those experts (expert-major rows), each PE runs its experts as batched matmuls (SwiGLU)
and combine brings the weighted outputs back. Attention and router weights are replicated
(their gradients summed over PEs), experts are split over PEs; gradients come from
jax.value_and_grad through the custom_vjps of attention, dispatch and combine; each step
ends with an SGD (momentum) update.

Two program shapes:
- ``threads``: one Python thread per device; each jits its own gradient step and update
  on its device. The replicated gradients are summed on the host (numpy, in PE order)
  between the two: independently jitted programs share no collective.
- ``shard_map``: one jit over the mesh of symheap.jax.make_mesh(); inside shard_map every
  device computes its gradients, psums the replicated ones and updates its parameters.

The run checks itself against the same steps on one device (the whole batch, every
expert, the MoE as a gather / scatter in plain jax.numpy). Under jit the phases of the
forward and backward run in one XLA program and are not timed apart.
"""
from __future__ import annotations

import functools
import threading
import time

import numpy as np
import torch

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

import symheap.jax as shj

import moe_block as mb
from moe_block import JAX_MODES, LR, MOMENTUM, TOLERANCE, ep_config, heap_size, progress

CPU = torch.device("cpu")

REPLICATED = ("ln1", "ln2", "wq", "wk", "wv", "wo", "wr")
EXPERT = ("w1", "w3", "w2")
NOT_SPLIT = ("attention, dispatch, experts, combine and backward run in one XLA program "
             "under jit and are not timed apart")


# ----------------------------------------------------------------- parameters and data
# Parameters: moe_block.py's initialisers (torch generators on the cpu), as numpy, the
# same numbers as its torch launches. Batches: drawn on the device that uses them
# (jax.random, seeded per step and PE), so that no step waits for host work.

def replicated_params(c) -> dict:
    return {k: v.numpy() for k, v in mb.replicated_params(c, CPU).items()}


def expert_params(c, first, count) -> dict:
    return {k: v.numpy() for k, v in mb.expert_params(c, first, count, CPU).items()}


def batch(c, step, pe, device):
    """PE ``pe``'s inputs and regression targets at ``step``, on ``device``."""
    shape = (c["batch"], c["seq"], c["hidden"])
    key = jax.random.fold_in(jax.random.key(c["seed"] + 10_000), step * c["n_pes"] + pe)
    with jax.default_device(device):
        return _normal_pair(key, shape)


@functools.partial(jax.jit, static_argnums=1)
def _normal_pair(key, shape):
    kx, kt = jax.random.split(key)
    return jax.random.normal(kx, shape), jax.random.normal(kt, shape)


def batches(c, step, device):
    """Every PE's batch at ``step`` on one device, concatenated along the batch axis."""
    data = [batch(c, step, pe, device) for pe in range(c["n_pes"])]
    return tuple(jnp.concatenate([d[j] for d in data]) for j in (0, 1))


# ----------------------------------------------------------------- the block

def rms_norm(x, g):
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * g


def mm(a, w, cd):
    return (a.astype(cd) @ w.astype(cd)).astype(jnp.float32)


def attention_forward(p, x, c, cd):
    B, S, h = x.shape
    H, KV, hd = c["heads"], c["kv_heads"], h // c["heads"]
    a = rms_norm(x, p["ln1"])
    q = mm(a, p["wq"], cd).reshape(B, S, H, hd).astype(cd)
    k = mm(a, p["wk"], cd).reshape(B, S, KV, hd).astype(cd)
    v = mm(a, p["wv"], cd).reshape(B, S, KV, hd).astype(cd)
    o = shj.flash_attn_func(q, k, v, causal=True)
    return x + mm(o.reshape(B, S, h), p["wo"], cd)


def route(p, h1, c):
    hn = rms_norm(h1, p["ln2"]).reshape(-1, c["hidden"])
    probs = jax.nn.softmax(hn @ p["wr"], axis=-1)
    w, idx = jax.lax.top_k(probs, c["topk"])
    return hn, idx.astype(jnp.int32), w / jnp.sum(w, -1, keepdims=True)


def experts_forward(rows, e, cd):
    """SwiGLU over expert-major rows [L, rows, hidden] as batched matmuls."""
    a = rows @ e["w1"].astype(cd)
    b = rows @ e["w3"].astype(cd)
    return (jax.nn.silu(a) * b) @ e["w2"].astype(cd)


def pe_loss(rep, exp, x, target, op, c):
    """One PE's share of the loss (the loss is the mean over every PE's tokens)."""
    cd = jnp.dtype(c["dtype"])
    h1 = attention_forward(rep, x, c, cd)
    hn, idx, w = route(rep, h1, c)
    d = op.dispatch(hn.astype(cd), idx, w)
    # rows past an expert's count are not tokens: zero them so they add nothing anywhere
    valid = jnp.arange(d.x.shape[1])[None, :] < d.expert_counts[:, None]
    y = experts_forward(jnp.where(valid[..., None], d.x, 0), exp, cd)
    out = h1 + op.combine(y, d.handle).astype(jnp.float32).reshape(h1.shape)
    return jnp.sum((out - target) ** 2) / (c["n_pes"] * out.size), out


def reference_loss(rep, exp, x, target, c):
    """The block on one device: x and target hold every PE's batch; each expert takes
    its tokens by a gather (padded to the dispatch capacity) and adds its weighted
    outputs back by a scatter."""
    cd = jnp.dtype(c["dtype"])
    h1 = attention_forward(rep, x, c, cd)
    hn, idx, w = route(rep, h1, c)
    T, K, cap = hn.shape[0], c["topk"], c["capacity"]
    flat = idx.reshape(-1)
    pos = jax.vmap(lambda e: jnp.nonzero(flat == e, size=cap, fill_value=T * K)[0])(
        jnp.arange(c["experts"]))                                    # [E, cap] (token, slot)
    tok = pos // K                                                   # T: padding
    wt = jnp.concatenate([w.reshape(-1), jnp.zeros(1, w.dtype)])[pos]
    rows = jnp.concatenate([hn, jnp.zeros((1, hn.shape[1]), hn.dtype)]).astype(cd)[tok]
    y = experts_forward(rows, exp, cd).astype(jnp.float32) * wt[..., None]
    moe = jnp.zeros((T + 1, hn.shape[1]), jnp.float32).at[tok].add(y)[:T]
    out = h1 + moe.astype(cd).astype(jnp.float32).reshape(h1.shape)
    return jnp.sum((out - target) ** 2) / out.size, out


def sgd(params, grads, momentum):
    """torch.optim.SGD(lr=LR, momentum=MOMENTUM) from zero momentum buffers."""
    buf = jax.tree_util.tree_map(lambda m, g: MOMENTUM * m + g, momentum, grads)
    return jax.tree_util.tree_map(lambda p, b: p - LR * b, params, buf), buf


def zeros_like(tree):
    return jax.tree_util.tree_map(jnp.zeros_like, tree)


# ----------------------------------------------------------------- launch

def jax_devices(c) -> list:
    """The first n_pes JAX devices of the backend's platform."""
    platform = "cpu" if c["backend"] == "cpu" else "gpu"
    try:
        devices = jax.devices(platform)
    except RuntimeError as e:
        raise SystemExit(f"--launch jax --backend {c['backend']}: JAX has no {platform} "
                         f"devices ({e})") from None
    if len(devices) < c["n_pes"]:
        hint = ("jax was imported before --xla_force_host_platform_device_count could be set"
                if platform == "cpu" else "use fewer --pes")
        raise SystemExit(f"--launch jax: --pes {c['n_pes']} needs {c['n_pes']} JAX {platform} "
                         f"devices, found {len(devices)} ({hint})")
    return devices[:c["n_pes"]]


def run(c, mode) -> dict:
    """Trains the block for c['steps'] steps with symheap.jax in ``mode``, checks it
    against the one-device reference; returns the summary moe_block.py prints."""
    if mode not in JAX_MODES:
        raise SystemExit(f"--jax-mode: unknown {mode}; choose among {', '.join(JAX_MODES)}")
    devices = jax_devices(c)
    shj.init(devices, heap_size=heap_size(c))
    try:
        with shj.EpDispatchCombine(ep_config(c)) as op:
            train = train_threads if mode == "threads" else train_shard_map
            got, split, step_s = train(c, op, devices)
    finally:
        shj.finalize()
    errors = check_against_reference(c, devices[0], *got)
    tokens = c["n_pes"] * c["batch"] * c["seq"]
    return {"errors": errors, "tolerance": TOLERANCE[c["dtype"]], "split_s": split,
            "step_s": step_s, "tokens_per_s": tokens / step_s, "note": NOT_SPLIT}


def _timed(step, c) -> bool:
    """Step 0 compiles: it is left out of the times unless it is the only one."""
    return step > 0 or c["steps"] == 1


def train_threads(c, op, devices):
    """One thread per device, each jitting its own gradient step and update."""
    n, L = c["n_pes"], c["experts"] // c["n_pes"]
    rep0 = replicated_params(c)
    slots = [None] * n                      # each PE's replicated gradients (its device)
    meet = threading.Barrier(n, timeout=600)
    phases = ("forward + backward (jit)", "gradient sum (device to device)", "optimizer (jit)")
    times = [dict.fromkeys(phases, 0.0) for _ in range(n)]
    walls = [0.0] * n

    def pe(i):
        dev = devices[i]
        put = lambda a: jax.device_put(a, dev)  # noqa: E731
        params = put((rep0, expert_params(c, i * L, L)))
        momentum = zeros_like(params)
        grad_step = jax.jit(jax.value_and_grad(
            lambda rep, exp, x, t: pe_loss(rep, exp, x, t, op, c), argnums=(0, 1), has_aux=True))
        update = jax.jit(sgd)
        for step in range(c["steps"]):
            meet.wait()
            t0 = time.perf_counter()
            x, target = batch(c, step, i, dev)
            (_, out), (g_rep, g_exp) = grad_step(*params, x, target)
            jax.block_until_ready((g_rep, g_exp))
            t1 = time.perf_counter()
            slots[i] = g_rep
            meet.wait()                     # every PE's gradients are ready
            # Each PE copies the others' gradients to its device (peer to peer) and adds
            # them in PE order, so every PE gets the same sums.
            total = jax.block_until_ready(_sum_trees([put(slots[s]) for s in range(n)]))
            meet.wait()                     # every PE read them: the slots may be refilled
            grads = (total, g_exp)
            t2 = time.perf_counter()
            params, momentum = jax.block_until_ready(update(params, grads, momentum))
            t3 = time.perf_counter()
            if _timed(step, c):
                for k, dt in zip(phases, (t1 - t0, t2 - t1, t3 - t2)):
                    times[i][k] += dt
                walls[i] += t3 - t0
            if i == 0:
                progress(step + 1, c["steps"], n * c["batch"] * c["seq"] / (t3 - t0))
        host = lambda tree: jax.tree_util.tree_map(np.asarray, tree)  # noqa: E731
        return np.asarray(out), host(grads), host(params)

    results = on_threads(pe, n, meet)
    timed = max(1, c["steps"] - 1)
    split = {k: float(np.mean([t[k] for t in times])) / timed for k in phases}
    outs = [r[0] for r in results]
    grads = [r[1] for r in results]
    params = [r[2] for r in results]
    return (outs, grads, params), split, max(walls) / timed


@jax.jit
def _sum_trees(trees):
    """The element-wise sum of same-shaped pytrees, added in list order."""
    return jax.tree_util.tree_map(lambda *leaves: functools.reduce(jnp.add, leaves), *trees)


def on_threads(fn, n, meet):
    """fn(i) on one thread per PE; a failure breaks the barrier so no PE waits for it."""
    results, errors = [None] * n, [None] * n

    def body(i):
        try:
            results[i] = fn(i)
        except BaseException as e:  # re-raised below, on the caller's thread
            errors[i] = e
            meet.abort()

    threads = [threading.Thread(target=body, args=(i,), name=f"moe-jax-pe{i}") for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(3600)
    if any(t.is_alive() for t in threads):
        raise TimeoutError("--launch jax: a PE thread did not finish within an hour")
    failed = [e for e in errors if e is not None]
    # a PE's own failure first: the others then only saw the barrier broken
    failed.sort(key=lambda e: isinstance(e, threading.BrokenBarrierError))
    if failed:
        raise failed[0]
    return results


def train_shard_map(c, op, devices):
    """One jit over the PE mesh: shard_map runs every PE's gradient step, the psum of
    the replicated gradients and the update in one program."""
    n, B = c["n_pes"], c["batch"]
    mesh = shj.make_mesh("pe")
    specs = ({k: P() for k in REPLICATED}, {k: P("pe") for k in EXPERT})

    def body(params, momentum, x, target):
        (_, out), (g_rep, g_exp) = jax.value_and_grad(
            lambda rep, exp: pe_loss(rep, exp, x, target, op, c), argnums=(0, 1),
            has_aux=True)(*params)
        grads = (jax.lax.psum(g_rep, "pe"), g_exp)
        params, momentum = sgd(params, grads, momentum)
        return params, momentum, out, grads

    # replication is by construction (psum), so the vma checks are off
    check = {"check_vma": False} if hasattr(jax, "shard_map") else {"check_rep": False}
    step_fn = jax.jit(shj.shard_map(body, mesh=mesh, in_specs=(specs, specs, P("pe"), P("pe")),
                                    out_specs=(specs, specs, P("pe"), specs), **check))
    sharding = jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), specs)
    params = jax.device_put((replicated_params(c), expert_params(c, 0, c["experts"])), sharding)
    momentum = jax.device_put(zeros_like(params), sharding)
    rows = NamedSharding(mesh, P("pe"))
    wall = 0.0
    for step in range(c["steps"]):
        t0 = time.perf_counter()
        data = [batch(c, step, pe, devices[pe]) for pe in range(n)]
        shape = (n * B,) + data[0][0].shape[1:]
        x, target = (jax.make_array_from_single_device_arrays(shape, rows, [d[j] for d in data])
                     for j in (0, 1))
        params, momentum, out, grads = jax.block_until_ready(
            step_fn(params, momentum, x, target))
        dt = time.perf_counter() - t0
        if _timed(step, c):
            wall += dt
        progress(step + 1, c["steps"], n * B * c["seq"] / dt)
    step_s = wall / max(1, c["steps"] - 1)
    # per-PE views: PE i holds batch rows i*B.., experts i*L.., and the replicated tensors
    out = np.asarray(out)
    L = c["experts"] // n
    host = jax.tree_util.tree_map(np.asarray, (grads, params))

    def mine(tree, i):
        rep, exp = tree
        return rep, {k: v[i * L:(i + 1) * L] for k, v in exp.items()}

    got = ([out[i * B:(i + 1) * B] for i in range(n)], [mine(host[0], i) for i in range(n)],
           [mine(host[1], i) for i in range(n)])
    return got, {"forward + backward + psum + optimizer (one jit)": step_s}, step_s


# ----------------------------------------------------------------- the check

def reference_run(c, device):
    """The same steps on one device; returns the last step's outputs (one per PE), the
    gradients and the final parameters (numpy)."""
    n, B = c["n_pes"], c["batch"]
    params = jax.device_put((replicated_params(c), expert_params(c, 0, c["experts"])), device)
    momentum = zeros_like(params)

    @jax.jit
    def step_fn(params, momentum, x, target):
        (_, out), grads = jax.value_and_grad(
            lambda rep, exp: reference_loss(rep, exp, x, target, c), argnums=(0, 1),
            has_aux=True)(*params)
        params, momentum = sgd(params, grads, momentum)
        return params, momentum, out, grads

    for step in range(c["steps"]):
        x, target = batches(c, step, device)
        params, momentum, out, grads = step_fn(params, momentum, x, target)
    out = np.asarray(out)
    host = jax.tree_util.tree_map(np.asarray, (grads, params))
    return [out[i * B:(i + 1) * B] for i in range(n)], host[0], host[1]


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def check_against_reference(c, device, outs, grads, params) -> dict:
    """Worst relative error over PEs and tensors of each PE's outputs, gradients and
    parameters against the reference's (experts: the PE's slice)."""
    ref_out, ref_grads, ref_params = reference_run(c, device)
    L = c["experts"] // c["n_pes"]

    def worst(got, ref, i):
        rep, exp = got
        return max([rel_err(rep[k], ref[0][k]) for k in REPLICATED] +
                   [rel_err(exp[k], ref[1][k][i * L:(i + 1) * L]) for k in EXPERT])

    n = c["n_pes"]
    return {"outputs": max(rel_err(outs[i], ref_out[i]) for i in range(n)),
            "gradients": max(worst(grads[i], ref_grads, i) for i in range(n)),
            "parameters": max(worst(params[i], ref_params, i) for i in range(n))}
