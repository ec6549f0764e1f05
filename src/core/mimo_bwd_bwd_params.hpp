// Checked arguments of the MIMO backward second pass mamba3_mimo_bwd_bwd (seed 001), shared by
// the backends. Built by make_mimo_bwd_bwd_params(), which validates every tensor; backends
// receive only validated params. Shapes and meaning: golden/include/mamba3_golden/mimo_bwd_bwd.hpp
// and the C API.
#pragma once

#include <cstdint>

#include "core/tensor.hpp"

namespace mamba3 {

// Where dL/dy^r comes from (see the C API): reduce-O dout [B,S,H,P] times mimo_o; per-rank dout
// [B,S,R,H,P]; or the packed pre-RMS dout [B,H,S*R,P] of the fused-norm first pass.
enum class MimoDout { ReduceO, PerRank, Packed };

struct MimoBwdBwdParams {
  int64_t B = 0, S = 0, H = 0, G = 0, N = 0, P = 0, R = 0;
  int64_t C = 16;       // chunk size
  int64_t nchunks = 0;  // ceil(S / C)
  int64_t rotary_dim_divisor = 4;
  int64_t A = 0;  // rotated pairs = N / rotary_dim_divisor
  MimoDout dout_layout = MimoDout::ReduceO;
  bool has_d = false;
  DeviceKind device = DeviceKind::None;
  int device_id = 0;
  // inputs
  TensorView dout, q, k, v, q_bias, k_bias, mimo_v, states, qk_dot, da_cs, da_cs_rev, dt, trap,
      segsum, angles, mimo_o, d;
  // outputs (dq, dk, dv in any of f16 / bf16 / f32; the rest f32)
  TensorView dq, dk, dv, dmimo_v, dangles, dfactor, dgamma, dda, dssda, dda_cs_rev, dda_cs, dd;
  // Set only by the combined backward (CUDA), never by make_mimo_bwd_bwd_params: the Z gate
  // applied to dout as the kernels load it, dPhiO^r = dout^r silu(z mimo_z^r) (z [B, S, H, P],
  // mimo_z [H, R, P]), so that no gated copy of dout is written and read back.
  TensorView z, mimo_z;
};

// Validates every argument of mamba3_mimo_bwd_bwd (see include/mamba3/mamba3.h for the contract)
// and returns the checked params; throws mamba3::Error naming the offending argument otherwise.
MimoBwdBwdParams make_mimo_bwd_bwd_params(
    const DLTensor* dout, const DLTensor* q, const DLTensor* k, const DLTensor* v,
    const DLTensor* q_bias, const DLTensor* k_bias, const DLTensor* mimo_v, const DLTensor* states,
    const DLTensor* qk_dot, const DLTensor* da_cs, const DLTensor* da_cs_rev, const DLTensor* dt,
    const DLTensor* trap, const DLTensor* segsum, const DLTensor* angles, const DLTensor* mimo_o,
    const DLTensor* d, int64_t chunk_size, int64_t rotary_dim_divisor, const DLTensor* dq,
    const DLTensor* dk, const DLTensor* dv, const DLTensor* dmimo_v, const DLTensor* dangles,
    const DLTensor* dfactor, const DLTensor* dgamma, const DLTensor* dda, const DLTensor* dssda,
    const DLTensor* dda_cs_rev, const DLTensor* dda_cs, const DLTensor* dd);

}  // namespace mamba3
