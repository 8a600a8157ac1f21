// Python bindings of the expert-parallel op core.
//
// One entry per user call: dispatch and combine take their arguments under
// the GIL (the only Python work; a plain torch.Tensor is only checked for its
// class there and read through torch_tensor.hpp after the release), then
// check them, find the op's PE and run the call with the GIL released, so
// PEs driven by other threads of the process make progress. The checks and
// their messages live here, once. Ops are addressed by (job, rank, id), the
// way any thread (an XLA FFI worker included) finds them: a call from a
// thread whose current device is another one runs on the op's PE and leaves
// the thread's current device as it was.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <structmember.h>

#include <algorithm>
#include <climits>
#include <optional>
#include <type_traits>

#include "bindings/gil_handoff.hpp"
#include "bindings/registry.hpp"
#include "bindings/torch_tensor.hpp"
#include "ops/ep/ep_device.hpp"
#include "ops/ep/ep_op.hpp"
#include "symheap/errors.hpp"

namespace py = pybind11;
using namespace symheap;
using bindings::TensorRef;
using bindings::TorchDType;

namespace {

const char* const kKernels[] = {"intranode", "low_latency", "copy_engine"};
const char* const kLayouts[] = {"token_major", "token_slots", "expert_major"};

// A config field as the core's int32; None (an optional bound) is 0.
int32_t int32_field(const py::dict& d, const char* name, bool optional = false) {
  py::object v = d[name];
  if (optional && v.is_none()) return 0;
  int overflow = 0;
  const long long x = PyLong_Check(v.ptr()) ? PyLong_AsLongLongAndOverflow(v.ptr(), &overflow) : 0;
  if (!PyLong_Check(v.ptr()) || overflow || x < INT32_MIN || x > INT32_MAX)
    throw InvalidArgument(std::string("EpConfig.") + name + " must be an int in [1, " +
                          std::to_string(INT32_MAX) + "], got " +
                          py::str(v).cast<std::string>());
  if (optional && x <= 0)
    throw InvalidArgument(std::string("EpConfig: ") + name + " must be positive, got " +
                          std::to_string(x));
  return static_cast<int32_t>(x);
}

ep::Config config_from(const py::dict& d) {
  ep::Config c;
  c.hidden = int32_field(d, "hidden");
  c.max_tokens = int32_field(d, "max_tokens_per_rank");
  c.num_experts = int32_field(d, "num_experts");
  c.topk = int32_field(d, "topk");
  c.dtype = ep::parse_dtype(d["dtype"].cast<std::string>());
  c.scale_dim = int32_field(d, "scale_dim");
  c.scale_dtype = ep::parse_dtype(d["scale_dtype"].cast<std::string>());
  c.kernel = ep::parse_kernel(d["kernel"].cast<std::string>());
  const std::string layout = d["layout"].cast<std::string>();
  c.token_slots = layout == "token_slots";
  c.layout = ep::parse_layout(c.token_slots ? "token_major" : layout);
  c.max_recv_tokens = int32_field(d, "max_recv_tokens", true);
  c.expert_capacity = int32_field(d, "expert_capacity", true);
  if (d.contains("grid_blocks")) c.grid_blocks = int32_field(d, "grid_blocks");
  return c;
}

py::dict geometry_dict(const ep::Config& c, const ep::Geometry& g) {
  py::dict d;
  d["n_pes"] = g.n_pes;
  d["local_experts"] = g.local_experts;
  d["scales_per_row"] = g.scales_per_row;
  d["recv_rows"] = g.recv_rows;
  d["expert_cap"] = g.expert_cap;
  d["combine_rows"] = g.combine_rows;
  d["send_cols"] = g.send_cols;
  d["summary_words"] = ep::summary_words(g.n_pes, g.local_experts, g.slot_words);
  d["summary_counts_at"] = ep::summary_counts_at(g.n_pes);
  d["padded_output"] = g.padded_output;
  d["combine_dtype"] = std::string(ep::dtype_name(g.combine_dtype));
  d["off_recv_x"] = g.off_recv_x;
  d["off_recv_scales"] = g.off_recv_scales;
  d["off_recv_idx"] = g.off_recv_idx;
  d["off_recv_w"] = g.off_recv_w;
  d["off_recv_meta"] = g.off_recv_meta;
  d["total"] = g.total;
  const ep::HandleLayout h = ep::handle_layout(c, g);
  py::dict hd;
  hd["num_recv"] = h.num_recv;
  hd["expert_counts"] = h.expert_counts;
  hd["send_rows"] = h.send_rows;
  hd["summary"] = h.summary;
  hd["recv_meta"] = h.recv_meta;
  hd["weights"] = h.weights;
  hd["words"] = h.words;
  d["handle"] = hd;
  return d;
}

TorchDType torch_dtype(ep::DType t) {
  switch (t) {
    case ep::DType::F32: return TorchDType::F32;
    case ep::DType::F16: return TorchDType::F16;
    case ep::DType::BF16: return TorchDType::BF16;
    case ep::DType::FP8_E4M3: return TorchDType::FP8_E4M3;
  }
  return TorchDType::Other;
}

// The first bad argument of a call, raised as TypeError or ValueError.
struct Problem {
  bool type_error = false;
  std::string message;
  [[noreturn]] void raise(const std::string& suffix = "") const {
    if (type_error) throw py::type_error(message + suffix);
    throw InvalidArgument(message + suffix);
  }
};
using Check = std::optional<Problem>;

Check value_error(std::string m) { return Problem{false, std::move(m)}; }

// The front end's EpHandle and DispatchOutput are classes with __slots__: an
// instance is made here and its slots filled and read at their offsets (found
// once from the class's member descriptors), with no dict per object and no
// attribute lookup per call. An unset slot is null.
struct SlotClass {
  enum HandleSlot { kOpId, kLayout, kNumTokens, kRowsShape, kSendRows, kRecvMeta, kSummary,
                    kWeights, kDevice, kStorage, kOp, kHandleSlots };
  enum OutputSlot { kHandle, kOwner, kRows, kOutputSlots };

  py::object type;
  std::vector<Py_ssize_t> offsets;

