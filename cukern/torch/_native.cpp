// The native eager path of cukern.torch: a call signature's launch plans, run from C++ under a
// C++ autograd node. The Python path (an autograd.Function over the array functions) works the
// plans out and records them the first time it sees a signature; cukern/torch/_native.py hands
// them here, and later calls of that signature cost a key, a map lookup, the allocations and the
// driver launches, with no Python in the forward or the backward.
//
// No CUDA headers: the driver entry points come from Python (ctypes on libcuda), the device
// guard and the current stream from c10's device-guard interface, so this builds wherever
// PyTorch's C++ headers and a host compiler are.
#include <torch/extension.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/graph_task.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

namespace py = pybind11;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

namespace {

using LaunchKernel = int (*)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void*,
                             void**, void**);
using CtxGetCurrent = int (*)(void**);
using CtxSetCurrent = int (*)(void*);
using DeviceGet = int (*)(int*, int);
using PrimaryCtxRetain = int (*)(void**, int);
using TensorMapEncodeTiled = int (*)(void*, int, unsigned, void*, const uint64_t*, const uint64_t*, const unsigned*,
                                     const unsigned*, int, int, int, int);

struct Driver {
  LaunchKernel launch = nullptr;
  CtxGetCurrent ctx_get = nullptr;
  CtxSetCurrent ctx_set = nullptr;
  DeviceGet device_get = nullptr;
  PrimaryCtxRetain primary_retain = nullptr;
  TensorMapEncodeTiled encode_tiled = nullptr;
} driver;

void check(int status, const char* what) {
  TORCH_CHECK(status == 0, "cukern native path: ", what, " failed: CUDA driver error ", status);
}

// A thread that made no CUDA runtime call yet (the autograd engine's device thread, whose tensors
// all came from torch's cache) has no context current, and a driver launch there fails with
// CUDA_ERROR_INVALID_CONTEXT: bind the device's primary context (the runtime's) the first time.
void bind_context(int device) {
  thread_local std::vector<bool> bound;
  if (device < static_cast<int>(bound.size()) && bound[device]) return;
  void* current = nullptr;
  check(driver.ctx_get(&current), "cuCtxGetCurrent");
  if (current == nullptr) {
    int dev = 0;
    void* primary = nullptr;
    check(driver.device_get(&dev, device), "cuDeviceGet");
    check(driver.primary_retain(&primary, dev), "cuDevicePrimaryCtxRetain");
    check(driver.ctx_set(primary), "cuCtxSetCurrent");
  }
  if (device >= static_cast<int>(bound.size())) bound.resize(device + 1, false);
  bound[device] = true;
}

// ---- plans -------------------------------------------------------------------------------------

struct PointerSlot {
  int64_t at;       // byte offset of the pointer in the parameter buffer
  int64_t buffer;   // the plan's buffer it points into
  int64_t offset;   // plus this many bytes
};

struct MapSlot {   // a CUtensorMap parameter, encoded per call for the buffer's address
  int64_t at, buffer;
  int data_type;
  unsigned rank;
  uint64_t dims[5], strides[4];
  unsigned box[5];
  int swizzle, l2_promotion;
};

// A step: a kernel launch or a fill of buffers (scratch that starts at zero).
enum class Kind { launch, fill };

struct Step {
  Kind kind = Kind::launch;
  std::vector<int64_t> buffers;   // fill: the buffers
  double value = 0;               // fill: the value
  void* function = nullptr;
  unsigned grid[3], block[3], smem;
  std::vector<uint8_t> params;   // the C parameter list; constants packed, pointers filled per call
  std::vector<PointerSlot> pointers;
  std::vector<MapSlot> maps;
  // With tensor maps the launch passes a pointer to each parameter (kernelParams): handed over
  // as one buffer, their TMA loads fault (cukern/_kernels.py, Launch).
  std::vector<int64_t> param_offsets;
};

struct Alloc {   // a buffer the plan allocates (absent: the slot stays undefined)
  bool absent = true;
  std::vector<int64_t> sizes, strides;
  at::ScalarType dtype = at::kFloat;
};

