// Plain Python values read without conversions: the eager entries take a call
// in C++ only when its options are exactly these (an int, a float, a bool, a
// tuple of ints), and leave anything else to the front end's general path.
#pragma once
#include <pybind11/pybind11.h>

#include <cmath>
#include <cstdint>

namespace symheap::bindings {

// An int (not a bool, not an int subclass) that fits 64 bits.
inline bool exact_int(pybind11::handle o, int64_t* v) {
  if (!PyLong_CheckExact(o.ptr())) return false;
  int overflow = 0;
  *v = PyLong_AsLongLongAndOverflow(o.ptr(), &overflow);
  return !overflow && !PyErr_Occurred();
}

// A float other than NaN, or an exact int.
inline bool plain_number(pybind11::handle o, double* v) {
  if (PyFloat_CheckExact(o.ptr())) {
    *v = PyFloat_AS_DOUBLE(o.ptr());
    return !std::isnan(*v);
  }
  int64_t i = 0;
  if (!exact_int(o, &i)) return false;
  *v = static_cast<double>(i);
  return true;
}

}  // namespace symheap::bindings
