// The first pass's lean K1 / K3 specialised to one shape (compile-time N, P, R, C), for the
// shapes of SPEC.md's benchmark grid. The lean bodies read the shape through `a.N`, `a.lgP`, ...
// of their argument type (a template parameter): MbArgsCT is MbArgs with those fields hidden by
// compile-time constants, so index arithmetic, masks and loop bounds fold. Same expressions and
// summation orders as the generic lean kernels, hence the same bits (CUDA test
// MimoBwdFwdCuda.SpecializedKernelsGiveIdenticalBits). The instantiations are split over two
// translation units (mimo_bwd_fwd_specialized_{a,b}.cu) so that a parallel build compiles them
// side by side; MAMBA3_MIMO_SPECIALIZED=0 forces the generic kernels (A/B runs, that test).
#pragma once

#include <cuda_runtime.h>

#include <cstdlib>

#include "cuda/mimo_bwd_fwd_kernels.cuh"
#include "cuda/mimo_bwd_fwd_lean.cuh"

namespace mamba3::cuda::mimo {

// One lean kernel: its address (for the shared-memory attribute) and its launch with the
// caller's parameter block (converted to the kernel's parameter type).
struct LeanLaunch {
  const void* kernel = nullptr;
  void (*launch)(const MbArgs&, unsigned grid, int nt, int smem, cudaStream_t st) = nullptr;
};

struct LeanPair {
  LeanLaunch k1, k3;
};

// Read at every call (no effect on the workspace or the outputs).
inline bool lean_specialized_allowed_by_env() {
  const char* e = std::getenv("MAMBA3_MIMO_SPECIALIZED");
  return e == nullptr || e[0] != '0';
}

// The specialised kernels for a's shape with the plan's thread count nt and state tiles st;
// false when none was compiled for them (then the generic kernels run). One lookup per
// translation unit.
bool lean_specialized_a(const MbArgs& a, int nt, int st, LeanPair* out);
bool lean_specialized_b(const MbArgs& a, int nt, int st, LeanPair* out);

inline bool lean_specialized(const MbArgs& a, int nt, int st, LeanPair* out) {
  if (!lean_specialized_allowed_by_env()) return false;
  return lean_specialized_a(a, nt, st, out) || lean_specialized_b(a, nt, st, out);
}

#if defined(__CUDACC__)
constexpr int lean_lg2(int x) { return x <= 1 ? 0 : 1 + lean_lg2(x / 2); }

template <int N_, int P_, int R_, int C_>
struct MbArgsCT : MbArgs {
  static constexpr int N = N_, P = P_, R = R_, C = C_, A = N_ / 4, half = N_ / 2;
  static constexpr int lgR = lean_lg2(R_), lgP = lean_lg2(P_);
  // The lean plan's tiles: whole chunks (Tb = C R rows) and the whole P (Ppt = P; Y's row
  // stride LP = mb_stride(P) = P + 8 for a power of two P >= 16). Why: the tile loops of the
  // scores and lean_y and their k-step counts then fold (lean_specialized_shape checks them).
  static constexpr int Tb = C_ * R_, Ppt = P_, LP = P_ + 8;
};

template <int NT, int ST, int N, int P, int R, int C>
__global__ void __launch_bounds__(NT, 1)
    mimo_lean_local_scan_ct_kernel(const __grid_constant__ MbArgsCT<N, P, R, C> a) {
  extern __shared__ float4 smem4[];
  k1_lean_body<NT, ST>(a, reinterpret_cast<float*>(smem4));
}

template <int NT, int ST, int N, int P, int R, int C>
__global__ void __launch_bounds__(NT, 1)
    mimo_lean_chunk_pass_ct_kernel(const __grid_constant__ MbArgsCT<N, P, R, C> a) {
  extern __shared__ float4 smem4[];
  k3_lean_body<NT, ST>(a, reinterpret_cast<float*>(smem4));
}

// The pair for shape (N, P, R, C), rotary_dim_divisor 4, at the thread count and state tiles
// the plan's rule picks for it (lean_nt_rule, lean_state_tiles); *out when they match.
template <int N, int P, int R, int C>
bool lean_specialized_shape(const MbArgs& a, int nt, int st, LeanPair* out) {
  constexpr int NT = lean_nt_rule(N), ST = lean_state_tiles(N, P, NT);
  static_assert(ST > 0, "a lean shape");
  using CT = MbArgsCT<N, P, R, C>;
  if (a.N != N || a.P != P || a.R != R || a.C != C || a.A != N / 4 || nt != NT || st != ST ||
      a.Tb != CT::Tb || a.Ppt != CT::Ppt || a.LP != CT::LP)
    return false;
  out->k1.kernel =
      reinterpret_cast<const void*>(mimo_lean_local_scan_ct_kernel<NT, ST, N, P, R, C>);
  out->k1.launch = [](const MbArgs& x, unsigned grid, int nthreads, int smem, cudaStream_t s) {
    CT c;
    static_cast<MbArgs&>(c) = x;
    mimo_lean_local_scan_ct_kernel<NT, ST, N, P, R, C><<<grid, nthreads, smem, s>>>(c);
  };
  out->k3.kernel =
      reinterpret_cast<const void*>(mimo_lean_chunk_pass_ct_kernel<NT, ST, N, P, R, C>);
  out->k3.launch = [](const MbArgs& x, unsigned grid, int nthreads, int smem, cudaStream_t s) {
    CT c;
    static_cast<MbArgs&>(c) = x;
    mimo_lean_chunk_pass_ct_kernel<NT, ST, N, P, R, C><<<grid, nthreads, smem, s>>>(c);
  };
  return true;
}
#endif

}  // namespace mamba3::cuda::mimo
