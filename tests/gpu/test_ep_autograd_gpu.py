"""symheap.ep.dispatch / combine under torch autograd on CUDA GPUs: every kernel and
layout against the single-PE fp32 reference of the cpu tests
(tests/ep/ep_autograd_programs.py), threads and one process per GPU (combine's gradient:
the redispatch kernels, a dispatch on copy_engine), and low_latency forward + backward
captured in a CUDA graph and replayed with new data and routing."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "ep"))

from symheap.testing import run_threads  # noqa: E402

import ep_autograd_programs as progs  # noqa: E402

two_gpus = pytest.mark.two_gpus
KERNELS = ["intranode", "low_latency", "copy_engine"]
LAYOUTS = ["token_major", "token_slots", "expert_major"]
# token_slots runs on the SM kernels only (EpConfig refuses it with copy_engine).
KERNEL_LAYOUTS = [(k, l) for k in KERNELS for l in LAYOUTS
                  if not (l == "token_slots" and k == "copy_engine")]


def cfg(**kw):
    base = dict(hidden=64, max_tokens_per_rank=40, num_experts=8, topk=3, dtype="float32")
    base.update(kw)
    return base


def per_device(fn, args):
    from launch import run_process_per_device
    return run_process_per_device(fn, [0, 1], args=args)


@two_gpus
@pytest.mark.parametrize("kernel,layout", KERNEL_LAYOUTS)
def test_threads(kernel, layout):
    c, tokens = cfg(kernel=kernel, layout=layout), [40, 23]
    progs.check_against_reference(run_threads(progs.layer_grads, 2, args=(c, 11, tokens)),
                                  c, 11, tokens)


@two_gpus
def test_intranode_with_max_recv_tokens():
    """Padded outputs (rows past num_recv_tokens are stale) must not leak into gradients."""
    c, tokens = cfg(max_recv_tokens=70), [30, 40]
    progs.check_against_reference(run_threads(progs.layer_grads, 2, args=(c, 12, tokens)),
                                  c, 12, tokens)


# The layouts with fixed shapes (symheap.jax's): combine's gradient is a redispatch
# through the forward's handle; 1100 tokens give combine per-row flags.
FIXED_SHAPES = [dict(layout="token_slots"), dict(layout="expert_major"),
                dict(kernel="low_latency"), dict(max_recv_tokens=2200)]


@two_gpus
@pytest.mark.parametrize("launch", ["threads", "processes"])
@pytest.mark.parametrize("kw", FIXED_SHAPES, ids=lambda kw: "-".join(map(str, kw.values())))
def test_combine_gradient_by_redispatch(kw, launch):
    c, tokens = cfg(max_tokens_per_rank=1100, **kw), [1100, 700]
    args = (c, 14, tokens)
    by_pe = run_threads(progs.layer_grads, 2, args=args) if launch == "threads" else \
        per_device(progs.layer_grads, args)
    progs.check_against_reference(by_pe, c, 14, tokens)


@two_gpus
@pytest.mark.parametrize("layout", ["token_major", "expert_major"])
def test_process_per_gpu(layout):
    c, tokens = cfg(kernel="low_latency", layout=layout), [40, 0]
    progs.check_against_reference(per_device(progs.layer_grads, (c, 13, tokens)), c, 13, tokens)


@two_gpus
@pytest.mark.parametrize("layout", LAYOUTS)
def test_low_latency_graph_capture_forward_backward(layout):
    c, tokens, seeds = cfg(kernel="low_latency", layout=layout), [40, 40], [21, 22, 23]
    by_pe = per_device(progs.graph_layer_grads, (c, seeds, tokens))
    for i, seed in enumerate(seeds):
        progs.check_against_reference([r[i] for r in by_pe], c, seed, tokens)
