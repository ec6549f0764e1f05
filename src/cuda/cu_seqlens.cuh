// cu_seqlens on the CUDA path: host-side validation of the device-resident values and the
// device-side accessors the kernels use (always clamped, so bad values never cause an
// out-of-bounds access).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/tensor.hpp"

namespace mamba3::cuda {

// Validates the values of a device cu_seqlens tensor (start 0, strictly increasing, last ==
// `total`) by copying them to the host and synchronising `stream`. This is skipped while the
// stream is being captured into a CUDA graph (synchronising is illegal there): under capture the
// values are trusted. The kernels clamp every value they read, so invalid values can give wrong
// results but never an out-of-bounds access.
void validate_cu_seqlens(const TensorView& cu, int64_t total, cudaStream_t stream);

// Device view of cu_seqlens: entry i, as int64.
struct CuSeqlens {
  const void* ptr = nullptr;
  int64_t stride = 1;  // elements
  int is64 = 0;
  int n = 0;  // number of entries (nseq + 1)

  __device__ __forceinline__ int64_t at(int64_t i) const {
    return is64 ? __ldg(static_cast<const long long*>(ptr) + i * stride)
                : static_cast<int64_t>(__ldg(static_cast<const int*>(ptr) + i * stride));
  }
  // Index i in [0, n-2] of the sequence whose range [cu[i], cu[i+1]) holds position t, for sorted
  // values: the largest i <= n-2 with cu[i] <= t (0 if none). Always in range.
  __device__ __forceinline__ int seq_of(int64_t t) const {
    int lo = 0, hi = n - 2;
    while (lo < hi) {
      const int mid = (lo + hi + 1) >> 1;
      if (at(mid) <= t)
        lo = mid;
      else
        hi = mid - 1;
    }
    return lo;
  }
};

CuSeqlens make_cu_seqlens(const TensorView& cu);

}  // namespace mamba3::cuda
