// mamba3_kernels._C: compiled front end of the SISO operators (the ctypes path in siso.py, in C++).
//
// The Python package calls libmamba3 through ctypes; for the small SISO kernels the per-call host
// cost of that path (seven torch allocations from Python, DLTensor packing with struct, the
// ctypes call) exceeds the GPU time. This module does the same work from at::Tensor metadata:
// the same argument pre-checks with the same messages as siso.py (_required, _rank_error), the
// same output shapes/dtypes, the same DLTensors as _dlpack.pack (inputs whose last dimension is
// not unit-stride are copied to a contiguous tensor; fresh outputs are passed compact, strides
// NULL, with the device of the last packed input), the same per-key workspace-size cache, the
// same device switch and stream (the current stream of the first tensor's CUDA device), and the
// same exceptions (ValueError for MAMBA3_ERROR_INVALID_ARGUMENT, RuntimeError prefixed with the
// status name otherwise, both carrying mamba3_last_error()). Every argument check of the library
// runs unchanged: this module only calls the C API.
//
// No CUDA header is needed: the current stream comes from c10's device-guard interface
// (c10::Stream::native_handle() is the cudaStream_t), so one source serves CPU and CUDA builds of
// torch, and the module links only c10, torch_cpu, torch_python and libmamba3.
#include <Python.h>
#include <dlfcn.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/Stream.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <pybind11/pybind11.h>
#include <torch/csrc/autograd/python_variable.h>

#include <mamba3/mamba3.h>

namespace py = pybind11;

namespace {

constexpr int kMaxDims = 6;         // the library's kMaxDims (_dltensor.MAX_DIMS)
constexpr int32_t kDLExtDevice = 12;  // "some other device": the library rejects it by name

// ------------------------------------------------------------------------------ errors

[[noreturn]] void raise_status(mamba3_status st) {
  const char* m = mamba3_last_error();
  std::string msg = m ? m : "";
  if (st == MAMBA3_ERROR_INVALID_ARGUMENT) throw py::value_error(msg);
  const char* name = nullptr;
  switch (st) {
    case MAMBA3_ERROR_UNSUPPORTED: name = "MAMBA3_ERROR_UNSUPPORTED"; break;
    case MAMBA3_ERROR_CUDA: name = "MAMBA3_ERROR_CUDA"; break;
    case MAMBA3_ERROR_INTERNAL: name = "MAMBA3_ERROR_INTERNAL"; break;
    default: break;
  }
  std::string prefix = name ? std::string(name) : "status " + std::to_string(static_cast<int>(st));
  throw std::runtime_error(prefix + ": " + msg);
}

[[noreturn]] void required(const char* name) {
  throw py::value_error(std::string(name) + " is required but was None");
}

// siso._rank_error: "{name}: expected rank {n} [{expected}], got shape [a, b, c]"
[[noreturn]] void rank_error(const char* name, const at::Tensor& t, int rank,
                             const char* expected) {
  // (std::string, not std::ostringstream: this path crashed in the module built on the H200
  // against torch 2.11 with g++ 13, cause not found; see docs/PERF.md, session 9.)
  std::string s = std::string(name) + ": expected rank " + std::to_string(rank) + " [" +
                  expected + "], got shape [";
  const int64_t nd = t.dim();
  for (int64_t i = 0; i < nd; ++i) {
    if (i) s += ", ";
    s += std::to_string(t.size(i));
  }
  s += "]";
  throw py::value_error(s);
}

// ------------------------------------------------------------------------------ arguments

// A tensor argument: None -> nullptr. Anything else must be a torch.Tensor.
const at::Tensor* tensor_arg(py::handle h, const char* name) {
  if (h.is_none()) return nullptr;
  if (!THPVariable_Check(h.ptr())) {
    throw py::type_error(std::string(name) + ": expected a torch.Tensor or None, got " +
                         Py_TYPE(h.ptr())->tp_name);
  }
  return &THPVariable_Unpack(h.ptr());
}

py::object wrap(at::Tensor t) { return py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(t))); }

// ------------------------------------------------------------------------------ DLTensors

