// Probe for the restructured second-pass K3 (docs/PERF.md, sessions 13-14 and 40): one chunk's
// coefficient products at N128 P64 T64 (R4 C16) in three forms, on data resident in shared memory
// (compute only: no global traffic inside the timed loop), one 16-warp CTA per SM:
//
//   planes  (today's K3): every warp builds one 16 x 16 tile of M1 = coef o (g x^T) and one of
//           M2 = coef o (x g^T) into bf16 hi/lo planes, a barrier, then each warp multiplies
//           16 rows of M1 by 64 columns of kh (dqh; warps 0-7) or of M2 by qh (dkh; 8-15);
//           in a second variant the first products go to fp32 tiles, a barrier, and M is built
//           from them, as the K3 builds M1-M3 from its KQ / XG tiles.
//   fused   (warp_fused_coef_mma): the same warp forms its own 16 rows of M in the mma
//           accumulators (4x the first product: each row block's S is formed by the two warps
//           of its column blocks), applies the coefficients there and multiplies on without
//           shared memory or a barrier.
//
// All three forms run the same fragments and mma in the same order for every output tile, so their
// outputs must be bitwise identical (checked here on the device, and on the host emulator with
// the float64 product by MmaEmulated.K3ProbeFormsGiveIdenticalBits: the chunk body is in
// k3_fused_probe.cuh). Prints the time per chunk per SM of each and their mma counts; the
// difference is what the builds, their barrier and the fragment reloads cost against the
// recomputed products; the two planes forms, what the fp32 round trip costs.
//
//   build/mamba3-k3-probe [iterations]     (CMake target mamba3-k3-probe, CUDA builds)
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "k3_fused_probe.cuh"

namespace {

using namespace mamba3::bench::k3probe;

template <int kForm>
__global__ void __launch_bounds__(kThreads, 1) probe_kernel(int iters, float* tiles) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  Smem& s = *reinterpret_cast<Smem*>(smem_raw);
  const float check = run_chunks<kForm>(s, iters, tiles, blockIdx.x == 0);
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

template <int kForm>
double time_ms(int sms, int iters, float* tiles) {
  auto k = probe_kernel<kForm>;
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
  CK(cudaEventDestroy(a));
  CK(cudaEventDestroy(b));
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
  constexpr size_t kTile = 2 * kT * kN;  // floats of one form's output tiles
  float* tiles = nullptr;
  CK(cudaMalloc(&tiles, 3 * kTile * sizeof(float)));
  const double ms[3] = {time_ms<kPlanes>(sms, iters, tiles),
                        time_ms<kPlanesFp32>(sms, iters, tiles + kTile),
                        time_ms<kFused>(sms, iters, tiles + 2 * kTile)};
  std::vector<float> h(3 * kTile);
  CK(cudaMemcpy(h.data(), tiles, h.size() * sizeof(float), cudaMemcpyDeviceToHost));
  const bool same = std::memcmp(h.data(), h.data() + kTile, kTile * sizeof(float)) == 0 &&
                    std::memcmp(h.data(), h.data() + 2 * kTile, kTile * sizeof(float)) == 0;
  // mma per chunk (m16n8k16, three per split product): the planes forms 32 build tiles x 4 k
  // steps x 6 + 16 warps x 4 column blocks x 4 k steps x 6; fused 16 warps x (4 S blocks x 4 x 6
  // + 4 x 4 x 6).
  const int mma[3] = {32 * 4 * 6 + 16 * kNB * 4 * 6, 32 * 4 * 6 + 16 * kNB * 4 * 6,
                      16 * (4 * 4 * 6 + kNB * 4 * 6)};
  const char* name[3] = {"planes (M from the accumulators, one barrier)",
                         "planes via fp32 S tiles (as the K3, two barriers)",
                         "fused (S in registers, no barrier)"};
  std::printf("device %s, %d SMs, %d chunks per SM, smem %zu bytes per CTA\n", prop.name, sms,
              iters, sizeof(Smem));
  std::printf(
      "| form | us per chunk per SM | mma per chunk | ns per mma per SM |\n|---|---|---|---|\n");
  for (int f = 0; f < 3; ++f)
    std::printf("| %s | %.3f | %d | %.3f |\n", name[f], ms[f] * 1e3 / iters, mma[f],
                ms[f] * 1e6 / iters / mma[f]);
  std::printf("outputs bitwise identical: %s\n", same ? "yes" : "NO");
  CK(cudaFree(tiles));
  return same ? 0 : 1;
}
