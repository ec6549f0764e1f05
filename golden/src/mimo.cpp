// Golden Mamba-3 MIMO model and mamba3_mimo_bwd_fwd (see mimo.hpp for the shapes, the model and
// the tail contract). The sequential recurrence and the chunked form are written independently
// so that their agreement checks both; the backward first pass is derived from the chunked form.
#include "mamba3_golden/mimo.hpp"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

namespace mamba3::golden {

namespace {

void require(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument("golden mimo: " + what);
}

template <class V>
void require_size(const V& v, int64_t n, const char* name) {
  require(static_cast<int64_t>(v.size()) == n,
          std::string(name) + " has " + std::to_string(v.size()) + " elements, expected " +
              std::to_string(n));
}

int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

enum class Form { Sequential, Chunked, BwdFwd };

template <class T>
void check(const MimoInputs<T>& in, Form form) {
  const int64_t B = in.B, S = in.S, H = in.H, G = in.G, N = in.N, P = in.P, R = in.R;
  require(B > 0 && S > 0 && H > 0 && G > 0 && N > 0 && P > 0 && R > 0, "sizes must be positive");
  require(H % G == 0, "H must be a multiple of G");
  require(N % 2 == 0, "N must be even");
  require(in.rotary_dim_divisor == 2 || in.rotary_dim_divisor == 4,
          "rotary_dim_divisor must be 2 or 4");
  const int64_t A = N / in.rotary_dim_divisor;
  require_size(in.q, B * S * R * G * N, "q");
  require_size(in.k, B * S * R * G * N, "k");
  require_size(in.v, B * S * H * P, "v");
  require_size(in.q_bias, H * R * N, "q_bias");
  require_size(in.k_bias, H * R * N, "k_bias");
  require_size(in.mimo_v, H * R * P, "mimo_v");
  if (!in.mimo_o.empty()) require_size(in.mimo_o, H * R * P, "mimo_o");
  require(in.z.empty() == in.mimo_z.empty(), "z and mimo_z must be given together");
  if (!in.z.empty()) {
    require_size(in.z, B * S * H * P, "z");
    require_size(in.mimo_z, H * R * P, "mimo_z");
  }
  if (!in.norm_weight.empty()) {
    require(!in.mimo_o.empty(), "the pre-gate RMSNorm needs mimo_o (reduce-O)");
    require(!in.z.empty(), "the pre-gate RMSNorm needs z and mimo_z");
    require_size(in.norm_weight, H * P, "norm_weight");
    require(in.norm_eps > T(0), "norm_eps must be positive");
  }
  if (!in.D.empty()) require_size(in.D, H, "D");
  require_size(in.angles, B * S * H * A, "angles");
  require_size(in.dt, B * H * S, "dt");
  require_size(in.trap, B * H * S, "trap");
  if (form == Form::Sequential) {
    require_size(in.adt, B * H * S, "adt");
    const bool st = !in.ssm_state0.empty();
    require(st == !in.k_state0.empty() && st == !in.v_state0.empty(),
            "input states must be given all together");
    if (st) {
      require_size(in.ssm_state0, B * H * P * N, "ssm_state0");
      require_size(in.k_state0, B * H * R * N, "k_state0");
      require_size(in.v_state0, B * H * P, "v_state0");
    }
  } else {
    const int64_t C = in.chunk_size;
    require(C > 0, "chunk_size must be positive");
    require_size(in.da_cs, B * H * S, "da_cs");
    require_size(in.da_cs_rev, B * H * S, "da_cs_rev");
    require_size(in.segsum, B * H * cdiv(S, C) * C * C, "segsum");
    if (form == Form::BwdFwd)
      require_size(in.dout, in.mimo_o.empty() ? B * S * R * H * P : B * S * H * P, "dout");
  }
}

template <class T>
T sigmoid(T x) {
  return T(1) / (T(1) + std::exp(-x));
}

// Per (b, h): the biased q/k (unrotated and rotated) and x^r = v * mimo_v^r of every step,
// laid out [S][R][N] and [S][R][P].
template <class T>
struct Head {
  std::vector<T> qb, kb, qh, kh, x;
};

template <class T>
void rotate_half_pairs(T* x, int64_t N, const T* theta, int64_t A) {
  const int64_t half = N / 2;
  for (int64_t i = 0; i < A; ++i) {
    const T c = std::cos(theta[i]), s = std::sin(theta[i]);
    const T a = x[i], b = x[half + i];
    x[i] = a * c - b * s;
    x[half + i] = a * s + b * c;
  }
}

template <class T>
Head<T> load_head(const MimoInputs<T>& in, int64_t b, int64_t h) {
  const int64_t S = in.S, H = in.H, G = in.G, N = in.N, P = in.P, R = in.R;
  const int64_t A = N / in.rotary_dim_divisor;
  const int64_t g = h / (H / G);
  Head<T> hd;
  hd.qb.resize(S * R * N);
  hd.kb.resize(S * R * N);
  hd.x.resize(S * R * P);
  for (int64_t t = 0; t < S; ++t) {
    for (int64_t r = 0; r < R; ++r) {
      const int64_t src = (((b * S + t) * R + r) * G + g) * N;
      const int64_t bias = (h * R + r) * N;
      for (int64_t n = 0; n < N; ++n) {
        hd.qb[(t * R + r) * N + n] = in.q[src + n] + in.q_bias[bias + n];
        hd.kb[(t * R + r) * N + n] = in.k[src + n] + in.k_bias[bias + n];
      }
      for (int64_t p = 0; p < P; ++p)
        hd.x[(t * R + r) * P + p] = in.v[((b * S + t) * H + h) * P + p] * in.mimo_v[(h * R + r) * P + p];
    }
  }
  hd.qh = hd.qb;
  hd.kh = hd.kb;
  for (int64_t t = 0; t < S; ++t) {
    const T* theta = &in.angles[((b * S + t) * H + h) * A];
    for (int64_t r = 0; r < R; ++r) {
      rotate_half_pairs(&hd.qh[(t * R + r) * N], N, theta, A);
      rotate_half_pairs(&hd.kh[(t * R + r) * N], N, theta, A);
    }
  }
  return hd;
}

template <class T>
T dot(const T* a, const T* b, int64_t n) {
  T s = T(0);
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// The readout y (before gate and down projection) of every step: [B,S,R,H,P].
template <class T>
struct Raw {
  std::vector<T> y;
  MimoOutputs<T> states;  // out left empty
};

template <class T>
int64_t yidx(const MimoInputs<T>& in, int64_t b, int64_t t, int64_t r, int64_t h) {
  return (((b * in.S + t) * in.R + r) * in.H + h) * in.P;
}

template <class T>
Raw<T> sequential_raw(const MimoInputs<T>& in) {
  const int64_t B = in.B, S = in.S, H = in.H, N = in.N, P = in.P, R = in.R;
  const bool st = !in.ssm_state0.empty();
  Raw<T> raw;
  raw.y.assign(B * S * R * H * P, T(0));
  raw.states.ssm_state.assign(B * H * P * N, T(0));
  raw.states.k_state.assign(B * H * R * N, T(0));
  raw.states.v_state.assign(B * H * P, T(0));
  std::vector<T> Hs(P * N), kprev(R * N), xprev(R * P);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < H; ++h) {
      const Head<T> hd = load_head(in, b, h);
      const int64_t bh = b * H + h;
      std::fill(Hs.begin(), Hs.end(), T(0));
      std::fill(kprev.begin(), kprev.end(), T(0));
      std::fill(xprev.begin(), xprev.end(), T(0));
      if (st) {
        std::copy_n(&in.ssm_state0[bh * P * N], P * N, Hs.begin());
        std::copy_n(&in.k_state0[bh * R * N], R * N, kprev.begin());
        for (int64_t r = 0; r < R; ++r)
          for (int64_t p = 0; p < P; ++p)
            xprev[r * P + p] = in.v_state0[bh * P + p] * in.mimo_v[(h * R + r) * P + p];
      }
      const T Dh = in.D.empty() ? T(0) : in.D[h];
      for (int64_t t = 0; t < S; ++t) {
        const int64_t i = bh * S + t;
        const T lam = sigmoid(in.trap[i]);
        const T alpha = std::exp(in.adt[i]);
        const T gamma = lam * in.dt[i];
        const T beta = (T(1) - lam) * in.dt[i] * alpha;
        const T* kh = &hd.kh[t * R * N];
        const T* x = &hd.x[t * R * P];
        for (int64_t p = 0; p < P; ++p) {
          for (int64_t n = 0; n < N; ++n) {
            T prev = T(0), cur = T(0);
            for (int64_t r = 0; r < R; ++r) {
              prev += kprev[r * N + n] * xprev[r * P + p];
              cur += kh[r * N + n] * x[r * P + p];
            }
            Hs[p * N + n] = alpha * Hs[p * N + n] + beta * prev + gamma * cur;
          }
        }
        for (int64_t r = 0; r < R; ++r) {
          const T* qh = &hd.qh[(t * R + r) * N];
          T* y = &raw.y[yidx(in, b, t, r, h)];
          for (int64_t p = 0; p < P; ++p) y[p] = dot(&Hs[p * N], qh, N) + Dh * x[r * P + p];
        }
        std::copy_n(kh, R * N, kprev.begin());
        std::copy_n(x, R * P, xprev.begin());
      }
      std::copy(Hs.begin(), Hs.end(), &raw.states.ssm_state[bh * P * N]);
      std::copy(kprev.begin(), kprev.end(), &raw.states.k_state[bh * R * N]);
      std::copy_n(&in.v[((b * S + S - 1) * H + h) * P], P, &raw.states.v_state[bh * P]);
    }
  }
  return raw;
}

template <class T>
Raw<T> chunked_raw(const MimoInputs<T>& in) {
  const int64_t B = in.B, S = in.S, H = in.H, N = in.N, P = in.P, R = in.R, C = in.chunk_size;
  const int64_t nch = cdiv(S, C);
  Raw<T> raw;
  raw.y.assign(B * S * R * H * P, T(0));
  raw.states.states.assign(B * H * nch * N * P, T(0));
  raw.states.ssm_state.assign(B * H * P * N, T(0));
  raw.states.k_state.assign(B * H * R * N, T(0));
  raw.states.v_state.assign(B * H * P, T(0));
  std::vector<T> St(N * P), gamma(S), tscale(S);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < H; ++h) {
      const Head<T> hd = load_head(in, b, h);
      const int64_t bh = b * H + h;
      const T* dt = &in.dt[bh * S];
      const T* trap = &in.trap[bh * S];
      const T* da_cs = &in.da_cs[bh * S];
      const T* da_cs_rev = &in.da_cs_rev[bh * S];
      for (int64_t t = 0; t < S; ++t) {
        gamma[t] = dt[t] * sigmoid(trap[t]);
        // The trapezoid's second half belongs to the next step; none after the last one.
        tscale[t] = gamma[t] + (t + 1 < S ? dt[t + 1] * (T(1) - sigmoid(trap[t + 1])) : T(0));
      }
      const T Dh = in.D.empty() ? T(0) : in.D[h];
      std::fill(St.begin(), St.end(), T(0));
      for (int64_t c = 0; c < nch; ++c) {
        const int64_t s0 = c * C, L = std::min(C, S - s0);
        const bool partial = L < C;
        std::copy(St.begin(), St.end(), &raw.states.states[(bh * nch + c) * N * P]);
        const T* seg = &in.segsum[(bh * nch + c) * C * C];
        // Tail contract: a partial chunk's decays come from da_cs alone (rebuild_dacs_tail).
        auto segsum = [&](int64_t i, int64_t j) {
          return partial ? da_cs[s0 + i] - da_cs[s0 + j] : seg[i * C + j];
        };
        const T da_last = da_cs[s0 + L - 1];
        auto rev = [&](int64_t i) { return partial ? da_last - da_cs[s0 + i] : da_cs_rev[s0 + i]; };

        for (int64_t i = 0; i < L; ++i) {
          const int64_t t = s0 + i;
          const T inter = std::exp(da_cs[t]);
          for (int64_t r = 0; r < R; ++r) {
            const T* qh = &hd.qh[(t * R + r) * N];
            T* y = &raw.y[yidx(in, b, t, r, h)];
            for (int64_t p = 0; p < P; ++p) {
              T acc = T(0);
              for (int64_t n = 0; n < N; ++n) acc += qh[n] * St[n * P + p];
              y[p] = inter * acc;
            }
            for (int64_t j = 0; j < i; ++j) {
              const int64_t s = s0 + j;
              const T w = tscale[s] * std::exp(segsum(i, j));
              for (int64_t r2 = 0; r2 < R; ++r2) {
                const T a = dot(qh, &hd.kh[(s * R + r2) * N], N) * w;
                const T* xs = &hd.x[(s * R + r2) * P];
                for (int64_t p = 0; p < P; ++p) y[p] += a * xs[p];
              }
            }
            // Same-position term from the unrotated dot (rotation invariant, as the kernels do).
            const T* qb = &hd.qb[(t * R + r) * N];
            for (int64_t r2 = 0; r2 < R; ++r2) {
              const T a = gamma[t] * dot(qb, &hd.kb[(t * R + r2) * N], N);
              const T* xt = &hd.x[(t * R + r2) * P];
              for (int64_t p = 0; p < P; ++p) y[p] += a * xt[p];
            }
            const T* xr = &hd.x[(t * R + r) * P];
            for (int64_t p = 0; p < P; ++p) y[p] += Dh * xr[p];
          }
        }

        const T decay = std::exp(da_last);
        for (T& e : St) e *= decay;
        for (int64_t i = 0; i < L; ++i) {
          const int64_t s = s0 + i;
          const T w = tscale[s] * std::exp(rev(i));
          for (int64_t r = 0; r < R; ++r) {
            const T* kh = &hd.kh[(s * R + r) * N];
            const T* xs = &hd.x[(s * R + r) * P];
            for (int64_t n = 0; n < N; ++n) {
              const T a = kh[n] * w;
              for (int64_t p = 0; p < P; ++p) St[n * P + p] += a * xs[p];
            }
          }
        }
      }
      for (int64_t n = 0; n < N; ++n)
        for (int64_t p = 0; p < P; ++p) raw.states.ssm_state[(bh * P + p) * N + n] = St[n * P + p];
      std::copy_n(&hd.kh[(S - 1) * R * N], R * N, &raw.states.k_state[bh * R * N]);
      std::copy_n(&in.v[((b * S + S - 1) * H + h) * P], P, &raw.states.v_state[bh * P]);
    }
  }
  return raw;
}

