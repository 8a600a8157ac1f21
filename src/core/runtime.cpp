#include "symheap/runtime.hpp"

#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <iterator>
#include <string>

#include "symheap/errors.hpp"
#include "transports/transport.hpp"

namespace symheap {

namespace {
size_t round_up(size_t v, size_t a) { return (v + a - 1) / a * a; }
// Whether the calling thread chose its device (set_device or init): a thread
// that did not must not silently act for device 0's PE.
thread_local bool t_device_chosen = false;
}  // namespace

// ---------------------------------------------------------------- PeState

void PeState::check_pe(int64_t pe) const {
  if (pe < 0 || pe >= n_pes)
    throw InvalidArgument("pe " + std::to_string(pe) + " out of range [0, " +
                          std::to_string(n_pes) + ")");
}

size_t PeState::checked_offset(const void* addr, size_t nbytes, const char* what) {
  const char* p = static_cast<const char*>(addr);
  if (p < base() || p >= base() + heap_size)
    throw InvalidArgument(std::string(what) +
                          " is not on this PE's symmetric heap: allocate it with "
                          "symheap.malloc() or symheap.empty()");
  size_t offset = static_cast<size_t>(p - base());
  std::lock_guard<std::mutex> lock(mu);
  if (!allocator.covers(offset, nbytes))
    throw InvalidArgument(std::string(what) + ": " + std::to_string(nbytes) +
                          " bytes at heap offset " + std::to_string(offset) +
                          " run outside the symmetric allocation (or it was freed)");
  return offset;
}

size_t PeState::heap_allocate(size_t nbytes, size_t align) {
  if (align == 0 || (align & (align - 1)))
    throw InvalidArgument("align must be a power of two, got " + std::to_string(align));
  std::lock_guard<std::mutex> lock(mu);
  return allocator.allocate(nbytes, std::max<size_t>(align, 8), heap_size);
}

void PeState::heap_release(size_t offset) {
  std::lock_guard<std::mutex> lock(mu);
  allocator.release(offset);
}

PeState::HeapUsage PeState::heap_usage() {
  std::lock_guard<std::mutex> lock(mu);
  return {allocator.bytes_in_use(), allocator.capacity(), allocator.live_blocks()};
}

char* PeState::peer_address(int pe, size_t offset, const char* what) {
  check_pe(pe);
  const Peer& peer = peers[pe];
  if (!peer.base) throw Unsupported(no_path_message(pe, what));
  return static_cast<char*>(peer.base) + offset;
}

std::string PeState::no_path_message(int pe, const char* what) const {
  const Peer& peer = peers.at(pe);
  const std::string mine = peers.at(my_pe).info.node_id;
  std::string text = std::string(what) + ": PE " + std::to_string(pe) + " is " +
                     peer_kind_name(peer.kind) + " (node '" + peer.info.node_id +
                     "'; PE " + std::to_string(my_pe) + " is on node '" + mine + "')";
  if (peer.kind != PeerKind::Remote)
    return text + " and its mapping is closed (the PE is being finalized)";
  return text + ": no load/store path reaches it (only the host RMA calls reach remote peers, "
                "through the remote transport; see docs/transports.md)";
}

// ---------------------------------------------------------------- Runtime

Runtime& Runtime::instance() {
  static Runtime* runtime = new Runtime();  // never destroyed: threads may outlive exit
  return *runtime;
}

namespace {
std::unique_ptr<Backend> make_backend(const std::string& requested) {
  std::string name = requested;
  if (name.empty()) {
    const char* env = std::getenv("SYMHEAP_BACKEND");
    name = env && *env ? env : "auto";
  }
  if (name == "cpu") return make_cpu_backend();
  if (name == "cuda" || name == "auto") {
#ifdef SYMHEAP_WITH_CUDA
    std::string why;
    auto cuda = make_cuda_backend(&why);
    if (cuda) return cuda;
    if (name == "cuda") throw StateError("the cuda backend is unavailable: " + why);
#else
    if (name == "cuda")
      throw StateError(
          "the cuda backend is unavailable: symheap was built without CUDA "
          "(rebuild with nvcc on PATH or SYMHEAP_CUDA=ON)");
#endif
    return make_cpu_backend();
  }
  throw InvalidArgument("unknown backend '" + name + "': use cpu, cuda or auto (SYMHEAP_BACKEND)");
}
}  // namespace

Backend& Runtime::backend() {
  // Every call of every PE thread reads it (device guards, host waits): no lock once made.
  if (Backend* made = active_backend_.load(std::memory_order_acquire)) return *made;
  std::lock_guard<std::mutex> lock(mu_);
  if (!backend_) {
    backend_ = make_backend("");
    active_backend_.store(backend_.get(), std::memory_order_release);
  }
  return *backend_;
}

void Runtime::select_backend(const std::string& name) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!slots_.empty())
    throw StateError("cannot switch backend while PEs are initialised; finalize them first");
  std::unique_ptr<Backend> made = make_backend(name);
  // The one it replaces stays alive: a thread may still be using a reference to it.
  if (backend_) retired_backends_.push_back(std::move(backend_));
  backend_ = std::move(made);
  active_backend_.store(backend_.get(), std::memory_order_release);
}

