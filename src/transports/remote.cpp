// The remote transport: peers of another node, which no load/store path
// reaches. Operations become requests of the process's remote engine
// (src/transports/remote_engine.hpp; MPI on the cpu backend), which the
// target's process serves on the target PE's heap. Puts and signals return
// once their message is copied; quiet waits until every one of them was
// sent and every process they went to has served them. Every wait has the
// PE's deadline and names the peer. Where no engine can serve a peer (a
// process without MPI) every operation raises the error that says what is
// missing and how to get it. The cuda backend has its own (remote_cuda.cpp).
#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <vector>

#include "symheap/errors.hpp"
#include "symheap/runtime.hpp"
#include "symheap/wait.hpp"
#include "transports/remote_engine_loader.hpp"
#include "transports/transport.hpp"

namespace symheap {
namespace {

using remote::Op;

// Larger transfers go as several messages (an MPI count is an int).
constexpr size_t kChunkBytes = size_t(64) << 20;

bool host_memory_backend() { return Runtime::instance().backend_name() == "cpu"; }

std::string seconds(double s) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3g s", s);
  return buf;
}

class RemoteTransport final : public Transport {
 public:
  explicit RemoteTransport(const PeState& s) : unreachable_(s.n_pes) {
    bool any_remote = false;
    for (const Peer& peer : s.peers) any_remote |= peer.kind == PeerKind::Remote;
    if (!any_remote) return;
    std::string why;
    engine_ = remote::process_engine(&why);
    for (int p = 0; p < s.n_pes; ++p) {
      const Peer& peer = s.peers[p];
      if (peer.kind != PeerKind::Remote) continue;
      std::string peer_why;
      if (!engine_) unreachable_[p] = why;
      else if (!engine_->reaches(peer.info.remote_address, &peer_why))
        unreachable_[p] = std::string("the ") + engine_->name() + " engine cannot reach it: " +
                          peer_why + " (launch every process with mpirun and init with "
                          "symheap.init_mpi)";
    }
    if (engine_) {
      engine_->attach(s.job, s.my_pe, s.base(), s.heap_size);
      attached_ = true;
    }
  }

  const char* name() const override { return "remote"; }

  void put(PeState& s, int pe, size_t dst_off, const void* src, size_t nbytes,
           StreamHandle) override {
    post_bytes(s, pe, Op::Put, dst_off, src, nbytes, nullptr);
  }

  void get(PeState& s, int pe, void* dst, size_t src_off, size_t nbytes, StreamHandle) override {
    reach(s, pe, "get");
    size_t done = 0;
    do {
      size_t n = std::min(kChunkBytes, nbytes - done);
      remote::Request req = request(s, pe, Op::Get);
      bytes_ += n;
      req.offset = src_off + done;
      req.nbytes = n;
      auto p = engine_->start(address(s, pe), req, nullptr, n);
      await(s, pe, p, "get");
      check_reply(s, pe, *p, "get");
      std::memcpy(static_cast<char*>(dst) + done, p->reply_data(), n);
      done += n;
    } while (done < nbytes);
  }

  void put_signal(PeState& s, int pe, size_t dst_off, const void* src, size_t nbytes,
                  size_t signal_off, uint64_t value, SignalOp op, StreamHandle) override {
    remote::Request sig = request(s, pe, Op::PutSignal);
    sig.signal_offset = signal_off;
    sig.value = static_cast<int64_t>(value);
    sig.signal_add = op == SignalOp::Add;
    post_bytes(s, pe, Op::PutSignal, dst_off, src, nbytes, &sig);
  }

  void signal(PeState& s, int pe, size_t signal_off, uint64_t value, SignalOp op,
              StreamHandle) override {
    reach(s, pe, "signal_op");
    remote::Request req = request(s, pe, Op::Signal);
    req.signal_offset = signal_off;
    req.value = static_cast<int64_t>(value);
    req.signal_add = op == SignalOp::Add;
    bytes_ += 8;
    post(s, pe, req, nullptr);
  }

