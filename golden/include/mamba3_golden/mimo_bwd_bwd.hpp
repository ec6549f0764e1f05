// Golden of the second MIMO backward pass mamba3_mimo_bwd_bwd (seed 001, SPEC.md section 2 item
// 4), templated on the scalar type (double: the golden; float: the fp32 reference). Shapes and
// the chunked forward are those of mimo.hpp; this pass consumes the first pass's `states` and
// `qk_dot` and returns the gradients of L = sum dPhiO . y (y the per-rank readout of the chunked
// forward) that need the reverse scan over chunks.
//
// dPhiO_t^r (dL/dy_t^r, [P]) comes from one of three dout layouts:
//   reduce-O   dout [B,S,H,P] with mimo_o:   dPhiO_t^r = dout_t * mimo_o^r
//   per rank   dout [B,S,R,H,P], no mimo_o: dPhiO_t^r = dout_t^r
//   packed     dout [B,H,S*R,P], no mimo_o: dPhiO_t^r = dout[t*R + r] (the dout_pre_rms of the
//              fused-norm first pass, which already holds the norm and gate backward)
// There is no gate here (as in the seed): a gated model's dout reaches this pass per rank or
// packed, with the gate already applied.
//
// Per batch b, head h, chunk c (steps t = s0 + i, i < L), with x, qh, kh, qb, kb, gamma,
// trap_scale ts as in mimo.hpp, E_t = exp(da_cs_t), F_t = exp(da_cs_rev_t),
// W[i,j] = exp(segsum[c,i,j]) (j < i), decay_c = exp(da_cs_{last of c}), St_c = states[b,h,c]
// and dS_{c+1} = dL/dSt_{c+1} (zero after the last chunk), the outputs are:
//   DQ  [B,S*R,H,N]  row t*R + r: dL/dq_t^r of head h (the caller sums the heads of a group)
//   DK  [B,S*R,H,N]  row t*R + r: dL/dk_t^r of head h
//   DV  [B,S,H,P]    dL/dv
//   DMIMO_V [B,H,R,P] dL/dmimo_v per batch (the caller sums over b)
//   DANGLES [B,S,H,A] dL/dangles
//   DFACTOR [B,H,S]  dL/dts_t (ts as one independent factor of step t's key in the intra-chunk
//                    and state terms)
//   DGAMMA  [B,H,S]  dL/dgamma_t through the diagonal term gamma_t sum_r' qk_dot x_t^r' only
//                    (so dL/dgamma_t in total is DGAMMA_t + DFACTOR_t)
//   DDA     [B,H,S]  dL/d(da_cs_{last of c}) through the chunk decay exp(da_cs_last) St_c,
//                    = decay_c St_c . dS_{c+1}, the same value at every step of chunk c
//   DDA_CS  [B,H,S]  dL/dE_t = sum_r qh_t^r . (St_c dPhiO_t^r): the gradient w.r.t. the
//                    inter-chunk factor exp(da_cs_t), i.e. dL/dda_cs_t (readout path) / E_t
//   DDA_CS_REV [B,H,S] dL/dF_t = ts_t sum_r kh_t^r . (dS_{c+1} x_t^r): the gradient w.r.t. the
//                    state-increment factor exp(da_cs_rev_t)
//   DSSDA [B,H,nchunks,C,C] [c, s, t] (key step s, query step t, both < L):
//                    ts_s sum_{r,r'} (qh_t^r . kh_s^r') (x_s^r' . dPhiO_t^r), for every s, t.
//                    For s < t this is dL/dW[t,s], the gradient w.r.t. exp(segsum[c,t,s]); the
//                    entries s >= t are that same product, not masked (upstream's layout and
//                    meaning: its dADT post-pass masks and scales them). Rows and columns
//                    >= L of a partial last chunk are 0.
//   DD [B,H]         dL/dD per batch (empty without D)
// The exponential factors (E, F, W) are left out of DDA_CS, DDA_CS_REV and DSSDA as upstream
// does; dADT is then sum of E * DDA_CS, F * DDA_CS_REV and W * DSSDA, each pushed through the
// cumsums, plus DDA (upstream's bwd_dadt).
//
// states and qk_dot enter where the first pass's values would: St_c in the inter-chunk readout
// terms (DQ, DDA_CS, DDA), qk_dot in the diagonal terms (DGAMMA and the DV / DMIMO_V diagonal
// contribution); the diagonal's DQ / DK contribution uses the biased q, k themselves. With the
// first pass's exact states and qk_dot, every output is the exact gradient of the chunked
// forward of mimo.hpp (checked by finite differences in tests/cpp/test_golden_mimo_bwd_bwd.cpp).
//
// Partial last chunk: the mimo.hpp tail contract (segsum and da_cs_rev of that chunk rebuilt
// from da_cs, the decay exp(da_cs_{S-1})); the outputs equal those of the explicitly padded
// problem, cut back to S, with DSSDA's rows and columns past the sequence zero.
#pragma once