  SlotClass() = default;
  SlotClass(py::object t, std::initializer_list<const char*> slots) : type(std::move(t)) {
    if (!PyType_Check(type.ptr())) throw py::type_error("expected a class");
    for (const char* name : slots) {
      py::object d = type.attr(name);  // the class's member descriptor of that slot
      if (!Py_IS_TYPE(d.ptr(), &PyMemberDescr_Type))
        throw py::type_error(std::string(py::str(type)) + "." + name + " is not a slot");
      offsets.push_back(reinterpret_cast<PyMemberDescrObject*>(d.ptr())->d_member->offset);
    }
    // Every slot the class itself declares (those above and the ones set on first use).
    for (py::handle name : py::reinterpret_borrow<py::iterable>(type.attr("__slots__"))) {
      py::object d = type.attr("__dict__")[name];
      // A field made on first use (ep/_op.py's _LazyField) keeps its slot's descriptor.
      if (!Py_IS_TYPE(d.ptr(), &PyMemberDescr_Type) && py::hasattr(d, "_member"))
        d = d.attr("_member");
      if (Py_IS_TYPE(d.ptr(), &PyMemberDescr_Type))
        every.push_back(reinterpret_cast<PyMemberDescrObject*>(d.ptr())->d_member->offset);
    }
  }
  std::vector<Py_ssize_t> every;
  // Unsets every slot of an instance of exactly this class.
  void clear(PyObject* obj) const {
    for (Py_ssize_t off : every)
      Py_CLEAR(*reinterpret_cast<PyObject**>(reinterpret_cast<char*>(obj) + off));
  }
  // A new instance, every slot unset (object.__new__, no __init__).
  py::object make() const {
    auto* t = reinterpret_cast<PyTypeObject*>(type.ptr());
    PyObject* obj = t->tp_alloc(t, 0);
    if (!obj) throw py::error_already_set();
    return py::reinterpret_steal<py::object>(obj);
  }
  PyObject*& at(PyObject* obj, int slot) const {
    return *reinterpret_cast<PyObject**>(reinterpret_cast<char*>(obj) + offsets[slot]);
  }
  // Sets an unset slot of an instance `make` returned.
  void init(const py::object& obj, int slot, py::handle value) const {
    at(obj.ptr(), slot) = py::reinterpret_borrow<py::object>(value).release().ptr();
  }
  void init(const py::object& obj, int slot, py::object&& value) const {
    at(obj.ptr(), slot) = value.release().ptr();
  }
  // A slot's value (borrowed), null when unset.
  py::handle get(py::handle obj, int slot) const { return py::handle(at(obj.ptr(), slot)); }
};

// One op of one PE as the Python front end holds it.
class EpOp {
  static constexpr size_t kPooled = 4;  // recycled outputs of each kind

 public:
  EpOp(const py::dict& cfg, size_t ws_offset, size_t ws_bytes, py::object handle_type)
      : handle_(std::move(handle_type),
                {"op_id", "layout", "num_tokens", "rows_shape", "send_rows", "recv_meta",
                 "summary", "weights", "device", "_storage", "_op"}) {
    auto s = Runtime::instance().current();
    cfg_ = config_from(cfg);
    layout_name_ = cfg["layout"].cast<std::string>();
    // This op's own string, not the interned one: every handle refers to it,
    // and an object shared with another PE thread's op would move its
    // reference count between the threads' cores on every call.
    PyObject* layout = PyUnicode_FromString(layout_name_.c_str());
    if (!layout) throw py::error_already_set();
    layout_str_ = py::reinterpret_steal<py::object>(layout);
    {
      py::gil_scoped_release nogil;
      id_ = ep::create(*s, cfg_, ws_offset, ws_bytes);
    }
    job_ = s->job;
    rank_ = s->my_pe;
    // What a handle carries as its op_id: this op on this PE (an op's id is
    // the same on every PE, so the ops of the PE threads of one process share it).
    stamp_ = id_ * s->n_pes + rank_;
    stamp_obj_ = py::int_(stamp_);
    generation_ = s->generation;
    pe_ = s;
    op_ = ep::find(*s, id_);
    geo_ = ep::make_geometry(cfg_, s->n_pes);
    hl_ = ep::handle_layout(cfg_, geo_);
    words_shape_ = {hl_.words};
    on_cuda_ = Runtime::instance().backend_name() == "cuda";
    torch_device_ = on_cuda_ ? s->device : -1;
    x_dtype_ = torch_dtype(cfg_.dtype);
    scale_dtype_ = torch_dtype(cfg_.scale_dtype);
    combine_dtype_ = torch_dtype(geo_.combine_dtype);
    // The handle's storage is private to the handle: views of it come only
    // from the front end's _handle_part, which calls expose_storage first.
    storage_pool_ = bindings::TensorPool(TorchDType::I32, torch_device_, kPooled,
                                         /*internal=*/false, /*until_exposed=*/true);
    out_pool_ = bindings::TensorPool(combine_dtype_, torch_device_, kPooled);
  }

  int64_t id() const { return id_; }

  void destroy() {
    closed_ = true;
    recycled_.clear();  // they refer to the front-end object, which refers to this op
    auto s = Runtime::instance().slot_of_rank(job_, rank_);
    if (!s || s->generation != generation_) return;
    py::gil_scoped_release nogil;
    ep::destroy(*s, id_);
  }

  void check(py::handle stream, bool sync) {
    const uintptr_t h = stream_of(stream);
    py::gil_scoped_release nogil;
    std::shared_ptr<PeState> s;
    auto op = find(&s);
    ep::check(*s, *op, h, sync);
  }

  // What dispatch's results are made of on the Python side: the output
  // class, the handle's torch device and its rows_shape when fixed (None
  // when it is the count the host knows).
  // `stream_handle` turns a stream= argument into a raw handle.
  void set_front_end(py::object output_type, py::object device, py::object fixed_rows,
                     py::object stream_handle) {
    output_ = SlotClass(std::move(output_type), {"handle", "_owner", "_rows"});
    device_obj_ = std::move(device);
    fixed_rows_ = std::move(fixed_rows);
    stream_handle_ = std::move(stream_handle);
  }

