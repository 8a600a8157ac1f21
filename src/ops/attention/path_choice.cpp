#include "ops/attention/path_choice.hpp"

#include <cstdlib>
#include <cstring>
#include <initializer_list>

#include "symheap/errors.hpp"

#ifdef SYMHEAP_WITH_CUDNN
#include "ops/attention/cudnn_attention.hpp"
#endif

namespace symheap::attention {

const char* path_name(Path p) {
  switch (p) {
    case Path::Auto: return "auto";
    case Path::Cudnn: return "cudnn";
    case Path::Own: return "own";
  }
  return "?";
}

std::string path_names() { return "'auto', 'cudnn', 'own'"; }

std::string cudnn_unavailable_reason() {
#ifdef SYMHEAP_WITH_CUDNN
  return cudnn::unavailable_reason();
#elif defined(SYMHEAP_CUDNN_MISSING)
  return std::string("the cuDNN path was not built: ") + SYMHEAP_CUDNN_MISSING;
#else
  return "the cuDNN path was not built";
#endif
}

Path choose_path(const std::optional<std::string>& requested, bool on_cuda) {
  std::string name, source = "backend";
  if (requested) {
    name = *requested;
  } else {
    const char* env = std::getenv(kPathEnv);
    name = env && *env ? env : "auto";
    source = kPathEnv;
  }
  Path p;
  if (name == "auto") p = Path::Auto;
  else if (name == "cudnn") p = Path::Cudnn;
  else if (name == "own") p = Path::Own;
  else
    throw InvalidArgument("attention: " + source + " must be one of " + path_names() + ", got '" + name + "'");
  if (!on_cuda) {
    if (p == Path::Cudnn && requested)
      throw InvalidArgument("attention: backend='cudnn' needs CUDA tensors (q is on the cpu); use backend='auto' or 'own'");
    return Path::Own;
  }
  if (p == Path::Cudnn) {
    const std::string why = cudnn_unavailable_reason();
    if (!why.empty())
      throw Unsupported("attention: backend='cudnn' (" + source + ") but the cuDNN path is unavailable: " + why);
  }
  return p;
}

namespace {
// The value of the variable `env_name` when it forces a kernel; null when it
// is unset, empty or "auto" (the default rule).
const char* forced_kernel(const char* env_name) {
  const char* env = std::getenv(env_name);
  return env && *env && std::strcmp(env, "auto") != 0 ? env : nullptr;
}

// `by_default` where the pipelined kernels serve the head dim, unless the
// variable `env` forces "basic" (or one of `variants`: a variant of the
// pipelined kernels, returned where they serve the head dim).
const char* own_kernel(const char* env_name, int head_dim, std::initializer_list<const char*> variants,
                       const char* by_default) {
  const char* env = forced_kernel(env_name);
  const bool served = pipelined_forward_serves(head_dim);
  if (env) {
    if (std::strcmp(env, "basic") == 0) return "basic";
    for (const char* variant : variants)
      if (std::strcmp(env, variant) == 0) return served ? variant : "basic";
    std::string allowed = "'auto'";
    const char* last = "basic";
    for (const char* variant : variants) {
      allowed += std::string(", '") + last + "'";
      last = variant;
    }
    allowed += std::string(" or '") + last + "'";
    throw InvalidArgument(std::string("attention: ") + env_name + " must be " + allowed + ", got '" + env +
                          "'");
  }
  return served ? by_default : "basic";
}
}  // namespace

std::string hopper_forward_unavailable_reason() {
#ifdef SYMHEAP_WITH_HOPPER_ATTN
  return "";
#elif defined(SYMHEAP_HOPPER_MISSING)
  return std::string("the Hopper forward kernel was not built: ") + SYMHEAP_HOPPER_MISSING;
#else
  return "the Hopper forward kernel was not built";
#endif
}

const char* own_forward_kernel(int head_dim) {
  // The default where the pipelined kernel serves: the Hopper kernel, when built.
#ifdef SYMHEAP_WITH_HOPPER_ATTN
  constexpr const char* by_default = kOwnForwardHopper;
#else
  constexpr const char* by_default = kOwnForwardPipelined;
#endif
  return own_kernel(kOwnForwardEnv, head_dim,
                    {kOwnForwardPrevious, kOwnForwardHopper, kOwnForwardHopperPingpong, kOwnForwardHopperLockstep,
                     kOwnForwardPipelined},
                    by_default);
}
const char* own_backward_kernel(int head_dim) {
#ifdef SYMHEAP_WITH_HOPPER_ATTN
  const HopperBackwardDefault* hopper = hopper_backward_default(head_dim);
  const char* by_default = hopper ? hopper->kernel : kOwnBackwardPipelined;
#else
  const char* by_default = kOwnBackwardPipelined;
#endif
  return own_kernel(kOwnBackwardEnv, head_dim,
                    {kOwnBackwardDq16, kOwnBackwardDkdv32, kOwnBackwardDkdvUnshared,
                     kOwnBackwardDqFused, kOwnBackwardDqSeparate, kOwnBackwardHopper,
                     kOwnBackwardHopperDqSeparate, kOwnBackwardHopperCpAsync},
                    by_default);
}

const char* backward_kernel_for_call(const char* kernel, int head_dim, bool dq_fused) {
  if (dq_fused || std::strcmp(kernel, kOwnBackwardHopper) != 0 || forced_kernel(kOwnBackwardEnv))
    return kernel;
  const HopperBackwardDefault* hopper = hopper_backward_default(head_dim);
  return hopper ? hopper->without_fused_dq : kOwnBackwardPipelined;
}

size_t cudnn_workspace_reserve(const CallPlan& p, bool backward) {
  if (p.varlen || p.dtype == DType::F32 || p.head_dim_run != p.head_dim) return 0;
  constexpr size_t kSlack = size_t{1} << 20;
  if (!backward) return kSlack;
  const size_t rows = static_cast<size_t>(p.batch) * p.heads_q * p.seqlen_q;
  return rows * p.head_dim * sizeof(float) + 2 * rows * sizeof(float) + kSlack;
}

}  // namespace symheap::attention