// _dlpack.dl_dtype: the DLPack (code, bits) of a torch dtype; types the library does not take
// still get a faithful code so that the library's error names the argument.
DLDataType dl_dtype(c10::ScalarType s) {
  DLDataType d;
  d.lanes = 1;
  switch (s) {
    case c10::ScalarType::Half: d.code = kDLFloat; d.bits = 16; return d;
    case c10::ScalarType::BFloat16: d.code = kDLBfloat; d.bits = 16; return d;
    case c10::ScalarType::Float: d.code = kDLFloat; d.bits = 32; return d;
    case c10::ScalarType::Double: d.code = kDLFloat; d.bits = 64; return d;
    case c10::ScalarType::Char: d.code = kDLInt; d.bits = 8; return d;
    case c10::ScalarType::Short: d.code = kDLInt; d.bits = 16; return d;
    case c10::ScalarType::Int: d.code = kDLInt; d.bits = 32; return d;
    case c10::ScalarType::Long: d.code = kDLInt; d.bits = 64; return d;
    case c10::ScalarType::Byte: d.code = kDLUInt; d.bits = 8; return d;
    case c10::ScalarType::Bool: d.code = kDLUInt; d.bits = 8; return d;
    case c10::ScalarType::ComplexFloat: d.code = kDLComplex; d.bits = 64; return d;
    case c10::ScalarType::ComplexDouble: d.code = kDLComplex; d.bits = 128; return d;
    default: break;
  }
  d.code = c10::isComplexType(s) ? kDLComplex : (c10::isFloatingType(s) ? kDLFloat : kDLUInt);
  d.bits = static_cast<uint8_t>(c10::elementSize(s) * 8);
  return d;
}

// The DLTensors of one call (at most 19 tensors). Shapes and strides point into the tensors'
// own size/stride arrays, which stay valid while `hold` keeps the tensors alive.
template <int N>
struct Pack {
  DLTensor dl[N];
  const at::Tensor* t[N] = {};
  at::Tensor hold[N];  // contiguous copies of inputs with a non-unit-stride last dimension
  int32_t dev_type = 0, dev_id = 0;  // device of the last packed input (for compact outputs)

  static void check_rank(const at::Tensor& x, const char* name) {
    if (x.dim() > kMaxDims) {
      throw py::value_error(std::string(name) + ": rank " + std::to_string(x.dim()) +
                            " is not supported (at most " + std::to_string(kMaxDims) + ")");
    }
  }

  // An input or a caller's tensor, strides as they are (contiguous copy only if `make_unit`).
  void strided(int i, const at::Tensor* x, const char* name, bool make_unit) {
    t[i] = x;
    if (!x) return;
    check_rank(*x, name);
    const int64_t nd = x->dim();
    if (make_unit && nd) {
      const int64_t st = x->strides()[nd - 1];
      if (st != 1 && x->sizes()[nd - 1] != 1) {
        hold[i] = x->contiguous();
        x = &hold[i];
        t[i] = x;
      }
    }
    if (x->is_cuda()) {
      dev_type = kDLCUDA;
      dev_id = x->get_device();
    } else if (x->is_cpu()) {
      dev_type = kDLCPU;
      dev_id = 0;
    } else {
      dev_type = kDLExtDevice;
      dev_id = 0;
    }
    DLTensor& d = dl[i];
    d.data = x->data_ptr();
    d.device.device_type = static_cast<DLDeviceType>(dev_type);
    d.device.device_id = dev_id;
    d.ndim = static_cast<int32_t>(nd);
    d.dtype = dl_dtype(x->scalar_type());
    d.shape = const_cast<int64_t*>(x->sizes().data());
    d.strides = const_cast<int64_t*>(x->strides().data());
    d.byte_offset = 0;
  }

  // A freshly allocated (contiguous) output: strides NULL (compact), device of the inputs.
  void compact(int i, const at::Tensor* x, const char* name) {
    t[i] = x;
    if (!x) return;
    check_rank(*x, name);
    DLTensor& d = dl[i];
    d.data = x->data_ptr();
    d.device.device_type = static_cast<DLDeviceType>(dev_type);
    d.device.device_id = dev_id;
    d.ndim = static_cast<int32_t>(x->dim());
    d.dtype = dl_dtype(x->scalar_type());
    d.shape = const_cast<int64_t*>(x->sizes().data());
    d.strides = nullptr;
    d.byte_offset = 0;
  }

  DLTensor* operator[](int i) { return t[i] ? &dl[i] : nullptr; }
};

// The device switch and stream of siso._*_launch: CUDA tensors run on the current stream of their
// device, made the current device for the call; CPU tensors get a NULL stream.
struct LaunchContext {
  c10::OptionalDeviceGuard guard;
  void* stream = nullptr;
  explicit LaunchContext(const at::Tensor& first) {
    if (first.is_cuda()) {
      const c10::Device dev = first.device();
      guard.reset_device(dev);
      stream = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(dev).native_handle();
    }
  }
};

// ------------------------------------------------------------------------------ compute_dqktheta

const char* const kDqkNames[19] = {"q", "k", "scale", "gamma", "q_bias", "k_bias", "angles",
                                   "dq_in", "dk_in", "dqk", "d_ok_state", "cu_seqlens",
                                   "dq", "dk", "dq_bias", "dk_bias", "dangles", "dscale", "dgamma"};

