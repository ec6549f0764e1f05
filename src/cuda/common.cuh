// Helpers shared by the CUDA kernels: error checking (CUDA failures become mamba3::Error with
// MAMBA3_ERROR_CUDA), device/stream utilities, fp16/bf16/fp32 conversions with a runtime dtype
// for the small tensors, typed vector pack/unpack for the big ones, and cp.async wrappers.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <utility>

#include "core/error.hpp"
#include "core/tensor.hpp"

namespace mamba3::cuda {

// ------------------------------------------------------------------ host side

inline void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    cudaGetLastError();  // do not leave a non-sticky error behind for the caller's next check
    MAMBA3_FAIL(MAMBA3_ERROR_CUDA, what, ": ", cudaGetErrorName(e), " (", cudaGetErrorString(e),
                ")");
  }
}

// Checks the launch just enqueued (bad configuration, missing kernel image, ...).
inline void check_launch(const char* kernel) { check_cuda(cudaGetLastError(), kernel); }

// Programmatic dependent launch (Hopper): a kernel launched with `pdl_attr` may be scheduled
// while the kernel before it on the stream is still finishing, which hides the launch gap
// between back-to-back kernels (a large share of a few-microsecond kernel). Contract: such a
// kernel calls pdl_wait() before its first global memory access (load or store), so it sees
// every write of the kernels before it and they see none of its own.
inline cudaLaunchAttribute pdl_attr() {
  cudaLaunchAttribute at;
  at.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  at.val.programmaticStreamSerializationAllowed = 1;
  return at;
}

// Raises a kernel's dynamic shared-memory limit on the current device, once per (kernel,
// device, size): later calls (e.g. inside CUDA-graph capture) then make no attribute call.
inline void set_smem(const void* kern, int device, size_t bytes, const char* what) {
  static std::mutex mu;
  static std::map<std::pair<const void*, int>, size_t> done;
  std::lock_guard<std::mutex> lock(mu);
  size_t& have = done[{kern, device}];
  if (have >= bytes) return;
  check_cuda(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  static_cast<int>(bytes)),
             what);
  have = bytes;
}

// Makes `device` current for the lifetime of the guard and restores the caller's device after.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    check_cuda(cudaGetDevice(&prev_), "cudaGetDevice");
    if (prev_ != device) check_cuda(cudaSetDevice(device), "cudaSetDevice");
    changed_ = prev_ != device;
  }
  ~DeviceGuard() {
    if (changed_) cudaSetDevice(prev_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int prev_ = 0;
  bool changed_ = false;
};

// True when work enqueued on `stream` is being recorded into a CUDA graph (then nothing may
// synchronise). A failing query (e.g. the legacy stream while another thread captures in global
// mode) is treated as capturing: that is the only situation in which the query itself fails.
inline bool stream_capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &st) != cudaSuccess) {
    cudaGetLastError();
    return true;
  }
  return st != cudaStreamCaptureStatusNone;
}

// Attributes of a device that the launch plans need, queried once per device (host overhead on
// the launch path shows up as idle GPU time in event-timed benchmarks).
struct DeviceProps {
  int sms = 1;
  int smem_per_sm = 0;    // bytes of shared memory per SM
  int smem_optin = 0;     // max dynamic shared memory per block (opt-in)
  int smem_reserved = 0;  // shared memory the system reserves per block
  int coop_launch = 0;    // cooperative launches (grid-wide barriers) supported
};

