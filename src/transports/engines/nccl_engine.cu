// The NCCL remote engine for the cuda backend (built as libsymheap_nccl.so,
// opened by the core only when a cuda PE has remote peers; it opens
// libnccl.so.2 itself, so nothing links NCCL). NCCL 2.28 has no one-sided
// host API, so operations are paired sends and receives driven by symheap:
//
// - For each ordered pair of PEs (a requests from b) there is one 2-rank
//   NCCL communicator and one TCP connection. a's thread issues every NCCL
//   call on a's side of it, b's service thread every call on b's side, each
//   on a stream of its own, so each side issues in one order from one thread.
// - A request is a small header on the TCP connection (the control path: no
//   kernel waits on the device while a PE is idle, so cudaDeviceSynchronize
//   never waits for a peer that sends nothing). The bytes go through NCCL:
//   a put is a send on a's stream (after the caller's stream) matched by a
//   receive the service thread posts straight into b's heap when the header
//   arrives; a get is the reverse. Headers arrive in the order a issued its
//   sends, so both sides issue NCCL calls in the same order: a's threads take
//   the pair's lock only to send a header and issue its NCCL call.
// - Requests are numbered per pair; an answer names its request's number, so
//   several threads of a wait for their answers at once, outside the lock.
//   A request b cannot serve (bytes outside its heap, an NCCL or CUDA
//   failure) is answered with what failed, and b ends its side of the pair:
//   a's next wait on it fails at once with that message (the core raises
//   symheap.RemoteError) instead of waiting out its deadline.
// - The service thread applies a signal with a kernel on its stream, after
//   the receive of the bytes (its kernels are loaded at connect, so no
//   launch waits for a kernel of this PE spinning until that signal lands);
//   atomics are system-scope atomics in a kernel on the target's device (so
//   they mix with the target node's device atomics);
//   a fence is answered once the service stream finished everything before
//   it, which is what quiet waits for.
// - Every wait of a requester polls (cudaEventQuery, ncclCommGetAsyncError,
//   non-blocking sockets, blocking in poll() between looks where a socket
//   tells) and asks the core's WaitHook between polls: a late peer gives up
//   within the PE's deadline, and the core then aborts its communicators.
//   The service thread blocks in poll() while idle and, while an answer
//   waits for its stream, spins briefly and then backs off (Backoff).
#include <arpa/inet.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <link.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdlib.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>
#include <vector>

#include <cuda_runtime.h>
#include <nccl.h>

#include "transports/remote_device_engine.hpp"
#include "transports/remote_trace.hpp"

namespace symheap {
namespace remote {
namespace {

// ---------------------------------------------------------------- NCCL, opened at run time

struct Nccl {
  decltype(&ncclGetVersion) GetVersion = nullptr;
  decltype(&ncclGetUniqueId) GetUniqueId = nullptr;
  decltype(&ncclCommInitRankConfig) CommInitRankConfig = nullptr;
  decltype(&ncclCommFinalize) CommFinalize = nullptr;
  decltype(&ncclCommDestroy) CommDestroy = nullptr;
  decltype(&ncclCommAbort) CommAbort = nullptr;
  decltype(&ncclCommGetAsyncError) CommGetAsyncError = nullptr;
  decltype(&ncclGetErrorString) GetErrorString = nullptr;
  decltype(&ncclGetLastError) GetLastError = nullptr;
  decltype(&ncclGroupStart) GroupStart = nullptr;
  decltype(&ncclGroupEnd) GroupEnd = nullptr;
  decltype(&ncclSend) Send = nullptr;
  decltype(&ncclRecv) Recv = nullptr;
  int version = 0;
  std::string path;
};

// The folder of this library, symlinks resolved ("" when unknown).
std::string own_folder() {
  Dl_info info{};
  if (!dladdr(reinterpret_cast<void*>(&own_folder), &info) || !info.dli_fname) return "";
  char real[PATH_MAX];
  std::string self = realpath(info.dli_fname, real) ? real : info.dli_fname;
  size_t slash = self.rfind('/');
  return slash == std::string::npos ? "" : self.substr(0, slash + 1);
}

// libnccl.so.2: SYMHEAP_NCCL_LIBRARY, else the copy the process already
// loaded (torch's) or the loader finds, else the nvidia-nccl wheel next to
// the installed package, else the one found at build time.
bool load_nccl(Nccl* n, std::string* why_not) {
  std::vector<std::string> tries;
  if (const char* env = getenv("SYMHEAP_NCCL_LIBRARY")) {
    tries.push_back(env);
  } else {
    tries.push_back("libnccl.so.2");
    tries.push_back(own_folder() + "../nvidia/nccl/lib/libnccl.so.2");
#ifdef SYMHEAP_NCCL_BUILD_LIBRARY
    tries.push_back(SYMHEAP_NCCL_BUILD_LIBRARY);
#endif
  }
  void* lib = nullptr;
  std::string errors;
  for (const std::string& path : tries) {
    lib = dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL);
    if (lib) {
      n->path = path;
      break;
    }
    const char* err = dlerror();
    errors += (errors.empty() ? "" : "; ") + std::string(err ? err : path);
  }
  if (!lib) {
    *why_not = "cannot load libnccl.so.2 (" + errors + "): " + kNcclInstallHint;
    return false;
  }
  bool ok = true;
  auto get = [&](auto& fn, const char* name) {
    fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(lib, name));
    if (!fn) {
      *why_not = n->path + " has no " + name + " (NCCL 2.19 or newer is needed)";
      ok = false;
    }
  };
  get(n->GetVersion, "ncclGetVersion");
  get(n->GetUniqueId, "ncclGetUniqueId");
  get(n->CommInitRankConfig, "ncclCommInitRankConfig");
  get(n->CommFinalize, "ncclCommFinalize");
  get(n->CommDestroy, "ncclCommDestroy");
  get(n->CommAbort, "ncclCommAbort");
  get(n->CommGetAsyncError, "ncclCommGetAsyncError");
  get(n->GetErrorString, "ncclGetErrorString");
  get(n->GetLastError, "ncclGetLastError");
  get(n->GroupStart, "ncclGroupStart");
  get(n->GroupEnd, "ncclGroupEnd");
  get(n->Send, "ncclSend");
  get(n->Recv, "ncclRecv");
  if (ok && n->GetVersion(&n->version) != ncclSuccess) n->version = 0;
  return ok;
}

// ---------------------------------------------------------------- wire formats

// Header::op: a remote::Op, or this engine's close handshake.
constexpr uint32_t kWireClose = 9;
constexpr uint32_t wire(Op op) { return static_cast<uint32_t>(op); }
const char* wire_op_name(uint32_t op) {
  if (op == kWireClose) return "finalize";
  if (op >= wire(Op::Put) && op <= wire(Op::Quiet)) return op_name(static_cast<Op>(op));
  return "unknown op";
}
bool wire_op_has_reply(uint32_t op) {
  return op == wire(Op::FetchAdd) || op == wire(Op::CompareSwap) || op == wire(Op::Swap) ||
         op == wire(Op::Quiet) || op == kWireClose;
}

constexpr uint64_t kHelloMagic = 0x73796d6865617032ull;  // "symheap2"

struct Hello {
  uint64_t magic = kHelloMagic;
  uint64_t job = 0;
  int32_t from_pe = -1;
  int32_t to_pe = -1;
};

struct Header {
  uint32_t op = 0;
  uint32_t signal_add = 0;
  uint64_t seq = 0;  // numbers the requests of one pair, from 1: answers name theirs
  uint64_t offset = 0;
  uint64_t nbytes = 0;
  uint64_t signal_offset = 0;
  int64_t value = 0;
  int64_t value2 = 0;
};

// The answer to a request with one (atomics, quiet, close), or the target's
// refusal of any request: it then ends its side of the pair, so the
// requester fails its waits at once with `what` instead of timing out.
enum : int64_t { kServed = 0, kOutOfHeap = 1, kEngineError = 2, kMalformed = 3 };
struct Answer {
  uint64_t seq = 0;       // the request's
  int64_t status = kServed;
  int64_t value = 0;      // an atomic's old value
  uint32_t failed_op = 0; // refusals: the request's op
  uint32_t reserved = 0;
  char what[224] = {};    // refusals: what failed, NUL-terminated
};

// ---------------------------------------------------------------- kernels

__global__ void signal_kernel(unsigned long long* word, unsigned long long value, int add) {
  __threadfence_system();  // the bytes received before it are visible first
  if (add) atomicAdd_system(word, value);
  else atomicExch_system(word, value);
  __threadfence_system();
}

__global__ void atomic_kernel(unsigned long long* word, Op op, unsigned long long a,
                              unsigned long long b, unsigned long long* old) {
  unsigned long long was;
  if (op == Op::FetchAdd) was = atomicAdd_system(word, a);
  else if (op == Op::CompareSwap) was = atomicCAS_system(word, a, b);
  else was = atomicExch_system(word, a);
  __threadfence_system();
  *old = was;
}

// ---------------------------------------------------------------- sockets, ids, devices

std::string cuda_text(cudaError_t e) {
  return std::string(cudaGetErrorName(e)) + ": " + cudaGetErrorString(e);
}

using Clock = std::chrono::steady_clock;

unsigned long long ull(uint64_t v) { return static_cast<unsigned long long>(v); }
// SYMHEAP_REMOTE_TRACE=1 (remote_trace.hpp): a line per step of every request,
// on both sides; the calls that may block are logged before and after.
template <class... A>
void trace(int me, const char* fmt, A... args) {
  if (!remote_trace_enabled()) return;
  char line[256];
  std::snprintf(line, sizeof line, fmt, args...);
  remote_trace_line("remote", me, line);
}

// Makes `device` current for the scope and restores the caller's device, so
// the engine never changes which device the calling thread works on.
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    if (cudaGetDevice(&prev_) != cudaSuccess) prev_ = -1;
    if (prev_ != device) cudaSetDevice(device);
  }
  ~DeviceScope() {
    int now = -1;
    if (prev_ >= 0 && cudaGetDevice(&now) == cudaSuccess && now != prev_) cudaSetDevice(prev_);
  }

 private:
  int prev_ = -1;
};

