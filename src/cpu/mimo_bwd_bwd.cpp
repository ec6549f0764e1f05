// CPU backend of mamba3_mimo_bwd_bwd (seed 001): per (batch, head), one reverse scan over the
// chunks carrying dS = dL/dSt of the state leaving the current chunk. Within a chunk the
// pairwise products (kh . qh and x . dPhiO of every two (step, rank) rows) are formed once and
// shared by the intra-chunk terms of DQ, DK, DV / DMIMO_V, DFACTOR and DSSDA; the state terms
// need St dPhiO, dS x and kh dS once per row. Formulas: golden/include/mamba3_golden/
// mimo_bwd_bwd.hpp (the golden writes them term by term; this is the same algebra regrouped).
//
// Every tensor is read through its own strides and runtime dtype; rows are converted to float
// once. One work item is one (b, h): it owns dS and writes only its own slices of every output,
// so the thread count cannot change a result. Long sums (DMIMO_V and DD over the sequence, DDA
// over N*P) are compensated.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu/io.hpp"
#include "cpu/mimo_bwd.hpp"

namespace mamba3::cpu {
namespace {

inline int64_t off5(const TensorView& v, int64_t i0, int64_t i1, int64_t i2, int64_t i3,
                    int64_t i4) {
  return i0 * v.strides[0] + i1 * v.strides[1] + i2 * v.strides[2] + i3 * v.strides[3] +
         i4 * v.strides[4];
}

inline float sigmoidf(float x) { return 1.f / (1.f + std::exp(-x)); }

inline float dot(const float* a, const float* b, int64_t n) {
  float s = 0.f;
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// Problems whose estimated flop count exceeds this are spread over hardware_concurrency threads.
constexpr double kParallelFlops = 4e6;

void head(const MimoBwdBwdParams& p, int64_t b, int64_t h) {
  const int64_t S = p.S, H = p.H, G = p.G, N = p.N, P = p.P, R = p.R, C = p.C, A = p.A;
  const int64_t nch = p.nchunks, half = N / 2, CR = C * R;
  const int64_t g = h / (H / G);
  const MimoDout layout = p.dout_layout;

  std::vector<float> qbias(R * N), kbias(R * N), psi(R * P), phi;
  for (int64_t r = 0; r < R; ++r) {
    load_row(p.q_bias, p.q_bias.offset(h, r, 0), p.q_bias.strides[2], N, &qbias[r * N]);
    load_row(p.k_bias, p.k_bias.offset(h, r, 0), p.k_bias.strides[2], N, &kbias[r * N]);
    load_row(p.mimo_v, p.mimo_v.offset(h, r, 0), p.mimo_v.strides[2], P, &psi[r * P]);
  }
  if (layout == MimoDout::ReduceO) {
    phi.resize(R * P);
    for (int64_t r = 0; r < R; ++r)
      load_row(p.mimo_o, p.mimo_o.offset(h, r, 0), p.mimo_o.strides[2], P, &phi[r * P]);
  }
  const float Dh = p.has_d ? load_at(p.d, p.d.offset(h)) : 0.f;

  // Chunk scratch: rows (i, r) of [C][R][*]. KQ[(i,r2),(j,r)] = kh_i^r2 . qh_j^r and
  // XG[(i,r2),(j,r)] = x_i^r2 . dPhiO_j^r for every pair of rows of the chunk.
  std::vector<float> qb(CR * N), kb(CR * N), qh(CR * N), kh(CR * N), x(CR * P), gr(CR * P);
  std::vector<float> vrow(C * P), cosv(C * A + 1), sinv(C * A + 1), qk(CR * R);
  std::vector<float> gamma(C), ts(C), E(C), F(C), W(C * C), dtv(C + 1), lamv(C + 1), dacs(C);
  std::vector<float> KQ(CR * CR), XG(CR * CR);
  std::vector<float> St(N * P), dS(N * P, 0.f), row(std::max(N, P));
  std::vector<float> SG(R * N), dqh(R * N), dkh(R * N), dpsiv(R * P), dqb(R * N), dkb(R * N);
  std::vector<float> dangle(A + 1), dvrow(P), ssd(C);
  std::vector<float> dmv(R * P, 0.f), dmv_err(R * P, 0.f);
  float dd = 0.f, dd_err = 0.f;

  for (int64_t c = nch - 1; c >= 0; --c) {
    const int64_t s0 = c * C, L = std::min(C, S - s0);
    const bool partial = L < C;

    // ---- load the chunk: biased and rotated q/k, x = v * Psi, dPhiO, qk_dot, decays
    for (int64_t i = 0; i < L; ++i) {
      const int64_t t = s0 + i;
      load_row(p.angles, p.angles.offset(b, t, h, 0), p.angles.strides[3], A, row.data());
      for (int64_t a = 0; a < A; ++a) {
        cosv[i * A + a] = std::cos(row[a]);
        sinv[i * A + a] = std::sin(row[a]);
      }
      load_row(p.v, p.v.offset(b, t, h, 0), p.v.strides[3], P, &vrow[i * P]);
      if (layout == MimoDout::ReduceO)
        load_row(p.dout, p.dout.offset(b, t, h, 0), p.dout.strides[3], P, row.data());
      for (int64_t r = 0; r < R; ++r) {
        const int64_t ir = i * R + r;
        float* qv = &qb[ir * N];
        float* kv = &kb[ir * N];
        load_row(p.q, off5(p.q, b, t, r, g, 0), p.q.strides[4], N, qv);
        load_row(p.k, off5(p.k, b, t, r, g, 0), p.k.strides[4], N, kv);
        for (int64_t n = 0; n < N; ++n) {
          qv[n] += qbias[r * N + n];
          kv[n] += kbias[r * N + n];
        }
        float* qr = &qh[ir * N];
        float* kr = &kh[ir * N];
        std::copy_n(qv, N, qr);
        std::copy_n(kv, N, kr);
        for (int64_t a = 0; a < A; ++a) {
          const float cs = cosv[i * A + a], sn = sinv[i * A + a];
          qr[a] = qv[a] * cs - qv[half + a] * sn;
          qr[half + a] = qv[a] * sn + qv[half + a] * cs;
          kr[a] = kv[a] * cs - kv[half + a] * sn;
          kr[half + a] = kv[a] * sn + kv[half + a] * cs;
        }
        for (int64_t pp = 0; pp < P; ++pp) x[ir * P + pp] = vrow[i * P + pp] * psi[r * P + pp];
        float* gv = &gr[ir * P];
        switch (layout) {
          case MimoDout::ReduceO:
            for (int64_t pp = 0; pp < P; ++pp) gv[pp] = row[pp] * phi[r * P + pp];
            break;
          case MimoDout::PerRank:
            load_row(p.dout, off5(p.dout, b, t, r, h, 0), p.dout.strides[4], P, gv);
            break;
          case MimoDout::Packed:
            load_row(p.dout, p.dout.offset(b, h, t * R + r, 0), p.dout.strides[3], P, gv);
            break;
        }
        load_row(p.qk_dot, off5(p.qk_dot, b, h, t, r, 0), p.qk_dot.strides[4], R, &qk[ir * R]);
      }
      dacs[i] = load_at(p.da_cs, p.da_cs.offset(b, h, t));
      E[i] = std::exp(dacs[i]);
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
      ts[i] = gamma[i] + (i + 1 < Lx ? dtv[i + 1] * (1.f - lamv[i + 1]) : 0.f);
    }
    // Decays; a partial last chunk takes them from da_cs alone (the tail contract).
    const float da_last = dacs[L - 1];
    for (int64_t i = 0; i < L; ++i) {
      F[i] = std::exp(partial ? da_last - dacs[i]
                              : load_at(p.da_cs_rev, p.da_cs_rev.offset(b, h, s0 + i)));
      for (int64_t j = 0; j < i; ++j)
        W[i * C + j] = std::exp(partial ? dacs[i] - dacs[j]
                                        : load_at(p.segsum, off5(p.segsum, b, h, c, i, j)));
    }
    const float decay = std::exp(da_last);
    for (int64_t n = 0; n < N; ++n)
      load_row(p.states, off5(p.states, b, h, c, n, 0), p.states.strides[4], P, &St[n * P]);

    // ---- pairwise products of the chunk's rows
    const int64_t LR = L * R;
    for (int64_t a = 0; a < LR; ++a)
      for (int64_t bb = 0; bb < LR; ++bb) {
        KQ[a * CR + bb] = dot(&kh[a * N], &qh[bb * N], N);
        XG[a * CR + bb] = dot(&x[a * P], &gr[bb * P], P);
      }

    // ---- the chunk decay: DDA (one value for every step of the chunk)
    float dda = 0.f, dda_err = 0.f;
    for (int64_t e = 0; e < N * P; ++e) compensated_add(dda, dda_err, St[e] * dS[e]);
    dda = decay * (dda + dda_err);

    for (int64_t i = 0; i < L; ++i) {
      const int64_t t = s0 + i;
      // Query side: inter-chunk readout E_i qh . St and the intra-chunk keys j < i.
      float dda_cs = 0.f;
      for (int64_t r = 0; r < R; ++r) {
        const float* gv = &gr[(i * R + r) * P];
        float* sg = &SG[r * N];
        float* dq = &dqh[r * N];
        const float* qv = &qh[(i * R + r) * N];
        for (int64_t n = 0; n < N; ++n) {
          sg[n] = dot(&St[n * P], gv, P);
          dda_cs += qv[n] * sg[n];
          dq[n] = E[i] * sg[n];
        }
        for (int64_t j = 0; j < i; ++j) {
          const float w = W[i * C + j] * ts[j];
          for (int64_t r2 = 0; r2 < R; ++r2) {
            const float a = w * XG[(j * R + r2) * CR + i * R + r];
            const float* k = &kh[(j * R + r2) * N];
            for (int64_t n = 0; n < N; ++n) dq[n] += a * k[n];
          }
        }
      }

      // Key / value side: the state increment (F_i, dS) and the later queries j > i.
      float dfactor = 0.f, dda_rev = 0.f;
      for (int64_t r2 = 0; r2 < R; ++r2) {
        const int64_t ir = i * R + r2;
        const float* xt = &x[ir * P];
        const float* kt = &kh[ir * N];
        float* dk = &dkh[r2 * N];
        float* dp = &dpsiv[r2 * P];
        std::fill(dp, dp + P, 0.f);
        for (int64_t n = 0; n < N; ++n) {
          const float* srow = &dS[n * P];
          const float sx = dot(srow, xt, P);  // (dS x)_n
          dda_rev += kt[n] * sx;
          dk[n] = F[i] * sx;
          const float kn = kt[n];
          for (int64_t pp = 0; pp < P; ++pp) dp[pp] += kn * srow[pp];
        }
        const float fts = F[i] * ts[i];
        for (int64_t pp = 0; pp < P; ++pp) dp[pp] *= fts;
        for (int64_t j = i + 1; j < L; ++j) {
          const float w = W[j * C + i];
          for (int64_t r = 0; r < R; ++r) {
            const int64_t jr = j * R + r;
            const float a = w * XG[ir * CR + jr];
            const float* qu = &qh[jr * N];
            for (int64_t n = 0; n < N; ++n) dk[n] += a * qu[n];
            const float bq = w * ts[i] * KQ[ir * CR + jr];
            const float* gu = &gr[jr * P];
            for (int64_t pp = 0; pp < P; ++pp) dp[pp] += bq * gu[pp];
          }
        }
        dfactor += dot(kt, dk, N);
        for (int64_t n = 0; n < N; ++n) dk[n] *= ts[i];
        // D skip and the diagonal term gamma_i sum_r qk_dot[i, r, r2] x_i^r2.
        for (int64_t pp = 0; pp < P; ++pp) dp[pp] += Dh * gr[ir * P + pp];
        for (int64_t r = 0; r < R; ++r) {
          const float a = gamma[i] * qk[(i * R + r) * R + r2];
          const float* gv = &gr[(i * R + r) * P];
          for (int64_t pp = 0; pp < P; ++pp) dp[pp] += a * gv[pp];
        }
      }
      store_at(p.dda, p.dda.offset(b, h, t), dda);
      store_at(p.dda_cs, p.dda_cs.offset(b, h, t), dda_cs);
      store_at(p.dfactor, p.dfactor.offset(b, h, t), dfactor);
      store_at(p.dda_cs_rev, p.dda_cs_rev.offset(b, h, t), ts[i] * dda_rev);

      // v and mimo_v through x^r = v * mimo_v^r; D.
      for (int64_t pp = 0; pp < P; ++pp) {
        float dv = 0.f;
        for (int64_t r = 0; r < R; ++r) {
          const float d = dpsiv[r * P + pp];
          dv += d * psi[r * P + pp];
          compensated_add(dmv[r * P + pp], dmv_err[r * P + pp], d * vrow[i * P + pp]);
        }
        dvrow[pp] = dv;
      }
      store_row(p.dv, p.dv.offset(b, t, h, 0), p.dv.strides[3], P, dvrow.data());
      // DD = sum of dPhiO * x over everything: element by element into the compensated sum
      // (a sum of per-row dots would add each dot's rounding error).
      if (p.has_d)
        for (int64_t e = i * R * P; e < (i + 1) * R * P; ++e)
          compensated_add(dd, dd_err, gr[e] * x[e]);

      // Diagonal: DGAMMA and the q/k terms of gamma_i sum qk_dot[i,r,r2] x^r2, qk_dot = qb . kb.
      float dgamma = 0.f;
      for (int64_t r = 0; r < R; ++r)
        for (int64_t r2 = 0; r2 < R; ++r2)
          dgamma += qk[(i * R + r) * R + r2] * XG[(i * R + r2) * CR + i * R + r];
      store_at(p.dgamma, p.dgamma.offset(b, h, t), dgamma);

      // Undo the rotation (R^T), the angle gradient, then the diagonal's q/k terms.
      std::fill(dangle.begin(), dangle.end(), 0.f);
      for (int64_t r = 0; r < R; ++r) {
        const float* yq = &qh[(i * R + r) * N];
        const float* yk = &kh[(i * R + r) * N];
        const float* gq = &dqh[r * N];
        const float* gk = &dkh[r * N];
        float* oq = &dqb[r * N];
        float* ok = &dkb[r * N];
        std::copy_n(gq, N, oq);
        std::copy_n(gk, N, ok);
        for (int64_t a = 0; a < A; ++a) {
          // d/dtheta of (u cos - w sin, u sin + w cos) is (-y2, y1) of the rotated pair.
          dangle[a] += gq[half + a] * yq[a] - gq[a] * yq[half + a] + gk[half + a] * yk[a] -
                       gk[a] * yk[half + a];
          const float cs = cosv[i * A + a], sn = sinv[i * A + a];
          oq[a] = gq[a] * cs + gq[half + a] * sn;
          oq[half + a] = gq[half + a] * cs - gq[a] * sn;
          ok[a] = gk[a] * cs + gk[half + a] * sn;
          ok[half + a] = gk[half + a] * cs - gk[a] * sn;
        }
      }
      for (int64_t r = 0; r < R; ++r)
        for (int64_t r2 = 0; r2 < R; ++r2) {
          const float m = gamma[i] * XG[(i * R + r2) * CR + i * R + r];
          const float* kv = &kb[(i * R + r2) * N];
          const float* qv = &qb[(i * R + r) * N];
          float* oq = &dqb[r * N];
          float* ok = &dkb[r2 * N];
          for (int64_t n = 0; n < N; ++n) {
            oq[n] += m * kv[n];
            ok[n] += m * qv[n];
          }
        }
      store_row(p.dangles, p.dangles.offset(b, t, h, 0), p.dangles.strides[3], A, dangle.data());
      for (int64_t r = 0; r < R; ++r) {
        store_row(p.dq, p.dq.offset(b, t * R + r, h, 0), p.dq.strides[3], N, &dqb[r * N]);
        store_row(p.dk, p.dk.offset(b, t * R + r, h, 0), p.dk.strides[3], N, &dkb[r * N]);
      }
    }

    // DSSDA[c, i, j] = ts_i sum_{r,r2} KQ[(i,r2),(j,r)] XG[(i,r2),(j,r)] for every pair of
    // valid steps (unmasked, as upstream); rows and columns past the sequence are 0.
    for (int64_t i = 0; i < C; ++i) {
      for (int64_t j = 0; j < C; ++j) {
        float acc = 0.f;
        if (i < L && j < L) {
          for (int64_t r2 = 0; r2 < R; ++r2)
            for (int64_t r = 0; r < R; ++r) {
              const int64_t e = (i * R + r2) * CR + j * R + r;
              acc += KQ[e] * XG[e];
            }
          acc *= ts[i];
        }
        ssd[j] = acc;
      }
      store_row(p.dssda, off5(p.dssda, b, h, c, i, 0), p.dssda.strides[4], C, ssd.data());
    }

    // dS of the state entering this chunk: decay dS + sum_i E_i sum_r qh_i^r (x) dPhiO_i^r.
    if (c > 0) {
      for (float& e : dS) e *= decay;
      for (int64_t i = 0; i < L; ++i)
        for (int64_t r = 0; r < R; ++r) {
          const float* q = &qh[(i * R + r) * N];
          const float* gv = &gr[(i * R + r) * P];
          for (int64_t n = 0; n < N; ++n) {
            const float a = E[i] * q[n];
            float* srow = &dS[n * P];
            for (int64_t pp = 0; pp < P; ++pp) srow[pp] += a * gv[pp];
          }
        }
    }
  }

  for (int64_t r = 0; r < R; ++r) {
    for (int64_t pp = 0; pp < P; ++pp) row[pp] = dmv[r * P + pp] + dmv_err[r * P + pp];
    store_row(p.dmimo_v, p.dmimo_v.offset(b, h, r, 0), p.dmimo_v.strides[3], P, row.data());
  }
  if (p.has_d) store_at(p.dd, p.dd.offset(b, h), dd + dd_err);
}

}  // namespace

void mimo_bwd_bwd(const MimoBwdBwdParams& p) {
  // Per step: the state terms (about 5 R N P) and the pairwise products of the chunk's rows
  // (C R^2 (N + P)) with their uses.
  const double per_step = 5.0 * p.R * p.N * p.P + 2.0 * p.C * p.R * p.R * (p.N + p.P);
  const bool parallel = static_cast<double>(p.B * p.H * p.S) * per_step > kParallelFlops;
  parallel_for(p.B * p.H, parallel, [&](int64_t item) { head(p, item / p.H, item % p.H); });
}

}  // namespace mamba3::cpu
