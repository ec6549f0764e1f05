// Golden SISO Mamba-3 model (SPEC.md section 1): the step-by-step recurrence, which is the
// definition, and the chunked form the kernels compute, written separately so that their
// agreement is a real check of both.
#include "mamba3_golden/siso_model.hpp"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

namespace mamba3::golden {

namespace {

constexpr double kPi = 3.141592653589793238462643383279502884;

void require(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument("golden siso_model: " + what);
}

template <class V>
void require_size(const V& v, int64_t n, const char* name) {
  require(static_cast<int64_t>(v.size()) == n,
          std::string(name) + " has " + std::to_string(v.size()) + " elements, expected " +
              std::to_string(n));
}

// Returns whether input states are given.
template <class T>
bool check(const SisoInputs<T>& in) {
  const int64_t B = in.B, S = in.S, H = in.H, G = in.G, N = in.N, P = in.P, A = in.A;
  require(B > 0 && S > 0 && H > 0 && G > 0 && N > 0 && P > 0 && A >= 0, "sizes must be positive");
  require(H % G == 0, "H must be a multiple of G");
  require(N % 2 == 0 && 2 * A <= N, "need even N and A <= N/2");
  require_size(in.q, B * S * G * N, "q");
  require_size(in.k, B * S * G * N, "k");
  require_size(in.v, B * S * H * P, "v");
  require_size(in.adt, B * H * S, "adt");
  require_size(in.dt, B * H * S, "dt");
  require_size(in.trap, B * H * S, "trap");
  require_size(in.q_bias, H * N, "q_bias");
  require_size(in.k_bias, H * N, "k_bias");
  require_size(in.angles, B * S * H * A, "angles");
  if (!in.D.empty()) require_size(in.D, H, "D");
  if (!in.z.empty()) require_size(in.z, B * S * H * P, "z");
  const bool st = !in.ssm_state0.empty();
  require(st == !in.k_state0.empty() && st == !in.v_state0.empty() &&
              (st == !in.angle_state0.empty() || A == 0),
          "input states must be given all together");
  if (st) {
    require_size(in.ssm_state0, B * H * P * N, "ssm_state0");
    require_size(in.k_state0, B * H * N, "k_state0");
    require_size(in.v_state0, B * H * P, "v_state0");
    require_size(in.angle_state0, B * H * A, "angle_state0");
  }
  return st;
}

template <class T>
T sigmoid(T x) {
  return T(1) / (T(1) + std::exp(-x));
}

// Angles live in [0, 2pi): the accumulated sum is reduced after every update.
template <class T>
T wrap_2pi(T x) {
  const T two_pi = T(2 * kPi);
  return x - two_pi * std::floor(x / two_pi);
}

template <class T>
void alloc_outputs(const SisoInputs<T>& in, SisoOutputs<T>& o) {
  const int64_t B = in.B, S = in.S, H = in.H, N = in.N, P = in.P, A = in.A;
  o.out.assign(B * S * H * P, T(0));
  o.ssm_state.assign(B * H * P * N, T(0));
  o.k_state.assign(B * H * N, T(0));
  o.v_state.assign(B * H * P, T(0));
  o.angle_state.assign(B * H * A, T(0));
}

// out = y * silu(z) when z is given.
template <class T>
T gate(const SisoInputs<T>& in, int64_t zi, T y) {
  if (in.z.empty()) return y;
  const T z = in.z[zi];
  return y * z * sigmoid(z);
}

}  // namespace

template <class T>
void rotate(T* x, int64_t N, const T* theta, int64_t npairs, Rotation conv, bool inverse) {
  for (int64_t i = 0; i < npairs; ++i) {
    const int64_t a = conv == Rotation::Interleaved ? 2 * i : i;
    const int64_t b = conv == Rotation::Interleaved ? 2 * i + 1 : N / 2 + i;
    const T c = std::cos(theta[i]);
    const T s = inverse ? -std::sin(theta[i]) : std::sin(theta[i]);
    const T x0 = x[a], x1 = x[b];
    x[a] = x0 * c - x1 * s;
    x[b] = x0 * s + x1 * c;
  }
}

// ------------------------------------------------------------------------------ sequential

template <class T>
SisoOutputs<T> siso_sequential(const SisoInputs<T>& in) {
  const bool st = check(in);
  const int64_t B = in.B, S = in.S, H = in.H, G = in.G, N = in.N, P = in.P, A = in.A;
  const int64_t ratio = H / G;
  SisoOutputs<T> o;
  alloc_outputs(in, o);
  std::vector<T> Hs(P * N), kprev(N), vprev(P), theta(A), qh(N), kh(N);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      const int64_t g = h / ratio;
      const int64_t bh = b * H + h;
      for (int64_t i = 0; i < P * N; ++i) Hs[i] = st ? in.ssm_state0[bh * P * N + i] : T(0);
      for (int64_t n = 0; n < N; ++n) kprev[n] = st ? in.k_state0[bh * N + n] : T(0);
      for (int64_t p = 0; p < P; ++p) vprev[p] = st ? in.v_state0[bh * P + p] : T(0);
      for (int64_t i = 0; i < A; ++i) theta[i] = st ? in.angle_state0[bh * A + i] : T(0);

      for (int64_t t = 0; t < S; ++t) {
        const int64_t ts = bh * S + t;  // [B,H,S]
        const T dt = in.dt[ts];
        for (int64_t i = 0; i < A; ++i)
          theta[i] = wrap_2pi(theta[i] + T(kPi) * std::tanh(in.angles[((b * S + t) * H + h) * A + i]) * dt);

        const int64_t qk = ((b * S + t) * G + g) * N;
        for (int64_t n = 0; n < N; ++n) {
          qh[n] = in.q[qk + n] + in.q_bias[h * N + n];
          kh[n] = in.k[qk + n] + in.k_bias[h * N + n];
        }
        rotate(qh.data(), N, theta.data(), A, in.rotation);
        rotate(kh.data(), N, theta.data(), A, in.rotation);

        const T lam = sigmoid(in.trap[ts]);
        const T alpha = std::exp(in.adt[ts]);
        const T beta = (T(1) - lam) * dt * alpha;
        const T gamma = lam * dt;
        const T* v = &in.v[((b * S + t) * H + h) * P];

        for (int64_t p = 0; p < P; ++p) {
          T y = 0;
          for (int64_t n = 0; n < N; ++n) {
            T& hv = Hs[p * N + n];
            hv = alpha * hv + beta * vprev[p] * kprev[n] + gamma * v[p] * kh[n];
            y += hv * qh[n];
          }
          if (!in.D.empty()) y += in.D[h] * v[p];
          const int64_t oi = ((b * S + t) * H + h) * P + p;
          o.out[oi] = gate(in, oi, y);
        }
        kprev = kh;
        for (int64_t p = 0; p < P; ++p) vprev[p] = v[p];
      }
      for (int64_t i = 0; i < P * N; ++i) o.ssm_state[bh * P * N + i] = Hs[i];
      for (int64_t n = 0; n < N; ++n) o.k_state[bh * N + n] = kprev[n];
      for (int64_t p = 0; p < P; ++p) o.v_state[bh * P + p] = vprev[p];
      for (int64_t i = 0; i < A; ++i) o.angle_state[bh * A + i] = theta[i];
    }
  return o;
}

