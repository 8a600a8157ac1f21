// The interface between the remote transport (in the core) and a network
// engine that moves bytes between processes of different nodes. An engine
// lives in its own shared library, loaded only when the process already runs
// its network stack (the MPI engine: libsymheap_mpi.so, opened once MPI is
// loaded), so `import symheap` never needs libmpi. Only virtual calls, plain
// structs and std::string cross the library boundary: no exception does.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "transports/remote_op.hpp"

namespace symheap {
namespace remote {

// Bumped whenever anything below changes layout or meaning.
constexpr int kEngineAbi = 2;
// extern "C" Engine* symheap_remote_engine_open(int abi, std::string* why_not)
constexpr const char* kOpenSymbol = "symheap_remote_engine_open";

inline bool op_has_payload(Op op) { return op == Op::Put || op == Op::PutSignal; }
inline bool op_has_reply(Op op) {
  return op == Op::Get || op == Op::FetchAdd || op == Op::CompareSwap || op == Op::Swap ||
         op == Op::Quiet;
}

// The head of every request; a put's bytes follow it in the same message.
struct Request {
  uint32_t op = 0;
  uint32_t signal_add = 0;  // put_signal / signal: 1 adds `value` to the word, 0 sets it
  uint64_t job = 0;         // the job's unique id: requests of one job never reach another
  int32_t from_pe = -1;
  int32_t to_pe = -1;
  int32_t reply_tag = -1;   // set by the engine for ops with a reply
  int32_t reserved = 0;
  uint64_t offset = 0;      // heap offset of the data, or of the atomic word
  uint64_t nbytes = 0;
  uint64_t signal_offset = 0;
  int64_t value = 0;        // signal value, atomic operand, compare_swap's expected value
  int64_t value2 = 0;       // compare_swap's desired value
};

// How the target served a request. Offsets were checked by the caller
// against its own (symmetric) heap, so anything but Ok means the target is
// not the PE the caller believes (not initialised, finalized, another job).
enum class Status : int64_t { Ok = 0, NotServed = 1, OutOfHeap = 2, Malformed = 3 };
const char* status_text(Status status);

// The head of every reply; a get's bytes follow it.
struct Reply {
  int64_t status = 0;   // Status
  int64_t value = 0;    // atomics: the old value; quiet: the op that failed (Op), if any
  int64_t detail = 0;   // quiet: the status of that failed op
  int64_t target = -1;  // quiet: the PE that failed op was for
};

// One request in flight.
class Pending {
 public:
  virtual ~Pending() = default;
  // 1: complete (the reply, if any, arrived); 0: in flight; -1: failed (error()).
  virtual int test() = 0;
  virtual std::string error() const = 0;
  virtual const Reply& reply() const = 0;
  virtual const char* reply_data() const = 0;  // a get's bytes
};

// One per process, shared by its PEs (threads).
class Engine {
 public:
  virtual ~Engine() = default;
  virtual const char* name() const = 0;
  // This process's address, published with each of its PEs' records at init.
  virtual std::string address() const = 0;
  // Whether the process at `address` is reachable; else why not.
  virtual bool reaches(const std::string& address, std::string* why_not) const = 0;
  // Serves requests for PE `pe` of `job` on [base, base + size) from now on;
  // the process's first attach starts the service thread.
  virtual void attach(uint64_t job, int pe, char* base, size_t size) = 0;
  // Stops serving the PE; the last detach stops the service thread.
  virtual void detach(uint64_t job, int pe) = 0;
  // Sends `req` (with req.nbytes bytes of `payload` for put ops) to the
  // process at `address`, expecting a reply with `reply_bytes` of data when
  // the op has one. The payload is copied: the caller may reuse it at once.
  // Never throws: a failure shows as a Pending whose test() is -1.
  virtual std::unique_ptr<Pending> start(const std::string& address, const Request& req,
                                         const void* payload, size_t reply_bytes) = 0;
  // The caller gave up on `p` (timeout): the engine cancels what it can and
  // keeps the buffers until the network library is done with them.
  virtual void abandon(std::unique_ptr<Pending> p) = 0;
};

using OpenFn = Engine* (*)(int abi, std::string* why_not);

inline const char* status_text(Status status) {
  switch (status) {
    case Status::Ok: return "ok";
    case Status::NotServed:
      return "the target PE is not served by that process (not initialised yet, finalized, "
             "or of another job)";
    case Status::OutOfHeap: return "the bytes fall outside the target PE's heap";
    case Status::Malformed: return "the request was malformed";
  }
  return "unknown status";
}

}  // namespace remote
}  // namespace symheap
