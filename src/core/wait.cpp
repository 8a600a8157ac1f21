#include "symheap/wait.hpp"

#include <sched.h>
#include <time.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>

#include "symheap/errors.hpp"

namespace symheap {

namespace {
std::atomic<InterruptCheck> g_interrupt_check{nullptr};
constexpr unsigned kSpins = 128;
constexpr unsigned kYields = 1024;
}  // namespace

void set_interrupt_check(InterruptCheck check) { g_interrupt_check.store(check); }

double checked_timeout(double t, const char* what) {
  if (!(t > 0) || !(t <= kMaxTimeoutS)) {  // also false for NaN
    char buf[160];
    std::snprintf(buf, sizeof buf, "%s must be a number of seconds in (0, %g], got %g", what,
                  kMaxTimeoutS, t);
    throw InvalidArgument(buf);
  }
  return t;
}

Waiter::Waiter(const PeState* s, double timeout_s)
    : s_(s), timeout_s_(checked_timeout(timeout_s)), start_(Clock::now()) {
  deadline_ = start_ + std::chrono::duration_cast<Clock::duration>(
                           std::chrono::duration<double>(timeout_s_));
  next_interrupt_poll_ = start_ + std::chrono::milliseconds(50);
}

void Waiter::poll(Clock::time_point now) {
  if (s_) {
    if (s_->closing.load(std::memory_order_acquire))
      throw JobFailed("PE " + std::to_string(s_->my_pe) +
                      " was finalized by another thread while this call waited");
    s_->throw_if_failed();
  }
  if (now >= next_interrupt_poll_) {
    next_interrupt_poll_ = now + std::chrono::milliseconds(50);
    if (auto check = g_interrupt_check.load()) check();
  }
}

bool Waiter::check() {
  auto now = Clock::now();
  if (now > deadline_) return false;
  poll(now);
  return true;
}

bool Waiter::pause() {
  ++n_;
  if (n_ < kSpins) return true;
  auto now = Clock::now();
  if (now > deadline_) return false;
  poll(now);
  if (n_ < kYields) {
    sched_yield();
    return true;
  }
  auto waited = std::chrono::duration_cast<std::chrono::nanoseconds>(now - start_).count();
  long ns = std::clamp<long>(static_cast<long>(waited / 8), 20000, 1000000);
  timespec ts{0, ns};
  nanosleep(&ts, nullptr);
  return true;
}

// ---------------------------------------------------------------- PeState

void PeState::mark_failed(const std::string& why) {
  std::lock_guard<std::mutex> lock(failure_mu_);
  if (failed_.load()) return;  // the first cause wins
  failure_ = why;
  failed_.store(true, std::memory_order_release);
}

std::string PeState::failure() const {
  std::lock_guard<std::mutex> lock(failure_mu_);
  return failure_;
}

void PeState::throw_if_failed() const {
  if (failed()) throw JobFailed("PE " + std::to_string(my_pe) + ": the job failed: " +
                                 failure() + " (finalize, then init a new job)");
}

void PeState::close_calls() {
  closing.store(true, std::memory_order_seq_cst);
  while (in_flight.load(std::memory_order_seq_cst) > 0) {
    timespec ts{0, 200000};
    nanosleep(&ts, nullptr);
  }
}

PeUse::PeUse(PeState& s) : s_(s) {
  s_.in_flight.fetch_add(1, std::memory_order_seq_cst);
  if (s_.closing.load(std::memory_order_seq_cst)) {
    s_.in_flight.fetch_sub(1, std::memory_order_seq_cst);
    throw StateError("PE " + std::to_string(s_.my_pe) +
                     " was finalized (by another thread) before this call could run");
  }
}

}  // namespace symheap
