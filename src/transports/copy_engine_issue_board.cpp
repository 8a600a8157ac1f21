#include "transports/copy_engine_issue_board.hpp"

#include <chrono>
#include <map>
#include <string>
#include <utility>

#include "symheap/errors.hpp"

namespace symheap {

std::shared_ptr<IssueBoard> IssueBoard::for_workspace(uint64_t job, size_t ws_offset, int n_pes) {
  // Ops on one workspace are created after the previous ones were destroyed on
  // every PE (freeing the workspace is collective), so an expired entry is
  // never mistaken for a live one.
  static std::mutex mu;
  static std::map<std::pair<uint64_t, size_t>, std::weak_ptr<IssueBoard>> boards;
  std::lock_guard<std::mutex> lock(mu);
  for (auto it = boards.begin(); it != boards.end();)  // drop expired entries
    it = it->second.expired() ? boards.erase(it) : std::next(it);
  auto& slot = boards[{job, ws_offset}];
  auto board = slot.lock();
  if (!board) {
    board = std::make_shared<IssueBoard>(n_pes);
    slot = board;
  }
  return board;
}

void IssueBoard::publish_and_wait(int series, const char* what, int pe, uint64_t seq,
                                  const std::vector<int>& peers, double timeout_s) {
  std::unique_lock<std::mutex> lock(mu_);
  std::vector<uint64_t>& queued = queued_[series];
  queued.at(pe) = seq;
  cv_.notify_all();
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                            std::chrono::duration<double>(timeout_s));
  for (int q : peers) {
    if (cv_.wait_until(lock, deadline, [&] { return queued.at(q) >= seq; })) continue;
    throw TimeoutError(std::string(what) + " on PE " + std::to_string(pe) + ": timed out after " +
                       std::to_string(timeout_s) + " s waiting for PE " + std::to_string(q) +
                       " (same process) to queue its copy-engine transfers (did every PE "
                       "make the same call?); the op is unusable now");
  }
}

}  // namespace symheap
