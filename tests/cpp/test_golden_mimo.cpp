// The MIMO golden (golden/include/mamba3_golden/mimo.hpp): the chunked form against the
// sequential recurrence, the bwd_fwd gradients against central finite differences, states and
// qk_dot against their direct definitions, the partial-chunk contract against explicit padding,
// and the float instantiation against the double one.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <iterator>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "mamba3_golden/mimo.hpp"
#include "mamba3_golden/siso_model.hpp"

using namespace mamba3::golden;

namespace {

constexpr double kPi = 3.141592653589793238462643383279502884;

struct Cfg {
  int64_t B = 2, S = 12, H = 2, G = 1, N = 8, P = 3, R = 2, C = 4, rdd = 4;
  bool z = true, D = true, reduce = true;
  uint64_t seed = 1;
  bool norm = false;  // fused pre-gate RMSNorm (needs z and reduce)
  double eps = 1e-5;
  std::string str() const {
    std::ostringstream o;
    o << "B" << B << " S" << S << " H" << H << " G" << G << " N" << N << " P" << P << " R" << R
      << " C" << C << " rdd" << rdd << (z ? " z" : "") << (D ? " D" : "") << (reduce ? "" : " per-rank")
      << (norm ? " norm" : "") << " seed" << seed;
    return o.str();
  }
};

std::vector<double> unif(std::mt19937_64& rng, int64_t n, double lo, double hi) {
  std::uniform_real_distribution<double> d(lo, hi);
  std::vector<double> v(n);
  for (auto& e : v) e = d(rng);
  return v;
}

// Random inputs with adt and the chunk decay inputs derived from it.
MimoInputs<double> make(const Cfg& c) {
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
  if (c.reduce) in.mimo_o = unif(rng, H * R * P, -1, 1);
  if (c.z) {
    in.mimo_z = unif(rng, H * R * P, -1.5, 1.5);
    in.z = unif(rng, B * S * H * P, -2, 2);
  }
  if (c.D) in.D = unif(rng, H, -1, 1);
  in.angles = unif(rng, B * S * H * A, -3, 3);
  in.dt = unif(rng, B * H * S, 0.05, 0.6);
  in.trap = unif(rng, B * H * S, -2, 2);
  const auto a = unif(rng, B * H * S, 0.1, 1.5);
  in.adt.resize(B * H * S);
  for (int64_t i = 0; i < B * H * S; ++i) in.adt[i] = -a[i] * in.dt[i];
  in.dout = unif(rng, c.reduce ? B * S * H * P : B * S * R * H * P, -1, 1);
  if (c.norm) {
    in.norm_weight = unif(rng, H * P, 0.5, 1.5);
    in.norm_eps = c.eps;
  }
  mimo_dacs_segsum(in);
  return in;
}

double max_abs(const std::vector<double>& a) {
  double m = 0;
  for (double x : a) m = std::max(m, std::abs(x));
  return m;
}

// max|a - b| / max|b|; infinite on a size mismatch or non-finite values.
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

template <class U>
double rel_l2(const std::vector<U>& a, const std::vector<double>& b) {
  if (a.size() != b.size()) return INFINITY;
  double num = 0, den = 0;
  for (size_t i = 0; i < b.size(); ++i) {
    if (!std::isfinite(static_cast<double>(a[i]))) return INFINITY;
    const double d = static_cast<double>(a[i]) - b[i];
    num += d * d;
    den += b[i] * b[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

// Positions [s0, s1) of a tensor laid out [outer][S][inner].
std::vector<double> slice_seq(const std::vector<double>& x, int64_t outer, int64_t S, int64_t inner,
                              int64_t s0, int64_t s1) {
  std::vector<double> o;
  if (x.empty()) return o;
  o.reserve(outer * (s1 - s0) * inner);
  for (int64_t a = 0; a < outer; ++a)
    o.insert(o.end(), x.begin() + (a * S + s0) * inner, x.begin() + (a * S + s1) * inner);
  return o;
}

// The sequence positions [s0, s1) as a problem of its own (no states, chunk inputs re-derived).
MimoInputs<double> sub_sequence(const MimoInputs<double>& in, int64_t s0, int64_t s1) {
  MimoInputs<double> o = in;
  const int64_t B = in.B, S = in.S, H = in.H, G = in.G, N = in.N, P = in.P, R = in.R;
  const int64_t A = N / in.rotary_dim_divisor;
  o.S = s1 - s0;
  o.q = slice_seq(in.q, B, S, R * G * N, s0, s1);
  o.k = slice_seq(in.k, B, S, R * G * N, s0, s1);
  o.v = slice_seq(in.v, B, S, H * P, s0, s1);
  o.z = slice_seq(in.z, B, S, H * P, s0, s1);
  o.dout = slice_seq(in.dout, B, S, (in.mimo_o.empty() ? R : 1) * H * P, s0, s1);
  o.angles = slice_seq(in.angles, B, S, H * A, s0, s1);
  o.dt = slice_seq(in.dt, B * H, S, 1, s0, s1);
  o.trap = slice_seq(in.trap, B * H, S, 1, s0, s1);
  o.adt = slice_seq(in.adt, B * H, S, 1, s0, s1);
  o.ssm_state0.clear(), o.k_state0.clear(), o.v_state0.clear();
  mimo_dacs_segsum(o);
  return o;
}

double sigmoid(double x) { return 1 / (1 + std::exp(-x)); }

// sum over batch row b of dout * out (the scalar whose gradients bwd_fwd returns, per batch);
// out is [B,S,H,P] or, per rank, [B,S,R,H,P]: batch row b is the b-th block either way.
double objective(const MimoInputs<double>& in, int64_t b) {
  const auto out = mimo_chunked_forward(in).out;
  const int64_t n = static_cast<int64_t>(out.size()) / in.B;
  double s = 0;
  for (int64_t i = b * n; i < (b + 1) * n; ++i) s += in.dout[i] * out[i];
  return s;
}

// Central differences of objective(., b) for every element of the member `field`, for all b:
// result [B][field size].
std::vector<double> central_fd(MimoInputs<double> in, std::vector<double> MimoInputs<double>::*field,
                               double eps) {
  const int64_t n = static_cast<int64_t>((in.*field).size());
  std::vector<double> fd(in.B * n);
  for (int64_t i = 0; i < n; ++i) {
    const double x0 = (in.*field)[i];
    (in.*field)[i] = x0 + eps;
    std::vector<double> fp(in.B), fm(in.B);
    for (int64_t b = 0; b < in.B; ++b) fp[b] = objective(in, b);
    (in.*field)[i] = x0 - eps;
    for (int64_t b = 0; b < in.B; ++b) fm[b] = objective(in, b);
    (in.*field)[i] = x0;
    for (int64_t b = 0; b < in.B; ++b) fd[b * n + i] = (fp[b] - fm[b]) / (2 * eps);
  }
  return fd;
}

std::vector<Cfg> sweep() {
  std::vector<Cfg> v;
  uint64_t seed = 100;
  for (int64_t R : {1, 2, 4})
    for (int64_t C : {2, 4, 8})
      for (int64_t extra : {int64_t(0), int64_t(1), C - 1})
        for (int variant = 0; variant < 4; ++variant) {
          if (extra == C - 1 && C == 2) continue;  // extra = 1 is already covered
          Cfg c;
          c.R = R, c.C = C, c.S = 3 * C + extra, c.seed = seed++;
          c.z = variant & 1;
          c.D = variant & 2;
          // GQA on half of the cases: 4 heads reading 2 q/k heads.
          if (variant == 1 || variant == 2) c.H = 4, c.G = 2, c.B = 1;
          c.rdd = (variant == 3) ? 2 : 4;
          c.N = (R == 4) ? 4 : 8;
          v.push_back(c);
        }
  return v;
}

}  // namespace

TEST(GoldenMimo, ChunkedMatchesSequential) {
  for (const Cfg& c : sweep()) {
    SCOPED_TRACE(c.str());
    const auto in = make(c);
    const auto seq = mimo_sequential(in);
    const auto chk = mimo_chunked_forward(in);
    ASSERT_GT(max_abs(seq.out), 1e-3);
    EXPECT_LT(max_rel(chk.out, seq.out), 1e-12);
    EXPECT_LT(max_rel(chk.ssm_state, seq.ssm_state), 1e-12);
    EXPECT_EQ(chk.k_state, seq.k_state);
    EXPECT_EQ(chk.v_state, seq.v_state);
  }
}

TEST(GoldenMimo, ChunkedMatchesSequentialPerRankOutput) {
  for (int64_t S : {8, 11}) {
    Cfg c;
    c.reduce = false, c.R = 4, c.S = S, c.seed = 7 + S;
    for (bool z : {false, true}) {
      c.z = z;
      SCOPED_TRACE(c.str());
      const auto in = make(c);
      const auto seq = mimo_sequential(in);
      const auto chk = mimo_chunked_forward(in);
      ASSERT_EQ(seq.out.size(), static_cast<size_t>(c.B * c.S * c.R * c.H * c.P));
      EXPECT_LT(max_rel(chk.out, seq.out), 1e-12);
    }
  }
}

// Two steps written out by hand (rotation and GQA head map included), independently of the
// golden's code:
// H_0 = gamma_0 K_0,  H_1 = alpha_1 H_0 + beta_1 K_0 + gamma_1 K_1  (K_t = sum_r kh_t^r (x) x_t^r),
// y_t^r = qh_t^r . H_t + D x_t^r,  out_t = sum_r mimo_o^r silu(z_t mimo_z^r) y_t^r.
TEST(GoldenMimo, TwoStepsByHand) {
  for (int64_t rdd : {2, 4}) {
    Cfg c;
    c.B = 1, c.H = 4, c.G = 2, c.S = 2, c.R = 2, c.N = 8, c.P = 3, c.rdd = rdd, c.seed = 60 + rdd;
    SCOPED_TRACE(c.str());
    const auto in = make(c);
    const int64_t S = 2, H = c.H, G = c.G, N = c.N, P = c.P, R = c.R, A = N / rdd;
    std::vector<double> ref(S * H * P, 0.0);
    for (int64_t h = 0; h < H; ++h) {
      const int64_t g = h / (H / G);  // heads 0,1 read q/k head 0; heads 2,3 head 1
      // qh[t][r][n], kh[t][r][n], x[t][r][p]
      std::vector<double> qh(S * R * N), kh(S * R * N), x(S * R * P);
      for (int64_t t = 0; t < S; ++t)
        for (int64_t r = 0; r < R; ++r) {
          double* qv = &qh[(t * R + r) * N];
          double* kv = &kh[(t * R + r) * N];
          for (int64_t n = 0; n < N; ++n) {
            qv[n] = in.q[((t * R + r) * G + g) * N + n] + in.q_bias[(h * R + r) * N + n];
            kv[n] = in.k[((t * R + r) * G + g) * N + n] + in.k_bias[(h * R + r) * N + n];
          }
          for (int64_t i = 0; i < A; ++i) {
            const double th = in.angles[(t * H + h) * A + i];
            for (double* v : {qv, kv}) {
              const double a = v[i], e = v[N / 2 + i];
              v[i] = a * std::cos(th) - e * std::sin(th);
              v[N / 2 + i] = a * std::sin(th) + e * std::cos(th);
            }
          }
          for (int64_t p = 0; p < P; ++p)
            x[(t * R + r) * P + p] = in.v[(t * H + h) * P + p] * in.mimo_v[(h * R + r) * P + p];
        }
      auto K = [&](int64_t t, int64_t n, int64_t p) {
        double s = 0;
        for (int64_t r = 0; r < R; ++r) s += kh[(t * R + r) * N + n] * x[(t * R + r) * P + p];
        return s;
      };
      const double lam0 = sigmoid(in.trap[h * S]), lam1 = sigmoid(in.trap[h * S + 1]);
      const double g0 = lam0 * in.dt[h * S], g1 = lam1 * in.dt[h * S + 1];
      const double al1 = std::exp(in.adt[h * S + 1]), be1 = (1 - lam1) * in.dt[h * S + 1] * al1;
      for (int64_t t = 0; t < S; ++t)
        for (int64_t r = 0; r < R; ++r)
          for (int64_t p = 0; p < P; ++p) {
            double y = 0;
            for (int64_t n = 0; n < N; ++n) {
              const double H0 = g0 * K(0, n, p);
              const double Ht = t == 0 ? H0 : al1 * H0 + be1 * K(0, n, p) + g1 * K(1, n, p);
              y += qh[(t * R + r) * N + n] * Ht;
            }
            y += in.D[h] * x[(t * R + r) * P + p];
            const double u = in.z[(t * H + h) * P + p] * in.mimo_z[(h * R + r) * P + p];
            ref[(t * H + h) * P + p] += in.mimo_o[(h * R + r) * P + p] * u * sigmoid(u) * y;
          }
    }
    EXPECT_LT(max_rel(mimo_sequential(in).out, ref), 1e-14);
    EXPECT_LT(max_rel(mimo_chunked_forward(in).out, ref), 1e-14);
  }
}

// Rank 1 with unit projections is the SISO model with the half-pair rotation (the SISO golden
// accumulates raw angles itself; the MIMO golden takes the accumulated ones).
TEST(GoldenMimo, RankOneIsSisoHalfSplit) {
  for (int64_t rdd : {2, 4}) {
    Cfg c;
    c.R = 1, c.H = 4, c.G = 2, c.S = 9, c.N = 8, c.rdd = rdd, c.seed = 80 + rdd;
    SCOPED_TRACE(c.str());
    auto in = make(c);
    std::fill(in.mimo_v.begin(), in.mimo_v.end(), 1.0);
    std::fill(in.mimo_o.begin(), in.mimo_o.end(), 1.0);
    std::fill(in.mimo_z.begin(), in.mimo_z.end(), 1.0);
    const int64_t B = c.B, S = c.S, H = c.H, A = c.N / rdd;
    SisoInputs<double> si;
    si.B = B, si.S = S, si.H = H, si.G = c.G, si.N = c.N, si.P = c.P, si.A = A;
    si.rotation = Rotation::HalfSplit;
    si.q = in.q, si.k = in.k, si.v = in.v, si.adt = in.adt, si.dt = in.dt, si.trap = in.trap;
    si.q_bias = in.q_bias, si.k_bias = in.k_bias, si.D = in.D, si.z = in.z;
    std::mt19937_64 rng(9);
    si.angles = unif(rng, B * S * H * A, -2, 2);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t i = 0; i < A; ++i) {
          double th = 0;
          for (int64_t t = 0; t < S; ++t) {
            const int64_t ai = ((b * S + t) * H + h) * A + i;
            th += kPi * std::tanh(si.angles[ai]) * in.dt[(b * H + h) * S + t];
            in.angles[ai] = th;
          }
        }
    const auto so = siso_sequential(si);
    const auto mo = mimo_sequential(in);
    EXPECT_LT(max_rel(mo.out, so.out), 1e-12);
    EXPECT_LT(max_rel(mo.ssm_state, so.ssm_state), 1e-12);
    EXPECT_LT(max_rel(mo.k_state, so.k_state), 1e-12);
    EXPECT_EQ(mo.v_state, so.v_state);
  }
}

// The reduce-O output is the per-rank output contracted with mimo_o.
TEST(GoldenMimo, ReduceIsContractionOfPerRank) {
  Cfg c;
  c.R = 4, c.S = 9;
  const auto in = make(c);
  auto in_pr = in;
  in_pr.mimo_o.clear();
  const auto red = mimo_sequential(in).out;
  const auto pr = mimo_sequential(in_pr).out;
  std::vector<double> ref(red.size(), 0.0);
  for (int64_t b = 0; b < c.B; ++b)
    for (int64_t t = 0; t < c.S; ++t)
      for (int64_t r = 0; r < c.R; ++r)
        for (int64_t h = 0; h < c.H; ++h)
          for (int64_t p = 0; p < c.P; ++p)
            ref[((b * c.S + t) * c.H + h) * c.P + p] +=
                in.mimo_o[(h * c.R + r) * c.P + p] * pr[(((b * c.S + t) * c.R + r) * c.H + h) * c.P + p];
  EXPECT_LT(max_rel(red, ref), 1e-14);
}

// Input states: running [0, S1) and then [S1, S) from its final states is the whole run.
TEST(GoldenMimo, SequentialInputStatesContinueARun) {
  Cfg c;
  c.R = 2, c.S = 10, c.H = 4, c.G = 2;
  const auto in = make(c);
  const auto whole = mimo_sequential(in);
  const int64_t S1 = 4;
  const auto first = mimo_sequential(sub_sequence(in, 0, S1));
  auto rest_in = sub_sequence(in, S1, c.S);
  rest_in.ssm_state0 = first.ssm_state;
  rest_in.k_state0 = first.k_state;
  rest_in.v_state0 = first.v_state;
  const auto rest = mimo_sequential(rest_in);
  const int64_t per = c.H * c.P;
  std::vector<double> joined;
  for (int64_t b = 0; b < c.B; ++b) {
    joined.insert(joined.end(), first.out.begin() + b * S1 * per, first.out.begin() + (b + 1) * S1 * per);
    joined.insert(joined.end(), rest.out.begin() + b * (c.S - S1) * per,
                  rest.out.begin() + (b + 1) * (c.S - S1) * per);
  }
  EXPECT_LT(max_rel(joined, whole.out), 1e-13);
  EXPECT_LT(max_rel(rest.ssm_state, whole.ssm_state), 1e-13);
  EXPECT_EQ(rest.k_state, whole.k_state);
  EXPECT_EQ(rest.v_state, whole.v_state);
}

// The entering state of chunk c is the sequential state after step cC-1 plus the trapezoid's
// not-yet-decayed half of step cC: dt_{cC} (1 - lam_{cC}) sum_r kh_{cC-1}^r (x) x_{cC-1}^r.
TEST(GoldenMimo, EnteringStatesAreSequentialPrefixStates) {
  for (int64_t S : {12, 14}) {
    Cfg c;
    c.R = 2, c.C = 4, c.S = S, c.H = 4, c.G = 2, c.seed = 30 + S;
    SCOPED_TRACE(c.str());
    const auto in = make(c);
    const auto st = mimo_bwd_fwd(in).states;
    const int64_t nch = (S + c.C - 1) / c.C, N = c.N, P = c.P, R = c.R, H = c.H;
    ASSERT_EQ(st.size(), static_cast<size_t>(c.B * H * nch * N * P));
    std::vector<double> ref(st.size(), 0.0);
    for (int64_t ch = 1; ch < nch; ++ch) {
      const int64_t L = ch * c.C;
      const auto pre = mimo_sequential(sub_sequence(in, 0, L));
      for (int64_t b = 0; b < c.B; ++b)
        for (int64_t h = 0; h < H; ++h) {
          const int64_t bh = b * H + h;
          const double w = in.dt[bh * S + L] * (1 - sigmoid(in.trap[bh * S + L]));
          for (int64_t n = 0; n < N; ++n)
            for (int64_t p = 0; p < P; ++p) {
              double half = 0;
              for (int64_t r = 0; r < R; ++r)
                half += pre.k_state[(bh * R + r) * N + n] * pre.v_state[bh * P + p] *
                        in.mimo_v[(h * R + r) * P + p];
              ref[((bh * nch + ch) * N + n) * P + p] = pre.ssm_state[(bh * P + p) * N + n] + w * half;
            }
        }
    }
    ASSERT_GT(max_abs(ref), 1e-3);
    EXPECT_LT(max_rel(st, ref), 1e-12);
  }
}

// qk_dot is the same-position dot of the biased q and k, unrotated, which equals the rotated dot.
TEST(GoldenMimo, QkDotDirectDefinition) {
  for (int64_t rdd : {2, 4}) {
    Cfg c;
    c.R = 4, c.H = 4, c.G = 2, c.S = 7, c.rdd = rdd, c.seed = 50 + rdd;
    SCOPED_TRACE(c.str());
    const auto in = make(c);
    const auto qk = mimo_bwd_fwd(in).qk_dot;
    const int64_t S = c.S, H = c.H, G = c.G, N = c.N, R = c.R, A = N / rdd;
    std::vector<double> plain(qk.size()), rotated(qk.size());
    for (int64_t b = 0; b < c.B; ++b)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t t = 0; t < S; ++t)
          for (int64_t r = 0; r < R; ++r)
            for (int64_t r2 = 0; r2 < R; ++r2) {
              const int64_t g = h / (H / G);
              std::vector<double> qv(N), kv(N);
              for (int64_t n = 0; n < N; ++n) {
                qv[n] = in.q[(((b * S + t) * R + r) * G + g) * N + n] + in.q_bias[(h * R + r) * N + n];
                kv[n] = in.k[(((b * S + t) * R + r2) * G + g) * N + n] + in.k_bias[(h * R + r2) * N + n];
              }
              double d = 0;
              for (int64_t n = 0; n < N; ++n) d += qv[n] * kv[n];
              const int64_t o = (((b * H + h) * S + t) * R + r) * R + r2;
              plain[o] = d;
              for (int64_t i = 0; i < A; ++i) {
                const double th = in.angles[((b * S + t) * H + h) * A + i];
                const double cs = std::cos(th), sn = std::sin(th);
                for (auto* x : {&qv, &kv}) {
                  const double a = (*x)[i], e = (*x)[N / 2 + i];
                  (*x)[i] = a * cs - e * sn;
                  (*x)[N / 2 + i] = a * sn + e * cs;
                }
              }
              d = 0;
              for (int64_t n = 0; n < N; ++n) d += qv[n] * kv[n];
              rotated[o] = d;
            }
    EXPECT_LT(max_rel(qk, plain), 1e-15);
    EXPECT_LT(max_rel(qk, rotated), 1e-13);
  }
}

TEST(GoldenMimo, DacsSegsumDefinitions) {
  Cfg c;
  c.S = 11, c.C = 4;
  const auto in = make(c);
  const int64_t S = c.S, C = c.C, nch = 3;
  for (int64_t bh = 0; bh < c.B * c.H; ++bh)
    for (int64_t t = 0; t < S; ++t) {
      const int64_t s0 = t / C * C, last = std::min(s0 + C, S) - 1;
      double cs = 0;
      for (int64_t u = s0; u <= t; ++u) cs += in.adt[bh * S + u];
      EXPECT_NEAR(in.da_cs[bh * S + t], cs, 1e-15);
      double rv = 0;
      for (int64_t u = t + 1; u <= last; ++u) rv += in.adt[bh * S + u];
      EXPECT_NEAR(in.da_cs_rev[bh * S + t], rv, 1e-15);
      for (int64_t j = 0; j < C; ++j) {
        const double seg = in.segsum[((bh * nch + t / C) * C + t % C) * C + j];
        if (j >= t % C)
          EXPECT_EQ(seg, 0.0);
        else
          EXPECT_NEAR(seg, in.da_cs[bh * S + t] - in.da_cs[bh * S + s0 + j], 1e-15);
      }
    }
}

// dmimo_o, dmimo_z (per batch) and dz are the gradients of sum(dout * out).
TEST(GoldenMimo, BwdFwdGradientsMatchFiniteDifferences) {
  std::vector<Cfg> cfgs(4);
  cfgs[0].R = 2, cfgs[0].S = 8, cfgs[0].C = 4;                                // whole chunks
  cfgs[1].R = 4, cfgs[1].S = 7, cfgs[1].C = 4, cfgs[1].N = 4, cfgs[1].D = false;  // tail
  cfgs[2].R = 1, cfgs[2].S = 6, cfgs[2].C = 2, cfgs[2].H = 4, cfgs[2].G = 2, cfgs[2].rdd = 2;
  cfgs[3].R = 2, cfgs[3].S = 5, cfgs[3].C = 4, cfgs[3].z = false;             // no gate
  uint64_t seed = 70;
  for (Cfg& c : cfgs) {
    c.seed = seed++;
    SCOPED_TRACE(c.str());
    const auto in = make(c);
    const auto g = mimo_bwd_fwd(in);
    const double eps = 1e-5;
    const auto fd_o = central_fd(in, &MimoInputs<double>::mimo_o, eps);
    ASSERT_GT(max_abs(fd_o), 1e-2);
    EXPECT_LT(max_rel(g.dmimo_o, fd_o), 1e-8);
    if (!c.z) {
      EXPECT_TRUE(g.dmimo_z.empty());
      EXPECT_TRUE(g.dz.empty());
      continue;
    }
    const auto fd_mz = central_fd(in, &MimoInputs<double>::mimo_z, eps);
    ASSERT_GT(max_abs(fd_mz), 1e-2);
    EXPECT_LT(max_rel(g.dmimo_z, fd_mz), 1e-8);
    // z of batch b only moves objective(., b): dz is the diagonal block of the differences.
    const auto fd_z_all = central_fd(in, &MimoInputs<double>::z, eps);
    const int64_t n = c.B * c.S * c.H * c.P, per = c.S * c.H * c.P;
    std::vector<double> fd_z(n);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t b = i / per;
      fd_z[i] = fd_z_all[b * n + i];
      for (int64_t b2 = 0; b2 < c.B; ++b2)
        if (b2 != b) {
          EXPECT_EQ(fd_z_all[b2 * n + i], 0.0);
        }
    }
    ASSERT_GT(max_abs(fd_z), 1e-2);
    EXPECT_LT(max_rel(g.dz, fd_z), 1e-8);
  }
}