struct Plan {
  int64_t inputs = 0;
  std::vector<Alloc> allocs;
  std::vector<Step> steps;
};

// Where a buffer the plan is given comes from.
enum class From : int64_t { none = 0, arg = 1, output = 2, grad = 3, saved = 4 };
struct Ref {
  From from;
  int64_t index;
};

struct Entry {
  int device = 0;
  bool grad = false;
  std::vector<int64_t> tensor_args;  // the op arguments that are tensors, in order (the node's inputs)
  Plan forward;
  std::vector<Ref> forward_inputs;   // arg j or none, a plan input each
  std::vector<int64_t> outputs;      // the op's outputs (visible first): forward buffer indices
  int64_t visible = 1;
  std::vector<Ref> saved;            // arg j or output k
  Plan backward;
  std::vector<Ref> backward_inputs;  // grad g, saved s or none, a plan input each
  std::vector<int64_t> gradients;    // per op argument: backward buffer index, or -1
  std::vector<std::vector<int64_t>> grad_strides;   // the layout the backward plan reads each gradient in
};

struct KeyHash {
  size_t operator()(const std::vector<int64_t>& k) const noexcept {
    uint64_t h = 1469598103934665603ull;
    for (int64_t v : k) h = (h ^ static_cast<uint64_t>(v)) * 1099511628211ull;
    return static_cast<size_t>(h);
  }
};

// Entries are never removed (a node in a pending graph points at its entry); a workload that
// keeps making new signatures stops registering at the limit and runs the Python path for them.
constexpr size_t kMaxEntries = 8192;
std::unordered_map<std::vector<int64_t>, std::unique_ptr<Entry>, KeyHash> entries;
std::unordered_map<std::vector<int64_t>, bool, KeyHash> declined;   // signatures the Python path keeps
std::vector<std::unique_ptr<Entry>> retired;   // cleared entries, kept for nodes that point at them
int64_t hits = 0;

void* current_stream(int device) {
  const auto* impl = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
  return impl->getStreamNativeHandle(impl->getStream(c10::Device(c10::DeviceType::CUDA, device)));
}

std::vector<at::Tensor> run(const Plan& plan, std::vector<at::Tensor> bufs, int device) {
  const auto options = at::TensorOptions().device(c10::Device(c10::DeviceType::CUDA, device));
  for (const Alloc& a : plan.allocs) {
    bufs.push_back(a.absent ? at::Tensor() : at::empty_strided(a.sizes, a.strides, options.dtype(a.dtype)));
  }
  if (plan.steps.empty()) return bufs;
  // (the driver launches into the current context: the device's, as PyTorch's ops run theirs)
  c10::DeviceGuard guard(c10::Device(c10::DeviceType::CUDA, device));
  bind_context(device);
  void* stream = current_stream(device);
  alignas(64) uint8_t params[4096];   // (a CUtensorMap parameter is 64-byte aligned)
  for (const Step& s : plan.steps) {
    if (s.kind == Kind::fill) {
      for (int64_t b : s.buffers)
        if (bufs[b].defined()) bufs[b].fill_(s.value);
      continue;
    }
    std::memcpy(params, s.params.data(), s.params.size());
    for (const PointerSlot& p : s.pointers) {
      const at::Tensor& b = bufs[p.buffer];
      uintptr_t ptr = b.defined() ? reinterpret_cast<uintptr_t>(b.data_ptr()) + p.offset : 0;
      std::memcpy(params + p.at, &ptr, sizeof ptr);
    }
    for (const MapSlot& m : s.maps) {
      const unsigned ones[5] = {1, 1, 1, 1, 1};
      check(driver.encode_tiled(params + m.at, m.data_type, m.rank, bufs[m.buffer].data_ptr(), m.dims, m.strides,
                                m.box, ones, 0, m.swizzle, m.l2_promotion, 0),
            "cuTensorMapEncodeTiled");
    }
    if (!s.param_offsets.empty()) {
      void* pointers[512];
      for (size_t i = 0; i < s.param_offsets.size(); ++i) pointers[i] = params + s.param_offsets[i];
      check(driver.launch(s.function, s.grid[0], s.grid[1], s.grid[2], s.block[0], s.block[1], s.block[2], s.smem,
                          stream, pointers, nullptr),
            "cuLaunchKernel");
      continue;
    }
    size_t size = s.params.size();
    void* extra[] = {reinterpret_cast<void*>(1), params, reinterpret_cast<void*>(2), &size, nullptr};
    check(driver.launch(s.function, s.grid[0], s.grid[1], s.grid[2], s.block[0], s.block[1], s.block[2], s.smem,
                        stream, nullptr, extra),
          "cuLaunchKernel");
  }
  return bufs;
}

