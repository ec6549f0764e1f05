// A checked, backend-neutral view of a DLTensor: data pointer (byte_offset applied), dtype,
// shape and strides in elements (filled in for compact tensors whose DLTensor has strides=NULL).
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>

#include <dlpack/dlpack.h>

namespace mamba3 {

enum class DType : int { F16 = 0, BF16 = 1, F32 = 2, F64 = 3, I32 = 4, I64 = 5 };

const char* dtype_name(DType t);
int dtype_size(DType t);
inline bool is_float(DType t) {
  return t == DType::F16 || t == DType::BF16 || t == DType::F32 || t == DType::F64;
}

enum class DeviceKind : int { None = 0, CPU = 1, CUDA = 2 };

constexpr int kMaxDims = 6;

struct TensorView {
  const char* name = "";
  void* data = nullptr;  // nullptr for an absent optional tensor
  DType dtype = DType::F32;
  DeviceKind device = DeviceKind::None;
  int device_id = 0;
  int ndim = 0;
  int64_t shape[kMaxDims] = {};
  int64_t strides[kMaxDims] = {};  // in elements

  bool present() const { return data != nullptr || ndim > 0; }
  int64_t numel() const {
    int64_t n = 1;
    for (int i = 0; i < ndim; ++i) n *= shape[i];
    return n;
  }
  std::string shape_str() const;
  // Element offset of a multi-index (rank must match ndim; checked by the caller).
  int64_t offset(int64_t i0) const { return i0 * strides[0]; }
  int64_t offset(int64_t i0, int64_t i1) const { return i0 * strides[0] + i1 * strides[1]; }
  int64_t offset(int64_t i0, int64_t i1, int64_t i2) const {
    return i0 * strides[0] + i1 * strides[1] + i2 * strides[2];
  }
  int64_t offset(int64_t i0, int64_t i1, int64_t i2, int64_t i3) const {
    return i0 * strides[0] + i1 * strides[1] + i2 * strides[2] + i3 * strides[3];
  }
};

// Converts a DLTensor (may be NULL for an optional argument) into a TensorView. Rejects
// unsupported dtypes, vector lanes, devices and ranks above kMaxDims, naming `name`.
TensorView make_view(const DLTensor* t, const char* name);

// A compact (row-major) float32 view of `data` with the given shape: the backends' internal
// intermediates (a combined operator's scratch between its passes).
TensorView compact_f32_view(void* data, std::initializer_list<int64_t> shape, const char* name,
                            DeviceKind device, int device_id = 0);

}  // namespace mamba3
