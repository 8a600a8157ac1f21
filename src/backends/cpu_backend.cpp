// The `cpu` backend: virtual devices are host memory. Heaps live in POSIX
// shared memory so that processes of one node can map each other's heap;
// threads of one process use direct pointers. A "kernel" runs on the calling
// thread, so every operation is complete when it returns.
#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <atomic>
#include <cctype>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <string>

#include "symheap/backend.hpp"
#include "symheap/errors.hpp"
#include "symheap/runtime.hpp"

namespace symheap {
namespace {

thread_local int t_current_device = 0;

// Heap segments are named "/symheap.<hint>", and the runtime's hint starts
// with the owner's pid (Runtime::create_pe).
constexpr const char kSegmentPrefix[] = "symheap.";

// True when no process holds the segment's liveness lock. The owner takes a
// shared flock on its segment for as long as it lives (create_heap); a lock
// is seen from every PID namespace that shares /dev/shm, unlike a pid; a pid
// alive in this namespace (the name's first field) also counts as alive.
// Empty segments are left alone: their owner may be about to take the lock.
bool segment_is_stale(const std::string& name) {
  const char* pid_text = name.c_str() + sizeof kSegmentPrefix - 1;
  char* end = nullptr;
  errno = 0;
  long pid = std::strtol(pid_text, &end, 10);
  if (end != pid_text && *end == '.' && errno == 0 && pid > 0 && pid <= INT_MAX &&
      std::isdigit(static_cast<unsigned char>(*pid_text))) {
    if (kill(static_cast<pid_t>(pid), 0) == 0 || errno != ESRCH) return false;
  }
  std::string path = "/dev/shm/" + name;
  int fd = open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) return false;
  struct stat st;
  bool stale = fstat(fd, &st) == 0 && st.st_uid == getuid() && st.st_size != 0 &&
               flock(fd, LOCK_EX | LOCK_NB) == 0;  // held: the owner lives
  close(fd);
  return stale;
}

// Unlinks heap segments of this user whose owner died during init. A heap's
// shared-memory name is dropped as soon as every peer has mapped it; only a
// process killed inside init can leave one behind.
void reap_stale_segments() {
  DIR* dir = opendir("/dev/shm");
  if (!dir) return;
  while (dirent* entry = readdir(dir)) {
    std::string name = entry->d_name;
    if (name.compare(0, sizeof kSegmentPrefix - 1, kSegmentPrefix) != 0) continue;
    if (segment_is_stale(name)) unlink(("/dev/shm/" + name).c_str());
  }
  closedir(dir);
}

int env_device_count() {
  const char* text = std::getenv("SYMHEAP_CPU_DEVICES");
  if (!text || !*text) return 8;
  char* end = nullptr;
  long n = std::strtol(text, &end, 10);
  if (*end != '\0' || n < 1 || n > 1 << 20)
    throw InvalidArgument(std::string("SYMHEAP_CPU_DEVICES='") + text +
                          "' must be a positive integer (the number of virtual cpu devices)");
  return static_cast<int>(n);
}

std::shared_ptr<Region> map_shm(int fd, size_t bytes, const std::string& name) {
  void* base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED)
    throw std::runtime_error("mmap of shared-memory heap " + name + " failed: " +
                             std::strerror(errno));
  auto region = std::make_shared<Region>();
  region->base = base;
  region->size = bytes;
  region->export_handle = name;
  region->on_release = [base, bytes] { munmap(base, bytes); };
  return region;
}

// Free and total bytes of the file system behind shared memory.
bool shm_space(size_t* free_bytes, size_t* total_bytes) {
  struct statvfs st;
  if (statvfs("/dev/shm", &st) != 0) return false;
  *free_bytes = static_cast<size_t>(st.f_bavail) * st.f_frsize;
  *total_bytes = static_cast<size_t>(st.f_blocks) * st.f_frsize;
  return true;
}

// A heap that does not fit: the message names the sizes and the remedies.
std::string no_room(const std::string& name, size_t bytes, const char* why) {
  size_t free_bytes = 0, total = 0;
  std::string space = shm_space(&free_bytes, &total)
                          ? format_size(free_bytes) + " free of " + format_size(total)
                          : std::string("free space unknown");
  return "cannot reserve the " + format_size(bytes) + " shared-memory heap " + name +
         ": /dev/shm has " + space + " (" + why +
         "). Lower heap_size / SYMHEAP_HEAP_SIZE, run fewer PEs on this node, or enlarge "
         "/dev/shm (docker run --shm-size=..., or mount -o remount,size=... /dev/shm)";
}

