/* mamba3-kernels public C API.
 *
 * Tensors cross the boundary as DLPack DLTensor (shape, strides in elements, dtype, device).
 * Every entry point returns a mamba3_status; on failure mamba3_last_error() gives a message that
 * names the offending argument. The backend is chosen from the tensors' device: all tensors of one
 * call must live on the same device (kDLCPU -> CPU backend, kDLCUDA -> CUDA backend). There is no
 * fallback from one backend to the other.
 *
 * Outputs are allocated by the caller with the documented shape and dtype and are fully
 * overwritten. CUDA work is enqueued on `stream` (a cudaStream_t, NULL = legacy default stream)
 * and is asynchronous; `workspace` must be device memory of at least the size reported by the
 * matching *_workspace_size function, and must stay alive until the work on `stream` finishes.
 */
#ifndef MAMBA3_MAMBA3_H_
#define MAMBA3_MAMBA3_H_

#include <stddef.h>
#include <stdint.h>

#include <dlpack/dlpack.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32)
#define MAMBA3_API __declspec(dllexport)
#else
#define MAMBA3_API __attribute__((visibility("default")))
#endif

typedef enum {
  MAMBA3_OK = 0,
  MAMBA3_ERROR_INVALID_ARGUMENT = 1, /* bad shape, dtype, device, value: the message names it */
  MAMBA3_ERROR_UNSUPPORTED = 2,      /* valid request this build cannot serve (e.g. no CUDA) */
  MAMBA3_ERROR_CUDA = 3,             /* a CUDA runtime call or launch failed */
  MAMBA3_ERROR_INTERNAL = 4
} mamba3_status;

/* Message of the last failed call on this thread ("" if none). */
MAMBA3_API const char* mamba3_last_error(void);
MAMBA3_API const char* mamba3_version(void);
/* 1 if this build contains the CUDA backend. */
MAMBA3_API int mamba3_has_cuda(void);

/* ---------------------------------------------------------------------------------------------
 * SISO backward: gradients through q/k biases, rotary embedding and angles (seed 000).
 *
 * Inputs (B batch, S sequence, G q/k heads, H heads with H % G == 0, N = headdim_qk even,
 * A = number of rotated pairs <= N/2; interleaved pairs (2i, 2i+1) for i < A are rotated):
 *   q, k          [B,S,G,N]   T in {f16, bf16, f32}
 *   scale, gamma  [B,H,S]     float (any of f16/bf16/f32)
 *   q_bias,k_bias [H,N]       float
 *   angles        [B,S,H,A]   float (accumulated angles)
 *   dq_in, dk_in  [B,S,H,N]   float: gradients w.r.t. rot(q+qb) and scale*rot(k+kb)
 *   dqk           [B,H,S]     float: gradient w.r.t. gamma * (q+qb).(k+kb)
 *   d_ok_state    [nseq,H,N]  float or NULL: gradient w.r.t. the output k state rot(k_last+kb)
 *   chunk_size    16, 32, 64, 128 or 256 (kept for API compatibility; results do not depend on it)
 *   cu_seqlens    [nseq+1] int32/int64 or NULL: varlen (B must be 1), increasing from 0 to S
 * Outputs:
 *   dq, dk        [B,S,G,N]  dtype of dq_in (summed over the heads of each q/k group)
 *   dq_bias,dk_bias [H,N]    f32 (summed over batch and sequence)
 *   dangles       [B,S,H,A]  dtype of angles
 *   dscale        [B,H,S]    dtype of scale
 *   dgamma        [B,H,S]    dtype of gamma
 * Results are deterministic: the same inputs give bitwise-identical outputs.
 * ------------------------------------------------------------------------------------------- */
MAMBA3_API mamba3_status mamba3_compute_dqktheta_workspace_size(
    const DLTensor* q, const DLTensor* scale, int64_t chunk_size, const DLTensor* cu_seqlens,
    size_t* workspace_bytes);

