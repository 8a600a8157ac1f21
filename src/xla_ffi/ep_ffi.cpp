// XLA FFI handlers of EpDispatchCombine: dispatch, combine and redispatch
// (combine's reverse, for gradients). The op is created collectively outside
// jit (symheap.jax.EpDispatchCombine) and found here by (job, id) from the
// PE of XLA's device. Operands and results come in a fixed order (see
// python/symheap/jax/_ep.py); absent ones are zero-size placeholders.
//
// Every result is written by the core straight into XLA's buffers: with every
// PE in this process the dispatch kernels of all PEs store their rows there
// (the op is created with caller_outputs; see ep::Op::peers_write_outputs);
// otherwise dispatch stores the rows a PE sends itself there and copies only
// the rows peers stored into its symmetric receive buffer (those within the
// counts; see ep::DispatchArgs::out_x), ordered on XLA's stream.
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "bindings/registry.hpp"
#include "ops/ep/ep_op.hpp"
#include "xla_ffi/ffi_common.hpp"

namespace symheap::xla_ffi {
namespace {

using ep::DType;

ffi::DataType ffi_type(DType t) {
  switch (t) {
    case DType::F32: return ffi::DataType::F32;
    case DType::F16: return ffi::DataType::F16;
    case DType::BF16: return ffi::DataType::BF16;
    case DType::FP8_E4M3: return ffi::DataType::F8E4M3FN;
  }
  return ffi::DataType::INVALID;
}

std::string shape_str(ffi::Span<const int64_t> dims) {
  std::string s = "(";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + (dims.size() == 1 ? ",)" : ")");
}

std::string shape_str(const std::vector<int64_t>& dims) {
  return shape_str(ffi::Span<const int64_t>(dims.data(), dims.size()));
}

// Throws InvalidArgument unless `b` has exactly this dtype and shape.
void expect(const ffi::AnyBuffer& b, const char* name, ffi::DataType dt, const char* dt_name,
            const std::vector<int64_t>& dims) {
  auto got = b.dimensions();
  bool same = got.size() == dims.size();
  for (size_t i = 0; same && i < dims.size(); ++i) same = got[i] == dims[i];
  if (!same || b.element_type() != dt)
    throw InvalidArgument(std::string(name) + " must have shape " + shape_str(dims) +
                          " and dtype " + dt_name + ", got shape " + shape_str(got));
}

struct Bound {
  std::shared_ptr<PeState> s;
  std::shared_ptr<ep::Op> op;
};

Bound bind_op(int32_t ordinal, uint64_t job, int64_t id, const char* what) {
  Bound b;
  b.s = pe_of_xla_device(ordinal, what);
  if (b.s->job != job)
    throw StateError(std::string(what) + ": this executable uses an EpDispatchCombine of an "
                     "earlier symheap.jax.init (finalized since); trace it again with a new op");
  std::shared_ptr<PeState> found;
  b.op = ep::find(b.s, b.s->my_pe, id, &found);  // b.s is this job's slot: no second lookup
  return b;
}

template <class T>
ffi::AnyBuffer arg(const ffi::RemainingArgs& args, size_t i) {
  auto r = args.get<T>(i);
  if (r.has_error()) throw InvalidArgument("ep: operand " + std::to_string(i) + " is missing");
  return *r;
}

ffi::AnyBuffer* ret(const ffi::RemainingRets& rets, size_t i,
                    std::vector<ffi::Result<ffi::AnyBuffer>>& keep) {
  auto r = rets.get<ffi::AnyBuffer>(i);
  if (r.has_error()) throw InvalidArgument("ep: result " + std::to_string(i) + " is missing");
  keep.push_back(*r);
  return &*keep.back();
}

// SYMHEAP_JAX_EP_DIRECT=0 restores the earlier delivery: rows stay in the
// op's receive buffer and whole buffers are copied into XLA's results (a
// reference for comparing the two on a device).
bool deliver_direct() {
  static const bool direct = [] {
    const char* v = std::getenv("SYMHEAP_JAX_EP_DIRECT");
    return !(v && std::strcmp(v, "0") == 0);
  }();
  return direct;
}

void copy_whole(const PeState& s, void* stream, ffi::AnyBuffer* dst, const void* src) {
  Runtime::instance().backend().copy(s.device, dst->untyped_data(), src, dst->size_bytes(),
                                     reinterpret_cast<StreamHandle>(stream));
}

constexpr const char* kI32 = "int32";
constexpr const char* kF32 = "float32";

// Runs one PE's share of a collective call whose arguments this PE may have
// refused (`problem`): the core still takes part, so the other PEs abort the
// call with it instead of waiting, and this PE raises its own message.
template <class Call>
void run_collective(const char* name, const std::string& problem, Call&& call) {
  try {
    call();
  } catch (const InvalidArgument&) {
    if (!problem.empty())
      throw InvalidArgument(problem + " (" + name + " aborted on every PE)");
    throw;
  }
  if (!problem.empty()) throw InvalidArgument(problem);
}

// Operands: x, scales, topk_idx, topk_weights, then any that only order the call
// (unread). Results:
// recv_x, recv_scales, recv_idx, recv_w, recv_meta, num_recv, expert_counts,
// send_rows, summary, saved_weights.
void dispatch(void* stream, int32_t ordinal, uint64_t job, int64_t id,
              const ffi::RemainingArgs& args, const ffi::RemainingRets& rets) {
  Bound b = bind_op(ordinal, job, id, "ep dispatch");
  PeState& s = *b.s;
  ep::Op& op = *b.op;
  const ep::Config& c = op.cfg;
  const ep::Geometry& g = op.geo;
  const bool em = c.layout == ep::Layout::ExpertMajor;
  const int64_t H = c.hidden, K = c.topk, L = g.local_experts, S = g.scales_per_row;
  const int64_t M = c.max_tokens, R = g.recv_rows, cap = g.expert_cap;
  DeviceGuard guard(s.device);
  std::vector<ffi::Result<ffi::AnyBuffer>> keep;
  keep.reserve(10);
  ffi::AnyBuffer x = arg<ffi::AnyBuffer>(args, 0), scales = arg<ffi::AnyBuffer>(args, 1),
                 idx = arg<ffi::AnyBuffer>(args, 2), w = arg<ffi::AnyBuffer>(args, 3);
  ffi::AnyBuffer* out[10];
  for (size_t i = 0; i < 10; ++i) out[i] = ret(rets, i, keep);

  std::string problem;
  int64_t T = x.dimensions().size() == 2 ? x.dimensions()[0] : 0;
  try {
    const char* dt = ep::dtype_name(c.dtype);
    expect(x, "x", ffi_type(c.dtype), dt, {T, H});
    expect(scales, "scales", ffi_type(c.scale_dtype), ep::dtype_name(c.scale_dtype), {T, S});
    if (idx.element_type() != ffi::DataType::S32 && idx.element_type() != ffi::DataType::S64)
      throw InvalidArgument("topk_idx must have dtype int64 or int32");
    expect(idx, "topk_idx", idx.element_type(), "int64 or int32", {T, K});
    expect(w, "topk_weights", ffi::DataType::F32, kF32, {T, K});
    std::vector<int64_t> rows = em ? std::vector<int64_t>{L, cap} : std::vector<int64_t>{R};
    auto with = [&](std::vector<int64_t> d, int64_t last) { d.push_back(last); return d; };
    expect(*out[0], "recv_x", ffi_type(c.dtype), dt, with(rows, H));
    expect(*out[1], "recv_scales", ffi_type(c.scale_dtype), ep::dtype_name(c.scale_dtype),
           with(rows, S));
    expect(*out[2], "recv_topk_idx", ffi::DataType::S32, kI32,
           em ? std::vector<int64_t>{0} : std::vector<int64_t>{R, K});
    expect(*out[3], "recv_topk_weights", ffi::DataType::F32, kF32,
           em ? std::vector<int64_t>{L, cap} : std::vector<int64_t>{R, K});
    expect(*out[4], "recv_meta", ffi::DataType::S32, kI32, {R, ep::kMetaWords});
    expect(*out[5], "num_recv_tokens", ffi::DataType::S32, kI32, {});
    expect(*out[6], "expert_counts", ffi::DataType::S32, kI32, {L});
    expect(*out[7], "send_rows", ffi::DataType::S32, kI32, {M, g.send_cols});
    expect(*out[8], "summary", ffi::DataType::S32, kI32,
           {ep::summary_words(g.n_pes, L, g.slot_words)});
    expect(*out[9], "saved_weights", ffi::DataType::F32, kF32,
           em ? std::vector<int64_t>{M, K} : std::vector<int64_t>{0});
  } catch (const InvalidArgument& e) {
    problem = e.what();
  }
  ep::DispatchArgs a;
  a.status = problem.empty() ? ep::kOk : ep::kBadArgument;
  if (problem.empty()) {
    a.x = x.untyped_data();
    a.scales = S ? scales.untyped_data() : nullptr;
    a.topk_idx = idx.untyped_data();
    a.idx_int64 = idx.element_type() == ffi::DataType::S64;
    a.topk_weights = static_cast<const float*>(w.untyped_data());
    a.num_tokens = T;
    a.num_recv = static_cast<int32_t*>(out[5]->untyped_data());
    a.expert_counts = static_cast<int32_t*>(out[6]->untyped_data());
    a.send_rows = static_cast<int32_t*>(out[7]->untyped_data());
    a.recv_meta = em ? static_cast<int32_t*>(out[4]->untyped_data()) : nullptr;
    a.recv_summary = static_cast<int32_t*>(out[8]->untyped_data());
    a.saved_weights = em ? static_cast<float*>(out[9]->untyped_data()) : nullptr;
    if (deliver_direct()) {
      a.out_x = out[0]->untyped_data();
      a.out_scales = S ? out[1]->untyped_data() : nullptr;
      a.out_w = static_cast<float*>(out[3]->untyped_data());
      if (!em) {
        a.out_idx = static_cast<int32_t*>(out[2]->untyped_data());
        a.out_meta = static_cast<int32_t*>(out[4]->untyped_data());
      }
    }
  }
  a.stream = reinterpret_cast<StreamHandle>(stream);
  run_collective("dispatch", problem, [&] { ep::dispatch(s, op, a); });
  if (!deliver_direct()) {
    const int me = op.my_pe;
    copy_whole(s, stream, out[0], ep::ws_addr(s, op, me, g.off_recv_x));
    if (S) copy_whole(s, stream, out[1], ep::ws_addr(s, op, me, g.off_recv_scales));
    copy_whole(s, stream, out[3], ep::ws_addr(s, op, me, g.off_recv_w));
    if (!em) {
      copy_whole(s, stream, out[2], ep::ws_addr(s, op, me, g.off_recv_idx));
      copy_whole(s, stream, out[4], ep::ws_addr(s, op, me, g.off_recv_meta));
    }
  }
}

// Operands: expert_out, send_rows, recv_meta, summary, weights, then any that only
// order the call (unread). Result: out.
void combine(void* stream, int32_t ordinal, uint64_t job, int64_t id,
             const ffi::RemainingArgs& args, const ffi::RemainingRets& rets) {
  Bound b = bind_op(ordinal, job, id, "ep combine");
  PeState& s = *b.s;
  ep::Op& op = *b.op;
  const ep::Config& c = op.cfg;
  const ep::Geometry& g = op.geo;
  const bool em = c.layout == ep::Layout::ExpertMajor;
  const int64_t H = c.hidden, K = c.topk, M = c.max_tokens, L = g.local_experts;
  DeviceGuard guard(s.device);
  std::vector<ffi::Result<ffi::AnyBuffer>> keep;
  ffi::AnyBuffer rows = arg<ffi::AnyBuffer>(args, 0), send_rows = arg<ffi::AnyBuffer>(args, 1),
                 meta = arg<ffi::AnyBuffer>(args, 2), summary = arg<ffi::AnyBuffer>(args, 3),
                 weights = arg<ffi::AnyBuffer>(args, 4);
  ffi::AnyBuffer* out = ret(rets, 0, keep);
  std::string problem;
  int64_t T = out->dimensions().size() == 2 ? out->dimensions()[0] : -1;
  try {
    const char* cdt = ep::dtype_name(g.combine_dtype);
    if (T < 0 || T > M)
      throw InvalidArgument("combine's result must have shape (num_tokens, " + std::to_string(H) +
                            ") with num_tokens <= max_tokens_per_rank=" + std::to_string(M));
    expect(*out, "out", ffi_type(g.combine_dtype), cdt, {T, H});
    expect(rows, "expert_out", ffi_type(g.combine_dtype), cdt,
           em ? std::vector<int64_t>{L, g.expert_cap, H} : std::vector<int64_t>{g.recv_rows, H});
    expect(send_rows, "handle.send_rows", ffi::DataType::S32, kI32, {M, g.send_cols});
    expect(meta, "handle.recv_meta", ffi::DataType::S32, kI32,
           em ? std::vector<int64_t>{g.recv_rows, ep::kMetaWords} : std::vector<int64_t>{0});
    expect(summary, "handle.summary", ffi::DataType::S32, kI32,
           {ep::summary_words(g.n_pes, L, g.slot_words)});
    expect(weights, "handle.weights", ffi::DataType::F32, kF32,
           em ? std::vector<int64_t>{M, K} : std::vector<int64_t>{0});
  } catch (const InvalidArgument& e) {
    problem = e.what();
  }
  ep::CombineArgs a;
  a.status = problem.empty() ? ep::kOk : ep::kBadArgument;
  if (problem.empty()) {
    a.expert_out = rows.untyped_data();
    a.expert_rows = g.recv_rows;
    a.send_rows = static_cast<const int32_t*>(send_rows.untyped_data());
    a.recv_meta = em ? static_cast<const int32_t*>(meta.untyped_data()) : nullptr;
    a.recv_summary = static_cast<const int32_t*>(summary.untyped_data());
    a.weights = em ? static_cast<const float*>(weights.untyped_data()) : nullptr;
    a.num_tokens = T;
    a.out = out->untyped_data();
  }
  a.stream = reinterpret_cast<StreamHandle>(stream);
  run_collective("combine", problem, [&] { ep::combine(s, op, a); });
}

// Operands: rows [num_tokens, hidden], send_rows, recv_meta, summary, then one that
// only orders the call (combine's result: the gradient runs after the forward).
// Result: the received rows' shape (recv_x of dispatch) in the combine dtype.
void redispatch(void* stream, int32_t ordinal, uint64_t job, int64_t id,
                const ffi::RemainingArgs& args, const ffi::RemainingRets& rets) {
  Bound b = bind_op(ordinal, job, id, "ep redispatch");
  PeState& s = *b.s;
  ep::Op& op = *b.op;
  const ep::Config& c = op.cfg;
  const ep::Geometry& g = op.geo;
  const bool em = c.layout == ep::Layout::ExpertMajor;
  const int64_t H = c.hidden, M = c.max_tokens, L = g.local_experts;
  DeviceGuard guard(s.device);
  std::vector<ffi::Result<ffi::AnyBuffer>> keep;
  ffi::AnyBuffer rows = arg<ffi::AnyBuffer>(args, 0), send_rows = arg<ffi::AnyBuffer>(args, 1),
                 meta = arg<ffi::AnyBuffer>(args, 2), summary = arg<ffi::AnyBuffer>(args, 3);
  ffi::AnyBuffer* out = ret(rets, 0, keep);
  std::string problem;
  int64_t T = rows.dimensions().size() == 2 ? rows.dimensions()[0] : -1;
  try {
    const char* cdt = ep::dtype_name(g.combine_dtype);
    if (T < 0 || T > M)
      throw InvalidArgument("rows must have shape (num_tokens, " + std::to_string(H) +
                            ") with num_tokens <= max_tokens_per_rank=" + std::to_string(M));
    expect(rows, "rows", ffi_type(g.combine_dtype), cdt, {T, H});
    expect(*out, "out", ffi_type(g.combine_dtype), cdt,
           em ? std::vector<int64_t>{L, g.expert_cap, H} : std::vector<int64_t>{g.recv_rows, H});
    expect(send_rows, "handle.send_rows", ffi::DataType::S32, kI32, {M, g.send_cols});
    expect(meta, "handle.recv_meta", ffi::DataType::S32, kI32,
           em ? std::vector<int64_t>{g.recv_rows, ep::kMetaWords} : std::vector<int64_t>{0});
    expect(summary, "handle.summary", ffi::DataType::S32, kI32,
           {ep::summary_words(g.n_pes, L, g.slot_words)});
  } catch (const InvalidArgument& e) {
    problem = e.what();
  }
  ep::RedispatchArgs a;
  a.status = problem.empty() ? ep::kOk : ep::kBadArgument;
  if (problem.empty()) {
    a.rows = rows.untyped_data();
    a.num_tokens = T;
    a.send_rows = static_cast<const int32_t*>(send_rows.untyped_data());
    a.recv_meta = em ? static_cast<const int32_t*>(meta.untyped_data()) : nullptr;
    a.recv_summary = static_cast<const int32_t*>(summary.untyped_data());
    a.out = out->untyped_data();
  }
  a.stream = reinterpret_cast<StreamHandle>(stream);
  run_collective("redispatch", problem, [&] { ep::redispatch(s, op, a); });
}

using Body = void (*)(void*, int32_t, uint64_t, int64_t, const ffi::RemainingArgs&,
                      const ffi::RemainingRets&);

// Calls and host time of each handler, summed over threads, from the first
// time they are read (bench/jax_ep_bench.py --parts: how much of a call's host
// time is ours, how much XLA's). Off until then: the counters are shared by
// every device's thread, and a program that never reads them pays nothing.
struct HandlerClock {
  std::atomic<int64_t> calls{0}, ns{0};
};
enum HandlerId { kDispatchId, kCombineId, kRedispatchId, kInitializeId, kHandlers };
HandlerClock g_clocks[kHandlers];
std::atomic<bool> g_clocks_on{false};

// Runs `f` as one call of handler `which`.
template <class F>
ffi::Error clocked(HandlerId which, F&& f) {
  if (!g_clocks_on.load(std::memory_order_relaxed)) return guarded(std::forward<F>(f));
  const auto t0 = std::chrono::steady_clock::now();
  ffi::Error e = guarded(std::forward<F>(f));
  const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                      std::chrono::steady_clock::now() - t0).count();
  g_clocks[which].ns.fetch_add(ns, std::memory_order_relaxed);
  g_clocks[which].calls.fetch_add(1, std::memory_order_relaxed);
  return e;
}

template <Body body, HandlerId which>
ffi::Error timed(void* stream, int32_t ordinal, uint64_t job, int64_t id,
                 const ffi::RemainingArgs& args, const ffi::RemainingRets& rets) {
  return clocked(which, [&] { body(stream, ordinal, job, id, args, rets); });
}

template <Body body, HandlerId which>
ffi::Error on_cpu(int32_t ordinal, uint64_t job, int64_t id, ffi::RemainingArgs args,
                  ffi::RemainingRets rets) {
  return timed<body, which>(nullptr, ordinal, job, id, args, rets);
}

#ifdef SYMHEAP_WITH_CUDA
template <Body body, HandlerId which>
ffi::Error on_cuda(void* stream, int32_t ordinal, uint64_t job, int64_t id,
                   ffi::RemainingArgs args, ffi::RemainingRets rets) {
  return timed<body, which>(stream, ordinal, job, id, args, rets);
}

// The initialize stage of the replayable CUDA handlers (XLA calls it before
// every run of a program, replays included).
ffi::Error ep_initialize(int32_t ordinal, uint64_t job, int64_t id) {
  return clocked(kInitializeId, [&] {
    Bound b = bind_op(ordinal, job, id, "ep call");
    ep::ready(*b.s, *b.op);
  });
}

// SYMHEAP_JAX_EP_COMMAND_BUFFER=0 registers the handlers that XLA runs
// outside its command buffers (a reference for comparing the two).
bool replayable() {
  const char* v = std::getenv("SYMHEAP_JAX_EP_COMMAND_BUFFER");
  return !(v && std::strcmp(v, "0") == 0);
}
#endif

}  // namespace

