// Probe for the restructured second-pass K3 (docs/PERF.md, sessions 13-14 and 40): one chunk's
// coefficient products at N128 P64 T64 (R4 C16) in two forms, on data resident in shared memory
// (compute only: no global traffic inside the timed loop), one 16-warp CTA per SM:
//
//   planes  (today's K3): every warp builds one 16 x 16 tile of M1 = coef o (g x^T) and one of
//           M2 = coef o (x g^T) into bf16 hi/lo planes, a barrier, then each warp multiplies
//           16 rows of M1 by 64 columns of kh (dqh; warps 0-7) or of M2 by qh (dkh; 8-15).
//   fused   (warp_fused_coef_mma): the same warp forms its own 16 rows of M in the mma
//           accumulators (4x the first product: each row block's S is formed by the two warps
//           of its column blocks), applies the coefficients there and multiplies on without
//           shared memory or a barrier.
//
// Both forms run the same fragments and mma in the same order for every output tile, so their
// outputs must be bitwise identical (checked). Prints the time per chunk per SM of each and
// their mma counts; the difference is what the builds, their barrier and the fragment reloads
// cost against the recomputed products.
//
//   build/mamba3-k3-probe [iterations]     (CMake target mamba3-k3-probe, CUDA builds)
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "cuda/fused_coef_mma.cuh"

namespace {

using namespace mamba3::cuda::mimo;

constexpr int kT = 64, kN = 128, kP = 64, kC = 16, kR = 4, kWarps = 16, kThreads = 32 * kWarps;
constexpr int kLdP = kP + 8, kLdN = kN + 8, kLdT = kT + 8;  // padded rows, as the K3's planes
constexpr int kNB = 4;                                      // 64 output columns per warp

struct Smem {
  __nv_bfloat16 g[2 * kT * kLdP], x[2 * kT * kLdP];    // [t][p] hi / lo planes
  __nv_bfloat16 kh[2 * kT * kLdN], qh[2 * kT * kLdN];  // [t][n]
  __nv_bfloat16 m1[2 * kT * kLdT], m2[2 * kT * kLdT];  // [t][t'] (planes form only)
  float W[kC * kC], ts[kT];
};

__device__ float hash_val(uint32_t i) {  // a fixed pseudo-random value in (-1, 1)
  i ^= i >> 16, i *= 0x7feb352du, i ^= i >> 15, i *= 0x846ca68bu, i ^= i >> 16;
  return static_cast<float>(i & 0xffffff) / 8388608.f - 1.f;
}

struct Coef {  // step-causal mask, segment decay, per-column scale: M's coefficients
  const float *W, *ts;
  int m0;
  __device__ float operator()(int r, int c) const {
    const int si = (m0 + r) / kR, sj = c / kR;
    return sj < si ? W[si * kC + sj] * ts[c] : 0.f;
  }
};

template <bool kFused>
__global__ void __launch_bounds__(kThreads, 1) probe_kernel(int iters, float* tiles) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  Smem& s = *reinterpret_cast<Smem*>(smem_raw);
  const int tid = threadIdx.x, w = tid >> 5, lane = tid & 31, g = lane >> 2, q = lane & 3;
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
    s.W[e] = __expf(-0.05f * static_cast<float>(e / kC - e % kC));
  for (int e = tid; e < kT; e += kThreads) s.ts[e] = 1.f + 0.01f * static_cast<float>(e);
  __syncthreads();

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
    if constexpr (kFused) {
      const Coef coef{s.W, s.ts, 16 * rb};
      if (half == 0)
        warp_fused_coef_mma<kT, kNB>(out, G, 16 * rb, kP, X, KH, 64 * cb, coef);
      else
        warp_fused_coef_mma<kT, kNB>(out, X, 16 * rb, kP, G, QH, 64 * cb, coef);
    } else {
      // Build: tile (w & 3, w >> 2) of M1 and of M2 (16 x 16 each: rows 16 (w & 3), columns
      // 16 (w >> 2)), coefficients applied, split into the planes.
      const int tr = w & 3, tc = w >> 2;
      const Coef coef{s.W, s.ts, 16 * tr};
#pragma unroll
      for (int which = 0; which < 2; ++which) {
        float acc[2][4];
        zero_acc(acc);
        warp_mma_16x16<false, false, 4>(acc, which ? X : G, 16 * tr, which ? G : X, 16 * tc, 0, kP);
        __nv_bfloat16* m = which ? s.m2 : s.m1;
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int c = 16 * tc + 8 * j + 2 * q;
          st_split2(m, kT * kLdT, (16 * tr + g) * kLdT + c, acc[j][0] * coef(g, c),
                    acc[j][1] * coef(g, c + 1));
          st_split2(m, kT * kLdT, (16 * tr + g + 8) * kLdT + c, acc[j][2] * coef(g + 8, c),
                    acc[j][3] * coef(g + 8, c + 1));
        }
      }
      __syncthreads();
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
    __syncthreads();  // the chunk loop's barrier (the planes are rewritten next chunk)
  }
  if (blockIdx.x == 0) {  // the last iteration's tiles of CTA 0, [half][64 rows][128 columns]
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
  if (check == 12345.f) tiles[0] = check;  // keeps the loop's work observable
}

