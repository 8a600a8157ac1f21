// Python bindings of the runtime and the host API. Every operation acts on the
// PE of the calling thread's current device; blocking calls release the GIL
// so that PEs driven by other threads of the process make progress.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "bindings/gil_handoff.hpp"
#include "bindings/registry.hpp"
#include "bindings/torch_tensor.hpp"
#include "symheap/errors.hpp"
#include "symheap/runtime.hpp"
#include "symheap/wait.hpp"
#include "transports/transport.hpp"

namespace py = pybind11;
using namespace symheap;

namespace {

Runtime& rt() { return Runtime::instance(); }

template <class T>
T* as_ptr(uintptr_t addr) {
  return reinterpret_cast<T*>(addr);
}

SignalOp parse_signal_op(const std::string& op) {
  if (op == "set") return SignalOp::Set;
  if (op == "add") return SignalOp::Add;
  throw InvalidArgument("signal op must be 'set' or 'add', got '" + op + "'");
}

Compare parse_compare(const std::string& cmp) {
  static const char* names[] = {"eq", "ne", "gt", "ge", "lt", "le"};
  static const char* symbols[] = {"==", "!=", ">", ">=", "<", "<="};
  for (int i = 0; i < 6; ++i)
    if (cmp == names[i] || cmp == symbols[i]) return static_cast<Compare>(i);
  throw InvalidArgument("comparison must be one of eq, ne, gt, ge, lt, le, got '" + cmp + "'");
}

// The Python package's bootstrap (symheap/_bootstrap.py) as the core's init
// and finalize drive it: `connect` is a callable that joins the job and
// returns the connection, whose allgather(bytes, tag), failure and
// close(grace_s=) the core then calls. Each call takes the GIL; what Python
// raises (a timeout, Ctrl-C) goes through the core unchanged.
class PyBootstrap final : public Bootstrap {
 public:
  static PyBootstrap joining(py::object connect) { return PyBootstrap(std::move(connect), {}); }
  static PyBootstrap joined(py::object link) { return PyBootstrap({}, std::move(link)); }

  void connect() override {
    py::gil_scoped_acquire gil;
    link_ = connect_();
  }
  std::vector<std::string> allgather(const std::string& mine, const std::string& tag) override {
    py::gil_scoped_acquire gil;
    std::vector<std::string> out;
    for (auto item : link_.attr("allgather")(py::bytes(mine), tag))
      out.push_back(item.cast<std::string>());
    return out;
  }
  std::string failure() override {
    py::gil_scoped_acquire gil;
    return py::str(link_.attr("failure"));
  }
  void close(double grace_s) override {
    py::gil_scoped_acquire gil;
    link_.attr("close")(py::arg("grace_s") = grace_s);
  }
  const py::object& link() const { return link_; }

 private:
  PyBootstrap(py::object connect, py::object link)
      : connect_(std::move(connect)), link_(std::move(link)) {}
  py::object connect_, link_;
};

// Lets Ctrl-C through long waits: on the main thread, runs Python's signal
// handlers (with the GIL briefly taken) and raises what they raise.
unsigned long g_main_thread = 0;
void check_python_signals() {
  if (PyThread_get_thread_ident() != g_main_thread) return;  // handlers run there only
  py::gil_scoped_acquire gil;
  if (PyErr_CheckSignals() != 0) throw py::error_already_set();
}

// A PE argument as Python gives it (any int64): checked against [0, n_pes)
// before it narrows to int.
int pe_arg(const PeState& s, int64_t pe) {
  s.check_pe(pe);
  return static_cast<int>(pe);
}

// Keeps a heap mapping alive for as long as Python objects view it.
struct HeapRef {
  std::shared_ptr<Region> region;
};

}  // namespace

