// CPU backend of the MIMO backward passes mamba3_mimo_bwd_fwd and mamba3_mimo_bwd_bwd: plain C++,
// float32 accumulation (like the CUDA kernels), one work item per (batch, head) spread over std::thread
// when the problem is large; every item writes its own outputs, so results do not depend on the
// thread count.
#pragma once

#include "core/mimo_bwd_bwd_params.hpp"
#include "core/mimo_bwd_params.hpp"
#include "core/mimo_combined_params.hpp"

namespace mamba3::cpu {

void mimo_bwd_fwd(const MimoBwdFwdParams& p);
void mimo_bwd_bwd(const MimoBwdBwdParams& p);
// First pass, second pass and the reductions (scratch allocated here).
void mimo_bwd_combined(const MimoCombinedParams& p);

}  // namespace mamba3::cpu
