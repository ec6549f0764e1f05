// The C API: converts DLTensors into checked params, dispatches on the tensors' device, and turns
// exceptions into status codes + a thread-local message. No backend ever falls back to another.
#include <exception>
#include <string>

#include "core/error.hpp"
#include "core/mimo_bwd_bwd_params.hpp"
#include "core/mimo_bwd_params.hpp"
#include "core/mimo_combined_params.hpp"
#include "core/siso_bwd_params.hpp"
#include "cpu/mimo_bwd.hpp"
#include "cpu/siso_bwd.hpp"
#include "mamba3/mamba3.h"
#ifdef MAMBA3_WITH_CUDA
#include "cuda/siso_bwd.hpp"
#endif
#ifdef MAMBA3_WITH_CUDA
#include "cuda/mimo_bwd.hpp"
#endif

#ifndef MAMBA3_VERSION_STRING
#define MAMBA3_VERSION_STRING "0.0.0"
#endif

namespace {

thread_local std::string g_last_error;

template <class F>
mamba3_status guarded(F&& f) {
  try {
    g_last_error.clear();
    f();
    return MAMBA3_OK;
  } catch (const mamba3::Error& e) {
    g_last_error = e.what();
    return e.status();
  } catch (const std::exception& e) {
    g_last_error = std::string("internal error: ") + e.what();
    return MAMBA3_ERROR_INTERNAL;
  } catch (...) {
    g_last_error = "internal error: unknown exception";
    return MAMBA3_ERROR_INTERNAL;
  }
}

[[maybe_unused]] [[noreturn]] void no_cuda_build(const char* op) {
  MAMBA3_FAIL(MAMBA3_ERROR_UNSUPPORTED, op,
              ": tensors are on a CUDA device but this build of mamba3-kernels has no CUDA "
              "backend (configure with -DMAMBA3_CUDA=ON)");
}

}  // namespace

