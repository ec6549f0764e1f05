// CPU backend of the SISO backward operators (seed 000).
//
// Every tensor is read through its own strides and runtime dtype; all arithmetic is float32, as in
// the CUDA kernels. Rows of N (or P) elements are converted to float once per row so the inner
// loops stay free of dtype dispatch. Results never depend on the number of threads: work is split
// into items whose size depends only on the problem shape, each item writes disjoint outputs or
// its own partial sums, and partials are reduced in a fixed order afterwards.
#include "cpu/siso_bwd.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "core/check.hpp"
#include "core/error.hpp"
#include "cpu/io.hpp"

namespace mamba3::cpu {
namespace {

// Problems above this many elements are spread over hardware_concurrency threads.
constexpr int64_t kParallelThreshold = int64_t(1) << 20;

// Sequence boundaries as (batch row, first position, one past the last position).
struct Seq {
  int64_t b, begin, end;
};

std::vector<Seq> sequences(bool varlen, const TensorView& cu, int64_t S, int64_t nseq) {
  std::vector<Seq> out(static_cast<size_t>(nseq));
  for (int64_t i = 0; i < nseq; ++i) {
    if (varlen)
      out[i] = Seq{0, read_index_host(cu, i), read_index_host(cu, i + 1)};
    else
      out[i] = Seq{i, 0, S};
  }
  return out;
}

}  // namespace

// ================================================================== compute_dqktheta

void compute_dqktheta(const DqkthetaParams& p) {
  const int64_t B = p.B, S = p.S, G = p.G, H = p.H, N = p.N, A = p.A;
  const int64_t HperG = H / G;

  // For each (b, s): index of the sequence that ends there, or -1. The d_ok_state gradient enters
  // dk through rot(k_last + kb) at exactly these positions.
  std::vector<int64_t> seq_ending_at;
  if (p.has_dok) {
    seq_ending_at.assign(static_cast<size_t>(B * S), -1);
    int64_t i = 0;
    for (const Seq& q : sequences(p.varlen, p.cu_seqlens, S, p.nseq))
      seq_ending_at[q.b * S + q.end - 1] = i++;
  }

  // Work items are blocks of consecutive positions of one batch row. The block length depends on
  // the shape only (at least 32 positions; it grows to keep the item count and the partial-sum
  // storage bounded), so the bias partials, and hence the bias sums, are the same whatever the
  // thread count.
  int64_t block = 32;
  auto items_for = [&](int64_t blk) { return B * ((S + blk - 1) / blk); };
  while (block < S && (items_for(block) > 1024 || items_for(block) * H * N > (int64_t(1) << 21)))
    block *= 2;
  const int64_t blocks_per_row = (S + block - 1) / block;
  const int64_t n_items = B * blocks_per_row;

  // Per-item compensated partial bias sums [item][H][N] (sum and its running error), for q and k.
  const size_t part_size = static_cast<size_t>(n_items * H * N);
  std::vector<float> part_q(part_size), part_q_err(part_size);
  std::vector<float> part_k(part_size), part_k_err(part_size);

  // Biases are tiny and read for every position: convert them once.
  std::vector<float> qbias(static_cast<size_t>(H * N)), kbias(static_cast<size_t>(H * N));
  for (int64_t h = 0; h < H; ++h) {
    load_row(p.q_bias, p.q_bias.offset(h, 0), p.q_bias.strides[1], N, &qbias[h * N]);
    load_row(p.k_bias, p.k_bias.offset(h, 0), p.k_bias.strides[1], N, &kbias[h * N]);
  }

  const bool parallel = B * S * H * N > kParallelThreshold;
  parallel_for(n_items, parallel, [&](int64_t item) {
    const int64_t b = item / blocks_per_row;
    const int64_t s0 = (item % blocks_per_row) * block;
    const int64_t s1 = std::min(S, s0 + block);
    float* pq = &part_q[item * H * N];
    float* pk = &part_k[item * H * N];
    float* pq_err = &part_q_err[item * H * N];
    float* pk_err = &part_k_err[item * H * N];
    std::fill(pq, pq + H * N, 0.f);
    std::fill(pk, pk + H * N, 0.f);
    std::fill(pq_err, pq_err + H * N, 0.f);
    std::fill(pk_err, pk_err + H * N, 0.f);

    std::vector<float> buf(static_cast<size_t>(12 * N + 4 * A));
    float* qraw = buf.data();        // q[b,s,g,:]
    float* kraw = qraw + N;          // k[b,s,g,:]
    float* qb = kraw + N;            // q + q_bias[h]
    float* kb = qb + N;              // k + k_bias[h]
    float* dqin = kb + N;            // dq_in[b,s,h,:]
    float* dks = dqin + N;           // dk_in[b,s,h,:] * scale (+ d_ok_state at a sequence end)
    float* dkin = dks + N;           // dk_in[b,s,h,:]
    float* dq_acc = dkin + N;        // sum over the heads of group g
    float* dk_acc = dq_acc + N;
    float* dok = dk_acc + N;         // d_ok_state[seq,h,:]
    float* dq_pre = dok + N;         // gradient w.r.t. q + q_bias[h] (one head)
    float* dk_pre = dq_pre + N;      // gradient w.r.t. k + k_bias[h]
    float* theta = dk_pre + N;       // angles[b,s,h,:]
    float* dtheta = theta + A;
    float* cos_t = dtheta + A;       // cos / sin of theta, computed once per head and position
    float* sin_t = cos_t + A;

    for (int64_t s = s0; s < s1; ++s) {
      const int64_t ending_seq = p.has_dok ? seq_ending_at[b * S + s] : -1;
      for (int64_t g = 0; g < G; ++g) {
        load_row(p.q, p.q.offset(b, s, g, 0), p.q.strides[3], N, qraw);
        load_row(p.k, p.k.offset(b, s, g, 0), p.k.strides[3], N, kraw);
        std::fill(dq_acc, dq_acc + N, 0.f);
        std::fill(dk_acc, dk_acc + N, 0.f);

        for (int64_t h = g * HperG; h < (g + 1) * HperG; ++h) {
          const float* qbh = &qbias[h * N];
          const float* kbh = &kbias[h * N];
          float qk = 0.f;
          for (int64_t n = 0; n < N; ++n) {
            qb[n] = qraw[n] + qbh[n];
            kb[n] = kraw[n] + kbh[n];
            qk += qb[n] * kb[n];
          }
          const float dqk = load_at(p.dqk, p.dqk.offset(b, h, s));
          const float sc = load_at(p.scale, p.scale.offset(b, h, s));
          const float gm = load_at(p.gamma, p.gamma.offset(b, h, s));
          store_at(p.dgamma, p.dgamma.offset(b, h, s), dqk * qk);

          load_row(p.dq_in, p.dq_in.offset(b, s, h, 0), p.dq_in.strides[3], N, dqin);
          load_row(p.dk_in, p.dk_in.offset(b, s, h, 0), p.dk_in.strides[3], N, dkin);
          load_row(p.angles, p.angles.offset(b, s, h, 0), p.angles.strides[3], A, theta);
          for (int64_t i = 0; i < A; ++i) {
            cos_t[i] = std::cos(theta[i]);
            sin_t[i] = std::sin(theta[i]);
          }

          // dscale = dk_in . rot(kb), summed in element order; the d_ok_state term is not
          // scaled, so it stays out.
          float dsc = 0.f;
          for (int64_t i = 0; i < A; ++i) {
            const float c = cos_t[i], sn = sin_t[i];
            const float k0 = kb[2 * i], k1 = kb[2 * i + 1];
            dsc += dkin[2 * i] * (k0 * c - k1 * sn);
            dsc += dkin[2 * i + 1] * (k0 * sn + k1 * c);
          }
          for (int64_t n = 2 * A; n < N; ++n) dsc += dkin[n] * kb[n];
          store_at(p.dscale, p.dscale.offset(b, h, s), dsc);

          for (int64_t n = 0; n < N; ++n) dks[n] = dkin[n] * sc;
          if (ending_seq >= 0) {
            load_row(p.d_ok_state, p.d_ok_state.offset(ending_seq, h, 0),
                     p.d_ok_state.strides[2], N, dok);
            for (int64_t n = 0; n < N; ++n) dks[n] += dok[n];
          }

          const float w = dqk * gm;  // weight of the gamma * (qb . kb) term
          for (int64_t i = 0; i < A; ++i) {
            const float c = cos_t[i], sn = sin_t[i];
            const float q0 = qb[2 * i], q1 = qb[2 * i + 1];
            const float k0 = kb[2 * i], k1 = kb[2 * i + 1];
            const float gq0 = dqin[2 * i], gq1 = dqin[2 * i + 1];
            const float gk0 = dks[2 * i], gk1 = dks[2 * i + 1];
            // Transposed rotation of the incoming gradients, plus the q.k term.
            const float dq0 = gq0 * c + gq1 * sn + w * k0;
            const float dq1 = -gq0 * sn + gq1 * c + w * k1;
            const float dk0 = gk0 * c + gk1 * sn + w * q0;
            const float dk1 = -gk0 * sn + gk1 * c + w * q1;
            dq_pre[2 * i] = dq0;
            dq_pre[2 * i + 1] = dq1;
            dk_pre[2 * i] = dk0;
            dk_pre[2 * i + 1] = dk1;
            // d rot(x, theta) / d theta = (-x0 sin - x1 cos, x0 cos - x1 sin).
            const float from_q = gq0 * (-q0 * sn - q1 * c) + gq1 * (q0 * c - q1 * sn);
            const float from_k = gk0 * (-k0 * sn - k1 * c) + gk1 * (k0 * c - k1 * sn);
            dtheta[i] = from_q + from_k;
          }
          for (int64_t n = 2 * A; n < N; ++n) {
            dq_pre[n] = dqin[n] + w * kb[n];
            dk_pre[n] = dks[n] + w * qb[n];
          }
          float* bq = pq + h * N;
          float* bk = pk + h * N;
          float* bq_err = pq_err + h * N;
          float* bk_err = pk_err + h * N;
          for (int64_t n = 0; n < N; ++n) {
            dq_acc[n] += dq_pre[n];  // the heads of a q/k group add up (GQA)
            dk_acc[n] += dk_pre[n];
            compensated_add(bq[n], bq_err[n], dq_pre[n]);
            compensated_add(bk[n], bk_err[n], dk_pre[n]);
          }
          store_row(p.dangles, p.dangles.offset(b, s, h, 0), p.dangles.strides[3], A, dtheta);
        }
        store_row(p.dq, p.dq.offset(b, s, g, 0), p.dq.strides[3], N, dq_acc);
        store_row(p.dk, p.dk.offset(b, s, g, 0), p.dk.strides[3], N, dk_acc);
      }
    }
  });

  // Reduce the bias partials in item order (fixed), still compensated, then write [H,N] f32.
  std::vector<float> sum_q(static_cast<size_t>(H * N), 0.f), sum_k(static_cast<size_t>(H * N), 0.f);
  std::vector<float> err_q(static_cast<size_t>(H * N), 0.f), err_k(static_cast<size_t>(H * N), 0.f);
  for (int64_t item = 0; item < n_items; ++item) {
    const size_t o = static_cast<size_t>(item * H * N);
    for (size_t j = 0; j < static_cast<size_t>(H * N); ++j) {
      compensated_add(sum_q[j], err_q[j], part_q[o + j]);
      compensated_add(sum_q[j], err_q[j], part_q_err[o + j]);
      compensated_add(sum_k[j], err_k[j], part_k[o + j]);
      compensated_add(sum_k[j], err_k[j], part_k_err[o + j]);
    }
  }
  for (size_t j = 0; j < static_cast<size_t>(H * N); ++j) {
    sum_q[j] += err_q[j];
    sum_k[j] += err_k[j];
  }
  for (int64_t h = 0; h < H; ++h) {
    store_row(p.dq_bias, p.dq_bias.offset(h, 0), p.dq_bias.strides[1], N, &sum_q[h * N]);
    store_row(p.dk_bias, p.dk_bias.offset(h, 0), p.dk_bias.strides[1], N, &sum_k[h * N]);
  }
}

// ================================================================== compute_ddt_dtrap_dinput_states

void compute_ddt_dtrap_dinput_states(const DdtDtrapParams& p) {
  const int64_t H = p.H, N = p.N, P = p.P;
  const std::vector<Seq> seqs = sequences(p.varlen, p.cu_seqlens, p.S, p.nseq);
  const int64_t n_items = p.nseq * H;
  const bool parallel = p.B * H * p.S + (p.has_state ? p.nseq * H * P * N : 0) > kParallelThreshold;

  parallel_for(n_items, parallel, [&](int64_t item) {
    const int64_t i = item / H, h = item % H;
    const Seq& q = seqs[i];
    const int64_t b = q.b;

    auto sigmoid = [](float x) { return 1.f / (1.f + std::exp(-x)); };

    float dsc_prev = 0.f;  // dscale at t-1 of the same sequence; 0 at the sequence start
    for (int64_t t = q.begin; t < q.end; ++t) {
      const float dsc = load_at(p.dscale, p.dscale.offset(b, h, t));
      const float dgm = load_at(p.dgamma, p.dgamma.offset(b, h, t));
      const float dt = load_at(p.dt, p.dt.offset(b, h, t));
      const float tr = load_at(p.trap, p.trap.offset(b, h, t));
      const float lam = sigmoid(tr), oml = 1.f - lam;
      const float cur = dgm + dsc;  // coefficient of gamma_t = dt_t * lam_t
      const float ddt = cur * lam + dsc_prev * oml;
      const float dtrap = (cur - dsc_prev) * dt * lam * oml;  // dlam/dtrap = lam (1 - lam)
      store_at(p.ddt, p.ddt.offset(b, h, t), ddt);
      store_at(p.dtrap, p.dtrap.offset(b, h, t), dtrap);
      dsc_prev = dsc;
    }

    if (!p.has_state) return;

    // issm_mid = issm + scalar * outer(v_state, k_state), scalar = dt0 * (1 - lam0).
    const int64_t t0 = q.begin;
    const float dt0 = load_at(p.dt, p.dt.offset(b, h, t0));
    const float tr0 = load_at(p.trap, p.trap.offset(b, h, t0));
    const float lam0 = sigmoid(tr0), oml0 = 1.f - lam0;
    const float scalar = dt0 * oml0;

    std::vector<float> kst(static_cast<size_t>(N)), vst(static_cast<size_t>(P));
    std::vector<float> row(static_cast<size_t>(N)), dk(static_cast<size_t>(N), 0.f);
    std::vector<float> dv(static_cast<size_t>(P));
    load_row(p.input_k_state, p.input_k_state.offset(i, h, 0), p.input_k_state.strides[2], N,
             kst.data());
    load_row(p.input_v_state, p.input_v_state.offset(i, h, 0), p.input_v_state.strides[2], P,
             vst.data());

    const TensorView& src = p.d_issm_state;
    const TensorView& dst = p.d_input_ssm_state;
    const int esize = dtype_size(src.dtype);  // same dtype: copy bits, exactly
    float dscalar = 0.f;
    for (int64_t pp = 0; pp < P; ++pp) {
      load_row(src, src.offset(i, h, pp, 0), src.strides[3], N, row.data());
      for (int64_t n = 0; n < N; ++n)
        std::memcpy(static_cast<char*>(dst.data) + dst.offset(i, h, pp, n) * esize,
                    static_cast<const char*>(src.data) + src.offset(i, h, pp, n) * esize,
                    static_cast<size_t>(esize));
      float rk = 0.f;
      for (int64_t n = 0; n < N; ++n) {
        rk += row[n] * kst[n];
        dk[n] += row[n] * vst[pp];
      }
      dv[pp] = rk * scalar;
      dscalar += rk * vst[pp];
    }
    for (int64_t n = 0; n < N; ++n) dk[n] *= scalar;
    store_row(p.d_input_v_state, p.d_input_v_state.offset(i, h, 0), p.d_input_v_state.strides[2],
              P, dv.data());
    store_row(p.d_input_k_state, p.d_input_k_state.offset(i, h, 0), p.d_input_k_state.strides[2],
              N, dk.data());

    // dscalar flows into dt0 and trap0 through scalar = dt0 * (1 - sigmoid(trap0)).
    const int64_t o_ddt = p.ddt.offset(b, h, t0), o_dtrap = p.dtrap.offset(b, h, t0);
    store_at(p.ddt, o_ddt, load_at(p.ddt, o_ddt) + dscalar * oml0);
    store_at(p.dtrap, o_dtrap, load_at(p.dtrap, o_dtrap) + dscalar * (-dt0) * lam0 * oml0);
  });
}

}  // namespace mamba3::cpu
