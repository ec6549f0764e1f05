// The golden of mamba3_mimo_bwd_bwd (golden/include/mamba3_golden/mimo_bwd_bwd.hpp) against
// central finite differences of the float64 chunked forward (mimo_chunked_forward), which reads
// da_cs, da_cs_rev and segsum as independent inputs: every one of the 12 outputs is checked,
// for the three dout layouts, with and without D, with GQA and partial last chunks; the tail
// contract against explicit padding; and the float instantiation against the double one.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "mamba3_golden/mimo.hpp"
#include "mamba3_golden/mimo_bwd_bwd.hpp"

using namespace mamba3::golden;

namespace {

using Layout = MimoDoutLayout;

struct Cfg {
  int64_t B = 2, S = 12, H = 2, G = 1, N = 8, P = 3, R = 2, C = 4, rdd = 4;
  bool D = true;
  Layout layout = Layout::ReduceO;
  uint64_t seed = 1;
  std::string str() const {
    std::ostringstream o;
    const char* ln[] = {"reduce-O", "per-rank", "packed"};
    o << "B" << B << " S" << S << " H" << H << " G" << G << " N" << N << " P" << P << " R" << R
      << " C" << C << " rdd" << rdd << (D ? " D " : " ") << ln[static_cast<int>(layout)] << " seed"
      << seed;
    return o.str();
  }
};

std::vector<double> unif(std::mt19937_64& rng, int64_t n, double lo, double hi) {
  std::uniform_real_distribution<double> d(lo, hi);
  std::vector<double> v(n);
  for (auto& e : v) e = d(rng);
  return v;
}

// Random inputs; da_cs / da_cs_rev / segsum derived from one adt, then (with `independent`)
// moved apart so that each is visibly read in its own role.
MimoInputs<double> make(const Cfg& c, bool independent = false) {
  std::mt19937_64 rng(c.seed);
  MimoInputs<double> in;
  in.B = c.B, in.S = c.S, in.H = c.H, in.G = c.G, in.N = c.N, in.P = c.P, in.R = c.R;
  in.rotary_dim_divisor = c.rdd;
  in.chunk_size = c.C;
  const int64_t B = c.B, S = c.S, H = c.H, G = c.G, N = c.N, P = c.P, R = c.R, A = N / c.rdd;
  in.q = unif(rng, B * S * R * G * N, -1, 1);
  in.k = unif(rng, B * S * R * G * N, -1, 1);
  in.v = unif(rng, B * S * H * P, -1, 1);
  in.q_bias = unif(rng, H * R * N, -0.5, 0.5);
  in.k_bias = unif(rng, H * R * N, -0.5, 0.5);
  in.mimo_v = unif(rng, H * R * P, -1, 1);
  if (c.layout == Layout::ReduceO) in.mimo_o = unif(rng, H * R * P, -1, 1);
  if (c.D) in.D = unif(rng, H, -1, 1);
  in.angles = unif(rng, B * S * H * A, -3, 3);
  in.dt = unif(rng, B * H * S, 0.05, 0.6);
  in.trap = unif(rng, B * H * S, -2, 2);
  const auto a = unif(rng, B * H * S, 0.1, 1.5);
  in.adt.resize(B * H * S);
  for (int64_t i = 0; i < B * H * S; ++i) in.adt[i] = -a[i] * in.dt[i];
  in.dout = unif(rng, c.layout == Layout::ReduceO ? B * S * H * P : B * S * R * H * P, -1, 1);
  mimo_dacs_segsum(in);
  if (independent) {
    std::uniform_real_distribution<double> d(-0.3, 0.0);
    for (auto* f : {&in.da_cs, &in.da_cs_rev, &in.segsum})
      for (auto& x : *f) x += d(rng);
  }
  return in;
}

// qk_dot [B,H,S,R,R] of the biased, unrotated q and k (what the first pass caches).
std::vector<double> qk_dot_of(const MimoInputs<double>& in) {
  const int64_t B = in.B, S = in.S, H = in.H, G = in.G, N = in.N, R = in.R;
  std::vector<double> o(B * H * S * R * R);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t t = 0; t < S; ++t)
        for (int64_t r = 0; r < R; ++r)
          for (int64_t r2 = 0; r2 < R; ++r2) {
            const int64_t g = h / (H / G);
            double s = 0;
            for (int64_t n = 0; n < N; ++n)
              s +=
                  (in.q[(((b * S + t) * R + r) * G + g) * N + n] + in.q_bias[(h * R + r) * N + n]) *
                  (in.k[(((b * S + t) * R + r2) * G + g) * N + n] +
                   in.k_bias[(h * R + r2) * N + n]);
            o[(((b * H + h) * S + t) * R + r) * R + r2] = s;
          }
  return o;
}

