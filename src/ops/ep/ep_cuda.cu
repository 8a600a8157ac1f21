// Host side of the CUDA implementation: launches on the caller's stream,
// copy-engine channels, and the host-mapped error mirror.
//
// Host synchronisation, by kernel:
//  low_latency             never (fixed capacity; graph capturable);
//  intranode               only without max_recv_tokens, to return exactly
//                          the received rows;
//  copy_engine             after packing (to learn the copy plan), in both
//                          dispatch and combine.
#include <cuda_runtime.h>

#include <algorithm>
#include <string>
#include <vector>

#include "ops/ep/ep_kernels.cuh"
#include "ops/ep/ep_op.hpp"
#include "symheap/errors.hpp"

namespace symheap::ep {
namespace {

using kernels::Params;

void cuda_check(cudaError_t err, const char* what, int line) {
  if (err == cudaSuccess) return;
  cudaGetLastError();  // clear non-sticky errors
  throw StateError(std::string("ep (ep_cuda.cu:") + std::to_string(line) + "): " + what +
                   " failed: " + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")");
}
#define EP_CUDA(call) cuda_check((call), #call, __LINE__)
#define EP_LAUNCHED(name) cuda_check(cudaGetLastError(), "launch of " name, __LINE__)

// Per-op CUDA resources.
struct CudaState {
  int device = -1;
  int32_t* host = nullptr;      // host-mapped mirror (kernels::HostWord)
  int32_t* host_dev = nullptr;  // its device address
  size_t host_words = 0;
  std::vector<cudaStream_t> channels;  // copy engine: one per destination PE
  std::vector<cudaEvent_t> done;       // one per channel
  cudaEvent_t packed = nullptr;

