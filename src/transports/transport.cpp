#include "transports/transport.hpp"

#include "symheap/errors.hpp"
#include "symheap/runtime.hpp"
#ifdef SYMHEAP_WITH_CUDA
#include "backends/cuda_api.hpp"
#endif

namespace symheap {

Via parse_via(const std::string& text) {
  if (text == "auto") return Via::Auto;
  if (text == "load_store") return Via::LoadStore;
  if (text == "copy_engine") return Via::CopyEngine;
  throw InvalidArgument("via must be 'auto', 'load_store' or 'copy_engine', got '" + text + "'");
}

Transports::Transports(const PeState& s)
    : load_store_(make_load_store_transport()), remote_(make_remote_transport(s)) {
#ifdef SYMHEAP_WITH_CUDA
  if (cuda::backend_active()) {
    sm_stores_ = make_cuda_sm_store_transport();
    copy_engine_ = make_cuda_copy_engine_transport();
  }
#endif
  by_peer_.reserve(s.peers.size());
  for (const Peer& peer : s.peers)
    by_peer_.push_back(peer.kind == PeerKind::Remote ? remote_.get() : load_store_.get());
}

Transport& Transports::select(int pe, Via via) const {
  Transport* chosen = by_peer_.at(pe);
  if (chosen != load_store_.get()) return *chosen;  // no other path reaches a remote peer
  // The cpu backend has one way to move bytes: every `via` takes it.
  if (via == Via::LoadStore && sm_stores_) return *sm_stores_;
  if (via == Via::CopyEngine && copy_engine_) return *copy_engine_;
  return *chosen;
}

void Transports::quiet(PeState& s, StreamHandle stream) const {
  // The backend's quiet (load/store's) completes the caller's stream, where
  // SM stores run, and on cuda every copy-engine channel of the device too:
  // the barrier relies on that, so the copy-engine transport adds nothing.
  // Remote first: on cuda the caller's stream may wait for the network, and
  // the remote quiet has the deadline (the stream sync has none).
  remote_->quiet(s, stream);
  load_store_->quiet(s, stream);
}

}  // namespace symheap
