// Which CUDA path an attention call takes: cuDNN's fused attention or the
// op's own kernels. One rule for every front end (torch, XLA FFI).
#pragma once
#include <cstddef>
#include <optional>
#include <string>

#include "ops/attention/call_plan.hpp"

namespace symheap::attention {

enum class Path { Auto, Cudnn, Own };

// The environment variable read when a call names no path.
inline constexpr const char* kPathEnv = "SYMHEAP_ATTN_BACKEND";

// "auto", "cudnn", "own".
const char* path_name(Path p);
// The names a caller may give, comma separated and quoted: "'auto', 'cudnn', 'own'".
std::string path_names();

// "" when the cuDNN path is built and usable, else why not.
std::string cudnn_unavailable_reason();

// The path of one call. `requested`: a path name, or nullopt for
// $SYMHEAP_ATTN_BACKEND (unset or empty: "auto"). cpu calls always take the
// cpu kernels (Own): the variable is ignored for them, and an explicit
// "cudnn" is InvalidArgument. A forced "cudnn" without a usable cuDNN path is
// Unsupported, naming why; an unknown name is InvalidArgument.
Path choose_path(const std::optional<std::string>& requested, bool on_cuda);

// Which own CUDA forward kernel runs a call. "pipelined" (cuda_forward_pipelined.cuh:
// 128-row tiles, cp.async double buffering, ldmatrix, swizzled shared memory)
// serves the head dims below, "basic" (cuda_forward.cuh) every other one.
// $SYMHEAP_ATTN_OWN_FORWARD = "basic" forces the basic kernel everywhere (to
// compare the two), = "pipelined_previous" the pipelined kernel with its
// softmax before the lean one (kLean in cuda_forward_pipelined.cuh, the
// default without logit features for a positive scale); unset, empty or
// "auto" is the default rule: at those head dims the Hopper kernel
// (cuda_forward_hopper.cuh: both products on wgmma) where it is built
// (hopper_forward_unavailable_reason), else the pipelined one. = "hopper" or
// "pipelined" forces either there; the Hopper kernel needs compute
// capability 9.0 and a build with CUTLASS's headers, else the call raises
// Unsupported naming why.
inline constexpr const char* kOwnForwardEnv = "SYMHEAP_ATTN_OWN_FORWARD";
inline constexpr const char* kOwnForwardPrevious = "pipelined_previous";
// "hopper" at head dim 128 without logit features runs the variant whose two
// warpgroups take turns on the tensor cores, fed by a third warpgroup's TMA
// copies (cuda_forward_hopper.cuh, kPingpong and kTma; 1.14-1.27x faster than
// the turns alone on H100, the same bits) where TMA can address the tensors,
// else by its own cp.async copies; calls without a mask take its persistent
// form (SYMHEAP_ATTN_FWD_PERSISTENT, cuda_forward_hopper_launch.cuh).
// "hopper_pingpong" forces the cp.async feed, "hopper_lockstep" the variant
// with one block barrier a tile (elsewhere the three are the same kernel).
inline constexpr const char* kOwnForwardHopper = "hopper";
inline constexpr const char* kOwnForwardHopperPingpong = "hopper_pingpong";
inline constexpr const char* kOwnForwardHopperLockstep = "hopper_lockstep";
inline constexpr const char* kOwnForwardPipelined = "pipelined";

// "" when the Hopper forward kernel is built in, else why not.
std::string hopper_forward_unavailable_reason();

// Head dims (as the CUDA path runs them, padded to a multiple of 8) the
// pipelined forward kernel is compiled for.
inline bool pipelined_forward_serves(int head_dim) {
  return head_dim == 64 || head_dim == 128 || head_dim == 256;
}

// Head dims (as above) the shared-fragment dK/dV kernel of the pipelined
// backward (cuda_backward_dkdv_shared.cuh), with or without the fused dQ, is
// compiled for; it runs there without logit features.
constexpr bool shared_dkdv_serves(int head_dim) { return head_dim == 64 || head_dim == 128; }

// "pipelined", "pipelined_previous", "hopper", "hopper_pingpong", "hopper_lockstep"
// or "basic" for a call of this head dim, reading $SYMHEAP_ATTN_OWN_FORWARD; another
// value of it is InvalidArgument.
const char* own_forward_kernel(int head_dim);

// The own CUDA backward's kernels, "pipelined" (cuda_backward_dq_pipelined.cuh
// and cuda_backward_dkdv_pipelined.cuh, at the head dims of
// shared_dkdv_serves without logit features cuda_backward_dkdv_shared.cuh;
// the head dims of the pipelined forward) or "basic" (cuda_backward.cuh);
// $SYMHEAP_ATTN_OWN_BACKWARD = "basic" forces the basic ones, =
// "pipelined_dq16" the pipelined ones with the dQ kernel of 16-row warps at
// every head dim, = "pipelined_dkdv32" with the dK/dV kernel of 32-row query
// tiles at head dim 128, = "pipelined_dkdv_unshared" with the dK/dV kernel
// whose warps each read every Q/dO fragment (64-row tiles) where the
// shared-fragment one is the default (to compare them with the default
// layouts; "basic" where the pipelined kernels do not serve),
// = "pipelined_dq_fused" with dQ computed inside the shared-fragment dK/dV
// kernel (fp32 atomics, no separate dQ kernel) at the head dims of
// shared_dkdv_serves without logit features, = "pipelined_dq_separate" with
// the separate dQ kernel there.
// "auto", empty or unset: the default rule; another value is
// InvalidArgument. delta (rowsum(dout * out)) has one kernel.
inline constexpr const char* kOwnBackwardEnv = "SYMHEAP_ATTN_OWN_BACKWARD";
inline constexpr const char* kOwnBackwardPipelined = "pipelined";
inline constexpr const char* kOwnBackwardDq16 = "pipelined_dq16";
inline constexpr const char* kOwnBackwardDkdv32 = "pipelined_dkdv32";
inline constexpr const char* kOwnBackwardDkdvUnshared = "pipelined_dkdv_unshared";
inline constexpr const char* kOwnBackwardDqFused = "pipelined_dq_fused";
inline constexpr const char* kOwnBackwardDqSeparate = "pipelined_dq_separate";
// = "hopper": the Hopper dK/dV kernel (cuda_backward_hopper.cuh: every
// product on wgmma) at head dims 64 and 128, with dQ fused into it where the
// default fuses it (not for deterministic calls; with logit features only
// fused, in its TMA-fed form);
// = "hopper_dq_separate": the same kernel with dQ always from the pipelined
// dQ kernel. With dQ fused (packed calls too), a producer warpgroup feeds it
// by TMA; = "hopper_cp_async" forces the kernel fed by its own cp.async
// copies there (the same dK and dV bits). At head dim 256 both run the
// kernel of cuda_backward_hopper_d256.cuh on batch calls TMA can address
// (there is no cp.async-fed form: "hopper_cp_async" runs it without dQ).
// Elsewhere they run the pipelined kernels. They need the Hopper build and
// device, as the Hopper forward.
inline constexpr const char* kOwnBackwardHopper = "hopper";
inline constexpr const char* kOwnBackwardHopperDqSeparate = "hopper_dq_separate";
inline constexpr const char* kOwnBackwardHopperCpAsync = "hopper_cp_async";
// Whether the default ("pipelined") backward fuses dQ into the dK/dV kernel
// at the head dims of shared_dkdv_serves without logit features. Never for
// deterministic calls: the fp32 atomics of the fused dQ have no fixed order.
inline constexpr bool kDqFusedByDefault = true;
// The default backward where the Hopper kernels are built, per head dim: the
// Hopper dK/dV kernel with dQ fused ("hopper"), and what a call that cannot
// fuse dQ (deterministic, no room for the accumulator) runs instead (with
// logit features: the pipelined kernels). At 64 and 128 (cuda_backward_hopper.cuh, dQ fed back by TMA
// reductions): fwd+bwd 1.22-1.28x the cp.async-fed form at 128, which was
// 7-9% faster than the shared-fragment kernel on H100; at 64 0.96-1.11x the
// shared-fragment kernel on H200; without dQ it loses to the pipelined
// kernels, which those calls run. At 256 (cuda_backward_hopper_d256.cuh):
// 1.52-1.77x the pipelined backward on H200 with dQ by atomics, 1.22-1.34x
// that again with dQ by bulk reductions (H100); its form without dQ
// ("hopper_dq_separate", slower still) beats the pipelined kernels. Where the head-dim-256 kernel cannot take a call
// (packed, logit features, rows TMA cannot address) the pipelined ones run.
struct HopperBackwardDefault {
  int head_dim;
  const char* kernel;
  const char* without_fused_dq;
};
inline constexpr HopperBackwardDefault kHopperBackwardDefaults[] = {
    {64, kOwnBackwardHopper, kOwnBackwardPipelined},
    {128, kOwnBackwardHopper, kOwnBackwardPipelined},
    {256, kOwnBackwardHopper, kOwnBackwardHopperDqSeparate}};
// The default's entry at this head dim, nullptr where it is pipelined.
constexpr const HopperBackwardDefault* hopper_backward_default(int head_dim) {
  for (const HopperBackwardDefault& d : kHopperBackwardDefaults)
    if (d.head_dim == head_dim) return &d;
  return nullptr;
}
const char* own_backward_kernel(int head_dim);
// `kernel` (own_backward_kernel's choice at this head dim) for one call,
// given whether that call fuses dQ: the default's "hopper" becomes its
// entry's without_fused_dq where dQ is not fused; a value forced through
// $SYMHEAP_ATTN_OWN_BACKWARD stays.
const char* backward_kernel_for_call(const char* kernel, int head_dim, bool dq_fused);

// Bytes the XLA handlers add to a call's scratch result for cuDNN's workspace
// (result shapes are fixed at trace time, before any graph exists): 1 MiB
// forward; backward an fp32 dQ, two fp32 statistics per query row and 1 MiB.
// 0 where cuDNN never runs (varlen, float32, padded head dims). A graph that
// needs more than this runs on the own kernels (or raises when forced). The
// own backward's fused dQ takes its fp32 accumulator from the same bytes.
size_t cudnn_workspace_reserve(const CallPlan& p, bool backward);

}  // namespace symheap::attention
