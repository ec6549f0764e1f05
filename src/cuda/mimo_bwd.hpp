// CUDA backend of the MIMO backward passes: mamba3_mimo_bwd_fwd (src/cuda/mimo_bwd_fwd*.cu) and
// mamba3_mimo_bwd_bwd (src/cuda/mimo_bwd_bwd.cu), and their composition mamba3_mimo_bwd_combined
// (src/cuda/mimo_bwd_combined.cu). Host-side entry points: they validate what
// only the CUDA path requires, pick the kernel instantiation and launch on `stream`; no host
// synchronisation, no allocation (the caller's workspace), capturable in a CUDA graph.
#pragma once

#include <cstddef>

#include "core/mimo_bwd_bwd_params.hpp"
#include "core/mimo_combined_params.hpp"
#include "core/mimo_bwd_params.hpp"

namespace mamba3::cuda {

// Bytes of device workspace mimo_bwd_fwd needs for these (validated) params.
size_t mimo_bwd_fwd_workspace_bytes(const MimoBwdFwdParams& p);
void mimo_bwd_fwd(const MimoBwdFwdParams& p, void* workspace, size_t workspace_bytes,
                  void* stream);

// Bytes of device workspace mimo_bwd_bwd needs for these (validated) params.
size_t mimo_bwd_bwd_workspace_bytes(const MimoBwdBwdParams& p);
void mimo_bwd_bwd(const MimoBwdBwdParams& p, void* workspace, size_t workspace_bytes,
                  void* stream);

// The combined backward's q / k group reduction, offered to the second pass: dq, dk
// [B, S, R, G, N] (the caller's) and part, [2][B nchunks][R H N] fp32 bias partials (per
// (b, chunk) the sums over the chunk's steps of each head's dq / dk).
struct QkGroupOut {
  TensorView dq, dk;
  float* part = nullptr;
};
// mimo_bwd_bwd that also does that reduction where its K3 can (the copy specialised to the
// combined backward's operands: returns true; p.dq / p.dk's per-head slots then hold scratch),
// else it leaves p.dq / p.dk per head and returns false (the caller reduces them).
// MAMBA3_CB_QK_GROUP=0: never.
bool mimo_bwd_bwd(const MimoBwdBwdParams& p, void* workspace, size_t workspace_bytes,
                  void* stream, const QkGroupOut* group);

// Bytes of device workspace mimo_bwd_combined needs (the first pass's intermediates, the second
// pass's per-head outputs, both passes' own workspace and the reductions' partials).
size_t mimo_bwd_combined_workspace_bytes(const MimoCombinedParams& p);
void mimo_bwd_combined(const MimoCombinedParams& p, void* workspace, size_t workspace_bytes,
                       void* stream);

}  // namespace mamba3::cuda
