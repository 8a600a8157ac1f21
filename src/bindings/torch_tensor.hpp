// The bindings' reader of torch tensors: a tensor's address, dtype, shape,
// strides and device, read under the GIL into plain data that the rest of a
// call uses with the GIL released. Nothing here links torch: where
// libsymheap_torch.so was built and fits the running torch, the fields come
// through torch's C++ API (src/torch_native/torch_native.hpp, a few ns each);
// otherwise through the Python C API (torch dtypes are singletons, so a dtype
// is one pointer compare; on a plain torch.Tensor through torch's C getters
// and methods, found once, with no attribute lookup). Also: torch's current
// stream of a device and torch.empty, both looked up once per process.
#pragma once
#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>
#include <vector>

namespace symheap::bindings {

namespace py = pybind11;

// The dtypes the ops take; Other: any other torch dtype (its name is kept).
enum class TorchDType : int { Other = 0, F32, F16, BF16, FP8_E4M3, I32, I64 };
const char* torch_dtype_name(TorchDType t);

// One argument as read from Python. `present` is false for None; `is_tensor`
// false for anything that is not a torch.Tensor (its type name is kept).
struct TensorRef {
  bool present = false;
  bool is_tensor = false;
  uintptr_t ptr = 0;
  TorchDType dtype = TorchDType::Other;
  int device = -1;  // CUDA ordinal, -1 on the cpu, kOtherDevice elsewhere
  bool native = false;  // read through torch's C++ API (so on the cpu or CUDA)
  bool contiguous = false;
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;  // filled only when asked for
  std::string type_name;         // not a tensor: its Python type name
  std::string dtype_name;        // dtype Other: torch's name for it
  std::string device_type;       // kOtherDevice: torch's name for it ("meta")
  py::object keep;               // a contiguous copy the call made, kept alive

