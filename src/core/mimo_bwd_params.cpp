#include "core/mimo_bwd_params.hpp"

#include <cmath>

#include "core/check.hpp"
#include "core/mimo_common_checks.hpp"

namespace mamba3 {

bool mimo_chunk_size_allowed(int64_t c) { return c == 8 || c == 16 || c == 32 || c == 64; }

namespace {

// An output that exists exactly when a feature is on: required with it, NULL without it, so a
// caller never believes a gradient was written that was not (or passes buffers for nothing).
void check_output_presence(const TensorView& v, bool wanted, const char* input) {
  if (wanted)
    MAMBA3_CHECK_ARG(v.present(), v.name, " is required when ", input, " is given (got NULL)");
  else
    MAMBA3_CHECK_ARG(!v.present(), v.name, " must be NULL when ", input, " is NULL");
}

}  // namespace

MimoBwdFwdParams make_mimo_bwd_fwd_params(
    const DLTensor* dout, const DLTensor* q, const DLTensor* k, const DLTensor* v,
    const DLTensor* q_bias, const DLTensor* k_bias, const DLTensor* mimo_v, const DLTensor* mimo_o,
    const DLTensor* angles, const DLTensor* da_cs, const DLTensor* da_cs_rev, const DLTensor* dt,
    const DLTensor* trap, const DLTensor* segsum, const DLTensor* mimo_z, const DLTensor* d,
    const DLTensor* z, const DLTensor* norm_weight, double norm_eps, int64_t chunk_size,
    int64_t rotary_dim_divisor, const DLTensor* states, const DLTensor* qk_dot,
    const DLTensor* dmimo_o, const DLTensor* dmimo_z, const DLTensor* dz,
    const DLTensor* dnorm_weight, const DLTensor* dout_pre_rms) {
  MimoBwdFwdParams p;
  p.dout = make_view(dout, "dout");
  p.q = make_view(q, "q");
  p.k = make_view(k, "k");
  p.v = make_view(v, "v");
  p.q_bias = make_view(q_bias, "q_bias");
  p.k_bias = make_view(k_bias, "k_bias");
  p.mimo_v = make_view(mimo_v, "mimo_v");
  p.mimo_o = make_view(mimo_o, "mimo_o");
  p.angles = make_view(angles, "angles");
  p.da_cs = make_view(da_cs, "da_cs");
  p.da_cs_rev = make_view(da_cs_rev, "da_cs_rev");
  p.dt = make_view(dt, "dt");
  p.trap = make_view(trap, "trap");
  p.segsum = make_view(segsum, "segsum");
  p.mimo_z = make_view(mimo_z, "mimo_z");
  p.d = make_view(d, "d");
  p.z = make_view(z, "z");
  p.norm_weight = make_view(norm_weight, "norm_weight");
  p.states = make_view(states, "states");
  p.qk_dot = make_view(qk_dot, "qk_dot");
  p.dmimo_o = make_view(dmimo_o, "dmimo_o");
  p.dmimo_z = make_view(dmimo_z, "dmimo_z");
  p.dz = make_view(dz, "dz");
  p.dnorm_weight = make_view(dnorm_weight, "dnorm_weight");
  p.dout_pre_rms = make_view(dout_pre_rms, "dout_pre_rms");

  for (const TensorView* t : {&p.dout, &p.q, &p.k, &p.v, &p.q_bias, &p.k_bias, &p.mimo_v,
                              &p.angles, &p.da_cs, &p.da_cs_rev, &p.dt, &p.trap, &p.segsum,
                              &p.states, &p.qk_dot})
    check_present(*t);

  p.device = check_same_device(
      {&p.q, &p.dout, &p.k, &p.v, &p.q_bias, &p.k_bias, &p.mimo_v, &p.mimo_o, &p.angles, &p.da_cs,
       &p.da_cs_rev, &p.dt, &p.trap, &p.segsum, &p.mimo_z, &p.d, &p.z, &p.norm_weight, &p.states,
       &p.qk_dot, &p.dmimo_o, &p.dmimo_z, &p.dz, &p.dnorm_weight, &p.dout_pre_rms},
      &p.device_id);

  check_mimo_shared_inputs(p, chunk_size, rotary_dim_divisor);

  const int64_t B = p.B, S = p.S, H = p.H, N = p.N, P = p.P, R = p.R;
  const int64_t nch = p.nchunks;
  p.reduce_o = p.mimo_o.present();
  if (p.reduce_o)
    check_shape(p.dout, {B, S, H, P}, {"B", "S", "H", "P"});
  else
    check_shape(p.dout, {B, S, R, H, P}, {"B", "S", "R", "H", "P"});
  if (p.reduce_o) check_shape(p.mimo_o, {H, R, P}, {"H", "R", "P"});

  // The gate needs both of its factors; one alone is no valid configuration.
  MAMBA3_CHECK_ARG(
      p.z.present() == p.mimo_z.present(),
      "z and mimo_z must be given together (SiLU gate silu(z * mimo_z)), but ",
      p.z.present() ? "z is given and mimo_z is NULL" : "mimo_z is given and z is NULL");
  p.has_z = p.z.present();
  if (p.has_z) {
    check_shape(p.z, {B, S, H, P}, {"B", "S", "H", "P"});
    check_shape(p.mimo_z, {H, R, P}, {"H", "R", "P"});
  }
  p.has_d = p.d.present();
  if (p.has_d) check_shape(p.d, {H}, {"H"});
  p.has_norm = p.norm_weight.present();
  if (p.has_norm) {
    MAMBA3_CHECK_ARG(p.reduce_o, "norm_weight (fused pre-gate headwise RMSNorm) requires mimo_o ",
                     "(reduce-O), but mimo_o is NULL");
    MAMBA3_CHECK_ARG(p.has_z,
                     "norm_weight (fused pre-gate headwise RMSNorm) requires z and mimo_z,",
                     " but they are NULL");
    check_shape(p.norm_weight, {H, P}, {"H", "P"});
    MAMBA3_CHECK_ARG(std::isfinite(norm_eps) && norm_eps > 0, "norm_eps=", norm_eps,
                     " must be finite and > 0");
    p.norm_eps = norm_eps;
  }

  for (const TensorView* t :
       {&p.dout, &p.q, &p.k, &p.v, &p.q_bias, &p.k_bias, &p.mimo_v, &p.mimo_o, &p.angles, &p.da_cs,
        &p.da_cs_rev, &p.dt, &p.trap, &p.segsum, &p.mimo_z, &p.d, &p.z, &p.norm_weight})
    if (t->present()) check_float_io(*t);

  // Outputs. The output dtype is the one of states; qk_dot, dz and dout_pre_rms share it.
  check_shape(p.states, {B, H, nch, N, P}, {"B", "H", "nchunks", "N", "P"});
  check_float_io(p.states);
  p.output_dtype = p.states.dtype;
  auto check_out_dtype = [&](const TensorView& t) {
    MAMBA3_CHECK_ARG(t.dtype == p.output_dtype, t.name, ": expected dtype ",
                     dtype_name(p.output_dtype), " (the output dtype, taken from states), got ",
                     dtype_name(t.dtype));
  };
  check_shape(p.qk_dot, {B, H, S, R, R}, {"B", "H", "S", "R", "R"});
  check_out_dtype(p.qk_dot);

  check_output_presence(p.dmimo_o, p.reduce_o, "mimo_o");
  if (p.reduce_o) {
    check_shape(p.dmimo_o, {B, H, R, P}, {"B", "H", "R", "P"});
    check_dtype_eq(p.dmimo_o, DType::F32);
  }
  check_output_presence(p.dmimo_z, p.has_z, "z");
  check_output_presence(p.dz, p.has_z, "z");
  if (p.has_z) {
    check_shape(p.dmimo_z, {B, H, R, P}, {"B", "H", "R", "P"});
    check_dtype_eq(p.dmimo_z, DType::F32);
    check_shape(p.dz, {B, S, H, P}, {"B", "S", "H", "P"});
    check_out_dtype(p.dz);
  }
  check_output_presence(p.dnorm_weight, p.has_norm, "norm_weight");
  check_output_presence(p.dout_pre_rms, p.has_norm, "norm_weight");
  if (p.has_norm) {
    check_shape(p.dnorm_weight, {B, H, R, P}, {"B", "H", "R", "P"});
    check_dtype_eq(p.dnorm_weight, DType::F32);
    check_shape(p.dout_pre_rms, {B, H, S * R, P}, {"B", "H", "S*R", "P"});
    check_out_dtype(p.dout_pre_rms);
  }
  return p;
}

}  // namespace mamba3