inline const DeviceProps& device_props(int device) {
  constexpr int kMaxDevices = 64;
  static DeviceProps props[kMaxDevices];
  static std::once_flag once[kMaxDevices];
  MAMBA3_CHECK_ARG(device >= 0 && device < kMaxDevices, "device id ", device, " is out of range");
  std::call_once(once[device], [device] {
    DeviceProps& p = props[device];
    check_cuda(cudaDeviceGetAttribute(&p.sms, cudaDevAttrMultiProcessorCount, device),
               "cudaDeviceGetAttribute(multiProcessorCount)");
    check_cuda(
        cudaDeviceGetAttribute(&p.smem_per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device),
        "cudaDeviceGetAttribute(maxSharedMemoryPerMultiprocessor)");
    check_cuda(
        cudaDeviceGetAttribute(&p.smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
        "cudaDeviceGetAttribute(maxSharedMemoryPerBlockOptin)");
    check_cuda(
        cudaDeviceGetAttribute(&p.smem_reserved, cudaDevAttrReservedSharedMemoryPerBlock, device),
        "cudaDeviceGetAttribute(reservedSharedMemoryPerBlock)");
    check_cuda(cudaDeviceGetAttribute(&p.coop_launch, cudaDevAttrCooperativeLaunch, device),
               "cudaDeviceGetAttribute(cooperativeLaunch)");
    if (p.sms < 1) p.sms = 1;
  });
  return props[device];
}

inline int sm_count(int device) { return device_props(device).sms; }

// Raises kernel K's dynamic shared-memory limit on the current device to at least `bytes`,
// calling the runtime only when the limit must grow (tracked per kernel and device: K is a
// template argument so that every kernel has its own record).
template <auto K>
void ensure_dynamic_smem(int device, size_t bytes) {
  constexpr int kMaxDevices = 64;
  static std::atomic<long long> granted[kMaxDevices];
  if (bytes <= 48 * 1024) return;  // the default limit
  MAMBA3_CHECK_ARG(device >= 0 && device < kMaxDevices, "device id ", device, " is out of range");
  if (granted[device].load(std::memory_order_acquire) >= static_cast<long long>(bytes)) return;
  check_cuda(
      cudaFuncSetAttribute(K, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)),
      "cudaFuncSetAttribute(MaxDynamicSharedMemorySize)");
  long long cur = granted[device].load(std::memory_order_relaxed);
  while (cur < static_cast<long long>(bytes) &&
         !granted[device].compare_exchange_weak(cur, static_cast<long long>(bytes))) {
  }
}

// Element-size helpers on the host view.
inline bool aligned_to(const void* p, int64_t bytes) {
  return bytes <= 1 || (reinterpret_cast<uintptr_t>(p) % static_cast<uintptr_t>(bytes)) == 0;
}

// The kernels access every element at its natural alignment (and 4-byte words of 2-byte
// elements), so a data pointer must be a multiple of the element size.
inline void check_element_aligned(const TensorView& v) {
  if (!v.present()) return;
  MAMBA3_CHECK_ARG(aligned_to(v.data, dtype_size(v.dtype)), v.name, ": data pointer ", v.data,
                   " is not aligned to its element size (", dtype_size(v.dtype),
                   " bytes); the CUDA kernels need naturally aligned elements");
}

// Byte range [lo, hi) covered by the elements of a view (any strides, also negative ones).
inline void byte_span(const TensorView& v, uintptr_t* lo, uintptr_t* hi) {
  int64_t mn = 0, mx = 0;
  for (int d = 0; d < v.ndim; ++d) {
    if (v.shape[d] <= 0) continue;
    const int64_t ext = (v.shape[d] - 1) * v.strides[d];
    if (ext < 0)
      mn += ext;
    else
      mx += ext;
  }
  const int64_t es = dtype_size(v.dtype);
  const uintptr_t base = reinterpret_cast<uintptr_t>(v.data);
  *lo = base + static_cast<uintptr_t>(mn * es);
  *hi = base + static_cast<uintptr_t>(mx * es + es);
}

// ------------------------------------------------------------------ device side: PDL