MAMBA3_API mamba3_status mamba3_compute_dqktheta(
    const DLTensor* q, const DLTensor* k, const DLTensor* scale, const DLTensor* gamma,
    const DLTensor* q_bias, const DLTensor* k_bias, const DLTensor* angles,
    const DLTensor* dq_in, const DLTensor* dk_in, const DLTensor* dqk,
    const DLTensor* d_ok_state, int64_t chunk_size, const DLTensor* cu_seqlens,
    DLTensor* dq, DLTensor* dk, DLTensor* dq_bias, DLTensor* dk_bias, DLTensor* dangles,
    DLTensor* dscale, DLTensor* dgamma,
    void* workspace, size_t workspace_bytes, void* stream);

/* ---------------------------------------------------------------------------------------------
 * SISO backward: dDT and dTrap from dScale/dGamma, and the input-state gradients (seed 000).
 *
 * Forward relations (per sequence, lam = sigmoid(trap)):
 *   gamma_t = dt_t * lam_t;  scale_t = gamma_t + dt_{t+1} * (1 - lam_{t+1})  (no second term at
 *   the last position of a sequence);  issm_mid = issm + dt_0 * (1 - lam_0) * outer(v_state, k_state).
 * Inputs:
 *   dscale, dgamma, dt, trap [B,H,S] float (trap is pre-sigmoid)
 *   d_issm_state  [nseq,H,P,N] float or NULL; input_k_state [nseq,H,N], input_v_state [nseq,H,P]
 *                 float, given exactly when d_issm_state is given
 *   cu_seqlens    [nseq+1] int32/int64 or NULL (varlen, B must be 1)
 * Outputs:
 *   ddt, dtrap    [B,H,S]    f32 (dtrap w.r.t. the pre-sigmoid trap)
 *   d_input_ssm_state [nseq,H,P,N] dtype of d_issm_state; d_input_k_state [nseq,H,N] f32;
 *   d_input_v_state [nseq,H,P] f32  (all three NULL exactly when d_issm_state is NULL)
 * ------------------------------------------------------------------------------------------- */
MAMBA3_API mamba3_status mamba3_compute_ddt_dtrap_dinput_states(
    const DLTensor* dscale, const DLTensor* dgamma, const DLTensor* dt, const DLTensor* trap,
    const DLTensor* d_issm_state, const DLTensor* input_k_state, const DLTensor* input_v_state,
    const DLTensor* cu_seqlens,
    DLTensor* ddt, DLTensor* dtrap, DLTensor* d_input_ssm_state, DLTensor* d_input_k_state,
    DLTensor* d_input_v_state, void* stream);

