// The emulated device primitives of cta_emulator.hpp, defined once for the test program.
//
// Warp-collective tensor-core instructions (fragment layouts as in the PTX ISA; g = lane / 4,
// q = lane % 4):
//   ldmatrix .x4: lanes 8j .. 8j+7 give the row addresses of 8x8 matrix j; lane l receives in
//     register j the elements (l / 4, 2 q) and (l / 4, 2 q + 1) of matrix j (.trans: elements
//     (2 q, l / 4) and (2 q + 1, l / 4)); the lower column / row in the low 16 bits.
//   mma m16n8k16 row.col: a0 = A[g][2q..], a1 = A[g+8][2q..], a2 = A[g][2q+8..],
//     a3 = A[g+8][2q+8..]; b0 = B[2q..][g], b1 = B[2q+8..][g]; d = D[g][2q], D[g][2q+1],
//     D[g+8][2q], D[g+8][2q+1]. The products are summed in double here (the hardware keeps at
//     least fp32): compare with a tolerance.
// Also the one device math intrinsic the lean bodies call that the host lacks: __expf (the
// hardware's ex2.approx(x log2 e); glibc declares the name but exports no definition).
//
// Only in CUDA builds: uses the CUDA headers' bf16 type.
#ifdef MAMBA3_GOLDEN_CUDA

#include "cta_emulator.hpp"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "cuda/bf16_split_mma.cuh"

namespace mamba3::test::emu {

Cta* g_cta = nullptr;
thread_local int t_tid = 0;
thread_local int64_t t_bid = 0;

}  // namespace mamba3::test::emu

namespace mamba3::cuda::mimo {
namespace {

using test::emu::g_cta;
using test::emu::t_tid;
using test::emu::Warp;

// The calling lane's warp and the deposit slot of its next collective instruction.
Warp& my_warp(int& slot) {
  if (g_cta == nullptr || g_cta->nthreads % 32 != 0) {
    std::fprintf(stderr, "cta_emulator: warp collective outside a launch of whole warps\n");
    std::abort();
  }
  Warp& w = g_cta->warps[t_tid / 32];
  slot = w.seq[t_tid % 32]++ & 1;
  return w;
}

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
  int s;
  Warp& w = my_warp(s);
  const int l = t_tid % 32, g = l / 4, q = l % 4;
  w.ptr[s][l] = p;
  w.bar.wait();
  auto row = [&](int lane) { return static_cast<const __nv_bfloat16*>(w.ptr[s][lane]); };
  for (int j = 0; j < 4; ++j) {
    uint16_t lo, hi;
    if (!trans) {
      lo = bits(row(8 * j + g) + 2 * q);
      hi = bits(row(8 * j + g) + 2 * q + 1);
    } else {
      lo = bits(row(8 * j + 2 * q) + g);
      hi = bits(row(8 * j + 2 * q + 1) + g);
    }
    r[j] = static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
  }
}

}  // namespace

int mb_tid() { return test::emu::t_tid; }
int64_t mb_bid() { return test::emu::t_bid; }
void mb_sync() { g_cta->bar.wait(); }

float mb_shfl_xor(float v, int mask) {
  int s;
  Warp& w = my_warp(s);
  const int l = t_tid % 32;
  std::memcpy(&w.a[s][l][0], &v, 4);
  w.bar.wait();
  float r;
  std::memcpy(&r, &w.a[s][l ^ (mask & 31)][0], 4);
  return r;
}

void ldsm4(uint32_t (&r)[4], const __nv_bfloat16* p) { ldsm(r, p, false); }
void ldsm4t(uint32_t (&r)[4], const __nv_bfloat16* p) { ldsm(r, p, true); }

void mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  int s;
  Warp& w = my_warp(s);
  const int l = t_tid % 32, g = l / 4, q = l % 4;
  for (int i = 0; i < 4; ++i) w.a[s][l][i] = a[i];
  w.b[s][l][0] = b0, w.b[s][l][1] = b1;
  w.bar.wait();
  // A[m][k] and B[k][n] of the tile from the lanes' fragments.
  auto A = [&](int m, int k) {
    const int lane = (m % 8) * 4 + (k % 8) / 2;
    const int reg = (m >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0);
    return bf(w.a[s][lane][reg], k % 2);
  };
  auto B = [&](int k, int n) {
    const int lane = n * 4 + (k % 8) / 2;
    return bf(w.b[s][lane][k >= 8 ? 1 : 0], k % 2);
  };
  for (int e = 0; e < 4; ++e) {
    const int m = g + (e >= 2 ? 8 : 0), n = 2 * q + (e % 2);
    double acc = d[e];
    for (int k = 0; k < 16; ++k) acc += static_cast<double>(A(m, k)) * B(k, n);
    d[e] = static_cast<float>(acc);
  }
}

}  // namespace mamba3::cuda::mimo

// The device's fast exponential (used by the lean epilogue's gate): 2^(x log2 e).
extern "C" float __expf(float x) noexcept { return exp2f(x * 1.44269504088896341f); }

namespace mamba3::test::emu {

Warp& collective_warp(int& slot) { return cuda::mimo::my_warp(slot); }

}  // namespace mamba3::test::emu

#endif  // MAMBA3_GOLDEN_CUDA
