// symheap.jax.barrier: every PE waits for every other. The operand passes
// through (aliased to the result), so the token orders the barrier against
// the calls that consume it; has_side_effect keeps XLA from dropping it.
#include <cstring>

#include "bindings/registry.hpp"
#include "xla_ffi/ffi_common.hpp"

namespace symheap::xla_ffi {

#ifdef SYMHEAP_WITH_CUDA
// barrier_cuda.cu: a one-thread device barrier on `stream`.
void launch_device_barrier(const PeState& s, void* stream);
#endif

namespace {

constexpr const char* kWhat = "symheap.jax.barrier";

void pass_through(const PeState& s, const ffi::AnyBuffer& in, ffi::AnyBuffer& out, void* stream) {
  if (out.untyped_data() != in.untyped_data())  // XLA did not alias: copy, stream-ordered
    Runtime::instance().backend().copy(s.device, out.untyped_data(), in.untyped_data(),
                                       in.size_bytes(), reinterpret_cast<StreamHandle>(stream));
}

ffi::Error barrier_cpu(int32_t ordinal, ffi::AnyBuffer token, ffi::Result<ffi::AnyBuffer> out) {
  return guarded([&] {
    auto s = pe_of_xla_device(ordinal, kWhat);
    host::barrier_all(*s, s->timeout_s);
    pass_through(*s, token, *out, nullptr);
  });
}

#ifdef SYMHEAP_WITH_CUDA
ffi::Error barrier_cuda(void* stream, int32_t ordinal, ffi::AnyBuffer token,
                        ffi::Result<ffi::AnyBuffer> out) {
  return guarded([&] {
    auto s = pe_of_xla_device(ordinal, kWhat);
    DeviceGuard guard(s->device);
    pass_through(*s, token, *out, stream);
    launch_device_barrier(*s, stream);
  });
}
#endif

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(kBarrierCpu, barrier_cpu,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());
#ifdef SYMHEAP_WITH_CUDA
XLA_FFI_DEFINE_HANDLER_SYMBOL(kBarrierCuda, barrier_cuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<void*>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());
#endif

}  // namespace symheap::xla_ffi

SYMHEAP_BINDINGS(xla_barrier) {
  using namespace symheap::xla_ffi;
  m.def("xla_barrier_targets", [] {
    pybind11::dict platforms;
    platforms["cpu"] = capsule(kBarrierCpu);
#ifdef SYMHEAP_WITH_CUDA
    platforms["CUDA"] = capsule(kBarrierCuda);
#endif
    pybind11::dict targets;
    targets["symheap_barrier"] = platforms;
    return targets;
  });
}
