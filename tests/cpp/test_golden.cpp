// The golden library checked on its own: the analytic gradients of the two SISO backward
// operators against central finite differences of their forward relations (every element),
// the float instantiation against double, and the chunked SISO model against the sequential
// recurrence.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "mamba3_golden/host.hpp"
#include "mamba3_golden/siso_bwd.hpp"
#include "mamba3_golden/siso_model.hpp"

using namespace mamba3::golden;

namespace {

std::vector<double> rnd(std::mt19937_64& rng, int64_t n, double lo, double hi) {
  return uniform(rng, n, lo, hi, IoType::F64);
}

template <class To, class From>
std::vector<To> cast(const std::vector<From>& v) {
  return std::vector<To>(v.begin(), v.end());
}

// Central difference step and the bound on the error of each gradient element, relative to
// max(|analytic|, 1) (the gradients here are O(1), so this is a relative error for all but the
// elements that are nearly zero, where it is an absolute one). With h = 1e-6 the truncation
// error is ~h^2 = 1e-12 and the rounding error ~eps |F| / h ~ 1e-9.
constexpr double kStep = 1e-6;
constexpr double kFdTol = 1e-7;

// Checks every element of `analytic` against the central difference of f() in `x`; returns
// the largest error seen.
double fd_check(const std::string& name, std::vector<double>& x, const std::vector<double>& analytic,
                const std::function<double()>& f) {
  EXPECT_EQ(x.size(), analytic.size()) << name;
  double worst = 0;
  for (size_t i = 0; i < x.size() && i < analytic.size(); ++i) {
    const double x0 = x[i];
    x[i] = x0 + kStep;
    const double fp = f();
    x[i] = x0 - kStep;
    const double fm = f();
    x[i] = x0;
    const double fd = (fp - fm) / (2 * kStep);
    const double err = std::fabs(fd - analytic[i]) / std::max(std::fabs(analytic[i]), 1.0);
    worst = std::max(worst, err);
    EXPECT_LE(err, kFdTol) << name << "[" << i << "]: analytic " << analytic[i] << " fd " << fd;
  }
  return worst;
}

// Largest |a - b| / max|b| over a tensor (both given as double).
double max_rel(const std::vector<double>& a, const std::vector<double>& b) {
  EXPECT_EQ(a.size(), b.size());
  double e = 0, m = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    e = std::max(e, std::fabs(a[i] - b[i]));
    m = std::max(m, std::fabs(b[i]));
  }
  return m > 0 ? e / m : e;
}

// ------------------------------------------------------------------------------ dqktheta

struct DqkCase {
  int64_t B, S, G, H, N, A;
  bool dok;
  std::vector<int64_t> cu;
};

std::string case_name(const DqkCase& c) {
  char buf[160];
  std::snprintf(buf, sizeof buf, "B%ld_S%ld_G%ld_H%ld_N%ld_A%ld%s%s", (long)c.B, (long)c.S,
                (long)c.G, (long)c.H, (long)c.N, (long)c.A, c.dok ? "_dok" : "",
                c.cu.empty() ? "" : "_varlen");
  return buf;
}
void PrintTo(const DqkCase& c, std::ostream* os) { *os << case_name(c); }

DqkthetaInputs<double> make_dqk(const DqkCase& c, uint64_t seed) {
  std::mt19937_64 rng(seed);
  DqkthetaInputs<double> in;
  in.B = c.B; in.S = c.S; in.G = c.G; in.H = c.H; in.N = c.N; in.A = c.A;
  const int64_t nseq = c.cu.empty() ? c.B : static_cast<int64_t>(c.cu.size()) - 1;
  in.q = rnd(rng, c.B * c.S * c.G * c.N, -1, 1);
  in.k = rnd(rng, c.B * c.S * c.G * c.N, -1, 1);
  in.scale = rnd(rng, c.B * c.H * c.S, 0, 1);
  in.gamma = rnd(rng, c.B * c.H * c.S, 0, 1);
  in.q_bias = rnd(rng, c.H * c.N, -0.5, 0.5);
  in.k_bias = rnd(rng, c.H * c.N, -0.5, 0.5);
  in.angles = rnd(rng, c.B * c.S * c.H * c.A, 0, 6.283);
  in.dq_in = rnd(rng, c.B * c.S * c.H * c.N, -1, 1);
  in.dk_in = rnd(rng, c.B * c.S * c.H * c.N, -1, 1);
  in.dqk = rnd(rng, c.B * c.H * c.S, -1, 1);
  if (c.dok) in.d_ok_state = rnd(rng, nseq * c.H * c.N, -1, 1);
  in.cu_seqlens = c.cu;
  return in;
}

