// Golden of the SISO backward operators (seed 000), templated on the scalar type: double is the
// golden, float the "fp32 reference" of the dual benchmark. Written from SPEC.md section 1 as
// gradients of explicit forward relations of exactly the operators' inputs; the forward
// relations themselves are exposed so that tests can check the gradients by finite differences.
// All tensors are logical row-major std::vector<T> with the shapes given in comments.
#pragma once

#include <cstdint>
#include <vector>

namespace mamba3::golden {

template <class T>
struct DqkthetaInputs {
  int64_t B = 0, S = 0, G = 0, H = 0, N = 0, A = 0;
  std::vector<T> q, k;             // [B,S,G,N]
  std::vector<T> scale, gamma;     // [B,H,S]
  std::vector<T> q_bias, k_bias;   // [H,N]
  std::vector<T> angles;           // [B,S,H,A]
  std::vector<T> dq_in, dk_in;     // [B,S,H,N]
  std::vector<T> dqk;              // [B,H,S]
  std::vector<T> d_ok_state;       // [nseq,H,N] or empty
  std::vector<int64_t> cu_seqlens; // [nseq+1] or empty (then nseq = B)
};

template <class T>
struct DqkthetaGrads {
  std::vector<T> dq, dk;            // [B,S,G,N]
  std::vector<T> dq_bias, dk_bias;  // [H,N]
  std::vector<T> dangles;           // [B,S,H,A]
  std::vector<T> dscale, dgamma;    // [B,H,S]
};

// The scalar whose gradients compute_dqktheta returns (interleaved rotation of pairs i < A):
//   F = sum dq_in . rot(q+qb)  +  sum dk_in . scale * rot(k+kb)  +  sum dqk * gamma * (q+qb).(k+kb)
//     + sum_seq d_ok_state . rot(k_last+kb, angles_last)     (last position of each sequence)
// with q/k of head h taken from q/k head g = h / (H/G).
template <class T>
T dqktheta_forward(const DqkthetaInputs<T>& in);
// Analytic gradients of dqktheta_forward w.r.t. q, k, q_bias, k_bias, angles, scale, gamma.
template <class T>
DqkthetaGrads<T> dqktheta(const DqkthetaInputs<T>& in);

template <class T>
struct DdtDtrapInputs {
  int64_t B = 0, H = 0, S = 0, N = 0, P = 0;
  std::vector<T> dscale, dgamma, dt, trap;  // [B,H,S] (trap pre-sigmoid)
  std::vector<T> d_issm_state;              // [nseq,H,P,N] or empty
  std::vector<T> input_k_state;             // [nseq,H,N]
  std::vector<T> input_v_state;             // [nseq,H,P]
  std::vector<int64_t> cu_seqlens;          // [nseq+1] or empty
};

template <class T>
struct DdtDtrapGrads {
  std::vector<T> ddt, dtrap;         // [B,H,S]
  std::vector<T> d_input_ssm_state;  // [nseq,H,P,N] (empty without states)
  std::vector<T> d_input_k_state;    // [nseq,H,N]
  std::vector<T> d_input_v_state;    // [nseq,H,P]
};

// F = sum dgamma*gamma + sum dscale*scale + sum d_issm . issm_mid, per sequence with
//   lam = sigmoid(trap), gamma_t = dt_t lam_t, scale_t = gamma_t + dt_{t+1} (1 - lam_{t+1})
//   (second term absent at a sequence's last position), and
//   issm_mid = issm + dt_0 (1 - lam_0) outer(v_state, k_state)  ([P,N]; t=0 = sequence start).
// `issm` (the input SSM state itself) enters F linearly; its gradient is d_issm.
template <class T>
T ddt_dtrap_forward(const DdtDtrapInputs<T>& in);
template <class T>
DdtDtrapGrads<T> ddt_dtrap(const DdtDtrapInputs<T>& in);

}  // namespace mamba3::golden
