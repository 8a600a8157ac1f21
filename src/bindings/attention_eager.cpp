// The eager entry of fixed-length attention calls: one C++ call per forward
// (and per backward) of a cached plan. The tensors are read through the
// C-level reader, outputs come from pools instead of torch.empty, the stream
// is torch's current one, cuDNN or the own kernels are picked here, and the
// op runs with the GIL released. Anything this entry does not handle (inputs
// that need a copy to meet the kernels' layout) makes it return None, and the
// Python wrapper takes its general path.
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <deque>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "bindings/plain_values.hpp"
#include "bindings/registry.hpp"
#include "bindings/torch_tensor.hpp"
#include "ops/attention/attention.hpp"
#include "ops/attention/path_choice.hpp"
#ifdef SYMHEAP_WITH_CUDNN
#include "ops/attention/cudnn_attention.hpp"
#endif
#include "symheap/errors.hpp"

namespace py = pybind11;
using namespace symheap;
using namespace symheap::attention;
using bindings::exact_int;
using bindings::plain_number;
using bindings::contiguous_strides;
using bindings::TensorPool;
using bindings::TensorRef;
using bindings::TorchDType;

namespace {

using bindings::kPoolMaxBytes;
constexpr size_t kPooled = bindings::kPoolEntries;

TorchDType torch_dtype(DType t) {
  switch (t) {
    case DType::F32: return TorchDType::F32;
    case DType::F16: return TorchDType::F16;
    case DType::BF16: return TorchDType::BF16;
  }
  return TorchDType::Other;
}

void fill(Tensor& t, const TensorRef& r) {
  t.data = reinterpret_cast<void*>(r.ptr);
  t.batch_stride = r.strides[0];
  t.row_stride = r.strides[1];
  t.head_stride = r.strides[2];
}

void fill(Tensor& t, uintptr_t ptr, const std::vector<int64_t>& strides) {
  t.data = reinterpret_cast<void*>(ptr);
  t.batch_stride = strides[0];
  t.row_stride = strides[1];
  t.head_stride = strides[2];
}

// The plan's path, already resolved by the core's rule (choose_path).
Path parse_path(const std::string& name) {
  for (Path p : {Path::Auto, Path::Cudnn, Path::Own})
    if (name == path_name(p)) return p;
  throw InvalidArgument("attention: backend must be one of " + path_names() + ", got '" + name + "'");
}

// One fixed-length plan's eager calls. Shared by the threads calling on its
// device; the pools are used under the GIL, the cuDNN outcomes under a mutex
// that is never held across a Python call.
class EagerAttention {
 public:
  EagerAttention(const Args& plan, const std::string& backend)
      : plan_(plan),
        backend_(parse_path(backend)),
        dtype_(torch_dtype(plan.q.dtype)) {
    out_shape_ = {plan.batch, plan.seqlen_q, plan.heads_q, plan.head_dim};
    lse_shape_ = {plan.batch, plan.heads_q, plan.seqlen_q};
    out_strides_ = contiguous_strides(out_shape_);
    lse_strides_ = contiguous_strides(lse_shape_);
    int64_t out_bytes = static_cast<int64_t>(dtype_size(plan.q.dtype));
    for (int64_t d : out_shape_) out_bytes *= d;
    pool_outputs_ = out_bytes <= kPoolMaxBytes;
  }

  // (out, lse) of q, k, v, or None when an input needs a copy first. With
  // `pooled`, out and lse may be tensors an earlier call returned and its
  // caller released; without (autograd saves and returns them), fresh ones.
  // `inference`: torch's inference mode is on; its tensors are pooled apart
  // (an inference tensor cannot be saved for a backward outside that mode).
  py::object forward(py::handle q, py::handle k, py::handle v, bool pooled, bool poison,
                     bool inference) {
    Inputs in;
    if (!read_inputs(q, k, v, in)) return py::none();
    return forward_read(in, pooled, poison, inference);
  }

  // forward() of inputs already read (each with its address, device and strides).
  py::object forward_read(const TensorRef& q, const TensorRef& k, const TensorRef& v, bool pooled,
                          bool poison, bool inference) {
    Inputs in{q, k, v, q.device};
    if (!usable(in.q, in.device) || !usable(in.k, in.device) || !usable(in.v, in.device))
      return py::none();
    return forward_read(in, pooled, poison, inference);
  }

 private:
  struct Inputs {
    TensorRef q, k, v;
    int device = -1;
  };