// The packed dout [B,H,S*R,P] holds per-rank dout [B,S,R,H,P] in another order.
std::vector<double> packed_to_per_rank(const MimoInputs<double>& in) {
  const int64_t B = in.B, S = in.S, H = in.H, P = in.P, R = in.R;
  std::vector<double> o(in.dout.size());
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t t = 0; t < S; ++t)
        for (int64_t r = 0; r < R; ++r)
          for (int64_t p = 0; p < P; ++p)
            o[(((b * S + t) * R + r) * H + h) * P + p] =
                in.dout[(((b * H + h) * S + t) * R + r) * P + p];
  return o;
}

MimoBwdBwdOutputs<double> golden(const MimoInputs<double>& in, Layout layout) {
  return mimo_bwd_bwd(in, mimo_chunked_forward(in).states, qk_dot_of(in), layout);
}

// L = sum dout * out of the chunked forward (out = y per rank, or sum_r mimo_o^r y^r).
double objective(const MimoInputs<double>& in, Layout layout) {
  MimoInputs<double> x = in;
  if (layout == Layout::Packed) x.dout = packed_to_per_rank(in);
  const auto out = mimo_chunked_forward(x).out;
  double s = 0;
  for (size_t i = 0; i < out.size(); ++i) s += x.dout[i] * out[i];
  return s;
}

std::vector<double> central_fd(MimoInputs<double> in,
                               std::vector<double> MimoInputs<double>::*field, Layout layout,
                               double eps = 1e-5) {
  const int64_t n = static_cast<int64_t>((in.*field).size());
  std::vector<double> fd(n);
  for (int64_t i = 0; i < n; ++i) {
    const double x0 = (in.*field)[i];
    (in.*field)[i] = x0 + eps;
    const double fp = objective(in, layout);
    (in.*field)[i] = x0 - eps;
    const double fm = objective(in, layout);
    (in.*field)[i] = x0;
    fd[i] = (fp - fm) / (2 * eps);
  }
  return fd;
}

double max_abs(const std::vector<double>& a) {
  double m = 0;
  for (double x : a) m = std::max(m, std::abs(x));
  return m;
}

template <class U>
double max_rel(const std::vector<U>& a, const std::vector<double>& b) {
  if (a.size() != b.size()) return INFINITY;
  double num = 0, den = 0;
  for (size_t i = 0; i < b.size(); ++i) {
    if (!std::isfinite(static_cast<double>(a[i]))) return INFINITY;
    num = std::max(num, std::abs(static_cast<double>(a[i]) - b[i]));
    den = std::max(den, std::abs(b[i]));
  }
  return den > 0 ? num / den : num;
}

// Sum of a per-head [B, X, H, Y] gradient over the heads of each q/k group -> [B, X, G, Y].
std::vector<double> group_sum(const std::vector<double>& v, int64_t B, int64_t X, int64_t H,
                              int64_t G, int64_t Y) {
  std::vector<double> o(B * X * G * Y, 0.0);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t x = 0; x < X; ++x)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t y = 0; y < Y; ++y)
          o[((b * X + x) * G + h / (H / G)) * Y + y] += v[((b * X + x) * H + h) * Y + y];
  return o;
}

// Sum over the leading batch axis of [B, rest].
std::vector<double> batch_sum(const std::vector<double>& v, int64_t B) {
  const size_t n = v.size() / B;
  std::vector<double> o(n, 0.0);
  for (int64_t b = 0; b < B; ++b)
    for (size_t i = 0; i < n; ++i) o[i] += v[b * n + i];
  return o;
}

double sigmoid(double x) { return 1 / (1 + std::exp(-x)); }

constexpr double kFdTol = 1e-7;

