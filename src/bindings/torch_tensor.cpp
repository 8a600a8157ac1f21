#include "bindings/torch_tensor.hpp"


#include <cstdlib>
#include <cstring>

#include "symheap/errors.hpp"
#include "torch_native/torch_native.hpp"
#include "transports/remote_engine_loader.hpp"

namespace symheap::bindings {

namespace {

PyObject* owned(py::object o) { return o.release().ptr(); }

constexpr int kDTypes = 7;
const char* const kDTypeNames[kDTypes] = {"?",       "float32", "float16", "bfloat16",
                                          "float8_e4m3fn", "int32", "int64"};

// What a call needs from torch, resolved once under the GIL and never freed
// (it must outlive every module-level object at interpreter exit).
struct Torch {
  PyObject* tensor_type = nullptr;
  PyObject* dtypes[kDTypes] = {};
  PyObject* empty = nullptr;
  PyObject* device_type = nullptr;  // torch.device
  PyObject* raw_stream = nullptr;   // torch._C._cuda_getCurrentRawStream, if built with CUDA
  PyObject* current_stream = nullptr;  // torch.cuda.current_stream otherwise
  PyObject* s_dtype = nullptr;
  PyObject* s_shape = nullptr;
  PyObject* s_data_ptr = nullptr;
  PyObject* s_get_device = nullptr;
  PyObject* s_is_contiguous = nullptr;
  PyObject* s_contiguous = nullptr;
  PyObject* s_stride = nullptr;
  PyObject* s_untyped_storage = nullptr;
  PyObject* s_cdata = nullptr;
  PyObject* s_requires_grad = nullptr;
  PyObject* s_device = nullptr;
  PyObject* s_type = nullptr;
  PyObject* storage_use_count = nullptr;  // torch._C._storage_Use_Count, if present
  PyObject* is_grad_enabled = nullptr;
  PyObject* is_inference_mode_enabled = nullptr;
  // torch.Tensor's own C accessors, called without an attribute lookup on
  // tensors whose class is exactly torch.Tensor (a subclass may override them).
  PyGetSetDef* get_dtype = nullptr;
  PyGetSetDef* get_shape = nullptr;
  PyObject* m_data_ptr = nullptr;
  PyObject* m_get_device = nullptr;
  PyObject* m_is_contiguous = nullptr;
  // torch's C++ API (libsymheap_torch.so) where it loaded, else null; `how`
  // says which reader is in use and why.
  const torch_native::Api* native = nullptr;
  std::string how;
};

// Opens libsymheap_torch.so (torch is imported, so the torch libraries it
// links are loaded) unless SYMHEAP_TORCH_NATIVE=0; null, with the reason in
// `how`, where it is absent or built against another torch.
const torch_native::Api* open_native(const std::string& torch_version, std::string* how) {
  const char* env = std::getenv("SYMHEAP_TORCH_NATIVE");
  if (env && std::strcmp(env, "0") == 0) {
    *how = "Python C API: SYMHEAP_TORCH_NATIVE=0";
    return nullptr;
  }
#ifdef SYMHEAP_TORCH_NATIVE_FILE
  std::string path, failed;
  auto open = reinterpret_cast<torch_native::OpenFn>(remote::symbol_beside_core(
      SYMHEAP_TORCH_NATIVE_FILE, torch_native::kOpenSymbol, "the torch reader", &failed, &path));
  if (!open) {
    *how = "Python C API: " + failed;
    return nullptr;
  }
  char why[256] = {};
  const torch_native::Api* api = open(torch_native::kAbi, torch_version.c_str(), why, sizeof why);
  *how = api ? "torch C++ API (" + path + ")"
             : "Python C API: " + path + " does not fit: " + why + "; rebuild symheap";
  return api;
#else
  (void)torch_version;
  *how = "Python C API: symheap was built without the torch C++ reader (torch was not "
         "importable when it was built)";
  return nullptr;
#endif
}

const Torch& torch_api() {
  static Torch* t = nullptr;
  if (t) return *t;
  py::module_ torch = py::module_::import("torch");
  auto* made = new Torch;
  made->tensor_type = owned(torch.attr("Tensor"));
  for (int i = 1; i < kDTypes; ++i)
    made->dtypes[i] = owned(torch.attr(kDTypeNames[i]));
  made->empty = owned(torch.attr("empty"));
  made->device_type = owned(torch.attr("device"));
  py::object C = torch.attr("_C");
  if (py::hasattr(C, "_cuda_getCurrentRawStream"))
    made->raw_stream = owned(C.attr("_cuda_getCurrentRawStream"));
  else
    made->current_stream = owned(torch.attr("cuda").attr("current_stream"));
  made->s_dtype = PyUnicode_InternFromString("dtype");
  made->s_shape = PyUnicode_InternFromString("shape");
  made->s_data_ptr = PyUnicode_InternFromString("data_ptr");
  made->s_get_device = PyUnicode_InternFromString("get_device");
  made->s_is_contiguous = PyUnicode_InternFromString("is_contiguous");
  made->s_contiguous = PyUnicode_InternFromString("contiguous");
  made->s_stride = PyUnicode_InternFromString("stride");
  made->s_untyped_storage = PyUnicode_InternFromString("untyped_storage");
  made->s_cdata = PyUnicode_InternFromString("_cdata");
  made->s_requires_grad = PyUnicode_InternFromString("requires_grad");
  made->s_device = PyUnicode_InternFromString("device");
  made->s_type = PyUnicode_InternFromString("type");
  made->is_grad_enabled = owned(torch.attr("is_grad_enabled"));
  made->is_inference_mode_enabled = owned(torch.attr("is_inference_mode_enabled"));
  if (py::hasattr(C, "_storage_Use_Count")) made->storage_use_count = owned(C.attr("_storage_Use_Count"));
  py::object tensor = torch.attr("Tensor");
  auto getset = [&](const char* name) -> PyGetSetDef* {
    py::object d = tensor.attr(name);
    if (!Py_IS_TYPE(d.ptr(), &PyGetSetDescr_Type)) return nullptr;
    return reinterpret_cast<PyGetSetDescrObject*>(d.ptr())->d_getset;
  };
  auto method = [&](const char* name) -> PyObject* {
    py::object d = tensor.attr(name);
    return Py_IS_TYPE(d.ptr(), &PyMethodDescr_Type) ? owned(d) : nullptr;
  };
  made->get_dtype = getset("dtype");
  made->get_shape = getset("shape");
  made->m_data_ptr = method("data_ptr");
  made->m_get_device = method("get_device");
  made->m_is_contiguous = method("is_contiguous");
  made->native = open_native(py::str(torch.attr("__version__")), &made->how);
  t = made;
  return *t;
}

py::object call_method(py::handle obj, PyObject* name) {
  PyObject* r = PyObject_CallMethodNoArgs(obj.ptr(), name);
  if (!r) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(r);
}

py::object get_attr(py::handle obj, PyObject* name) {
  PyObject* r = PyObject_GetAttr(obj.ptr(), name);
  if (!r) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(r);
}

// Whether `obj`'s class is exactly torch.Tensor: then the accessors below may
// call torch's C functions directly.
bool plain_tensor(const Torch& T, py::handle obj) {
  return Py_TYPE(obj.ptr()) == reinterpret_cast<PyTypeObject*>(T.tensor_type);
}

// obj.<name> through torch's getter `g` when given (a plain tensor), else by lookup.
py::object get_field(const Torch& T, py::handle obj, PyGetSetDef* g, PyObject* name) {
  if (!g || !plain_tensor(T, obj)) return get_attr(obj, name);
  PyObject* r = g->get(obj.ptr(), g->closure);
  if (!r) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(r);
}

// obj.<name>() through torch's method descriptor `m` when given, else by lookup.
py::object call_accessor(const Torch& T, py::handle obj, PyObject* m, PyObject* name) {
  if (!m || !plain_tensor(T, obj)) return call_method(obj, name);
  PyObject* self = obj.ptr();
  PyObject* r = PyObject_Vectorcall(m, &self, 1, nullptr);
  if (!r) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(r);
}

std::vector<int64_t> int_tuple(const py::object& t) {
  PyObject* p = t.ptr();
  if (!PyTuple_Check(p)) throw InvalidArgument("expected a tuple of ints");
  Py_ssize_t n = PyTuple_GET_SIZE(p);
  std::vector<int64_t> out(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) out[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(p, i));
  return out;
}

// `n` into `r` (its strides too with `strides`).
void from_native(const torch_native::Tensor& n, TensorRef& r, bool strides) {
  r.native = true;
  r.ptr = n.ptr;
  r.dtype = static_cast<TorchDType>(n.dtype);
  r.device = n.device;
  r.contiguous = n.contiguous != 0;
  r.shape.assign(n.shape, n.shape + n.ndim);
  if (strides) r.strides.assign(n.strides, n.strides + n.ndim);
}

// Reads `obj` through torch's C++ API where it is loaded and takes it.
bool read_native(const Torch& T, py::handle obj, TensorRef& r, bool strides) {
  torch_native::Tensor n;
  if (!T.native || !T.native->read(obj.ptr(), &n)) return false;
  from_native(n, r, strides);
  return true;
}

// The device of a tensor read the Python way: get_device() is the CUDA
// ordinal, or -1 on the cpu and on every other device (meta): those are told
// apart by the device's type.
void read_device(const Torch& T, py::handle obj, TensorRef& r, long ordinal) {
  r.device = static_cast<int>(ordinal);
  if (r.device >= 0) return;
  py::object type = get_attr(get_attr(obj, T.s_device), T.s_type);
  std::string name = py::str(type);
  if (name == "cpu") return;
  r.device = kOtherDevice;
  r.device_type = std::move(name);
}

void read_fields(const Torch& T, py::handle obj, TensorRef& r) {
  const py::object dtype = get_field(T, obj, T.get_dtype, T.s_dtype);
  PyObject* dt = dtype.ptr();
  r.dtype = TorchDType::Other;
  for (int i = 1; i < kDTypes; ++i)
    if (dt == T.dtypes[i]) r.dtype = static_cast<TorchDType>(i);
  if (r.dtype == TorchDType::Other) {
    std::string name = py::str(dt);
    r.dtype_name = name.rfind("torch.", 0) == 0 ? name.substr(6) : name;
  }
  r.shape = int_tuple(get_field(T, obj, T.get_shape, T.s_shape));
  r.ptr = PyLong_AsUnsignedLongLong(call_accessor(T, obj, T.m_data_ptr, T.s_data_ptr).ptr());
  read_device(T, obj, r, PyLong_AsLong(call_accessor(T, obj, T.m_get_device, T.s_get_device).ptr()));
  r.contiguous = call_accessor(T, obj, T.m_is_contiguous, T.s_is_contiguous).ptr() == Py_True;
}

bool integer_dtype(TorchDType t) { return t == TorchDType::I32 || t == TorchDType::I64; }

// References to a tensor's storage (its own and its views'), or -1 when
// torch cannot tell.
int64_t storage_uses(const Torch& T, py::handle tensor) {
  if (T.native) return T.native->storage_uses(tensor.ptr());
  if (!T.storage_use_count) return -1;
  py::object storage = call_method(tensor, T.s_untyped_storage);
  py::object n = py::handle(T.storage_use_count)(get_attr(storage, T.s_cdata));
  // (the holders of the storage's Python object, as torch_native counts them)
  return n.cast<int64_t>() + Py_REFCNT(storage.ptr()) - 1;
}

}  // namespace

const char* torch_dtype_name(TorchDType t) { return kDTypeNames[static_cast<int>(t)]; }

int64_t TensorRef::numel() const {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

std::vector<int64_t> contiguous_strides(const std::vector<int64_t>& shape) {
  std::vector<int64_t> s(shape.size(), 1);
  for (size_t i = shape.size(); i-- > 1;) s[i - 1] = s[i] * shape[i];
  return s;
}

std::string shape_repr(const std::vector<int64_t>& shape) {
  std::string s = "(";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + (shape.size() == 1 ? ",)" : ")");
}

std::string TensorRef::shape_repr() const { return bindings::shape_repr(shape); }

std::string TensorRef::dtype_str() const {
  return dtype == TorchDType::Other ? dtype_name : torch_dtype_name(dtype);
}

std::string TensorRef::device_str() const {
  if (device == kOtherDevice) return device_type;
  return device < 0 ? "cpu" : "cuda:" + std::to_string(device);
}

void raise_unusable_device(const TensorRef& r, const char* prefix, const char* name) {
  throw InvalidArgument(std::string(prefix) + name + " is on " + r.device_type +
                        ": symheap reads and writes tensors on the cpu or a CUDA device");
}

TensorRef read_tensor(py::handle obj, bool make_contiguous, bool want_strides) {
  TensorRef r;
  if (obj.is_none()) return r;
  r.present = true;
  const Torch& T = torch_api();
  if (!PyObject_TypeCheck(obj.ptr(), reinterpret_cast<PyTypeObject*>(T.tensor_type))) {
    r.type_name = py::str(py::type::handle_of(obj).attr("__name__"));
    return r;
  }
  r.is_tensor = true;
  if (read_native(T, obj, r, want_strides) && (r.contiguous || !make_contiguous)) return r;
  read_fields(T, obj, r);
  if (!r.contiguous && make_contiguous) {
    r.keep = call_method(obj, T.s_contiguous);
    r.ptr = PyLong_AsUnsignedLongLong(call_method(r.keep, T.s_data_ptr).ptr());
    r.contiguous = true;
  }
  if (want_strides) r.strides = int_tuple(call_method(r.keep ? r.keep : obj, T.s_stride));
  return r;
}

void defer(py::handle obj, DeferredTensor& out, bool make_contiguous) {
  const Torch& T = torch_api();
  out.make_contiguous = make_contiguous;
  if (T.native && plain_tensor(T, obj)) {
    out.obj = obj.ptr();
    return;
  }
  out.obj = nullptr;
  out.ref = read_tensor(obj, make_contiguous);
}

bool finish(DeferredTensor& t) {
  if (!t.obj) return true;
  TensorRef& r = t.ref;
  torch_native::Tensor n;
  // torch_api() was resolved by defer; T.native is set once and never changes.
  if (!torch_api().native->read(t.obj, &n) || (!n.contiguous && t.make_contiguous))
    return false;
  r.present = r.is_tensor = true;
  from_native(n, r, false);
  t.obj = nullptr;
  return true;
}

TensorRef read_address(py::handle tensor) {
  const Torch& T = torch_api();
  TensorRef r;
  r.present = r.is_tensor = true;
  if (read_native(T, tensor, r, true)) return r;
  r.ptr = PyLong_AsUnsignedLongLong(call_method(tensor, T.s_data_ptr).ptr());
  read_device(T, tensor, r, PyLong_AsLong(call_method(tensor, T.s_get_device).ptr()));
  r.strides = int_tuple(call_method(tensor, T.s_stride));
  return r;
}

TensorRef read_layout(py::handle obj) {
  TensorRef r;
  if (obj.is_none()) return r;
  r.present = true;
  const Torch& T = torch_api();
  if (!PyObject_TypeCheck(obj.ptr(), reinterpret_cast<PyTypeObject*>(T.tensor_type))) return r;
  r.is_tensor = true;
  if (read_native(T, obj, r, true)) return r;
  PyObject* dt = get_attr(obj, T.s_dtype).ptr();
  for (int i = 1; i < kDTypes; ++i)
    if (dt == T.dtypes[i]) r.dtype = static_cast<TorchDType>(i);
  r.shape = int_tuple(get_attr(obj, T.s_shape));
  r.ptr = PyLong_AsUnsignedLongLong(call_method(obj, T.s_data_ptr).ptr());
  read_device(T, obj, r, PyLong_AsLong(call_method(obj, T.s_get_device).ptr()));
  r.strides = int_tuple(call_method(obj, T.s_stride));
  return r;
}

namespace {
bool call_flag(PyObject* fn) {
  PyObject* r = PyObject_CallNoArgs(fn);
  if (!r) throw py::error_already_set();
  const bool on = r == Py_True;
  Py_DECREF(r);
  return on;
}
}  // namespace

bool torch_grad_enabled() {
  const Torch& T = torch_api();
  return T.native ? T.native->grad_enabled() != 0 : call_flag(T.is_grad_enabled);
}

bool torch_inference_mode() {
  const Torch& T = torch_api();
  return T.native ? T.native->inference_mode() != 0 : call_flag(T.is_inference_mode_enabled);
}

bool requires_grad(py::handle tensor) {
  const Torch& T = torch_api();
  const int native = T.native ? T.native->requires_grad(tensor.ptr()) : -1;
  if (native >= 0) return native != 0;
  return get_attr(tensor, T.s_requires_grad).ptr() == Py_True;
}

uintptr_t tensor_data_ptr(py::handle tensor) {
  const Torch& T = torch_api();
  TensorRef r;
  if (read_native(T, tensor, r, false)) return r.ptr;
  return PyLong_AsUnsignedLongLong(call_method(tensor, T.s_data_ptr).ptr());
}

std::string torch_reader() { return torch_api().how; }

uintptr_t torch_current_stream(int device) {
  const Torch& T = torch_api();
  if (T.native && T.native->current_stream) return T.native->current_stream(device);
  if (T.raw_stream) {
    py::object s = py::reinterpret_steal<py::object>(
        PyObject_CallOneArg(T.raw_stream, py::int_(device).ptr()));
    if (!s) throw py::error_already_set();
    return PyLong_AsUnsignedLongLong(s.ptr());
  }
  py::object s = py::handle(T.current_stream)(device);
  return s.attr("cuda_stream").cast<uintptr_t>();
}

py::object torch_empty(const std::vector<int64_t>& shape, TorchDType dtype, int device,
                       const py::dict& kwargs) {
  const Torch& T = torch_api();
  if (T.native) {
    PyObject* r = T.native->empty(shape.data(), static_cast<int>(shape.size()),
                                  static_cast<int>(dtype), device);
    if (r) return py::reinterpret_steal<py::object>(r);
  }
  py::tuple size(shape.size());
  for (size_t i = 0; i < shape.size(); ++i) size[i] = py::int_(shape[i]);
  PyObject* r = PyObject_Call(T.empty, py::make_tuple(size).ptr(), kwargs.ptr());
  if (!r) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(r);
}

py::dict empty_kwargs(TorchDType dtype, int device) {
  const Torch& T = torch_api();
  py::dict kw;
  kw["dtype"] = py::handle(T.dtypes[static_cast<int>(dtype)]);
  if (device < 0)
    kw["device"] = py::handle(T.device_type)("cpu");
  else
    kw["device"] = py::handle(T.device_type)("cuda", device);
  return kw;
}

// Any call into torch below may run Python code (the cyclic collector, a
// finalizer) and so let another thread take from this pool meanwhile: no
// reference into entries_ is held across such a call, an entry under check is
// held (its count above 1, so no other thread takes it), and a tensor the pool
// lets go of is released only once entries_ is consistent again.
py::object TensorPool::take(const std::vector<int64_t>& shape, uintptr_t stream,
                            uintptr_t* data) {
  const Torch& T = torch_api();
  for (size_t i = 0; i < entries_.size(); ++i) {
    const Entry& e = entries_[i];
    if (e.stream != stream || e.shape != shape || Py_REFCNT(e.tensor.ptr()) != 1) continue;
    py::object tensor = e.tensor;
    const uintptr_t addr = e.data;
    const int64_t idle_uses = e.idle_uses;
    if (!internal_ && e.exposed) {
      if (idle_uses < 0 || storage_uses(T, tensor) != idle_uses) continue;
      if (!integer_dtype(dtype_) && requires_grad(tensor)) {
        // Its last holder made it an autograd leaf: not a fresh output any more.
        forget(tensor);
        i = static_cast<size_t>(-1);  // entries_ changed: look again from the start
        continue;
      }
    }
    if (data) *data = addr;
    return tensor;
  }
  uintptr_t addr = 0;
  py::object t = make(shape, &addr);
  if (data) *data = addr;
  if (capacity_ == 0) return t;
  const int64_t uses = internal_ ? 0 : storage_uses(T, t);
  if (!internal_ && uses <= 0) return t;
  Entry entry{t, shape, stream, uses, addr, !internal_ && !until_exposed_};
  py::object replaced;  // released on return, after entries_ is consistent
  if (entries_.size() < capacity_) {
    entries_.push_back(std::move(entry));
  } else {  // full of outputs callers keep: forget one in turn (its holders keep it alive)
    Entry& slot = entries_[replace_next_ % entries_.size()];
    replaced = std::move(slot.tensor);
    slot = std::move(entry);
    replace_next_ = (replace_next_ + 1) % capacity_;
  }
  return t;
}

void TensorPool::forget(const py::object& tensor) {
  for (size_t i = 0; i < entries_.size(); ++i) {
    if (entries_[i].tensor.ptr() != tensor.ptr()) continue;
    py::object released = std::move(entries_[i].tensor);  // `tensor` holds it: no release here
    entries_.erase(entries_.begin() + static_cast<std::ptrdiff_t>(i));
    return;
  }
}

py::object TensorPool::make(const std::vector<int64_t>& shape, uintptr_t* data) {
  if (!kwargs_) kwargs_ = empty_kwargs(dtype_, device_);
  py::object t = torch_empty(shape, dtype_, device_, kwargs_);
  if (data) *data = tensor_data_ptr(t);
  return t;
}

void TensorPool::expose(py::handle tensor) {
  for (Entry& e : entries_)
    if (e.tensor.ptr() == tensor.ptr()) e.exposed = true;
}

bool TensorPool::holds(py::handle tensor, const std::vector<int64_t>& shape,
                       uintptr_t* data) const {
  for (const Entry& e : entries_)
    if (e.tensor.ptr() == tensor.ptr() && e.shape == shape) {
      *data = e.data;
      return true;
    }
  return false;
}

}  // namespace symheap::bindings
