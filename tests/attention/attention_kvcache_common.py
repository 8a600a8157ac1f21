"""Shared pieces of the KV-cache attention tests (cpu in tests/attention/, CUDA in
tests/gpu/); no tests here. Caches are poisoned with NaN beyond the valid rows,
and the reference gathers each sequence's keys into a dense fp32 tensor."""
from __future__ import annotations

import math
import threading

import torch

from symheap.attention import attention_reference

# name -> (Hq, Hkv, options of the call)
FEATURES = {
    "plain": (4, 4, {}),
    "causal": (4, 2, dict(causal=True)),
    "window": (4, 2, dict(window_size=(45, 2))),
    "causal_window": (4, 2, dict(causal=True, window_size=(70, -1))),
    "softcap": (4, 2, dict(softcap=2.5)),
    "alibi": (4, 2, dict(alibi=True)),
    "gqa": (8, 2, {}),
    "mqa": (4, 1, dict(causal=True)),
    "all": (8, 2, dict(causal=True, window_size=(60, 0), softcap=3.0, alibi=True)),
}


def alibi_slopes(Hq):
    return torch.tensor([2.0 ** (-8.0 * (h + 1) / Hq) for h in range(Hq)], dtype=torch.float32)


def call_options(opts, Hq, device):
    """The call's keyword arguments (ALiBi slopes made concrete)."""
    kw = dict(opts)
    if kw.pop("alibi", False):
        kw["alibi_slopes"] = alibi_slopes(Hq).to(device)
    return kw


class Cache:
    """A dense (B, capacity, Hkv, D) or paged (num_blocks, block_size, Hkv, D)
    pair of caches whose sequence b holds `lengths[b]` random rows; every other
    element is NaN."""

    def __init__(self, *, B, capacity, Hkv, D, dtype, device, gen, lengths, block_size=None,
                 extra_blocks=3):
        self.B, self.Hkv, self.D, self.block_size = B, Hkv, D, block_size
        nan = float("nan")
        if block_size is None:
            self.capacity = capacity
            shape = (B, capacity, Hkv, D)
            self.block_table = None
        else:
            max_blocks = math.ceil(capacity / block_size)
            self.capacity = max_blocks * block_size
            num_blocks = B * max_blocks + extra_blocks
            ids = torch.randperm(num_blocks, generator=gen)[: B * max_blocks]
            self.block_table = ids.view(B, max_blocks).to(torch.int32).to(device)
            shape = (num_blocks, block_size, Hkv, D)
        self.k = torch.full(shape, nan, dtype=dtype, device=device)
        self.v = torch.full(shape, nan, dtype=dtype, device=device)
        for b, n in enumerate(lengths):
            self.write(b, 0, torch.randn((n, Hkv, D), generator=gen).to(dtype),
                       torch.randn((n, Hkv, D), generator=gen).to(dtype))

    def flat_rows(self, b, start, n):
        """Row indices into the caches viewed as (rows, Hkv, D)."""
        j = torch.arange(start, start + n)
        if self.block_table is None:
            return b * self.capacity + j
        table = self.block_table.cpu().long()
        return table[b, j // self.block_size] * self.block_size + j % self.block_size

    def write(self, b, start, k_rows, v_rows):
        idx = self.flat_rows(b, start, k_rows.shape[0]).to(self.k.device)
        self.k.view(-1, self.Hkv, self.D)[idx] = k_rows.to(self.k.device, self.k.dtype)
        self.v.view(-1, self.Hkv, self.D)[idx] = v_rows.to(self.v.device, self.v.dtype)

    def gather(self, b, n):
        """(1, n, Hkv, D) fp32 keys and values of sequence b's first n rows."""
        idx = self.flat_rows(b, 0, n).to(self.k.device)
        k = self.k.view(-1, self.Hkv, self.D)[idx].float().cpu()
        v = self.v.view(-1, self.Hkv, self.D)[idx].float().cpu()
        return k[None], v[None]

    def snapshot(self):
        return self.k.clone(), self.v.clone()


def bits(t):
    """A tensor's raw bits, so NaN poison compares equal to itself."""
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def reference(q, cache, b, n_keys, opts, Hq):
    """fp32 (out, lse) of q (1, Sq, Hq, D) over sequence b's first n_keys rows."""
    k, v = cache.gather(b, n_keys)
    kw = {key: val for key, val in opts.items() if key != "alibi"}
    if opts.get("alibi"):
        kw["alibi_slopes"] = alibi_slopes(Hq)
    return attention_reference(q.float().cpu(), k, v, upcast=True, **kw)


def threads_with_other_outputs(cases, call, calls):
    """Makes `call(*case)` ((out, lse)) once per case alone, then `calls` times in
    one thread per case, all at once; returns the indices of the threads that
    got an output other than their case's alone."""
    want = [tuple(t.clone() for t in call(*case)) for case in cases]
    bad, barrier = [], threading.Barrier(len(cases))

    def worker(i):
        barrier.wait()
        for _ in range(calls):
            out, lse = call(*cases[i])
            if not (torch.equal(out, want[i][0]) and torch.equal(lse, want[i][1])):
                bad.append(i)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sorted(set(bad))
