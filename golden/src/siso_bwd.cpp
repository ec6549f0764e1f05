// Golden of the SISO backward operators compute_dqktheta and compute_ddt_dtrap_dinput_states:
// each forward relation F is written out explicitly, and the gradients are derived from it by
// hand. Everything is computed in T (double: golden; float: the fp32 reference).
#include "mamba3_golden/siso_bwd.hpp"

#include <cmath>
#include <stdexcept>
#include <string>

namespace mamba3::golden {

namespace {

void require(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument("golden siso_bwd: " + what);
}

template <class V>
void require_size(const V& v, int64_t n, const char* name) {
  require(static_cast<int64_t>(v.size()) == n,
          std::string(name) + " has " + std::to_string(v.size()) + " elements, expected " +
              std::to_string(n));
}

// One sequence: rows of batch `b` in [start, end).
struct Seq {
  int64_t b, start, end;
};

// Sequences as the operators see them: one per batch row, or the cu_seqlens ranges of row 0.
std::vector<Seq> sequences(int64_t B, int64_t S, const std::vector<int64_t>& cu) {
  std::vector<Seq> r;
  if (cu.empty()) {
    for (int64_t b = 0; b < B; ++b) r.push_back({b, 0, S});
    return r;
  }
  require(B == 1, "cu_seqlens needs B == 1");
  require(cu.size() >= 2 && cu.front() == 0 && cu.back() == S,
          "cu_seqlens must run from 0 to S");
  for (size_t i = 0; i + 1 < cu.size(); ++i) {
    require(cu[i + 1] > cu[i], "cu_seqlens must be strictly increasing");
    r.push_back({0, cu[i], cu[i + 1]});
  }
  return r;
}

template <class T>
T sigmoid(T x) {
  return T(1) / (T(1) + std::exp(-x));
}

template <class T>
void check_dqktheta(const DqkthetaInputs<T>& in, int64_t nseq) {
  const int64_t B = in.B, S = in.S, G = in.G, H = in.H, N = in.N, A = in.A;
  require(B > 0 && S > 0 && G > 0 && H > 0 && N > 0 && A >= 0, "sizes must be positive");
  require(H % G == 0, "H must be a multiple of G");
  require(N % 2 == 0 && 2 * A <= N, "need even N and A <= N/2");
  require_size(in.q, B * S * G * N, "q");
  require_size(in.k, B * S * G * N, "k");
  require_size(in.scale, B * H * S, "scale");
  require_size(in.gamma, B * H * S, "gamma");
  require_size(in.q_bias, H * N, "q_bias");
  require_size(in.k_bias, H * N, "k_bias");
  require_size(in.angles, B * S * H * A, "angles");
  require_size(in.dq_in, B * S * H * N, "dq_in");
  require_size(in.dk_in, B * S * H * N, "dk_in");
  require_size(in.dqk, B * H * S, "dqk");
  if (!in.d_ok_state.empty()) require_size(in.d_ok_state, nseq * H * N, "d_ok_state");
}

// y = rot(x) for the interleaved pairs (2i, 2i+1), i < A; other dims copied.
template <class T>
void rot_fwd(const T* x, const T* theta, int64_t N, int64_t A, T* y) {
  for (int64_t n = 2 * A; n < N; ++n) y[n] = x[n];
  for (int64_t i = 0; i < A; ++i) {
    const T c = std::cos(theta[i]), s = std::sin(theta[i]);
    const T x0 = x[2 * i], x1 = x[2 * i + 1];
    y[2 * i] = x0 * c - x1 * s;
    y[2 * i + 1] = x0 * s + x1 * c;
  }
}

// y = rot(x)^T g = rot^-1(g): the gradient of g . rot(x) with respect to x.
template <class T>
void rot_bwd(const T* g, const T* theta, int64_t N, int64_t A, T* y) {
  for (int64_t n = 2 * A; n < N; ++n) y[n] = g[n];
  for (int64_t i = 0; i < A; ++i) {
    const T c = std::cos(theta[i]), s = std::sin(theta[i]);
    const T g0 = g[2 * i], g1 = g[2 * i + 1];
    y[2 * i] = g0 * c + g1 * s;
    y[2 * i + 1] = -g0 * s + g1 * c;
  }
}

// d/dtheta_i of g . rot(x): rot'(theta) x = (-x0 s - x1 c, x0 c - x1 s).
template <class T>
void rot_dtheta_acc(const T* g, const T* x, const T* theta, int64_t A, T* dtheta) {
  for (int64_t i = 0; i < A; ++i) {
    const T c = std::cos(theta[i]), s = std::sin(theta[i]);
    const T x0 = x[2 * i], x1 = x[2 * i + 1];
    dtheta[i] += g[2 * i] * (-x0 * s - x1 * c) + g[2 * i + 1] * (x0 * c - x1 * s);
  }
}

}  // namespace

// ------------------------------------------------------------------------------ dqktheta

template <class T>
T dqktheta_forward(const DqkthetaInputs<T>& in) {
  const int64_t B = in.B, S = in.S, G = in.G, H = in.H, N = in.N, A = in.A;
  const auto seqs = sequences(B, S, in.cu_seqlens);
  check_dqktheta(in, static_cast<int64_t>(seqs.size()));
  const int64_t ratio = H / G;
  std::vector<T> qb(N), kb(N), rq(N), rk(N);
  T F = 0;
  auto load = [&](int64_t b, int64_t s, int64_t h) {
    const int64_t g = h / ratio;
    const T* q = &in.q[((b * S + s) * G + g) * N];
    const T* k = &in.k[((b * S + s) * G + g) * N];
    for (int64_t n = 0; n < N; ++n) {
      qb[n] = q[n] + in.q_bias[h * N + n];
      kb[n] = k[n] + in.k_bias[h * N + n];
    }
  };
  for (int64_t b = 0; b < B; ++b)
    for (int64_t s = 0; s < S; ++s)
      for (int64_t h = 0; h < H; ++h) {
        load(b, s, h);
        const T* th = in.angles.data() + ((b * S + s) * H + h) * A;
        rot_fwd(qb.data(), th, N, A, rq.data());
        rot_fwd(kb.data(), th, N, A, rk.data());
        const int64_t row = ((b * S + s) * H + h) * N;
        const int64_t hs = (b * H + h) * S + s;
        T tq = 0, tk = 0, qk = 0;
        for (int64_t n = 0; n < N; ++n) {
          tq += in.dq_in[row + n] * rq[n];
          tk += in.dk_in[row + n] * rk[n];
          qk += qb[n] * kb[n];
        }
        F += tq + in.scale[hs] * tk + in.dqk[hs] * in.gamma[hs] * qk;
      }
  if (!in.d_ok_state.empty()) {
    for (size_t i = 0; i < seqs.size(); ++i) {
      const int64_t b = seqs[i].b, s = seqs[i].end - 1;
      for (int64_t h = 0; h < H; ++h) {
        load(b, s, h);
        rot_fwd(kb.data(), in.angles.data() + ((b * S + s) * H + h) * A, N, A, rk.data());
        for (int64_t n = 0; n < N; ++n) F += in.d_ok_state[(i * H + h) * N + n] * rk[n];
      }
    }
  }
  return F;
}

template <class T>
DqkthetaGrads<T> dqktheta(const DqkthetaInputs<T>& in) {
  const int64_t B = in.B, S = in.S, G = in.G, H = in.H, N = in.N, A = in.A;
  const auto seqs = sequences(B, S, in.cu_seqlens);
  check_dqktheta(in, static_cast<int64_t>(seqs.size()));
  const int64_t ratio = H / G;
  // seq_of_last[b*S+s] = index of the sequence whose last position this is, or -1.
  std::vector<int64_t> seq_of_last(static_cast<size_t>(B * S), -1);
  for (size_t i = 0; i < seqs.size(); ++i)
    seq_of_last[seqs[i].b * S + seqs[i].end - 1] = static_cast<int64_t>(i);

  DqkthetaGrads<T> gr;
  gr.dq.assign(B * S * G * N, T(0));
  gr.dk.assign(B * S * G * N, T(0));
  gr.dq_bias.assign(H * N, T(0));
  gr.dk_bias.assign(H * N, T(0));
  gr.dangles.assign(B * S * H * A, T(0));
  gr.dscale.assign(B * H * S, T(0));
  gr.dgamma.assign(B * H * S, T(0));

  std::vector<T> qb(N), kb(N), rk(N), dks(N), dq_pre(N), dk_pre(N);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t s = 0; s < S; ++s)
      for (int64_t h = 0; h < H; ++h) {
        const int64_t g = h / ratio;
        const int64_t qrow = ((b * S + s) * G + g) * N;
        const int64_t row = ((b * S + s) * H + h) * N;
        const int64_t hs = (b * H + h) * S + s;
        const T* th = in.angles.data() + ((b * S + s) * H + h) * A;
        for (int64_t n = 0; n < N; ++n) {
          qb[n] = in.q[qrow + n] + in.q_bias[h * N + n];
          kb[n] = in.k[qrow + n] + in.k_bias[h * N + n];
        }
        rot_fwd(kb.data(), th, N, A, rk.data());
        const T* dq_in = &in.dq_in[row];
        const T* dk_in = &in.dk_in[row];

        // F is linear in gamma and scale.
        T qk = 0, dsc = 0;
        for (int64_t n = 0; n < N; ++n) {
          qk += qb[n] * kb[n];
          dsc += dk_in[n] * rk[n];
        }
        gr.dgamma[hs] = in.dqk[hs] * qk;
        gr.dscale[hs] = dsc;

        // Everything multiplying rot(kb) at this position: scale*dk_in, plus d_ok_state when
        // this is the last position of a sequence.
        const int64_t last = seq_of_last[b * S + s];
        for (int64_t n = 0; n < N; ++n) {
          dks[n] = in.scale[hs] * dk_in[n];
          if (last >= 0 && !in.d_ok_state.empty()) dks[n] += in.d_ok_state[(last * H + h) * N + n];
        }

        // qb and kb: back through the rotation, plus the product rule of the qk term.
        rot_bwd(dq_in, th, N, A, dq_pre.data());
        rot_bwd(dks.data(), th, N, A, dk_pre.data());
        const T w = in.dqk[hs] * in.gamma[hs];
        for (int64_t n = 0; n < N; ++n) {
          dq_pre[n] += w * kb[n];
          dk_pre[n] += w * qb[n];
          gr.dq[qrow + n] += dq_pre[n];  // heads sharing q/k head g add up (GQA)
          gr.dk[qrow + n] += dk_pre[n];
          gr.dq_bias[h * N + n] += dq_pre[n];
          gr.dk_bias[h * N + n] += dk_pre[n];
        }

        T* dth = gr.dangles.data() + ((b * S + s) * H + h) * A;
        rot_dtheta_acc(dq_in, qb.data(), th, A, dth);
        rot_dtheta_acc(dks.data(), kb.data(), th, A, dth);
      }
  return gr;
}

