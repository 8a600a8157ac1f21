"""symheap.jax on the cpu platform: each scenario runs jax_programs.py in its own
process (XLA_FLAGS sets the device count there), with fresh random data."""
import json
import os
import random
import socket
import subprocess
import sys

import pytest

pytest.importorskip("jax")

from symheap import _core  # noqa: E402

if not getattr(_core, "built_with_xla_ffi", False):
    raise RuntimeError("symheap was built without the XLA FFI handlers (jaxlib's FFI headers "
                       "were not found at build time), so symheap.jax cannot run: rebuild "
                       "with jax installed")

HERE = os.path.dirname(os.path.abspath(__file__))
PROGRAM = os.path.join(HERE, "jax_programs.py")
ALL_LAYOUTS = ["token_slots", "expert_major", "low_latency", "intranode"]


def env(devices: int) -> dict:
    e = dict(os.environ)
    e["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    e["SYMHEAP_BACKEND"] = "cpu"
    e["JAX_PLATFORMS"] = "cpu"
    e["PYTHONPATH"] = os.pathsep.join([os.path.dirname(_core.__file__) + "/..",
                                       e.get("PYTHONPATH", "")])
    return e


def launch(name: str, devices: int, extra_env: dict | None = None, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, PROGRAM, name, json.dumps(kwargs)],
                            env={**env(devices), **(extra_env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(proc: subprocess.Popen, timeout: float = 240) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        raise AssertionError(f"timed out:\n{out[-4000:]}")
    assert proc.returncode == 0 and "OK" in out, out[-6000:]
    return out


def seed() -> int:
    return random.SystemRandom().randrange(1 << 30)


@pytest.mark.parametrize("n,layouts", [(2, ALL_LAYOUTS + ["fp8", "fp8_low_latency"]),
                                       (4, ["expert_major", "intranode"]),
                                       (8, ["token_slots"])])
def test_one_thread_per_device(n, layouts):
    finish(launch("threads", 8, n=n, layouts=layouts, seed=seed(), iters=2 if n == 2 else 1))


@pytest.mark.parametrize("n,layouts", [(2, ALL_LAYOUTS), (4, ["expert_major"])])
def test_gradients(n, layouts):
    """Combine's gradient (a redispatch through the forward's handle) and dispatch's,
    each against the single-PE reference."""
    finish(launch("gradients", 8, n=n, layouts=layouts, seed=seed()))


def test_shard_map_eight_devices_and_permuted_mesh():
    finish(launch("shard_map_ep", 8, n=8, layouts=["token_slots", "expert_major"], seed=seed()))


def test_chained_pairs_exact_and_closed_ops_raise():
    # 8 dependent pairs in one shard_map program, five runs: exact every run, each run
    # calls every handler once per PE (no command buffers on cpu; tests/gpu replays them),
    # and the cached program of a closed op or a finalized runtime raises
    finish(launch("replayed_chain", 2, n=2, seed=seed()))


def test_failures_are_clean_errors():
    out = finish(launch("failures", 8, seed=seed()))
    assert "timed out" in out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("bad_config", [False, True])
def test_jax_distributed_two_processes(bad_config):
    port, s = _free_port(), seed()
    procs = [launch("distributed", 4, process_id=p, n_processes=2, port=port, seed=s,
                    bad_config=bad_config) for p in range(2)]
    outs = [finish(p) for p in procs]
    if not bad_config:
        assert "OK distributed 0 [0, 1, 2, 3]" in outs[0]
        assert "OK distributed 1 [4, 5, 6, 7]" in outs[1]


def test_device_kernels_emulated_under_jax_distributed():
    """The CUDA kernels' host emulation (one PE per process) behind the XLA handlers:
    dispatch's own rows (and fp8 scales) stored straight into XLA's result, the peers'
    rows copied there within the counts (collect_kernel), the defaults past them; every
    layout, threads and shard_map, forward and gradients."""
    port, s = _free_port(), seed()
    procs = [launch("distributed", 1, {"SYMHEAP_EP_EMULATE_DEVICE": "1"}, process_id=p,
                    n_processes=2, port=port, seed=s, layouts=ALL_LAYOUTS + ["fp8_low_latency"])
             for p in range(2)]
    outs = [finish(p) for p in procs]
    for p, out in enumerate(outs):
        assert f"OK distributed {p} [{p}]" in out, out[-3000:]


def test_ops_in_turn_emulated_under_jax_distributed():
    """EP ops created one after another (each closed first) get the same heap range; one
    shard_map dispatch and combine each, past one round of loads (180 tokens of top-3 in
    the emulation): a new op's first call starts at the epoch the previous op's words
    ended on and must not take them for its own (the dispatch blocks' look-back and
    ticket 0's totals)."""
    port, s = _free_port(), seed()
    layouts = ["low_latency", "intranode"]
    procs = [launch("distributed", 1, {"SYMHEAP_EP_EMULATE_DEVICE": "1"}, process_id=p,
                    n_processes=2, port=port, seed=s, layouts=layouts, tokens=180,
                    threads_step=False, grad=False)
             for p in range(2)]
    outs = [finish(p) for p in procs]
    for p, out in enumerate(outs):
        assert f"OK distributed {p} [{p}]" in out, out[-3000:]


def test_jax_issues_the_device_operations_of_the_torch_path():
    """One PE on the CUDA kernels' host emulation (the core counts what both runtimes
    issue): per layout, a dispatch and a combine inside jit issue exactly the kernels,
    memsets, copies, stream waits and host syncs that the torch front end's do. The
    received rows go straight into XLA's results (no copy after the dispatch kernel),
    and the results match a numpy reference (jax_ep_device_ops.check_jax)."""
    pytest.importorskip("torch")
    from symheap.testing import run_processes
    import jax_ep_device_ops as prog
    emulate = {"SYMHEAP_EP_EMULATE_DEVICE": "1", "SYMHEAP_TIMEOUT": "20"}
    proc = subprocess.Popen([sys.executable, os.path.join(HERE, "jax_ep_device_ops.py"), "jax",
                             json.dumps({"seed": seed()})], env={**env(1), **emulate},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = finish(proc)
    jax_ops = json.loads(out.split("COUNTS ", 1)[1].splitlines()[0])
    torch_ops = run_processes(prog.torch_counts, 1, env=emulate, timeout=240)[0]
    assert jax_ops == torch_ops, (jax_ops, torch_ops)
    for layout, calls in jax_ops.items():  # one kernel each, nothing else
        assert calls["dispatch"] == {"launches": 1, "memsets": 0, "copies": 0,
                                     "stream_waits": 0, "host_syncs": 0}, (layout, calls)
        assert calls["combine"]["launches"] == 1, (layout, calls)
