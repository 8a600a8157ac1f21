// The GIL around a blocking collective call of a PE thread (EP dispatch and
// combine). PE threads of one process run such calls in lockstep: they leave
// a call's wait together and all want the GIL back at once; the losers then
// sleep in CPython's condition variable, and each wake-up costs more than the
// whole Python part of a call (measured on the cpu backend: see
// bench/RESULTS.md). So the threads leaving a call take turns: one claims the
// turn and takes the GIL, the others spin (GIL released) until it enters its
// next call, then the next claims it. The spin is bounded: a thread doing
// other Python work in between is waited for the usual way.
#pragma once
#include <Python.h>
#include <sched.h>

#include <atomic>
#include <chrono>
#include <cstdint>

namespace symheap::bindings {

class PeCallGil {
 public:
  // Releases the GIL (held on entry). The turn is freed only once the GIL is:
  // a thread that claims it earlier would find the GIL still held and sleep
  // on CPython's condition variable, the wait the turns exist to avoid.
  PeCallGil() {
    state_ = PyEval_SaveThread();
    released_at_ = now_ns();
    between_calls_since().store(0, std::memory_order_release);
  }
  // Takes the GIL back.
  ~PeCallGil() {
    std::atomic<int64_t>& since = between_calls_since();
    const int64_t start = now_ns();
    for (unsigned i = 0;; ++i) {
      int64_t t = since.load(std::memory_order_acquire);
      const int64_t now = now_ns();
      // Free: claim the turn, so the threads leaving a call together take the
      // GIL one after the other instead of all queueing on it.
      if (t == 0 && since.compare_exchange_weak(t, now, std::memory_order_acq_rel)) break;
      if (t != 0 && (now - t > kSpinNs || now - start > kSpinNs)) break;
      if (i > 64) sched_yield();
    }
    PyEval_RestoreThread(state_);
    const int64_t back = now_ns();
    since.store(back, std::memory_order_release);
    released_ns() += back - released_at_;
  }
  // Runs `f` with the GIL (a rare step of a call that needs Python: the
  // GIL is taken the usual way, outside the turns).
  template <class F>
  void with_gil(F&& f) {
    PyEval_RestoreThread(state_);
    try {
      f();
    } catch (...) {
      state_ = PyEval_SaveThread();
      throw;
    }
    state_ = PyEval_SaveThread();
  }
  PeCallGil(const PeCallGil&) = delete;
  PeCallGil& operator=(const PeCallGil&) = delete;

  // Nanoseconds the calling thread has spent in such calls without the GIL,
  // from the release to the GIL back in hand (its wait for the GIL
  // included), since the thread started: a call's wall time less this is
  // the time it held the GIL (bench/host_overhead.py --gil).
  static int64_t& released_ns() {
    thread_local int64_t ns = 0;
    return ns;
  }

 private:
  static constexpr int64_t kSpinNs = 200000;
  // When a PE thread claimed the GIL back from a call (ns), 0 once it
  // entered the next one.
  static std::atomic<int64_t>& between_calls_since() {
    static std::atomic<int64_t> t{0};
    return t;
  }
  static int64_t now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }
  PyThreadState* state_;
  int64_t released_at_;
};

}  // namespace symheap::bindings