// Paces the service thread while it waits for work of its own on the device
// (an answer waiting for its stream, a call in progress, a full socket): a
// brief spin first, since most such waits end within microseconds, then
// blocking waits of 1/64 of the time waited so far (5 us to 200 us), so a
// long wait costs little CPU and ends at most ~2% late.
class Backoff {
 public:
  static constexpr auto kSpin = std::chrono::microseconds(20);
  // Zero while the wait is young (look again at once); else how long to block.
  std::chrono::nanoseconds next() {
    auto now = Clock::now();
    if (!waiting_) {
      waiting_ = true;
      since_ = now;
    }
    auto waited = now - since_;
    if (waited < kSpin) return std::chrono::nanoseconds(0);
    return std::clamp<std::chrono::nanoseconds>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(waited) / 64,
        std::chrono::microseconds(5), std::chrono::microseconds(200));
  }
  void reset() { waiting_ = false; }

 private:
  bool waiting_ = false;
  Clock::time_point since_;
};

// Blocks until one of `fds` is ready or `timeout` passed (microsecond grain).
void wait_fds(std::vector<pollfd>& fds, std::chrono::nanoseconds timeout) {
  timespec ts{static_cast<time_t>(timeout.count() / 1000000000),
              static_cast<long>(timeout.count() % 1000000000)};
  ::ppoll(fds.data(), fds.size(), &ts, nullptr);
}

void set_nonblocking(int fd) {
  int flags = fcntl(fd, F_GETFL, 0);
  fcntl(fd, F_SETFL, flags | O_NONBLOCK);
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

// Moves `n` bytes over a non-blocking socket, out of `p` when sending, into it
// when receiving; polls `keep_going` between tries.
// 1: done; 0: gave up; -1: the connection failed (`why`).
template <class KeepGoing>
int move_all(int fd, char* p, size_t n, bool sending, KeepGoing keep_going, std::string* why) {
  while (n > 0) {
    ssize_t k = sending ? ::send(fd, p, n, MSG_NOSIGNAL | MSG_DONTWAIT)
                        : ::recv(fd, p, n, MSG_DONTWAIT);
    if (k > 0) {
      p += k;
      n -= static_cast<size_t>(k);
      continue;
    }
    if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
      if (!keep_going()) return 0;
      continue;
    }
    if (k == 0 && !sending) *why = "it closed its connection (its process died or finalized)";
    else *why = std::string("its connection failed: ") + (k < 0 ? strerror(errno) : "closed");
    return -1;
  }
  return 1;
}

template <class KeepGoing>
int send_all(int fd, const void* data, size_t n, KeepGoing keep_going, std::string* why) {
  return move_all(fd, static_cast<char*>(const_cast<void*>(data)), n, true, keep_going, why);
}

template <class KeepGoing>
int recv_all(int fd, void* data, size_t n, KeepGoing keep_going, std::string* why) {
  return move_all(fd, static_cast<char*>(data), n, false, keep_going, why);
}

std::string hex(const void* data, size_t n) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  for (size_t i = 0; i < n; ++i) {
    unsigned char c = static_cast<const unsigned char*>(data)[i];
    out += digits[c >> 4];
    out += digits[c & 15];
  }
  return out;
}