  // Returns the DispatchOutput (its fields made on first use by `owner`, the
  // EpDispatchCombine) with its EpHandle, both built here.
  py::object dispatch(py::handle owner, py::handle x, py::handle topk_idx,
                      py::handle topk_weights, py::handle scales, py::handle stream) {
    check_open();
    // Plain tensors are read once the GIL is released (finish_reads).
    bindings::DeferredTensor args[4];
    const py::handle objs[4] = {x, topk_idx, topk_weights, scales};
    for (int i = 0; i < 4; ++i) bindings::defer(objs[i], args[i]);
    const uintptr_t h = stream_of(stream);
    uintptr_t base = 0;
    py::object storage = storage_pool_.take(words_shape_, h, &base);
    int64_t n = 0, num_tokens = 0;
    {
      bindings::PeCallGil nogil;
      finish_reads(nogil, args, objs, 4);
      const DispatchInputs in{args[0].ref, args[1].ref, args[2].ref, args[3].ref};
      const Check problem = check_dispatch(in);
      num_tokens = problem ? 0 : in.x.shape[0];
      ep::DispatchArgs a;
      if (!problem) {
        a.x = ptr<const void>(in.x.ptr);
        a.scales = in.scales.present ? ptr<const void>(in.scales.ptr) : nullptr;
        a.topk_idx = ptr<const void>(in.idx.ptr);
        a.idx_int64 = in.idx.dtype == TorchDType::I64;
        a.topk_weights = ptr<const float>(in.w.ptr);
      }
      a.num_tokens = num_tokens;
      a.status = problem ? ep::kBadArgument : ep::kOk;
      a.num_recv = word<int32_t>(base, hl_.num_recv);
      a.expert_counts = word<int32_t>(base, hl_.expert_counts);
      a.send_rows = word<int32_t>(base, hl_.send_rows);
      a.recv_meta = hl_.recv_meta < 0 ? nullptr : word<int32_t>(base, hl_.recv_meta);
      a.recv_summary = word<int32_t>(base, hl_.summary);
      a.saved_weights = hl_.weights < 0 ? nullptr : word<float>(base, hl_.weights);
      a.stream = h;
      n = collective("dispatch", problem, [&](PeState& s, ep::Op& op) { return ep::dispatch(s, op, a); });
    }
    return make_output(owner, n, num_tokens, std::move(storage));
  }

  // Returns `out` (allocated here when None).
  py::object combine(py::handle expert_out, py::handle handle, py::handle topk_weights,
                     py::handle out, py::handle stream) {
    check_open();
    // Plain tensors are read once the GIL is released (finish_reads); `out`
    // as given (a non-contiguous one is refused, not copied).
    bindings::DeferredTensor args[3];
    const py::handle objs[3] = {expert_out, topk_weights, out};
    bindings::defer(expert_out, args[0]);
    bindings::defer(topk_weights, args[1]);
    bindings::defer(out, args[2], false);
    CombineInputs in;
    read_handle(handle, in);
    const uintptr_t h = stream_of(stream);
    py::object result = py::reinterpret_borrow<py::object>(out);
    const bool made_out = out.is_none() && in.num_tokens >= 0;
    if (made_out) {
      // Made here: its dtype, shape and device are known, only the address is read.
      result = out_pool_.take({in.num_tokens, cfg_.hidden}, h, &in.out.ptr);
      in.out.present = in.out.is_tensor = in.out.contiguous = true;
      in.out.dtype = combine_dtype_;
      in.out.shape = {in.num_tokens, cfg_.hidden};
      in.out.device = torch_device_;
    }
    {
      bindings::PeCallGil nogil;
      finish_reads(nogil, args, objs, 3);
      in.expert_out = std::move(args[0].ref);
      in.w = std::move(args[1].ref);
      if (!made_out) in.out = std::move(args[2].ref);
      const Check problem = check_combine(in);
      const bool ok = !problem;
      ep::CombineArgs a;
      if (ok) {
        a.expert_out = ptr<const void>(in.expert_out.ptr);
        a.expert_rows = in.expert_out.numel() / cfg_.hidden;
        a.send_rows = ptr<const int32_t>(in.part(kSendRows));
        a.recv_meta = expert_major() ? ptr<const int32_t>(in.part(kRecvMeta)) : nullptr;
        a.recv_summary = ptr<const int32_t>(in.part(kSummary));
        a.weights = !expert_major()     ? nullptr
                    : in.w.present      ? ptr<const float>(in.w.ptr)
                                        : ptr<const float>(in.part(kWeights));
        a.num_tokens = in.num_tokens;
        a.out = ptr<void>(in.out.ptr);
      }
      a.status = ok ? ep::kOk : ep::kBadArgument;
      a.stream = h;
      collective("combine", problem, [&](PeState& s, ep::Op& op) { ep::combine(s, op, a); });
    }
    return result;
  }

  // Returns the rows of every received row of the handle's dispatch (the
  // receive buffer's shape: recv_rows rows, of which the handle's rows_shape
  // are the caller's; rows nothing landed in are zeros).
  py::object redispatch(py::handle rows, py::handle handle, py::handle stream) {
    bindings::DeferredTensor arg;  // this call's input rows, read without the GIL
    bindings::defer(rows, arg);
    CombineInputs in;
    read_handle(handle, in);
    const uintptr_t h = stream_of(stream);
    uintptr_t out = 0;
    py::object result = out_pool_.take({geo_.recv_rows, cfg_.hidden}, h, &out);
    {
      bindings::PeCallGil nogil;
      finish_reads(nogil, &arg, &rows, 1);
      in.expert_out = std::move(arg.ref);
      Check problem = check_handle(in, false);
      if (!problem)
        problem = check_tensor("rows", in.expert_out, {combine_dtype_},
                               {in.num_tokens, cfg_.hidden});
      ep::RedispatchArgs a;
      if (!problem) {
        a.rows = ptr<const void>(in.expert_out.ptr);
        a.num_tokens = in.num_tokens;
        a.send_rows = ptr<const int32_t>(in.part(kSendRows));
        a.recv_meta = expert_major() ? ptr<const int32_t>(in.part(kRecvMeta)) : nullptr;
        a.recv_summary = ptr<const int32_t>(in.part(kSummary));
        a.out = ptr<void>(out);
      }
      a.status = problem ? ep::kBadArgument : ep::kOk;
      a.stream = h;
      collective("redispatch", problem, [&](PeState& s, ep::Op& op) { ep::redispatch(s, op, a); });
    }
    return result;
  }

  // A view of a handle's storage is about to be made (see TensorPool::expose).
  void expose_storage(py::handle storage) { storage_pool_.expose(storage); }