const std::vector<DqkCase> kDqkCases = {
    {2, 5, 1, 2, 4, 1, false, {}},             // A < N/2
    {2, 5, 1, 2, 4, 2, true, {}},              // A = N/2
    {2, 5, 2, 4, 8, 3, true, {}},              // GQA ratio 2, A < N/2
    {2, 5, 2, 4, 8, 4, false, {}},             // A = N/2
    {1, 7, 2, 4, 8, 4, true, {0, 3, 4, 7}},    // varlen with a length-1 sequence
    {1, 6, 1, 2, 4, 1, true, {0, 1, 6}},       // varlen, first sequence of length 1
    {1, 6, 1, 3, 8, 2, false, {0, 2, 6}},      // varlen without d_ok_state, G=1/H=3
};

class DqkthetaFD : public ::testing::TestWithParam<DqkCase> {};

TEST_P(DqkthetaFD, EveryGradientElement) {
  const DqkCase c = GetParam();
  DqkthetaInputs<double> in = make_dqk(c, 1000 + c.N * 10 + c.A);
  const DqkthetaGrads<double> g = dqktheta(in);
  auto f = [&] { return dqktheta_forward(in); };
  double worst = 0;
  worst = std::max(worst, fd_check("dq", in.q, g.dq, f));
  worst = std::max(worst, fd_check("dk", in.k, g.dk, f));
  worst = std::max(worst, fd_check("dq_bias", in.q_bias, g.dq_bias, f));
  worst = std::max(worst, fd_check("dk_bias", in.k_bias, g.dk_bias, f));
  worst = std::max(worst, fd_check("dangles", in.angles, g.dangles, f));
  worst = std::max(worst, fd_check("dscale", in.scale, g.dscale, f));
  worst = std::max(worst, fd_check("dgamma", in.gamma, g.dgamma, f));
  std::printf("[ fd       ] dqktheta %s: max error %.3g\n", case_name(c).c_str(), worst);
}

INSTANTIATE_TEST_SUITE_P(Golden, DqkthetaFD, ::testing::ValuesIn(kDqkCases),
                         [](const auto& info) { return case_name(info.param); });

// d_ok_state only touches the last position of each sequence: removing it changes dk, dk_bias
// and dangles there and nowhere else, and never dq, dscale or dgamma.
TEST(GoldenDqktheta, DokStateOnlyAtSequenceEnds) {
  const DqkCase c{1, 7, 2, 4, 8, 3, true, {0, 3, 4, 7}};
  DqkthetaInputs<double> in = make_dqk(c, 77);
  const auto with = dqktheta(in);
  in.d_ok_state.clear();
  const auto without = dqktheta(in);
  EXPECT_EQ(with.dq, without.dq);
  EXPECT_EQ(with.dscale, without.dscale);
  EXPECT_EQ(with.dgamma, without.dgamma);
  for (int64_t s = 0; s < c.S; ++s) {
    const bool last = s == 2 || s == 3 || s == 6;
    bool differs = false;
    for (int64_t i = 0; i < c.G * c.N; ++i)
      differs |= with.dk[s * c.G * c.N + i] != without.dk[s * c.G * c.N + i];
    EXPECT_EQ(differs, last) << "position " << s;
  }
}

class DqkthetaFloat : public ::testing::TestWithParam<DqkCase> {};