bool unhex(const std::string& text, void* data, size_t n) {
  if (text.size() != 2 * n) return false;
  auto val = [](char c) {
    return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
  };
  for (size_t i = 0; i < n; ++i) {
    int hi = val(text[2 * i]), lo = val(text[2 * i + 1]);
    if (hi < 0 || lo < 0) return false;
    static_cast<unsigned char*>(data)[i] = static_cast<unsigned char>(hi * 16 + lo);
  }
  return true;
}

// The host name other nodes reach this one by: SYMHEAP_REMOTE_HOST, else
// this host's name (resolved by the peer).
std::string reachable_host() {
  if (const char* env = getenv("SYMHEAP_REMOTE_HOST")) return env;
  char name[256] = {0};
  if (gethostname(name, sizeof name - 1) != 0 || !name[0]) return "127.0.0.1";
  return name;
}

// ---------------------------------------------------------------- the endpoint

class NcclEndpoint;

// The answers coming back on an Out link, matched to their requests by
// sequence number: one waiting thread at a time reads the socket and files
// what it read; the others wait for it here.
struct Answers {
  std::mutex mu;
  std::condition_variable filed;
  std::map<uint64_t, Answer> by_seq;  // read, not yet taken by their requester
  bool reading = false;               // a thread reads the socket
  Answer partial;                     // the reader's answer in the making
  size_t have = 0;
  // Once set, every wait on the link fails so: the target's refusal
  // (Result::Refused, with the op it refused) or the connection's end.
  Result failure = Result::Ok;
  std::string failure_text, failed_op;
};

// One direction of a pair: this PE's requests to `pe` (Out) or `pe`'s
// requests to this PE, served by the service thread (In).
struct Link {
  int pe = -1;
  int fd = -1;
  ncclComm_t comm = nullptr;
  ncclUniqueId id{};
  cudaStream_t stream = nullptr;
  cudaEvent_t before = nullptr, after = nullptr;
  unsigned long long* answer_host = nullptr;  // pinned, mapped: an atomic's old value
  unsigned long long* answer_dev = nullptr;
  // Out: held while a request's header is sent and its NCCL call issued, so
  // both sides issue NCCL calls in header order; never across a wait for an
  // answer. In: the service thread's, against abort().
  std::mutex mu;
  std::string broken;  // why the link is gone (aborted, peer died); empty while usable
  bool closed = false;   // the close handshake completed
  // Out: the last request number given (under mu), the last put/get/signal's
  // and the last quiet's that was answered (every request before it served).
  uint64_t next_seq = 0;
  std::atomic<uint64_t> last_touch{0};
  std::atomic<uint64_t> fenced{0};
  Answers answers;
  // In (service thread only): a header in the making, and the answer waiting
  // for the service stream.
  Header hdr{};
  size_t hdr_have = 0;
  bool answer_pending = false;
  Header answer_for{};
};

class NcclEndpoint final : public DeviceEndpoint {
 public:
  NcclEndpoint(Nccl* nccl, const EndpointSpec& spec) : nccl_(nccl), spec_(spec) {}

  ~NcclEndpoint() override {
    DeviceScope on(spec_.device);
    stop_service();
    abort(-1, "the PE finalized");
    for (auto* links : {&out_, &in_})
      for (auto& [pe, link] : *links) release(*link);
    if (listen_fd_ >= 0) ::close(listen_fd_);
    if (warm_) cudaFree(warm_);
  }

