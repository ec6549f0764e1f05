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
#include <type_traits>
#include <vector>

#include "cpu/io.hpp"

namespace mamba3::cpu {
namespace {

inline int64_t off5(const TensorView& v, int64_t i0, int64_t i1, int64_t i2, int64_t i3,
                    int64_t i4) {
  return i0 * v.strides[0] + i1 * v.strides[1] + i2 * v.strides[2] + i3 * v.strides[3] +
         i4 * v.strides[4];
}

// The chunked forward below runs in float (the first pass's outputs) and in double (the fused
// norm's dD, norm_dd_f64) from the same templates, so the double recomputation is the float
// forward with the same operations in the same order, only wider.

template <typename T>
inline T sigmoid(T x) {
  return T(1) / (T(1) + std::exp(-x));
}

// Rotates the pairs (i, N/2 + i), i < A, of x by theta[i]:
// (a, b) -> (a cos - b sin, a sin + b cos).
template <typename T>
inline void rotate_half_pairs(T* x, int64_t N, const T* cos_t, const T* sin_t, int64_t A) {
  const int64_t half = N / 2;
  for (int64_t i = 0; i < A; ++i) {
    const T a = x[i], b = x[half + i];
    x[i] = a * cos_t[i] - b * sin_t[i];
    x[half + i] = a * sin_t[i] + b * cos_t[i];
  }
}

template <typename T>
inline T dot(const T* a, const T* b, int64_t n) {
  T s = 0;
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// Loads n elements as T; double goes through float (tmp, n long), which every stored dtype
// converts to exactly.
template <typename T>
inline void load_as(const TensorView& v, int64_t off, int64_t stride, int64_t n, T* out,
                    float* tmp) {
  if constexpr (std::is_same_v<T, float>) {
    load_row(v, off, stride, n, out);
  } else {
    load_row(v, off, stride, n, tmp);
    for (int64_t i = 0; i < n; ++i) out[i] = tmp[i];
  }
}

// The R rows of head h of an [H, R, n] parameter (q_bias, mimo_v, mimo_o, ...), as T.
template <typename T>
std::vector<T> load_head_rows(const TensorView& v, int64_t h, int64_t R, int64_t n) {
  std::vector<T> out(R * n);
  std::vector<float> tmp(n);
  for (int64_t r = 0; r < R; ++r)
    load_as(v, v.offset(h, r, 0), v.strides[2], n, &out[r * n], tmp.data());
  return out;
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

// The chunked forward of one (b, h) in T, a chunk at a time: load_chunk(c), then per step i
// weights(i) and readout(i, r, ...) of each rank, then carry_state() into the next chunk.
template <typename T>
struct ChunkForward {
  const MimoBwdFwdParams& p;
  const int64_t b, h, g, S, N, P, R, C, A;
  const std::vector<T> qbias, kbias, psi;  // per head, [R][N] / [R][P]
  const T Dh;
  // St: the state entering the current chunk. Chunk scratch: [C][R][N] for q/k (biased, then
  // rotated), [C][R][P] for x, [C][R][R] for the same-position qk dots.
  std::vector<T> St, qb, kb, qh, kh, x, qk;
  std::vector<T> gamma, tscale, dacs, dtv, lamv, coef, ang, cos_t, sin_t, vrow;
  std::vector<float> tmp;  // load_as's float row
  int64_t c = 0, s0 = 0, L = 0;  // the current chunk, its first step and length
  bool partial = false;

  ChunkForward(const MimoBwdFwdParams& p_, int64_t b_, int64_t h_)
      : p(p_), b(b_), h(h_), g(h_ / (p_.H / p_.G)), S(p_.S), N(p_.N), P(p_.P), R(p_.R),
        C(p_.C), A(p_.A),
        qbias(load_head_rows<T>(p_.q_bias, h_, p_.R, p_.N)),
        kbias(load_head_rows<T>(p_.k_bias, h_, p_.R, p_.N)),
        psi(load_head_rows<T>(p_.mimo_v, h_, p_.R, p_.P)),
        Dh(p_.has_d ? T(load_at(p_.d, p_.d.offset(h_))) : T(0)),
        St(N * P, T(0)), qb(C * R * N), kb(C * R * N), qh(C * R * N), kh(C * R * N),
        x(C * R * P), qk(C * R * R), gamma(C), tscale(C), dacs(C), dtv(C + 1), lamv(C + 1),
        coef(C), ang(std::max<int64_t>(A, 1)), cos_t(std::max<int64_t>(A, 1)),
        sin_t(std::max<int64_t>(A, 1)), vrow(P), tmp(std::max({N, P, A, int64_t{1}})) {}

  // Biased q/k, their same-position dots, rotation, x = v * Psi, and the per-step scalars.
  void load_chunk(int64_t chunk) {
    c = chunk;
    s0 = c * C;
    L = std::min(C, S - s0);
    partial = L < C;
    for (int64_t i = 0; i < L; ++i) {
      const int64_t t = s0 + i;
      for (int64_t r = 0; r < R; ++r) {
        T* qv = &qb[(i * R + r) * N];
        T* kv = &kb[(i * R + r) * N];
        load_as(p.q, off5(p.q, b, t, r, g, 0), p.q.strides[4], N, qv, tmp.data());
        load_as(p.k, off5(p.k, b, t, r, g, 0), p.k.strides[4], N, kv, tmp.data());
        for (int64_t n = 0; n < N; ++n) {
          qv[n] += qbias[r * N + n];
          kv[n] += kbias[r * N + n];
        }
      }
      // Same-position dot from the unrotated vectors: the rotation is orthogonal.
      for (int64_t r = 0; r < R; ++r)
        for (int64_t r2 = 0; r2 < R; ++r2)
          qk[(i * R + r) * R + r2] = dot(&qb[(i * R + r) * N], &kb[(i * R + r2) * N], N);
      load_as(p.angles, p.angles.offset(b, t, h, 0), p.angles.strides[3], A, ang.data(),
              tmp.data());
      for (int64_t a = 0; a < A; ++a) {
        cos_t[a] = std::cos(ang[a]);
        sin_t[a] = std::sin(ang[a]);
      }
      std::copy_n(&qb[i * R * N], R * N, &qh[i * R * N]);
      std::copy_n(&kb[i * R * N], R * N, &kh[i * R * N]);
      for (int64_t r = 0; r < R; ++r) {
        rotate_half_pairs(&qh[(i * R + r) * N], N, cos_t.data(), sin_t.data(), A);
        rotate_half_pairs(&kh[(i * R + r) * N], N, cos_t.data(), sin_t.data(), A);
      }
      load_as(p.v, p.v.offset(b, t, h, 0), p.v.strides[3], P, vrow.data(), tmp.data());
      for (int64_t r = 0; r < R; ++r)
        for (int64_t pp = 0; pp < P; ++pp) x[(i * R + r) * P + pp] = vrow[pp] * psi[r * P + pp];
      dacs[i] = load_at(p.da_cs, p.da_cs.offset(b, h, t));
    }
    // dt and lambda of the chunk's steps and of the step after it (its trapezoid half belongs to
    // the chunk's last step; there is none after the sequence's last step).
    const int64_t Lx = std::min(L + 1, S - s0);
    for (int64_t i = 0; i < Lx; ++i) {
      dtv[i] = load_at(p.dt, p.dt.offset(b, h, s0 + i));
      lamv[i] = sigmoid(T(load_at(p.trap, p.trap.offset(b, h, s0 + i))));
    }
    for (int64_t i = 0; i < L; ++i) {
      gamma[i] = dtv[i] * lamv[i];
      tscale[i] = gamma[i] + (i + 1 < Lx ? dtv[i + 1] * (T(1) - lamv[i + 1]) : T(0));
    }
  }

  // Intra-chunk decay weights coef[j] of the earlier steps j < i, and step i's inter-chunk decay
  // (returned). A partial last chunk takes them from da_cs alone (the tail contract); otherwise
  // from the caller's segsum.
  T weights(int64_t i) {
    for (int64_t j = 0; j < i; ++j) {
      const T seg = partial ? dacs[i] - dacs[j]
                            : T(load_at(p.segsum, off5(p.segsum, b, h, c, i, j)));
      coef[j] = tscale[j] * std::exp(seg);
    }
    return std::exp(dacs[i]);
  }

  // Readout y (P long) of step i, rank r: inter-chunk, strictly causal intra-chunk, diagonal, D.
  void readout(int64_t i, int64_t r, T inter, T* yr) const {
    const T* q = &qh[(i * R + r) * N];
    std::fill(yr, yr + P, T(0));
    for (int64_t n = 0; n < N; ++n) {
      const T a = q[n];
      const T* srow = &St[n * P];
      for (int64_t pp = 0; pp < P; ++pp) yr[pp] += a * srow[pp];
    }
    for (int64_t pp = 0; pp < P; ++pp) yr[pp] *= inter;
    for (int64_t j = 0; j < i; ++j)
      for (int64_t r2 = 0; r2 < R; ++r2) {
        const T a = dot(q, &kh[(j * R + r2) * N], N) * coef[j];
        const T* xs = &x[(j * R + r2) * P];
        for (int64_t pp = 0; pp < P; ++pp) yr[pp] += a * xs[pp];
      }
    for (int64_t r2 = 0; r2 < R; ++r2) {
      const T a = gamma[i] * qk[(i * R + r) * R + r2];
      const T* xs = &x[(i * R + r2) * P];
      for (int64_t pp = 0; pp < P; ++pp) yr[pp] += a * xs[pp];
    }
    const T* xr = &x[(i * R + r) * P];
    for (int64_t pp = 0; pp < P; ++pp) yr[pp] += Dh * xr[pp];
  }

  // The state carried into the next chunk.
  void carry_state() {
    const T decay = std::exp(dacs[L - 1]);
    for (T& e : St) e *= decay;
    for (int64_t j = 0; j < L; ++j) {
      const T w = tscale[j] * std::exp(T(load_at(p.da_cs_rev, p.da_cs_rev.offset(b, h, s0 + j))));
      for (int64_t r = 0; r < R; ++r) {
        const T* k = &kh[(j * R + r) * N];
        const T* xs = &x[(j * R + r) * P];
        for (int64_t n = 0; n < N; ++n) {
          const T a = k[n] * w;
          T* srow = &St[n * P];
          for (int64_t pp = 0; pp < P; ++pp) srow[pp] += a * xs[pp];
        }
      }
    }
  }
};

// dD of one (b, h) with the fused norm (which implies z and mimo_o; D given), recomputed from
// the inputs in float64: the readout y (ChunkForward<double>), G = dL/dxhat and the norm's
// projection, summed per row as rstd (G . x - (y . x) rstd^2 (G . y) / P). Why float64 all the
// way: dD = sum dout_pre_rms . x came to 1/120 - 1/5200 of sum |pre| |x| on the NormDd test's
// failing draws (each row's term ~1/10 of |pre| |x|, the rest cancelling across rows), and each
// float32 rounding on the way to y (states, bias add, rotation, exp) moves a row's term by
// ~2^-24 |pre| |x|; with the readout alone left in float32 the error stayed at the float32
// reference's (up to 1.7e-5).
// It repeats the forward once more per (b, h) (the first pass's cost again, in double).
double norm_dd_f64(const MimoBwdFwdParams& p, int64_t b, int64_t h) {
  const int64_t P = p.P, R = p.R;
  ChunkForward<double> fw(p, b, h);
  const std::vector<double> phi = load_head_rows<double>(p.mimo_o, h, R, P),
                            zeta = load_head_rows<double>(p.mimo_z, h, R, P);
  std::vector<double> nw(P), y(P), gr(P), dout(P), z(P);
  std::vector<float> tmp(P);
  load_as(p.norm_weight, p.norm_weight.offset(h, 0), p.norm_weight.strides[1], P, nw.data(),
          tmp.data());
  const double eps = p.norm_eps;
  double dd = 0;
  for (int64_t c = 0; c < p.nchunks; ++c) {
    fw.load_chunk(c);
    for (int64_t i = 0; i < fw.L; ++i) {
      const int64_t t = fw.s0 + i;
      const double inter = fw.weights(i);
      load_as(p.dout, p.dout.offset(b, t, h, 0), p.dout.strides[3], P, dout.data(), tmp.data());
      load_as(p.z, p.z.offset(b, t, h, 0), p.z.strides[3], P, z.data(), tmp.data());
      for (int64_t r = 0; r < R; ++r) {
        fw.readout(i, r, inter, y.data());
        const double* xr = &fw.x[(i * R + r) * P];
        for (int64_t pp = 0; pp < P; ++pp) {
          const double u = z[pp] * zeta[r * P + pp];
          gr[pp] = dout[pp] * phi[r * P + pp] * u * sigmoid(u) * nw[pp];  // dL/dxhat
        }
        const double rs = 1.0 / std::sqrt(dot(y.data(), y.data(), P) / P + eps);
        dd += rs * (dot(gr.data(), xr, P) -
                    dot(y.data(), xr, P) * rs * rs * dot(gr.data(), y.data(), P) / P);
      }
    }
    if (c + 1 < p.nchunks) fw.carry_state();
  }
  return dd;
}

// Problems whose estimated flop count exceeds this are spread over hardware_concurrency threads.
constexpr double kParallelFlops = 4e6;

void head(const MimoBwdFwdParams& p, int64_t b, int64_t h) {
  const int64_t N = p.N, P = p.P, R = p.R, C = p.C;
  const int64_t nch = p.nchunks;
  const bool reduce = p.reduce_o, has_z = p.has_z, norm = p.has_norm;
  // dD in float64 (a combined backward's internal output; see norm_dd_f64).
  const bool want_dd = norm && p.has_d && p.norm_dd.data != nullptr;

  // Per-head parameters, converted once (q/k biases, Psi and D in fw).
  ChunkForward<float> fw(p, b, h);
  std::vector<float> phi, zeta, nw;
  if (reduce) phi = load_head_rows<float>(p.mimo_o, h, R, P);
  if (has_z) zeta = load_head_rows<float>(p.mimo_z, h, R, P);
  if (norm) {
    nw.resize(P);
    load_row(p.norm_weight, p.norm_weight.offset(h, 0), p.norm_weight.strides[1], P, nw.data());
  }
  const float eps = static_cast<float>(p.norm_eps);

  std::vector<float> y(C * R * P);  // [C][R][P]: the readout of every (step, rank) of a chunk
  std::vector<float> dout_row(P), z_row(P), dz_row(P), pre(P);
  SumRP dphi(reduce ? R * P : 0), dzeta(has_z ? R * P : 0), dnw(norm ? R * P : 0);

  for (int64_t c = 0; c < nch; ++c) {
    // The state entering this chunk.
    for (int64_t n = 0; n < N; ++n)
      store_row(p.states, off5(p.states, b, h, c, n, 0), p.states.strides[4], P, &fw.St[n * P]);

    fw.load_chunk(c);
    const int64_t s0 = fw.s0, L = fw.L;
    for (int64_t i = 0; i < L; ++i)
      for (int64_t r = 0; r < R; ++r)
        store_row(p.qk_dot, off5(p.qk_dot, b, h, s0 + i, r, 0), p.qk_dot.strides[4], R,
                  &fw.qk[(i * R + r) * R]);

    for (int64_t i = 0; i < L; ++i) {
      const float inter = fw.weights(i);
      for (int64_t r = 0; r < R; ++r) fw.readout(i, r, inter, &y[(i * R + r) * P]);
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
          const float sg = sigmoid(u);
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
    if (c + 1 < nch) fw.carry_state();
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
