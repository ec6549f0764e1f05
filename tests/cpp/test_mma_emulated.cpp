// Host emulation of the warp-collective tensor-core instructions the kernels use (ldmatrix .x4,
// with and without .trans, and mma.sync m16n8k16 bf16 -> fp32), so that kernel bodies built on
// them can run on machines without a GPU. Each lane of the emulated warp is a std::thread; a
// collective instruction is a rendezvous of the 32 lanes: every lane deposits its operands
// (a row address, or its fragments), all wait, every lane computes its own result from all the
// deposits, all wait again. Fragment layouts as in the PTX ISA (g = lane / 4, q = lane % 4):
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
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include "cuda/mimo_bwd_fwd_lean.cuh"

namespace mamba3::cuda::mimo {
namespace {

class Barrier {
 public:
  explicit Barrier(int n) : n_(n) {}
  void wait() {
    std::unique_lock<std::mutex> lock(m_);
    const int64_t gen = gen_;
    if (++count_ == n_) {
      count_ = 0;
      ++gen_;
      cv_.notify_all();
    } else {
      cv_.wait(lock, [&] { return gen_ != gen; });
    }
  }

 private:
  std::mutex m_;
  std::condition_variable cv_;
  int n_, count_ = 0;
  int64_t gen_ = 0;
};

// One emulated warp (the CTA of these tests): the lanes' deposits and the rendezvous barrier.
struct Warp {
  Barrier bar{32};
  const __nv_bfloat16* ptr[32];
  uint32_t a[32][4], b[32][2];
};

thread_local int t_lane = 0;
Warp* g_warp = nullptr;

uint16_t bits(const __nv_bfloat16* p) {
  uint16_t u;
  std::memcpy(&u, p, 2);
  return u;
}
float bf(uint32_t word, int half) {
  const uint32_t u = half ? (word & 0xffff0000u) : (word << 16);
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

void ldsm(uint32_t (&r)[4], const __nv_bfloat16* p, bool trans) {
  Warp& w = *g_warp;
  const int l = t_lane, g = l / 4, q = l % 4;
  w.ptr[l] = p;
  w.bar.wait();
  for (int j = 0; j < 4; ++j) {
    uint16_t lo, hi;
    if (!trans) {
      lo = bits(w.ptr[8 * j + g] + 2 * q);
      hi = bits(w.ptr[8 * j + g] + 2 * q + 1);
    } else {
      lo = bits(w.ptr[8 * j + 2 * q] + g);
      hi = bits(w.ptr[8 * j + 2 * q + 1] + g);
    }
    r[j] = static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
  }
  w.bar.wait();
}

}  // namespace

int mb_tid() { return t_lane; }
int64_t mb_bid() { return 0; }
void mb_sync() { g_warp->bar.wait(); }

void ldsm4(uint32_t (&r)[4], const __nv_bfloat16* p) { ldsm(r, p, false); }
void ldsm4t(uint32_t (&r)[4], const __nv_bfloat16* p) { ldsm(r, p, true); }

void mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  Warp& w = *g_warp;
  const int l = t_lane, g = l / 4, q = l % 4;
  for (int i = 0; i < 4; ++i) w.a[l][i] = a[i];
  w.b[l][0] = b0, w.b[l][1] = b1;
  w.bar.wait();
  // A[m][k] and B[k][n] of the tile from the lanes' fragments.
  auto A = [&](int m, int k) {
    const int lane = (m % 8) * 4 + (k % 8) / 2;
    const int reg = (m >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0);
    return bf(w.a[lane][reg], k % 2);
  };
  auto B = [&](int k, int n) {
    const int lane = n * 4 + (k % 8) / 2;
    return bf(w.b[lane][k >= 8 ? 1 : 0], k % 2);
  };
  for (int e = 0; e < 4; ++e) {
    const int m = g + (e >= 2 ? 8 : 0), n = 2 * q + (e % 2);
    double s = d[e];
    for (int k = 0; k < 16; ++k) s += static_cast<double>(A(m, k)) * B(k, n);
    d[e] = static_cast<float>(s);
  }
  w.bar.wait();
}

namespace {

// Runs body(lane) on the 32 lanes of one emulated warp.
template <class F>
void run_warp(F body) {
  Warp w;
  g_warp = &w;
  std::vector<std::thread> lanes;
  for (int l = 0; l < 32; ++l)
    lanes.emplace_back([&, l] {
      t_lane = l;
      body(l);
    });
  for (auto& t : lanes) t.join();
  g_warp = nullptr;
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
