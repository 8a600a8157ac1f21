"""symheap.jax on CUDA GPUs (2 devices): the cpu scenarios of tests/jax on the gpu
platform, each in its own process, plus XLA command buffers on."""
import json
import os
import random
import subprocess
import sys

import pytest

pytest.importorskip("jax")

HERE = os.path.dirname(os.path.abspath(__file__))
PROGRAM = os.path.join(HERE, os.pardir, "jax", "jax_programs.py")
LAYOUTS = ["token_slots", "expert_major", "low_latency", "intranode", "fp8"]


DEVICE_OPS = os.path.join(HERE, os.pardir, "jax", "jax_ep_device_ops.py")


def run(name: str, xla_flags: str = "", program: str = PROGRAM, extra_env=None,
        **kwargs) -> str:
    env = dict(os.environ, **(extra_env or {}))
    env.pop("JAX_PLATFORMS", None)
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"  # leave room for the symmetric heaps
    env["XLA_FLAGS"] = xla_flags
    env["SYMHEAP_BACKEND"] = "cuda"
    kwargs.setdefault("seed", random.SystemRandom().randrange(1 << 30))
    proc = subprocess.run([sys.executable, program, name, json.dumps(kwargs)], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=300)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout[-6000:]
    return proc.stdout


pytestmark = pytest.mark.two_gpus


def test_threads_two_gpus_every_layout():
    # forward, and d/d(x, topk_weights) through both custom_vjps (fp8: forward only;
    # fp8_low_latency: token-major rows and scales a PE sends itself stored straight
    # into XLA's results)
    run("threads", n=2, layouts=LAYOUTS + ["fp8_low_latency"], iters=3)


def test_shard_map_two_gpus():
    run("shard_map_ep", n=2, layouts=LAYOUTS[:-1])  # fp8: threads only


def test_gradients_on_device():
    # dispatch's gradient alone, and combine's (by the CUDA redispatch kernels) row by
    # row against the fp32 reference and end to end, every layout, two steps each
    run("gradients", n=2, layouts=LAYOUTS[:-1])


def test_command_buffers_on():
    # The EP handlers claim command-buffer compatibility: with every command type on and
    # graphs of one call allowed, XLA records them into its graphs (the attention and
    # barrier handlers stay outside) and the results must stay right call after call.
    flags = ("--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL,CUBLAS "
             "--xla_gpu_graph_min_graph_size=1")
    run("threads", xla_flags=flags, n=2, layouts=["token_slots", "low_latency"], grad=False,
        iters=4)
    run("shard_map_ep", xla_flags=flags, n=2, layouts=["expert_major"], grad=False)


def test_chained_pairs_replayed_from_command_buffers():
    # XLA's default flags: 8 dependent pairs in one shard_map program are graph replays
    # after the first runs (no handler called), exact at every run; the cached program
    # of a closed op, then of a finalized runtime, raises (ep_initialize, before the
    # replay) instead of launching kernels on freed memory.
    run("replayed_chain", n=2, replayed=True)
    # and outside the command buffers (the handlers registered without the claim)
    env = {"SYMHEAP_JAX_EP_COMMAND_BUFFER": "0"}
    run("replayed_chain", n=2, replayed=False, extra_env=env)


def test_peers_store_into_xla_results_two_gpus():
    # Both GPUs in one process (shard_map): each PE's dispatch is the one kernel the torch
    # path runs (the peers store their rows straight into XLA's results: no collect
    # kernel, memset, copy or host sync), combine one kernel too, and combine(dispatch(x).x)
    # is right. Two launches per dispatch here means the peers could not write XLA's
    # buffers and the call fell back to the collect kernel (docs/jax.md).
    out = run("shard_map", program=DEVICE_OPS, n=2)
    counts = json.loads(out.split("COUNTS ", 1)[1].splitlines()[0])
    one_kernel = {"launches": 1, "memsets": 0, "copies": 0, "stream_waits": 0, "host_syncs": 0}
    for layout, pes in counts.items():
        for pe, calls in enumerate(pes):
            assert calls == {"dispatch": one_kernel, "combine": one_kernel}, (layout, pe, calls)


def test_large_batches_two_gpus():
    # tokens * topk past one round of loads (the look-back ranking paths) and thousands of
    # rows: dispatch stores its own rows straight into XLA's results, collect copies the
    # peers' within the counts, and the rows past them read as empty (ids -1, weights 0)
    layouts = ["intranode", "low_latency", "expert_major"]
    run("threads", n=2, layouts=layouts + ["fp8_low_latency"], tokens=1500, iters=2)
    run("shard_map_ep", n=2, layouts=layouts, tokens=1500)


def test_ops_in_turn_two_gpus():
    # Ops created one after another in one process (each closed first: the same heap
    # range), one shard_map dispatch each, past one round of loads: each op's first
    # dispatch must count its own blocks, not words the previous op left at that epoch.
    # Prints every PE's receive counts for every dispatch.
    print(run("ops_in_turn", n=2, tokens=1500))
