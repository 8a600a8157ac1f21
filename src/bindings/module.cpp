#include <pybind11/pybind11.h>

#include <algorithm>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "bindings/registry.hpp"
#include "symheap/errors.hpp"

namespace py = pybind11;

namespace symheap::bindings {
namespace {
std::vector<std::pair<std::string, BindFn>>& registry() {
  static std::vector<std::pair<std::string, BindFn>> r;
  return r;
}
}  // namespace

int register_bindings(const char* name, BindFn fn) {
  registry().emplace_back(name, fn);
  return 0;
}

void bind_all(py::module_& m) {
  auto& r = registry();
  // "core" first so other components can refer to its types.
  std::stable_sort(r.begin(), r.end(), [](const auto& a, const auto& b) {
    return (a.first == "core") > (b.first == "core");
  });
  for (auto& [name, fn] : r) fn(m);
}
}  // namespace symheap::bindings

namespace symheap::bindings {
namespace {
PyObject* g_state_error = nullptr;
PyObject* g_unsupported = nullptr;
PyObject* g_remote_error = nullptr;

// The core's exceptions as Python ones; false for any other exception.
bool set_core_error(std::exception_ptr p) {
  try {
    if (p) std::rethrow_exception(p);
  } catch (const symheap::InvalidArgument& e) {
    PyErr_SetString(PyExc_ValueError, e.what());
  } catch (const symheap::TimeoutError& e) {
    PyErr_SetString(PyExc_TimeoutError, e.what());
  } catch (const symheap::HeapExhausted& e) {
    PyErr_SetString(PyExc_MemoryError, e.what());
  } catch (const symheap::Unsupported& e) {
    PyErr_SetString(g_unsupported, e.what());
  } catch (const symheap::RemoteError& e) {
    // The target PE and the operation as attributes, for code that handles it.
    py::object err = py::reinterpret_borrow<py::object>(g_remote_error)(e.what());
    err.attr("pe") = e.pe;
    err.attr("op") = e.op;
    PyErr_SetObject(g_remote_error, err.ptr());
  } catch (const symheap::StateError& e) {
    PyErr_SetString(g_state_error, e.what());
  } catch (...) {
    return false;
  }
  return true;
}
}  // namespace

void set_python_error(std::exception_ptr p) {
  if (set_core_error(p)) return;
  try {
    std::rethrow_exception(p);
  } catch (py::error_already_set& e) {
    e.restore();
  } catch (const py::builtin_exception& e) {
    e.set_error();
  } catch (const std::bad_alloc&) {
    PyErr_NoMemory();
  } catch (const std::domain_error& e) {
    PyErr_SetString(PyExc_ValueError, e.what());
  } catch (const std::invalid_argument& e) {
    PyErr_SetString(PyExc_ValueError, e.what());
  } catch (const std::length_error& e) {
    PyErr_SetString(PyExc_ValueError, e.what());
  } catch (const std::out_of_range& e) {
    PyErr_SetString(PyExc_IndexError, e.what());
  } catch (const std::range_error& e) {
    PyErr_SetString(PyExc_ValueError, e.what());
  } catch (const std::overflow_error& e) {
    PyErr_SetString(PyExc_OverflowError, e.what());
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  } catch (...) {
    PyErr_SetString(PyExc_RuntimeError, "unknown C++ exception");
  }
}
}  // namespace symheap::bindings

PYBIND11_MODULE(_core, m) {
  m.doc() = "symheap C++ core";
  static py::exception<symheap::StateError> state_error(m, "SymheapError", PyExc_RuntimeError);
  static py::exception<symheap::Unsupported> unsupported(m, "UnsupportedError",
                                                         state_error.ptr());
  static py::exception<symheap::RemoteError> remote_error(m, "RemoteError", state_error.ptr());
  symheap::bindings::g_state_error = state_error.ptr();
  symheap::bindings::g_remote_error = remote_error.ptr();
  symheap::bindings::g_unsupported = unsupported.ptr();
  py::register_exception_translator([](std::exception_ptr p) {
    // Anything else goes on to pybind11's own translators.
    if (!symheap::bindings::set_core_error(p)) std::rethrow_exception(p);
  });
#ifdef SYMHEAP_WITH_CUDA
  m.attr("built_with_cuda") = true;
#else
  m.attr("built_with_cuda") = false;
#endif
#ifdef SYMHEAP_WITH_XLA_FFI
  m.attr("built_with_xla_ffi") = true;
#else
  m.attr("built_with_xla_ffi") = false;
#endif
  symheap::bindings::bind_all(m);
}
