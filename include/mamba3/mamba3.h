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

/* ---------------------------------------------------------------------------------------------
 * MIMO backward, second pass (seed 001; upstream mamba_mimo_bwd_bwd): the reverse scan over
 * chunks that consumes the first pass's `states` and `qk_dot` and returns the gradients w.r.t.
 * q, k, v, mimo_v, angles, D and the discretization factors.
 *
 * Sizes as for mamba3_mimo_bwd_fwd (B, S, H, G, N <= 256 even, P <= 256, R <= 8,
 * C = chunk_size in {8, 16, 32, 64}, nchunks = ceil(S / C), A = N / rotary_dim_divisor).
 * Inputs (each float tensor any of f16 / bf16 / f32, arbitrary strides):
 *   dout     one of three layouts of dL/dy^r (y^r the per-rank readout, see mimo.hpp):
 *            [B,S,H,P] with mimo_o (reduce-O: dL/dy^r = dout * mimo_o^r);
 *            [B,S,R,H,P] with mimo_o NULL (per rank);
 *            [B,H,S*R,P] with mimo_o NULL (packed: row t*R + r, the dout_pre_rms of the
 *            fused-norm first pass). There is no gate here: a gated model passes the per-rank
 *            or packed dout with the gate applied.
 *   q, k [B,S,R,G,N]; v [B,S,H,P]; q_bias, k_bias [H,R,N]; mimo_v [H,R,P]
 *   states   [B,H,nchunks,N,P]  the state entering each chunk (mamba3_mimo_bwd_fwd's output)
 *   qk_dot   [B,H,S,R,R]        (q^r + q_bias^r) . (k^r' + k_bias^r') (its output too)
 *   da_cs, da_cs_rev, dt, trap [B,H,S]; segsum [B,H,nchunks,C,C] (strictly lower triangle read);
 *   angles [B,S,H,A]; mimo_o [H,R,P] or NULL; d [H] or NULL
 * Partial last chunk: as mamba3_mimo_bwd_fwd (that chunk's segsum / da_cs_rev are not read).
 * Outputs (meaning: golden/include/mamba3_golden/mimo_bwd_bwd.hpp; all of L = sum dL/dy . y):
 *   dq, dk      [B,S*R,H,N]  f16 / bf16 / f32 each: per head (sum over the heads of a q/k group
 *               for the q / k gradient), row t*R + r
 *   dv          [B,S,H,P]    f16 / bf16 / f32
 *   dmimo_v     [B,H,R,P]    f32, per batch (sum over B)
 *   dangles     [B,S,H,A]    f32
 *   dfactor     [B,H,S]      f32  dL/dtrap_scale_t
 *   dgamma      [B,H,S]      f32  dL/dgamma_t through the diagonal (same-step) term only
 *   dda         [B,H,S]      f32  dL/d(da_cs at the chunk's last step) through the chunk decay,
 *                                 repeated at every step of the chunk
 *   dssda       [B,H,nchunks,C,C] f32  [c, s, t] = dL/dexp(segsum[c,t,s]) for s < t; the same
 *                                 product (unmasked) for s >= t; 0 past S in the last chunk
 *   dda_cs_rev  [B,H,S]      f32  dL/dexp(da_cs_rev_t)
 *   dda_cs      [B,H,S]      f32  dL/dexp(da_cs_t) through the inter-chunk readout
 *   dd          [B,H]        f32, per batch; given exactly when d is given
 * Accumulation is float32; results are deterministic. CUDA tensors run the CUDA backend on
 * `stream` with the caller's device workspace (no allocation, no host synchronisation, capturable
 * in a CUDA graph; any alignment of the workspace pointer). mamba3_mimo_bwd_bwd_workspace_size
 * takes the same tensors (reading only their metadata); it is 0 on the CPU.
 * ------------------------------------------------------------------------------------------- */
MAMBA3_API mamba3_status mamba3_mimo_bwd_bwd_workspace_size(
    const DLTensor* dout, const DLTensor* q, const DLTensor* k, const DLTensor* v,
    const DLTensor* q_bias, const DLTensor* k_bias, const DLTensor* mimo_v,
    const DLTensor* states, const DLTensor* qk_dot, const DLTensor* da_cs,
    const DLTensor* da_cs_rev, const DLTensor* dt, const DLTensor* trap, const DLTensor* segsum,
    const DLTensor* angles, const DLTensor* mimo_o, const DLTensor* d, int64_t chunk_size,
    int64_t rotary_dim_divisor, const DLTensor* dq, const DLTensor* dk, const DLTensor* dv,
    const DLTensor* dmimo_v, const DLTensor* dangles, const DLTensor* dfactor,
    const DLTensor* dgamma, const DLTensor* dda, const DLTensor* dssda,
    const DLTensor* dda_cs_rev, const DLTensor* dda_cs, const DLTensor* dd,
    size_t* workspace_bytes);