// Every output whose input is read the same way whatever S: q, k, v, biases are not outputs of
// this pass; q, k (DQ, DK summed over the group), v, mimo_v, angles, D, and dt / trap (which
// check DFACTOR and DGAMMA jointly: d/ddt_t = lam_t (DGAMMA_t + DFACTOR_t) + (1 - lam_t)
// DFACTOR_{t-1}, d/dtrap_t = lam_t (1 - lam_t) dt_t (DGAMMA_t + DFACTOR_t - DFACTOR_{t-1}); both
// together determine DGAMMA_t + DFACTOR_t and DFACTOR_{t-1} separately).
void check_main_gradients(const Cfg& c) {
  SCOPED_TRACE(c.str());
  const auto in = make(c);
  const auto g = golden(in, c.layout);
  const int64_t B = c.B, S = c.S, H = c.H, G = c.G, N = c.N, R = c.R;

  const auto fq = central_fd(in, &MimoInputs<double>::q, c.layout);
  ASSERT_GT(max_abs(fq), 1e-2);
  EXPECT_LT(max_rel(group_sum(g.dq, B, S * R, H, G, N), fq), kFdTol) << "DQ";
  const auto fk = central_fd(in, &MimoInputs<double>::k, c.layout);
  ASSERT_GT(max_abs(fk), 1e-2);
  EXPECT_LT(max_rel(group_sum(g.dk, B, S * R, H, G, N), fk), kFdTol) << "DK";
  const auto fv = central_fd(in, &MimoInputs<double>::v, c.layout);
  ASSERT_GT(max_abs(fv), 1e-2);
  EXPECT_LT(max_rel(g.dv, fv), kFdTol) << "DV";
  const auto fmv = central_fd(in, &MimoInputs<double>::mimo_v, c.layout);
  ASSERT_GT(max_abs(fmv), 1e-2);
  EXPECT_LT(max_rel(batch_sum(g.dmimo_v, B), fmv), kFdTol) << "DMIMO_V";
  const auto fa = central_fd(in, &MimoInputs<double>::angles, c.layout);
  ASSERT_GT(max_abs(fa), 1e-2);
  EXPECT_LT(max_rel(g.dangles, fa), kFdTol) << "DANGLES";
  if (c.D) {
    const auto fd = central_fd(in, &MimoInputs<double>::D, c.layout);
    ASSERT_GT(max_abs(fd), 1e-2);
    EXPECT_LT(max_rel(batch_sum(g.dd, B), fd), kFdTol) << "DD";
  } else {
    EXPECT_TRUE(g.dd.empty());
  }
  const auto fdt = central_fd(in, &MimoInputs<double>::dt, c.layout);
  const auto ftrap = central_fd(in, &MimoInputs<double>::trap, c.layout);
  std::vector<double> pdt(B * H * S), ptrap(B * H * S);
  for (int64_t bh = 0; bh < B * H; ++bh)
    for (int64_t t = 0; t < S; ++t) {
      const int64_t i = bh * S + t;
      const double lam = sigmoid(in.trap[i]), dl = lam * (1 - lam);
      const double both = g.dgamma[i] + g.dfactor[i], prev = t > 0 ? g.dfactor[i - 1] : 0.0;
      pdt[i] = lam * both + (1 - lam) * prev;
      ptrap[i] = dl * in.dt[i] * (both - prev);
    }
  ASSERT_GT(max_abs(fdt), 1e-2);
  EXPECT_LT(max_rel(pdt, fdt), kFdTol) << "DFACTOR/DGAMMA via dt";
  ASSERT_GT(max_abs(ftrap), 1e-2);
  EXPECT_LT(max_rel(ptrap, ftrap), kFdTol) << "DFACTOR/DGAMMA via trap";
}

// DGAMMA at the last step (where trap_scale is gamma alone, so dt / trap cannot split it from
// DFACTOR) by its definition: sum_{r,r'} qk_dot[t,r,r'] (dPhiO_t^r . x_t^r').
void check_dgamma_definition(const Cfg& c) {
  const auto in = make(c);
  const auto g = golden(in, c.layout);
  const auto qk = qk_dot_of(in);
  const int64_t B = c.B, S = c.S, H = c.H, P = c.P, R = c.R;
  std::vector<double> want(B * H * S);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t t = 0; t < S; ++t) {
        double s = 0;
        for (int64_t r = 0; r < R; ++r)
          for (int64_t r2 = 0; r2 < R; ++r2)
            for (int64_t p = 0; p < P; ++p) {
              const double x =
                  in.v[((b * S + t) * H + h) * P + p] * in.mimo_v[(h * R + r2) * P + p];
              double d;
              if (c.layout == Layout::ReduceO)
                d = in.dout[((b * S + t) * H + h) * P + p] * in.mimo_o[(h * R + r) * P + p];
              else if (c.layout == Layout::PerRank)
                d = in.dout[(((b * S + t) * R + r) * H + h) * P + p];
              else
                d = in.dout[(((b * H + h) * S + t) * R + r) * P + p];
              s += qk[(((b * H + h) * S + t) * R + r) * R + r2] * d * x;
            }
        want[(b * H + h) * S + t] = s;
      }
  EXPECT_LT(max_rel(g.dgamma, want), 1e-14);
}

}  // namespace

TEST(GoldenMimoBwdBwd, GradientsMatchFiniteDifferences) {
  uint64_t seed = 300;
  for (Layout layout : {Layout::ReduceO, Layout::PerRank, Layout::Packed})
    for (int variant = 0; variant < 4; ++variant) {
      Cfg c;
      c.layout = layout;
      c.seed = seed++;
      c.D = variant != 1;
      if (variant == 1 || variant == 3) c.H = 4, c.G = 2, c.B = 1;  // GQA
      c.S = variant >= 2 ? 13 : 12;                                 // partial last chunk
      c.R = variant == 3 ? 4 : (variant == 2 ? 1 : 2);
      c.rdd = variant == 2 ? 2 : 4;
      check_main_gradients(c);
      check_dgamma_definition(c);
    }
}