SYMHEAP_BINDINGS(core) {
  py::class_<HeapRef>(m, "HeapRef")
      .def_property_readonly("base", [](const HeapRef& h) {
        return reinterpret_cast<uintptr_t>(h.region->base);
      })
      .def_property_readonly("size", [](const HeapRef& h) { return h.region->size; });

  g_main_thread = py::module_::import("threading").attr("main_thread")().attr("ident")
                      .cast<unsigned long>();
  set_interrupt_check(&check_python_signals);
  m.attr("default_timeout_s") = kDefaultTimeoutS;
  m.attr("max_timeout_s") = kMaxTimeoutS;
  m.def("check_timeout", [](double t, const std::string& what) {
    return checked_timeout(t, what.c_str());
  });
  m.def("acting_device", [] { return rt().acting_device(); });
  // Records that the job failed (a PE died): every wait of the PE on
  // `device` raises `why` from now on. False when no PE is there.
  m.def("mark_failed", [](int device, const std::string& why) {
    auto s = rt().slot(device);
    if (!s) return false;
    s->mark_failed(why);
    return true;
  });
  m.def("failure", [](int device) -> py::object {
    auto s = rt().slot(device);
    if (!s || !s->failed()) return py::none();
    return py::str(s->failure());
  });

  m.def("backend_name", [] { return rt().backend_name(); });
  m.def("torch_reader", &bindings::torch_reader,
        "How the ops read torch tensors: \"torch C++ API (<library>)\" or \"Python C API: "
        "<why>\" (imports torch).");
  m.def("torch_tensor_fields", [](py::handle t, bool make_contiguous) -> py::object {
    const bindings::TensorRef r = bindings::read_tensor(t, make_contiguous, true);
    if (!r.is_tensor) return py::none();
    return py::make_tuple(r.ptr, r.dtype_str(), r.shape, r.strides, r.device, r.contiguous);
  }, py::arg("tensor"), py::arg("make_contiguous"),
        "(data_ptr, dtype, shape, strides, device, contiguous) as the ops read a tensor; None "
        "for anything else.");
  m.def("select_backend", [](const std::string& name) { rt().select_backend(name); });
  m.def("device_count", [] { return rt().backend().device_count(); });
  m.def("current_device", [] { return rt().current_device(); });
  m.def("set_device", [](int d) { rt().set_device(d); });
  m.def("parse_size", &parse_size);
  m.def("format_size", &format_size);
  m.def("node_id", &this_node_id);
  m.def("active_devices", [] { return rt().active_devices(); });

  // Collective init of the PE on `device` (Runtime::init_pe); returns what
  // `connect` returned, the job's bootstrap connection.
  m.def("init_pe", [](uint64_t job, int device, int rank, int world, size_t heap_size,
                      double timeout_s, py::object connect, int xla_ordinal) {
    PyBootstrap boot = PyBootstrap::joining(std::move(connect));
    {
      py::gil_scoped_release nogil;
      rt().init_pe(job, device, rank, world, heap_size, timeout_s, boot, xla_ordinal);
    }
    return boot.link();
  }, py::arg("job"), py::arg("device"), py::arg("rank"), py::arg("world"),
     py::arg("heap_size"), py::arg("timeout_s"), py::arg("connect"),
     py::arg("xla_ordinal") = -1);
  // Collective finalize of the PE on `device` over its bootstrap connection
  // (Runtime::finalize_pe); the PE is gone afterwards even when it raises.
  m.def("finalize_pe", [](int device, py::object link) {
    PyBootstrap boot = PyBootstrap::joined(std::move(link));
    py::gil_scoped_release nogil;
    rt().finalize_pe(device, boot);
  });
  m.def("destroy_pe", [](int device) {
    py::gil_scoped_release nogil;
    rt().destroy_pe(device);
  });
  m.def("device_of_rank", [](uint64_t job, int rank) { return rt().device_of_rank(job, rank); });

  // Identity of the current thread's PE.
  m.def("pe_identity", [] {
    auto s = rt().current();
    return py::make_tuple(s->my_pe, s->n_pes, s->generation, s->job, s->device);
  });
  m.def("slot_identity", [](int device) -> py::object {
    auto s = rt().slot(device);
    if (!s || s->peers.empty()) return py::none();
    return py::make_tuple(s->my_pe, s->n_pes, s->generation, s->job, s->device);
  });
  m.def("heap_ref", [] { return HeapRef{rt().current()->heap}; });
  m.def("peer_heap_ref", [](int64_t pe) {
    auto s = rt().current();
    s->check_pe(pe);
    const Peer& p = s->peers[pe];
    if (p.kind == PeerKind::Self) return HeapRef{s->heap};
    if (!p.base)
      throw Unsupported(s->no_path_message(static_cast<int>(pe), "a view of a peer's memory"));
    return HeapRef{p.mapping};
  });
  m.def("peer_kind", [](int64_t pe) {
    auto s = rt().current();
    s->check_pe(pe);
    return std::string(peer_kind_name(s->peers[pe].kind));
  });
  m.def("peer_device", [](int64_t pe) {
    auto s = rt().current();
    s->check_pe(pe);
    return s->peers[pe].info.device;
  });

  // Memory.
  m.def("malloc", [](size_t nbytes, size_t align) {
    return rt().current()->heap_allocate(nbytes, align);
  });
  m.def("free", [](size_t offset) { rt().current()->heap_release(offset); });
  m.def("heap_usage", [] {
    auto s = rt().current();
    auto use = s->heap_usage();
    return py::make_tuple(use.bytes_in_use, use.capacity, use.live_blocks, s->heap_size);
  });

  // RMA, signals, atomics, ordering.
  // `via` picks the path to a mapped peer: "auto", "load_store" or
  // "copy_engine" (transports/transport.hpp); the transport is chosen here.
  m.def("put", [](uintptr_t dst, uintptr_t src, size_t n, int64_t pe_in, uintptr_t stream,
                  const std::string& via) {
    auto s = rt().current();
    int pe = pe_arg(*s, pe_in);
    Via path = parse_via(via);
    py::gil_scoped_release nogil;
    host::put(*s, as_ptr<void>(dst), as_ptr<const void>(src), n, pe, stream, path);
  }, py::arg("dst"), py::arg("src"), py::arg("nbytes"), py::arg("pe"), py::arg("stream"),
     py::arg("via") = "auto");
  m.def("get", [](uintptr_t dst, uintptr_t src, size_t n, int64_t pe_in, uintptr_t stream) {
    auto s = rt().current();
    int pe = pe_arg(*s, pe_in);
    py::gil_scoped_release nogil;
    host::get(*s, as_ptr<void>(dst), as_ptr<const void>(src), n, pe, stream);
  });
  m.def("put_signal", [](uintptr_t dst, uintptr_t src, size_t n, uintptr_t sig, uint64_t value,
                         const std::string& op, int64_t pe_in, uintptr_t stream,
                         const std::string& via) {
    auto s = rt().current();
    int pe = pe_arg(*s, pe_in);
    Via path = parse_via(via);
    SignalOp sop = parse_signal_op(op);
    py::gil_scoped_release nogil;
    host::put_signal(*s, as_ptr<void>(dst), as_ptr<const void>(src), n, as_ptr<uint64_t>(sig),
                     value, sop, pe, stream, path);
  }, py::arg("dst"), py::arg("src"), py::arg("nbytes"), py::arg("signal"), py::arg("value"),
     py::arg("op"), py::arg("pe"), py::arg("stream"), py::arg("via") = "auto");
  m.def("transport_of", [](int64_t pe) {
    auto s = rt().current();
    int p = pe_arg(*s, pe);
    return std::string(s->transports->name_of(p));
  });
  // Bytes the current PE moved across nodes (the remote transport's payloads).
  m.def("bytes_across_nodes", [] { return rt().current()->transports->bytes_across_nodes(); });
  m.def("signal_op", [](uintptr_t sig, uint64_t value, const std::string& op, int64_t pe_in,
                        uintptr_t stream) {
    auto s = rt().current();
    int pe = pe_arg(*s, pe_in);
    SignalOp sop = parse_signal_op(op);
    py::gil_scoped_release nogil;
    host::signal_op(*s, as_ptr<uint64_t>(sig), value, sop, pe, stream);
  });
  m.def("signal_wait_until", [](uintptr_t sig, const std::string& cmp, uint64_t value,
                                double timeout_s) {
    auto s = rt().current();
    Compare c = parse_compare(cmp);
    py::gil_scoped_release nogil;
    return host::signal_wait_until(*s, as_ptr<uint64_t>(sig), c, value, timeout_s);
  });
  m.def("atomic_fetch_add", [](uintptr_t dst, int64_t v, int64_t pe_in) {
    auto s = rt().current();
    int pe = pe_arg(*s, pe_in);
    py::gil_scoped_release nogil;
    return host::atomic_fetch_add(*s, as_ptr<int64_t>(dst), v, pe);
  });
  m.def("atomic_compare_swap", [](uintptr_t dst, int64_t cond, int64_t v, int64_t pe_in) {
    auto s = rt().current();
    int pe = pe_arg(*s, pe_in);
    py::gil_scoped_release nogil;
    return host::atomic_compare_swap(*s, as_ptr<int64_t>(dst), cond, v, pe);
  });
  m.def("atomic_swap", [](uintptr_t dst, int64_t v, int64_t pe_in) {
    auto s = rt().current();
    int pe = pe_arg(*s, pe_in);
    py::gil_scoped_release nogil;
    return host::atomic_swap(*s, as_ptr<int64_t>(dst), v, pe);
  });
  m.def("quiet", [](uintptr_t stream) {
    auto s = rt().current();
    py::gil_scoped_release nogil;
    host::quiet(*s, stream);
  });
  m.def("fence", [](uintptr_t stream) {
    auto s = rt().current();
    py::gil_scoped_release nogil;
    host::fence(*s, stream);
  });
  m.def("heap_barrier", [](double timeout_s) {
    auto s = rt().current();
    // PE threads leave a barrier together, as they leave an EP call: they take
    // the GIL back in turns (gil_handoff.hpp) instead of one sleeping on
    // CPython's condition variable until the other releases it (a wake-up of
    // 0.1-0.5 ms on the dev VM, and one that can move it onto the other's core).
    bindings::PeCallGil nogil;
    host::barrier_all(*s, timeout_s);
  });
  m.def("all_peers_load_store", [] {
    auto s = rt().current();
    PeUse use(*s);
    for (auto& p : s->peers)
      if (!p.base) return false;
    return true;
  });
}
