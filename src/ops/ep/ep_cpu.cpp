// The cpu implementation of dispatch/combine. PEs exchange only through the
// symmetric heap: peer loads/stores through the peer base table, flags with
// release/acquire ordering. The protocol is the one the CUDA kernels follow:
//
// dispatch #e on PE s
//   1. route locally (validate ids), publish [status, counts] into every PE's
//      count row s, then set count_flag[s] = e there;
//   2. wait for every PE's count row; all PEs now hold the same matrix, so
//      they agree on aborts (bad input anywhere, receive overflow) and on
//      every row's destination: rows arrive ordered by (source PE, send list);
//   3. unless aborting, store each row, its scales, weights and metadata
//      straight into the destination's receive buffer;
//   4. set data_flag[s] = e on every PE and wait for all of them. Waiting for
//      count rows also proves each peer left its previous dispatch, so
//      nothing a peer still reads is overwritten.
//   token_slots: token t's row goes to row s * max_tokens + t of each of its
//   destinations, and the slots it does not fill there are marked empty; the
//   count row also carries, per destination, a bit per token sent there.
//   (The CUDA kernel sends its rows before the counts; the results agree.)
//
// combine #e on PE d
//   1. wait until each PE freed its combine buffer of #e-1 (freed_flag);
//   2. store each received row into its source's combine buffer at the row
//      the source chose at dispatch; set combine_flag[d] = e everywhere;
//   3. wait for every PE's rows, reduce in fp32 per token, set freed_flag.
//
// Remote peers (another node): every store into a remote PE's workspace
// lands in a buffer of its own (Stores), and the stores go through the
// remote transport, adjacent ones merged, right before the flag that
// announces them;
// the transport keeps a PE's requests in order, so the peer sees the rows
// before the flag. Rows a PE pulls from a remote source (redispatch, without
// forwarding) come through a get, once per destination PE.
//
// Forwarding (Op::nodes.forward: several nodes, one with several PEs):
//   dispatch: step 3 sends a token bound for another node once, as a record
//   to this PE's forwarder there (fwd_flag[s] = e after the records); in step
//   3b each PE waits for the sources it forwards for and stores their records
//   into its node's receive buffers before its data flag, so a destination
//   that has every data flag has every row.
//   combine: a row for a source on another node goes to the source's
//   forwarder on this node (stage_flag[d] = e); the source sends each
//   forwarder a plan (per token: combine rows there, weights; plan_flag); the
//   forwarder sums and stores one row per token into the source's partials
//   before its combine flag; the source adds them to its own node's rows.
//   redispatch: see its own header below.
#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "ops/ep/ep_numeric.hpp"
#include "ops/ep/ep_op.hpp"
#include "ops/ep/ep_routing.hpp"
#include "symheap/errors.hpp"
#include "symheap/wait.hpp"
#include "transports/transport.hpp"

namespace symheap::ep {
namespace {

template <class T>
T* at(const PeState& s, const Op& op, int pe, size_t off) {
  return reinterpret_cast<T*>(ws_addr(s, op, pe, off));
}

void store_flag(uint64_t* word, uint64_t v) { __atomic_store_n(word, v, __ATOMIC_RELEASE); }

// This PE's stores into other PEs' workspaces (see the header comment).
class Stores {
 public:
  Stores(PeState& s, Op& op) : s_(s), op_(op), staged_(op.n_pes) {}

  // Where `count` elements at workspace offset `off` of PE d are written:
  // d's workspace when mapped, else a buffer of their own, sent by flag().
  template <class T>
  T* at(int d, size_t off, size_t count) {
    if (s_.peers[d].base) return ep::at<T>(s_, op_, d, off);
    staged_[d].push_back({off, count * sizeof(T), staged_[d].size(),
                          std::make_unique<char[]>(count * sizeof(T))});
    return reinterpret_cast<T*>(staged_[d].back().bytes.get());
  }

  // Sends what was written to d, then sets its flag word `flag_off`[me] to `value`.
  void flag(int d, size_t flag_off, uint64_t value) {
    const size_t word = flag_off + static_cast<size_t>(op_.my_pe) * sizeof(uint64_t);
    if (s_.peers[d].base) {
      store_flag(ep::at<uint64_t>(s_, op_, d, word), value);
      return;
    }
    Transport& remote = s_.transports->select(d);
    std::vector<Staged>& stores = staged_[d];
    std::sort(stores.begin(), stores.end(),
              [](const Staged& a, const Staged& b) { return a.off < b.off; });
    std::vector<char> run;  // adjacent stores as one put
    for (size_t first = 0; first < stores.size();) {
      const size_t begin = stores[first].off;
      size_t end = begin, last = first;
      for (; last < stores.size() && stores[last].off <= end; ++last)
        end = std::max(end, stores[last].off + stores[last].len);
      // In the order they were made, so a later store wins an overlap.
      std::sort(stores.begin() + first, stores.begin() + last,
                [](const Staged& a, const Staged& b) { return a.seq < b.seq; });
      run.resize(end - begin);
      for (size_t i = first; i < last; ++i)
        std::memcpy(run.data() + (stores[i].off - begin), stores[i].bytes.get(), stores[i].len);
      remote.put(s_, d, op_.ws_offset + begin, run.data(), end - begin, 0);
      first = last;
    }
    stores.clear();
    remote.signal(s_, d, op_.ws_offset + word, value, SignalOp::Set, 0);
  }

  // Reads n bytes at workspace offset `off` of PE d.
  void read(int d, size_t off, void* out, size_t n) {
    if (s_.peers[d].base) std::memcpy(out, ep::at<char>(s_, op_, d, off), n);
    else s_.transports->select(d).get(s_, d, out, op_.ws_offset + off, n, 0);
  }

