// Checks and sizes shared by the MIMO backward passes (mimo_bwd_params.cpp, mimo_bwd_bwd_params.cpp):
// one copy of the size derivation and of the shape checks of the inputs both passes take, so
// that the two operators accept and refuse the same arguments with the same messages.
#pragma once

#include <cstdint>

#include "core/check.hpp"
#include "core/mimo_bwd_params.hpp"  // mimo_chunk_size_allowed

namespace mamba3 {

// Params: MimoBwdFwdParams or MimoBwdBwdParams (fields B..R, C, nchunks, rotary_dim_divisor, A
// and the views q, k, v, q_bias, k_bias, mimo_v, angles, da_cs, da_cs_rev, dt, trap, segsum).
// q gives B, S, R, G, N; v gives H and P; every other shared input is checked against them.
template <class Params>
void check_mimo_shared_inputs(Params& p, int64_t chunk_size, int64_t rotary_dim_divisor) {
  MAMBA3_CHECK_ARG(p.q.ndim == 5, "q: expected rank 5 [B,S,R,G,N], got ", p.q.shape_str());
  p.B = p.q.shape[0];
  p.S = p.q.shape[1];
  p.R = p.q.shape[2];
  p.G = p.q.shape[3];
  p.N = p.q.shape[4];
  MAMBA3_CHECK_ARG(p.v.ndim == 4, "v: expected rank 4 [B,S,H,P], got ", p.v.shape_str());
  p.H = p.v.shape[2];
  p.P = p.v.shape[3];

  MAMBA3_CHECK_ARG(p.B >= 1 && p.S >= 1 && p.R >= 1 && p.G >= 1, "q: B, S, R and G must be >= 1",
                   " (got ", p.q.shape_str(), ")");
  MAMBA3_CHECK_ARG(p.H >= 1 && p.P >= 1, "v: H and P must be >= 1 (got ", p.v.shape_str(), ")");
  MAMBA3_CHECK_ARG(p.H % p.G == 0, "v/q: number of heads H=", p.H,
                   " must be a multiple of the number of q/k heads G=", p.G, " (H % G != 0)");
  MAMBA3_CHECK_ARG(p.R <= 8, "q: MIMO rank R=", p.R, " is larger than the supported 8");
  MAMBA3_CHECK_ARG(p.N >= 2 && p.N % 2 == 0, "q: headdim_qk N=", p.N, " must be even and >= 2");
  MAMBA3_CHECK_ARG(p.N <= 256, "q: headdim_qk N=", p.N, " is larger than the supported 256");
  MAMBA3_CHECK_ARG(p.P <= 256, "v: headdim_v P=", p.P, " is larger than the supported 256");
  MAMBA3_CHECK_ARG(rotary_dim_divisor == 2 || rotary_dim_divisor == 4, "rotary_dim_divisor=",
                   rotary_dim_divisor, " is not allowed (expected 2 or 4)");
  MAMBA3_CHECK_ARG(p.N % rotary_dim_divisor == 0, "q: headdim_qk N=", p.N,
                   " must be a multiple of rotary_dim_divisor=", rotary_dim_divisor);
  MAMBA3_CHECK_ARG(mimo_chunk_size_allowed(chunk_size), "chunk_size=", chunk_size,
                   " is not allowed (expected 8, 16, 32 or 64)");
  p.rotary_dim_divisor = rotary_dim_divisor;
  p.A = p.N / rotary_dim_divisor;
  p.C = chunk_size;
  p.nchunks = (p.S + p.C - 1) / p.C;

  const int64_t B = p.B, S = p.S, H = p.H, G = p.G, N = p.N, P = p.P, R = p.R, A = p.A, C = p.C;
  check_shape(p.k, {B, S, R, G, N}, {"B", "S", "R", "G", "N"});
  check_shape(p.q_bias, {H, R, N}, {"H", "R", "N"});
  check_shape(p.k_bias, {H, R, N}, {"H", "R", "N"});
  check_shape(p.mimo_v, {H, R, P}, {"H", "R", "P"});
  MAMBA3_CHECK_ARG(p.angles.ndim == 4, "angles: expected rank 4 [B,S,H,A], got ",
                   p.angles.shape_str());
  MAMBA3_CHECK_ARG(p.angles.shape[3] == A, "angles: expected shape [B=", B, ",S=", S, ",H=", H,
                   ",A=", A, "] (A = N / rotary_dim_divisor = ", N, " / ", rotary_dim_divisor,
                   " rotated pairs), got ", p.angles.shape_str());
  check_shape(p.angles, {B, S, H, A}, {"B", "S", "H", "A"});
  for (const TensorView* t : {&p.da_cs, &p.da_cs_rev, &p.dt, &p.trap})
    check_shape(*t, {B, H, S}, {"B", "H", "S"});
  check_shape(p.segsum, {B, H, p.nchunks, C, C}, {"B", "H", "nchunks", "C", "C"});
}

}  // namespace mamba3
