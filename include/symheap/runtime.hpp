// Runtime state. A PE is a (process, device) pair: each local device that
// hosts a PE owns one PeState slot, found from the calling thread's current
// device or, from any thread, through the process-wide rank -> device map.
#pragma once
#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "symheap/allocator.hpp"
#include "symheap/backend.hpp"
#include "symheap/device_context.h"

namespace symheap {

// Timeouts, in seconds: the default of every wait, and the accepted range
// (0, kMaxTimeoutS]. Written once here; the Python layer reads them.
constexpr double kDefaultTimeoutS = 120.0;
constexpr double kMaxTimeoutS = 1e6;
// Returns `t` or throws InvalidArgument naming `what` and the range (NaN,
// inf, zero, negative and values above kMaxTimeoutS are refused alike).
double checked_timeout(double t, const char* what = "timeout");

// The transport layer (src/transports/transport.hpp): a PE's transports and
// the caller's choice of path for a put.
class Transports;
enum class Via : int;

enum class PeerKind { Self = 0, SameProcess = 1, SameNode = 2, Remote = 3 };
const char* peer_kind_name(PeerKind kind);

// What each PE publishes at init (all-gathered by the bootstrap).
struct PeInfo {
  int rank = -1;
  int device = -1;
  int64_t pid = 0;
  std::string node_id;
  std::string heap_handle;
  size_t heap_size = 0;
  std::string remote_address;  // how remote peers reach this process (empty: they cannot)
};

struct Peer {
  PeerKind kind = PeerKind::Remote;
  PeInfo info;
  void* base = nullptr;             // load/store address of its heap, or null
  std::shared_ptr<Region> mapping;  // keeps a peer mapping alive
};

// A keyed cache (kernels, plans, workspaces, device properties) shared by
// every thread that drives one device; each entry is made once, under a lock.
class DeviceCaches {
 public:
  template <class T>
  std::shared_ptr<T> get(const std::string& key, const std::function<std::shared_ptr<T>()>& make) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = items_.find(key);
    if (it != items_.end()) return std::static_pointer_cast<T>(it->second);
    auto made = make();
    items_[key] = made;
    return made;
  }
  void clear() {
    std::lock_guard<std::mutex> lock(mu_);
    items_.clear();
  }

 private:
  std::mutex mu_;
  std::unordered_map<std::string, std::shared_ptr<void>> items_;
};

struct PeState {
  uint64_t job = 0;
  uint64_t generation = 0;  // unique per slot creation; stale buffers are detected
  int device = -1;
  int my_pe = -1;
  int n_pes = 0;
  size_t heap_size = 0;
  size_t header_size = 0;  // reserved bytes at the start of every heap
  double timeout_s = kDefaultTimeoutS;
  std::shared_ptr<Region> heap;
  std::vector<Peer> peers;
  // The transport each peer's kind selects, with each transport's resources;
  // set by Runtime::connect_peers.
  std::shared_ptr<const Transports> transports;

  std::mutex mu;  // guards allocator, barrier epoch and caches
  Allocator allocator;
  uint64_t barrier_epoch = 0;

  char* base() const { return static_cast<char*>(heap->base); }
  // Offset of `addr` in this PE's heap; throws unless [addr, addr+n) is
  // inside one live symmetric allocation.
  size_t checked_offset(const void* addr, size_t nbytes, const char* what);
  // Load/store address of `offset` in peer `pe`'s heap; throws for remote peers.
  char* peer_address(int pe, size_t offset, const char* what);
  // Why `what` cannot reach peer `pe` (a remote peer, or one whose mapping
  // is gone): names the peer, its node and the missing transport. Every
  // refusal of a peer without a path uses this text.
  std::string no_path_message(int pe, const char* what) const;
  void check_pe(int64_t pe) const;  // InvalidArgument naming [0, n_pes)
  // The heap allocator, under `mu`. Every PE makes the same calls in the same
  // order (the front end checks that first), so a block lands at the same
  // offset on every PE. `align` must be a power of two; blocks are aligned to
  // at least 8 bytes. heap_release throws unless `offset` starts a live block.
  size_t heap_allocate(size_t nbytes, size_t align);
  void heap_release(size_t offset);
  struct HeapUsage {
    size_t bytes_in_use, capacity, live_blocks;
  };
  HeapUsage heap_usage();
  // Heap header layout (same on every PE): [barrier flags: n_pes words]
  // [scratch words: n_pes] [peer table: n_pes load/store base addresses]
  // [device barrier counters: n_pes] [device error record: 4 words].
  uint64_t* barrier_flags() const { return reinterpret_cast<uint64_t*>(base()); }
  uint64_t* scratch_words() const { return barrier_flags() + n_pes; }
  // Peer base addresses as seen from this PE's device, stored in its own heap
  // (device memory on cuda) so kernels take one pointer: see device.cuh.
  char* const* peer_table() const {
    return reinterpret_cast<char* const*>(barrier_flags() + 2 * n_pes);
  }
  uint64_t* device_barrier_flags() const { return barrier_flags() + 3 * n_pes; }
  uint64_t* device_error_record() const { return barrier_flags() + 4 * n_pes; }
  static size_t header_words(int n_pes) { return 4 * static_cast<size_t>(n_pes) + 4; }