  ~CudaState() {  // best effort: the process may be exiting
    int previous = -1;
    cudaGetDevice(&previous);
    cudaSetDevice(device);
    for (auto s : channels)
      if (s) cudaStreamDestroy(s);
    for (auto e : done)
      if (e) cudaEventDestroy(e);
    if (packed) cudaEventDestroy(packed);
    if (host) cudaFreeHost(host);
    if (previous >= 0) cudaSetDevice(previous);
  }
};

CudaState& state_of(Op& op) { return *static_cast<CudaState*>(op.cuda.get()); }

int blocks_for(int64_t items, int per_block) {
  int64_t b = (items + per_block - 1) / per_block;
  return static_cast<int>(std::clamp<int64_t>(b, 1, kernels::kMaxBlocks));
}
// Grids depend on the config only, so every PE adds the same amount to a flag.
int dispatch_blocks(const Op& op) { return blocks_for(op.cfg.max_tokens, kernels::kWarpsPerBlock); }
int send_blocks(const Op& op) { return blocks_for(op.geo.recv_rows, kernels::kWarpsPerBlock); }
int reduce_blocks(const Op& op) { return blocks_for(op.cfg.max_tokens, kernels::kWarpsPerBlock); }
int route_blocks(const Op& op) {
  return op.cfg.layout == Layout::TokenMajor ? op.n_pes + op.cfg.num_experts : op.cfg.num_experts;
}

Params base_params(PeState& s, Op& op) {
  CudaState& cs = state_of(op);
  Params p{};
  p.c = op.cfg;
  p.g = op.geo;
  p.peers = s.peer_table();
  p.ws = op.ws_offset;
  p.me = op.my_pe;
  p.n = op.n_pes;
  p.timeout_ns = static_cast<uint64_t>(op.timeout_s * 1e9);
  p.host = cs.host_dev;
  p.pack = op.cfg.kernel == Kernel::CopyEngine;
  return p;
}

cudaStream_t as_stream(StreamHandle h) { return reinterpret_cast<cudaStream_t>(h); }

volatile int32_t* mirror(Op& op) { return state_of(op).host; }

// Raises the failure a kernel recorded, if any, and clears it.
void raise_recorded(PeState& s, Op& op, StreamHandle stream) {
  volatile int32_t* h = mirror(op);
  const int32_t status = h[kernels::kHostStatus];
  if (status == kOk) return;
  const int32_t detail = h[kernels::kHostDetail], pe = h[kernels::kHostPe],
                epoch = h[kernels::kHostEpoch];
  h[kernels::kHostStatus] = kOk;
  EP_CUDA(cudaMemsetAsync(s.base() + op.ws_offset + op.geo.off_local + 8 * kErrorWord, 0, 8,
                          as_stream(stream)));
  std::string what = "ep call (device epoch " + std::to_string(epoch) + ") on PE " +
                     std::to_string(op.my_pe) + " failed: ";
  if (status == kPeerTimeout)
    throw TimeoutError(what + "timed out after " + std::to_string(op.timeout_s) +
                       " s waiting for PE " + std::to_string(detail) +
                       " (did every PE make the same call?); the op is unusable now");
  if (status == kRecvOverflow)
    throw InvalidArgument(what + "a receive buffer would overflow (" +
                          (op.cfg.layout == Layout::TokenMajor
                               ? "PE " + std::to_string(detail) + "; raise max_recv_tokens)"
                               : "expert " + std::to_string(detail) + "; raise expert_capacity)"));
  std::string msg = what + describe_status(status, detail, pe, op.cfg);
  if (pe == op.my_pe) throw InvalidArgument(msg);
  throw StateError(msg);
}

int32_t host_status_of(const Op& op, int32_t status, int64_t num_tokens, int32_t* detail) {
  *detail = 0;
  if (status != kOk) return status;
  if (num_tokens < 0 || num_tokens > op.cfg.max_tokens) {
    *detail = static_cast<int32_t>(std::min<int64_t>(num_tokens, INT32_MAX));
    return kTooManyTokens;
  }
  return kOk;
}

void raise_own(const Op& op, int32_t status, int32_t detail, const char* call) {
  if (status == kOk) return;
  throw InvalidArgument(std::string("ep ") + call + " aborted on every PE: " +
                        describe_status(status, detail, op.my_pe, op.cfg));
}

// Queues a copy on the channel to `pe` (creating it), after `packed`.
cudaStream_t channel(Op& op, int pe) {
  CudaState& cs = state_of(op);
  if (!cs.channels[pe]) {
    EP_CUDA(cudaStreamCreateWithFlags(&cs.channels[pe], cudaStreamNonBlocking));
    EP_CUDA(cudaEventCreateWithFlags(&cs.done[pe], cudaEventDisableTiming));
  }
  return cs.channels[pe];
}

// Copy engine: moves the segments of the host mirror (plan written by a
// pack kernel), then adds 1 to `flag_off` of every PE, from each channel
// after its copies; `stream` waits for all channels.
template <class CopySegment>
void run_channels(PeState& s, Op& op, StreamHandle stream, size_t flag_off, CopySegment copy) {
  CudaState& cs = state_of(op);
  volatile int32_t* h = mirror(op);
  cudaStream_t main = as_stream(stream);
  EP_CUDA(cudaEventRecord(cs.packed, main));
  const int segs = h[kernels::kHostSegments];
  for (int q = 0; q < op.n_pes; ++q) EP_CUDA(cudaStreamWaitEvent(channel(op, q), cs.packed, 0));
  for (int i = 0; i < segs; ++i) {
    volatile int32_t* seg = h + kernels::kHostSegment0 + 4 * i;
    const int pe = seg[0];
    copy(channel(op, pe), pe, seg[1], seg[2], seg[3]);
  }
  for (int q = 0; q < op.n_pes; ++q) {
    cudaStream_t ch = channel(op, q);
    auto* flag = reinterpret_cast<uint64_t*>(static_cast<char*>(s.peers[q].base) + op.ws_offset +
                                             flag_off) + op.my_pe;
    kernels::signal_kernel<<<1, 1, 0, ch>>>(flag, 1);
    EP_LAUNCHED("signal_kernel");
    EP_CUDA(cudaEventRecord(cs.done[q], ch));
    EP_CUDA(cudaStreamWaitEvent(main, cs.done[q], 0));
  }
}

char* peer_ws(PeState& s, Op& op, int pe, size_t off) {
  return static_cast<char*>(s.peers[pe].base) + op.ws_offset + off;
}

}  // namespace

void create_cuda(PeState& s, Op& op) {
  auto cs = std::make_shared<CudaState>();
  cs->device = s.device;
  cs->host_words = kernels::kHostSegment0 + 4 * static_cast<size_t>(
                                                    std::max(op.n_pes, op.cfg.num_experts));
  EP_CUDA(cudaHostAlloc(reinterpret_cast<void**>(&cs->host), cs->host_words * 4,
                        cudaHostAllocMapped | cudaHostAllocPortable));
  std::fill(cs->host, cs->host + cs->host_words, 0);
  EP_CUDA(cudaHostGetDevicePointer(reinterpret_cast<void**>(&cs->host_dev), cs->host, 0));
  if (op.cfg.kernel == Kernel::CopyEngine) {
    cs->channels.assign(op.n_pes, nullptr);
    cs->done.assign(op.n_pes, nullptr);
    EP_CUDA(cudaEventCreateWithFlags(&cs->packed, cudaEventDisableTiming));
  }
  op.cuda = cs;
  EP_CUDA(cudaDeviceSynchronize());  // the zeroed sync words are in place before peers write
}

int64_t dispatch_cuda(PeState& s, Op& op, const DispatchArgs& a) {
  const Geometry& g = op.geo;
  int32_t detail = 0;
  const int32_t status = host_status_of(op, a.status, a.num_tokens, &detail);
  Params p = base_params(s, op);
  p.T = status == kOk ? a.num_tokens : 0;
  p.host_status = status;
  p.host_detail = detail;
  p.x = static_cast<const char*>(a.x);
  p.scales = static_cast<const char*>(a.scales);
  p.idx = a.topk_idx;
  p.idx64 = a.idx_int64;
  p.w = a.topk_weights;
  p.num_recv = a.num_recv;
  p.expert_counts = a.expert_counts;
  p.send_rows = a.send_rows;
  p.recv_meta = a.recv_meta;
  p.summary = a.recv_summary;
  p.saved_w = a.saved_weights;
  const bool ce = op.cfg.kernel == Kernel::CopyEngine;
  p.flag_per_epoch = ce ? 1 : dispatch_blocks(op);
  cudaStream_t stream = as_stream(a.stream);

  kernels::route_kernel<<<route_blocks(op), kernels::kRouteThreads, 0, stream>>>(p);
  EP_LAUNCHED("route_kernel");
  const int cols = op.cfg.layout == Layout::TokenMajor ? op.n_pes : op.cfg.num_experts;
  const size_t shared = 2 * static_cast<size_t>(cols) * sizeof(int32_t);
  kernels::dispatch_kernel<<<dispatch_blocks(op), kernels::kThreads, shared, stream>>>(p);
  EP_LAUNCHED("dispatch_kernel");
  if (!ce) {
    if (g.padded_output) {
      raise_own(op, status, detail, "dispatch");
      raise_recorded(s, op, a.stream);
      return -1;
    }
    EP_CUDA(cudaStreamSynchronize(stream));  // intranode without max_recv_tokens: exact rows
    raise_own(op, status, detail, "dispatch");
    raise_recorded(s, op, a.stream);
    return mirror(op)[kernels::kHostNumRecv];
  }

  // Copy engine: the host needs the plan, then the channels move the rows.
  EP_CUDA(cudaStreamSynchronize(stream));
  volatile int32_t* h = mirror(op);
  const int32_t abort = h[kernels::kHostAbort];
  const int64_t num_recv = h[kernels::kHostNumRecv];
  const bool tm = op.cfg.layout == Layout::TokenMajor;
  const int K = op.cfg.topk;
  run_channels(s, op, a.stream, g.off_data_flag,
               [&](cudaStream_t ch, int pe, int64_t from, int64_t to, int64_t rows) {
                 auto move = [&](size_t src_off, size_t dst_off, size_t row_bytes) {
                   if (!row_bytes) return;
                   EP_CUDA(cudaMemcpyAsync(peer_ws(s, op, pe, dst_off) + to * row_bytes,
                                           peer_ws(s, op, op.my_pe, src_off) + from * row_bytes,
                                           rows * row_bytes, cudaMemcpyDefault, ch));
                 };
                 move(g.off_stage_x, g.off_recv_x, g.row_bytes);
                 move(g.off_stage_scales, g.off_recv_scales, g.scale_row_bytes);
                 if (tm) move(g.off_stage_idx, g.off_recv_idx, K * 4);
                 move(g.off_stage_w, g.off_recv_w, (tm ? K : 1) * 4);
                 move(g.off_stage_meta, g.off_recv_meta, kMetaWords * 4);
               });
  kernels::finish_kernel<<<1, kernels::kThreads, 0, stream>>>(p, abort);
  EP_LAUNCHED("finish_kernel");
  raise_own(op, status, detail, "dispatch");
  raise_recorded(s, op, a.stream);
  return num_recv;
}

void combine_cuda(PeState& s, Op& op, const CombineArgs& a) {
  const Geometry& g = op.geo;
  int32_t detail = 0;
  int32_t status = a.status;
  if (status == kOk && (a.num_tokens < 0 || a.num_tokens > op.cfg.max_tokens)) status = kBadArgument;
  Params p = base_params(s, op);
  p.T = status == kOk ? a.num_tokens : 0;
  p.host_status = status;
  p.expert_out = static_cast<const char*>(a.expert_out);
  p.h_send_rows = a.send_rows;
  p.h_meta = a.recv_meta;
  p.h_summary = a.recv_summary;
  p.cw = a.weights;
  p.out = static_cast<char*>(a.out);
  const bool ce = op.cfg.kernel == Kernel::CopyEngine;
  p.flag_per_epoch = ce ? 1 : send_blocks(op);
  cudaStream_t stream = as_stream(a.stream);

  kernels::combine_send_kernel<<<send_blocks(op), kernels::kThreads, 0, stream>>>(p);
  EP_LAUNCHED("combine_send_kernel");
  if (ce) {
    EP_CUDA(cudaStreamSynchronize(stream));
    const size_t crb = g.combine_row_bytes;
    const bool tm = op.cfg.layout == Layout::TokenMajor;
    run_channels(s, op, a.stream, g.off_combine_flag,
                 [&](cudaStream_t ch, int pe, int64_t from, int64_t to, int64_t rows) {
                   const char* src = tm ? static_cast<const char*>(a.expert_out) + from * crb
                                        : peer_ws(s, op, op.my_pe, g.off_stage_combine) + from * crb;
                   EP_CUDA(cudaMemcpyAsync(peer_ws(s, op, pe, g.off_combine_buf) + to * crb, src,
                                           rows * crb, cudaMemcpyDefault, ch));
                 });
  }
  kernels::combine_reduce_kernel<<<reduce_blocks(op), kernels::kThreads, 0, stream>>>(p);
  EP_LAUNCHED("combine_reduce_kernel");
  raise_own(op, status, detail, "combine");
  raise_recorded(s, op, a.stream);
}

void check_cuda(PeState& s, Op& op, StreamHandle stream, bool sync) {
  if (sync) EP_CUDA(cudaStreamSynchronize(as_stream(stream)));
  raise_recorded(s, op, stream);
}

}  // namespace symheap::ep
