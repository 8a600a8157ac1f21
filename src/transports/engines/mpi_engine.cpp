// The MPI remote engine (built as libsymheap_mpi.so, loaded by the core only
// once the process has MPI loaded). Two-sided messages driven by symheap:
// every PE's request is one message to the target's process on a request
// tag; one service thread per process receives them (any source), performs
// them on the target PE's heap and answers those that need an answer (get,
// atomics, quiet) on a tag unique to that request. MPI keeps messages of one
// sender on one communicator and tag in order, so one service thread serving
// in arrival order gives SHMEM's ordering: a put's bytes land before the
// signal that follows them, and a quiet's answer means every earlier request
// of that PE was served. The service thread also drives MPI's progress for
// the process's own sends while PE threads do not call MPI.
//
// Why not passive-target one-sided MPI (MPI_Win): with Open MPI over TCP a
// passive target makes progress only when it calls MPI itself, and a PE that
// spins on its own memory in signal_wait_until never does.
#include <mpi.h>
#include <sched.h>
#include <time.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <list>
#include <map>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "transports/remote_engine.hpp"

namespace symheap {
namespace remote {
namespace {

std::string mpi_error(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int n = 0;
  if (MPI_Error_string(code, text, &n) != MPI_SUCCESS) return "MPI error " + std::to_string(code);
  return std::string(text, n);
}

// Tags: one request tag, then a ring of reply tags (one per request in
// flight), at the top of the tag space to stay clear of the application's.
constexpr int kReplyTags = 1 << 20;

class MpiPending final : public Pending {
 public:
  std::vector<char> out;  // Request (+ payload)
  std::vector<char> in;   // Reply (+ data)
  MPI_Request send = MPI_REQUEST_NULL;
  MPI_Request recv = MPI_REQUEST_NULL;
  std::string failure;

  int test() override {
    if (!failure.empty()) return -1;
    for (MPI_Request* r : {&send, &recv}) {
      if (*r == MPI_REQUEST_NULL) continue;
      int done = 0;
      int rc = MPI_Test(r, &done, MPI_STATUS_IGNORE);
      if (rc != MPI_SUCCESS) {
        failure = "MPI_Test failed: " + mpi_error(rc);
        return -1;
      }
    }
    return send == MPI_REQUEST_NULL && recv == MPI_REQUEST_NULL ? 1 : 0;
  }
  std::string error() const override { return failure; }
  const Reply& reply() const override { return *reinterpret_cast<const Reply*>(in.data()); }
  const char* reply_data() const override { return in.data() + sizeof(Reply); }

  // After the caller gave up: a receive can be cancelled; a send must finish
  // (or fail) before its buffer goes.
  void cancel() {
    if (recv != MPI_REQUEST_NULL) MPI_Cancel(&recv);
  }
  // Whether MPI is done with the buffers (abandoned requests).
  bool settled() {
    for (MPI_Request* r : {&send, &recv}) {
      if (*r == MPI_REQUEST_NULL) continue;
      int done = 0;
      if (MPI_Test(r, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS) {
        MPI_Request_free(r);  // MPI reported the failure: nothing more will come
        *r = MPI_REQUEST_NULL;
      }
    }
    return send == MPI_REQUEST_NULL && recv == MPI_REQUEST_NULL;
  }
};

class MpiEngine final : public Engine {
 public:
  MpiEngine(int rank, int size, int request_tag)
      : rank_(rank), size_(size), request_tag_(request_tag) {}

  const char* name() const override { return "mpi"; }
  std::string address() const override {
    return "mpi:" + std::to_string(size_) + ":" + std::to_string(rank_);
  }

  bool reaches(const std::string& address, std::string* why_not) const override {
    int size = -1, rank = -1;
    if (!parse(address, &size, &rank)) {
      *why_not = address.empty() ? "its process published no MPI address"
                                 : "its process published '" + address + "', not an MPI rank";
      return false;
    }
    if (size != size_) {
      *why_not = "its process belongs to another MPI job (MPI_COMM_WORLD of " +
                 std::to_string(size) + " processes, this one has " + std::to_string(size_) + ")";
      return false;
    }
    return true;
  }

  void attach(uint64_t job, int pe, char* base, size_t size) override {
    std::lock_guard<std::mutex> life(life_mu_);
    {
      std::lock_guard<std::mutex> lock(table_mu_);
      served_[{job, pe}] = {base, size};
    }
    if (!service_.joinable() && !mpi_finalizing_) {
      stop_.store(false);
      service_ = std::thread([this] { serve_loop(); });
    }
  }

