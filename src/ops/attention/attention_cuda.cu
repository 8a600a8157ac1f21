// CUDA entry points of the attention op: checks, the per-device caches
// (device properties, kernel attributes) and the argument block. Nothing here
// allocates device memory or synchronises with the host.
#include <cuda_runtime.h>

#include <atomic>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>

#include "backends/cuda_util.cuh"
#include "ops/attention/attention.hpp"
#include "ops/attention/cuda_launch.cuh"
#include "ops/attention/path_choice.hpp"
#include "symheap/errors.hpp"
#include "symheap/runtime.hpp"

namespace symheap::attention {
namespace cuda {

namespace {
// Device properties, read for one device and kept in its slot's caches.
struct DeviceProps {
  int sm_count = 0;
  int smem_optin = 0;
  int cc_major = 0, cc_minor = 0;
};

std::shared_ptr<DeviceProps> device_props(int device) {
  return Runtime::instance().device_caches(device).get<DeviceProps>(
      "attention.cuda.props", [device] {
        auto props = std::make_shared<DeviceProps>();
        SYMHEAP_CUDA_CHECK(
            cudaDeviceGetAttribute(&props->sm_count, cudaDevAttrMultiProcessorCount, device));
        SYMHEAP_CUDA_CHECK(cudaDeviceGetAttribute(&props->smem_optin,
                                                  cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
        SYMHEAP_CUDA_CHECK(cudaDeviceGetAttribute(&props->cc_major, cudaDevAttrComputeCapabilityMajor, device));
        SYMHEAP_CUDA_CHECK(cudaDeviceGetAttribute(&props->cc_minor, cudaDevAttrComputeCapabilityMinor, device));
        return props;
      });
}

struct KernelReady {};
}  // namespace

// The Hopper forward kernel is built in, and its sm_90a code runs on this
// device (compute capability 9.0); checked once per device (ordinals below 64).
void require_hopper(int device) {
  const std::string why = hopper_forward_unavailable_reason();
  if (!why.empty())
    throw Unsupported(std::string("attention: ") + kOwnForwardEnv + "='" + kOwnForwardHopper + "' but " + why);
  static std::atomic<uint64_t> checked{0};
  const uint64_t bit = device >= 0 && device < 64 ? uint64_t{1} << device : 0;
  if (checked.load(std::memory_order_acquire) & bit) return;
  auto props = device_props(device);
  if (props->cc_major != 9 || props->cc_minor != 0)
    throw Unsupported("attention: the Hopper kernels (" + std::string(kOwnForwardEnv) + "='" +
                      kOwnForwardHopper + "', the forward's default where built) need a compute capability 9.0 GPU "
                      "(H100/H200); device " + std::to_string(device) + " is " +
                      std::to_string(props->cc_major) + "." + std::to_string(props->cc_minor) + "; set " +
                      kOwnForwardEnv + "=pipelined (and " + kOwnBackwardEnv + " to anything but '" +
                      kOwnBackwardHopper + "')");
  checked.fetch_or(bit, std::memory_order_acq_rel);
}

bool run_dkdv_hopper(const Launch& l, const KArgs& p, bool f16, bool fuse_dq, bool tma) {
#ifdef SYMHEAP_WITH_HOPPER_ATTN
  return f16 ? run_dkdv_hopper_f16(l, p, fuse_dq, tma) : run_dkdv_hopper_bf16(l, p, fuse_dq, tma);
#else
  (void)l;
  (void)p;
  (void)f16;
  (void)fuse_dq;
  (void)tma;
  throw Unsupported("attention: " + hopper_forward_unavailable_reason());
#endif
}

int sm_count(int device) {
  // Per call: a lock-free read for the first 64 ordinals, the slot's cache beyond.
  static std::atomic<int> counts[64] = {};
  if (device < 0 || device >= 64) return device_props(device)->sm_count;
  int n = counts[device].load(std::memory_order_relaxed);
  if (n == 0) {
    n = device_props(device)->sm_count;
    counts[device].store(n, std::memory_order_relaxed);
  }
  return n;
}

void ensure_smem(int device, const void* kernel, size_t smem, const std::string& key) {
  auto props = device_props(device);
  if (smem > static_cast<size_t>(props->smem_optin))
    throw Unsupported("attention: kernel " + key + " needs " + std::to_string(smem) +
                      " bytes of shared memory per block; device " + std::to_string(device) +
                      " allows " + std::to_string(props->smem_optin));
  Runtime::instance().device_caches(device).get<KernelReady>("attention.cuda.kernel." + key, [&] {
    SYMHEAP_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            static_cast<int>(smem)));
    return std::make_shared<KernelReady>();
  });
}

}  // namespace cuda

namespace {

// Messages are built only on failure: the checks run on every call.
void require(bool ok, const char* message) {
  if (!ok) throw InvalidArgument(std::string("attention (CUDA): ") + message);
}
template <class MakeMessage>
void require(bool ok, MakeMessage make_message) {
  if (!ok) throw InvalidArgument("attention (CUDA): " + make_message());
}

bool aligned(const Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.data) % 16 == 0 && t.batch_stride % 8 == 0 &&
         t.row_stride % 8 == 0 && t.head_stride % 8 == 0;
}

void validate_cuda(const Args& a, bool backward) {
  require(a.q.dtype == DType::F16 || a.q.dtype == DType::BF16,
          [&] { return std::string("takes float16 or bfloat16 tensors, got ") + dtype_name(a.q.dtype); });
  require(a.head_dim % 8 == 0, "head_dim must be a multiple of 8 (pad it; the Python API does)");
  const char* names[] = {"q", "k", "v", "out", "dout", "dq", "dk", "dv"};
  const Tensor* tensors[] = {&a.q, &a.k, &a.v, &a.out, &a.dout, &a.dq, &a.dk, &a.dv};
  for (int n = 0; n < (backward ? 8 : 4); ++n)
    require(aligned(*tensors[n]), [&] {
      return std::string(names[n]) +
             " needs 16-byte aligned rows (address and strides multiples of 8 elements): make it "
             "contiguous";
    });
  require(a.heads_q <= 65535 && a.batch <= 65535, "batch and head counts must be <= 65535");
}

// Guards the calling thread's current CUDA device and restores it.
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    SYMHEAP_CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != device) {
      SYMHEAP_CUDA_CHECK(cudaSetDevice(device));
      changed_ = true;
    }
  }
  ~DeviceScope() {
    if (changed_) cudaSetDevice(previous_);
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int previous_ = 0;
  bool changed_ = false;
};

