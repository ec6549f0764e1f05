// CPU backend of the MIMO backward first pass mamba3_mimo_bwd_fwd: plain C++, float32
// accumulation (like the CUDA kernels), one work item per (batch, head) spread over std::thread
// when the problem is large; every item writes its own outputs, so results do not depend on the
// thread count.
#pragma once

#include "core/mimo_bwd_params.hpp"

namespace mamba3::cpu {

void mimo_bwd_fwd(const MimoBwdFwdParams& p);

}  // namespace mamba3::cpu