  py::object forward_read(Inputs& in, bool pooled, bool poison, bool inference) {
    const uintptr_t stream = stream_of(in.device);
    Pools& pools = pools_of(in.device, inference);
    uintptr_t out_ptr = 0, lse_ptr = 0;
    py::object out = output(pools.out, pooled && pool_outputs_, out_shape_, stream, &out_ptr);
    py::object lse = output(pools.lse, pooled && pool_outputs_, lse_shape_, stream, &lse_ptr);
    if (poison) {  // tests: any element the op forgets to write stays NaN
      out.attr("fill_")(NAN);
      lse.attr("fill_")(NAN);
    }
    Args a = plan_;
    fill(a.q, in.q);
    fill(a.k, in.k);
    fill(a.v, in.v);
    fill(a.out, out_ptr, out_strides_);
    a.lse = reinterpret_cast<float*>(lse_ptr);
    a.lse_batch_stride = lse_strides_[0];
    a.lse_head_stride = lse_strides_[1];
    if (in.device < 0) {
      py::gil_scoped_release nogil;
      forward_cpu(a, 0);
    } else {
      launch(a, false, in.device, stream, pools, {&in.q, &in.k, &in.v});
    }
    return py::make_tuple(std::move(out), std::move(lse));
  }

 public:
  // (dq, dk, dv) of a forward's saved q, k, v, out, lse and the incoming
  // dout, or None when dout needs a copy first. The gradients are fresh
  // tensors (autograd keeps them).
  py::object backward(py::handle q, py::handle k, py::handle v, py::handle out, py::handle lse,
                      py::handle dout, bool poison) {
    Inputs in;
    if (!read_inputs(q, k, v, in)) return py::none();
    const TensorRef to = bindings::read_address(out), tl = bindings::read_address(lse),
                    td = bindings::read_address(dout);
    if (!usable(td, in.device) || !usable(to, in.device)) return py::none();
    const uintptr_t stream = stream_of(in.device);
    Pools& pools = pools_of(in.device, false);
    py::object dq = output(pools.out, false, out_shape_, stream);
    const std::vector<int64_t> kv_shape{plan_.batch, plan_.seqlen_k, plan_.heads_kv, plan_.head_dim};
    py::object dk = output(pools.out, false, kv_shape, stream);
    py::object dv = output(pools.out, false, kv_shape, stream);
    if (poison)
      for (const py::object& t : {dq, dk, dv}) t.attr("fill_")(NAN);
    const std::vector<int64_t> kv_strides = contiguous_strides(kv_shape);
    Args a = plan_;
    a.dout.dtype = a.dq.dtype = a.dk.dtype = a.dv.dtype = plan_.q.dtype;
    fill(a.q, in.q);
    fill(a.k, in.k);
    fill(a.v, in.v);
    fill(a.out, to);
    fill(a.dout, td);
    a.lse = reinterpret_cast<float*>(tl.ptr);
    a.lse_batch_stride = tl.strides[0];
    a.lse_head_stride = tl.strides[1];
    fill(a.dq, bindings::tensor_data_ptr(dq), out_strides_);
    fill(a.dk, bindings::tensor_data_ptr(dk), kv_strides);
    fill(a.dv, bindings::tensor_data_ptr(dv), kv_strides);
    if (in.device < 0) {
      py::gil_scoped_release nogil;
      backward_cpu(a, 0);
    } else {
      launch(a, true, in.device, stream, pools, {&in.q, &in.k, &in.v, &to, &tl, &td});
    }
    return py::make_tuple(std::move(dq), std::move(dk), std::move(dv));
  }

 private:
  struct Pools {
    int device;
    bool inference;
    TensorPool out, lse, workspace;
  };
  // What cuDNN said about one call signature (direction and strides; shapes,
  // dtypes and options are the plan's): its workspace bytes, or why not.
  struct CudnnCall {
    bool backward;
    std::vector<int64_t> strides;  // of the inputs, one after another
    bool ok;
    size_t bytes;
    std::string reason;
  };

  // The layout the kernels read (what _plan.prepare makes): unit stride on
  // the head dim and, on CUDA, 16-byte aligned rows.
  static bool usable(const TensorRef& r, int device) {
    if (r.device == bindings::kOtherDevice || r.device != device) return false;
    if (r.strides.size() < 4 || r.strides[3] != 1) return false;
    if (device < 0) return true;
    if (r.ptr % 16) return false;
    for (int d = 0; d < 3; ++d)
      if (r.strides[d] % 8) return false;
    return true;
  }

