#include "ops/ep/ep_routing.hpp"

#include <algorithm>
#include <limits>

namespace symheap::ep {

HostRouting route_on_host(const Config& c, const Geometry& g, const void* topk_idx, bool int64,
                          int64_t T) {
  const int n = g.n_pes, K = c.topk, E = c.num_experts, L = g.local_experts;
  HostRouting r;
  r.dest_count.assign(n, 0);
  r.expert_count.assign(E, 0);
  for (int64_t i = 0; i < T * K; ++i) {
    int64_t id = read_index(topk_idx, int64, static_cast<size_t>(i));
    if (id < -1 || id >= E) {
      r.status = kExpertOutOfRange;
      r.detail = std::clamp<int64_t>(id, std::numeric_limits<int32_t>::min(),
                                     std::numeric_limits<int32_t>::max());
      return r;
    }
  }
  auto id_at = [&](int64_t t, int k) {
    return read_index(topk_idx, int64, static_cast<size_t>(t * K + k));
  };
  if (c.layout == Layout::TokenMajor) {
    r.pos.assign(static_cast<size_t>(T) * n, -1);
    std::vector<char> hit(n);
    for (int64_t t = 0; t < T; ++t) {
      std::fill(hit.begin(), hit.end(), 0);
      for (int k = 0; k < K; ++k) {
        int64_t id = id_at(t, k);
        if (id < 0) continue;
        hit[id / L] = 1;
        ++r.expert_count[id];
      }
      for (int d = 0; d < n; ++d)
        if (hit[d]) r.pos[t * n + d] = r.dest_count[d]++;
    }
    std::vector<int32_t> base(n, 0);
    for (int d = 1; d < n; ++d) base[d] = base[d - 1] + r.dest_count[d - 1];
    r.send_rows.assign(r.pos.size(), -1);
    for (int64_t t = 0; t < T; ++t)
      for (int d = 0; d < n; ++d)
        if (r.pos[t * n + d] >= 0) r.send_rows[t * n + d] = base[d] + r.pos[t * n + d];
  } else {
    r.pos.assign(static_cast<size_t>(T) * K, -1);
    for (int64_t t = 0; t < T; ++t)
      for (int k = 0; k < K; ++k) {
        int64_t id = id_at(t, k);
        if (id < 0) continue;
        r.pos[t * K + k] = r.expert_count[id]++;
        ++r.dest_count[id / L];
      }
    // Experts are ordered by id and each PE hosts a contiguous id range, so
    // the expert-ordered concatenation is also destination-ordered.
    std::vector<int32_t> base(E, 0);
    for (int e = 1; e < E; ++e) base[e] = base[e - 1] + r.expert_count[e - 1];
    r.send_rows.assign(r.pos.size(), -1);
    for (int64_t t = 0; t < T; ++t)
      for (int k = 0; k < K; ++k) {
        int64_t id = id_at(t, k);
        if (id >= 0) r.send_rows[t * K + k] = base[id] + r.pos[t * K + k];
      }
  }
  return r;
}

}  // namespace symheap::ep
