"""Run under mpirun (2 processes): each process is one "node" (SYMHEAP_NODE_ID
from its MPI rank) hosting 2 PE threads, so every PE has 2 remote peers that
only the MPI remote engine reaches. ``python remote_mpi_program.py <scenario>``
prints one "OK <scenario> pe <rank>" line per PE; test_remote_peers.py drives it.
"""
import os
import re
import signal
import struct
import sys
import threading
import time

import mpi4py
import numpy as np

import symheap

THREADS = int(os.environ.get("SYMHEAP_TEST_PES_PER_NODE", "2"))
# Byte counts: one element up to a few MiB, most not a multiple of 8.
SIZES = [1, 3, 8, 13, 4096 + 5, (1 << 20) + 3, (3 << 20) + 7]
REGION = sum(SIZES)
ATOMIC_ROUNDS = 40


def node_of(pe):
    return pe // THREADS


def remote_peers(me, n):
    return [p for p in range(n) if node_of(p) != node_of(me)]


def payload(seed, src, dst, i):
    """The fresh random bytes PE ``src`` sends PE ``dst`` for size index ``i``."""
    return np.random.default_rng([seed, src, dst, i]).integers(0, 256, SIZES[i], dtype=np.uint8)


def region(i):
    start = sum(SIZES[:i])
    return slice(start, start + SIZES[i])


POISON = 0xEE


def rma(seed, timeout):
    """put / get / put_signal + signal_wait_until / signal_op / the three
    atomics / quiet / barrier across nodes, checked against numpy."""
    me, n = symheap.my_pe(), symheap.n_pes()
    remote = remote_peers(me, n)
    kinds = [symheap.peer_kind(p) for p in range(n)]
    assert kinds == ["self" if p == me else "remote" if p in remote else "same_process"
                     for p in range(n)], kinds
    rows = symheap.empty((n, REGION), "uint8", like="numpy")  # row q: what PE q put here
    sig_rows = symheap.empty((n, REGION), "uint8", like="numpy")
    sig = symheap.empty((1,), "uint64", like="numpy")
    flags = symheap.empty((n,), "uint64", like="numpy")
    words = symheap.empty((3,), "int64", like="numpy")  # fetch_add, compare_swap, swap
    rows[:] = POISON
    sig_rows[:] = POISON
    sig[:] = 0
    flags[:] = 0
    words[:] = 0
    symheap.barrier_all(timeout=timeout)

    # put_signal first: the receiver checks the bytes right after its signal
    # (no barrier), so they must land before the signal does.
    for p in remote:
        data = payload(seed + 1, me, p, len(SIZES) - 1)
        symheap.put_signal(sig_rows[me, region(len(SIZES) - 1)], data, sig, 1, p, op="add")
    symheap.signal_wait_until(sig, "eq", len(remote), timeout=timeout)
    for q in remote:
        np.testing.assert_array_equal(sig_rows[q, region(len(SIZES) - 1)],
                                      payload(seed + 1, q, me, len(SIZES) - 1))

    # puts of every size, then a quiet and the barrier across nodes
    for p in remote:
        for i in range(len(SIZES)):
            symheap.put(rows[me, region(i)], payload(seed, me, p, i), p)
    symheap.quiet()
    symheap.barrier_all(timeout=timeout)
    for q in range(n):
        expected = np.full(REGION, POISON, np.uint8)
        if q in remote:
            expected = np.concatenate([payload(seed, q, me, i) for i in range(len(SIZES))])
        np.testing.assert_array_equal(rows[q], expected)

    # gets of every size: the remote copy of my row holds what I put there
    for p in remote:
        for i in range(len(SIZES)):
            out = np.full(SIZES[i], POISON ^ 0xFF, np.uint8)
            symheap.get(out, rows[me, region(i)], p)
            np.testing.assert_array_equal(out, payload(seed, me, p, i))

    # signal_op: set my flag on every remote PE, then add to it
    for p in remote:
        symheap.signal_op(flags[me:me + 1], 1000 + me, p, op="set")
        symheap.signal_op(flags[me:me + 1], 7, p, op="add")

    # atomics, concurrently from both remote PEs (and both threads of each process)
    olds = {"fetch_add": [], "swap": []}
    for p in remote:
        for k in range(ATOMIC_ROUNDS):
            olds["fetch_add"].append(symheap.atomic_fetch_add(words[0:1], me + 1, p))
            symheap.atomic_swap(words[2:3], (me + 1) * 1000 + k, p)
            guess = 0
            while True:  # one increment through compare_swap
                old = symheap.atomic_compare_swap(words[1:2], guess, guess + 1, p)
                if old == guess:
                    break
                guess = old
    symheap.barrier_all(timeout=timeout)
    for q in remote:
        assert int(flags[q]) == 1000 + q + 7, (q, flags)
    for q in range(n):
        if q not in remote and q != me:
            assert int(flags[q]) == 0
    assert int(words[0]) == sum(ATOMIC_ROUNDS * (q + 1) for q in remote), words
    assert int(words[1]) == ATOMIC_ROUNDS * len(remote), words
    last = int(words[2])
    assert last in [(q + 1) * 1000 + ATOMIC_ROUNDS - 1 for q in remote], last
    symheap.barrier_all(timeout=timeout)
    for buf in (rows, sig_rows, sig, flags, words):
        symheap.free(buf)