  bool has_redispatch() const {
    std::shared_ptr<PeState> s;
    return ep::has_redispatch(*find(&s));
  }

 private:
  struct DispatchInputs {
    const TensorRef &x, &idx, &w, &scales;
  };

  // The reads `defer` left for after the GIL's release; one that needs
  // Python (a non-contiguous tensor's copy, a tensor the C++ reader does not
  // take) is read with the GIL taken back for it.
  static void finish_reads(bindings::PeCallGil& nogil, bindings::DeferredTensor* args,
                           const py::handle* objs, int n) {
    for (int i = 0; i < n; ++i)
      if (!bindings::finish(args[i]))
        nogil.with_gil([&] {
          args[i].ref = bindings::read_tensor(objs[i], args[i].make_contiguous);
          args[i].obj = nullptr;
        });
  }
  // The handle's four tensors: each from the handle's one storage, unless
  // the caller replaced it (then read and checked on its own).
  enum Part { kSendRows = 0, kRecvMeta = 1, kSummary = 2, kWeights = 3 };
  struct CombineInputs {
    TensorRef expert_out, w, out;
    bool is_handle = false;
    std::string handle_type;
    bool foreign = false, modified = false;
    int64_t num_tokens = -1;  // -1: the handle's count is unusable
    std::vector<int64_t> rows_shape;
    TensorRef storage;
    TensorRef parts[4];
    bool replaced[4] = {};
    uintptr_t part_ptr[4] = {};
    uintptr_t part(Part p) const { return replaced[p] ? parts[p].ptr : part_ptr[p]; }
  };

  // DispatchOutput(handle=EpHandle(...), _owner=owner, _rows=rows); see ep/_op.py.
  py::object make_output(py::handle owner, int64_t rows, int64_t num_tokens, py::object storage) {
    if (!output_.type) throw StateError("EpOp.set_front_end was not called before dispatch");
    using S = SlotClass;
    // Borrowed, not copied: a copy of fixed_rows_ when it is None would move
    // None's reference count, shared by every PE thread (before 3.12).
    py::handle rows_shape = fixed_rows_;
    if (rows_shape.is_none()) {  // the count the host knows: the last call's tuple if it fits
      const int64_t n = std::max<int64_t>(rows, 0);
      if (!last_rows_shape_ || last_rows_ != n) {
        last_rows_shape_ = py::make_tuple(n, cfg_.hidden);
        last_rows_ = n;
      }
      rows_shape = last_rows_shape_;
    }
    py::object o, h;
    take_recycled(&o, &h);
    if (!o) {
      h = handle_.make();
      o = output_.make();
      py::object forgotten;  // released on return: its release may run Python code
      if (recycled_.size() < kPooled) {
        recycled_.push_back(o);
      } else {  // every one kept by its caller: forget one in turn
        forgotten = std::move(recycled_[recycle_next_]);
        recycled_[recycle_next_] = o;
        recycle_next_ = (recycle_next_ + 1) % kPooled;
      }
    }
    handle_.init(h, S::kOpId, stamp_obj_);
    handle_.init(h, S::kLayout, layout_str_);
    handle_.init(h, S::kNumTokens, own_int(num_tokens, num_tokens_obj_));
    handle_.init(h, S::kRowsShape, rows_shape);
    handle_.init(h, S::kDevice, device_obj_);
    handle_.init(h, S::kStorage, std::move(storage));
    handle_.init(h, S::kOp, owner);
    output_.init(o, S::kHandle, std::move(h));
    output_.init(o, S::kOwner, owner);
    output_.init(o, S::kRows, own_int(rows, rows_obj_));
    return o;
  }

  // An int of this op's own, the last one made while the value repeats.
  // CPython before 3.12 shares one object per small int (-5..256) among all
  // threads and counts its references: every PE thread's handle holding
  // "8" would move that object's cache line between the threads' cores.
  struct OwnInt {
    py::object obj;
    int64_t value = 0;
  };
  static py::object own_int(int64_t v, OwnInt& cache) {
    if (cache.obj && cache.value == v) return cache.obj;
    py::object made;
#if PY_VERSION_HEX < 0x030C0000
    if (v >= 0 && v <= static_cast<int64_t>(PyLong_MASK)) {  // one digit
      PyLongObject* o = _PyLong_New(1);
      if (!o) throw py::error_already_set();
      o->ob_digit[0] = static_cast<digit>(v);
      if (v == 0) Py_SET_SIZE(o, 0);
      made = py::reinterpret_steal<py::object>(reinterpret_cast<PyObject*>(o));
    }
#endif
    if (!made) made = py::int_(v);
    cache.obj = made;
    cache.value = v;
    return made;
  }

  // A DispatchOutput this op made whose caller let go of it and of its handle
  // (only the pool holds either; neither class takes weak references), both
  // emptied: made again in place, the two objects cost no allocation, no
  // deallocation and no reference to their (shared) classes.
  void take_recycled(py::object* o, py::object* h) {
    const auto* handle_type = reinterpret_cast<PyTypeObject*>(handle_.type.ptr());
    for (const py::object& e : recycled_) {
      if (Py_REFCNT(e.ptr()) != 1) continue;
      PyObject* handle = output_.get(e, SlotClass::kHandle).ptr();
      if (!handle || Py_TYPE(handle) != handle_type || Py_REFCNT(handle) != 1) continue;
      *h = py::reinterpret_borrow<py::object>(handle);
      *o = e;  // held before the clears, whose releases may run Python code
      output_.clear(o->ptr());
      handle_.clear(h->ptr());
      return;
    }
  }

  template <class T>
  static T* ptr(uintptr_t addr) {
    return reinterpret_cast<T*>(addr);
  }
  template <class T>
  static T* word(uintptr_t base, int64_t off) {
    return reinterpret_cast<T*>(base + static_cast<uintptr_t>(off) * 4);
  }
  bool expert_major() const { return cfg_.layout == ep::Layout::ExpertMajor; }