// ---- the call's signature ---------------------------------------------------------------------

constexpr int64_t kTensor = 1, kNone = 2, kBool = 3, kInt = 4, kFloat = 5, kStr = 6;

// Everything a plan depends on: each tensor's shape, strides, dtype, device and 16-byte
// alignment (not its address), each scalar's value. False for an argument of another kind.
bool signature(int64_t op, const py::tuple& args, std::vector<int64_t>& key, std::vector<at::Tensor>& tensors,
               bool& requires_grad) {
  key.push_back(op);
  key.push_back(0);   // the grad flag, set by the caller
  // (torch.use_deterministic_algorithms: a plan may depend on it, attention's backward does)
  key.push_back(at::globalContext().deterministicAlgorithms());
  requires_grad = false;
  for (const py::handle& h : args) {
    PyObject* o = h.ptr();
    if (THPVariable_Check(o)) {
      const at::Tensor& t = THPVariable_Unpack(o);
      key.push_back(kTensor);
      key.push_back(static_cast<int64_t>(t.scalar_type()));
      key.push_back(static_cast<int64_t>(t.device().type()));
      key.push_back(t.device().index());
      key.push_back(t.dim());
      for (int64_t s : t.sizes()) key.push_back(s);
      for (int64_t s : t.strides()) key.push_back(s);
      key.push_back(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0);
      requires_grad |= t.requires_grad();
      tensors.push_back(t);
    } else if (o == Py_None) {
      key.push_back(kNone);
      tensors.emplace_back();
    } else if (PyBool_Check(o)) {
      key.push_back(kBool);
      key.push_back(o == Py_True);
      tensors.emplace_back();
    } else if (PyLong_Check(o)) {
      int overflow = 0;
      long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
      if (overflow) return false;
      key.push_back(kInt);
      key.push_back(v);
      tensors.emplace_back();
    } else if (PyFloat_Check(o)) {
      double v = PyFloat_AS_DOUBLE(o);
      int64_t bits;
      std::memcpy(&bits, &v, sizeof bits);
      key.push_back(kFloat);
      key.push_back(bits);
      tensors.emplace_back();
    } else if (PyUnicode_Check(o)) {   // (the whole string: a hash could collide)
      Py_ssize_t n = 0;
      const char* text = PyUnicode_AsUTF8AndSize(o, &n);
      if (text == nullptr) {
        PyErr_Clear();
        return false;
      }
      key.push_back(kStr);
      key.push_back(n);
      for (Py_ssize_t i = 0; i < n; i += 8) {
        int64_t word = 0;
        std::memcpy(&word, text + i, std::min<Py_ssize_t>(8, n - i));
        key.push_back(word);
      }
      tensors.emplace_back();
    } else {
      return false;
    }
  }
  return true;
}

std::vector<at::Tensor> forward_inputs(const Entry& e, const std::vector<at::Tensor>& args) {
  std::vector<at::Tensor> bufs;
  bufs.reserve(e.forward.inputs + e.forward.allocs.size());
  for (const Ref& r : e.forward_inputs) bufs.push_back(r.from == From::arg ? args[r.index] : at::Tensor());
  return bufs;
}