def bad_input(seed, timeout):
    """Bad arguments raise before anything is sent: the target stays untouched."""
    me, n = symheap.my_pe(), symheap.n_pes()
    remote = remote_peers(me, n)
    buf = symheap.empty((64,), "uint8", like="numpy")
    buf[:] = POISON
    symheap.barrier_all(timeout=timeout)
    p = remote[0]
    local = np.zeros(64, np.uint8)
    errors = []
    for call in (lambda: symheap.put(local, buf, p),             # destination not on the heap
                 lambda: symheap.get(buf, local, p),             # source not on the heap
                 lambda: symheap.put(buf, np.zeros(65, np.uint8), p),  # runs past the block
                 lambda: symheap.atomic_fetch_add(buf[4:12].view(np.int64), 1, p),  # misaligned
                 lambda: symheap.signal_op(buf[3:11].view(np.uint64), 1, p),
                 lambda: symheap.put(buf, local, n)):            # PE out of range
        try:
            call()
        except (ValueError, TypeError) as e:
            errors.append(str(e))
        else:
            raise AssertionError("a bad call to a remote PE did not raise")
    assert any("8-byte aligned" in e for e in errors), errors
    assert any("out of range" in e for e in errors), errors
    symheap.quiet()
    symheap.barrier_all(timeout=timeout)
    assert (buf == POISON).all()
    symheap.free(buf)


# The MPI engine's request as the core lays it out (remote::Request in
# src/transports/remote_engine.hpp) and its request tag (the top of the tag
# space, below the reply tags: src/transports/engines/mpi_engine.cpp), for a
# request that symheap itself never sends.
REQUEST = struct.Struct("<IIQiiiiQQQqq")
REPLY_TAGS = 1 << 20
OP_PUT = 1


