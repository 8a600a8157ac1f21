// The emulation runtime of the device driver: the CUDA kernels of
// ep_kernels.cuh compiled for the host and run on the cpu backend's heaps
// (see ep_device_compat.hpp). Launches and copies complete before they
// return, so stream order holds trivially.
#include <condition_variable>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "ops/ep/ep_device_driver.hpp"

namespace symheap::ep {
namespace host_emulation {
namespace {

// Threads that play the CUDA threads of one block at a time, kept for the
// life of the process (creating hundreds of threads per block is slow).
class ThreadPool {
 public:
  // Runs fn(t) for t in [0, n) on n threads at once and waits for all.
  void run(int n, const std::function<void(int)>& fn) {
    std::unique_lock<std::mutex> lock(mu_);
    while (static_cast<int>(workers_.size()) < n) {
      int id = static_cast<int>(workers_.size());
      workers_.emplace_back([this, id] { work(id); });
    }
    task_ = &fn;
    active_ = n;
    remaining_ = n;
    ++round_;
    start_.notify_all();
    done_.wait(lock, [&] { return remaining_ == 0; });
    task_ = nullptr;
  }

 private:
  std::mutex mu_;
  std::condition_variable start_, done_;
  std::vector<std::thread> workers_;
  const std::function<void(int)>* task_ = nullptr;
  int active_ = 0, remaining_ = 0;
  uint64_t round_ = 0;

  void work(int id) {
    uint64_t seen = 0;
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      start_.wait(lock, [&] { return round_ != seen; });
      seen = round_;
      if (id >= active_) continue;
      const auto* fn = task_;
      lock.unlock();
      (*fn)(id);
      lock.lock();
      if (--remaining_ == 0) done_.notify_all();
    }
  }
};

ThreadPool& pool() {
  static ThreadPool* p = new ThreadPool;  // never destroyed: its threads block until exit
  return *p;
}

class EmuRt {
 public:
  int32_t* host = nullptr;
  int32_t* host_dev = nullptr;

  EmuRt(PeState&, Op& op)
      : mirror_(kernels::kHostSegment0 + 4 * static_cast<size_t>(std::max(op.n_pes, op.cfg.num_experts))) {
    host = host_dev = mirror_.data();
  }

  template <class... KA, class... A>
  void launch(void (*kernel)(KA...), int grid, int block, size_t shared, StreamHandle,
              A&&... args) {
    for (int b = 0; b < grid; ++b) {  // one block at a time: blocks never wait on each other
      emu::Block ctx(block, shared);
      pool().run(block, [&](int t) {
        kernels::threadIdx = {static_cast<unsigned>(t), 0, 0};
        kernels::blockIdx = {static_cast<unsigned>(b), 0, 0};
        kernels::blockDim = {static_cast<unsigned>(block), 1, 1};
        kernels::gridDim = {static_cast<unsigned>(grid), 1, 1};
        emu::t_block = &ctx;
        kernel(args...);
      });
    }
  }
  template <class... KA, class... A>
  void launch_early(void (*kernel)(KA...), int grid, int block, size_t shared, StreamHandle s,
                    A&&... args) {
    launch(kernel, grid, block, shared, s, std::forward<A>(args)...);
  }
  void sync(StreamHandle) {}
  bool peers_can_store(const void*) { return true; }  // (host memory of this process)
  void zero_async(void* p, size_t bytes, StreamHandle) { std::memset(p, 0, bytes); }
  void channels_after(StreamHandle) {}
  void copy(int, void* dst, const void* src, size_t bytes) {
    std::memcpy(dst, src, bytes);
    std::atomic_thread_fence(std::memory_order_release);
  }
  void signal(int, uint64_t* flag) { __atomic_fetch_add(flag, 1, __ATOMIC_RELEASE); }
  void read(void* host, const void* src, size_t bytes, StreamHandle) {
    std::memcpy(host, src, bytes);
  }
  void write(void* dst, const void* host, size_t bytes, StreamHandle) {
    std::memcpy(dst, host, bytes);
  }
  void stream_after_channels(StreamHandle) {}
  void read_words(const uint64_t* words, uint64_t* out, size_t n) {
    for (size_t i = 0; i < n; ++i) out[i] = __atomic_load_n(words + i, __ATOMIC_ACQUIRE);
  }

 private:
  std::vector<int32_t> mirror_;
};

}  // namespace
}  // namespace host_emulation

std::shared_ptr<DeviceImpl> make_emulated_device(PeState& s, Op& op) {
  (void)s;
  if (Runtime::instance().active_devices().size() != 1)
    throw Unsupported(
        "SYMHEAP_EP_EMULATE_DEVICE runs the CUDA kernels' host emulation with one PE per "
        "process (shared-memory variables are process-wide); use one PE per process");
  return std::make_shared<host_emulation::DeviceDriver<host_emulation::EmuRt>>(s, op);
}

}  // namespace symheap::ep