#define SYMHEAP_EP_CPU(symbol, body, which)                                             \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(symbol, (on_cpu<body, which>),                          \
                                ffi::Ffi::Bind()                                        \
                                    .Ctx<ffi::DeviceOrdinal>()                          \
                                    .Attr<uint64_t>("job")                              \
                                    .Attr<int64_t>("op")                                \
                                    .RemainingArgs()                                    \
                                    .RemainingRets())
#define SYMHEAP_EP_CUDA_BINDING                                                         \
  ffi::Ffi::Bind()                                                                      \
      .Ctx<ffi::PlatformStream<void*>>()                                                \
      .Ctx<ffi::DeviceOrdinal>()                                                        \
      .Attr<uint64_t>("job")                                                            \
      .Attr<int64_t>("op")                                                              \
      .RemainingArgs()                                                                  \
      .RemainingRets()
#define SYMHEAP_EP_CUDA(symbol, body, which) \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(symbol, (on_cuda<body, which>), SYMHEAP_EP_CUDA_BINDING)

SYMHEAP_EP_CPU(kEpDispatchCpu, dispatch, kDispatchId);
SYMHEAP_EP_CPU(kEpCombineCpu, combine, kCombineId);
SYMHEAP_EP_CPU(kEpRedispatchCpu, redispatch, kRedispatchId);
#ifdef SYMHEAP_WITH_CUDA
SYMHEAP_EP_CUDA(kEpDispatchCuda, dispatch, kDispatchId);
SYMHEAP_EP_CUDA(kEpCombineCuda, combine, kCombineId);
SYMHEAP_EP_CUDA(kEpRedispatchCuda, redispatch, kRedispatchId);
// The same, claimed command-buffer compatible: with XLA's command buffers on
// (the default), XLA records the launches into its CUDA graphs and replays
// them without calling these handlers. Every op symheap.jax makes can be
// replayed (no host synchronisation; epochs and parities live on the device),
// and before each run XLA calls ep_initialize: the op must still exist and
// not have failed (errors its kernels record are raised by check, close and
// the calls XLA makes outside a replay; see ep::ready).
#define SYMHEAP_EP_CUDA_REPLAYABLE(symbol, body, which)                                  \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(symbol, (on_cuda<body, which>), SYMHEAP_EP_CUDA_BINDING, \
                                {ffi::Traits::kCmdBufferCompatible})