// The node's inputs are the defined tensors among the arguments (an undefined tensor cannot be
// an autograd input); `in` puts them back at their argument positions.
struct PlanFunction : public torch::autograd::Function<PlanFunction> {
  static variable_list forward(AutogradContext* ctx, int64_t entry, at::TensorList tensors) {
    const Entry& e = *reinterpret_cast<const Entry*>(entry);
    std::vector<at::Tensor> in(e.gradients.size());
    for (size_t i = 0; i < e.tensor_args.size(); ++i) in[e.tensor_args[i]] = tensors[i];
    auto bufs = run(e.forward, forward_inputs(e, in), e.device);
    variable_list saved;
    saved.reserve(e.saved.size());
    for (const Ref& r : e.saved) saved.push_back(r.from == From::arg ? in[r.index] : bufs[e.outputs[r.index]]);
    ctx->save_for_backward(saved);
    ctx->saved_data["entry"] = entry;
    variable_list out;
    for (int64_t k = 0; k < e.visible; ++k) out.push_back(bufs[e.outputs[k]]);
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const Entry& e = *reinterpret_cast<const Entry*>(ctx->saved_data["entry"].toInt());
    auto saved = ctx->get_saved_variables();
    std::vector<at::Tensor> bufs;
    bufs.reserve(e.backward.inputs + e.backward.allocs.size());
    for (const Ref& r : e.backward_inputs) {
      if (r.from == From::grad) {
        // The plan was made for a gradient laid out densely, 16-byte aligned, with the strides
        // of the first call's; one in another layout is copied into that one.
        at::Tensor g = grads[r.index];
        const auto& strides = e.grad_strides[r.index];
        if (g.strides() != at::IntArrayRef(strides) || reinterpret_cast<uintptr_t>(g.data_ptr()) % 16 != 0) {
          g = at::empty_strided(g.sizes(), strides, g.options()).copy_(g);
        }
        bufs.push_back(g);
      } else if (r.from == From::saved) {
        bufs.push_back(saved[r.index]);
      } else {
        bufs.emplace_back();
      }
    }
    // A donating backward (cukern/_family.py, TorchOp) writes its gradients into saved buffers
    // its forward made: where autograd keeps the graph for another pass, into copies of them.
    if (torch::autograd::get_current_graph_task_keep_graph()) {
      std::vector<bool> copied(bufs.size(), false);
      for (int64_t b : e.gradients) {
        if (b >= 0 && b < e.backward.inputs && e.backward_inputs[b].from == From::saved && !copied[b]) {
          bufs[b] = bufs[b].clone();
          copied[b] = true;
        }
      }
    }
    bufs = run(e.backward, std::move(bufs), e.device);
    variable_list out;
    out.reserve(e.tensor_args.size() + 1);
    out.emplace_back();   // (the entry argument)
    for (int64_t j : e.tensor_args) {
      int64_t b = e.gradients[j];
      out.push_back(b >= 0 ? bufs[b] : at::Tensor());
    }
    return out;
  }
};

// ---- Python -----------------------------------------------------------------------------------

// The visible outputs of op `op` on `args` (one tensor, or a tuple); None when the signature has
// no entry (the caller runs the Python path and records it), False when it was declined (the
// caller runs the Python path).
py::object call(int64_t op, const py::tuple& args) {
  std::vector<int64_t> key;
  key.reserve(64);
  std::vector<at::Tensor> tensors;
  tensors.reserve(args.size());
  bool requires_grad = false;
  if (!signature(op, args, key, tensors, requires_grad)) return py::none();
  const bool grad = requires_grad && at::GradMode::is_enabled();
  key[1] = grad;
  auto it = entries.find(key);
  if (it == entries.end()) return declined.count(key) ? py::object(py::bool_(false)) : py::object(py::none());
  const Entry& e = *it->second;
  ++hits;
  variable_list out;
  {
    py::gil_scoped_release release;
    if (grad) {
      std::vector<at::Tensor> defined;
      defined.reserve(e.tensor_args.size());
      for (int64_t j : e.tensor_args) defined.push_back(tensors[j]);
      out = PlanFunction::apply(reinterpret_cast<int64_t>(&e), at::TensorList(defined));
    } else {
      at::AutoGradMode no_grad(false);
      auto bufs = run(e.forward, forward_inputs(e, tensors), e.device);
      for (int64_t k = 0; k < e.visible; ++k) out.push_back(bufs[e.outputs[k]]);
    }
  }
  if (out.size() == 1) return py::cast(out[0]);
  return py::tuple(py::cast(out));
}