 private:
  struct Staged {
    size_t off, len, seq;
    std::unique_ptr<char[]> bytes;
  };
  PeState& s_;
  Op& op_;
  std::vector<std::vector<Staged>> staged_;
};
uint64_t load_flag(const uint64_t* word) { return __atomic_load_n(word, __ATOMIC_ACQUIRE); }

// Waits until flags[q] >= target for every PE q of `pes`; the error names the late ones.
void wait_for(const PeState& s, const Op& op, const uint64_t* flags, uint64_t target,
              const std::vector<int>& pes, const std::string& call, const char* what) {
  Waiter waiter(&s, op.timeout_s);
  for (int q : pes) {
    while (load_flag(&flags[q]) < target) {
      if (!waiter.pause()) {
        std::string late;
        for (int r : pes)
          if (load_flag(&flags[r]) < target) late += (late.empty() ? "" : ", ") + std::to_string(r);
        throw TimeoutError(call + " on PE " + std::to_string(op.my_pe) + " timed out after " +
                           std::to_string(op.timeout_s) + " s waiting for " + what +
                           " from PE(s) " + late + " (did every PE make the same call?)");
      }
    }
  }
}

void wait_all(const PeState& s, const Op& op, const uint64_t* flags, uint64_t target,
              const std::string& call, const char* what) {
  std::vector<int> all(op.n_pes);
  for (int q = 0; q < op.n_pes; ++q) all[q] = q;
  wait_for(s, op, flags, target, all, call, what);
}

std::string call_name(const char* what, uint64_t epoch) {
  return std::string("ep ") + what + " #" + std::to_string(epoch);
}

// The received rows into the caller's buffers (DispatchArgs::out_*): rows
// within the counts from the receive buffer; past them the defaults the
// device's collect_kernel writes (x and scales left alone).
void deliver_rows(const PeState& s, const Op& op, const DispatchArgs& a, int64_t num_recv,
                  const std::vector<int32_t>& per_expert) {
  const Geometry& g = op.geo;
  const int me = op.my_pe;
  const bool tm = op.cfg.layout == Layout::TokenMajor, slots = op.cfg.token_slots;
  const size_t K = static_cast<size_t>(op.cfg.topk), topk_bytes = K * 4;
  auto copy = [&](void* dst, size_t off, int64_t r, size_t bytes) {
    if (bytes) std::memcpy(static_cast<char*>(dst) + r * bytes, at<char>(s, op, me, off) + r * bytes,
                           bytes);
  };
  for (int64_t r = 0; r < g.recv_rows; ++r) {
    const bool in = slots ? true : tm ? r < num_recv
                                      : r % g.expert_cap < per_expert[r / g.expert_cap];
    if (in) {
      copy(a.out_x, g.off_recv_x, r, g.row_bytes);
      copy(a.out_scales, g.off_recv_scales, r, g.scale_row_bytes);
      copy(a.out_w, g.off_recv_w, r, tm ? topk_bytes : 4);
      if (tm) {
        copy(a.out_idx, g.off_recv_idx, r, topk_bytes);
        copy(a.out_meta, g.off_recv_meta, r, kMetaWords * 4);
      }
    } else if (tm) {
      std::fill_n(a.out_idx + r * K, K, -1);
      std::fill_n(a.out_w + r * K, K, 0.0f);
      std::fill_n(a.out_meta + r * kMetaWords, kMetaWords, -1);
    } else {
      a.out_w[r] = 0.0f;
    }
  }
}

}  // namespace

int64_t dispatch_cpu(PeState& s, Op& op, const DispatchArgs& a) {
  const Config& c = op.cfg;
  const Geometry& g = op.geo;
  const int n = op.n_pes, me = op.my_pe, K = c.topk, L = g.local_experts;
  const bool token_major = c.layout == Layout::TokenMajor;
  const uint64_t epoch = ++op.dispatch_epoch;
  const std::string call = call_name("dispatch", epoch);

  // 1. Validate and route locally; a bad PE still takes part, routing nothing.
  int64_t T = a.num_tokens;
  HostRouting r;
  r.status = a.status;
  if (r.status == kOk && (T < 0 || T > c.max_tokens)) {
    r.status = kTooManyTokens;
    r.detail = T;
  }
  if (r.status == kOk) r = route_on_host(c, g, a.topk_idx, a.idx_int64, T);
  if (r.status != kOk) {
    T = 0;
    r.dest_count.assign(n, 0);
    r.expert_count.assign(c.num_experts, 0);
    r.pos.clear();
    r.send_rows.clear();
  }
  std::vector<int32_t> row(g.count_words, 0);
  row[kCountStatus] = r.status;
  row[kCountDetail] = static_cast<int32_t>(r.detail);
  std::memcpy(&row[kCountDest], r.dest_count.data(), n * 4);
  std::memcpy(&row[kCountDest + n], r.expert_count.data(), c.num_experts * 4);
  const int W = g.slot_words, bits_at = count_bits_at(n, c.num_experts);
  for (int64_t t = 0; c.token_slots && t < T; ++t)
    for (int d = 0; d < n; ++d)
      if (r.pos[t * n + d] >= 0) row[bits_at + d * W + t / 32] |= int32_t(1u << (t % 32));
  Stores st(s, op);
  for (int p = 0; p < n; ++p) {
    std::memcpy(st.at<int32_t>(p, g.off_count_rows + size_t(me) * g.count_words * 4, row.size()),
                row.data(), row.size() * 4);
    st.flag(p, g.off_count_flag, epoch);
  }

  // 2. Every PE's counts: the same matrix everywhere, so the same decisions.
  wait_all(s, op, at<uint64_t>(s, op, me, g.off_count_flag), epoch, call, "routing counts");
  std::vector<int32_t> M(static_cast<size_t>(n) * g.count_words);
  std::memcpy(M.data(), at<int32_t>(s, op, me, g.off_count_rows), M.size() * 4);
  auto cell = [&](int q, int i) { return M[static_cast<size_t>(q) * g.count_words + i]; };
  std::string abort;
  bool my_fault = false;
  for (int q = 0; q < n; ++q)
    if (cell(q, kCountStatus) != kOk) {
      abort += (abort.empty() ? "" : "; ") +
               describe_status(cell(q, kCountStatus), cell(q, kCountDetail), q, c);
      my_fault |= q == me;
    }
  bool overflow = false;
  if (abort.empty()) {
    if (token_major) {
      for (int d = 0; d < n && abort.empty(); ++d) {
        int64_t total = 0;
        for (int q = 0; q < n; ++q) total += cell(q, kCountDest + d);
        if (total > g.recv_rows)
          abort = "PE " + std::to_string(d) + " would receive " + std::to_string(total) +
                  " rows, more than its capacity of " + std::to_string(g.recv_rows) +
                  " (raise max_recv_tokens)";
      }
    } else {
      for (int e = 0; e < c.num_experts && abort.empty(); ++e) {
        int64_t total = 0;
        for (int q = 0; q < n; ++q) total += cell(q, kCountDest + n + e);
        if (total > g.expert_cap)
          abort = "expert " + std::to_string(e) + " (on PE " + std::to_string(e / L) +
                  ") would receive " + std::to_string(total) + " rows, more than " +
                  "expert_capacity=" + std::to_string(g.expert_cap);
      }
    }
    overflow = !abort.empty();
  }

  // 3. Rows straight into their destination's receive buffer; with
  //    forwarding, rows for another node go once, as one record per token and
  //    node, to that node's forwarder for this PE (step 3b stores them).
  const NodeLayout& nl = op.nodes;
  const int my_node = nl.node_of[me], n_nodes = static_cast<int>(nl.pes_of.size());
  auto crosses = [&](int d) { return nl.forward && nl.node_of[d] != my_node; };
  const int cols = g.send_cols, HW = g.fwd_header_words;
  const int64_t cap = c.max_tokens;  // token_slots: slots per source
  std::vector<int32_t> fwd_count(n_nodes, 0);
  // Stores into d's receive buffer, shared by senders and forwarders.
  auto land_row = [&](int d, int64_t dst, const char* xrow, const char* srow) {
    std::memcpy(st.at<char>(d, g.off_recv_x + dst * g.row_bytes, g.row_bytes), xrow, g.row_bytes);
    if (g.scale_row_bytes)
      std::memcpy(st.at<char>(d, g.off_recv_scales + dst * g.scale_row_bytes, g.scale_row_bytes),
                  srow, g.scale_row_bytes);
  };
  auto land_meta = [&](int d, int64_t dst, int src, int64_t t, int32_t slot, int32_t crow) {
    int32_t* meta = st.at<int32_t>(d, g.off_recv_meta + dst * kMetaWords * 4, kMetaWords);
    meta[kMetaSrcPe] = src;
    meta[kMetaToken] = static_cast<int32_t>(t);
    meta[kMetaSlot] = slot;
    meta[kMetaCombineRow] = crow;
  };
  // Token-major: ids and weights of the token's top-k, as d sees them.
  auto land_topk = [&](int d, int64_t dst, const int64_t* ids, const float* weights) {
    int32_t* idx = st.at<int32_t>(d, g.off_recv_idx + dst * K * 4, K);
    float* w = st.at<float>(d, g.off_recv_w + dst * K * 4, K);
    for (int k = 0; k < K; ++k) {
      bool local = ids[k] >= 0 && ids[k] / L == d;
      idx[k] = local ? static_cast<int32_t>(ids[k] % L) : -1;
      w[k] = local ? weights[k] : 0.0f;
    }
  };
  auto land_empty_slot = [&](int d, int64_t slot) {  // token_slots: no source, no experts
    std::fill_n(st.at<int32_t>(d, g.off_recv_idx + slot * K * 4, K), K, -1);
    std::fill_n(st.at<float>(d, g.off_recv_w + slot * K * 4, K), K, 0.0f);
    std::fill_n(st.at<int32_t>(d, g.off_recv_meta + slot * kMetaWords * 4, kMetaWords),
                kMetaWords, -1);
  };
  // A forwarded record's header: [token, dst row per column, combine row per
  // column, ids[K], weights[K]] (see Geometry::fwd_header_words).
  auto rec_dst = [&](int32_t* h, int j) -> int32_t& { return h[1 + j]; };
  auto rec_crow = [&](int32_t* h, int j) -> int32_t& { return h[1 + cols + j]; };
  const char* x = static_cast<const char*>(a.x);
  const char* scales = static_cast<const char*>(a.scales);
  if (abort.empty() && (T > 0 || c.token_slots)) {  // (token_slots: empty slots too)
    std::vector<std::vector<int32_t>> rec(n_nodes);  // this token's record per node
    std::vector<int64_t> ids(K);
    std::vector<float> weights(K);
    auto record = [&](int node, int64_t t) {
      std::vector<int32_t>& h = rec[node];
      if (h.empty()) {
        h.assign(HW, -1);
        h[0] = static_cast<int32_t>(t);
        for (int k = 0; k < K; ++k) h[1 + 2 * cols + k] = static_cast<int32_t>(ids[k]);
        std::memcpy(&h[1 + 2 * cols + K], weights.data(), K * 4);
      }
      return h.data();
    };
    auto begin_token = [&](int64_t t) {
      for (int k = 0; k < K && t < T; ++k) {
        ids[k] = read_index(a.topk_idx, a.idx_int64, t * K + k);
        weights[k] = a.topk_weights[t * K + k];
      }
      for (auto& h : rec) h.clear();
    };
    auto send_records = [&](int64_t t) {  // one store per record: one put when adjacent
      for (int node = 0; node < n_nodes; ++node) {
        if (rec[node].empty()) continue;
        const int f = nl.forwarder(me, node);
        const size_t i = static_cast<size_t>(me) * cap + fwd_count[node]++;
        char* out = st.at<char>(f, g.off_fwd_rec + i * g.fwd_rec_bytes, g.fwd_rec_bytes);
        std::memset(out, 0, g.fwd_rec_bytes);
        std::memcpy(out, rec[node].data(), HW * 4);
        std::memcpy(out + g.fwd_x_at, x + t * g.row_bytes, g.row_bytes);
        if (g.scale_row_bytes)
          std::memcpy(out + g.fwd_scales_at, scales + t * g.scale_row_bytes, g.scale_row_bytes);
      }
    };
    if (token_major) {
      std::vector<int64_t> base(n, 0);  // first row of this PE's rows on each destination
      for (int d = 0; d < n; ++d)
        for (int q = 0; q < me; ++q) base[d] += cell(q, kCountDest + d);
      for (int64_t t = 0; t < (c.token_slots ? cap : T); ++t) {
        begin_token(t);
        for (int d = 0; d < n; ++d) {
          int32_t p = t < T ? r.pos[t * n + d] : -1;
          if (p < 0 && c.token_slots && !crosses(d)) land_empty_slot(d, me * cap + t);
          if (p < 0) continue;
          int64_t dst = c.token_slots ? me * cap + t : base[d] + p;
          int32_t crow = c.token_slots ? static_cast<int32_t>(d * cap + t) : r.send_rows[t * n + d];
          if (crosses(d)) {
            int32_t* h = record(nl.node_of[d], t);
            rec_dst(h, d) = static_cast<int32_t>(dst);
            rec_crow(h, d) = crow;
            continue;
          }
          land_row(d, dst, x + t * g.row_bytes, scales + t * g.scale_row_bytes);
          land_topk(d, dst, ids.data(), weights.data());
          land_meta(d, dst, me, t, -1, crow);
        }
        send_records(t);
      }
    } else {
      std::vector<int64_t> base(c.num_experts, 0);  // this PE's first row in each expert's run
      for (int e = 0; e < c.num_experts; ++e)
        for (int q = 0; q < me; ++q) base[e] += cell(q, kCountDest + n + e);
      for (int64_t t = 0; t < T; ++t) {
        begin_token(t);
        for (int k = 0; k < K; ++k) {
          int32_t p = r.pos[t * K + k];
          if (p < 0) continue;
          int64_t id = ids[k];
          int d = static_cast<int>(id / L);
          int64_t dst = (id % L) * g.expert_cap + base[id] + p;
          if (crosses(d)) {
            int32_t* h = record(nl.node_of[d], t);
            rec_dst(h, k) = static_cast<int32_t>(dst);
            rec_crow(h, k) = r.send_rows[t * K + k];
            continue;
          }
          land_row(d, dst, x + t * g.row_bytes, scales + t * g.scale_row_bytes);
          *st.at<float>(d, g.off_recv_w + dst * 4, 1) = weights[k];
          land_meta(d, dst, me, t, k, r.send_rows[t * K + k]);
        }
        send_records(t);
      }
    }
  }
  for (int node = 0; nl.forward && node < n_nodes; ++node) {
    if (node == my_node) continue;
    const int f = nl.forwarder(me, node);
    *st.at<int32_t>(f, g.off_fwd_count + static_cast<size_t>(me) * 4, 1) = fwd_count[node];
    st.flag(f, g.off_fwd_flag, epoch);
  }

  // 3b. Forward: the records of every source of another node whose
  //     forwarder here is this PE, into the receive buffers of this node.
  for (int src = 0; nl.forward && src < n; ++src) {
    if (nl.node_of[src] == my_node || nl.forwarder(src, my_node) != me) continue;
    wait_for(s, op, at<uint64_t>(s, op, me, g.off_fwd_flag), epoch, {src}, call,
             "rows to forward");
    if (!abort.empty()) continue;
    const int32_t records =
        std::min<int32_t>(*at<int32_t>(s, op, me, g.off_fwd_count + size_t(src) * 4),
                          static_cast<int32_t>(cap));
    for (int32_t i = 0; i < records; ++i) {
      char* rec = at<char>(s, op, me, g.off_fwd_rec + (size_t(src) * cap + i) * g.fwd_rec_bytes);
      int32_t* h = reinterpret_cast<int32_t*>(rec);
      const int64_t t = h[0];
      int64_t ids[64];
      float weights[64];
      for (int k = 0; k < K; ++k) ids[k] = h[1 + 2 * cols + k];
      std::memcpy(weights, &h[1 + 2 * cols + K], K * 4);
      const char* xrow = rec + g.fwd_x_at;
      const char* srow = rec + g.fwd_scales_at;
      if (token_major) {
        for (int d : nl.pes_of[my_node]) {
          const int32_t dst = rec_dst(h, d);
          if (dst < 0) continue;
          land_row(d, dst, xrow, srow);
          land_topk(d, dst, ids, weights);
          land_meta(d, dst, src, t, -1, rec_crow(h, d));
        }
      } else {
        for (int k = 0; k < K; ++k) {
          const int32_t dst = rec_dst(h, k);
          if (dst < 0) continue;
          const int d = static_cast<int>(ids[k] / L);
          land_row(d, dst, xrow, srow);
          *st.at<float>(d, g.off_recv_w + int64_t(dst) * 4, 1) = weights[k];
          land_meta(d, dst, src, t, k, rec_crow(h, k));
        }
      }
    }
    for (int d : nl.pes_of[my_node])  // token_slots: src's slots that hold no row for d
      for (int64_t t = 0; c.token_slots && t < cap; ++t)
        if (!((cell(src, bits_at + d * W + int(t / 32)) >> (t % 32)) & 1))
          land_empty_slot(d, src * cap + t);
  }

  // 4. Signal and wait even when aborting: count rows stay safe to reuse.
  for (int p = 0; p < n; ++p) st.flag(p, g.off_data_flag, epoch);
  wait_all(s, op, at<uint64_t>(s, op, me, g.off_data_flag), epoch, call, "dispatched rows");
  if (!abort.empty()) {
    std::string msg = call + " aborted on every PE: " + abort;
    if (my_fault || overflow) throw InvalidArgument(msg);
    throw StateError(msg);
  }

  // Outputs and handle: counts, a private copy of the row metadata
  // (expert-major; token-major combine needs only the summary).
  int64_t num_recv = 0;
  std::vector<int32_t> per_expert(L, 0);
  for (int q = 0; q < n; ++q) {
    if (token_major) num_recv += cell(q, kCountDest + me);
    for (int l = 0; l < L; ++l) per_expert[l] += cell(q, kCountDest + n + me * L + l);
  }
  if (!token_major)
    for (int l = 0; l < L; ++l) num_recv += per_expert[l];
  if (a.num_recv) a.num_recv[0] = static_cast<int32_t>(num_recv);
  if (a.expert_counts) std::memcpy(a.expert_counts, per_expert.data(), L * 4);
  const int32_t* meta = at<int32_t>(s, op, me, g.off_recv_meta);
  for (int64_t row_i = 0; !token_major && row_i < g.recv_rows; ++row_i) {
    const bool valid = row_i % g.expert_cap < per_expert[row_i / g.expert_cap];
    int32_t* out = a.recv_meta + row_i * kMetaWords;
    if (valid) std::memcpy(out, meta + row_i * kMetaWords, kMetaWords * 4);
    else std::fill(out, out + kMetaWords, -1);
  }
  int32_t* summary = a.recv_summary;
  std::fill(summary, summary + summary_words(n, L, g.slot_words), 0);
  for (int q = 0; q < n; ++q) {
    int64_t range_start = 0, rows_from_q = 0, first_row = 0;
    if (token_major) {
      for (int d = 0; d < me; ++d) range_start += cell(q, kCountDest + d);
      rows_from_q = cell(q, kCountDest + me);
      for (int p = 0; p < q; ++p) first_row += cell(p, kCountDest + me);
    } else {
      for (int e = 0; e < me * L; ++e) range_start += cell(q, kCountDest + n + e);
      for (int l = 0; l < L; ++l) rows_from_q += cell(q, kCountDest + n + me * L + l);
    }
    summary[4 * q] = static_cast<int32_t>(range_start);
    summary[4 * q + 1] = static_cast<int32_t>(rows_from_q);
    summary[4 * q + 2] = static_cast<int32_t>(first_row);
    int64_t sent_before = 0;  // first row of this PE's rows to q in its send order
    for (int d = 0; d < q; ++d) sent_before += cell(me, kCountDest + d);
    summary[4 * q + 3] = static_cast<int32_t>(sent_before);
  }
  for (int l = 0; l < L; ++l) summary[4 * n + l] = per_expert[l];
  summary[4 * n + L] = static_cast<int32_t>(num_recv);
  const size_t table = static_cast<size_t>(c.max_tokens) * g.send_cols;
  std::fill(a.send_rows, a.send_rows + table, -1);
  std::memcpy(a.send_rows, r.send_rows.data(), r.send_rows.size() * 4);
  if (c.token_slots) {  // every source's slots, and which of them hold a row
    const int32_t cap = c.max_tokens;
    for (int q = 0; q < n; ++q) {
      summary[4 * q] = me * cap;
      summary[4 * q + 1] = cap;
      summary[4 * q + 2] = q * cap;
      summary[4 * q + 3] = q * cap;
      for (int i = 0; i < W; ++i) summary[slot_bits_at(n, L) + q * W + i] = cell(q, bits_at + me * W + i);
    }
    summary[4 * n + L] = n * cap;
    for (size_t i = 0; i < r.send_rows.size(); ++i)
      if (a.send_rows[i] >= 0) a.send_rows[i] = static_cast<int32_t>(i % n) * cap + int32_t(i / n);
  }
  if (a.saved_weights && T > 0)
    std::memcpy(a.saved_weights, a.topk_weights, static_cast<size_t>(T) * K * 4);
  if (a.out_x) deliver_rows(s, op, a, num_recv, per_expert);
  return num_recv;
}

void combine_cpu(PeState& s, Op& op, const CombineArgs& a) {
  const Config& c = op.cfg;
  const Geometry& g = op.geo;
  const int n = op.n_pes, me = op.my_pe, K = c.topk;
  const bool token_major = c.layout == Layout::TokenMajor;
  const uint64_t epoch = ++op.combine_epoch;
  const std::string call = call_name("combine", epoch);
  const NodeLayout& nl = op.nodes;
  const int my_node = nl.node_of[me], n_nodes = static_cast<int>(nl.pes_of.size());
  const int64_t cap = c.max_tokens;
  const int cols = token_major ? n : K;
  int32_t status = a.status;
  if (status == kOk && (a.num_tokens < 0 || a.num_tokens > c.max_tokens)) status = kBadArgument;

  // 1. Each source must have consumed its buffer of the previous combine.
  wait_all(s, op, at<uint64_t>(s, op, me, g.off_freed_flag), epoch - 1, call,
           "the previous combine to finish");
  Stores st(s, op);
  const size_t crb = g.combine_row_bytes;
  const char* rows = static_cast<const char*>(a.expert_out);
  // Rows named by the handle must lie inside the combine buffers: a handle
  // edited by the caller must not write or read outside them.
  if (status == kOk) {
    for (int64_t t = 0; t < a.num_tokens && status == kOk; ++t)
      for (int j = 0; j < cols; ++j) {
        int32_t row = a.send_rows[t * g.send_cols + j];
        if (row >= g.combine_rows || row < -1) status = kBadHandle;
      }
  }
  // With forwarding, the rows of this PE's tokens that PEs of another node
  // hold are summed there (step 3b): each token crosses back once per node.
  auto holder = [&](int j, int32_t crow) {
    return holder_of(token_major, n, a.recv_summary, j, crow);
  };
  std::vector<std::vector<int64_t>> planned(n_nodes);  // per node: its records' tokens
  std::vector<char> via_node(nl.forward ? static_cast<size_t>(a.num_tokens) * cols : 0);
  if (nl.forward && status == kOk) {
    std::vector<int32_t> rec(g.plan_words);
    for (int64_t t = 0; t < a.num_tokens; ++t)
      for (int node = 0; node < n_nodes; ++node) {
        if (node == my_node) continue;
        std::fill(rec.begin(), rec.end(), -1);
        bool any = false;
        for (int j = 0; j < cols; ++j) {
          int32_t crow = a.send_rows[t * g.send_cols + j];
          if (crow < 0 || nl.node_of[holder(j, crow)] != node) continue;
          via_node[t * cols + j] = 1;
          rec[1 + j] = crow;
          float w = token_major ? 1.0f : a.weights[t * K + j];
          std::memcpy(&rec[1 + cols + j], &w, 4);
          any = true;
        }
        if (!any) continue;
        rec[0] = static_cast<int32_t>(t);
        const int f = nl.forwarder(me, node);
        const size_t i = static_cast<size_t>(me) * cap + planned[node].size();
        std::memcpy(st.at<int32_t>(f, g.off_plan_rec + i * g.plan_words * 4, g.plan_words),
                    rec.data(), g.plan_words * 4);
        planned[node].push_back(t);
      }
  }
  for (int node = 0; nl.forward && node < n_nodes; ++node) {
    if (node == my_node) continue;
    const int f = nl.forwarder(me, node);
    *st.at<int32_t>(f, g.off_plan_count + size_t(me) * 4, 1) =
        static_cast<int32_t>(planned[node].size());
    st.flag(f, g.off_plan_flag, epoch);
  }

  // 2. Every received row back to its source, at the row the source chose;
  //    with forwarding, rows of another node's source to its forwarder here.
  auto send_back = [&](int64_t r, int src, int64_t crow) {
    if (r < 0 || r >= a.expert_rows || r >= g.recv_rows || src < 0 || src >= n || crow < 0 ||
        crow >= g.combine_rows) {
      status = kBadArgument;  // rows not covered by the caller, or an edited handle
      return;
    }
    if (nl.forward && nl.node_of[src] != my_node) {
      const int f = nl.forwarder(src, my_node);
      std::memcpy(st.at<char>(f, g.off_stage_rows + (size_t(src) * g.combine_rows + crow) * crb,
                              crb),
                  rows + r * crb, crb);
      return;
    }
    std::memcpy(st.at<char>(src, g.off_combine_buf + crow * crb, crb), rows + r * crb, crb);
  };
  if (status == kOk && token_major) {
    // Source q's k-th row here is its combine row summary[4q] + k (its rows
    // to this PE, in token order).
    const int32_t* summary = a.recv_summary;
    const int32_t* bits = summary + slot_bits_at(n, g.local_experts);
    auto filled = [&](int q, int64_t k) {  // token_slots: slot k of q holds a row
      return k < c.max_tokens && ((bits[q * g.slot_words + k / 32] >> (k % 32)) & 1);
    };
    for (int q = 0; q < n && status == kOk; ++q)
      for (int64_t k = 0; k < summary[4 * q + 1] && status == kOk; ++k)
        if (!c.token_slots || filled(q, k))
          send_back(summary[4 * q + 2] + k, q, static_cast<int64_t>(summary[4 * q]) + k);
  } else if (status == kOk) {
    for (int64_t r = 0; r < g.recv_rows && status == kOk; ++r) {
      const int32_t* meta = a.recv_meta + r * kMetaWords;
      if (meta[kMetaSrcPe] >= 0) send_back(r, meta[kMetaSrcPe], meta[kMetaCombineRow]);
    }
  }
  for (int p : nl.forward ? nl.pes_of[my_node] : std::vector<int>{})
    store_flag(at<uint64_t>(s, op, p, g.off_stage_flag + size_t(me) * 8), epoch);

  // 3b. Forwarder: for each source of another node it serves, sum the
  //     token's rows staged by this node's PEs (weighted, expert-major) in
  //     fp32; one row of the combine dtype goes back per token.
  bool waited_stage = false;
  for (int src = 0; nl.forward && src < n; ++src) {
    if (nl.node_of[src] == my_node || nl.forwarder(src, my_node) != me) continue;
    if (!waited_stage) {
      wait_for(s, op, at<uint64_t>(s, op, me, g.off_stage_flag), epoch, nl.pes_of[my_node], call,
               "rows to reduce");
      waited_stage = true;
    }
    wait_for(s, op, at<uint64_t>(s, op, me, g.off_plan_flag), epoch, {src}, call,
             "its reduction plan");
    const int32_t records = std::min<int32_t>(
        *at<int32_t>(s, op, me, g.off_plan_count + size_t(src) * 4), static_cast<int32_t>(cap));
    const char* staged = at<char>(s, op, me, g.off_stage_rows + size_t(src) * g.combine_rows * crb);
    std::vector<float> acc(c.hidden);
    for (int32_t i = 0; i < records; ++i) {
      const int32_t* rec =
          at<int32_t>(s, op, me, g.off_plan_rec + (size_t(src) * cap + i) * g.plan_words * 4);
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int j = 0; j < cols; ++j) {
        const int32_t crow = rec[1 + j];
        if (crow < 0 || crow >= g.combine_rows) continue;
        float w;
        std::memcpy(&w, &rec[1 + cols + j], 4);
        const char* row = staged + size_t(crow) * crb;
        for (int h = 0; h < c.hidden; ++h) acc[h] += w * load_as_float(row, h, g.combine_dtype);
      }
      void* out = st.at<char>(src, g.off_partial + (size_t(me) * cap + i) * crb, crb);
      for (int h = 0; h < c.hidden; ++h) store_from_float(out, h, g.combine_dtype, acc[h]);
    }
  }

