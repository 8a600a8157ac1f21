// The interface of libsymheap_torch.so: torch tensors read and made through
// torch's C++ API (a few ns a field) instead of its Python getters. The
// library is built only where torch's headers are found at build time and is
// opened at run time by the Python module once torch is imported, only if
// the running torch is the one it was built against; otherwise the module
// keeps its Python C API path (src/bindings/torch_tensor.cpp). Plain C types
// only: the two sides share no C++ ABI.
#pragma once
#include <Python.h>

#include <cstdint>

namespace symheap::torch_native {

constexpr uint32_t kAbi = 1;
constexpr int kMaxDims = 8;
constexpr const char* kOpenSymbol = "symheap_torch_native_open";

// A tensor as read; `dtype` takes the values of bindings::TorchDType.
struct Tensor {
  uintptr_t ptr;
  int64_t shape[kMaxDims];
  int64_t strides[kMaxDims];
  int32_t ndim;
  int32_t dtype;
  int32_t device;  // -1 on the cpu, else the CUDA ordinal
  int32_t contiguous;
};

struct Api {
  // 1: `obj` is a tensor of class exactly torch.Tensor, on the cpu or a CUDA
  // device, of one of TorchDType's dtypes and at most kMaxDims dimensions,
  // read into `out`; 0: anything else (the caller reads it the Python way).
  int (*read)(PyObject* obj, Tensor* out);
  // A new tensor (torch.empty), or null with no Python error set.
  PyObject* (*empty)(const int64_t* shape, int ndim, int dtype, int device);
  // References to `tensor`'s storage (its own, its views', Python storage
  // objects), counted as torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)
  // counts, plus one for each holder of the storage's Python object; -1 where
  // `tensor` is not a plain torch.Tensor.
  int64_t (*storage_uses)(PyObject* tensor);
  // 1 / 0; -1 where `tensor` is not a plain torch.Tensor.
  int (*requires_grad)(PyObject* tensor);
  // torch's grad mode and inference mode of the calling thread.
  int (*grad_enabled)();
  int (*inference_mode)();
  // torch's current CUDA stream of `device` for the calling thread; null
  // where the library was built without torch's CUDA headers.
  uintptr_t (*current_stream)(int device);
};

// The library's one export: the Api if `abi` is kAbi and `torch_version`
// (torch.__version__ of the running process) is the one it was built
// against, else null with the reason in `why` (`why_len` bytes at most).
using OpenFn = const Api* (*)(uint32_t abi, const char* torch_version, char* why, size_t why_len);

}  // namespace symheap::torch_native