// The per-rank readout y [B,S,R,H,P] of `in` (no gate, no norm, no down projection).
std::vector<double> raw_readout(const MimoInputs<double>& in) {
  auto x = in;
  x.mimo_o.clear(), x.z.clear(), x.mimo_z.clear(), x.norm_weight.clear();
  return mimo_chunked_forward(x).out;
}

// The pre-gate RMSNorm model written out from the definition, on a given readout y:
// out_t = sum_r mimo_o^r silu(z_t mimo_z^r) y_t^r / sqrt(mean_p (y_t^r)^2 + eps) * w.
std::vector<double> norm_gate_project(const MimoInputs<double>& in, const std::vector<double>& y) {
  const int64_t B = in.B, S = in.S, H = in.H, P = in.P, R = in.R;
  std::vector<double> out(B * S * H * P, 0.0);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < S; ++t)
      for (int64_t r = 0; r < R; ++r)
        for (int64_t h = 0; h < H; ++h) {
          const double* yr = &y[(((b * S + t) * R + r) * H + h) * P];
          double ms = 0;
          for (int64_t p = 0; p < P; ++p) ms += yr[p] * yr[p] / P;
          for (int64_t p = 0; p < P; ++p) {
            const double u = in.z[((b * S + t) * H + h) * P + p] * in.mimo_z[(h * R + r) * P + p];
            out[((b * S + t) * H + h) * P + p] += in.mimo_o[(h * R + r) * P + p] * u * sigmoid(u) *
                                                  yr[p] / std::sqrt(ms + in.norm_eps) *
                                                  in.norm_weight[h * P + p];
          }
        }
  return out;
}

