// Checked arguments of the MIMO backward first pass mamba3_mimo_bwd_fwd (seed 003), shared by
// both backends. Built by make_mimo_bwd_fwd_params(), which validates every tensor; backends
// receive only validated params. Shapes: see golden/include/mamba3_golden/mimo.hpp and the C API.
#pragma once

#include <cstdint>

#include "core/tensor.hpp"

namespace mamba3 {

struct MimoBwdFwdParams {
  int64_t B = 0, S = 0, H = 0, G = 0, N = 0, P = 0, R = 0;
  int64_t C = 16;           // chunk size
  int64_t nchunks = 0;      // ceil(S / C)
  int64_t rotary_dim_divisor = 4;
  int64_t A = 0;            // rotated pairs = N / rotary_dim_divisor
  bool reduce_o = true;     // mimo_o given: dout [B,S,H,P]; else per-rank dout [B,S,R,H,P]
  bool has_z = false;       // z and mimo_z (both or neither)
  bool has_d = false;
  bool has_norm = false;    // fused pre-gate headwise RMSNorm (norm_weight given)
  double norm_eps = 1e-5;
  DType output_dtype = DType::F32;  // dtype of states, qk_dot, dz (and dout_pre_rms)
  DeviceKind device = DeviceKind::None;
  int device_id = 0;
  // inputs
  TensorView dout, q, k, v, q_bias, k_bias, mimo_v, mimo_o, angles, da_cs, da_cs_rev, dt, trap,
      segsum, mimo_z, d, z, norm_weight;
  // outputs
  TensorView states, qk_dot, dmimo_o, dmimo_z, dz, dnorm_weight, dout_pre_rms;
  // Internal, not part of the C API (make_mimo_bwd_fwd_params leaves it absent): a combined
  // backward's [B, H, 2] float32 scratch for dD with the fused norm, computed by the first pass
  // in float64 and kept as hi + lo (the second pass's float32 sum of dout_pre_rms . x is
  // ill-conditioned; docs/ACCURACY.md). Written by the CPU backend when present with has_norm
  // and has_d; the CUDA backend ignores it (its combined backward recomputes dD in float64 in
  // kernels of its own: src/cuda/mimo_norm_dd_f64.cuh).
  TensorView norm_dd;
};

// Chunk sizes accepted by mamba3_mimo_bwd_fwd (the seeds' and upstream's grid).
bool mimo_chunk_size_allowed(int64_t c);

// Validates every argument of mamba3_mimo_bwd_fwd (see include/mamba3/mamba3.h for the contract)
// and returns the checked params; throws mamba3::Error naming the offending argument otherwise.
// The output dtype is the dtype of `states`.
MimoBwdFwdParams make_mimo_bwd_fwd_params(
    const DLTensor* dout, const DLTensor* q, const DLTensor* k, const DLTensor* v,
    const DLTensor* q_bias, const DLTensor* k_bias, const DLTensor* mimo_v, const DLTensor* mimo_o,
    const DLTensor* angles, const DLTensor* da_cs, const DLTensor* da_cs_rev, const DLTensor* dt,
    const DLTensor* trap, const DLTensor* segsum, const DLTensor* mimo_z, const DLTensor* d,
    const DLTensor* z, const DLTensor* norm_weight, double norm_eps, int64_t chunk_size,
    int64_t rotary_dim_divisor, const DLTensor* states, const DLTensor* qk_dot,
    const DLTensor* dmimo_o, const DLTensor* dmimo_z, const DLTensor* dz,
    const DLTensor* dnorm_weight, const DLTensor* dout_pre_rms);

}  // namespace mamba3
