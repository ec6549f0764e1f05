// Host entry of the float64 dD of mamba3_mimo_bwd_combined with the fused norm
// (mimo_norm_dd_f64.cu; the kernels' bodies and why: mimo_norm_dd_f64.cuh).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "core/mimo_bwd_params.hpp"
#include "core/tensor.hpp"

namespace mamba3::cuda {

// Bytes of workspace norm_dd_f64 needs (the float64 states [B H][nch][N][P] and the chunk
// partials [B H][nch]); a multiple of 8.
size_t norm_dd_f64_workspace_bytes(const MimoBwdFwdParams& f);

// dD [H] (summed over the batch) of the combined backward with the fused norm, in float64,
// stored into `dd` (its dtype). Enqueued on `st`.
void norm_dd_f64(const MimoBwdFwdParams& f, void* workspace, const TensorView& dd,
                 cudaStream_t st);

}  // namespace mamba3::cuda
