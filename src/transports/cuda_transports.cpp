// The cuda transports a caller picks for a mapped peer with `via`: SM stores
// (a copy kernel on the caller's stream writing into the peer's heap) and
// the copy-engine channel to the peer's GPU (src/transports/copy_engine.cu).
// Gets, signals and atomics stay load/store operations at the peer's
// address: a copy engine has no atomics.
#ifdef SYMHEAP_WITH_CUDA
#include "backends/cuda_api.hpp"
#include "symheap/runtime.hpp"
#include "transports/load_store.hpp"

namespace symheap {
namespace {

class SmStoreTransport final : public LoadStoreTransport {
 public:
  const char* name() const override { return "load_store_sm"; }
  void put(PeState& s, int pe, size_t dst_off, const void* src, size_t nbytes,
           StreamHandle stream) override {
    cuda::put_load_store(s, s.peer_address(pe, dst_off, "put"), src, nbytes, stream, 0);
  }
  // put_signal: LoadStoreTransport's (this put, then the signal on the stream).
};

class CopyEngineTransport final : public LoadStoreTransport {
 public:
  const char* name() const override { return "copy_engine"; }
  void put(PeState& s, int pe, size_t dst_off, const void* src, size_t nbytes,
           StreamHandle stream) override {
    cuda::put_copy_engine(s, pe, s.peer_address(pe, dst_off, "put"), src, nbytes, stream,
                          nullptr, 0, SignalOp::Set);
  }
  // The signal follows the bytes on the same channel: the receiver learns of
  // completion without the sender synchronising.
  void put_signal(PeState& s, int pe, size_t dst_off, const void* src, size_t nbytes,
                  size_t signal_off, uint64_t value, SignalOp op, StreamHandle stream) override {
    auto* word = reinterpret_cast<uint64_t*>(s.peer_address(pe, signal_off, "signal"));
    cuda::put_copy_engine(s, pe, s.peer_address(pe, dst_off, "put"), src, nbytes, stream, word,
                          value, op);
  }
  // quiet: the backend's, which waits for every channel of the device.
};

}  // namespace

std::unique_ptr<Transport> make_cuda_sm_store_transport() {
  return std::make_unique<SmStoreTransport>();
}
std::unique_ptr<Transport> make_cuda_copy_engine_transport() {
  return std::make_unique<CopyEngineTransport>();
}

}  // namespace symheap
#endif  // SYMHEAP_WITH_CUDA
