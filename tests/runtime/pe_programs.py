"""PE programs shared by the launch-model tests (importable by spawned processes)."""
import numpy as np

import symheap


def ring_put_signal(n_words: int = 1024):
    """Each PE puts fresh random data to its right neighbour with a signal; returns
    (what it received, what its left neighbour sent, peer kinds)."""
    me, n = symheap.my_pe(), symheap.n_pes()
    dst = symheap.empty((n_words,), "float64", like="numpy")
    dst[:] = np.nan  # poison
    sig = symheap.empty((1,), "uint64", like="numpy")
    sig[:] = 0
    symheap.barrier_all()
    rng = np.random.default_rng(1000 + me)
    mine = rng.standard_normal(n_words)
    symheap.put_signal(dst, mine, sig, 7, (me + 1) % n)
    symheap.signal_wait_until(sig, "eq", 7)
    left = (me - 1) % n
    expected = np.random.default_rng(1000 + left).standard_normal(n_words)
    got = dst.copy()
    kinds = [symheap.peer_kind(p) for p in range(n)]
    symheap.barrier_all()
    symheap.free(dst)
    symheap.free(sig)
    return got, expected, kinds


def atomics_and_get():
    """Every PE adds to a counter on PE 0, then each gets a peer's array."""
    me, n = symheap.my_pe(), symheap.n_pes()
    counter = symheap.empty((1,), "int64", like="numpy")
    counter[:] = 0
    arr = symheap.empty((257,), "int32", like="numpy")
    arr[:] = np.arange(257, dtype=np.int32) * (me + 1)
    symheap.barrier_all()
    olds = [symheap.atomic_fetch_add(counter, me + 1, 0) for _ in range(10)]
    symheap.barrier_all()
    total = int(counter[0]) if me == 0 else None
    symheap.barrier_all()
    out = np.full(257, -1, dtype=np.int32)
    peer = (me + 2) % n
    symheap.get(out, arr, peer)
    # compare-swap: only one PE wins
    flag = symheap.empty((1,), "int64", like="numpy")
    flag[:] = 0
    symheap.barrier_all()
    old = symheap.atomic_compare_swap(flag, 0, me + 100, 0)
    symheap.barrier_all()
    winner = int(flag[0]) if me == 0 else None
    swapped = symheap.atomic_swap(counter, -5, me)
    symheap.barrier_all()
    for b in (counter, arr, flag):
        symheap.free(b)
    return {"olds": olds, "total": total, "got": out, "peer": peer, "cas_old": old,
            "winner": winner, "swapped": swapped}


def identity():
    return symheap.my_pe(), symheap.n_pes(), symheap.current_device()


def heap_offsets(sizes):
    bufs = [symheap.malloc(s) for s in sizes]
    offs = [b.offset for b in bufs]
    for b in reversed(bufs):
        b.free()
    return offs


def reinit_cycles(uids, heap_size=None):
    """Ring, then finalize and init again with each id in ``uids``; every cycle must work."""
    import symheap as sh
    rank, world, device = sh.my_pe(), sh.n_pes(), sh.current_device()
    out = [ring_put_signal(64)]
    for uid in uids:
        sh.finalize()
        sh.init(rank, world, uid, device=device, heap_size=heap_size)
        out.append(ring_put_signal(64))
    return out


def heap_segments_of_this_process():
    import os
    return sorted(f for f in os.listdir("/dev/shm") if f.startswith(f"symheap.{os.getpid()}."))


def die_hard_after_init():
    import os
    symheap.barrier_all()
    os._exit(3)  # no finalize, no atexit: the kernel reclaims everything but shm names


def torch_tensors_and_peer_views():
    """Heap tensors (torch and numpy) and aliases of peers' copies."""
    import torch
    me, n = symheap.my_pe(), symheap.n_pes()
    t = symheap.empty((3, 5), torch.bfloat16)
    assert t.dtype == torch.bfloat16 and t.shape == (3, 5)
    a = symheap.empty((6,), "int32", like="numpy")
    g = torch.Generator().manual_seed(me)
    t.copy_(torch.randn(3, 5, generator=g).to(torch.bfloat16))
    a[:] = np.arange(6, dtype=np.int32) + 100 * me
    symheap.barrier_all()
    right = (me + 1) % n
    peer_t = symheap.peer_tensor(t, right)
    peer_a = symheap.peer_tensor(a, right)
    expect_t = torch.randn(3, 5, generator=torch.Generator().manual_seed(right)).to(torch.bfloat16)
    ok_read = bool(torch.equal(peer_t, expect_t)) and bool(np.all(peer_a == np.arange(6) + 100 * right))
    symheap.barrier_all()
    peer_a[0] = -me  # store into the right neighbour's copy
    symheap.barrier_all()
    left = (me - 1) % n
    ok_write = int(a[0]) == -left
    with symheap.malloc(64) as buf:
        assert buf.nbytes == 64
        usage = symheap.heap_usage()
    symheap.free(t)
    symheap.free(a)
    return ok_read, ok_write, usage["live_buffers"] >= 3, [symheap.device_of(p) for p in range(n)
                                                           if symheap.peer_kind(p) in ("self", "same_process")]