// The decay outputs against differences w.r.t. the decay inputs, which the chunked forward reads
// as independent inputs (whole chunks: in a partial chunk they are rebuilt from da_cs, see the
// padding test):
//   d/dda_cs_t     = E_t DDA_CS_t (+ DDA_t at the last step of a chunk: the chunk decay)
//   d/dda_cs_rev_t = F_t DDA_CS_REV_t
//   d/dsegsum[c,i,j] = exp(segsum[c,i,j]) DSSDA[c,j,i] for j < i; 0 elsewhere (not read)
TEST(GoldenMimoBwdBwd, DecayGradientsMatchFiniteDifferences) {
  uint64_t seed = 400;
  for (Layout layout : {Layout::ReduceO, Layout::PerRank, Layout::Packed})
    for (int64_t R : {1, 2, 4}) {
      Cfg c;
      c.layout = layout, c.R = R, c.seed = seed++, c.S = 12, c.C = 4;
      c.N = R == 4 ? 4 : 8;
      if (R == 2) c.H = 4, c.G = 2, c.B = 1;
      SCOPED_TRACE(c.str());
      const auto in = make(c, /*independent=*/true);
      const auto g = golden(in, layout);
      const int64_t B = c.B, S = c.S, H = c.H, C = c.C, nch = S / C;
      const auto fcs = central_fd(in, &MimoInputs<double>::da_cs, layout);
      const auto frev = central_fd(in, &MimoInputs<double>::da_cs_rev, layout);
      const auto fseg = central_fd(in, &MimoInputs<double>::segsum, layout);
      std::vector<double> pcs(B * H * S), prev(B * H * S), pseg(B * H * nch * C * C, 0.0);
      double dda_max = 0, dda_last_chunk = 0;
      for (int64_t bh = 0; bh < B * H; ++bh) {
        for (int64_t t = 0; t < S; ++t) {
          const int64_t i = bh * S + t;
          pcs[i] = std::exp(in.da_cs[i]) * g.dda_cs[i] + (t % C == C - 1 ? g.dda[i] : 0.0);
          prev[i] = std::exp(in.da_cs_rev[i]) * g.dda_cs_rev[i];
          // DDA is one value per chunk, repeated at each of its steps.
          EXPECT_EQ(g.dda[i], g.dda[bh * S + (t / C) * C]);
          dda_max = std::max(dda_max, std::abs(g.dda[i]));
          if (t >= S - C) dda_last_chunk = std::max(dda_last_chunk, std::abs(g.dda[i]));
        }
        for (int64_t ch = 0; ch < nch; ++ch)
          for (int64_t i = 0; i < C; ++i)
            for (int64_t j = 0; j < i; ++j) {
              const int64_t e = ((bh * nch + ch) * C + i) * C + j;
              pseg[e] = std::exp(in.segsum[e]) * g.dssda[((bh * nch + ch) * C + j) * C + i];
            }
      }
      EXPECT_GT(dda_max, 1e-2);
      EXPECT_EQ(dda_last_chunk, 0.0);  // nothing after the last chunk reads its state
      ASSERT_GT(max_abs(fcs), 1e-2);
      EXPECT_LT(max_rel(pcs, fcs), kFdTol) << "DDA_CS / DDA";
      ASSERT_GT(max_abs(frev), 1e-2);
      EXPECT_LT(max_rel(prev, frev), kFdTol) << "DDA_CS_REV";
      ASSERT_GT(max_abs(fseg), 1e-2);
      EXPECT_LT(max_rel(pseg, fseg), kFdTol) << "DSSDA";
    }
}

// DSSDA on and above the diagonal is the same product, unmasked. On the diagonal it is
// ts_t sum_{r,r'} (qh_t^r . kh_t^r')(x_t^r' . dPhiO_t^r) = ts_t DGAMMA_t, since the same-position
// dot of the rotated q, k is qk_dot (the rotation is orthogonal).
TEST(GoldenMimoBwdBwd, DssdaDiagonalIsTrapScaleTimesDgamma) {
  Cfg c;
  c.S = 10, c.R = 2, c.seed = 450;
  const auto in = make(c);
  const auto g = golden(in, c.layout);
  const int64_t S = c.S, C = c.C, nch = (S + C - 1) / C;
  std::vector<double> diag, want;
  for (int64_t bh = 0; bh < c.B * c.H; ++bh)
    for (int64_t t = 0; t < S; ++t) {
      const int64_t i = bh * S + t, ch = t / C, ii = t % C;
      diag.push_back(g.dssda[((bh * nch + ch) * C + ii) * C + ii]);
      const double lam = sigmoid(in.trap[i]);
      const double ts =
          in.dt[i] * lam + (t + 1 < S ? in.dt[i + 1] * (1 - sigmoid(in.trap[i + 1])) : 0.0);
      want.push_back(ts * g.dgamma[i]);
    }
  EXPECT_LT(max_rel(diag, want), 1e-13);
  double upper = 0;  // the upper triangle is filled (not masked)
  for (int64_t i = 0; i < C; ++i)
    for (int64_t j = i + 1; j < C; ++j) upper = std::max(upper, std::abs(g.dssda[i * C + j]));
  EXPECT_GT(upper, 1e-3);
}