MAMBA3_API mamba3_status mamba3_mimo_bwd_bwd(
    const DLTensor* dout, const DLTensor* q, const DLTensor* k, const DLTensor* v,
    const DLTensor* q_bias, const DLTensor* k_bias, const DLTensor* mimo_v,
    const DLTensor* states, const DLTensor* qk_dot, const DLTensor* da_cs,
    const DLTensor* da_cs_rev, const DLTensor* dt, const DLTensor* trap, const DLTensor* segsum,
    const DLTensor* angles, const DLTensor* mimo_o, const DLTensor* d, int64_t chunk_size,
    int64_t rotary_dim_divisor, DLTensor* dq, DLTensor* dk, DLTensor* dv, DLTensor* dmimo_v,
    DLTensor* dangles, DLTensor* dfactor, DLTensor* dgamma, DLTensor* dda, DLTensor* dssda,
    DLTensor* dda_cs_rev, DLTensor* dda_cs, DLTensor* dd, void* workspace,
    size_t workspace_bytes, void* stream);

/* ---------------------------------------------------------------------------------------------
 * MIMO backward, combined (upstream mamba_mimo_bwd_combined): the first pass, the second pass
 * and the reductions to the gradients of the raw inputs, in one call. Inputs as for
 * mamba3_mimo_bwd_fwd (z / mimo_z gate, norm_weight for the fused pre-gate RMSNorm, d), in
 * upstream's argument order; chunk decays da_cs / da_cs_rev / segsum as compute_dacs_segsum of
 * adt gives them. Outputs (upstream's 15 gradients, in its return order; of L = sum dout . out):
 *   dq, dk       [B,S,R,G,N]  f16 / bf16 / f32 (summed over the heads of each q/k group)
 *   dv           [B,S,H,P]    f16 / bf16 / f32
 *   dadt         [B,H,S]      f32  dL/dadt (upstream's ddA; the adt = A dt share of dt and A is
 *                                  the caller's)
 *   ddt, dtrap   [B,H,S]      f32  through gamma and the trapezoid's trap_scale
 *   dq_bias, dk_bias [H,R,N]  f32
 *   dmimo_v      [H,R,P]      f32;  dmimo_z [H,R,P] f32 exactly with z; dmimo_o [H,R,P] f32
 *                                  exactly with mimo_o (all summed over the batch)
 *   dangles      [B,S,H,A]    f32
 *   dd           [H]          f32 exactly with d
 *   dz           [B,S,H,P]    f16 / bf16 / f32 exactly with z
 *   dnorm_weight [H,P]        f32 exactly with norm_weight (summed over batch and rank)
 * Meaning: golden/include/mamba3_golden/mimo_bwd_bwd.hpp (mimo_bwd_combined). The first pass's
 * intermediates are the backend's scratch: float32 in the workspace on CUDA (its size from
 * mamba3_mimo_bwd_combined_workspace_size, about 1.15 GB at B=4 S=2048 H=16 N=128 P=64 R=4 C=16:
 * the state per chunk, the per-head dq / dk and the second pass's own scratch;
 * none on the CPU).
 * ------------------------------------------------------------------------------------------- */
MAMBA3_API mamba3_status mamba3_mimo_bwd_combined_workspace_size(
    const DLTensor* dout, const DLTensor* q, const DLTensor* k, const DLTensor* v,
    const DLTensor* q_bias, const DLTensor* k_bias, const DLTensor* mimo_v, const DLTensor* mimo_o,
    const DLTensor* z, const DLTensor* mimo_z, const DLTensor* angles, const DLTensor* da_cs,
    const DLTensor* da_cs_rev, const DLTensor* dt, const DLTensor* trap, const DLTensor* d,
    const DLTensor* segsum, int64_t chunk_size, int64_t rotary_dim_divisor,
    const DLTensor* norm_weight, double norm_eps, const DLTensor* dq, const DLTensor* dk,
    const DLTensor* dv, const DLTensor* dadt, const DLTensor* ddt, const DLTensor* dtrap,
    const DLTensor* dq_bias, const DLTensor* dk_bias, const DLTensor* dmimo_v,
    const DLTensor* dmimo_z, const DLTensor* dmimo_o, const DLTensor* dangles, const DLTensor* dd,
    const DLTensor* dz, const DLTensor* dnorm_weight, size_t* workspace_bytes);

MAMBA3_API mamba3_status mamba3_mimo_bwd_combined(
    const DLTensor* dout, const DLTensor* q, const DLTensor* k, const DLTensor* v,
    const DLTensor* q_bias, const DLTensor* k_bias, const DLTensor* mimo_v, const DLTensor* mimo_o,
    const DLTensor* z, const DLTensor* mimo_z, const DLTensor* angles, const DLTensor* da_cs,
    const DLTensor* da_cs_rev, const DLTensor* dt, const DLTensor* trap, const DLTensor* d,
    const DLTensor* segsum, int64_t chunk_size, int64_t rotary_dim_divisor,
    const DLTensor* norm_weight, double norm_eps, DLTensor* dq, DLTensor* dk, DLTensor* dv,
    DLTensor* dadt, DLTensor* ddt, DLTensor* dtrap, DLTensor* dq_bias, DLTensor* dk_bias,
    DLTensor* dmimo_v, DLTensor* dmimo_z, DLTensor* dmimo_o, DLTensor* dangles, DLTensor* dd,
    DLTensor* dz, DLTensor* dnorm_weight, void* workspace, size_t workspace_bytes, void* stream);

#ifdef __cplusplus
}
#endif

#endif /* MAMBA3_MAMBA3_H_ */