// The float instantiation (the fp32 reference of the dual benchmark) tracks double.
TEST_P(DqkthetaFloat, CloseToDouble) {
  const DqkCase c = GetParam();
  const DqkthetaInputs<double> in = make_dqk(c, 2000 + c.N);
  DqkthetaInputs<float> inf;
  inf.B = in.B; inf.S = in.S; inf.G = in.G; inf.H = in.H; inf.N = in.N; inf.A = in.A;
  inf.q = cast<float>(in.q); inf.k = cast<float>(in.k);
  inf.scale = cast<float>(in.scale); inf.gamma = cast<float>(in.gamma);
  inf.q_bias = cast<float>(in.q_bias); inf.k_bias = cast<float>(in.k_bias);
  inf.angles = cast<float>(in.angles);
  inf.dq_in = cast<float>(in.dq_in); inf.dk_in = cast<float>(in.dk_in);
  inf.dqk = cast<float>(in.dqk); inf.d_ok_state = cast<float>(in.d_ok_state);
  inf.cu_seqlens = in.cu_seqlens;
  const auto gd = dqktheta(in);
  const auto gf = dqktheta(inf);
  const double tol = 1e-5;
  EXPECT_LE(max_rel(cast<double>(gf.dq), gd.dq), tol);
  EXPECT_LE(max_rel(cast<double>(gf.dk), gd.dk), tol);
  EXPECT_LE(max_rel(cast<double>(gf.dq_bias), gd.dq_bias), tol);
  EXPECT_LE(max_rel(cast<double>(gf.dk_bias), gd.dk_bias), tol);
  EXPECT_LE(max_rel(cast<double>(gf.dangles), gd.dangles), tol);
  EXPECT_LE(max_rel(cast<double>(gf.dscale), gd.dscale), tol);
  EXPECT_LE(max_rel(cast<double>(gf.dgamma), gd.dgamma), tol);
  EXPECT_NEAR(dqktheta_forward(inf), dqktheta_forward(in),
              1e-5 * std::max(1.0, std::fabs(dqktheta_forward(in))));
}

INSTANTIATE_TEST_SUITE_P(Golden, DqkthetaFloat, ::testing::ValuesIn(kDqkCases),
                         [](const auto& info) { return case_name(info.param); });

// ------------------------------------------------------------------------------ ddt / dtrap

struct DdtCase {
  int64_t B, H, S, N, P;
  bool states;
  std::vector<int64_t> cu;
};

std::string case_name(const DdtCase& c) {
  char buf[160];
  std::snprintf(buf, sizeof buf, "B%ld_H%ld_S%ld_N%ld_P%ld%s%s", (long)c.B, (long)c.H, (long)c.S,
                (long)c.N, (long)c.P, c.states ? "_states" : "", c.cu.empty() ? "" : "_varlen");
  return buf;
}
void PrintTo(const DdtCase& c, std::ostream* os) { *os << case_name(c); }

DdtDtrapInputs<double> make_ddt(const DdtCase& c, uint64_t seed) {
  std::mt19937_64 rng(seed);
  DdtDtrapInputs<double> in;
  in.B = c.B; in.H = c.H; in.S = c.S; in.N = c.N; in.P = c.P;
  const int64_t nseq = c.cu.empty() ? c.B : static_cast<int64_t>(c.cu.size()) - 1;
  in.dscale = rnd(rng, c.B * c.H * c.S, -1, 1);
  in.dgamma = rnd(rng, c.B * c.H * c.S, -1, 1);
  in.dt = rnd(rng, c.B * c.H * c.S, 0.01, 1);
  in.trap = rnd(rng, c.B * c.H * c.S, -3, 3);
  if (c.states) {
    in.d_issm_state = rnd(rng, nseq * c.H * c.P * c.N, -1, 1);
    in.input_k_state = rnd(rng, nseq * c.H * c.N, -1, 1);
    in.input_v_state = rnd(rng, nseq * c.H * c.P, -1, 1);
  }
  in.cu_seqlens = c.cu;
  return in;
}

const std::vector<DdtCase> kDdtCases = {
    {2, 3, 5, 4, 3, false, {}},
    {2, 2, 5, 4, 3, true, {}},
    {2, 2, 1, 4, 2, true, {}},                // S = 1: every position starts and ends a sequence
    {1, 2, 7, 8, 4, true, {0, 3, 4, 7}},      // varlen with a length-1 sequence
    {1, 3, 6, 4, 4, false, {0, 1, 2, 6}},     // varlen without states
};

class DdtDtrapFD : public ::testing::TestWithParam<DdtCase> {};

