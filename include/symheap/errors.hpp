// Exception types of the core. The Python bindings map each to a Python
// exception class, so a bad argument never aborts the process.
#pragma once
#include <stdexcept>
#include <string>
#include <utility>

// Checks `ok`; where it does not hold, calls `fail(message)`, which throws.
// The message is built only then: a call's argument checks run on every
// call, and building every message (a few string concatenations each) cost
// more than the checks themselves.
#define SYMHEAP_REQUIRE(ok, fail, message) \
  do {                                     \
    if (!(ok)) fail(message);              \
  } while (0)

namespace symheap {

// Invalid argument from the caller (ValueError in Python).
struct InvalidArgument : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};
// A wait that ran past its deadline (TimeoutError in Python).
struct TimeoutError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
// The symmetric heap cannot hold the request (MemoryError in Python).
struct HeapExhausted : std::runtime_error {
  using std::runtime_error::runtime_error;
};
// Wrong call order or state: before init, init twice, ... (symheap.SymheapError).
struct StateError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
// A wait left early because its PE is being finalized or its job failed (a
// PE died): the PEs are out of step (symheap.SymheapError).
struct JobFailed : StateError {
  using StateError::StateError;
};
// A PE of another node could not serve a request (symheap.RemoteError, a
// SymheapError): `pe` is that PE, `op` the operation it could not serve
// ("put", "atomic_swap", ...).
struct RemoteError : StateError {
  RemoteError(const std::string& what, int pe, std::string op)
      : StateError(what), pe(pe), op(std::move(op)) {}
  int pe;
  std::string op;
};
// An operation needs a load/store path the peer does not have.
struct Unsupported : std::runtime_error {
  using std::runtime_error::runtime_error;
};

}  // namespace symheap
