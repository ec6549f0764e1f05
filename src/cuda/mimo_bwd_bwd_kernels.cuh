// Kernels of mamba3_mimo_bwd_bwd (CUDA backend, seed 001), the CPU backend's algorithm
// (src/cpu/mimo_bwd_bwd.cpp; formulas in golden/include/mamba3_golden/mimo_bwd_bwd.hpp) over fp32
// scratch in the workspace. The chunk products are block GEMMs (block_gemm: register-tiled FFMA;
// block_gemm_tc: 3xTF32 mma.sync for 16-bit activations) over masked coefficient matrices. Not
// yet fast (see docs/PERF.md): the operands live in global scratch, not shared memory. Included
// by mimo_bwd_bwd.cu; the bodies use only the primitives at the top (thread / block index,
// barrier, typed loads and stores), so the tests also run them on the host
// (test_mimo_bwd_bwd_emulated.cpp; the tensor-core products run there as FFMA tiles).
//
// The only serial dependency is dS_c = dL/dSt of the state leaving chunk c, carried backwards
// over the chunks of one (b, h):
//   dS_{c-1} = decay_c dS_c + U_c,   U_c = sum_{i,r} E_i qh_i^r (x) dPhiO_i^r   ([N, P]).
// Everything else of a chunk needs only its own inputs, states[c] and dS_c. Four kernels:
//   K1 (one CTA per (b, h, c), c >= 1): U_c into the workspace slab `ds` [B*H, nch, N*P].
//   K2 (one thread per (b, h, n, p)): the reverse scan, in place: afterwards ds[bh, c] = dS_c
//      (zero for the last chunk).
//   K3 (grid-stride over the chunks, each CTA owns one scratch slot of the workspace): the
//      chunk's rows (rotated q / k, x, dPhiO) in fp32, the pairwise products KQ / XG, then every
//      output of the chunk: DQ, DK, DV, DANGLES, DFACTOR, DGAMMA, DDA, DSSDA, DDA_CS_REV, DDA_CS,
//      and the chunk's partials of DMIMO_V and DD.
//   For bf16 q, k, v with power-of-two N, P, R, C (when the planes fit the shared memory: all
//   of SPEC.md's grid) the plan takes the planes kernels for K1 and K3 instead
//   (mimo_bwd_bwd_chunk_planes.cuh: operands as bf16 hi/lo planes in shared memory, mma
//   products; same U_c, outputs and partials; K3 one CTA per SM, grid-stride);
//   increment_body and chunk_body stay for the rest (fp16 activations among them: see
//   make_plan).
//   K4: sums those partials over the chunks in a fixed order (compensated): DMIMO_V, DD.
//   Where the planes K3 is specialised to the shape and the contiguous layouts of its operand
//   set (but N32), K1 and K2 are one kernel (mimo_bwd_bwd_state_chain.cuh: dS carried in
//   registers over the chunks, U never written; the same bits).
// Determinism: every reduction runs in one thread or through a fixed-shape block tree (shared
// memory, or warp-shuffle butterflies); nothing depends on scheduling (no atomics), so repeated
// calls give identical bits.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <type_traits>

#include "core/error.hpp"
#include "core/mimo_bwd_bwd_params.hpp"
#include "cuda/rt_dtype.cuh"

#if defined(__CUDACC__)
#define BB_DEV __device__ __forceinline__
#define BB_HD __host__ __device__ inline
#define BB_UNROLL _Pragma("unroll")
#define BB_NO_UNROLL _Pragma("unroll 1")
#else
#define BB_DEV inline
#define BB_HD inline
#define BB_UNROLL
#define BB_NO_UNROLL
#endif

