// CUDA backend of the MIMO backward first pass mamba3_mimo_bwd_fwd (implemented in
// src/cuda/mimo_bwd_fwd*.cu). Host-side entry points: they validate what only the CUDA path
// requires, pick the kernel instantiation and launch on `stream`; no host synchronisation.
#pragma once

#include <cstddef>

#include "core/mimo_bwd_params.hpp"

namespace mamba3::cuda {

// Bytes of device workspace mimo_bwd_fwd needs for these (validated) params.
size_t mimo_bwd_fwd_workspace_bytes(const MimoBwdFwdParams& p);
void mimo_bwd_fwd(const MimoBwdFwdParams& p, void* workspace, size_t workspace_bytes,
                  void* stream);

}  // namespace mamba3::cuda