TEST(GoldenMimo, NormForwardNormalizesEachRankBeforeTheGate) {
  for (double eps : {1e-5, 0.5}) {
    Cfg c;
    c.R = 2, c.S = 10, c.H = 4, c.G = 2, c.norm = true, c.eps = eps, c.seed = 140;
    SCOPED_TRACE(c.str());
    const auto in = make(c);
    const auto ref = norm_gate_project(in, raw_readout(in));
    ASSERT_GT(max_abs(ref), 1e-2);
    EXPECT_LT(max_rel(mimo_sequential(in).out, ref), 1e-12);
    EXPECT_LT(max_rel(mimo_chunked_forward(in).out, ref), 1e-12);
    // The norm changes the output (it is not silently skipped).
    auto plain = in;
    plain.norm_weight.clear();
    EXPECT_GT(max_rel(mimo_chunked_forward(plain).out, ref), 1e-2);
  }
}

// With the norm: dmimo_o, dmimo_z, dz and dnorm_weight (summed over r: the weight is shared by
// the ranks) against central differences of sum(dout * out).
TEST(GoldenMimo, BwdFwdNormGradientsMatchFiniteDifferences) {
  std::vector<Cfg> cfgs(3);
  cfgs[0].R = 2, cfgs[0].S = 8, cfgs[0].C = 4;
  cfgs[1].R = 4, cfgs[1].S = 7, cfgs[1].C = 4, cfgs[1].N = 4, cfgs[1].D = false, cfgs[1].eps = 0.3;
  cfgs[2].R = 1, cfgs[2].S = 6, cfgs[2].C = 2, cfgs[2].H = 4, cfgs[2].G = 2, cfgs[2].rdd = 2;
  uint64_t seed = 150;
  for (Cfg& c : cfgs) {
    c.norm = true;
    c.seed = seed++;
    SCOPED_TRACE(c.str());
    const auto in = make(c);
    const auto g = mimo_bwd_fwd(in);
    const double eps = 1e-5;
    const int64_t B = c.B, H = c.H, P = c.P, R = c.R;
    const auto fd_o = central_fd(in, &MimoInputs<double>::mimo_o, eps);
    ASSERT_GT(max_abs(fd_o), 1e-2);
    EXPECT_LT(max_rel(g.dmimo_o, fd_o), 1e-8);
    const auto fd_mz = central_fd(in, &MimoInputs<double>::mimo_z, eps);
    ASSERT_GT(max_abs(fd_mz), 1e-2);
    EXPECT_LT(max_rel(g.dmimo_z, fd_mz), 1e-8);
    const auto fd_w = central_fd(in, &MimoInputs<double>::norm_weight, eps);  // [B][H*P]
    std::vector<double> dw(B * H * P, 0.0);
    ASSERT_EQ(g.dnorm_weight.size(), static_cast<size_t>(B * H * R * P));
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t r = 0; r < R; ++r)
          for (int64_t p = 0; p < P; ++p)
            dw[(b * H + h) * P + p] += g.dnorm_weight[((b * H + h) * R + r) * P + p];
    ASSERT_GT(max_abs(fd_w), 1e-2);
    EXPECT_LT(max_rel(dw, fd_w), 1e-8);
    const auto fd_z_all = central_fd(in, &MimoInputs<double>::z, eps);
    const int64_t n = B * c.S * H * P, per = c.S * H * P;
    std::vector<double> fd_z(n);
    for (int64_t i = 0; i < n; ++i) fd_z[i] = fd_z_all[(i / per) * n + i];
    ASSERT_GT(max_abs(fd_z), 1e-2);
    EXPECT_LT(max_rel(g.dz, fd_z), 1e-8);
  }
}

