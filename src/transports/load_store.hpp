// The load/store transport: the peer's heap is mapped in this process (same
// process, or another process of this node through shared memory / CUDA
// IPC), so every operation is a backend copy, signal or atomic at the
// peer's address. The cuda transports below derive from it for what they
// do not change.
#pragma once
#include "transports/transport.hpp"

namespace symheap {

class LoadStoreTransport : public Transport {
 public:
  const char* name() const override { return "load_store"; }
  void put(PeState& s, int pe, size_t dst_off, const void* src, size_t nbytes,
           StreamHandle stream) override;
  void get(PeState& s, int pe, void* dst, size_t src_off, size_t nbytes,
           StreamHandle stream) override;
  void put_signal(PeState& s, int pe, size_t dst_off, const void* src, size_t nbytes,
                  size_t signal_off, uint64_t value, SignalOp op, StreamHandle stream) override;
  void signal(PeState& s, int pe, size_t signal_off, uint64_t value, SignalOp op,
              StreamHandle stream) override;
  int64_t fetch_add(PeState& s, int pe, size_t off, int64_t value) override;
  int64_t compare_swap(PeState& s, int pe, size_t off, int64_t expected,
                       int64_t desired) override;
  int64_t swap(PeState& s, int pe, size_t off, int64_t value) override;
  void quiet(PeState& s, StreamHandle stream) override;
};

}  // namespace symheap
