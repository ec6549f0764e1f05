#include "core/tensor.hpp"

#include <sstream>

#include "core/error.hpp"

namespace mamba3 {

const char* dtype_name(DType t) {
  switch (t) {
    case DType::F16: return "float16";
    case DType::BF16: return "bfloat16";
    case DType::F32: return "float32";
    case DType::F64: return "float64";
    case DType::I32: return "int32";
    case DType::I64: return "int64";
  }
  return "?";
}

int dtype_size(DType t) {
  switch (t) {
    case DType::F16:
    case DType::BF16: return 2;
    case DType::F32:
    case DType::I32: return 4;
    case DType::F64:
    case DType::I64: return 8;
  }
  return 0;
}

std::string TensorView::shape_str() const {
  std::ostringstream os;
  os << '[';
  for (int i = 0; i < ndim; ++i) os << (i ? "," : "") << shape[i];
  os << ']';
  return os.str();
}

static DType convert_dtype(const DLDataType& d, const char* name) {
  MAMBA3_CHECK_ARG(d.lanes == 1, name, ": vector dtypes (lanes=", int(d.lanes), ") are not supported");
  if (d.code == kDLFloat && d.bits == 16) return DType::F16;
  if (d.code == kDLBfloat && d.bits == 16) return DType::BF16;
  if (d.code == kDLFloat && d.bits == 32) return DType::F32;
  if (d.code == kDLFloat && d.bits == 64) return DType::F64;
  if (d.code == kDLInt && d.bits == 32) return DType::I32;
  if (d.code == kDLInt && d.bits == 64) return DType::I64;
  MAMBA3_FAIL(MAMBA3_ERROR_INVALID_ARGUMENT, name, ": unsupported dtype (code=", int(d.code),
              ", bits=", int(d.bits), ")");
}

TensorView make_view(const DLTensor* t, const char* name) {
  TensorView v;
  v.name = name;
  if (t == nullptr) return v;
  MAMBA3_CHECK_ARG(t->ndim >= 0 && t->ndim <= kMaxDims, name, ": rank ", t->ndim,
                   " is not supported (at most ", kMaxDims, ")");
  switch (t->device.device_type) {
    case kDLCPU: v.device = DeviceKind::CPU; break;
    case kDLCUDA: v.device = DeviceKind::CUDA; break;
    default:
      MAMBA3_FAIL(MAMBA3_ERROR_INVALID_ARGUMENT, name, ": device type ", int(t->device.device_type),
                  " is not supported (only CPU and CUDA device memory)");
  }
  v.device_id = t->device.device_id;
  v.dtype = convert_dtype(t->dtype, name);
  v.ndim = t->ndim;
  int64_t numel = 1;
  for (int i = 0; i < t->ndim; ++i) {
    MAMBA3_CHECK_ARG(t->shape[i] >= 0, name, ": negative dimension ", t->shape[i]);
    v.shape[i] = t->shape[i];
    numel *= t->shape[i];
  }
  if (t->strides) {
    for (int i = 0; i < t->ndim; ++i) v.strides[i] = t->strides[i];
  } else {
    int64_t s = 1;
    for (int i = t->ndim - 1; i >= 0; --i) {
      v.strides[i] = s;
      s *= t->shape[i];
    }
  }
  MAMBA3_CHECK_ARG(numel == 0 || t->data != nullptr, name, ": data pointer is NULL");
  v.data = static_cast<char*>(t->data) + t->byte_offset;
  return v;
}

TensorView compact_f32_view(void* data, std::initializer_list<int64_t> shape, const char* name,
                            DeviceKind device, int device_id) {
  TensorView v;
  v.name = name;
  v.data = data;
  v.dtype = DType::F32;
  v.device = device;
  v.device_id = device_id;
  v.ndim = static_cast<int>(shape.size());
  MAMBA3_CHECK_ARG(v.ndim <= kMaxDims, name, ": ", v.ndim, " dims exceed ", kMaxDims);
  int64_t n = 1;
  for (int i = v.ndim - 1; i >= 0; --i) {
    v.shape[i] = shape.begin()[i];
    v.strides[i] = n;
    n *= v.shape[i];
  }
  return v;
}

}  // namespace mamba3