  static bool read_inputs(py::handle q, py::handle k, py::handle v, Inputs& in) {
    in.q = bindings::read_address(q);
    in.k = bindings::read_address(k);
    in.v = bindings::read_address(v);
    in.device = in.q.device;
    return usable(in.q, in.device) && usable(in.k, in.device) && usable(in.v, in.device);
  }

  static uintptr_t stream_of(int device) {
    return device < 0 ? 0 : bindings::torch_current_stream(device);
  }

  // GIL held (the plan's pools are only touched under it).
  Pools& pools_of(int device, bool inference) {
    for (Pools& p : pools_)
      if (p.device == device && p.inference == inference) return p;
    pools_.push_back(Pools{device, inference, TensorPool(dtype_, device, kPooled),
                           TensorPool(TorchDType::F32, device, kPooled),
                           TensorPool(TorchDType::I64, device, kPooled, /*internal=*/true)});
    return pools_.back();
  }

  // A fresh or pooled tensor of the pool's dtype and device; `data`, if given,
  // receives its address.
  static py::object output(TensorPool& pool, bool pooled, const std::vector<int64_t>& shape,
                           uintptr_t stream, uintptr_t* data = nullptr) {
    return pooled ? pool.take(shape, stream, data) : pool.make(shape, data);
  }

  // A CUDA call: through cuDNN when the plan allows it and cuDNN takes the
  // call (its outcome kept per signature), else the own kernels.
  void launch(Args& a, bool backward, int device, uintptr_t stream, Pools& pools,
              std::initializer_list<const TensorRef*> inputs) {
#ifdef SYMHEAP_WITH_CUDA
    void* s = reinterpret_cast<void*>(stream);
#ifdef SYMHEAP_WITH_CUDNN
    if (backend_ != Path::Own) {
      const std::shared_ptr<const CudnnCall> call = cudnn_outcome(a, backward, device, inputs);
      if (call->ok) {
        uintptr_t w_ptr = 0;
        py::object ws = workspace(pools, call->bytes, stream, &w_ptr);
        void* w = reinterpret_cast<void*>(w_ptr);
        py::gil_scoped_release nogil;
        if (backward)
          cudnn::backward(a, device, s, w, call->bytes);
        else
          cudnn::forward(a, device, s, w, call->bytes);
        return;
      }
      if (backend_ == Path::Cudnn)
        throw Unsupported("attention: backend='cudnn' cannot run this call: " + call->reason);
    }
#else
    (void)inputs;
#endif
    if (!backward) {
      py::gil_scoped_release nogil;
      forward_cuda(a, device, s);
      return;
    }
    const size_t bytes = backward_cuda_workspace_bytes(a);
    uintptr_t w_ptr = 0;
    py::object ws = workspace(pools, bytes, stream, &w_ptr);
    void* w = reinterpret_cast<void*>(w_ptr);
    py::gil_scoped_release nogil;
    backward_cuda(a, device, s, w, bytes);
#else
    (void)a, (void)backward, (void)device, (void)stream, (void)pools, (void)inputs;
    throw InvalidArgument("attention: q is on a CUDA device but symheap was built without CUDA");
#endif
  }

  // Device scratch of `bytes` on the caller's stream: pooled (the call drops
  // it right after the launch, and a later call on the same stream runs after
  // this one), or from torch's caching allocator when large.
  static py::object workspace(Pools& pools, size_t bytes, uintptr_t stream, uintptr_t* data) {
    const int64_t words = static_cast<int64_t>((std::max<size_t>(bytes, 1) + 7) / 8);
    return output(pools.workspace, words * 8 <= kPoolMaxBytes, {words}, stream, data);
  }

#ifdef SYMHEAP_WITH_CUDNN
  std::shared_ptr<const CudnnCall> cudnn_outcome(const Args& a, bool backward, int device,
                                                 std::initializer_list<const TensorRef*> inputs) {
    std::vector<int64_t> strides;
    strides.reserve(inputs.size() * 4);
    for (const TensorRef* r : inputs) strides.insert(strides.end(), r->strides.begin(), r->strides.end());
    {
      std::lock_guard<std::mutex> lock(cudnn_mutex_);
      for (const auto& c : cudnn_calls_)
        if (c->backward == backward && c->strides == strides) return c;
    }
    cudnn::Prepared p;
    {
      py::gil_scoped_release nogil;
      p = cudnn::prepare(a, backward, device);
    }
    auto c = std::make_shared<const CudnnCall>(
        CudnnCall{backward, std::move(strides), p.ok, p.workspace_bytes, p.reason});
    std::lock_guard<std::mutex> lock(cudnn_mutex_);
    if (cudnn_calls_.size() >= kMaxCudnnCalls) cudnn_calls_.clear();
    cudnn_calls_.push_back(c);
    return c;
  }
  static constexpr size_t kMaxCudnnCalls = 32;
  std::mutex cudnn_mutex_;
  std::vector<std::shared_ptr<const CudnnCall>> cudnn_calls_;
#endif