  // One collective step of the core on this op's PE. A call with a bad
  // argument still enters it (status kBadArgument) so that every PE leaves
  // together; the core then raises on every PE, and this PE sees its own
  // problem, named with `what`. Returns what `step` returns.
  template <class Step, class R = std::invoke_result_t<Step&, PeState&, ep::Op&>>
  R collective(const char* what, const Check& problem, Step&& step) {
    std::shared_ptr<PeState> s;
    auto op = find(&s);
    auto guarded = [&]() -> R {
      try {
        return step(*s, *op);
      } catch (const InvalidArgument&) {
        if (problem) problem->raise(std::string(" (") + what + " aborted on every PE)");
        throw;
      }
    };
    if constexpr (std::is_void_v<R>) {
      guarded();
      if (problem) problem->raise();  // only reached if the core did not raise
    } else {
      R result = guarded();
      if (problem) problem->raise();
      return result;
    }
  }

  // The op and its PE as found when it was made: a call takes no lock that
  // other PE threads take (the runtime's rank map and the PE's op registry
  // both have one). A PE being finalized is seen here or by the core call
  // (which counts itself in the PE's calls in flight first).
  std::shared_ptr<ep::Op> find(std::shared_ptr<PeState>* s) const {
    std::shared_ptr<PeState> pe = pe_.lock();
    if (!pe || pe->closing.load(std::memory_order_acquire))
      throw StateError("this EpDispatchCombine's PE was finalized");
    std::shared_ptr<ep::Op> op = op_.lock();
    if (!op)
      throw StateError("ep: this EpDispatchCombine was closed (op " + std::to_string(id_) +
                       " of PE " + std::to_string(rank_) + ")");
    *s = std::move(pe);
    return op;
  }

  // A raw handle as given, or any stream object through the front end's
  // converter; None: torch's current stream of this PE's device.
  uintptr_t stream_of(py::handle stream) const {
    if (stream.is_none()) return on_cuda_ ? bindings::torch_current_stream(torch_device_) : 0;
    if (PyLong_CheckExact(stream.ptr())) {
      const unsigned long long h = PyLong_AsUnsignedLongLong(stream.ptr());
      if (!PyErr_Occurred()) return h;
      PyErr_Clear();  // negative or too large: the converter says so
    }
    if (!stream_handle_) return stream.cast<uintptr_t>();
    return stream_handle_(stream).cast<uintptr_t>();
  }

  void check_open() const {
    if (closed_) throw StateError("this EpDispatchCombine is closed");
  }

  std::string device_str() const {
    return torch_device_ < 0 ? "cpu" : "cuda:" + std::to_string(torch_device_);
  }

  // A tensor argument of one of `dtypes` and exactly `shape`, on this PE's device.
  Check check_tensor(const std::string& name, const TensorRef& t,
                     std::initializer_list<TorchDType> dtypes,
                     const std::vector<int64_t>& shape) const {
    if (!t.is_tensor)
      return Problem{true, name + " must be a torch.Tensor, got " +
                               (t.present ? t.type_name : std::string("NoneType"))};
    if (std::find(dtypes.begin(), dtypes.end(), t.dtype) == dtypes.end()) {
      std::string want;  // the message is built only when it is raised
      for (TorchDType d : dtypes)
        want += (want.empty() ? "" : " or ") + std::string(bindings::torch_dtype_name(d));
      return value_error(name + " must have dtype " + want + ", got " + t.dtype_str());
    }
    if (t.shape != shape)
      return value_error(name + " must have shape " + bindings::shape_repr(shape) + ", got " +
                         t.shape_repr());
    if (t.device != torch_device_)
      return value_error(name + " is on " + t.device_str() + ", but this PE runs on " +
                         device_str());
    return std::nullopt;
  }

  Check check_dispatch(const DispatchInputs& in) const {
    const TensorRef& x = in.x;
    if (!x.is_tensor)
      return Problem{true, "x must be a torch.Tensor, got " +
                               (x.present ? x.type_name : std::string("NoneType"))};
    if (x.shape.size() != 2 || x.shape[1] != cfg_.hidden)
      return value_error("x must have shape [num_tokens, " + std::to_string(cfg_.hidden) +
                         "], got " + x.shape_repr());
    const int64_t t = x.shape[0];
    if (auto p = check_tensor("x", x, {x_dtype_}, {t, cfg_.hidden})) return p;
    if (auto p = check_tensor("topk_idx", in.idx, {TorchDType::I64, TorchDType::I32},
                              {t, cfg_.topk}))
      return p;
    if (auto p = check_tensor("topk_weights", in.w, {TorchDType::F32}, {t, cfg_.topk})) return p;
    if (cfg_.scale_dim) {
      if (!in.scales.present)
        return value_error("scales are required: the config has scale_dim=" +
                           std::to_string(cfg_.scale_dim));
      if (auto p = check_tensor("scales", in.scales, {scale_dtype_},
                                {t, cfg_.hidden / cfg_.scale_dim}))
        return p;
    } else if (in.scales.present) {
      return value_error("scales given, but the config has scale_dim=0");
    }
    return std::nullopt;
  }

