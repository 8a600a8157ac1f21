#include <pybind11/pybind11.h>

#include <algorithm>
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

PYBIND11_MODULE(_core, m) {
  m.doc() = "symheap C++ core";
  static py::exception<symheap::StateError> state_error(m, "SymheapError", PyExc_RuntimeError);
  static py::exception<symheap::Unsupported> unsupported(m, "UnsupportedError",
                                                         state_error.ptr());
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const symheap::InvalidArgument& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    } catch (const symheap::TimeoutError& e) {
      PyErr_SetString(PyExc_TimeoutError, e.what());
    } catch (const symheap::HeapExhausted& e) {
      PyErr_SetString(PyExc_MemoryError, e.what());
    } catch (const symheap::Unsupported& e) {
      PyErr_SetString(unsupported.ptr(), e.what());
    } catch (const symheap::StateError& e) {
      PyErr_SetString(state_error.ptr(), e.what());
    }
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