  const Args plan_;
  const Path backend_;
  const TorchDType dtype_;
  std::vector<int64_t> out_shape_, lse_shape_, out_strides_, lse_strides_;
  bool pool_outputs_ = true;
  // deques: a reference taken before a GIL release stays valid when another
  // thread adds an entry meanwhile.
  std::deque<Pools> pools_;
};

// What selects a fixed-length plan without tensor options: the inputs'
// shapes, dtypes and devices and the scalar options, as the front end's plan
// cache keys them (symheap/attention/_plan.py: cached_plan). Built only from
// plain values (bool, int, float, None, str): any other kind of argument
// leaves the call to the front end.
struct CallKey {
  std::vector<int64_t> shapes;  // q, k, v: rank, then sizes
  int dtypes[3] = {}, devices[3] = {};
  bool causal = false, deterministic = false, has_scale = false;
  int64_t window[2] = {};
  double scale = 0, softcap = 0;
  std::string backend;  // as given, else $SYMHEAP_ATTN_BACKEND ("" when unset)

  bool operator==(const CallKey& o) const {
    return shapes == o.shapes && std::equal(dtypes, dtypes + 3, o.dtypes) &&
           std::equal(devices, devices + 3, o.devices) && causal == o.causal &&
           deterministic == o.deterministic && has_scale == o.has_scale &&
           window[0] == o.window[0] && window[1] == o.window[1] &&
           (!has_scale || scale == o.scale) && softcap == o.softcap && backend == o.backend;
  }
};

// Fills `key` from a call's arguments; false when one is not a plain value.
bool make_key(const TensorRef* t, py::handle causal, py::handle window, py::handle scale,
              py::handle softcap, py::handle deterministic, py::handle backend, CallKey& key) {
  for (int i = 0; i < 3; ++i) {
    if (!t[i].is_tensor || t[i].dtype == TorchDType::Other) return false;
    key.shapes.push_back(static_cast<int64_t>(t[i].shape.size()));
    key.shapes.insert(key.shapes.end(), t[i].shape.begin(), t[i].shape.end());
    key.dtypes[i] = static_cast<int>(t[i].dtype);
    key.devices[i] = t[i].device;
  }
  if (!PyBool_Check(causal.ptr()) || !PyBool_Check(deterministic.ptr())) return false;
  key.causal = causal.ptr() == Py_True;
  key.deterministic = deterministic.ptr() == Py_True;
  if (!PyTuple_CheckExact(window.ptr()) || PyTuple_GET_SIZE(window.ptr()) != 2) return false;
  for (int i = 0; i < 2; ++i)
    if (!exact_int(PyTuple_GET_ITEM(window.ptr(), i), &key.window[i])) return false;
  key.has_scale = !scale.is_none();
  if (key.has_scale && !plain_number(scale, &key.scale)) return false;
  if (!plain_number(softcap, &key.softcap)) return false;
  if (backend.is_none()) {
    const char* env = std::getenv(kPathEnv);
    key.backend = env ? env : "";
  } else {
    if (!PyUnicode_CheckExact(backend.ptr())) return false;
    Py_ssize_t n = 0;
    const char* s = PyUnicode_AsUTF8AndSize(backend.ptr(), &n);
    if (!s) {
      PyErr_Clear();
      return false;
    }
    key.backend.assign(s, static_cast<size_t>(n));
  }
  return true;
}

// The eager entries of the plans the front end made, by CallKey: a repeat
// no-grad call finds its entry here in one C++ call. Used under the GIL.
class EagerCalls {
 public:
  static EagerCalls& instance() {
    static EagerCalls* calls = new EagerCalls;  // outlives module teardown
    return *calls;
  }