  void detach(uint64_t job, int pe) override {
    std::lock_guard<std::mutex> life(life_mu_);
    bool last;
    {
      std::lock_guard<std::mutex> lock(table_mu_);
      served_.erase({job, pe});
      errors_.erase({job, pe});
      last = served_.empty();
    }
    if (last) stop_service();
  }

  std::unique_ptr<Pending> start(const std::string& address, const Request& req,
                                 const void* payload, size_t reply_bytes) override {
    auto p = std::make_unique<MpiPending>();
    int size = -1, rank = -1;
    if (mpi_finalizing_) {
      p->failure = "MPI was finalized in this process";
      return p;
    }
    if (!parse(address, &size, &rank) || size != size_ || rank < 0 || rank >= size_) {
      p->failure = "no MPI rank in address '" + address + "'";
      return p;
    }
    Op op = static_cast<Op>(req.op);
    size_t payload_bytes = op_has_payload(op) ? req.nbytes : 0;
    if (payload_bytes > static_cast<size_t>(INT32_MAX) - sizeof(Request) ||
        reply_bytes > static_cast<size_t>(INT32_MAX) - sizeof(Reply)) {
      p->failure = "message too large for one MPI message";
      return p;
    }
    Request head = req;
    if (op_has_reply(op)) {
      head.reply_tag = request_tag_ + 1 +
                       static_cast<int>(next_reply_.fetch_add(1, std::memory_order_relaxed) %
                                        kReplyTags);
      p->in.assign(sizeof(Reply) + reply_bytes, 0);
      int rc = MPI_Irecv(p->in.data(), static_cast<int>(p->in.size()), MPI_BYTE, rank,
                         head.reply_tag, MPI_COMM_WORLD, &p->recv);
      if (rc != MPI_SUCCESS) {
        p->failure = "MPI_Irecv failed: " + mpi_error(rc);
        return p;
      }
    }
    p->out.resize(sizeof(Request) + payload_bytes);
    std::memcpy(p->out.data(), &head, sizeof head);
    if (payload_bytes) std::memcpy(p->out.data() + sizeof head, payload, payload_bytes);
    int rc = MPI_Isend(p->out.data(), static_cast<int>(p->out.size()), MPI_BYTE, rank,
                       request_tag_, MPI_COMM_WORLD, &p->send);
    if (rc != MPI_SUCCESS) {
      p->failure = "MPI_Isend failed: " + mpi_error(rc);
      p->cancel();
      std::lock_guard<std::mutex> lock(graveyard_mu_);
      graveyard_.push_back(std::move(p));
      auto failed = std::make_unique<MpiPending>();
      failed->failure = "MPI_Isend failed: " + mpi_error(rc);
      return failed;
    }
    return p;
  }

  void abandon(std::unique_ptr<Pending> p) override {
    if (!p) return;
    auto* mine = static_cast<MpiPending*>(p.release());
    mine->cancel();
    std::lock_guard<std::mutex> lock(graveyard_mu_);
    graveyard_.emplace_back(mine);
  }

  // MPI_Finalize is starting (the COMM_SELF attribute's delete callback):
  // the service thread must leave MPI before it goes.
  void on_mpi_finalize() {
    std::lock_guard<std::mutex> life(life_mu_);
    mpi_finalizing_ = true;
    stop_service();
  }

 private:
  struct Heap {
    char* base;
    size_t size;
  };
  using PeKey = std::pair<uint64_t, int>;  // (job, pe)

  static bool parse(const std::string& address, int* size, int* rank) {
    return std::sscanf(address.c_str(), "mpi:%d:%d", size, rank) == 2;
  }

  void stop_service() {  // under life_mu_
    if (!service_.joinable()) return;
    stop_.store(true);
    service_.join();
  }

  void serve_loop() {
    std::vector<char> buffer;
    unsigned idle = 0;
    while (!stop_.load(std::memory_order_acquire)) {
      int found = 0;
      MPI_Message message;
      MPI_Status status;
      int rc = MPI_Improbe(MPI_ANY_SOURCE, request_tag_, MPI_COMM_WORLD, &found, &message,
                           &status);
      if (rc == MPI_SUCCESS && found) {
        int count = 0;
        MPI_Get_count(&status, MPI_BYTE, &count);
        buffer.resize(std::max<size_t>(static_cast<size_t>(count), sizeof(Request)));
        if (MPI_Mrecv(buffer.data(), count, MPI_BYTE, &message, &status) == MPI_SUCCESS)
          serve(status.MPI_SOURCE, buffer.data(), static_cast<size_t>(count));
        idle = 0;
        continue;
      }
      reap();
      // Idle: yield at first, then sleep up to 200 us (the latency an idle
      // process adds to the first request of a burst).
      if (++idle < 64) {
        sched_yield();
      } else {
        timespec ts{0, static_cast<long>(std::min(idle, 100u)) * 2000};
        nanosleep(&ts, nullptr);
      }
    }
    reap();
  }

