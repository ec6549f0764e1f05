#include "core/siso_bwd_params.hpp"

#include "core/check.hpp"

namespace mamba3 {

bool dqktheta_chunk_size_allowed(int64_t c) {
  return c == 16 || c == 32 || c == 64 || c == 128 || c == 256;
}

DqkthetaParams make_dqktheta_params(
    const DLTensor* q, const DLTensor* k, const DLTensor* scale, const DLTensor* gamma,
    const DLTensor* q_bias, const DLTensor* k_bias, const DLTensor* angles,
    const DLTensor* dq_in, const DLTensor* dk_in, const DLTensor* dqk,
    const DLTensor* d_ok_state, int64_t chunk_size, const DLTensor* cu_seqlens,
    const DLTensor* dq, const DLTensor* dk, const DLTensor* dq_bias, const DLTensor* dk_bias,
    const DLTensor* dangles, const DLTensor* dscale, const DLTensor* dgamma) {
  DqkthetaParams p;
  p.q = make_view(q, "q");
  p.k = make_view(k, "k");
  p.scale = make_view(scale, "scale");
  p.gamma = make_view(gamma, "gamma");
  p.q_bias = make_view(q_bias, "q_bias");
  p.k_bias = make_view(k_bias, "k_bias");
  p.angles = make_view(angles, "angles");
  p.dq_in = make_view(dq_in, "dq_in");
  p.dk_in = make_view(dk_in, "dk_in");
  p.dqk = make_view(dqk, "dqk");
  p.d_ok_state = make_view(d_ok_state, "d_ok_state");
  p.cu_seqlens = make_view(cu_seqlens, "cu_seqlens");
  p.dq = make_view(dq, "dq");
  p.dk = make_view(dk, "dk");
  p.dq_bias = make_view(dq_bias, "dq_bias");
  p.dk_bias = make_view(dk_bias, "dk_bias");
  p.dangles = make_view(dangles, "dangles");
  p.dscale = make_view(dscale, "dscale");
  p.dgamma = make_view(dgamma, "dgamma");

  for (const TensorView* v : {&p.q, &p.k, &p.scale, &p.gamma, &p.q_bias, &p.k_bias, &p.angles,
                              &p.dq_in, &p.dk_in, &p.dqk, &p.dq, &p.dk, &p.dq_bias, &p.dk_bias,
                              &p.dangles, &p.dscale, &p.dgamma})
    check_present(*v);

  p.device = check_same_device({&p.q, &p.k, &p.scale, &p.gamma, &p.q_bias, &p.k_bias, &p.angles,
                                &p.dq_in, &p.dk_in, &p.dqk, &p.d_ok_state, &p.cu_seqlens, &p.dq,
                                &p.dk, &p.dq_bias, &p.dk_bias, &p.dangles, &p.dscale, &p.dgamma},
                               &p.device_id);

  MAMBA3_CHECK_ARG(p.q.ndim == 4, "q: expected rank 4 [B,S,G,N], got ", p.q.shape_str());
  p.B = p.q.shape[0];
  p.S = p.q.shape[1];
  p.G = p.q.shape[2];
  p.N = p.q.shape[3];
  MAMBA3_CHECK_ARG(p.scale.ndim == 3, "scale: expected rank 3 [B,H,S], got ", p.scale.shape_str());
  p.H = p.scale.shape[1];
  MAMBA3_CHECK_ARG(p.angles.ndim == 4, "angles: expected rank 4 [B,S,H,A], got ",
                   p.angles.shape_str());
  p.A = p.angles.shape[3];

  MAMBA3_CHECK_ARG(p.B >= 1 && p.S >= 1 && p.G >= 1 && p.H >= 1, "q/scale: B, S, G and H must be ",
                   ">= 1 (got B=", p.B, ", S=", p.S, ", G=", p.G, ", H=", p.H, ")");
  MAMBA3_CHECK_ARG(p.H % p.G == 0, "scale/q: number of heads H=", p.H,
                   " must be a multiple of the number of q/k heads G=", p.G, " (H % G != 0)");
  MAMBA3_CHECK_ARG(p.N >= 2 && p.N % 2 == 0, "q: headdim_qk N=", p.N, " must be even and >= 2");
  MAMBA3_CHECK_ARG(p.N <= 256, "q: headdim_qk N=", p.N, " is larger than the supported 256");
  MAMBA3_CHECK_ARG(p.A >= 1 && p.A <= p.N / 2, "angles: number of rotated pairs A=", p.A,
                   " must satisfy 1 <= A <= N/2 = ", p.N / 2);
  MAMBA3_CHECK_ARG(dqktheta_chunk_size_allowed(chunk_size), "chunk_size=", chunk_size,
                   " is not allowed (expected 16, 32, 64, 128 or 256)");
  p.chunk_size = chunk_size;

  const int64_t B = p.B, S = p.S, G = p.G, H = p.H, N = p.N, A = p.A;
  check_shape(p.q, {B, S, G, N}, {"B", "S", "G", "N"});
  check_shape(p.k, {B, S, G, N}, {"B", "S", "G", "N"});
  check_shape(p.scale, {B, H, S}, {"B", "H", "S"});
  check_shape(p.gamma, {B, H, S}, {"B", "H", "S"});
  check_shape(p.q_bias, {H, N}, {"H", "N"});
  check_shape(p.k_bias, {H, N}, {"H", "N"});
  check_shape(p.angles, {B, S, H, A}, {"B", "S", "H", "A"});
  check_shape(p.dq_in, {B, S, H, N}, {"B", "S", "H", "N"});
  check_shape(p.dk_in, {B, S, H, N}, {"B", "S", "H", "N"});
  check_shape(p.dqk, {B, H, S}, {"B", "H", "S"});

  check_float_io(p.q);
  check_dtype_eq(p.k, p.q.dtype);
  check_float_io(p.dq_in);
  check_dtype_eq(p.dk_in, p.dq_in.dtype);
  for (const TensorView* v : {&p.scale, &p.gamma, &p.q_bias, &p.k_bias, &p.angles, &p.dqk})
    check_float_io(*v);

  p.varlen = p.cu_seqlens.present();
  if (p.varlen) {
    check_cu_seqlens_meta(p.cu_seqlens);
    MAMBA3_CHECK_ARG(B == 1, "cu_seqlens: varlen mode needs batch B=1, got B=", B);
    p.nseq = p.cu_seqlens.shape[0] - 1;
    if (p.device == DeviceKind::CPU) check_cu_seqlens_values_host(p.cu_seqlens, S);
  } else {
    p.nseq = B;
  }
  p.has_dok = p.d_ok_state.present();
  if (p.has_dok) {
    check_shape(p.d_ok_state, {p.nseq, H, N}, {"nseq", "H", "N"});
    check_float_io(p.d_ok_state);
  }

  check_shape(p.dq, {B, S, G, N}, {"B", "S", "G", "N"});
  check_shape(p.dk, {B, S, G, N}, {"B", "S", "G", "N"});
  check_shape(p.dq_bias, {H, N}, {"H", "N"});
  check_shape(p.dk_bias, {H, N}, {"H", "N"});
  check_shape(p.dangles, {B, S, H, A}, {"B", "S", "H", "A"});
  check_shape(p.dscale, {B, H, S}, {"B", "H", "S"});
  check_shape(p.dgamma, {B, H, S}, {"B", "H", "S"});
  check_dtype_eq(p.dq, p.dq_in.dtype);
  check_dtype_eq(p.dk, p.dq_in.dtype);
  check_dtype_eq(p.dq_bias, DType::F32);
  check_dtype_eq(p.dk_bias, DType::F32);
  check_dtype_eq(p.dangles, p.angles.dtype);
  check_dtype_eq(p.dscale, p.scale.dtype);
  check_dtype_eq(p.dgamma, p.gamma.dtype);
  return p;
}

DdtDtrapParams make_ddt_dtrap_params(
    const DLTensor* dscale, const DLTensor* dgamma, const DLTensor* dt, const DLTensor* trap,
    const DLTensor* d_issm_state, const DLTensor* input_k_state, const DLTensor* input_v_state,
    const DLTensor* cu_seqlens, const DLTensor* ddt, const DLTensor* dtrap,
    const DLTensor* d_input_ssm_state, const DLTensor* d_input_k_state,
    const DLTensor* d_input_v_state) {
  DdtDtrapParams p;
  p.dscale = make_view(dscale, "dscale");
  p.dgamma = make_view(dgamma, "dgamma");
  p.dt = make_view(dt, "dt");
  p.trap = make_view(trap, "trap");
  p.d_issm_state = make_view(d_issm_state, "d_issm_state");
  p.input_k_state = make_view(input_k_state, "input_k_state");
  p.input_v_state = make_view(input_v_state, "input_v_state");
  p.cu_seqlens = make_view(cu_seqlens, "cu_seqlens");
  p.ddt = make_view(ddt, "ddt");
  p.dtrap = make_view(dtrap, "dtrap");
  p.d_input_ssm_state = make_view(d_input_ssm_state, "d_input_ssm_state");
  p.d_input_k_state = make_view(d_input_k_state, "d_input_k_state");
  p.d_input_v_state = make_view(d_input_v_state, "d_input_v_state");

  for (const TensorView* v : {&p.dscale, &p.dgamma, &p.dt, &p.trap, &p.ddt, &p.dtrap})
    check_present(*v);
  p.device = check_same_device({&p.dscale, &p.dgamma, &p.dt, &p.trap, &p.d_issm_state,
                                &p.input_k_state, &p.input_v_state, &p.cu_seqlens, &p.ddt,
                                &p.dtrap, &p.d_input_ssm_state, &p.d_input_k_state,
                                &p.d_input_v_state},
                               &p.device_id);

  MAMBA3_CHECK_ARG(p.dscale.ndim == 3, "dscale: expected rank 3 [B,H,S], got ",
                   p.dscale.shape_str());
  p.B = p.dscale.shape[0];
  p.H = p.dscale.shape[1];
  p.S = p.dscale.shape[2];
  MAMBA3_CHECK_ARG(p.B >= 1 && p.H >= 1 && p.S >= 1, "dscale: B, H and S must be >= 1, got ",
                   p.dscale.shape_str());
  const int64_t B = p.B, H = p.H, S = p.S;
  for (const TensorView* v : {&p.dscale, &p.dgamma, &p.dt, &p.trap}) {
    check_shape(*v, {B, H, S}, {"B", "H", "S"});
    check_float_io(*v);
  }
  check_shape(p.ddt, {B, H, S}, {"B", "H", "S"});
  check_shape(p.dtrap, {B, H, S}, {"B", "H", "S"});
  check_dtype_eq(p.ddt, DType::F32);
  check_dtype_eq(p.dtrap, DType::F32);

  p.varlen = p.cu_seqlens.present();
  if (p.varlen) {
    check_cu_seqlens_meta(p.cu_seqlens);
    MAMBA3_CHECK_ARG(B == 1, "cu_seqlens: varlen mode needs batch B=1, got B=", B);
    p.nseq = p.cu_seqlens.shape[0] - 1;
    if (p.device == DeviceKind::CPU) check_cu_seqlens_values_host(p.cu_seqlens, S);
  } else {
    p.nseq = B;
  }

  p.has_state = p.d_issm_state.present();
  if (p.has_state) {
    MAMBA3_CHECK_ARG(p.input_k_state.present() && p.input_v_state.present(),
                     "input_k_state and input_v_state are required when d_issm_state is given");
    MAMBA3_CHECK_ARG(p.d_issm_state.ndim == 4, "d_issm_state: expected rank 4 [nseq,H,P,N], got ",
                     p.d_issm_state.shape_str());
    p.P = p.d_issm_state.shape[2];
    p.N = p.d_issm_state.shape[3];
    MAMBA3_CHECK_ARG(p.P >= 1 && p.N >= 1, "d_issm_state: P and N must be >= 1, got ",
                     p.d_issm_state.shape_str());
    check_shape(p.d_issm_state, {p.nseq, H, p.P, p.N}, {"nseq", "H", "P", "N"});
    check_shape(p.input_k_state, {p.nseq, H, p.N}, {"nseq", "H", "N"});
    check_shape(p.input_v_state, {p.nseq, H, p.P}, {"nseq", "H", "P"});
    check_float_io(p.d_issm_state);
    check_float_io(p.input_k_state);
    check_float_io(p.input_v_state);
    for (const TensorView* v : {&p.d_input_ssm_state, &p.d_input_k_state, &p.d_input_v_state})
      MAMBA3_CHECK_ARG(v->present(), v->name, " is required when d_issm_state is given");
    check_shape(p.d_input_ssm_state, {p.nseq, H, p.P, p.N}, {"nseq", "H", "P", "N"});
    check_shape(p.d_input_k_state, {p.nseq, H, p.N}, {"nseq", "H", "N"});
    check_shape(p.d_input_v_state, {p.nseq, H, p.P}, {"nseq", "H", "P"});
    check_dtype_eq(p.d_input_ssm_state, p.d_issm_state.dtype);
    check_dtype_eq(p.d_input_k_state, DType::F32);
    check_dtype_eq(p.d_input_v_state, DType::F32);
  } else {
    for (const TensorView* v : {&p.input_k_state, &p.input_v_state, &p.d_input_ssm_state,
                                &p.d_input_k_state, &p.d_input_v_state})
      MAMBA3_CHECK_ARG(!v->present(), v->name, " must be NULL when d_issm_state is not given");
  }
  return p;
}

}  // namespace mamba3
