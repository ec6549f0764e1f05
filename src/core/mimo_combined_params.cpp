#include "core/mimo_combined_params.hpp"

#include <vector>

#include "core/check.hpp"

namespace mamba3 {

namespace {

// A descriptor of one first-pass intermediate (f32, compact) that only takes part in the checks.
struct Internal {
  std::vector<int64_t> shape;
  DLTensor t{};
  Internal(std::vector<int64_t> s, DLDevice dev) : shape(std::move(s)) {
    static char placeholder;  // never read or written: backends swap in their own scratch
    t.data = &placeholder;
    t.device = dev;
    t.ndim = static_cast<int32_t>(shape.size());
    t.dtype = DLDataType{kDLFloat, 32, 1};
    t.shape = shape.data();
    t.strides = nullptr;
    t.byte_offset = 0;
  }
};

void check_output_presence(const TensorView& v, bool wanted, const char* input) {
  if (wanted)
    MAMBA3_CHECK_ARG(v.present(), v.name, " is required when ", input, " is given (got NULL)");
  else
    MAMBA3_CHECK_ARG(!v.present(), v.name, " must be NULL when ", input, " is NULL");
}

}  // namespace

MimoCombinedParams make_mimo_combined_params(
    const DLTensor* dout, const DLTensor* q, const DLTensor* k, const DLTensor* v,
    const DLTensor* q_bias, const DLTensor* k_bias, const DLTensor* mimo_v, const DLTensor* mimo_o,
    const DLTensor* z, const DLTensor* mimo_z, const DLTensor* angles, const DLTensor* da_cs,
    const DLTensor* da_cs_rev, const DLTensor* dt, const DLTensor* trap, const DLTensor* d,
    const DLTensor* segsum, int64_t chunk_size, int64_t rotary_dim_divisor,
    const DLTensor* norm_weight, double norm_eps, const DLTensor* dq, const DLTensor* dk,
    const DLTensor* dv, const DLTensor* dadt, const DLTensor* ddt, const DLTensor* dtrap,
    const DLTensor* dq_bias, const DLTensor* dk_bias, const DLTensor* dmimo_v,
    const DLTensor* dmimo_z, const DLTensor* dmimo_o, const DLTensor* dangles, const DLTensor* dd,
    const DLTensor* dz, const DLTensor* dnorm_weight) {
  // Tentative sizes for the intermediates' descriptors. Were q or v malformed, the first pass's
  // checks report them before they look at these.
  int64_t B = 1, S = 1, R = 1, G = 1, N = 2, H = 1, P = 1;
  if (q && q->ndim == 5 && q->shape)
    B = q->shape[0], S = q->shape[1], R = q->shape[2], G = q->shape[3], N = q->shape[4];
  if (v && v->ndim == 4 && v->shape) H = v->shape[2], P = v->shape[3];
  (void)G;
  const int64_t nch = chunk_size > 0 ? (S + chunk_size - 1) / chunk_size : 1;
  const DLDevice dev = q ? q->device : DLDevice{kDLCPU, 0};
  Internal states({B, H, nch, N, P}, dev), qk_dot({B, H, S, R, R}, dev);
  Internal dmo({B, H, R, P}, dev), dmz({B, H, R, P}, dev), dzi({B, S, H, P}, dev);
  Internal dnw({B, H, R, P}, dev), dpre({B, H, S * R, P}, dev);

  MimoCombinedParams p;
  p.fwd = make_mimo_bwd_fwd_params(
      dout, q, k, v, q_bias, k_bias, mimo_v, mimo_o, angles, da_cs, da_cs_rev, dt, trap, segsum,
      mimo_z, d, z, norm_weight, norm_eps, chunk_size, rotary_dim_divisor, &states.t, &qk_dot.t,
      mimo_o ? &dmo.t : nullptr, z ? &dmz.t : nullptr, z ? &dzi.t : nullptr,
      norm_weight ? &dnw.t : nullptr, norm_weight ? &dpre.t : nullptr);
  const MimoBwdFwdParams& f = p.fwd;

  p.dq = make_view(dq, "dq");
  p.dk = make_view(dk, "dk");
  p.dv = make_view(dv, "dv");
  p.dadt = make_view(dadt, "dadt");
  p.ddt = make_view(ddt, "ddt");
  p.dtrap = make_view(dtrap, "dtrap");
  p.dq_bias = make_view(dq_bias, "dq_bias");
  p.dk_bias = make_view(dk_bias, "dk_bias");
  p.dmimo_v = make_view(dmimo_v, "dmimo_v");
  p.dmimo_z = make_view(dmimo_z, "dmimo_z");
  p.dmimo_o = make_view(dmimo_o, "dmimo_o");
  p.dangles = make_view(dangles, "dangles");
  p.dd = make_view(dd, "dd");
  p.dz = make_view(dz, "dz");
  p.dnorm_weight = make_view(dnorm_weight, "dnorm_weight");
  for (const TensorView* t : {&p.dq, &p.dk, &p.dv, &p.dadt, &p.ddt, &p.dtrap, &p.dq_bias,
                              &p.dk_bias, &p.dmimo_v, &p.dangles})
    check_present(*t);
  check_output_presence(p.dmimo_o, f.reduce_o, "mimo_o");
  check_output_presence(p.dmimo_z, f.has_z, "z");
  check_output_presence(p.dz, f.has_z, "z");
  check_output_presence(p.dd, f.has_d, "d");
  check_output_presence(p.dnorm_weight, f.has_norm, "norm_weight");
  TensorView first = f.q;  // the inputs' device, checked against every output
  int id = 0;
  check_same_device({&first, &p.dq, &p.dk, &p.dv, &p.dadt, &p.ddt, &p.dtrap, &p.dq_bias, &p.dk_bias,
                     &p.dmimo_v, &p.dmimo_z, &p.dmimo_o, &p.dangles, &p.dd, &p.dz, &p.dnorm_weight},
                    &id);

  const int64_t Hh = f.H, A = f.A;
  check_shape(p.dq, {f.B, f.S, f.R, f.G, f.N}, {"B", "S", "R", "G", "N"});
  check_shape(p.dk, {f.B, f.S, f.R, f.G, f.N}, {"B", "S", "R", "G", "N"});
  check_shape(p.dv, {f.B, f.S, Hh, f.P}, {"B", "S", "H", "P"});
  for (const TensorView* t : {&p.dadt, &p.ddt, &p.dtrap})
    check_shape(*t, {f.B, Hh, f.S}, {"B", "H", "S"});
  check_shape(p.dq_bias, {Hh, f.R, f.N}, {"H", "R", "N"});
  check_shape(p.dk_bias, {Hh, f.R, f.N}, {"H", "R", "N"});
  check_shape(p.dmimo_v, {Hh, f.R, f.P}, {"H", "R", "P"});
  if (f.has_z) {
    check_shape(p.dmimo_z, {Hh, f.R, f.P}, {"H", "R", "P"});
    check_shape(p.dz, {f.B, f.S, Hh, f.P}, {"B", "S", "H", "P"});
  }
  if (f.reduce_o) check_shape(p.dmimo_o, {Hh, f.R, f.P}, {"H", "R", "P"});
  check_shape(p.dangles, {f.B, f.S, Hh, A}, {"B", "S", "H", "A"});
  if (f.has_d) check_shape(p.dd, {Hh}, {"H"});
  if (f.has_norm) check_shape(p.dnorm_weight, {Hh, f.P}, {"H", "P"});
  for (const TensorView* t : {&p.dq, &p.dk, &p.dv, &p.dz})
    if (t->present()) check_float_io(*t);
  for (const TensorView* t : {&p.dadt, &p.ddt, &p.dtrap, &p.dq_bias, &p.dk_bias, &p.dmimo_v,
                              &p.dmimo_z, &p.dmimo_o, &p.dangles, &p.dd, &p.dnorm_weight})
    if (t->present()) check_dtype_eq(*t, DType::F32);
  // The intermediates' views must not outlive the descriptors above: clear them here; the
  // backend builds its own.
  for (TensorView* t : {&p.fwd.states, &p.fwd.qk_dot, &p.fwd.dmimo_o, &p.fwd.dmimo_z, &p.fwd.dz,
                        &p.fwd.dnorm_weight, &p.fwd.dout_pre_rms})
    t->data = nullptr;
  return p;
}

}  // namespace mamba3
