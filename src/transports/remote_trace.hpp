// SYMHEAP_REMOTE_TRACE=1: the remote engine and EP calls across nodes write a
// line on stderr per step, stamped with the wall clock's microseconds so that
// two PEs' lines can be put side by side: where a stuck pair stopped.
// Header-only: the NCCL engine is a library of its own.
#pragma once
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace symheap {

inline bool remote_trace_enabled() {
  static const bool on = [] {
    const char* v = std::getenv("SYMHEAP_REMOTE_TRACE");
    return v && *v && std::strcmp(v, "0") != 0;
  }();
  return on;
}

// "[symheap <who> <us> us, PE <pe>] <line>" on stderr.
inline void remote_trace_line(const char* who, int pe, const char* line) {
  const long long us = std::chrono::duration_cast<std::chrono::microseconds>(
                           std::chrono::system_clock::now().time_since_epoch())
                           .count() %
                       10000000000LL;
  std::fprintf(stderr, "[symheap %s %lld us, PE %d] %s\n", who, us, pe, line);
}

}  // namespace symheap