TEST_P(DdtDtrapFD, EveryGradientElement) {
  const DdtCase c = GetParam();
  DdtDtrapInputs<double> in = make_ddt(c, 3000 + c.S * 10 + c.N);
  const DdtDtrapGrads<double> g = ddt_dtrap(in);
  auto f = [&] { return ddt_dtrap_forward(in); };
  double worst = 0;
  worst = std::max(worst, fd_check("ddt", in.dt, g.ddt, f));
  worst = std::max(worst, fd_check("dtrap", in.trap, g.dtrap, f));
  if (c.states) {
    worst = std::max(worst, fd_check("d_input_k_state", in.input_k_state, g.d_input_k_state, f));
    worst = std::max(worst, fd_check("d_input_v_state", in.input_v_state, g.d_input_v_state, f));
    // The input SSM state enters F linearly with coefficient d_issm (see the header).
    EXPECT_EQ(g.d_input_ssm_state, in.d_issm_state);
  } else {
    EXPECT_TRUE(g.d_input_ssm_state.empty());
    EXPECT_TRUE(g.d_input_k_state.empty());
    EXPECT_TRUE(g.d_input_v_state.empty());
  }
  std::printf("[ fd       ] ddt_dtrap %s: max error %.3g\n", case_name(c).c_str(), worst);
}

INSTANTIATE_TEST_SUITE_P(Golden, DdtDtrapFD, ::testing::ValuesIn(kDdtCases),
                         [](const auto& info) { return case_name(info.param); });

class DdtDtrapFloat : public ::testing::TestWithParam<DdtCase> {};

TEST_P(DdtDtrapFloat, CloseToDouble) {
  const DdtCase c = GetParam();
  const DdtDtrapInputs<double> in = make_ddt(c, 4000 + c.S);
  DdtDtrapInputs<float> inf;
  inf.B = in.B; inf.H = in.H; inf.S = in.S; inf.N = in.N; inf.P = in.P;
  inf.dscale = cast<float>(in.dscale); inf.dgamma = cast<float>(in.dgamma);
  inf.dt = cast<float>(in.dt); inf.trap = cast<float>(in.trap);
  inf.d_issm_state = cast<float>(in.d_issm_state);
  inf.input_k_state = cast<float>(in.input_k_state);
  inf.input_v_state = cast<float>(in.input_v_state);
  inf.cu_seqlens = in.cu_seqlens;
  const auto gd = ddt_dtrap(in);
  const auto gf = ddt_dtrap(inf);
  const double tol = 1e-5;
  EXPECT_LE(max_rel(cast<double>(gf.ddt), gd.ddt), tol);
  EXPECT_LE(max_rel(cast<double>(gf.dtrap), gd.dtrap), tol);
  EXPECT_LE(max_rel(cast<double>(gf.d_input_ssm_state), gd.d_input_ssm_state), tol);
  EXPECT_LE(max_rel(cast<double>(gf.d_input_k_state), gd.d_input_k_state), tol);
  EXPECT_LE(max_rel(cast<double>(gf.d_input_v_state), gd.d_input_v_state), tol);
}

INSTANTIATE_TEST_SUITE_P(Golden, DdtDtrapFloat, ::testing::ValuesIn(kDdtCases),
                         [](const auto& info) { return case_name(info.param); });

// Rejected inputs: the golden throws instead of reading out of bounds.
TEST(GoldenBwd, RejectsInconsistentInputs) {
  DqkthetaInputs<double> in = make_dqk({2, 5, 1, 2, 4, 1, false, {}}, 5);
  in.cu_seqlens = {0, 5};  // needs B == 1
  EXPECT_THROW(dqktheta(in), std::invalid_argument);
  DdtDtrapInputs<double> d = make_ddt({1, 2, 6, 4, 3, true, {0, 3, 6}}, 6);
  d.cu_seqlens = {0, 3, 5};  // does not end at S
  EXPECT_THROW(ddt_dtrap(d), std::invalid_argument);
  d.cu_seqlens = {0, 3, 6};
  d.input_v_state.clear();  // states must come together
  EXPECT_THROW(ddt_dtrap(d), std::invalid_argument);
}

// ------------------------------------------------------------------------------ SISO model

struct ModelCase {
  int64_t B, S, H, G, N, P, A;
  bool D, z, states;
  Rotation rot;
};

