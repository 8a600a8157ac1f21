// The cuDNN fast path of the attention op: fused SDPA forward and backward
// through the cudnn-frontend graph API, for the calls whose semantics cuDNN
// reproduces exactly (see unsupported_reason). Everything else runs on the
// op's own kernels.
//
// Built only when the cuDNN and cudnn-frontend headers were found at configure
// time (SYMHEAP_WITH_CUDNN). libcudnn is not linked: it is opened at run time
// (the copy torch already loaded, else the soname search path, else
// SYMHEAP_CUDNN_LIBRARY), so the module imports on machines without it and
// `available()` says why the path is off.
#pragma once
#include <cstddef>
#include <string>

#include "ops/attention/attention.hpp"

namespace symheap::attention::cudnn {

// "" when cuDNN is loaded and usable (version 9 or later), else the reason.
std::string unavailable_reason();
// "cuDNN 9.19.0 (frontend 1.19.0)" once loaded; the frontend version alone before.
std::string version_string();

// Why this call cannot run through cuDNN with the op's semantics ("" = it can),
// from the arguments alone (dtype, head dim, options, alignment).
std::string unsupported_reason(const Args& a, bool backward);

struct Prepared {
  bool ok = false;
  size_t workspace_bytes = 0;
  std::string reason;  // why not, when !ok
};

// Looks up, or builds and caches in the device's slot, the graph of this call
// (keyed by direction, dtype, shapes, strides and options). A graph cuDNN
// rejects is cached too, so a rejected shape costs one build per device.
Prepared prepare(const Args& a, bool backward, int device);

// Run the graph prepare() built, on `stream` (which must belong to `device`),
// with `workspace` of at least prepared.workspace_bytes from the caller's
// allocator. Writes out and lse (forward: lse is the natural-log
// log-sum-exp of the scaled logits, as on the own kernels), or dq, dk, dv.
// Throws Unsupported when the call has no usable graph.
void forward(const Args& a, int device, void* stream, void* workspace, size_t bytes);
void backward(const Args& a, int device, void* stream, void* workspace, size_t bytes);

// One lookup instead of prepare() then forward()/backward(), for callers that
// hold their workspace before knowing the graph's size: runs the call when
// cuDNN takes it and `bytes` cover the graph's workspace and returns ""; else
// runs nothing and returns why not.
std::string try_run(const Args& a, bool backward, int device, void* stream, void* workspace, size_t bytes);

}  // namespace symheap::attention::cudnn