  // Per-op caches tied to this PE (plans, symmetric workspaces).
  DeviceCaches caches;

  // Lifetime of calls: every operation counts itself in `in_flight` (PeUse);
  // finalize sets `closing`, then waits for the count to drain before it
  // tears down peer mappings. Waits see `closing` and leave at once.
  std::atomic<int> in_flight{0};
  std::atomic<bool> closing{false};
  // Sets `closing` and waits until no call is in flight (finalize).
  void close_calls();

  // Set once when the job failed (a PE died, a collective timed out): every
  // wait of this PE, now or later, throws the first cause.
  void mark_failed(const std::string& why);
  bool failed() const { return failed_.load(std::memory_order_acquire); }
  std::string failure() const;
  void throw_if_failed() const;  // StateError with the first cause

 private:
  std::atomic<bool> failed_{false};
  mutable std::mutex failure_mu_;
  std::string failure_;
};

// Counts one call in flight on a PE for as long as it lives; throws
// StateError if the PE is being finalized.
class PeUse {
 public:
  explicit PeUse(PeState& s);
  ~PeUse() { s_.in_flight.fetch_sub(1, std::memory_order_seq_cst); }
  PeUse(const PeUse&) = delete;
  PeUse& operator=(const PeUse&) = delete;

 private:
  PeState& s_;
};

DeviceContext device_context(const PeState& s);

// The out-of-band exchange that init and finalize run over (the Python
// package's TCP bootstrap today, symheap/_bootstrap.py). Each method may throw
// what its implementation raises (a timeout naming the late PE, Ctrl-C);
// init and finalize clean up and let it through unchanged.
class Bootstrap {
 public:
  virtual ~Bootstrap() = default;
  virtual void connect() = 0;  // joins the job; rank 0 also starts the root
  // Every PE's `mine` in rank order, for the collective named `tag`.
  virtual std::vector<std::string> allgather(const std::string& mine, const std::string& tag) = 0;
  virtual std::string failure() = 0;  // why the job failed (a PE died), or empty
  virtual void close(double grace_s) = 0;  // after connect only
};

class Runtime {
 public:
  static Runtime& instance();

  Backend& backend();
  // Picks the backend by name ("cpu", "cuda" or "auto"); only while no PE
  // is initialised in this process.
  void select_backend(const std::string& name);
  std::string backend_name();

  int current_device();
  // Sets the thread's device and records that the thread chose one.
  void set_device(int device);
  // Device of the PE the calling thread acts for: its current device once it
  // chose one (set_device or init); before that, the only PE of the process,
  // and a StateError naming the cause when the process hosts several.
  int acting_device();

