// bf16 hi/lo split operands on tensor cores: the primitives shared by the MIMO passes' chunk
// kernels (the first pass's lean kernels, mimo_bwd_fwd_lean.cuh, and the second pass's planes
// kernel, mimo_bwd_bwd_chunk_planes.cuh). Each operand x is rounded once into a bf16 pair
// x = hi + lo (hi = bf16(x), lo = bf16(x - hi)) stored as two planes in shared memory; a product
// reads fragments with ldmatrix and runs three bf16 mma.sync m16n8k16 per tile (hi*hi + hi*lo +
// lo*hi: ~2^-17 relative error per product, fp32 accumulation).
//
// The bodies built on them also run on the host (tests/cpp/cta_emulator.{hpp,cpp} defines the
// thread index, barrier and warp-collective instructions there).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define MB_DEV __device__ __forceinline__
#else
#define MB_DEV inline
#endif

namespace mamba3::cuda::mimo {

// ------------------------------------------------------------------ CTA primitives

#if defined(__CUDACC__)
MB_DEV int mb_tid() { return static_cast<int>(threadIdx.x); }
MB_DEV int64_t mb_bid() { return static_cast<int64_t>(blockIdx.x); }
MB_DEV void mb_sync() { __syncthreads(); }
// The value of lane (this lane ^ mask) of the warp (every lane must call it).
MB_DEV float mb_shfl_xor(float v, int mask) { return __shfl_xor_sync(0xffffffffu, v, mask); }
#else
// Provided by the host-side emulator that runs these bodies (tests only).
int mb_tid();
int64_t mb_bid();
void mb_sync();
float mb_shfl_xor(float v, int mask);
#endif

// Read-only (non-coherent) global load on the device; a plain load in the host emulation.
template <class T>
MB_DEV T mb_ldg(const T* p) {
#if defined(__CUDA_ARCH__)
  return __ldg(p);
#else
  return *p;
#endif
}

// x, opaque to the compiler: values derived from it are formed where they are used instead of
// being hoisted out of a loop, where they would hold registers across it (the chunk kernels run
// at their register limit). Nothing on the host.
MB_DEV int mb_opaque(int x) {
#if defined(__CUDA_ARCH__)
  asm volatile("" : "+r"(x));
#endif
  return x;
}

// x, formed here: a value computed before a barrier stays there, rather than being sunk past the
// barrier by the compiler (which then keeps its operand alive in a copy made where that operand
// may still be in flight from global memory: the state chain's decay). Nothing on the host.
MB_DEV float mb_pin(float x) {
#if defined(__CUDA_ARCH__)
  asm volatile("" : "+f"(x));
#endif
  return x;
}

// a * b rounded to float, never contracted with an add that follows it into one FMA (the
// device's __fmul_rn). Where a later add is conditional at run time in one kernel and always
// taken in another (a condition a compile-time shape folds), nvcc may fuse the product with
// the add in the second only; this keeps the two kernels' bits equal. The host emulation (x86
// without -mfma) never contracts.
MB_DEV float mb_fmul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

// a * b + c as one FMA (the device's __fmaf_rn) where nvcc would otherwise choose which of two
// products to fuse: in x1 sn + x2 cs it fused x1 sn in one kernel and x2 cs in its
// compile-time-shape copy (the second pass's K1 at R = 1). With the products written as
// mb_fma_rn(x1, sn, mb_fmul_rn(x2, cs)) every copy computes the same. The host emulation
// computes a * b + c unfused, as before.
MB_DEV float mb_fma_rn(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return a * b + c;
#endif
}

// ------------------------------------------------------------------ bf16 pair primitives

MB_DEV uint32_t bf2_bits(__nv_bfloat162 v) { return *reinterpret_cast<uint32_t*>(&v); }

// (x0, x1) -> packed hi pair and lo pair.
MB_DEV void split2(float x0, float x1, uint32_t& hi, uint32_t& lo) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(x0, x1);
  const float2 hf = __bfloat1622float2(h);
  hi = bf2_bits(h);
  lo = bf2_bits(__floats2bfloat162_rn(x0 - hf.x, x1 - hf.y));
}

