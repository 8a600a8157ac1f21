#include "transports/load_store.hpp"

#include "symheap/runtime.hpp"

namespace symheap {
namespace {

Backend& be() { return Runtime::instance().backend(); }

template <class T>
T* at(PeState& s, int pe, size_t off, const char* what) {
  return reinterpret_cast<T*>(s.peer_address(pe, off, what));
}

}  // namespace

void LoadStoreTransport::put(PeState& s, int pe, size_t dst_off, const void* src, size_t nbytes,
                             StreamHandle stream) {
  be().copy(s.device, at<char>(s, pe, dst_off, "put"), src, nbytes, stream);
}

void LoadStoreTransport::get(PeState& s, int pe, void* dst, size_t src_off, size_t nbytes,
                             StreamHandle stream) {
  be().copy(s.device, dst, at<char>(s, pe, src_off, "get"), nbytes, stream);
}

void LoadStoreTransport::put_signal(PeState& s, int pe, size_t dst_off, const void* src,
                                    size_t nbytes, size_t signal_off, uint64_t value,
                                    SignalOp op, StreamHandle stream) {
  uint64_t* word = at<uint64_t>(s, pe, signal_off, "signal");
  put(s, pe, dst_off, src, nbytes, stream);
  be().fence(s.device, stream);  // data before signal
  be().signal(s.device, word, value, op, stream);
}

void LoadStoreTransport::signal(PeState& s, int pe, size_t signal_off, uint64_t value,
                                SignalOp op, StreamHandle stream) {
  be().signal(s.device, at<uint64_t>(s, pe, signal_off, "signal"), value, op, stream);
}

int64_t LoadStoreTransport::fetch_add(PeState& s, int pe, size_t off, int64_t value) {
  return be().fetch_add(s.device, at<int64_t>(s, pe, off, "atomic_fetch_add"), value);
}

int64_t LoadStoreTransport::compare_swap(PeState& s, int pe, size_t off, int64_t expected,
                                         int64_t desired) {
  return be().compare_swap(s.device, at<int64_t>(s, pe, off, "atomic_compare_swap"), expected,
                           desired);
}

int64_t LoadStoreTransport::swap(PeState& s, int pe, size_t off, int64_t value) {
  return be().swap(s.device, at<int64_t>(s, pe, off, "atomic_swap"), value);
}

void LoadStoreTransport::quiet(PeState& s, StreamHandle stream) { be().quiet(s.device, stream); }

std::unique_ptr<Transport> make_load_store_transport() {
  return std::make_unique<LoadStoreTransport>();
}

}  // namespace symheap