// The three dout layouts are one gradient: reduce-O is per rank with dout * mimo_o^r, packed is
// per rank reordered.
TEST(GoldenMimoBwdBwd, DoutLayoutsAgree) {
  Cfg c;
  c.S = 11, c.R = 4, c.H = 4, c.G = 2, c.seed = 460;
  const auto in = make(c);
  const auto red = golden(in, Layout::ReduceO);
  auto pr = in;
  pr.mimo_o.clear();
  pr.dout.assign(c.B * c.S * c.R * c.H * c.P, 0.0);
  for (int64_t b = 0; b < c.B; ++b)
    for (int64_t t = 0; t < c.S; ++t)
      for (int64_t r = 0; r < c.R; ++r)
        for (int64_t h = 0; h < c.H; ++h)
          for (int64_t p = 0; p < c.P; ++p)
            pr.dout[(((b * c.S + t) * c.R + r) * c.H + h) * c.P + p] =
                in.dout[((b * c.S + t) * c.H + h) * c.P + p] * in.mimo_o[(h * c.R + r) * c.P + p];
  const auto per = golden(pr, Layout::PerRank);
  auto pk = pr;
  for (int64_t b = 0; b < c.B; ++b)
    for (int64_t h = 0; h < c.H; ++h)
      for (int64_t t = 0; t < c.S; ++t)
        for (int64_t r = 0; r < c.R; ++r)
          for (int64_t p = 0; p < c.P; ++p)
            pk.dout[(((b * c.H + h) * c.S + t) * c.R + r) * c.P + p] =
                pr.dout[(((b * c.S + t) * c.R + r) * c.H + h) * c.P + p];
  const auto pac = golden(pk, Layout::Packed);
  for (const auto* o : {&per, &pac}) {
    EXPECT_LT(max_rel(o->dq, red.dq), 1e-14);
    EXPECT_LT(max_rel(o->dk, red.dk), 1e-14);
    EXPECT_LT(max_rel(o->dv, red.dv), 1e-14);
    EXPECT_LT(max_rel(o->dmimo_v, red.dmimo_v), 1e-14);
    EXPECT_LT(max_rel(o->dangles, red.dangles), 1e-12);
    EXPECT_LT(max_rel(o->dfactor, red.dfactor), 1e-14);
    EXPECT_LT(max_rel(o->dgamma, red.dgamma), 1e-14);
    EXPECT_LT(max_rel(o->dda, red.dda), 1e-14);
    EXPECT_LT(max_rel(o->dda_cs, red.dda_cs), 1e-14);
    EXPECT_LT(max_rel(o->dda_cs_rev, red.dda_cs_rev), 1e-14);
    EXPECT_LT(max_rel(o->dssda, red.dssda), 1e-14);
    EXPECT_LT(max_rel(o->dd, red.dd), 1e-14);
  }
}

