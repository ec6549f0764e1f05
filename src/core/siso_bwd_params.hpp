// Checked arguments of the SISO backward operators (seed 000), shared by both backends.
// Built by make_*_params(), which validates every tensor (presence, rank, shape, dtype, device,
// sizes) and derives the problem sizes; backends receive only validated params.
#pragma once

#include <cstdint>

#include "core/tensor.hpp"

namespace mamba3 {

struct DqkthetaParams {
  int64_t B = 0, S = 0, G = 0, H = 0, N = 0, A = 0;
  int64_t chunk_size = 64;
  int64_t nseq = 0;     // number of sequences: B, or cu_seqlens.shape[0]-1 in varlen mode
  bool varlen = false;  // cu_seqlens given (then B == 1)
  bool has_dok = false; // d_ok_state given
  DeviceKind device = DeviceKind::None;
  int device_id = 0;
  // inputs
  TensorView q, k, scale, gamma, q_bias, k_bias, angles, dq_in, dk_in, dqk, d_ok_state, cu_seqlens;
  // outputs
  TensorView dq, dk, dq_bias, dk_bias, dangles, dscale, dgamma;
};

struct DdtDtrapParams {
  int64_t B = 0, H = 0, S = 0, N = 0, P = 0;
  int64_t nseq = 0;
  bool varlen = false;
  bool has_state = false;  // d_issm_state / input_k_state / input_v_state given
  DeviceKind device = DeviceKind::None;
  int device_id = 0;
  // inputs
  TensorView dscale, dgamma, dt, trap, d_issm_state, input_k_state, input_v_state, cu_seqlens;
  // outputs
  TensorView ddt, dtrap, d_input_ssm_state, d_input_k_state, d_input_v_state;
};

// Chunk sizes accepted by compute_dqktheta.
bool dqktheta_chunk_size_allowed(int64_t c);

DqkthetaParams make_dqktheta_params(
    const DLTensor* q, const DLTensor* k, const DLTensor* scale, const DLTensor* gamma,
    const DLTensor* q_bias, const DLTensor* k_bias, const DLTensor* angles,
    const DLTensor* dq_in, const DLTensor* dk_in, const DLTensor* dqk,
    const DLTensor* d_ok_state, int64_t chunk_size, const DLTensor* cu_seqlens,
    const DLTensor* dq, const DLTensor* dk, const DLTensor* dq_bias, const DLTensor* dk_bias,
    const DLTensor* dangles, const DLTensor* dscale, const DLTensor* dgamma);

DdtDtrapParams make_ddt_dtrap_params(
    const DLTensor* dscale, const DLTensor* dgamma, const DLTensor* dt, const DLTensor* trap,
    const DLTensor* d_issm_state, const DLTensor* input_k_state, const DLTensor* input_v_state,
    const DLTensor* cu_seqlens, const DLTensor* ddt, const DLTensor* dtrap,
    const DLTensor* d_input_ssm_state, const DLTensor* d_input_k_state,
    const DLTensor* d_input_v_state);

}  // namespace mamba3