// Workspace bytes depend only on shapes, dtypes, chunk size and device (siso._dqktheta_workspace):
// asked from the library once per key.
std::mutex g_ws_mutex;
std::map<std::vector<int64_t>, size_t> g_ws_cache;

size_t dqktheta_workspace(const at::Tensor& q, const at::Tensor& scale, int64_t chunk_size,
                          const at::Tensor* cu) {
  std::vector<int64_t> key;
  key.reserve(24);
  for (int64_t s : q.sizes()) key.push_back(s);
  key.push_back(static_cast<int64_t>(q.scalar_type()));
  for (int64_t s : scale.sizes()) key.push_back(s);
  key.push_back(static_cast<int64_t>(q.device().type()));
  key.push_back(q.device().index());
  key.push_back(chunk_size);
  if (cu) {
    key.push_back(cu->dim());
    for (int64_t s : cu->sizes()) key.push_back(s);
    key.push_back(static_cast<int64_t>(cu->scalar_type()));
  } else {
    key.push_back(-1);
  }
  {
    std::lock_guard<std::mutex> lock(g_ws_mutex);
    auto it = g_ws_cache.find(key);
    if (it != g_ws_cache.end()) return it->second;
  }
  Pack<3> p;
  p.strided(0, &q, "q", false);
  p.strided(1, &scale, "scale", false);
  p.strided(2, cu, "cu_seqlens", false);
  size_t n = 0;
  const mamba3_status st = mamba3_compute_dqktheta_workspace_size(p[0], p[1], chunk_size, p[2], &n);
  if (st != MAMBA3_OK) raise_status(st);
  std::lock_guard<std::mutex> lock(g_ws_mutex);
  if (g_ws_cache.size() > 4096) g_ws_cache.clear();  // bounded: shapes of a run are few
  g_ws_cache.emplace(std::move(key), n);
  return n;
}

py::tuple compute_dqktheta(py::handle q_, py::handle k_, py::handle scale_, py::handle gamma_,
                           py::handle q_bias_, py::handle k_bias_, py::handle angles_,
                           py::handle dq_in_, py::handle dk_in_, py::handle dqk_,
                           py::handle d_ok_state_, int64_t chunk_size, py::handle cu_seqlens_) {
  const py::handle in[12] = {q_, k_, scale_, gamma_, q_bias_, k_bias_, angles_, dq_in_, dk_in_,
                             dqk_, d_ok_state_, cu_seqlens_};
  const at::Tensor* a[12];
  for (int i = 0; i < 12; ++i) a[i] = tensor_arg(in[i], kDqkNames[i]);
  const at::Tensor *q = a[0], *scale = a[2], *gamma = a[3], *angles = a[6], *dq_in = a[7];

  // siso._dqktheta_alloc / _dqktheta_sizes
  if (!q) required("q");
  if (!scale) required("scale");
  if (!angles) required("angles");
  if (q->dim() != 4) rank_error("q", *q, 4, "B,S,G,N");
  if (scale->dim() != 3) rank_error("scale", *scale, 3, "B,H,S");
  if (angles->dim() != 4) rank_error("angles", *angles, 4, "B,S,H,A");
  if (!gamma) required("gamma");
  if (!dq_in) required("dq_in");
  const int64_t B = q->size(0), S = q->size(1), G = q->size(2), N = q->size(3);
  const int64_t H = scale->size(1), A = angles->size(3);
  const at::TensorOptions o = q->options();
  at::Tensor out[7] = {
      at::empty({B, S, G, N}, o.dtype(dq_in->scalar_type())),
      at::empty({B, S, G, N}, o.dtype(dq_in->scalar_type())),
      at::empty({H, N}, o.dtype(at::kFloat)),
      at::empty({H, N}, o.dtype(at::kFloat)),
      at::empty({B, S, H, A}, o.dtype(angles->scalar_type())),
      at::empty({B, H, S}, o.dtype(scale->scalar_type())),
      at::empty({B, H, S}, o.dtype(gamma->scalar_type())),
  };

  // siso._dqktheta_launch
  LaunchContext ctx(*q);
  const size_t ws_bytes = dqktheta_workspace(*q, *scale, chunk_size, a[11]);
  at::Tensor ws;
  if (ws_bytes) ws = at::empty({static_cast<int64_t>(ws_bytes)}, o.dtype(at::kByte));
  Pack<19> p;
  for (int i = 0; i < 12; ++i) p.strided(i, a[i], kDqkNames[i], true);
  for (int i = 0; i < 7; ++i) p.compact(12 + i, &out[i], kDqkNames[12 + i]);
  mamba3_status st;
  {
    py::gil_scoped_release nogil;  // as ctypes does: CPU calls can take long
    st = mamba3_compute_dqktheta(p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7], p[8], p[9],
                                 p[10], chunk_size, p[11], p[12], p[13], p[14], p[15], p[16],
                                 p[17], p[18], ws_bytes ? ws.data_ptr() : nullptr, ws_bytes,
                                 ctx.stream);
  }
  if (st != MAMBA3_OK) raise_status(st);
  py::tuple r(7);
  for (int i = 0; i < 7; ++i) r[i] = wrap(std::move(out[i]));
  return r;
}