std::string Runtime::backend_name() { return backend().name(); }

int Runtime::current_device() { return backend().current_device(); }
void Runtime::set_device(int device) {
  backend().set_device(device);
  t_device_chosen = true;
}

int Runtime::acting_device() {
  if (t_device_chosen) return current_device();
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (slots_.size() == 1) return slots_.begin()->first;
    if (slots_.size() > 1) {
      std::string devices;
      for (auto& kv : slots_) devices += (devices.empty() ? "" : ", ") + std::to_string(kv.first);
      throw StateError(
          "this thread never chose a device, and this process hosts PEs on devices " + devices +
          ": call symheap.set_device(d) in this thread first (a new thread does not inherit "
          "the device of the thread that started it)");
    }
  }
  return current_device();
}

std::shared_ptr<PeState> Runtime::create_pe(uint64_t job, int device, int rank, int world,
                                            size_t heap_size, double timeout_s) {
  Backend& be = backend();
  if (world < 1) throw InvalidArgument("world_size must be >= 1, got " + std::to_string(world));
  if (rank < 0 || rank >= world)
    throw InvalidArgument("rank " + std::to_string(rank) + " outside [0, world_size=" +
                          std::to_string(world) + ")");
  if (device < 0 || device >= be.device_count())
    throw InvalidArgument("device " + std::to_string(device) + " out of range: the " +
                          std::string(be.name()) + " backend has " +
                          std::to_string(be.device_count()) + " devices");
  checked_timeout(timeout_s);
  size_t header = round_up(PeState::header_words(world) * sizeof(uint64_t), 4096);
  if (heap_size < header + 4096)
    throw InvalidArgument("heap size " + std::to_string(heap_size) + " bytes is too small: " +
                          std::to_string(world) + " PEs need at least " +
                          std::to_string(header + 4096));

  auto state = std::make_shared<PeState>();
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = slots_.find(device);
    if (it != slots_.end())
      throw StateError("device " + std::to_string(device) + " already hosts PE " +
                       std::to_string(it->second->my_pe) +
                       ": init was called twice on this device slot (finalize first, or "
                       "give each thread its own device with device=)");
    if (rank_to_device_.count({job, rank}))
      throw StateError("rank " + std::to_string(rank) +
                       " is already initialised in this process for this unique id");
    state->generation = next_generation_++;
    slots_[device] = state;  // reserve the slot before the slow heap creation
    rank_to_device_[{job, rank}] = device;
  }
  state->job = job;
  state->device = device;
  state->my_pe = rank;
  state->n_pes = world;
  state->heap_size = heap_size;
  state->header_size = header;
  state->timeout_s = timeout_s;
  try {
    DeviceGuard guard(device);
    char hint[96];  // the owner's pid first: the cpu backend's stale-heap reaper reads it
    std::snprintf(hint, sizeof hint, "%ld.%016llx.%d.%llu", static_cast<long>(getpid()),
                  static_cast<unsigned long long>(job), rank,
                  static_cast<unsigned long long>(state->generation));
    state->heap = be.create_heap(device, heap_size, hint);
    be.zero(device, state->heap->base, header);
    state->allocator = Allocator(header, heap_size);
  } catch (...) {
    std::lock_guard<std::mutex> lock(mu_);
    slots_.erase(device);
    rank_to_device_.erase({job, rank});
    throw;
  }
  return state;
}

void Runtime::connect_peers(PeState& s, const std::vector<PeInfo>& infos) {
  Backend& be = backend();
  if (static_cast<int>(infos.size()) != s.n_pes)
    throw StateError("bootstrap returned " + std::to_string(infos.size()) + " PE records for " +
                     std::to_string(s.n_pes) + " PEs");
  const PeInfo& mine = infos[s.my_pe];
  std::vector<Peer> peers(infos.size());
  for (size_t r = 0; r < infos.size(); ++r) {
    const PeInfo& info = infos[r];
    if (info.rank != static_cast<int>(r))
      throw StateError("bootstrap PE records out of order");
    if (info.heap_size != s.heap_size)
      throw InvalidArgument("heap sizes differ across PEs: PE " + std::to_string(s.my_pe) +
                            " has " + std::to_string(s.heap_size) + " bytes, PE " +
                            std::to_string(r) + " has " + std::to_string(info.heap_size) +
                            " (set the same heap_size / SYMHEAP_HEAP_SIZE everywhere)");
    Peer& peer = peers[r];
    peer.info = info;
    if (static_cast<int>(r) == s.my_pe) {
      peer.kind = PeerKind::Self;
      peer.base = s.heap->base;
    } else if (info.node_id != mine.node_id) {
      peer.kind = PeerKind::Remote;
    } else if (info.pid == mine.pid) {
      peer.kind = PeerKind::SameProcess;
      auto other = slot_of_rank(s.job, static_cast<int>(r));
      if (!other || !other->heap)
        throw StateError("same-process PE " + std::to_string(r) + " has no heap in this process");
      be.enable_peer_access(s.device, other->device);
      peer.mapping = other->heap;
      peer.base = other->heap->base;
    } else {
      peer.kind = PeerKind::SameNode;
      DeviceGuard guard(s.device);
      peer.mapping = be.open_peer_heap(s.device, info.heap_handle, info.heap_size);
      peer.base = peer.mapping->base;
    }
  }
  s.peers = std::move(peers);
  s.transports = std::make_shared<const Transports>(s);
  std::vector<char*> table(s.n_pes);
  for (int r = 0; r < s.n_pes; ++r) table[r] = static_cast<char*>(s.peers[r].base);
  be.copy(s.device, const_cast<char**>(s.peer_table()), table.data(),
          table.size() * sizeof(char*), 0);
  be.quiet(s.device, 0);
}

