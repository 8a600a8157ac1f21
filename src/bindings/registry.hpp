// Each component registers its Python bindings here, so adding a module means
// adding a file, not editing a central list.
#pragma once
#include <pybind11/pybind11.h>

#include <exception>

namespace symheap::bindings {
using BindFn = void (*)(pybind11::module_&);
int register_bindings(const char* name, BindFn fn);
void bind_all(pybind11::module_& m);
// Sets the Python error for a C++ exception, as the module's bindings
// translate it (for functions called without pybind11's dispatcher).
void set_python_error(std::exception_ptr p);
}  // namespace symheap::bindings

#define SYMHEAP_BINDINGS(name)                                                       \
  static void symheap_bind_##name(pybind11::module_& m);                             \
  [[maybe_unused]] static const int symheap_registered_##name =                      \
      ::symheap::bindings::register_bindings(#name, symheap_bind_##name);           \
  static void symheap_bind_##name(pybind11::module_& m)