// Stores the split pair (x0, x1) at element e of the hi plane (lo plane `plane` elements later).
MB_DEV void st_split2(__nv_bfloat16* base, int plane, int e, float x0, float x1) {
  uint32_t hi, lo;
  split2(x0, x1, hi, lo);
  *reinterpret_cast<uint32_t*>(base + e) = hi;
  *reinterpret_cast<uint32_t*>(base + plane + e) = lo;
}

#if defined(__CUDACC__)
MB_DEV void ldsm4(uint32_t (&r)[4], const __nv_bfloat16* p) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}
MB_DEV void ldsm4t(uint32_t (&r)[4], const __nv_bfloat16* p) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}
// d += a * b, one m16n8k16 bf16 tile (fp32 accumulate).
MB_DEV void mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
#else
// Provided by the host-side emulator of the warp-collective instructions (tests only:
// tests/cpp/cta_emulator.cpp).
void ldsm4(uint32_t (&r)[4], const __nv_bfloat16* p);
void ldsm4t(uint32_t (&r)[4], const __nv_bfloat16* p);
void mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);
#endif

// An L2 prefetch of the line holding p (a hint; nothing to emulate on the host).
#if defined(__CUDA_ARCH__)
MB_DEV void mb_prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }
#else
inline void mb_prefetch_l2(const void*) {}
#endif

// Bulk asynchronous copies from shared to global memory (sm_90's bulk copy engine, what a TMA
// store uses without a tensor map): bytes (a multiple of 16, both addresses 16-byte aligned)
// from s to g, as a plain copy (bulk_s2g) or added into g's floats at L2 (bulk_add_s2g: the
// L2's fp32 add, round to nearest; subnormals flushed to zero, as red.add.f32 does). Each is in
// the calling thread's next bulk group (bulk_commit); bulk_wait_read waits until its groups have
// read their shared memory, bulk_wait until their writes are done. The shared-memory writes a
// copy reads must be ordered before it by fence_async_smem (each writing thread) and a barrier;
// generic loads of what a copy wrote after it by bulk_wait, fence_async_global (the issuing
// thread) and a barrier.
// Host (the emulator): done at once, in order.
#if defined(__CUDA_ARCH__)
MB_DEV void bulk_s2g(float* g, const float* s, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(g),
               "r"(static_cast<uint32_t>(__cvta_generic_to_shared(s))), "r"(bytes)
               : "memory");
}
MB_DEV void bulk_add_s2g(float* g, const float* s, uint32_t bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;" ::"l"(g),
               "r"(static_cast<uint32_t>(__cvta_generic_to_shared(s))), "r"(bytes)
               : "memory");
}
MB_DEV void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
MB_DEV void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }
MB_DEV void bulk_wait() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }
MB_DEV void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
// Orders the thread's completed bulk writes to global memory (async proxy) before its later
// generic accesses (and, through a barrier, other threads' loads).
MB_DEV void fence_async_global() { asm volatile("fence.proxy.async.global;" ::: "memory"); }
// A float4 load through L2 only (not L1): for data the bulk copies wrote.
MB_DEV float4 ld_cg4(const float* p) { return __ldcg(reinterpret_cast<const float4*>(p)); }
#else
inline float4 ld_cg4(const float* p) { return *reinterpret_cast<const float4*>(p); }
inline void bulk_s2g(float* g, const float* s, uint32_t bytes) { std::memcpy(g, s, bytes); }
inline void bulk_add_s2g(float* g, const float* s, uint32_t bytes) {
  for (uint32_t i = 0; i < bytes / 4; ++i) g[i] += s[i];
}
inline void bulk_commit() {}
inline void bulk_wait_read() {}
inline void bulk_wait() {}
inline void fence_async_smem() {}
inline void fence_async_global() {}
#endif

// L2 prefetches of the cnt elements p[off + j stride] (bytes es each): one request per 128-byte
// line when the elements are closer than a line, else one per element.
MB_DEV void mb_prefetch_row(const unsigned char* p, int es, int64_t off, int64_t stride, int cnt) {
  const int64_t span = (stride < 0 ? -stride : stride) * es;
  const int step = span >= 128 || span == 0 ? 1 : static_cast<int>(128 / span);
  for (int j = 0; j < cnt; j += step) mb_prefetch_l2(p + (off + j * stride) * es);
}