#define CK(x)                                                                                   \
  do {                                                                                          \
    cudaError_t e_ = (x);                                                                       \
    if (e_ != cudaSuccess) {                                                                    \
      std::fprintf(stderr, "%s: %s (%s:%d)\n", #x, cudaGetErrorString(e_), __FILE__, __LINE__); \
      std::exit(1);                                                                             \
    }                                                                                           \
  } while (0)

template <bool kFused>
double time_ms(int sms, int iters, float* tiles) {
  auto k = probe_kernel<kFused>;
  CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, sizeof(Smem)));
  k<<<sms, kThreads, sizeof(Smem)>>>(2, tiles);  // warm-up
  CK(cudaGetLastError());
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  float best = 1e30f;
  for (int rep = 0; rep < 5; ++rep) {
    CK(cudaEventRecord(a));
    k<<<sms, kThreads, sizeof(Smem)>>>(iters, tiles);
    CK(cudaEventRecord(b));
    CK(cudaEventSynchronize(b));
    float ms = 0.f;
    CK(cudaEventElapsedTime(&ms, a, b));
    if (ms < best) best = ms;
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  const int iters = argc > 1 ? std::atoi(argv[1]) : 2000;
  int dev = 0, sms = 0;
  CK(cudaGetDevice(&dev));
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  cudaDeviceProp prop{};
  CK(cudaGetDeviceProperties(&prop, dev));
  float* tiles = nullptr;
  CK(cudaMalloc(&tiles, 2 * 2 * kT * kN * sizeof(float)));
  const double fused = time_ms<true>(sms, iters, tiles + 2 * kT * kN);
  const double planes = time_ms<false>(sms, iters, tiles);
  std::vector<float> h(2 * 2 * kT * kN);
  CK(cudaMemcpy(h.data(), tiles, h.size() * sizeof(float), cudaMemcpyDeviceToHost));
  const bool same = std::memcmp(h.data(), h.data() + 2 * kT * kN, 2 * kT * kN * sizeof(float)) == 0;
  // mma per chunk (m16n8k16, three per split product): planes 32 build tiles x 4 k steps x 6
  // + 16 warps x 4 column blocks x 4 k steps x 6; fused 16 warps x (4 S blocks x 4 x 6 + 4 x 4 x
  // 6).
  const int mma_planes = 32 * 4 * 6 + 16 * kNB * 4 * 6, mma_fused = 16 * (4 * 4 * 6 + kNB * 4 * 6);
  std::printf("device %s, %d SMs, %d chunks per SM, smem %zu bytes per CTA\n", prop.name, sms,
              iters, sizeof(Smem));
  std::printf(
      "| form | us per chunk per SM | mma per chunk | ns per mma per SM |\n|---|---|---|---|\n");
  std::printf("| planes (builds + barrier) | %.3f | %d | %.3f |\n", planes * 1e3 / iters,
              mma_planes, planes * 1e6 / iters / mma_planes);
  std::printf("| fused (S in registers) | %.3f | %d | %.3f |\n", fused * 1e3 / iters, mma_fused,
              fused * 1e6 / iters / mma_fused);
  std::printf("outputs bitwise identical: %s\n", same ? "yes" : "NO");
  CK(cudaFree(tiles));
  return same ? 0 : 1;
}
