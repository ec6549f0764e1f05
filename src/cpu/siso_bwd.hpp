// CPU backend of the SISO backward operators: plain C++, float32 accumulation (like the CUDA
// kernels), parallel over (batch, q/k head) with std::thread where the problem is large enough.
#pragma once

#include "core/siso_bwd_params.hpp"

namespace mamba3::cpu {

void compute_dqktheta(const DqkthetaParams& p);
void compute_ddt_dtrap_dinput_states(const DdtDtrapParams& p);

}  // namespace mamba3::cpu