def refused(seed, timeout):
    """A put the target cannot serve (its bytes outside the target's heap:
    sent raw, since symheap checks offsets before sending): the requester's
    next quiet raises symheap.RemoteError naming the target PE and the op
    without waiting out its timeout; the good put before it landed, and the
    pair goes on."""
    from mpi4py import MPI
    me, n = symheap.my_pe(), symheap.n_pes()
    rows = symheap.empty((n, 256), "uint8", like="numpy")  # row q: what PE q put here
    rows[:] = POISON

    def target(q):
        peers = remote_peers(q, n)
        return peers[q % len(peers)]

    def data(q):
        return np.random.default_rng([seed, q]).integers(0, 256, 256, dtype=np.uint8)

    symheap.barrier_all(timeout=timeout)
    p = target(me)
    symheap.put(rows[me], data(me), p)
    job = symheap._core.slot_identity(symheap.current_device())[3]
    bad = REQUEST.pack(OP_PUT, 0, job, me, p, -1, 0, 1 << 40, 8, 0, 0, 0) + bytes(8)
    COMM.Send([bad, MPI.BYTE], dest=p // THREADS, tag=COMM.Get_attr(MPI.TAG_UB) - REPLY_TAGS - 1)
    start = time.monotonic()
    try:
        symheap.quiet()
    except symheap.RemoteError as e:
        err = e
    else:
        raise AssertionError("quiet did not report the put its target could not serve")
    took = time.monotonic() - start
    assert isinstance(err, symheap.SymheapError)
    assert (err.pe, err.op) == (p, "put"), (err.pe, err.op, str(err))
    assert f"quiet on PE {me}: PE {p} (node 'node-{node_of(p)}') could not serve an earlier " \
        "request (put): the bytes fall outside the target PE's heap" in str(err), str(err)
    assert took < timeout / 2, took
    symheap.quiet()  # told once: the pair goes on
    symheap.put(rows[me], data(me), p)
    symheap.quiet()
    symheap.barrier_all(timeout=timeout)
    for q in range(n):
        expected = data(q) if node_of(q) != node_of(me) and target(q) == me else POISON
        np.testing.assert_array_equal(rows[q], np.broadcast_to(np.uint8(expected), (256,)))
    symheap.barrier_all(timeout=timeout)
    symheap.free(rows)


_frozen = threading.Event()


def freeze_process_one(me):
    """PE 0 stops process 1 (SIGSTOP) and waits until it is stopped; every
    PE of node 0 returns once it is."""
    if me == 0:
        os.kill(PIDS[1], signal.SIGSTOP)
        while open(f"/proc/{PIDS[1]}/stat").read().split(")")[1].split()[0] != "T":
            time.sleep(0.01)
        _frozen.set()
    assert _frozen.wait(30)


def frozen_peer(seed, timeout):
    """Process 0 stops process 1 (SIGSTOP): its PEs' remote get and quiet
    raise TimeoutError naming the frozen PE within the timeout, and so does a
    second quiet (the put is still not served); then it lets process 1 go on,
    a quiet confirms the late put, and the job finishes normally."""
    me, n = symheap.my_pe(), symheap.n_pes()
    buf = symheap.empty((16,), "uint8", like="numpy")
    buf[:] = me
    symheap.barrier_all(timeout=timeout)
    pids = PIDS
    if node_of(me) == 0:
        freeze_process_one(me)
        target = 2 + me  # PE 0 -> PE 2, PE 1 -> PE 3
        out = np.zeros(16, np.uint8)
        t0 = time.monotonic()
        try:
            symheap.get(out, buf, target)
        except TimeoutError as e:
            text = str(e)
        else:
            raise AssertionError("a get from a frozen PE returned")
        took = time.monotonic() - t0
        assert f"PE {target} (node 'node-1')" in text and "did not answer" in text, text
        assert timeout * 0.9 <= took <= timeout + 3, took
        symheap.put(buf, np.full(16, 200, np.uint8), target)
        t0 = time.monotonic()
        try:
            symheap.quiet()
        except TimeoutError as e:
            text = str(e)
        else:
            raise AssertionError("quiet towards a frozen PE returned")
        assert "quiet" in text and f"PE {target} (node 'node-1')" in text, text
        assert time.monotonic() - t0 <= timeout + 3
        # The put is still unconfirmed: a second quiet must not report it done
        # while its target is frozen (the failed one left that process to it).
        try:
            symheap.quiet()
        except TimeoutError as e:
            assert f"PE {target} (node 'node-1')" in str(e), str(e)
        else:
            raise AssertionError("a second quiet towards a frozen PE returned")
        sys.stdout.write(f"FROZEN-ERROR pe {me}: {text}\n")  # one line, whole
        sys.stdout.flush()
        barrier = _thread_barrier
        if barrier.wait(30) == 0:
            os.kill(pids[1], signal.SIGCONT)
    symheap.barrier_all(timeout=60)  # process 1 waits here while frozen
    symheap.quiet()
    symheap.barrier_all(timeout=60)
    if node_of(me) == 1:  # the late put landed once the process went on
        assert (buf == 200).all(), buf
    symheap.free(buf)


def _ep_programs():
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "ep"))
    import test_ep_programs as progs
    return progs