// Fragment row addresses for ldmatrix: on the device 32-bit shared-window byte addresses, on the
// host (emulation) element pointers.
#if defined(__CUDACC__)
using SmemAddr = uint32_t;
MB_DEV SmemAddr smem_addr(const __nv_bfloat16* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
MB_DEV SmemAddr smem_addr_add(SmemAddr a, int elems) {
  return a + 2u * static_cast<uint32_t>(elems);
}
template <bool TRANS>
MB_DEV void ldsm_at(uint32_t (&r)[4], SmemAddr a) {
  if constexpr (TRANS) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
  }
}
#else
using SmemAddr = const __nv_bfloat16*;
inline SmemAddr smem_addr(const __nv_bfloat16* p) { return p; }
inline SmemAddr smem_addr_add(SmemAddr a, int elems) { return a + elems; }
template <bool TRANS>
inline void ldsm_at(uint32_t (&r)[4], SmemAddr a) {
  if constexpr (TRANS) ldsm4t(r, a);
  else ldsm4(r, a);
}
#endif

// A split tile in shared memory: hi plane at h, lo plane `plane` elements later, row stride ld.
struct SplitTile {
  __nv_bfloat16* h;
  int plane, ld;
};

// The hi and lo fragments of tile t at element offset off (TRANS: ldmatrix .trans).
template <bool TRANS>
MB_DEV void ldsm_split(uint32_t (&hi)[4], uint32_t (&lo)[4], const SplitTile& t, int off) {
  if constexpr (TRANS) {
    ldsm4t(hi, t.h + off);
    ldsm4t(lo, t.h + t.plane + off);
  } else {
    ldsm4(hi, t.h + off);
    ldsm4(lo, t.h + t.plane + off);
  }
}

// The fp32 value of the bits u.
MB_DEV float mb_u2f(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

// A raw bf16 pair (low half first) as fp32 (exact): a shift and a mask, not the compiler's byte
// permutes.
MB_DEV float2 bf2_f(uint32_t u) { return make_float2(mb_u2f(u << 16), mb_u2f(u & 0xffff0000u)); }

// Four raw bf16 as fp32 (exact), as bf2_f.
MB_DEV float4 bf4_f(uint2 u) {
  return make_float4(mb_u2f(u.x << 16), mb_u2f(u.x & 0xffff0000u), mb_u2f(u.y << 16),
                     mb_u2f(u.y & 0xffff0000u));
}

// split2 (same values) with the bf16 -> fp32 widening of the hi pair as bit operations (a shift
// and a mask): through __bfloat1622float2 the compiler spends two extra byte permutes per pair.
MB_DEV void split2f(float x0, float x1, uint32_t& hi, uint32_t& lo) {
  hi = bf2_bits(__floats2bfloat162_rn(x0, x1));
  lo = bf2_bits(__floats2bfloat162_rn(x0 - mb_u2f(hi << 16), x1 - mb_u2f(hi & 0xffff0000u)));
}

// acc[j] += the split product of one 16 x 16 x 16 step: lo*hi, hi*lo, hi*hi for each 8-column
// half j (the order every caller uses: the same bits).
MB_DEV void mma_split3(float (&acc)[2][4], const uint32_t (&ah)[4], const uint32_t (&al)[4],
                       const uint32_t (&bh)[4], const uint32_t (&bl)[4]) {
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    mma16816(acc[j], al, bh[2 * j], bh[2 * j + 1]);
    mma16816(acc[j], ah, bl[2 * j], bl[2 * j + 1]);
    mma16816(acc[j], ah, bh[2 * j], bh[2 * j + 1]);
  }
}

