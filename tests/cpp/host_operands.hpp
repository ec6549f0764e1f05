// Host operands for the tests that run kernel bodies on the host (the *_emulated.cpp suites):
// random golden Buffers (optionally padded: non-contiguous rows) and their TensorView, as the
// library's params see a tensor.
#pragma once

#include <cstdint>
#include <random>
#include <utility>
#include <vector>

#include "core/tensor.hpp"
#include "mamba3_golden/host.hpp"

namespace mamba3::test {

inline golden::Buffer rand_buf(std::mt19937_64& rng, golden::IoType t, std::vector<int64_t> shape,
                               double lo, double hi, int64_t pad) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  golden::Buffer b = golden::Buffer::from_double(t, std::move(shape), golden::uniform(rng, n, lo, hi, t));
  return pad > 0 ? b.padded(pad) : b;
}

// A host Buffer as the library's TensorView (absent when the Buffer has no shape).
inline TensorView view_of(golden::Buffer& b) {
  TensorView v;
  if (b.shape.empty()) return v;
  DLTensor* t = b.tensor();
  v.data = static_cast<char*>(t->data) + t->byte_offset;
  v.dtype = b.type == golden::IoType::F16    ? DType::F16
            : b.type == golden::IoType::BF16 ? DType::BF16
                                             : DType::F32;
  v.device = DeviceKind::CPU;
  v.ndim = t->ndim;
  int64_t stride = 1;
  for (int d = v.ndim - 1; d >= 0; --d) {
    v.shape[d] = t->shape[d];
    v.strides[d] = t->strides ? t->strides[d] : stride;
    stride *= t->shape[d];
  }
  return v;
}

}  // namespace mamba3::test
