// The remote transport on the cuda backend: peers of another node, reached
// through the device engine of remote_device_engine.hpp (NCCL, in
// libsymheap_nccl.so next to the module, opened only when a cuda PE has
// remote peers). Puts, gets and signals are ordered on the caller's stream
// and return once queued; quiet returns once every one of them landed at its
// target. Every wait has the PE's deadline and names the late peer; after a
// timeout the engine's connections to that peer are torn down, so nothing of
// it keeps running on the device. Where no engine serves the peers, every
// operation raises the error that says what is missing and how to get it.
#ifdef SYMHEAP_WITH_CUDA
#include <cuda_runtime.h>

#include <cstdio>
#include <exception>
#include <mutex>

#include "symheap/errors.hpp"
#include "symheap/runtime.hpp"
#include "symheap/wait.hpp"
#include "transports/remote_device_engine.hpp"
#include "transports/remote_engine_loader.hpp"
#include "transports/transport.hpp"

namespace symheap {
namespace {

// The process's device engine, loaded on first success and kept.
remote::DeviceEngine* device_engine(std::string* why_not) {
#ifdef SYMHEAP_NCCL_ENGINE_FILE
  static std::mutex mu;
  static remote::DeviceEngine* engine = nullptr;
  std::lock_guard<std::mutex> lock(mu);
  if (engine) return engine;
  auto open = reinterpret_cast<remote::DeviceOpenFn>(remote::symbol_beside_core(
      SYMHEAP_NCCL_ENGINE_FILE, remote::kDeviceOpenSymbol, "the NCCL engine", why_not));
  if (!open) return nullptr;
  std::string why;
  engine = open(remote::kDeviceEngineAbi, &why);
  if (!engine) *why_not = "the NCCL engine is unavailable: " + why;
  return engine;
#else
  *why_not = std::string("symheap was built without the NCCL engine (" SYMHEAP_NCCL_MISSING
                         "): ") + remote::kNcclInstallHint + ", then rebuild symheap";
  return nullptr;
#endif
}

std::string seconds(double s) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3g s", s);
  return buf;
}

// The core's waits for the engine: the PE's Waiter; what it throws (the job
// failed, Ctrl-C) is kept and rethrown once the engine returned.
class HookWaiter final : public remote::WaitHook {
 public:
  HookWaiter(const PeState* s, double timeout_s) : waiter_(s, timeout_s) {}
  bool pause() override { return guarded([this] { return waiter_.pause(); }); }
  bool check() override { return guarded([this] { return waiter_.check(); }); }
  void rethrow() const {
    if (caught_) std::rethrow_exception(caught_);
  }

 private:
  template <class F>
  bool guarded(F&& f) {
    if (caught_) return false;
    try {
      return f();
    } catch (...) {
      caught_ = std::current_exception();
      return false;
    }
  }

  Waiter waiter_;
  std::exception_ptr caught_;
};

class CudaRemoteTransport final : public Transport {
 public:
  explicit CudaRemoteTransport(const PeState& s) : unreachable_(s.n_pes) {
    // Every PE computes the same answer (the same peer table), so the
    // exchange at init is collective.
    for (const Peer& peer : s.peers) exchange_ |= peer.info.node_id != s.peers[0].info.node_id;
    remote::EndpointSpec spec;
    spec.job = s.job;
    spec.my_pe = s.my_pe;
    spec.n_pes = s.n_pes;
    spec.device = s.device;
    spec.base = s.base();
    spec.heap_size = s.heap_size;
    spec.timeout_s = s.timeout_s;
    for (int p = 0; p < s.n_pes; ++p)
      if (s.peers[p].kind == PeerKind::Remote) spec.remote_pes.push_back(p);
    if (spec.remote_pes.empty()) return;
    std::string why;
    if (remote::DeviceEngine* engine = device_engine(&why)) {
      engine_name_ = engine->name();
      endpoint_ = engine->endpoint(spec, &why);
    }
    if (!endpoint_) set_unreachable(spec.remote_pes, why);
    remote_pes_ = spec.remote_pes;
  }

  ~CudaRemoteTransport() override { endpoint_.reset(); }

  const char* name() const override { return "remote"; }

  bool needs_exchange() const override { return exchange_; }

  // "+<offer>" when this PE's engine is ready, "-<why not>" otherwise.
  std::string exchange_offer() const override {
    if (endpoint_) return "+" + endpoint_->offer();
    if (remote_pes_.empty()) return "+";
    return "-" + unreachable_.at(remote_pes_.front());
  }

