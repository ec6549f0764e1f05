// The chunk body of bench/k3_fused_probe.cu (see there), on the primitives of
// src/cuda/bf16_split_mma.cuh so that the host emulator runs it too
// (MmaEmulated.K3ProbeFormsGiveIdenticalBits).
#pragma once

#include <cmath>
#include <cstdint>

#include "cuda/fused_coef_mma.cuh"

namespace mamba3::bench::k3probe {

using namespace mamba3::cuda::mimo;

constexpr int kT = 64, kN = 128, kP = 64, kC = 16, kR = 4, kWarps = 16, kThreads = 32 * kWarps;
constexpr int kLdP = kP + 8, kLdN = kN + 8, kLdT = kT + 8;  // padded rows, as the K3's planes
constexpr int kNB = 4;                                      // 64 output columns per warp
constexpr int kLdS = kT + 4;                                // fp32 S tiles' rows (K3-like form)

// The forms of one chunk's M1 kh / M2 qh products (bench/k3_fused_probe.cu).
enum Form : int {
  kPlanes = 0,      // M tiles built straight from the first product's accumulators
  kPlanesFp32 = 1,  // as the K3: S = XG / KQ stored as fp32 tiles, a barrier, M built from them
  kFused = 2,       // warp_fused_coef_mma: no build, no barrier
};

struct Smem {
  __nv_bfloat16 g[2 * kT * kLdP], x[2 * kT * kLdP];    // [t][p] hi / lo planes
  __nv_bfloat16 kh[2 * kT * kLdN], qh[2 * kT * kLdN];  // [t][n]
  __nv_bfloat16 m1[2 * kT * kLdT], m2[2 * kT * kLdT];  // [t][t'] (planes forms)
  float s1[kT * kLdS], s2[kT * kLdS];                  // [t][t'] fp32 (kPlanesFp32)
  float W[kC * kC], ts[kT];
};

MB_DEV float hash_val(uint32_t i) {  // a fixed pseudo-random value in (-1, 1)
  i ^= i >> 16, i *= 0x7feb352du, i ^= i >> 15, i *= 0x846ca68bu, i ^= i >> 16;
  return static_cast<float>(i & 0xffffff) / 8388608.f - 1.f;
}

struct Coef {  // step-causal mask, segment decay, per-column scale: M's coefficients
  const float *W, *ts;
  int m0;
  MB_DEV float operator()(int r, int c) const {
    const int si = (m0 + r) / kR, sj = c / kR;
    return sj < si ? W[si * kC + sj] * ts[c] : 0.f;
  }
};

// `iters` chunks on the data this CTA's threads first write into s; returns the thread's sum of
// its outputs (kept observable by the caller). write_tiles: the last chunk's output tiles to
// tiles ([dqh | dkh][64 rows][128 columns] floats).
template <int kForm>
MB_DEV float run_chunks(Smem& s, int iters, float* tiles, bool write_tiles) {
  const int tid = mb_tid(), w = tid >> 5, lane = tid & 31, g = lane >> 2, q = lane & 3;
  for (int e = 2 * tid; e < kT * kP; e += 2 * kThreads) {
    const int t = e / kP, p = e % kP;
    st_split2(s.g, kT * kLdP, t * kLdP + p, hash_val(3 * e), hash_val(3 * e + 1));
    st_split2(s.x, kT * kLdP, t * kLdP + p, hash_val(5 * e + 7), hash_val(5 * e + 8));
  }
  for (int e = 2 * tid; e < kT * kN; e += 2 * kThreads) {
    const int t = e / kN, n = e % kN;
    st_split2(s.kh, kT * kLdN, t * kLdN + n, hash_val(7 * e + 1), hash_val(7 * e + 2));
    st_split2(s.qh, kT * kLdN, t * kLdN + n, hash_val(11 * e + 3), hash_val(11 * e + 4));
  }
  for (int e = tid; e < kC * kC; e += kThreads)
    s.W[e] = std::exp(-0.05f * static_cast<float>(e / kC - e % kC));
  for (int e = tid; e < kT; e += kThreads) s.ts[e] = 1.f + 0.01f * static_cast<float>(e);
  mb_sync();

  const SplitTile G{s.g, kT * kLdP, kLdP}, X{s.x, kT * kLdP, kLdP};
  const SplitTile KH{s.kh, kT * kLdN, kLdN}, QH{s.qh, kT * kLdN, kLdN};
  const SplitTile M1{s.m1, kT * kLdT, kLdT}, M2{s.m2, kT * kLdT, kLdT};
  // Output tile of this warp: dqh (warps 0-7) or dkh (8-15), rows 16 rb, columns 64 cb.
  const int half = w >> 3, rb = w & 3, cb = (w >> 2) & 1;
  float out[kNB][2][4];
  float check = 0.f;
  for (int it = 0; it < iters; ++it) {
#pragma unroll
    for (int nb = 0; nb < kNB; ++nb) zero_acc(out[nb]);
    if constexpr (kForm == kFused) {
      const Coef coef{s.W, s.ts, 16 * rb};
      if (half == 0)
        warp_fused_coef_mma<kT, kNB>(out, G, 16 * rb, kP, X, KH, 64 * cb, coef);
      else
        warp_fused_coef_mma<kT, kNB>(out, X, 16 * rb, kP, G, QH, 64 * cb, coef);
    } else {
      // Build: tile (w & 3, w >> 2) of M1 and of M2 (16 x 16 each: rows 16 (w & 3), columns
      // 16 (w >> 2)), coefficients applied, split into the planes; kPlanesFp32 stores S as fp32
      // first and builds M from those tiles after a barrier, each thread 8 pairs.
      const int tr = w & 3, tc = w >> 2;
      const Coef coef{s.W, s.ts, 16 * tr};
#pragma unroll
      for (int which = 0; which < 2; ++which) {
        float acc[2][4];
        zero_acc(acc);
        warp_mma_16x16<false, false, 4>(acc, which ? X : G, 16 * tr, which ? G : X, 16 * tc, 0, kP);
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int c = 16 * tc + 8 * j + 2 * q;
          if constexpr (kForm == kPlanesFp32) {
            float* st = which ? s.s2 : s.s1;
            st[(16 * tr + g) * kLdS + c] = acc[j][0], st[(16 * tr + g) * kLdS + c + 1] = acc[j][1];
            st[(16 * tr + g + 8) * kLdS + c] = acc[j][2];
            st[(16 * tr + g + 8) * kLdS + c + 1] = acc[j][3];
          } else {
            __nv_bfloat16* m = which ? s.m2 : s.m1;
            st_split2(m, kT * kLdT, (16 * tr + g) * kLdT + c, acc[j][0] * coef(g, c),
                      acc[j][1] * coef(g, c + 1));
            st_split2(m, kT * kLdT, (16 * tr + g + 8) * kLdT + c, acc[j][2] * coef(g + 8, c),
                      acc[j][3] * coef(g + 8, c + 1));
          }
        }
      }
      mb_sync();
      if constexpr (kForm == kPlanesFp32) {
        const Coef all{s.W, s.ts, 0};
        for (int e = 2 * tid; e < 2 * kT * kT; e += 2 * kThreads) {
          const int which = e >= kT * kT, i = (e % (kT * kT)) / kT, j = e % kT;
          const float* st = (which ? s.s2 : s.s1) + i * kLdS + j;
          st_split2(which ? s.m2 : s.m1, kT * kLdT, i * kLdT + j, st[0] * all(i, j),
                    st[1] * all(i, j + 1));
        }
        mb_sync();
      }
      // (Copies, not references to one of two tiles: that would put both on the stack.)
      const SplitTile MA = half ? M2 : M1, MB = half ? QH : KH;
#pragma unroll
      for (int nb = 0; nb < kNB; ++nb)
        warp_mma_16x16<false, true, 4>(out[nb], MA, 16 * rb, MB, 64 * cb + 16 * nb, 0, kT);
    }
#pragma unroll
    for (int nb = 0; nb < kNB; ++nb)
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) check += out[nb][j][e];
    mb_sync();  // the chunk loop's barrier (the planes are rewritten next chunk)
  }
  if (write_tiles) {  // the last iteration's tiles of CTA 0, [half][64 rows][128 columns]
#pragma unroll
    for (int nb = 0; nb < kNB; ++nb)
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = 16 * rb + g + (e >= 2 ? 8 : 0),
                    c = 64 * cb + 16 * nb + 8 * j + 2 * q + (e & 1);
          tiles[(half * kT + r) * kN + c] = out[nb][j][e];
        }
  }
  return check;
}

}  // namespace mamba3::bench::k3probe