void check_stream_device(void* stream, int device) {
#if CUDART_VERSION >= 12080
  if (stream) {
    int stream_device = -1;
    SYMHEAP_CUDA_CHECK(
        cudaStreamGetDevice(static_cast<cudaStream_t>(stream), &stream_device));
    require(stream_device == device, [&] {
      return "the stream belongs to device " + std::to_string(stream_device) +
             " but the tensors are on device " + std::to_string(device);
    });
  }
#else
  (void)stream;
  (void)device;
#endif
}

cuda::KArgs kernel_args(const Args& a) {
  cuda::KArgs k{};
  k.q = a.q.data;
  k.k = a.k.data;
  k.v = a.v.data;
  k.out = a.out.data;
  k.lse = a.lse;
  k.dout = a.dout.data;
  k.dq = a.dq.data;
  k.dk = a.dk.data;
  k.dv = a.dv.data;
  auto strides = [](const Tensor& t, int64_t& sb, int64_t& sr, int64_t& sh) {
    sb = t.batch_stride;
    sr = t.row_stride;
    sh = t.head_stride;
  };
  strides(a.q, k.q_sb, k.q_sr, k.q_sh);
  strides(a.k, k.k_sb, k.k_sr, k.k_sh);
  strides(a.v, k.v_sb, k.v_sr, k.v_sh);
  strides(a.out, k.o_sb, k.o_sr, k.o_sh);
  strides(a.dout, k.do_sb, k.do_sr, k.do_sh);
  strides(a.dq, k.dq_sb, k.dq_sr, k.dq_sh);
  strides(a.dk, k.dk_sb, k.dk_sr, k.dk_sh);
  strides(a.dv, k.dv_sb, k.dv_sr, k.dv_sh);
  k.lse_sb = a.lse_batch_stride;
  k.lse_sh = a.lse_head_stride;
  k.batch = a.batch;
  k.heads_q = a.heads_q;
  k.heads_kv = a.heads_kv;
  k.group = a.group();
  k.d = a.head_dim;
  k.seqlen_q = a.seqlen_q;
  k.seqlen_k = a.seqlen_k;
  k.total_q = a.total_q;
  k.total_k = a.total_k;
  k.cu_q = a.cu_seqlens_q;
  k.cu_k = a.cu_seqlens_k;
  k.scale = a.scale;
  k.softcap = a.softcap;
  k.win_left = a.window_left;
  k.win_right = a.window_right;
  k.bias = a.bias.data;
  k.bias_dtype = static_cast<int>(a.bias.dtype);
  k.bias_sb = a.bias.sb;
  k.bias_sh = a.bias.sh;
  k.bias_sq = a.bias.sq;
  k.bias_sk = a.bias.sk;
  k.bias_kv = a.bias.kv_heads;
  k.mask = static_cast<const uint8_t*>(a.mask.data);
  k.mask_sb = a.mask.sb;
  k.mask_sh = a.mask.sh;
  k.mask_sq = a.mask.sq;
  k.mask_sk = a.mask.sk;
  k.mask_kv = a.mask.kv_heads;
  k.alibi = a.alibi_slopes;
  k.alibi_sb = a.alibi_batch_stride;
  k.dropout = a.dropout_p > 0;
  k.drop_threshold = dropout_threshold(a.dropout_p);
  k.keep_scale = 1.0f / (1.0f - a.dropout_p);
  k.seed = a.seed;
  k.offset = a.offset;
  k.dbias = static_cast<float*>(a.dbias.data);
  k.dbias_sb = a.dbias.sb;
  k.dbias_sh = a.dbias.sh;
  k.dbias_sq = a.dbias.sq;
  k.dbias_sk = a.dbias.sk;
  return k;
}