// dout_pre_rms is the gradient of sum(dout * out) w.r.t. the raw readout y: central differences
// over every element of y of the model written out in the test (norm_gate_project).
TEST(GoldenMimo, DoutPreRmsIsTheGradientWrtTheReadout) {
  for (double eps : {1e-5, 0.2}) {
    Cfg c;
    c.R = 2, c.S = 6, c.H = 2, c.P = 5, c.norm = true, c.eps = eps, c.seed = 160;
    SCOPED_TRACE(c.str());
    const auto in = make(c);
    const auto g = mimo_bwd_fwd(in);
    const int64_t B = c.B, S = c.S, H = c.H, P = c.P, R = c.R;
    std::vector<double> y = raw_readout(in);
    std::vector<double> fd(B * H * S * R * P);
    const double h_eps = 1e-6;
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 0; t < S; ++t)
        for (int64_t r = 0; r < R; ++r)
          for (int64_t h = 0; h < H; ++h)
            for (int64_t p = 0; p < P; ++p) {
              const int64_t yi = (((b * S + t) * R + r) * H + h) * P + p;
              const double y0 = y[yi];
              double f[2];
              for (int sgn = 0; sgn < 2; ++sgn) {
                y[yi] = y0 + (sgn ? -h_eps : h_eps);
                const auto out = norm_gate_project(in, y);
                f[sgn] = 0;
                for (size_t i = 0; i < out.size(); ++i) f[sgn] += in.dout[i] * out[i];
              }
              y[yi] = y0;
              fd[(((b * H + h) * S + t) * R + r) * P + p] = (f[0] - f[1]) / (2 * h_eps);
            }
    ASSERT_GT(max_abs(fd), 1e-2);
    EXPECT_LT(max_rel(g.dout_pre_rms, fd), 1e-8);
  }
}

