// The operations a PE asks of a peer of another node: one numbering for the
// core and every remote engine (remote_engine.hpp for host memory,
// remote_device_engine.hpp for device memory), which also carry it on their
// wires.
#pragma once
#include <cstdint>

namespace symheap {
namespace remote {

enum class Op : uint32_t {
  Put = 1,
  PutSignal = 2,
  Signal = 3,
  Get = 4,
  FetchAdd = 5,
  CompareSwap = 6,
  Swap = 7,
  Quiet = 8,  // answered once every earlier request of the PE to that peer was served
};

inline const char* op_name(Op op) {
  switch (op) {
    case Op::Put: return "put";
    case Op::PutSignal: return "put_signal";
    case Op::Signal: return "signal_op";
    case Op::Get: return "get";
    case Op::FetchAdd: return "atomic_fetch_add";
    case Op::CompareSwap: return "atomic_compare_swap";
    case Op::Swap: return "atomic_swap";
    case Op::Quiet: return "quiet";
  }
  return "unknown op";
}

}  // namespace remote
}  // namespace symheap