// The warp's lane addresses of a 16 x 16 fragment of A (rows m0.., k..) and of B (columns
// n0.., k..) for ldmatrix (lane row lr = lane & 7, matrix lm = lane >> 3); A_KM / B_KN as in
// warp_mma_16x16.
template <bool A_KM>
MB_DEV int frag_off_a(int ld, int m0, int k, int lr, int lm) {
  return A_KM ? (k + lr + 8 * (lm >> 1)) * ld + m0 + 8 * (lm & 1)
              : (m0 + lr + 8 * (lm & 1)) * ld + k + 8 * (lm >> 1);
}
template <bool B_KN>
MB_DEV int frag_off_b(int ld, int n0, int k, int lr, int lm) {
  return B_KN ? (k + lr + 8 * (lm & 1)) * ld + n0 + 8 * (lm >> 1)
              : (n0 + lr + 8 * (lm >> 1)) * ld + k + 8 * (lm & 1);
}

// One k-step of warp_mma_16x16 (lane row lr = lane & 7, matrix lm = lane >> 3).
template <bool A_KM, bool B_KN>
MB_DEV void mma_kstep(float (&acc)[2][4], const SplitTile& A, int m0, const SplitTile& B, int n0,
                      int k, int lr, int lm) {
  const int ao = frag_off_a<A_KM>(A.ld, m0, k, lr, lm);
  const int bo = frag_off_b<B_KN>(B.ld, n0, k, lr, lm);
  uint32_t ah[4], al[4], bh[4], bl[4];
  ldsm_split<A_KM>(ah, al, A, ao);
  ldsm_split<B_KN>(bh, bl, B, bo);
  mma_split3(acc, ah, al, bh, bl);
}

// acc[j] (16 x 8 C fragments at rows m0.., columns n0 + 8j, j < 2) += A B over k in [k0, k1)
// (multiples of 16). A_KM: A is stored k-major ([k][m], read transposed); else [m][k].
// B_KN: B is stored [k][n] (read transposed); else [n][k]. Each product is hi*hi + hi*lo +
// lo*hi. Every lane of the warp calls it with the same arguments.
// UNROLL > 0: the k loop unrolled UNROLL times (else as the compiler chooses: for a runtime
// trip count nvcc emits a 16 / 8 / 4 / 2 / 1 ladder of ~30 k steps of code per call site).
// INC: the lane addresses formed once and advanced by one add per operand and k step, B's
// fragments loaded before A's (the same values and mma); else formed from the indices at every
// step (mma_kstep). Chosen per caller by measurement (H200, session 14): INC took the planes K1
// from 0.59 to 0.54 ms at N256 C8 and 0.58 to 0.51 at N128 P128 C8 (same elsewhere), but the
// planes K3 +1.2% at N128 P64 R4 C16 (K3 takes it at N256 C8 only: IncAddr). Same bits.
template <bool A_KM, bool B_KN, int UNROLL = 0, bool INC = false>
MB_DEV void warp_mma_16x16(float (&acc)[2][4], const SplitTile& A, int m0, const SplitTile& B,
                           int n0, int k0, int k1) {
  const int lane = mb_tid() & 31, lr = lane & 7, lm = lane >> 3;
  if constexpr (INC) {
    SmemAddr pa = smem_addr(A.h + frag_off_a<A_KM>(A.ld, m0, k0, lr, lm));
    SmemAddr pb = smem_addr(B.h + frag_off_b<B_KN>(B.ld, n0, k0, lr, lm));
    const int da = A_KM ? 16 * A.ld : 16, db = B_KN ? 16 * B.ld : 16;
    auto step = [&] {
      uint32_t bh[4], bl[4], ah[4], al[4];
      ldsm_at<B_KN>(bh, pb);
      ldsm_at<B_KN>(bl, smem_addr_add(pb, B.plane));
      ldsm_at<A_KM>(ah, pa);
      ldsm_at<A_KM>(al, smem_addr_add(pa, A.plane));
      mma_split3(acc, ah, al, bh, bl);
      pa = smem_addr_add(pa, da);
      pb = smem_addr_add(pb, db);
    };
    if constexpr (UNROLL > 0) {
#pragma unroll UNROLL
      for (int k = k0; k < k1; k += 16) step();
    } else {
      for (int k = k0; k < k1; k += 16) step();
    }
  } else if constexpr (UNROLL > 0) {
#pragma unroll UNROLL
    for (int k = k0; k < k1; k += 16) {
      mma_kstep<A_KM, B_KN>(acc, A, m0, B, n0, k, lr, lm);
    }
  } else {
    for (int k = k0; k < k1; k += 16) {
      mma_kstep<A_KM, B_KN>(acc, A, m0, B, n0, k, lr, lm);
    }
  }
}

