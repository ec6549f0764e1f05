// The planes K1 and K3 of mimo_bwd_bwd specialised to the shapes of SPEC.md's grid (bb::ArgsCT,
// MAMBA3_BB_CT_SHAPES), one translation unit per kind so that none compiles longer than
// mimo_bwd_bwd.cu did with two kinds (each K3 copy is ~10 s of ptxas):
//   mimo_bwd_bwd_ct_shape.cu  K1 and K3 specialised to the shape only (kCtShape)
//   mimo_bwd_bwd_ct_bb.cu     also to the benchmark's contiguous layouts (kCtBwdBwd)
//   mimo_bwd_bwd_ct_cb.cu     also to the combined backward's (kCtCombined)
// mimo_bwd_bwd.cu picks among them (bb::k3_kind) and launches.
#pragma once

#include "cuda/common.cuh"
#include "cuda/mimo_bwd_bwd_chunk_planes.cuh"
#include "cuda/mimo_bwd_bwd_kernels.cuh"
#include "cuda/mimo_bwd_bwd_state_chain.cuh"

namespace mamba3::cuda::bb {

// A planes kernel of one shape: the kernel (for its shared-memory attribute) and its launch
// (the same parameter block, passed as the kernel's type).
struct PlanesKernel {
  const void* kernel = nullptr;  // nullptr: none (the caller takes the generic kernel)
  void (*launch)(const Args&, unsigned grid, int nthreads, int smem, cudaStream_t st) = nullptr;
};

// The specialised kernels for a's shape (its N, P, R, C, and A = N / 4, one of
// MAMBA3_BB_CT_SHAPES) and operand set (ct_layout_ok(a, set) must hold but for kCtShape), or {}
// if it has none (K1: nor at N16). Each is defined in the translation unit of its kind (above).
PlanesKernel ct_k1_shape(const Args& a);
PlanesKernel ct_k3_shape(const Args& a);
PlanesKernel ct_k1_bwd_bwd(const Args& a);
PlanesKernel ct_k3_bwd_bwd(const Args& a);
PlanesKernel ct_k1_combined(const Args& a);
PlanesKernel ct_k3_combined(const Args& a);

// The state chain kernel (K1 + K2 in one: mimo_bwd_bwd_state_chain.cuh) of a's shape and
// contiguous-layout set: launched with `per_bh` CTAs per (b, h) of kChainThreads and `smem`
// bytes of shared memory; {} (kernel nullptr) where there is none (a's shape is not one of
// MAMBA3_BB_CT_SHAPES, or N32: ct_chain_entry).
struct ChainKernel {
  PlanesKernel k;
  int smem = 0, per_bh = 0;
};
ChainKernel ct_chain_bwd_bwd(const Args& a);
ChainKernel ct_chain_combined(const Args& a);

// ---- the kernels (instantiated by the translation unit of their kind only)

// One CTA per SM: its planes take most of the shared memory.
template <int N, int P, int R, int C, int CL>
__global__ void __launch_bounds__(kPlanesThreads, 1)
    bb_chunk_planes_ct_kernel(const __grid_constant__ ArgsCT<N, P, R, C, CL> a) {
  extern __shared__ __align__(16) unsigned char planes_smem[];
  chunk_planes_body(a, planes_smem);
}

// K1 specialised: kIncPlanesMinBlocks (4) CTAs per SM, as the generic kernel (<= 64 registers),
// for every grid shape but N16 (ct_k1_of).
// ptxas at 64: 43-64 registers, no spills at any grid shape or operand set. In session 10 the
// specialised copies spilled 24-216 bytes at 64 registers (the folded shapes unroll more and
// keep more values live; the unrolled rank loop of rotated_pair_rows, since rolled, was one
// cause at R = 8), so they ran at 3 per SM. Since then only the contiguous-layout copies at
// N256 P64 and N128 P128 (C8; 65 registers) and the shape-only copy at R2 C32 (72) needed more
// than 64: the two C8 copies' K1 measured 9-10% faster at 4 per SM (H200, session 18); the
// shape-only copies were rescheduled by ptxas (their layouts are not the benchmark's) and not
// timed.
template <int N, int P, int R, int C, int CL>
__global__ void __launch_bounds__(kIncPlanesThreads, kIncPlanesMinBlocks)
    bb_increment_planes_ct_kernel(const __grid_constant__ ArgsCT<N, P, R, C, CL> a) {
  extern __shared__ __align__(16) unsigned char inc_planes_smem[];
  increment_planes_body(a, inc_planes_smem);
}

// The state chain: each CTA one block of dS of one (b, h) (ChainSplit); 2 per SM (<= 128
// registers; at most ~57 KB of shared memory each), so that the grid's 256 CTAs (B4 H16) are
// resident at once.
template <int N, int P, int R, int C, int CL>
__global__ void __launch_bounds__(kChainThreads, 2)
    bb_state_chain_ct_kernel(const __grid_constant__ ArgsCT<N, P, R, C, CL> a) {
  extern __shared__ __align__(16) unsigned char chain_smem[];
  state_chain_body(a, chain_smem);
}

// The parameter block of shape (N, P, R, C) and operand set CL from a.
template <int N, int P, int R, int C, int CL>
ArgsCT<N, P, R, C, CL> ct_args(const Args& a) {
  ArgsCT<N, P, R, C, CL> s;
  if constexpr (CL == kCtShape)
    static_cast<Args&>(s) = a;
  else
    s.set(a);
  return s;
}

// K1 / K3 of shape (N, P, R, C) and operand set CL. K1 keeps the generic kernel at N16 P64 R4
// C8 ({}): specialised (3 CTAs per SM) it measured slower there on the H200 (0.195 -> 0.217 ms;
// N128 0.297 -> 0.249, R1 C64 0.107 -> 0.085, N32 0.159 -> 0.136).
template <int N, int P, int R, int C, int CL>
PlanesKernel ct_k1_entry() {
  if constexpr (N == 16) {
    return {};
  } else {
    return {reinterpret_cast<const void*>(bb_increment_planes_ct_kernel<N, P, R, C, CL>),
            [](const Args& a, unsigned grid, int nt, int smem, cudaStream_t st) {
              bb_increment_planes_ct_kernel<N, P, R, C, CL>
                  <<<grid, nt, smem, st>>>(ct_args<N, P, R, C, CL>(a));
            }};
  }
}
template <int N, int P, int R, int C, int CL>
PlanesKernel ct_k3_entry() {
  return {reinterpret_cast<const void*>(bb_chunk_planes_ct_kernel<N, P, R, C, CL>),
          [](const Args& a, unsigned grid, int nt, int smem, cudaStream_t st) {
            bb_chunk_planes_ct_kernel<N, P, R, C, CL>
                <<<grid, nt, smem, st>>>(ct_args<N, P, R, C, CL>(a));
          }};
}

// None at N32 (K1 + K2 there): its one row block leaves four column blocks each forming all of
// q's rows, and the chain stays slower than K1 + K2 there (H100: 0.183 against 0.163 ms with the
// ranks inside each q task, session 22, its first form 0.185 against 0.154 on an H200; 0.165
// against 0.162 with one q task per rank, session 25).
template <int N, int P, int R, int C, int CL>
ChainKernel ct_chain_entry() {
  if constexpr (N == 32) {
    return {};
  } else {
    return {{reinterpret_cast<const void*>(bb_state_chain_ct_kernel<N, P, R, C, CL>),
             [](const Args& a, unsigned grid, int nt, int smem, cudaStream_t st) {
               bb_state_chain_ct_kernel<N, P, R, C, CL>
                   <<<grid, nt, smem, st>>>(ct_args<N, P, R, C, CL>(a));
             }},
            chain_smem_bytes<ArgsCT<N, P, R, C, CL>>(),
            chain_blocks_per_bh<ArgsCT<N, P, R, C, CL>>()};
  }
}

// The entry of one kind (K1, K3, state chain) as a class template over the shape and set, for
// ct_of's dispatch.
template <int N, int P, int R, int C, int CL>
struct CtK1 {
  static PlanesKernel get() { return ct_k1_entry<N, P, R, C, CL>(); }
};
template <int N, int P, int R, int C, int CL>
struct CtK3 {
  static PlanesKernel get() { return ct_k3_entry<N, P, R, C, CL>(); }
};
template <int N, int P, int R, int C, int CL>
struct CtChain {
  static ChainKernel get() { return ct_chain_entry<N, P, R, C, CL>(); }
};

// Entry<N, P, R, C, CL>::get() for a's shape (one of MAMBA3_BB_CT_SHAPES), or {}.
template <template <int, int, int, int, int> class Entry, int CL>
auto ct_of(const Args& a) -> decltype(Entry<16, 64, 4, 8, CL>::get()) {
#define MAMBA3_BB_CT_OF(n, p, r, c)                                   \
  if (a.N == n && a.P == p && a.R == r && a.C == c && a.A == n / 4) \
    return Entry<n, p, r, c, CL>::get();
  MAMBA3_BB_CT_SHAPES(MAMBA3_BB_CT_OF)
#undef MAMBA3_BB_CT_OF
  return {};
}

// K1 / K3 / the state chain of operand set CL for a's shape, or {}.
template <int CL>
PlanesKernel ct_k1_of(const Args& a) {
  return ct_of<CtK1, CL>(a);
}
template <int CL>
PlanesKernel ct_k3_of(const Args& a) {
  return ct_of<CtK3, CL>(a);
}
template <int CL>
ChainKernel ct_chain_of(const Args& a) {
  return ct_of<CtChain, CL>(a);
}

}  // namespace mamba3::cuda::bb
