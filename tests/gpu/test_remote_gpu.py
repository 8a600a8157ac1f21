"""Remote peers on the cuda backend, through the NCCL engine.

Two processes on one host, one GPU each, declare different nodes
(SYMHEAP_NODE_ID) and tell NCCL the same (NCCL_HOSTID, no P2P, no SHM, the
socket transport on loopback), so every byte between them crosses NCCL's
network path (remote_nccl_program.py). Also: two processes x two threads
sharing both GPUs, where NCCL refuses two ranks of one pair on one GPU, so
the remote calls raise naming NCCL while same-node peers still move data.
"""
import os
import re
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "transports"))

import remote_nccl_program as prog  # noqa: E402
import test_remote_peers as remote  # noqa: E402


@pytest.mark.two_gpus
def test_remote_rma_through_nccl():
    """put, get, put_signal + signal_wait_until, signal_op, atomics, quiet and
    barrier across the two nodes, 8 B to 64 MiB on fresh random data against
    the expected bytes (destinations poisoned first), a put ordered after its
    stream's earlier work, the bytes-across-nodes counter; then finalize, init
    again and move data once more."""
    results = prog.run_two_nodes([("rma", (0,), True), ("small_roundtrip", (), True)])
    prog.check_rma([results[r][0] for r in range(2)])
    assert all(results[r][1] is True for r in range(2))


@pytest.mark.two_gpus
def test_remote_threads_sharing_a_pair_through_nccl():
    """Four threads of each PE run atomics on one remote word while a fifth
    puts and quiets on the same pair: every fetched old value comes back once
    (answers reach their own requests) and the bytes land."""
    results = prog.run_two_nodes([("threads_sharing_a_pair", (), True)])
    assert all(results[r][0] is True for r in range(2))


@pytest.mark.two_gpus
@pytest.mark.parametrize("how", ["frozen", "killed"])
def test_remote_lost_peer_through_nccl(how):
    """PE 1 stops (SIGSTOP) or dies (SIGKILL): PE 0's put + quiet raises an
    error naming PE 1 within its 5 s timeout, never hangs."""
    timeout = 5.0
    results = prog.run_two_nodes([("lost_peer", (how,), False)], timeout=timeout, wait_s=90,
                                 ranks_expected=(0,))
    message, elapsed = results[0]
    assert re.search(r"PE 1\b", message), message
    if how == "frozen":
        assert message.startswith("TimeoutError"), message
    else:
        assert message.startswith(("TimeoutError", "SymheapError")), message
    assert elapsed < 2 * timeout + 5, (elapsed, message)


@pytest.mark.two_gpus
def test_ep_across_nodes_through_nccl():
    """symheap.ep with kernel='copy_engine' between the two nodes: count rows,
    rows, statuses and flags through the NCCL engine; every routing pattern
    checked against the references in both layouts, fp8 with scales, and
    hidden 7168 x 1024 tokens, top-8 of 256; each PE digests what it received."""
    results = prog.run_two_nodes([("ep_across_nodes", (), True)], timeout=60.0,
                                 heap_size="2G", wait_s=150.0)
    digests = [results[r][0] for r in range(2)]
    assert len(digests[0]) == 5 and all(isinstance(d, str) for d in digests[0]), digests


@pytest.mark.two_gpus
def test_two_nodes_of_two_pes_sharing_gpus():
    """PEs of different nodes on one GPU: NCCL will not connect them, init
    goes on and every remote call raises the error naming the peer and NCCL."""
    remote.check_two_nodes(remote.run_two_nodes())


@pytest.mark.two_gpus
def test_ep_forwarding_inside_nodes_through_nccl():
    """symheap.ep (kernel='copy_engine') on 2 nodes x 2 PEs, a node's two PEs
    processes on its GPU: forwarding inside each node (a token
    crosses once per node, to the forwarder there, which stores it into its
    node's receive buffers; combine sums there, one row crosses back) against
    per-PE sending (SYMHEAP_EP_HIERARCHICAL=0): every routing pattern checked
    against the references both ways, in both layouts, fp8 with scales and
    hidden 7168 x 1024 tokens, top-8 of 256; the received rows and, with
    every token bound for every PE, every dispatch output the same bits both
    ways, and fewer bytes across nodes forwarded, in dispatch and combine."""
    results = prog.run_two_nodes_of_two_pes("ep_forwarding", timeout=60.0, heap_size="2G",
                                            wait_s=240.0)
    for pe in range(4):
        digests, sent, sent_back = results[pe]
        assert len(digests) == 2 and len(digests[0]) == 5, digests
        assert sent[0] < sent[1] and sent_back[0] < sent_back[1], (sent, sent_back)
