// Python bindings of the expert-parallel op core. Ops are addressed by
// (job, rank, id), the way any thread (an XLA FFI worker included) finds them;
// buffers travel as raw addresses. Blocking calls release the GIL so that
// PEs driven by other threads of the process make progress.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "bindings/registry.hpp"
#include "ops/ep/ep_op.hpp"
#include "symheap/errors.hpp"

namespace py = pybind11;
using namespace symheap;

namespace {

ep::Config config_from(const py::dict& d) {
  ep::Config c;
  c.hidden = d["hidden"].cast<int32_t>();
  c.max_tokens = d["max_tokens_per_rank"].cast<int32_t>();
  c.num_experts = d["num_experts"].cast<int32_t>();
  c.topk = d["topk"].cast<int32_t>();
  c.dtype = ep::parse_dtype(d["dtype"].cast<std::string>());
  c.scale_dim = d["scale_dim"].cast<int32_t>();
  c.scale_dtype = ep::parse_dtype(d["scale_dtype"].cast<std::string>());
  c.kernel = ep::parse_kernel(d["kernel"].cast<std::string>());
  const std::string layout = d["layout"].cast<std::string>();
  c.token_slots = layout == "token_slots";
  c.layout = ep::parse_layout(c.token_slots ? "token_major" : layout);
  c.max_recv_tokens = d["max_recv_tokens"].cast<int32_t>();
  c.expert_capacity = d["expert_capacity"].cast<int32_t>();
  return c;
}

py::dict geometry_dict(const ep::Geometry& g) {
  py::dict d;
  d["n_pes"] = g.n_pes;
  d["local_experts"] = g.local_experts;
  d["scales_per_row"] = g.scales_per_row;
  d["recv_rows"] = g.recv_rows;
  d["expert_cap"] = g.expert_cap;
  d["combine_rows"] = g.combine_rows;
  d["send_cols"] = g.send_cols;
  d["summary_words"] = ep::summary_words(g.n_pes, g.local_experts, g.slot_words);
  d["padded_output"] = g.padded_output;
  d["combine_dtype"] = std::string(ep::dtype_name(g.combine_dtype));
  d["off_recv_x"] = g.off_recv_x;
  d["off_recv_scales"] = g.off_recv_scales;
  d["off_recv_idx"] = g.off_recv_idx;
  d["off_recv_w"] = g.off_recv_w;
  d["off_recv_meta"] = g.off_recv_meta;
  d["total"] = g.total;
  return d;
}

template <class T>
T* ptr(uintptr_t addr) {
  return reinterpret_cast<T*>(addr);
}

std::shared_ptr<ep::Op> lookup(uint64_t job, int rank, int64_t id,
                               std::shared_ptr<PeState>* state) {
  return ep::find(job, rank, id, state);
}

}  // namespace

SYMHEAP_BINDINGS(ep) {
  m.def("ep_geometry", [](const py::dict& cfg, int n_pes) {
    return geometry_dict(ep::make_geometry(config_from(cfg), n_pes));
  });
  m.def("ep_create", [](const py::dict& cfg, size_t ws_offset, size_t ws_bytes) {
    auto s = Runtime::instance().current();
    ep::Config c = config_from(cfg);
    py::gil_scoped_release nogil;
    return ep::create(*s, c, ws_offset, ws_bytes);
  });
  m.def("ep_destroy", [](uint64_t job, int rank, int64_t id) {
    auto s = Runtime::instance().slot_of_rank(job, rank);
    if (!s) return;
    py::gil_scoped_release nogil;
    ep::destroy(*s, id);
  });
  m.def(
      "ep_dispatch",
      [](uint64_t job, int rank, int64_t id, uintptr_t x, uintptr_t scales, uintptr_t topk_idx,
         bool idx_int64, uintptr_t topk_weights, int64_t num_tokens, int32_t status,
         uintptr_t num_recv, uintptr_t expert_counts, uintptr_t send_rows, uintptr_t recv_meta,
         uintptr_t recv_summary, uintptr_t saved_weights, uintptr_t stream) {
        std::shared_ptr<PeState> s;
        auto op = lookup(job, rank, id, &s);
        ep::DispatchArgs a;
        a.x = ptr<const void>(x);
        a.scales = ptr<const void>(scales);
        a.topk_idx = ptr<const void>(topk_idx);
        a.idx_int64 = idx_int64;
        a.topk_weights = ptr<const float>(topk_weights);
        a.num_tokens = num_tokens;
        a.status = status;
        a.num_recv = ptr<int32_t>(num_recv);
        a.expert_counts = ptr<int32_t>(expert_counts);
        a.send_rows = ptr<int32_t>(send_rows);
        a.recv_meta = ptr<int32_t>(recv_meta);
        a.recv_summary = ptr<int32_t>(recv_summary);
        a.saved_weights = ptr<float>(saved_weights);
        a.stream = stream;
        py::gil_scoped_release nogil;
        return ep::dispatch(*s, *op, a);
      });
  m.def("ep_combine", [](uint64_t job, int rank, int64_t id, uintptr_t expert_out,
                         int64_t expert_rows, uintptr_t send_rows, uintptr_t recv_meta,
                         uintptr_t recv_summary, uintptr_t weights, int64_t num_tokens, uintptr_t out, int32_t status,
                         uintptr_t stream) {
    std::shared_ptr<PeState> s;
    auto op = lookup(job, rank, id, &s);
    ep::CombineArgs a;
    a.expert_out = ptr<const void>(expert_out);
    a.expert_rows = expert_rows;
    a.send_rows = ptr<const int32_t>(send_rows);
    a.recv_meta = ptr<const int32_t>(recv_meta);
    a.recv_summary = ptr<const int32_t>(recv_summary);
    a.weights = ptr<const float>(weights);
    a.num_tokens = num_tokens;
    a.out = ptr<void>(out);
    a.status = status;
    a.stream = stream;
    py::gil_scoped_release nogil;
    ep::combine(*s, *op, a);
  });
  m.def("ep_check", [](uint64_t job, int rank, int64_t id, uintptr_t stream, bool sync) {
    std::shared_ptr<PeState> s;
    auto op = lookup(job, rank, id, &s);
    py::gil_scoped_release nogil;
    ep::check(*s, *op, stream, sync);
  });
}
