"""Two "nodes" on one host, one GPU each, every byte between them through the
NCCL engine over NCCL's socket transport on loopback (the forced-network
setup of docs/transports.md). Used by test_remote_gpu.py and
bench/remote_bw.py; each scenario runs as one PE in its own process.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import time
import traceback

import numpy as np

NODES = ["node-a", "node-b"]


def forced_network_env(rank: int) -> dict:
    """What makes process `rank` its own node for symheap and for NCCL."""
    return {"SYMHEAP_NODE_ID": NODES[rank], "NCCL_HOSTID": NODES[rank],
            "NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_NET": "Socket",
            "NCCL_SOCKET_IFNAME": "lo", "SYMHEAP_REMOTE_HOST": "127.0.0.1",
            "NCCL_NVLS_ENABLE": "0"}


def _bytes(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


POISON = 0xAB
SIZES = [8, 24, 4096, 65536 + 8, 1 << 20, 3 * (1 << 20) + 16, 64 << 20]


def _check(got, want, what):
    got = np.asarray(got)
    if not np.array_equal(got, want):
        bad = np.flatnonzero(got != want)
        raise AssertionError(f"{what}: {bad.size} of {want.size} bytes differ, first at {bad[0]} "
                             f"(got {got[bad[0]]}, want {want[bad[0]]})")


# ---------------------------------------------------------------- scenarios (one PE each)

def rma(round_: int = 0):
    """put, get, put_signal + signal_wait_until, signal_op, atomics, quiet and
    barrier to the PE of the other node, both PEs at once, every size."""
    import torch
    import symheap
    from symheap import _core
    me, n = symheap.my_pe(), symheap.n_pes()
    peer = 1 - me
    dev = torch.device("cuda", symheap.current_device())
    out = {"kinds": [symheap.peer_kind(p) for p in range(n)],
           "transports": [_core.transport_of(p) for p in range(n)]}
    big = SIZES[-1]
    dst = symheap.empty((big + 64,), "uint8")
    sig = symheap.empty((2 * len(SIZES) + 2,), "uint64")
    word = symheap.empty((1,), "int64")
    sig.zero_()
    word.zero_()
    local = torch.empty(big + 64, dtype=torch.uint8, device=dev)
    seed = lambda pe, i: 1000 * round_ + 100 * pe + i  # noqa: E731
    bytes0 = _core.bytes_across_nodes()
    moved = 0
    for i, nb in enumerate(SIZES):
        # put: the peer's bytes land in my copy; nothing past them is touched.
        dst.fill_(POISON)
        torch.cuda.synchronize(dev)
        symheap.barrier_all()
        src = torch.from_numpy(_bytes(seed(me, i), nb)).to(dev)
        symheap.put(dst[:nb], src, peer)
        symheap.quiet()
        symheap.barrier_all()
        host = dst.cpu().numpy()
        _check(host[:nb], _bytes(seed(peer, i), nb), f"put of {nb} B from PE {peer}")
        _check(host[nb:nb + 64], np.full(64, POISON, np.uint8), f"bytes after a put of {nb} B")
        # get: my own bytes in my copy, the peer's fetched into local memory.
        symheap.barrier_all()
        dst[:nb].copy_(src)
        torch.cuda.synchronize(dev)
        symheap.barrier_all()
        local.fill_(POISON)
        symheap.get(local[:nb], dst[:nb], peer)
        symheap.quiet()
        host = local.cpu().numpy()
        _check(host[:nb], _bytes(seed(peer, i), nb), f"get of {nb} B from PE {peer}")
        _check(host[nb:nb + 64], np.full(64, POISON, np.uint8), f"bytes after a get of {nb} B")
        symheap.barrier_all()
        # put_signal: the signal means the bytes are there (no quiet, no barrier).
        dst.fill_(POISON)
        torch.cuda.synchronize(dev)
        symheap.barrier_all()
        fresh = torch.from_numpy(_bytes(seed(me, i) + 50, nb)).to(dev)
        symheap.put_signal(dst[:nb], fresh, sig[i:i + 1], i + 1, peer)
        symheap.signal_wait_until(sig[i:i + 1], "eq", i + 1, timeout=30)
        _check(dst[:nb].cpu().numpy(), _bytes(seed(peer, i) + 50, nb),
               f"put_signal of {nb} B from PE {peer}")
        moved += 3 * nb + 8
    # Stream order: the put reads its source after the caller's stream wrote it.
    s = torch.cuda.Stream(dev)
    src = torch.zeros(1 << 20, dtype=torch.uint8, device=dev)
    want = torch.from_numpy(_bytes(seed(me, 77), 1 << 20)).to(dev)
    dst.fill_(POISON)
    torch.cuda.synchronize(dev)
    symheap.barrier_all()
    with torch.cuda.stream(s):
        torch.cuda._sleep(20_000_000)  # the copy below runs well after put() returned
        src.copy_(want)
        symheap.put(dst[:1 << 20], src, peer, stream=s)
    symheap.quiet(stream=s)
    symheap.barrier_all()
    _check(dst[:1 << 20].cpu().numpy(), _bytes(seed(peer, 77), 1 << 20), "stream-ordered put")
    moved += 1 << 20
    # signal_op add from the peer, twice, after a put: the put landed first.
    k = len(SIZES)
    symheap.barrier_all()
    symheap.put(dst[:4096], torch.from_numpy(_bytes(seed(me, 88), 4096)).to(dev), peer)
    symheap.signal_op(sig[k:k + 1], 3, peer, "add")
    symheap.signal_op(sig[k:k + 1], 4, peer, "add")
    symheap.signal_wait_until(sig[k:k + 1], "eq", 7, timeout=30)
    _check(dst[:4096].cpu().numpy(), _bytes(seed(peer, 88), 4096), "put before signal_op")
    moved += 4096 + 16
    # Atomics on the peer's word (system-scope atomics on its device). Only this
    # PE changes the peer's word, and only the peer changes this PE's.
    symheap.barrier_all()
    olds = [symheap.atomic_fetch_add(word, me + 1, peer) for _ in range(10)]
    symheap.barrier_all()
    total = int(word.cpu()[0])  # the peer's ten adds
    symheap.barrier_all()
    old_swap = symheap.atomic_swap(word, 100 + me, peer)
    cas_old = symheap.atomic_compare_swap(word, 100 + me, 7 + me, peer)  # holds: swaps
    cas_miss = symheap.atomic_compare_swap(word, 12345, 0, peer)  # fails: no change
    symheap.barrier_all()
    after_cas = int(word.cpu()[0])
    moved += 13 * 8
    out.update(fetch_add_olds=olds, total=total, old_swap=old_swap, cas_old=cas_old,
               cas_miss=cas_miss, after_cas=after_cas, moved=moved,
               bytes=_core.bytes_across_nodes() - bytes0)
    symheap.barrier_all()
    for b in (dst, sig, word):
        symheap.free(b)
    return out


def check_rma(results):
    for me, r in enumerate(results):
        assert r["kinds"] == ["self" if p == me else "remote" for p in range(2)], r["kinds"]
        assert r["transports"] == ["load_store" if p == me else "remote" for p in range(2)]
        assert r["bytes"] == r["moved"], (r["bytes"], r["moved"])
        peer = 1 - me
        assert r["fetch_add_olds"] == [(me + 1) * j for j in range(10)], r["fetch_add_olds"]
        assert r["total"] == 10 * (peer + 1), r["total"]
        assert r["old_swap"] == 10 * (me + 1), r["old_swap"]
        assert r["cas_old"] == 100 + me, r["cas_old"]
        assert r["cas_miss"] == 7 + me, r["cas_miss"]
        assert r["after_cas"] == 7 + peer, r["after_cas"]


def small_roundtrip():
    """After finalize and init again: one put and one get each way."""
    import torch
    import symheap
    me = symheap.my_pe()
    peer = 1 - me
    dev = torch.device("cuda", symheap.current_device())
    dst = symheap.empty((1 << 16,), "uint8")
    dst.fill_(POISON)
    torch.cuda.synchronize(dev)
    symheap.barrier_all()
    symheap.put(dst, torch.from_numpy(_bytes(500 + me, 1 << 16)).to(dev), peer)
    symheap.barrier_all()
    _check(dst.cpu().numpy(), _bytes(500 + peer, 1 << 16), "put after init again")
    local = torch.full((1 << 16,), POISON, dtype=torch.uint8, device=dev)
    symheap.get(local, dst, peer)
    symheap.quiet()
    _check(local.cpu().numpy(), _bytes(500 + me, 1 << 16), "get after init again")
    symheap.barrier_all()
    symheap.free(dst)
    return True


def threads_sharing_a_pair(n_adders=4, rounds=50):
    """Several threads of each PE on the one pair to the other PE at once:
    atomic_fetch_add of 1 on one remote word (every old value comes back
    exactly once, so each answer reached its own request) while another
    thread puts 1 MiB and quiets in a loop."""
    import threading
    import torch
    import symheap
    me, device = symheap.my_pe(), symheap.current_device()
    peer = 1 - me
    dev = torch.device("cuda", device)
    word = symheap.empty((1,), "int64")
    dst = symheap.empty((1 << 20,), "uint8")
    word.zero_()
    dst.fill_(POISON)
    src = torch.from_numpy(_bytes(700 + me, 1 << 20)).to(dev)
    torch.cuda.synchronize(dev)
    symheap.barrier_all()
    olds = [[] for _ in range(n_adders)]
    errors = []

    def run(body):
        try:
            symheap.set_device(device)
            body()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(f"{type(e).__name__}: {e}")

    def adder(t):
        for _ in range(rounds):
            olds[t].append(symheap.atomic_fetch_add(word, 1, peer))

    def putter():
        for _ in range(rounds // 5):
            symheap.put(dst, src, peer)
            symheap.quiet()

    threads = [threading.Thread(target=run, args=(lambda t=t: adder(t),), daemon=True)
               for t in range(n_adders)]
    threads.append(threading.Thread(target=run, args=(putter,), daemon=True))
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads), "a thread did not finish within 120 s"
    symheap.barrier_all()
    assert sorted(sum(olds, [])) == list(range(n_adders * rounds)), olds
    assert int(word.item()) == n_adders * rounds, int(word.item())
    _check(dst.cpu().numpy(), _bytes(700 + peer, 1 << 20), "put beside atomics of other threads")
    symheap.barrier_all()
    symheap.free(word)
    symheap.free(dst)
    return True


def lost_peer(how: str):
    """PE 1 stops (SIGSTOP) or dies (SIGKILL) after a first put; PE 0's next
    put + quiet must raise naming PE 1 within the timeout."""
    import torch
    import symheap
    me = symheap.my_pe()
    dev = torch.device("cuda", symheap.current_device())
    dst = symheap.empty((1 << 20,), "uint8")
    src = torch.from_numpy(_bytes(9, 1 << 20)).to(dev)
    symheap.put(dst, src, 1 - me)
    symheap.barrier_all()
    if me == 1:
        os.kill(os.getpid(), signal.SIGSTOP if how == "frozen" else signal.SIGKILL)
        time.sleep(60)  # not reached before the parent kills this process
        return None
    time.sleep(0.5)
    t0 = time.monotonic()
    try:
        for _ in range(4):
            symheap.put(dst, src, 1)
        symheap.quiet()
        return ("no error", time.monotonic() - t0)
    except Exception as e:  # noqa: BLE001 - the test checks the class and the text
        return (f"{type(e).__name__}: {e}", time.monotonic() - t0)


def bandwidth(sizes, iters, port, rounds=2, min_round_bytes=0):
    """PE 0 -> PE 1: symheap puts then quiet, against torch.distributed's NCCL
    send/recv of the same bytes (then a 1-byte answer once they are received),
    on the same forced-network setup. The two are timed in alternating rounds,
    so a drift of the loopback's speed during the run reaches both alike. A
    round is `iters` transfers, more where that moves fewer than
    `min_round_bytes`. Rows of (bytes, iterations, symheap GB/s per round,
    NCCL GB/s per round), as PE 0 timed them."""
    import torch
    import torch.distributed as dist
    import symheap
    me = symheap.my_pe()
    dev = torch.device("cuda", symheap.current_device())
    # one pair, one direction: torch's note on serialized unbatched sends says nothing here
    os.environ.setdefault("TORCH_NCCL_SHOW_EAGER_INIT_P2P_SERIALIZATION_WARNING", "false")
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=me,
                            world_size=2, device_id=dev)
    biggest = max(sizes)
    dst = symheap.empty((biggest,), "uint8")
    src = torch.randint(0, 256, (biggest,), dtype=torch.uint8, device=dev)
    recv = torch.empty(biggest, dtype=torch.uint8, device=dev)
    ack = torch.zeros(1, dtype=torch.uint8, device=dev)
    rows = []

    def timed_symheap(nb, n_it):
        symheap.barrier_all()
        t0 = time.perf_counter()
        if me == 0:
            for _ in range(n_it):
                symheap.put(dst[:nb], src[:nb], 1)
            symheap.quiet()  # returns once every put landed at PE 1
        t = time.perf_counter() - t0
        # PE 1 waits here too: else it enters the NCCL round's barrier while
        # the puts still stream in, and that barrier's traffic shares their path.
        symheap.barrier_all()
        return t

    def timed_nccl(nb, n_it):
        dist.barrier()
        torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        if me == 0:
            for _ in range(n_it):
                dist.send(src[:nb], 1)
            dist.recv(ack, 1)
            torch.cuda.synchronize(dev)
        else:
            for _ in range(n_it):
                dist.recv(recv[:nb], 0)
            torch.cuda.synchronize(dev)
            dist.send(ack, 0)
            torch.cuda.synchronize(dev)
        return time.perf_counter() - t0

    for nb in sizes:
        n_it = max(2, min(max(iters, -(-min_round_bytes // nb)), (8 << 30) // nb))
        timed_symheap(nb, 1)  # warm-up
        timed_nccl(nb, 1)
        sym, nccl = [], []
        for _ in range(rounds):
            sym.append(n_it * nb / timed_symheap(nb, n_it) / 1e9)
            nccl.append(n_it * nb / timed_nccl(nb, n_it) / 1e9)
        rows.append((nb, n_it, sym, nccl))
    symheap.barrier_all()
    symheap.free(dst)
    dist.destroy_process_group()
    return rows


def ep_across_nodes():
    """symheap.ep (kernel='copy_engine') between the two nodes: every routing
    pattern of the EP tests (tests/ep/test_ep_programs.py: received rows traced
    to their source bit for bit, combine against the fp32 reference, outputs
    poisoned first) in both layouts, fp8 with scales, a receive bound, and the
    benchmark's shape at 1024 tokens; the SM kernels refuse another node with
    an error naming copy_engine. Returns the digests of every config."""
    import sys
    import symheap
    from symheap.ep import EpConfig, EpDispatchCombine
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "ep"))
    import test_ep_programs as progs
    import torch
    torch.cuda.set_device(symheap.current_device())  # (the calls' current stream is there)
    base = dict(hidden=512, max_tokens_per_rank=64, num_experts=16, topk=4, dtype="bfloat16",
                kernel="copy_engine")
    configs = [dict(base, max_recv_tokens=128), dict(base, layout="expert_major"),
               dict(base, dtype="float8_e4m3fn", scale_dim=128, layout="expert_major"),
               dict(base, dtype="float16", scale_dim=128, scale_dtype="float32"),
               dict(hidden=7168, max_tokens_per_rank=1024, num_experts=256, topk=8,
                    dtype="bfloat16", kernel="copy_engine", max_recv_tokens=2048)]
    digests = progs.many_configs(configs)
    try:
        EpDispatchCombine(EpConfig(**dict(base, kernel="intranode"))).close()
    except symheap.SymheapError as e:
        assert "across nodes the EP kernels run as kernel='copy_engine'" in str(e), e
    else:
        raise AssertionError("kernel='intranode' across nodes did not raise")
    symheap.barrier_all()
    return digests


def ep_forwarding():
    """symheap.ep (kernel='copy_engine') on 2 nodes x 2 PEs (a node's PEs share
    its GPU, a process each): forwarding inside each node (a token
    bound for both PEs of the other node crosses once, to the forwarder
    there, which stores it into its node's receive buffers; combine sums a
    token's rows there and one row crosses back) and per PE
    (SYMHEAP_EP_HIERARCHICAL=0). Every routing pattern of the EP tests checked
    against the references both ways, in both layouts, fp8 with scales, a
    receive bound and hidden 7168 x 1024 tokens, top-8 of 256 (combine's sums,
    forwarded summed inside the node, against the fp32 reference each way):
    the received rows the same bits both ways; with every token bound for
    every PE, all dispatch outputs and the handle the same bits, and fewer
    bytes across nodes forwarded, in dispatch and in combine. Returns (digests
    per way, dispatch bytes per way, combine bytes per way)."""
    import sys
    import symheap
    from symheap import _core
    from symheap.ep import EpConfig, EpDispatchCombine
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "ep"))
    import test_ep_programs as progs
    import torch
    dev = torch.device("cuda", symheap.current_device())
    torch.cuda.set_device(dev)  # (the calls' current stream is there)
    me, n = symheap.my_pe(), symheap.n_pes()
    base = dict(hidden=512, max_tokens_per_rank=64, num_experts=16, topk=4, dtype="bfloat16",
                kernel="copy_engine")
    configs = [dict(base, max_recv_tokens=n * 64), dict(base, layout="expert_major"),
               dict(base, dtype="float8_e4m3fn", scale_dim=128, layout="expert_major"),
               dict(base, dtype="float16", scale_dim=128, scale_dtype="float32"),
               dict(hidden=7168, max_tokens_per_rank=1024, num_experts=256, topk=8,
                    dtype="bfloat16", kernel="copy_engine", max_recv_tokens=n * 1024)]
    L, T = 2, 64
    cfg = EpConfig(hidden=1024, max_tokens_per_rank=T, num_experts=L * n, topk=n,
                   dtype="bfloat16", scale_dim=128, scale_dtype="float32", kernel="copy_engine")
    gen = torch.Generator().manual_seed(1234 + me)
    x = torch.randn(T, cfg.hidden, generator=gen).to(torch.bfloat16).to(dev)
    scales = torch.rand(T, cfg.hidden // 128, generator=gen).to(dev)
    idx = torch.tensor([[p * L + (t + p) % L for p in range(n)] for t in range(T)], device=dev)
    w = torch.rand(T, n, generator=gen).to(dev)
    digests, sent, sent_back, outputs = [], [], [], []
    for on in (True, False):
        os.environ["SYMHEAP_EP_HIERARCHICAL"] = "1" if on else "0"  # read by the ops made next
        digests.append(progs.many_configs(configs, combine_digest=False))
        with EpDispatchCombine(cfg) as ep:
            symheap.barrier_all()
            torch.cuda.synchronize()
            before = _core.bytes_across_nodes()
            out = ep.dispatch(x, idx, w, scales)
            torch.cuda.synchronize()
            sent.append(_core.bytes_across_nodes() - before)
            outputs.append([f.clone() for f in (
                out.x, out.scales, out.topk_idx, out.topk_weights, out.src_info,
                out.num_recv_tokens, out.expert_counts, out.handle.send_rows,
                out.handle.summary)])
            y = progs.identity_experts(cfg, out, dev)
            symheap.barrier_all()
            torch.cuda.synchronize()
            before = _core.bytes_across_nodes()
            res = ep.combine(y, out.handle)
            torch.cuda.synchronize()
            sent_back.append(_core.bytes_across_nodes() - before)
            progs.check_combine(cfg, res, x.cpu(), idx.cpu(), w.cpu(), scales.cpu(), me)
            symheap.barrier_all()
    os.environ["SYMHEAP_EP_HIERARCHICAL"] = "1"
    assert digests[0] == digests[1], "forwarded and per-PE dispatches received different rows"
    for got, want in zip(*outputs):
        progs.assert_same_bits(got.cpu(), want.cpu(), f"PE {me} forwarded vs per-PE dispatch")
    # per PE: every token's row crosses once per PE of the other node; forwarded: once
    assert sent[1] > 2 * T * cfg.hidden * 2, sent
    assert sent[0] < sent[1] * 0.6, sent
    # combine: a token's rows on the other node are summed there and come back once
    assert sent_back[1] > 2 * T * cfg.hidden * 2, sent_back
    assert sent_back[0] < sent_back[1] * 0.6, sent_back
    symheap.barrier_all()
    return digests, sent, sent_back


def ep_remote_bench(port, iters, tokens):
    """bench/ep_bench.py's case (tokens, copy_engine, bf16, token-major, receive
    bound) between the two nodes, with its NCCL reference on the same
    forced-network setup, plus the bare all_to_all_single of the same rows
    (dispatch's direction, then back; splits known beforehand). This PE's result."""
    import sys
    import torch
    import torch.distributed as dist
    import symheap
    import symheap.ep as ep_mod
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                    "bench"))
    import ep_bench as eb
    me = symheap.my_pe()
    dev = torch.device("cuda", symheap.current_device())
    torch.cuda.set_device(dev)  # (ep_bench times the current stream, where the calls run)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=me,
                            world_size=2, device_id=dev)
    try:
        case = (tokens, "copy_engine", "bfloat16", "token_major", True)
        result = eb.run_case(torch, dist, symheap, ep_mod, case, iters, me, 2, dev)
        x, idx, _ = eb.routing(torch, tokens, me, dev)
        x = x.to(torch.bfloat16)
        hit = torch.zeros(tokens, 2, dtype=torch.bool, device=dev)
        hit.scatter_(1, idx // (eb.EXPERTS // 2), True)
        dests, toks = hit.t().nonzero(as_tuple=True)
        send = torch.bincount(dests, minlength=2)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send)
        sc, rc = send.tolist(), recv.tolist()
        rows = x.index_select(0, toks)
        got = torch.empty(sum(rc), eb.HIDDEN, dtype=x.dtype, device=dev)
        back = torch.empty_like(rows)

        def a2a():
            dist.all_to_all_single(got, rows, rc, sc)
            dist.all_to_all_single(back, got, sc, rc)

        result["a2a_only_us"] = eb.timed(torch, dist, a2a, iters)
        result["cross_rows"] = rc[1 - me]
    finally:
        dist.destroy_process_group()
    return result


# ---------------------------------------------------------------- launcher

def _pin_to_share(rank, ranks):
    """Pins this process (and every thread it starts later, NCCL's proxy and
    socket threads among them) to its own share of the physical cores it may
    use (with their hyperthreads), so the two nodes' network threads never take
    turns on one core."""
    cpus = sorted(os.sched_getaffinity(0))

    def core_of(cpu):
        topo = f"/sys/devices/system/cpu/cpu{cpu}/topology/"
        try:
            with open(topo + "physical_package_id") as a, open(topo + "core_id") as b:
                return int(a.read()), int(b.read())
        except (OSError, ValueError):
            return 0, cpu

    cores = sorted({core_of(c) for c in cpus})
    share = len(cores) // ranks
    if share:
        mine = set(cores[rank * share:(rank + 1) * share])
        os.sched_setaffinity(0, [c for c in cpus if core_of(c) in mine])


def _child(rank, uids, steps, timeout, heap_size, out, pin=False):
    if pin:
        _pin_to_share(rank, 2)
    os.environ.update(forced_network_env(rank))
    os.environ.setdefault("NCCL_DEBUG", "WARN")  # NCCL's own reasons, should anything fail
    os.environ["SYMHEAP_BACKEND"] = "cuda"
    try:
        import symheap
        results = []
        for (name, args, finalize), uid in zip(steps, uids):  # a fresh job id per init
            symheap.init(rank, 2, uid, device=rank, heap_size=heap_size, timeout=timeout)
            result = globals()[name](*args)
            if name == "lost_peer":  # report before finalize, which may not complete
                out.put((rank, True, result))
                try:
                    symheap.finalize()
                except Exception:  # noqa: BLE001 - the job lost a PE
                    pass
                return
            results.append(result)
            if finalize:
                symheap.finalize()
        out.put((rank, True, results))
    except BaseException as e:  # noqa: BLE001 - reported to the parent with the rank
        out.put((rank, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def _child_pe_of_node(pe, uid, step, timeout, heap_size, out):
    """PE `pe` in a process of its own, on node NODES[pe // 2] and its GPU."""
    node = pe // 2
    os.environ.update(forced_network_env(node))
    os.environ.setdefault("NCCL_DEBUG", "WARN")
    os.environ["SYMHEAP_BACKEND"] = "cuda"
    try:
        import symheap
        symheap.init(pe, 4, uid, device=node, heap_size=heap_size, timeout=timeout)
        try:
            result = globals()[step]()
        finally:
            symheap.finalize()
        out.put((pe, True, result))
    except BaseException as e:  # noqa: BLE001 - reported to the parent with the PE
        out.put((pe, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def run_two_nodes_of_two_pes(step, timeout=30.0, heap_size="1G", wait_s=300.0):
    """Runs scenario `step` on 4 PEs, one process each: PEs 0 and 1 on node
    "node-a" and GPU 0, PEs 2 and 3 on "node-b" and GPU 1, so that a node's
    PEs share its GPU (CUDA IPC between them) and every pair of PEs on
    different nodes spans both GPUs (NCCL will not pair two ranks on one
    GPU). Returns {PE: result}; raises with every PE's error otherwise."""
    import symheap
    ctx = mp.get_context("spawn")
    uid = symheap.get_unique_id()
    out = ctx.Queue()
    procs = [ctx.Process(target=_child_pe_of_node, args=(pe, uid, step, timeout, heap_size, out))
             for pe in range(4)]
    return _gather(procs, out, range(4), wait_s)


def run_two_nodes(steps, timeout=20.0, heap_size="256M", wait_s=300.0, ranks_expected=(0, 1),
                  pin=False):
    """Runs `steps` [(scenario, args, finalize)] in 2 processes (GPU 0 and 1,
    nodes "node-a" and "node-b"); returns {rank: result}; raises with every
    rank's error otherwise. Processes still alive at the end are killed.
    `pin`: each process runs on its own half of the physical cores."""
    import symheap
    ctx = mp.get_context("spawn")
    uids = [symheap.get_unique_id() for _ in steps]
    out = ctx.Queue()
    procs = [ctx.Process(target=_child, args=(r, uids, steps, timeout, heap_size, out, pin))
             for r in range(2)]
    return _gather(procs, out, ranks_expected, wait_s)


def _gather(procs, out, ranks_expected, wait_s):
    """Starts `procs` (process r is PE r) and collects (PE, ok, value) from
    queue `out` until every PE of `ranks_expected` reported or `wait_s`
    passed; returns {PE: result} or raises with every PE's error. A PE
    expected to report finishes on its own; the others are killed."""
    for p in procs:
        p.start()
    results, errors = {}, {}
    deadline = time.monotonic() + wait_s
    try:
        while len(results) + len(errors) < len(ranks_expected):
            try:
                rank, ok, value = out.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                break
            (results if ok else errors)[rank] = value
    finally:
        for r, p in enumerate(procs):
            p.join(10 if r in ranks_expected and r in results else 0.5)
            if p.is_alive():
                p.kill()
                p.join(5)
    missing = [r for r in ranks_expected if r not in results and r not in errors]
    if errors or missing:
        lines = [f"PE {r}: {m}" for r, m in sorted(errors.items())]
        lines += [f"PE {r}: no result within {wait_s} s (exit code {procs[r].exitcode})"
                  for r in missing]
        raise RuntimeError("\n".join(lines))
    return results