// Waits until the kernels before this one on the stream have completed and their writes are
// visible (a no-op when the kernel was launched without pdl_attr).
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Lets a kernel launched after this one with pdl_attr be scheduled now (it still waits for this
// kernel's completion at its pdl_wait); without such a dependent, a no-op.
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// ------------------------------------------------------------------ device side: dtypes

// Runtime dtype codes, equal to mamba3::DType's values.
enum : int { kF16 = 0, kBF16 = 1, kF32 = 2 };

__host__ __device__ constexpr int dt_size(int dt) { return dt == kF32 ? 4 : 2; }

// 16 or 32 raw bits of one element -> float.
__device__ __forceinline__ float bits_to_float(uint32_t bits, int dt) {
  if (dt == kF32) return __uint_as_float(bits);
  if (dt == kBF16) return __uint_as_float(bits << 16);
  return __half2float(__ushort_as_half(static_cast<unsigned short>(bits)));
}

__device__ __forceinline__ uint32_t float_to_bits(float v, int dt) {
  if (dt == kF32) return __float_as_uint(v);
  if (dt == kBF16) return __bfloat16_as_ushort(__float2bfloat16_rn(v));
  return __half_as_ushort(__float2half_rn(v));
}

// One element at `p` (byte address) of runtime dtype `dt`, read through the read-only path.
__device__ __forceinline__ float load_rt(const void* p, int dt) {
  if (dt == kF32) return __ldg(static_cast<const float*>(p));
  return bits_to_float(__ldg(static_cast<const unsigned short*>(p)), dt);
}
// The raw 16 or 32 bits of the element at `p` (as load_rt reads them; bits_to_float gives its
// value). Why separate: a loop of load_rt converts each value right after its load, so the next
// iteration's load waits for this one (a memory latency per element); raw loads first, then the
// conversions, keep them all in flight.
__device__ __forceinline__ uint32_t load_bits_rt(const void* p, int dt) {
  if (dt == kF32) return __ldg(static_cast<const unsigned int*>(p));
  return __ldg(static_cast<const unsigned short*>(p));
}
// Stores v rounded (to nearest even) to runtime dtype `dt` at `p`.
__device__ __forceinline__ void store_rt(void* p, int dt, float v) {
  if (dt == kF32) {
    *static_cast<float*>(p) = v;
  } else {
    *static_cast<unsigned short*>(p) = static_cast<unsigned short>(float_to_bits(v, dt));
  }
}

// Typed traits of the big tensors' element types: pack/unpack between 32-bit words and floats.
template <class T>
struct Elem;

template <>
struct Elem<float> {
  static constexpr int kSize = 4;
  static constexpr int kDt = kF32;
  // n floats from n/1 words
  template <int NE>
  __device__ __forceinline__ static void unpack(const uint32_t* w, float* f) {
#pragma unroll
    for (int i = 0; i < NE; ++i) f[i] = __uint_as_float(w[i]);
  }
  template <int NE>
  __device__ __forceinline__ static void pack(const float* f, uint32_t* w) {
#pragma unroll
    for (int i = 0; i < NE; ++i) w[i] = __float_as_uint(f[i]);
  }
  __device__ __forceinline__ static float load1(const void* p) {
    return *static_cast<const float*>(p);
  }
  __device__ __forceinline__ static void store1(void* p, float v) { *static_cast<float*>(p) = v; }
};

template <>
struct Elem<__nv_bfloat16> {
  static constexpr int kSize = 2;
  static constexpr int kDt = kBF16;
  template <int NE>
  __device__ __forceinline__ static void unpack(const uint32_t* w, float* f) {
#pragma unroll
    for (int i = 0; i < NE / 2; ++i) {
      f[2 * i] = __uint_as_float(w[i] << 16);
      f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
  }
  template <int NE>
  __device__ __forceinline__ static void pack(const float* f, uint32_t* w) {
#pragma unroll
    for (int i = 0; i < NE / 2; ++i) {
      const __nv_bfloat162 h = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
      w[i] = *reinterpret_cast<const uint32_t*>(&h);
    }
  }
  __device__ __forceinline__ static float load1(const void* p) {
    return __uint_as_float(static_cast<uint32_t>(*static_cast<const unsigned short*>(p)) << 16);
  }
  __device__ __forceinline__ static void store1(void* p, float v) {
    *static_cast<unsigned short*>(p) = __bfloat16_as_ushort(__float2bfloat16_rn(v));
  }
};

template <>
struct Elem<__half> {
  static constexpr int kSize = 2;
  static constexpr int kDt = kF16;
  template <int NE>
  __device__ __forceinline__ static void unpack(const uint32_t* w, float* f) {
#pragma unroll
    for (int i = 0; i < NE / 2; ++i) {
      const float2 v = __half22float2(*reinterpret_cast<const __half2*>(&w[i]));
      f[2 * i] = v.x;
      f[2 * i + 1] = v.y;
    }
  }
  template <int NE>
  __device__ __forceinline__ static void pack(const float* f, uint32_t* w) {
#pragma unroll
    for (int i = 0; i < NE / 2; ++i) {
      const __half2 h = __floats2half2_rn(f[2 * i], f[2 * i + 1]);
      w[i] = *reinterpret_cast<const uint32_t*>(&h);
    }
  }
  __device__ __forceinline__ static float load1(const void* p) {
    return __half2float(*static_cast<const __half*>(p));
  }
  __device__ __forceinline__ static void store1(void* p, float v) {
    *static_cast<__half*>(p) = __float2half_rn(v);
  }
};

// ------------------------------------------------------------------ raw vector memory access

// NB bytes (4, 8 or 16; naturally aligned) as NB/4 words.
template <int NB>
__device__ __forceinline__ void ld_global_words(const void* p, uint32_t* w) {
  if constexpr (NB == 16) {
    const uint4 v = __ldg(static_cast<const uint4*>(p));
    w[0] = v.x, w[1] = v.y, w[2] = v.z, w[3] = v.w;
  } else if constexpr (NB == 8) {
    const uint2 v = __ldg(static_cast<const uint2*>(p));
    w[0] = v.x, w[1] = v.y;
  } else {
    static_assert(NB == 4, "4, 8 or 16 bytes");
    w[0] = __ldg(static_cast<const unsigned int*>(p));
  }
}

template <int NB>
__device__ __forceinline__ void st_global_words(void* p, const uint32_t* w) {
  if constexpr (NB == 16) {
    *static_cast<uint4*>(p) = make_uint4(w[0], w[1], w[2], w[3]);
  } else if constexpr (NB == 8) {
    *static_cast<uint2*>(p) = make_uint2(w[0], w[1]);
  } else {
    static_assert(NB == 4, "4, 8 or 16 bytes");
    *static_cast<unsigned int*>(p) = w[0];
  }
}

template <int NB>
__device__ __forceinline__ void ld_shared_words(const unsigned char* p, uint32_t* w) {
  if constexpr (NB == 16) {
    const uint4 v = *reinterpret_cast<const uint4*>(p);
    w[0] = v.x, w[1] = v.y, w[2] = v.z, w[3] = v.w;
  } else if constexpr (NB == 8) {
    const uint2 v = *reinterpret_cast<const uint2*>(p);
    w[0] = v.x, w[1] = v.y;
  } else {
    static_assert(NB == 4, "4, 8 or 16 bytes");
    w[0] = *reinterpret_cast<const unsigned int*>(p);
  }
}

// ------------------------------------------------------------------ cp.async (sm_80+)

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Asynchronous copy of NB bytes global -> shared; when `valid` is false nothing is read and the
// destination is zero-filled (src must still be a valid address; callers pass the tensor base).
template <int NB>
__device__ __forceinline__ void cp_async(uint32_t dst, const void* src, bool valid) {
  const int src_size = valid ? NB : 0;
  if constexpr (NB == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
                 "r"(src_size)
                 : "memory");
  } else {
    static_assert(NB == 4 || NB == 8, "cp.async copies 4, 8 or 16 bytes");
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(dst), "l"(src), "n"(NB),
                 "r"(src_size)
                 : "memory");
  }
}

