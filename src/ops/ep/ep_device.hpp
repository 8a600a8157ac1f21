// The device implementation of an op (CUDA, or its host emulation): the
// same host driver and kernels over two small runtimes.
#pragma once
#include <memory>

#include "ops/ep/ep_op.hpp"

namespace symheap::ep {

// Device operations an op's calls issued so far (both runtimes count alike,
// so the cpu suite can compare what two front ends issue for one layout).
struct DeviceOps {
  uint64_t launches = 0;      // kernels
  uint64_t memsets = 0;       // async zeroing
  uint64_t copies = 0;        // copies (copy-engine channels, host reads and writes)
  uint64_t stream_waits = 0;  // cross-stream orderings (copy-engine channels)
  uint64_t host_syncs = 0;    // the host waits for the stream
};

class DeviceImpl {
 public:
  virtual DeviceOps device_ops() const = 0;
  virtual ~DeviceImpl() = default;
  virtual int64_t dispatch(PeState& s, Op& op, const DispatchArgs& a) = 0;
  virtual void combine(PeState& s, Op& op, const CombineArgs& a) = 0;
  // Intranode and low_latency kernels only (see has_redispatch).
  virtual void redispatch(PeState& s, Op& op, const RedispatchArgs& a) = 0;
  // Raises the first failure a kernel recorded; with sync, waits for the stream first.
  virtual void check(PeState& s, Op& op, StreamHandle stream, bool sync) = 0;
};

#ifdef SYMHEAP_WITH_CUDA
std::shared_ptr<DeviceImpl> make_cuda_device(PeState& s, Op& op);
// The SM count of a CUDA device: the most blocks one grid of the kernels uses.
int cuda_sm_count(int device);
#endif
// The kernels compiled for the host and run in an emulation on the cpu
// backend (SYMHEAP_EP_EMULATE_DEVICE=1): one PE per process.
std::shared_ptr<DeviceImpl> make_emulated_device(PeState& s, Op& op);

}  // namespace symheap::ep