  for (int p = 0; p < n; ++p) {
    *st.at<int32_t>(p, g.off_combine_status + me * 4, 1) = status;
    st.flag(p, g.off_combine_flag, epoch);
  }
  wait_all(s, op, at<uint64_t>(s, op, me, g.off_combine_flag), epoch, call, "combined rows");
  std::string abort;
  const int32_t* statuses = at<int32_t>(s, op, me, g.off_combine_status);
  for (int q = 0; q < n; ++q)
    if (statuses[q] != kOk)
      abort += (abort.empty() ? "" : "; ") + describe_status(statuses[q], 0, q, c);
  auto release = [&] {
    for (int p = 0; p < n; ++p) st.flag(p, g.off_freed_flag, epoch);
  };
  if (!abort.empty()) {
    release();
    std::string msg = call + " aborted on every PE: " + abort;
    if (status != kOk) throw InvalidArgument(msg);
    throw StateError(msg);
  }

  // 3. Sum in fp32 per token: token-major rows as they are, expert-major
  //    rows weighted by the token's top-k weight; then each other node's
  //    partial sum.
  const char* buf = at<char>(s, op, me, g.off_combine_buf);
  const DType dt = g.combine_dtype;
  std::vector<float> acc(c.hidden);
  std::vector<size_t> next(n_nodes, 0);  // per node: its next partial
  for (int64_t t = 0; t < a.num_tokens; ++t) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int j = 0; j < cols; ++j) {
      int32_t row = a.send_rows[t * g.send_cols + j];
      if (row < 0 || (nl.forward && via_node[t * cols + j])) continue;
      float w = token_major ? 1.0f : a.weights[t * K + j];
      const char* src = buf + row * crb;
      for (int h = 0; h < c.hidden; ++h) acc[h] += w * load_as_float(src, h, dt);
    }
    for (int node = 0; node < n_nodes; ++node) {
      if (next[node] >= planned[node].size() || planned[node][next[node]] != t) continue;
      const size_t i = static_cast<size_t>(nl.forwarder(me, node)) * cap + next[node]++;
      const char* partial = at<char>(s, op, me, g.off_partial + i * crb);
      for (int h = 0; h < c.hidden; ++h) acc[h] += load_as_float(partial, h, dt);
    }
    for (int h = 0; h < c.hidden; ++h)
      store_from_float(a.out, static_cast<size_t>(t) * c.hidden + h, dt, acc[h]);
  }
  release();
}

}  // namespace symheap::ep