  // flash_attn_func's no-grad path for a call whose plan the front end made
  // before: out, or (out, lse) with `return_lse`; None when this call is not
  // one (a tensor option, a new key, an input that requires grad or needs a
  // copy), and the front end takes its general path.
  py::object call(py::handle q, py::handle k, py::handle v, py::handle causal, py::handle window,
                  py::handle scale, py::handle softcap, py::handle deterministic,
                  py::handle backend, bool return_lse, bool poison) {
    const TensorRef t[3] = {bindings::read_layout(q), bindings::read_layout(k),
                            bindings::read_layout(v)};
    CallKey key;
    if (!make_key(t, causal, window, scale, softcap, deterministic, backend, key))
      return py::none();
    const Entry* found = find(key);
    if (!found) return py::none();
    // Held for the call: another thread may drop the entry while the GIL is released.
    const py::object owner = found->owner;
    EagerAttention* e = found->eager;
    if (bindings::torch_grad_enabled() &&
        (bindings::requires_grad(q) || bindings::requires_grad(k) || bindings::requires_grad(v)))
      return py::none();
    py::object r = e->forward_read(t[0], t[1], t[2], true, poison, bindings::torch_inference_mode());
    if (r.is_none() || return_lse) return r;
    return py::reinterpret_borrow<py::tuple>(r)[0];
  }

  // Records the eager entry of the plan made for these arguments.
  void remember(py::handle q, py::handle k, py::handle v, py::handle causal, py::handle window,
                py::handle scale, py::handle softcap, py::handle deterministic,
                py::handle backend, py::object eager) {
    const TensorRef t[3] = {bindings::read_layout(q), bindings::read_layout(k),
                            bindings::read_layout(v)};
    CallKey key;
    if (!make_key(t, causal, window, scale, softcap, deterministic, backend, key)) return;
    if (find(key)) return;
    if (entries_.size() >= kMaxEntries) entries_.clear();
    EagerAttention* e = eager.cast<EagerAttention*>();
    entries_.push_back(Entry{std::move(key), std::move(eager), e});
  }

  void forget() { entries_.clear(); }

 private:
  struct Entry {
    CallKey key;
    py::object owner;  // keeps `eager` alive
    EagerAttention* eager;
  };
  static constexpr size_t kMaxEntries = 256;

  const Entry* find(const CallKey& key) const {
    // Most recent first: a model's few shapes repeat.
    for (size_t i = entries_.size(); i-- > 0;)
      if (entries_[i].key == key) return &entries_[i];
    return nullptr;
  }

  std::vector<Entry> entries_;
};

}  // namespace

SYMHEAP_BINDINGS(attention_eager) {
  py::class_<EagerAttention>(m, "AttentionEager")
      .def(py::init<const Args&, const std::string&>(), py::arg("plan_args"), py::arg("backend"))
      .def("forward", &EagerAttention::forward, py::arg("q"), py::arg("k"), py::arg("v"),
           py::arg("pooled"), py::arg("poison") = false, py::arg("inference") = false)
      .def("backward", &EagerAttention::backward, py::arg("q"), py::arg("k"), py::arg("v"),
           py::arg("out"), py::arg("lse"), py::arg("dout"), py::arg("poison") = false);
  m.def(
      "attention_eager_call",
      [](py::handle q, py::handle k, py::handle v, py::handle causal, py::handle window,
         py::handle scale, py::handle softcap, py::handle deterministic, py::handle backend,
         bool return_lse, bool poison) {
        return EagerCalls::instance().call(q, k, v, causal, window, scale, softcap,
                                           deterministic, backend, return_lse, poison);
      },
      "flash_attn_func without tensor options and without autograd, when an earlier call "
      "planned it (attention_eager_remember); None otherwise.");
  m.def(
      "attention_eager_remember",
      [](py::handle q, py::handle k, py::handle v, py::handle causal, py::handle window,
         py::handle scale, py::handle softcap, py::handle deterministic, py::handle backend,
         py::object eager) {
        EagerCalls::instance().remember(q, k, v, causal, window, scale, softcap, deterministic,
                                        backend, std::move(eager));
      });
  m.def("attention_eager_forget", [] { EagerCalls::instance().forget(); },
        "Drops every entry attention_eager_remember recorded.");
  // os.environ.get(name, "") at a tenth of its cost (os.environ writes reach
  // the C environment): the plan cache reads the backend variable every call.
  m.def(
      "attention_env",
      [](py::handle name) -> py::object {
        const char* key = PyUnicode_AsUTF8(name.ptr());
        if (!key) throw py::error_already_set();
        const char* value = std::getenv(key);
        return py::reinterpret_steal<py::object>(PyUnicode_FromString(value ? value : ""));
      },
      py::arg("name"));
}
