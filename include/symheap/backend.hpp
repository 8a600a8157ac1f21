// The backend interface: memory, copies, signals and atomics on one kind of
// device. `cpu` (host memory, POSIX shared memory between processes) and
// `cuda` implement it.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

namespace symheap {

// A raw stream handle: 0 means the backend's current/default stream.
using StreamHandle = uintptr_t;

enum class SignalOp { Set = 0, Add = 1 };
enum class Compare { Eq = 0, Ne = 1, Gt = 2, Ge = 3, Lt = 4, Le = 5 };

bool compare_holds(uint64_t lhs, Compare cmp, uint64_t rhs);
const char* compare_name(Compare cmp);

// A mapped memory region (own heap or a peer's). The destructor unmaps it;
// buffers handed to users keep a reference so memory never dangles.
struct Region {
  void* base = nullptr;
  size_t size = 0;
  std::string export_handle;  // what a peer process needs to map it
  std::function<void()> on_release;
  ~Region() {
    if (on_release) on_release();
  }
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual const char* name() const = 0;
  virtual int device_count() = 0;
  virtual int current_device() = 0;
  virtual void set_device(int device) = 0;

  // Symmetric heap of one PE, exportable to processes of the same node.
  virtual std::shared_ptr<Region> create_heap(int device, size_t bytes,
                                              const std::string& name_hint) = 0;
  // Map a heap created by another process of this node.
  virtual std::shared_ptr<Region> open_peer_heap(int device, const std::string& handle,
                                                 size_t bytes) = 0;
  // Drop the export name once every peer has mapped the heap.
  virtual void unexport(const std::string& handle) = 0;
  // Whether importers must unmap a peer's heap before its owner frees it
  // (CUDA IPC): finalize then waits for every PE in between.
  virtual bool unmap_before_owner_frees() const { return false; }
  // Waits until the work `device` has in flight (kernels, copy channels) ended.
  virtual void drain(int) {}
  // Make a same-process peer's memory addressable from `device`.
  virtual void enable_peer_access(int device, int peer_device) = 0;

  // Data movement and synchronisation, ordered on `stream` where the backend
  // has streams.
  virtual void copy(int device, void* dst, const void* src, size_t nbytes,
                    StreamHandle stream) = 0;
  virtual void signal(int device, uint64_t* word, uint64_t value, SignalOp op,
                      StreamHandle stream) = 0;
  virtual uint64_t load_word(int device, const uint64_t* word) = 0;
  virtual int64_t fetch_add(int device, int64_t* word, int64_t value) = 0;
  virtual int64_t compare_swap(int device, int64_t* word, int64_t expected,
                               int64_t desired) = 0;
  virtual int64_t swap(int device, int64_t* word, int64_t value) = 0;
  // Completes every outstanding operation issued on `stream`.
  virtual void quiet(int device, StreamHandle stream) = 0;
  // Orders operations to each peer (earlier ones are visible first).
  virtual void fence(int device, StreamHandle stream) = 0;
  // Zero-fill local memory (the heap header at init).
  virtual void zero(int device, void* dst, size_t nbytes) = 0;
};

std::unique_ptr<Backend> make_cpu_backend();
#ifdef SYMHEAP_WITH_CUDA
// Returns nullptr (with a reason) when no driver or device is usable.
std::unique_ptr<Backend> make_cuda_backend(std::string* why_not);
#endif

}  // namespace symheap