__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}

template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// wait_group needs an immediate: dispatch the (warp-uniform) pipeline depth.
__device__ __forceinline__ void cp_async_wait_dyn(int pending) {
  switch (pending) {
    case 0:
      cp_async_wait<0>();
      break;
    case 1:
      cp_async_wait<1>();
      break;
    case 2:
      cp_async_wait<2>();
      break;
    case 3:
      cp_async_wait<3>();
      break;
    case 4:
      cp_async_wait<4>();
      break;
    case 5:
      cp_async_wait<5>();
      break;
    case 6:
      cp_async_wait<6>();
      break;
    default:
      cp_async_wait<7>();
      break;
  }
}

__device__ __forceinline__ void st_shared_u32(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
}

// Copies the 32-bit word holding one element (4-byte element: the element itself; 2-byte
// element: its aligned containing word, whose other half is ignored by the reader) into shared
// memory asynchronously. The containing word is only read when it lies inside the tensor's byte
// span [lo, hi) (so no byte outside the caller's tensor is touched); otherwise the element is
// loaded synchronously and placed in the half of the word where the reader expects it.
// `valid` false stores zero.
__device__ __forceinline__ void copy_elem_word(uint32_t dst, const unsigned char* src, int dt,
                                               bool valid, uintptr_t lo, uintptr_t hi) {
  if (!valid) {
    st_shared_u32(dst, 0u);
    return;
  }
  if (dt == kF32) {
    cp_async<4>(dst, src, true);
    return;
  }
  const uintptr_t a = reinterpret_cast<uintptr_t>(src);
  const uintptr_t w = a & ~uintptr_t(3);
  if (w >= lo && w + 4 <= hi) {
    cp_async<4>(dst, reinterpret_cast<const void*>(w), true);
  } else {
    const uint32_t v = __ldg(reinterpret_cast<const unsigned short*>(src));
    st_shared_u32(dst, (a & 2) ? (v << 16) : v);
  }
}

// Reader side of copy_elem_word: the element's bits from its word (`addr_bit1` = bit 1 of the
// element's byte address, i.e. which half holds it).
__device__ __forceinline__ float word_elem_to_float(uint32_t word, int dt, uint32_t addr_bit1) {
  if (dt == kF32) return __uint_as_float(word);
  return bits_to_float(addr_bit1 ? (word >> 16) : (word & 0xffffu), dt);
}

}  // namespace mamba3::cuda