// Two tiles of the same columns n0.. (rows ma.. and mb..) as two warp_mma_16x16 calls, tile a
// over k in [ka0, ka1) and tile b over [kb0, kb1), with B's fragments loaded once for the k
// steps both take: 6 ldmatrix per 12 mma instead of 8 where the ranges overlap (the products
// are bound by shared-memory bandwidth at 16 x 16 warp tiles: docs/PERF.md, session 14). Each
// tile's k steps run in increasing k with the same fragments and mma as warp_mma_16x16's: the
// same bits.
// INC: lane addresses advanced per k step, as warp_mma_16x16's INC.
template <bool A_KM, bool B_KN, int UNROLL, bool INC = false>
MB_DEV void warp_mma_16x16_pair(float (&acc_a)[2][4], int ma, int ka0, int ka1,
                                float (&acc_b)[2][4], int mb, int kb0, int kb1,
                                const SplitTile& A, const SplitTile& B, int n0) {
  const int lane = mb_tid() & 31, lr = lane & 7, lm = lane >> 3;
  const int k0 = ka0 < kb0 ? ka0 : kb0, k1 = ka1 > kb1 ? ka1 : kb1;
  if constexpr (INC) {
    SmemAddr pa = smem_addr(A.h + frag_off_a<A_KM>(A.ld, ma, k0, lr, lm));
    SmemAddr pc = smem_addr(A.h + frag_off_a<A_KM>(A.ld, mb, k0, lr, lm));
    SmemAddr pb = smem_addr(B.h + frag_off_b<B_KN>(B.ld, n0, k0, lr, lm));
    const int da = A_KM ? 16 * A.ld : 16, db = B_KN ? 16 * B.ld : 16;
    auto tile = [&](float (&acc)[2][4], SmemAddr p, const uint32_t (&bh)[4],
                    const uint32_t (&bl)[4]) {
      uint32_t ah[4], al[4];
      ldsm_at<A_KM>(ah, p);
      ldsm_at<A_KM>(al, smem_addr_add(p, A.plane));
      mma_split3(acc, ah, al, bh, bl);
    };
#pragma unroll UNROLL
    for (int k = k0; k < k1; k += 16) {
      uint32_t bh[4], bl[4];
      ldsm_at<B_KN>(bh, pb);
      ldsm_at<B_KN>(bl, smem_addr_add(pb, B.plane));
      if (k >= ka0 && k < ka1) tile(acc_a, pa, bh, bl);
      if (k >= kb0 && k < kb1) tile(acc_b, pc, bh, bl);
      pa = smem_addr_add(pa, da);
      pc = smem_addr_add(pc, da);
      pb = smem_addr_add(pb, db);
    }
    return;
  }
  auto step = [&](float (&acc)[2][4], int m0, int k, const uint32_t (&bh)[4],
                  const uint32_t (&bl)[4]) {
    uint32_t ah[4], al[4];
    ldsm_split<A_KM>(ah, al, A, frag_off_a<A_KM>(A.ld, m0, k, lr, lm));
    mma_split3(acc, ah, al, bh, bl);
  };
#pragma unroll UNROLL
  for (int k = k0; k < k1; k += 16) {
    const int bo = frag_off_b<B_KN>(B.ld, n0, k, lr, lm);
    uint32_t bh[4], bl[4];
    ldsm_split<B_KN>(bh, bl, B, bo);
    if (k >= ka0 && k < ka1) step(acc_a, ma, k, bh, bl);
    if (k >= kb0 && k < kb1) step(acc_b, mb, k, bh, bl);
  }
}

MB_DEV void zero_acc(float (&acc)[2][4]) {
#pragma unroll
  for (int j = 0; j < 2; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[j][e] = 0.f;
}

}  // namespace mamba3::cuda::mimo