SYMHEAP_EP_CUDA_REPLAYABLE(kEpDispatchCudaReplayable, dispatch, kDispatchId);
SYMHEAP_EP_CUDA_REPLAYABLE(kEpCombineCudaReplayable, combine, kCombineId);
SYMHEAP_EP_CUDA_REPLAYABLE(kEpRedispatchCudaReplayable, redispatch, kRedispatchId);

XLA_FFI_DEFINE_HANDLER_SYMBOL(kEpInitializeCuda, ep_initialize,
                              ffi::Ffi::BindInitialize()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Attr<uint64_t>("job")
                                  .Attr<int64_t>("op"));

#endif

}  // namespace symheap::xla_ffi

SYMHEAP_BINDINGS(xla_ep) {
  using namespace symheap::xla_ffi;
  m.def("xla_ep_targets", [] {
    pybind11::dict targets;
    auto add = [&](const char* name, XLA_FFI_Handler* cpu, XLA_FFI_Handler* cuda,
                   XLA_FFI_Handler* cuda_replayable) {
      pybind11::dict platforms;
      platforms["cpu"] = capsule(cpu);
#ifdef SYMHEAP_WITH_CUDA
      if (replayable()) {  // (a dict of stages: jax.ffi.register_ffi_target)
        pybind11::dict stages;
        stages["initialize"] = capsule(kEpInitializeCuda);
        stages["execute"] = capsule(cuda_replayable);
        platforms["CUDA"] = stages;
      } else {
        platforms["CUDA"] = capsule(cuda);
      }
#endif
      targets[name] = platforms;
    };
#ifdef SYMHEAP_WITH_CUDA
    add("symheap_ep_dispatch", kEpDispatchCpu, kEpDispatchCuda, kEpDispatchCudaReplayable);
    add("symheap_ep_combine", kEpCombineCpu, kEpCombineCuda, kEpCombineCudaReplayable);
    add("symheap_ep_redispatch", kEpRedispatchCpu, kEpRedispatchCuda,
        kEpRedispatchCudaReplayable);
#else
    add("symheap_ep_dispatch", kEpDispatchCpu, nullptr, nullptr);
    add("symheap_ep_combine", kEpCombineCpu, nullptr, nullptr);
    add("symheap_ep_redispatch", kEpRedispatchCpu, nullptr, nullptr);
#endif
    return targets;
  });
  m.def("xla_ep_handler_clocks", [] {
    // {handler: (calls, host seconds)} since the first read, all threads (the
    // first read turns the clocks on and returns zeros).
    g_clocks_on.store(true, std::memory_order_relaxed);
    pybind11::dict out;
    const char* names[kHandlers] = {"dispatch", "combine", "redispatch", "initialize"};
    for (int i = 0; i < kHandlers; ++i)
      out[names[i]] = pybind11::make_tuple(g_clocks[i].calls.load(),
                                           static_cast<double>(g_clocks[i].ns.load()) * 1e-9);
    return out;
  });
}