// redispatch #e on PE s (shares combine's epochs and combine buffers)
//   1. wait until every PE is done with the combine buffers of #e-1;
//   2. store each token's row into this PE's own combine buffer at every row
//      the dispatch chose for it; with forwarding, send each other node's
//      forwarder one record per token (plan_flag), and as a forwarder copy
//      the records received into the staging rows; set combine_flag[s] = e
//      everywhere;
//   3. wait for every PE, then pull each received row from its source's
//      combine buffer (the row combine would have sent back), or from the
//      forwarder's staging rows; set freed_flag.
namespace symheap::ep {

void redispatch_cpu(PeState& s, Op& op, const RedispatchArgs& a) {
  const Config& c = op.cfg;
  const Geometry& g = op.geo;
  const int n = op.n_pes, me = op.my_pe, K = c.topk;
  const bool token_major = c.layout == Layout::TokenMajor;
  const uint64_t epoch = ++op.combine_epoch;
  const std::string call = "ep redispatch #" + std::to_string(epoch);
  const size_t crb = g.combine_row_bytes;
  int32_t status = a.status;
  if (status == kOk && (a.num_tokens < 0 || a.num_tokens > c.max_tokens)) status = kBadArgument;
  const int cols = token_major ? n : K;
  for (int64_t t = 0; status == kOk && t < a.num_tokens; ++t)
    for (int j = 0; j < cols; ++j) {
      int32_t row = a.send_rows[t * g.send_cols + j];
      if (row >= g.combine_rows || row < -1) status = kBadHandle;
    }
  // (received row, source, source's combine row) of every row that landed here.
  struct Pull { int64_t row; int src; int64_t crow; };
  std::vector<Pull> pulls;
  if (status == kOk && token_major) {
    const int32_t* summary = a.recv_summary;
    const int32_t* bits = summary + slot_bits_at(n, g.local_experts);
    for (int q = 0; q < n && status == kOk; ++q) {
      if (summary[4 * q + 1] < 0 || summary[4 * q + 1] > g.recv_rows) {
        status = kBadHandle;  // an edited handle
        break;
      }
      for (int64_t k = 0; k < summary[4 * q + 1]; ++k)
        if (!c.token_slots ||
            (k < c.max_tokens && ((bits[q * g.slot_words + k / 32] >> (k % 32)) & 1)))
          pulls.push_back({summary[4 * q + 2] + k, q, static_cast<int64_t>(summary[4 * q]) + k});
    }
  } else if (status == kOk) {
    for (int64_t r = 0; r < g.recv_rows; ++r) {
      const int32_t* meta = a.recv_meta + r * kMetaWords;
      if (meta[kMetaSrcPe] >= 0) pulls.push_back({r, meta[kMetaSrcPe], meta[kMetaCombineRow]});
    }
  }
  for (const Pull& p : pulls)
    if (p.row < 0 || p.row >= g.recv_rows || p.src < 0 || p.src >= n || p.crow < 0 ||
        p.crow >= g.combine_rows)
      status = kBadHandle;  // an edited handle

  // 1-2. This PE's rows into its own combine buffer.
  wait_all(s, op, at<uint64_t>(s, op, me, g.off_freed_flag), epoch - 1, call,
           "the previous combine to finish");
  char* mine = at<char>(s, op, me, g.off_combine_buf);
  const char* rows = static_cast<const char*>(a.rows);
  for (int64_t t = 0; status == kOk && t < a.num_tokens; ++t)
    for (int j = 0; j < cols; ++j) {
      int32_t row = a.send_rows[t * g.send_cols + j];
      if (row >= 0) std::memcpy(mine + row * crb, rows + t * crb, crb);
    }
  Stores st(s, op);
  // With forwarding, a token's row crosses once per other node: a record
  // (the row, its combine rows there) to this PE's forwarder, which copies it
  // into its staging rows [this PE][combine row] before its combine flag;
  // that node's PEs read it there instead of from this PE.
  const NodeLayout& nl = op.nodes;
  const int my_node = nl.node_of[me], n_nodes = static_cast<int>(nl.pes_of.size());
  const int64_t cap = c.max_tokens;
  std::vector<int32_t> records(n_nodes, 0);
  if (nl.forward && status == kOk) {
    std::vector<int32_t> crows(cols);
    for (int64_t t = 0; t < a.num_tokens; ++t)
      for (int node = 0; node < n_nodes; ++node) {
        if (node == my_node) continue;
        bool any = false;
        for (int j = 0; j < cols; ++j) {
          int32_t crow = a.send_rows[t * g.send_cols + j];
          bool there = crow >= 0 &&
                       nl.node_of[holder_of(token_major, n, a.recv_summary, j, crow)] == node;
          crows[j] = there ? crow : -1;
          any |= there;
        }
        if (!any) continue;
        const int f = nl.forwarder(me, node);
        const size_t i = static_cast<size_t>(me) * cap + records[node]++;
        char* out = st.at<char>(f, g.off_row_rec + i * g.row_rec_bytes, g.row_rec_bytes);
        std::memset(out, 0, g.row_rec_bytes);
        std::memcpy(out, crows.data(), cols * 4);
        std::memcpy(out + g.row_rec_row_at, rows + t * crb, crb);
      }
  }
  for (int node = 0; nl.forward && node < n_nodes; ++node) {
    if (node == my_node) continue;
    const int f = nl.forwarder(me, node);
    *st.at<int32_t>(f, g.off_plan_count + size_t(me) * 4, 1) = records[node];
    st.flag(f, g.off_plan_flag, epoch);
  }
  for (int src = 0; nl.forward && src < n; ++src) {  // as the forwarder of src
    if (nl.node_of[src] == my_node || nl.forwarder(src, my_node) != me) continue;
    wait_for(s, op, at<uint64_t>(s, op, me, g.off_plan_flag), epoch, {src}, call,
             "rows to forward");
    const int32_t count = std::min<int32_t>(
        *at<int32_t>(s, op, me, g.off_plan_count + size_t(src) * 4), static_cast<int32_t>(cap));
    char* staged = at<char>(s, op, me, g.off_stage_rows + size_t(src) * g.combine_rows * crb);
    for (int32_t i = 0; i < count; ++i) {
      const char* rec =
          at<char>(s, op, me, g.off_row_rec + (size_t(src) * cap + i) * g.row_rec_bytes);
      const int32_t* crows = reinterpret_cast<const int32_t*>(rec);
      for (int j = 0; j < cols; ++j)
        if (crows[j] >= 0 && crows[j] < g.combine_rows)
          std::memcpy(staged + size_t(crows[j]) * crb, rec + g.row_rec_row_at, crb);
    }
  }
  for (int p = 0; p < n; ++p) {
    *st.at<int32_t>(p, g.off_combine_status + me * 4, 1) = status;
    st.flag(p, g.off_combine_flag, epoch);
  }
  wait_all(s, op, at<uint64_t>(s, op, me, g.off_combine_flag), epoch, call, "redispatched rows");
  std::string abort;
  const int32_t* statuses = at<int32_t>(s, op, me, g.off_combine_status);
  for (int q = 0; q < n; ++q)
    if (statuses[q] != kOk)
      abort += (abort.empty() ? "" : "; ") + describe_status(statuses[q], 0, q, c);
  // 3. Pull every received row from its source (another node's: from its
  //    forwarder here).
  if (abort.empty()) {
    std::memset(a.out, 0, static_cast<size_t>(g.recv_rows) * crb);
    for (const Pull& p : pulls) {
      char* out = static_cast<char*>(a.out) + p.row * crb;
      if (nl.forward && nl.node_of[p.src] != my_node)
        std::memcpy(out,
                    at<char>(s, op, nl.forwarder(p.src, my_node),
                             g.off_stage_rows + (size_t(p.src) * g.combine_rows + p.crow) * crb),
                    crb);
      else
        st.read(p.src, g.off_combine_buf + p.crow * crb, out, crb);
    }
  }
  for (int p = 0; p < n; ++p) st.flag(p, g.off_freed_flag, epoch);
  if (!abort.empty()) {
    std::string msg = call + " aborted on every PE: " + abort;
    if (status != kOk) throw InvalidArgument(msg);
    throw StateError(msg);
  }
}

}  // namespace symheap::ep
