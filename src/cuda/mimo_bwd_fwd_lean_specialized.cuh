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
#include <initializer_list>
#include <iterator>

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

// Read at every call. MAMBA3_MIMO_CT_LAYOUT=0: never the K3 copies specialised to the
// benchmark's layouts too (lean_specialized_layout; A/B runs in one process, the bits tests).
inline bool lean_ct_layout_allowed_by_env() {
  const char* e = std::getenv("MAMBA3_MIMO_CT_LAYOUT");
  return e == nullptr || e[0] != '0';
}

// Whether a meets MbArgsCT<.., true>'s conditions (the benchmark's bwd_fwd operands,
// bench/bench_mimo_bwd.py): reduce-O with the gate and D, no norm, bf16 q / k / v / z / dout
// and bf16 outputs states / qk_dot / dz, fp32 angles / segsum, the chunk scalars not all fp32
// (bf16 trap: scal_f32 0), 4-element loads and vector state stores (lean_ld 2, states_vec4);
// every tensor that K3 reads or writes through its views contiguous, of at most 2^30 elements
// (32-bit offsets; the headroom covers the offsets formed for a chunk's rows past the end, never
// dereferenced). Host; the shape's own match (N, P, R, C, A) is lean_specialized_shape's.
inline bool lean_ct_layout_ok(const MbArgs& a) {
  if (!a.reduce_o || !a.has_z || !a.has_d || a.has_norm || a.act_dt != 1 || a.scal_f32 ||
      a.lean_ld != 2 || !a.lean_vec || !a.states_vec4)
    return false;
  const int64_t B = a.B, S = a.S, H = a.H, G = a.G, N = a.N, P = a.P, R = a.R, C = a.C,
                A = a.A, nch = a.nch;
  constexpr auto is = &rt_contiguous_of<MbView>;  // (rt_dtype.cuh)
  const int F32 = 2, BF16 = 1;
  return is(a.dout, BF16, {B, S, H, P}) && is(a.v, BF16, {B, S, H, P}) &&
         is(a.z, BF16, {B, S, H, P}) && is(a.dz, BF16, {B, S, H, P}) &&
         is(a.q, BF16, {B, S, R, G, N}) && is(a.k, BF16, {B, S, R, G, N}) &&
         is(a.angles, F32, {B, S, H, A}) && is(a.segsum, F32, {B, H, nch, C, C}) &&
         is(a.qk_dot, BF16, {B, H, S, R, R}) && is(a.states, BF16, {B, H, nch, N, P});
}

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
// The K3 (mimo_bwd_fwd_specialized_c.cu) / K1 (_d.cu) specialised to a's shape and the
// benchmark's layouts (MbArgsCT<.., true>), where one was compiled for them; the caller checks
// lean_ct_layout_ok.
bool lean_specialized_layout_k3(const MbArgs& a, int nt, int st, LeanLaunch* k3);
bool lean_specialized_layout_k1(const MbArgs& a, int nt, int st, LeanLaunch* k1);

// The shape's K3 and K1 are replaced by their contiguous-layout copies where lean_ct_layout_ok
// (and MAMBA3_MIMO_CT_LAYOUT is not 0).
inline bool lean_specialized(const MbArgs& a, int nt, int st, LeanPair* out) {
  if (!lean_specialized_allowed_by_env()) return false;
  if (!lean_specialized_a(a, nt, st, out) && !lean_specialized_b(a, nt, st, out)) return false;
  if (lean_ct_layout_allowed_by_env() && lean_ct_layout_ok(a)) {
    LeanLaunch k;
    if (lean_specialized_layout_k3(a, nt, st, &k)) out->k3 = k;
    if (lean_specialized_layout_k1(a, nt, st, &k)) out->k1 = k;
  }
  return true;
}

constexpr int lean_lg2(int x) { return x <= 1 ? 0 : 1 + lean_lg2(x / 2); }

template <int N_, int P_, int R_, int C_>
struct MbArgsShapeCT : MbArgs {
  static constexpr int N = N_, P = P_, R = R_, C = C_, A = N_ / 4, half = N_ / 2;
  static constexpr int lgR = lean_lg2(R_), lgP = lean_lg2(P_);
  // The lean plan's tiles: whole chunks (Tb = C R rows) and the whole P (Ppt = P; Y's row
  // stride LP = mb_stride(P) = P + 8 for a power of two P >= 16). Why: the tile loops of the
  // scores and lean_y and their k-step counts then fold (lean_specialized_shape checks them).
  static constexpr int Tb = C_ * R_, Ppt = P_, LP = P_ + 8;
};

// CL: also the layouts and dtypes of the benchmark's first pass (lean_ct_layout_ok).
// The views K3 reads or writes in its loops are MbCViews (compile-time dtypes, unit last
// strides, the strides of compile-time dims folded, 32-bit offsets) and the flags constants:
// the dtype and load-layout dispatches (three copies of each loop), the flag tests and the
// 64-bit stride products of the runtime views fold away. The same offsets, loads and float
// expressions as the runtime views: the same bits. The base MbArgs stays filled: helpers that
// take an MbArgs (chunk scalars, constants, partials, the prefetch hint) read it, same values.
template <int N_, int P_, int R_, int C_, bool CL = false>
struct MbArgsCT : MbArgsShapeCT<N_, P_, R_, C_> {};

