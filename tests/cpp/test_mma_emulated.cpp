// Host emulation of the warp-collective tensor-core instructions the kernels use (ldmatrix .x4,
// with and without .trans, and mma.sync m16n8k16 bf16 -> fp32), so that kernel bodies built on
// them can run on machines without a GPU. The emulator (cta_emulator.hpp / .cpp, shared with the
// kernel-body tests) runs each lane of a warp as a std::thread; a collective instruction is a
// rendezvous of the warp's 32 lanes: every lane deposits its operands (a row address, or its
// fragments), all wait, every lane computes its own result from all the deposits. Fragment
// layouts as in the PTX ISA (g = lane / 4, q = lane % 4):
//   ldmatrix .x4: lanes 8j .. 8j+7 give the row addresses of 8x8 matrix j; lane l receives in
//     register j the elements (l / 4, 2 q) and (l / 4, 2 q + 1) of matrix j (.trans: elements
//     (2 q, l / 4) and (2 q + 1, l / 4)); the lower column / row in the low 16 bits.
//   mma m16n8k16 row.col: a0 = A[g][2q..], a1 = A[g+8][2q..], a2 = A[g][2q+8..],
//     a3 = A[g+8][2q+8..]; b0 = B[2q..][g], b1 = B[2q+8..][g]; d = D[g][2q], D[g][2q+1],
//     D[g+8][2q], D[g+8][2q+1].
// The check that the emulation means what the hardware does: the first pass's warp_mma_16x16
// (run on the H200 by every MimoBwdFwdCuda test) must compute the product of its split operands
// in all four operand orientations. This lets later kernel bodies on the same primitives be
// tested on the host (the mma accumulates in double here, so compare with a tolerance).
//
// Only in CUDA builds: the bodies use the CUDA headers' bf16 types and conversions.
#ifdef MAMBA3_GOLDEN_CUDA

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "../../bench/k3_fused_probe.cuh"
#include "cta_emulator.hpp"
#include "cuda/fused_coef_mma.cuh"
#include "cuda/mimo_bwd_fwd_lean.cuh"