class CpuBackend final : public Backend {
 public:
  CpuBackend() : device_count_(env_device_count()) {}
  const char* name() const override { return "cpu"; }
  int device_count() override { return device_count_; }
  int current_device() override { return t_current_device; }
  void set_device(int device) override {
    if (device < 0 || device >= device_count_)
      throw InvalidArgument("device " + std::to_string(device) + " out of range: the cpu backend has " +
                            std::to_string(device_count_) +
                            " virtual devices (set SYMHEAP_CPU_DEVICES for more)");
    t_current_device = device;
  }

  std::shared_ptr<Region> create_heap(int, size_t bytes, const std::string& hint) override {
    reap_stale_segments();
    std::string name = "/" + std::string(kSegmentPrefix) + hint;
    int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);  // owner-only
    if (fd < 0)
      throw std::runtime_error("shm_open(" + name + ") failed: " + std::strerror(errno));
    // A shared lock held for the heap's life tells the stale-segment reaper
    // (reap_stale_segments) that the owner lives, whatever PID namespace it is
    // in; the reaper leaves empty segments alone, so taking it after the
    // open is race-free.
    flock(fd, LOCK_SH);
    // Reserve every page now: a sparse heap would fail later, with SIGBUS, on
    // the first write past the free space of /dev/shm.
    size_t free_bytes = 0, total = 0;
    int err = 0;
    const char* why = nullptr;
    if (shm_space(&free_bytes, &total) && bytes > free_bytes) {
      why = "not enough free space";
    } else if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
      err = errno;
      why = "ftruncate failed";
    } else if ((err = posix_fallocate(fd, 0, static_cast<off_t>(bytes))) != 0) {
      why = err == ENOSPC ? "the reservation ran out of space" : "posix_fallocate failed";
    }
    if (why) {
      close(fd);
      shm_unlink(name.c_str());
      std::string detail = err ? std::string(why) + ": " + std::strerror(err) : why;
      throw HeapExhausted(no_room(name, bytes, detail.c_str()));
    }
    try {
      auto region = map_shm(fd, bytes, name);
      auto unmap = std::move(region->on_release);
      region->on_release = [unmap, fd] {
        unmap();
        close(fd);  // drops the liveness lock
      };
      return region;
    } catch (...) {
      close(fd);
      shm_unlink(name.c_str());
      throw;
    }
  }

  std::shared_ptr<Region> open_peer_heap(int, const std::string& handle, size_t bytes) override {
    int fd = shm_open(handle.c_str(), O_RDWR, 0600);
    if (fd < 0)
      throw std::runtime_error("cannot map peer heap " + handle + ": " + std::strerror(errno) +
                               " (is the peer run by another user, or already gone?)");
    struct stat st;
    if (fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) < bytes) {
      close(fd);
      throw std::runtime_error("peer heap " + handle + " is smaller than announced");
    }
    auto region = map_shm(fd, bytes, handle);
    close(fd);
    region->export_handle.clear();
    return region;
  }

  void unexport(const std::string& handle) override {
    if (!handle.empty()) shm_unlink(handle.c_str());
  }
  void enable_peer_access(int, int) override {}

  void copy(int, void* dst, const void* src, size_t nbytes, StreamHandle) override {
    std::memmove(dst, src, nbytes);
    std::atomic_thread_fence(std::memory_order_release);
  }
  void signal(int, uint64_t* word, uint64_t value, SignalOp op, StreamHandle) override {
    if (op == SignalOp::Set) __atomic_store_n(word, value, __ATOMIC_SEQ_CST);
    else __atomic_fetch_add(word, value, __ATOMIC_SEQ_CST);
  }
  uint64_t load_word(int, const uint64_t* word) override {
    return __atomic_load_n(word, __ATOMIC_ACQUIRE);
  }
  int64_t fetch_add(int, int64_t* word, int64_t value) override {
    return __atomic_fetch_add(word, value, __ATOMIC_SEQ_CST);
  }
  int64_t compare_swap(int, int64_t* word, int64_t expected, int64_t desired) override {
    __atomic_compare_exchange_n(word, &expected, desired, false, __ATOMIC_SEQ_CST,
                                __ATOMIC_SEQ_CST);
    return expected;  // the old value either way
  }
  int64_t swap(int, int64_t* word, int64_t value) override {
    return __atomic_exchange_n(word, value, __ATOMIC_SEQ_CST);
  }
  void quiet(int, StreamHandle) override { std::atomic_thread_fence(std::memory_order_seq_cst); }
  void fence(int, StreamHandle) override { std::atomic_thread_fence(std::memory_order_seq_cst); }
  void zero(int, void* dst, size_t nbytes) override { std::memset(dst, 0, nbytes); }

 private:
  int device_count_;
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend() { return std::make_unique<CpuBackend>(); }

}  // namespace symheap