template <class T>
T silu(T u) {
  return u * sigmoid(u);
}

// 1 / sqrt(mean_p (y^r_p)^2 + eps) of the readout of (b, t, r, h): the pre-gate RMSNorm's scale.
template <class T>
T rms_scale(const MimoInputs<T>& in, const std::vector<T>& y, int64_t b, int64_t t, int64_t r,
            int64_t h) {
  const T* yr = &y[yidx(in, b, t, r, h)];
  T ss = T(0);
  for (int64_t p = 0; p < in.P; ++p) ss += yr[p] * yr[p];
  return T(1) / std::sqrt(ss / static_cast<T>(in.P) + in.norm_eps);
}

// Optional pre-gate norm, gate and (optional) down projection of the raw readout.
template <class T>
std::vector<T> project(const MimoInputs<T>& in, const std::vector<T>& y) {
  const int64_t B = in.B, S = in.S, H = in.H, P = in.P, R = in.R;
  const bool has_z = !in.z.empty(), reduce = !in.mimo_o.empty(), norm = !in.norm_weight.empty();
  std::vector<T> out(reduce ? B * S * H * P : B * S * R * H * P, T(0));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < S; ++t)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t r = 0; r < R; ++r) {
          const T rstd = norm ? rms_scale(in, y, b, t, r, h) : T(1);
          for (int64_t p = 0; p < P; ++p) {
            const int64_t w = (h * R + r) * P + p;
            const int64_t zi = ((b * S + t) * H + h) * P + p;
            const T gate = has_z ? silu(in.z[zi] * in.mimo_z[w]) : T(1);
            T yv = y[yidx(in, b, t, r, h) + p];
            if (norm) yv *= rstd * in.norm_weight[h * P + p];
            const T g = gate * yv;
            if (reduce)
              out[zi] += in.mimo_o[w] * g;
            else
              out[yidx(in, b, t, r, h) + p] = g;
          }
        }
  return out;
}

}  // namespace