// S % C != 0: the outputs are those of the problem padded explicitly (sequence inputs zero,
// da_cs edge-extended, the last chunk's da_cs_rev and segsum rebuilt from it) cut back to S,
// with DSSDA's rows and columns past S zero.
TEST(GoldenMimoBwdBwd, TailMatchesExplicitPadding) {
  for (int64_t S : {5, 9, 15})
    for (Layout layout : {Layout::ReduceO, Layout::PerRank, Layout::Packed}) {
      Cfg c;
      c.R = 2, c.C = 4, c.S = S, c.H = 4, c.G = 2, c.layout = layout;
      c.seed = 500 + S + 10 * static_cast<int>(layout);
      SCOPED_TRACE(c.str());
      const auto in = make(c);
      const auto g = golden(in, layout);
      const int64_t B = c.B, H = c.H, G = c.G, N = c.N, P = c.P, R = c.R, C = c.C;
      const int64_t A = N / c.rdd, nch = (S + C - 1) / C, Sp = nch * C, s0 = (nch - 1) * C;
      const int64_t L = S - s0;
      auto pad = [&](const std::vector<double>& x, int64_t outer, int64_t inner, bool edge) {
        std::vector<double> o;
        for (int64_t a = 0; a < outer; ++a) {
          o.insert(o.end(), x.begin() + a * S * inner, x.begin() + (a + 1) * S * inner);
          for (int64_t s = S; s < Sp; ++s)
            for (int64_t i = 0; i < inner; ++i)
              o.push_back(edge ? x[(a * S + S - 1) * inner + i] : 0.0);
        }
        return o;
      };
      MimoInputs<double> pd = in;
      pd.S = Sp;
      pd.q = pad(in.q, B, R * G * N, false);
      pd.k = pad(in.k, B, R * G * N, false);
      pd.v = pad(in.v, B, H * P, false);
      pd.dout = layout == Layout::ReduceO   ? pad(in.dout, B, H * P, false)
                : layout == Layout::PerRank ? pad(in.dout, B, R * H * P, false)
                                            : pad(in.dout, B * H, R * P, false);
      pd.angles = pad(in.angles, B, H * A, false);
      pd.dt = pad(in.dt, B * H, 1, false);
      pd.trap = pad(in.trap, B * H, 1, false);
      pd.da_cs = pad(in.da_cs, B * H, 1, true);
      pd.da_cs_rev = pad(in.da_cs_rev, B * H, 1, false);
      for (int64_t bh = 0; bh < B * H; ++bh) {
        const double* cs = &pd.da_cs[bh * Sp + s0];
        for (int64_t i = 0; i < C; ++i) {
          pd.da_cs_rev[bh * Sp + s0 + i] = cs[C - 1] - cs[i];
          for (int64_t j = 0; j < C; ++j)
            pd.segsum[((bh * nch + nch - 1) * C + i) * C + j] = cs[i] - cs[j];
        }
      }
      const auto gp = golden(pd, layout);
      auto crop = [&](const std::vector<double>& x, int64_t outer, int64_t inner) {
        std::vector<double> o;
        for (int64_t a = 0; a < outer; ++a)
          o.insert(o.end(), x.begin() + a * Sp * inner, x.begin() + (a * Sp + S) * inner);
        return o;
      };
      EXPECT_LT(max_rel(g.dq, crop(gp.dq, B, R * H * N)), 1e-13);
      EXPECT_LT(max_rel(g.dk, crop(gp.dk, B, R * H * N)), 1e-13);
      EXPECT_LT(max_rel(g.dv, crop(gp.dv, B, H * P)), 1e-13);
      EXPECT_LT(max_rel(g.dangles, crop(gp.dangles, B, H * A)), 1e-12);
      EXPECT_LT(max_rel(g.dmimo_v, gp.dmimo_v), 1e-13);
      EXPECT_LT(max_rel(g.dd, gp.dd), 1e-13);
      for (auto m : {&MimoBwdBwdOutputs<double>::dfactor, &MimoBwdBwdOutputs<double>::dgamma,
                     &MimoBwdBwdOutputs<double>::dda, &MimoBwdBwdOutputs<double>::dda_cs,
                     &MimoBwdBwdOutputs<double>::dda_cs_rev})
        EXPECT_LT(max_rel(g.*m, crop(gp.*m, B * H, 1)), 1e-13);
      auto dssda = gp.dssda;  // zero the padded rows and columns of the last chunk
      for (int64_t bh = 0; bh < B * H; ++bh)
        for (int64_t i = 0; i < C; ++i)
          for (int64_t j = 0; j < C; ++j)
            if (i >= L || j >= L) dssda[((bh * nch + nch - 1) * C + i) * C + j] = 0.0;
      EXPECT_LT(max_rel(g.dssda, dssda), 1e-13);
      for (int64_t bh = 0; bh < B * H; ++bh)
        for (int64_t i = 0; i < C; ++i)
          for (int64_t j = 0; j < C; ++j)
            if (i >= L || j >= L) EXPECT_EQ(g.dssda[((bh * nch + nch - 1) * C + i) * C + j], 0.0);
    }
}

// The given states and qk_dot are read in their roles: perturbing states moves only the outputs
// of the inter-chunk readout (DQ, DANGLES, DDA_CS, DDA), perturbing qk_dot only the diagonal's
// (DV, DMIMO_V, DGAMMA); nothing else is recomputed from them.
TEST(GoldenMimoBwdBwd, StatesAndQkDotReadInTheirRoles) {
  Cfg c;
  c.S = 12, c.seed = 470;
  const auto in = make(c);
  const auto st = mimo_chunked_forward(in).states;
  const auto qk = qk_dot_of(in);
  const auto g = mimo_bwd_bwd(in, st, qk, c.layout);
  auto st2 = st;
  for (auto& x : st2) x *= 1.5;
  const auto gs = mimo_bwd_bwd(in, st2, qk, c.layout);
  EXPECT_NE(g.dq, gs.dq);
  EXPECT_NE(g.dda_cs, gs.dda_cs);
  EXPECT_NE(g.dda, gs.dda);
  EXPECT_EQ(g.dk, gs.dk);
  EXPECT_EQ(g.dv, gs.dv);
  EXPECT_EQ(g.dgamma, gs.dgamma);
  EXPECT_EQ(g.dssda, gs.dssda);
  auto qk2 = qk;
  for (auto& x : qk2) x += 0.25;
  const auto gq = mimo_bwd_bwd(in, st, qk2, c.layout);
  EXPECT_NE(g.dv, gq.dv);
  EXPECT_NE(g.dmimo_v, gq.dmimo_v);
  EXPECT_NE(g.dgamma, gq.dgamma);
  EXPECT_EQ(g.dq, gq.dq);
  EXPECT_EQ(g.dk, gq.dk);
  EXPECT_EQ(g.dfactor, gq.dfactor);
  EXPECT_EQ(g.dda_cs, gq.dda_cs);
}

