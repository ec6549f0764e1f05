// CUDA backend of mamba3_mimo_bwd_fwd (seed 003): host entry points and kernel launches. The
// design (segmented chunk scan, five kernels, shared-memory tiles) is described in
// mimo_bwd_fwd_kernels.cuh, which holds the kernel bodies and the launch plan.
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>
#include <utility>

#include "core/error.hpp"
#include "cuda/common.cuh"
#include "cuda/mimo_bwd.hpp"
#include "cuda/mimo_bwd_fwd_kernels.cuh"
#include "cuda/mimo_bwd_fwd_lean.cuh"
#include "cuda/mimo_bwd_fwd_lean_specialized.cuh"

namespace mamba3::cuda {
namespace {

using mimo::kNT;
using mimo::MbArgs;

template <bool TC>
__global__ void __launch_bounds__(kNT, kNT <= 256 ? 2 : 1) mimo_local_scan_kernel(const __grid_constant__ MbArgs a) {
  extern __shared__ float4 smem4[];
  mimo::k1_body<TC>(a, reinterpret_cast<float*>(smem4));
}

__global__ void __launch_bounds__(kNT) mimo_segment_states_kernel(const __grid_constant__ MbArgs a) {
  mimo::k2_body(a);
}

template <bool TC>
__global__ void __launch_bounds__(kNT, 1) mimo_chunk_pass_kernel(const __grid_constant__ MbArgs a) {
  extern __shared__ float4 smem4[];
  mimo::k3_body<TC>(a, reinterpret_cast<float*>(smem4));
}

// The lean bf16 path (mimo_bwd_fwd_lean.cuh), one instantiation per thread count (256, 512)
// and state-tile count: every pair is reachable (ST <= 8 with either count).
template <int NT, int ST>
__global__ void __launch_bounds__(NT, mimo::lean_k1_min_blocks(NT, ST))
    mimo_lean_local_scan_kernel(const __grid_constant__ MbArgs a) {
  extern __shared__ float4 smem4[];
  mimo::k1_lean_body<NT, ST>(a, reinterpret_cast<float*>(smem4));
}

template <int NT, int ST>
__global__ void __launch_bounds__(NT, 1)
    mimo_lean_chunk_pass_kernel(const __grid_constant__ MbArgs a) {
  extern __shared__ float4 smem4[];
  mimo::k3_lean_body<NT, ST>(a, reinterpret_cast<float*>(smem4));
}

using LeanKernel = void (*)(MbArgs);
template <int NT>
LeanKernel lean_k1_nt(int st) {
  switch (st) {
    case 1: return mimo_lean_local_scan_kernel<NT, 1>;
    case 2: return mimo_lean_local_scan_kernel<NT, 2>;
    case 4: return mimo_lean_local_scan_kernel<NT, 4>;
    default: return mimo_lean_local_scan_kernel<NT, 8>;
  }
}
template <int NT>
LeanKernel lean_k3_nt(int st) {
  switch (st) {
    case 1: return mimo_lean_chunk_pass_kernel<NT, 1>;
    case 2: return mimo_lean_chunk_pass_kernel<NT, 2>;
    case 4: return mimo_lean_chunk_pass_kernel<NT, 4>;
    default: return mimo_lean_chunk_pass_kernel<NT, 8>;
  }
}
LeanKernel lean_k1(int nt, int st) { return nt == 256 ? lean_k1_nt<256>(st) : lean_k1_nt<512>(st); }
LeanKernel lean_k3(int nt, int st) { return nt == 256 ? lean_k3_nt<256>(st) : lean_k3_nt<512>(st); }

__global__ void __launch_bounds__(kNT) mimo_reduce_partials_kernel(const __grid_constant__ MbArgs a) {
  mimo::k4_body(a);
}

__global__ void __launch_bounds__(kNT, 1) mimo_deferred_epilogue_kernel(const __grid_constant__ MbArgs a) {
  extern __shared__ float4 smem4[];
  mimo::k5_body(a, reinterpret_cast<float*>(smem4));
}

mimo::MbDevice device_info(int device) {
  mimo::MbDevice d;
  d.sms = sm_count(device);
  int optin = 0, per_sm = 0;
  check_cuda(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
             "cudaDeviceGetAttribute(MaxSharedMemoryPerBlockOptin)");
  check_cuda(cudaDeviceGetAttribute(&per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device),
             "cudaDeviceGetAttribute(MaxSharedMemoryPerMultiprocessor)");
  d.smem_optin = optin;
  d.smem_per_sm = per_sm;
  return d;
}

// MAMBA3_MIMO_LEAN_NT=256 or 512: the lean kernels' preferred thread count instead of the
// plan's rule (A/B measurements). Read once, so that the workspace size and the run agree.
const std::string& lean_nt_env() {
  static const std::string v = [] {
    const char* s = std::getenv("MAMBA3_MIMO_LEAN_NT");
    return std::string(s ? s : "");
  }();
  return v;
}

// MAMBA3_MIMO_PREFETCH=0: the lean kernels do not ask L2 for their next chunk's rows (A/B runs;
// results are identical either way).
bool prefetch_env() {
  static const bool on = [] {
    const char* s = std::getenv("MAMBA3_MIMO_PREFETCH");
    return s == nullptr || s[0] != '0';
  }();
  return on;
}

mimo::MbPlan plan_for(const MimoBwdFwdParams& p) {
  // Every index the kernels form in 32 bits stays far below INT_MAX under these bounds.
  MAMBA3_CHECK_ARG(p.S <= (int64_t{1} << 30) && p.B * p.H <= (int64_t{1} << 24),
                   "mimo_bwd_fwd: B*H=", p.B * p.H, " or S=", p.S,
                   " exceeds the CUDA backend's index range");
  const int lean_nt = mimo::parse_lean_nt(lean_nt_env().c_str());
  MAMBA3_CHECK_ARG(lean_nt >= 0, "MAMBA3_MIMO_LEAN_NT=", lean_nt_env(),
                   ": expected 256 or 512 (or unset)");
  const mimo::MbPlan pl =
      mimo::make_mimo_plan(mimo::mb_problem(p), device_info(p.device_id), lean_nt);
  if (!pl.ok)
    MAMBA3_FAIL(MAMBA3_ERROR_UNSUPPORTED, "mimo_bwd_fwd: no shared-memory tiling fits this device for N=",
                p.N, ", P=", p.P, ", R=", p.R, ", C=", p.C);
  return pl;
}

}  // namespace

size_t mimo_bwd_fwd_workspace_bytes(const MimoBwdFwdParams& p) { return plan_for(p).ws_total; }

void mimo_bwd_fwd(const MimoBwdFwdParams& p, void* workspace, size_t workspace_bytes,
                  void* stream) {
  DeviceGuard guard(p.device_id);
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  const mimo::MbPlan pl = plan_for(p);
  MAMBA3_CHECK_ARG(workspace != nullptr && workspace_bytes >= pl.ws_total, "workspace: ",
                   workspace_bytes, " bytes at ", workspace, " given, mimo_bwd_fwd needs ",
                   pl.ws_total, " bytes of device memory (see mamba3_mimo_bwd_fwd_workspace_size)");

  MbArgs a{};
  mimo::mb_set_tensors(p, &a);
  mimo::apply_plan(mimo::mb_problem(p), pl, workspace, &a);
  if (!prefetch_env()) a.prefetch = 0;

  const int64_t BH = p.B * p.H;
  // The lean kernels specialised to this shape, where they were compiled for it.
  mimo::LeanPair ct;
  const bool spec = pl.lean && mimo::lean_specialized(a, pl.nt, pl.lean, &ct);
  // K1 or K3: its specialised copy sk when there is one, else the generic kernel k.
  auto launch = [&](const mimo::LeanLaunch& sk, LeanKernel k, int64_t grid, size_t smem,
                    const char* attr_what, const char* launch_what) {
    set_smem(spec ? sk.kernel : reinterpret_cast<const void*>(k), p.device_id, smem, attr_what);
    if (spec)
      sk.launch(a, static_cast<unsigned>(grid), pl.nt, static_cast<int>(smem), st);
    else
      k<<<static_cast<unsigned>(grid), pl.nt, smem, st>>>(a);
    check_launch(launch_what);
  };
  if (pl.nseg > 1) {
    launch(ct.k1,
           pl.lean ? lean_k1(pl.nt, pl.lean)
                   : pl.tc1 ? mimo_local_scan_kernel<true> : mimo_local_scan_kernel<false>,
           BH * pl.npt * pl.nsub, pl.smem1, "mimo_bwd_fwd: cudaFuncSetAttribute(local scan)",
           "mimo_bwd_fwd: local scan kernel");
    const int64_t per_bh = (p.N * p.P + kNT - 1) / kNT;
    mimo_segment_states_kernel<<<static_cast<unsigned>(BH * per_bh), kNT, 0, st>>>(a);
    check_launch("mimo_bwd_fwd: segment states kernel");
  }
  launch(ct.k3,
         pl.lean ? lean_k3(pl.nt, pl.lean)
                 : pl.tc ? mimo_chunk_pass_kernel<true> : mimo_chunk_pass_kernel<false>,
         BH * pl.npt * pl.nseg, pl.smem3, "mimo_bwd_fwd: cudaFuncSetAttribute(chunk pass)",
         "mimo_bwd_fwd: chunk pass kernel");
  if (pl.defer_epi) {
    set_smem(reinterpret_cast<const void*>(mimo_deferred_epilogue_kernel), p.device_id, pl.smem5,
             "mimo_bwd_fwd: cudaFuncSetAttribute(deferred epilogue)");
    mimo_deferred_epilogue_kernel<<<static_cast<unsigned>(BH * pl.nseg), kNT, pl.smem5, st>>>(a);
    check_launch("mimo_bwd_fwd: deferred epilogue kernel");
  }
  if (p.reduce_o || p.has_z) {
    const int64_t n = BH * p.R * p.P;
    mimo_reduce_partials_kernel<<<static_cast<unsigned>((n + kNT - 1) / kNT), kNT, 0, st>>>(a);
    check_launch("mimo_bwd_fwd: partials reduction kernel");
  }
}

}  // namespace mamba3::cuda