int64_t query_rows(const Args& a) {
  return a.varlen() ? a.total_q : static_cast<int64_t>(a.batch) * a.seqlen_q;
}
}  // namespace

void forward_cuda(const Args& a, int device, void* stream) {
  validate(a, false);
  validate_cuda(a, false);
  if (a.seqlen_q == 0 || query_rows(a) == 0) return;
  DeviceScope scope(device);
  check_stream_device(stream, device);
  const cuda::Launch l{device, static_cast<cudaStream_t>(stream),
                       a.q.dtype == DType::F16 ? "f16" : "bf16"};
  const cuda::KArgs k = kernel_args(a);
  const char* kernel = own_forward_kernel(a.head_dim);
  const bool tma = std::strcmp(kernel, kOwnForwardHopper) == 0;
  const bool pingpong = std::strcmp(kernel, kOwnForwardHopperPingpong) == 0;
  if (pingpong || tma || std::strcmp(kernel, kOwnForwardHopperLockstep) == 0) {
    cuda::require_hopper(device);
#ifdef SYMHEAP_WITH_HOPPER_ATTN
    const cuda::HopperForward mode = tma        ? cuda::HopperForward::kTma
                                     : pingpong ? cuda::HopperForward::kPingpong
                                                : cuda::HopperForward::kLockstep;
    if (a.q.dtype == DType::F16) cuda::run_forward_hopper_f16(l, k, mode);
    else cuda::run_forward_hopper_bf16(l, k, mode);
#endif
    return;
  }
  const bool previous = std::strcmp(kernel, kOwnForwardPrevious) == 0;
  const bool pipelined = previous || std::strcmp(kernel, kOwnForwardPipelined) == 0;
  if (a.q.dtype == DType::F16) cuda::run_forward_f16(l, k, pipelined, previous);
  else cuda::run_forward_bf16(l, k, pipelined, previous);
}

namespace {
// delta (rowsum(dout * out)), one float per query row and head, sized from
// the shapes alone (the packed row count for varlen; cu_seqlens is not read).
size_t delta_bytes(const Args& a) {
  const size_t bytes = static_cast<size_t>(query_rows(a)) * a.heads_q * sizeof(float);
  return (bytes + 255) / 256 * 256;
}

// The fp32 dQ accumulator of the fused backward: a float per dq element.
size_t dq_accum_bytes(const Args& a) {
  return static_cast<size_t>(query_rows(a)) * a.heads_q * a.head_dim * sizeof(float);
}

// Whether the Hopper dK/dV kernel of head dim 256 (cuda_backward_hopper_d256.cuh)
// can take the call: the batch layout, every tensor it loads by TMA
// addressable (the rule its maps' encoding applies).
bool hopper256_backward_serves(const Args& a, const cuda::KArgs& k) {
  if (a.head_dim != 256 || k.d != 256 || k.cu_q) return false;
  return cuda::tma_addressable(k.q, 2, k.q_sr, k.q_sh, k.q_sb) &&
         cuda::tma_addressable(k.k, 2, k.k_sr, k.k_sh, k.k_sb) &&
         cuda::tma_addressable(k.v, 2, k.v_sr, k.v_sh, k.v_sb) &&
         cuda::tma_addressable(k.dout, 2, k.do_sr, k.do_sh, k.do_sb);
}

// Whether the Hopper dK/dV kernel (its TMA-fed form, dQ fused) takes a call
// with logit features: the kernel "hopper" at head dims 64 and 128 (where its
// maps do not encode, the pipelined kernels run after all: backward_dq_fused)
// and at 256 where hopper256_backward_serves.
bool hopper_features_backward_serves(const Args& a, const cuda::KArgs& k, const char* kernel) {
  if (std::strcmp(kernel, kOwnBackwardHopper) != 0) return false;
  return shared_dkdv_serves(a.head_dim) || hopper256_backward_serves(a, k);
}

// Whether the backward computes dQ inside the dK/dV kernel (a head dim of
// shared_dkdv_serves, no logit features, SYMHEAP_ATTN_OWN_BACKWARD unset/auto with
// kDqFusedByDefault, or = pipelined_dq_fused; at head dim 256 = hopper, where
// hopper256_backward_serves; with logit features where
// hopper_features_backward_serves); never when the call asks for a
// deterministic backward (its atomics and bulk reductions add in no fixed
// order).
bool backward_fuses_dq(const Args& a, const cuda::KArgs& k, const char* kernel) {
  if (a.deterministic) return false;
  if (cuda::logit_features(k)) return hopper_features_backward_serves(a, k, kernel);
  if (!shared_dkdv_serves(a.head_dim))
    return std::strcmp(kernel, kOwnBackwardHopper) == 0 && hopper256_backward_serves(a, k);
  if (std::strcmp(kernel, kOwnBackwardDqFused) == 0 || std::strcmp(kernel, kOwnBackwardHopper) == 0 ||
      std::strcmp(kernel, kOwnBackwardHopperCpAsync) == 0)
    return true;
  return kDqFusedByDefault && std::strcmp(kernel, kOwnBackwardPipelined) == 0;
}
}  // namespace