  int64_t fetch_add(PeState& s, int pe, size_t off, int64_t value) override {
    return atomic(s, pe, Op::FetchAdd, off, value, 0);
  }
  int64_t compare_swap(PeState& s, int pe, size_t off, int64_t expected,
                       int64_t desired) override {
    return atomic(s, pe, Op::CompareSwap, off, expected, desired);
  }
  int64_t swap(PeState& s, int pe, size_t off, int64_t value) override {
    return atomic(s, pe, Op::Swap, off, value, 0);
  }

  void quiet(PeState& s, StreamHandle) override {
    if (!engine_) return;  // nothing was ever sent
    std::vector<Sent> sends;
    std::map<std::string, int> targets;  // address -> a PE there (for messages)
    {
      std::lock_guard<std::mutex> lock(mu_);
      sends.swap(outstanding_);
      targets.swap(touched_);
    }
    // A quiet that fails (a peer late or gone) leaves the processes it did not
    // hear back from to the next quiet: what was sent to them still arrives
    // once they go on, and only their answer to a later quiet says they served it.
    auto keep_unconfirmed = [&](std::map<std::string, int>::const_iterator from) {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto it = from; it != targets.cend(); ++it) touched_.emplace(it->first, it->second);
    };
    for (size_t i = 0; i < sends.size(); ++i) {
      try {
        await(s, sends[i].pe, sends[i].p, "quiet");
      } catch (...) {
        for (size_t j = i + 1; j < sends.size(); ++j) engine_->abandon(std::move(sends[j].p));
        keep_unconfirmed(targets.cbegin());
        throw;
      }
    }
    for (auto it = targets.cbegin(); it != targets.cend(); ++it) {
      try {
        confirm_served(s, it->first, it->second);
      } catch (...) {
        keep_unconfirmed(it);
        throw;
      }
    }
  }

