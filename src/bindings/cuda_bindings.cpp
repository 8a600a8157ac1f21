// Python bindings of the device context, DLPack views of heap memory and the
// CUDA-only operations (SM and copy-engine puts, device-side error reports,
// the benchmark's SM put). Everything that needs CUDA is registered
// only in builds with CUDA; the rest works on every backend.
#include <pybind11/pybind11.h>

#include <cstring>
#include <string>

#include "bindings/registry.hpp"
#include "symheap/errors.hpp"
#include "symheap/runtime.hpp"
#ifdef SYMHEAP_WITH_CUDA
#include "backends/cuda_api.hpp"
#endif

namespace py = pybind11;
using namespace symheap;

namespace {

Runtime& rt() { return Runtime::instance(); }

template <class T>
T* as_ptr(uintptr_t addr) {
  return reinterpret_cast<T*>(addr);
}

// ---- DLPack (the stable C ABI of the "dltensor" capsule) -------------------
struct DLDevice {
  int32_t device_type;  // 1 = CPU, 2 = CUDA
  int32_t device_id;
};
struct DLDataType {
  uint8_t code;  // 1 = unsigned int
  uint8_t bits;
  uint16_t lanes;
};
struct DLTensor {
  void* data;
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t* shape;
  int64_t* strides;
  uint64_t byte_offset;
};
struct DLManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(DLManagedTensor* self);
};

struct ByteView {
  DLManagedTensor managed{};
  int64_t shape[1] = {0};
  PyObject* owner = nullptr;  // a strong reference, dropped by the deleter
};

void delete_byte_view(DLManagedTensor* self) {
  auto* view = static_cast<ByteView*>(self->manager_ctx);
  if (view->owner && Py_IsInitialized()) {
    PyGILState_STATE gil = PyGILState_Ensure();  // the consumer may free on any thread
    Py_DECREF(view->owner);
    PyGILState_Release(gil);
  }
  delete view;
}

void capsule_destructor(PyObject* capsule) {
  // Called when the capsule dies; a consumer renames it "used_dltensor"
  // and owns the tensor from then on.
  if (!PyCapsule_IsValid(capsule, "dltensor")) return;
  auto* managed = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule, "dltensor"));
  if (managed && managed->deleter) managed->deleter(managed);
}

// A 1-D uint8 DLPack capsule over [ptr, ptr + nbytes) that says it lives on
// `device`. Naming the device explicitly lets a PE's tensor alias memory of a
// same-process peer (reached through peer access) without torch copying it
// to the device the pointer belongs to.
py::object byte_capsule(uintptr_t ptr, int64_t nbytes, int device_type, int device,
                        py::object owner) {
  if (nbytes < 0) throw InvalidArgument("nbytes must be >= 0");
  auto* view = new ByteView();
  view->shape[0] = nbytes;
  view->owner = owner.release().ptr();
  DLTensor& t = view->managed.dl_tensor;
  t.data = reinterpret_cast<void*>(ptr);
  t.device = {device_type, device};
  t.ndim = 1;
  t.dtype = {1, 8, 1};
  t.shape = view->shape;
  t.strides = nullptr;
  t.byte_offset = 0;
  view->managed.manager_ctx = view;
  view->managed.deleter = delete_byte_view;
  PyObject* capsule = PyCapsule_New(&view->managed, "dltensor", capsule_destructor);
  if (!capsule) {
    delete_byte_view(&view->managed);
    throw py::error_already_set();
  }
  return py::reinterpret_steal<py::object>(capsule);
}

#ifdef SYMHEAP_WITH_CUDA
std::shared_ptr<PeState> cuda_pe(const char* what) {
  if (!cuda::backend_active())
    throw StateError(std::string(what) + " needs the cuda backend (the active one is " +
                     rt().backend_name() + ")");
  return rt().current();
}
#endif

}  // namespace

SYMHEAP_BINDINGS(device) {
  m.def(
      "device_context",
      [] {
        auto s = rt().current();
        DeviceContext ctx = device_context(*s);
        return py::bytes(reinterpret_cast<const char*>(&ctx), sizeof ctx);
      },
      "Bytes of the calling PE's symheap::DeviceContext (pass by value to kernels).");
  m.attr("device_context_size") = sizeof(DeviceContext);
  m.def("byte_capsule", &byte_capsule, py::arg("ptr"), py::arg("nbytes"),
        py::arg("device_type"), py::arg("device"), py::arg("owner"));

#ifdef SYMHEAP_WITH_CUDA
  // Raises what a kernel of the calling PE recorded, as the exception its code
  // maps to, and clears it.
  m.def("check_device_errors", [] {
    auto s = cuda_pe("check_device_errors");
    cuda::DeviceError e;
    {
      py::gil_scoped_release nogil;
      e = cuda::take_device_error(*s);
    }
    switch (e.code) {
      case kDeviceOk: return;
      case kDeviceWaitTimeout:
      case kDeviceBarrierTimeout: throw TimeoutError(e.message);
      case kDeviceNoPath: throw Unsupported(e.message);
      default: throw StateError(e.message);
    }
  });
  m.def("cuda_channel_count", [](int device) { return cuda::channel_count(device); });
  m.def("cuda_kernel_cache_entries", [](int device) { return cuda::kernel_cache_entries(device); });

  // The benchmark's SM put with a chosen grid (bench/shmem_bw.py); the test
  // and benchmark kernels live in symheap._devtest.
  m.def("bench_sm_put", [](uintptr_t dst, uintptr_t src, size_t n, int pe, int blocks,
                           uintptr_t stream) {
    auto s = cuda_pe("bench_sm_put");
    py::gil_scoped_release nogil;
    PeUse use(*s);
    char* remote = s->peer_address(pe, s->checked_offset(as_ptr<void>(dst), n, "put destination"),
                                   "put");
    cuda::put_load_store(*s, remote, as_ptr<const void>(src), n, stream, blocks);
  });
#endif
}
