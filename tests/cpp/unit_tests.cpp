// Unit tests of the core's small C++ pieces: the heap allocator, size
// parsing, the EP workspace geometry, the EP host routing and the order of
// init and finalize's steps (over a fake bootstrap). Built by CMake
// when SYMHEAP_BUILD_TESTS is on (target symheap_unit_tests) and run by
// tests/cpp/test_cpp_units.py. Every check prints what failed with its values;
// the exit status is the number of failed checks (0: all passed).
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "ops/ep/ep_config.hpp"
#include "ops/ep/ep_op.hpp"
#include "ops/ep/ep_routing.hpp"
#include "symheap/allocator.hpp"
#include "symheap/errors.hpp"
#include "symheap/runtime.hpp"

namespace {

int g_failed = 0, g_checks = 0;
const char* g_test = "";

#define CHECK(cond)                                                                  \
  do {                                                                               \
    ++g_checks;                                                                      \
    if (!(cond)) {                                                                   \
      ++g_failed;                                                                    \
      std::printf("FAIL %s (%s:%d): %s\n", g_test, __FILE__, __LINE__, #cond);       \
    }                                                                                \
  } while (0)
#define CHECK_EQ(a, b)                                                               \
  do {                                                                               \
    ++g_checks;                                                                      \
    const auto va = (a);                                                             \
    const auto vb = (b);                                                             \
    if (!(va == vb)) {                                                               \
      ++g_failed;                                                                    \
      std::printf("FAIL %s (%s:%d): %s == %s: %lld != %lld\n", g_test, __FILE__,     \
                  __LINE__, #a, #b, static_cast<long long>(va),                      \
                  static_cast<long long>(vb));                                       \
    }                                                                                \
  } while (0)

// True when fn throws exactly E.
template <class E>
bool throws(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const E&) {
    return true;
  } catch (...) {
    return false;
  }
  return false;
}

void allocator() {
  using symheap::Allocator;
  const size_t heap = 1 << 20;
  Allocator a(4096, heap);
  CHECK_EQ(a.capacity(), heap - 4096);
  size_t x = a.allocate(100, 256, heap);
  size_t y = a.allocate(1000, 4096, heap);
  size_t z = a.allocate(8, 8, heap);
  CHECK_EQ(x % 256, 0u);
  CHECK_EQ(y % 4096, 0u);
  CHECK(x >= 4096 && y >= 4096 && z >= 4096);
  CHECK(x + 100 <= y || y + 1000 <= x);  // no overlap
  CHECK(z + 8 <= x || x + 100 <= z);
  CHECK(z + 8 <= y || y + 1000 <= z);
  CHECK_EQ(a.block_size(y), 1000u);
  CHECK_EQ(a.block_size(y + 1), 0u);
  CHECK(a.covers(y + 10, 990));
  CHECK(!a.covers(y + 10, 991));
  CHECK_EQ(a.live_blocks(), 3u);
  CHECK_EQ(a.bytes_in_use(), 1108u);
  // Same sequence, same offsets: every PE agrees.
  Allocator b(4096, heap);
  CHECK_EQ(b.allocate(100, 256, heap), x);
  CHECK_EQ(b.allocate(1000, 4096, heap), y);
  // Freed blocks coalesce: the whole range is one block again.
  a.release(x);
  a.release(z);
  a.release(y);
  CHECK_EQ(a.live_blocks(), 0u);
  CHECK_EQ(a.bytes_in_use(), 0u);
  size_t all = a.allocate(heap - 4096, 1, heap);
  CHECK_EQ(all, 4096u);
  CHECK(throws<symheap::HeapExhausted>([&] { a.allocate(1, 1, heap); }));
  CHECK(throws<symheap::InvalidArgument>([&] { a.release(all + 8); }));
  a.release(all);
  CHECK(throws<symheap::InvalidArgument>([&] { a.release(all); }));  // twice
  // First fit: a freed hole is reused by the next request that fits.
  size_t p = a.allocate(512, 256, heap), q = a.allocate(512, 256, heap);
  a.release(p);
  CHECK_EQ(a.allocate(256, 256, heap), p);
  (void)q;
}

void size_parsing() {
  using symheap::parse_size;
  CHECK_EQ(parse_size("4096"), 4096u);
  CHECK_EQ(parse_size("512M"), size_t{512} << 20);
  CHECK_EQ(parse_size("1GiB"), size_t{1} << 30);
  CHECK_EQ(parse_size(" 2 kb "), 2048u);
  CHECK_EQ(parse_size("3T"), size_t{3} << 40);
  CHECK_EQ(parse_size("0"), 0u);
  for (const char* bad : {"", "M", "abc", "12X", "1.5G", "-1", "99999999999999999999"})
    CHECK(throws<symheap::InvalidArgument>([&] { parse_size(bad); }));
  CHECK(throws<symheap::InvalidArgument>([] { parse_size("17000000T"); }));  // overflows
}

symheap::ep::Config config(symheap::ep::Layout layout, symheap::ep::Kernel kernel) {
  symheap::ep::Config c;
  c.hidden = 256;
  c.max_tokens = 40;
  c.num_experts = 16;
  c.topk = 4;
  c.layout = layout;
  c.kernel = kernel;
  return c;
}

void ep_geometry() {
  using namespace symheap::ep;
  for (Layout layout : {Layout::TokenMajor, Layout::ExpertMajor})
    for (Kernel kernel : {Kernel::Intranode, Kernel::LowLatency, Kernel::CopyEngine})
      for (int n : {1, 2, 4, 8}) {
        Config c = config(layout, kernel);
        Geometry g = make_geometry(c, n);
        CHECK_EQ(g.n_pes, n);
        CHECK_EQ(g.local_experts, c.num_experts / n);
        const int64_t worst = static_cast<int64_t>(n) * c.max_tokens;
        if (layout == Layout::TokenMajor) {
          CHECK_EQ(g.recv_rows, worst);
          CHECK_EQ(g.send_cols, n);
          CHECK_EQ(g.combine_rows, static_cast<int64_t>(c.max_tokens) * std::min(n, c.topk));
        } else {
          CHECK_EQ(g.expert_cap, worst);
          CHECK_EQ(g.recv_rows, worst * g.local_experts);
          CHECK_EQ(g.send_cols, c.topk);
          CHECK_EQ(g.combine_rows, static_cast<int64_t>(c.max_tokens) * c.topk);
        }
        CHECK_EQ(g.row_bytes, static_cast<size_t>(c.hidden) * 2);  // bfloat16
        CHECK_EQ(g.combine_sets, kernel == Kernel::CopyEngine ? 1 : 2);
        // Regions: aligned, in order, inside the workspace; the sync words
        // (zeroed at creation) come first, the dispatch blocks' epoch-tagged
        // counts and done words among them (epochs restart in every op).
        const size_t route_cols = layout == Layout::TokenMajor ? n : c.num_experts;
        std::vector<std::pair<size_t, size_t>> sync = {
            {g.off_count_flag, n * 8u}, {g.off_data_flag, n * 8u},
            {g.off_combine_flag, n * 8u}, {g.off_freed_flag, n * 8u},
            {g.off_entered, n * 8u}, {g.off_local, kLocalWords * 8u},
            {g.off_route_counts, g.grid_blocks * route_cols * 8u},
            {g.off_route_done, g.grid_blocks * 8u}};
        size_t end = 0;
        for (auto [off, bytes] : sync) {
          CHECK_EQ(off % 256, 0u);
          CHECK(off >= end);
          end = off + bytes;
        }
        CHECK(end <= g.sync_bytes);
        for (size_t off : {g.off_scratch_pos, g.off_recv_x,
                           g.off_recv_meta, g.off_combine_buf}) {
          CHECK_EQ(off % 256, 0u);
          CHECK(off >= g.sync_bytes && off < g.total);
        }
        CHECK(g.off_combine_buf + static_cast<size_t>(g.combine_sets) * g.combine_rows *
                                      g.combine_row_bytes <= g.total);
      }
  Config odd = config(Layout::TokenMajor, Kernel::Intranode);
  CHECK(throws<symheap::InvalidArgument>([&] { make_geometry(odd, 3); }));  // 16 % 3
  odd.max_recv_tokens = 1000;
  CHECK(throws<symheap::InvalidArgument>([&] { make_geometry(odd, 2); }));  // > n * max_tokens
  Config zero = config(Layout::TokenMajor, Kernel::Intranode);
  zero.topk = 0;
  CHECK(throws<symheap::InvalidArgument>([&] { make_geometry(zero, 2); }));
}

// Routing of random ids (some dropped with -1) against a reference built a
// different way: each send list as a sorted list, each row's place its index.
void ep_host_routing() {
  using namespace symheap::ep;
  std::mt19937 rng(12345);
  for (Layout layout : {Layout::TokenMajor, Layout::ExpertMajor})
    for (int n : {1, 2, 4}) {
      Config c = config(layout, Kernel::Intranode);
      Geometry g = make_geometry(c, n);
      const int K = c.topk, E = c.num_experts, L = g.local_experts;
      const int64_t T = 37;
      std::vector<int64_t> ids(T * K);
      for (int64_t t = 0; t < T; ++t) {  // distinct experts per token, some dropped
        std::vector<int> all(E);
        for (int e = 0; e < E; ++e) all[e] = e;
        std::shuffle(all.begin(), all.end(), rng);
        for (int k = 0; k < K; ++k) ids[t * K + k] = rng() % 5 == 0 ? -1 : all[k];
      }
      HostRouting r = route_on_host(c, g, ids.data(), true, T);
      CHECK_EQ(r.status, kOk);
      std::vector<int32_t> experts(E, 0);
      for (int64_t id : ids)
        if (id >= 0) ++experts[id];
      for (int e = 0; e < E; ++e) CHECK_EQ(r.expert_count[e], experts[e]);
      if (layout == Layout::TokenMajor) {
        std::vector<std::vector<int64_t>> lists(n);  // tokens sent to each PE, in order
        for (int64_t t = 0; t < T; ++t)
          for (int d = 0; d < n; ++d) {
            bool hit = false;
            for (int k = 0; k < K; ++k) hit |= ids[t * K + k] >= 0 && ids[t * K + k] / L == d;
            if (hit) lists[d].push_back(t);
          }
        int32_t base = 0;
        for (int d = 0; d < n; ++d) {
          CHECK_EQ(r.dest_count[d], static_cast<int32_t>(lists[d].size()));
          for (int64_t t = 0; t < T; ++t) {
            auto it = std::find(lists[d].begin(), lists[d].end(), t);
            int32_t want = it == lists[d].end() ? -1 : static_cast<int32_t>(it - lists[d].begin());
            CHECK_EQ(r.pos[t * n + d], want);
            CHECK_EQ(r.send_rows[t * n + d], want < 0 ? -1 : base + want);
          }
          base += static_cast<int32_t>(lists[d].size());
        }
      } else {
        std::vector<std::tuple<int64_t, int64_t, int>> pairs;  // (expert, token, slot)
        for (int64_t t = 0; t < T; ++t)
          for (int k = 0; k < K; ++k)
            if (ids[t * K + k] >= 0) pairs.emplace_back(ids[t * K + k], t, k);
        std::sort(pairs.begin(), pairs.end());
        std::vector<int32_t> first(E, -1);
        for (size_t i = 0; i < pairs.size(); ++i) {
          auto [e, t, k] = pairs[i];
          if (first[e] < 0) first[e] = static_cast<int32_t>(i);
          CHECK_EQ(r.send_rows[t * K + k], static_cast<int32_t>(i));
          CHECK_EQ(r.pos[t * K + k], static_cast<int32_t>(i) - first[e]);
        }
        for (int64_t t = 0; t < T; ++t)
          for (int k = 0; k < K; ++k)
            if (ids[t * K + k] < 0) CHECK_EQ(r.send_rows[t * K + k], -1);
        for (int d = 0; d < n; ++d) {
          int32_t rows = 0;
          for (int e = d * L; e < (d + 1) * L; ++e) rows += experts[e];
          CHECK_EQ(r.dest_count[d], rows);
        }
      }
    }
  // An id out of range routes nothing and names the id; int32 ids read too.
  Config c = config(Layout::TokenMajor, Kernel::Intranode);
  Geometry g = make_geometry(c, 2);
  std::vector<int32_t> bad = {0, 1, 2, 3, 4, 99, 5, 6};
  HostRouting r = route_on_host(c, g, bad.data(), false, 2);
  CHECK_EQ(r.status, kExpertOutOfRange);
  CHECK_EQ(r.detail, 99);
  CHECK(r.send_rows.empty());
}

// A one-PE job's bootstrap: the exchange echoes (or returns `reply` for the
// init record), and every call is logged in order.
struct EchoBootstrap : symheap::Bootstrap {
  std::vector<std::string> log;
  std::string reply_to_init;  // non-empty: returned instead of the PE's own record
  void connect() override { log.push_back("connect"); }
  std::vector<std::string> allgather(const std::string& mine, const std::string& tag) override {
    log.push_back(tag);
    if (tag == "init" && !reply_to_init.empty()) return {reply_to_init};
    return {mine};
  }
  std::string failure() override { return ""; }
  void close(double grace_s) override { log.push_back("close " + std::to_string(grace_s)); }
};

void lifecycle() {
  using symheap::Runtime;
  Runtime& rt = Runtime::instance();
  rt.select_backend("cpu");
  rt.set_device(3);
  // Init and finalize take their steps in this order; the PE is gone after.
  EchoBootstrap boot;
  rt.init_pe(77, 3, 0, 1, 1 << 20, 5.0, boot, /*xla_ordinal=*/11);
  CHECK(rt.slot(3) != nullptr);
  CHECK(rt.slot_of_xla(11) == rt.slot(3));
  CHECK(rt.slot(3)->heap->export_handle.empty());  // the shared-memory name is dropped
  rt.finalize_pe(3, boot);
  const std::vector<std::string> steps = {"connect", "init", "init-connect", "finalize",
                                          "close 5.000000"};
  CHECK(boot.log == steps);
  CHECK(rt.slot(3) == nullptr);
  CHECK(rt.slot_of_xla(11) == nullptr);
  // A malformed record fails init cleanly: slot freed, bootstrap closed at once.
  for (const std::string& junk : {std::string("x"), std::string("99:short"),
                                  std::string("1:0"), std::string("1:01:01:a1:11:n1:h")}) {
    EchoBootstrap bad;
    bad.reply_to_init = junk;
    bool refused = false;
    try {
      rt.init_pe(78, 3, 0, 1, 1 << 20, 5.0, bad);
    } catch (const symheap::StateError& e) {
      refused = std::string(e.what()).find("malformed PE record from PE 0") != std::string::npos;
    }
    CHECK(refused);
    CHECK(rt.slot(3) == nullptr);
    CHECK(!bad.log.empty() && bad.log.back() == "close 0.000000");
  }
}

// The node layout EP forwarding reads from the peer table.
void ep_node_layout() {
  using symheap::ep::node_layout;
  auto state = [](std::vector<std::string> nodes) {
    auto s = std::make_unique<symheap::PeState>();
    s->n_pes = static_cast<int>(nodes.size());
    s->peers.resize(nodes.size());
    for (size_t p = 0; p < nodes.size(); ++p) s->peers[p].info.node_id = nodes[p];
    return s;
  };
  auto s = state({"a", "a", "b", "a", "b"});  // nodes interleaved, unequal
  auto l = node_layout(*s);
  CHECK(l.forward);
  CHECK(l.node_of == std::vector<int>({0, 0, 1, 0, 1}));
  CHECK(l.local_index == std::vector<int>({0, 1, 0, 2, 1}));
  CHECK(l.pes_of == std::vector<std::vector<int>>({{0, 1, 3}, {2, 4}}));
  CHECK_EQ(l.forwarder(0, 1), 2);  // same local index
  CHECK_EQ(l.forwarder(1, 1), 4);
  CHECK_EQ(l.forwarder(3, 1), 2);  // local index 2 of a node of 2: modulo
  CHECK_EQ(l.forwarder(2, 0), 0);
  CHECK_EQ(l.forwarder(4, 0), 1);
  CHECK(!node_layout(*state({"a", "a"})).forward);       // one node
  CHECK(!node_layout(*state({"a", "b", "c"})).forward);  // no node with several PEs
  setenv("SYMHEAP_EP_HIERARCHICAL", "0", 1);
  CHECK(!node_layout(*s).forward);
  unsetenv("SYMHEAP_EP_HIERARCHICAL");
}

}  // namespace

int main() {
  const std::pair<const char*, void (*)()> tests[] = {{"allocator", allocator},
                                                      {"size_parsing", size_parsing},
                                                      {"ep_geometry", ep_geometry},
                                                      {"ep_host_routing", ep_host_routing},
                                                      {"ep_node_layout", ep_node_layout},
                                                      {"lifecycle", lifecycle}};
  for (auto [name, fn] : tests) {
    g_test = name;
    const int before = g_failed;
    try {
      fn();
    } catch (const std::exception& e) {
      ++g_failed;
      std::printf("FAIL %s: unexpected exception: %s\n", name, e.what());
    }
    std::printf("%s %s\n", g_failed == before ? "ok  " : "FAIL", name);
  }
  std::printf("%d checks, %d failed\n", g_checks, g_failed);
  return g_failed == 0 ? 0 : 1;
}