// Through the whole operator: with dout_pre_rms as the per-rank dout of an ungated, unnormalized
// run (what the second pass consumes), the gradients w.r.t. inputs that only act through y (D,
// q, v) are those of the normalized, gated model.
TEST(GoldenMimo, DoutPreRmsDrivesTheReadoutGradients) {
  Cfg c;
  c.R = 2, c.S = 7, c.C = 4, c.H = 2, c.norm = true, c.seed = 170;
  SCOPED_TRACE(c.str());
  const auto in = make(c);
  const auto g = mimo_bwd_fwd(in);
  const int64_t B = c.B, S = c.S, H = c.H, P = c.P, R = c.R;
  auto lin = in;
  lin.mimo_o.clear(), lin.z.clear(), lin.mimo_z.clear(), lin.norm_weight.clear();
  lin.dout.assign(B * S * R * H * P, 0.0);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t t = 0; t < S; ++t)
        for (int64_t r = 0; r < R; ++r)
          for (int64_t p = 0; p < P; ++p)
            lin.dout[(((b * S + t) * R + r) * H + h) * P + p] =
                g.dout_pre_rms[(((b * H + h) * S + t) * R + r) * P + p];
  for (auto field : {&MimoInputs<double>::D, &MimoInputs<double>::q, &MimoInputs<double>::v}) {
    const auto full = central_fd(in, field, 1e-5);
    const auto via = central_fd(lin, field, 1e-5);
    ASSERT_GT(max_abs(full), 1e-2);
    EXPECT_LT(max_rel(via, full), 1e-7);
  }
}

