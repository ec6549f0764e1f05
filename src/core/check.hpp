// Shared argument checking: every failure names the argument and says what was expected.
#pragma once

#include <initializer_list>
#include <string>

#include "core/error.hpp"
#include "core/tensor.hpp"

namespace mamba3 {

// A required tensor must be given.
void check_present(const TensorView& v);
// Rank and every dimension must match; `dims` gives the expected sizes, `names` the symbols used
// in the message (e.g. {"B","S","G","N"}).
void check_shape(const TensorView& v, std::initializer_list<int64_t> dims,
                 std::initializer_list<const char*> names);
void check_dtype_in(const TensorView& v, std::initializer_list<DType> allowed);
void check_dtype_eq(const TensorView& v, DType expected);
void check_float_io(const TensorView& v);  // f16, bf16 or f32
// All present tensors on one device (kind and id); returns that device. Refuses mixed devices.
DeviceKind check_same_device(std::initializer_list<const TensorView*> views, int* device_id);
// cu_seqlens: rank 1, int32/int64, at least 2 entries; on CPU its values are checked here
// (starts at 0, non-decreasing... strictly increasing, ends at `total`). On CUDA the values are
// checked by the backend on the device before use.
void check_cu_seqlens_meta(const TensorView& cu);
void check_cu_seqlens_values_host(const TensorView& cu, int64_t total);
// Reads entry i of an int32/int64 host tensor.
int64_t read_index_host(const TensorView& v, int64_t i);

}  // namespace mamba3