std::string case_name(const ModelCase& c) {
  char buf[160];
  std::snprintf(buf, sizeof buf, "B%ld_S%ld_H%ld_G%ld_N%ld_P%ld_A%ld%s%s%s%s", (long)c.B,
                (long)c.S, (long)c.H, (long)c.G, (long)c.N, (long)c.P, (long)c.A, c.D ? "_D" : "",
                c.z ? "_z" : "", c.states ? "_states" : "",
                c.rot == Rotation::HalfSplit ? "_half" : "");
  return buf;
}
void PrintTo(const ModelCase& c, std::ostream* os) { *os << case_name(c); }

SisoInputs<double> make_model(const ModelCase& c, uint64_t seed) {
  std::mt19937_64 rng(seed);
  SisoInputs<double> in;
  in.B = c.B; in.S = c.S; in.H = c.H; in.G = c.G; in.N = c.N; in.P = c.P; in.A = c.A;
  in.rotation = c.rot;
  in.q = rnd(rng, c.B * c.S * c.G * c.N, -1, 1);
  in.k = rnd(rng, c.B * c.S * c.G * c.N, -1, 1);
  in.v = rnd(rng, c.B * c.S * c.H * c.P, -1, 1);
  in.dt = rnd(rng, c.B * c.H * c.S, 0.05, 1);
  in.adt = in.dt;
  const auto a = rnd(rng, c.B * c.H, 0.1, 1.5);  // A = -a per head
  for (int64_t b = 0; b < c.B; ++b)
    for (int64_t h = 0; h < c.H; ++h)
      for (int64_t t = 0; t < c.S; ++t) in.adt[(b * c.H + h) * c.S + t] *= -a[b * c.H + h];
  in.trap = rnd(rng, c.B * c.H * c.S, -3, 3);
  in.q_bias = rnd(rng, c.H * c.N, -0.5, 0.5);
  in.k_bias = rnd(rng, c.H * c.N, -0.5, 0.5);
  in.angles = rnd(rng, c.B * c.S * c.H * c.A, -3, 3);
  if (c.D) in.D = rnd(rng, c.H, -1, 1);
  if (c.z) in.z = rnd(rng, c.B * c.S * c.H * c.P, -2, 2);
  if (c.states) {
    in.ssm_state0 = rnd(rng, c.B * c.H * c.P * c.N, -1, 1);
    in.k_state0 = rnd(rng, c.B * c.H * c.N, -1, 1);
    in.v_state0 = rnd(rng, c.B * c.H * c.P, -1, 1);
    in.angle_state0 = rnd(rng, c.B * c.H * c.A, 0, 6.283);
  }
  return in;
}

// Angles are reduced mod 2pi in different places by the two forms: compare on the circle.
double angle_err(const std::vector<double>& a, const std::vector<double>& b) {
  EXPECT_EQ(a.size(), b.size());
  double e = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    double d = std::fmod(std::fabs(a[i] - b[i]), 2 * M_PI);
    e = std::max(e, std::min(d, 2 * M_PI - d));
  }
  return e;
}

const std::vector<ModelCase> kModelCases = {
    {1, 7, 1, 1, 4, 2, 1, false, false, false, Rotation::Interleaved},
    {2, 10, 2, 1, 8, 3, 4, true, false, false, Rotation::Interleaved},   // GQA H/G = 2
    {2, 10, 4, 2, 8, 4, 2, true, true, false, Rotation::Interleaved},    // GQA, D, z
    {2, 9, 2, 2, 4, 3, 2, false, true, true, Rotation::Interleaved},     // states, z
    {1, 13, 4, 1, 8, 2, 3, true, true, true, Rotation::Interleaved},     // everything
    {2, 11, 2, 1, 8, 3, 2, true, false, true, Rotation::HalfSplit},      // MIMO convention
};

class SisoModel : public ::testing::TestWithParam<ModelCase> {};