  int64_t numel() const;
  // "(4, 2)", "(4,)", "()": Python's repr of the shape tuple.
  std::string shape_repr() const;
  std::string dtype_str() const;
  std::string device_str() const;  // "cpu", "cuda:N" or "meta", as torch prints it
};

// TensorRef::device of a tensor on neither the cpu nor a CUDA device (meta,
// say): no data the ops can read or write, so every entry refuses it.
constexpr int kOtherDevice = -2;

// Raises InvalidArgument naming the argument (`prefix` + `name`) where `r` is
// a tensor on a device the ops cannot use (kOtherDevice). Nothing is built
// unless it raises: the calls check every tensor argument this way.
[[noreturn]] void raise_unusable_device(const TensorRef& r, const char* prefix, const char* name);
inline void require_usable_device(const TensorRef& r, const char* prefix, const char* name) {
  if (r.is_tensor && r.device == kOtherDevice) raise_unusable_device(r, prefix, name);
}

// Reads `obj` (a torch.Tensor or None). With `make_contiguous`, a
// non-contiguous tensor is replaced by its contiguous copy (kept in `keep`).
TensorRef read_tensor(py::handle obj, bool make_contiguous = true, bool want_strides = false);

// A tensor argument read in two steps, so that a call holds the GIL only for
// what needs it: `defer` (GIL held) reads None, non-tensors and anything the
// C++ reader cannot take as read_tensor does, and leaves a plain torch.Tensor
// for `finish`, which reads it through torch's C++ API without the GIL (the
// caller keeps the object alive: a call's arguments are). `finish` returns
// false where that read fails or a non-contiguous tensor needs its copy: the
// caller then reads it with read_tensor(obj, make_contiguous) under the GIL.
struct DeferredTensor {
  PyObject* obj = nullptr;  // to read in finish; null: `ref` is read
  bool make_contiguous = true;
  TensorRef ref;
};
void defer(py::handle obj, DeferredTensor& out, bool make_contiguous = true);
bool finish(DeferredTensor& t);

// Only the address, device and strides of a tensor known to be one (its
// shape and dtype checked before): the cheapest read.
TensorRef read_address(py::handle tensor);

// A torch.Tensor's dtype, shape, address, device and strides (no
// contiguity); `is_tensor` false (nothing else read) for anything else.
TensorRef read_layout(py::handle obj);

// torch's grad mode and inference mode of the calling thread, and whether a
// tensor requires grad.
bool torch_grad_enabled();
bool torch_inference_mode();
bool requires_grad(py::handle tensor);

// The address of a tensor known to be one (a tensor this call allocated).
uintptr_t tensor_data_ptr(py::handle tensor);

// Which reader is in use: "torch C++ API (<library>)" or "Python C API: <why>".
std::string torch_reader();

// The element strides of a contiguous tensor of `shape`.
std::vector<int64_t> contiguous_strides(const std::vector<int64_t>& shape);

// "(4, 2)" for a shape given as numbers.
std::string shape_repr(const std::vector<int64_t>& shape);

// torch's current CUDA stream of `device` for the calling thread (0 where
// torch has no CUDA); the lookup function is resolved once.
uintptr_t torch_current_stream(int device);

// torch.empty(shape, dtype=dtype, device=device): through torch's C++ API
// where it is loaded, else torch.empty with the callable resolved once;
// `kwargs` comes from empty_kwargs(dtype, device) and is kept by the caller.
py::object torch_empty(const std::vector<int64_t>& shape, TorchDType dtype, int device,
                       const py::dict& kwargs);
py::dict empty_kwargs(TorchDType dtype, int device);

// The eager attention entries' pools: the tensors each recycles, and the
// largest one pooled. Larger tensors are allocated per call: their kernels
// dwarf an allocation, and a pool must not pin large blocks the caching
// allocator could give to other shapes.
constexpr size_t kPoolEntries = 4;
constexpr int64_t kPoolMaxBytes = int64_t{16} << 20;

// Outputs a call hands out fresh, without an allocation per call: a tensor
// returns to the pool once nothing else refers to it (no Python reference, no
// view of its storage) and is handed out again for the same shape on the same
// stream (the rule of torch's caching allocator, which also reuses a block
// only on the stream it was allocated for). torch.empty is skipped, and with
// it a GIL release and re-acquire inside torch on every call. A tensor whose
// last holder made it require grad is dropped, not handed out; when every
// entry is kept by its callers, a new tensor takes an entry's place in turn
// (the pool only forgets the old one). GIL held; threads may share a pool
// (take() stays consistent when torch runs Python code inside it and another
// thread takes meanwhile).
//
// `internal`: the pool's tensors never reach Python code (a call's scratch),
// so no view of them exists and the pool's own reference being the only one
// is enough: the storage and autograd checks are skipped. `until_exposed`:
// the same for each tensor until expose() names it (a private tensor whose
// views the front end makes only through expose()). Integer tensors cannot
// require grad, so theirs is never checked.
class TensorPool {
 public:
  TensorPool(TorchDType dtype, int device, size_t capacity, bool internal = false,
             bool until_exposed = false)
      : dtype_(dtype), device_(device), capacity_(capacity), internal_(internal),
        until_exposed_(until_exposed) {}
  // A tensor of `shape`; `data`, if given, receives its address.
  py::object take(const std::vector<int64_t>& shape, uintptr_t stream, uintptr_t* data = nullptr);
  // A new tensor of `shape` that the pool does not keep.
  py::object make(const std::vector<int64_t>& shape, uintptr_t* data = nullptr);
  // Whether `tensor` is one of the pool's entries, handed out with `shape`:
  // then its address is known (`data`) without asking torch.
  bool holds(py::handle tensor, const std::vector<int64_t>& shape, uintptr_t* data) const;
  // From now on `tensor` (if the pool's) returns to the pool only when no
  // view of its storage is left either.
  void expose(py::handle tensor);

 private:
  // Drops the entry of `tensor`, which the caller holds (so nothing is released here).
  void forget(const py::object& tensor);

  struct Entry {
    py::object tensor;
    std::vector<int64_t> shape;
    uintptr_t stream = 0;
    int64_t idle_uses = 0;  // storage references when only the pool holds it
    uintptr_t data = 0;
    bool exposed = true;    // views of it may exist
  };
  TorchDType dtype_;
  int device_;
  size_t capacity_;
  bool internal_ = false;
  bool until_exposed_ = false;
  size_t replace_next_ = 0;
  std::vector<Entry> entries_;
  py::object kwargs_;
};

}  // namespace symheap::bindings
