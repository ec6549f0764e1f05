// Pieces shared by the compute_dqktheta kernels (siso_bwd_dqktheta.cu: the pipelined and the lean
// kernel; siso_bwd_dqktheta_split.cu: the split-run kernel): row reductions, the fast sin/cos,
// the host-side layout tests and the bound on CTAs per q/k head that sizes the workspace.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "core/siso_bwd_params.hpp"
#include "cuda/common.cuh"
#include "cuda/cu_seqlens.cuh"

namespace mamba3::cuda::dqk {

// Transposed xor butterfly: K values per lane (K a power of two) summed over the lanes that
// differ in the mask bits M, M/2, ..., 1 (UP = false: within a row, M = LPR / 2) or M, 2M, ..., 16
// (UP = true: across the rows of a warp, M = LPR). At each exchange a lane keeps the half of its
// values selected by its mask bit (upper when set) and receives the partner's copy of that half,
// so each exchange moves half of the remaining values (K-1 + ... shuffles instead of K per mask);
// once one value is left it is summed over the remaining masks. Afterwards v[0 ..) holds full sums:
// within a row (K <= 2M) lane `col` holds value col / (2M / K); across rows, v[0 .. K / rows)
// holds the values from offset sum_j bit_j(row) K / 2^(j+1). Each sum is keep + received: the same
// additions in the same tree as a plain butterfly; a fixed order: deterministic.
template <int K, int M, bool UP>
__device__ __forceinline__ void xor_reduce_t(float* v, int lane) {
  if constexpr (UP ? M < 32 : M >= 1) {
    constexpr int kNext = UP ? 2 * M : M / 2;
    if constexpr (K > 1) {
      const bool up = (lane & M) != 0;
#pragma unroll
      for (int j = 0; j < K / 2; ++j) {
        const float send = up ? v[j] : v[j + K / 2];
        const float keep = up ? v[j + K / 2] : v[j];
        v[j] = keep + __shfl_xor_sync(0xffffffffu, send, M);
      }
      xor_reduce_t<K / 2, kNext, UP>(v, lane);
    } else {
      v[0] += __shfl_xor_sync(0xffffffffu, v[0], M);
      xor_reduce_t<1, kNext, UP>(v, lane);
    }
  }
}

// Within a row: xor masks M, M/2, ..., 1 (M = LPR / 2).
template <int K, int M>
__device__ __forceinline__ void row_reduce_t(float* v, int col) {
  xor_reduce_t<K, M, false>(v, col);
}

// Angle reduced to [-pi, pi] (two-constant Cody-Waite), then the hardware sin/cos (abs error
// ~1e-6, far below the 16-bit tolerances; float32 inputs keep the precise sincosf).
__device__ __forceinline__ void fast_sincos(float x, float* s, float* c) {
  const float k = rintf(x * 0.159154943f);
  const float r = fmaf(-k, 1.74845553e-7f, fmaf(-k, 6.28318548f, x));
  __sincosf(r, s, c);
}

// The tensors of the lean and split-run kernels' argument blocks: 32-bit element strides (the
// host checks that every offset fits), one set of strides for each pair of tensors that the
// host checked to share them.
struct DqkTensors {
  int rows, S, HG;  // rows = B * S, flattened as b * S + s; heads per q/k head
  const unsigned char *q, *k;
  int q_sb, q_ss, q_sg;  // shared by q and k
  const unsigned char *dqi, *dki;
  int gi_sb, gi_ss, gi_sh;  // shared by dq_in and dk_in
  unsigned char *dq, *dk;
  int go_sb, go_ss, go_sg;  // shared by dq and dk
  const float* ang;
  float* dang;
  int an_sb, an_ss, an_sh;  // shared by angles and dangles
  const float *sc, *ga, *dqk;
  float *dsc, *dga;
  int sm_sb, sm_sh, sm_ss;  // shared by scale, gamma, dqk, dscale, dgamma
  const unsigned char *qb, *kb;
  int t_qb, t_kb;
  int64_t qb_sh, qb_sn, kb_sh, kb_sn;
  const unsigned char* dok;
  int t_dok;
  int64_t dok_sq, dok_sh, dok_sn;
  int has_dok, varlen;
  CuSeqlens cu;
  float* ws;
};

// Fills the tensor part of an argument block from validated params (workspace at `ws`).
inline void fill_dqk_tensors(DqkTensors& a, const DqkthetaParams& p, float* ws) {
  auto i32 = [](int64_t x) { return static_cast<int>(x); };
  auto cptr = [](const TensorView& v) { return static_cast<const unsigned char*>(v.data); };
  auto mptr = [](const TensorView& v) { return static_cast<unsigned char*>(v.data); };
  a.rows = i32(p.B * p.S), a.S = i32(p.S), a.HG = i32(p.H / p.G);
  a.q = cptr(p.q), a.k = cptr(p.k);
  a.q_sb = i32(p.q.strides[0]), a.q_ss = i32(p.q.strides[1]), a.q_sg = i32(p.q.strides[2]);
  a.dqi = cptr(p.dq_in), a.dki = cptr(p.dk_in);
  a.gi_sb = i32(p.dq_in.strides[0]), a.gi_ss = i32(p.dq_in.strides[1]);
  a.gi_sh = i32(p.dq_in.strides[2]);
  a.dq = mptr(p.dq), a.dk = mptr(p.dk);
  a.go_sb = i32(p.dq.strides[0]), a.go_ss = i32(p.dq.strides[1]), a.go_sg = i32(p.dq.strides[2]);
  a.ang = static_cast<const float*>(p.angles.data), a.dang = static_cast<float*>(p.dangles.data);
  a.an_sb = i32(p.angles.strides[0]), a.an_ss = i32(p.angles.strides[1]);
  a.an_sh = i32(p.angles.strides[2]);
  a.sc = static_cast<const float*>(p.scale.data), a.ga = static_cast<const float*>(p.gamma.data);
  a.dqk = static_cast<const float*>(p.dqk.data);
  a.dsc = static_cast<float*>(p.dscale.data), a.dga = static_cast<float*>(p.dgamma.data);
  a.sm_sb = i32(p.scale.strides[0]), a.sm_sh = i32(p.scale.strides[1]);
  a.sm_ss = i32(p.scale.strides[2]);
  a.qb = cptr(p.q_bias), a.kb = cptr(p.k_bias);
  a.t_qb = static_cast<int>(p.q_bias.dtype), a.t_kb = static_cast<int>(p.k_bias.dtype);
  a.qb_sh = p.q_bias.strides[0], a.qb_sn = p.q_bias.strides[1];
  a.kb_sh = p.k_bias.strides[0], a.kb_sn = p.k_bias.strides[1];
  a.has_dok = p.has_dok;
  if (p.has_dok) {
    a.dok = cptr(p.d_ok_state), a.t_dok = static_cast<int>(p.d_ok_state.dtype);
    a.dok_sq = p.d_ok_state.strides[0], a.dok_sh = p.d_ok_state.strides[1];
    a.dok_sn = p.d_ok_state.strides[2];
  }
  a.varlen = p.varlen;
  a.cu = make_cu_seqlens(p.cu_seqlens);
  a.ws = ws;
}

// The per-pair terms of compute_dqktheta for one (position, head) and one pair of elements
// (2i, 2i+1), shared by the lean and split-run kernels: qb/kb the biased q and k, dqr/dkr dq_in
// and dk_in rotated back (unrotated pairs: as they are), scl the scale, gd = dqk * gamma.
// Accumulates the row dots dsc (dscale) and qkd (q.k of dgamma); returns the q/k gradient terms
// before the head and bias sums, and the pair's dangles (meaningful for rotated pairs only).
struct PairTerms {
  float dq0, dq1, dk0, dk1, dan;
};
__device__ __forceinline__ PairTerms pair_terms(float qb0, float qb1, float kb0, float kb1,
                                                float dqr0, float dqr1, float dkr0, float dkr1,
                                                float scl, float gd, float& dsc, float& qkd) {
  dsc = fmaf(dkr0, kb0, fmaf(dkr1, kb1, dsc));
  qkd = fmaf(qb0, kb0, fmaf(qb1, kb1, qkd));
  const float k0 = scl * dkr0, k1 = scl * dkr1;
  PairTerms t;
  t.dq0 = fmaf(gd, kb0, dqr0);
  t.dq1 = fmaf(gd, kb1, dqr1);
  t.dk0 = fmaf(gd, qb0, k0);
  t.dk1 = fmaf(gd, qb1, k1);
  t.dan = fmaf(qb0, dqr1, -(qb1 * dqr0)) + fmaf(kb0, k1, -(kb1 * k0));
  return t;
}

// CTAs per q/k head: one per SM over all heads, but at least kMinRowsPerCta rows each, so that the
// per-CTA bias partials (HG*2N floats) stay small next to the CTA's own traffic (~6*HG*N bytes
// per row): the workspace is then also bounded by a fraction of the inputs' size.
constexpr int64_t kMinRowsPerCta = 16;
inline int64_t ctas_per_group_bound(int64_t G, int sms, int64_t rows, int per_sm) {
  const int64_t target = static_cast<int64_t>(per_sm) * sms;
  const int64_t by_sm = (target + G - 1) / G;
  return std::max<int64_t>(1, std::min(by_sm, rows / kMinRowsPerCta));
}
// The most CTAs per SM any kernel plans with (sizes the workspace: one bias partial per CTA).
constexpr int kMaxCtasPerSm = 2;

// Every element offset of the view is non-negative and below 2^31 / elem_bytes (32-bit index
// arithmetic in elements, or, with elem_bytes > 1, in bytes).
inline bool offsets_fit_int32(const TensorView& v, int64_t elem_bytes = 1) {
  int64_t mx = 0;
  for (int d = 0; d < v.ndim; ++d) {
    if (v.strides[d] < 0) return false;
    if (v.shape[d] > 1) mx += (v.shape[d] - 1) * v.strides[d];
  }
  return mx * elem_bytes < (int64_t(1) << 31);
}

// The big tensor's rows can be read as chunks of `bytes` (unit innermost stride, base and outer
// strides aligned to `bytes`).
inline bool rows_vectorizable(const TensorView& v, int64_t bytes) {
  const int last = v.ndim - 1;
  if (v.strides[last] != 1) return false;
  if (!aligned_to(v.data, bytes)) return false;
  const int64_t es = dtype_size(v.dtype);
  for (int d = 0; d < last; ++d)
    if (v.shape[d] > 1 && ((v.strides[d] * es) % bytes) != 0) return false;
  return true;
}

// Whether a DqkTensors block describes these arguments (the lean and split-run kernels'
// common contract): q, k, dk_in, dq, dk of dq_in's dtype; float32 angles and row scalars; B*S
// below 2^31; each pair that shares strides in DqkTensors really does; the big tensors' rows
// readable in `big_bytes` pieces and the angles' in `ang_bytes`; every offset in 32 bits.
inline bool dqk_tensors_fit(const DqkthetaParams& p, int64_t big_bytes, int64_t ang_bytes) {
  const DType tg = p.dq_in.dtype;
  for (const TensorView* v : {&p.q, &p.k, &p.dk_in, &p.dq, &p.dk})
    if (v->dtype != tg) return false;
  for (const TensorView* v : {&p.angles, &p.dangles, &p.scale, &p.gamma, &p.dqk, &p.dscale,
                              &p.dgamma})
    if (v->dtype != DType::F32) return false;
  if (p.B * p.S >= (int64_t(1) << 31)) return false;
  auto same3 = [](const TensorView& x, const TensorView& y) {
    for (int d = 0; d < 3; ++d)
      if (x.strides[d] != y.strides[d]) return false;
    return true;
  };
  if (!same3(p.q, p.k) || !same3(p.dq_in, p.dk_in) || !same3(p.dq, p.dk) ||
      !same3(p.angles, p.dangles))
    return false;
  for (const TensorView* v : {&p.gamma, &p.dqk, &p.dscale, &p.dgamma})
    if (!same3(p.scale, *v)) return false;
  for (const TensorView* v : {&p.q, &p.k, &p.dq_in, &p.dk_in, &p.dq, &p.dk})
    if (!rows_vectorizable(*v, big_bytes) || !offsets_fit_int32(*v)) return false;
  for (const TensorView* v : {&p.angles, &p.dangles})
    if (!rows_vectorizable(*v, ang_bytes) || !offsets_fit_int32(*v)) return false;
  for (const TensorView* v : {&p.scale, &p.gamma, &p.dqk, &p.dscale, &p.dgamma})
    if (!offsets_fit_int32(*v)) return false;
  return true;
}

// The split-run kernel (siso_bwd_dqktheta_split.cu) when it takes these arguments: launches it
// on `st`, writing one bias partial per CTA into `ws` ([G][ctas][HG][2][N] floats), and returns
// the CTAs per q/k head it used; 0 when it does not apply (nothing launched). *biases_done: the
// kernel also summed the partials into dq_bias / dk_bias (cooperative launch); otherwise the
// caller runs the bias reduction.
int run_split(const DqkthetaParams& p, float* ws, int sms, cudaStream_t st, bool* biases_done);

}  // namespace mamba3::cuda::dqk