def _forwarding(on):
    """Ops created from here on forward rows inside nodes (the default) or
    send each row straight to its PE. Every PE thread of the process calls
    it at the same point: the environment is the process's."""
    _thread_barrier.wait(30)
    os.environ["SYMHEAP_EP_HIERARCHICAL"] = "1" if on else "0"
    _thread_barrier.wait(30)


def ep_across_nodes(seed, timeout):
    """symheap.ep across the two nodes: every routing pattern of the EP tests
    (tests/ep/test_ep_programs.py: dispatch, combine and redispatch checked
    row by row against references) in each layout and dtype, with rows
    forwarded inside nodes and sent per PE: dispatch and redispatch give the
    same bits either way; combine's sums, added in another order when
    forwarded, are each checked against the fp32 reference."""
    progs = _ep_programs()
    n = symheap.n_pes()
    base = dict(hidden=32, max_tokens_per_rank=6, num_experts=4 * n, topk=3, dtype="bfloat16")
    configs = [dict(base), dict(base, dtype="float16", scale_dim=16, scale_dtype="bfloat16"),
               dict(base, dtype="float32"), dict(base, dtype="float8_e4m3fn", scale_dim=8),
               dict(base, layout="token_slots"), dict(base, layout="expert_major"),
               dict(base, layout="expert_major", dtype="float8_e4m3fn", scale_dim=8),
               dict(base, max_recv_tokens=n * 6)]
    digests = []
    for on in (True, False):
        _forwarding(on)
        digests.append(progs.redispatch_configs(configs, combine_digest=False))
    _forwarding(True)
    assert digests[0] == digests[1], "forwarded and per-PE results differ"
    symheap.barrier_all(timeout=timeout)


def ep_device_across_nodes(seed, timeout):
    """The device kernels (their host emulation, one PE per process) across
    nodes: kernel='copy_engine' in both layouts, fp8 with scales, a receive
    bound, and enough tokens for the blocks' look-back (unless
    SYMHEAP_TEST_EP_QUICK); rows for other nodes' PEs go through the remote
    transport. Every routing pattern of the EP tests, each output checked
    against the references (poisoned first), and the same bits as the cpu
    implementation. The kernels that
    store into every PE themselves refuse another node with a clear error."""
    import torch
    from symheap.ep import EpConfig, EpDispatchCombine
    progs = _ep_programs()
    n = symheap.n_pes()
    base = dict(hidden=32, max_tokens_per_rank=6, num_experts=4 * n, topk=3, dtype="bfloat16",
                kernel="copy_engine")
    configs = [dict(base, max_recv_tokens=n * 6),
               dict(base, dtype="float8_e4m3fn", scale_dim=8, layout="expert_major")]
    # too many ids for one pass: blocks rank from the blocks before them (the
    # emulation is slow: three patterns, and not on the three-process job)
    large = [dict(base, max_tokens_per_rank=200)]
    if os.environ.get("SYMHEAP_TEST_EP_QUICK") == "1":
        large = []

    def run_all():
        return (progs.many_configs(configs, combine_digest=False) +
                progs.many_configs(large, progs.DEFAULT_PLAN[:3], combine_digest=False))

    os.environ["SYMHEAP_EP_EMULATE_DEVICE"] = "1"
    try:
        by_kernels = run_all()
        for bad in (dict(base, kernel="intranode"), dict(base, kernel="low_latency",
                                                         layout="token_slots")):
            try:
                EpDispatchCombine(EpConfig(**bad)).close()
            except symheap.SymheapError as e:
                assert "across nodes the EP kernels run as kernel='copy_engine'" in str(e), e
            else:
                raise AssertionError(f"{bad} across nodes did not raise")
    finally:
        os.environ["SYMHEAP_EP_EMULATE_DEVICE"] = "0"
    by_cpu = run_all()
    assert by_kernels == by_cpu, "the kernels and the cpu implementation received different rows"
    symheap.barrier_all(timeout=timeout)


def _dispatch_outputs(out):
    """Every output of a dispatch and its handle, copied."""
    fields = [getattr(out, f) for f in ("x", "scales", "topk_idx", "topk_weights", "src_info",
                                        "num_recv_tokens", "expert_counts")]
    fields += [getattr(out.handle, f) for f in ("send_rows", "summary")]
    return [f.clone() for f in fields if f is not None]


