// symheap._devtest: the test and benchmark kernels of devtest.hpp. The
// context argument is symheap.device_context() (the bytes of the calling
// PE's DeviceContext); addresses are raw pointers.
#include <pybind11/pybind11.h>

#include <cstring>
#include <string>

#include "devtest/devtest.hpp"
#include "symheap/errors.hpp"

namespace py = pybind11;
using namespace symheap;

namespace {

DeviceContext context_of(const py::bytes& bytes) {
  std::string raw = bytes;
  if (raw.size() != sizeof(DeviceContext))
    throw InvalidArgument("ctx must be symheap.device_context() (" +
                          std::to_string(sizeof(DeviceContext)) + " bytes), got " +
                          std::to_string(raw.size()) + " bytes");
  DeviceContext ctx;
  std::memcpy(&ctx, raw.data(), sizeof ctx);
  return ctx;
}

template <class T>
T* as_ptr(uintptr_t addr) {
  return reinterpret_cast<T*>(addr);
}

}  // namespace

PYBIND11_MODULE(_devtest, m) {
  m.doc() = "Kernels for symheap's GPU tests and benchmarks (not part of the API).";
  m.def("put", [](py::bytes ctx, int device, uintptr_t dst, uintptr_t src, size_t n, int pe,
                  int scope, int units, uintptr_t sig, bool nbi, uintptr_t stream) {
    DeviceContext c = context_of(ctx);
    py::gil_scoped_release nogil;
    devtest::put(c, device, as_ptr<void>(dst), as_ptr<const void>(src), n, pe, scope, units,
                 sig ? as_ptr<uint64_t>(sig) : nullptr, nbi, stream);
  });
  m.def("get", [](py::bytes ctx, int device, uintptr_t dst, uintptr_t src, size_t n, int pe,
                  int scope, int units, uintptr_t stream) {
    DeviceContext c = context_of(ctx);
    py::gil_scoped_release nogil;
    devtest::get(c, device, as_ptr<void>(dst), as_ptr<const void>(src), n, pe, scope, units,
                 stream);
  });
  m.def("atomics", [](py::bytes ctx, int device, uintptr_t counter, uintptr_t cas_word,
                      uintptr_t swap_word, int64_t cond, int64_t value, int pe, int threads,
                      uintptr_t out, uintptr_t stream) {
    DeviceContext c = context_of(ctx);
    py::gil_scoped_release nogil;
    devtest::atomics(c, device, as_ptr<int64_t>(counter), as_ptr<int64_t>(cas_word),
                     as_ptr<int64_t>(swap_word), cond, value, pe, threads, as_ptr<int64_t>(out),
                     stream);
  });
  m.def("wait_until", [](py::bytes ctx, int device, uintptr_t sig, int cmp, uint64_t value,
                         uintptr_t out, uintptr_t stream) {
    DeviceContext c = context_of(ctx);
    py::gil_scoped_release nogil;
    devtest::wait_until(c, device, as_ptr<uint64_t>(sig), cmp, value, as_ptr<uint64_t>(out),
                        stream);
  });
  m.def("barrier", [](py::bytes ctx, int device, uintptr_t slots, int rounds, int scope,
                      uintptr_t bad, uintptr_t stream) {
    DeviceContext c = context_of(ctx);
    py::gil_scoped_release nogil;
    devtest::barrier_rounds(c, device, as_ptr<uint64_t>(slots), rounds, scope,
                            as_ptr<uint64_t>(bad), stream);
  });
  m.def("ping_pong", [](py::bytes ctx, int device, uintptr_t data, uintptr_t sig, int peer,
                        bool initiator, int iters, uintptr_t stream, int variant) {
    DeviceContext c = context_of(ctx);
    py::gil_scoped_release nogil;
    devtest::ping_pong(c, device, as_ptr<uint64_t>(data), as_ptr<uint64_t>(sig), peer,
                       initiator, iters, variant, stream);
  }, py::arg("ctx"), py::arg("device"), py::arg("data"), py::arg("sig"), py::arg("peer"),
     py::arg("initiator"), py::arg("iters"), py::arg("stream"), py::arg("variant") = 0);
  m.attr("ping_pong_variants") = devtest::kPingPongVariants;
  m.def("plain_copy", [](uintptr_t dst, uintptr_t src, size_t n, int blocks, int device,
                         uintptr_t stream) {
    py::gil_scoped_release nogil;
    devtest::plain_copy_kernel(as_ptr<void>(dst), as_ptr<const void>(src), n, blocks, device,
                               stream);
  });
  m.def("memcpy_peer", [](uintptr_t dst, int dst_device, uintptr_t src, int src_device,
                          size_t n, uintptr_t stream) {
    py::gil_scoped_release nogil;
    devtest::memcpy_peer(as_ptr<void>(dst), dst_device, as_ptr<const void>(src), src_device, n,
                         stream);
  });
  m.def("fill", [](uintptr_t dst, size_t n, uint32_t seed, int device, uintptr_t stream) {
    py::gil_scoped_release nogil;
    devtest::fill_pattern(as_ptr<uint32_t>(dst), n, seed, device, stream);
  });
}
