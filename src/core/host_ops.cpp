// Host-initiated SHMEM operations. Addresses are this PE's symmetric
// addresses; the peer's copy is found at the same heap offset.
#include <cstdio>
#include <string>

#include "symheap/errors.hpp"
#include "symheap/runtime.hpp"
#include "symheap/wait.hpp"
#include "transports/transport.hpp"

namespace symheap {
namespace host {
namespace {

Backend& be() { return Runtime::instance().backend(); }

std::string fmt_seconds(double s) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3g s", s);
  return buf;
}

}  // namespace

namespace {
// The transport of `pe` (range-checked), once the PE is connected.
Transport& transport(PeState& s, int pe, Via via = Via::Auto) {
  s.check_pe(pe);
  if (!s.transports) throw StateError("PE " + std::to_string(s.my_pe) + " is not connected yet");
  return s.transports->select(pe, via);
}

// Heap offset of a local signal word, validated before anything moves.
size_t signal_offset(PeState& s, uint64_t* signal) {
  size_t off = s.checked_offset(signal, sizeof(uint64_t), "signal");
  if (off % sizeof(uint64_t))
    throw InvalidArgument("signal word must be 8-byte aligned");
  return off;
}
}  // namespace

void put(PeState& s, void* dst, const void* src, size_t nbytes, int pe, StreamHandle stream,
         Via via) {
  PeUse use(s);
  size_t off = s.checked_offset(dst, nbytes, "put destination");
  transport(s, pe, via).put(s, pe, off, src, nbytes, stream);
}

void get(PeState& s, void* dst, const void* src, size_t nbytes, int pe, StreamHandle stream) {
  PeUse use(s);
  size_t off = s.checked_offset(src, nbytes, "get source");
  transport(s, pe).get(s, pe, dst, off, nbytes, stream);
}

void signal_op(PeState& s, uint64_t* signal, uint64_t value, SignalOp op, int pe,
               StreamHandle stream) {
  PeUse use(s);
  size_t off = signal_offset(s, signal);
  transport(s, pe).signal(s, pe, off, value, op, stream);
}

void put_signal(PeState& s, void* dst, const void* src, size_t nbytes, uint64_t* signal,
                uint64_t value, SignalOp op, int pe, StreamHandle stream, Via via) {
  PeUse use(s);
  // Validate everything before moving a byte.
  size_t sig_off = signal_offset(s, signal);
  size_t off = s.checked_offset(dst, nbytes, "put destination");
  transport(s, pe, via).put_signal(s, pe, off, src, nbytes, sig_off, value, op, stream);
}

uint64_t signal_wait_until(PeState& s, uint64_t* signal, Compare cmp, uint64_t value,
                           double timeout_s) {
  PeUse use(s);
  size_t off = signal_offset(s, signal);
  Waiter waiter(&s, timeout_s);
  for (;;) {
    uint64_t now = be().load_word(s.device, signal);
    if (compare_holds(now, cmp, value)) return now;
    if (!waiter.pause())
      throw TimeoutError("signal_wait_until on PE " + std::to_string(s.my_pe) +
                         ": signal at heap offset " + std::to_string(off) + " is " +
                         std::to_string(now) + ", still not " + compare_name(cmp) + " " +
                         std::to_string(value) + " after " + fmt_seconds(timeout_s) +
                         " (the PE expected to signal is late or never signalled)");
  }
}

namespace {
size_t atomic_offset(PeState& s, int64_t* dst, const char* what) {
  size_t off = s.checked_offset(dst, sizeof(int64_t), what);
  if (off % sizeof(int64_t))
    throw InvalidArgument(std::string(what) + ": the int64 word must be 8-byte aligned");
  return off;
}
}  // namespace

int64_t atomic_fetch_add(PeState& s, int64_t* dst, int64_t value, int pe) {
  PeUse use(s);
  size_t off = atomic_offset(s, dst, "atomic_fetch_add");
  return transport(s, pe).fetch_add(s, pe, off, value);
}
int64_t atomic_compare_swap(PeState& s, int64_t* dst, int64_t cond, int64_t value, int pe) {
  PeUse use(s);
  size_t off = atomic_offset(s, dst, "atomic_compare_swap");
  return transport(s, pe).compare_swap(s, pe, off, cond, value);
}
int64_t atomic_swap(PeState& s, int64_t* dst, int64_t value, int pe) {
  PeUse use(s);
  size_t off = atomic_offset(s, dst, "atomic_swap");
  return transport(s, pe).swap(s, pe, off, value);
}

void quiet(PeState& s, StreamHandle stream) {
  PeUse use(s);
  if (s.transports) s.transports->quiet(s, stream);
  else be().quiet(s.device, stream);
}
void fence(PeState& s, StreamHandle stream) {
  PeUse use(s);
  be().fence(s.device, stream);
}

void barrier_all(PeState& s, double timeout_s) {
  PeUse use(s);
  Waiter waiter(&s, timeout_s);
  for (int p = 0; p < s.n_pes; ++p)
    if (!s.peers[p].base)
      throw Unsupported("barrier_all through the heap needs a load/store path to every PE");
  uint64_t epoch;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    epoch = ++s.barrier_epoch;
  }
  be().quiet(s.device, 0);
  // flags[q] on PE p counts the barriers PE q has entered; each PE bumps its
  // own counter on every peer, then waits until every counter reaches epoch.
  size_t my_flag = static_cast<size_t>(s.my_pe) * sizeof(uint64_t);
  for (int p = 0; p < s.n_pes; ++p) {
    auto* word = reinterpret_cast<uint64_t*>(static_cast<char*>(s.peers[p].base) + my_flag);
    be().signal(s.device, word, 1, SignalOp::Add, 0);
  }
  uint64_t* flags = s.barrier_flags();
  for (int q = 0; q < s.n_pes; ++q) {
    while (be().load_word(s.device, &flags[q]) < epoch) {
      if (!waiter.pause()) {
        std::string late;
        for (int r = 0; r < s.n_pes; ++r)
          if (be().load_word(s.device, &flags[r]) < epoch)
            late += (late.empty() ? "" : ", ") + std::to_string(r);
        throw TimeoutError("barrier_all #" + std::to_string(epoch) + " on PE " +
                           std::to_string(s.my_pe) + " timed out after " +
                           fmt_seconds(timeout_s) + ": PE(s) " + late +
                           " never reached the barrier");
      }
    }
  }
}

}  // namespace host
}  // namespace symheap
