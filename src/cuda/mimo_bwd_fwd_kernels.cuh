// Kernels and launch plan of mamba3_mimo_bwd_fwd (CUDA backend). Included by
// mimo_bwd_fwd.cu; the device bodies use only the few primitives defined at the top (thread and
// block index, block barrier, typed loads/stores), so they also build with a host compiler.
//
// Work per (b, h): the chunk recurrence St_{c+1} = e_c St_c + Kw_c^T X_c over nchunks chunks
// (states[c] = St_c is an output) and, per chunk, the readout
//   Y = diag(exp(da_cs)) Qh St_c + Sc X,   Sc[t r, s r'] = (qh_t^r . kh_s^r') tscale_s
//   exp(segsum[t, s]) for s < t, gamma_t qk_dot[t, r, r'] (+ D when r = r') for s = t,
// followed by the projection / gate / norm gradients of Y (see golden/include/mamba3_golden/mimo.hpp).
// Rows of the chunk tiles are (step, rank) pairs i = t R + r.
//
// Segmented scan (one CTA per (b, h) would leave most SMs idle at B*H = 64):
//   K1 (B*H*npt*nsub CTAs): each sub-segment of L1 chunks runs the recurrence from a zero state
//      and writes its final local state and its summed log decay (small).
//   K2 (B*H x N*P threads): a serial pass over the sub-segments turns the local finals into the
//      true state entering each K3 segment.
//   K3 (B*H*npt*nseg CTAs): from its entering state, each segment walks its chunks: writes
//      states[c], qk_dot, Y, dz (and dout_pre_rms), accumulates the per-segment partials of
//      dmimo_o / dmimo_z / dnorm_weight, and updates the state.
//   K4: sums the per-segment partials in a fixed order (deterministic, no atomics).
//   K5: only when the fused RMSNorm meets a P split (state too large for one CTA): K3 then leaves
//      Y in the workspace and K5 runs the epilogue with the whole P row.
// The products run on fp32 tiles in shared memory: Qh^T and Kh^T [N][T] (k-major for the score
// product), Kw [T][N] (k-major for the state update), X [T][P], Sc^T [T][T], Y [T][P] and the
// running state [N][P]. With fp32 inputs every product is a 4x4-per-thread FFMA register tile
// (float4 operand loads), which keeps the error at the float32 reference's. With 16-bit q/k/v
// the same shared-memory operands go through tensor cores (mma.sync m16n8k8, 3xTF32 split:
// about 2^-21 relative error, far inside the 16-bit tolerances). When a chunk's tiles do not fit,
// the chunk is processed in blocks of Cb steps (queries block by block, earlier key blocks
// rebuilt), and P is split across CTAs when the state itself does not fit.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <vector_types.h>

#include "core/mimo_bwd_params.hpp"
#include "cuda/bf16_split_mma.cuh"
#include "cuda/rt_dtype.cuh"


