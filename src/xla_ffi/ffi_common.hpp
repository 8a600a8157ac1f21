// Shared by the XLA FFI handlers: how a handler finds its PE, how a core
// exception becomes an ffi::Error, and how a handler reaches Python.
//
// Rules every handler follows (see docs/jax.md):
//  - the PE comes from XLA's DeviceOrdinal through the runtime's XLA device
//    map, never from an attribute (one compiled shard_map program serves
//    every device) nor from the thread's current device;
//  - instantiate does no collective work and takes no process-wide lock;
//  - ops owning symmetric memory are created outside jit and looked up by id
//    at execute; a missing one is an error, never a crash;
//  - a core exception becomes an ffi::Error carrying the same message.
#pragma once
#include <pybind11/pybind11.h>

#include <exception>
#include <memory>
#include <string>

#include "symheap/errors.hpp"
#include "symheap/runtime.hpp"
#include "xla/ffi/api/ffi.h"

namespace symheap::xla_ffi {

namespace ffi = ::xla::ffi;

// A handler symbol wrapped the way jax.ffi.register_ffi_target takes it.
inline pybind11::capsule capsule(XLA_FFI_Handler* handler) {
  return pybind11::capsule(reinterpret_cast<void*>(handler));
}

// Runs `body` and turns a core exception into the matching ffi::Error.
template <class Body>
ffi::Error guarded(Body&& body) {
  try {
    body();
    return ffi::Error::Success();
  } catch (const InvalidArgument& e) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, e.what());
  } catch (const TimeoutError& e) {
    return ffi::Error(ffi::ErrorCode::kDeadlineExceeded, e.what());
  } catch (const HeapExhausted& e) {
    return ffi::Error(ffi::ErrorCode::kResourceExhausted, e.what());
  } catch (const StateError& e) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition, e.what());
  } catch (const Unsupported& e) {
    return ffi::Error(ffi::ErrorCode::kUnimplemented, e.what());
  } catch (const std::exception& e) {
    return ffi::Error(ffi::ErrorCode::kInternal, e.what());
  } catch (...) {
    return ffi::Error(ffi::ErrorCode::kUnknown, "symheap: unknown exception in an XLA handler");
  }
}

// XLA's dtype by the name the op cores use ("float32", "bfloat16", "int32", ...).
inline std::string dtype_name(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return "float32";
    case ffi::DataType::F16: return "float16";
    case ffi::DataType::BF16: return "bfloat16";
    case ffi::DataType::F64: return "float64";
    case ffi::DataType::PRED: return "bool";
    case ffi::DataType::S32: return "int32";
    case ffi::DataType::S64: return "int64";
    case ffi::DataType::U8: return "uint8";
    default: return "xla dtype " + std::to_string(static_cast<int>(t));
  }
}

// A call's attribute; a missing one is an InvalidArgument naming it.
template <class T>
T attr(const ffi::Dictionary& attrs, const char* name) {
  auto v = attrs.get<T>(name);
  if (!v.has_value())
    throw InvalidArgument(std::string("the XLA call has no attribute '") + name + "'");
  return *v;
}

// The PE that serves XLA device `ordinal`; throws StateError when none does
// (never initialised, or finalized since the executable was compiled).
inline std::shared_ptr<PeState> pe_of_xla_device(int32_t ordinal, const char* what) {
  auto s = Runtime::instance().slot_of_xla(ordinal);
  if (!s || s->peers.empty())
    throw StateError(std::string(what) + ": XLA device " + std::to_string(ordinal) +
                     " hosts no symheap PE (call symheap.jax.init() first; an executable "
                     "compiled before symheap.jax.finalize() cannot run after it)");
  return s;
}

}  // namespace symheap::xla_ffi
