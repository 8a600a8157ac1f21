// The device-side context: everything a kernel needs to address any PE,
// passed to kernels by value. It is plain data with 64-bit fields only, so
// it compiles unchanged under nvcc, NVRTC and a host C++ compiler, and its
// bytes (symheap.device_context()) can be handed to kernels built elsewhere.
// There is no global device symbol, so any number of PEs per process is safe.
#pragma once

namespace symheap {

// PEs 0 .. kContextPeerBases - 1 have their heap base in the context itself
// as well as in the peer table.
enum { kContextPeerBases = 8 };

struct DeviceContext {
  char* const* peer_bases;  // [n_pes] heap base of each PE as seen from this
                            // device, null when a PE has no load/store path
  char* my_base;            // this PE's heap base
  int my_pe;
  int n_pes;
  unsigned long long heap_size;
  unsigned long long* device_barrier;  // [n_pes] counters of device barriers
  unsigned long long* error_record;    // [4] first device-side failure
  unsigned long long timeout_ns;       // bound of every device-side wait
  // peer_bases[0 .. min(n_pes, kContextPeerBases) - 1], the rest null. A
  // kernel reads them from its parameters (the constant cache, which an
  // acquire load does not invalidate), so a put right after a wait finds its
  // peer without a round trip to memory.
  char* first_peer_bases[kContextPeerBases];
};

// Codes in error_record[0]; [1..3] say what failed (see device.cuh).
enum DeviceErrorCode {
  kDeviceOk = 0,
  kDeviceWaitTimeout = 1,     // [1] heap offset of the word, [2] seen, [3] wanted
  kDeviceBarrierTimeout = 2,  // [1] late PE, [2] its count, [3] wanted count
  kDeviceNoPath = 3,          // [1] PE without a load/store path
};

}  // namespace symheap
