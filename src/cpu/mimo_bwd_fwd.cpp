// CPU backend of mamba3_mimo_bwd_fwd (seed 003): the chunked forward recomputed per (batch, head)
// in float32, the entering states and qk_dot cached for the second pass, and the gradients of the
// output projection, the SiLU gate and the pre-gate RMSNorm, which need no reverse scan.
//
// Every tensor is read through its own strides and runtime dtype; rows are converted to float once
// so the inner loops are plain float arithmetic. One work item is one (b, h): it owns the running
// state and writes only its own slices of every output, so the thread count cannot change a
// result. Sums over the sequence (dmimo_o, dmimo_z, dnorm_weight) are compensated: they add up
// thousands of terms of both signs.
#include "cpu/mimo_bwd.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu/io.hpp"

namespace mamba3::cpu {
namespace {

inline int64_t off5(const TensorView& v, int64_t i0, int64_t i1, int64_t i2, int64_t i3,
                    int64_t i4) {
  return i0 * v.strides[0] + i1 * v.strides[1] + i2 * v.strides[2] + i3 * v.strides[3] +
         i4 * v.strides[4];
}

inline float sigmoidf(float x) { return 1.f / (1.f + std::exp(-x)); }

// Rotates the pairs (i, N/2 + i), i < A, of x by theta[i]:
// (a, b) -> (a cos - b sin, a sin + b cos).
inline void rotate_half_pairs(float* x, int64_t N, const float* cos_t, const float* sin_t,
                              int64_t A) {
  const int64_t half = N / 2;
  for (int64_t i = 0; i < A; ++i) {
    const float a = x[i], b = x[half + i];
    x[i] = a * cos_t[i] - b * sin_t[i];
    x[half + i] = a * sin_t[i] + b * cos_t[i];
  }
}

inline float dot(const float* a, const float* b, int64_t n) {
  float s = 0.f;
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// Compensated running sums of an [R,P] gradient over the sequence.
struct SumRP {
  std::vector<float> sum, err;
  explicit SumRP(int64_t n) : sum(static_cast<size_t>(n), 0.f), err(static_cast<size_t>(n), 0.f) {}
  void add(int64_t i, float x) { compensated_add(sum[i], err[i], x); }
  std::vector<float> result() const {
    std::vector<float> r(sum.size());
    for (size_t i = 0; i < r.size(); ++i) r[i] = sum[i] + err[i];
    return r;
  }
};

// dD of one (b, h) with the fused norm (which implies z and mimo_o; D given), recomputed from
// the inputs in float64: the readout y (states, intra-chunk and diagonal terms, D x), G = dL/dxhat
// and the norm's projection, summed per row as rstd (G . x - (y . x) rstd^2 (G . y) / P). Why
// float64 all the way: dD = sum dout_pre_rms . x came to 1/120 - 1/5200 of sum |pre| |x| on the
// NormDd test's failing draws (each row's term ~1/10 of |pre| |x|, the rest cancelling across
// rows), and each float32 rounding on the way to y (states, bias add, rotation, exp) moves a
// row's term by ~2^-24 |pre| |x|; with the readout alone left in float32 the error stayed at
// the float32 reference's (up to 1.7e-5).
// It repeats the forward once more per (b, h) (the first pass's cost again, in double).
double norm_dd_f64(const MimoBwdFwdParams& p, int64_t b, int64_t h) {
  const int64_t S = p.S, H = p.H, G = p.G, N = p.N, P = p.P, R = p.R, C = p.C, A = p.A;
  const int64_t nch = p.nchunks;
  const int64_t g = h / (H / G);
  std::vector<float> f(static_cast<size_t>(std::max({N, P, A, int64_t{1}})));
  auto load = [&](const TensorView& v, int64_t off, int64_t stride, int64_t n, double* out) {
    load_row(v, off, stride, n, f.data());
    for (int64_t i = 0; i < n; ++i) out[i] = f[i];
  };
  auto at = [&](const TensorView& v, int64_t off) { return static_cast<double>(load_at(v, off)); };
  auto sig = [](double u) { return 1.0 / (1.0 + std::exp(-u)); };
  auto dotd = [](const double* a, const double* c, int64_t n) {
    double s = 0;
    for (int64_t i = 0; i < n; ++i) s += a[i] * c[i];
    return s;
  };
  std::vector<double> qbias(R * N), kbias(R * N), psi(R * P), phi(R * P), zeta(R * P), nw(P);
  for (int64_t r = 0; r < R; ++r) {
    load(p.q_bias, p.q_bias.offset(h, r, 0), p.q_bias.strides[2], N, &qbias[r * N]);
    load(p.k_bias, p.k_bias.offset(h, r, 0), p.k_bias.strides[2], N, &kbias[r * N]);
    load(p.mimo_v, p.mimo_v.offset(h, r, 0), p.mimo_v.strides[2], P, &psi[r * P]);
    load(p.mimo_o, p.mimo_o.offset(h, r, 0), p.mimo_o.strides[2], P, &phi[r * P]);
    load(p.mimo_z, p.mimo_z.offset(h, r, 0), p.mimo_z.strides[2], P, &zeta[r * P]);
  }
  load(p.norm_weight, p.norm_weight.offset(h, 0), p.norm_weight.strides[1], P, nw.data());
  const double Dh = at(p.d, p.d.offset(h)), eps = p.norm_eps;

  std::vector<double> St(N * P, 0.0), qb(C * R * N), kb(C * R * N), qh(C * R * N), kh(C * R * N);
  std::vector<double> x(C * R * P), qk(C * R * R), y(P), gr(P), dout(P), z(P), row(std::max(N, P));
  std::vector<double> gamma(C), tscale(C), dacs(C), dtv(C + 1), lamv(C + 1), coef(C);
  std::vector<double> ang(std::max<int64_t>(A, 1));
  double dd = 0;
  for (int64_t c = 0; c < nch; ++c) {
    const int64_t s0 = c * C, L = std::min(C, S - s0);
    const bool partial = L < C;
    for (int64_t i = 0; i < L; ++i) {
      const int64_t t = s0 + i;
      for (int64_t r = 0; r < R; ++r) {
        double* qv = &qb[(i * R + r) * N];
        double* kv = &kb[(i * R + r) * N];
        load(p.q, off5(p.q, b, t, r, g, 0), p.q.strides[4], N, qv);
        load(p.k, off5(p.k, b, t, r, g, 0), p.k.strides[4], N, kv);
        for (int64_t n = 0; n < N; ++n) qv[n] += qbias[r * N + n], kv[n] += kbias[r * N + n];
      }
      for (int64_t r = 0; r < R; ++r)
        for (int64_t r2 = 0; r2 < R; ++r2)
          qk[(i * R + r) * R + r2] = dotd(&qb[(i * R + r) * N], &kb[(i * R + r2) * N], N);
      load(p.angles, p.angles.offset(b, t, h, 0), p.angles.strides[3], A, ang.data());
      std::copy_n(&qb[i * R * N], R * N, &qh[i * R * N]);
      std::copy_n(&kb[i * R * N], R * N, &kh[i * R * N]);
      for (int64_t r = 0; r < R; ++r)
        for (double* w : {&qh[(i * R + r) * N], &kh[(i * R + r) * N]})
          for (int64_t a = 0; a < A; ++a) {
            const double u = w[a], v = w[N / 2 + a], cs = std::cos(ang[a]), sn = std::sin(ang[a]);
            w[a] = u * cs - v * sn;
            w[N / 2 + a] = u * sn + v * cs;
          }
      load(p.v, p.v.offset(b, t, h, 0), p.v.strides[3], P, row.data());
      for (int64_t r = 0; r < R; ++r)
        for (int64_t pp = 0; pp < P; ++pp) x[(i * R + r) * P + pp] = row[pp] * psi[r * P + pp];
      dacs[i] = at(p.da_cs, p.da_cs.offset(b, h, t));
    }
    const int64_t Lx = std::min(L + 1, S - s0);
    for (int64_t i = 0; i < Lx; ++i) {
      dtv[i] = at(p.dt, p.dt.offset(b, h, s0 + i));
      lamv[i] = sig(at(p.trap, p.trap.offset(b, h, s0 + i)));
    }
    for (int64_t i = 0; i < L; ++i) {
      gamma[i] = dtv[i] * lamv[i];
      tscale[i] = gamma[i] + (i + 1 < Lx ? dtv[i + 1] * (1.0 - lamv[i + 1]) : 0.0);
    }
    for (int64_t i = 0; i < L; ++i) {
      const int64_t t = s0 + i;
      for (int64_t j = 0; j < i; ++j)
        coef[j] = tscale[j] * std::exp(partial ? dacs[i] - dacs[j]
                                               : at(p.segsum, off5(p.segsum, b, h, c, i, j)));
      const double inter = std::exp(dacs[i]);
      load(p.dout, p.dout.offset(b, t, h, 0), p.dout.strides[3], P, dout.data());
      load(p.z, p.z.offset(b, t, h, 0), p.z.strides[3], P, z.data());
      for (int64_t r = 0; r < R; ++r) {
        const double* q = &qh[(i * R + r) * N];
        std::fill(y.begin(), y.end(), 0.0);
        for (int64_t n = 0; n < N; ++n)
          for (int64_t pp = 0; pp < P; ++pp) y[pp] += q[n] * St[n * P + pp];
        for (int64_t pp = 0; pp < P; ++pp) y[pp] *= inter;
        for (int64_t j = 0; j < i; ++j)
          for (int64_t r2 = 0; r2 < R; ++r2) {
            const double a = dotd(q, &kh[(j * R + r2) * N], N) * coef[j];
            for (int64_t pp = 0; pp < P; ++pp) y[pp] += a * x[(j * R + r2) * P + pp];
          }
        for (int64_t r2 = 0; r2 < R; ++r2) {
          const double a = gamma[i] * qk[(i * R + r) * R + r2];
          for (int64_t pp = 0; pp < P; ++pp) y[pp] += a * x[(i * R + r2) * P + pp];
        }
        const double* xr = &x[(i * R + r) * P];
        for (int64_t pp = 0; pp < P; ++pp) y[pp] += Dh * xr[pp];
        for (int64_t pp = 0; pp < P; ++pp) {
          const double u = z[pp] * zeta[r * P + pp];
          gr[pp] = dout[pp] * phi[r * P + pp] * u * sig(u) * nw[pp];  // dL/dxhat
        }
        const double rs = 1.0 / std::sqrt(dotd(y.data(), y.data(), P) / P + eps);
        dd += rs * (dotd(gr.data(), xr, P) -
                    dotd(y.data(), xr, P) * rs * rs * dotd(gr.data(), y.data(), P) / P);
      }
    }
    if (c + 1 < nch) {
      const double decay = std::exp(dacs[L - 1]);
      for (double& e : St) e *= decay;
      for (int64_t j = 0; j < L; ++j) {
        const double w = tscale[j] * std::exp(at(p.da_cs_rev, p.da_cs_rev.offset(b, h, s0 + j)));
        for (int64_t r = 0; r < R; ++r)
          for (int64_t n = 0; n < N; ++n) {
            const double a = kh[(j * R + r) * N + n] * w;
            for (int64_t pp = 0; pp < P; ++pp) St[n * P + pp] += a * x[(j * R + r) * P + pp];
          }
      }
    }
  }
  return dd;
}

// Problems whose estimated flop count exceeds this are spread over hardware_concurrency threads.
constexpr double kParallelFlops = 4e6;

void head(const MimoBwdFwdParams& p, int64_t b, int64_t h) {
  const int64_t S = p.S, H = p.H, G = p.G, N = p.N, P = p.P, R = p.R, C = p.C, A = p.A;
  const int64_t nch = p.nchunks;
  const int64_t g = h / (H / G);
  const bool reduce = p.reduce_o, has_z = p.has_z, norm = p.has_norm;
  // dD in float64 (a combined backward's internal output; see norm_dd_f64).
  const bool want_dd = norm && p.has_d && p.norm_dd.data != nullptr;

  // Per-head parameters, converted once.
  std::vector<float> qbias(R * N), kbias(R * N), psi(R * P), phi, zeta, nw;
  for (int64_t r = 0; r < R; ++r) {
    load_row(p.q_bias, p.q_bias.offset(h, r, 0), p.q_bias.strides[2], N, &qbias[r * N]);
    load_row(p.k_bias, p.k_bias.offset(h, r, 0), p.k_bias.strides[2], N, &kbias[r * N]);
    load_row(p.mimo_v, p.mimo_v.offset(h, r, 0), p.mimo_v.strides[2], P, &psi[r * P]);
  }
  if (reduce) {
    phi.resize(R * P);
    for (int64_t r = 0; r < R; ++r)
      load_row(p.mimo_o, p.mimo_o.offset(h, r, 0), p.mimo_o.strides[2], P, &phi[r * P]);
  }
  if (has_z) {
    zeta.resize(R * P);
    for (int64_t r = 0; r < R; ++r)
      load_row(p.mimo_z, p.mimo_z.offset(h, r, 0), p.mimo_z.strides[2], P, &zeta[r * P]);
  }
  if (norm) {
    nw.resize(P);
    load_row(p.norm_weight, p.norm_weight.offset(h, 0), p.norm_weight.strides[1], P, nw.data());
  }
  const float Dh = p.has_d ? load_at(p.d, p.d.offset(h)) : 0.f;
  const float eps = static_cast<float>(p.norm_eps);

  // Chunk-sized scratch: [C][R][N] for q/k (biased, then rotated), [C][R][P] for x and y.
  std::vector<float> St(N * P, 0.f);
  std::vector<float> qb(C * R * N), kb(C * R * N), qh(C * R * N), kh(C * R * N);
  std::vector<float> x(C * R * P), y(C * R * P), qk(C * R * R);
  std::vector<float> gamma(C), tscale(C), dacs(C), dtv(C + 1), lamv(C + 1);
  std::vector<float> row(std::max(N, P)), cos_t(std::max<int64_t>(A, 1)),
      sin_t(std::max<int64_t>(A, 1));
  std::vector<float> dout_row(P), z_row(P), dz_row(P), pre(P), coef(C);
  SumRP dphi(reduce ? R * P : 0), dzeta(has_z ? R * P : 0), dnw(norm ? R * P : 0);

  for (int64_t c = 0; c < nch; ++c) {
    const int64_t s0 = c * C, L = std::min(C, S - s0);
    const bool partial = L < C;

    // The state entering this chunk.
    for (int64_t n = 0; n < N; ++n)
      store_row(p.states, off5(p.states, b, h, c, n, 0), p.states.strides[4], P, &St[n * P]);

    // Biased q/k, qk_dot, rotation, x = v * Psi, and the per-step scalars.
    for (int64_t i = 0; i < L; ++i) {
      const int64_t t = s0 + i;
      for (int64_t r = 0; r < R; ++r) {
        float* qv = &qb[(i * R + r) * N];
        float* kv = &kb[(i * R + r) * N];
        load_row(p.q, off5(p.q, b, t, r, g, 0), p.q.strides[4], N, qv);
        load_row(p.k, off5(p.k, b, t, r, g, 0), p.k.strides[4], N, kv);
        for (int64_t n = 0; n < N; ++n) {
          qv[n] += qbias[r * N + n];
          kv[n] += kbias[r * N + n];
        }
      }
      // Same-position dot from the unrotated vectors: the rotation is orthogonal.
      for (int64_t r = 0; r < R; ++r) {
        for (int64_t r2 = 0; r2 < R; ++r2)
          qk[(i * R + r) * R + r2] = dot(&qb[(i * R + r) * N], &kb[(i * R + r2) * N], N);
        store_row(p.qk_dot, off5(p.qk_dot, b, h, t, r, 0), p.qk_dot.strides[4], R,
                  &qk[(i * R + r) * R]);
      }
      load_row(p.angles, p.angles.offset(b, t, h, 0), p.angles.strides[3], A, row.data());
      for (int64_t a = 0; a < A; ++a) {
        cos_t[a] = std::cos(row[a]);
        sin_t[a] = std::sin(row[a]);
      }
      std::copy_n(&qb[i * R * N], R * N, &qh[i * R * N]);
      std::copy_n(&kb[i * R * N], R * N, &kh[i * R * N]);
      for (int64_t r = 0; r < R; ++r) {
        rotate_half_pairs(&qh[(i * R + r) * N], N, cos_t.data(), sin_t.data(), A);
        rotate_half_pairs(&kh[(i * R + r) * N], N, cos_t.data(), sin_t.data(), A);
      }
      load_row(p.v, p.v.offset(b, t, h, 0), p.v.strides[3], P, row.data());
      for (int64_t r = 0; r < R; ++r)
        for (int64_t pp = 0; pp < P; ++pp) x[(i * R + r) * P + pp] = row[pp] * psi[r * P + pp];
      dacs[i] = load_at(p.da_cs, p.da_cs.offset(b, h, t));
    }
    // dt and lambda of the chunk's steps and of the step after it (its trapezoid half belongs to
    // the chunk's last step; there is none after the sequence's last step).
    const int64_t Lx = std::min(L + 1, S - s0);
    for (int64_t i = 0; i < Lx; ++i) {
      dtv[i] = load_at(p.dt, p.dt.offset(b, h, s0 + i));
      lamv[i] = sigmoidf(load_at(p.trap, p.trap.offset(b, h, s0 + i)));
    }
    for (int64_t i = 0; i < L; ++i) {
      gamma[i] = dtv[i] * lamv[i];
      tscale[i] = gamma[i] + (i + 1 < Lx ? dtv[i + 1] * (1.f - lamv[i + 1]) : 0.f);
    }

    // Readout y of every (step, rank): inter-chunk, strictly causal intra-chunk, diagonal, D.
    for (int64_t i = 0; i < L; ++i) {
      // Intra-chunk decay weights of the earlier steps j < i. A partial last chunk takes them
      // from da_cs alone (the tail contract); otherwise from the caller's segsum.
      for (int64_t j = 0; j < i; ++j) {
        const float seg = partial ? dacs[i] - dacs[j]
                                  : load_at(p.segsum, off5(p.segsum, b, h, c, i, j));
        coef[j] = tscale[j] * std::exp(seg);
      }
      const float inter = std::exp(dacs[i]);
      for (int64_t r = 0; r < R; ++r) {
        const float* q = &qh[(i * R + r) * N];
        float* yr = &y[(i * R + r) * P];
        std::fill(yr, yr + P, 0.f);
        for (int64_t n = 0; n < N; ++n) {
          const float a = q[n];
          const float* srow = &St[n * P];
          for (int64_t pp = 0; pp < P; ++pp) yr[pp] += a * srow[pp];
        }
        for (int64_t pp = 0; pp < P; ++pp) yr[pp] *= inter;
        for (int64_t j = 0; j < i; ++j)
          for (int64_t r2 = 0; r2 < R; ++r2) {
            const float a = dot(q, &kh[(j * R + r2) * N], N) * coef[j];
            const float* xs = &x[(j * R + r2) * P];
            for (int64_t pp = 0; pp < P; ++pp) yr[pp] += a * xs[pp];
          }
        for (int64_t r2 = 0; r2 < R; ++r2) {
          const float a = gamma[i] * qk[(i * R + r) * R + r2];
          const float* xs = &x[(i * R + r2) * P];
          for (int64_t pp = 0; pp < P; ++pp) yr[pp] += a * xs[pp];
        }
        const float* xr = &x[(i * R + r) * P];
        for (int64_t pp = 0; pp < P; ++pp) yr[pp] += Dh * xr[pp];
      }
    }

    // Projection / gate / norm gradients of every step (they only need y and dout).
    for (int64_t i = 0; i < L; ++i) {
      const int64_t t = s0 + i;
      if (reduce)
        load_row(p.dout, p.dout.offset(b, t, h, 0), p.dout.strides[3], P, dout_row.data());
      if (has_z) {
        load_row(p.z, p.z.offset(b, t, h, 0), p.z.strides[3], P, z_row.data());
        std::fill(dz_row.begin(), dz_row.end(), 0.f);
      }
      for (int64_t r = 0; r < R; ++r) {
        const float* yr = &y[(i * R + r) * P];
        if (!reduce)
          load_row(p.dout, off5(p.dout, b, t, r, h, 0), p.dout.strides[4], P, dout_row.data());
        float rstd = 1.f;
        if (norm) {
          float ss = 0.f;
          for (int64_t pp = 0; pp < P; ++pp) ss += yr[pp] * yr[pp];
          rstd = 1.f / std::sqrt(ss / static_cast<float>(P) + eps);
        }
        float mdot = 0.f;  // norm: sum_p dL/dxhat_p * xhat_p
        for (int64_t pp = 0; pp < P; ++pp) {
          const int64_t w = r * P + pp;
          const float d = dout_row[pp];
          if (!has_z) {  // reduce-O without a gate: out = sum_r Phi y
            if (reduce) dphi.add(w, d * yr[pp]);
            continue;
          }
          const float u = z_row[pp] * zeta[w];
          const float sg = sigmoidf(u);
          const float dsilu = sg * (1.f + u * (1.f - sg));
          float du;  // dL/du
          if (norm) {
            const float xhat = yr[pp] * rstd;
            const float nrm = xhat * nw[pp];
            const float dn = d * phi[w] * u * sg;  // dL/d(normed y) = dout Phi gate
            dphi.add(w, d * u * sg * nrm);
            dnw.add(w, dn * xhat);
            du = d * phi[w] * nrm * dsilu;
            pre[pp] = dn * nw[pp];  // dL/dxhat
            mdot += pre[pp] * xhat;
          } else if (reduce) {
            dphi.add(w, d * u * sg * yr[pp]);
            du = d * phi[w] * yr[pp] * dsilu;
          } else {
            du = d * yr[pp] * dsilu;
          }
          dzeta.add(w, du * z_row[pp]);
          dz_row[pp] += du * zeta[w];
        }
        if (norm) {
          // d xhat_p / d y_q = rstd (delta_pq - xhat_p xhat_q / P).
          const float m = mdot / static_cast<float>(P);
          for (int64_t pp = 0; pp < P; ++pp) pre[pp] = rstd * (pre[pp] - yr[pp] * rstd * m);
          store_row(p.dout_pre_rms, p.dout_pre_rms.offset(b, h, t * R + r, 0),
                    p.dout_pre_rms.strides[3], P, pre.data());
        }
      }
      if (has_z) store_row(p.dz, p.dz.offset(b, t, h, 0), p.dz.strides[3], P, dz_row.data());
    }

    // State carried into the next chunk (none is needed after the last one).
    if (c + 1 < nch) {
      const float decay = std::exp(dacs[L - 1]);
      for (float& e : St) e *= decay;
      for (int64_t j = 0; j < L; ++j) {
        const float w =
            tscale[j] * std::exp(load_at(p.da_cs_rev, p.da_cs_rev.offset(b, h, s0 + j)));
        for (int64_t r = 0; r < R; ++r) {
          const float* k = &kh[(j * R + r) * N];
          const float* xs = &x[(j * R + r) * P];
          for (int64_t n = 0; n < N; ++n) {
            const float a = k[n] * w;
            float* srow = &St[n * P];
            for (int64_t pp = 0; pp < P; ++pp) srow[pp] += a * xs[pp];
          }
        }
      }
    }
  }

  auto store_rp = [&](const TensorView& out, const SumRP& acc) {
    const std::vector<float> v = acc.result();
    for (int64_t r = 0; r < R; ++r)
      store_row(out, out.offset(b, h, r, 0), out.strides[3], P, &v[r * P]);
  };
  if (reduce) store_rp(p.dmimo_o, dphi);
  if (has_z) store_rp(p.dmimo_z, dzeta);
  if (norm) store_rp(p.dnorm_weight, dnw);
  if (want_dd) {  // as a float pair, hi + lo: the batch sum may cancel too
    const double v = norm_dd_f64(p, b, h);
    const float hi = static_cast<float>(v);
    store_at(p.norm_dd, p.norm_dd.offset(b, h, 0), hi);
    store_at(p.norm_dd, p.norm_dd.offset(b, h, 1), static_cast<float>(v - hi));
  }
}

}  // namespace

void mimo_bwd_fwd(const MimoBwdFwdParams& p) {
  // Per step: the inter-chunk readout and the state update (2 R N P each) and the intra-chunk
  // pairs (about C/2 R^2 (N + P)).
  const double per_step = 4.0 * p.R * p.N * p.P + 0.5 * p.C * p.R * p.R * (p.N + p.P);
  const bool parallel = static_cast<double>(p.B * p.H * p.S) * per_step > kParallelFlops;
  parallel_for(p.B * p.H, parallel, [&](int64_t item) { head(p, item / p.H, item % p.H); });
}

}  // namespace mamba3::cpu
