// Element access with a runtime dtype (mamba3::DType codes: 0 f16, 1 bf16, 2 f32) for the small
// or rarely read tensors of the MIMO kernels, whose bodies also run on the host in the emulated
// tests (so: device and host versions of one function, read-only loads through __ldg on the
// device).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <iterator>

#if defined(__CUDACC__)
#define RT_DEV __device__ __forceinline__
#else
#define RT_DEV inline
#endif

namespace mamba3::cuda {

// Host: whether the view w (fields p, dt and element strides s[]) has dtype dt and is contiguous
// with the given shape, of at most 2^30 elements: the condition under which the kernels
// compiled for contiguous layouts (both MIMO passes) may take it, with 32-bit offsets.
template <class V>
inline bool rt_contiguous_of(const V& w, int dt, std::initializer_list<int64_t> shape) {
  if (w.p == nullptr || w.dt != dt) return false;
  int64_t st = 1;
  int i = static_cast<int>(shape.size());
  for (auto it = std::rbegin(shape); it != std::rend(shape); ++it) {
    if (w.s[--i] != st) return false;
    st *= *it;
  }
  return st <= (int64_t{1} << 30);
}

// Element `off` of the tensor at byte pointer p, as float.
RT_DEV float rt_ld(const unsigned char* p, int64_t off, int dt) {
#if defined(__CUDA_ARCH__)
  if (dt == 2) return __ldg(reinterpret_cast<const float*>(p) + off);
  const unsigned short bits = __ldg(reinterpret_cast<const unsigned short*>(p) + off);
#else
  if (dt == 2) return reinterpret_cast<const float*>(p)[off];
  const unsigned short bits = reinterpret_cast<const unsigned short*>(p)[off];
#endif
  if (dt == 1) return __bfloat162float(__ushort_as_bfloat16(bits));
  return __half2float(__ushort_as_half(bits));
}

// rt_ld in two halves: the element's raw bits (fp32 bits, or the 16-bit pattern), then their
// value. In a run of rt_ld calls each load and its conversion sit in one dtype branch, so the
// run waits one memory latency per element; the raw loads compile to predicated selects that
// issue back to back, and the conversions come after all of them. DT: a dtype code known at
// compile time, or negative for the runtime dtype dt.
template <int DT = -1>
RT_DEV uint32_t rt_ld_raw(const unsigned char* p, int64_t off, int dt) {
  const bool f32 = DT < 0 ? dt == 2 : DT == 2;
  // One byte address for both widths (the element size as a shift): the two predicated loads
  // share it instead of each forming its own 64-bit address (fewer registers in the callers).
  const unsigned char* q = p + (off << (f32 ? 2 : 1));
#if defined(__CUDA_ARCH__)
  if (f32) return __ldg(reinterpret_cast<const unsigned int*>(q));
  return __ldg(reinterpret_cast<const unsigned short*>(q));
#else
  if (f32) return *reinterpret_cast<const uint32_t*>(q);
  return *reinterpret_cast<const unsigned short*>(q);
#endif
}
template <int DT = -1>
RT_DEV float rt_raw_f(uint32_t u, int dt) {
  const int d = DT < 0 ? dt : DT;
  if (d == 2) {
#if defined(__CUDA_ARCH__)
    return __uint_as_float(u);
#else
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
#endif
  }
  const unsigned short bits = static_cast<unsigned short>(u);
  if (d == 1) return __bfloat162float(__ushort_as_bfloat16(bits));
  return __half2float(__ushort_as_half(bits));
}

// Stores v, rounded to nearest in the tensor's dtype, as element `off`.
RT_DEV void rt_st(unsigned char* p, int64_t off, int dt, float v) {
  if (dt == 2) {
    reinterpret_cast<float*>(p)[off] = v;
  } else if (dt == 1) {
    reinterpret_cast<unsigned short*>(p)[off] = __bfloat16_as_ushort(__float2bfloat16_rn(v));
  } else {
    reinterpret_cast<unsigned short*>(p)[off] = __half_as_ushort(__float2half_rn(v));
  }
}

}  // namespace mamba3::cuda