  // Reads a dispatch's handle into `in` (GIL held).
  void read_handle(py::handle handle, CombineInputs& in) {
    // A real subtype check (not isinstance, which a proxy's __class__ can
    // satisfy): the slots are then read at the class's offsets.
    in.is_handle = PyObject_TypeCheck(handle.ptr(),
                                      reinterpret_cast<PyTypeObject*>(handle_.type.ptr())) != 0;
    if (!in.is_handle) {
      in.handle_type = py::str(py::type::handle_of(handle).attr("__name__"));
      return;
    }
    using S = SlotClass;
    auto field = [&](int slot) { return handle_.get(handle, slot); };
    py::handle op_id = field(S::kOpId);
    in.foreign = !op_id || (op_id.ptr() != stamp_obj_.ptr() &&
                            (!PyLong_CheckExact(op_id.ptr()) ||
                             PyLong_AsLongLong(op_id.ptr()) != stamp_));
    if (in.foreign) {
      PyErr_Clear();
      return;
    }
    py::handle layout = field(S::kLayout), count = field(S::kNumTokens),
               rows = field(S::kRowsShape);
    const bool layout_ok = layout && PyUnicode_Check(layout.ptr()) &&
                           (layout.ptr() == layout_str_.ptr() ||
                            PyUnicode_Compare(layout.ptr(), layout_str_.ptr()) == 0);
    in.modified = !layout_ok || !count || !PyLong_CheckExact(count.ptr()) || !rows ||
                  !PyTuple_Check(rows.ptr());
    if (!in.modified) {
      const int64_t n = PyLong_AsLongLong(count.ptr());
      in.modified = n < 0 || n > cfg_.max_tokens;
      if (!in.modified) in.num_tokens = n;
      const Py_ssize_t dims = PyTuple_GET_SIZE(rows.ptr());
      for (Py_ssize_t i = 0; i < dims; ++i)
        in.rows_shape.push_back(PyLong_AsLongLong(PyTuple_GET_ITEM(rows.ptr(), i)));
    }
    PyErr_Clear();
    if (in.modified) return;
    const int part_slot[4] = {S::kSendRows, S::kRecvMeta, S::kSummary, S::kWeights};
    for (int p = 0; p < 4; ++p)
      if (py::handle v = field(part_slot[p])) {
        in.replaced[p] = true;
        in.parts[p] = bindings::read_tensor(v);
      }
    if (py::handle st = field(S::kStorage)) {
      TensorRef& r = in.storage;
      if (storage_pool_.holds(st, words_shape_, &r.ptr)) {  // the one dispatch made: known
        r.present = r.is_tensor = r.contiguous = true;
        r.dtype = TorchDType::I32;
        r.shape = words_shape_;
        r.device = torch_device_;
      } else {
        r = bindings::read_tensor(st, false);
      }
      const int64_t offs[4] = {hl_.send_rows, hl_.recv_meta, hl_.summary, hl_.weights};
      for (int p = 0; p < 4; ++p)
        if (offs[p] >= 0) in.part_ptr[p] = in.storage.ptr + static_cast<uintptr_t>(offs[p]) * 4;
    }
    PyErr_Clear();
  }

  Check check_combine(const CombineInputs& in) const {
    if (auto p = check_handle(in, !in.w.present)) return p;
    const bool em = expert_major();
    if (auto p = check_tensor("expert_out", in.expert_out, {combine_dtype_}, in.rows_shape))
      return p;
    if (!em && in.w.present)
      return value_error(
          "token_major combine sums rows the expert side already weighted: topk_weights "
          "applies to layout='expert_major' only");
    if (em && in.w.present)
      if (auto p = check_tensor("topk_weights", in.w, {TorchDType::F32},
                                {in.num_tokens, cfg_.topk}))
        return p;
    const TensorRef& o = in.out;
    const std::vector<int64_t> shape{in.num_tokens, cfg_.hidden};
    if (!o.is_tensor || o.dtype != combine_dtype_ || o.shape != shape || !o.contiguous ||
        o.device != torch_device_)
      return value_error(std::string("out must be a contiguous ") +
                         bindings::torch_dtype_name(combine_dtype_) + " tensor of shape " +
                         bindings::shape_repr(shape) + " on " + device_str());
    return std::nullopt;
  }

  // The handle's parts (expert-major weights only with `weights`: combine
  // without topk_weights reads the handle's).
  Check check_handle(const CombineInputs& in, bool weights) const {
    if (!in.is_handle)
      return Problem{true, "handle must be the EpHandle of a dispatch, got " + in.handle_type};
    if (in.foreign)
      return value_error("handle comes from another EpDispatchCombine, or from this op on "
                         "another PE");
    if (in.modified)
      return value_error("handle was modified: its layout or num_tokens no longer match this op");
    const bool em = expert_major();
    // The parts that come from the handle's storage need it intact.
    bool from_storage = !in.replaced[kSendRows] || !in.replaced[kSummary] ||
                        (em && (!in.replaced[kRecvMeta] || (weights && !in.replaced[kWeights])));
    if (from_storage) {
      const TensorRef& st = in.storage;
      if (!st.is_tensor || st.dtype != TorchDType::I32 || st.shape.size() != 1 ||
          st.shape[0] != hl_.words || !st.contiguous || st.device != torch_device_)
        return value_error("handle was modified: its storage no longer matches this op");
    }
    const int64_t M = cfg_.max_tokens;
    if (in.replaced[kSendRows])
      if (auto p = check_tensor("handle.send_rows", in.parts[kSendRows], {TorchDType::I32},
                                {M, geo_.send_cols}))
        return p;
    if (em && in.replaced[kRecvMeta])
      if (auto p = check_tensor("handle.recv_meta", in.parts[kRecvMeta], {TorchDType::I32},
                                {geo_.recv_rows, ep::kMetaWords}))
        return p;
    if (in.replaced[kSummary])
      if (auto p = check_tensor("handle.summary", in.parts[kSummary], {TorchDType::I32},
                                {ep::summary_words(geo_.n_pes, geo_.local_experts,
                                                   geo_.slot_words)}))
        return p;
    if (em && weights && in.replaced[kWeights])
      if (auto p = check_tensor("handle.weights", in.parts[kWeights], {TorchDType::F32},
                                {M, cfg_.topk}))
        return p;
    return std::nullopt;
  }