TEST_P(SisoModel, ChunkedMatchesSequential) {
  const ModelCase c = GetParam();
  const SisoInputs<double> in = make_model(c, 5000 + c.S);
  const SisoOutputs<double> seq = siso_sequential(in);
  double worst = 0;
  for (int64_t C : {1, 2, 3, 4, 8, 16}) {
    const SisoOutputs<double> ch = siso_chunked(in, C);
    const double e_out = max_rel(ch.out, seq.out);
    const double e_ssm = max_rel(ch.ssm_state, seq.ssm_state);
    const double e_k = max_rel(ch.k_state, seq.k_state);
    const double e_v = max_rel(ch.v_state, seq.v_state);
    const double e_a = angle_err(ch.angle_state, seq.angle_state);
    EXPECT_LE(e_out, 1e-10) << "C=" << C;
    EXPECT_LE(e_ssm, 1e-10) << "C=" << C;
    EXPECT_LE(e_k, 1e-10) << "C=" << C;
    EXPECT_EQ(e_v, 0) << "C=" << C;
    EXPECT_LE(e_a, 1e-12) << "C=" << C;
    worst = std::max({worst, e_out, e_ssm, e_k, e_a});
  }
  std::printf("[ model    ] %s: chunked vs sequential max error %.3g\n", case_name(c).c_str(),
              worst);
}

// Splitting a sequence in two and feeding the first part's final states into the second part
// reproduces the whole run: checks the input/final state conventions of both forms.
TEST_P(SisoModel, StatesCarryAcrossSplit) {
  const ModelCase c = GetParam();
  const SisoInputs<double> in = make_model(c, 6000 + c.S);
  const SisoOutputs<double> whole = siso_sequential(in);
  const int64_t S1 = c.S / 2 + 1, S2 = c.S - S1;
  auto part = [&](int64_t t0, int64_t len) {
    SisoInputs<double> p = in;
    p.S = len;
    auto slice_bs = [&](const std::vector<double>& v, int64_t inner) {  // [B,S,...]
      std::vector<double> r;
      if (v.empty()) return r;
      for (int64_t b = 0; b < c.B; ++b)
        r.insert(r.end(), v.begin() + (b * c.S + t0) * inner, v.begin() + (b * c.S + t0 + len) * inner);
      return r;
    };
    auto slice_bhs = [&](const std::vector<double>& v) {  // [B,H,S]
      std::vector<double> r;
      for (int64_t bh = 0; bh < c.B * c.H; ++bh)
        r.insert(r.end(), v.begin() + bh * c.S + t0, v.begin() + bh * c.S + t0 + len);
      return r;
    };
    p.q = slice_bs(in.q, c.G * c.N);
    p.k = slice_bs(in.k, c.G * c.N);
    p.v = slice_bs(in.v, c.H * c.P);
    p.z = slice_bs(in.z, c.H * c.P);
    p.angles = slice_bs(in.angles, c.H * c.A);
    p.adt = slice_bhs(in.adt);
    p.dt = slice_bhs(in.dt);
    p.trap = slice_bhs(in.trap);
    return p;
  };
  SisoInputs<double> first = part(0, S1);
  const SisoOutputs<double> o1 = siso_sequential(first);
  SisoInputs<double> second = part(S1, S2);
  second.ssm_state0 = o1.ssm_state;
  second.k_state0 = o1.k_state;
  second.v_state0 = o1.v_state;
  second.angle_state0 = o1.angle_state;
  for (int64_t C : {0, 3}) {  // 0: sequential
    const SisoOutputs<double> o2 = C ? siso_chunked(second, C) : siso_sequential(second);
    std::vector<double> joined;
    for (int64_t b = 0; b < c.B; ++b) {
      const int64_t row = c.H * c.P;
      joined.insert(joined.end(), o1.out.begin() + b * S1 * row, o1.out.begin() + (b + 1) * S1 * row);
      joined.insert(joined.end(), o2.out.begin() + b * S2 * row, o2.out.begin() + (b + 1) * S2 * row);
    }
    EXPECT_LE(max_rel(joined, whole.out), 1e-12) << "C=" << C;
    EXPECT_LE(max_rel(o2.ssm_state, whole.ssm_state), 1e-12) << "C=" << C;
    EXPECT_LE(max_rel(o2.k_state, whole.k_state), 1e-12) << "C=" << C;
    EXPECT_EQ(o2.v_state, whole.v_state);
    EXPECT_LE(angle_err(o2.angle_state, whole.angle_state), 1e-12) << "C=" << C;
  }
}