  static bool inside(const Heap& heap, uint64_t offset, uint64_t nbytes) {
    return offset <= heap.size && nbytes <= heap.size - offset;
  }
  static bool word_inside(const Heap& heap, uint64_t offset) {
    return offset % sizeof(uint64_t) == 0 && inside(heap, offset, sizeof(uint64_t));
  }

  void serve(int source, const char* message, size_t count) {
    if (count < sizeof(Request)) return;  // not ours to answer: no reply tag to use
    Request req;
    std::memcpy(&req, message, sizeof req);
    const char* payload = message + sizeof req;
    size_t payload_bytes = count - sizeof req;
    Op op = static_cast<Op>(req.op);
    Status status = Status::Ok;
    std::vector<char> answer(sizeof(Reply));
    Reply reply;
    {
      std::lock_guard<std::mutex> lock(table_mu_);  // detach waits until this request is done
      if (op == Op::Quiet) {
        auto err = errors_.find({req.job, req.from_pe});
        if (err != errors_.end()) {
          reply.value = err->second.op;
          reply.detail = err->second.status;
          reply.target = err->second.target;
          errors_.erase(err);
        }
      } else {
        auto it = served_.find({req.job, req.to_pe});
        if (it == served_.end()) {
          status = Status::NotServed;
        } else {
          status = perform(it->second, req, op, payload, payload_bytes, &reply, &answer);
        }
        if (status != Status::Ok && !op_has_reply(op))  // told at the PE's next quiet
          errors_.emplace(PeKey{req.job, req.from_pe},
                          Failure{static_cast<int64_t>(op), static_cast<int64_t>(status),
                                  static_cast<int64_t>(req.to_pe)});
      }
    }
    if (!op_has_reply(op) || req.reply_tag < 0) return;
    if (status != Status::Ok) answer.resize(sizeof(Reply));
    reply.status = static_cast<int64_t>(status);
    std::memcpy(answer.data(), &reply, sizeof reply);
    auto p = std::make_unique<MpiPending>();
    p->out = std::move(answer);
    if (MPI_Isend(p->out.data(), static_cast<int>(p->out.size()), MPI_BYTE, source,
                  req.reply_tag, MPI_COMM_WORLD, &p->send) == MPI_SUCCESS) {
      std::lock_guard<std::mutex> lock(graveyard_mu_);
      graveyard_.push_back(std::move(p));  // reaped once sent
    }
  }