  void disconnect(PeState& s) override {
    if (!attached_) return;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (Sent& sent : outstanding_) engine_->abandon(std::move(sent.p));
      outstanding_.clear();
      touched_.clear();
    }
    engine_->detach(s.job, s.my_pe);
    attached_ = false;
  }

  std::string unreachable_reason(int pe) const override { return unreachable_.at(pe); }
  uint64_t bytes_across_nodes() const override { return bytes_.load(); }

  ~RemoteTransport() override {
    if (engine_)
      for (Sent& sent : outstanding_) engine_->abandon(std::move(sent.p));
  }

 private:
  // Throws the reason when no engine reaches `pe`.
  void reach(const PeState& s, int pe, const char* what) const {
    const std::string& why = unreachable_.at(pe);
    if (!why.empty())
      throw Unsupported(s.no_path_message(pe, what) + "; the remote transport cannot serve it: " +
                        why);
  }

  static const std::string& address(const PeState& s, int pe) {
    return s.peers[pe].info.remote_address;
  }

  static std::string who(const PeState& s, int pe) {
    return "PE " + std::to_string(pe) + " (node '" + s.peers[pe].info.node_id + "')";
  }

  static remote::Request request(const PeState& s, int pe, Op op) {
    remote::Request req;
    req.op = static_cast<uint32_t>(op);
    req.job = s.job;
    req.from_pe = s.my_pe;
    req.to_pe = pe;
    return req;
  }

  // A put's bytes in chunks; with `signal_req`, the last chunk carries the signal.
  void post_bytes(PeState& s, int pe, Op op, size_t dst_off, const void* src, size_t nbytes,
                  const remote::Request* signal_req) {
    reach(s, pe, remote::op_name(op));
    size_t done = 0;
    do {
      size_t n = std::min(kChunkBytes, nbytes - done);
      bool last = done + n == nbytes;
      remote::Request req = last && signal_req ? *signal_req : request(s, pe, Op::Put);
      req.offset = dst_off + done;
      req.nbytes = n;
      bytes_ += n + (last && signal_req ? 8 : 0);
      post(s, pe, req, static_cast<const char*>(src) + done);
      done += n;
    } while (done < nbytes);
  }

  // A request without a reply: quiet completes it.
  void post(PeState& s, int pe, const remote::Request& req, const void* payload) {
    auto p = engine_->start(address(s, pe), req, payload, 0);
    std::lock_guard<std::mutex> lock(mu_);
    touched_.emplace(address(s, pe), pe);
    // Drop the sends MPI already completed, so a long run of puts keeps little
    // (a failed one stays for quiet to report).
    outstanding_.erase(std::remove_if(outstanding_.begin(), outstanding_.end(),
                                      [](Sent& sent) { return sent.p->test() == 1; }),
                       outstanding_.end());
    outstanding_.push_back({std::move(p), pe});
  }

  int64_t atomic(PeState& s, int pe, Op op, size_t off, int64_t value, int64_t value2) {
    const char* what = remote::op_name(op);
    reach(s, pe, what);
    remote::Request req = request(s, pe, op);
    req.offset = off;
    req.value = value;
    req.value2 = value2;
    bytes_ += 8;
    auto p = engine_->start(address(s, pe), req, nullptr, 0);
    await(s, pe, p, what);
    check_reply(s, pe, *p, what);
    return p->reply().value;
  }

  // Polls `p` until done, within the PE's timeout; leaves early (and throws)
  // when the job failed (the bootstrap's notice of a dead PE) or on Ctrl-C.
  void await(PeState& s, int pe, std::unique_ptr<remote::Pending>& p, const char* what) {
    Waiter waiter(&s, s.timeout_s);
    try {
      for (;;) {
        int state = p->test();
        if (state == 1) return;
        if (state < 0)
          throw StateError(std::string(what) + " on PE " + std::to_string(s.my_pe) + " to " +
                           who(s, pe) + " failed in the " + engine_->name() + " engine: " +
                           p->error());
        if (!waiter.pause())
          throw TimeoutError(std::string(what) + " on PE " + std::to_string(s.my_pe) + ": " +
                             who(s, pe) + " did not answer within " + seconds(s.timeout_s) +
                             " (its process is frozen, dead, or no longer serving remote "
                             "requests)");
      }
    } catch (...) {
      engine_->abandon(std::move(p));
      throw;
    }
  }

  // quiet's round trip to the process at `addr` (PE `pe` there): its answer
  // comes after it served every earlier request of this PE, and reports the
  // first of them it could not serve.
  void confirm_served(PeState& s, const std::string& addr, int pe) {
    remote::Request req = request(s, pe, Op::Quiet);
    auto p = engine_->start(addr, req, nullptr, 0);
    await(s, pe, p, "quiet");
    check_reply(s, pe, *p, "quiet");
    const remote::Reply& r = p->reply();
    if (r.value != 0) {
      const char* op = remote::op_name(static_cast<Op>(r.value));
      int target = r.target >= 0 && r.target < s.n_pes ? static_cast<int>(r.target) : pe;
      throw RemoteError("quiet on PE " + std::to_string(s.my_pe) + ": " + who(s, target) +
                            " could not serve an earlier request (" + op + "): " +
                            remote::status_text(static_cast<remote::Status>(r.detail)),
                        target, op);
    }
  }

  void check_reply(const PeState& s, int pe, const remote::Pending& p, const char* what) {
    auto status = static_cast<remote::Status>(p.reply().status);
    if (status != remote::Status::Ok)
      throw RemoteError(std::string(what) + " on PE " + std::to_string(s.my_pe) + ": " +
                            who(s, pe) + " could not serve it: " + remote::status_text(status),
                        pe, what);
  }

  remote::Engine* engine_ = nullptr;
  bool attached_ = false;
  std::atomic<uint64_t> bytes_{0};  // see bytes_across_nodes
  std::vector<std::string> unreachable_;  // per PE: why no engine reaches it, or empty

  std::mutex mu_;  // the PE's requests in flight (several threads may act for one PE)
  struct Sent {
    std::unique_ptr<remote::Pending> p;
    int pe;
  };
  std::vector<Sent> outstanding_;
  std::map<std::string, int> touched_;  // processes sent to since the last quiet -> a PE there
};

}  // namespace

std::unique_ptr<Transport> make_remote_transport(const PeState& s) {
#ifdef SYMHEAP_WITH_CUDA
  if (!host_memory_backend()) return make_cuda_remote_transport(s);
#endif
  return std::make_unique<RemoteTransport>(s);
}

std::string remote_address_of_this_process() {
  if (!host_memory_backend()) return "";
  std::string why;
  remote::Engine* engine = remote::process_engine(&why);
  return engine ? engine->address() : "";
}

}  // namespace symheap