def _counted_round_trip(ep, cfg, args, sent, sent_back, outputs, timeout):
    """One dispatch of `args` (x, topk_idx, topk_weights, scales) and the
    combine of its rows through identity experts, checked against the fp32
    reference; appends the bytes each sent across nodes to `sent` and
    `sent_back`, and dispatch's outputs (copied) to `outputs`. Returns the
    dispatch's output."""
    import torch
    from symheap import _core
    progs = _ep_programs()
    symheap.barrier_all(timeout=timeout)
    before = _core.bytes_across_nodes()
    out = ep.dispatch(*args)
    sent.append(_core.bytes_across_nodes() - before)
    outputs.append(_dispatch_outputs(out))
    y = progs.identity_experts(cfg, out, torch.device("cpu"))
    symheap.barrier_all(timeout=timeout)
    before = _core.bytes_across_nodes()
    res = ep.combine(y, out.handle)
    sent_back.append(_core.bytes_across_nodes() - before)
    progs.check_combine(cfg, res, *args, symheap.my_pe())
    symheap.barrier_all(timeout=timeout)
    return out


def ep_device_forwarding(seed, timeout):
    """The device kernels (host emulation, one PE per process) on 2 nodes x 2
    PEs with kernel='copy_engine', forwarding inside nodes (a token bound for
    several PEs of the other node crosses once, to the forwarder there, which
    stores it into its node's receive buffers) and per PE: every routing
    pattern of the EP tests checked against the references (poisoned first),
    dispatch's rows the same bits both ways; with every token bound for every
    PE, every dispatch output and the handle the same bits both ways, and
    fewer bytes across nodes when forwarded, for dispatch and for combine
    (whose sums, added in another order when forwarded, are checked against
    the fp32 reference each way)."""
    import torch
    from symheap.ep import EpConfig, EpDispatchCombine
    progs = _ep_programs()
    me, n = symheap.my_pe(), symheap.n_pes()
    base = dict(hidden=32, max_tokens_per_rank=6, num_experts=4 * n, topk=3, dtype="bfloat16",
                kernel="copy_engine")
    configs = [dict(base, dtype="float16", scale_dim=16, scale_dtype="bfloat16",
                    max_recv_tokens=n * 6),
               dict(base, dtype="float8_e4m3fn", scale_dim=8, layout="expert_major")]
    L, T = 2, 8
    cfg = EpConfig(hidden=256, max_tokens_per_rank=T, num_experts=L * n, topk=n,
                   dtype="bfloat16", scale_dim=128, scale_dtype="float32", kernel="copy_engine")
    gen = torch.Generator().manual_seed(seed + me)
    x = torch.randn(T, cfg.hidden, generator=gen).to(torch.bfloat16)
    scales = torch.rand(T, 2, generator=gen)
    idx = torch.tensor([[p * L + (t + p) % L for p in range(n)] for t in range(T)])
    w = torch.rand(T, n, generator=gen)
    os.environ["SYMHEAP_EP_EMULATE_DEVICE"] = "1"
    digests, sent, sent_back, outputs = [], [], [], []
    try:
        for on in (True, False):
            _forwarding(on)
            digests.append(progs.many_configs(configs, combine_digest=False))
            with EpDispatchCombine(cfg) as ep:
                _counted_round_trip(ep, cfg, (x, idx, w, scales), sent, sent_back, outputs,
                                    timeout)
    finally:
        os.environ["SYMHEAP_EP_EMULATE_DEVICE"] = "0"
        _forwarding(True)
    assert digests[0] == digests[1], "forwarded and per-PE dispatches received different rows"
    for got, want in zip(*outputs):
        progs.assert_same_bits(got, want, f"PE {me} forwarded vs per-PE dispatch")
    remote_pes = n // 2
    # per PE: every token's row crosses once per remote PE; forwarded: once
    assert sent[1] > remote_pes * T * cfg.hidden * 2, sent
    assert sent[0] < sent[1] * (1.0 / remote_pes + 0.15), sent
    # combine: each token's rows on the other node come back once, summed there
    assert sent_back[1] > remote_pes * T * cfg.hidden * 2, sent_back
    assert sent_back[0] < sent_back[1] * (1.0 / remote_pes + 0.15), sent_back
    sys.stdout.write(f"DEVICE-BYTES pe {me}: forwarded {sent[0]} per-PE {sent[1]}; "
                     f"combine forwarded {sent_back[0]} per-PE {sent_back[1]}\n")
    sys.stdout.flush()
    symheap.barrier_all(timeout=timeout)


