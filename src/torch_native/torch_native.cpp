// libsymheap_torch.so: see torch_native.hpp. Built against torch's headers
// (the torch of the build machine, whose version it records) and linked to
// torch's libraries, which the process has loaded by the time it is opened.
#include "torch_native/torch_native.hpp"

#include <ATen/ops/empty.h>
#include <c10/core/GradMode.h>
#include <c10/core/InferenceMode.h>
#include <torch/csrc/Storage.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cstdio>
#include <cstring>

#ifdef SYMHEAP_TORCH_CUDA
#include <c10/cuda/CUDAStream.h>
#endif

namespace symheap::torch_native {
namespace {

// TorchDType's values (src/bindings/torch_tensor.hpp), in its order.
constexpr c10::ScalarType kTypes[] = {c10::ScalarType::Undefined, c10::ScalarType::Float,
                                      c10::ScalarType::Half,      c10::ScalarType::BFloat16,
                                      c10::ScalarType::Float8_e4m3fn, c10::ScalarType::Int,
                                      c10::ScalarType::Long};
constexpr int kTypeCount = sizeof(kTypes) / sizeof(kTypes[0]);

int dtype_code(c10::ScalarType t) {
  for (int i = 1; i < kTypeCount; ++i)
    if (kTypes[i] == t) return i;
  return 0;
}

// The tensor of a Python object of class exactly torch.Tensor (a subclass may
// override what the Python getters return), else null.
const at::Tensor* plain(PyObject* obj) {
  if (!THPVariable_CheckExact(obj)) return nullptr;
  return &THPVariable_Unpack(obj);
}

int read(PyObject* obj, Tensor* out) {
  try {
    const at::Tensor* t = plain(obj);
    if (!t || !t->defined() || t->layout() != c10::kStrided) return 0;
    const c10::Device dev = t->device();
    if (!dev.is_cpu() && !dev.is_cuda()) return 0;
    const int code = dtype_code(t->scalar_type());
    const int64_t ndim = t->dim();
    if (code == 0 || ndim > kMaxDims) return 0;
    const c10::IntArrayRef sizes = t->sizes(), strides = t->strides();
    for (int64_t i = 0; i < ndim; ++i) {
      out->shape[i] = sizes[i];
      out->strides[i] = strides[i];
    }
    out->ndim = static_cast<int32_t>(ndim);
    out->dtype = code;
    out->device = dev.is_cpu() ? -1 : dev.index();
    out->contiguous = t->is_contiguous() ? 1 : 0;
    out->ptr = reinterpret_cast<uintptr_t>(t->data_ptr());
    return 1;
  } catch (...) {  // a tensor without storage, say: the Python path says what it is
    return 0;
  }
}

PyObject* empty(const int64_t* shape, int ndim, int dtype, int device) {
  if (dtype <= 0 || dtype >= kTypeCount) return nullptr;
  try {
    const c10::Device dev = device < 0 ? c10::Device(c10::kCPU)
                                       : c10::Device(c10::kCUDA, static_cast<int8_t>(device));
    at::Tensor t = at::empty(c10::IntArrayRef(shape, static_cast<size_t>(ndim)),
                             at::TensorOptions().dtype(kTypes[dtype]).device(dev));
    return THPVariable_Wrap(std::move(t));
  } catch (...) {
    return nullptr;
  }
}

int64_t storage_uses(PyObject* tensor) {
  const at::Tensor* t = plain(tensor);
  if (!t || !t->has_storage()) return -1;
  try {
    // Counted with the storage's Python object alive, as torch's Python API
    // counts: once made, that object stays (owned by the storage) and holds
    // a reference, so the count must not depend on whether anyone made it.
    // Holders of that object (x.untyped_storage()) count once each beyond
    // this call's own reference: they share the storage without a reference
    // of their own to it.
    PyObject* s = THPStorage_Wrap(t->storage());
    if (!s) {
      PyErr_Clear();
      return -1;
    }
    const int64_t uses = static_cast<int64_t>(t->storage().use_count()) + Py_REFCNT(s) - 1;
    Py_DECREF(s);
    return uses;
  } catch (...) {
    return -1;
  }
}

int requires_grad(PyObject* tensor) {
  const at::Tensor* t = plain(tensor);
  return t ? (t->requires_grad() ? 1 : 0) : -1;
}

int grad_enabled() { return c10::GradMode::is_enabled() ? 1 : 0; }

int inference_mode() { return c10::InferenceMode::is_enabled() ? 1 : 0; }

#ifdef SYMHEAP_TORCH_CUDA
uintptr_t current_stream(int device) {
  return reinterpret_cast<uintptr_t>(
      c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream());
}
#endif

const Api kApi = {read, empty, storage_uses, requires_grad, grad_enabled, inference_mode,
#ifdef SYMHEAP_TORCH_CUDA
                  current_stream,
#else
                  nullptr,
#endif
};

}  // namespace
}  // namespace symheap::torch_native

extern "C" __attribute__((visibility("default"))) const symheap::torch_native::Api*
symheap_torch_native_open(uint32_t abi, const char* torch_version, char* why, size_t why_len) {
  using namespace symheap::torch_native;
  if (abi != kAbi) {
    std::snprintf(why, why_len, "it has interface %u, the module wants %u", kAbi, abi);
    return nullptr;
  }
  if (std::strcmp(torch_version, SYMHEAP_TORCH_VERSION) != 0) {
    std::snprintf(why, why_len, "it was built against torch %s, this process runs torch %s",
                  SYMHEAP_TORCH_VERSION, torch_version);
    return nullptr;
  }
  return &kApi;
}
