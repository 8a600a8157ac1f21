// The interface between the remote transport on the cuda backend and a
// network engine that moves device memory between PEs of different nodes
// (the NCCL engine: libsymheap_nccl.so, opened by the core only when a cuda
// PE has remote peers, so `import symheap` never needs NCCL). Operations are
// ordered on the caller's CUDA stream. The engine never waits on its own: it
// polls and calls the core's WaitHook between polls, so every wait has the
// PE's deadline. As in remote_engine.hpp, only virtual calls, plain structs
// and std::string cross the library boundary: no exception does.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "transports/remote_op.hpp"

namespace symheap {
namespace remote {

// Bumped whenever anything below changes layout or meaning.
constexpr int kDeviceEngineAbi = 3;
// extern "C" DeviceEngine* symheap_device_engine_open(int abi, std::string* why_not)
constexpr const char* kDeviceOpenSymbol = "symheap_device_engine_open";

// How to get NCCL, for every message that says it is missing (the build's
// configure error reads it from here too: keep it on one line, without ';').
constexpr const char* kNcclInstallHint = "install the nvidia-nccl-cu13 wheel (pip install nvidia-nccl-cu13, or a CUDA wheel of torch, which brings it): symheap builds its NCCL engine against the wheel's headers (or SYMHEAP_NCCL_INCLUDE) and opens its libnccl.so.2 at run time (or the one SYMHEAP_NCCL_LIBRARY names)";

// Given by the core to every call that may wait.
class WaitHook {
 public:
  virtual ~WaitHook() = default;
  // Called after each unsuccessful poll: true to poll again, false to give up
  // (the deadline passed, the job failed, Ctrl-C; the core knows which).
  virtual bool pause() = 0;
  // The same answer without waiting, for an engine that blocks on its own
  // between checks (poll() on a socket, at most a few ms) and so wakes as
  // soon as its data comes.
  virtual bool check() = 0;
};

enum class Result : int {
  Ok = 0,
  GaveUp = 1,  // the hook said stop; `late_pe` names the PE waited for
  Failed = 2,  // `error` says why; `late_pe` names the PE involved, if any
  // The target `late_pe` could not serve a request (`op`, this one or an
  // earlier one on the same pair): `error` says why, as the target wrote it.
  Refused = 3,
};

struct Outcome {
  Result result = Result::Ok;
  int late_pe = -1;
  std::string error;
  std::string op;  // Refused: the name of the operation the target could not serve
};

struct SignalSpec {
  uint64_t offset = 0;  // heap offset of the 8-byte signal word
  uint64_t value = 0;
  bool add = false;     // add `value` (else set it)
};

// One PE's connections to its remote peers.
class DeviceEndpoint {
 public:
  virtual ~DeviceEndpoint() = default;
  // What this PE publishes (all-gathered by the bootstrap) before connect.
  virtual std::string offer() const = 0;
  // Connects to every remote peer from their offers (index: PE). Collective
  // with those peers.
  virtual Outcome connect(const std::vector<std::string>& offers, WaitHook& wait) = 0;
  // The bytes [src, src + nbytes) of this PE's device into `pe`'s heap at
  // `dst_off`, after the work already on `stream`; later work on `stream`
  // waits until `src` was read. With `signal`, the target applies it once
  // the bytes landed. Returns once queued.
  virtual Outcome put(int pe, uint64_t dst_off, const void* src, uint64_t nbytes,
                      const SignalSpec* signal, void* stream, WaitHook& wait) = 0;
  // `pe`'s heap bytes at `src_off` into `dst` (this PE's device); later work
  // on `stream` sees them. Returns once queued.
  virtual Outcome get(int pe, void* dst, uint64_t src_off, uint64_t nbytes, void* stream,
                      WaitHook& wait) = 0;
  // Set/add on `pe`'s signal word, after this PE's earlier puts to it landed.
  virtual Outcome signal(int pe, const SignalSpec& signal, void* stream, WaitHook& wait) = 0;
  // op: FetchAdd(a), CompareSwap(expected a, desired b) or Swap(a); the old
  // value in *old. Waits for the answer.
  virtual Outcome atomic(int pe, Op op, uint64_t offset, int64_t a, int64_t b, int64_t* old,
                         void* stream, WaitHook& wait) = 0;
  // Returns once every put and signal this PE queued so far has landed at its
  // target. Several threads may call any of these at once for one endpoint.
  virtual Outcome quiet(WaitHook& wait) = 0;
  // Ends every connection in order (finalize, after the job's last barrier):
  // afterwards nothing of the engine runs on the device for this PE.
  virtual Outcome close(WaitHook& wait) = 0;
  // Tears down the connections to `pe` at once (after a timeout on it), or
  // to every peer with -1; later operations on them fail saying so.
  virtual void abort(int pe, const std::string& why) = 0;
  // Payload bytes moved to or from other nodes (puts, gets; 8 per signal or atomic).
  virtual uint64_t bytes_moved() const = 0;
};

struct EndpointSpec {
  uint64_t job = 0;
  int my_pe = -1;
  int n_pes = 0;
  int device = -1;
  char* base = nullptr;  // the PE's heap (device memory)
  uint64_t heap_size = 0;
  std::vector<int> remote_pes;  // the peers of other nodes, ascending
  double timeout_s = 120.0;     // the service thread's bound on its own waits
};

// One per process.
class DeviceEngine {
 public:
  virtual ~DeviceEngine() = default;
  virtual const char* name() const = 0;
  // The PE's endpoint, ready to offer; null with `why_not` set.
  virtual std::unique_ptr<DeviceEndpoint> endpoint(const EndpointSpec& spec,
                                                   std::string* why_not) = 0;
};

using DeviceOpenFn = DeviceEngine* (*)(int abi, std::string* why_not);

}  // namespace remote
}  // namespace symheap
