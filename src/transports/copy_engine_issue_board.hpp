// Copy-engine calls of the PEs of one process: each PE's host records that it
// queued its transfers for a call, and returns from the call only once every
// same-process peer has queued its own.
//
// Why: a kernel waiting for a peer's copy-engine rows must never depend on an
// API call the peer's thread has yet to make. A thread blocked in a
// synchronous CUDA call (say, a device-to-host copy of this call's output,
// which waits for that very kernel) can hold a driver lock the peer's copy
// needs; the two then stall until the kernel's wait times out. Once every
// same-process peer has queued its copies, the kernel finishes without help
// from any host. Peers in other processes do not share the driver lock.
#pragma once
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

namespace symheap {

class IssueBoard {
 public:
  // Independent series of calls counted on one board (an op's kinds of call).
  static constexpr int kSeries = 2;

  // The board shared by every op of this process on the same symmetric
  // workspace (job, heap offset): the same op on each same-process PE.
  static std::shared_ptr<IssueBoard> for_workspace(uint64_t job, size_t ws_offset, int n_pes);

  // Records that `pe` queued its transfers of call number `seq` (1, 2, ...)
  // of series `series` (in [0, kSeries)), then waits until every PE of
  // `peers` has too. Throws TimeoutError naming `what` (the call) and the
  // first late PE after `timeout_s`.
  void publish_and_wait(int series, const char* what, int pe, uint64_t seq,
                        const std::vector<int>& peers, double timeout_s);

  explicit IssueBoard(int n_pes)
      : queued_{std::vector<uint64_t>(n_pes), std::vector<uint64_t>(n_pes)} {}

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<uint64_t> queued_[kSeries];  // per series: the last call number each PE queued
};

}  // namespace symheap
