// The transport layer: how one PE's host-initiated operations reach a peer.
// Each peer's kind selects a transport when the PE connects (load/store for
// peers whose heap is mapped here, remote for peers of another node); a
// caller may ask for another path to a mapped peer (via=). Host operations
// validate their local arguments and hand heap offsets to the transport;
// the transport finds the peer's copy and moves the bytes.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "symheap/backend.hpp"

namespace symheap {

struct PeState;

// The caller's choice of path for a put (Python's `via`): Auto takes the
// transport the peer's kind selects.
enum class Via : int { Auto = 0, LoadStore = 1, CopyEngine = 2 };  // declared in runtime.hpp
// Throws InvalidArgument naming the accepted values.
Via parse_via(const std::string& text);

// One way to reach peers. Offsets are heap offsets (the same on every PE),
// already checked against this PE's allocations; `pe` is in range.
class Transport {
 public:
  virtual ~Transport() = default;
  virtual const char* name() const = 0;
  virtual void put(PeState& s, int pe, size_t dst_off, const void* src, size_t nbytes,
                   StreamHandle stream) = 0;
  virtual void get(PeState& s, int pe, void* dst, size_t src_off, size_t nbytes,
                   StreamHandle stream) = 0;
  // put, then set/add `value` on the peer's signal word once the data is visible.
  virtual void put_signal(PeState& s, int pe, size_t dst_off, const void* src, size_t nbytes,
                          size_t signal_off, uint64_t value, SignalOp op,
                          StreamHandle stream) = 0;
  virtual void signal(PeState& s, int pe, size_t signal_off, uint64_t value, SignalOp op,
                      StreamHandle stream) = 0;
  virtual int64_t fetch_add(PeState& s, int pe, size_t off, int64_t value) = 0;
  virtual int64_t compare_swap(PeState& s, int pe, size_t off, int64_t expected,
                               int64_t desired) = 0;
  virtual int64_t swap(PeState& s, int pe, size_t off, int64_t value) = 0;
  // Completes everything this transport queued for the PE (on `stream`).
  virtual void quiet(PeState& s, StreamHandle stream) = 0;
  // The PE is going away (Runtime::destroy_pe): release what serves it.
  virtual void disconnect(PeState&) {}
  // Engines that connect their PEs after the peer table is known (NCCL on
  // cuda): whether init runs one more exchange (the same answer on every PE),
  // what this PE publishes in it, and the connect from every PE's offer.
  virtual bool needs_exchange() const { return false; }
  virtual std::string exchange_offer() const { return ""; }
  virtual void exchange_connect(PeState&, const std::vector<std::string>&) {}
  // Some PE's connect failed (`why`, from every PE): every remote peer becomes
  // unreachable with that reason.
  virtual void exchange_failed(PeState&, const std::string&) {}
  // Finalize, after the job's last barrier: end connections in order.
  virtual void close(PeState&) {}
  // Why this transport cannot reach `pe` (empty: it can).
  virtual std::string unreachable_reason(int) const { return ""; }
  // Bytes this PE moved to or from other nodes (payloads of puts and gets,
  // 8 per signal or atomic): 0 for transports inside a node.
  virtual uint64_t bytes_across_nodes() const { return 0; }
};

// A PE's transports: one instance of each the backend offers (each holds or
// reaches its own resources) and the one each peer's kind selects. Built
// once the peer kinds are known (Runtime::connect_peers).
class Transports {
 public:
  explicit Transports(const PeState& s);
  // The transport for an operation on `pe`: a remote peer always gets the
  // remote transport; a mapped peer gets the one `via` names, or load/store.
  Transport& select(int pe, Via via = Via::Auto) const;
  // Name of the transport select(pe) gives ("load_store", "remote"): for tests and docs.
  const char* name_of(int pe) const { return by_peer_.at(pe)->name(); }
  // quiet on every transport of this PE.
  void quiet(PeState& s, StreamHandle stream) const;
  // quiet on the remote transport only (finalize, before its barrier).
  void quiet_remote(PeState& s) const { remote_->quiet(s, 0); }
  // The PE is going away: every transport releases what serves it.
  void disconnect(PeState& s) const { remote_->disconnect(s); }
  // The remote engine's exchange at init and its close at finalize (see Transport).
  bool remote_needs_exchange() const { return remote_->needs_exchange(); }
  std::string remote_offer() const { return remote_->exchange_offer(); }
  void remote_connect(PeState& s, const std::vector<std::string>& offers) const {
    remote_->exchange_connect(s, offers);
  }
  void remote_connect_failed(PeState& s, const std::string& why) const {
    remote_->exchange_failed(s, why);
  }
  void close_remote(PeState& s) const { remote_->close(s); }
  uint64_t bytes_across_nodes() const { return remote_->bytes_across_nodes(); }
  // Why select(pe) cannot reach `pe` (empty: it can).
  std::string unreachable_reason(int pe) const { return by_peer_.at(pe)->unreachable_reason(pe); }

 private:
  std::unique_ptr<Transport> load_store_;  // backend copies through the peer's mapping
  std::unique_ptr<Transport> sm_stores_;   // cuda: a copy kernel storing into the peer (via=load_store)
  std::unique_ptr<Transport> copy_engine_; // cuda: the copy-engine channel to the peer's GPU
  std::unique_ptr<Transport> remote_;      // another node: the process's remote engine, or raises
  std::vector<Transport*> by_peer_;
};

// Backend-specific transports; null where the backend has none.
std::unique_ptr<Transport> make_load_store_transport();
std::unique_ptr<Transport> make_remote_transport(const PeState& s);
// What this process publishes at init for remote peers to reach its PEs
// (the remote engine's address), or empty when it has no engine.
std::string remote_address_of_this_process();
#ifdef SYMHEAP_WITH_CUDA
std::unique_ptr<Transport> make_cuda_remote_transport(const PeState& s);
std::unique_ptr<Transport> make_cuda_sm_store_transport();
std::unique_ptr<Transport> make_cuda_copy_engine_transport();
#endif

}  // namespace symheap