// ------------------------------------------------------------------------------ chunked

template <class T>
SisoOutputs<T> siso_chunked(const SisoInputs<T>& in, int64_t C) {
  require(C > 0, "chunk size must be positive");
  const bool st = check(in);
  const int64_t B = in.B, S = in.S, H = in.H, G = in.G, N = in.N, P = in.P, A = in.A;
  const int64_t ratio = H / G;
  SisoOutputs<T> o;
  alloc_outputs(in, o);

  // Per (b, h), whole-sequence arrays: rotated q/k [S,N], unrotated q.k [S], trap_scale [S].
  std::vector<T> qh(S * N), kh(S * N), qk_raw(S), lam(S), tscale(S), ang(S * A);
  std::vector<T> Hc(P * N), Hn(P * N), cs(C), theta_state(A);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      const int64_t g = h / ratio;
      const int64_t bh = b * H + h;
      const T* dt = &in.dt[bh * S];
      const T* adt = &in.adt[bh * S];

      // Angles: per chunk, inclusive cumsum of pi*tanh(angle)*dt plus the carried state; the
      // carry advances by the chunk total (as angle_dt does), both reduced mod 2pi.
      for (int64_t i = 0; i < A; ++i) theta_state[i] = st ? in.angle_state0[bh * A + i] : T(0);
      for (int64_t c0 = 0; c0 < S; c0 += C) {
        const int64_t c1 = std::min(S, c0 + C);
        for (int64_t i = 0; i < A; ++i) {
          T run = 0;
          for (int64_t t = c0; t < c1; ++t) {
            run += T(kPi) * std::tanh(in.angles[((b * S + t) * H + h) * A + i]) * dt[t];
            ang[t * A + i] = wrap_2pi(run + theta_state[i]);
          }
          theta_state[i] = wrap_2pi(theta_state[i] + run);
        }
      }

      for (int64_t t = 0; t < S; ++t) {
        const int64_t qrow = ((b * S + t) * G + g) * N;
        T dot = 0;
        for (int64_t n = 0; n < N; ++n) {
          const T qb = in.q[qrow + n] + in.q_bias[h * N + n];
          const T kb = in.k[qrow + n] + in.k_bias[h * N + n];
          qh[t * N + n] = qb;
          kh[t * N + n] = kb;
          dot += qb * kb;
        }
        qk_raw[t] = dot;
        rotate(&qh[t * N], N, ang.data() + t * A, A, in.rotation);
        rotate(&kh[t * N], N, ang.data() + t * A, A, in.rotation);
        lam[t] = sigmoid(in.trap[bh * S + t]);
      }
      // trap_scale_t = gamma_t + dt_{t+1}(1 - lam_{t+1}): the trapezoid's weight of x_t k_t,
      // split over the step that writes it and the next one.
      for (int64_t t = 0; t < S; ++t)
        tscale[t] = lam[t] * dt[t] + (t + 1 < S ? dt[t + 1] * (T(1) - lam[t + 1]) : T(0));

      // State entering chunk 0: the input state plus the pending half-step of the input k/v
      // (the beta_0 term, whose alpha_0 factor is part of da_cs of chunk 0).
      for (int64_t p = 0; p < P; ++p)
        for (int64_t n = 0; n < N; ++n)
          Hc[p * N + n] = st ? in.ssm_state0[(bh * P + p) * N + n] +
                                   dt[0] * (T(1) - lam[0]) * in.v_state0[bh * P + p] *
                                       in.k_state0[bh * N + n]
                             : T(0);

      for (int64_t c0 = 0; c0 < S; c0 += C) {
        const int64_t c1 = std::min(S, c0 + C), L = c1 - c0;
        T run = 0;
        for (int64_t j = 0; j < L; ++j) cs[j] = (run += adt[c0 + j]);  // da_cs, inclusive
        const T cs_last = cs[L - 1];

        for (int64_t i = 0; i < L; ++i) {
          const int64_t t = c0 + i;
          const T* vt = &in.v[((b * S + t) * H + h) * P];
          // Causal weights w_j = (qh_t . kh_s) trap_scale_s exp(segsum[t,s]) for s < t.
          std::vector<T> w(i);
          for (int64_t j = 0; j < i; ++j) {
            const int64_t s = c0 + j;
            T d = 0;
            for (int64_t n = 0; n < N; ++n) d += qh[t * N + n] * kh[s * N + n];
            w[j] = d * tscale[s] * std::exp(cs[i] - cs[j]);
          }
          const T decay = std::exp(cs[i]);
          const T diag = lam[t] * dt[t] * qk_raw[t];  // rotation-invariant same-position term
          for (int64_t p = 0; p < P; ++p) {
            T inter = 0;
            for (int64_t n = 0; n < N; ++n) inter += Hc[p * N + n] * qh[t * N + n];
            T y = decay * inter + diag * vt[p];
            for (int64_t j = 0; j < i; ++j) y += w[j] * in.v[((b * S + c0 + j) * H + h) * P + p];
            if (!in.D.empty()) y += in.D[h] * vt[p];
            const int64_t oi = ((b * S + t) * H + h) * P + p;
            o.out[oi] = gate(in, oi, y);
          }
        }

        // Carry: decay the entering state over the whole chunk and add every position's
        // write, decayed from its position to the chunk end (da_cs_rev).
        const T dlast = std::exp(cs_last);
        for (int64_t i = 0; i < P * N; ++i) Hn[i] = dlast * Hc[i];
        for (int64_t j = 0; j < L; ++j) {
          const int64_t s = c0 + j;
          const T f = tscale[s] * std::exp(cs_last - cs[j]);
          const T* vs = &in.v[((b * S + s) * H + h) * P];
          for (int64_t p = 0; p < P; ++p)
            for (int64_t n = 0; n < N; ++n) Hn[p * N + n] += f * vs[p] * kh[s * N + n];
        }
        Hc.swap(Hn);
      }

      // After the last chunk trap_scale_{S-1} = gamma_{S-1}, so Hc is exactly H_{S-1}.
      for (int64_t i = 0; i < P * N; ++i) o.ssm_state[bh * P * N + i] = Hc[i];
      for (int64_t n = 0; n < N; ++n) o.k_state[bh * N + n] = kh[(S - 1) * N + n];
      for (int64_t p = 0; p < P; ++p) o.v_state[bh * P + p] = in.v[((b * S + S - 1) * H + h) * P + p];
      for (int64_t i = 0; i < A; ++i) o.angle_state[bh * A + i] = theta_state[i];
    }
  return o;
}

template void rotate<float>(float*, int64_t, const float*, int64_t, Rotation, bool);
template void rotate<double>(double*, int64_t, const double*, int64_t, Rotation, bool);
template SisoOutputs<float> siso_sequential<float>(const SisoInputs<float>&);
template SisoOutputs<double> siso_sequential<double>(const SisoInputs<double>&);
template SisoOutputs<float> siso_chunked<float>(const SisoInputs<float>&, int64_t);
template SisoOutputs<double> siso_chunked<double>(const SisoInputs<double>&, int64_t);

}  // namespace mamba3::golden