  void exchange_connect(PeState& s, const std::vector<std::string>& offers) override {
    // A PE without an engine cannot take part: then nobody connects, and
    // every remote peer stays unreachable with that PE's reason.
    for (size_t p = 0; p < offers.size(); ++p) {
      if (!offers[p].empty() && offers[p][0] == '+') continue;
      std::string why = static_cast<int>(p) == s.my_pe
                            ? unreachable_.at(remote_pes_.front())
                            : "PE " + std::to_string(p) + " has no remote engine (" +
                                  (offers[p].empty() ? std::string("no reason given")
                                                     : offers[p].substr(1)) + ")";
      endpoint_.reset();
      set_unreachable(remote_pes_, why);
      return;
    }
    if (!endpoint_) return;
    std::vector<std::string> bare;
    for (const std::string& o : offers) bare.push_back(o.substr(1));
    HookWaiter wait(&s, s.timeout_s);
    remote::Outcome o = endpoint_->connect(bare, wait);
    if (o.result != remote::Result::Ok) {
      endpoint_->abort(-1, "its connection failed at init");
      wait.rethrow();
      if (o.result == remote::Result::GaveUp)
        throw TimeoutError("init on PE " + std::to_string(s.my_pe) + ": " + who(s, o.late_pe) +
                           " did not connect through the " + engine_name_ + " engine within " +
                           seconds(s.timeout_s));
      throw StateError("init on PE " + std::to_string(s.my_pe) + ": connecting to " +
                       who(s, o.late_pe) + " through the " + engine_name_ +
                       " engine failed: " + o.error);
    }
    connected_ = true;
  }

  void exchange_failed(PeState&, const std::string& why) override {
    if (endpoint_) endpoint_->abort(-1, "init could not connect every PE");
    endpoint_.reset();
    connected_ = false;
    set_unreachable(remote_pes_, "connecting the PEs through the " + engine_name_ +
                                     " engine failed at init: " + why);
  }

  void put(PeState& s, int pe, size_t dst_off, const void* src, size_t nbytes,
           StreamHandle stream) override {
    reach(s, pe, "put");
    device_memory(s, src, "put source");
    HookWaiter wait(&s, s.timeout_s);
    finish(s, pe, "put", wait,
           endpoint_->put(pe, dst_off, src, nbytes, nullptr, as_stream(stream), wait));
  }

  void get(PeState& s, int pe, void* dst, size_t src_off, size_t nbytes,
           StreamHandle stream) override {
    reach(s, pe, "get");
    device_memory(s, dst, "get destination");
    HookWaiter wait(&s, s.timeout_s);
    finish(s, pe, "get", wait, endpoint_->get(pe, dst, src_off, nbytes, as_stream(stream), wait));
  }

  void put_signal(PeState& s, int pe, size_t dst_off, const void* src, size_t nbytes,
                  size_t signal_off, uint64_t value, SignalOp op, StreamHandle stream) override {
    reach(s, pe, "put_signal");
    if (nbytes > 0) device_memory(s, src, "put_signal source");
    remote::SignalSpec sig{signal_off, value, op == SignalOp::Add};
    HookWaiter wait(&s, s.timeout_s);
    finish(s, pe, "put_signal", wait,
           endpoint_->put(pe, dst_off, src, nbytes, &sig, as_stream(stream), wait));
  }

  void signal(PeState& s, int pe, size_t signal_off, uint64_t value, SignalOp op,
              StreamHandle stream) override {
    reach(s, pe, "signal_op");
    remote::SignalSpec sig{signal_off, value, op == SignalOp::Add};
    HookWaiter wait(&s, s.timeout_s);
    finish(s, pe, "signal_op", wait, endpoint_->signal(pe, sig, as_stream(stream), wait));
  }

  int64_t fetch_add(PeState& s, int pe, size_t off, int64_t value) override {
    return atomic(s, pe, remote::Op::FetchAdd, off, value, 0);
  }
  int64_t compare_swap(PeState& s, int pe, size_t off, int64_t expected,
                       int64_t desired) override {
    return atomic(s, pe, remote::Op::CompareSwap, off, expected, desired);
  }
  int64_t swap(PeState& s, int pe, size_t off, int64_t value) override {
    return atomic(s, pe, remote::Op::Swap, off, value, 0);
  }

  void quiet(PeState& s, StreamHandle) override {
    if (!endpoint_ || !connected_) return;
    HookWaiter wait(&s, s.timeout_s);
    remote::Outcome o = endpoint_->quiet(wait);
    if (o.result != remote::Result::Ok) fail(s, o.late_pe, "quiet", wait, o);
  }

  // Finalize, after the job's last barrier: ends the engine's connections in
  // order, so nothing of it is left on the device when the heap goes.
  void close(PeState& s) override {
    if (!endpoint_ || !connected_) return;
    HookWaiter wait(nullptr, s.timeout_s);  // the PE is closing: only the deadline counts
    remote::Outcome o = endpoint_->close(wait);
    connected_ = false;
    if (o.result == remote::Result::Ok) return;
    endpoint_->abort(-1, "finalize could not close it in order");
    std::fprintf(stderr,
                 "symheap: finalize on PE %d: the %s engine's connections were aborted (%s: %s)\n",
                 s.my_pe, engine_name_.c_str(), who(s, o.late_pe).c_str(),
                 o.result == remote::Result::GaveUp ? "did not answer in time" : o.error.c_str());
  }