// ------------------------------------------------------------------------------ ddt / dtrap

namespace {

template <class T>
bool check_ddt(const DdtDtrapInputs<T>& in, int64_t nseq) {
  const int64_t B = in.B, H = in.H, S = in.S, N = in.N, P = in.P;
  require(B > 0 && H > 0 && S > 0, "sizes must be positive");
  require_size(in.dscale, B * H * S, "dscale");
  require_size(in.dgamma, B * H * S, "dgamma");
  require_size(in.dt, B * H * S, "dt");
  require_size(in.trap, B * H * S, "trap");
  const bool st = !in.d_issm_state.empty();
  require(st == !in.input_k_state.empty() && st == !in.input_v_state.empty(),
          "d_issm_state, input_k_state and input_v_state must be given together");
  if (st) {
    require(N > 0 && P > 0, "N and P must be positive with states");
    require_size(in.d_issm_state, nseq * H * P * N, "d_issm_state");
    require_size(in.input_k_state, nseq * H * N, "input_k_state");
    require_size(in.input_v_state, nseq * H * P, "input_v_state");
  }
  return st;
}

}  // namespace

template <class T>
T ddt_dtrap_forward(const DdtDtrapInputs<T>& in) {
  const int64_t H = in.H, S = in.S, N = in.N, P = in.P;
  const auto seqs = sequences(in.B, S, in.cu_seqlens);
  const bool st = check_ddt(in, static_cast<int64_t>(seqs.size()));
  T F = 0;
  for (size_t i = 0; i < seqs.size(); ++i) {
    const auto& sq = seqs[i];
    for (int64_t h = 0; h < H; ++h) {
      const int64_t base = (sq.b * H + h) * S;
      for (int64_t t = sq.start; t < sq.end; ++t) {
        const T lam = sigmoid(in.trap[base + t]);
        const T gamma = in.dt[base + t] * lam;
        T scale = gamma;
        if (t + 1 < sq.end) scale += in.dt[base + t + 1] * (T(1) - sigmoid(in.trap[base + t + 1]));
        F += in.dgamma[base + t] * gamma + in.dscale[base + t] * scale;
      }
      if (st) {
        // The constant issm term of issm_mid is left out: it does not depend on any input here.
        const T scalar = in.dt[base + sq.start] * (T(1) - sigmoid(in.trap[base + sq.start]));
        const T* d = &in.d_issm_state[(i * H + h) * P * N];
        const T* kst = &in.input_k_state[(i * H + h) * N];
        const T* vst = &in.input_v_state[(i * H + h) * P];
        for (int64_t p = 0; p < P; ++p)
          for (int64_t n = 0; n < N; ++n) F += d[p * N + n] * scalar * vst[p] * kst[n];
      }
    }
  }
  return F;
}