def ep_device_forwarding_late_pe(seed, timeout):
    """The forwarders' waits on the device path (host emulation, 2 nodes x 2
    PEs, one PE per process): PE 3 skips a combine. Within the timeout PE 2,
    which sums the rows of PE 0's tokens on node 1, raises TimeoutError naming
    PE 3 (whose rows it waited for), PE 1, which sums for PE 3, names PE 3
    (whose plan it waited for), and PE 0 times out too; then every PE closes
    the op and the job finishes."""
    import torch
    from symheap.ep import EpConfig, EpDispatchCombine
    progs = _ep_programs()
    me, n = symheap.my_pe(), symheap.n_pes()
    cfg = EpConfig(hidden=32, max_tokens_per_rank=4, num_experts=2 * n, topk=n,
                   kernel="copy_engine")
    os.environ["SYMHEAP_EP_EMULATE_DEVICE"] = "1"  # (read when the op is made)
    try:
        ep = EpDispatchCombine(cfg)
    finally:
        os.environ["SYMHEAP_EP_EMULATE_DEVICE"] = "0"
    x = torch.randn(4, 32).to(torch.bfloat16)
    idx = torch.tensor([[2 * p for p in range(n)]] * 4)  # every token to every PE
    out = ep.dispatch(x, idx, torch.ones(4, n))
    y = progs.identity_experts(cfg, out, torch.device("cpu"))
    symheap.barrier_all(timeout=timeout)
    if me == 3:
        time.sleep(timeout + 3)  # no combine here
    else:
        t0 = time.monotonic()
        try:
            ep.combine(y, out.handle)
        except TimeoutError as e:
            text = str(e)
        else:
            raise AssertionError("a combine without PE 3 returned")
        assert time.monotonic() - t0 <= timeout + 3, time.monotonic() - t0
        why = {1: "its combine plan", 2: "its rows to sum for a PE of another node"}
        if me in why:
            assert f"waiting for PE 3 ({why[me]}" in text, text
        else:
            assert re.search(r"waiting for PE [23]\b", text), text
        sys.stdout.write(f"EP-LATE-ERROR pe {me}: {text}\n")  # one write: a line of its own
        sys.stdout.flush()
    ep.close()
    symheap.barrier_all(timeout=60)


