// CUDA backend of the SISO backward operators. Host-side entry points: they validate what only
// the CUDA path requires (alignment, cu_seqlens values), pick the kernel instantiation and launch
// on `stream`. No host synchronisation on the hot path.
#pragma once

#include <cstddef>

#include "core/siso_bwd_params.hpp"

namespace mamba3::cuda {

// Bytes of device workspace compute_dqktheta needs for these sizes on device `device_id`.
size_t dqktheta_workspace_bytes(int64_t B, int64_t S, int64_t G, int64_t H, int64_t N,
                                int device_id);
void compute_dqktheta(const DqkthetaParams& p, void* workspace, size_t workspace_bytes,
                      void* stream);
void compute_ddt_dtrap_dinput_states(const DdtDtrapParams& p, void* stream);

}  // namespace mamba3::cuda