extern "C" {

const char* mamba3_last_error(void) { return g_last_error.c_str(); }
const char* mamba3_version(void) { return MAMBA3_VERSION_STRING; }
int mamba3_has_cuda(void) {
#ifdef MAMBA3_WITH_CUDA
  return 1;
#else
  return 0;
#endif
}

mamba3_status mamba3_compute_dqktheta_workspace_size(const DLTensor* q, const DLTensor* scale,
                                                     int64_t chunk_size,
                                                     const DLTensor* cu_seqlens,
                                                     size_t* workspace_bytes) {
  return guarded([&] {
    using namespace mamba3;
    MAMBA3_CHECK_ARG(workspace_bytes != nullptr, "workspace_bytes: output pointer is NULL");
    TensorView vq = make_view(q, "q"), vs = make_view(scale, "scale");
    TensorView vc = make_view(cu_seqlens, "cu_seqlens");
    MAMBA3_CHECK_ARG(vq.present() && vq.ndim == 4, "q: expected rank 4 [B,S,G,N]");
    MAMBA3_CHECK_ARG(vs.present() && vs.ndim == 3, "scale: expected rank 3 [B,H,S]");
    MAMBA3_CHECK_ARG(dqktheta_chunk_size_allowed(chunk_size), "chunk_size=", chunk_size,
                     " is not allowed (expected 16, 32, 64, 128 or 256)");
    (void)vc;
    *workspace_bytes = 0;
    if (vq.device == DeviceKind::CUDA) {
#ifdef MAMBA3_WITH_CUDA
      *workspace_bytes = cuda::dqktheta_workspace_bytes(vq.shape[0], vq.shape[1], vq.shape[2],
                                                        vs.shape[1], vq.shape[3], vq.device_id);
#else
      no_cuda_build("compute_dqktheta");
#endif
    }
  });
}

mamba3_status mamba3_compute_dqktheta(
    const DLTensor* q, const DLTensor* k, const DLTensor* scale, const DLTensor* gamma,
    const DLTensor* q_bias, const DLTensor* k_bias, const DLTensor* angles,
    const DLTensor* dq_in, const DLTensor* dk_in, const DLTensor* dqk,
    const DLTensor* d_ok_state, int64_t chunk_size, const DLTensor* cu_seqlens,
    DLTensor* dq, DLTensor* dk, DLTensor* dq_bias, DLTensor* dk_bias, DLTensor* dangles,
    DLTensor* dscale, DLTensor* dgamma, void* workspace, size_t workspace_bytes, void* stream) {
  return guarded([&] {
    using namespace mamba3;
    DqkthetaParams p = make_dqktheta_params(q, k, scale, gamma, q_bias, k_bias, angles, dq_in,
                                            dk_in, dqk, d_ok_state, chunk_size, cu_seqlens, dq, dk,
                                            dq_bias, dk_bias, dangles, dscale, dgamma);
    if (p.device == DeviceKind::CPU) {
      cpu::compute_dqktheta(p);
    } else {
#ifdef MAMBA3_WITH_CUDA
      cuda::compute_dqktheta(p, workspace, workspace_bytes, stream);
#else
      (void)workspace, (void)workspace_bytes, (void)stream;
      no_cuda_build("compute_dqktheta");
#endif
    }
  });
}

mamba3_status mamba3_compute_ddt_dtrap_dinput_states(
    const DLTensor* dscale, const DLTensor* dgamma, const DLTensor* dt, const DLTensor* trap,
    const DLTensor* d_issm_state, const DLTensor* input_k_state, const DLTensor* input_v_state,
    const DLTensor* cu_seqlens, DLTensor* ddt, DLTensor* dtrap, DLTensor* d_input_ssm_state,
    DLTensor* d_input_k_state, DLTensor* d_input_v_state, void* stream) {
  return guarded([&] {
    using namespace mamba3;
    DdtDtrapParams p = make_ddt_dtrap_params(dscale, dgamma, dt, trap, d_issm_state, input_k_state,
                                             input_v_state, cu_seqlens, ddt, dtrap,
                                             d_input_ssm_state, d_input_k_state, d_input_v_state);
    if (p.device == DeviceKind::CPU) {
      cpu::compute_ddt_dtrap_dinput_states(p);
    } else {
#ifdef MAMBA3_WITH_CUDA
      cuda::compute_ddt_dtrap_dinput_states(p, stream);
#else
      (void)stream;
      no_cuda_build("compute_ddt_dtrap_dinput_states");
#endif
    }
  });
}

mamba3_status mamba3_mimo_bwd_fwd_workspace_size(
    const DLTensor* dout, const DLTensor* q, const DLTensor* k, const DLTensor* v,
    const DLTensor* q_bias, const DLTensor* k_bias, const DLTensor* mimo_v, const DLTensor* mimo_o,
    const DLTensor* angles, const DLTensor* da_cs, const DLTensor* da_cs_rev, const DLTensor* dt,
    const DLTensor* trap, const DLTensor* segsum, const DLTensor* mimo_z, const DLTensor* d,
    const DLTensor* z, const DLTensor* norm_weight, double norm_eps, int64_t chunk_size,
    int64_t rotary_dim_divisor, const DLTensor* states, const DLTensor* qk_dot,
    const DLTensor* dmimo_o, const DLTensor* dmimo_z, const DLTensor* dz,
    const DLTensor* dnorm_weight, const DLTensor* dout_pre_rms, size_t* workspace_bytes) {
  return guarded([&] {
    using namespace mamba3;
    MAMBA3_CHECK_ARG(workspace_bytes != nullptr, "workspace_bytes: output pointer is NULL");
    *workspace_bytes = 0;
    MimoBwdFwdParams p = make_mimo_bwd_fwd_params(
        dout, q, k, v, q_bias, k_bias, mimo_v, mimo_o, angles, da_cs, da_cs_rev, dt, trap, segsum,
        mimo_z, d, z, norm_weight, norm_eps, chunk_size, rotary_dim_divisor, states, qk_dot,
        dmimo_o, dmimo_z, dz, dnorm_weight, dout_pre_rms);
    if (p.device == DeviceKind::CUDA) {
#ifdef MAMBA3_WITH_CUDA
      *workspace_bytes = cuda::mimo_bwd_fwd_workspace_bytes(p);
#else
      no_cuda_build("mimo_bwd_fwd");
#endif
    }
  });
}

mamba3_status mamba3_mimo_bwd_fwd(
    const DLTensor* dout, const DLTensor* q, const DLTensor* k, const DLTensor* v,
    const DLTensor* q_bias, const DLTensor* k_bias, const DLTensor* mimo_v, const DLTensor* mimo_o,
    const DLTensor* angles, const DLTensor* da_cs, const DLTensor* da_cs_rev, const DLTensor* dt,
    const DLTensor* trap, const DLTensor* segsum, const DLTensor* mimo_z, const DLTensor* d,
    const DLTensor* z, const DLTensor* norm_weight, double norm_eps, int64_t chunk_size,
    int64_t rotary_dim_divisor, DLTensor* states, DLTensor* qk_dot, DLTensor* dmimo_o,
    DLTensor* dmimo_z, DLTensor* dz, DLTensor* dnorm_weight, DLTensor* dout_pre_rms,
    void* workspace, size_t workspace_bytes, void* stream) {
  return guarded([&] {
    using namespace mamba3;
    MimoBwdFwdParams p = make_mimo_bwd_fwd_params(
        dout, q, k, v, q_bias, k_bias, mimo_v, mimo_o, angles, da_cs, da_cs_rev, dt, trap, segsum,
        mimo_z, d, z, norm_weight, norm_eps, chunk_size, rotary_dim_divisor, states, qk_dot,
        dmimo_o, dmimo_z, dz, dnorm_weight, dout_pre_rms);
    if (p.device == DeviceKind::CPU) {
      cpu::mimo_bwd_fwd(p);
    } else {
#ifdef MAMBA3_WITH_CUDA
      cuda::mimo_bwd_fwd(p, workspace, workspace_bytes, stream);
#else
      (void)workspace, (void)workspace_bytes, (void)stream;
      no_cuda_build("mimo_bwd_fwd");
#endif
    }
  });
}

mamba3_status mamba3_mimo_bwd_bwd_workspace_size(
    const DLTensor* dout, const DLTensor* q, const DLTensor* k, const DLTensor* v,
    const DLTensor* q_bias, const DLTensor* k_bias, const DLTensor* mimo_v,
    const DLTensor* states, const DLTensor* qk_dot, const DLTensor* da_cs,
    const DLTensor* da_cs_rev, const DLTensor* dt, const DLTensor* trap, const DLTensor* segsum,
    const DLTensor* angles, const DLTensor* mimo_o, const DLTensor* d, int64_t chunk_size,
    int64_t rotary_dim_divisor, const DLTensor* dq, const DLTensor* dk, const DLTensor* dv,
    const DLTensor* dmimo_v, const DLTensor* dangles, const DLTensor* dfactor,
    const DLTensor* dgamma, const DLTensor* dda, const DLTensor* dssda,
    const DLTensor* dda_cs_rev, const DLTensor* dda_cs, const DLTensor* dd,
    size_t* workspace_bytes) {
  return guarded([&] {
    using namespace mamba3;
    MAMBA3_CHECK_ARG(workspace_bytes != nullptr, "workspace_bytes: output pointer is NULL");
    *workspace_bytes = 0;
    MimoBwdBwdParams p = make_mimo_bwd_bwd_params(
        dout, q, k, v, q_bias, k_bias, mimo_v, states, qk_dot, da_cs, da_cs_rev, dt, trap, segsum,
        angles, mimo_o, d, chunk_size, rotary_dim_divisor, dq, dk, dv, dmimo_v, dangles, dfactor,
        dgamma, dda, dssda, dda_cs_rev, dda_cs, dd);
    if (p.device == DeviceKind::CUDA) {
#ifdef MAMBA3_WITH_CUDA
      *workspace_bytes = cuda::mimo_bwd_bwd_workspace_bytes(p);
#else
      no_cuda_build("mimo_bwd_bwd");
#endif
    }
  });
}

mamba3_status mamba3_mimo_bwd_bwd(
    const DLTensor* dout, const DLTensor* q, const DLTensor* k, const DLTensor* v,
    const DLTensor* q_bias, const DLTensor* k_bias, const DLTensor* mimo_v,
    const DLTensor* states, const DLTensor* qk_dot, const DLTensor* da_cs,
    const DLTensor* da_cs_rev, const DLTensor* dt, const DLTensor* trap, const DLTensor* segsum,
    const DLTensor* angles, const DLTensor* mimo_o, const DLTensor* d, int64_t chunk_size,
    int64_t rotary_dim_divisor, DLTensor* dq, DLTensor* dk, DLTensor* dv, DLTensor* dmimo_v,
    DLTensor* dangles, DLTensor* dfactor, DLTensor* dgamma, DLTensor* dda, DLTensor* dssda,
    DLTensor* dda_cs_rev, DLTensor* dda_cs, DLTensor* dd, void* workspace,
    size_t workspace_bytes, void* stream) {
  return guarded([&] {
    using namespace mamba3;
    MimoBwdBwdParams p = make_mimo_bwd_bwd_params(
        dout, q, k, v, q_bias, k_bias, mimo_v, states, qk_dot, da_cs, da_cs_rev, dt, trap, segsum,
        angles, mimo_o, d, chunk_size, rotary_dim_divisor, dq, dk, dv, dmimo_v, dangles, dfactor,
        dgamma, dda, dssda, dda_cs_rev, dda_cs, dd);
    if (p.device == DeviceKind::CPU) {
      cpu::mimo_bwd_bwd(p);
    } else {
#ifdef MAMBA3_WITH_CUDA
      cuda::mimo_bwd_bwd(p, workspace, workspace_bytes, stream);
#else
      (void)workspace, (void)workspace_bytes, (void)stream;
      no_cuda_build("mimo_bwd_bwd");
#endif
    }
  });
}

mamba3_status mamba3_mimo_bwd_combined_workspace_size(
    const DLTensor* dout, const DLTensor* q, const DLTensor* k, const DLTensor* v,
    const DLTensor* q_bias, const DLTensor* k_bias, const DLTensor* mimo_v, const DLTensor* mimo_o,
    const DLTensor* z, const DLTensor* mimo_z, const DLTensor* angles, const DLTensor* da_cs,
    const DLTensor* da_cs_rev, const DLTensor* dt, const DLTensor* trap, const DLTensor* d,
    const DLTensor* segsum, int64_t chunk_size, int64_t rotary_dim_divisor,
    const DLTensor* norm_weight, double norm_eps, const DLTensor* dq, const DLTensor* dk,
    const DLTensor* dv, const DLTensor* dadt, const DLTensor* ddt, const DLTensor* dtrap,
    const DLTensor* dq_bias, const DLTensor* dk_bias, const DLTensor* dmimo_v,
    const DLTensor* dmimo_z, const DLTensor* dmimo_o, const DLTensor* dangles, const DLTensor* dd,
    const DLTensor* dz, const DLTensor* dnorm_weight, size_t* workspace_bytes) {
  return guarded([&] {
    using namespace mamba3;
    MAMBA3_CHECK_ARG(workspace_bytes != nullptr, "workspace_bytes: output pointer is NULL");
    *workspace_bytes = 0;
    MimoCombinedParams p = make_mimo_combined_params(
        dout, q, k, v, q_bias, k_bias, mimo_v, mimo_o, z, mimo_z, angles, da_cs, da_cs_rev, dt,
        trap, d, segsum, chunk_size, rotary_dim_divisor, norm_weight, norm_eps, dq, dk, dv, dadt,
        ddt, dtrap, dq_bias, dk_bias, dmimo_v, dmimo_z, dmimo_o, dangles, dd, dz, dnorm_weight);
    if (p.fwd.device == DeviceKind::CUDA) {
#ifdef MAMBA3_WITH_CUDA
      *workspace_bytes = cuda::mimo_bwd_combined_workspace_bytes(p);
#else
      no_cuda_build("mimo_bwd_combined");
#endif
    }
  });
}

mamba3_status mamba3_mimo_bwd_combined(
    const DLTensor* dout, const DLTensor* q, const DLTensor* k, const DLTensor* v,
    const DLTensor* q_bias, const DLTensor* k_bias, const DLTensor* mimo_v, const DLTensor* mimo_o,
    const DLTensor* z, const DLTensor* mimo_z, const DLTensor* angles, const DLTensor* da_cs,
    const DLTensor* da_cs_rev, const DLTensor* dt, const DLTensor* trap, const DLTensor* d,
    const DLTensor* segsum, int64_t chunk_size, int64_t rotary_dim_divisor,
    const DLTensor* norm_weight, double norm_eps, DLTensor* dq, DLTensor* dk, DLTensor* dv,
    DLTensor* dadt, DLTensor* ddt, DLTensor* dtrap, DLTensor* dq_bias, DLTensor* dk_bias,
    DLTensor* dmimo_v, DLTensor* dmimo_z, DLTensor* dmimo_o, DLTensor* dangles, DLTensor* dd,
    DLTensor* dz, DLTensor* dnorm_weight, void* workspace, size_t workspace_bytes, void* stream) {
  return guarded([&] {
    using namespace mamba3;
    MimoCombinedParams p = make_mimo_combined_params(
        dout, q, k, v, q_bias, k_bias, mimo_v, mimo_o, z, mimo_z, angles, da_cs, da_cs_rev, dt,
        trap, d, segsum, chunk_size, rotary_dim_divisor, norm_weight, norm_eps, dq, dk, dv, dadt,
        ddt, dtrap, dq_bias, dk_bias, dmimo_v, dmimo_z, dmimo_o, dangles, dd, dz, dnorm_weight);
    if (p.fwd.device == DeviceKind::CPU) {
      cpu::mimo_bwd_combined(p);
    } else {
#ifdef MAMBA3_WITH_CUDA
      cuda::mimo_bwd_combined(p, workspace, workspace_bytes, stream);
#else
      (void)workspace, (void)workspace_bytes, (void)stream;
      no_cuda_build("mimo_bwd_combined");
#endif
    }
  });
}

}  // extern "C"