def ep_bytes(seed, timeout):
    """Every token goes to every PE: forwarded, a token crosses to the other
    node once instead of once per PE there, and its sum comes back once.
    Dispatch's and redispatch's outputs are the same bit for bit, and
    dispatch, combine and redispatch each send fewer bytes through the remote
    transport (this PE's own)."""
    import torch
    from symheap import _core
    from symheap.ep import EpConfig, EpDispatchCombine
    progs = _ep_programs()
    me, n = symheap.my_pe(), symheap.n_pes()
    L, T = 2, 8
    cfg = EpConfig(hidden=256, max_tokens_per_rank=T, num_experts=L * n, topk=n,
                   dtype="bfloat16", scale_dim=128, scale_dtype="float32")
    gen = torch.Generator().manual_seed(seed + me)
    x = torch.randn(T, cfg.hidden, generator=gen).to(torch.bfloat16)
    scales = torch.rand(T, 2, generator=gen)
    idx = torch.tensor([[p * L + (t + p) % L for p in range(n)] for t in range(T)])
    w = torch.rand(T, n, generator=gen)
    grads = [progs.redispatch_rows(cfg, n, r, seed % 100003, T) for r in range(n)]
    sent, sent_back, sent_again, outputs = [], [], [], []
    for on in (True, False):
        _forwarding(on)
        with EpDispatchCombine(cfg) as ep:
            out = _counted_round_trip(ep, cfg, (x, idx, w, scales), sent, sent_back, outputs,
                                      timeout)
            before = _core.bytes_across_nodes()
            back = ep.redispatch(grads[me], out.handle)
            sent_again.append(_core.bytes_across_nodes() - before)
            progs.check_redispatch(cfg, back, out, grads, me)
            outputs[-1].append(back)
            symheap.barrier_all(timeout=timeout)
    _forwarding(True)
    for got, want in zip(*outputs):
        progs.assert_same_bits(got, want, f"PE {me} forwarded vs per-PE dispatch")
    remote_pes = n - THREADS
    # per PE: every token's row crosses once per remote PE; forwarded: once
    assert sent[1] > remote_pes * T * cfg.hidden * 2, sent
    assert sent[0] < sent[1] * (1.0 / remote_pes + 0.1), sent
    # combine: each token's rows from the other node (bf16) come back once
    assert sent_back[1] > remote_pes * T * cfg.hidden * 2, sent_back
    assert sent_back[0] < sent_back[1] * (1.0 / remote_pes + 0.1), sent_back
    # redispatch: each token's row crosses once (per PE: a get per remote PE)
    assert sent_again[1] > remote_pes * T * cfg.hidden * 2, sent_again
    assert sent_again[0] < sent_again[1] * (1.0 / remote_pes + 0.1), sent_again
    sys.stdout.write(f"BYTES pe {me}: forwarded {sent[0]} per-PE {sent[1]}; "
                     f"combine forwarded {sent_back[0]} per-PE {sent_back[1]}; "
                     f"redispatch forwarded {sent_again[0]} per-PE {sent_again[1]}\n")
    sys.stdout.flush()


def ep_frozen_node(seed, timeout):
    """Process 0 stops process 1 (SIGSTOP), whose PEs forward rows for node
    0: node 0's dispatch raises TimeoutError naming them within the timeout;
    once process 1 goes on, every PE closes the op and the job finishes."""
    import torch
    from symheap.ep import EpConfig, EpDispatchCombine
    me, n = symheap.my_pe(), symheap.n_pes()
    cfg = EpConfig(hidden=32, max_tokens_per_rank=4, num_experts=2 * n, topk=2)
    ep = EpDispatchCombine(cfg)
    symheap.barrier_all(timeout=timeout)
    if node_of(me) == 0:
        freeze_process_one(me)
        x = torch.randn(4, 32).to(torch.bfloat16)
        node1_pe = [THREADS + t % THREADS for t in range(4)]
        idx = torch.tensor([[2 * p, 2 * p + 1] for p in node1_pe])  # experts on node 1
        t0 = time.monotonic()
        try:
            ep.dispatch(x, idx, torch.ones(4, 2))
        except TimeoutError as e:
            text = str(e)
        else:
            raise AssertionError("a dispatch with a frozen node returned")
        assert time.monotonic() - t0 <= timeout + 3
        forwarder = THREADS + me  # node 1's PE with this PE's local index
        assert re.search(rf"from PE\(s\) [\d, ]*\b{forwarder}\b", text), text
        sys.stdout.write(f"EP-FROZEN-ERROR pe {me}: {text}\n")  # one write: a line of its own
        sys.stdout.flush()
        if _thread_barrier.wait(30) == 0:
            os.kill(PIDS[1], signal.SIGCONT)
    symheap.barrier_all(timeout=60)
    ep.close()
    symheap.barrier_all(timeout=60)


def funneled(seed, timeout):
    """MPI initialised below MPI_THREAD_MULTIPLE: remote peers raise the error
    that says so, before anything is sent."""
    me, n = symheap.my_pe(), symheap.n_pes()
    buf = symheap.empty((16,), "uint8", like="numpy")
    for p in remote_peers(me, n):
        try:
            symheap.put(buf, np.zeros(16, np.uint8), p)
        except symheap.UnsupportedError as e:
            text = str(e)
        else:
            raise AssertionError("a put to a remote PE without MPI_THREAD_MULTIPLE returned")
        assert "MPI_THREAD_MULTIPLE" in text and f"PE {p} is remote" in text, text
    symheap.barrier_all(timeout=timeout)
    symheap.free(buf)