#include <cstdint>
#include <vector>

#include "mamba3_golden/mimo.hpp"

namespace mamba3::golden {

template <class T>
struct MimoBwdBwdOutputs {
  std::vector<T> dq, dk;                                    // [B,S*R,H,N]
  std::vector<T> dv;                                        // [B,S,H,P]
  std::vector<T> dmimo_v;                                   // [B,H,R,P]
  std::vector<T> dangles;                                   // [B,S,H,A]
  std::vector<T> dfactor, dgamma, dda, dda_cs_rev, dda_cs;  // [B,H,S]
  std::vector<T> dssda;                                     // [B,H,nchunks,C,C]
  std::vector<T> dd;                                        // [B,H], empty without D
};

// The dout layout of mimo_bwd_bwd: reduce-O needs in.mimo_o; the other two need it empty.
enum class MimoDoutLayout { ReduceO, PerRank, Packed };

// mamba3_mimo_bwd_bwd for in.dout in `layout`; reads q, k, v, q_bias, k_bias, mimo_v, mimo_o,
// D, angles, dt, trap, da_cs, da_cs_rev, segsum, chunk_size, rotary_dim_divisor of `in` (z,
// mimo_z and norm_weight must be empty), states [B,H,nchunks,N,P] and qk_dot [B,H,S,R,R].
template <class T>
MimoBwdBwdOutputs<T> mimo_bwd_bwd(const MimoInputs<T>& in, const std::vector<T>& states,
                                  const std::vector<T>& qk_dot, MimoDoutLayout layout);

// The combined MIMO backward (upstream's mamba_mimo_bwd_combined; issue 4 item 2): the first
// pass, the second pass, and the reductions to the gradients of the raw inputs. For
// L = sum dout . out of the model of mimo.hpp (gate, pre-gate norm, reduce-O or per rank, D):
//   dq, dk      [B,S,R,G,N]  DQ / DK summed over the heads of each q/k group
//   dv          [B,S,H,P]
//   dadt        [B,H,S]      dL/dadt (upstream's ddA): DDA plus the cumsum chain of
//                            E DDA_CS (reverse cumsum in the chunk), F DDA_CS_REV (exclusive
//                            forward cumsum) and W DSSDA (over the pairs j < m <= i)
//   ddt, dtrap  [B,H,S]      through gamma = lam dt and trap_scale (not through adt = A dt,
//                            whose share is dadt times A, the caller's)
//   dq_bias, dk_bias [H,R,N] DQ / DK summed over batch and sequence
//   dmimo_v, dmimo_z, dmimo_o [H,R,P] summed over batch (dmimo_z without z, dmimo_o without
//                            mimo_o empty)
//   dangles     [B,S,H,A]
//   dd          [H]          (empty without D)
//   dz          [B,S,H,P]    (empty without z)
//   dnorm_weight [H,P]       summed over batch and rank (empty without the norm)
// The second pass takes the gate as a gated per-rank dout (or, with the norm, the packed
// dout_pre_rms of the first pass). The decay inputs of a partial last chunk are rebuilt from
// da_cs (the tail contract), which is what compute_dacs_segsum of adt gives there.
template <class T>
struct MimoCombinedOutputs {
  std::vector<T> dq, dk, dv, dadt, ddt, dtrap, dq_bias, dk_bias, dmimo_v, dmimo_z, dmimo_o, dangles,
      dd, dz, dnorm_weight;
};

// Reads everything mimo_bwd_fwd reads (in.dout in the reduce-O or per-rank layout).
template <class T>
MimoCombinedOutputs<T> mimo_bwd_combined(const MimoInputs<T>& in);

}  // namespace mamba3::golden
