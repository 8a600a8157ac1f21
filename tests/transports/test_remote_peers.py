"""Peers on another node (SYMHEAP_NODE_ID): kinds and transports; under
mpirun every host operation across nodes through the MPI remote engine
(remote_mpi_program.py); without an engine (a launch without MPI) the error
saying what is missing. two_nodes is backend-neutral (torch tensors):
tests/gpu runs it on cuda, where its PEs of two nodes share GPUs, which NCCL
will not connect, so the error names NCCL."""
import os
import re
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest

import symheap
from symheap import _core
from symheap.testing import run_processes

torch = pytest.importorskip("torch")

NODES = ["node-a", "node-b"]
PES_PER_NODE = 2  # 2 processes (one per node id) x 2 threads


def _node(pe):
    return NODES[pe // PES_PER_NODE]


def _refused_calls(x, src, sig, word, pe):
    calls = {"get": lambda: symheap.get(torch.empty_like(src), x, pe),
             "signal_op": lambda: symheap.signal_op(sig, 1, pe),
             "atomic_fetch_add": lambda: symheap.atomic_fetch_add(word, 1, pe),
             "atomic_compare_swap": lambda: symheap.atomic_compare_swap(word, 0, 1, pe),
             "atomic_swap": lambda: symheap.atomic_swap(word, 1, pe),
             "peer_tensor": lambda: symheap.peer_tensor(x, pe)}
    for via in ("auto", "load_store", "copy_engine"):
        calls[f"put/{via}"] = lambda via=via: symheap.put(x, src, pe, via=via)
        calls[f"put_signal/{via}"] = lambda via=via: symheap.put_signal(x, src, sig, 1, pe,
                                                                        via=via)
    return calls


def two_nodes():
    """One PE of a 2 nodes x 2 PEs job: refused calls to remote peers, then
    data, a signal and an atomic to the other PE of its node."""
    me, n = symheap.my_pe(), symheap.n_pes()
    kinds = [symheap.peer_kind(p) for p in range(n)]
    transports = [_core.transport_of(p) for p in range(n)]
    buddy = me ^ 1  # the other PE of this node (the other thread of this process)
    x = symheap.empty((256,), "float32")
    sig = symheap.empty((1,), "uint64")
    word = symheap.empty((1,), "int64")
    x.fill_(float("nan"))
    sig.zero_()
    word.zero_()
    src = torch.randn(256, device=x.device)
    symheap.barrier_all(timeout=30)

    messages = {}
    for p in range(n):
        if _node(p) == _node(me):
            continue
        for name, call in _refused_calls(x, src, sig, word, p).items():
            with pytest.raises(symheap.UnsupportedError) as err:
                call()
            messages[(p, name)] = str(err.value)
    from symheap.ep import EpConfig, EpDispatchCombine
    with pytest.raises(symheap.SymheapError) as err:  # every PE reports, none waits
        EpDispatchCombine(EpConfig(hidden=32, max_tokens_per_rank=4, num_experts=8, topk=2))
    messages[(None, "ep")] = str(err.value)
    symheap.barrier_all(timeout=30)  # through the bootstrap: some peers are remote
    untouched = bool(x.isnan().all()) and int(sig[0]) == 0 and int(word[0]) == 0
    symheap.barrier_all(timeout=30)

    # Peers of the same node still work: data, signal and atomic to the buddy.
    symheap.put_signal(x, src, sig, 1, buddy)
    symheap.signal_wait_until(sig, "eq", 1, timeout=30)
    received = x.cpu().numpy().copy()
    symheap.atomic_fetch_add(word, me + 1, buddy)
    symheap.barrier_all(timeout=30)
    fetched = torch.full_like(src, float("nan"))
    symheap.get(fetched, x, buddy)  # the buddy's copy holds what this PE sent
    symheap.quiet()
    total = int(word[0])
    symheap.barrier_all(timeout=30)
    for buf in (x, sig, word):
        symheap.free(buf)
    return (kinds, transports, messages, untouched, src.cpu().numpy(), received,
            fetched.cpu().numpy(), total)


def run_two_nodes(**kwargs):
    return run_processes(two_nodes, 2, threads_per_proc=2, init_kwargs={"timeout": 60.0},
                         env_per_proc=[{"SYMHEAP_NODE_ID": node} for node in NODES],
                         timeout=240, **kwargs)


def check_two_nodes(results):
    n = len(results)
    assert n == 4
    for me, r in enumerate(results):
        kinds, transports, messages, untouched, src, received, fetched, total = r
        buddy = me ^ 1
        expected = ["self" if p == me else "same_process" if _node(p) == _node(me) else "remote"
                    for p in range(n)]
        assert kinds == expected
        assert transports == ["remote" if k == "remote" else "load_store" for k in kinds]
        remote = [p for p in range(n) if _node(p) != _node(me)]
        ep = messages.pop((None, "ep"))
        # the first remote PE each PE meets, as every PE reports it
        for q in range(n):
            first = next(p for p in range(n) if _node(p) != _node(q))
            assert f"PE {q}: UnsupportedError: EpDispatchCombine (it needs every PE): PE " \
                f"{first} is remote (node '{_node(first)}'" in ep, ep
        assert "the remote transport cannot serve it" in ep, ep
        assert sorted({p for p, _ in messages}) == remote
        assert len(messages) == len(remote) * 12
        for (p, name), text in messages.items():
            assert f"PE {p} is remote (node '{_node(p)}'; PE {me} is on node '{_node(me)}')" \
                in text, (name, text)
            if name == "peer_tensor":  # a view needs a load/store path, whatever the engine
                assert "only the host RMA calls reach remote peers" in text, text
            else:
                assert "the remote transport cannot serve it" in text, (name, text)
                assert ("launch with mpirun and init with symheap.init_mpi" in text
                        if symheap_backend() == "cpu" else "NCCL" in text), (name, text)
        assert untouched  # no refused call wrote anything
        np.testing.assert_array_equal(received, results[buddy][4])
        np.testing.assert_array_equal(fetched, src)
        assert total == buddy + 1


def symheap_backend():
    return symheap.backend()  # the PEs' backend too: they inherit the environment


def test_two_nodes_of_two_pes_without_mpi():
    """A launch without MPI: remote peers raise the error naming the way to an engine."""
    check_two_nodes(run_two_nodes())


HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def run_mpi_program(scenario, timeout_s, mpirun_args=(), survivors=(0, 1, 2, 3),
                    pes_per_node=2, nodes=None, env=None):
    """remote_mpi_program.py under mpirun: 2 processes (nodes) x ``pes_per_node``
    PE threads (or, with ``nodes``, one process per entry, on that node);
    every PE of ``survivors`` must report OK (and, when all do, mpirun succeed)."""
    pytest.importorskip("mpi4py")
    mpirun = shutil.which("mpirun")
    assert mpirun, "mpirun not found: scripts/setup.sh installs OpenMPI"
    env = dict(os.environ, SYMHEAP_BACKEND="cpu", OMPI_ALLOW_RUN_AS_ROOT="1",
               OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMPI_MCA_rmaps_base_oversubscribe="1",
               SYMHEAP_TEST_PES_PER_NODE=str(pes_per_node),
               SYMHEAP_TEST_NODES=",".join(map(str, nodes or ())),
               # The ranks import the symheap this test imported (installed, or the
               # source tree with a built extension).
               PYTHONPATH=os.path.dirname(os.path.dirname(symheap.__file__)) + os.pathsep +
               os.environ.get("PYTHONPATH", ""), **(env or {}))
    cmd = [mpirun, "-np", str(len(nodes) if nodes else 2), "--oversubscribe", "--bind-to", "none",
           *mpirun_args, sys.executable,
           os.path.join(HERE, "remote_mpi_program.py"), scenario, str(timeout_s)]
    # Its own session, so that a hang kills mpirun and every process it started.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, cwd=ROOT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"mpirun {scenario} did not finish within 120 s:\n{out[-6000:]}")
    if len(survivors) == (len(nodes) if nodes else 2) * pes_per_node:
        assert proc.returncode == 0, out[-6000:]
    assert sorted(re.findall(rf"OK {scenario} pe (\d)", out)) == [str(r) for r in survivors], \
        out[-6000:]
    return out


def test_remote_rma_under_mpirun():
    """put, get, put_signal + signal_wait_until, signal_op, the three atomics
    (from several PEs at once), quiet and barrier across nodes, 1 B to 3 MiB,
    against numpy; then finalize, init again and the same once more."""
    run_mpi_program("rma", 20)


def test_remote_bad_input_under_mpirun():
    """Bad arguments aimed at a remote PE raise before anything is sent."""
    run_mpi_program("bad_input", 20)


def test_remote_without_thread_multiple_under_mpirun():
    """MPI initialised with MPI_THREAD_FUNNELED: the error names MPI_THREAD_MULTIPLE."""
    run_mpi_program("funneled", 20)


def test_remote_refused_request_under_mpirun():
    """A put its target cannot serve (sent raw: symheap checks offsets before
    sending): the requester's quiet raises symheap.RemoteError with the target
    PE and the op at once; the pair goes on."""
    run_mpi_program("refused", 20)


def test_remote_frozen_peer_under_mpirun():
    """A frozen (SIGSTOP) remote process: get and quiet raise TimeoutError
    naming the PE within the 3 s timeout, a second quiet too (the put is not
    served yet); once it goes on, a quiet confirms the put and the job finishes."""
    out = run_mpi_program("frozen", 3)
    assert len(re.findall(r"FROZEN-ERROR pe \d: quiet on PE \d: PE [23] \(node 'node-1'\) "
                          r"did not answer within 3 s", out)) == 2, out[-6000:]


def test_remote_killed_peer_under_mpirun():
    """A killed remote process (SIGKILL): the survivors' remote get raises an
    error naming a PE of it, cut short by the bootstrap's dead-PE notice, and
    they finalize. --enable-recovery keeps mpirun from killing the survivors."""
    out = run_mpi_program("killed", 5, mpirun_args=["--enable-recovery"], survivors=(0, 1))
    errors = re.findall(r"KILLED-ERROR pe (\d) after [\d.]+ s: (.*)", out)
    assert sorted(pe for pe, _ in errors) == ["0", "1"], out[-6000:]
    for _, text in errors:
        assert re.search(r"PE [23] died", text), text


def test_ep_across_nodes_under_mpirun():
    """symheap.ep with half of every PE's peers on the other node: every routing
    pattern in each layout and dtype, dispatch / combine / redispatch checked
    against references (rows for remote PEs go through the remote transport),
    once forwarded inside nodes and once per PE: dispatch and redispatch give
    the same bits both ways."""
    run_mpi_program("ep", 30)


def test_ep_across_nodes_three_pes_per_node_under_mpirun():
    """The same with 2 nodes x 3 PEs (forwarders serve sources of every local index)."""
    run_mpi_program("ep", 30, survivors=tuple(range(6)), pes_per_node=3)


def test_ep_across_nodes_of_unequal_size_under_mpirun():
    """Nodes of 2 PEs and 1 PE (3 processes of one PE thread): both PEs of the
    first node forward through the single PE of the second, which forwards
    through the first node's PE 0."""
    run_mpi_program("ep", 30, survivors=(0, 1, 2), pes_per_node=1, nodes=(0, 0, 1))


def test_ep_forwarding_bytes_under_mpirun():
    """Tokens bound for every PE: forwarded inside the node, a dispatch and a
    redispatch (same outputs bit for bit) and a combine send fewer bytes
    across nodes than per PE."""
    out = run_mpi_program("ep_bytes", 30)
    lines = re.findall(r"BYTES pe \d: forwarded \d+ per-PE \d+; combine .*; redispatch", out)
    assert len(lines) == 4, out[-6000:]


def test_ep_frozen_node_under_mpirun():
    """A frozen (SIGSTOP) node whose PEs forward for the caller: dispatch raises
    TimeoutError naming the forwarder within the 3 s timeout; the job then finishes."""
    out = run_mpi_program("ep_frozen", 3)
    assert len(re.findall(r"EP-FROZEN-ERROR pe [01]: .*?timed out after", out)) == 2, out[-6000:]


def test_ep_device_kernels_across_nodes_under_mpirun():
    """The device kernels (host emulation: one PE per process, 2 nodes of one
    PE) with kernel='copy_engine': count rows and packed rows for the other
    node go through the remote transport; every routing pattern checked
    against references and against the cpu implementation bit for bit."""
    run_mpi_program("ep_device", 20, survivors=(0, 1), pes_per_node=1)


def test_ep_device_kernels_across_unequal_nodes_under_mpirun():
    """The same with nodes of 2 PEs and 1 PE: mapped peers get the kernels'
    stores and the copy engine, the other node the remote transport."""
    run_mpi_program("ep_device", 20, survivors=(0, 1, 2), pes_per_node=1, nodes=(0, 0, 1),
                    env={"SYMHEAP_TEST_EP_QUICK": "1"})


def test_ep_device_kernels_forwarding_inside_nodes_under_mpirun():
    """The device kernels on 2 nodes x 2 PEs (4 processes): forwarding
    inside nodes (kernel='copy_engine': a token crosses once per node, to the
    forwarder there) gives dispatch outputs bit for bit those of per-PE
    sending in every routing pattern, checked against references, and sends
    fewer bytes across nodes."""
    out = run_mpi_program("ep_device_fwd", 20, survivors=(0, 1, 2, 3), pes_per_node=1,
                          nodes=(0, 0, 1, 1))
    assert len(re.findall(r"DEVICE-BYTES pe \d: forwarded \d+ per-PE \d+", out)) == 4, out[-6000:]


def test_ep_device_kernels_forwarding_late_pe_under_mpirun():
    """The forwarders' waits on the device path are bounded: PE 3 skips a
    combine; the others raise TimeoutError within the 3 s timeout, the
    forwarders naming PE 3 and what they waited for; the job then finishes."""
    out = run_mpi_program("ep_device_fwd_late", 3, survivors=(0, 1, 2, 3), pes_per_node=1,
                          nodes=(0, 0, 1, 1))
    assert len(re.findall(r"EP-LATE-ERROR pe [012]: .*?timed out after", out)) == 3, out[-6000:]