// ------------------------------------------------------------------ compute_ddt_dtrap_dinput_states

const char* const kDdtNames[13] = {"dscale", "dgamma", "dt", "trap", "d_issm_state",
                                   "input_k_state", "input_v_state", "cu_seqlens", "ddt",
                                   "dtrap", "d_input_ssm_state", "d_input_k_state",
                                   "d_input_v_state"};

py::tuple compute_ddt(py::handle dscale_, py::handle dgamma_, py::handle dt_, py::handle trap_,
                      py::handle d_issm_state_, py::handle input_k_state_,
                      py::handle input_v_state_, py::handle cu_seqlens_) {
  const py::handle in[8] = {dscale_, dgamma_, dt_, trap_, d_issm_state_, input_k_state_,
                            input_v_state_, cu_seqlens_};
  const at::Tensor* a[8];
  for (int i = 0; i < 8; ++i) a[i] = tensor_arg(in[i], kDdtNames[i]);
  const at::Tensor *dscale = a[0], *dissm = a[4];

  // siso._ddt_alloc / _ddt_sizes
  if (!dscale) required("dscale");
  if (dscale->dim() != 3) rank_error("dscale", *dscale, 3, "B,H,S");
  if (dissm && dissm->dim() != 4) rank_error("d_issm_state", *dissm, 4, "nseq,H,P,N");
  const at::TensorOptions o = dscale->options();
  at::Tensor out[5];
  out[0] = at::empty(dscale->sizes(), o.dtype(at::kFloat));
  out[1] = at::empty(dscale->sizes(), o.dtype(at::kFloat));
  if (dissm) {
    const int64_t nseq = dissm->size(0), H = dissm->size(1), P = dissm->size(2),
                  N = dissm->size(3);
    out[2] = at::empty({nseq, H, P, N}, o.dtype(dissm->scalar_type()));
    out[3] = at::empty({nseq, H, N}, o.dtype(at::kFloat));
    out[4] = at::empty({nseq, H, P}, o.dtype(at::kFloat));
  }

  // siso._ddt_launch
  LaunchContext ctx(*dscale);
  Pack<13> p;
  for (int i = 0; i < 8; ++i) p.strided(i, a[i], kDdtNames[i], true);
  for (int i = 0; i < 5; ++i) p.compact(8 + i, out[i].defined() ? &out[i] : nullptr, kDdtNames[8 + i]);
  mamba3_status st;
  {
    py::gil_scoped_release nogil;
    st = mamba3_compute_ddt_dtrap_dinput_states(p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7],
                                                p[8], p[9], p[10], p[11], p[12], ctx.stream);
  }
  if (st != MAMBA3_OK) raise_status(st);
  py::tuple r(5);
  for (int i = 0; i < 5; ++i) r[i] = out[i].defined() ? wrap(std::move(out[i])) : py::none();
  return r;
}

// Path of the libmamba3 this module is bound to (the package checks that it is the library the
// ctypes layer loaded).
std::string bound_library_path() {
  Dl_info info;
  if (dladdr(reinterpret_cast<void*>(&mamba3_version), &info) && info.dli_fname) {
    return info.dli_fname;
  }
  return "";
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "mamba3_kernels._C: compiled front end of the SISO operators (see siso.py)";
  m.def("compute_dqktheta", &compute_dqktheta, py::arg("q"), py::arg("k"), py::arg("scale"),
        py::arg("gamma"), py::arg("q_bias"), py::arg("k_bias"), py::arg("angles"),
        py::arg("dq_in"), py::arg("dk_in"), py::arg("dqk"), py::arg("d_ok_state"),
        py::arg("chunk_size"), py::arg("cu_seqlens"));
  m.def("compute_ddt_dtrap_dinput_states", &compute_ddt, py::arg("dscale"), py::arg("dgamma"),
        py::arg("dt"), py::arg("trap"), py::arg("d_issm_state"), py::arg("input_k_state"),
        py::arg("input_v_state"), py::arg("cu_seqlens"));
  m.def("library_path", &bound_library_path);
  m.def("library_version", [] { return std::string(mamba3_version()); });
  // The torch this module was compiled against: it must be the running one (checked by _ext.py).
  m.attr("torch_version") = MAMBA3_TORCH_VERSION_STRING;
}