// The call's key (op, args, and whether it records a graph), for `add` and `decline` later.
py::object key(int64_t op, const py::tuple& args, bool grad) {
  std::vector<int64_t> k;
  std::vector<at::Tensor> tensors;
  bool requires_grad = false;
  if (!signature(op, args, k, tensors, requires_grad)) return py::none();
  k[1] = grad;
  return py::cast(k);
}

Plan plan_from(const py::tuple& p) {
  // (inputs, allocs: [None | layout(a tensor the plan allocated)], steps: [(function, grid,
  //  block, smem, params bytes, [(at, buffer, offset)], maps, param offsets) | (kind, buffers,
  //  value)])
  Plan plan;
  plan.inputs = p[0].cast<int64_t>();
  for (const py::handle& a : p[1].cast<py::list>()) {
    Alloc alloc;
    if (!a.is_none()) {
      auto t = a.cast<py::tuple>();
      alloc.absent = false;
      alloc.sizes = t[0].cast<std::vector<int64_t>>();
      alloc.strides = t[1].cast<std::vector<int64_t>>();
      alloc.dtype = static_cast<at::ScalarType>(t[2].cast<int64_t>());
    }
    plan.allocs.push_back(std::move(alloc));
  }
  const int64_t nbufs = plan.inputs + static_cast<int64_t>(plan.allocs.size());
  for (const py::handle& h : p[2].cast<py::list>()) {
    auto t = h.cast<py::tuple>();
    Step s;
    if (py::isinstance<py::str>(t[0])) {   // ("fill", buffers, value)
      const std::string kind = t[0].cast<std::string>();
      TORCH_CHECK(kind == "fill", "cukern native path: unknown step ", kind);
      s.kind = Kind::fill;
      s.buffers = t[1].cast<std::vector<int64_t>>();
      s.value = t[2].cast<double>();
      for (int64_t b : s.buffers) TORCH_CHECK(b >= 0 && b < nbufs, "cukern native path: bad step buffer");
      plan.steps.push_back(std::move(s));
      continue;
    }
    s.function = reinterpret_cast<void*>(t[0].cast<uintptr_t>());
    auto grid = t[1].cast<std::vector<unsigned>>(), block = t[2].cast<std::vector<unsigned>>();
    TORCH_CHECK(grid.size() == 3 && block.size() == 3, "cukern native path: grid and block need 3 dims");
    for (int i = 0; i < 3; ++i) s.grid[i] = grid[i], s.block[i] = block[i];
    s.smem = t[3].cast<unsigned>();
    std::string params = t[4].cast<std::string>();
    TORCH_CHECK(params.size() <= 4096, "cukern native path: parameters above 4096 bytes");
    s.params.assign(params.begin(), params.end());
    for (const py::handle& q : t[5].cast<py::list>()) {
      auto v = q.cast<std::vector<int64_t>>();
      TORCH_CHECK(v[0] >= 0 && v[0] + 8 <= static_cast<int64_t>(s.params.size()), "cukern native path: bad slot");
      s.pointers.push_back({v[0], v[1], v[2]});
    }
    // maps: (at, buffer, data type, rank, dims x5, strides x4, box x5, swizzle, L2 promotion)
    for (const py::handle& q : t[6].cast<py::list>()) {
      auto v = q.cast<std::vector<int64_t>>();
      TORCH_CHECK(v.size() == 20 && v[0] % 64 == 0 && v[0] + 128 <= static_cast<int64_t>(s.params.size()) &&
                      v[3] >= 1 && v[3] <= 5,
                  "cukern native path: bad tensor map slot");
      MapSlot m{};
      m.at = v[0], m.buffer = v[1], m.data_type = static_cast<int>(v[2]), m.rank = static_cast<unsigned>(v[3]);
      for (int i = 0; i < 5; ++i) m.dims[i] = v[4 + i], m.box[i] = static_cast<unsigned>(v[13 + i]);
      for (int i = 0; i < 4; ++i) m.strides[i] = v[9 + i];
      m.swizzle = static_cast<int>(v[18]), m.l2_promotion = static_cast<int>(v[19]);
      s.maps.push_back(m);
    }
    s.param_offsets = t[7].cast<std::vector<int64_t>>();
    TORCH_CHECK(s.param_offsets.size() <= 512, "cukern native path: too many parameters");
    TORCH_CHECK(s.maps.empty() || !s.param_offsets.empty(), "cukern native path: tensor maps need kernelParams");
    plan.steps.push_back(std::move(s));
  }
  return plan;
}