  ep::Config cfg_;
  ep::Geometry geo_;
  ep::HandleLayout hl_;
  std::vector<int64_t> words_shape_;  // the handle storage's shape
  std::string layout_name_;
  uint64_t job_ = 0;
  int rank_ = -1;
  int64_t id_ = 0;
  int64_t stamp_ = 0;  // a handle's op_id: id_ and rank_ together
  uint64_t generation_ = 0;
  std::weak_ptr<PeState> pe_;
  std::weak_ptr<ep::Op> op_;
  bool on_cuda_ = false;
  int torch_device_ = -1;
  TorchDType x_dtype_ = TorchDType::Other, scale_dtype_ = TorchDType::Other,
             combine_dtype_ = TorchDType::Other;
  SlotClass handle_, output_;
  py::object device_obj_, fixed_rows_, layout_str_, stamp_obj_, stream_handle_;
  std::vector<py::object> recycled_;  // outputs this op made (take_recycled)
  size_t recycle_next_ = 0;
  OwnInt num_tokens_obj_, rows_obj_;  // the ints dispatch's results hold (own_int)
  py::object last_rows_shape_;  // (rows, hidden) of the last dispatch, when rows vary
  int64_t last_rows_ = -1;
  bool closed_ = false;
  // Handle storage and combine outputs, recycled once the caller let go of them.
  bindings::TensorPool storage_pool_{TorchDType::I32, -1, 0}, out_pool_{TorchDType::I32, -1, 0};
};

// dispatch and combine as plain CPython functions with the signatures of
// EpDispatchCombine.dispatch / .combine, which the front end sets on each op
// as its own attributes: a call goes from the caller's code straight here,
// past pybind11's argument dispatcher and any Python frame (a sizable share of
// what a call does under the GIL, and the function objects a Python method
// would share between the PE threads' calls). Each function's `self` is a
// capsule of the EpOp (kept alive) and a weak reference to the front end's
// object, which holds the functions: no reference cycle.
struct FastCalls {
  py::object op;         // the EpOp's Python object
  EpOp* ep = nullptr;
  py::object owner_ref;  // weakref to the EpDispatchCombine
};
constexpr const char* kOpCapsule = "symheap.EpOp.calls";

FastCalls* calls_of(PyObject* capsule) {
  return static_cast<FastCalls*>(PyCapsule_GetPointer(capsule, kOpCapsule));
}

// Binds METH_FASTCALL | METH_KEYWORDS arguments to the parameters `names`
// (the first `positional` may come by position, the first `required` must
// come), as Python binds a def's; unset ones stay null. False with Python's
// own TypeError set.
bool bind_args(const char* fn, std::initializer_list<const char*> names, int positional,
               int required, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames,
               PyObject** out) {
  const int n = static_cast<int>(names.size());
  const char* const* name = names.begin();
  if (nargs > positional) {
    PyErr_Format(PyExc_TypeError,
                 "EpDispatchCombine.%s() takes from %d to %d positional arguments but %zd "
                 "were given",
                 fn, required + 1, positional + 1, nargs + 1);
    return false;
  }
  for (Py_ssize_t i = 0; i < nargs; ++i) out[i] = args[i];
  const Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
  for (Py_ssize_t k = 0; k < nkw; ++k) {
    PyObject* key = PyTuple_GET_ITEM(kwnames, k);
    int at = -1;
    for (int i = 0; i < n && at < 0; ++i)
      if (PyUnicode_CompareWithASCIIString(key, name[i]) == 0) at = i;
    if (at < 0) {
      PyErr_Format(PyExc_TypeError, "EpDispatchCombine.%s() got an unexpected keyword argument '%U'",
                   fn, key);
      return false;
    }
    if (out[at]) {
      PyErr_Format(PyExc_TypeError, "EpDispatchCombine.%s() got multiple values for argument '%s'",
                   fn, name[at]);
      return false;
    }
    out[at] = args[nargs + k];
  }
  std::string missing;
  int count = 0;
  for (int i = 0; i < required; ++i)
    if (!out[i]) {
      missing += std::string(missing.empty() ? "" : ", ") + "'" + name[i] + "'";
      ++count;
    }
  if (count) {
    PyErr_Format(PyExc_TypeError, "EpDispatchCombine.%s() missing %d required argument%s: %s", fn,
                 count, count == 1 ? "" : "s", missing.c_str());
    return false;
  }
  for (int i = 0; i < n; ++i)
    if (!out[i]) out[i] = Py_None;
  return true;
}

// The op's front-end object (borrowed).
PyObject* owner_of(const FastCalls& f) {
  PyObject* owner = PyWeakref_GetObject(f.owner_ref.ptr());
  if (!owner) throw py::error_already_set();
  if (owner == Py_None) throw StateError("this EpDispatchCombine is gone");
  return owner;
}

PyObject* fast_dispatch(PyObject* self, PyObject* const* args, Py_ssize_t nargs,
                        PyObject* kwnames) {
  PyObject* a[5] = {};
  if (!bind_args("dispatch", {"x", "topk_idx", "topk_weights", "scales", "stream"}, 4, 3, args,
                 nargs, kwnames, a))
    return nullptr;
  try {
    FastCalls* f = calls_of(self);
    return f->ep->dispatch(owner_of(*f), a[0], a[1], a[2], a[3], a[4]).release().ptr();
  } catch (...) {
    bindings::set_python_error(std::current_exception());
    return nullptr;
  }
}

PyObject* fast_combine(PyObject* self, PyObject* const* args, Py_ssize_t nargs,
                       PyObject* kwnames) {
  PyObject* a[5] = {};
  if (!bind_args("combine", {"expert_out", "handle", "topk_weights", "out", "stream"}, 3, 2, args,
                 nargs, kwnames, a))
    return nullptr;
  try {
    return calls_of(self)->ep->combine(a[0], a[1], a[2], a[3], a[4]).release().ptr();
  } catch (...) {
    bindings::set_python_error(std::current_exception());
    return nullptr;
  }
}

PyMethodDef kFastDispatch{"dispatch", reinterpret_cast<PyCFunction>(fast_dispatch),
                          METH_FASTCALL | METH_KEYWORDS,
                          "dispatch(x, topk_idx, topk_weights, scales=None, *, stream=None): "
                          "see EpDispatchCombine.dispatch"};
PyMethodDef kFastCombine{"combine", reinterpret_cast<PyCFunction>(fast_combine),
                         METH_FASTCALL | METH_KEYWORDS,
                         "combine(expert_out, handle, topk_weights=None, *, out=None, "
                         "stream=None): see EpDispatchCombine.combine"};

// (dispatch, combine) of the EpOp `self` for the front-end object `owner`.
py::tuple fast_calls(py::object self, py::handle owner) {
  auto* f = new FastCalls{self, self.cast<EpOp*>(), py::none()};
  PyObject* capsule = PyCapsule_New(f, kOpCapsule, [](PyObject* c) {
    delete static_cast<FastCalls*>(PyCapsule_GetPointer(c, kOpCapsule));
  });
  if (!capsule) {
    delete f;
    throw py::error_already_set();
  }
  py::object keep = py::reinterpret_steal<py::object>(capsule);
  PyObject* ref = PyWeakref_NewRef(owner.ptr(), nullptr);
  if (!ref) throw py::error_already_set();
  f->owner_ref = py::reinterpret_steal<py::object>(ref);
  PyObject* d = PyCFunction_New(&kFastDispatch, capsule);
  if (!d) throw py::error_already_set();
  py::object dispatch = py::reinterpret_steal<py::object>(d);
  PyObject* c = PyCFunction_New(&kFastCombine, capsule);
  if (!c) throw py::error_already_set();
  return py::make_tuple(dispatch, py::reinterpret_steal<py::object>(c));
}

}  // namespace

