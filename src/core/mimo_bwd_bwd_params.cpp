#include "core/mimo_bwd_bwd_params.hpp"

#include "core/check.hpp"
#include "core/mimo_common_checks.hpp"
#include "core/mimo_bwd_params.hpp"  // mimo_chunk_size_allowed

namespace mamba3 {

MimoBwdBwdParams make_mimo_bwd_bwd_params(
    const DLTensor* dout, const DLTensor* q, const DLTensor* k, const DLTensor* v,
    const DLTensor* q_bias, const DLTensor* k_bias, const DLTensor* mimo_v, const DLTensor* states,
    const DLTensor* qk_dot, const DLTensor* da_cs, const DLTensor* da_cs_rev, const DLTensor* dt,
    const DLTensor* trap, const DLTensor* segsum, const DLTensor* angles, const DLTensor* mimo_o,
    const DLTensor* d, int64_t chunk_size, int64_t rotary_dim_divisor, const DLTensor* dq,
    const DLTensor* dk, const DLTensor* dv, const DLTensor* dmimo_v, const DLTensor* dangles,
    const DLTensor* dfactor, const DLTensor* dgamma, const DLTensor* dda, const DLTensor* dssda,
    const DLTensor* dda_cs_rev, const DLTensor* dda_cs, const DLTensor* dd) {
  MimoBwdBwdParams p;
  p.dout = make_view(dout, "dout");
  p.q = make_view(q, "q");
  p.k = make_view(k, "k");
  p.v = make_view(v, "v");
  p.q_bias = make_view(q_bias, "q_bias");
  p.k_bias = make_view(k_bias, "k_bias");
  p.mimo_v = make_view(mimo_v, "mimo_v");
  p.states = make_view(states, "states");
  p.qk_dot = make_view(qk_dot, "qk_dot");
  p.da_cs = make_view(da_cs, "da_cs");
  p.da_cs_rev = make_view(da_cs_rev, "da_cs_rev");
  p.dt = make_view(dt, "dt");
  p.trap = make_view(trap, "trap");
  p.segsum = make_view(segsum, "segsum");
  p.angles = make_view(angles, "angles");
  p.mimo_o = make_view(mimo_o, "mimo_o");
  p.d = make_view(d, "d");
  p.dq = make_view(dq, "dq");
  p.dk = make_view(dk, "dk");
  p.dv = make_view(dv, "dv");
  p.dmimo_v = make_view(dmimo_v, "dmimo_v");
  p.dangles = make_view(dangles, "dangles");
  p.dfactor = make_view(dfactor, "dfactor");
  p.dgamma = make_view(dgamma, "dgamma");
  p.dda = make_view(dda, "dda");
  p.dssda = make_view(dssda, "dssda");
  p.dda_cs_rev = make_view(dda_cs_rev, "dda_cs_rev");
  p.dda_cs = make_view(dda_cs, "dda_cs");
  p.dd = make_view(dd, "dd");

  for (const TensorView* t :
       {&p.dout,   &p.q,      &p.k,     &p.v,          &p.q_bias,  &p.k_bias,  &p.mimo_v,
        &p.states, &p.qk_dot, &p.da_cs, &p.da_cs_rev,  &p.dt,      &p.trap,    &p.segsum,
        &p.angles, &p.dq,     &p.dk,    &p.dv,         &p.dmimo_v, &p.dangles, &p.dfactor,
        &p.dgamma, &p.dda,    &p.dssda, &p.dda_cs_rev, &p.dda_cs})
    check_present(*t);

  p.device = check_same_device(
      {&p.q,      &p.dout,  &p.k,          &p.v,      &p.q_bias,  &p.k_bias,  &p.mimo_v,  &p.states,
       &p.qk_dot, &p.da_cs, &p.da_cs_rev,  &p.dt,     &p.trap,    &p.segsum,  &p.angles,  &p.mimo_o,
       &p.d,      &p.dq,    &p.dk,         &p.dv,     &p.dmimo_v, &p.dangles, &p.dfactor, &p.dgamma,
       &p.dda,    &p.dssda, &p.dda_cs_rev, &p.dda_cs, &p.dd},
      &p.device_id);

  check_mimo_shared_inputs(p, chunk_size, rotary_dim_divisor);

  const int64_t B = p.B, S = p.S, H = p.H, N = p.N, P = p.P, R = p.R, A = p.A, C = p.C;
  const int64_t nch = p.nchunks;
  // The dout layout: mimo_o selects reduce-O; without it the rank says per-rank or packed.
  if (p.mimo_o.present()) {
    p.dout_layout = MimoDout::ReduceO;
    MAMBA3_CHECK_ARG(p.dout.ndim == 4,
                     "dout: with mimo_o (reduce-O) expected rank 4 [B,S,H,P], "
                     "got ",
                     p.dout.shape_str(), " (a per-rank or packed dout needs mimo_o NULL)");
    check_shape(p.dout, {B, S, H, P}, {"B", "S", "H", "P"});
    check_shape(p.mimo_o, {H, R, P}, {"H", "R", "P"});
  } else if (p.dout.ndim == 5) {
    p.dout_layout = MimoDout::PerRank;
    check_shape(p.dout, {B, S, R, H, P}, {"B", "S", "R", "H", "P"});
  } else {
    MAMBA3_CHECK_ARG(p.dout.ndim == 4,
                     "dout: without mimo_o expected rank 5 [B,S,R,H,P] "
                     "(per rank) or rank 4 [B,H,S*R,P] (packed pre-RMS dout), got ",
                     p.dout.shape_str());
    p.dout_layout = MimoDout::Packed;
    check_shape(p.dout, {B, H, S * R, P}, {"B", "H", "S*R", "P"});
  }
  check_shape(p.states, {B, H, nch, N, P}, {"B", "H", "nchunks", "N", "P"});
  check_shape(p.qk_dot, {B, H, S, R, R}, {"B", "H", "S", "R", "R"});
  p.has_d = p.d.present();
  if (p.has_d) check_shape(p.d, {H}, {"H"});

  for (const TensorView* t :
       {&p.dout, &p.q, &p.k, &p.v, &p.q_bias, &p.k_bias, &p.mimo_v, &p.states, &p.qk_dot, &p.da_cs,
        &p.da_cs_rev, &p.dt, &p.trap, &p.segsum, &p.angles, &p.mimo_o, &p.d})
    if (t->present()) check_float_io(*t);

  // Outputs: dq, dk, dv in any I/O dtype (upstream: their inputs' dtype, or output_dtype); the
  // other gradients are f32.
  check_shape(p.dq, {B, S * R, H, N}, {"B", "S*R", "H", "N"});
  check_shape(p.dk, {B, S * R, H, N}, {"B", "S*R", "H", "N"});
  check_shape(p.dv, {B, S, H, P}, {"B", "S", "H", "P"});
  for (const TensorView* t : {&p.dq, &p.dk, &p.dv}) check_float_io(*t);
  check_shape(p.dmimo_v, {B, H, R, P}, {"B", "H", "R", "P"});
  check_shape(p.dangles, {B, S, H, A}, {"B", "S", "H", "A"});
  for (const TensorView* t : {&p.dfactor, &p.dgamma, &p.dda, &p.dda_cs_rev, &p.dda_cs})
    check_shape(*t, {B, H, S}, {"B", "H", "S"});
  check_shape(p.dssda, {B, H, nch, C, C}, {"B", "H", "nchunks", "C", "C"});
  if (p.has_d) {
    MAMBA3_CHECK_ARG(p.dd.present(), "dd is required when d is given (got NULL)");
    check_shape(p.dd, {B, H}, {"B", "H"});
  } else {
    MAMBA3_CHECK_ARG(!p.dd.present(), "dd must be NULL when d is NULL");
  }
  for (const TensorView* t : {&p.dmimo_v, &p.dangles, &p.dfactor, &p.dgamma, &p.dda, &p.dssda,
                              &p.dda_cs_rev, &p.dda_cs, &p.dd})
    if (t->present()) check_dtype_eq(*t, DType::F32);
  return p;
}

}  // namespace mamba3