  bool prepare(std::string* why_not) {
    DeviceScope on(spec_.device);
    listen_fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_ANY);
    addr.sin_port = 0;
    socklen_t len = sizeof addr;
    if (listen_fd_ < 0 || ::bind(listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) ||
        ::listen(listen_fd_, 256) ||
        getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&addr), &len)) {
      *why_not = std::string("cannot listen for remote peers: ") + strerror(errno);
      return false;
    }
    set_nonblocking(listen_fd_);
    std::ostringstream offer;
    offer << reachable_host() << " " << ntohs(addr.sin_port);
    for (int pe : spec_.remote_pes) {
      auto link = std::make_unique<Link>();
      link->pe = pe;
      ncclResult_t r = nccl_->GetUniqueId(&link->id);
      if (r != ncclSuccess) {
        *why_not = std::string("ncclGetUniqueId failed: ") + nccl_->GetErrorString(r);
        return false;
      }
      offer << "\n" << pe << " " << hex(&link->id, sizeof link->id);
      out_[pe] = std::move(link);
      in_[pe] = std::make_unique<Link>();
      in_[pe]->pe = pe;
    }
    offer_ = offer.str();
    return true;
  }

  std::string offer() const override { return offer_; }

  Outcome connect(const std::vector<std::string>& offers, WaitHook& wait) override {
    DeviceScope on(spec_.device);
    auto keep_going = [&] { return wait.pause(); };
    // 1. This PE's id of each pair it receives requests on, from the peer's offer.
    std::map<int, std::pair<std::string, int>> where;  // pe -> (host, port)
    for (int pe : spec_.remote_pes) {
      std::istringstream in(offers.at(pe));
      std::string host, line;
      int port = 0;
      in >> host >> port;
      bool found = false;
      int id_pe;
      std::string id_hex;
      while (in >> id_pe >> id_hex)
        if (id_pe == spec_.my_pe) found = unhex(id_hex, &in_[pe]->id, sizeof(ncclUniqueId));
      if (host.empty() || port <= 0 || !found)
        return failed(pe, "its offer names no connection for PE " + std::to_string(spec_.my_pe));
      where[pe] = {host, port};
    }
    // 2. A TCP connection for each pair: ours to every peer's listener, then theirs.
    for (int pe : spec_.remote_pes) {
      Outcome o = dial(*out_[pe], where[pe].first, where[pe].second, wait);
      if (o.result != Result::Ok) return o;
    }
    size_t accepted = 0;
    while (accepted < spec_.remote_pes.size()) {
      int fd = ::accept(listen_fd_, nullptr, nullptr);
      if (fd < 0) {
        if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
          return failed(-1, std::string("accept failed: ") + strerror(errno));
        if (!wait.pause()) return gave_up(first_missing_in());
        continue;
      }
      set_nonblocking(fd);
      Hello hello;
      std::string why;
      int got = recv_all(fd, &hello, sizeof hello, keep_going, &why);
      if (got <= 0 || hello.magic != kHelloMagic || hello.job != spec_.job ||
          hello.to_pe != spec_.my_pe || !in_.count(hello.from_pe) || in_[hello.from_pe]->fd >= 0) {
        ::close(fd);
        if (got == 0) return gave_up(first_missing_in());
        continue;  // not one of this job's peers: ignore it
      }
      in_[hello.from_pe]->fd = fd;
      ++accepted;
    }
    // 3. The communicators, all in one group (each pair's two ranks init together).
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;  // every wait below polls, with the PE's deadline
    nccl_->GroupStart();
    ncclResult_t r = ncclSuccess;
    for (int pe : spec_.remote_pes) {
      if (r == ncclSuccess || r == ncclInProgress)
        r = nccl_->CommInitRankConfig(&out_[pe]->comm, 2, out_[pe]->id, 0, &config);
      if (r == ncclSuccess || r == ncclInProgress)
        r = nccl_->CommInitRankConfig(&in_[pe]->comm, 2, in_[pe]->id, 1, &config);
    }
    ncclResult_t end = nccl_->GroupEnd();
    if (r != ncclSuccess && r != ncclInProgress) return failed(-1, nccl_text("ncclCommInitRankConfig", r, nullptr));
    if (end != ncclSuccess && end != ncclInProgress)
      return failed(-1, nccl_text("ncclGroupEnd (communicator init)", end, nullptr));
    // Every communicator settles before a failure returns: a peer still
    // initialising one with this PE would otherwise wait for it in vain.
    Outcome first;
    for (auto* links : {&out_, &in_})
      for (auto& [pe, link] : *links) {
        Outcome o = settle(*link, "ncclCommInitRankConfig", wait);
        if (o.result == Result::GaveUp) return o;
        if (o.result != Result::Ok && first.result == Result::Ok) first = o;
      }
    if (first.result != Result::Ok) return first;
    // 4. Streams, events and answer words; then connect NCCL's transport for both
    // directions of every communicator now (NCCL connects on first use, which
    // needs the peer's thread to join).
    for (auto* links : {&out_, &in_})
      for (auto& [pe, link] : *links) {
        cudaError_t e = cudaStreamCreateWithFlags(&link->stream, cudaStreamNonBlocking);
        if (e == cudaSuccess) e = cudaEventCreateWithFlags(&link->before, cudaEventDisableTiming);
        if (e == cudaSuccess) e = cudaEventCreateWithFlags(&link->after, cudaEventDisableTiming);
        if (e == cudaSuccess)
          e = cudaHostAlloc(reinterpret_cast<void**>(&link->answer_host), 64,
                            cudaHostAllocMapped | cudaHostAllocPortable);
        if (e == cudaSuccess)
          e = cudaHostGetDevicePointer(reinterpret_cast<void**>(&link->answer_dev),
                                       link->answer_host, 0);
        if (e != cudaSuccess) return failed(-1, "CUDA resources: " + cuda_text(e));
      }
    cudaError_t e = cudaMalloc(&warm_, 2 * 64);
    if (e != cudaSuccess) return failed(-1, "cudaMalloc: " + cuda_text(e));
    nccl_->GroupStart();
    r = ncclSuccess;
    for (auto* links : {&out_, &in_})
      for (auto& [pe, link] : *links) {
        int peer = links == &out_ ? 1 : 0;
        char* buf = static_cast<char*>(warm_) + (links == &out_ ? 0 : 64);
        if (r == ncclSuccess || r == ncclInProgress)
          r = nccl_->Send(buf, 8, ncclUint8, peer, link->comm, link->stream);
        if (r == ncclSuccess || r == ncclInProgress)
          r = nccl_->Recv(buf + 32, 8, ncclUint8, peer, link->comm, link->stream);
      }
    end = nccl_->GroupEnd();
    if (r != ncclSuccess && r != ncclInProgress) return failed(-1, nccl_text("warm-up", r, nullptr));
    if (end != ncclSuccess && end != ncclInProgress)
      return failed(-1, nccl_text("ncclGroupEnd (warm-up)", end, nullptr));
    for (auto* links : {&out_, &in_})
      for (auto& [pe, link] : *links) {
        Outcome o = settle(*link, "the warm-up exchange", wait);
        if (o.result == Result::Ok) o = drain(*link, "the warm-up exchange", wait);
        if (o.result != Result::Ok) return o;
      }
    // The service thread's kernels loaded now: with lazy module loading a
    // first launch may wait for every kernel running on the device, and a
    // signal must never wait behind a kernel of this PE that spins until it lands.
    cudaFuncAttributes attrs;
    e = cudaFuncGetAttributes(&attrs, signal_kernel);
    if (e == cudaSuccess) e = cudaFuncGetAttributes(&attrs, atomic_kernel);
    if (e != cudaSuccess) return failed(-1, "loading the engine's kernels: " + cuda_text(e));
    ::close(listen_fd_);
    listen_fd_ = -1;
    running_ = true;
    service_ = std::thread([this] { serve(); });
    return {};
  }

  Outcome put(int pe, uint64_t dst_off, const void* src, uint64_t nbytes, const SignalSpec* sig,
              void* stream, WaitHook& wait) override {
    Header h;
    h.op = wire(sig ? Op::PutSignal : Op::Put);
    h.offset = dst_off;
    h.nbytes = nbytes;
    if (sig) {
      h.signal_offset = sig->offset;
      h.value = static_cast<int64_t>(sig->value);
      h.signal_add = sig->add;
    }
    bytes_ += nbytes + (sig ? 8 : 0);
    return request(pe, h, const_cast<void*>(src), true, stream, wait, nullptr);
  }

  Outcome get(int pe, void* dst, uint64_t src_off, uint64_t nbytes, void* stream,
              WaitHook& wait) override {
    Header h;
    h.op = wire(Op::Get);
    h.offset = src_off;
    h.nbytes = nbytes;
    bytes_ += nbytes;
    return request(pe, h, dst, false, stream, wait, nullptr);
  }

  Outcome signal(int pe, const SignalSpec& sig, void* stream, WaitHook& wait) override {
    Header h;
    h.op = wire(Op::Signal);
    h.signal_offset = sig.offset;
    h.value = static_cast<int64_t>(sig.value);
    h.signal_add = sig.add;
    bytes_ += 8;
    return request(pe, h, nullptr, false, stream, wait, nullptr);
  }

  Outcome atomic(int pe, Op op, uint64_t offset, int64_t a, int64_t b, int64_t* old, void*,
                 WaitHook& wait) override {
    if (op != Op::FetchAdd && op != Op::CompareSwap && op != Op::Swap)
      return failed(pe, std::string(op_name(op)) + " is not an atomic");
    Header h;
    h.op = wire(op);
    h.offset = offset;
    h.value = a;
    h.value2 = b;
    bytes_ += 8;
    Answer answer;
    Outcome o = request(pe, h, nullptr, false, nullptr, wait, &answer);
    if (o.result == Result::Ok) *old = answer.value;
    return o;
  }

  Outcome quiet(WaitHook& wait) override {
    for (auto& [pe, link] : out_) {
      // A quiet answered after this PE's last put/get/signal covers them all
      // (another thread's, maybe).
      uint64_t touched = link->last_touch.load();
      if (touched == 0 || touched < link->fenced.load()) continue;
      Header h;
      h.op = wire(Op::Quiet);
      Answer answer;
      Outcome o = request(pe, h, nullptr, false, nullptr, wait, &answer);
      if (o.result != Result::Ok) return o;
      uint64_t was = link->fenced.load();
      while (was < answer.seq && !link->fenced.compare_exchange_weak(was, answer.seq)) {
      }
    }
    return {};
  }

  Outcome close(WaitHook& wait) override {
    DeviceScope on(spec_.device);
    // Our requests first: the peer's service answers the close once it served
    // everything before it, and sends nothing more on that pair.
    for (auto& [pe, link] : out_) {
      Header h;
      h.op = kWireClose;
      Answer answer;
      Outcome o = request(pe, h, nullptr, false, nullptr, wait, &answer);
      if (o.result != Result::Ok) return o;
      std::lock_guard<std::mutex> lock(link->mu);
      link->closed = true;
    }
    // Then wait until every peer closed its requests to us (the service stops).
    while (running_.load()) {
      if (!wait.pause()) return gave_up(first_open_in());
    }
    if (service_.joinable()) service_.join();
    if (!service_error_.empty()) return failed(service_error_pe_, service_error_);
    // Both sides of every pair are idle: finalize the communicators.
    for (auto* links : {&out_, &in_})
      for (auto& [pe, link] : *links) {
        if (!link->comm) continue;
        ncclResult_t r = nccl_->CommFinalize(link->comm);
        if (r != ncclSuccess && r != ncclInProgress)
          return failed(pe, nccl_text("ncclCommFinalize", r, link->comm));
      }
    for (auto* links : {&out_, &in_})
      for (auto& [pe, link] : *links) {
        if (!link->comm) continue;
        Outcome o = settle(*link, "ncclCommFinalize", wait);
        if (o.result != Result::Ok) return o;
        nccl_->CommDestroy(link->comm);
        link->comm = nullptr;
        link->broken = "the PE finalized";
      }
    return {};
  }

  void abort(int pe, const std::string& why) override {
    if (pe < 0) stop_service();
    for (auto* links : {&out_, &in_}) {
      for (auto& [p, link] : *links) {
        if (pe >= 0 && p != pe) continue;
        {
          std::lock_guard<std::mutex> lock(link->mu);
          if (link->comm) nccl_->CommAbort(link->comm);  // ends its kernels
          link->comm = nullptr;
          if (link->broken.empty()) link->broken = why;
          if (link->fd >= 0) ::shutdown(link->fd, SHUT_RDWR);
        }
        fail_answers(*link, Result::Failed, "its connection is gone: " + why, "");
      }
    }
  }

  uint64_t bytes_moved() const override { return bytes_.load(); }

 private:
  Outcome failed(int pe, const std::string& why) { return {Result::Failed, pe, why}; }
  Outcome gave_up(int pe) { return {Result::GaveUp, pe, ""}; }

  std::string nccl_text(const char* what, ncclResult_t r, ncclComm_t comm) {
    std::string out = std::string(what) + " failed: " + nccl_->GetErrorString(r);
    const char* last = nccl_->GetLastError(comm);
    if (last && *last) out += std::string(" (") + last + ")";
    return out;
  }

  int first_missing_in() {
    for (auto& [pe, link] : in_)
      if (link->fd < 0) return pe;
    return -1;
  }
  int first_open_in() {
    for (auto& [pe, link] : in_) {
      std::lock_guard<std::mutex> lock(link->mu);
      if (!link->closed && link->broken.empty()) return pe;
    }
    return -1;
  }

  Outcome dial(Link& link, const std::string& host, int port, WaitHook& wait) {
    addrinfo hints{}, *res = nullptr;
    hints.ai_family = AF_INET;
    hints.ai_socktype = SOCK_STREAM;
    int rc = getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res);
    if (rc != 0 || !res)
      return failed(link.pe, "cannot resolve its host '" + host + "': " + gai_strerror(rc) +
                                 " (set SYMHEAP_REMOTE_HOST on each node to an address the "
                                 "others reach)");
    // Non-blocking connect, retried until the deadline (a host that drops
    // packets would otherwise hold connect() for minutes).
    int fd = -1;
    bool gave_up_waiting = false;
    while (fd < 0 && !gave_up_waiting) {
      fd = ::socket(AF_INET, SOCK_STREAM, 0);
      if (fd < 0) break;
      set_nonblocking(fd);
      int rc = ::connect(fd, res->ai_addr, res->ai_addrlen);
      if (rc != 0 && errno == EINPROGRESS) {
        for (;;) {
          pollfd p{fd, POLLOUT, 0};
          if (::poll(&p, 1, 0) > 0) {
            int err = 0;
            socklen_t len = sizeof err;
            getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
            rc = err == 0 ? 0 : -1;
            break;
          }
          if (!wait.pause()) {
            gave_up_waiting = true;
            break;
          }
        }
      }
      if (rc == 0 && !gave_up_waiting) break;
      ::close(fd);
      fd = -1;
      if (!gave_up_waiting && !wait.pause()) gave_up_waiting = true;
    }
    freeaddrinfo(res);
    if (fd < 0) return gave_up(link.pe);
    Hello hello;
    hello.job = spec_.job;
    hello.from_pe = spec_.my_pe;
    hello.to_pe = link.pe;
    std::string why;
    int sent = send_all(fd, &hello, sizeof hello, [&] { return wait.pause(); }, &why);
    if (sent <= 0) {
      ::close(fd);
      return sent == 0 ? gave_up(link.pe) : failed(link.pe, why);
    }
    link.fd = fd;
    return {};
  }

  // Polls the communicator until its last call is no longer in progress.
  Outcome settle(Link& link, const char* what, WaitHook& wait) {
    for (;;) {
      ncclResult_t state = ncclSuccess;
      ncclResult_t r = nccl_->CommGetAsyncError(link.comm, &state);
      if (r != ncclSuccess) return failed(link.pe, nccl_text(what, r, link.comm));
      if (state == ncclSuccess) return {};
      if (state != ncclInProgress) return failed(link.pe, nccl_text(what, state, link.comm));
      if (!wait.pause()) return gave_up(link.pe);
    }
  }

  // Waits until the link's stream has done everything queued on it.
  Outcome drain(Link& link, const char* what, WaitHook& wait) {
    cudaError_t e = cudaEventRecord(link.after, link.stream);
    while (e == cudaSuccess) {
      e = cudaEventQuery(link.after);
      if (e == cudaSuccess) return {};
      if (e != cudaErrorNotReady) break;
      ncclResult_t state = ncclSuccess;
      nccl_->CommGetAsyncError(link.comm, &state);
      if (state != ncclSuccess && state != ncclInProgress)
        return failed(link.pe, nccl_text(what, state, link.comm));
      if (!wait.pause()) return gave_up(link.pe);
      e = cudaSuccess;
    }
    return failed(link.pe, std::string(what) + ": " + cuda_text(e));
  }

  // One request of this PE to `pe`: the header, then the bytes through NCCL on
  // the link's stream after the caller's stream (`data`: put source or get
  // destination), then, for ops with one, the answer. The link is held only
  // while the header goes and the NCCL call is issued (both sides must issue
  // them in header order); the wait for the answer is outside it, so other
  // threads' requests on the link go on meanwhile.
  Outcome request(int pe, Header h, void* data, bool data_out, void* stream, WaitHook& wait,
                  Answer* answer) {
    auto it = out_.find(pe);
    if (it == out_.end()) return failed(pe, "no connection to it");
    Link& link = *it->second;
    {
      std::lock_guard<std::mutex> lock(link.mu);
      Outcome gone = link_failure(link);
      if (gone.result != Result::Ok) return gone;
      h.seq = ++link.next_seq;
      Outcome o = issue(link, h, data, data_out, stream, wait);
      if (o.result != Result::Ok) return o;
      if (h.op == wire(Op::Put) || h.op == wire(Op::PutSignal) || h.op == wire(Op::Get) ||
          h.op == wire(Op::Signal))
        link.last_touch.store(h.seq);
    }
    if (!wire_op_has_reply(h.op)) return {};
    Answer got;
    Outcome o = await_answer(link, h.seq, wait, &got);
    if (o.result == Result::Ok && answer) *answer = got;
    return o;
  }

  // The header and the NCCL call of one request (link locked).
  Outcome issue(Link& link, const Header& h, void* data, bool data_out, void* stream,
                WaitHook& wait) {
    DeviceScope on(spec_.device);
    // Block in poll() between checks, so the header goes as soon as there is room.
    auto room = [&] {
      pollfd p{link.fd, POLLOUT, 0};
      ::poll(&p, 1, 1);
      return wait.check();
    };
    std::string why;
    trace(spec_.my_pe, "to PE %d: %s seq %llu off %llu bytes %llu signal %llu: header", link.pe,
          wire_op_name(h.op), ull(h.seq), ull(h.offset), ull(h.nbytes), ull(h.signal_offset));
    int sent = send_all(link.fd, &h, sizeof h, room, &why);
    if (sent == 0) return gave_up(link.pe);
    if (sent < 0) return failed(link.pe, why);
    bool moves_bytes =
        h.op == wire(Op::Put) || h.op == wire(Op::PutSignal) || h.op == wire(Op::Get);
    if (h.nbytes == 0 || !moves_bytes) return {};
    auto caller = static_cast<cudaStream_t>(stream);
    cudaError_t e = cudaEventRecord(link.before, caller);
    if (e == cudaSuccess) e = cudaStreamWaitEvent(link.stream, link.before, 0);
    if (e != cudaSuccess)
      return failed(link.pe, "ordering after the caller's stream: " + cuda_text(e));
    const char* call = data_out ? "ncclSend" : "ncclRecv";
    ncclResult_t r = data_out ? nccl_->Send(data, h.nbytes, ncclUint8, 1, link.comm, link.stream)
                              : nccl_->Recv(data, h.nbytes, ncclUint8, 1, link.comm, link.stream);
    if (r != ncclSuccess && r != ncclInProgress)
      return failed(link.pe, nccl_text(call, r, link.comm));
    if (r == ncclInProgress) {
      Outcome o = settle(link, call, wait);
      if (o.result != Result::Ok) return o;
    }
    trace(spec_.my_pe, "to PE %d: seq %llu: %s issued", link.pe, ull(h.seq), call);
    e = cudaEventRecord(link.after, link.stream);
    if (e == cudaSuccess) e = cudaStreamWaitEvent(caller, link.after, 0);
    if (e != cudaSuccess) return failed(link.pe, "ordering the caller's stream: " + cuda_text(e));
    return {};
  }

  // The answer numbered `seq` on an Out link. Whoever finds nobody reading
  // the socket reads it (blocking in poll() up to 1 ms at a time, so an
  // answer is taken as soon as it comes) and files every answer it reads;
  // the others wait until their answer was filed.
  Outcome await_answer(Link& link, uint64_t seq, WaitHook& wait, Answer* out) {
    Answers& a = link.answers;
    std::unique_lock<std::mutex> lock(a.mu);
    for (;;) {
      auto found = a.by_seq.find(seq);
      if (found != a.by_seq.end()) {
        *out = found->second;
        a.by_seq.erase(found);
        if (out->status == kServed) return {};
        return refusal(link.pe, *out);
      }
      if (a.failure != Result::Ok) return answers_outcome(link.pe, a);
      bool keep_going;
      if (!a.reading) {
        a.reading = true;
        lock.unlock();
        pollfd p{link.fd, POLLIN, 0};
        ::poll(&p, 1, 1);
        read_answers(link);
        keep_going = wait.check();
        lock.lock();
        a.reading = false;
        a.filed.notify_all();
      } else {
        a.filed.wait_for(lock, std::chrono::milliseconds(1));
        lock.unlock();
        keep_going = wait.check();
        lock.lock();
      }
      if (!keep_going) {
        if (a.by_seq.count(seq)) continue;  // it came meanwhile
        return gave_up(link.pe);
      }
    }
  }

  // Reads and files whatever answers arrived (the link's reader only).
  void read_answers(Link& link) {
    Answers& a = link.answers;
    for (;;) {
      char* at = reinterpret_cast<char*>(&a.partial) + a.have;
      ssize_t k = ::recv(link.fd, at, sizeof(Answer) - a.have, MSG_DONTWAIT);
      if (k > 0) {
        a.have += static_cast<size_t>(k);
        if (a.have < sizeof(Answer)) continue;
        a.have = 0;
        Answer got = a.partial;
        got.what[sizeof got.what - 1] = '\0';
        std::lock_guard<std::mutex> lock(a.mu);
        a.by_seq[got.seq] = got;
        if (got.status != kServed && a.failure == Result::Ok) {
          // The target ended its side of the pair: every later wait fails so.
          Outcome o = refusal(link.pe, got);
          a.failure = o.result;
          a.failure_text = o.error;
          a.failed_op = o.op;
        }
        a.filed.notify_all();
        continue;
      }
      if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return;
      fail_answers(link, Result::Failed,
                   k == 0 ? "it closed its connection (its process died or finalized)"
                          : std::string("its connection failed: ") + strerror(errno),
                   "");
      return;
    }
  }

  // Ends every wait on the link with this failure (the first one stays).
  void fail_answers(Link& link, Result result, const std::string& why, const std::string& op) {
    Answers& a = link.answers;
    std::lock_guard<std::mutex> lock(a.mu);
    if (a.failure == Result::Ok) {
      a.failure = result;
      a.failure_text = why;
      a.failed_op = op;
    }
    a.filed.notify_all();
  }

  Outcome refusal(int pe, const Answer& got) {
    Outcome o{Result::Refused, pe, got.what, wire_op_name(got.failed_op)};
    if (o.error.empty()) o.error = "its engine failed";
    return o;
  }
  static Outcome answers_outcome(int pe, const Answers& a) {
    return {a.failure, pe, a.failure_text, a.failed_op};
  }
  // Why an Out link can no longer be used (link locked): the target's
  // refusal or the connection's end; Ok while usable.
  Outcome link_failure(Link& link) {
    {
      std::lock_guard<std::mutex> lock(link.answers.mu);
      if (link.answers.failure != Result::Ok) return answers_outcome(link.pe, link.answers);
    }
    if (!link.broken.empty()) return failed(link.pe, "its connection is gone: " + link.broken);
    return {};
  }

  // ------------------------------------------------------------ the service thread

  void stop_service() {
    running_ = false;
    if (service_.joinable()) service_.join();
  }

  // Ends this PE's side of a pair it serves (service thread, link locked).
  void end_pair(Link& link, const std::string& why) {
    {
      std::lock_guard<std::mutex> lock(in_mu_);
      if (service_error_.empty()) {
        service_error_ = "serving PE " + std::to_string(link.pe) + ": " + why;
        service_error_pe_ = link.pe;
      }
    }
    if (link.comm) nccl_->CommAbort(link.comm);
    link.comm = nullptr;
    link.broken = why;
  }

  // The request `h` cannot be served: the requester learns what failed (and
  // fails at once rather than at its deadline), then the pair ends, since
  // its NCCL calls would no longer match.
  void refuse(Link& link, const Header& h, int64_t status, const std::string& why) {
    Answer a;
    a.seq = h.seq;
    a.status = status;
    a.failed_op = h.op;
    std::snprintf(a.what, sizeof a.what, "%s", why.c_str());
    send_answer(link, a);
    end_pair(link, why);
  }

  void serve() {
    cudaSetDevice(spec_.device);
    // The backoff's short sleeps end on time (Linux's default slack is 50 us).
    prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);
    std::vector<pollfd> fds;
    Backoff backoff;
    while (running_.load()) {
      bool progressed = false, pending = false;
      size_t open = 0;
      fds.clear();
      for (auto& [pe, link_ptr] : in_) {
        Link& link = *link_ptr;
        std::lock_guard<std::mutex> lock(link.mu);
        if (!link.broken.empty() || link.closed) continue;
        ++open;
        if (link.answer_pending) {
          progressed |= finish_answer(link);
          // The next header waits for this answer (one at a time per pair).
          if (link.answer_pending) pending = true;
          if (link.answer_pending || !link.broken.empty() || link.closed) continue;
        }
        // Headers, as many as arrived.
        for (;;) {
          char* at = reinterpret_cast<char*>(&link.hdr) + link.hdr_have;
          ssize_t k = ::recv(link.fd, at, sizeof(Header) - link.hdr_have, MSG_DONTWAIT);
          if (k > 0) {
            link.hdr_have += static_cast<size_t>(k);
            if (link.hdr_have < sizeof(Header)) continue;
            link.hdr_have = 0;
            progressed = true;
            perform(link);
            if (link.answer_pending) pending = true;
            if (link.answer_pending || !link.broken.empty()) break;
            continue;
          }
          if (k == 0) {
            end_pair(link, "it closed its connection (its process died)");
          } else if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
            end_pair(link, std::string("its connection failed: ") + strerror(errno));
          } else {
            fds.push_back({link.fd, POLLIN, 0});
          }
          break;
        }
      }
      if (open == 0) {
        running_ = false;  // every peer closed its requests to us
        break;
      }
      if (progressed) {
        backoff.reset();
        continue;
      }
      if (pending) {
        // Answers wait for the device: look again soon, or at once when a header comes.
        std::chrono::nanoseconds pause = backoff.next();
        if (pause.count() > 0) wait_fds(fds, pause);
        continue;
      }
      backoff.reset();
      ::poll(fds.data(), fds.size(), 1);  // idle: until a header comes (1 ms at most)
    }
  }

  // Queues the header's work on the link's stream (service thread, link locked).
  void perform(Link& link) {
    const Header h = link.hdr;
    char* base = spec_.base;
    auto in_heap = [&](uint64_t off, uint64_t n) {
      return off <= spec_.heap_size && n <= spec_.heap_size - off;
    };
    auto outside = [&](const char* what, uint64_t off, uint64_t n) {
      return std::string("the ") + what + " at offset " +
             std::to_string(off) + " (" + std::to_string(n) + " bytes) fall outside PE " +
             std::to_string(spec_.my_pe) + "'s heap of " + std::to_string(spec_.heap_size) +
             " bytes";
    };
    ncclResult_t r = ncclSuccess;
    cudaError_t e = cudaSuccess;
    switch (h.op) {
      case wire(Op::Put):
      case wire(Op::PutSignal):
      case wire(Op::Get):
        if (!in_heap(h.offset, h.nbytes))
          return refuse(link, h, kOutOfHeap, outside("bytes", h.offset, h.nbytes));
        if (h.op == wire(Op::PutSignal) && !in_heap(h.signal_offset, 8))
          return refuse(link, h, kOutOfHeap, outside("signal word", h.signal_offset, 8));
        trace(spec_.my_pe, "from PE %d: %s seq %llu off %llu bytes %llu signal %llu: serving",
              link.pe, wire_op_name(h.op), ull(h.seq), ull(h.offset), ull(h.nbytes),
              ull(h.signal_offset));
        if (h.nbytes > 0)
          r = h.op == wire(Op::Get)
                  ? nccl_->Send(base + h.offset, h.nbytes, ncclUint8, 0, link.comm, link.stream)
                  : nccl_->Recv(base + h.offset, h.nbytes, ncclUint8, 0, link.comm, link.stream);
        if (r == ncclInProgress) r = settle_service(link);
        trace(spec_.my_pe, "from PE %d: seq %llu: NCCL call issued (%d)", link.pe, ull(h.seq),
              static_cast<int>(r));
        if (r == ncclSuccess && h.op == wire(Op::PutSignal)) {
          signal_kernel<<<1, 1, 0, link.stream>>>(
              reinterpret_cast<unsigned long long*>(base + h.signal_offset),
              static_cast<unsigned long long>(h.value), h.signal_add ? 1 : 0);
          e = cudaGetLastError();
          trace(spec_.my_pe, "from PE %d: seq %llu: signal kernel launched", link.pe, ull(h.seq));
        }
        break;
      case wire(Op::Signal):
        if (!in_heap(h.signal_offset, 8))
          return refuse(link, h, kOutOfHeap, outside("signal word", h.signal_offset, 8));
        trace(spec_.my_pe, "from PE %d: signal seq %llu: launching", link.pe, ull(h.seq));
        signal_kernel<<<1, 1, 0, link.stream>>>(
            reinterpret_cast<unsigned long long*>(base + h.signal_offset),
            static_cast<unsigned long long>(h.value), h.signal_add ? 1 : 0);
        e = cudaGetLastError();
        trace(spec_.my_pe, "from PE %d: signal seq %llu: launched", link.pe, ull(h.seq));
        break;
      case wire(Op::FetchAdd):
      case wire(Op::CompareSwap):
      case wire(Op::Swap):
        if (!in_heap(h.offset, 8))
          return refuse(link, h, kOutOfHeap, outside("atomic word", h.offset, 8));
        atomic_kernel<<<1, 1, 0, link.stream>>>(
            reinterpret_cast<unsigned long long*>(base + h.offset), static_cast<Op>(h.op),
            static_cast<unsigned long long>(h.value), static_cast<unsigned long long>(h.value2),
            link.answer_dev);
        e = cudaGetLastError();
        [[fallthrough]];
      case wire(Op::Quiet):
      case kWireClose:
        if (e == cudaSuccess) e = cudaEventRecord(link.after, link.stream);
        if (e == cudaSuccess) {
          link.answer_pending = true;
          link.answer_for = h;
        }
        break;
      default:
        return refuse(link, h, kMalformed,
                      "a request with the unknown op " + std::to_string(h.op));
    }
    if (r != ncclSuccess) refuse(link, h, kEngineError, nccl_text(wire_op_name(h.op), r, link.comm));
    else if (e != cudaSuccess)
      refuse(link, h, kEngineError, std::string(wire_op_name(h.op)) + ": " + cuda_text(e));
  }

  // A call still in progress after it was issued (rare once connected): polled
  // with the backoff, within the PE's timeout.
  ncclResult_t settle_service(Link& link) {
    auto deadline = Clock::now() + std::chrono::duration<double>(spec_.timeout_s);
    Backoff backoff;
    for (;;) {
      ncclResult_t state = ncclSuccess;
      ncclResult_t r = nccl_->CommGetAsyncError(link.comm, &state);
      if (r != ncclSuccess) return r;
      if (state != ncclInProgress) return state;
      if (Clock::now() > deadline || !running_.load()) return ncclSystemError;
      std::chrono::nanoseconds pause = backoff.next();
      if (pause.count() > 0) std::this_thread::sleep_for(pause);
    }
  }

  // Answers once the service stream reached the point recorded for it; true
  // once the request is done with (answered or refused).
  bool finish_answer(Link& link) {
    cudaError_t e = cudaEventQuery(link.after);
    if (e == cudaErrorNotReady) {
      ncclResult_t state = ncclSuccess;
      nccl_->CommGetAsyncError(link.comm, &state);
      if (state == ncclSuccess || state == ncclInProgress) return false;
      link.answer_pending = false;
      refuse(link, link.answer_for, kEngineError,
             nccl_text("serving an earlier request", state, link.comm));
      return true;
    }
    link.answer_pending = false;
    if (e != cudaSuccess) {
      refuse(link, link.answer_for, kEngineError, "serving a request: " + cuda_text(e));
      return true;
    }
    Answer a;
    a.seq = link.answer_for.seq;
    uint32_t op = link.answer_for.op;
    if (op == wire(Op::FetchAdd) || op == wire(Op::CompareSwap) || op == wire(Op::Swap))
      a.value = static_cast<int64_t>(*reinterpret_cast<volatile unsigned long long*>(link.answer_host));
    send_answer(link, a);
    if (op == kWireClose && link.broken.empty()) link.closed = true;
    return true;
  }

  // Blocks in poll() while the socket is full (the requester reads its
  // answers only when it waits for one), within the PE's timeout.
  void send_answer(Link& link, const Answer& a) {
    auto deadline = Clock::now() + std::chrono::duration<double>(spec_.timeout_s);
    auto room = [&] {
      pollfd p{link.fd, POLLOUT, 0};
      ::poll(&p, 1, 1);
      return running_.load() && Clock::now() < deadline;
    };
    std::string why;
    int sent = send_all(link.fd, &a, sizeof a, room, &why);
    if (sent <= 0) end_pair(link, sent == 0 ? "it stopped reading its answers" : why);
  }

  void release(Link& link) {
    if (link.comm) nccl_->CommAbort(link.comm);
    link.comm = nullptr;
    if (link.stream) cudaStreamDestroy(link.stream);
    if (link.before) cudaEventDestroy(link.before);
    if (link.after) cudaEventDestroy(link.after);
    if (link.answer_host) cudaFreeHost(link.answer_host);
    if (link.fd >= 0) ::close(link.fd);
    link.stream = nullptr;
    link.before = link.after = nullptr;
    link.answer_host = nullptr;
    link.fd = -1;
  }

  Nccl* nccl_;
  EndpointSpec spec_;
  std::string offer_;
  int listen_fd_ = -1;
  void* warm_ = nullptr;
  std::map<int, std::unique_ptr<Link>> out_;  // this PE's requests, by target
  std::map<int, std::unique_ptr<Link>> in_;   // requests to this PE, by origin
  std::atomic<bool> running_{false};
  std::thread service_;
  std::mutex in_mu_;  // service_error_*
  std::string service_error_;
  int service_error_pe_ = -1;
  std::atomic<uint64_t> bytes_{0};
};