namespace mamba3::cuda::mimo {

#ifndef MAMBA3_MIMO_NT
// 16 warps: the chunk pass runs one CTA per SM (its tiles take most of the shared memory), so
// the warps of that CTA are all the latency hiding there is (H200: 1.86 -> 1.44 ms at the
// reference shape against 8 warps).
#define MAMBA3_MIMO_NT 512
#endif
// Threads per CTA of the general kernels and of K2 / K4. The lean kernels take theirs as a
// template parameter NT (256 or 512), chosen per problem by the plan (MbPlan::nt).
constexpr int kNT = MAMBA3_MIMO_NT;

// ------------------------------------------------------------------ primitives

#if !defined(__CUDACC__)
using std::max;
using std::min;
#endif

// Compile-time-typed load: DT is one of rt_ld's dtype codes, or negative for the runtime dtype dt. A
// typed load has no dtype branch, so the loads of a loop body issue back to back (one latency)
// instead of one basic block, and one full memory latency, per element: the runtime branches
// made the chunk pass wait on serialized global loads (half of its stall samples, ncu).
template <int DT>
MB_DEV float mb_ldt(const unsigned char* p, int64_t off, int dt) {
  if constexpr (DT < 0) {
    return rt_ld(p, off, dt);
  } else if constexpr (DT == 2) {
#if defined(__CUDA_ARCH__)
    return __ldg(reinterpret_cast<const float*>(p) + off);
#else
    return reinterpret_cast<const float*>(p)[off];
#endif
  } else {
#if defined(__CUDA_ARCH__)
    const unsigned short bits = __ldg(reinterpret_cast<const unsigned short*>(p) + off);
#else
    const unsigned short bits = reinterpret_cast<const unsigned short*>(p)[off];
#endif
    if constexpr (DT == 1) return __bfloat162float(__ushort_as_bfloat16(bits));
    else return __half2float(__ushort_as_half(bits));
  }
}

// A tensor as the kernels see it: byte pointer, runtime dtype, strides in elements.
struct MbView {
  unsigned char* p = nullptr;
  int dt = 2;
  int64_t s[5] = {0, 0, 0, 0, 0};
  static constexpr bool kI32 = false;  // offsets in 64 bits (MbCView: 32)
};

#if defined(__CUDACC__)
#define MB_HD __host__ __device__ inline
#else
#define MB_HD inline
#endif

// A tensor of a compile-time dtype DT and layout (the lean K3 specialised to the benchmark's
// contiguous layouts: MbArgsCT<.., true>): strides s[i] = K_i where K_i > 0 (compile-time,
// derived from compile-time dims; the last one 1), else the runtime v[i] (32-bit). Offsets in
// 32 bits (mb_off_t): the host takes that kernel only for tensors of at most 2^30 elements
// (lean_ct_layout_ok). Reads as MbView (p, dt, s[i]), so the lean bodies take either.
template <int DT, int... K>
struct MbCView {
  static constexpr int kRank = sizeof...(K);
  static constexpr int dt = DT;
  static constexpr bool kI32 = true;
  static MB_HD constexpr int kat(int i) {
    int j = 0, r = 0;
    ((r = j++ == i ? K : r), ...);
    return r;
  }
  struct Strides {
    int v[kRank];
    MB_HD int operator[](int i) const { return i >= kRank ? 0 : kat(i) > 0 ? kat(i) : v[i]; }
  };
  unsigned char* p;
  Strides s;
};

// Offset type of a view's element offsets (the same values either way: see MbCView).
template <class V>
using mb_off_t = std::conditional_t<std::decay_t<V>::kI32, int, int64_t>;

MB_DEV float ld1(const MbView& v, int64_t i0) { return rt_ld(v.p, i0 * v.s[0], v.dt); }
MB_DEV float ld2(const MbView& v, int64_t i0, int64_t i1) {
  return rt_ld(v.p, i0 * v.s[0] + i1 * v.s[1], v.dt);
}
MB_DEV float ld3(const MbView& v, int64_t i0, int64_t i1, int64_t i2) {
  return rt_ld(v.p, i0 * v.s[0] + i1 * v.s[1] + i2 * v.s[2], v.dt);
}
MB_DEV float ld4(const MbView& v, int64_t i0, int64_t i1, int64_t i2, int64_t i3) {
  return rt_ld(v.p, i0 * v.s[0] + i1 * v.s[1] + i2 * v.s[2] + i3 * v.s[3], v.dt);
}
MB_DEV float ld5(const MbView& v, int64_t i0, int64_t i1, int64_t i2, int64_t i3, int64_t i4) {
  return rt_ld(v.p, i0 * v.s[0] + i1 * v.s[1] + i2 * v.s[2] + i3 * v.s[3] + i4 * v.s[4], v.dt);
}
template <int DT>
MB_DEV float ld4t(const MbView& v, int64_t i0, int64_t i1, int64_t i2, int64_t i3) {
  return mb_ldt<DT>(v.p, i0 * v.s[0] + i1 * v.s[1] + i2 * v.s[2] + i3 * v.s[3], v.dt);
}
template <int DT>
MB_DEV float ld5t(const MbView& v, int64_t i0, int64_t i1, int64_t i2, int64_t i3, int64_t i4) {
  return mb_ldt<DT>(v.p, i0 * v.s[0] + i1 * v.s[1] + i2 * v.s[2] + i3 * v.s[3] + i4 * v.s[4], v.dt);
}
MB_DEV void st4(const MbView& v, int64_t i0, int64_t i1, int64_t i2, int64_t i3, float x) {
  rt_st(v.p, i0 * v.s[0] + i1 * v.s[1] + i2 * v.s[2] + i3 * v.s[3], v.dt, x);
}
MB_DEV void st5(const MbView& v, int64_t i0, int64_t i1, int64_t i2, int64_t i3, int64_t i4,
                float x) {
  rt_st(v.p, i0 * v.s[0] + i1 * v.s[1] + i2 * v.s[2] + i3 * v.s[3] + i4 * v.s[4], v.dt, x);
}

MB_DEV float sigmoid_f(float x) { return 1.f / (1.f + expf(-x)); }

// ------------------------------------------------------------------ arguments and layout

// Shared-memory layout of one kernel, offsets in floats (each region 16-byte aligned).
struct MbLayout {
  int St = 0, QhT = 0, KhT = 0, Khw = 0, X = 0, ScT = 0, Y = 0, W = 0;
  int da = 0, expda = 0, gamma = 0, tscale = 0, wk = 0, misc = 0, qkd = 0;
  int rstd = 0, rdot = 0, red = 0, qb = 0, kb = 0, mv = 0, mo = 0, mz = 0, nw = 0, acc = 0;
  int ang = -1;  // lean path: cos and sin of the chunk's angles [2][C][A]
  int zs = -1, ds = -1, ered = -1;  // lean path: staged z, dout; epilogue partials exchange
  int total = 0;  // floats
};

// Indices of the per-segment partial sums (ws_part) and of their Kahan compensations (acc).
enum : int { kPartO = 0, kPartZ = 1, kPartN = 2, kParts = 3 };

struct MbArgs {
  // problem
  int B, S, H, G, N, P, R, C, nch, A, half, HG, Np;
  int reduce_o, has_z, has_d, has_norm;
  int act_dt;  // dtype code shared by q, k, v, z, dout; -1 when they differ
  int states_vec4;  // states rows take aligned 4-element stores (see write_state)
  int lean_vec;     // the lean path's bf16 inputs take 4-byte pair loads
  int lean_ld;      // the lean path's loads of 4 bf16: 2 one 8-byte, 1 two 4-byte, 0 four 2-byte
  int prefetch;     // the lean K1 / K3 ask L2 for their next chunk's rows (lean_prefetch_chunk)
  int scal_f32;  // da_cs, da_cs_rev, dt and trap are all float32 (typed loads)
  int lgR;  // log2(R) when R is a power of two (the lean path), else -1
  int lgP;  // log2(P) when P is a power of two (the lean path), else -1
  float eps;
  // K3 tiles: Cb steps per block (nb blocks per chunk), Tb = Cb R rows, LT = row stride of the
  // transposed tiles; K1 tiles likewise; K5 rows per block.
  int Cb, nb, Tb, LT;
  int Cb1, nb1, Tb1;
  // Row strides (floats) of the [.][P] tiles (St, X, Y) and of Kw; padded so that the
  // tensor-core fragment loads hit 32 distinct banks.
  int LP, LK;
  int tc, tc1;  // K3 / K1 run their products on tensor cores (3xTF32)
  int Cb5, Tb5;
  // P split: Pt columns per CTA (npt tiles), Ppt = Pt rounded up to 4 (row stride of P tiles).
  int Pt, npt, Ppt, Pp5;
  // segments: K3 segments of L3 chunks (nseg); K1 sub-segments of L1 chunks (nsub, covering the
  // chunks before the last K3 segment, subs_per_seg per K3 segment).
  int nseg, L3, nsub, L1, subs_per_seg;
  int defer_epi;  // K3 leaves Y in ws_y and K5 runs the epilogue
  // tensors
  MbView dout, q, k, v, q_bias, k_bias, mimo_v, mimo_o, mimo_z, angles, da_cs, da_cs_rev, dt, trap,
      segsum, d, z, norm_w;
  MbView states, qk_dot, dmimo_o, dmimo_z, dz, dnorm_w, dout_pre;
  // workspace
  float* ws_local;  // [B*H][nsub][N][P] local final states of K1
  float* ws_dec;    // [B*H][nsub] summed log decay of each sub-segment
  float* ws_enter;  // [B*H][nseg-1][N][P] states entering K3 segments 1..
  float* ws_part;   // [B*H][nseg][kParts][R][P]
  float* ws_y;      // [B*H][S][R][P] (defer_epi only)
  MbLayout l1, l3, l5;
};

// ------------------------------------------------------------------ register-tile products

// acc[i][j] += sum_{k0 <= k < k1} A[k][m0 + i] * B[k][n0 + j]; A and B row-major with leading
// dimensions lda/ldb (multiples of 4), m0 and n0 multiples of 4.
MB_DEV void tile_acc(float (&acc)[4][4], const float* A, int lda, int m0, const float* B, int ldb,
                     int n0, int k0, int k1) {
#pragma unroll 4
  for (int k = k0; k < k1; ++k) {
    const float4 av = *reinterpret_cast<const float4*>(A + k * lda + m0);
    const float4 bv = *reinterpret_cast<const float4*>(B + k * ldb + n0);
    const float ar[4] = {av.x, av.y, av.z, av.w};
    const float br[4] = {bv.x, bv.y, bv.z, bv.w};
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(ar[i], br[j], acc[i][j]);
  }
}

MB_DEV void tile_zero(float (&acc)[4][4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[i][j] = 0.f;
}


// ------------------------------------------------------------------ tensor-core products

// 3xTF32 on mma.sync m16n8k8: each fp32 operand x is split into x_hi = tf32(x) and
// x_lo = tf32(x - x_hi) and a*b ~ a_lo b_hi + a_hi b_lo + a_hi b_hi (about 2^-21 relative error
// per product; the tensor cores' fp32 accumulation adds a little: up to 2e-6 relative was seen on
// the fp32 outputs on an H200). Used for 16-bit inputs, whose tolerances (1e-4 / 2e-5) this
// meets with a wide margin; fp32 inputs keep the FFMA tiles above (float32-reference accuracy).
#if defined(__CUDACC__)
MB_DEV uint32_t mb_tf32(float x) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
  return r;
}
MB_DEV float mb_bits_f(uint32_t u) { return __uint_as_float(u); }
// d += a * b for one 16x8x8 tile; fragments as in the PTX ISA (g = lane / 4, q = lane % 4):
// a = A[g][q], A[g+8][q], A[g][q+4], A[g+8][q+4]; b = B[q][g], B[q+4][g];
// d = D[g][2q], D[g][2q+1], D[g+8][2q], D[g+8][2q+1].
MB_DEV void mb_mma_tf32(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
#else
uint32_t mb_tf32(float x);
float mb_bits_f(uint32_t u);
void mb_mma_tf32(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]);
#endif

MB_DEV void mb_split(float x, uint32_t& hi, uint32_t& lo) {
  hi = mb_tf32(x);
  lo = mb_tf32(x - mb_bits_f(hi));
}

constexpr int kTcNT = 4;  // a warp's output tile: 16 rows x 4 subtiles of 8 columns

// acc[j] (C fragment of the 16x8 block at rows m0.., columns n0 + 8j, j < nsub) +=
// sum_{k0 <= k < k1} A[k][m] B[k][n], A and B k-major in shared memory (k0, k1 multiples of 8).
// Every lane of the warp must call it with the same arguments.
MB_DEV void warp_tile_tc(float (&acc)[kTcNT][4], const float* A, int lda, int m0, const float* B,
                         int ldb, int n0, int nsub, int k0, int k1) {
  const int lane = mb_tid() & 31, g = lane >> 2, q = lane & 3;
  for (int k = k0; k < k1; k += 8) {
    uint32_t ah[4], al[4];
    const float* ap = A + (k + q) * lda + m0 + g;
    mb_split(ap[0], ah[0], al[0]);
    mb_split(ap[8], ah[1], al[1]);
    mb_split(ap[4 * lda], ah[2], al[2]);
    mb_split(ap[4 * lda + 8], ah[3], al[3]);
#pragma unroll
    for (int j = 0; j < kTcNT; ++j) {
      if (j < nsub) {
        const float* bp = B + (k + q) * ldb + n0 + 8 * j + g;
        uint32_t bh[2], bl[2];
        mb_split(bp[0], bh[0], bl[0]);
        mb_split(bp[4 * ldb], bh[1], bl[1]);
        mb_mma_tf32(acc[j], al, bh);
        mb_mma_tf32(acc[j], ah, bl);
        mb_mma_tf32(acc[j], ah, bh);
      }
    }
  }
}

MB_DEV void tc_zero(float (&acc)[kTcNT][4]) {
#pragma unroll
  for (int j = 0; j < kTcNT; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[j][e] = 0.f;
}

// ------------------------------------------------------------------ per-chunk pieces

struct MbCta {
  int b, h, g, bhi, p0, Pv;
};

// Per-step scalars of chunk c (threads t < C): da_cs (padded with the last valid value),
// exp(da_cs), gamma, trap_scale, the state-update weight tscale exp(da_cs_rev) (rebuilt from
// da_cs in a partial chunk) and, in misc[0..1], the chunk decay exp(da_last) and da_last.
// In two halves, chunk_scalars_load (the global loads, raw bits) and chunk_scalars_store (the
// rest), so that a caller can issue the loads early and keep them in flight across a barrier
// (the lean K3); chunk_scalars_t runs both at once.
struct ChunkScalarsRaw {
  uint32_t last, dav, dtv, trv, dtn, trn, rev;
};

template <int DT>
MB_DEV ChunkScalarsRaw chunk_scalars_load(const MbArgs& a, const MbCta& k, int c) {
  ChunkScalarsRaw u{};
  const int t = mb_tid();
  if (t >= a.C) return u;
  const int s0 = c * a.C;
  const int Lc = min(a.C, a.S - s0);
  const int gi = s0 + t;
  const bool valid = t < Lc;
  // All loads first, at clamped positions (one latency, not a chain of them).
  const int gl = s0 + Lc - 1, gv = valid ? gi : gl, gn = min(gi + 1, a.S - 1);
  auto at = [&](const MbView& v, int pos) {
    return rt_ld_raw<DT>(v.p, k.b * v.s[0] + k.h * v.s[1] + static_cast<int64_t>(pos) * v.s[2], v.dt);
  };
  u.last = at(a.da_cs, gl), u.dav = at(a.da_cs, gv);
  u.dtv = at(a.dt, gv), u.trv = at(a.trap, gv), u.dtn = at(a.dt, gn), u.trn = at(a.trap, gn);
  u.rev = at(a.da_cs_rev, gv);
  return u;
}

template <int DT>
MB_DEV void chunk_scalars_store(const MbArgs& a, const MbLayout& L, float* sm, int c,
                                const ChunkScalarsRaw& u) {
  const int t = mb_tid();
  if (t >= a.C) return;
  const int s0 = c * a.C;
  const int Lc = min(a.C, a.S - s0);
  const bool partial = Lc < a.C;
  const int gi = s0 + t;
  const bool valid = t < Lc;
  const float da_last = rt_raw_f<DT>(u.last, a.da_cs.dt), dav = rt_raw_f<DT>(u.dav, a.da_cs.dt);
  const float dtv = rt_raw_f<DT>(u.dtv, a.dt.dt), trv = rt_raw_f<DT>(u.trv, a.trap.dt);
  const float dtn = rt_raw_f<DT>(u.dtn, a.dt.dt), trn = rt_raw_f<DT>(u.trn, a.trap.dt);
  const float rev_in = rt_raw_f<DT>(u.rev, a.da_cs_rev.dt);
  sm[L.da + t] = dav;
  sm[L.expda + t] = expf(dav);
  float gam = 0.f, ts = 0.f, w = 0.f;
  if (valid) {
    gam = dtv * sigmoid_f(trv);
    // The trapezoid's second half belongs to the next step; none after the sequence's last.
    const float nxt = gi + 1 < a.S ? dtn * (1.f - sigmoid_f(trn)) : 0.f;
    ts = gam + nxt;
    const float rev = partial ? da_last - dav : rev_in;
    w = ts * expf(rev);
  }
  sm[L.gamma + t] = gam;
  sm[L.tscale + t] = ts;
  sm[L.wk + t] = w;
  if (t == 0) {
    sm[L.misc] = expf(da_last);
    sm[L.misc + 1] = da_last;
  }
}

template <int DT>
MB_DEV void chunk_scalars_t(const MbArgs& a, const MbLayout& L, float* sm, const MbCta& k, int c) {
  chunk_scalars_store<DT>(a, L, sm, c, chunk_scalars_load<DT>(a, k, c));
}

MB_DEV void chunk_scalars(const MbArgs& a, const MbLayout& L, float* sm, const MbCta& k, int c) {
  if (a.scal_f32) chunk_scalars_t<2>(a, L, sm, k, c);
  else chunk_scalars_t<-1>(a, L, sm, k, c);
}

// Intra-chunk weights W[t][s] = tscale_s exp(segsum[t, s]) for s < t (0 elsewhere); a partial
// chunk takes segsum from da_cs (the tail contract). Needs chunk_scalars. NT: threads per CTA
// (here and in the other helpers the lean kernels share).
template <int NT = kNT>
MB_DEV void chunk_weights(const MbArgs& a, const MbLayout& L, float* sm, const MbCta& k, int c) {
  const int s0 = c * a.C;
  const bool partial = a.S - s0 < a.C;
  for (int e = mb_tid(); e < a.C * a.C; e += NT) {
    const int t = e / a.C, s = e - t * a.C;
    float w = 0.f;
    if (s < t) {
      const float seg = partial ? sm[L.da + t] - sm[L.da + s]
                                : ld5(a.segsum, k.b, k.h, c, t, s);
      w = sm[L.tscale + s] * expf(seg);
    }
    sm[L.W + e] = w;
  }
}

constexpr int kMaxR = 8;  // the largest MIMO rank (checked in make_mimo_bwd_fwd_params)

template <int DT>
MB_DEV void build_block_t(const MbArgs& a, const MbLayout& L, float* sm, const MbCta& k, int c,
                          int blk, int Cb, int LT, int mode_q, int mode_k, bool want_kw,
                          bool want_x) {
  const int s0 = c * a.C;
  const int Lc = min(a.C, a.S - s0);
  const int R = a.R, half = a.half, Np = a.Np;
  (void)Np;
  if (mode_q || mode_k || want_kw) {
    const bool need_k = mode_k || want_kw;
    const bool need_rot = mode_k == 2 || want_kw;
    const int64_t hq = static_cast<int64_t>(half) * a.q.s[4];
    const int64_t hk = static_cast<int64_t>(half) * a.k.s[4];
    for (int u = mb_tid(); u < Cb * half; u += kNT) {
      const int tl = u / half, n = u - tl * half;
      const int t = blk * Cb + tl;
      const bool valid = t < Lc;
      const int64_t gi = s0 + t;
      const bool rot = n < a.A;
      // Every global load of the task first (they issue together), then the arithmetic.
      const float ang = valid && rot && need_rot ? ld4(a.angles, k.b, gi, k.h, n) : 0.f;
      float qa[kMaxR], qb[kMaxR], ka[kMaxR], kb[kMaxR];
#pragma unroll
      for (int r = 0; r < kMaxR; ++r) {
        qa[r] = qb[r] = ka[r] = kb[r] = 0.f;
        if (r < R && valid) {
          if (mode_q) {
            const int64_t o = k.b * a.q.s[0] + gi * a.q.s[1] + r * a.q.s[2] + k.g * a.q.s[3] +
                              n * a.q.s[4];
            qa[r] = mb_ldt<DT>(a.q.p, o, a.q.dt);
            qb[r] = mb_ldt<DT>(a.q.p, o + hq, a.q.dt);
          }
          if (need_k) {
            const int64_t o = k.b * a.k.s[0] + gi * a.k.s[1] + r * a.k.s[2] + k.g * a.k.s[3] +
                              n * a.k.s[4];
            ka[r] = mb_ldt<DT>(a.k.p, o, a.k.dt);
            kb[r] = mb_ldt<DT>(a.k.p, o + hk, a.k.dt);
          }
        }
      }
      float cs = 1.f, sn = 0.f;
      if (valid && rot && need_rot) sincosf(ang, &sn, &cs);
      const float wk = want_kw ? sm[L.wk + t] : 0.f;
#pragma unroll
      for (int r = 0; r < kMaxR; ++r) {
        if (r >= R) break;
        const int i = tl * R + r;
        if (mode_q) {
          float q1 = 0.f, q2 = 0.f;
          if (valid) {
            q1 = qa[r] + sm[L.qb + r * Np + n];
            q2 = qb[r] + sm[L.qb + r * Np + n + half];
          }
          sm[L.QhT + n * LT + i] = q1;
          sm[L.QhT + (n + half) * LT + i] = q2;
        }
        if (need_k) {
          float k1 = 0.f, k2 = 0.f;
          if (valid) {
            k1 = ka[r] + sm[L.kb + r * Np + n];
            k2 = kb[r] + sm[L.kb + r * Np + n + half];
          }
          float r1 = k1, r2 = k2;
          if (rot) {
            r1 = k1 * cs - k2 * sn;
            r2 = k1 * sn + k2 * cs;
          }
          if (mode_k) {
            sm[L.KhT + n * LT + i] = mode_k == 1 ? k1 : r1;
            sm[L.KhT + (n + half) * LT + i] = mode_k == 1 ? k2 : r2;
          }
          if (want_kw) {
            sm[L.Khw + i * a.LK + n] = r1 * wk;
            sm[L.Khw + i * a.LK + n + half] = r2 * wk;
          }
        }
      }
    }
  }
  // Kh^T's padding rows [N, Np) must read as zero for the tensor-core products over Np; Y may
  // have been stored over them (it shares Kh^T's space when a chunk is one block).
  if (mode_k && a.Np > a.N) {
    const int Tb = Cb * R;
    for (int e = mb_tid(); e < (a.Np - a.N) * Tb; e += kNT)
      sm[L.KhT + (a.N + e / Tb) * LT + e % Tb] = 0.f;
  }
  if (want_x) {
    const int Pv = k.Pv, Ppt = a.Ppt, LP = a.LP;
#pragma unroll 4
    for (int u = mb_tid(); u < Cb * Pv; u += kNT) {
      const int tl = u / Pv, p = u - tl * Pv;
      const int t = blk * Cb + tl;
      const float vv = t < Lc ? ld4t<DT>(a.v, k.b, s0 + t, k.h, k.p0 + p) : 0.f;
      for (int r = 0; r < R; ++r) sm[L.X + (tl * R + r) * LP + p] = vv * sm[L.mv + r * Ppt + p];
    }
  }
}

// Calls F<DT>(args...) with DT = a.act_dt, the dtype shared by q, k, v, z and dout (-1: they
// differ, runtime-typed loads). One uniform branch per call, not one per element.
#define MB_ACT_DISPATCH(F, ...)                \
  do {                                         \
    switch (a.act_dt) {                        \
      case 0: F<0>(__VA_ARGS__); break;        \
      case 1: F<1>(__VA_ARGS__); break;        \
      case 2: F<2>(__VA_ARGS__); break;        \
      default: F<-1>(__VA_ARGS__); break;      \
    }                                          \
  } while (0)

// Builds the tiles of block `blk` (steps blk*Cb .. +Cb of chunk c): q biased and unrotated into
// Qh^T (mode_q 1); k biased into Kh^T unrotated (mode_k 1) or rotated (mode_k 2); rotated k
// times the state-update weight into Kw (want_kw); x = v * mimo_v into X (want_x). Steps past
// the sequence end are zero rows (the zero padding of the tail contract).
MB_DEV void build_block(const MbArgs& a, const MbLayout& L, float* sm, const MbCta& k, int c,
                        int blk, int Cb, int LT, int mode_q, int mode_k, bool want_kw,
                        bool want_x) {
  MB_ACT_DISPATCH(build_block_t, a, L, sm, k, c, blk, Cb, LT, mode_q, mode_k, want_kw, want_x);
}

// Same-step dots qk_dot[t, r, r'] of the unrotated biased q/k of block blk (the rotation is
// orthogonal, so this is the rotated dot without the rotation's rounding): into qkd[i][r'] and
// (first P tile only) into the qk_dot output.
MB_DEV void block_qkdot(const MbArgs& a, const MbLayout& L, float* sm, const MbCta& k, int c,
                        int blk, int Cb, int LT, bool write_out) {
  const int s0 = c * a.C;
  const int Lc = min(a.C, a.S - s0);
  const int R = a.R, Tb = Cb * R;
  for (int u = mb_tid(); u < Tb * R; u += kNT) {
    const int i = u / R, r2 = u - i * R;
    const int tl = i / R, r = i - tl * R;
    const float* qc = sm + L.QhT + i;
    const float* kc = sm + L.KhT + tl * R + r2;
    float s = 0.f;
    for (int n = 0; n < a.N; ++n) s = fmaf(qc[n * LT], kc[n * LT], s);
    sm[L.qkd + u] = s;
    const int t = blk * Cb + tl;
    if (write_out && t < Lc) st5(a.qk_dot, k.b, k.h, s0 + t, r, r2, s);
  }
}

// Rotates the pairs (n, N/2 + n), n < A, of Qh^T and Kh^T of block blk in place.
MB_DEV void block_rotate(const MbArgs& a, const MbLayout& L, float* sm, const MbCta& k, int c,
                         int blk, int Cb, int LT) {
  const int s0 = c * a.C;
  const int Lc = min(a.C, a.S - s0);
  const int R = a.R, half = a.half, A = a.A;
  for (int u = mb_tid(); u < Cb * A; u += kNT) {
    const int tl = u / A, n = u - tl * A;
    const int t = blk * Cb + tl;
    if (t >= Lc) continue;  // zero rows
    float sn, cs;
    sincosf(ld4(a.angles, k.b, s0 + t, k.h, n), &sn, &cs);
    for (int r = 0; r < R; ++r) {
      const int i = tl * R + r;
      float* q1 = sm + L.QhT + n * LT + i;
      float* q2 = sm + L.QhT + (n + half) * LT + i;
      const float qa = *q1, qb = *q2;
      *q1 = qa * cs - qb * sn;
      *q2 = qa * sn + qb * cs;
      float* k1 = sm + L.KhT + n * LT + i;
      float* k2 = sm + L.KhT + (n + half) * LT + i;
      const float ka = *k1, kb = *k2;
      *k1 = ka * cs - kb * sn;
      *k2 = ka * sn + kb * cs;
    }
  }
}

// Scores of query block jq against key block jk into Sc^T[j][i] (masked, weighted; on the step
// diagonal gamma qk_dot + D).
MB_DEV void block_scores(const MbArgs& a, const MbLayout& L, float* sm, int jq, int jk, int Cb,
                         int LT, float Dv) {
  const int R = a.R, Tb = Cb * R, tn = Tb / 4;
  for (int tile = mb_tid(); tile < (Tb / 4) * tn; tile += kNT) {
    const int m0 = (tile / tn) * 4, n0 = (tile % tn) * 4;
    float acc[4][4];
    tile_zero(acc);
    // Only pairs with key step < query step need the product.
    if (jk * Cb + n0 / R < jq * Cb + (m0 + 3) / R)
      tile_acc(acc, sm + L.QhT, LT, m0, sm + L.KhT, LT, n0, 0, a.N);
#pragma unroll
    for (int mi = 0; mi < 4; ++mi) {
      const int i = m0 + mi;
      const int tq = jq * Cb + i / R, ri = i % R;
#pragma unroll
      for (int nj = 0; nj < 4; ++nj) {
        const int j = n0 + nj;
        const int tk = jk * Cb + j / R, rj = j % R;
        float val = 0.f;
        if (tk < tq) {
          val = acc[mi][nj] * sm[L.W + tq * a.C + tk];
        } else if (tk == tq) {
          val = sm[L.gamma + tq] * sm[L.qkd + i * R + rj];
          if (ri == rj) val += Dv;
        }
        sm[L.ScT + j * LT + i] = val;
      }
    }
  }
}

// Y of query block jq from the state and its own (diagonal) key block:
// Y = diag(exp(da_cs)) Qh St + Sc X.
MB_DEV void block_y_diag(const MbArgs& a, const MbLayout& L, float* sm, int jq, int Cb, int LT) {
  const int R = a.R, Tb = Cb * R, LP = a.LP, tn = a.Ppt / 4;
  for (int tile = mb_tid(); tile < (Tb / 4) * tn; tile += kNT) {
    const int m0 = (tile / tn) * 4, n0 = (tile % tn) * 4;
    float acc[4][4];
    tile_zero(acc);
    tile_acc(acc, sm + L.QhT, LT, m0, sm + L.St, LP, n0, 0, a.N);
#pragma unroll
    for (int mi = 0; mi < 4; ++mi) {
      const float s = sm[L.expda + jq * Cb + (m0 + mi) / R];
#pragma unroll
      for (int nj = 0; nj < 4; ++nj) acc[mi][nj] *= s;
    }
    const int k1 = min(Tb, ((m0 + 3) / R + 1) * R);  // keys up to the tile's last step
    tile_acc(acc, sm + L.ScT, LT, m0, sm + L.X, LP, n0, 0, k1);
#pragma unroll
    for (int mi = 0; mi < 4; ++mi)
      *reinterpret_cast<float4*>(sm + L.Y + (m0 + mi) * LP + n0) =
          make_float4(acc[mi][0], acc[mi][1], acc[mi][2], acc[mi][3]);
  }
}

// Y += Sc X for an earlier key block (all of its steps precede the query block's).
MB_DEV void block_y_prev(const MbArgs& a, const MbLayout& L, float* sm, int Cb, int LT) {
  const int Tb = Cb * a.R, LP = a.LP, tn = a.Ppt / 4;
  for (int tile = mb_tid(); tile < (Tb / 4) * tn; tile += kNT) {
    const int m0 = (tile / tn) * 4, n0 = (tile % tn) * 4;
    float acc[4][4];
    tile_zero(acc);
    tile_acc(acc, sm + L.ScT, LT, m0, sm + L.X, LP, n0, 0, Tb);
#pragma unroll
    for (int mi = 0; mi < 4; ++mi) {
      float4* y = reinterpret_cast<float4*>(sm + L.Y + (m0 + mi) * LP + n0);
      float4 o = *y;
      o.x += acc[mi][0], o.y += acc[mi][1], o.z += acc[mi][2], o.w += acc[mi][3];
      *y = o;
    }
  }
}

// St = scale * St + Kw^T X over Tb rows.
MB_DEV void state_update(const MbArgs& a, const MbLayout& L, float* sm, int Tb, float scale) {
  const int Np = a.Np, LP = a.LP, tn = a.Ppt / 4;
  for (int tile = mb_tid(); tile < (Np / 4) * tn; tile += kNT) {
    const int m0 = (tile / tn) * 4, n0 = (tile % tn) * 4;
    float acc[4][4];
    tile_zero(acc);
    tile_acc(acc, sm + L.Khw, a.LK, m0, sm + L.X, LP, n0, 0, Tb);
#pragma unroll
    for (int mi = 0; mi < 4; ++mi) {
      float4* s = reinterpret_cast<float4*>(sm + L.St + (m0 + mi) * LP + n0);
      float4 o = *s;
      o.x = fmaf(scale, o.x, acc[mi][0]);
      o.y = fmaf(scale, o.y, acc[mi][1]);
      o.z = fmaf(scale, o.z, acc[mi][2]);
      o.w = fmaf(scale, o.w, acc[mi][3]);
      *s = o;
    }
  }
}


// Tensor-core versions of the four products (same shared-memory operands; Tb and Np multiples
// of 16, Ppt of 8). Warp w takes the 16 x 32 output tiles w, w + 8, ...

MB_DEV void block_scores_tc(const MbArgs& a, const MbLayout& L, float* sm, int jq, int jk, int Cb,
                            int LT, float Dv) {
  const int R = a.R, Tb = Cb * R;
  const int lane = mb_tid() & 31, g = lane >> 2, q = lane & 3;
  const int ntn = (Tb + 31) / 32;
  for (int tile = mb_tid() >> 5; tile < (Tb / 16) * ntn; tile += kNT / 32) {
    const int m0 = (tile / ntn) * 16, n0 = (tile % ntn) * 32;
    const int nsub = min(kTcNT, (Tb - n0) / 8);
    float acc[kTcNT][4];
    tc_zero(acc);
    if (jk * Cb + n0 / R < jq * Cb + (m0 + 15) / R)
      warp_tile_tc(acc, sm + L.QhT, LT, m0, sm + L.KhT, LT, n0, nsub, 0, a.Np);
#pragma unroll
    for (int j = 0; j < kTcNT; ++j) {
      if (j >= nsub) continue;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = m0 + g + 8 * (e >> 1), jj = n0 + 8 * j + 2 * q + (e & 1);
        const int tq = jq * Cb + i / R, tk = jk * Cb + jj / R;
        float val = 0.f;
        if (tk < tq) {
          val = acc[j][e] * sm[L.W + tq * a.C + tk];
        } else if (tk == tq) {
          val = sm[L.gamma + tq] * sm[L.qkd + i * R + jj % R];
          if (i % R == jj % R) val += Dv;
        }
        sm[L.ScT + jj * LT + i] = val;
      }
    }
  }
}

MB_DEV void block_y_diag_tc(const MbArgs& a, const MbLayout& L, float* sm, int jq, int Cb, int LT) {
  const int R = a.R, Tb = Cb * R, LP = a.LP, Ppt = a.Ppt;
  const int lane = mb_tid() & 31, g = lane >> 2, q = lane & 3;
  const int ntn = (Ppt + 31) / 32;
  for (int tile = mb_tid() >> 5; tile < (Tb / 16) * ntn; tile += kNT / 32) {
    const int m0 = (tile / ntn) * 16, n0 = (tile % ntn) * 32;
    const int nsub = min(kTcNT, (Ppt - n0) / 8);
    float acc[kTcNT][4];
    tc_zero(acc);
    warp_tile_tc(acc, sm + L.QhT, LT, m0, sm + L.St, LP, n0, nsub, 0, a.Np);
    const float s0 = sm[L.expda + jq * Cb + (m0 + g) / R];
    const float s1 = sm[L.expda + jq * Cb + (m0 + g + 8) / R];
#pragma unroll
    for (int j = 0; j < kTcNT; ++j) {
      acc[j][0] *= s0, acc[j][1] *= s0;
      acc[j][2] *= s1, acc[j][3] *= s1;
    }
    // Keys up to the tile's last step (the masked Sc entries past it are zero).
    const int k1 = min(Tb, (((m0 + 15) / R + 1) * R + 7) & ~7);
    warp_tile_tc(acc, sm + L.ScT, LT, m0, sm + L.X, LP, n0, nsub, 0, k1);
#pragma unroll
    for (int j = 0; j < kTcNT; ++j) {
      if (j >= nsub) continue;
      const int col = n0 + 8 * j + 2 * q;
      *reinterpret_cast<float2*>(sm + L.Y + (m0 + g) * LP + col) = make_float2(acc[j][0], acc[j][1]);
      *reinterpret_cast<float2*>(sm + L.Y + (m0 + g + 8) * LP + col) = make_float2(acc[j][2], acc[j][3]);
    }
  }
}

MB_DEV void block_y_prev_tc(const MbArgs& a, const MbLayout& L, float* sm, int Cb, int LT) {
  const int Tb = Cb * a.R, LP = a.LP, Ppt = a.Ppt;
  const int lane = mb_tid() & 31, g = lane >> 2, q = lane & 3;
  const int ntn = (Ppt + 31) / 32;
  for (int tile = mb_tid() >> 5; tile < (Tb / 16) * ntn; tile += kNT / 32) {
    const int m0 = (tile / ntn) * 16, n0 = (tile % ntn) * 32;
    const int nsub = min(kTcNT, (Ppt - n0) / 8);
    float acc[kTcNT][4];
    tc_zero(acc);
    warp_tile_tc(acc, sm + L.ScT, LT, m0, sm + L.X, LP, n0, nsub, 0, Tb);
#pragma unroll
    for (int j = 0; j < kTcNT; ++j) {
      if (j >= nsub) continue;
      const int col = n0 + 8 * j + 2 * q;
      float2* y0 = reinterpret_cast<float2*>(sm + L.Y + (m0 + g) * LP + col);
      float2* y1 = reinterpret_cast<float2*>(sm + L.Y + (m0 + g + 8) * LP + col);
      float2 v0 = *y0, v1 = *y1;
      v0.x += acc[j][0], v0.y += acc[j][1];
      v1.x += acc[j][2], v1.y += acc[j][3];
      *y0 = v0, *y1 = v1;
    }
  }
}

MB_DEV void state_update_tc(const MbArgs& a, const MbLayout& L, float* sm, int Tb, float scale) {
  const int Np = a.Np, LP = a.LP, Ppt = a.Ppt;
  const int lane = mb_tid() & 31, g = lane >> 2, q = lane & 3;
  const int ntn = (Ppt + 31) / 32;
  for (int tile = mb_tid() >> 5; tile < (Np / 16) * ntn; tile += kNT / 32) {
    const int m0 = (tile / ntn) * 16, n0 = (tile % ntn) * 32;
    const int nsub = min(kTcNT, (Ppt - n0) / 8);
    float acc[kTcNT][4];
    tc_zero(acc);
    warp_tile_tc(acc, sm + L.Khw, a.LK, m0, sm + L.X, LP, n0, nsub, 0, Tb);
#pragma unroll
    for (int j = 0; j < kTcNT; ++j) {
      if (j >= nsub) continue;
      const int col = n0 + 8 * j + 2 * q;
      float2* s0 = reinterpret_cast<float2*>(sm + L.St + (m0 + g) * LP + col);
      float2* s1 = reinterpret_cast<float2*>(sm + L.St + (m0 + g + 8) * LP + col);
      float2 v0 = *s0, v1 = *s1;
      v0.x = fmaf(scale, v0.x, acc[j][0]), v0.y = fmaf(scale, v0.y, acc[j][1]);
      v1.x = fmaf(scale, v1.x, acc[j][2]), v1.y = fmaf(scale, v1.y, acc[j][3]);
      *s0 = v0, *s1 = v1;
    }
  }
}

// Dispatch between the FFMA tiles and the tensor cores (compile-time).
template <bool TC>
MB_DEV void op_scores(const MbArgs& a, const MbLayout& L, float* sm, int jq, int jk, int Cb, int LT,
                      float Dv) {
  if constexpr (TC) block_scores_tc(a, L, sm, jq, jk, Cb, LT, Dv);
  else block_scores(a, L, sm, jq, jk, Cb, LT, Dv);
}
template <bool TC>
MB_DEV void op_y_diag(const MbArgs& a, const MbLayout& L, float* sm, int jq, int Cb, int LT) {
  if constexpr (TC) block_y_diag_tc(a, L, sm, jq, Cb, LT);
  else block_y_diag(a, L, sm, jq, Cb, LT);
}
template <bool TC>
MB_DEV void op_y_prev(const MbArgs& a, const MbLayout& L, float* sm, int Cb, int LT) {
  if constexpr (TC) block_y_prev_tc(a, L, sm, Cb, LT);
  else block_y_prev(a, L, sm, Cb, LT);
}
template <bool TC>
MB_DEV void op_state_update(const MbArgs& a, const MbLayout& L, float* sm, int Tb, float scale) {
  if constexpr (TC) state_update_tc(a, L, sm, Tb, scale);
  else state_update(a, L, sm, Tb, scale);
}

// ------------------------------------------------------------------ epilogue (gradients of Y)

// One block of Y rows: steps gt0 .. gt0 + nvalid - 1 of the sequence (rows i = tl R + r for
// tl < Cbk), columns p0 .. p0 + Pv - 1 of P.
struct MbEpi {
  int gt0, nvalid, Cbk;
};

MB_DEV void kahan_add(float* s, float* comp, float x) {
  const float y = x - *comp;
  const float t = *s + y;
  *comp = (t - *s) - y;
  *s = t;
}

// RMSNorm row statistics (whole P in this CTA): rstd = 1/sqrt(mean y^2 + eps) and
// rdot = mean(dL/dxhat * xhat). Two phases with barriers; every thread must call it.
template <int DT>
MB_DEV void epi_norm_stats_t(const MbArgs& a, const MbLayout& L, float* sm, const MbCta& k,
                             const MbEpi& e, int ys, int Ppt) {
  const int R = a.R, Tbk = e.Cbk * R, P = a.P;
  int tpr = 1;  // threads per row
  while (tpr * 2 * Tbk <= kNT && tpr < 64) tpr *= 2;
  for (int task = mb_tid(); task < Tbk * tpr; task += kNT) {
    const int i = task / tpr, sl = task - i * tpr;
    const int tl = i / R, r = i - tl * R;
    float ss = 0.f, sd = 0.f;
    if (tl < e.nvalid) {
      const int64_t gi = e.gt0 + tl;
      for (int p = sl; p < P; p += tpr) {
        const float y = sm[L.Y + i * ys + p];
        const float d = ld4t<DT>(a.dout, k.b, gi, k.h, p);
        const float u = ld4t<DT>(a.z, k.b, gi, k.h, p) * sm[L.mz + r * Ppt + p];
        const float gate = u * sigmoid_f(u);
        const float dxhat = d * sm[L.mo + r * Ppt + p] * gate * sm[L.nw + p];
        ss = fmaf(y, y, ss);
        sd = fmaf(dxhat, y, sd);
      }
    }
    sm[L.red + 2 * task] = ss;
    sm[L.red + 2 * task + 1] = sd;
  }
  mb_sync();
  for (int i = mb_tid(); i < Tbk; i += kNT) {
    float ss = 0.f, sd = 0.f;
    for (int sl = 0; sl < tpr; ++sl) {
      ss += sm[L.red + 2 * (i * tpr + sl)];
      sd += sm[L.red + 2 * (i * tpr + sl) + 1];
    }
    const float rstd = 1.f / sqrtf(ss / static_cast<float>(P) + a.eps);
    sm[L.rstd + i] = rstd;
    sm[L.rdot + i] = rstd * sd / static_cast<float>(P);
  }
  mb_sync();
}

MB_DEV void epi_norm_stats(const MbArgs& a, const MbLayout& L, float* sm, const MbCta& k,
                           const MbEpi& e, int ys, int Ppt) {
  MB_ACT_DISPATCH(epi_norm_stats_t, a, L, sm, k, e, ys, Ppt);
}

// dz (and dout_pre_rms) of the block: one thread per (step, column), summing over the ranks.
template <int DT>
MB_DEV void epi_rows_t(const MbArgs& a, const MbLayout& L, float* sm, const MbCta& k,
                       const MbEpi& e, int ys, int Ppt) {
  if (!a.has_z) return;  // nothing per element without the gate (the norm requires it)
  const int R = a.R, Pv = k.Pv;
  for (int u = mb_tid(); u < e.Cbk * Pv; u += kNT) {
    const int tl = u / Pv, p = u - tl * Pv;
    if (tl >= e.nvalid) continue;
    const int64_t gi = e.gt0 + tl;
    const int64_t pg = k.p0 + p;
    const float d = a.reduce_o ? ld4t<DT>(a.dout, k.b, gi, k.h, pg) : 0.f;
    const float zz = ld4t<DT>(a.z, k.b, gi, k.h, pg);
    float dzs = 0.f;
    for (int r = 0; r < R; ++r) {
      const int i = tl * R + r;
      const float y = sm[L.Y + i * ys + p];
      const float mzv = sm[L.mz + r * Ppt + p];
      const float dr = a.reduce_o ? d * sm[L.mo + r * Ppt + p] : ld5t<DT>(a.dout, k.b, gi, r, k.h, pg);
      const float u2 = zz * mzv;
      const float sg = sigmoid_f(u2);
      const float dsilu = sg * (1.f + u2 * (1.f - sg));
      float yg = y;  // what the gate multiplies
      if (a.has_norm) {
        const float rstd = sm[L.rstd + i];
        const float xhat = y * rstd;
        const float nwp = sm[L.nw + p];
        yg = xhat * nwp;
        const float dxhat = dr * (u2 * sg) * nwp;
        const float pre = rstd * (dxhat - xhat * sm[L.rdot + i]);
        st4(a.dout_pre, k.b, k.h, gi * R + r, pg, pre);
      }
      dzs = fmaf(dr * yg * dsilu, mzv, dzs);
    }
    st4(a.dz, k.b, gi, k.h, pg, dzs);
  }
}

MB_DEV void epi_rows(const MbArgs& a, const MbLayout& L, float* sm, const MbCta& k,
                     const MbEpi& e, int ys, int Ppt) {
  MB_ACT_DISPATCH(epi_rows_t, a, L, sm, k, e, ys, Ppt);
}

// Per-(rank, column) partial sums over the block's steps, Kahan-compensated, in acc (shared
// memory; each thread always owns the same entries).
template <int DT>
MB_DEV void epi_partials_t(const MbArgs& a, const MbLayout& L, float* sm, const MbCta& k,
                           const MbEpi& e, int ys, int Ppt) {
  if (!a.reduce_o && !a.has_z) return;
  const int R = a.R, Pv = k.Pv;
  const int RP = R * Ppt;
  for (int q = mb_tid(); q < R * Pv; q += kNT) {
    const int r = q / Pv, p = q - r * Pv;
    const int64_t pg = k.p0 + p;
    const int slot = r * Ppt + p;
    float* so = sm + L.acc + kPartO * 2 * RP + slot;
    float* sz = sm + L.acc + kPartZ * 2 * RP + slot;
    float* sn = sm + L.acc + kPartN * 2 * RP + slot;
    const float mov = a.reduce_o ? sm[L.mo + slot] : 0.f;
    const float mzv = a.has_z ? sm[L.mz + slot] : 0.f;
    const float nwp = a.has_norm ? sm[L.nw + p] : 1.f;
    // Unrolled so that the typed global loads of several steps are in flight together.
#pragma unroll 4
    for (int tl = 0; tl < e.nvalid; ++tl) {
      const int64_t gi = e.gt0 + tl;
      const int i = tl * R + r;
      const float y = sm[L.Y + i * ys + p];
      const float d = a.reduce_o ? ld4t<DT>(a.dout, k.b, gi, k.h, pg) : ld5t<DT>(a.dout, k.b, gi, r, k.h, pg);
      const float zz = a.has_z ? ld4t<DT>(a.z, k.b, gi, k.h, pg) : 0.f;
      if (!a.has_z) {  // reduce-O without a gate
        kahan_add(so, so + RP, d * y);
        continue;
      }
      const float u = zz * mzv;
      const float sg = sigmoid_f(u);
      const float gate = u * sg;
      const float dsilu = sg * (1.f + u * (1.f - sg));
      const float dr = a.reduce_o ? d * mov : d;
      float yg = y;
      if (a.has_norm) {
        const float xhat = y * sm[L.rstd + i];
        yg = xhat * nwp;
        kahan_add(sn, sn + RP, dr * gate * xhat);
      }
      if (a.reduce_o) kahan_add(so, so + RP, d * gate * yg);
      kahan_add(sz, sz + RP, dr * yg * dsilu * zz);
    }
  }
}

MB_DEV void epi_partials(const MbArgs& a, const MbLayout& L, float* sm, const MbCta& k,
                         const MbEpi& e, int ys, int Ppt) {
  MB_ACT_DISPATCH(epi_partials_t, a, L, sm, k, e, ys, Ppt);
}

// Writes this CTA's partial sums (its columns) to ws_part[bhi][seg].
template <int NT = kNT>
MB_DEV void write_partials(const MbArgs& a, const MbLayout& L, const float* sm, const MbCta& k,
                           int seg, int Ppt) {
  const int R = a.R, Pv = k.Pv, RP = R * Ppt;
  for (int q = mb_tid(); q < R * Pv; q += NT) {
    const int r = q / Pv, p = q - r * Pv;
    const int slot = r * Ppt + p;
    for (int kind = 0; kind < kParts; ++kind) {
      const float* s = sm + L.acc + kind * 2 * RP + slot;
      a.ws_part[((static_cast<int64_t>(k.bhi) * a.nseg + seg) * kParts + kind) * R * a.P +
                static_cast<int64_t>(r) * a.P + k.p0 + p] = s[0] - s[RP];
    }
  }
}

// ------------------------------------------------------------------ kernel bodies

// states[b, h, c, :, p0 .. p0 + Pv) = St. Four columns per thread and one 8- or 16-byte store
// when the layout allows (a.states_vec4): per-element stores with 64-bit index arithmetic were
// 7% of the chunk pass's instructions.
MB_DEV void write_state(const MbArgs& a, const float* St, int LP, const MbCta& k, int c) {
  const int N = a.N, Pv = k.Pv;
  if (!a.states_vec4) {
    for (int e = mb_tid(); e < N * Pv; e += kNT) {
      const int n = e / Pv, p = e - n * Pv;
      st5(a.states, k.b, k.h, c, n, k.p0 + p, St[n * LP + p]);
    }
    return;
  }
  const MbView& o = a.states;
  const int pq = Pv / 4;
  const int64_t base = k.b * o.s[0] + k.h * o.s[1] + static_cast<int64_t>(c) * o.s[2] + k.p0;
  for (int e = mb_tid(); e < N * pq; e += kNT) {
    const int n = e / pq, p = (e - n * pq) * 4;
    const float4 v = *reinterpret_cast<const float4*>(St + n * LP + p);
    const int64_t off = base + n * o.s[3] + p;
    if (o.dt == 2) {
      *reinterpret_cast<float4*>(reinterpret_cast<float*>(o.p) + off) = v;
    } else {
      uint2 w;
      if (o.dt == 1) {
        const __nv_bfloat162 lo = __floats2bfloat162_rn(v.x, v.y), hi = __floats2bfloat162_rn(v.z, v.w);
        w.x = *reinterpret_cast<const uint32_t*>(&lo), w.y = *reinterpret_cast<const uint32_t*>(&hi);
      } else {
        const __half2 lo = __floats2half2_rn(v.x, v.y), hi = __floats2half2_rn(v.z, v.w);
        w.x = *reinterpret_cast<const uint32_t*>(&lo), w.y = *reinterpret_cast<const uint32_t*>(&hi);
      }
      *reinterpret_cast<uint2*>(reinterpret_cast<unsigned short*>(o.p) + off) = w;
    }
  }
}

MB_DEV void zero_smem(float* sm, int total) {
  for (int e = mb_tid(); e < total; e += kNT) sm[e] = 0.f;
}

// Per-CTA constants: biases [R][Np], mimo_v / mimo_o / mimo_z [R][Ppt] (this CTA's columns),
// norm weight [Ppt].
template <int NT = kNT>
MB_DEV void load_consts(const MbArgs& a, const MbLayout& L, float* sm, const MbCta& k, bool q_too,
                        bool epi_too, int Ppt) {
  const int R = a.R, N = a.N, Np = a.Np, Pv = k.Pv;
  for (int e = mb_tid(); e < R * N; e += NT) {
    const int r = e / N, n = e - r * N;
    sm[L.kb + r * Np + n] = ld3(a.k_bias, k.h, r, n);
    if (q_too) sm[L.qb + r * Np + n] = ld3(a.q_bias, k.h, r, n);
  }
  for (int e = mb_tid(); e < R * Pv; e += NT) {
    const int r = e / Pv, p = e - r * Pv;
    if (L.mv >= 0) sm[L.mv + r * Ppt + p] = ld3(a.mimo_v, k.h, r, k.p0 + p);
    if (epi_too && a.reduce_o) sm[L.mo + r * Ppt + p] = ld3(a.mimo_o, k.h, r, k.p0 + p);
    if (epi_too && a.has_z) sm[L.mz + r * Ppt + p] = ld3(a.mimo_z, k.h, r, k.p0 + p);
  }
  if (epi_too && a.has_norm)
    for (int p = mb_tid(); p < Pv; p += NT) sm[L.nw + p] = ld2(a.norm_w, k.h, k.p0 + p);
}

// K1: local recurrence of one sub-segment from a zero state.
template <bool TC>
MB_DEV void k1_body(const MbArgs& a, float* sm) {
  const MbLayout& L = a.l1;
  const int64_t bid = mb_bid();
  const int pt = static_cast<int>(bid % a.npt);
  const int sub = static_cast<int>((bid / a.npt) % a.nsub);
  MbCta k;
  k.bhi = static_cast<int>(bid / (static_cast<int64_t>(a.npt) * a.nsub));
  k.b = k.bhi / a.H, k.h = k.bhi % a.H, k.g = k.h / a.HG;
  k.p0 = pt * a.Pt, k.Pv = min(a.Pt, a.P - k.p0);
  zero_smem(sm, L.total);
  mb_sync();
  load_consts(a, L, sm, k, false, false, a.Ppt);
  float dec = 0.f;
  const int c0 = sub * a.L1, c1 = c0 + a.L1;  // sub-segments never reach the last chunk
  for (int c = c0; c < c1; ++c) {
    mb_sync();
    chunk_scalars(a, L, sm, k, c);
    mb_sync();
    dec += sm[L.misc + 1];
    const float e = sm[L.misc];
    for (int blk = 0; blk < a.nb1; ++blk) {
      build_block(a, L, sm, k, c, blk, a.Cb1, 0, 0, 0, true, true);
      mb_sync();
      op_state_update<TC>(a, L, sm, a.Tb1, blk == 0 ? e : 1.f);
      mb_sync();
    }
  }
  const int N = a.N, P = a.P, Pv = k.Pv, LP = a.LP;
  float* out = a.ws_local + (static_cast<int64_t>(k.bhi) * a.nsub + sub) * N * P;
  for (int e = mb_tid(); e < N * Pv; e += kNT) {
    const int n = e / Pv, p = e - n * Pv;
    out[static_cast<int64_t>(n) * P + k.p0 + p] = sm[L.St + n * LP + p];
  }
  if (mb_tid() == 0 && pt == 0) a.ws_dec[static_cast<int64_t>(k.bhi) * a.nsub + sub] = dec;
}

// K2: states entering K3 segments 1.. from the K1 locals (one thread per state element).
MB_DEV void k2_body(const MbArgs& a) {
  const int NP = a.N * a.P;
  const int nblk = (NP + kNT - 1) / kNT;
  const int64_t bid = mb_bid();
  const int64_t bhi = bid / nblk;
  const int e = static_cast<int>(bid % nblk) * kNT + mb_tid();
  if (e >= NP) return;
  const float* loc = a.ws_local + bhi * a.nsub * NP + e;
  const float* dec = a.ws_dec + bhi * a.nsub;
  float* ent = a.ws_enter + bhi * (a.nseg - 1) * NP + e;
  float st = 0.f;
  for (int s = 0; s < a.nsub; ++s) {
    st = fmaf(expf(dec[s]), st, loc[static_cast<int64_t>(s) * NP]);
    if ((s + 1) % a.subs_per_seg == 0) ent[static_cast<int64_t>((s + 1) / a.subs_per_seg - 1) * NP] = st;
  }
}

// K3: one segment of one (b, h) and P tile: the full chunk pass.
template <bool TC>
MB_DEV void k3_body(const MbArgs& a, float* sm) {
  const MbLayout& L = a.l3;
  const int64_t bid = mb_bid();
  const int pt = static_cast<int>(bid % a.npt);
  const int seg = static_cast<int>((bid / a.npt) % a.nseg);
  MbCta k;
  k.bhi = static_cast<int>(bid / (static_cast<int64_t>(a.npt) * a.nseg));
  k.b = k.bhi / a.H, k.h = k.bhi % a.H, k.g = k.h / a.HG;
  k.p0 = pt * a.Pt, k.Pv = min(a.Pt, a.P - k.p0);
  const int N = a.N, P = a.P, R = a.R, Pv = k.Pv, Ppt = a.Ppt, LP = a.LP;
  const int Cb = a.Cb, nb = a.nb, Tb = a.Tb, LT = a.LT;
  const bool epi = !a.defer_epi;

  zero_smem(sm, L.total);
  mb_sync();
  load_consts(a, L, sm, k, true, epi, Ppt);
  if (seg > 0) {
    const float* in = a.ws_enter + (static_cast<int64_t>(k.bhi) * (a.nseg - 1) + seg - 1) * N * P;
    for (int e = mb_tid(); e < N * Pv; e += kNT) {
      const int n = e / Pv, p = e - n * Pv;
      sm[L.St + n * LP + p] = in[static_cast<int64_t>(n) * P + k.p0 + p];
    }
  }
  const float Dv = a.has_d ? ld1(a.d, k.h) : 0.f;

  const int c0 = seg * a.L3, c1 = min(a.nch, c0 + a.L3);
  for (int c = c0; c < c1; ++c) {
    const int s0 = c * a.C;
    const int Lc = min(a.C, a.S - s0);
    mb_sync();
    chunk_scalars(a, L, sm, k, c);
    write_state(a, sm + L.St, LP, k, c);
    mb_sync();
    chunk_weights(a, L, sm, k, c);
    const float e_chunk = sm[L.misc];
    for (int jq = 0; jq < nb; ++jq) {
      build_block(a, L, sm, k, c, jq, Cb, LT, 1, 1, nb == 1, true);
      mb_sync();
      block_qkdot(a, L, sm, k, c, jq, Cb, LT, pt == 0);
      mb_sync();
      block_rotate(a, L, sm, k, c, jq, Cb, LT);
      mb_sync();
      op_scores<TC>(a, L, sm, jq, jq, Cb, LT, Dv);
      mb_sync();
      op_y_diag<TC>(a, L, sm, jq, Cb, LT);
      mb_sync();
      for (int jk = 0; jk < jq; ++jk) {
        build_block(a, L, sm, k, c, jk, Cb, LT, 0, 2, false, true);
        mb_sync();
        op_scores<TC>(a, L, sm, jq, jk, Cb, LT, Dv);
        mb_sync();
        op_y_prev<TC>(a, L, sm, Cb, LT);
        mb_sync();
      }
      const int nvalid = max(0, min(Cb, Lc - jq * Cb));
      if (epi) {
        const MbEpi ep{s0 + jq * Cb, nvalid, Cb};
        if (a.has_norm) epi_norm_stats(a, L, sm, k, ep, LP, Ppt);
        epi_rows(a, L, sm, k, ep, LP, Ppt);
        epi_partials(a, L, sm, k, ep, LP, Ppt);
      } else {
        for (int u = mb_tid(); u < nvalid * R * Pv; u += kNT) {
          const int i = u / Pv, p = u - i * Pv;
          const int tl = i / R, r = i - tl * R;
          a.ws_y[((static_cast<int64_t>(k.bhi) * a.S + s0 + jq * Cb + tl) * R + r) * P + k.p0 + p] =
              sm[L.Y + i * LP + p];
        }
      }
      // One block: its Kw and X are still resident, the state update joins this phase (it
      // touches only St, Kw and X).
      if (nb == 1 && c + 1 < a.nch) op_state_update<TC>(a, L, sm, Tb, e_chunk);
      mb_sync();
    }
    if (nb > 1 && c + 1 < a.nch) {
      for (int blk = 0; blk < nb; ++blk) {
        build_block(a, L, sm, k, c, blk, Cb, LT, 0, 0, true, true);
        mb_sync();
        op_state_update<TC>(a, L, sm, Tb, blk == 0 ? e_chunk : 1.f);
        mb_sync();
      }
    }
  }
  mb_sync();
  if (epi) write_partials(a, L, sm, k, seg, Ppt);
}

// K4: dmimo_o / dmimo_z / dnorm_weight = fixed-order sums of the per-segment partials.
MB_DEV void k4_body(const MbArgs& a) {
  const int64_t RP = static_cast<int64_t>(a.R) * a.P;
  const int64_t e = mb_bid() * kNT + mb_tid();
  if (e >= static_cast<int64_t>(a.B) * a.H * RP) return;
  const int64_t bhi = e / RP, rp = e % RP;
  const int b = static_cast<int>(bhi / a.H), h = static_cast<int>(bhi % a.H);
  const int r = static_cast<int>(rp / a.P), p = static_cast<int>(rp % a.P);
  for (int kind = 0; kind < kParts; ++kind) {
    const MbView& out = kind == kPartO ? a.dmimo_o : kind == kPartZ ? a.dmimo_z : a.dnorm_w;
    if (out.p == nullptr) continue;
    float s = 0.f;
    for (int seg = 0; seg < a.nseg; ++seg)
      s += a.ws_part[((bhi * a.nseg + seg) * kParts + kind) * RP + rp];
    st4(out, b, h, r, p, s);
  }
}

// K5: the epilogue over the whole P row from Y left in ws_y by K3 (norm with a P split).
MB_DEV void k5_body(const MbArgs& a, float* sm) {
  const MbLayout& L = a.l5;
  const int64_t bid = mb_bid();
  const int seg = static_cast<int>(bid % a.nseg);
  MbCta k;
  k.bhi = static_cast<int>(bid / a.nseg);
  k.b = k.bhi / a.H, k.h = k.bhi % a.H, k.g = k.h / a.HG;
  k.p0 = 0, k.Pv = a.P;
  const int R = a.R, P = a.P, Pp = a.Pp5, Cb = a.Cb5;
  zero_smem(sm, L.total);
  mb_sync();
  load_consts(a, L, sm, k, false, true, Pp);
  const int t0 = seg * a.L3 * a.C, t1 = min(a.S, (seg + 1) * a.L3 * a.C);
  for (int tb = t0; tb < t1; tb += Cb) {
    const int nvalid = min(Cb, t1 - tb);
    mb_sync();
    for (int u = mb_tid(); u < nvalid * R * P; u += kNT) {
      const int i = u / P, p = u - i * P;
      const int tl = i / R, r = i - tl * R;
      sm[L.Y + i * Pp + p] = a.ws_y[((static_cast<int64_t>(k.bhi) * a.S + tb + tl) * R + r) * P + p];
    }
    mb_sync();
    const MbEpi ep{tb, nvalid, Cb};
    epi_norm_stats(a, L, sm, k, ep, Pp, Pp);
    epi_rows(a, L, sm, k, ep, Pp, Pp);
    epi_partials(a, L, sm, k, ep, Pp, Pp);
  }
  mb_sync();
  write_partials(a, L, sm, k, seg, Pp);
}

// ------------------------------------------------------------------ host-side plan

inline int mb_up4(int x) { return (x + 3) & ~3; }
inline int mb_up(int x, int m) { return (x + m - 1) / m * m; }
// Smallest row stride >= x (a multiple of 4) that is 8 or 24 modulo 32: the rows k..k+3 of a
// tensor-core fragment load then start 8 banks apart and its 32 lanes hit 32 distinct banks.
inline int mb_stride(int x) {
  int s = mb_up4(x);
  while (s % 32 != 8 && s % 32 != 24) s += 4;
  return s;
}

struct MbDevice {
  int sms = 132;
  int smem_optin = 232448;   // max dynamic shared memory per block
  int smem_per_sm = 233472;  // shared memory per SM
};

// Layouts (floats). Regions used by a kernel get a 16-byte aligned offset; unused ones -1.
// Y shares Kh^T's space when a chunk is one block (Kh^T is dead once the scores are formed).
inline MbLayout layout_k3(int N, int Np, int Ppt, int R, int C, int Cb, int LT, int LP, int LK,
                          bool epi) {
  MbLayout l;
  const int Tb = Cb * R;
  int off = 0;
  auto take = [&](int n) {
    const int o = off;
    off += mb_up4(n);
    return o;
  };
  (void)N;
  l.St = take(Np * LP);
  l.QhT = take(Np * LT);
  l.KhT = take(Np * LT);
  l.Khw = take(Tb * LK);
  l.X = take(Tb * LP);
  l.ScT = take(Tb * LT);
  l.Y = (Cb == C && Np * LT >= Tb * LP) ? l.KhT : take(Tb * LP);
  l.W = take(C * C);
  l.da = take(C);
  l.expda = take(C);
  l.gamma = take(C);
  l.tscale = take(C);
  l.wk = take(C);
  l.misc = take(4);
  l.qkd = take(Tb * R);
  l.qb = take(R * Np);
  l.kb = take(R * Np);
  l.mv = take(R * Ppt);
  if (epi) {
    l.rstd = take(Tb);
    l.rdot = take(Tb);
    l.red = take(2 * std::max(kNT, Tb));
    l.mo = take(R * Ppt);
    l.mz = take(R * Ppt);
    l.nw = take(Ppt);
    l.acc = take(2 * kParts * R * Ppt);
  } else {
    l.rstd = l.rdot = l.red = l.mo = l.mz = l.nw = l.acc = -1;
  }
  l.total = off;
  return l;
}

inline MbLayout layout_k1(int Np, int Ppt, int R, int C, int Cb, int LP, int LK) {
  MbLayout l;
  const int Tb = Cb * R;
  int off = 0;
  auto take = [&](int n) {
    const int o = off;
    off += mb_up4(n);
    return o;
  };
  l.St = take(Np * LP);
  l.Khw = take(Tb * LK);
  l.X = take(Tb * LP);
  l.da = take(C);
  l.expda = take(C);
  l.gamma = take(C);
  l.tscale = take(C);
  l.wk = take(C);
  l.misc = take(4);
  l.kb = take(R * Np);
  l.mv = take(R * Ppt);
  l.QhT = l.KhT = l.ScT = l.Y = l.W = l.qkd = l.qb = -1;
  l.rstd = l.rdot = l.red = l.mo = l.mz = l.nw = l.acc = -1;
  l.total = off;
  return l;
}

inline MbLayout layout_k5(int Np, int Pp, int R, int Cb) {
  MbLayout l;
  const int Tb = Cb * R;
  int off = 0;
  auto take = [&](int n) {
    const int o = off;
    off += mb_up4(n);
    return o;
  };
  l.Y = take(Tb * Pp);
  l.rstd = take(Tb);
  l.rdot = take(Tb);
  l.red = take(2 * std::max(kNT, Tb));
  l.kb = take(R * Np);  // load_consts always fills the k bias
  l.mo = take(R * Pp);
  l.mz = take(R * Pp);
  l.nw = take(Pp);
  l.acc = take(2 * kParts * R * Pp);
  l.mv = -1;
  l.St = l.QhT = l.KhT = l.Khw = l.X = l.ScT = l.W = l.qkd = l.qb = -1;
  l.da = l.expda = l.gamma = l.tscale = l.wk = l.misc = -1;
  l.total = off;
  return l;
}

// Shared-memory layout of the lean kernels (floats) for nt threads per CTA. The bf16 planes take
// the general layout's tile fields: QhT -> Qh, KhT -> Kh, Khw -> Xw, ScT -> Sc.
inline MbLayout layout_lean(int N, int P, int R, int C, int A, bool reduce_o, bool angles,
                            bool full, int nt, int defer_slots = 0) {
  MbLayout l;
  const int T = C * R;
  int off = 0;
  auto take = [&](int n) {
    const int o = off;
    off += mb_up4(n);
    return o;
  };
  // A split tile of rows x (cols + 8) bf16 pairs is rows * (cols + 8) floats.
  auto planes = [&](int rows, int cols) { return take(rows * (cols + 8)); };
  l.QhT = l.ScT = l.X = l.St = l.Y = l.W = l.qkd = l.qb = -1;
  l.rstd = l.rdot = l.red = l.mo = l.mz = l.nw = l.acc = -1;
  l.KhT = planes(T, N);
  l.Khw = planes(T, P);
  if (full) {
    l.QhT = planes(T, N);
    l.X = planes(T, P);
    l.St = planes(N, P);
    // defer_slots > 0: the epilogue's exchange (that many kinds of R nt partials) goes to the
    // Sc planes, enlarged where they are smaller, and is summed after the next chunk's first
    // barrier (lean_defer_sums).
    l.ScT = take(std::max(T * (T + 8), defer_slots * R * nt));
    l.Y = take(T * mb_stride(P));
    // The intra-chunk weights in the Y tile when they fit (C <= R mb_stride(P): every shape of
    // SPEC.md's grid): K3 writes W after the barrier that ends the previous chunk's reads of Y
    // (its epilogue) and reads it in the scores, before lean_y writes Y. Why: the C C floats
    // (16 KB at C = 64) kept the cos / sin table out of shared memory at N128 P64 R1 C64, whose
    // q / k build then ran four rolled sincosf with their angle loads per task.
    l.W = C * C <= T * mb_stride(P) ? l.Y : take(C * C);
  }
  l.da = take(C);
  l.expda = take(C);
  l.gamma = take(C);
  l.tscale = take(C);
  l.wk = take(C);
  l.misc = take(4);
  l.kb = take(R * N);
  l.mv = take(R * P);
  if (angles) l.ang = take(2 * C * A);
  if (full) {
    // Staged bf16 rows (two per float): z [C][P], dout [C][P] (reduce-O) or [C R][P].
    l.zs = take(C * P / 2);
    l.ds = take((reduce_o ? C : C * R) * P / 2);
    // Per-thread partial sums exchanged in the epilogue: deferred, in the Sc planes; else the
    // Qh and X planes (adjacent), dead by then.
    l.ered = defer_slots > 0                          ? l.ScT
             : T * (N + 8) + T * (P + 8) >= 3 * R * nt ? l.QhT
                                                        : take(3 * R * nt);
    l.qb = take(R * N);
    l.rstd = take(T);
    l.rdot = take(T);
    l.red = take(2 * std::max(nt, T));
    l.mo = take(R * P);
    l.mz = take(R * P);
    l.nw = take(P);
    l.acc = take(2 * kParts * R * P);
  }
  l.total = off;
  return l;
}

// State tiles per warp the lean kernels need with nt threads (0: more than 8, the lean path
// does not apply).
constexpr int lean_state_tiles(int N, int P, int nt) {
  const int tiles = (N / 16) * (P / 16), warps = nt / 32;
  const int per = (tiles + warps - 1) / warps;
  for (int st : {1, 2, 4, 8})
    if (per <= st) return st;
  return 0;
}

// Sizes and options the plan depends on (from the checked params).
struct MbProblem {
  int64_t B, S, H, G, N, P, R, C, A;
  bool reduce_o, has_z, has_d, has_norm;
  bool act16;  // q, k and v are 16-bit: the products may run on tensor cores
  int act_dt;  // the dtype code shared by q, k, v (and z, dout), or -1
  bool lean_io;   // bf16 q, k, v, z, dout (the lean path)
  bool lean_vec;  // ... with unit last strides, even strides, 4-byte aligned bases (pair loads)
  bool lean_vec4 = false;  // ... strides multiples of 4, 8-byte aligned bases (4-element loads)
};

struct MbPlan {
  bool ok = false;
  int lean = 0;  // > 0: the lean bf16 kernels run K1 / K3, with this many state tiles per warp
  int nt = kNT;  // threads per CTA of K1 / K3 (the lean kernels: 256 or 512)
  int Np, Cb, nb, Tb, LT, Cb1, nb1, Tb1, Cb5, Pt, npt, Ppt, Pp5, LP, LK, tc, tc1;
  int nseg, L3, nsub, L1, subs_per_seg, defer_epi;
  MbLayout l1, l3, l5;
  size_t smem1 = 0, smem3 = 0, smem5 = 0;
  // workspace (bytes, each region 256-byte aligned)
  size_t ws_local = 0, ws_dec = 0, ws_enter = 0, ws_part = 0, ws_y = 0, ws_total = 0;
};

inline size_t mb_align256(size_t x) { return (x + 255) & ~static_cast<size_t>(255); }

// Threads per CTA the lean kernels try first. Measured on the H200 over the 11 benchmark shapes
// (B=4 S=2048 H=16, bf16; docs/PERF.md): 256 wins only at N=16 (1.08 vs 1.84 ms at P=64 R=4 C=8,
// where per-chunk latency dominates); every larger N is 17-45% slower with 256.
constexpr int lean_nt_rule(int N) { return N <= 16 ? 256 : 512; }

// The lean K1's CTAs per SM (its launch bounds' minimum; the plan's K1 slots). Two at 512
// threads where 64 registers can hold the state tiles (up to four per warp): one CTA's barrier
// waits, prologue and final stores then overlap the other's work. At one CTA per SM (its 70-88
// registers allowed no more) K1 ran ~4.8 us per chunk per SM at N128 P64 R4 C16, half of K3's
// whole chunk. ptxas at 64 registers: the shape copies spill nothing at one tile per warp, 12
// bytes at two (one value kept across the chunk loop's barrier), ~90 at four; the generic
// kernels 128 / 236 bytes at two / four. Measured on the H200 with the plan's K1 slots to match
// (docs/PERF.md, session 18): the shape copies 26-45% faster at every 512-thread grid shape,
// the generic kernels 13-32%. Eight tiles per warp need their registers: one CTA.
constexpr int lean_k1_min_blocks(int NT, int ST) { return NT == 512 && ST <= 4 ? 2 : 1; }

// The value of MAMBA3_MIMO_LEAN_NT (A/B measurements): 256 or 512, 0 when unset or empty, -1
// when invalid.
inline int parse_lean_nt(const char* s) {
  if (s == nullptr || *s == '\0') return 0;
  return std::strcmp(s, "256") == 0 ? 256 : std::strcmp(s, "512") == 0 ? 512 : -1;
}

// Picks tiles and segments. Costs are rough FLOP-time estimates; what matters is keeping every
// SM busy while adding little K1 / K2 work. lean_nt: the lean kernels' preferred thread count
// (256 or 512; 0: lean_nt_rule); 512 is tried next when the lean path does not apply with it.
inline MbPlan make_mimo_plan(const MbProblem& pr, const MbDevice& dev, int lean_nt = 0) {
  MbPlan pl;
  const int N = static_cast<int>(pr.N), P = static_cast<int>(pr.P), R = static_cast<int>(pr.R);
  const int C = static_cast<int>(pr.C);
  const int64_t nch = (pr.S + pr.C - 1) / pr.C;
  // Tensor-core tiles need Np a multiple of 16 and Ppt of 8 (zero padding).
  const bool tcw = pr.act16;
  pl.Np = tcw ? mb_up(N, 16) : mb_up4(N);
  pl.LK = mb_stride(pl.Np);
  const size_t budget = static_cast<size_t>(dev.smem_optin);

  // K3 tiles: the whole P and whole chunks when they fit; else smaller step blocks; else a P
  // split (halving the tile width).
  // Candidate tile widths: P, then halves rounded up to multiples of 4.
  int cands[16], ncand = 0;
  for (int Pt = P;; Pt = mb_up4((Pt + 1) / 2)) {
    cands[ncand++] = Pt;
    if (Pt <= 4 || ncand == 16) break;
  }
  bool found = false;
  // The lean bf16 path (mimo_bwd_fwd_lean.cuh): whole chunks and the whole P in one CTA.
  {
    const int T = C * R, A = static_cast<int>(pr.A);
    const int pref = lean_nt ? lean_nt : lean_nt_rule(N);
    const int nts[2] = {pref, 512};
    for (int ni = 0; ni < (pref == 512 ? 1 : 2) && !found; ++ni) {
      const int nt = nts[ni], st = lean_state_tiles(N, P, nt);
      // nt % P: the epilogue gives each thread one column and every nt / P-th step.
      if (!(pr.lean_io && (R & (R - 1)) == 0 && nt % P == 0 && (T == 16 || T == 32 || T == 64) &&
            N % 16 == 0 && P % 16 == 0 && st > 0))
        continue;
      // With a per-chunk table of the angles' cos / sin when it fits, else without; with the
      // epilogue's exchange deferred (its slots: mimo_o, the gate, the norm, as many as are on)
      // when that fits too.
      const int slots = pr.has_norm ? 3 : pr.has_z ? 2 : 1;
      bool fits = false;
      MbLayout l3, l1;
      for (int with_ang = 1; with_ang >= 0 && !fits; --with_ang) {
        for (int defer = 1; defer >= 0 && !fits; --defer) {
          l3 = layout_lean(N, P, R, C, A, pr.reduce_o, with_ang, true, nt, defer ? slots : 0);
          l1 = layout_lean(N, P, R, C, A, pr.reduce_o, with_ang, false, nt);
          fits = static_cast<size_t>(l3.total) * 4 <= budget;
        }
      }
      if (fits) {
        found = true;
        pl.lean = st, pl.nt = nt;
        pl.Pt = P, pl.Ppt = P, pl.LP = mb_stride(P), pl.Cb = C, pl.LT = T + 8, pl.l3 = l3;
        pl.defer_epi = 0;
        pl.Cb1 = C, pl.l1 = l1;
      }
    }
  }
  for (int ci = 0; ci < ncand && !found; ++ci) {
    const int Pt = cands[ci], Ppt = tcw ? mb_up(Pt, 8) : mb_up4(Pt), LP = mb_stride(Ppt);
    for (int Cb = C; Cb >= 4 && !found; Cb /= 2) {
      const int LT = mb_stride(Cb * R);
      const bool epi = !(pr.has_norm && Pt < P);
      const MbLayout l = layout_k3(N, pl.Np, Ppt, R, C, Cb, LT, LP, pl.LK, epi);
      if (static_cast<size_t>(l.total) * 4 <= budget) {
        found = true;
        pl.Pt = Pt, pl.Ppt = Ppt, pl.LP = LP, pl.Cb = Cb, pl.LT = LT, pl.l3 = l;
        pl.defer_epi = epi ? 0 : 1;
      }
    }
  }
  if (!found) return pl;
  pl.npt = (P + pl.Pt - 1) / pl.Pt;
  pl.nb = C / pl.Cb;
  pl.Tb = pl.Cb * R;
  pl.tc = tcw && pl.Tb % 16 == 0;
  pl.smem3 = static_cast<size_t>(pl.l3.total) * 4;

  // K1 tiles (same P tiles, its own step blocks).
  if (!pl.lean) pl.Cb1 = 0;
  for (int Cb = C; Cb >= 4 && !pl.lean; Cb /= 2) {
    const MbLayout l = layout_k1(pl.Np, pl.Ppt, R, C, Cb, pl.LP, pl.LK);
    if (static_cast<size_t>(l.total) * 4 <= budget) {
      pl.Cb1 = Cb, pl.l1 = l;
      break;
    }
  }
  if (pl.Cb1 == 0) return pl;
  pl.nb1 = C / pl.Cb1;
  pl.Tb1 = pl.Cb1 * R;
  pl.tc1 = tcw && pl.Tb1 % 16 == 0;
  pl.smem1 = static_cast<size_t>(pl.l1.total) * 4;

  // K5 (deferred epilogue only): whole P rows, steps per block as fits.
  pl.Pp5 = mb_up4(P);
  pl.Cb5 = 0;
  if (pl.defer_epi) {
    for (int Cb = C; Cb >= 1; Cb /= 2) {
      const MbLayout l = layout_k5(pl.Np, pl.Pp5, R, Cb);
      if (static_cast<size_t>(l.total) * 4 <= budget) {
        pl.Cb5 = Cb, pl.l5 = l;
        break;
      }
    }
    if (pl.Cb5 == 0) return pl;
    pl.smem5 = static_cast<size_t>(pl.l5.total) * 4;
  } else {
    pl.Cb5 = 1;
    pl.l5 = MbLayout{};
  }

  // Segments.
  auto occ = [&](size_t smem, int cap) {
    const int n = static_cast<int>(static_cast<size_t>(dev.smem_per_sm) / (smem + 1024));
    return std::max(1, std::min(cap, n));
  };
  const double slots3 = static_cast<double>(dev.sms) * occ(pl.smem3, 2);
  // K1: the lean 512-thread kernels' registers allow lean_k1_min_blocks CTAs per SM (more
  // would take fewer registers than their launch bounds); the other K1s up to 4 as shared memory
  // allows.
  const int k1_cap = pl.lean && pl.nt == 512 ? lean_k1_min_blocks(pl.nt, pl.lean) : 4;
  const double slots1 = static_cast<double>(dev.sms) * occ(pl.smem1, k1_cap);
  const double T = static_cast<double>(C) * R;
  const double f3 = 4.0 * T * N * P + T * T * N + 0.5 * T * T * P;  // FLOP/2 per K3 chunk
  const double f1 = 2.0 * T * N * P;
  const double sm_rate = 1.2e11;  // FMA/s one SM sustains on these tiles (rough)
  const double BHP = static_cast<double>(pr.B * pr.H) * pl.npt;
  double best = 1e300;
  for (int64_t nseg = 1; nseg <= std::min<int64_t>(nch, 1024); ++nseg) {
    const int64_t L3 = (nch + nseg - 1) / nseg;
    if ((nch + L3 - 1) / L3 != nseg) continue;  // same segments as a smaller nseg
    const double t3 = std::ceil(BHP * nseg / slots3) * L3 * f3 / sm_rate;
    double t1best = 0;
    int64_t L1best = L3;
    if (nseg > 1) {
      t1best = 1e300;
      for (int64_t L1 = 1; L1 <= L3; ++L1) {
        if (L3 % L1) continue;
        const int64_t nsub = (nseg - 1) * (L3 / L1);
        if (nsub > 4096) continue;
        const double t1 = std::ceil(BHP * nsub / slots1) * L1 * f1 / sm_rate +
                          static_cast<double>(pr.B * pr.H) * nsub * N * P * 8.0 / 3e12 + 4e-6;
        if (t1 < t1best) t1best = t1, L1best = L1;
      }
      if (t1best >= 1e300) continue;
    }
    const double tot = t3 + t1best;
    if (tot < best * 0.999) {
      best = tot;
      pl.nseg = static_cast<int>(nseg);
      pl.L3 = static_cast<int>(L3);
      pl.L1 = static_cast<int>(L1best);
    }
  }
  pl.subs_per_seg = pl.L3 / pl.L1;
  pl.nsub = (pl.nseg - 1) * pl.subs_per_seg;

  const size_t BH = static_cast<size_t>(pr.B * pr.H), NP = static_cast<size_t>(N) * P;
  pl.ws_local = mb_align256(BH * pl.nsub * NP * 4);
  pl.ws_dec = mb_align256(BH * pl.nsub * 4);
  pl.ws_enter = mb_align256(BH * (pl.nseg - 1) * NP * 4);
  pl.ws_part = mb_align256(BH * pl.nseg * kParts * R * P * 4);
  pl.ws_y = pl.defer_epi ? mb_align256(BH * static_cast<size_t>(pr.S) * R * P * 4) : 0;
  pl.ws_total = pl.ws_local + pl.ws_dec + pl.ws_enter + pl.ws_part + pl.ws_y + 256;
  pl.ok = true;
  return pl;
}

// Fills the plan-dependent fields of the arguments and carves the workspace (`ws` may be
// unaligned; the plan reserves 256 bytes for that).
inline void apply_plan(const MbProblem& pr, const MbPlan& pl, void* ws, MbArgs* a) {
  a->B = static_cast<int>(pr.B), a->S = static_cast<int>(pr.S), a->H = static_cast<int>(pr.H);
  a->G = static_cast<int>(pr.G), a->N = static_cast<int>(pr.N), a->P = static_cast<int>(pr.P);
  a->R = static_cast<int>(pr.R), a->C = static_cast<int>(pr.C);
  a->nch = static_cast<int>((pr.S + pr.C - 1) / pr.C);
  a->A = static_cast<int>(pr.A), a->half = a->N / 2, a->HG = a->H / a->G, a->Np = pl.Np;
  a->reduce_o = pr.reduce_o, a->has_z = pr.has_z, a->has_d = pr.has_d, a->has_norm = pr.has_norm;
  a->act_dt = pr.act_dt;
  a->lean_vec = pr.lean_vec;
  a->lean_ld = pr.lean_vec4 ? 2 : pr.lean_vec ? 1 : 0;
  a->prefetch = 1;  // the host entry may turn it off (MAMBA3_MIMO_PREFETCH=0)
  a->scal_f32 = a->da_cs.dt == 2 && a->da_cs_rev.dt == 2 && a->dt.dt == 2 && a->trap.dt == 2;
  a->lgR = -1;
  for (int l = 0; l < 4; ++l)
    if ((1 << l) == a->R) a->lgR = l;
  a->lgP = -1;
  for (int l = 0; l < 31; ++l)
    if ((1 << l) == a->P) a->lgP = l;
  {
    // Vector stores of the states: unit column stride, every other stride and the P tile
    // start a multiple of 4 elements, a 16-byte aligned base.
    const MbView& o = a->states;
    const bool strides4 = o.s[4] == 1 && o.s[0] % 4 == 0 && o.s[1] % 4 == 0 && o.s[2] % 4 == 0 &&
                          o.s[3] % 4 == 0;
    a->states_vec4 = strides4 && pl.Pt % 4 == 0 && pr.P % 4 == 0 &&
                     reinterpret_cast<uintptr_t>(o.p) % 16 == 0 && o.dt >= 0 && o.dt <= 2;
  }
  a->Cb = pl.Cb, a->nb = pl.nb, a->Tb = pl.Tb, a->LT = pl.LT;
  a->Cb1 = pl.Cb1, a->nb1 = pl.nb1, a->Tb1 = pl.Tb1;
  a->LP = pl.LP, a->LK = pl.LK, a->tc = pl.tc, a->tc1 = pl.tc1;
  a->Cb5 = pl.Cb5, a->Tb5 = pl.Cb5 * a->R;
  a->Pt = pl.Pt, a->npt = pl.npt, a->Ppt = pl.Ppt, a->Pp5 = pl.Pp5;
  a->nseg = pl.nseg, a->L3 = pl.L3, a->nsub = pl.nsub, a->L1 = pl.L1;
  a->subs_per_seg = pl.subs_per_seg, a->defer_epi = pl.defer_epi;
  a->l1 = pl.l1, a->l3 = pl.l3, a->l5 = pl.l5;
  uintptr_t base = (reinterpret_cast<uintptr_t>(ws) + 255) & ~static_cast<uintptr_t>(255);
  auto carve = [&](size_t bytes) {
    float* p = bytes ? reinterpret_cast<float*>(base) : nullptr;
    base += bytes;
    return p;
  };
  a->ws_local = carve(pl.ws_local);
  a->ws_dec = carve(pl.ws_dec);
  a->ws_enter = carve(pl.ws_enter);
  a->ws_part = carve(pl.ws_part);
  a->ws_y = carve(pl.ws_y);
}

inline MbView mb_view(const TensorView& t) {
  MbView v;
  v.p = static_cast<unsigned char*>(t.data);
  v.dt = static_cast<int>(t.dtype);
  for (int d = 0; d < t.ndim && d < 5; ++d) v.s[d] = t.strides[d];
  return v;
}

inline MbProblem mb_problem(const MimoBwdFwdParams& p) {
  MbProblem pr;
  pr.B = p.B, pr.S = p.S, pr.H = p.H, pr.G = p.G, pr.N = p.N, pr.P = p.P, pr.R = p.R;
  pr.C = p.C, pr.A = p.A;
  pr.reduce_o = p.reduce_o, pr.has_z = p.has_z, pr.has_d = p.has_d, pr.has_norm = p.has_norm;
  pr.act16 = p.q.dtype != DType::F32 && p.k.dtype != DType::F32 && p.v.dtype != DType::F32;
  const DType d0 = p.q.dtype;
  const bool same = p.k.dtype == d0 && p.v.dtype == d0 && p.dout.dtype == d0 &&
                    (!p.has_z || p.z.dtype == d0);
  pr.act_dt = same ? static_cast<int>(d0) : -1;
  // Runs of w bf16 elements along the last dim (w = 2: pairs, 4: quads) take one load each.
  auto runs = [](const TensorView& t, int ndim, int w) {
    if (t.strides[ndim - 1] != 1 || reinterpret_cast<uintptr_t>(t.data) % (2 * w) != 0) return false;
    for (int d = 0; d + 1 < ndim; ++d)
      if (t.strides[d] % w != 0) return false;
    return true;
  };
  auto pairs = [&](const TensorView& t, int ndim) { return runs(t, ndim, 2); };
  auto quads = [&](const TensorView& t, int ndim) { return runs(t, ndim, 4); };
  // Any layout runs the lean path (same arithmetic, so the same bits); lean_vec picks its
  // 4-byte loads.
  pr.lean_io = pr.act_dt == static_cast<int>(DType::BF16);
  pr.lean_vec = pairs(p.q, 5) && pairs(p.k, 5) && pairs(p.v, 4) && pairs(p.dout, p.dout.ndim) &&
                (!p.has_z || pairs(p.z, 4));
  pr.lean_vec4 = quads(p.q, 5) && quads(p.k, 5) && quads(p.v, 4) && quads(p.dout, p.dout.ndim) &&
                 (!p.has_z || quads(p.z, 4));
  return pr;
}

// The tensor fields of the arguments.
inline void mb_set_tensors(const MimoBwdFwdParams& p, MbArgs* a) {
  a->eps = static_cast<float>(p.norm_eps);
  a->dout = mb_view(p.dout), a->q = mb_view(p.q), a->k = mb_view(p.k), a->v = mb_view(p.v);
  a->q_bias = mb_view(p.q_bias), a->k_bias = mb_view(p.k_bias), a->mimo_v = mb_view(p.mimo_v);
  a->mimo_o = mb_view(p.mimo_o), a->mimo_z = mb_view(p.mimo_z), a->angles = mb_view(p.angles);
  a->da_cs = mb_view(p.da_cs), a->da_cs_rev = mb_view(p.da_cs_rev), a->dt = mb_view(p.dt);
  a->trap = mb_view(p.trap), a->segsum = mb_view(p.segsum), a->d = mb_view(p.d);
  a->z = mb_view(p.z), a->norm_w = mb_view(p.norm_weight);
  a->states = mb_view(p.states), a->qk_dot = mb_view(p.qk_dot), a->dmimo_o = mb_view(p.dmimo_o);
  a->dmimo_z = mb_view(p.dmimo_z), a->dz = mb_view(p.dz), a->dnorm_w = mb_view(p.dnorm_weight);
  a->dout_pre = mb_view(p.dout_pre_rms);
}

}  // namespace mamba3::cuda::mimo
