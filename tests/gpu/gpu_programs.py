"""PE programs for the GPU tests (importable by spawned processes).

Each runs as one PE after symheap.init and returns plain Python / numpy
values (picklable), so the same program serves threads and processes.
Data is fresh random data; destinations are poisoned before every transfer.
"""
from __future__ import annotations

import os
import sys
import threading

import numpy as np
import torch

import symheap
from symheap import _core, _devtest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "ep"))

THREAD, WARP, BLOCK = 0, 1, 2
CMP = {"eq": 0, "ne": 1, "gt": 2, "ge": 3, "lt": 4, "le": 5}


def _dev():
    return torch.device("cuda", symheap.current_device())


def _rand(seed, shape, dtype=np.float32):
    rng = np.random.default_rng(seed)
    if np.issubdtype(dtype, np.integer):
        return rng.integers(0, np.iinfo(dtype).max, size=shape, dtype=dtype)
    return rng.standard_normal(shape).astype(dtype)


def _pe():
    """The calling PE's DeviceContext bytes and device: the first arguments of
    every symheap._devtest kernel call."""
    return symheap.device_context(), symheap.current_device()


def _stream():
    return torch.cuda.current_stream(_dev()).cuda_stream


def _sync():
    torch.cuda.synchronize(_dev())


def fill_pattern_host(n: int, seed: int) -> np.ndarray:
    """numpy twin of the devtest fill kernel (src/devtest/devtest_kernels.cu)."""
    i = np.arange(n, dtype=np.uint64)
    x = ((i * np.uint64(2654435761)) & np.uint64(0xFFFFFFFF)) ^ np.uint64(seed)
    x ^= x >> np.uint64(15)
    x = (x * np.uint64(2246822519)) & np.uint64(0xFFFFFFFF)
    x ^= x >> np.uint64(13)
    return x.astype(np.uint32)


# --------------------------------------------------------------- host API

def host_api(n_words: int = 4099):
    """put_signal by every transport, get (to device and host), atomics and
    signal adds, across the ring. Returns what arrived and what should have."""
    me, n = symheap.my_pe(), symheap.n_pes()
    right, left = (me + 1) % n, (me - 1) % n
    dev = _dev()
    vias = ("auto", "load_store", "copy_engine")
    dst = symheap.empty((len(vias), n_words), "float32")
    sig = symheap.empty((len(vias),), "uint64")
    dst.fill_(float("nan"))
    sig.zero_()
    src = torch.from_numpy(_rand(1000 + me, (len(vias), n_words))).to(dev)
    _sync()
    symheap.barrier_all()
    for i, via in enumerate(vias):
        symheap.put_signal(dst[i], src[i], sig[i:i + 1], 7 + i, right, via=via)
    for i in range(len(vias)):
        symheap.signal_wait_until(sig[i:i + 1], "eq", 7 + i)
    received = dst.cpu().numpy()
    expected = _rand(1000 + left, (len(vias), n_words))

    mine = symheap.empty((n_words,), "float64")
    mine.copy_(torch.from_numpy(_rand(2000 + me, n_words, np.float64)).to(dev))
    _sync()
    symheap.barrier_all()
    out_dev = torch.full((n_words,), float("nan"), dtype=torch.float64, device=dev)
    symheap.get(out_dev, mine, right)
    out_host = np.full(n_words, np.nan)
    symheap.get(out_host, mine, left)
    symheap.quiet()
    got_right, got_left = out_dev.cpu().numpy(), out_host

    counter = symheap.empty((1,), "int64")
    flag = symheap.empty((1,), "int64")
    total = symheap.empty((1,), "uint64")
    for t in (counter, flag, total):
        t.zero_()
    _sync()
    symheap.barrier_all()
    olds = [symheap.atomic_fetch_add(counter, me + 1, 0) for _ in range(5)]
    symheap.signal_op(total, me + 1, 0, op="add")
    symheap.quiet()
    symheap.barrier_all()
    counter_total = int(counter.item()) if me == 0 else None
    signal_total = int(total.item()) if me == 0 else None
    cas_old = symheap.atomic_compare_swap(flag, 0, 100 + me, 0)
    symheap.barrier_all()
    winner = int(flag.item()) if me == 0 else None
    swapped = symheap.atomic_swap(counter, -5 - me, right)
    symheap.barrier_all()
    after_swap = int(counter.item())
    kinds = [symheap.peer_kind(p) for p in range(n)]
    symheap.barrier_all()
    for b in (dst, sig, mine, counter, flag, total):
        symheap.free(b)
    return {"received": received, "expected": expected,
            "got_right": got_right, "exp_right": _rand(2000 + right, n_words, np.float64),
            "got_left": got_left, "exp_left": _rand(2000 + left, n_words, np.float64),
            "olds": olds, "counter_total": counter_total, "signal_total": signal_total,
            "cas_old": cas_old, "winner": winner, "swapped": swapped,
            "after_swap": after_swap, "kinds": kinds, "device": symheap.current_device()}


