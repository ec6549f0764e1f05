// Checked arguments of the combined MIMO backward mamba3_mimo_bwd_combined (upstream's
// mamba_mimo_bwd_combined): the first pass's checks of every input (make_mimo_bwd_fwd_params,
// run on descriptors of the first pass's outputs, which the backend keeps internally) plus the
// combined outputs. Shapes and meaning: golden/include/mamba3_golden/mimo_bwd_bwd.hpp
// (mimo_bwd_combined) and the C API.
#pragma once

#include <cstdint>

#include "core/mimo_bwd_params.hpp"
#include "core/tensor.hpp"

namespace mamba3 {

struct MimoCombinedParams {
  // The validated inputs, sizes and options. Its output views (states, qk_dot, dmimo_o, ...)
  // describe the first pass's intermediates but point at no memory of the caller's: a backend
  // replaces them with its own scratch before running the first pass.
  MimoBwdFwdParams fwd;
  // outputs: dq, dk, dv, dz in any of f16 / bf16 / f32; the rest f32
  TensorView dq, dk, dv, dadt, ddt, dtrap, dq_bias, dk_bias, dmimo_v, dmimo_z, dmimo_o, dangles, dd,
      dz, dnorm_weight;
};

MimoCombinedParams make_mimo_combined_params(
    const DLTensor* dout, const DLTensor* q, const DLTensor* k, const DLTensor* v,
    const DLTensor* q_bias, const DLTensor* k_bias, const DLTensor* mimo_v, const DLTensor* mimo_o,
    const DLTensor* z, const DLTensor* mimo_z, const DLTensor* angles, const DLTensor* da_cs,
    const DLTensor* da_cs_rev, const DLTensor* dt, const DLTensor* trap, const DLTensor* d,
    const DLTensor* segsum, int64_t chunk_size, int64_t rotary_dim_divisor,
    const DLTensor* norm_weight, double norm_eps, const DLTensor* dq, const DLTensor* dk,
    const DLTensor* dv, const DLTensor* dadt, const DLTensor* ddt, const DLTensor* dtrap,
    const DLTensor* dq_bias, const DLTensor* dk_bias, const DLTensor* dmimo_v,
    const DLTensor* dmimo_z, const DLTensor* dmimo_o, const DLTensor* dangles, const DLTensor* dd,
    const DLTensor* dz, const DLTensor* dnorm_weight);

}  // namespace mamba3