DeviceContext device_context(const PeState& s) {
  DeviceContext ctx{};
  ctx.peer_bases = s.peer_table();
  ctx.my_base = s.base();
  ctx.my_pe = s.my_pe;
  ctx.n_pes = s.n_pes;
  ctx.heap_size = s.heap_size;
  ctx.device_barrier = reinterpret_cast<unsigned long long*>(s.device_barrier_flags());
  ctx.error_record = reinterpret_cast<unsigned long long*>(s.device_error_record());
  ctx.timeout_ns = static_cast<unsigned long long>(s.timeout_s * 1e9);
  for (int r = 0; r < s.n_pes && r < kContextPeerBases; ++r)
    ctx.first_peer_bases[r] = static_cast<char*>(s.peers[r].base);
  return ctx;
}

void Runtime::destroy_pe(int device) {
  std::shared_ptr<PeState> state;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = slots_.find(device);
    if (it == slots_.end()) return;
    state = it->second;
    slots_.erase(it);
    rank_to_device_.erase({state->job, state->my_pe});
    for (auto x = xla_devices_.begin(); x != xla_devices_.end();)
      x = x->second == device ? xla_devices_.erase(x) : std::next(x);
  }
  // Let calls in flight on other threads finish (waits leave at once when
  // they see `closing`) before the peer mappings go away under them.
  state->close_calls();
  if (state->transports) state->transports->disconnect(*state);  // before the heap goes
  if (state->heap && backend_) backend_->unexport(state->heap->export_handle);
  state->peers.clear();  // drops peer mappings held by this PE
}

std::shared_ptr<PeState> Runtime::slot(int device) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = slots_.find(device);
  return it == slots_.end() ? nullptr : it->second;
}

std::shared_ptr<PeState> Runtime::current() {
  int device = acting_device();
  auto state = slot(device);
  if (!state || state->peers.empty())
    throw StateError("symheap is not initialised on device " + std::to_string(device) +
                     " of this thread: call symheap.init(...) (or set_device to a device "
                     "that hosts a PE) first");
  return state;
}

std::shared_ptr<PeState> Runtime::slot_of_rank(uint64_t job, int rank) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = rank_to_device_.find({job, rank});
  if (it == rank_to_device_.end()) return nullptr;
  auto s = slots_.find(it->second);
  return s == slots_.end() ? nullptr : s->second;
}

int Runtime::device_of_rank(uint64_t job, int rank) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = rank_to_device_.find({job, rank});
  return it == rank_to_device_.end() ? -1 : it->second;
}

DeviceCaches& Runtime::device_caches(int device) {
  // Every attention call looks its device's caches up: no lock once they exist.
  const bool fast = device >= 0 && device < kFastDevices;
  if (fast)
    if (DeviceCaches* made = fast_device_caches_[device].load(std::memory_order_acquire))
      return *made;
  std::lock_guard<std::mutex> lock(mu_);
  auto& entry = device_caches_[device];
  if (!entry) entry = std::make_unique<DeviceCaches>();
  if (fast) fast_device_caches_[device].store(entry.get(), std::memory_order_release);
  return *entry;  // stable address: entries are never erased
}

std::vector<int> Runtime::active_devices() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<int> out;
  for (auto& kv : slots_) out.push_back(kv.first);
  return out;
}

void Runtime::map_xla_device(int ordinal, int device) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!slots_.count(device))
    throw StateError("XLA device " + std::to_string(ordinal) + ": device slot " +
                     std::to_string(device) + " hosts no PE");
  xla_devices_[ordinal] = device;
}

std::shared_ptr<PeState> Runtime::slot_of_xla(int ordinal) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = xla_devices_.find(ordinal);
  if (it == xla_devices_.end()) return nullptr;
  auto slot = slots_.find(it->second);
  return slot == slots_.end() ? nullptr : slot->second;
}

// ---------------------------------------------------------------- DeviceGuard

DeviceGuard::DeviceGuard(int device) {
  Backend& be = Runtime::instance().backend();
  previous_ = be.current_device();
  changed_ = previous_ != device;
  if (changed_) be.set_device(device);
}

DeviceGuard::~DeviceGuard() {
  if (changed_) {
    try {
      Runtime::instance().backend().set_device(previous_);
    } catch (...) {
    }
  }
}

}  // namespace symheap