def check_host_api(results):
    n = len(results)
    for rank, r in enumerate(results):
        np.testing.assert_array_equal(r["received"], r["expected"], err_msg=f"PE {rank} put_signal")
        np.testing.assert_array_equal(r["got_right"], r["exp_right"], err_msg=f"PE {rank} get")
        np.testing.assert_array_equal(r["got_left"], r["exp_left"], err_msg=f"PE {rank} get host")
        assert r["kinds"][rank] == "self"
        # PE rank swapped -5-(rank) into right's counter; left swapped into ours
        assert r["after_swap"] == -5 - ((rank - 1) % n), (rank, r["after_swap"])
    assert results[0]["counter_total"] == 5 * sum(p + 1 for p in range(n))
    assert results[0]["signal_total"] == sum(p + 1 for p in range(n))
    olds = sorted(o for r in results for o in r["olds"])
    assert len(set(olds)) == len(olds), "every fetch_add must see a distinct old value"
    assert results[0]["winner"] in [100 + p for p in range(n)]
    assert sum(1 for r in results if r["cas_old"] == 0) == 1


# --------------------------------------------------------------- torch tensors and streams

def torch_tensors(n_elems: int = 1 << 16):
    """empty(like="torch") on the PE's device, peer_tensor aliasing (read and
    write), and puts ordered on a side stream behind a long kernel."""
    me, n = symheap.my_pe(), symheap.n_pes()
    right, left = (me + 1) % n, (me - 1) % n
    dev = _dev()
    t = symheap.empty((4, n_elems // 4), "float32")
    out = {"is_cuda": t.is_cuda, "device_ok": t.device == dev}
    t.copy_(torch.from_numpy(_rand(3000 + me, (4, n_elems // 4))).to(dev))
    _sync()
    symheap.barrier_all()
    p = symheap.peer_tensor(t, right)
    out["peer_device_ok"] = p.device == dev
    out["peer_read"] = p.cpu().numpy()
    out["peer_expected"] = _rand(3000 + right, (4, n_elems // 4))
    out["self_alias"] = symheap.peer_tensor(t, me).data_ptr() == t.data_ptr()
    symheap.barrier_all()
    p.mul_(2.0)  # writes the right neighbour's memory from this device
    _sync()
    symheap.barrier_all()
    out["doubled"] = t.cpu().numpy()
    out["doubled_expected"] = 2.0 * _rand(3000 + me, (4, n_elems // 4))

    # Stream ordering: the source is written on a side stream after a long
    # sleep kernel; puts on that stream must carry the new bytes.
    dst = symheap.empty((3, n_elems), "float32")
    dst.fill_(float("nan"))
    x = torch.zeros(n_elems, device=dev)
    fresh = torch.from_numpy(_rand(4000 + me, n_elems)).to(dev)
    _sync()
    symheap.barrier_all()
    side = torch.cuda.Stream(dev)
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of spinning before the data is ready
        x.copy_(fresh)
        symheap.put(dst[0], x, right, stream=side)                    # explicit stream
        symheap.put(dst[1], x, right)                                 # current stream = side
        symheap.put(dst[2], x, right, stream=side, via="copy_engine")  # ordered after side
    symheap.quiet(stream=side)
    symheap.barrier_all()
    out["stream_rows"] = dst.cpu().numpy()
    out["stream_expected"] = np.stack([_rand(4000 + left, n_elems)] * 3)
    symheap.barrier_all()
    symheap.free(t)
    symheap.free(dst)
    return out


def check_torch_tensors(results):
    for rank, r in enumerate(results):
        assert r["is_cuda"] and r["device_ok"] and r["peer_device_ok"], rank
        assert r["self_alias"], rank
        np.testing.assert_array_equal(r["peer_read"], r["peer_expected"], err_msg=f"PE {rank}")
        np.testing.assert_array_equal(r["doubled"], r["doubled_expected"], err_msg=f"PE {rank}")
        np.testing.assert_array_equal(r["stream_rows"], r["stream_expected"],
                                      err_msg=f"PE {rank} stream-ordered puts")


# --------------------------------------------------------------- device API

def device_api(nbytes: int = 300_013):
    """put / put_nbi / put_signal and get at thread, warp and block scope,
    atomics, signal waits and barriers, all issued from kernels; verified on
    the receiving side (a kernel waits for the signal before the check)."""
    me, n = symheap.my_pe(), symheap.n_pes()
    right, left = (me + 1) % n, (me - 1) % n
    dev = _dev()
    stream = _stream()
    src = symheap.empty((nbytes,), "uint8")
    dst = symheap.empty((nbytes,), "uint8")
    sig = symheap.empty((1,), "uint64")
    seen = torch.zeros(1, dtype=torch.int64, device=dev)
    src.copy_(torch.from_numpy(_rand(5000 + me, nbytes, np.uint8)).to(dev))
    mine_expected = _rand(5000 + left, nbytes, np.uint8)
    out = {"put": {}, "get": {}}
    units_of = {THREAD: 37, WARP: 9, BLOCK: 5}
    for scope, units in units_of.items():
        for mode in ("put", "nbi", "signal"):
            dst.fill_(0xAB)
            sig.zero_()
            _sync()
            symheap.barrier_all()
            _devtest.put(*_pe(), dst.data_ptr(), src.data_ptr(), nbytes, right, scope, units,
                         sig.data_ptr() if mode == "signal" else 0, mode == "nbi", stream)
            if mode == "signal":
                # The receiver learns of the data from the signal alone.
                _devtest.wait_until(*_pe(), sig.data_ptr(), CMP["ge"], units, seen.data_ptr(),
                                    stream)
                _sync()
                ok_signal = int(seen.item()) == units
            else:
                symheap.quiet()         # the sender's puts are complete ...
                symheap.barrier_all()   # ... before the receiver looks
                ok_signal = True
            got = dst.cpu().numpy()  # on this PE's stream, after the wait kernel
            out["put"][(scope, mode)] = (bool(np.array_equal(got, mine_expected)), ok_signal)
            symheap.barrier_all()
        local = torch.full((nbytes,), 0xCD, dtype=torch.uint8, device=dev)
        _devtest.get(*_pe(), local.data_ptr(), src.data_ptr(), nbytes, right, scope, units, stream)
        symheap.quiet()
        out["get"][scope] = bool(np.array_equal(local.cpu().numpy(),
                                                _rand(5000 + right, nbytes, np.uint8)))
        symheap.barrier_all()

    threads = 256
    words = symheap.empty((3,), "int64")  # counter, cas word, swap word on PE 0
    words.zero_()
    olds = torch.full((threads + 2,), -1, dtype=torch.int64, device=dev)
    _sync()
    symheap.barrier_all()
    w = words.data_ptr()
    _devtest.atomics(*_pe(), w, w + 8, w + 16, 0, me + 1, 0, threads, olds.data_ptr(), stream)
    symheap.quiet()
    symheap.barrier_all()
    out["atomic_olds"] = olds.cpu().numpy()
    out["atomic_words"] = words.cpu().numpy() if me == 0 else None

    # wait_until against values a peer sets from the host. The signal goes on
    # another stream: on `stream` it would queue behind our own wait kernel,
    # and every PE would wait for its left neighbour forever. The stream is
    # made and used once before the wait kernel starts, so that no first-use
    # work (stream pools, lazy loading) can wait behind the spinning kernel.
    side = torch.cuda.Stream(dev)
    symheap.signal_op(sig, 0, me, stream=side)
    symheap.quiet(stream=side)
    sig.zero_()
    _sync()
    symheap.barrier_all()
    _devtest.wait_until(*_pe(), sig.data_ptr(), CMP["eq"], 41 + me, seen.data_ptr(), stream)
    symheap.signal_op(sig, 41 + right, right, stream=side)
    symheap.quiet(stream=side)
    symheap.quiet()
    out["waited"] = int(seen.item())

    slots = symheap.empty((n,), "uint64")
    bad = torch.zeros(1, dtype=torch.int64, device=dev)
    out["barrier_bad"] = {}
    for scope in (THREAD, WARP, BLOCK):
        slots.zero_()
        bad.zero_()
        _sync()
        symheap.barrier_all()
        _devtest.barrier(*_pe(), slots.data_ptr(), 25, scope, bad.data_ptr(), stream)
        symheap.quiet()
        out["barrier_bad"][scope] = int(bad.item())
        out.setdefault("barrier_slots", {})[scope] = slots.cpu().numpy().tolist()
    symheap.barrier_all()
    for b in (src, dst, sig, words, slots):
        symheap.free(b)
    return out


def check_device_api(results):
    n = len(results)
    threads = 256
    for rank, r in enumerate(results):
        for key, (data_ok, signal_ok) in r["put"].items():
            assert data_ok, f"PE {rank}: device {key} delivered wrong bytes"
            assert signal_ok, f"PE {rank}: device {key} signal count wrong"
        for scope, ok in r["get"].items():
            assert ok, f"PE {rank}: device get at scope {scope} wrong"
        assert r["waited"] == 41 + rank
        for scope, bad in r["barrier_bad"].items():
            assert bad == 0, f"PE {rank}: barrier at scope {scope} let {bad} stale reads through"
            assert r["barrier_slots"][scope] == [25] * n
    olds = np.concatenate([r["atomic_olds"][:threads] for r in results])
    words = results[0]["atomic_words"]
    assert words[0] == n * (threads + 1000)
    assert len(np.unique(olds)) == len(olds), "fetch_add olds must be distinct"
    assert olds.min() >= 0 and olds.max() < n * (threads + 1000)
    cas_olds = [int(r["atomic_olds"][threads]) for r in results]
    assert cas_olds.count(0) == 1 and words[1] in [p + 1 for p in range(n)]
    swap_olds = sorted(int(r["atomic_olds"][threads + 1]) for r in results)
    # the swaps form a chain: the olds plus the final word are {0, 1, ..., n}
    assert sorted(swap_olds + [int(words[2])]) == list(range(n + 1))


# --------------------------------------------------------------- copy engines

def copy_engine(nbytes: int = 48 << 20, rounds: int = 3):
    """Large puts through the copy-engine channel; the receiver waits on the
    completion signal from a kernel and from the host; one channel per
    destination device, reused."""
    me, n = symheap.my_pe(), symheap.n_pes()
    right, left = (me + 1) % n, (me - 1) % n
    dev = _dev()
    stream = _stream()
    words = nbytes // 4
    dst = symheap.empty((words,), "int32")
    sig = symheap.empty((2,), "uint64")
    seen = torch.zeros(1, dtype=torch.int64, device=dev)
    before = _core.cuda_channel_count(symheap.current_device())
    results = []
    for r in range(rounds):
        src = torch.from_numpy(_rand(6000 + 10 * me + r, words, np.int32)).to(dev)
        dst.fill_(-7)
        sig.zero_()
        _sync()
        symheap.barrier_all()
        symheap.put_signal(dst, src, sig[0:1], r + 1, right, via="copy_engine")
        symheap.put_signal(dst[:16], src[:16], sig[1:2], 1, right, op="add", via="copy_engine")
        _devtest.wait_until(*_pe(), sig.data_ptr(), CMP["eq"], r + 1, seen.data_ptr(), stream)
        symheap.signal_wait_until(sig[1:2], "eq", 1)
        got = dst.cpu().numpy()
        results.append(bool(np.array_equal(got, _rand(6000 + 10 * left + r, words, np.int32)))
                       and int(seen.item()) == r + 1)
        symheap.quiet()
        symheap.barrier_all()
    after = _core.cuda_channel_count(symheap.current_device())
    symheap.free(dst)
    symheap.free(sig)
    return {"rounds_ok": results, "new_channels": after - before}


# --------------------------------------------------------------- concurrency

def concurrent_launches(workers: int = 4, words: int = 1 << 18):
    """`workers` threads drive this PE's device at once: each fills its slice
    with a cached kernel and puts it to the right neighbour with SM stores on
    its own stream. Checks the data and that the kernel cache made each entry
    once per device."""
    me, n = symheap.my_pe(), symheap.n_pes()
    right, left = (me + 1) % n, (me - 1) % n
    device = symheap.current_device()
    work = symheap.empty((workers, words), "int32")
    staging = symheap.empty((workers, words), "int32")
    work.fill_(-1)
    _sync()
    symheap.barrier_all()
    entries = [_core.cuda_kernel_cache_entries(device)]
    errors = []
    start = threading.Barrier(workers)

    def worker(w, round_):
        try:
            symheap.set_device(device)
            s = torch.cuda.Stream(device)
            start.wait(30)
            seed = 7919 * (me + 1) + 31 * w + round_
            _devtest.fill(staging[w].data_ptr(), words, seed, device, s.cuda_stream)
            symheap.put(work[w], staging[w], right, stream=s, via="load_store")
            symheap.quiet(stream=s)
        except BaseException as e:  # reported to the caller
            errors.append(f"worker {w}: {type(e).__name__}: {e}")

    ok = []
    for round_ in range(2):
        ts = [threading.Thread(target=worker, args=(w, round_)) for w in range(workers)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(120)
        symheap.barrier_all()
        got = work.cpu().numpy().view(np.uint32)
        exp = np.stack([fill_pattern_host(words, 7919 * (left + 1) + 31 * w + round_)
                        for w in range(workers)])
        ok.append(bool(np.array_equal(got, exp)))
        entries.append(_core.cuda_kernel_cache_entries(device))
        symheap.barrier_all()
    symheap.free(work)
    symheap.free(staging)
    return {"ok": ok, "errors": errors, "entries": entries}


# --------------------------------------------------------------- failures

def failures():
    """Bad arguments raise clear Python exceptions; a kernel's wait that times
    out is reported by the next quiet; nothing hangs or aborts."""
    me, n = symheap.my_pe(), symheap.n_pes()
    right = (me + 1) % n
    dev = _dev()
    out = {}
    buf = symheap.empty((1024,), "float32")
    sig = symheap.empty((1,), "uint64")
    sig.zero_()
    _sync()
    symheap.barrier_all()

    def raised(fn):
        try:
            fn()
        except Exception as e:
            return type(e).__name__, str(e)
        return None, ""

    other = (symheap.current_device() + 1) % symheap.device_count()
    if other != symheap.current_device():
        foreign = torch.cuda.Stream(other)
        out["foreign_stream"] = raised(
            lambda: symheap.put(buf, torch.ones(1024, device=dev), right, stream=foreign))
    out["pageable_load_store"] = raised(
        lambda: symheap.put(buf, np.ones(1024, np.float32), right, via="load_store"))
    out["off_heap"] = raised(
        lambda: symheap.put(torch.ones(8, device=dev), torch.ones(8, device=dev), right))
    out["bad_via"] = raised(lambda: symheap.put(buf, buf, right, via="dma"))
    out["numpy_view"] = raised(lambda: symheap.empty((4,), "float32", like="numpy"))
    # A kernel waits for a signal nobody sends: the wait gives up after the
    # PE's timeout (init(timeout=...)), and quiet() raises it.
    seen = torch.zeros(1, dtype=torch.int64, device=dev)
    _devtest.wait_until(*_pe(), sig.data_ptr(), CMP["eq"], 99, seen.data_ptr(), _stream())
    out["device_timeout"] = raised(symheap.quiet)
    out["after_timeout"] = raised(symheap.quiet)  # the record was cleared
    # the PE still works afterwards
    src = torch.full((1024,), float(me), device=dev)
    symheap.barrier_all()
    symheap.put(buf, src, right)
    symheap.barrier_all()
    out["still_works"] = bool((buf == float((me - 1) % n)).all().item())
    symheap.barrier_all()
    symheap.free(buf)
    symheap.free(sig)
    return out


def heap_roundtrip(nbytes: int):
    """Fills most of the heap with my_pe + 1; returns (min, max) of it."""
    t = symheap.empty((nbytes // 4,), "int32")
    t.fill_(symheap.my_pe() + 1)
    lo, hi = int(t.min().item()), int(t.max().item())  # no widened temporaries
    symheap.barrier_all()
    symheap.free(t)
    return lo, hi


def ep_and_attention():
    """Expert-parallel dispatch/combine with every kernel (each received row,
    count and combined sum checked against references; tests/ep/test_ep_programs.py),
    then attention forward and backward against an fp32 reference, on this
    PE's GPU. Returns the EP digests (equal across launch models) and the
    attention error."""
    import test_ep_programs as ep_progs
    n = symheap.n_pes()
    base = dict(hidden=256, max_tokens_per_rank=32, num_experts=4 * n, topk=4)
    configs = [dict(base, kernel="intranode", dtype="bfloat16"),
               dict(base, kernel="low_latency", layout="expert_major", dtype="float8_e4m3fn",
                    scale_dim=128),
               dict(base, kernel="copy_engine", dtype="float16")]
    digests = ep_progs.many_configs(configs, ep_progs.DEFAULT_PLAN[:4])
    return {"ep": digests, "attention_err": attention_error(seed=symheap.my_pe())}


def attention_error(seed: int, B: int = 2, S: int = 256, H: int = 4, D: int = 64) -> float:
    """Relative error of causal flash_attn_func (bf16) and its gradients
    against PyTorch's attention in fp32; raises above 2e-2."""
    from symheap.attention import flash_attn_func
    dev = _dev()
    gen = torch.Generator().manual_seed(1000 + seed)
    q, k, v, dout = (torch.randn(B, S, H, D, generator=gen).to(dev, torch.bfloat16)
                     for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = flash_attn_func(q, k, v, causal=True)
    got = (out,) + torch.autograd.grad(out, (q, k, v), dout)
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(
        qf.transpose(1, 2), kf.transpose(1, 2), vf.transpose(1, 2), is_causal=True).transpose(1, 2)
    want = (ref,) + torch.autograd.grad(ref, (qf, kf, vf), dout.float())
    errs = [float((a.float() - b).abs().max() / b.abs().max()) for a, b in zip(got, want)]
    if not max(errs) < 2e-2:
        raise AssertionError(f"PE {symheap.my_pe()}: attention error {errs} (out, dq, dk, dv)")
    return max(errs)
