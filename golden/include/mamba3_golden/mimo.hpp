// Golden of the Mamba-3 MIMO model (SPEC.md section 1) and of the first MIMO backward pass
// mamba3_mimo_bwd_fwd (seed 003, SPEC.md section 2 item 3), templated on the scalar type:
// double is the golden, float the "fp32 reference" of the dual benchmark. All tensors are
// logical row-major std::vector<T> with the shapes given in the comments.
//
// Shapes (B batch, S sequence, H heads, G q/k heads with H % G == 0, N headdim_qk (even),
// P headdim_v, R MIMO rank, C chunk size, A = N / rotary_dim_divisor, nchunks = ceil(S / C)):
//   q, k                      [B,S,R,G,N]   head h reads q/k head g = h / (H/G)
//   v, z                      [B,S,H,P]
//   dout                      [B,S,H,P] with mimo_o (reduce-O), [B,S,R,H,P] without (per rank)
//   q_bias, k_bias            [H,R,N]
//   mimo_v (Psi), mimo_o (Phi), mimo_z (Zeta)   [H,R,P]
//   D                         [H]
//   norm_weight               [H,P]         fused pre-gate headwise RMSNorm (optional)
//   angles                    [B,S,H,A]     already accumulated angles (the angle_dt output)
//   adt, dt, trap             [B,H,S]       adt = A*dt <= 0 (natural log), trap pre-sigmoid
//   da_cs, da_cs_rev          [B,H,S]
//   segsum                    [B,H,nchunks,C,C]
//   bwd_fwd outputs: states [B,H,nchunks,N,P], qk_dot [B,H,S,R,R], dmimo_o/dmimo_z [B,H,R,P]
//   (per batch; the caller sums over b), dz [B,S,H,P], with the norm dnorm_weight [B,H,R,P]
//   (per batch and rank; the caller sums over b and r) and dout_pre_rms [B,H,S*R,P].
//
// Model, per batch b, head h, step t (x^r = v * mimo_v^r, elementwise over P):
//   qh^r = rot(q^r + q_bias^r, angles_t), kh^r likewise; rot turns the pairs (i, N/2 + i),
//   i < A, by angles_t[i]: (a, b) -> (a cos - b sin, a sin + b cos); dims outside stay.
//   lam = sigmoid(trap), alpha = exp(adt), gamma = lam dt, beta = (1 - lam) dt alpha
//   H_t = alpha_t H_{t-1} + beta_t sum_r kh_{t-1}^r (x) x_{t-1}^r + gamma_t sum_r kh_t^r (x) x_t^r
//   y_t^r = qh_t^r . H_t + D x_t^r
//   out_t = sum_r mimo_o^r * gate_t^r * y_t^r, gate^r = silu(z_t * mimo_z^r) (1 without z);
//   without mimo_o the per-rank output gate^r * y^r [B,S,R,H,P] is returned instead.
//   Fused pre-gate headwise RMSNorm (norm_weight given; needs mimo_o, z and mimo_z): y_t^r is
//   replaced by yn_t^r = y_t^r * rstd_t^r * norm_weight, rstd = 1 / sqrt(mean_p (y^r_p)^2 + eps),
//   before the gate.
//
// Chunked form (what mamba3_mimo_bwd_fwd recomputes; da_cs, da_cs_rev, segsum are independent
// inputs, never re-derived from dt, except in a partial last chunk, see below):
//   trap_scale_t = gamma_t + dt_{t+1} (1 - lam_{t+1})   (second term 0 at t = S-1)
//   y_t^r = exp(da_cs_t) qh_t^r . St_c                                  (St_c: state entering c)
//         + sum_{s<t in c} sum_r' (qh_t^r . kh_s^r') trap_scale_s exp(segsum[c, t-cC, s-cC]) x_s^r'
//         + gamma_t sum_r' qk_dot[t, r, r'] x_t^r'  +  D x_t^r
//   St_{c+1} = exp(da_cs_{last of c}) St_c + sum_{s in c} sum_r kh_s^r trap_scale_s exp(da_cs_rev_s) (x) x_s^r
//   with St_0 = 0. Only the strictly lower triangle of segsum is read (the diagonal uses gamma).
//   In these terms St_c = H_{cC-1} + dt_{cC} (1 - lam_{cC}) sum_r kh_{cC-1}^r (x) x_{cC-1}^r
//   (transposed to [N,P]): the sequential state before the alpha decay of step cC.
//   qk_dot[b,h,t,r,r'] = (q_t^r + q_bias^r) . (k_t^r' + k_bias^r'), unrotated (the rotation is
//   orthogonal, so the same-position dot is the rotated one).
//
// Partial last chunk (S % C != 0), the seed's pad_tail_seq / rebuild_dacs_tail contract: the
// operator behaves as if every sequence input (q, k, v, angles, z, dout, dt, trap) were right-
// padded with zeros to nchunks*C, da_cs padded with its last valid value, and the last chunk's
// da_cs_rev and segsum rebuilt from the padded da_cs. On the valid positions this means: in the
// last chunk (start s0 = (nchunks-1) C, length L = S - s0)
//   segsum[last, i, j] is replaced by da_cs_{s0+i} - da_cs_{s0+j}   (i > j, both < L),
//   da_cs_rev_t is replaced by da_cs_{S-1} - da_cs_t and the chunk decay by exp(da_cs_{S-1}),
// so the caller's segsum / da_cs_rev values of that chunk are never read. Padded rows add
// nothing (v, dt, dout are zero there) and trap_scale_{S-1} = gamma_{S-1}; outputs with a
// sequence axis are cut back to S. Whatever S, da_cs_rev of the last chunk only shapes the state
// after it: no output of bwd_fwd, only the final state of mimo_chunked_forward.
//
// Gradients returned by mimo_bwd_fwd, of L = sum dout * out (per batch b):
//   dmimo_o[b,h,r,p] = sum_t dout gate^r y^r     (reduce-O only; absent per rank)
//   with z, u = z mimo_z^r, silu'(u) = sig(u) (1 + u (1 - sig(u))), g = dL/du = dout mimo_o^r y^r
//   silu'(u) (per rank: dout^r y^r silu'(u)):
//   dmimo_z[b,h,r,p] = sum_t g z,   dz[b,t,h,p] = sum_r g mimo_z^r.
//   With the norm, y^r above reads yn^r, and with xhat = y^r rstd, e = dout mimo_o^r gate^r:
//   dnorm_weight[b,h,r,p] = sum_t e xhat,
//   dout_pre_rms[b,h,t*R+r,p] = dL/dy_t^r = rstd (e w_p - xhat_p mean_q(e w_q xhat_q)).
#pragma once

