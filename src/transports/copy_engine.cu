// Copy-engine channels: bulk puts that use DMA copy engines, not SMs (the
// NVIDIA counterpart of AMD SDMA queues). One channel per (source device,
// destination device): its own non-blocking stream on the source device, so
// transfers to different destinations proceed side by side on the copy
// engines while each destination sees its transfers in issue order.
// Channels are created lazily and kept in the source device's caches,
// shared by every thread that drives that device.
#include <cuda_runtime.h>

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "backends/cuda_api.hpp"
#include "backends/cuda_util.cuh"
#include "symheap/errors.hpp"
#include "symheap/runtime.hpp"

namespace symheap::cuda {
namespace {

struct Channel {
  int src_device = -1;
  std::string dst_key;
  cudaStream_t stream = nullptr;
  cudaEvent_t caller_done = nullptr;   // marks the point of the caller's stream
  cudaEvent_t channel_done = nullptr;  // marks the point of this channel's stream
  std::mutex mu;                       // one issuer at a time keeps the events reusable
  ~Channel() {
    if (caller_done) cudaEventDestroy(caller_done);
    if (channel_done) cudaEventDestroy(channel_done);
    if (stream) cudaStreamDestroy(stream);
  }
};

struct ChannelSet {
  std::mutex mu;
  std::vector<std::shared_ptr<Channel>> all;
};

std::shared_ptr<ChannelSet> channel_set(int device) {
  return Runtime::instance().device_caches(device).get<ChannelSet>(
      "symheap.cuda.ce_channels", [] { return std::make_shared<ChannelSet>(); });
}

std::shared_ptr<Channel> channel(int src_device, const std::string& dst_key) {
  auto set = channel_set(src_device);  // before get(): its lock is not recursive
  return Runtime::instance().device_caches(src_device).get<Channel>(
      "symheap.cuda.ce." + dst_key, [&] {
        ScopedDevice on(src_device);
        auto ch = std::make_shared<Channel>();
        ch->src_device = src_device;
        ch->dst_key = dst_key;
        SYMHEAP_CUDA_CHECK(cudaStreamCreateWithFlags(&ch->stream, cudaStreamNonBlocking));
        SYMHEAP_CUDA_CHECK(cudaEventCreateWithFlags(&ch->caller_done, cudaEventDisableTiming));
        SYMHEAP_CUDA_CHECK(cudaEventCreateWithFlags(&ch->channel_done, cudaEventDisableTiming));
        std::lock_guard<std::mutex> lock(set->mu);
        set->all.push_back(ch);
        return ch;
      });
}

// The destination device's identity: its UUID, which the heap handle of
// every cuda PE carries ("cudaipc:<handle>:<uuid>"), so that PEs of other
// processes on the same GPU share one channel.
std::string destination_key(const PeState& s, int pe) {
  const std::string& handle = s.peers[pe].info.heap_handle;
  size_t colon = handle.rfind(':');
  if (colon == std::string::npos || colon + 1 >= handle.size())
    return "pe" + std::to_string(pe) + "." + std::to_string(s.job);
  return handle.substr(colon + 1);
}

std::shared_ptr<Channel> channel_to(const PeState& s, int pe) {
  return channel(s.device, destination_key(s, pe));
}

cudaStream_t as_stream(StreamHandle h) { return reinterpret_cast<cudaStream_t>(h); }

}  // namespace

void copy_engine_begin(PeState& s, const std::vector<int>& pes, StreamHandle stream) {
  ScopedDevice on(s.device);
  for (int pe : pes) {
    auto ch = channel_to(s, pe);
    std::lock_guard<std::mutex> lock(ch->mu);
    SYMHEAP_CUDA_CHECK(cudaEventRecord(ch->caller_done, as_stream(stream)));
    SYMHEAP_CUDA_CHECK(cudaStreamWaitEvent(ch->stream, ch->caller_done, 0));
  }
}

void copy_engine_copy(PeState& s, int pe, void* remote_dst, const void* src, size_t nbytes) {
  auto ch = channel_to(s, pe);
  ScopedDevice on(s.device);
  SYMHEAP_CUDA_CHECK(cudaMemcpyAsync(remote_dst, src, nbytes, cudaMemcpyDefault, ch->stream));
}

void copy_engine_signal(PeState& s, int pe, uint64_t* remote_word, uint64_t value, SignalOp op) {
  auto ch = channel_to(s, pe);
  Runtime::instance().backend().signal(s.device, remote_word, value, op,
                                       reinterpret_cast<StreamHandle>(ch->stream));
}

void copy_engine_end(PeState& s, const std::vector<int>& pes, StreamHandle stream) {
  ScopedDevice on(s.device);
  for (int pe : pes) {
    auto ch = channel_to(s, pe);
    std::lock_guard<std::mutex> lock(ch->mu);
    SYMHEAP_CUDA_CHECK(cudaEventRecord(ch->channel_done, ch->stream));
    SYMHEAP_CUDA_CHECK(cudaStreamWaitEvent(as_stream(stream), ch->channel_done, 0));
  }
}

void put_copy_engine(PeState& s, int pe, char* remote, const void* src, size_t nbytes,
                     StreamHandle stream, uint64_t* remote_signal, uint64_t value, SignalOp op) {
  check_stream(s.device, stream);
  auto ch = channel_to(s, pe);
  ScopedDevice on(s.device);
  std::lock_guard<std::mutex> lock(ch->mu);
  // Ordered after everything already queued on the caller's stream.
  SYMHEAP_CUDA_CHECK(cudaEventRecord(ch->caller_done, as_stream(stream)));
  SYMHEAP_CUDA_CHECK(cudaStreamWaitEvent(ch->stream, ch->caller_done, 0));
  if (nbytes)
    SYMHEAP_CUDA_CHECK(cudaMemcpyAsync(remote, src, nbytes, cudaMemcpyDefault, ch->stream));
  if (remote_signal)
    Runtime::instance().backend().signal(s.device, remote_signal, value, op,
                                         reinterpret_cast<StreamHandle>(ch->stream));
}

void sync_channels(int device) {
  auto set = channel_set(device);
  std::vector<std::shared_ptr<Channel>> all;
  {
    std::lock_guard<std::mutex> lock(set->mu);
    all = set->all;
  }
  if (all.empty()) return;
  ScopedDevice on(device);
  for (auto& ch : all) SYMHEAP_CUDA_CHECK(cudaStreamSynchronize(ch->stream));
}

size_t channel_count(int device) {
  auto set = channel_set(device);
  std::lock_guard<std::mutex> lock(set->mu);
  return set->all.size();
}

}  // namespace symheap::cuda