namespace mamba3::cuda::bb {

constexpr int kThreads = 256;       // every kernel; block_sum assumes a power of two
constexpr int kMaxC = 64;           // largest chunk size the params allow
constexpr int kMaxR = 8;            // largest rank the params allow
constexpr int kK1Smem = 48 * 1024;  // K1: shared memory for its row tiles (the default limit)
// K3 CTAs (and scratch slots; bounds the workspace): 3 per SM of a 132-SM H100 / H200 (K3 is
// compiled for 3 resident CTAs per SM).
constexpr int64_t kMaxSlots = 396;
constexpr size_t kAlign = 256;      // workspace base alignment (bytes)

// ------------------------------------------------------------------ primitives

#if defined(__CUDACC__)
BB_DEV int bb_tid() { return static_cast<int>(threadIdx.x); }
BB_DEV int64_t bb_bid() { return static_cast<int64_t>(blockIdx.x); }
BB_DEV int64_t bb_nblocks() { return static_cast<int64_t>(gridDim.x); }
BB_DEV void bb_sync() { __syncthreads(); }
BB_DEV void bb_sincos(float x, float* s, float* c) { sincosf(x, s, c); }
BB_DEV int bb_min(int a, int b) { return min(a, b); }
#else
// Provided by the host emulator that runs these bodies (tests only).
int bb_tid();
int64_t bb_bid();
int64_t bb_nblocks();
void bb_sync();
inline void bb_sincos(float x, float* s, float* c) {
  *s = std::sin(x);
  *c = std::cos(x);
}
inline int bb_min(int a, int b) { return std::min(a, b); }
#endif

// K3 on the planes kernel (mimo_bwd_bwd_chunk_planes.cuh): one CTA of kPlanesThreads per SM,
// grid-stride over the (b, h, chunk) items, every chunk operand in shared memory as bf16 hi/lo
// planes. Byte offsets of its regions in dynamic shared memory (and of K1's on planes),
// computed once on the host (planes_layout).
constexpr int kPlanesThreads = 512;        // 16 warps: one CTA per SM holds the whole chunk
constexpr int kIncPlanesThreads = 256;     // K1 on planes: ~50 KB per CTA, several per SM
// K1 on planes, generic and shape copies: CTAs per SM of its launch bounds (<= 64 registers;
// ptxas: no spills at any grid shape; mimo_bwd_bwd_ct.cuh has the measurements).
constexpr int kIncPlanesMinBlocks = 4;
constexpr int kPlanesWarps = kPlanesThreads / 32;
constexpr int kPlanesTilesPerWarp = 2;     // 16 x 16 tiles of dqh, dkh, dx kept per warp
constexpr int64_t kPlanesSmemMax = 227 * 1024;  // the H100 / H200 per-block opt-in limit
// Row padding (elements) of the planes: conflict-free ldmatrix rows. The planes K3's fp32
// [T][N] / [T][P] matrices over a dead plane pair (dqh, dkh, dx) take the same row stride in
// floats (a pair's bytes per row): its 8-byte tile stores are then conflict-free too.
constexpr int kPlanesPad = 8;

struct PlanesLayout {
  int ldN = 0, ldP = 0, ldT = 0;  // row strides (elements) of the [.][N], [.][P], [.][T] planes
  // Elements per plane (hi to lo) of [T][ldN], [T][ldP], [N][ldP], [T][ldT]: kernel parameters
  // rather than products formed in the kernel, which kept them in registers (K3 spilled).
  int plT_N = 0, plT_P = 0, plN_P = 0, plT_T = 0;
  // bf16 hi/lo planes (hi plane, then lo): qh, kh [T][ldN]; x, g (dPhiO) [T][ldP]; st [N][ldP]
  // (states[c], then dS_c); mc [T][ldT] (the coefficient matrix of the current product).
  // Reused in phase 3 as fp32: dqh in qh, dkh in kh [T][ldN], dx in x [T][ldP].
  int qh = 0, kh = 0, x = 0, g = 0, st = 0, mc = 0;
  int kq = 0, xg = 0;  // fp32 [T][ldT]
  // fp32 per-step scalars ([C], dt / lam [C + 1]), qk_dot [C][R][R], the block-sum buffer
  // [2 kPlanesWarps + 1] (block_sum2's per-warp partials, then the DDA total) and three
  // per-row partial sums [T][N / 16][3].
  int dacs = 0, dt = 0, lam = 0, E = 0, F = 0, ts = 0, gam = 0, qk = 0, red = 0, part = 0,
      W = 0;  // + exp(segsum) [C][C] (fp32, rows padded to C + 1)
  // q_bias, k_bias of the chunk's head [2][R][N] (fp32), staged once per chunk for phases 0
  // and 3; and, where it fits (cs >= 0: all of SPEC.md's grid but N128 R1 C64), the chunk's
  // (sin, cos) of the angles [C][A] (float2), from phase 0 for phase 3, else phase 3 calls
  // sincos again.
  int qb = 0, cs = -1;
  int64_t bytes = 0;
  // K1 on planes (increment_planes_body, kIncPlanesThreads): E qh [T][ldN] and dPhiO [T][ldP]
  // planes, then E [C] (fp32).
  int inc_g = 0, inc_E = 0;
  int64_t inc_bytes = 0;
};

// (constexpr: the specialised K3 asks at compile time whether its layout has the (sin, cos)
// table: GlobalAngleTable in mimo_bwd_bwd_chunk_planes.cuh.)
constexpr PlanesLayout planes_layout(int64_t N, int64_t P, int64_t R, int64_t C, int64_t A) {
  PlanesLayout L;
  const int64_t T = C * R;
  L.ldN = static_cast<int>(N + kPlanesPad), L.ldP = static_cast<int>(P + kPlanesPad);
  L.ldT = static_cast<int>(T + kPlanesPad);
  L.plT_N = static_cast<int>(T * L.ldN), L.plT_P = static_cast<int>(T * L.ldP);
  L.plN_P = static_cast<int>(N * L.ldP), L.plT_T = static_cast<int>(T * L.ldT);
  int64_t o = 0;
  auto take = [&o](int64_t bytes) {
    const int64_t at = o;
    o += (bytes + 15) / 16 * 16;  // ldmatrix rows need 16-byte alignment
    return static_cast<int>(at);
  };
  const int64_t bf2 = 2 * 2;  // two bf16 planes
  L.qh = take(bf2 * T * L.ldN);
  L.kh = take(bf2 * T * L.ldN);
  L.x = take(bf2 * T * L.ldP);
  L.g = take(bf2 * T * L.ldP);
  L.st = take(bf2 * N * L.ldP);
  L.mc = take(bf2 * T * L.ldT);
  L.kq = take(4 * T * L.ldT);  // fp32 rows padded as mc's (conflict-free tile stores)
  L.xg = take(4 * T * L.ldT);
  L.dacs = take(4 * C);
  L.dt = take(4 * (C + 1));
  L.lam = take(4 * (C + 1));
  L.E = take(4 * C);
  L.F = take(4 * C);
  L.ts = take(4 * C);
  L.gam = take(4 * C);
  L.qk = take(4 * C * R * R);
  L.red = take(4 * (2 * kPlanesWarps + 1));  // block_sum2's warp partials and the DDA total
  L.part = take(4 * 3 * T * (N / 16));
  L.W = take(4 * C * (C + 1));  // rows of C + 1 floats (chunk_planes_body: Wf)
  L.qb = take(4 * 2 * R * N);
  const int64_t cs_bytes = 8 * C * std::max<int64_t>(A, 1);
  if (o + cs_bytes <= kPlanesSmemMax) L.cs = take(cs_bytes);
  L.bytes = o;
  o = 0;
  take(bf2 * T * L.ldN);
  L.inc_g = take(bf2 * T * L.ldP);
  L.inc_E = take(4 * C);
  L.inc_bytes = o;
  return L;
}

// A tensor as the kernels see it: byte pointer (byte_offset applied), runtime dtype, strides
// in elements.
struct View {
  unsigned char* p = nullptr;
  int dt = 2;
  int64_t s[5] = {0, 0, 0, 0, 0};
  static constexpr bool kI32 = false;  // offsets in 64 bits (CView: 32)
};

// A tensor of a compile-time dtype DT and layout (the planes K3 specialised to the contiguous
// layouts: ArgsCT<.., kCtBwdBwd / kCtCombined>): strides s[i] = K_i where K_i > 0 (compile-
// time: derived from the compile-time dims; the last one 1), else the runtime v[i] (32-bit).
// Offsets (o1 .. o5) in 32 bits: the host takes that kernel only for tensors of at most 2^30
// elements (ct_layout_ok).
// Reads as View (p, dt, s[i]), so that the kernel bodies take either.
template <int DT, int... K>
struct CView {
  static constexpr int kRank = sizeof...(K);
  static constexpr int dt = DT;
  static constexpr bool kI32 = true;
  // K_i, or 0 (runtime) for i >= kRank too.
  static BB_HD constexpr int kat(int i) {
    int j = 0, r = 0;
    ((r = j++ == i ? K : r), ...);
    return r;
  }
  struct Strides {
    int v[kRank];
    BB_HD int operator[](int i) const {
      return i >= kRank ? 0 : kat(i) > 0 ? kat(i) : v[i];
    }
  };
  unsigned char* p;
  Strides s;
};

// Division by a runtime divisor d >= 1 of 0 <= n < 2^31 as a multiply-high, an add and a shift
// (the round-up multiplier m = floor(2^32 (2^s - d) / d) + 1, s = ceil(log2 d); exact for
// n < 2^32, the sum below does not overflow for n < 2^31): the planes K3 splits its item index
// into (b, h, c) per chunk, where nvcc's division sequences cost ~20 instructions each.
struct FastDiv {
  uint32_t m = 1;
  int s = 0;
  BB_DEV int div(int n) const {
    const uint32_t u = static_cast<uint32_t>(n);
#if defined(__CUDA_ARCH__)
    const uint32_t hi = __umulhi(m, u);
#else
    const uint32_t hi = static_cast<uint32_t>((uint64_t{m} * u) >> 32);
#endif
    return static_cast<int>((hi + u) >> s);
  }
};
inline FastDiv fast_div(int64_t d) {  // host
  FastDiv f;
  while ((int64_t{1} << f.s) < d) ++f.s;
  f.m = static_cast<uint32_t>(((uint64_t{1} << 32) * ((uint64_t{1} << f.s) - d)) / d + 1);
  return f;
}

struct Args {
  int B, S, H, G, N, P, R, C, A, half, nch, HG;
  FastDiv div_nch, div_H, div_HG;  // by nch, H, HG (the planes K3's item decomposition)
  int layout;  // 0 reduce-O, 1 per rank, 2 packed (MimoDout order)
  int has_d;
  int gate;  // dPhiO carries the combined backward's Z gate (z_gate)
  View z, mimo_z;
  View dout, q, k, v, q_bias, k_bias, mimo_v, states, qk_dot, da_cs, da_cs_rev, dt, trap, segsum,
      angles, mimo_o, d;
  View dq, dk, dv, dmimo_v, dangles, dfactor, dgamma, dda, dssda, dda_cs_rev, dda_cs, dd;
  float* ws_ds;    // [B*H][nch][N*P]: U_c, then dS_c
  float* ws_part;  // [B*H][nch][R*P]: per-chunk DMIMO_V partials
  float* ws_dd;    // [B*H][nch]: per-chunk DD partials
  // [B*H][S][A] (sin, cos) of the angles (angle_table_body), for the planes K3 where its shared
  // memory has no room for the per-chunk table (PlanesLayout::cs < 0); else nullptr.
  float2* ws_cs;
  FastDiv div_cs;  // by cs_nb, the angle table's CTAs per (b, h) (angle_table_body)
  int cs_nb;
  int lgA;         // log2(A) (A = N / 2 or N / 4: a power of two on the planes path)
  float* ws_slot;  // [nslots][slot_floats]: K3 scratch
  int64_t slot_floats;
  int k1_rows;  // K1: rows per shared-memory tile
  int tc;       // the chunk products on tensor cores (3xTF32; see block_gemm_tc)
  // Offsets (floats) of the scratch arrays inside a slot; Tm = C R rows at most.
  int64_t o_qh, o_kh, o_sg, o_sx, o_x, o_g, o_dp, o_kq, o_xg, o_st, o_m, o_qb, o_kb,
      o_cs, o_sn;
  int planes;        // K1 and K3 are the planes kernels (else increment_body, chunk_body)
  int prefetch;      // the planes K3 prefetches its next chunk's inputs to L2
  PlanesLayout ply;  // its shared-memory layout
  // Planes path only (N, P, R, C powers of two there): their log2, so that the element loops
  // index with shifts and masks, not runtime divisions.
  int lgN, lgP, lgR, lgC, lgT;  // T = C R
  int lgtN, lgtP, lgtT;          // log2 of the 16-wide tile counts along N, P, T
  // Planes path: q, k, v, dout, states take pair loads (two consecutive elements of the last dim
  // in one load; see pair_layout), else two scalar loads of the same elements (same values);
  // dq, dk pair stores likewise. vec_q, vec_k, vec_dq, vec_dk: vec_level (2: quads too).
  int vec_q, vec_k, vec_v, vec_dout, vec_states, vec_dq, vec_dk;
  int bf16_z_pairs;  // Args::gate with a bf16 z in pair layout: one 4-byte load per pair
  // The combined backward's q / k group sums done by K3 (QkGroup; set by the combined backward,
  // read only by the K3 specialised to its operands, kQkGroup): dq / dk summed over the heads of
  // each group into dq_grp / dk_grp ([B, S, R, G, N], the caller's dtype and strides; vec_grp:
  // vec_level of both), with the running sums in the per-head dq / dk slots of each group's first
  // head, and each (b, h, chunk)'s sums over its steps into qk_part
  // ([2][B nch][R H N], the bias gradients' partials).
  int qk_group, vec_grp;
  View dq_grp, dk_grp;
  float* qk_part;
  // K3 specialisations that do the group sums (ArgsCT<.., kCtCombined>) override this.
  static constexpr int kQkGroup = 0;
};

// K3's shared memory (per CTA).
struct ChunkShared {
  float dacs[kMaxC], dt[kMaxC + 1], lam[kMaxC + 1];
  float E[kMaxC], F[kMaxC], ts[kMaxC], gam[kMaxC];
  float W[kMaxC * kMaxC];           // [i][j] (row stride C) exp(segsum), j < i; 0 elsewhere
  float qk[kMaxC * kMaxR * kMaxR];  // qk_dot of the chunk [i][r][r2]
  float red[kThreads];              // block_sum, step_sums
  float s1[kMaxC], s2[kMaxC];       // step_sums results
};

// ------------------------------------------------------------------ element access

// (Templates over View and CView: with a CView the dtype branch and the unit / compile-time
// strides fold, and the offsets are 32-bit.)
template <class V>
BB_DEV float ld(const V& v, int64_t off) { return rt_ld(v.p, off, v.dt); }
template <class V>
BB_DEV void st(const V& v, int64_t off, float x) { rt_st(v.p, off, v.dt, x); }
// Offset type of a view's element offsets (same values either way: see CView).
template <class V>
using off_t_of = std::conditional_t<V::kI32, int, int64_t>;
template <class V>
BB_DEV int64_t o1(const V& v, int64_t i0) {
  using O = off_t_of<V>;
  return static_cast<O>(i0) * v.s[0];
}
template <class V>
BB_DEV int64_t o2(const V& v, int64_t i0, int64_t i1) {
  using O = off_t_of<V>;
  return static_cast<O>(i0) * v.s[0] + static_cast<O>(i1) * v.s[1];
}
template <class V>
BB_DEV int64_t o3(const V& v, int64_t i0, int64_t i1, int64_t i2) {
  using O = off_t_of<V>;
  return static_cast<O>(i0) * v.s[0] + static_cast<O>(i1) * v.s[1] +
         static_cast<O>(i2) * v.s[2];
}
template <class V>
BB_DEV int64_t o4(const V& v, int64_t i0, int64_t i1, int64_t i2, int64_t i3) {
  using O = off_t_of<V>;
  return static_cast<O>(i0) * v.s[0] + static_cast<O>(i1) * v.s[1] +
         static_cast<O>(i2) * v.s[2] + static_cast<O>(i3) * v.s[3];
}
template <class V>
BB_DEV int64_t o5(const V& v, int64_t i0, int64_t i1, int64_t i2, int64_t i3, int64_t i4) {
  using O = off_t_of<V>;
  return static_cast<O>(i0) * v.s[0] + static_cast<O>(i1) * v.s[1] +
         static_cast<O>(i2) * v.s[2] + static_cast<O>(i3) * v.s[3] +
         static_cast<O>(i4) * v.s[4];
}

BB_DEV float sigmoid_f(float x) { return 1.f / (1.f + expf(-x)); }

// silu(u) = u / (1 + e^-u) with the approximate division (~2 ulp; in the planes K3 the IEEE
// division's slow-path call made ptxas spill at its 128 registers) and the approximate
// exponential (ex2.approx of u log2 e, as the first pass's lean_gate; expf's range reduction
// was ~11 more SASS instructions per gate value, which the state chain forms once per row
// block). Its error, ~1e-6 relative at worst (|u| <= 16), is below the ~2^-17 of the bf16
// hi/lo products that consume it.
BB_DEV float silu_f(float u) {
#if defined(__CUDA_ARCH__)
  return __fdividef(u, 1.f + __expf(-u));
#else
  return u / (1.f + expf(-u));  // the host emulation (its combined tests): exact division
#endif
}

// The Z gate of dPhiO element (t, r, p) of head h (Args::gate): silu(z mimo_z^r);
// dPhiO = (dout [mimo_o]) times it.
BB_DEV float z_gate(const Args& a, int b, int t, int h, int r, int p) {
  return silu_f(ld(a.z, o4(a.z, b, t, h, p)) * ld(a.mimo_z, o3(a.mimo_z, h, r, p)));
}

// Offset of element p = 0 of dPhiO row (t, r) in dout, and dout's stride along p (row-wise loads
// do the multi-stride index math once per row, not per element).
template <class AT>
BB_DEV int64_t dphio_row(const AT& a, int b, int t, int r, int h) {
  if (a.layout == 0) return o3(a.dout, b, t, h);
  if (a.layout == 1) return o4(a.dout, b, t, r, h);
  return o3(a.dout, b, h, static_cast<int64_t>(t) * a.R + r);
}
template <class AT>
BB_DEV int64_t dphio_pstride(const AT& a) { return a.layout == 1 ? a.dout.s[4] : a.dout.s[3]; }

// Sum over the block in a fixed tree (deterministic); every thread must call it and gets the
// total. Ends with a barrier, so `red` may be reused right after.
template <int NT = kThreads>
BB_DEV float block_sum(float v, float* red) {
  const int tid = bb_tid();
  red[tid] = v;
  bb_sync();
  for (int s = NT / 2; s > 0; s >>= 1) {
    if (tid < s) red[tid] += red[tid + s];
    bb_sync();
  }
  const float total = red[0];
  bb_sync();
  return total;
}

// out[i] = sum_{idx < cnt} f(i, idx) for every step i < L, split over kThreads / C threads per
// step (why: one thread per step left most of the block idle), the partials summed in a fixed
// order. Every thread must call it (barriers); `out` is ready for all threads on return.
template <class F>
BB_DEV void step_sums(int L, int C, int cnt, float* red, float* out, F f) {
  const int nper = kThreads / C, tid = bb_tid(), i = tid / nper, k = tid % nper;
  float acc[4] = {0.f, 0.f, 0.f, 0.f};  // four chains: the terms are scratch loads
  if (i < L)
    for (int idx = k; idx < cnt; idx += 4 * nper) {
      BB_UNROLL
      for (int u = 0; u < 4; ++u)
        if (idx + u * nper < cnt) acc[u] += f(i, idx + u * nper);
    }
  red[tid] = (acc[0] + acc[1]) + (acc[2] + acc[3]);
  bb_sync();
  if (tid < L) {
    float sum = 0.f;
    for (int k2 = 0; k2 < nper; ++k2) sum += red[tid * nper + k2];
    out[tid] = sum;
  }
  bb_sync();
}

// Error-free accumulation (sum + err is the compensated total), as the CPU backend's.
BB_DEV void comp_add(float& sum, float& err, float x) {
  const float t = sum + x;
  err += fabsf(sum) >= fabsf(x) ? (sum - t) + x : (x - t) + sum;
  sum = t;
}

// Block-wide product out(m, n) = sum_{k in krange(m0)} A[m am + k ak] B[k bk + n bn] for
// m < M, n < Nn, handed to epi(m, n, value). Register-tiled (why: the plain per-element dot
// products were bound by two loads per FMA and one serial chain per thread): each thread owns
// kTile x kTile outputs, so a k step costs 2 kTile loads for kTile^2 independent FMAs.
// krange(m0, rows, &kb, &ke) lets causal products skip the zero blocks of their coefficient
// matrix (rows m0 .. m0 + rows - 1 must be zero outside [kb, ke)). A thread's outputs depend only on
// (M, Nn): two products of the same M x Nn give every output to the same thread, so the second
// may accumulate into the first's results without a barrier.
constexpr int kTile = 4;

template <class KRange, class Epi>
BB_DEV void block_gemm(int M, int Nn, const float* A, int am, int ak, const float* B, int bk,
                       int bn, KRange krange, Epi epi) {
  const int tm = (M + kTile - 1) / kTile, tn = (Nn + kTile - 1) / kTile;
  for (int tile = bb_tid(); tile < tm * tn; tile += kThreads) {
    const int m0 = (tile / tn) * kTile, n0 = (tile % tn) * kTile;
    float acc[kTile][kTile];
    const float* ap[kTile];
    const float* bp[kTile];
    BB_UNROLL
    for (int i = 0; i < kTile; ++i) {
      BB_UNROLL
      for (int j = 0; j < kTile; ++j) acc[i][j] = 0.f;
      // Rows / columns past the end read the last valid one; their results are dropped.
      ap[i] = A + static_cast<int64_t>(bb_min(m0 + i, M - 1)) * am;
      bp[i] = B + static_cast<int64_t>(bb_min(n0 + i, Nn - 1)) * bn;
    }
    int kb = 0, ke = 0;
    krange(m0, kTile, &kb, &ke);
    for (int k = kb; k < ke; ++k) {
      float av[kTile], bv[kTile];
      BB_UNROLL
      for (int i = 0; i < kTile; ++i) {
        av[i] = ap[i][static_cast<int64_t>(k) * ak];
        bv[i] = bp[i][static_cast<int64_t>(k) * bk];
      }
      BB_UNROLL
      for (int i = 0; i < kTile; ++i)
        BB_UNROLL
        for (int j = 0; j < kTile; ++j) acc[i][j] += av[i] * bv[j];
    }
    BB_UNROLL
    for (int i = 0; i < kTile; ++i)
      BB_UNROLL
      for (int j = 0; j < kTile; ++j)
        if (m0 + i < M && n0 + j < Nn) epi(m0 + i, n0 + j, acc[i][j]);
  }
}

// The whole contraction [0, K).
struct KAll {
  int K;
  BB_DEV void operator()(int, int, int* kb, int* ke) const {
    *kb = 0;
    *ke = K;
  }
};

// The same product on tensor cores (mma.sync m16n8k8, 3xTF32: every fp32 operand x split into
// hi = tf32(x), lo = tf32(x - hi), a b ~ a_lo b_hi + a_hi b_lo + a_hi b_hi, about 2^-21 relative
// per product). Chosen by the plan (Args::tc) only for 16-bit q, k, v, whose tolerances it meets
// with a wide margin; fp32 activations keep the FFMA tiles (float32-reference accuracy).
// Needs M % 16 == 0, Nn % 8 == 0 and a contraction length that is a multiple of 8 (the k range is
// widened to multiples of 8: the coefficient matrices hold explicit zeros there). Each warp owns
// 16 x 32 output tiles; the output-to-thread map depends only on (M, Nn), as block_gemm's.
#if defined(__CUDA_ARCH__)
BB_DEV uint32_t bb_tf32(float x) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
  return r;
}
BB_DEV void bb_split(float x, uint32_t& hi, uint32_t& lo) {
  hi = bb_tf32(x);
  lo = bb_tf32(x - __uint_as_float(hi));
}
// d += a b for one 16x8x8 tile (fragments as in the PTX ISA, g = lane / 4, q = lane % 4):
// a = A[g][q], A[g+8][q], A[g][q+4], A[g+8][q+4]; b = B[q][g], B[q+4][g];
// d = D[g][2q], D[g][2q+1], D[g+8][2q], D[g+8][2q+1].
BB_DEV void bb_mma(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

template <class KRange, class Epi>
BB_DEV void block_gemm_tc(int M, int Nn, const float* A, int am, int ak, const float* B, int bk,
                          int bn, KRange krange, Epi epi) {
  constexpr int kSub = 4;  // 8-column subtiles per warp tile
  const int lane = bb_tid() & 31, g = lane >> 2, q = lane & 3;
  const int tm = M / 16, tn = (Nn + 8 * kSub - 1) / (8 * kSub);
  for (int tile = bb_tid() >> 5; tile < tm * tn; tile += kThreads / 32) {
    const int m0 = (tile / tn) * 16, n0 = (tile % tn) * (8 * kSub);
    const int nsub = bb_min(kSub, (Nn - n0) / 8);
    float acc[kSub][4];
    BB_UNROLL
    for (int j = 0; j < kSub; ++j)
      BB_UNROLL
      for (int e = 0; e < 4; ++e) acc[j][e] = 0.f;
    int kb = 0, ke = 0;
    krange(m0, 16, &kb, &ke);
    kb &= ~7;
    ke = (ke + 7) & ~7;
    const float* a0 = A + static_cast<int64_t>(m0 + g) * am;
    const float* a8 = a0 + static_cast<int64_t>(8) * am;
    for (int k = kb; k < ke; k += 8) {
      const int64_t kq = static_cast<int64_t>(k + q) * ak, kq4 = kq + 4 * static_cast<int64_t>(ak);
      uint32_t ah[4], al[4];
      bb_split(a0[kq], ah[0], al[0]);
      bb_split(a8[kq], ah[1], al[1]);
      bb_split(a0[kq4], ah[2], al[2]);
      bb_split(a8[kq4], ah[3], al[3]);
      const float* bq = B + static_cast<int64_t>(k + q) * bk;
      const float* bq4 = bq + static_cast<int64_t>(4) * bk;
      BB_UNROLL
      for (int j = 0; j < kSub; ++j) {
        if (j < nsub) {
          const int64_t col = static_cast<int64_t>(n0 + 8 * j + g) * bn;
          uint32_t bh[2], bl[2];
          bb_split(bq[col], bh[0], bl[0]);
          bb_split(bq4[col], bh[1], bl[1]);
          bb_mma(acc[j], al, bh);
          bb_mma(acc[j], ah, bl);
          bb_mma(acc[j], ah, bh);
        }
      }
    }
    BB_UNROLL
    for (int j = 0; j < kSub; ++j) {
      if (j < nsub) {
        const int n = n0 + 8 * j + 2 * q;
        epi(m0 + g, n, acc[j][0]);
        epi(m0 + g, n + 1, acc[j][1]);
        epi(m0 + g + 8, n, acc[j][2]);
        epi(m0 + g + 8, n + 1, acc[j][3]);
      }
    }
  }
}
#endif

// The chunk products: tensor cores when the plan says so (device only), else the FFMA tiles.
template <class KRange, class Epi>
BB_DEV void gemm(const Args& a, int M, int Nn, const float* A, int am, int ak, const float* B,
                 int bk, int bn, KRange krange, Epi epi) {
#if defined(__CUDA_ARCH__)
  if (a.tc) {
    block_gemm_tc(M, Nn, A, am, ak, B, bk, bn, krange, epi);
    return;
  }
#endif
  block_gemm(M, Nn, A, am, ak, B, bk, bn, krange, epi);
}

// ------------------------------------------------------------------ K1: U_c

// smem: k1_rows * (N + P) floats (as many rows as fit kK1Smem: a whole chunk for most shapes,
// so U is written once instead of read and rewritten per tile).
BB_DEV void increment_body(const Args& a, float* smem) {
  const int64_t item = bb_bid();  // = bh * nch + c
  const int c = static_cast<int>(item % a.nch);
  if (c == 0) return;  // U_0 would only feed the state entering chunk 0, which nothing reads
  const int tid = bb_tid();
  const int64_t bh = item / a.nch;
  const int b = static_cast<int>(bh / a.H), h = static_cast<int>(bh % a.H);
  const int N = a.N, P = a.P, R = a.R;
  const int s0 = c * a.C, L = bb_min(a.C, a.S - s0), T = L * R;
  const int rows = a.k1_rows;
  const int Tg = a.tc ? (T + 15) / 16 * 16 : T;  // rows T .. Tg - 1 are zero (whole mma steps)
  float* sq = smem;             // [rows][N]: E_i qh_i^r
  float* sg = smem + rows * N;  // [rows][P]: dPhiO_i^r
  float* U = a.ws_ds + item * static_cast<int64_t>(N) * P;
  const int64_t q0 = int64_t{b} * a.q.s[0] + int64_t{h / a.HG} * a.q.s[3];
  const int64_t dps = dphio_pstride(a);
  for (int a0 = 0; a0 < Tg; a0 += rows) {
    const int nr = bb_min(rows, Tg - a0);
    // Biased q rows and dPhiO rows, each element loaded once ...
    for (int e = tid; e < nr * N; e += kThreads) {
      const int row = a0 + e / N, n = e % N, i = row / R, r = row % R, t = s0 + i;
      sq[e] = row < T ? ld(a.q, q0 + t * a.q.s[1] + r * a.q.s[2] + n * a.q.s[4]) +
                            ld(a.q_bias, o3(a.q_bias, h, r, n))
                      : 0.f;
    }
    for (int e = tid; e < nr * P; e += kThreads) {
      const int row = a0 + e / P, p = e % P, i = row / R, r = row % R, t = s0 + i;
      float vg = 0.f;
      if (row < T) {
        vg = ld(a.dout, dphio_row(a, b, t, r, h) + p * dps);
        if (a.layout == 0) vg *= ld(a.mimo_o, o3(a.mimo_o, h, r, p));
        if (a.gate) vg *= z_gate(a, b, t, h, r, p);
      }
      sg[e] = vg;
    }
    bb_sync();
    // ... then rotated in place (the thread of pair element j < A turns both j and half + j) and
    // scaled by E_i.
    for (int e = tid; e < nr * N; e += kThreads) {
      const int row = a0 + e / N, n = e % N, t = s0 + row / R;
      if (row >= T || (n >= a.half && n < a.half + a.A)) continue;
      const float E = expf(ld(a.da_cs, o3(a.da_cs, b, h, t)));
      if (n < a.A) {
        float sn, cs;
        bb_sincos(ld(a.angles, o4(a.angles, b, t, h, n)), &sn, &cs);
        const float u = sq[e], w = sq[e + a.half];
        sq[e] = E * (u * cs - w * sn);
        sq[e + a.half] = E * (u * sn + w * cs);
      } else {
        sq[e] *= E;
      }
    }
    bb_sync();
    // U[n][p] += sum_rows sq[row][n] sg[row][p]; the same N x P product every tile, so each
    // thread keeps its own elements of U across the row tiles (no races).
    const bool first = a0 == 0;
    gemm(a, N, P, sq, 1, N, sg, P, 1, KAll{nr}, [&](int n, int p, float v) {
      U[n * P + p] = first ? v : U[n * P + p] + v;
    });
    bb_sync();  // the tiles are restaged next
  }
}

// ------------------------------------------------------------------ the angle table

// ws_cs[(bh S + s) A + j] = (sin, cos) of angles[b, s, h, j]: the same bb_sincos of the same
// value as the planes K3's stage_chunk, hence the same bits. A CTA covers kThreads 4 / A steps of
// one (b, h), a thread four consecutive angles (A a power of two >= 4: make_plan's planes path),
// stored as two 16-byte pairs; no 64-bit division (one per element made this kernel ~3x slower).
BB_DEV void angle_table_body(const Args& a) {
  const int cta = static_cast<int>(bb_bid()), bh = a.div_cs.div(cta);
  const int lgq = a.lgA - 2, tid = bb_tid();
  static_assert(kThreads == 256, "the steps per CTA below are 2^8 >> lgq");
  const int s = ((cta - bh * a.cs_nb) << (8 - lgq)) + (tid >> lgq);
  if (s >= a.S) return;
  const int j = (tid & ((1 << lgq) - 1)) << 2, b = a.div_H.div(bh), h = bh - b * a.H;
  const int64_t o = int64_t{b} * a.angles.s[0] + int64_t{s} * a.angles.s[1] +
                    int64_t{h} * a.angles.s[2] + int64_t{j} * a.angles.s[3];
  float sv[4], cv[4];
  BB_UNROLL
  for (int u = 0; u < 4; ++u) bb_sincos(ld(a.angles, o + u * a.angles.s[3]), &sv[u], &cv[u]);
  float4* out = reinterpret_cast<float4*>(a.ws_cs + ((int64_t{bh} * a.S + s) << a.lgA) + j);
  out[0] = make_float4(sv[0], cv[0], sv[1], cv[1]);
  out[1] = make_float4(sv[2], cv[2], sv[3], cv[3]);
}

// ------------------------------------------------------------------ K2: reverse scan

// The scan's cells per thread: 4 (one 16-byte load / store per chunk) when N P is a multiple of
// 4 (the workspace is kAlign-aligned, so every chunk's cell group is too) and that still leaves
// >= 64K threads (~2 CTAs per SM), else 1. Why: one float per thread kept ~64 KB in flight per
// SM at N128 P64 and ran at ~63% of the copy ceiling; with 4 the scan is ~26% faster there, but
// at N16 P64 (B H = 64) 4 per thread left only 64 CTAs for 132 SMs and ran 7% slower. Tried:
// 16 chunks per group for the 1-wide case: 0.126 vs 0.074 ms at N32 P64 (and the build with it
// ran the 4-wide case at 0.188 instead of 0.147 ms at N128).
BB_HD int scan_width(int64_t BH, int64_t NP) {
  return NP % 4 == 0 && BH * NP / 4 >= (int64_t{1} << 16) ? 4 : 1;
}

template <int W>
BB_DEV void scan_cells(const Args& a, int64_t NP) {
  using V = typename std::conditional<W == 4, float4, float>::type;
  const int64_t idx = bb_bid() * kThreads + bb_tid();
  const int64_t NPW = NP / W;
  if (idx >= static_cast<int64_t>(a.B) * a.H * NPW) return;
  const int64_t bh = idx / NPW, e = (idx % NPW) * W;
  const int b = static_cast<int>(bh / a.H), h = static_cast<int>(bh % a.H);
  V* col = reinterpret_cast<V*>(a.ws_ds + bh * a.nch * NP + e);  // chunk c: col[c * NP / W]
  const int64_t cs = NP / W;
  // Chunks in groups of kScanU, each group's loads issued before its serial updates (why: one
  // dependent load per chunk made this kernel latency-bound, ~170 GB/s).
  constexpr int kScanU = 8;
  float acc[W];  // dS leaving the current chunk
  BB_UNROLL
  for (int w = 0; w < W; ++w) acc[w] = 0.f;
  for (int c1 = a.nch - 1; c1 >= 1; c1 -= kScanU) {
    V u[kScanU];
    float dec[kScanU];
    BB_UNROLL
    for (int j = 0; j < kScanU; ++j) {
      const int c = c1 - j;
      if (c >= 1) {
        u[j] = col[c * cs];
        dec[j] = expf(ld(a.da_cs, o3(a.da_cs, b, h, bb_min(c * a.C + a.C, a.S) - 1)));
      }
    }
    BB_UNROLL
    for (int j = 0; j < kScanU; ++j) {
      const int c = c1 - j;
      if (c >= 1) {
        const float* uj = reinterpret_cast<const float*>(&u[j]);
        V out;
        float* o = reinterpret_cast<float*>(&out);
        BB_UNROLL
        for (int w = 0; w < W; ++w) {
          o[w] = acc[w];
          acc[w] = dec[j] * acc[w] + uj[w];
        }
        col[c * cs] = out;
      }
    }
  }
  V out;  // U_0 is never formed: nothing reads the state entering chunk 0
  BB_UNROLL
  for (int w = 0; w < W; ++w) reinterpret_cast<float*>(&out)[w] = acc[w];
  col[0] = out;
}

BB_DEV void scan_body(const Args& a) {
  const int64_t NP = static_cast<int64_t>(a.N) * a.P;
  if (scan_width(static_cast<int64_t>(a.B) * a.H, NP) == 4)
    scan_cells<4>(a, NP);
  else
    scan_cells<1>(a, NP);
}

// ------------------------------------------------------------------ K3: the chunk pass

BB_DEV void chunk_body(const Args& a, ChunkShared& sh) {
  const int tid = bb_tid();
  const int N = a.N, P = a.P, R = a.R, C = a.C, A = a.A, half = a.half;
  const int NP = N * P;
  float* slot = a.ws_slot + bb_bid() * a.slot_floats;
  float* qh = slot + a.o_qh;    // [T][N] rotated biased q
  float* kh = slot + a.o_kh;    // [T][N] rotated biased k
  float* SG = slot + a.o_sg;    // [T][N] St dPhiO
  float* SX = slot + a.o_sx;    // [T][N] dS x
  float* dqh = SG;              // [T][N] dL/dqh (phase 2 on: in place of SG)
  float* dkh = SX;              // [T][N] dL/dkh / ts (in place of SX)
  float* xs = slot + a.o_x;     // [T][P] x = v * mimo_v
  float* gs = slot + a.o_g;     // [T][P] dPhiO
  float* dp = slot + a.o_dp;    // [T][P] dL/dx
  float* KQ = slot + a.o_kq;    // [Tg][Tg] kh_a . qh_b
  float* XG = slot + a.o_xg;    // [Tg][Tg] x_a . dPhiO_b
  float* St = slot + a.o_st;    // [N][P] states[c]
  float* Mc = slot + a.o_m;     // [Tg][Tg] a coefficient matrix of phase 2
  float* qb = slot + a.o_qb;    // [T][N] biased q (unrotated)
  float* kb = slot + a.o_kb;    // [T][N] biased k (unrotated)
  float* tcs = slot + a.o_cs;   // [L][A] cos of the step's angles
  float* tsn = slot + a.o_sn;   // [L][A] sin

  const int64_t total = static_cast<int64_t>(a.B) * a.H * a.nch;
  for (int64_t item = bb_bid(); item < total; item += bb_nblocks()) {
    const int c = static_cast<int>(item % a.nch);
    const int64_t bh = item / a.nch;
    const int b = static_cast<int>(bh / a.H), h = static_cast<int>(bh % a.H);
    const int s0 = c * C, L = bb_min(C, a.S - s0), Lx = bb_min(L + 1, a.S - s0), T = L * R;
    // The products run over Tg rows (whole 16-row mma tiles; rows T .. Tg - 1 of every row
    // operand and coefficient matrix are zero); KQ, XG and Mc have leading dimension Tg.
    const int Tg = a.tc ? (T + 15) / 16 * 16 : T;
    const bool partial = L < C;
    const float* dS = a.ws_ds + item * static_cast<int64_t>(NP);
    const float Dh = a.has_d ? ld(a.d, o1(a.d, h)) : 0.f;

    // ---- phase 0: per-step inputs, rows, state
    for (int i = tid; i < Lx; i += kThreads) {
      const int t = s0 + i;
      if (i < L) sh.dacs[i] = ld(a.da_cs, o3(a.da_cs, b, h, t));
      sh.dt[i] = ld(a.dt, o3(a.dt, b, h, t));
      sh.lam[i] = sigmoid_f(ld(a.trap, o3(a.trap, b, h, t)));
    }
    for (int e = tid; e < L * R * R; e += kThreads) {
      const int i = e / (R * R), r = (e / R) % R, r2 = e % R;
      sh.qk[e] = ld(a.qk_dot, o5(a.qk_dot, b, h, s0 + i, r, r2));
    }
    // Biased q / k rows (unrotated; phase 3's diagonal terms reuse them) and the step's
    // rotation table, each element loaded once (why: a per-element rotation reloaded both halves
    // and recomputed sincos, and the loads' index math dominated this kernel's instructions).
    {
      const int g = h / a.HG;
      const int64_t q0 = int64_t{b} * a.q.s[0] + int64_t{g} * a.q.s[3];
      const int64_t k0 = int64_t{b} * a.k.s[0] + int64_t{g} * a.k.s[3];
      for (int e = tid; e < Tg * N; e += kThreads) {
        const int row = e / N, n = e % N, i = row / R, r = row % R, t = s0 + i;
        float vq = 0.f, vk = 0.f;
        if (row < T) {
          const float bq = ld(a.q_bias, o3(a.q_bias, h, r, n));
          const float bk = ld(a.k_bias, o3(a.k_bias, h, r, n));
          vq = ld(a.q, q0 + t * a.q.s[1] + r * a.q.s[2] + n * a.q.s[4]) + bq;
          vk = ld(a.k, k0 + t * a.k.s[1] + r * a.k.s[2] + n * a.k.s[4]) + bk;
        }
        qb[e] = vq;
        kb[e] = vk;
      }
      for (int e = tid; e < L * A; e += kThreads) {
        const int i = e / A, j = e % A;
        bb_sincos(ld(a.angles, o4(a.angles, b, s0 + i, h, j)), &tsn[e], &tcs[e]);
      }
    }
    bb_sync();
    // Rotated rows: pairs (j, half + j), j < A, turned by the step's angle j.
    for (int e = tid; e < Tg * N; e += kThreads) {
      const int row = e / N, n = e % N, i = row / R;
      float vq = qb[e], vk = kb[e];
      if (row < T && (n < A || (n >= half && n < half + A))) {
        const int j = n < A ? n : n - half;
        const float cs = tcs[i * A + j], sn = tsn[i * A + j];
        const float pq = qb[n < A ? e + half : e - half], pk = kb[n < A ? e + half : e - half];
        vq = n < A ? vq * cs - pq * sn : pq * sn + vq * cs;
        vk = n < A ? vk * cs - pk * sn : pk * sn + vk * cs;
      }
      qh[e] = vq;
      kh[e] = vk;
    }
    const int64_t dps = dphio_pstride(a);
    for (int e = tid; e < Tg * P; e += kThreads) {
      const int row = e / P, p = e % P, i = row / R, r = row % R, t = s0 + i;
      float vx = 0.f, vg = 0.f;
      if (row < T) {
        vx = ld(a.v, o3(a.v, b, t, h) + p * a.v.s[3]) * ld(a.mimo_v, o3(a.mimo_v, h, r, p));
        vg = ld(a.dout, dphio_row(a, b, t, r, h) + p * dps);
        if (a.layout == 0) vg *= ld(a.mimo_o, o3(a.mimo_o, h, r, p));
        if (a.gate) vg *= z_gate(a, b, t, h, r, p);
      }
      xs[e] = vx;
      gs[e] = vg;
    }
    {
      const int64_t sb = o3(a.states, b, h, c);
      for (int e = tid; e < NP; e += kThreads)
        St[e] = ld(a.states, sb + (e / P) * a.states.s[3] + (e % P) * a.states.s[4]);
    }
    bb_sync();
    // Decays; a partial last chunk takes them from da_cs alone (the tail contract).
    const float da_last = sh.dacs[L - 1];
    for (int i = tid; i < L; i += kThreads) {
      sh.gam[i] = sh.dt[i] * sh.lam[i];
      sh.ts[i] = sh.gam[i] + (i + 1 < Lx ? sh.dt[i + 1] * (1.f - sh.lam[i + 1]) : 0.f);
      sh.E[i] = expf(sh.dacs[i]);
      sh.F[i] = expf(partial ? da_last - sh.dacs[i]
                             : ld(a.da_cs_rev, o3(a.da_cs_rev, b, h, s0 + i)));
    }
    for (int e = tid; e < C * C; e += kThreads) {
      const int i = e / C, j = e % C;
      float w = 0.f;
      if (i < L && j < i)
        w = expf(partial ? sh.dacs[i] - sh.dacs[j] : ld(a.segsum, o5(a.segsum, b, h, c, i, j)));
      sh.W[e] = w;
    }

    // ---- phase 1: pairwise products, state products, DDA
    // KQ[a][b] = kh_a . qh_b, XG[a][b] = x_a . dPhiO_b, SG[row][n] = sum_p St[n][p] dPhiO[row][p],
    // SX[row][n] = sum_p dS[n][p] x[row][p].
    gemm(a, Tg, Tg, kh, N, 1, qh, 1, N, KAll{N},
         [&](int m, int n, float v) { KQ[m * Tg + n] = v; });
    gemm(a, Tg, Tg, xs, P, 1, gs, 1, P, KAll{P},
         [&](int m, int n, float v) { XG[m * Tg + n] = v; });
    gemm(a, Tg, N, gs, P, 1, St, 1, P, KAll{P},
               [&](int m, int n, float v) { SG[m * N + n] = v; });
    gemm(a, Tg, N, xs, P, 1, dS, 1, P, KAll{P},
               [&](int m, int n, float v) { SX[m * N + n] = v; });
    float dda_part = 0.f;
    for (int e = tid; e < NP; e += kThreads) dda_part += St[e] * dS[e];
    const float dda = expf(da_last) * block_sum(dda_part, sh.red);  // its barriers end phase 1
    // DDA_CS and DDA_CS_REV / ts per step (stored below), before phase 2 overwrites SG and SX.
    // Step i's rows are the R N contiguous elements from i R N on.
    step_sums(L, C, R * N, sh.red, sh.s1,
              [&](int i, int idx) { return qh[i * R * N + idx] * SG[i * R * N + idx]; });
    step_sums(L, C, R * N, sh.red, sh.s2,
              [&](int i, int idx) { return kh[i * R * N + idx] * SX[i * R * N + idx]; });

    // ---- phase 2: dqh, dkh / ts, dx as products with masked coefficient matrices (in Mc)
    // Query row (i, r): the inter-chunk readout and the earlier keys (j, r') with j < i:
    //   dqh = E_i SG + M1 kh,  M1[(i,r)][(j,r')] = W[i][j] ts_j XG[(j,r')][(i,r)].
    for (int e = tid; e < Tg * Tg; e += kThreads) {
      const int row = e / Tg, ra = e % Tg, i = row / R, j = ra / R;
      Mc[e] = j < i && row < T ? sh.W[i * C + j] * sh.ts[j] * XG[ra * Tg + row] : 0.f;
    }
    bb_sync();
    gemm(a, Tg, N, Mc, Tg, 1, kh, N, 1,
               [&](int m0, int rows, int* kb, int* ke) {
                 *kb = 0;
                 *ke = (bb_min(m0 + rows, Tg) - 1) / R * R;  // keys of steps before the last row's
               },
               [&](int m, int n, float v) { dqh[m * N + n] = sh.E[m / R] * SG[m * N + n] + v; });
    bb_sync();
    // Key row (i, r2): the state increment and the later queries (j, r) with j > i (ts_i is
    // applied in phase 3):  dkh = F_i SX + M2 qh,  M2[(i,r2)][(j,r)] = W[j][i] XG[(i,r2)][(j,r)].
    for (int e = tid; e < Tg * Tg; e += kThreads) {
      const int row = e / Tg, rb = e % Tg, i = row / R, j = rb / R;
      Mc[e] = j > i && rb < T ? sh.W[j * C + i] * XG[row * Tg + rb] : 0.f;
    }
    bb_sync();
    gemm(a, Tg, N, Mc, Tg, 1, qh, N, 1,
               [&](int m0, int, int* kb, int* ke) {
                 *kb = bb_min((m0 / R + 1) * R, Tg);  // queries of steps after the first row's
                 *ke = Tg;
               },
               [&](int m, int n, float v) { dkh[m * N + n] = sh.F[m / R] * SX[m * N + n] + v; });
    bb_sync();
    // Value row (i, r2): the state increment F_i ts_i (kh dS), the later queries, the D skip and
    // the diagonal gamma_i qk_dot[i, r, r2]:  dx = F_i ts_i kh dS + M3 dPhiO with
    //   M3[(i,r2)][(j,r)] = W[j][i] ts_i KQ[(i,r2)][(j,r)] (j > i),
    //                       gamma_i qk_dot[i, r, r2] + D [r = r2] (j = i), 0 (j < i).
    for (int e = tid; e < Tg * Tg; e += kThreads) {
      const int row = e / Tg, rb = e % Tg, i = row / R, j = rb / R, r2 = row % R, r = rb % R;
      float m = 0.f;
      if (row >= T || rb >= T)
        m = 0.f;  // padding rows (their per-step scalars are not loaded)
      else if (j > i)
        m = sh.W[j * C + i] * sh.ts[i] * KQ[row * Tg + rb];
      else if (j == i)
        m = sh.gam[i] * sh.qk[(i * R + r) * R + r2] + (r == r2 ? Dh : 0.f);
      Mc[e] = m;
    }
    gemm(a, Tg, P, kh, N, 1, dS, P, 1, KAll{N},
               [&](int m, int n, float v) { dp[m * P + n] = sh.F[m / R] * sh.ts[m / R] * v; });
    bb_sync();
    // Same T x P shape: every output is owned by the thread that wrote it above.
    gemm(a, Tg, P, Mc, Tg, 1, gs, P, 1,
               [&](int m0, int, int* kb, int* ke) {
                 *kb = bb_min(m0 / R * R, Tg);  // from the first row's own step on
                 *ke = Tg;
               },
               [&](int m, int n, float v) { dp[m * P + n] += v; });
    for (int e = tid; e < C * C; e += kThreads) {
      // DSSDA[s, t]: every pair of valid steps, unmasked; rows / columns past the sequence 0.
      const int s = e / C, tq = e % C;
      float acc = 0.f;
      if (s < L && tq < L) {
        for (int r2 = 0; r2 < R; ++r2)
          for (int r = 0; r < R; ++r) {
            const int idx = (s * R + r2) * Tg + tq * R + r;
            acc += KQ[idx] * XG[idx];
          }
        acc *= sh.ts[s];
      }
      st(a.dssda, o5(a.dssda, b, h, c, s, tq), acc);
    }
    for (int i = tid; i < L; i += kThreads) {
      const int t = s0 + i;
      const float dcs = sh.s1[i], drev = sh.s2[i];
      float dgam = 0.f;
      for (int r = 0; r < R; ++r)
        for (int r2 = 0; r2 < R; ++r2)
          dgam += sh.qk[(i * R + r) * R + r2] * XG[(i * R + r2) * Tg + i * R + r];
      st(a.dda, o3(a.dda, b, h, t), dda);
      st(a.dda_cs, o3(a.dda_cs, b, h, t), dcs);
      st(a.dda_cs_rev, o3(a.dda_cs_rev, b, h, t), sh.ts[i] * drev);
      st(a.dgamma, o3(a.dgamma, b, h, t), dgam);
    }
    bb_sync();

    // ---- phase 3: rotation undone, diagonal q/k terms, angles, v / mimo_v / D
    step_sums(L, C, R * N, sh.red, sh.s1,
              [&](int i, int idx) { return kh[i * R * N + idx] * dkh[i * R * N + idx]; });
    for (int i = tid; i < L; i += kThreads) st(a.dfactor, o3(a.dfactor, b, h, s0 + i), sh.s1[i]);
    for (int e = tid; e < L * A; e += kThreads) {
      // d/dtheta of (u cos - w sin, u sin + w cos) is (-y2, y1) of the rotated pair.
      const int i = e / A, j = e % A;
      const float ts = sh.ts[i];
      float acc = 0.f;
      for (int r = 0; r < R; ++r) {
        const int base = (i * R + r) * N;
        const float gk0 = dkh[base + j] * ts, gk1 = dkh[base + half + j] * ts;
        acc += dqh[base + half + j] * qh[base + j] - dqh[base + j] * qh[base + half + j] +
               gk1 * kh[base + j] - gk0 * kh[base + half + j];
      }
      st(a.dangles, o4(a.dangles, b, s0 + i, h, j), acc);
    }
    for (int e = tid; e < T * N; e += kThreads) {
      const int row = e / N, n = e % N, i = row / R, r = row % R, t = s0 + i;
      const int base = row * N;
      const float ts = sh.ts[i], gam = sh.gam[i];
      float oq, ok;
      if (n < A || (n >= half && n < half + A)) {
        const int j = n < A ? n : n - half;
        const float cs = tcs[i * A + j], sn = tsn[i * A + j];
        const float q0 = dqh[base + j], q1 = dqh[base + half + j];
        const float k0 = dkh[base + j] * ts, k1 = dkh[base + half + j] * ts;
        if (n < A) {
          oq = q0 * cs + q1 * sn;
          ok = k0 * cs + k1 * sn;
        } else {
          oq = q1 * cs - q0 * sn;
          ok = k1 * cs - k0 * sn;
        }
      } else {
        oq = dqh[e];
        ok = dkh[e] * ts;
      }
      // Diagonal gamma_i sum qk_dot[i, r, r2] x^r2 with qk_dot = qb . kb (unrotated).
      for (int r2 = 0; r2 < R; ++r2)
        oq += (gam * XG[(i * R + r2) * Tg + row]) * kb[(i * R + r2) * N + n];
      for (int r1 = 0; r1 < R; ++r1)
        ok += (gam * XG[row * Tg + i * R + r1]) * qb[(i * R + r1) * N + n];
      const int64_t orow = static_cast<int64_t>(t) * R + r;
      st(a.dq, o4(a.dq, b, orow, h, n), oq);
      st(a.dk, o4(a.dk, b, orow, h, n), ok);
    }
    for (int e = tid; e < L * P; e += kThreads) {
      const int i = e / P, p = e % P;
      float acc = 0.f;
      for (int r = 0; r < R; ++r)
        acc += dp[(i * R + r) * P + p] * ld(a.mimo_v, o3(a.mimo_v, h, r, p));
      st(a.dv, o4(a.dv, b, s0 + i, h, p), acc);
    }
    for (int e = tid; e < R * P; e += kThreads) {
      const int r = e / P, p = e % P;
      float acc = 0.f;
      for (int i = 0; i < L; ++i)
        acc += dp[(i * R + r) * P + p] * ld(a.v, o4(a.v, b, s0 + i, h, p));
      a.ws_part[item * (static_cast<int64_t>(R) * P) + e] = acc;
    }
    if (a.has_d) {  // uniform over the block
      float part = 0.f;
      for (int e = tid; e < T * P; e += kThreads) part += gs[e] * xs[e];
      const float tot = block_sum(part, sh.red);
      if (tid == 0) a.ws_dd[item] = tot;
    }
    bb_sync();  // the slot and the shared scalars are rewritten for the next chunk
  }
}

// ------------------------------------------------------------------ K4: partial sums

BB_DEV void reduce_body(const Args& a) {
  const int64_t idx = bb_bid() * kThreads + bb_tid();
  const int64_t RP = static_cast<int64_t>(a.R) * a.P;
  const int64_t BH = static_cast<int64_t>(a.B) * a.H, nv = BH * RP;
  if (idx < nv) {
    const int64_t bh = idx / RP, e = idx % RP;
    float sum = 0.f, err = 0.f;
    for (int c = 0; c < a.nch; ++c) comp_add(sum, err, a.ws_part[(bh * a.nch + c) * RP + e]);
    st(a.dmimo_v, o4(a.dmimo_v, bh / a.H, bh % a.H, e / a.P, e % a.P), sum + err);
  } else if (a.has_d && idx < nv + BH) {
    const int64_t bh = idx - nv;
    float sum = 0.f, err = 0.f;
    for (int c = 0; c < a.nch; ++c) comp_add(sum, err, a.ws_dd[bh * a.nch + c]);
    st(a.dd, o2(a.dd, bh / a.H, bh % a.H), sum + err);
  }
}

// ------------------------------------------------------------------ launch plan (host)

// Workspace layout (floats; every region a multiple of 64 floats = 256 bytes) and grid sizes.
struct Plan {
  int64_t n_ds = 0, n_part = 0, n_dd = 0, nslots = 0, slot_floats = 0;
  int64_t o_qh = 0, o_kh = 0, o_sg = 0, o_sx = 0, o_x = 0, o_g = 0,
          o_dp = 0, o_kq = 0, o_xg = 0, o_st = 0, o_m = 0, o_qb = 0, o_kb = 0, o_cs = 0, o_sn = 0;
  size_t bytes = 0;
  int64_t grid1 = 0, grid2 = 0, grid3 = 0, grid4 = 0;  // K1 is skipped when grid1 == 0
  size_t smem1 = 0;                                    // K1 dynamic shared memory (bytes)
  int k1_rows = 1;                                     // K1: rows per shared-memory tile
  bool tc = false;                                     // products on tensor cores
  bool planes = false;                                 // K1 and K3 on the planes kernels
  int64_t n_cs = 0;     // floats of Args::ws_cs (0: none)
  int64_t grid_cs = 0;  // angle_table_body's CTAs (0: not launched)
  PlanesLayout ply;                                    // its shared-memory layout
};

inline int64_t up64(int64_t n) { return (n + 63) / 64 * 64; }

// angle_table_body's CTAs per (b, h): kThreads threads of four angles each cover kThreads 4 / A
// steps (A a power of two >= 4 on the planes path).
inline int64_t cs_blocks_per_bh(int64_t S, int64_t A) {
  const int64_t steps = std::max<int64_t>(1, kThreads * 4 / A);
  return (S + steps - 1) / steps;
}

// MAMBA3_BB_PLANES=0 in the environment keeps K1 and K3 off the planes kernels (A/B runs).
// Read once, so that the workspace size and the run agree.
inline bool planes_allowed_by_env() {
  static const bool allowed = [] {
    const char* e = std::getenv("MAMBA3_BB_PLANES");
    return e == nullptr || e[0] != '0';
  }();
  return allowed;
}

// MAMBA3_BB_PREFETCH=0: the planes K3 does not prefetch its next chunk's inputs to L2 (A/B runs).
inline bool prefetch_allowed_by_env() {
  static const bool allowed = [] {
    const char* e = std::getenv("MAMBA3_BB_PREFETCH");
    return e == nullptr || e[0] != '0';
  }();
  return allowed;
}

// MAMBA3_BB_SPECIALIZED=0: the planes K1 and K3 never take their shape-specialised copies
// (mimo_bwd_bwd.cu; A/B runs and the bitwise-identity test). Read at every call (the choice
// changes neither the workspace nor the outputs), so a test can compare both in one process.
inline bool specialized_allowed_by_env() {
  const char* e = std::getenv("MAMBA3_BB_SPECIALIZED");
  return e == nullptr || e[0] != '0';
}
// MAMBA3_BB_CHAIN=0: K1 and K2 on the planes path even where the state chain kernel exists
// (mimo_bwd_bwd_state_chain.cuh; for A/B runs in one process and the bits tests).
inline bool chain_allowed_by_env() {
  const char* e = std::getenv("MAMBA3_BB_CHAIN");
  return e == nullptr || e[0] != '0';
}
// MAMBA3_BB_CT_LAYOUT=0: the planes K3 specialised to the shape only, never to the contiguous
// layouts too (bb::k3_kind; for A/B runs in one process and the bits tests).
inline bool ct_layout_allowed_by_env() {
  const char* e = std::getenv("MAMBA3_BB_CT_LAYOUT");
  return e == nullptr || e[0] != '0';
}

// max_slots: K3's CTA count cap (the host emulation test lowers it to reach slot reuse cheaply).
// allow_planes: false keeps K3 on chunk_body (the tests run both paths).
inline Plan make_plan(const MimoBwdBwdParams& p, int64_t max_slots = kMaxSlots,
                      bool allow_planes = true) {
  // Every index the kernels form in 32 bits (rows x dims of one chunk, grid sizes) fits.
  MAMBA3_CHECK_ARG(p.S <= (int64_t{1} << 30) && p.B * p.H <= (int64_t{1} << 24) &&
                       p.B * p.H * p.nchunks < (int64_t{1} << 31),
                   "mimo_bwd_bwd: B*H=", p.B * p.H, " or S=", p.S,
                   " exceeds the CUDA backend's index range");
  MAMBA3_CHECK_ARG(p.C <= kMaxC && p.R <= kMaxR, "mimo_bwd_bwd: chunk_size=", p.C, " or R=", p.R,
                   " exceeds the CUDA backend's limits (", kMaxC, ", ", kMaxR, ")");
  Plan pl;
  const int64_t BH = p.B * p.H, nch = p.nchunks, NP = p.N * p.P, Tm = p.C * p.R;
  pl.n_ds = up64(BH * nch * NP);
  pl.n_part = up64(BH * nch * p.R * p.P);
  pl.n_dd = up64(BH * nch);
  int64_t o = 0;
  auto take = [&o](int64_t n) {
    const int64_t at = o;
    o += up64(n);
    return at;
  };
  pl.o_qh = take(Tm * p.N);
  pl.o_kh = take(Tm * p.N);
  pl.o_sg = take(Tm * p.N);
  pl.o_sx = take(Tm * p.N);
  pl.o_x = take(Tm * p.P);
  pl.o_g = take(Tm * p.P);
  pl.o_dp = take(Tm * p.P);
  pl.o_kq = take(Tm * Tm);
  pl.o_xg = take(Tm * Tm);
  pl.o_st = take(NP);
  pl.o_m = take(Tm * Tm);
  pl.o_qb = take(Tm * p.N);
  pl.o_kb = take(Tm * p.N);
  pl.o_cs = take(p.C * std::max<int64_t>(p.A, 1));
  pl.o_sn = take(p.C * std::max<int64_t>(p.A, 1));
  pl.slot_floats = o;
  // Tensor cores (3xTF32) for 16-bit q, k, v, whose tolerance leaves room for its ~2^-21
  // relative product error, when every product's dims fit the m16n8k8 tiles. dout may be fp32:
  // the combined backward hands over the pre-RMS dout of 16-bit inputs in fp32.
  auto half16 = [](const TensorView& t) { return t.dtype == DType::F16 || t.dtype == DType::BF16; };
  pl.tc = half16(p.q) && half16(p.k) && half16(p.v) && Tm % 16 == 0 && p.N % 16 == 0 &&
          p.P % 16 == 0;
  // The planes kernel for those, when a chunk's rows are at most 64 (its coefficient matrices),
  // its dqh / dkh / dx tiles fit kPlanesTilesPerWarp per warp and its planes the shared memory
  // (all of SPEC.md's grid at bf16 activations). It needs no scratch slots. Further conditions:
  //  - bf16 q, k, v (fp16 keeps chunk_body: its tolerance is ~8x tighter than bf16's, too tight
  //    for the ~2^-17 per product of the bf16 hi/lo split, as in the first pass's lean path;
  //    see docs/PERF.md), a bf16 or fp32 dout (the combined backward's pre-RMS dout is fp32): the
  //    kernels load them with compile-time types;
  //  - N, P, R, C powers of two (all of SPEC.md's grid: N 16..256, P 32..128, R 1..8,
  //    C 8..64): its element loops index with shifts (Args::lgN ...); other shapes keep
  //    increment_body / chunk_body;
  //  - P <= 2 kPlanesThreads / kMaxR (128, SPEC.md's largest): the [rows][P] loops give each
  //    thread a fixed column pair, and in K3 a fixed rank (its rows step by a multiple of R).
  pl.ply = planes_layout(p.N, p.P, p.R, p.C, p.A);
  const int64_t tiles_max = int64_t{kPlanesWarps} * kPlanesTilesPerWarp * 256;
  auto pow2 = [](int64_t x) { return x > 0 && (x & (x - 1)) == 0; };
  const bool bf16_io = p.q.dtype == DType::BF16 && p.k.dtype == DType::BF16 &&
                       p.v.dtype == DType::BF16 &&
                       (p.dout.dtype == DType::BF16 || p.dout.dtype == DType::F32);
  pl.planes = allow_planes && planes_allowed_by_env() && pl.tc && bf16_io && pow2(p.N) &&
              pow2(p.P) && pow2(p.R) && pow2(p.C) && p.P <= 2 * kPlanesThreads / kMaxR &&
              Tm <= 64 && Tm * p.N <= tiles_max && Tm * p.P <= tiles_max &&
              pl.ply.bytes <= kPlanesSmemMax;
  pl.nslots = pl.planes ? 0 : std::min<int64_t>(BH * nch, std::max<int64_t>(max_slots, 1));
  // Where the planes K3's shared memory has no room for the chunk's (sin, cos) table (of
  // SPEC.md's grid, N128 R1 C64), the table of the whole sequence in the workspace, computed
  // once by angle_table_body: K3 then reads it in phase 0 and phase 3 instead of calling
  // sincosf in each (~20K of its ~143K warp instructions per chunk there: ncu, session 15).
  if (pl.planes && pl.ply.cs < 0) {
    pl.n_cs = up64(BH * p.S * p.A * 2);
    pl.grid_cs = BH * cs_blocks_per_bh(p.S, p.A);
    MAMBA3_CHECK_ARG(pl.grid_cs < (int64_t{1} << 31), "mimo_bwd_bwd: B*H=", BH, " and S=", p.S,
                     " exceed the CUDA backend's index range (angle table)");
  }
  // + kAlign: the caller's pointer is rounded up to kAlign bytes.
  pl.bytes = static_cast<size_t>(pl.n_ds + pl.n_part + pl.n_dd + pl.nslots * pl.slot_floats +
                                 pl.n_cs) *
                 sizeof(float) +
             kAlign;
  pl.grid1 = nch > 1 ? BH * nch : 0;
  pl.grid2 = (BH * NP / scan_width(BH, NP) + kThreads - 1) / kThreads;
  pl.grid3 = pl.planes ? BH * nch : pl.nslots;
  pl.grid4 = (BH * p.R * p.P + BH + kThreads - 1) / kThreads;
  // At most kK1Smem = 48 KB: the default limit (no attribute call).
  pl.k1_rows = static_cast<int>(std::min<int64_t>(
      Tm, std::max<int64_t>(1, kK1Smem / (static_cast<int64_t>(sizeof(float)) * (p.N + p.P)))));
  if (pl.k1_rows >= 8) pl.k1_rows &= ~7;  // whole mma k-steps per tile
  pl.smem1 = static_cast<size_t>(pl.k1_rows) * (p.N + p.P) * sizeof(float);
  return pl;
}

// Whether pair loads of t are valid at every even index of its last dim: unit last stride,
// even other strides, base aligned to a pair (else the planes kernels load the two elements
// one by one: same values, so the results do not depend on the layout).
inline bool pair_layout(const TensorView& t, int w = 2) {
  const uintptr_t pair_bytes = (t.dtype == DType::F32 ? 4 : 2) * w;
  if (t.ndim == 0 || t.strides[t.ndim - 1] != 1 ||
      reinterpret_cast<uintptr_t>(t.data) % pair_bytes != 0)
    return false;
  for (int d = 0; d + 1 < t.ndim; ++d)
    if (t.strides[d] % w != 0) return false;
  return true;
}

// Args::vec_* of t: 2 when quads (four consecutive elements of the last dim at an index that is a
// multiple of 4) take one load / store, 1 when pairs do (pair_layout), else 0.
inline int vec_level(const TensorView& t) {
  return pair_layout(t, 4) ? 2 : pair_layout(t) ? 1 : 0;
}

inline int ilog2(int64_t x) {  // floor(log2(x)), x >= 1
  int l = 0;
  while ((int64_t{2} << l) <= x) ++l;
  return l;
}

inline View view_of(const TensorView& t) {
  View v;
  v.p = static_cast<unsigned char*>(t.data);
  v.dt = static_cast<int>(t.dtype);
  for (int d = 0; d < t.ndim && d < 5; ++d) v.s[d] = t.strides[d];
  return v;
}

// The kernels' arguments; `workspace` is rounded up to kAlign (plan.bytes includes the slack).
inline Args make_args(const MimoBwdBwdParams& p, const Plan& pl, void* workspace) {
  Args a{};
  a.B = static_cast<int>(p.B), a.S = static_cast<int>(p.S), a.H = static_cast<int>(p.H);
  a.G = static_cast<int>(p.G), a.N = static_cast<int>(p.N), a.P = static_cast<int>(p.P);
  a.R = static_cast<int>(p.R), a.C = static_cast<int>(p.C), a.A = static_cast<int>(p.A);
  a.half = a.N / 2, a.nch = static_cast<int>(p.nchunks), a.HG = static_cast<int>(p.H / p.G);
  a.div_nch = fast_div(a.nch), a.div_H = fast_div(a.H), a.div_HG = fast_div(a.HG);
  a.layout = p.dout_layout == MimoDout::ReduceO ? 0 : p.dout_layout == MimoDout::PerRank ? 1 : 2;
  a.has_d = p.has_d ? 1 : 0;
  a.gate = p.z.present() ? 1 : 0;
  if (a.gate) a.z = view_of(p.z), a.mimo_z = view_of(p.mimo_z);
  a.dout = view_of(p.dout), a.q = view_of(p.q), a.k = view_of(p.k), a.v = view_of(p.v);
  a.q_bias = view_of(p.q_bias), a.k_bias = view_of(p.k_bias), a.mimo_v = view_of(p.mimo_v);
  a.states = view_of(p.states), a.qk_dot = view_of(p.qk_dot), a.da_cs = view_of(p.da_cs);
  a.da_cs_rev = view_of(p.da_cs_rev), a.dt = view_of(p.dt), a.trap = view_of(p.trap);
  a.segsum = view_of(p.segsum), a.angles = view_of(p.angles), a.mimo_o = view_of(p.mimo_o);
  a.d = view_of(p.d);
  a.dq = view_of(p.dq), a.dk = view_of(p.dk), a.dv = view_of(p.dv);
  a.dmimo_v = view_of(p.dmimo_v), a.dangles = view_of(p.dangles), a.dfactor = view_of(p.dfactor);
  a.dgamma = view_of(p.dgamma), a.dda = view_of(p.dda), a.dssda = view_of(p.dssda);
  a.dda_cs_rev = view_of(p.dda_cs_rev), a.dda_cs = view_of(p.dda_cs), a.dd = view_of(p.dd);
  const uintptr_t base = (reinterpret_cast<uintptr_t>(workspace) + kAlign - 1) & ~(kAlign - 1);
  float* ws = reinterpret_cast<float*>(base);
  a.ws_ds = ws;
  a.ws_part = a.ws_ds + pl.n_ds;
  a.ws_dd = a.ws_part + pl.n_part;
  a.ws_slot = a.ws_dd + pl.n_dd;
  a.slot_floats = pl.slot_floats;
  a.ws_cs = pl.n_cs > 0 ? reinterpret_cast<float2*>(a.ws_slot + pl.nslots * pl.slot_floats)
                        : nullptr;
  a.cs_nb = static_cast<int>(cs_blocks_per_bh(p.S, p.A));
  a.div_cs = fast_div(a.cs_nb);
  a.lgA = ilog2(std::max<int64_t>(p.A, 1));
  a.k1_rows = pl.k1_rows;
  a.tc = pl.tc ? 1 : 0;
  a.planes = pl.planes ? 1 : 0;
  a.prefetch = prefetch_allowed_by_env() ? 1 : 0;
  a.ply = pl.ply;
  a.lgN = ilog2(p.N), a.lgP = ilog2(p.P), a.lgR = ilog2(p.R), a.lgC = ilog2(p.C);
  a.lgT = a.lgC + a.lgR;
  // (From Args rather than derived in the kernel: a kernel parameter is an operand from the
  // constant bank, a derived value takes a register across the planes K3's phases.)
  a.lgtN = std::max(a.lgN - 4, 0), a.lgtP = std::max(a.lgP - 4, 0), a.lgtT = std::max(a.lgT - 4, 0);
  a.vec_q = vec_level(p.q), a.vec_k = vec_level(p.k), a.vec_v = pair_layout(p.v);
  a.vec_dout = pair_layout(p.dout), a.vec_states = pair_layout(p.states);
  a.vec_dq = vec_level(p.dq), a.vec_dk = vec_level(p.dk);
  a.bf16_z_pairs = a.gate && p.z.dtype == DType::BF16 && pair_layout(p.z);
  a.qk_group = 0, a.vec_grp = 0, a.qk_part = nullptr;  // (set by set_qk_group)
  a.o_qh = pl.o_qh, a.o_kh = pl.o_kh, a.o_sg = pl.o_sg, a.o_sx = pl.o_sx;
  a.o_x = pl.o_x, a.o_g = pl.o_g, a.o_dp = pl.o_dp;
  a.o_kq = pl.o_kq, a.o_xg = pl.o_xg, a.o_st = pl.o_st, a.o_m = pl.o_m;
  a.o_qb = pl.o_qb, a.o_kb = pl.o_kb, a.o_cs = pl.o_cs, a.o_sn = pl.o_sn;
  return a;
}

// The combined backward's request that K3 sum dq / dk over each q / k group (Args::qk_group):
// dq, dk [B, S, R, G, N] and the bias partials part [2][B nch][R H N] (fp32, compact).
inline void set_qk_group(Args& a, const TensorView& dq, const TensorView& dk, float* part) {
  a.qk_group = 1;
  a.dq_grp = view_of(dq), a.dk_grp = view_of(dk);
  a.vec_grp = dq.dtype == dk.dtype ? std::min(vec_level(dq), vec_level(dk)) : 0;
  a.qk_part = part;
}

}  // namespace mamba3::cuda::bb