std::vector<Ref> refs_from(const py::list& l) {
  std::vector<Ref> out;
  for (const py::handle& h : l) {
    auto v = h.cast<std::vector<int64_t>>();
    out.push_back({static_cast<From>(v[0]), v[1]});
  }
  return out;
}

bool add(const std::vector<int64_t>& key, int64_t device, const std::vector<int64_t>& tensor_args,
         const py::tuple& forward, const py::list& forward_inputs, const std::vector<int64_t>& outputs,
         int64_t visible, const py::list& saved, const py::object& backward, const py::list& backward_inputs,
         const std::vector<int64_t>& gradients, const std::vector<std::vector<int64_t>>& grad_strides) {
  if (entries.size() >= kMaxEntries) return false;
  auto e = std::make_unique<Entry>();
  e->device = static_cast<int>(device);
  e->grad = key[1] != 0;
  e->tensor_args = tensor_args;
  e->forward = plan_from(forward);
  e->forward_inputs = refs_from(forward_inputs);
  e->outputs = outputs;
  e->visible = visible;
  e->saved = refs_from(saved);
  if (!backward.is_none()) e->backward = plan_from(backward.cast<py::tuple>());
  e->backward_inputs = refs_from(backward_inputs);
  e->gradients = gradients;
  e->grad_strides = grad_strides;
  TORCH_CHECK(!e->grad || static_cast<int64_t>(grad_strides.size()) == visible,
              "cukern native path: one gradient layout a visible output");
  TORCH_CHECK(static_cast<int64_t>(e->forward_inputs.size()) == e->forward.inputs &&
                  static_cast<int64_t>(e->backward_inputs.size()) == e->backward.inputs,
              "cukern native path: plan inputs do not match their sources");
  entries[key] = std::move(e);
  declined.erase(key);
  return true;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "cukern.torch's native eager path (see cukern/torch/_native.py)";
  m.def("init", [](uintptr_t launch, uintptr_t ctx_get, uintptr_t ctx_set, uintptr_t device_get,
                   uintptr_t primary_retain, uintptr_t encode_tiled) {
    driver.encode_tiled = reinterpret_cast<TensorMapEncodeTiled>(encode_tiled);
    driver.launch = reinterpret_cast<LaunchKernel>(launch);
    driver.ctx_get = reinterpret_cast<CtxGetCurrent>(ctx_get);
    driver.ctx_set = reinterpret_cast<CtxSetCurrent>(ctx_set);
    driver.device_get = reinterpret_cast<DeviceGet>(device_get);
    driver.primary_retain = reinterpret_cast<PrimaryCtxRetain>(primary_retain);
  });
  m.def("call", &call);
  m.def("layout", [](const at::Tensor& t) {
    return py::make_tuple(t.sizes().vec(), t.strides().vec(), static_cast<int64_t>(t.scalar_type()));
  });
  m.def("key", &key);
  m.def("add", &add);
  m.def("decline", [](const std::vector<int64_t>& key) { declined[key] = true; });
  m.def("hits", []() { return hits; });
  m.def("size", []() { return entries.size(); });
  m.def("clear", []() {
    for (auto& kv : entries) retired.push_back(std::move(kv.second));
    entries.clear();
    declined.clear();
    hits = 0;
  });
}