  // Creates the slot of `device` with its heap; throws if the slot is in use.
  std::shared_ptr<PeState> create_pe(uint64_t job, int device, int rank, int world,
                                     size_t heap_size, double timeout_s);
  // Maps every peer from the all-gathered infos and fixes its kind.
  void connect_peers(PeState& state, const std::vector<PeInfo>& infos);
  void destroy_pe(int device);
  // Collective init of one PE, in this order: the heap (on cpu, after
  // unlinking heaps that owners killed inside init left behind), the
  // bootstrap, the exchange of PeInfo, the peer mappings (a failure on any PE
  // fails every PE alike), then the heap's export name is dropped. With
  // `xla_ordinal` >= 0 the PE also serves that XLA device. On any failure the
  // slot is destroyed and the bootstrap closed without goodbyes.
  void init_pe(uint64_t job, int device, int rank, int world, size_t heap_size,
               double timeout_s, Bootstrap& boot, int xla_ordinal = -1);
  // Collective finalize: a barrier (skipped once the job failed), on backends
  // whose importers must unmap before an owner frees (CUDA IPC) the unmapping
  // and a second barrier, then the slot is destroyed and the bootstrap closed,
  // whether or not the barriers succeeded.
  void finalize_pe(int device, Bootstrap& boot);

  std::shared_ptr<PeState> slot(int device);          // null when absent
  std::shared_ptr<PeState> current();                 // throws before init
  std::shared_ptr<PeState> slot_of_rank(uint64_t job, int rank);  // null when absent
  int device_of_rank(uint64_t job, int rank);          // -1 when not local
  // Caches of `device` that outlive PEs (ops usable without init, such as
  // attention, keep kernels and device properties here). No device limit.
  DeviceCaches& device_caches(int device);
  std::vector<int> active_devices();

  // Devices as XLA numbers them (its DeviceOrdinal: the local GPU ordinal on
  // CUDA, the JAX device id on cpu, global across processes) -> local device
  // slot. Set by init_pe for the JAX front end; an entry goes with its PE.
  void map_xla_device(int ordinal, int device);
  // The PE serving XLA device `ordinal`; null when no PE of this process does.
  std::shared_ptr<PeState> slot_of_xla(int ordinal);

 private:
  Runtime() = default;
  // Closes the calls in flight on `s` and unmaps the heaps of other
  // processes while their owners still hold them (finalize).
  void release_peer_mappings(PeState& s);
  std::mutex mu_;
  std::unique_ptr<Backend> backend_;
  std::atomic<Backend*> active_backend_{nullptr};  // backend_, read without mu_
  std::vector<std::unique_ptr<Backend>> retired_backends_;  // replaced by select_backend
  std::unordered_map<int, std::shared_ptr<PeState>> slots_;
  std::map<std::pair<uint64_t, int>, int> rank_to_device_;
  std::unordered_map<int, std::unique_ptr<DeviceCaches>> device_caches_;
  static constexpr int kFastDevices = 64;  // devices whose caches are found without mu_
  std::atomic<DeviceCaches*> fast_device_caches_[kFastDevices] = {};
  std::unordered_map<int, int> xla_devices_;  // XLA device ordinal -> device slot
  uint64_t next_generation_ = 1;
};

// Sets the calling thread's current device and restores the previous one.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_;
  bool changed_;
};

// Host-side SHMEM operations on the calling PE's state.
namespace host {
// Each operation validates its local arguments, then goes through the
// transport of `pe` (PeState::transports); `via` picks another path to a
// mapped peer (puts only).
void put(PeState& s, void* dst, const void* src, size_t nbytes, int pe, StreamHandle stream,
         Via via);
void get(PeState& s, void* dst, const void* src, size_t nbytes, int pe, StreamHandle stream);
void put_signal(PeState& s, void* dst, const void* src, size_t nbytes, uint64_t* signal,
                uint64_t value, SignalOp op, int pe, StreamHandle stream, Via via);
void signal_op(PeState& s, uint64_t* signal, uint64_t value, SignalOp op, int pe,
               StreamHandle stream);
uint64_t signal_wait_until(PeState& s, uint64_t* signal, Compare cmp, uint64_t value,
                           double timeout_s);
int64_t atomic_fetch_add(PeState& s, int64_t* dst, int64_t value, int pe);
int64_t atomic_compare_swap(PeState& s, int64_t* dst, int64_t cond, int64_t value, int pe);
int64_t atomic_swap(PeState& s, int64_t* dst, int64_t value, int pe);
void quiet(PeState& s, StreamHandle stream);
void fence(PeState& s, StreamHandle stream);
// Barrier through the heap: every peer must have a load/store path.
void barrier_all(PeState& s, double timeout_s);
}  // namespace host

size_t parse_size(const std::string& text);  // "256M", "1GiB", "4096"
std::string format_size(size_t bytes);
std::string this_node_id();

}  // namespace symheap