TEST_P(SisoModel, FloatCloseToDouble) {
  const ModelCase c = GetParam();
  const SisoInputs<double> in = make_model(c, 7000 + c.S);
  SisoInputs<float> f;
  f.B = in.B; f.S = in.S; f.H = in.H; f.G = in.G; f.N = in.N; f.P = in.P; f.A = in.A;
  f.rotation = in.rotation;
  f.q = cast<float>(in.q); f.k = cast<float>(in.k); f.v = cast<float>(in.v);
  f.adt = cast<float>(in.adt); f.dt = cast<float>(in.dt); f.trap = cast<float>(in.trap);
  f.q_bias = cast<float>(in.q_bias); f.k_bias = cast<float>(in.k_bias);
  f.angles = cast<float>(in.angles); f.D = cast<float>(in.D); f.z = cast<float>(in.z);
  f.ssm_state0 = cast<float>(in.ssm_state0); f.k_state0 = cast<float>(in.k_state0);
  f.v_state0 = cast<float>(in.v_state0); f.angle_state0 = cast<float>(in.angle_state0);
  const auto d = siso_sequential(in);
  const auto s = siso_chunked(f, 4);
  EXPECT_LE(max_rel(cast<double>(s.out), d.out), 1e-5);
  EXPECT_LE(max_rel(cast<double>(s.ssm_state), d.ssm_state), 1e-5);
}

INSTANTIATE_TEST_SUITE_P(Golden, SisoModel, ::testing::ValuesIn(kModelCases),
                         [](const auto& info) { return case_name(info.param); });

// One step by hand: S = 1 without states is out = gamma (qh . kh) v + D v, with qh . kh =
// (q+qb).(k+kb) since both are rotated by the same angles.
TEST(GoldenModel, SingleStepByHand) {
  ModelCase c{1, 1, 1, 1, 4, 2, 2, true, false, false, Rotation::Interleaved};
  const SisoInputs<double> in = make_model(c, 9);
  const auto o = siso_sequential(in);
  double qk = 0;
  for (int n = 0; n < 4; ++n) qk += (in.q[n] + in.q_bias[n]) * (in.k[n] + in.k_bias[n]);
  const double lam = 1 / (1 + std::exp(-in.trap[0]));
  for (int p = 0; p < 2; ++p)
    EXPECT_NEAR(o.out[p], lam * in.dt[0] * qk * in.v[p] + in.D[0] * in.v[p], 1e-14);
  // The final angle is pi * tanh(angle) * dt reduced to [0, 2pi).
  for (int i = 0; i < 2; ++i) {
    double th = M_PI * std::tanh(in.angles[i]) * in.dt[0];
    th -= 2 * M_PI * std::floor(th / (2 * M_PI));
    EXPECT_NEAR(o.angle_state[i], th, 1e-15);
    EXPECT_GE(o.angle_state[i], 0);
    EXPECT_LT(o.angle_state[i], 2 * M_PI);
  }
}

TEST(GoldenModel, RotateConventions) {
  const double theta[2] = {0.3, -1.1};
  double x[8] = {1, 2, 3, 4, 5, 6, 7, 8};
  double y[8];
  std::copy(x, x + 8, y);
  rotate(y, 8, theta, 2, Rotation::Interleaved);
  EXPECT_NEAR(y[0], std::cos(0.3) * 1 - std::sin(0.3) * 2, 1e-15);
  EXPECT_NEAR(y[1], std::sin(0.3) * 1 + std::cos(0.3) * 2, 1e-15);
  EXPECT_NEAR(y[2], std::cos(-1.1) * 3 - std::sin(-1.1) * 4, 1e-15);
  for (int i = 4; i < 8; ++i) EXPECT_EQ(y[i], x[i]);
  rotate(y, 8, theta, 2, Rotation::Interleaved, true);
  for (int i = 0; i < 8; ++i) EXPECT_NEAR(y[i], x[i], 1e-15);

  std::copy(x, x + 8, y);
  rotate(y, 8, theta, 2, Rotation::HalfSplit);
  EXPECT_NEAR(y[0], std::cos(0.3) * 1 - std::sin(0.3) * 5, 1e-15);
  EXPECT_NEAR(y[4], std::sin(0.3) * 1 + std::cos(0.3) * 5, 1e-15);
  EXPECT_NEAR(y[1], std::cos(-1.1) * 2 - std::sin(-1.1) * 6, 1e-15);
  EXPECT_NEAR(y[5], std::sin(-1.1) * 2 + std::cos(-1.1) * 6, 1e-15);
  for (int i : {2, 3, 6, 7}) EXPECT_EQ(y[i], x[i]);
}

}  // namespace