  static Status perform(const Heap& heap, const Request& req, Op op, const char* payload,
                        size_t payload_bytes, Reply* reply, std::vector<char>* answer) {
    auto word = [&](uint64_t offset) { return reinterpret_cast<int64_t*>(heap.base + offset); };
    auto signal = [&] {
      auto* w = reinterpret_cast<uint64_t*>(heap.base + req.signal_offset);
      // After the bytes, sequentially consistent (a release at least): the
      // target's signal_wait_until, an acquire load, sees the bytes first.
      if (req.signal_add) __atomic_fetch_add(w, static_cast<uint64_t>(req.value), __ATOMIC_SEQ_CST);
      else __atomic_store_n(w, static_cast<uint64_t>(req.value), __ATOMIC_SEQ_CST);
    };
    switch (op) {
      case Op::Put:
      case Op::PutSignal:
        if (payload_bytes != req.nbytes) return Status::Malformed;
        if (!inside(heap, req.offset, req.nbytes)) return Status::OutOfHeap;
        if (op == Op::PutSignal && !word_inside(heap, req.signal_offset)) return Status::OutOfHeap;
        std::memcpy(heap.base + req.offset, payload, req.nbytes);
        if (op == Op::PutSignal) signal();
        else std::atomic_thread_fence(std::memory_order_release);
        return Status::Ok;
      case Op::Signal:
        if (!word_inside(heap, req.signal_offset)) return Status::OutOfHeap;
        signal();
        return Status::Ok;
      case Op::Get:
        if (!inside(heap, req.offset, req.nbytes)) return Status::OutOfHeap;
        answer->resize(sizeof(Reply) + req.nbytes);
        std::atomic_thread_fence(std::memory_order_acquire);
        std::memcpy(answer->data() + sizeof(Reply), heap.base + req.offset, req.nbytes);
        return Status::Ok;
      case Op::FetchAdd:
        if (!word_inside(heap, req.offset)) return Status::OutOfHeap;
        reply->value = __atomic_fetch_add(word(req.offset), req.value, __ATOMIC_SEQ_CST);
        return Status::Ok;
      case Op::CompareSwap: {
        if (!word_inside(heap, req.offset)) return Status::OutOfHeap;
        int64_t expected = req.value;
        __atomic_compare_exchange_n(word(req.offset), &expected, req.value2, false,
                                    __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
        reply->value = expected;  // the old value either way
        return Status::Ok;
      }
      case Op::Swap:
        if (!word_inside(heap, req.offset)) return Status::OutOfHeap;
        reply->value = __atomic_exchange_n(word(req.offset), req.value, __ATOMIC_SEQ_CST);
        return Status::Ok;
      case Op::Quiet:
        return Status::Ok;
    }
    return Status::Malformed;
  }

  // Frees replies once sent and abandoned requests once MPI let go of them.
  void reap() {
    std::lock_guard<std::mutex> lock(graveyard_mu_);
    graveyard_.remove_if([](const std::unique_ptr<MpiPending>& p) { return p->settled(); });
  }

  const int rank_, size_, request_tag_;
  std::atomic<uint64_t> next_reply_{0};

  std::mutex life_mu_;  // service thread start/stop
  std::thread service_;
  std::atomic<bool> stop_{false};
  bool mpi_finalizing_ = false;

  std::mutex table_mu_;
  std::map<PeKey, Heap> served_;
  // The first failed request without a reply, per sending PE.
  struct Failure {
    int64_t op, status, target;
  };
  std::map<PeKey, Failure> errors_;

  std::mutex graveyard_mu_;
  std::list<std::unique_ptr<MpiPending>> graveyard_;
};

MpiEngine* g_engine = nullptr;  // one per process, never destroyed (threads may outlive exit)
std::mutex g_open_mu;

int on_comm_self_delete(MPI_Comm, int, void*, void*) {
  if (g_engine) g_engine->on_mpi_finalize();
  return MPI_SUCCESS;
}

}  // namespace
}  // namespace remote
}  // namespace symheap

extern "C" __attribute__((visibility("default"))) symheap::remote::Engine*
symheap_remote_engine_open(int abi, std::string* why_not) {
  using namespace symheap::remote;
  if (abi != kEngineAbi) {
    *why_not = "libsymheap_mpi.so speaks engine ABI " + std::to_string(kEngineAbi) +
               ", the core " + std::to_string(abi) + ": rebuild symheap";
    return nullptr;
  }
  std::lock_guard<std::mutex> lock(g_open_mu);
  if (g_engine) return g_engine;
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (!initialized || finalized) {
    *why_not = std::string("MPI is ") + (finalized ? "already finalized" : "not initialised") +
               " in this process: launch with mpirun and init with symheap.init_mpi (or import "
               "mpi4py.MPI before symheap.init)";
    return nullptr;
  }
  int level = 0;
  MPI_Query_thread(&level);
  if (level != MPI_THREAD_MULTIPLE) {
    *why_not =
        "MPI was initialised without MPI_THREAD_MULTIPLE (level " + std::to_string(level) +
        "): the remote engine's service thread calls MPI beside the PE threads; initialise MPI "
        "with MPI_THREAD_MULTIPLE (mpi4py's default: leave mpi4py.rc.thread_level at "
        "'multiple')";
    return nullptr;
  }
  int rank = 0, size = 0, found = 0;
  int* tag_ub = nullptr;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &tag_ub, &found);
  if (!found || *tag_ub < 2 * kReplyTags) {
    *why_not = "this MPI's largest tag (MPI_TAG_UB) is below " + std::to_string(2 * kReplyTags) +
               ", too few for the remote engine's reply tags";
    return nullptr;
  }
  g_engine = new MpiEngine(rank, size, *tag_ub - kReplyTags - 1);
  int key = MPI_KEYVAL_INVALID;  // its delete callback runs first thing in MPI_Finalize
  if (MPI_Comm_create_keyval(MPI_COMM_NULL_COPY_FN, on_comm_self_delete, &key, nullptr) ==
      MPI_SUCCESS)
    MPI_Comm_set_attr(MPI_COMM_SELF, key, nullptr);
  return g_engine;
}
