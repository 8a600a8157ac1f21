// CUDA kernels of expert-parallel dispatch/combine. The protocol is the cpu
// implementation's (ep_cpu.cpp): routing counts exchanged through every PE's
// count rows, rows stored straight into their final place, epoch flags.
//
// Blocks never wait on a block of their own grid that may not have started,
// only on blocks that took an earlier ticket and on kernels of other PEs, so
// no grid needs to be co-resident:
//   dispatch       every block counts and ranks its own tokens, publishes
//                  its counts for the blocks after it and adds them to this
//                  PE's totals (token-major: also to every PE's destination
//                  sums); it takes its rank offsets from the blocks before
//                  it (a look-back). Ticket 0 publishes this PE's count row
//                  (epoch-tagged words, no fence) from the totals once every
//                  block added to them, or after a grace period from a count
//                  of its own (small calls rank from one round of loads,
//                  with no look-back). Every block waits for every PE's
//                  counts (token-major blocks with a look-back: from the
//                  sums, unless a count row comes first), stores its rows
//                  into peers (or, in pack mode, into local staging for the
//                  copy engines) and adds 1 to each peer's data flag;
//                  token-major, the block with the last ticket then waits
//                  for every PE's blocks; expert-major, the last block to
//                  arrive does, and copies the rows' metadata into the
//                  handle, helped by the few blocks that arrived just
//                  before it when the rows land soon (a bounded wait);
//   dispatch_slots (token_slots) rows go to fixed rows, so blocks wait only
//                  for each destination's "entered" word; block 0 counts,
//                  publishes the count row and writes the outputs meanwhile;
//   combine        (intranode, low_latency) blocks take roles in the order
//                  they start: senders wait until each source consumed its
//                  combine buffer (unless it has two, used in turn), store
//                  rows back into it (in the order of a shared counter)
//                  and flag each piece of a row;
//                  reducers (started after every sender) sum
//                  each token once its pieces have landed; the last reducer
//                  to finish marks this PE's buffer consumed on every peer
//                  (with two buffers, the last to start ends the call);
//   combine_pack / combine_reduce   the copy engine's combine: stage and plan,
//                  then (after the host's copies) sum;
//   collect        (after a dispatch, when the caller owns the outputs and
//                  the peers did not store into them) the rows within the
//                  counts, from the receive buffer to them;
//   count_row      (copy engine, PEs on other nodes) this PE's count row for
//                  the host to put there (ep_remote.cuh);
//   forward_rows / forward_sums   (copy engine, forwarding inside a node)
//                  the rows a source on another node put here once, into
//                  this node's PEs' receive buffers; combine's sums of its
//                  tokens' rows on this node, sent back as one row each
//                  (ep_forward.cuh);
//   redispatch_store / redispatch_pull   combine's reverse through a handle
//                  (intranode, low_latency): each PE stores its rows into its
//                  own combine buffer, then each pulls the rows it received.
// Small batches split each row between several warps, so a call of a few
// hundred rows still uses the whole GPU.
// Epochs live on the device, so the launches can be captured in a CUDA graph
// and replayed. Every wait gives up after timeout_ns, recording the late PE
// in the error word (and its host-mapped mirror); the host raises it.
//
// The file also compiles as host C++ (ep_device_compat.hpp): the cpu test
// suite runs these kernels in an emulation (ep_emulated.cpp).
#pragma once
#include "ops/ep/ep_collect.cuh"
#include "ops/ep/ep_combine.cuh"
#include "ops/ep/ep_dispatch.cuh"
#include "ops/ep/ep_dispatch_slots.cuh"
#include "ops/ep/ep_forward.cuh"
#include "ops/ep/ep_redispatch.cuh"
#include "ops/ep/ep_remote.cuh"

namespace symheap::ep::EP_DEVICE_NS::kernels {

// Calls f(kernel) for every kernel above. The CUDA runtime loads them all when
// an op is made: with lazy module loading, a kernel's first launch may wait
// for every kernel running on the device, and a launch made while a wait
// spins (this PE's next grid, or the remote engine's landing of the bytes it
// waits for) must never wait for it.
template <class F>
void for_each_kernel(F&& f) {
  f(dispatch_kernel<kSmallTokenMajor>);
  f(dispatch_kernel<kLargeTokenMajor>);
  f(dispatch_kernel<kAnyDispatch>);
  f(finish_kernel);
  f(dispatch_slots_kernel);
  f(collect_kernel);
  f(combine_kernel);
  f(combine_pack_kernel);
  f(combine_reduce_kernel);
  f(redispatch_store_kernel);
  f(redispatch_pull_kernel);
  f(count_row_kernel);
  f(forward_rows_kernel);
  f(forward_sums_kernel);
}

}  // namespace symheap::ep::EP_DEVICE_NS::kernels