template <class T>
DdtDtrapGrads<T> ddt_dtrap(const DdtDtrapInputs<T>& in) {
  const int64_t B = in.B, H = in.H, S = in.S, N = in.N, P = in.P;
  const auto seqs = sequences(B, S, in.cu_seqlens);
  const int64_t nseq = static_cast<int64_t>(seqs.size());
  const bool st = check_ddt(in, nseq);
  DdtDtrapGrads<T> gr;
  gr.ddt.assign(B * H * S, T(0));
  gr.dtrap.assign(B * H * S, T(0));
  if (st) {
    gr.d_input_ssm_state = in.d_issm_state;  // issm enters F linearly with coefficient d_issm
    gr.d_input_k_state.assign(nseq * H * N, T(0));
    gr.d_input_v_state.assign(nseq * H * P, T(0));
  }
  for (int64_t i = 0; i < nseq; ++i) {
    const auto& sq = seqs[i];
    for (int64_t h = 0; h < H; ++h) {
      const int64_t base = (sq.b * H + h) * S;
      for (int64_t t = sq.start; t < sq.end; ++t) {
        // dt_t and lam_t enter gamma_t (coefficient dgamma_t + dscale_t) and, through the
        // shifted term dt_t (1 - lam_t), scale_{t-1} (coefficient dscale_{t-1}, same sequence).
        const T lam = sigmoid(in.trap[base + t]);
        const T dt = in.dt[base + t];
        const T cur = in.dgamma[base + t] + in.dscale[base + t];
        const T prev = t > sq.start ? in.dscale[base + t - 1] : T(0);
        gr.ddt[base + t] = cur * lam + prev * (T(1) - lam);
        gr.dtrap[base + t] = (cur - prev) * dt * lam * (T(1) - lam);  // dlam/dtrap = lam(1-lam)
      }
      if (st) {
        const int64_t t0 = base + sq.start;
        const T lam0 = sigmoid(in.trap[t0]);
        const T dt0 = in.dt[t0];
        const T scalar = dt0 * (T(1) - lam0);
        const T* d = &in.d_issm_state[(i * H + h) * P * N];
        const T* kst = &in.input_k_state[(i * H + h) * N];
        const T* vst = &in.input_v_state[(i * H + h) * P];
        T* dk = &gr.d_input_k_state[(i * H + h) * N];
        T* dv = &gr.d_input_v_state[(i * H + h) * P];
        T dsc = 0;  // dF/dscalar
        for (int64_t p = 0; p < P; ++p) {
          T acc = 0;
          for (int64_t n = 0; n < N; ++n) {
            acc += d[p * N + n] * kst[n];
            dk[n] += d[p * N + n] * vst[p];
          }
          dv[p] = scalar * acc;
          dsc += acc * vst[p];
        }
        for (int64_t n = 0; n < N; ++n) dk[n] *= scalar;
        gr.ddt[t0] += dsc * (T(1) - lam0);
        gr.dtrap[t0] += dsc * (-dt0) * lam0 * (T(1) - lam0);
      }
    }
  }
  return gr;
}

template float dqktheta_forward<float>(const DqkthetaInputs<float>&);
template double dqktheta_forward<double>(const DqkthetaInputs<double>&);
template DqkthetaGrads<float> dqktheta<float>(const DqkthetaInputs<float>&);
template DqkthetaGrads<double> dqktheta<double>(const DqkthetaInputs<double>&);
template float ddt_dtrap_forward<float>(const DdtDtrapInputs<float>&);
template double ddt_dtrap_forward<double>(const DdtDtrapInputs<double>&);
template DdtDtrapGrads<float> ddt_dtrap<float>(const DdtDtrapInputs<float>&);
template DdtDtrapGrads<double> ddt_dtrap<double>(const DdtDtrapInputs<double>&);

}  // namespace mamba3::golden