def killed_peer(seed, timeout):
    """Process 1 is killed (SIGKILL) after a barrier: the survivors' remote
    get raises an error naming a PE of the dead process within the timeout
    (the bootstrap's dead-PE notice cuts the wait short)."""
    me, n = symheap.my_pe(), symheap.n_pes()
    buf = symheap.empty((16,), "uint8", like="numpy")
    buf[:] = me
    symheap.barrier_all(timeout=timeout)
    if node_of(me) == 1:
        _thread_barrier.wait(30)
        os.kill(os.getpid(), signal.SIGKILL)
    target = 2 + me
    while True:  # until the process is gone (it may serve a get or two before)
        out = np.zeros(16, np.uint8)
        t0 = time.monotonic()
        try:
            symheap.get(out, buf, target)
        except (TimeoutError, symheap.SymheapError) as e:
            text = f"{type(e).__name__}: {e}"
            break
        assert (out == target).all()
        time.sleep(0.01)
    took = time.monotonic() - t0
    assert "PE 2" in text or "PE 3" in text, text
    assert took <= timeout + 3, took
    sys.stdout.write(f"KILLED-ERROR pe {me} after {took:.2f} s: {text}\n")  # one line, whole
    sys.stdout.flush()


_thread_barrier = threading.Barrier(THREADS)
PIDS = []
SCENARIOS = {"rma": rma, "bad_input": bad_input, "frozen": frozen_peer, "killed": killed_peer,
             "funneled": funneled, "ep": ep_across_nodes, "ep_bytes": ep_bytes,
             "ep_frozen": ep_frozen_node, "refused": refused,
             "ep_device": ep_device_across_nodes, "ep_device_fwd": ep_device_forwarding,
             "ep_device_fwd_late": ep_device_forwarding_late_pe}
COMM = None


def main(scenario, timeout):
    global COMM
    if scenario == "funneled":
        mpi4py.rc.thread_level = "funneled"
    from mpi4py import MPI  # MPI_THREAD_MULTIPLE, mpi4py's default, unless told otherwise
    COMM = MPI.COMM_WORLD
    rank, nprocs = COMM.Get_rank(), COMM.Get_size()
    # SYMHEAP_TEST_NODES="0,0,1": the node of each process (default: its own)
    nodes = os.environ.get("SYMHEAP_TEST_NODES")
    os.environ["SYMHEAP_NODE_ID"] = f"node-{nodes.split(',')[rank] if nodes else rank}"
    PIDS[:] = COMM.allgather(os.getpid())
    seed = COMM.bcast(int(np.random.SeedSequence().entropy % (1 << 62)) if rank == 0 else None)
    # one unique id per init cycle (a job's id is not reused)
    uids = [COMM.bcast(symheap.get_unique_id() if rank == 0 else None) for _ in range(2)]
    failures = []

    def pe(t):
        r = rank * THREADS + t
        try:
            symheap.init(r, nprocs * THREADS, uids[0], device=t, heap_size="48M",
                         timeout=timeout)
            try:
                for cycle in range(2 if scenario == "rma" else 1):  # init again works
                    SCENARIOS[scenario](seed + cycle, timeout)
                    if cycle == 0 and scenario == "rma":
                        symheap.finalize()
                        symheap.init(r, nprocs * THREADS, uids[1], device=t, heap_size="48M",
                                     timeout=timeout)
            finally:
                symheap.set_device(t)
                if symheap.is_initialized():
                    symheap.finalize()
            print(f"OK {scenario} pe {r}", flush=True)
        except BaseException as e:  # reported with the PE, at once (mpirun may end the job)
            import traceback
            failures.append(f"PE {r}: {type(e).__name__}: {e}")
            print(f"FAILED PE {r}: {type(e).__name__}: {e}\n{traceback.format_exc()}",
                  flush=True)

    threads = [threading.Thread(target=pe, args=(t,), daemon=True) for t in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(240)
    if failures or any(t.is_alive() for t in threads):
        print("FAILED\n" + "\n".join(failures), flush=True)
        os._exit(1)
    if scenario == "killed":  # MPI_Finalize cannot complete once a process died
        sys.stdout.flush()
        os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else 20.0)