// The float instantiation (the dual benchmark's fp32 reference) stays close to the double golden.
TEST(GoldenMimoBwdBwd, FloatCloseToDouble) {
  for (Layout layout : {Layout::ReduceO, Layout::PerRank, Layout::Packed}) {
    Cfg c;
    c.B = 1, c.S = 37, c.H = 4, c.G = 2, c.N = 16, c.P = 8, c.R = 4, c.C = 8, c.layout = layout;
    c.seed = 480 + static_cast<int>(layout);
    SCOPED_TRACE(c.str());
    auto in = make(c);
    auto st = mimo_chunked_forward(in).states;
    auto qk = qk_dot_of(in);
    auto rnd = [](std::vector<double>& v) {
      for (auto& x : v) x = static_cast<float>(x);
    };
    std::vector<double> MimoInputs<double>::*fields[] = {
        &MimoInputs<double>::q,         &MimoInputs<double>::k,      &MimoInputs<double>::v,
        &MimoInputs<double>::q_bias,    &MimoInputs<double>::k_bias, &MimoInputs<double>::mimo_v,
        &MimoInputs<double>::mimo_o,    &MimoInputs<double>::D,      &MimoInputs<double>::angles,
        &MimoInputs<double>::dt,        &MimoInputs<double>::trap,   &MimoInputs<double>::da_cs,
        &MimoInputs<double>::da_cs_rev, &MimoInputs<double>::segsum, &MimoInputs<double>::dout};
    for (auto f : fields) rnd(in.*f);
    rnd(st), rnd(qk);
    MimoInputs<float> f;
    f.B = in.B, f.S = in.S, f.H = in.H, f.G = in.G, f.N = in.N, f.P = in.P, f.R = in.R;
    f.rotary_dim_divisor = in.rotary_dim_divisor, f.chunk_size = in.chunk_size;
    std::vector<float> MimoInputs<float>::*ffields[] = {
        &MimoInputs<float>::q,         &MimoInputs<float>::k,      &MimoInputs<float>::v,
        &MimoInputs<float>::q_bias,    &MimoInputs<float>::k_bias, &MimoInputs<float>::mimo_v,
        &MimoInputs<float>::mimo_o,    &MimoInputs<float>::D,      &MimoInputs<float>::angles,
        &MimoInputs<float>::dt,        &MimoInputs<float>::trap,   &MimoInputs<float>::da_cs,
        &MimoInputs<float>::da_cs_rev, &MimoInputs<float>::segsum, &MimoInputs<float>::dout};
    for (size_t i = 0; i < std::size(fields); ++i)
      (f.*ffields[i]).assign((in.*fields[i]).begin(), (in.*fields[i]).end());
    const auto gd = mimo_bwd_bwd(in, st, qk, layout);
    const auto gf = mimo_bwd_bwd(f, std::vector<float>(st.begin(), st.end()),
                                 std::vector<float>(qk.begin(), qk.end()), layout);
    EXPECT_LT(max_rel(gf.dq, gd.dq), 1e-5);
    EXPECT_LT(max_rel(gf.dk, gd.dk), 1e-5);
    EXPECT_LT(max_rel(gf.dv, gd.dv), 1e-5);
    EXPECT_LT(max_rel(gf.dmimo_v, gd.dmimo_v), 1e-5);
    EXPECT_LT(max_rel(gf.dangles, gd.dangles), 1e-5);
    EXPECT_LT(max_rel(gf.dfactor, gd.dfactor), 1e-5);
    EXPECT_LT(max_rel(gf.dgamma, gd.dgamma), 1e-5);
    EXPECT_LT(max_rel(gf.dda, gd.dda), 1e-5);
    EXPECT_LT(max_rel(gf.dda_cs, gd.dda_cs), 1e-5);
    EXPECT_LT(max_rel(gf.dda_cs_rev, gd.dda_cs_rev), 1e-5);
    EXPECT_LT(max_rel(gf.dssda, gd.dssda), 1e-5);
    EXPECT_LT(max_rel(gf.dd, gd.dd), 1e-5);
  }
}

TEST(GoldenMimoBwdBwd, RejectsBadInputs) {
  Cfg c;
  const auto in = make(c);
  const auto st = mimo_chunked_forward(in).states;
  const auto qk = qk_dot_of(in);
  EXPECT_NO_THROW(mimo_bwd_bwd(in, st, qk, Layout::ReduceO));
  EXPECT_THROW(mimo_bwd_bwd(in, st, qk, Layout::PerRank), std::invalid_argument);  // mimo_o given
  {
    auto x = in;
    x.z = x.v;  // no gate in this pass
    x.mimo_z = x.mimo_v;
    EXPECT_THROW(mimo_bwd_bwd(x, st, qk, Layout::ReduceO), std::invalid_argument);
  }
  auto short_st = st;
  short_st.pop_back();
  EXPECT_THROW(mimo_bwd_bwd(in, short_st, qk, Layout::ReduceO), std::invalid_argument);
  auto short_qk = qk;
  short_qk.pop_back();
  EXPECT_THROW(mimo_bwd_bwd(in, st, short_qk, Layout::ReduceO), std::invalid_argument);
}

// ------------------------------------------------------------------ the combined backward

