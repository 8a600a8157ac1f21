// The runtime's map from XLA device ordinals to device slots (set by
// symheap.jax.init, read by the XLA FFI handlers).
#include <pybind11/pybind11.h>

#include "bindings/registry.hpp"
#include "symheap/runtime.hpp"

SYMHEAP_BINDINGS(xla_devices) {
  using symheap::Runtime;
  m.def("map_xla_device", [](int ordinal, int device) {
    Runtime::instance().map_xla_device(ordinal, device);
  });
  m.def("unmap_xla_device", [](int ordinal) { Runtime::instance().unmap_xla_device(ordinal); });
  m.def("device_of_xla", [](int ordinal) { return Runtime::instance().device_of_xla(ordinal); });
}