SYMHEAP_BINDINGS(ep) {
  py::tuple kernels(3), layouts(3);
  for (int i = 0; i < 3; ++i) {
    kernels[i] = kKernels[i];
    layouts[i] = kLayouts[i];
  }
  m.attr("ep_kernels") = kernels;
  m.attr("ep_layouts") = layouts;
  m.def("ep_dtype_name", [](const std::string& name) {
    return std::string(ep::dtype_name(ep::parse_dtype(name)));
  }, "Canonical name of an EP dtype alias (\"bf16\" -> \"bfloat16\"); ValueError if unknown.");
  m.def("ep_combine_dtype", [](const std::string& name) {
    return std::string(ep::dtype_name(ep::combine_dtype_of(ep::parse_dtype(name))));
  }, "dtype of expert outputs and of combine's result for a dispatch dtype.");
  m.def("ep_validate_config", [](const py::dict& cfg) {
    const std::string kernel = cfg["kernel"].cast<std::string>();
    const std::string layout = cfg["layout"].cast<std::string>();
    if (std::find(std::begin(kKernels), std::end(kKernels), kernel) == std::end(kKernels))
      throw InvalidArgument("EpConfig.kernel must be one of ('intranode', 'low_latency', "
                            "'copy_engine'), got '" + kernel + "'");
    if (std::find(std::begin(kLayouts), std::end(kLayouts), layout) == std::end(kLayouts))
      throw InvalidArgument("EpConfig.layout must be one of ('token_major', 'token_slots', "
                            "'expert_major'), got '" + layout + "'");
    ep::validate_config(config_from(cfg));
  });
  m.def("pe_call_released_ns", [] { return bindings::PeCallGil::released_ns(); },
        "Nanoseconds the calling thread spent in EP calls with the GIL released (its wait "
        "for the GIL back included), cumulative: a call's wall time less its share is the "
        "time it held the GIL.");
  m.def("ep_local_grid_blocks", [] {
    auto s = Runtime::instance().current();
    return ep::local_grid_blocks(*s);
  }, "Most blocks one grid of the EP kernels uses on the calling thread's PE.");
  m.def("ep_geometry", [](const py::dict& cfg, int n_pes) {
    ep::Config c = config_from(cfg);
    return geometry_dict(c, ep::make_geometry(c, n_pes));
  });
  // Ops by (job, rank, id), the way the XLA FFI front end (symheap.jax) holds them:
  // its handlers take every buffer from XLA, so it needs no EpOp.
  m.def("ep_create", [](const py::dict& cfg, size_t ws_offset, size_t ws_bytes,
                        bool caller_outputs) {
    auto s = Runtime::instance().current();
    ep::Config c = config_from(cfg);
    py::gil_scoped_release nogil;
    return ep::create(*s, c, ws_offset, ws_bytes, caller_outputs);
  }, py::arg("cfg"), py::arg("ws_offset"), py::arg("ws_bytes"), py::arg("caller_outputs") = false);
  m.def("ep_destroy", [](uint64_t job, int rank, int64_t id) {
    auto s = Runtime::instance().slot_of_rank(job, rank);
    if (!s) return;
    py::gil_scoped_release nogil;
    ep::destroy(*s, id);
  });
  m.def("ep_check", [](uint64_t job, int rank, int64_t id, uintptr_t stream, bool sync) {
    std::shared_ptr<PeState> s;
    auto op = ep::find(job, rank, id, &s);
    py::gil_scoped_release nogil;
    ep::check(*s, *op, stream, sync);
  });
  // Raises if the op failed earlier (its calls would raise that at once).
  m.def("ep_ready", [](uint64_t job, int rank, int64_t id) {
    std::shared_ptr<PeState> s;
    auto op = ep::find(job, rank, id, &s);
    ep::ready(*s, *op);
  });
  // Device operations the op's calls issued so far (None: the cpu implementation).
  m.def("ep_device_ops", [](uint64_t job, int rank, int64_t id) -> py::object {
    std::shared_ptr<PeState> s;
    auto op = ep::find(job, rank, id, &s);
    if (!op->impl) return py::none();
    const ep::DeviceOps o = op->impl->device_ops();
    py::dict d;
    d["launches"] = o.launches;
    d["memsets"] = o.memsets;
    d["copies"] = o.copies;
    d["stream_waits"] = o.stream_waits;
    d["host_syncs"] = o.host_syncs;
    return d;
  });
  // XLA runs the op's calls on its own streams, which the front end cannot name:
  // before the op's memory is freed, wait for everything the PE's device runs.
  m.def("ep_wait_device", [](uint64_t job, int rank) {
    auto s = Runtime::instance().slot_of_rank(job, rank);
    if (!s) return;
    py::gil_scoped_release nogil;
    Runtime::instance().backend().drain(s->device);
  });
  py::class_<EpOp>(m, "EpOp")
      .def(py::init<const py::dict&, size_t, size_t, py::object>(), py::arg("config"),
           py::arg("ws_offset"), py::arg("ws_bytes"), py::arg("handle_type"))
      .def_property_readonly("id", &EpOp::id)
      .def("destroy", &EpOp::destroy)
      .def("check", &EpOp::check, py::arg("stream"), py::arg("sync"))
      .def("set_front_end", &EpOp::set_front_end, py::arg("output_type"), py::arg("device"),
           py::arg("fixed_rows"), py::arg("stream_handle"))
      .def("dispatch", &EpOp::dispatch, py::arg("owner"), py::arg("x"), py::arg("topk_idx"),
           py::arg("topk_weights"), py::arg("scales"), py::arg("stream"))
      .def("combine", &EpOp::combine, py::arg("expert_out"), py::arg("handle"),
           py::arg("topk_weights"), py::arg("out"), py::arg("stream"))
      .def("redispatch", &EpOp::redispatch, py::arg("rows"), py::arg("handle"),
           py::arg("stream"))
      .def("expose_storage", &EpOp::expose_storage, py::arg("storage"))
      .def("fast_calls", &fast_calls, py::arg("owner"),
           "(dispatch, combine) for the EpDispatchCombine `owner`, with its methods' signatures")
      .def_property_readonly("has_redispatch", &EpOp::has_redispatch);
}