namespace {

struct CombinedCfg {
  Cfg base;
  bool z = true, norm = false;
};

MimoInputs<double> make_combined(const CombinedCfg& c) {
  MimoInputs<double> in = make(c.base);
  std::mt19937_64 rng(c.base.seed + 7777);
  const int64_t B = in.B, S = in.S, H = in.H, P = in.P, R = in.R;
  if (c.z) {
    in.mimo_z = unif(rng, H * R * P, -1.5, 1.5);
    in.z = unif(rng, B * S * H * P, -2, 2);
  }
  if (c.norm) {
    in.norm_weight = unif(rng, H * P, 0.5, 1.5);
    in.norm_eps = 1e-5;
  }
  return in;
}

// L = sum dout . out of the sequential recurrence (SPEC.md section 1), from adt.
double sequential_objective(const MimoInputs<double>& in) {
  const auto out = mimo_sequential(in).out;
  double s = 0;
  for (size_t i = 0; i < out.size(); ++i) s += in.dout[i] * out[i];
  return s;
}

std::vector<double> sequential_fd(MimoInputs<double> in,
                                  std::vector<double> MimoInputs<double>::*field,
                                  double eps = 1e-5) {
  const int64_t n = static_cast<int64_t>((in.*field).size());
  std::vector<double> fd(n);
  for (int64_t i = 0; i < n; ++i) {
    const double x0 = (in.*field)[i];
    (in.*field)[i] = x0 + eps;
    const double fp = sequential_objective(in);
    (in.*field)[i] = x0 - eps;
    const double fm = sequential_objective(in);
    (in.*field)[i] = x0;
    fd[i] = (fp - fm) / (2 * eps);
  }
  return fd;
}

}  // namespace

// The combined backward's 15 gradients against central differences of the sequential
// recurrence w.r.t. the raw inputs (adt instead of da_cs / da_cs_rev / segsum, which the
// golden derives from it as compute_dacs_segsum does), over the gate / norm / reduce-O /
// per-rank / D / GQA / tail variants.
TEST(GoldenMimoBwdCombined, GradientsMatchFiniteDifferencesOfTheRecurrence) {
  uint64_t seed = 600;
  for (int variant = 0; variant < 6; ++variant) {
    CombinedCfg c;
    c.base.seed = seed++;
    c.base.layout = variant == 2 || variant == 4 ? Layout::PerRank : Layout::ReduceO;
    c.z = variant != 3 && variant != 4;
    c.norm = variant == 1 || variant == 5;
    c.base.D = variant != 2;
    c.base.S = variant % 2 ? 13 : 12;
    c.base.R = variant == 5 ? 4 : (variant == 3 ? 1 : 2);
    c.base.N = variant == 5 ? 4 : 8;
    if (variant == 1 || variant == 4) c.base.H = 4, c.base.G = 2, c.base.B = 1;
    SCOPED_TRACE(c.base.str() + (c.z ? " z" : "") + (c.norm ? " norm" : ""));
    const auto in = make_combined(c);
    const auto g = mimo_bwd_combined(in);
    struct Check {
      const char* name;
      std::vector<double> MimoInputs<double>::*field;
      const std::vector<double>* grad;
    };
    std::vector<Check> checks = {{"dq", &MimoInputs<double>::q, &g.dq},
                                 {"dk", &MimoInputs<double>::k, &g.dk},
                                 {"dv", &MimoInputs<double>::v, &g.dv},
                                 {"dadt", &MimoInputs<double>::adt, &g.dadt},
                                 {"ddt", &MimoInputs<double>::dt, &g.ddt},
                                 {"dtrap", &MimoInputs<double>::trap, &g.dtrap},
                                 {"dq_bias", &MimoInputs<double>::q_bias, &g.dq_bias},
                                 {"dk_bias", &MimoInputs<double>::k_bias, &g.dk_bias},
                                 {"dmimo_v", &MimoInputs<double>::mimo_v, &g.dmimo_v},
                                 {"dangles", &MimoInputs<double>::angles, &g.dangles}};
    if (!in.mimo_o.empty()) checks.push_back({"dmimo_o", &MimoInputs<double>::mimo_o, &g.dmimo_o});
    if (c.z) {
      checks.push_back({"dmimo_z", &MimoInputs<double>::mimo_z, &g.dmimo_z});
      checks.push_back({"dz", &MimoInputs<double>::z, &g.dz});
    }
    if (c.base.D) checks.push_back({"dd", &MimoInputs<double>::D, &g.dd});
    if (c.norm)
      checks.push_back({"dnorm_weight", &MimoInputs<double>::norm_weight, &g.dnorm_weight});
    for (const Check& k : checks) {
      const auto fd = sequential_fd(in, k.field);
      ASSERT_GT(max_abs(fd), 1e-3) << k.name;
      EXPECT_LT(max_rel(*k.grad, fd), 2e-7) << k.name;
    }
    EXPECT_EQ(g.dmimo_o.empty(), in.mimo_o.empty());
    EXPECT_EQ(g.dz.empty(), !c.z);
    EXPECT_EQ(g.dd.empty(), !c.base.D);
    EXPECT_EQ(g.dnorm_weight.empty(), !c.norm);
  }
}
