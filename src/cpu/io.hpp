// Shared helpers of the CPU backend: element access through strides with the dtype chosen at
// run time (fp16 / bf16 / fp32 stored, float32 computed; round-to-nearest-even on every store),
// a deterministic parallel_for over independent work items, and compensated float32 summation.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#include "core/tensor.hpp"

namespace mamba3::cpu {

// ------------------------------------------------------------------ scalar conversions

inline uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float bits_f32(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t man = h & 0x3ffu;
  if (exp == 0x1f) return bits_f32(sign | 0x7f800000u | (man << 13));  // inf / nan
  if (exp == 0) {
    // Zero or subnormal: value = man * 2^-24, exact in float.
    const float v = static_cast<float>(man) * 5.9604644775390625e-08f;
    return sign ? -v : v;
  }
  return bits_f32(sign | ((exp + 112u) << 23) | (man << 13));
}

// float -> IEEE half with round-to-nearest-even, including subnormals, overflow to inf and NaN.
inline uint16_t float_to_half(float f) {
  const uint32_t u = f32_bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a >= 0x7f800000u) {  // inf or nan (keep nan quiet and non-zero mantissa)
    return static_cast<uint16_t>(sign | 0x7c00u | (a > 0x7f800000u ? 0x200u | ((a >> 13) & 0x3ffu) : 0));
  }
  if (a >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to >= 65520: inf
  if (a < 0x38800000u) {
    // Result is subnormal (or zero): units of 2^-24, rounded to nearest even. Values below 2^-25
    // round to zero; exactly 2^-25 is a tie that rounds to zero (even).
    if (a < 0x33000000u) return sign;
    const uint32_t exp = a >> 23;
    const uint32_t man = (a & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126u - exp;  // man * 2^(exp-150) / 2^-24 = man >> (126 - exp)
    uint32_t q = man >> shift;
    const uint32_t rem = man & ((1u << shift) - 1u);
    const uint32_t half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (q & 1u))) ++q;
    return static_cast<uint16_t>(sign | q);
  }
  // Normal: rebias the exponent and round the 13 dropped mantissa bits; a carry out of the
  // mantissa correctly bumps the exponent.
  uint32_t r = a - 0x38000000u;  // exponent bias 127 -> 15 (in the float layout)
  const uint32_t rem = r & 0x1fffu;
  r >>= 13;
  if (rem > 0x1000u || (rem == 0x1000u && (r & 1u))) ++r;
  return static_cast<uint16_t>(sign | r);
}

inline float bf16_to_float(uint16_t b) { return bits_f32(static_cast<uint32_t>(b) << 16); }

inline uint16_t float_to_bf16(float f) {
  const uint32_t u = f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // quiet nan
  const uint32_t lsb = (u >> 16) & 1u;
  return static_cast<uint16_t>((u + 0x7fffu + lsb) >> 16);  // round to nearest even
}

inline float load1(const char* base, DType t, int64_t off) {
  switch (t) {
    case DType::F16: {
      uint16_t h;
      std::memcpy(&h, base + off * 2, 2);
      return half_to_float(h);
    }
    case DType::BF16: {
      uint16_t h;
      std::memcpy(&h, base + off * 2, 2);
      return bf16_to_float(h);
    }
    case DType::F32: {
      float f;
      std::memcpy(&f, base + off * 4, 4);
      return f;
    }
    default: {
      double d;
      std::memcpy(&d, base + off * 8, 8);
      return static_cast<float>(d);
    }
  }
}

inline void store1(char* base, DType t, int64_t off, float v) {
  switch (t) {
    case DType::F16: {
      const uint16_t h = float_to_half(v);
      std::memcpy(base + off * 2, &h, 2);
      break;
    }
    case DType::BF16: {
      const uint16_t h = float_to_bf16(v);
      std::memcpy(base + off * 2, &h, 2);
      break;
    }
    case DType::F32: std::memcpy(base + off * 4, &v, 4); break;
    default: {
      const double d = v;
      std::memcpy(base + off * 8, &d, 8);
      break;
    }
  }
}