class NcclEngine final : public DeviceEngine {
 public:
  explicit NcclEngine(Nccl nccl) : nccl_(std::move(nccl)) {}
  const char* name() const override { return "NCCL"; }
  std::unique_ptr<DeviceEndpoint> endpoint(const EndpointSpec& spec,
                                           std::string* why_not) override {
    auto ep = std::make_unique<NcclEndpoint>(&nccl_, spec);
    if (!ep->prepare(why_not)) return nullptr;
    return ep;
  }

 private:
  Nccl nccl_;
};

}  // namespace
}  // namespace remote
}  // namespace symheap

extern "C" __attribute__((visibility("default"))) symheap::remote::DeviceEngine*
symheap_device_engine_open(int abi, std::string* why_not) {
  using namespace symheap::remote;
  if (abi != kDeviceEngineAbi) {
    *why_not = "libsymheap_nccl.so speaks engine ABI " + std::to_string(kDeviceEngineAbi) +
               ", the core " + std::to_string(abi) + ": rebuild symheap";
    return nullptr;
  }
  static std::mutex mu;
  static DeviceEngine* engine = nullptr;  // one per process, kept
  std::lock_guard<std::mutex> lock(mu);
  if (engine) return engine;
  Nccl nccl;
  if (!load_nccl(&nccl, why_not)) return nullptr;
  engine = new NcclEngine(std::move(nccl));
  return engine;
}