namespace mamba3::cuda::mimo {
namespace {

float bf(uint32_t word, int half) {
  const uint32_t u = half ? (word & 0xffff0000u) : (word << 16);
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Runs body(lane) on the 32 lanes of one emulated warp (a CTA of one warp).
template <class F>
void run_warp(F body) {
  test::emu::launch(1, 32, [&] { body(mb_tid()); });
}

// A 16 x 16 output tile C = A B (K = 48) through warp_mma_16x16 with A stored [m][k] or [k][m]
// and B stored [n][k] or [k][n] as split planes, against the float64 product of the unsplit
// values. The split keeps ~16 bits of each operand, so the error is ~1e-5 of the terms' scale.
template <bool A_KM, bool B_KN>
void check_orientation(uint64_t seed) {
  constexpr int M = 16, Nn = 16, K = 48, ld = K + 8;  // padded rows, as the kernels' tiles
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  std::vector<float> a(M * K), b(K * Nn);
  for (float& x : a) x = u(rng);
  for (float& x : b) x = u(rng);
  const int plane = 64 * ld;
  std::vector<__nv_bfloat16> sa(2 * plane), sb(2 * plane);
  // Element (r, c) of a stored [rows][ld] tile; pairs of columns split together.
  for (int m = 0; m < M; ++m)
    for (int k = 0; k < K; k += 2) {
      if (A_KM) {  // [k][m]: the pair runs along m
        if (m % 2 == 0)
          for (int kk = k; kk < k + 2; ++kk)
            st_split2(sa.data(), plane, kk * ld + m, a[m * K + kk], a[(m + 1) * K + kk]);
      } else {
        st_split2(sa.data(), plane, m * ld + k, a[m * K + k], a[m * K + k + 1]);
      }
    }
  for (int n = 0; n < Nn; ++n)
    for (int k = 0; k < K; k += 2) {
      if (B_KN) {  // [k][n]
        if (n % 2 == 0)
          for (int kk = k; kk < k + 2; ++kk)
            st_split2(sb.data(), plane, kk * ld + n, b[kk * Nn + n], b[kk * Nn + n + 1]);
      } else {  // [n][k]
        st_split2(sb.data(), plane, n * ld + k, b[k * Nn + n], b[(k + 1) * Nn + n]);
      }
    }
  const SplitTile TA{sa.data(), plane, ld}, TB{sb.data(), plane, ld};
  std::vector<float> c(M * Nn, std::nanf(""));
  run_warp([&](int l) {
    float acc[2][4];
    zero_acc(acc);
    warp_mma_16x16<A_KM, B_KN>(acc, TA, 0, TB, 0, 0, K);
    const int g = l / 4, q = l % 4;
    for (int j = 0; j < 2; ++j)
      for (int e = 0; e < 4; ++e) c[(g + (e >= 2 ? 8 : 0)) * Nn + 8 * j + 2 * q + e % 2] = acc[j][e];
  });
  for (int m = 0; m < M; ++m)
    for (int n = 0; n < Nn; ++n) {
      double ref = 0;
      for (int k = 0; k < K; ++k) ref += static_cast<double>(a[m * K + k]) * b[k * Nn + n];
      EXPECT_NEAR(c[m * Nn + n], ref, 2e-4) << "A_KM=" << A_KM << " B_KN=" << B_KN << " (" << m
                                            << ", " << n << ")";
    }
}

TEST(MmaEmulated, WarpMma16x16ComputesTheProductInEveryOrientation) {
  check_orientation<false, false>(1);
  check_orientation<false, true>(2);
  check_orientation<true, false>(3);
  check_orientation<true, true>(4);
}

// warp_fused_coef_mma: (coef o (A1 B1^T)) B2 for one 16-row block with S kept in the
// accumulators, against the float64 product of the unsplit values. The coefficients are a
// step-causal mask (four rows per step, as R = 4) times a weight that depends on both indices,
// so a fragment placed at the wrong row or column, or a lo term dropped (a single bf16 product,
// ~4e-3 of the terms' scale), fails the 1e-4 bound.
TEST(MmaEmulated, FusedCoefProductMatchesTheDoubleProduct) {
  constexpr int M0 = 32, K1 = 32, T = 64, NB = 2, NC = 16 * NB, ld = 72;
  std::mt19937_64 rng(11);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  std::vector<float> a((M0 + 16) * K1), b1(T * K1), b2(T * NC);
  for (float& x : a) x = u(rng);
  for (float& x : b1) x = u(rng);
  for (float& x : b2) x = u(rng);
  const int plane = T * ld;
  std::vector<__nv_bfloat16> sa(2 * plane), sb1(2 * plane), sb2(2 * plane);
  for (int m = 0; m < M0 + 16; ++m)
    for (int k = 0; k < K1; k += 2)
      st_split2(sa.data(), plane, m * ld + k, a[m * K1 + k], a[m * K1 + k + 1]);
  for (int t = 0; t < T; ++t)
    for (int k = 0; k < K1; k += 2)
      st_split2(sb1.data(), plane, t * ld + k, b1[t * K1 + k], b1[t * K1 + k + 1]);
  for (int t = 0; t < T; ++t)
    for (int n = 0; n < NC; n += 2)
      st_split2(sb2.data(), plane, t * ld + n, b2[t * NC + n], b2[t * NC + n + 1]);
  auto coef = [](int r, int c) -> float {
    const int si = (M0 + r) / 4, sj = c / 4;
    return sj < si ? std::exp(-0.05f * static_cast<float>(si - sj)) * (1.f + 0.25f * (c % 4))
                   : 0.f;
  };
  const SplitTile TA{sa.data(), plane, ld}, TB1{sb1.data(), plane, ld}, TB2{sb2.data(), plane, ld};
  std::vector<float> c(16 * NC, std::nanf(""));
  run_warp([&](int l) {
    float out[NB][2][4];
    for (int nb = 0; nb < NB; ++nb) zero_acc(out[nb]);
    warp_fused_coef_mma<T, NB>(out, TA, M0, K1, TB1, TB2, 0, coef);
    const int g = l / 4, q = l % 4;
    for (int nb = 0; nb < NB; ++nb)
      for (int j = 0; j < 2; ++j)
        for (int e = 0; e < 4; ++e)
          c[(g + (e >= 2 ? 8 : 0)) * NC + 16 * nb + 8 * j + 2 * q + e % 2] = out[nb][j][e];
  });
  int masked_rows = 0;
  for (int r = 0; r < 16; ++r) {
    double sp[T];
    for (int t = 0; t < T; ++t) {
      double sv = 0;
      for (int k = 0; k < K1; ++k) sv += static_cast<double>(a[(M0 + r) * K1 + k]) * b1[t * K1 + k];
      sp[t] = sv * coef(r, t);
    }
    masked_rows += sp[T - 1] == 0.0;
    for (int n = 0; n < NC; ++n) {
      double ref = 0, mag = 0;
      for (int t = 0; t < T; ++t) {
        ref += sp[t] * b2[t * NC + n];
        mag += std::fabs(sp[t] * b2[t * NC + n]);
      }
      EXPECT_NEAR(c[r * NC + n], ref, 1e-4 * mag + 1e-30) << "(" << r << ", " << n << ")";
    }
  }
  EXPECT_EQ(masked_rows, 16);  // the mask is in play: the last steps' columns are zero
}

// bench/k3_fused_probe.cu's three forms of one chunk's M1 kh / M2 qh products (today's planes
// form, with and without the fp32 tiles, and the fused form) on the emulated 16-warp CTA: the
// same bits, every element written, and the float64 products of the probe's data (so that a
// wrong tile index in all forms alike fails too).
TEST(MmaEmulated, K3ProbeFormsGiveIdenticalBits) {
  namespace kp = mamba3::bench::k3probe;
  constexpr int T = kp::kT, N = kp::kN, P = kp::kP;
  auto smem = std::make_unique<kp::Smem>();
  std::vector<float> tp(2 * T * N, std::nanf("")), t32(tp), tf(tp);
  test::emu::launch(1, kp::kThreads,
                    [&] { kp::run_chunks<kp::kPlanes>(*smem, 1, tp.data(), true); });
  test::emu::launch(1, kp::kThreads,
                    [&] { kp::run_chunks<kp::kPlanesFp32>(*smem, 1, t32.data(), true); });
  test::emu::launch(1, kp::kThreads,
                    [&] { kp::run_chunks<kp::kFused>(*smem, 1, tf.data(), true); });
  EXPECT_EQ(std::memcmp(t32.data(), tp.data(), tp.size() * sizeof(float)), 0);
  EXPECT_EQ(std::memcmp(tf.data(), tp.data(), tp.size() * sizeof(float)), 0);
  // The probe's inputs, as its kernel writes them (pairs of elements e, e + 1 from one hash).
  auto pairs = [](int n, int mul, int add) {
    std::vector<double> v(n);
    for (int e = 0; e < n; e += 2) {
      v[e] = kp::hash_val(static_cast<uint32_t>(mul * e + add));
      v[e + 1] = kp::hash_val(static_cast<uint32_t>(mul * e + add + 1));
    }
    return v;
  };
  const std::vector<double> g = pairs(T * P, 3, 0), x = pairs(T * P, 5, 7), kh = pairs(T * N, 7, 1),
                            qh = pairs(T * N, 11, 3);
  auto coef = [](int i, int j) {
    const int si = i / kp::kR, sj = j / kp::kR;
    return sj < si ? std::exp(-0.05 * (si - sj)) * (1.0 + 0.01 * j) : 0.0;
  };
  for (int half = 0; half < 2; ++half) {
    const std::vector<double>&a = half ? x : g, &b = half ? g : x, &c = half ? qh : kh;
    for (int i = 0; i < T; ++i) {
      double m[T];
      for (int j = 0; j < T; ++j) {
        double sv = 0;
        for (int p = 0; p < P; ++p) sv += a[i * P + p] * b[j * P + p];
        m[j] = coef(i, j) * sv;
      }
      for (int n = 0; n < N; ++n) {
        double ref = 0, mag = 0;
        for (int j = 0; j < T; ++j) {
          ref += m[j] * c[j * N + n];
          mag += std::fabs(m[j] * c[j * N + n]);
        }
        const float got = tp[(half * T + i) * N + n];
        ASSERT_FALSE(std::isnan(got)) << half << " (" << i << ", " << n << ")";
        EXPECT_NEAR(got, ref, 1e-4 * mag + 1e-30) << half << " (" << i << ", " << n << ")";
      }
    }
  }
}

// The split itself: hi + lo keeps ~16 bits, far more than a single bf16 (so a test that drops
// the lo terms, or swaps the planes, fails the tolerance above).
TEST(MmaEmulated, SplitPairKeepsSixteenBits) {
  std::mt19937_64 rng(7);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  for (int i = 0; i < 1000; ++i) {
    const float x0 = u(rng), x1 = u(rng);
    uint32_t hi, lo;
    split2(x0, x1, hi, lo);
    EXPECT_NEAR(bf(hi, 0) + bf(lo, 0), x0, std::fabs(x0) * 1.6e-5f + 1e-30f);
    EXPECT_NEAR(bf(hi, 1) + bf(lo, 1), x1, std::fabs(x1) * 1.6e-5f + 1e-30f);
  }
}

}  // namespace
}  // namespace mamba3::cuda::mimo

#endif  // MAMBA3_GOLDEN_CUDA