template <class T>
MimoOutputs<T> mimo_sequential(const MimoInputs<T>& in) {
  check(in, Form::Sequential);
  Raw<T> raw = sequential_raw(in);
  MimoOutputs<T> o = std::move(raw.states);
  o.out = project(in, raw.y);
  return o;
}

template <class T>
MimoOutputs<T> mimo_chunked_forward(const MimoInputs<T>& in) {
  check(in, Form::Chunked);
  Raw<T> raw = chunked_raw(in);
  MimoOutputs<T> o = std::move(raw.states);
  o.out = project(in, raw.y);
  return o;
}

template <class T>
MimoBwdFwdOutputs<T> mimo_bwd_fwd(const MimoInputs<T>& in) {
  check(in, Form::BwdFwd);
  const int64_t B = in.B, S = in.S, H = in.H, P = in.P, R = in.R, N = in.N, G = in.G;
  const bool has_z = !in.z.empty();
  Raw<T> raw = chunked_raw(in);
  MimoBwdFwdOutputs<T> o;
  o.states = std::move(raw.states.states);

  o.qk_dot.assign(B * H * S * R * R, T(0));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      const int64_t g = h / (H / G);
      for (int64_t t = 0; t < S; ++t)
        for (int64_t r = 0; r < R; ++r)
          for (int64_t r2 = 0; r2 < R; ++r2) {
            const T* q = &in.q[(((b * S + t) * R + r) * G + g) * N];
            const T* k = &in.k[(((b * S + t) * R + r2) * G + g) * N];
            const T* qb = &in.q_bias[(h * R + r) * N];
            const T* kb = &in.k_bias[(h * R + r2) * N];
            T s = T(0);
            for (int64_t n = 0; n < N; ++n) s += (q[n] + qb[n]) * (k[n] + kb[n]);
            o.qk_dot[(((b * H + h) * S + t) * R + r) * R + r2] = s;
          }
    }

  const bool reduce = !in.mimo_o.empty(), norm = !in.norm_weight.empty();
  if (reduce) o.dmimo_o.assign(B * H * R * P, T(0));
  if (has_z) {
    o.dmimo_z.assign(B * H * R * P, T(0));
    o.dz.assign(B * S * H * P, T(0));
  }
  if (norm) {
    o.dnorm_weight.assign(B * H * R * P, T(0));
    o.dout_pre_rms.assign(B * H * S * R * P, T(0));
  }
  std::vector<T> e(P);  // norm: dL/d(normalized y) of one (t, r)
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < S; ++t)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t r = 0; r < R; ++r) {
          const T* yr = &raw.y[yidx(in, b, t, r, h)];
          const T rstd = norm ? rms_scale(in, raw.y, b, t, r, h) : T(1);
          for (int64_t p = 0; p < P; ++p) {
            const int64_t w = (h * R + r) * P + p;
            const int64_t zi = ((b * S + t) * H + h) * P + p;
            const int64_t gi = ((b * H + h) * R + r) * P + p;
            // What the gate multiplies: y, or its normalized and weighted form.
            const T xhat = yr[p] * rstd;
            const T y = norm ? xhat * in.norm_weight[h * P + p] : yr[p];
            const T d = reduce ? in.dout[zi] : in.dout[yidx(in, b, t, r, h) + p];
            const T wo = reduce ? in.mimo_o[w] : T(1);  // down projection (1 per rank)
            T gate = T(1);
            if (has_z) {
              const T u = in.z[zi] * in.mimo_z[w];
              const T sg = sigmoid(u);
              gate = u * sg;
              const T du = d * wo * y * sg * (T(1) + u * (T(1) - sg));
              o.dmimo_z[gi] += du * in.z[zi];
              o.dz[zi] += du * in.mimo_z[w];
            }
            if (reduce) o.dmimo_o[gi] += d * gate * y;
            if (norm) {
              e[p] = d * wo * gate;
              o.dnorm_weight[gi] += e[p] * xhat;
            }
          }
          if (norm) {
            // y -> xhat = y rstd: d xhat_p / d y_q = rstd (delta_pq - xhat_p xhat_q / P).
            T m = T(0);
            for (int64_t p = 0; p < P; ++p) m += e[p] * in.norm_weight[h * P + p] * yr[p] * rstd;
            m /= static_cast<T>(P);
            T* pre = &o.dout_pre_rms[(((b * H + h) * S + t) * R + r) * P];
            for (int64_t p = 0; p < P; ++p)
              pre[p] = rstd * (e[p] * in.norm_weight[h * P + p] - yr[p] * rstd * m);
          }
        }
  return o;
}

