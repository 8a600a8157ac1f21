// One attention call as the XLA FFI handlers prepare it: the op core's Args
// plus what the handler does around the core (padded copies, clearing, the
// dbias reduction). Plain data, so the CUDA side needs no XLA header.
#pragma once
#include <cstddef>

#include "ops/attention/attention.hpp"
#include "ops/attention/call_plan.hpp"

namespace symheap::attention::xla {

struct Call {
  CallPlan plan;
  ScratchLayout layout;
  Args args;                 // what the core reads and writes (padded copies when `padded`)
  bool padded = false;       // CUDA: head dim padded to a multiple of 8 in scratch copies
  char* scratch = nullptr;
  size_t scratch_bytes = 0;  // the whole scratch result; past layout.total: cuDNN's workspace
  // The caller's buffers at the caller's head dim.
  Tensor user_q, user_k, user_v, user_out, user_dout, user_dq, user_dk, user_dv;
  void* dbias_out = nullptr;  // the bias's shape and dtype; args.dbias is the fp32 accumulator
  void* delta = nullptr;      // CUDA backward workspace
  size_t delta_bytes = 0;
};

#ifdef SYMHEAP_WITH_CUDA
// Enqueue everything on `stream` (no host synchronisation, no allocation).
void run_forward_cuda(const Call& c, int device, void* stream);
void run_backward_cuda(const Call& c, int device, void* stream);
#endif

}  // namespace symheap::attention::xla