// Per-rank dout (no mimo_o): dmimo_z and dz against central differences; no dmimo_o.
TEST(GoldenMimo, BwdFwdPerRankGradientsMatchFiniteDifferences) {
  for (bool z : {true, false}) {
    Cfg c;
    c.R = 4, c.S = 9, c.C = 4, c.N = 4, c.H = 4, c.G = 2, c.reduce = false, c.z = z;
    c.seed = 180 + z;
    SCOPED_TRACE(c.str());
    const auto in = make(c);
    const auto g = mimo_bwd_fwd(in);
    EXPECT_TRUE(g.dmimo_o.empty());
    EXPECT_TRUE(g.dnorm_weight.empty() && g.dout_pre_rms.empty());
    EXPECT_EQ(g.qk_dot.size(), static_cast<size_t>(c.B * c.H * c.S * c.R * c.R));
    if (!z) {
      EXPECT_TRUE(g.dmimo_z.empty() && g.dz.empty());
      continue;
    }
    const auto fd_mz = central_fd(in, &MimoInputs<double>::mimo_z, 1e-5);
    ASSERT_GT(max_abs(fd_mz), 1e-2);
    EXPECT_LT(max_rel(g.dmimo_z, fd_mz), 1e-8);
    const auto fd_z_all = central_fd(in, &MimoInputs<double>::z, 1e-5);
    const int64_t n = c.B * c.S * c.H * c.P, per = c.S * c.H * c.P;
    std::vector<double> fd_z(n);
    for (int64_t i = 0; i < n; ++i) fd_z[i] = fd_z_all[(i / per) * n + i];
    ASSERT_GT(max_abs(fd_z), 1e-2);
    EXPECT_LT(max_rel(g.dz, fd_z), 1e-8);
  }
}

// Partial last chunk: the operator equals the seed's recipe run on a padded problem (sequence
// inputs zero-padded, da_cs edge-padded, the last chunk's da_cs_rev / segsum rebuilt), with
// the outputs that have a sequence axis cut back to S.
TEST(GoldenMimo, TailMatchesExplicitPadding) {
  for (int64_t S : {5, 9, 15})
  for (int variant = 0; variant < 3; ++variant) {  // reduce-O + gate, + norm, per rank + gate
    Cfg c;
    c.R = 2, c.C = 4, c.S = S, c.H = 4, c.G = 2, c.seed = 90 + S + 20 * variant;
    c.norm = variant == 1;
    c.reduce = variant != 2;
    SCOPED_TRACE(c.str());
    const auto in = make(c);
    const auto g = mimo_bwd_fwd(in);
    const int64_t B = c.B, H = c.H, G = c.G, N = c.N, P = c.P, R = c.R, C = c.C;
    const int64_t A = N / c.rdd, nch = (S + C - 1) / C, Sp = nch * C;
    auto pad = [&](const std::vector<double>& x, int64_t outer, int64_t inner, bool edge) {
      std::vector<double> o;
      for (int64_t a = 0; a < outer; ++a) {
        o.insert(o.end(), x.begin() + a * S * inner, x.begin() + (a + 1) * S * inner);
        for (int64_t s = S; s < Sp; ++s)
          for (int64_t i = 0; i < inner; ++i) o.push_back(edge ? x[(a * S + S - 1) * inner + i] : 0.0);
      }
      return o;
    };
    MimoInputs<double> pd = in;
    pd.S = Sp;
    pd.q = pad(in.q, B, R * G * N, false);
    pd.k = pad(in.k, B, R * G * N, false);
    pd.v = pad(in.v, B, H * P, false);
    pd.z = pad(in.z, B, H * P, false);
    pd.dout = pad(in.dout, B, (c.reduce ? 1 : R) * H * P, false);
    pd.angles = pad(in.angles, B, H * A, false);
    pd.dt = pad(in.dt, B * H, 1, false);
    pd.trap = pad(in.trap, B * H, 1, false);
    pd.da_cs = pad(in.da_cs, B * H, 1, true);
    pd.da_cs_rev = pad(in.da_cs_rev, B * H, 1, false);
    const int64_t s0 = (nch - 1) * C;
    for (int64_t bh = 0; bh < B * H; ++bh) {
      const double* cs = &pd.da_cs[bh * Sp + s0];
      for (int64_t i = 0; i < C; ++i) {
        pd.da_cs_rev[bh * Sp + s0 + i] = cs[C - 1] - cs[i];
        for (int64_t j = 0; j < C; ++j) pd.segsum[((bh * nch + nch - 1) * C + i) * C + j] = cs[i] - cs[j];
      }
    }
    const auto gp = mimo_bwd_fwd(pd);
    EXPECT_LT(max_rel(g.states, gp.states), 1e-13);
    EXPECT_LT(max_rel(g.dmimo_o, gp.dmimo_o), 1e-13);
    EXPECT_LT(max_rel(g.dmimo_z, gp.dmimo_z), 1e-13);
    EXPECT_LT(max_rel(g.qk_dot, slice_seq(gp.qk_dot, B * H, Sp, R * R, 0, S)), 1e-15);
    EXPECT_LT(max_rel(g.dz, slice_seq(gp.dz, B, Sp, H * P, 0, S)), 1e-13);
    EXPECT_LT(max_rel(g.dnorm_weight, gp.dnorm_weight), 1e-13);
    EXPECT_LT(max_rel(g.dout_pre_rms, slice_seq(gp.dout_pre_rms, B * H, Sp, R * P, 0, S)), 1e-13);
    EXPECT_EQ(g.dmimo_o.empty(), !c.reduce);
    EXPECT_EQ(g.dnorm_weight.empty(), !c.norm);
    // The padded run's final state is the unpadded one too (zero rows add nothing).
    EXPECT_LT(max_rel(mimo_chunked_forward(in).ssm_state, mimo_chunked_forward(pd).ssm_state), 1e-13);
  }
}