// delta, then (when dQ is fused into the dK/dV kernel) its fp32 accumulator.
size_t backward_cuda_workspace_bytes(const Args& a) {
  const bool fused = backward_fuses_dq(a, kernel_args(a), own_backward_kernel(a.head_dim));
  return delta_bytes(a) + (fused ? dq_accum_bytes(a) : 0);
}

void backward_cuda(const Args& a, int device, void* stream, void* workspace, size_t bytes) {
  validate(a, true);
  validate_cuda(a, true);
  // delta at least; with room for the fp32 dQ accumulator too (what
  // backward_cuda_workspace_bytes asks for) dQ may be fused, else the dQ
  // kernel runs.
  const size_t need = delta_bytes(a);
  require(bytes >= need && (need == 0 || workspace != nullptr), [&] {
    return "the backward workspace has " + std::to_string(bytes) + " bytes; it needs at least " +
           std::to_string(need) + " (backward_cuda_workspace_bytes)";
  });
  require(reinterpret_cast<uintptr_t>(workspace) % 16 == 0, "the workspace must be 16-byte aligned");
  if (a.seqlen_q == 0 && a.seqlen_k == 0) return;
  DeviceScope scope(device);
  check_stream_device(stream, device);
  const cuda::Launch l{device, static_cast<cudaStream_t>(stream),
                       a.q.dtype == DType::F16 ? "f16" : "bf16"};
  cuda::KArgs k = kernel_args(a);
  k.delta = static_cast<float*>(workspace);
  if (a.varlen()) {
    k.delta_sb = 0;
    k.delta_sh = a.total_q;
  } else {
    k.delta_sb = static_cast<int64_t>(a.heads_q) * a.seqlen_q;
    k.delta_sh = a.seqlen_q;
  }
  cuda::BackwardVariant variant;
  const char* chosen = own_backward_kernel(a.head_dim);  // reads the variable once a call
  variant.dq_fused = backward_fuses_dq(a, k, chosen) && bytes >= need + dq_accum_bytes(a);
  const char* kernel = backward_kernel_for_call(chosen, a.head_dim, variant.dq_fused);
  if (variant.dq_fused) {
    k.dq_accum = reinterpret_cast<float*>(static_cast<char*>(workspace) + need);
    k.dqa_sh = a.head_dim;
    k.dqa_sr = static_cast<int64_t>(a.heads_q) * a.head_dim;
    k.dqa_sb = a.varlen() ? 0 : k.dqa_sr * a.seqlen_q;
  }
  variant.dq16 = std::strcmp(kernel, kOwnBackwardDq16) == 0;
  variant.dkdv32 = std::strcmp(kernel, kOwnBackwardDkdv32) == 0;
  variant.dkdv_unshared = std::strcmp(kernel, kOwnBackwardDkdvUnshared) == 0;
  variant.hopper_tma = std::strcmp(kernel, kOwnBackwardHopper) == 0;
  variant.hopper = variant.hopper_tma || std::strcmp(kernel, kOwnBackwardHopperDqSeparate) == 0 ||
                   std::strcmp(kernel, kOwnBackwardHopperCpAsync) == 0;
  variant.hopper256 = variant.hopper && hopper256_backward_serves(a, k);
  if (variant.hopper) cuda::require_hopper(device);
  const bool pipelined_backward = std::strcmp(kernel, "basic") != 0;
  if (a.q.dtype == DType::F16) cuda::run_backward_f16(l, k, pipelined_backward, variant);
  else cuda::run_backward_bf16(l, k, pipelined_backward, variant);
}

}  // namespace symheap::attention