/* ---------------------------------------------------------------------------------------------
 * MIMO backward, first pass (seed 003; upstream mamba_mimo_bwd_fwd): recomputes the chunked
 * forward from its inputs, caches what the second pass (mimo_bwd_bwd) needs, and returns the
 * gradients of the output projection / gate / pre-gate RMSNorm, which need no reverse scan.
 *
 * Sizes: B batch, S sequence (any S >= 1; need not be a multiple of C), H heads, G q/k heads
 * (H % G == 0, head h reads q/k head g = h / (H/G)), N = headdim_qk (even, <= 256, a multiple of
 * rotary_dim_divisor), P = headdim_v (1..256), R = MIMO rank (1..8), C = chunk_size in
 * {8, 16, 32, 64}, nchunks = ceil(S / C), A = N / rotary_dim_divisor (divisor 2 or 4).
 * Inputs (each float tensor any of f16 / bf16 / f32, arbitrary strides):
 *   dout        [B,S,H,P] with mimo_o (reduce-O); [B,S,R,H,P] (per-rank) when mimo_o is NULL
 *   q, k        [B,S,R,G,N]
 *   v           [B,S,H,P]
 *   q_bias, k_bias [H,R,N]
 *   mimo_v      [H,R,P]  (Psi);  mimo_o [H,R,P] (Phi) or NULL;  mimo_z [H,R,P] (Zeta) or NULL
 *   angles      [B,S,H,A]  accumulated angles; pairs (i, N/2 + i), i < A, are rotated
 *   da_cs, da_cs_rev, dt, trap [B,H,S]  (trap pre-sigmoid)
 *   segsum      [B,H,nchunks,C,C]  (only the strictly lower triangle is read)
 *   d           [H] or NULL (D skip)
 *   z           [B,S,H,P] or NULL; z and mimo_z are given together (SiLU gate silu(z * mimo_z))
 *   norm_weight [H,P] or NULL: fused pre-gate headwise RMSNorm, y -> y / sqrt(mean_p y^2 +
 *               norm_eps) * norm_weight before the gate; requires mimo_o, z and mimo_z.
 *   norm_eps    > 0, read only with norm_weight
 * Model: golden/include/mamba3_golden/mimo.hpp (y^r = per-rank readout before norm / gate;
 *   out = sum_r mimo_o^r gate^r y^r, or gate^r y^r per rank without mimo_o).
 * Partial last chunk (S % C != 0): handled by the operator as if every sequence input were
 *   zero-padded to nchunks*C, da_cs padded with its last value and the last chunk's da_cs_rev and
 *   segsum rebuilt from it; the caller's segsum / da_cs_rev entries of that chunk are not read.
 * Outputs (output dtype = the dtype of `states`, one of f16 / bf16 / f32):
 *   states       [B,H,nchunks,N,P]  output dtype: the state entering each chunk
 *   qk_dot       [B,H,S,R,R]        output dtype: (q^r + q_bias^r) . (k^r' + k_bias^r')
 *   dmimo_o      [B,H,R,P]  f32, per batch (sum over B for the mimo_o gradient); given exactly
 *                when mimo_o is given
 *   dmimo_z      [B,H,R,P]  f32, per batch; dz [B,S,H,P] output dtype; given exactly when z is
 *   dnorm_weight [B,H,R,P]  f32, per batch and rank (sum over B and R for the norm_weight
 *                gradient); dout_pre_rms [B,H,S*R,P] output dtype, row t*R + r = the gradient
 *                w.r.t. y^r_t (the dout of the second pass); both given exactly with norm_weight
 * All gradients are of sum(dout * out). Accumulation is float32; results are deterministic.
 * mamba3_mimo_bwd_fwd_workspace_size takes the same tensors (reading only their metadata) and
 * reports the CUDA workspace; it is 0 on the CPU.
 * ------------------------------------------------------------------------------------------- */
MAMBA3_API mamba3_status mamba3_mimo_bwd_fwd_workspace_size(
    const DLTensor* dout, const DLTensor* q, const DLTensor* k, const DLTensor* v,
    const DLTensor* q_bias, const DLTensor* k_bias, const DLTensor* mimo_v, const DLTensor* mimo_o,
    const DLTensor* angles, const DLTensor* da_cs, const DLTensor* da_cs_rev, const DLTensor* dt,
    const DLTensor* trap, const DLTensor* segsum, const DLTensor* mimo_z, const DLTensor* d,
    const DLTensor* z, const DLTensor* norm_weight, double norm_eps, int64_t chunk_size,
    int64_t rotary_dim_divisor, const DLTensor* states, const DLTensor* qk_dot,
    const DLTensor* dmimo_o, const DLTensor* dmimo_z, const DLTensor* dz,
    const DLTensor* dnorm_weight, const DLTensor* dout_pre_rms, size_t* workspace_bytes);

MAMBA3_API mamba3_status mamba3_mimo_bwd_fwd(
    const DLTensor* dout, const DLTensor* q, const DLTensor* k, const DLTensor* v,
    const DLTensor* q_bias, const DLTensor* k_bias, const DLTensor* mimo_v, const DLTensor* mimo_o,
    const DLTensor* angles, const DLTensor* da_cs, const DLTensor* da_cs_rev, const DLTensor* dt,
    const DLTensor* trap, const DLTensor* segsum, const DLTensor* mimo_z, const DLTensor* d,
    const DLTensor* z, const DLTensor* norm_weight, double norm_eps, int64_t chunk_size,
    int64_t rotary_dim_divisor, DLTensor* states, DLTensor* qk_dot, DLTensor* dmimo_o,
    DLTensor* dmimo_z, DLTensor* dz, DLTensor* dnorm_weight, DLTensor* dout_pre_rms,
    void* workspace, size_t workspace_bytes, void* stream);

#ifdef __cplusplus
}
#endif

#endif /* MAMBA3_MAMBA3_H_ */