template <class T>
void mimo_dacs_segsum(MimoInputs<T>& in) {
  const int64_t B = in.B, H = in.H, S = in.S, C = in.chunk_size;
  require(B > 0 && H > 0 && S > 0 && C > 0, "sizes must be positive");
  require_size(in.adt, B * H * S, "adt");
  const int64_t nch = cdiv(S, C);
  in.da_cs.assign(B * H * S, T(0));
  in.da_cs_rev.assign(B * H * S, T(0));
  in.segsum.assign(B * H * nch * C * C, T(0));
  for (int64_t bh = 0; bh < B * H; ++bh)
    for (int64_t c = 0; c < nch; ++c) {
      const int64_t s0 = c * C, L = std::min(C, S - s0);
      const T* adt = &in.adt[bh * S + s0];
      T* cs = &in.da_cs[bh * S + s0];
      T acc = T(0);
      for (int64_t i = 0; i < L; ++i) cs[i] = acc += adt[i];
      for (int64_t i = 0; i < L; ++i) in.da_cs_rev[bh * S + s0 + i] = cs[L - 1] - cs[i];
      T* seg = &in.segsum[(bh * nch + c) * C * C];
      // Summed directly over (j, i]: a difference of two cumsums would cancel digits.
      for (int64_t i = 0; i < L; ++i) {
        T sum = T(0);
        for (int64_t j = i - 1; j >= 0; --j) {
          sum += adt[j + 1];
          seg[i * C + j] = sum;
        }
      }
    }
}

#define MAMBA3_MIMO_INSTANTIATE(T)                                          \
  template MimoOutputs<T> mimo_sequential<T>(const MimoInputs<T>&);         \
  template MimoOutputs<T> mimo_chunked_forward<T>(const MimoInputs<T>&);    \
  template MimoBwdFwdOutputs<T> mimo_bwd_fwd<T>(const MimoInputs<T>&);      \
  template void mimo_dacs_segsum<T>(MimoInputs<T>&);
MAMBA3_MIMO_INSTANTIATE(double)
MAMBA3_MIMO_INSTANTIATE(float)
#undef MAMBA3_MIMO_INSTANTIATE

}  // namespace mamba3::golden
