// Host-side waiting: every wait of the core (signal waits, barriers, op
// protocols) polls through a Waiter, so all of them back off the same way,
// honour the same deadline and leave early for the same reasons.
#pragma once
#include <chrono>

#include "symheap/runtime.hpp"

namespace symheap {

// Called from waits every kInterruptPollS: raises (throws) when the user
// asked to stop (the Python module installs one that runs signal handlers,
// so Ctrl-C gets through). Null: no check.
using InterruptCheck = void (*)();
void set_interrupt_check(InterruptCheck check);

class Waiter {
 public:
  static constexpr double kInterruptPollS = 0.05;

  // `s` may be null (a wait outside any PE). `timeout_s` must be valid.
  Waiter(const PeState* s, double timeout_s);

  // Call after each unsuccessful check of the awaited condition. Spins
  // first, then yields, then sleeps for an eighth of the time waited so far
  // (20 us to 1 ms), so a short wait stays fast and a long one costs little
  // CPU. Returns false once the deadline passed; throws StateError when the
  // PE is finalized or its job failed, and whatever the interrupt check
  // throws.
  bool pause();
  // The checks of pause without its wait, for a caller that blocks on its
  // own (poll() on a socket, a few ms at a time) and wakes when data comes.
  bool check();
  double timeout_s() const { return timeout_s_; }

 private:
  using Clock = std::chrono::steady_clock;
  void poll(Clock::time_point now);

  const PeState* s_;
  double timeout_s_;
  Clock::time_point start_, deadline_, next_interrupt_poll_;
  unsigned n_ = 0;
};

}  // namespace symheap
