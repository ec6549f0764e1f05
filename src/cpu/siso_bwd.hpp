// CPU backend of the SISO backward operators: plain C++, float32 accumulation (like the CUDA
// kernels), parallel over (batch row, block of positions) with std::thread where the problem is
// large enough; per-block partial sums are combined in a fixed order, so results do not depend on
// the thread count.
#pragma once

#include "core/siso_bwd_params.hpp"

namespace mamba3::cpu {

void compute_dqktheta(const DqkthetaParams& p);
void compute_ddt_dtrap_dinput_states(const DdtDtrapParams& p);

}  // namespace mamba3::cpu
