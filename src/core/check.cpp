#include "core/check.hpp"

#include <sstream>
#include <vector>

namespace mamba3 {

void check_present(const TensorView& v) {
  MAMBA3_CHECK_ARG(v.present(), v.name, " is required but was not given (NULL)");
}

void check_shape(const TensorView& v, std::initializer_list<int64_t> dims,
                 std::initializer_list<const char*> names) {
  // Fast path first: the message is only built on failure (this runs on every call).
  bool ok = v.ndim == static_cast<int>(dims.size());
  for (size_t i = 0; ok && i < dims.size(); ++i) ok = v.shape[i] == dims.begin()[i];
  if (ok) return;
  std::vector<int64_t> d(dims);
  std::vector<const char*> n(names);
  std::ostringstream expect;
  expect << '[';
  for (size_t i = 0; i < d.size(); ++i) {
    expect << (i ? "," : "");
    if (i < n.size() && n[i] && *n[i]) expect << n[i] << '=';
    expect << d[i];
  }
  expect << ']';
  MAMBA3_CHECK_ARG(v.ndim == static_cast<int>(d.size()), v.name, ": expected rank ", d.size(), " ",
                   expect.str(), ", got rank ", v.ndim, " ", v.shape_str());
  for (size_t i = 0; i < d.size(); ++i)
    MAMBA3_CHECK_ARG(v.shape[i] == d[i], v.name, ": expected shape ", expect.str(), ", got ",
                     v.shape_str(), " (dimension ", i, ")");
}

void check_dtype_in(const TensorView& v, std::initializer_list<DType> allowed) {
  for (DType t : allowed)
    if (t == v.dtype) return;
  std::ostringstream os;
  bool first = true;
  for (DType t : allowed) {
    os << (first ? "" : ", ") << dtype_name(t);
    first = false;
  }
  MAMBA3_FAIL(MAMBA3_ERROR_INVALID_ARGUMENT, v.name, ": dtype ", dtype_name(v.dtype),
              " is not supported (expected one of: ", os.str(), ")");
}

void check_dtype_eq(const TensorView& v, DType expected) {
  MAMBA3_CHECK_ARG(v.dtype == expected, v.name, ": expected dtype ", dtype_name(expected), ", got ",
                   dtype_name(v.dtype));
}

void check_float_io(const TensorView& v) {
  check_dtype_in(v, {DType::F16, DType::BF16, DType::F32});
}

DeviceKind check_same_device(std::initializer_list<const TensorView*> views, int* device_id) {
  const TensorView* first = nullptr;
  for (const TensorView* v : views) {
    if (!v->present()) continue;
    if (!first) {
      first = v;
      continue;
    }
    MAMBA3_CHECK_ARG(v->device == first->device && v->device_id == first->device_id, v->name,
                     " is on ", (v->device == DeviceKind::CUDA ? "cuda:" : "cpu:"), v->device_id,
                     " but ", first->name, " is on ",
                     (first->device == DeviceKind::CUDA ? "cuda:" : "cpu:"), first->device_id,
                     "; all tensors of one call must be on the same device");
  }
  MAMBA3_CHECK_ARG(first != nullptr, "no tensor given");
  if (device_id) *device_id = first->device_id;
  return first->device;
}

void check_cu_seqlens_meta(const TensorView& cu) {
  MAMBA3_CHECK_ARG(cu.ndim == 1, cu.name, ": expected rank 1 [nseq+1], got ", cu.shape_str());
  MAMBA3_CHECK_ARG(cu.shape[0] >= 2, cu.name, ": needs at least 2 entries (one sequence), got ",
                   cu.shape[0]);
  check_dtype_in(cu, {DType::I32, DType::I64});
}

int64_t read_index_host(const TensorView& v, int64_t i) {
  const char* base = static_cast<const char*>(v.data);
  if (v.dtype == DType::I32) return reinterpret_cast<const int32_t*>(base)[i * v.strides[0]];
  return reinterpret_cast<const int64_t*>(base)[i * v.strides[0]];
}

void check_cu_seqlens_values_host(const TensorView& cu, int64_t total) {
  const int64_t n = cu.shape[0];
  MAMBA3_CHECK_ARG(read_index_host(cu, 0) == 0, cu.name, ": must start at 0, got ",
                   read_index_host(cu, 0));
  for (int64_t i = 1; i < n; ++i) {
    const int64_t a = read_index_host(cu, i - 1), b = read_index_host(cu, i);
    MAMBA3_CHECK_ARG(b > a, cu.name, ": must be strictly increasing, but entry ", i, " (", b,
                     ") <= entry ", i - 1, " (", a, ")");
  }
  MAMBA3_CHECK_ARG(read_index_host(cu, n - 1) == total, cu.name, ": last entry must equal the ",
                   "sequence length ", total, ", got ", read_index_host(cu, n - 1));
}

}  // namespace mamba3
