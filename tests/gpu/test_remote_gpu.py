"""Remote peers on the cuda backend: two processes on one host declare
different nodes (SYMHEAP_NODE_ID), each driving both GPUs from two threads.
Same checks as tests/transports/test_remote_peers.py: peer kinds and transports, every
operation on a remote peer raises the error naming the peer, its node and the
missing transport, and same-node peers still move data."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "transports"))

import test_remote_peers as remote  # noqa: E402


@pytest.mark.two_gpus
def test_two_nodes_of_two_pes_cuda():
    remote.check_two_nodes(remote.run_two_nodes())