// What the operator never reads: the diagonal and upper triangle of segsum, and in a partial
// last chunk the caller's segsum and da_cs_rev; da_cs_rev of a whole last chunk only moves the
// (non-output) state after it.
TEST(GoldenMimo, UnreadDecayEntriesDoNotMatter) {
  for (int64_t S : {12, 10}) {
    Cfg c;
    c.R = 2, c.C = 4, c.S = S, c.seed = 110 + S;
    SCOPED_TRACE(c.str());
    const auto in = make(c);
    const auto g = mimo_bwd_fwd(in);
    auto junk = in;
    const int64_t C = c.C, nch = (S + C - 1) / C, s0 = (nch - 1) * C;
    std::mt19937_64 rng(5);
    std::uniform_real_distribution<double> d(-3, 3);
    for (int64_t bh = 0; bh < c.B * c.H; ++bh) {
      for (int64_t ch = 0; ch < nch; ++ch)
        for (int64_t i = 0; i < C; ++i)
          for (int64_t j = 0; j < C; ++j)
            if (j >= i || (ch == nch - 1 && S % C != 0)) junk.segsum[((bh * nch + ch) * C + i) * C + j] = d(rng);
      for (int64_t t = s0; t < S; ++t) junk.da_cs_rev[bh * S + t] = d(rng);
    }
    const auto gj = mimo_bwd_fwd(junk);
    EXPECT_EQ(g.states, gj.states);
    EXPECT_EQ(g.qk_dot, gj.qk_dot);
    EXPECT_EQ(g.dmimo_o, gj.dmimo_o);
    EXPECT_EQ(g.dmimo_z, gj.dmimo_z);
    EXPECT_EQ(g.dz, gj.dz);
    EXPECT_EQ(mimo_chunked_forward(in).out, mimo_chunked_forward(junk).out);
  }
}

// da_cs, da_cs_rev and segsum are independent inputs, each read in its own role. With them made
// mutually inconsistent, and per-rank output without z or D (so out = y), finite differences
// split y_t into its parts: d y_t / d da_cs_t is the inter-chunk term, the sum over j of
// d y_t / d segsum[c, i, j] the intra-chunk term, and the rest is gamma_t sum_r' qk_dot x_t^r';
// for the states, sum_s d St_{c+1} / d da_cs_rev_s = St_{c+1} - exp(da_cs_last) St_c and
// d St_{c+1} / d da_cs_last = exp(da_cs_last) St_c.
TEST(GoldenMimo, DecayInputsReadInTheirRoles) {
  Cfg c;
  c.B = 1, c.H = 2, c.G = 1, c.S = 12, c.C = 4, c.R = 2, c.z = false, c.D = false, c.reduce = false;
  c.seed = 120;
  auto in = make(c);
  std::mt19937_64 rng(11);
  std::uniform_real_distribution<double> d(-0.3, 0.0);
  for (auto* f : {&in.da_cs, &in.da_cs_rev, &in.segsum})
    for (auto& x : *f) x += d(rng);
  const int64_t S = c.S, H = c.H, N = c.N, P = c.P, R = c.R, C = c.C, nch = S / C;
  const auto base = mimo_chunked_forward(in);
  const auto qk = mimo_bwd_fwd([&] {
                    auto x = in;
                    x.mimo_o.assign(H * R * P, 1.0);
                    x.dout.assign(S * H * P, 0.0);
                    return x;
                  }())
                      .qk_dot;
  const double eps = 1e-6;
  // Central difference of the forward's output `which` (0: out, 1: states) w.r.t. field[i].
  auto fd = [&](std::vector<double> MimoInputs<double>::*field, int64_t i, int which) {
    auto x = in;
    (x.*field)[i] += eps;
    const auto p = mimo_chunked_forward(x);
    (x.*field)[i] -= 2 * eps;
    const auto m = mimo_chunked_forward(x);
    const auto& a = which ? p.states : p.out;
    const auto& b = which ? m.states : m.out;
    std::vector<double> g(a.size());
    for (size_t k = 0; k < a.size(); ++k) g[k] = (a[k] - b[k]) / (2 * eps);
    return g;
  };
  auto yi = [&](int64_t t, int64_t r, int64_t h, int64_t p) { return ((t * R + r) * H + h) * P + p; };
  for (int64_t h = 0; h < H; ++h) {
    std::vector<double> y, parts;
    double inter_max = 0, intra_max = 0;
    for (int64_t t = 0; t < S; ++t) {
      const int64_t ch = t / C, i = t % C;
      const auto inter = fd(&MimoInputs<double>::da_cs, h * S + t, 0);
      std::vector<double> intra(base.out.size(), 0.0);
      for (int64_t j = 0; j < i; ++j) {
        const auto g = fd(&MimoInputs<double>::segsum, ((h * nch + ch) * C + i) * C + j, 0);
        for (size_t k = 0; k < g.size(); ++k) intra[k] += g[k];
      }
      const double gamma = in.dt[h * S + t] * sigmoid(in.trap[h * S + t]);
      for (int64_t r = 0; r < R; ++r)
        for (int64_t p = 0; p < P; ++p) {
          double diag = 0;
          for (int64_t r2 = 0; r2 < R; ++r2)
            diag += qk[((h * S + t) * R + r) * R + r2] * in.v[(t * H + h) * P + p] * in.mimo_v[(h * R + r2) * P + p];
          const int64_t k = yi(t, r, h, p);
          y.push_back(base.out[k]);
          parts.push_back(inter[k] + intra[k] + gamma * diag);
          inter_max = std::max(inter_max, std::abs(inter[k]));
          intra_max = std::max(intra_max, std::abs(intra[k]));
        }
    }
    EXPECT_GT(inter_max, 1e-2);
    EXPECT_GT(intra_max, 1e-2);
    EXPECT_LT(max_rel(parts, y), 1e-8);

    for (int64_t ch = 0; ch + 1 < nch; ++ch) {
      const int64_t last = h * S + ch * C + C - 1;
      std::vector<double> rev_sum(N * P, 0.0), carried(N * P), decay_ref(N * P), step(N * P);
      for (int64_t s = ch * C; s < ch * C + C; ++s) {
        const auto g = fd(&MimoInputs<double>::da_cs_rev, h * S + s, 1);
        for (int64_t e = 0; e < N * P; ++e) rev_sum[e] += g[((h * nch + ch + 1) * N * P) + e];
      }
      const auto gd = fd(&MimoInputs<double>::da_cs, last, 1);
      const double dec = std::exp(in.da_cs[last]);
      for (int64_t e = 0; e < N * P; ++e) {
        const double now = base.states[(h * nch + ch) * N * P + e];
        const double next = base.states[(h * nch + ch + 1) * N * P + e];
        step[e] = next - dec * now;
        decay_ref[e] = dec * now;
        carried[e] = gd[(h * nch + ch + 1) * N * P + e];
      }
      ASSERT_GT(max_abs(step), 1e-2);
      EXPECT_LT(max_rel(rev_sum, step), 1e-8);
      if (ch > 0) {
        ASSERT_GT(max_abs(decay_ref), 1e-2);
        EXPECT_LT(max_rel(carried, decay_ref), 1e-8);
      }
    }
  }
}