  void disconnect(PeState&) override {
    if (endpoint_ && connected_) endpoint_->abort(-1, "the PE finalized");
    connected_ = false;
    endpoint_.reset();
  }

  std::string unreachable_reason(int pe) const override { return unreachable_.at(pe); }
  uint64_t bytes_across_nodes() const override { return endpoint_ ? endpoint_->bytes_moved() : 0; }

 private:
  static void* as_stream(StreamHandle stream) { return reinterpret_cast<void*>(stream); }

  void set_unreachable(const std::vector<int>& pes, const std::string& why) {
    for (int p : pes) unreachable_[p] = why;
  }

  void reach(const PeState& s, int pe, const char* what) const {
    const std::string& why = unreachable_.at(pe);
    if (!why.empty())
      throw Unsupported(s.no_path_message(pe, what) + "; the remote transport cannot serve it: " +
                        why);
    if (!endpoint_ || !connected_)
      throw StateError(std::string(what) + " on PE " + std::to_string(s.my_pe) + " to " +
                       who(s, pe) + ": the remote engine's connections are closed");
  }

  // NCCL moves device memory only.
  static void device_memory(const PeState& s, const void* p, const char* what) {
    cudaPointerAttributes attr{};
    cudaError_t e = cudaPointerGetAttributes(&attr, p);
    if (e != cudaSuccess) cudaGetLastError();
    bool ok = e == cudaSuccess &&
              (attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged) &&
              attr.device == s.device;
    if (!ok)
      throw InvalidArgument(std::string(what) + " must be memory of this PE's device (cuda:" +
                            std::to_string(s.device) + ") for a remote peer: the network "
                            "engine moves device memory only; copy host data to the device "
                            "first");
  }

  static std::string who(const PeState& s, int pe) {
    if (pe < 0 || pe >= s.n_pes) return "a remote PE";
    return "PE " + std::to_string(pe) + " (node '" + s.peers[pe].info.node_id + "')";
  }

  int64_t atomic(PeState& s, int pe, remote::Op op, size_t off, int64_t a, int64_t b) {
    const char* what = remote::op_name(op);
    reach(s, pe, what);
    HookWaiter wait(&s, s.timeout_s);
    int64_t old = 0;
    finish(s, pe, what, wait, endpoint_->atomic(pe, op, off, a, b, &old, nullptr, wait));
    return old;
  }

  void finish(PeState& s, int pe, const char* what, const HookWaiter& wait,
              const remote::Outcome& o) {
    if (o.result == remote::Result::Ok) return;
    fail(s, o.late_pe >= 0 ? o.late_pe : pe, what, wait, o);
  }

  // A late or failed peer: its connections go (nothing of it stays queued on
  // the device), then the error names it.
  [[noreturn]] void fail(PeState& s, int pe, const char* what, const HookWaiter& wait,
                         const remote::Outcome& o) {
    std::string why = o.result == remote::Result::GaveUp
                          ? "did not answer within " + seconds(s.timeout_s)
                          : o.error;
    endpoint_->abort(pe, std::string(what) + " on PE " + std::to_string(s.my_pe) + ": " + why);
    wait.rethrow();
    if (o.result == remote::Result::GaveUp)
      throw TimeoutError(std::string(what) + " on PE " + std::to_string(s.my_pe) + ": " +
                         who(s, pe) + " did not answer within " + seconds(s.timeout_s) +
                         " (its process is frozen, dead, or no longer serving remote "
                         "requests); its " + engine_name_ + " connections were aborted");
    if (o.result == remote::Result::Refused)
      throw RemoteError(std::string(what) + " on PE " + std::to_string(s.my_pe) + ": " +
                            who(s, pe) + " could not serve a request (" + o.op + "): " +
                            o.error +
                            "; its " + engine_name_ + " connections were aborted",
                        pe, o.op);
    throw StateError(std::string(what) + " on PE " + std::to_string(s.my_pe) + " to " +
                     who(s, pe) + " failed in the " + engine_name_ + " engine: " + o.error);
  }

  bool exchange_ = false;
  bool connected_ = false;
  std::string engine_name_ = "NCCL";
  std::vector<int> remote_pes_;
  std::vector<std::string> unreachable_;  // per PE: why no engine reaches it, or empty
  std::unique_ptr<remote::DeviceEndpoint> endpoint_;
};

}  // namespace

std::unique_ptr<Transport> make_cuda_remote_transport(const PeState& s) {
  return std::make_unique<CudaRemoteTransport>(s);
}

}  // namespace symheap
#endif  // SYMHEAP_WITH_CUDA
