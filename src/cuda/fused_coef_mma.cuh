// A product whose left operand is itself a product, with coefficients applied in registers on
// the way (FlashAttention's P V step, here on bf16 hi/lo splits):
//
//   out (16 rows m0.., 16 NB columns n0..) += (coef ∘ (A1 B1^T)) B2
//
// with S = A1[m0 .. m0 + 16) B1[0 .. T)^T a 16 x T block kept in the mma accumulators, each
// element multiplied by coef(row, column) (zero masks it), then split into bf16 hi/lo A
// fragments of the second product without going through shared memory.
//
// Why: the second pass's planes K3 builds its T x T coefficient matrices (M1-M3: a mask, the
// segment decays and a product such as XG) into shared memory, one barrier per build, and reads
// them back with ldmatrix (docs/PERF.md, sessions 13-14 and 40: the builds and their barriers are
// ~16% of K3's stall samples at N128 P64 R4 C16). This is the building block of the restructured
// K3 those entries plan: the warp that needs a row block of M forms it itself. It costs the
// first product again for every warp that shares the row block; bench/k3_fused_probe.cu times it.
//
// Layouts (SplitTile planes, as warp_mma_16x16): A1 stored [m][k1] (k1 contiguous), B1 stored
// [t][k1] (the columns t of S), B2 stored [t][n] (n contiguous). T a multiple of 16, k1 of 16.
// The accumulator layout of m16n8 (rows g, g + 8 and columns 2q, 2q + 1 of each 8-column tile,
// g = lane / 4, q = lane % 4) is the A-operand layout of m16n8k16 over two such tiles, so lane l
// re-splits only its own values (no shuffles).
#pragma once

#include "cuda/bf16_split_mma.cuh"

namespace mamba3::cuda::mimo {

// coef(r, c): the factor of S's element (row m0 + r, column c), r < 16, c < T; the same value
// for every call with the same arguments (each lane asks for its own elements only).
template <int T, int NB, int UNROLL = 4, class Coef>
MB_DEV void warp_fused_coef_mma(float (&out)[NB][2][4], const SplitTile& A1, int m0, int k1,
                                const SplitTile& B1, const SplitTile& B2, int n0,
                                const Coef& coef) {
  static_assert(T % 16 == 0 && T >= 16, "T: a multiple of 16");
  const int lane = mb_tid() & 31, lr = lane & 7, lm = lane >> 3, g = lane >> 2, q = lane & 3;
  // S: T / 16 blocks of two 8-column C fragments.
  float s[T / 16][2][4];
#pragma unroll
  for (int jt = 0; jt < T / 16; ++jt) {
    zero_acc(s[jt]);
    warp_mma_16x16<false, false, UNROLL>(s[jt], A1, m0, B1, 16 * jt, 0, k1);
  }
  // The coefficients, then each 16-column block of S' as the A fragments of one k step.
#pragma unroll
  for (int kk = 0; kk < T / 16; ++kk) {
    uint32_t ah[4], al[4];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int c = 16 * kk + 8 * j + 2 * q;
      const float x0 = s[kk][j][0] * coef(g, c), x1 = s[kk][j][1] * coef(g, c + 1);
      const float x2 = s[kk][j][2] * coef(g + 8, c), x3 = s[kk][j][3] * coef(g + 8, c + 1);
      split2(x0, x1, ah[2 * j], al[2 * j]);          // a0 / a2: row g
      split2(x2, x3, ah[2 * j + 1], al[2 * j + 1]);  // a1 / a3: row g + 8
    }
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
      uint32_t bh[4], bl[4];
      ldsm_split<true>(bh, bl, B2, frag_off_b<true>(B2.ld, n0 + 16 * nb, 16 * kk, lr, lm));
      mma_split3(out[nb], ah, al, bh, bl);
    }
  }
}

}  // namespace mamba3::cuda::mimo
