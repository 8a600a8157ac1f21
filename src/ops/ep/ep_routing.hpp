// Routing of one PE's tokens, computed on the host (the cpu implementation).
//
// Send lists, per destination PE d:
//  token-major : the tokens with at least one kept expert on d, by token index;
//  expert-major: the kept (token, slot) pairs whose expert is on d, ordered by
//                expert id, then token, then slot.
// A pair's "combine row" is its index in the concatenation of the send lists
// of d = 0..n-1: the row of this PE's combine buffer where d returns it.
#pragma once
#include <cstdint>
#include <vector>

#include "ops/ep/ep_config.hpp"

namespace symheap::ep {

struct HostRouting {
  int32_t status = kOk;
  int64_t detail = 0;
  std::vector<int32_t> dest_count;    // [n] length of the send list to each PE
  std::vector<int32_t> expert_count;  // [E] kept (token, slot) pairs per expert
  // token-major [T, n], expert-major [T, topk]: position in the send list
  // (token-major) or within the expert's run (expert-major), -1 when not sent.
  std::vector<int32_t> pos;
  std::vector<int32_t> send_rows;  // same shape: combine row, or -1
};

inline int64_t read_index(const void* idx, bool int64, size_t i) {
  return int64 ? static_cast<const int64_t*>(idx)[i] : static_cast<const int32_t*>(idx)[i];
}

// Validates ids (status kExpertOutOfRange, routing nothing) and routes.
HostRouting route_on_host(const Config& c, const Geometry& g, const void* topk_idx, bool int64,
                          int64_t num_tokens);

}  // namespace symheap::ep
