// The remote transport: peers of another node, which no load/store path
// reaches. No network engine is wired in yet, so every operation raises the
// error that names the peer, its node and the missing transport
// (PeState::no_path_message); nothing is ever queued, so quiet has nothing
// to complete. docs/transports.md says what a real one needs.
#include "symheap/errors.hpp"
#include "symheap/runtime.hpp"
#include "transports/transport.hpp"

namespace symheap {
namespace {

class RemoteTransport final : public Transport {
 public:
  const char* name() const override { return "remote"; }
  void put(PeState& s, int pe, size_t, const void*, size_t, StreamHandle) override {
    refuse(s, pe, "put");
  }
  void get(PeState& s, int pe, void*, size_t, size_t, StreamHandle) override {
    refuse(s, pe, "get");
  }
  void put_signal(PeState& s, int pe, size_t, const void*, size_t, size_t, uint64_t, SignalOp,
                  StreamHandle) override {
    refuse(s, pe, "put_signal");
  }
  void signal(PeState& s, int pe, size_t, uint64_t, SignalOp, StreamHandle) override {
    refuse(s, pe, "signal");
  }
  int64_t fetch_add(PeState& s, int pe, size_t, int64_t) override {
    refuse(s, pe, "atomic_fetch_add");
  }
  int64_t compare_swap(PeState& s, int pe, size_t, int64_t, int64_t) override {
    refuse(s, pe, "atomic_compare_swap");
  }
  int64_t swap(PeState& s, int pe, size_t, int64_t) override { refuse(s, pe, "atomic_swap"); }
  void quiet(PeState&, StreamHandle) override {}

 private:
  [[noreturn]] static void refuse(const PeState& s, int pe, const char* what) {
    throw Unsupported(s.no_path_message(pe, what));
  }
};

}  // namespace

std::unique_ptr<Transport> make_remote_transport() { return std::make_unique<RemoteTransport>(); }

}  // namespace symheap