// Strided row access: `n` elements starting at element offset `off`, `stride` elements apart.
// The dtype switch is hoisted out of the element loop.
template <class Cvt>
inline void load_row_as(const char* base, int64_t off, int64_t stride, int64_t n, float* out,
                        Cvt cvt, int esize) {
  for (int64_t i = 0; i < n; ++i) {
    uint16_t h;
    std::memcpy(&h, base + (off + i * stride) * esize, 2);
    out[i] = cvt(h);
  }
}

inline void load_row(const TensorView& v, int64_t off, int64_t stride, int64_t n, float* out) {
  const char* base = static_cast<const char*>(v.data);
  switch (v.dtype) {
    case DType::F16: load_row_as(base, off, stride, n, out, half_to_float, 2); break;
    case DType::BF16: load_row_as(base, off, stride, n, out, bf16_to_float, 2); break;
    case DType::F32:
      if (stride == 1) {
        std::memcpy(out, base + off * 4, static_cast<size_t>(n) * 4);
      } else {
        for (int64_t i = 0; i < n; ++i) std::memcpy(out + i, base + (off + i * stride) * 4, 4);
      }
      break;
    default:
      for (int64_t i = 0; i < n; ++i) out[i] = load1(base, v.dtype, off + i * stride);
      break;
  }
}

inline void store_row(const TensorView& v, int64_t off, int64_t stride, int64_t n,
                      const float* in) {
  char* base = static_cast<char*>(v.data);
  switch (v.dtype) {
    case DType::F16:
      for (int64_t i = 0; i < n; ++i) {
        const uint16_t h = float_to_half(in[i]);
        std::memcpy(base + (off + i * stride) * 2, &h, 2);
      }
      break;
    case DType::BF16:
      for (int64_t i = 0; i < n; ++i) {
        const uint16_t h = float_to_bf16(in[i]);
        std::memcpy(base + (off + i * stride) * 2, &h, 2);
      }
      break;
    case DType::F32:
      if (stride == 1) {
        std::memcpy(base + off * 4, in, static_cast<size_t>(n) * 4);
      } else {
        for (int64_t i = 0; i < n; ++i) std::memcpy(base + (off + i * stride) * 4, in + i, 4);
      }
      break;
    default:
      for (int64_t i = 0; i < n; ++i) store1(base, v.dtype, off + i * stride, in[i]);
      break;
  }
}

inline float load_at(const TensorView& v, int64_t off) {
  return load1(static_cast<const char*>(v.data), v.dtype, off);
}
inline void store_at(const TensorView& v, int64_t off, float x) {
  store1(static_cast<char*>(v.data), v.dtype, off, x);
}

// ------------------------------------------------------------------ threading

// Runs body(item) for item in [0, n_items). Items are independent, so the schedule (and the
// number of threads) cannot change any result. Exceptions from workers are rethrown here.
template <class Body>
void parallel_for(int64_t n_items, bool parallel, Body body) {
  unsigned nthreads = parallel ? std::thread::hardware_concurrency() : 1u;
  if (nthreads == 0) nthreads = 1;
  nthreads = static_cast<unsigned>(std::min<int64_t>(nthreads, n_items));
  if (nthreads <= 1) {
    for (int64_t i = 0; i < n_items; ++i) body(i);
    return;
  }
  std::atomic<int64_t> next{0};
  std::exception_ptr error;
  std::mutex error_mu;
  auto worker = [&] {
    try {
      for (int64_t i = next.fetch_add(1); i < n_items; i = next.fetch_add(1)) body(i);
    } catch (...) {
      std::lock_guard<std::mutex> lock(error_mu);
      if (!error) error = std::current_exception();
      next.store(n_items);
    }
  };
  std::vector<std::thread> pool;
  pool.reserve(nthreads - 1);
  for (unsigned t = 1; t < nthreads; ++t) pool.emplace_back(worker);
  worker();
  for (auto& th : pool) th.join();
  if (error) std::rethrow_exception(error);
}

// Neumaier's compensated summation in float32: `err` collects the rounding error of every
// addition, so a bias summed over B*S positions is accurate to about one rounding of the result
// instead of growing with the number of terms.
inline void compensated_add(float& sum, float& err, float x) {
  const float t = sum + x;
  err += std::fabs(sum) >= std::fabs(x) ? (sum - t) + x : (x - t) + sum;
  sum = t;
}

}  // namespace mamba3::cpu