#include <cstdint>
#include <vector>

namespace mamba3::golden {

template <class T>
struct MimoInputs {
  int64_t B = 0, S = 0, H = 0, G = 0, N = 0, P = 0, R = 0;
  int64_t rotary_dim_divisor = 4;  // 2 or 4 (A = N / divisor rotated pairs)
  int64_t chunk_size = 16;         // C: chunked form, bwd_fwd and mimo_dacs_segsum

  std::vector<T> q, k;            // [B,S,R,G,N]
  std::vector<T> v;               // [B,S,H,P]
  std::vector<T> q_bias, k_bias;  // [H,R,N]
  std::vector<T> mimo_v;          // [H,R,P]
  std::vector<T> mimo_o;          // [H,R,P], or empty: per-rank output (bwd_fwd requires it)
  std::vector<T> mimo_z;          // [H,R,P] or empty; z and mimo_z are both given or both empty
  std::vector<T> z;               // [B,S,H,P] or empty
  std::vector<T> D;               // [H] or empty
  // Fused pre-gate headwise RMSNorm: [H,P] or empty (then norm_eps is not read).
  std::vector<T> norm_weight;
  T norm_eps = T(1e-5);
  std::vector<T> angles;          // [B,S,H,A] accumulated
  std::vector<T> dt, trap;        // [B,H,S]

  // Sequential form only.
  std::vector<T> adt;  // [B,H,S]
  // Optional input states (all three empty, or all given): ssm [B,H,P,N]; k = the rotated,
  // biased k of the step before t = 0 [B,H,R,N]; v = the raw v of that step [B,H,P] (its x^r
  // is v * mimo_v^r). This is the layout of the final states the forward returns.
  std::vector<T> ssm_state0, k_state0, v_state0;

  // Chunked form and bwd_fwd only (the operator's inputs).
  std::vector<T> da_cs, da_cs_rev;  // [B,H,S]
  std::vector<T> segsum;            // [B,H,nchunks,C,C]
  // bwd_fwd only.
  std::vector<T> dout;  // [B,S,H,P] with mimo_o, [B,S,R,H,P] without
};

template <class T>
struct MimoOutputs {
  std::vector<T> out;        // [B,S,H,P] with mimo_o, else [B,S,R,H,P]
  std::vector<T> ssm_state;  // [B,H,P,N] state after the last step
  std::vector<T> k_state;    // [B,H,R,N] rotated, biased k of the last step
  std::vector<T> v_state;    // [B,H,P]   raw v of the last step
  std::vector<T> states;     // chunked form only: [B,H,nchunks,N,P] states entering each chunk
};

template <class T>
struct MimoBwdFwdOutputs {
  std::vector<T> states;   // [B,H,nchunks,N,P]
  std::vector<T> qk_dot;   // [B,H,S,R,R]
  std::vector<T> dmimo_o;       // [B,H,R,P], empty without mimo_o
  std::vector<T> dmimo_z;       // [B,H,R,P], empty without z
  std::vector<T> dz;            // [B,S,H,P], empty without z
  std::vector<T> dnorm_weight;  // [B,H,R,P], empty without norm_weight
  std::vector<T> dout_pre_rms;  // [B,H,S*R,P], empty without norm_weight
};

// The sequential recurrence, one step at a time (the definition). Reads the shared fields, adt
// and the optional input states.
template <class T>
MimoOutputs<T> mimo_sequential(const MimoInputs<T>& in);

// The chunked form as a function of exactly the bwd_fwd operator's inputs (da_cs, da_cs_rev,
// segsum, dt, trap, ...; adt and input states are not read). Returns out, the entering states,
// and the final ssm/k/v states.
template <class T>
MimoOutputs<T> mimo_chunked_forward(const MimoInputs<T>& in);

// mamba3_mimo_bwd_fwd: the operator's outputs for in.dout (reduce-O or per rank).
template <class T>
MimoBwdFwdOutputs<T> mimo_bwd_fwd(const MimoInputs<T>& in);

// The per-chunk decay inputs derived from in.adt (upstream's compute_dacs_segsum, dense):
// da_cs = inclusive cumsum of adt inside each chunk, da_cs_rev_t = da_cs_{last of chunk} - da_cs_t,
// segsum[c,i,j] = da_cs_i - da_cs_j for i > j, 0 on and above the diagonal. In a partial last
// chunk the sums run over the valid positions; rows/columns past S are 0.
template <class T>
void mimo_dacs_segsum(MimoInputs<T>& in);

}  // namespace mamba3::golden