template <int N_, int P_, int R_, int C_>
struct MbArgsCT<N_, P_, R_, C_, true> : MbArgsShapeCT<N_, P_, R_, C_> {
  static constexpr int kBF16 = 1, kF32 = 2;  // (rt_dtype.cuh's codes)
  MbCView<kBF16, 0, 0, P_, 1> dout, v, z, dz;          // [B,S,H,P]
  MbCView<kBF16, 0, 0, 0, N_, 1> q, k;                 // [B,S,R,G,N]
  MbCView<kF32, 0, 0, N_ / 4, 1> angles;               // [B,S,H,A]
  MbCView<kF32, 0, 0, C_ * C_, C_, 1> segsum;          // [B,H,nch,C,C]
  MbCView<kBF16, 0, 0, R_ * R_, R_, 1> qk_dot;         // [B,H,S,R,R]
  MbCView<kBF16, 0, 0, N_ * P_, P_, 1> states;         // [B,H,nch,N,P]
  static constexpr int reduce_o = 1, has_z = 1, has_d = 1, has_norm = 0, act_dt = kBF16;
  static constexpr int scal_f32 = 0, lean_ld = 2, lean_vec = 1, states_vec4 = 1;
  static constexpr bool kContiguousLayout = true;  // (mb_ct_layout)

  // Host: the MbCViews from the runtime views of a (lean_ct_layout_ok(a) must hold).
  void set(const MbArgs& a) {
    static_cast<MbArgs&>(*this) = a;
    auto cv = [](auto& c, const MbView& w) {
      c.p = w.p;
      for (int i = 0; i < std::decay_t<decltype(c)>::kRank; ++i)
        c.s.v[i] = static_cast<int>(w.s[i]);
    };
    cv(dout, a.dout), cv(v, a.v), cv(z, a.z), cv(dz, a.dz), cv(q, a.q), cv(k, a.k);
    cv(angles, a.angles), cv(segsum, a.segsum), cv(qk_dot, a.qk_dot), cv(states, a.states);
  }
};

#if defined(__CUDACC__)
template <int NT, int ST, int N, int P, int R, int C, bool CL = false>
__global__ void __launch_bounds__(NT, lean_k1_min_blocks(NT, ST))
    mimo_lean_local_scan_ct_kernel(const __grid_constant__ MbArgsCT<N, P, R, C, CL> a) {
  extern __shared__ float4 smem4[];
  k1_lean_body<NT, ST>(a, reinterpret_cast<float*>(smem4));
}

template <int NT, int ST, int N, int P, int R, int C, bool CL = false>
__global__ void __launch_bounds__(NT, 1)
    mimo_lean_chunk_pass_ct_kernel(const __grid_constant__ MbArgsCT<N, P, R, C, CL> a) {
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

// K3 (K1 if K1) for shape (N, P, R, C) and the benchmark's layouts (MbArgsCT<.., true>) at the
// plan's thread count and state tiles; *kl when they match (as lean_specialized_shape).
template <int N, int P, int R, int C, bool K1 = false>
bool lean_specialized_layout_shape(const MbArgs& a, int nt, int st, LeanLaunch* kl) {
  constexpr int NT = lean_nt_rule(N), ST = lean_state_tiles(N, P, NT);
  static_assert(ST > 0, "a lean shape");
  using CT = MbArgsCT<N, P, R, C, true>;
  if (a.N != N || a.P != P || a.R != R || a.C != C || a.A != N / 4 || nt != NT || st != ST ||
      a.Tb != CT::Tb || a.Ppt != CT::Ppt || a.LP != CT::LP)
    return false;
  if constexpr (K1) {
    kl->kernel =
        reinterpret_cast<const void*>(mimo_lean_local_scan_ct_kernel<NT, ST, N, P, R, C, true>);
    kl->launch = [](const MbArgs& x, unsigned grid, int nthreads, int smem, cudaStream_t s) {
      CT c;
      c.set(x);
      mimo_lean_local_scan_ct_kernel<NT, ST, N, P, R, C, true><<<grid, nthreads, smem, s>>>(c);
    };
  } else {
    kl->kernel =
        reinterpret_cast<const void*>(mimo_lean_chunk_pass_ct_kernel<NT, ST, N, P, R, C, true>);
    kl->launch = [](const MbArgs& x, unsigned grid, int nthreads, int smem, cudaStream_t s) {
      CT c;
      c.set(x);
      mimo_lean_chunk_pass_ct_kernel<NT, ST, N, P, R, C, true><<<grid, nthreads, smem, s>>>(c);
    };
  }
  return true;
}
#endif

}  // namespace mamba3::cuda::mimo