// The float instantiation (the dual benchmark's fp32 reference) stays close to the double golden.
TEST(GoldenMimo, FloatCloseToDouble) {
  for (const Cfg& base : {Cfg{}, Cfg{1, 37, 4, 2, 16, 8, 4, 8, 4, true, true, true, 3},
                          Cfg{2, 21, 2, 1, 8, 16, 2, 8, 2, true, false, true, 4, true, 1e-5},
                          Cfg{1, 19, 4, 2, 8, 8, 4, 4, 4, true, true, false, 5}}) {
    Cfg c = base;
    SCOPED_TRACE(c.str());
    const auto in = make(c);
    MimoInputs<float> f;
    f.B = in.B, f.S = in.S, f.H = in.H, f.G = in.G, f.N = in.N, f.P = in.P, f.R = in.R;
    f.rotary_dim_divisor = in.rotary_dim_divisor, f.chunk_size = in.chunk_size;
    std::vector<double> MimoInputs<double>::*dfields[] = {
        &MimoInputs<double>::q,      &MimoInputs<double>::k,         &MimoInputs<double>::v,
        &MimoInputs<double>::q_bias, &MimoInputs<double>::k_bias,    &MimoInputs<double>::mimo_v,
        &MimoInputs<double>::mimo_o, &MimoInputs<double>::mimo_z,    &MimoInputs<double>::z,
        &MimoInputs<double>::D,      &MimoInputs<double>::angles,    &MimoInputs<double>::dt,
        &MimoInputs<double>::trap,   &MimoInputs<double>::adt,       &MimoInputs<double>::da_cs,
        &MimoInputs<double>::da_cs_rev, &MimoInputs<double>::segsum, &MimoInputs<double>::dout,
        &MimoInputs<double>::norm_weight};
    std::vector<float> MimoInputs<float>::*ffields[] = {
        &MimoInputs<float>::q,      &MimoInputs<float>::k,         &MimoInputs<float>::v,
        &MimoInputs<float>::q_bias, &MimoInputs<float>::k_bias,    &MimoInputs<float>::mimo_v,
        &MimoInputs<float>::mimo_o, &MimoInputs<float>::mimo_z,    &MimoInputs<float>::z,
        &MimoInputs<float>::D,      &MimoInputs<float>::angles,    &MimoInputs<float>::dt,
        &MimoInputs<float>::trap,   &MimoInputs<float>::adt,       &MimoInputs<float>::da_cs,
        &MimoInputs<float>::da_cs_rev, &MimoInputs<float>::segsum, &MimoInputs<float>::dout,
        &MimoInputs<float>::norm_weight};
    // Round the double inputs to float first so both see the same values.
    MimoInputs<double> in_r = in;
    for (size_t i = 0; i < std::size(dfields); ++i) {
      auto& dv = in_r.*dfields[i];
      for (auto& x : dv) x = static_cast<float>(x);
      (f.*ffields[i]).assign(dv.begin(), dv.end());
    }
    f.norm_eps = static_cast<float>(in.norm_eps);
    in_r.norm_eps = f.norm_eps;
    const auto gd = mimo_bwd_fwd(in_r);
    const auto gf = mimo_bwd_fwd(f);
    EXPECT_LT(rel_l2(gf.dnorm_weight, gd.dnorm_weight), 1e-5);
    EXPECT_LT(rel_l2(gf.dout_pre_rms, gd.dout_pre_rms), 1e-5);
    EXPECT_LT(rel_l2(gf.states, gd.states), 1e-5);
    EXPECT_LT(max_rel(gf.qk_dot, gd.qk_dot), 1e-6);
    EXPECT_LT(rel_l2(gf.dmimo_o, gd.dmimo_o), 1e-5);
    EXPECT_LT(max_rel(gf.dmimo_z, gd.dmimo_z), 1e-5);
    EXPECT_LT(rel_l2(gf.dz, gd.dz), 1e-5);
    EXPECT_LT(rel_l2(mimo_sequential(f).out, mimo_sequential(in_r).out), 1e-5);
    EXPECT_LT(rel_l2(mimo_chunked_forward(f).out, mimo_chunked_forward(in_r).out), 1e-5);
  }
}

TEST(GoldenMimo, RejectsBadInputs) {
  Cfg c;
  const auto in = make(c);
  {
    auto x = in;
    x.mimo_z.clear();  // z without mimo_z is no gate configuration
    EXPECT_THROW(mimo_bwd_fwd(x), std::invalid_argument);
  }
  {
    auto x = in;
    x.mimo_o.clear();  // per rank: dout must then be [B,S,R,H,P]
    EXPECT_THROW(mimo_bwd_fwd(x), std::invalid_argument);
    EXPECT_NO_THROW(mimo_chunked_forward(x));
    x.dout.assign(x.B * x.S * x.R * x.H * x.P, 0.5);
    EXPECT_NO_THROW(mimo_bwd_fwd(x));
  }
  {
    auto x = in;
    x.norm_weight.assign(x.H * x.P, 1.0);
    EXPECT_NO_THROW(mimo_bwd_fwd(x));
    x.norm_weight.pop_back();
    EXPECT_THROW(mimo_bwd_fwd(x), std::invalid_argument);
    x.norm_weight.push_back(1.0);
    x.norm_eps = 0;
    EXPECT_THROW(mimo_sequential(x), std::invalid_argument);
    x.norm_eps = 1e-5;
    auto no_z = x;  // the norm sits before the gate: it needs the gate
    no_z.z.clear(), no_z.mimo_z.clear();
    EXPECT_THROW(mimo_chunked_forward(no_z), std::invalid_argument);
    auto no_o = x;  // and the reduce-O projection
    no_o.mimo_o.clear();
    EXPECT_THROW(mimo_chunked_forward(no_o), std::invalid_argument);
  }
  {
    auto x = in;
    x.segsum.pop_back();
    EXPECT_THROW(mimo_bwd_fwd(x), std::invalid_argument);
  }
  {
    auto x = in;
    x.rotary_dim_divisor = 3;
    EXPECT_THROW(mimo_sequential(x), std::invalid_argument);
  }
  {
    auto x = in;
    x.G = 3;  // H = 2 is no multiple of 3
    EXPECT_THROW(mimo_chunked_forward(x), std::invalid_argument);
  }
  {
    auto x = in;
    x.ssm_state0.assign(x.B * x.H * x.P * x.N, 0.0);  // k/v states missing
    EXPECT_THROW(mimo_sequential(x), std::invalid_argument);
  }
}
