// Kernels of mamba3_mimo_bwd_bwd (CUDA backend, seed 001): a correctness-first port of the CPU
// backend (src/cpu/mimo_bwd_bwd.cpp; formulas in golden/include/mamba3_golden/mimo_bwd_bwd.hpp).
// Speed comes later: plain fp32 FFMA loops over fp32 scratch, no tensor cores. Included by
// mimo_bwd_bwd.cu; the bodies use only the primitives at the top (thread / block index, barrier,
// typed loads and stores), so the tests also run them on the host (test_mimo_bwd_bwd_emulated.cpp).
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
//   K4: sums those partials over the chunks in a fixed order (compensated): DMIMO_V, DD.
// Determinism: every reduction runs in one thread or through a fixed-shape block tree; nothing
// depends on scheduling (no atomics), so repeated calls give identical bits.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "core/error.hpp"
#include "core/mimo_bwd_bwd_params.hpp"

#if defined(__CUDACC__)
#define BB_DEV __device__ __forceinline__
#else
#define BB_DEV inline
#endif

namespace mamba3::cuda::bb {

constexpr int kThreads = 256;       // every kernel; block_sum assumes a power of two
constexpr int kMaxC = 64;           // largest chunk size the params allow
constexpr int kMaxR = 8;            // largest rank the params allow
constexpr int kRowTile = 16;        // K1: rows staged in shared memory per step
constexpr int64_t kMaxSlots = 256;  // K3 CTAs (and scratch slots); bounds the workspace
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

// Runtime dtype codes (mamba3::DType values): 0 f16, 1 bf16, 2 f32.
BB_DEV float bb_ld_raw(const unsigned char* p, int64_t off, int dt) {
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

BB_DEV void bb_st_raw(unsigned char* p, int64_t off, int dt, float v) {
  if (dt == 2) {
    reinterpret_cast<float*>(p)[off] = v;
  } else if (dt == 1) {
    reinterpret_cast<unsigned short*>(p)[off] = __bfloat16_as_ushort(__float2bfloat16_rn(v));
  } else {
    reinterpret_cast<unsigned short*>(p)[off] = __half_as_ushort(__float2half_rn(v));
  }
}

// A tensor as the kernels see it: byte pointer (byte_offset applied), runtime dtype, strides
// in elements.
struct View {
  unsigned char* p = nullptr;
  int dt = 2;
  int64_t s[5] = {0, 0, 0, 0, 0};
};

struct Args {
  int B, S, H, G, N, P, R, C, A, half, nch, HG;
  int layout;  // 0 reduce-O, 1 per rank, 2 packed (MimoDout order)
  int has_d;
  View dout, q, k, v, q_bias, k_bias, mimo_v, states, qk_dot, da_cs, da_cs_rev, dt, trap, segsum,
      angles, mimo_o, d;
  View dq, dk, dv, dmimo_v, dangles, dfactor, dgamma, dda, dssda, dda_cs_rev, dda_cs, dd;
  float* ws_ds;    // [B*H][nch][N*P]: U_c, then dS_c
  float* ws_part;  // [B*H][nch][R*P]: per-chunk DMIMO_V partials
  float* ws_dd;    // [B*H][nch]: per-chunk DD partials
  float* ws_slot;  // [nslots][slot_floats]: K3 scratch
  int64_t slot_floats;
  // Offsets (floats) of the scratch arrays inside a slot; Tm = C R rows at most.
  int64_t o_qh, o_kh, o_sg, o_sx, o_dqh, o_dkh, o_x, o_g, o_dp, o_kq, o_xg, o_st;
};

// K3's shared memory (per CTA).
struct ChunkShared {
  float dacs[kMaxC], dt[kMaxC + 1], lam[kMaxC + 1];
  float E[kMaxC], F[kMaxC], ts[kMaxC], gam[kMaxC];
  float W[kMaxC * kMaxC];           // [i][j] (row stride C) exp(segsum), j < i; 0 elsewhere
  float qk[kMaxC * kMaxR * kMaxR];  // qk_dot of the chunk [i][r][r2]
  float red[kThreads];              // block_sum
};

// ------------------------------------------------------------------ element access

BB_DEV float ld(const View& v, int64_t off) { return bb_ld_raw(v.p, off, v.dt); }
BB_DEV void st(const View& v, int64_t off, float x) { bb_st_raw(v.p, off, v.dt, x); }
BB_DEV int64_t o1(const View& v, int64_t i0) { return i0 * v.s[0]; }
BB_DEV int64_t o2(const View& v, int64_t i0, int64_t i1) { return i0 * v.s[0] + i1 * v.s[1]; }
BB_DEV int64_t o3(const View& v, int64_t i0, int64_t i1, int64_t i2) {
  return i0 * v.s[0] + i1 * v.s[1] + i2 * v.s[2];
}
BB_DEV int64_t o4(const View& v, int64_t i0, int64_t i1, int64_t i2, int64_t i3) {
  return i0 * v.s[0] + i1 * v.s[1] + i2 * v.s[2] + i3 * v.s[3];
}
BB_DEV int64_t o5(const View& v, int64_t i0, int64_t i1, int64_t i2, int64_t i3, int64_t i4) {
  return i0 * v.s[0] + i1 * v.s[1] + i2 * v.s[2] + i3 * v.s[3] + i4 * v.s[4];
}

BB_DEV float sigmoid_f(float x) { return 1.f / (1.f + expf(-x)); }

// Biased, unrotated q (or k) of step t, rank r, for head h: element m.
BB_DEV float biased(const Args& a, const View& x, const View& bias, int b, int t, int r, int h,
                    int m) {
  const int g = h / a.HG;
  return ld(x, o5(x, b, t, r, g, m)) + ld(bias, o3(bias, h, r, m));
}

// Element n of the rotated, biased q (or k): half pairs (i, half + i), i < A, turned by the
// step's angle i; the other dims unrotated.
BB_DEV float rotated(const Args& a, const View& x, const View& bias, int b, int t, int r, int h,
                     int n) {
  if (n < a.A) {
    float sn, cs;
    bb_sincos(ld(a.angles, o4(a.angles, b, t, h, n)), &sn, &cs);
    return biased(a, x, bias, b, t, r, h, n) * cs -
           biased(a, x, bias, b, t, r, h, a.half + n) * sn;
  }
  if (n >= a.half && n < a.half + a.A) {
    const int i = n - a.half;
    float sn, cs;
    bb_sincos(ld(a.angles, o4(a.angles, b, t, h, i)), &sn, &cs);
    return biased(a, x, bias, b, t, r, h, i) * sn + biased(a, x, bias, b, t, r, h, n) * cs;
  }
  return biased(a, x, bias, b, t, r, h, n);
}

// dPhiO_t^r[p] = dL/dy_t^r[p] from the dout layout.
BB_DEV float dphio(const Args& a, int b, int t, int r, int h, int p) {
  if (a.layout == 0)
    return ld(a.dout, o4(a.dout, b, t, h, p)) * ld(a.mimo_o, o3(a.mimo_o, h, r, p));
  if (a.layout == 1) return ld(a.dout, o5(a.dout, b, t, r, h, p));
  return ld(a.dout, o4(a.dout, b, h, static_cast<int64_t>(t) * a.R + r, p));
}

// Sum over the block in a fixed tree (deterministic); every thread must call it and gets the
// total. Ends with a barrier, so `red` may be reused right after.
BB_DEV float block_sum(float v, float* red) {
  const int tid = bb_tid();
  red[tid] = v;
  bb_sync();
  for (int s = kThreads / 2; s > 0; s >>= 1) {
    if (tid < s) red[tid] += red[tid + s];
    bb_sync();
  }
  const float total = red[0];
  bb_sync();
  return total;
}

// Error-free accumulation (sum + err is the compensated total), as the CPU backend's.
BB_DEV void comp_add(float& sum, float& err, float x) {
  const float t = sum + x;
  err += fabsf(sum) >= fabsf(x) ? (sum - t) + x : (x - t) + sum;
  sum = t;
}

// ------------------------------------------------------------------ K1: U_c

// smem: kRowTile * (N + P) floats.
BB_DEV void increment_body(const Args& a, float* smem) {
  const int64_t item = bb_bid();  // = bh * nch + c
  const int c = static_cast<int>(item % a.nch);
  if (c == 0) return;  // U_0 would only feed the state entering chunk 0, which nothing reads
  const int tid = bb_tid();
  const int64_t bh = item / a.nch;
  const int b = static_cast<int>(bh / a.H), h = static_cast<int>(bh % a.H);
  const int N = a.N, P = a.P, R = a.R;
  const int s0 = c * a.C, L = bb_min(a.C, a.S - s0), T = L * R;
  float* sq = smem;                 // [kRowTile][N]: E_i qh_i^r
  float* sg = smem + kRowTile * N;  // [kRowTile][P]: dPhiO_i^r
  float* U = a.ws_ds + item * static_cast<int64_t>(N) * P;
  for (int a0 = 0; a0 < T; a0 += kRowTile) {
    const int nr = bb_min(kRowTile, T - a0);
    for (int e = tid; e < nr * N; e += kThreads) {
      const int row = a0 + e / N, n = e % N, i = row / R, r = row % R, t = s0 + i;
      const float E = expf(ld(a.da_cs, o3(a.da_cs, b, h, t)));
      sq[e] = E * rotated(a, a.q, a.q_bias, b, t, r, h, n);
    }
    for (int e = tid; e < nr * P; e += kThreads) {
      const int row = a0 + e / P, p = e % P, i = row / R, r = row % R;
      sg[e] = dphio(a, b, s0 + i, r, h, p);
    }
    bb_sync();
    // Each thread owns its elements of U across all row tiles (no races).
    for (int e = tid; e < N * P; e += kThreads) {
      const int n = e / P, p = e % P;
      float acc = a0 == 0 ? 0.f : U[e];
      for (int rr = 0; rr < nr; ++rr) acc += sq[rr * N + n] * sg[rr * P + p];
      U[e] = acc;
    }
    bb_sync();  // the tiles are restaged next
  }
}

// ------------------------------------------------------------------ K2: reverse scan

BB_DEV void scan_body(const Args& a) {
  const int64_t NP = static_cast<int64_t>(a.N) * a.P;
  const int64_t idx = bb_bid() * kThreads + bb_tid();
  if (idx >= static_cast<int64_t>(a.B) * a.H * NP) return;
  const int64_t bh = idx / NP, e = idx % NP;
  const int b = static_cast<int>(bh / a.H), h = static_cast<int>(bh % a.H);
  float acc = 0.f;  // dS leaving the current chunk
  for (int c = a.nch - 1; c >= 0; --c) {
    float* cell = a.ws_ds + (bh * a.nch + c) * NP + e;
    if (c == 0) {
      *cell = acc;
      break;
    }
    const float u = *cell;
    *cell = acc;
    const int last = bb_min(c * a.C + a.C, a.S) - 1;
    acc = expf(ld(a.da_cs, o3(a.da_cs, b, h, last))) * acc + u;
  }
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
  float* dqh = slot + a.o_dqh;  // [T][N] dL/dqh
  float* dkh = slot + a.o_dkh;  // [T][N] dL/dkh / ts
  float* xs = slot + a.o_x;     // [T][P] x = v * mimo_v
  float* gs = slot + a.o_g;     // [T][P] dPhiO
  float* dp = slot + a.o_dp;    // [T][P] dL/dx
  float* KQ = slot + a.o_kq;    // [T][T] kh_a . qh_b
  float* XG = slot + a.o_xg;    // [T][T] x_a . dPhiO_b
  float* St = slot + a.o_st;    // [N][P] states[c]

  const int64_t total = static_cast<int64_t>(a.B) * a.H * a.nch;
  for (int64_t item = bb_bid(); item < total; item += bb_nblocks()) {
    const int c = static_cast<int>(item % a.nch);
    const int64_t bh = item / a.nch;
    const int b = static_cast<int>(bh / a.H), h = static_cast<int>(bh % a.H);
    const int s0 = c * C, L = bb_min(C, a.S - s0), Lx = bb_min(L + 1, a.S - s0), T = L * R;
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
    for (int e = tid; e < T * N; e += kThreads) {
      const int row = e / N, n = e % N, i = row / R, r = row % R;
      qh[e] = rotated(a, a.q, a.q_bias, b, s0 + i, r, h, n);
      kh[e] = rotated(a, a.k, a.k_bias, b, s0 + i, r, h, n);
    }
    for (int e = tid; e < T * P; e += kThreads) {
      const int row = e / P, p = e % P, i = row / R, r = row % R, t = s0 + i;
      xs[e] = ld(a.v, o4(a.v, b, t, h, p)) * ld(a.mimo_v, o3(a.mimo_v, h, r, p));
      gs[e] = dphio(a, b, t, r, h, p);
    }
    for (int e = tid; e < NP; e += kThreads)
      St[e] = ld(a.states, o5(a.states, b, h, c, e / P, e % P));
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
    for (int e = tid; e < T * T; e += kThreads) {
      const int ra = e / T, rb = e % T;
      const float* k1 = kh + ra * N;
      const float* q1 = qh + rb * N;
      float s = 0.f;
      for (int n = 0; n < N; ++n) s += k1[n] * q1[n];
      KQ[e] = s;
      const float* x1 = xs + ra * P;
      const float* g1 = gs + rb * P;
      s = 0.f;
      for (int p = 0; p < P; ++p) s += x1[p] * g1[p];
      XG[e] = s;
    }
    for (int e = tid; e < T * N; e += kThreads) {
      const int row = e / N, n = e % N;
      const float* srow = St + n * P;
      const float* drow = dS + static_cast<int64_t>(n) * P;
      const float* g1 = gs + row * P;
      const float* x1 = xs + row * P;
      float sg = 0.f, sx = 0.f;
      for (int p = 0; p < P; ++p) {
        sg += srow[p] * g1[p];
        sx += drow[p] * x1[p];
      }
      SG[e] = sg;
      SX[e] = sx;
    }
    float dda_part = 0.f;
    for (int e = tid; e < NP; e += kThreads) dda_part += St[e] * dS[e];
    const float dda = expf(da_last) * block_sum(dda_part, sh.red);  // its barriers end phase 1

    // ---- phase 2: dqh, dkh / ts, dx, DSSDA and the per-step scalars
    for (int e = tid; e < T * N; e += kThreads) {
      // Query row (i, r): inter-chunk readout and the earlier keys j < i.
      const int row = e / N, n = e % N, i = row / R;
      float acc = sh.E[i] * SG[e];
      for (int ra = 0; ra < i * R; ++ra) {
        const int j = ra / R;
        acc += (sh.W[i * C + j] * sh.ts[j] * XG[ra * T + row]) * kh[ra * N + n];
      }
      dqh[e] = acc;
    }
    for (int e = tid; e < T * N; e += kThreads) {
      // Key row (i, r2): the state increment and the later queries j > i (ts_i applied later).
      const int row = e / N, n = e % N, i = row / R;
      float acc = sh.F[i] * SX[e];
      for (int rb = (i + 1) * R; rb < T; ++rb) {
        const int j = rb / R;
        acc += (sh.W[j * C + i] * XG[row * T + rb]) * qh[rb * N + n];
      }
      dkh[e] = acc;
    }
    for (int e = tid; e < T * P; e += kThreads) {
      // Value row (i, r2): state increment, later queries, D skip, diagonal term.
      const int row = e / P, p = e % P, i = row / R, r2 = row % R;
      const float* k1 = kh + row * N;
      float kds = 0.f;
      for (int n = 0; n < N; ++n) kds += k1[n] * dS[static_cast<int64_t>(n) * P + p];
      float acc = sh.F[i] * sh.ts[i] * kds;
      for (int rb = (i + 1) * R; rb < T; ++rb) {
        const int j = rb / R;
        acc += (sh.W[j * C + i] * sh.ts[i] * KQ[row * T + rb]) * gs[rb * P + p];
      }
      acc += Dh * gs[e];
      for (int r = 0; r < R; ++r)
        acc += (sh.gam[i] * sh.qk[(i * R + r) * R + r2]) * gs[(i * R + r) * P + p];
      dp[e] = acc;
    }
    for (int e = tid; e < C * C; e += kThreads) {
      // DSSDA[s, t]: every pair of valid steps, unmasked; rows / columns past the sequence 0.
      const int s = e / C, tq = e % C;
      float acc = 0.f;
      if (s < L && tq < L) {
        for (int r2 = 0; r2 < R; ++r2)
          for (int r = 0; r < R; ++r) {
            const int idx = (s * R + r2) * T + tq * R + r;
            acc += KQ[idx] * XG[idx];
          }
        acc *= sh.ts[s];
      }
      st(a.dssda, o5(a.dssda, b, h, c, s, tq), acc);
    }
    for (int i = tid; i < L; i += kThreads) {
      const int t = s0 + i;
      float dcs = 0.f, drev = 0.f, dgam = 0.f;
      for (int r = 0; r < R; ++r) {
        const int base = (i * R + r) * N;
        for (int n = 0; n < N; ++n) dcs += qh[base + n] * SG[base + n];
        for (int n = 0; n < N; ++n) drev += kh[base + n] * SX[base + n];
      }
      for (int r = 0; r < R; ++r)
        for (int r2 = 0; r2 < R; ++r2)
          dgam += sh.qk[(i * R + r) * R + r2] * XG[(i * R + r2) * T + i * R + r];
      st(a.dda, o3(a.dda, b, h, t), dda);
      st(a.dda_cs, o3(a.dda_cs, b, h, t), dcs);
      st(a.dda_cs_rev, o3(a.dda_cs_rev, b, h, t), sh.ts[i] * drev);
      st(a.dgamma, o3(a.dgamma, b, h, t), dgam);
    }
    bb_sync();

    // ---- phase 3: rotation undone, diagonal q/k terms, angles, v / mimo_v / D
    for (int i = tid; i < L; i += kThreads) {
      float df = 0.f;
      for (int r2 = 0; r2 < R; ++r2) {
        const int base = (i * R + r2) * N;
        for (int n = 0; n < N; ++n) df += kh[base + n] * dkh[base + n];
      }
      st(a.dfactor, o3(a.dfactor, b, h, s0 + i), df);
    }
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
        float sn, cs;
        bb_sincos(ld(a.angles, o4(a.angles, b, t, h, j)), &sn, &cs);
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
        oq += (gam * XG[(i * R + r2) * T + row]) * biased(a, a.k, a.k_bias, b, t, r2, h, n);
      for (int r1 = 0; r1 < R; ++r1)
        ok += (gam * XG[row * T + i * R + r1]) * biased(a, a.q, a.q_bias, b, t, r1, h, n);
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
  int64_t o_qh = 0, o_kh = 0, o_sg = 0, o_sx = 0, o_dqh = 0, o_dkh = 0, o_x = 0, o_g = 0,
          o_dp = 0, o_kq = 0, o_xg = 0, o_st = 0;
  size_t bytes = 0;
  int64_t grid1 = 0, grid2 = 0, grid3 = 0, grid4 = 0;  // K1 is skipped when grid1 == 0
  size_t smem1 = 0;                                    // K1 dynamic shared memory (bytes)
};

inline int64_t up64(int64_t n) { return (n + 63) / 64 * 64; }

// max_slots: K3's CTA count cap (the host emulation test lowers it to reach slot reuse cheaply).
inline Plan make_plan(const MimoBwdBwdParams& p, int64_t max_slots = kMaxSlots) {
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
  pl.o_dqh = take(Tm * p.N);
  pl.o_dkh = take(Tm * p.N);
  pl.o_x = take(Tm * p.P);
  pl.o_g = take(Tm * p.P);
  pl.o_dp = take(Tm * p.P);
  pl.o_kq = take(Tm * Tm);
  pl.o_xg = take(Tm * Tm);
  pl.o_st = take(NP);
  pl.slot_floats = o;
  pl.nslots = std::min<int64_t>(BH * nch, std::max<int64_t>(max_slots, 1));
  // + kAlign: the caller's pointer is rounded up to kAlign bytes.
  pl.bytes = static_cast<size_t>(pl.n_ds + pl.n_part + pl.n_dd + pl.nslots * pl.slot_floats) *
                 sizeof(float) +
             kAlign;
  pl.grid1 = nch > 1 ? BH * nch : 0;
  pl.grid2 = (BH * NP + kThreads - 1) / kThreads;
  pl.grid3 = pl.nslots;
  pl.grid4 = (BH * p.R * p.P + BH + kThreads - 1) / kThreads;
  // At most 16 * (256 + 256) floats = 32 KB: under the default 48 KB (no attribute call).
  pl.smem1 = static_cast<size_t>(kRowTile) * (p.N + p.P) * sizeof(float);
  return pl;
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
  a.layout = p.dout_layout == MimoDout::ReduceO ? 0 : p.dout_layout == MimoDout::PerRank ? 1 : 2;
  a.has_d = p.has_d ? 1 : 0;
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
  a.o_qh = pl.o_qh, a.o_kh = pl.o_kh, a.o_sg = pl.o_sg, a.o_sx = pl.o_sx;
  a.o_dqh = pl.o_dqh, a.o_dkh = pl.o_dkh, a.o_x = pl.o_x, a.o_g = pl.o_g, a.o_dp = pl.o_dp;
  a.o_kq = pl.o_kq, a.o_xg = pl.o_xg, a.o_st = pl.o_st;
  return a;
}

}  // namespace mamba3::cuda::bb
