// CPU backend of mamba3_mimo_bwd_combined (upstream's mamba_mimo_bwd_combined): the first pass,
// the second pass on the first pass's intermediates (kept here in float32 scratch), and the
// reductions to the gradients of the raw inputs (formulas: golden/include/mamba3_golden/
// mimo_bwd_bwd.hpp, mimo_bwd_combined). The gate reaches the second pass as a gated per-rank
// dout, the fused norm as the first pass's packed pre-RMS dout. Every reduction runs in a fixed
// order (sums over batch and sequence compensated), so results are deterministic. With the norm
// and D, dD comes from the first pass in float64 (norm_dd_f64 in mimo_bwd_fwd.cpp): in float32
// it is ill-conditioned (docs/ACCURACY.md).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <vector>

#include "cpu/io.hpp"
#include "cpu/mimo_bwd.hpp"

namespace mamba3::cpu {
namespace {

// A compact float32 CPU view of `buf` (resized and zeroed) with the given shape.
TensorView scratch(std::vector<float>& buf, std::initializer_list<int64_t> shape,
                   const char* name) {
  int64_t n = 1;
  for (int64_t x : shape) n *= x;
  buf.assign(static_cast<size_t>(n), 0.f);
  return compact_f32_view(buf.data(), shape, name, DeviceKind::CPU);
}

inline float sigmoidf(float x) { return 1.f / (1.f + std::exp(-x)); }

}  // namespace

void mimo_bwd_combined(const MimoCombinedParams& cp) {
  MimoBwdFwdParams f = cp.fwd;
  const int64_t B = f.B, S = f.S, H = f.H, G = f.G, N = f.N, P = f.P, R = f.R, C = f.C;
  const int64_t nch = f.nchunks;

  // ---- first pass, into scratch (dz straight into the caller's output)
  std::vector<float> states, qk, dmo, dmz, dnw, dpre, ndd;
  f.states = scratch(states, {B, H, nch, N, P}, "states");
  f.qk_dot = scratch(qk, {B, H, S, R, R}, "qk_dot");
  if (f.reduce_o) f.dmimo_o = scratch(dmo, {B, H, R, P}, "dmimo_o");
  if (f.has_z) {
    f.dmimo_z = scratch(dmz, {B, H, R, P}, "dmimo_z");
    f.dz = cp.dz;
  }
  if (f.has_norm) {
    f.dnorm_weight = scratch(dnw, {B, H, R, P}, "dnorm_weight");
    f.dout_pre_rms = scratch(dpre, {B, H, S * R, P}, "dout_pre_rms");
    // dD from the first pass, in float64 (hi, lo): the second pass's float32 sum of
    // dout_pre_rms . x cancels (docs/ACCURACY.md, the fused norm's dD).
    if (f.has_d) f.norm_dd = scratch(ndd, {B, H, 2}, "norm_dd");
  }
  f.output_dtype = DType::F32;
  mimo_bwd_fwd(f);

  // ---- second pass
  MimoBwdBwdParams b;
  b.B = B, b.S = S, b.H = H, b.G = G, b.N = N, b.P = P, b.R = R, b.C = C, b.nchunks = nch;
  b.rotary_dim_divisor = f.rotary_dim_divisor, b.A = f.A, b.has_d = f.has_d;
  b.device = DeviceKind::CPU;
  b.q = f.q, b.k = f.k, b.v = f.v, b.q_bias = f.q_bias, b.k_bias = f.k_bias, b.mimo_v = f.mimo_v;
  b.states = f.states, b.qk_dot = f.qk_dot, b.da_cs = f.da_cs, b.da_cs_rev = f.da_cs_rev;
  b.dt = f.dt, b.trap = f.trap, b.segsum = f.segsum, b.angles = f.angles, b.d = f.d;
  std::vector<float> gated;
  if (f.has_norm) {  // dL/dy^r is the first pass's pre-RMS dout
    b.dout = f.dout_pre_rms;
    b.dout_layout = MimoDout::Packed;
  } else if (f.has_z) {  // the gate folded into a per-rank dout
    b.dout = scratch(gated, {B, S, R, H, P}, "dout");
    b.dout_layout = MimoDout::PerRank;
    std::vector<float> phi(R * P), zeta(R * P), drow(R * P), zrow(P);
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t r = 0; r < R; ++r) {
        load_row(f.mimo_z, f.mimo_z.offset(h, r, 0), f.mimo_z.strides[2], P, &zeta[r * P]);
        if (f.reduce_o)
          load_row(f.mimo_o, f.mimo_o.offset(h, r, 0), f.mimo_o.strides[2], P, &phi[r * P]);
      }
      for (int64_t bb = 0; bb < B; ++bb)
        for (int64_t t = 0; t < S; ++t) {
          load_row(f.z, f.z.offset(bb, t, h, 0), f.z.strides[3], P, zrow.data());
          if (f.reduce_o)
            load_row(f.dout, f.dout.offset(bb, t, h, 0), f.dout.strides[3], P, drow.data());
          for (int64_t r = 0; r < R; ++r) {
            float* dst = &gated[(((bb * S + t) * R + r) * H + h) * P];
            if (!f.reduce_o)
              load_row(f.dout,
                       f.dout.strides[0] * bb + f.dout.strides[1] * t + f.dout.strides[2] * r +
                           f.dout.strides[3] * h,
                       f.dout.strides[4], P, &drow[r * P]);
            for (int64_t p = 0; p < P; ++p) {
              const float u = zrow[p] * zeta[r * P + p];
              const float d = f.reduce_o ? drow[p] * phi[r * P + p] : drow[r * P + p];
              dst[p] = d * (u * sigmoidf(u));
            }
          }
        }
    }
  } else {
    b.dout = f.dout;
    b.mimo_o = f.mimo_o;
    b.dout_layout = f.reduce_o ? MimoDout::ReduceO : MimoDout::PerRank;
  }
  std::vector<float> dqh, dkh, dmv, dfac, dgam, dda, dssda, drev, dcs, dd;
  b.dq = scratch(dqh, {B, S * R, H, N}, "dq");
  b.dk = scratch(dkh, {B, S * R, H, N}, "dk");
  b.dv = cp.dv;
  b.dmimo_v = scratch(dmv, {B, H, R, P}, "dmimo_v");
  b.dangles = cp.dangles;
  b.dfactor = scratch(dfac, {B, H, S}, "dfactor");
  b.dgamma = scratch(dgam, {B, H, S}, "dgamma");
  b.dda = scratch(dda, {B, H, S}, "dda");
  b.dssda = scratch(dssda, {B, H, nch, C, C}, "dssda");
  b.dda_cs_rev = scratch(drev, {B, H, S}, "dda_cs_rev");
  b.dda_cs = scratch(dcs, {B, H, S}, "dda_cs");
  if (f.has_d) b.dd = scratch(dd, {B, H}, "dd");
  mimo_bwd_bwd(b);

  // ---- q / k: sum the heads of each group; the biases over batch and sequence.
  std::vector<float> row(std::max(N, P)), bsum(H * R * N), berr(H * R * N);
  for (int which = 0; which < 2; ++which) {
    const std::vector<float>& src = which ? dkh : dqh;
    const TensorView& out = which ? cp.dk : cp.dq;
    for (int64_t bb = 0; bb < B; ++bb)
      for (int64_t t = 0; t < S; ++t)
        for (int64_t r = 0; r < R; ++r)
          for (int64_t g = 0; g < G; ++g) {
            std::fill(row.begin(), row.begin() + N, 0.f);
            for (int64_t h = g * (H / G); h < (g + 1) * (H / G); ++h) {
              const float* s = &src[((bb * S * R + t * R + r) * H + h) * N];
              for (int64_t n = 0; n < N; ++n) row[n] += s[n];
            }
            store_row(
                out,
                out.strides[0] * bb + out.strides[1] * t + out.strides[2] * r + out.strides[3] * g,
                out.strides[4], N, row.data());
          }
    std::fill(bsum.begin(), bsum.end(), 0.f);
    std::fill(berr.begin(), berr.end(), 0.f);
    for (int64_t bb = 0; bb < B; ++bb)
      for (int64_t t = 0; t < S; ++t)
        for (int64_t r = 0; r < R; ++r)
          for (int64_t h = 0; h < H; ++h) {
            const float* s = &src[((bb * S * R + t * R + r) * H + h) * N];
            for (int64_t n = 0; n < N; ++n)
              compensated_add(bsum[(h * R + r) * N + n], berr[(h * R + r) * N + n], s[n]);
          }
    const TensorView& bias = which ? cp.dk_bias : cp.dq_bias;
    for (int64_t h = 0; h < H; ++h)
      for (int64_t r = 0; r < R; ++r) {
        for (int64_t n = 0; n < N; ++n)
          row[n] = bsum[(h * R + r) * N + n] + berr[(h * R + r) * N + n];
        store_row(bias, bias.offset(h, r, 0), bias.strides[2], N, row.data());
      }
  }

  // ---- per-batch parameter gradients summed over the batch (and over R for the norm weight)
  auto batch_sum_rp = [&](const std::vector<float>& src, const TensorView& out) {
    for (int64_t h = 0; h < H; ++h)
      for (int64_t r = 0; r < R; ++r) {
        for (int64_t p = 0; p < P; ++p) {
          float s = 0.f;
          for (int64_t bb = 0; bb < B; ++bb) s += src[((bb * H + h) * R + r) * P + p];
          row[p] = s;
        }
        store_row(out, out.offset(h, r, 0), out.strides[2], P, row.data());
      }
  };
  batch_sum_rp(dmv, cp.dmimo_v);
  if (f.reduce_o) batch_sum_rp(dmo, cp.dmimo_o);
  if (f.has_z) batch_sum_rp(dmz, cp.dmimo_z);
  if (f.has_d)
    for (int64_t h = 0; h < H; ++h) {
      float s = 0.f;
      if (f.has_norm) {  // the first pass's (the second pass's dd, a required output there, unused)
        double sd = 0;
        for (int64_t bb = 0; bb < B; ++bb)
          sd += static_cast<double>(ndd[(bb * H + h) * 2]) + ndd[(bb * H + h) * 2 + 1];
        s = static_cast<float>(sd);
      } else {
        for (int64_t bb = 0; bb < B; ++bb) s += dd[bb * H + h];
      }
      store_at(cp.dd, cp.dd.offset(h), s);
    }
  if (f.has_norm)
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t p = 0; p < P; ++p) {
        float s = 0.f;
        for (int64_t bb = 0; bb < B; ++bb)
          for (int64_t r = 0; r < R; ++r) s += dnw[((bb * H + h) * R + r) * P + p];
        row[p] = s;
      }
      store_row(cp.dnorm_weight, cp.dnorm_weight.offset(h, 0), cp.dnorm_weight.strides[1], P,
                row.data());
    }

  // ---- dt, trap (gamma_t = lam_t dt_t in DGAMMA and trap_scale_t; dt_t (1 - lam_t) in
  // trap_scale_{t-1}) and adt (the chunk sums behind da_cs, da_cs_rev, segsum and the decay).
  std::vector<float> E(C), F(C), Q(C * C), dadt(C);
  for (int64_t bb = 0; bb < B; ++bb)
    for (int64_t h = 0; h < H; ++h) {
      const int64_t bh = bb * H + h;
      for (int64_t t = 0; t < S; ++t) {
        const float dtv = load_at(f.dt, f.dt.offset(bb, h, t));
        const float lam = sigmoidf(load_at(f.trap, f.trap.offset(bb, h, t)));
        const float both = dgam[bh * S + t] + dfac[bh * S + t];
        const float prev = t > 0 ? dfac[bh * S + t - 1] : 0.f;
        store_at(cp.ddt, cp.ddt.offset(bb, h, t), lam * both + (1.f - lam) * prev);
        store_at(cp.dtrap, cp.dtrap.offset(bb, h, t), lam * (1.f - lam) * dtv * (both - prev));
      }
      for (int64_t c = 0; c < nch; ++c) {
        const int64_t s0 = c * C, L = std::min(C, S - s0);
        const bool partial = L < C;
        std::vector<float> dcsv(L);
        for (int64_t i = 0; i < L; ++i) dcsv[i] = load_at(f.da_cs, f.da_cs.offset(bb, h, s0 + i));
        for (int64_t i = 0; i < L; ++i) {
          E[i] = std::exp(dcsv[i]) * dcs[bh * S + s0 + i];
          F[i] = std::exp(partial ? dcsv[L - 1] - dcsv[i]
                                  : load_at(f.da_cs_rev, f.da_cs_rev.offset(bb, h, s0 + i))) *
                 drev[bh * S + s0 + i];
        }
        // Q[i][m] = sum_{j<m} W[i,j] DSSDA[j,i] (j < i): the segsum pairs (i, j) that contain m.
        for (int64_t i = 0; i < L; ++i) {
          float acc = 0.f;
          Q[i * C] = 0.f;
          for (int64_t m = 1; m <= i; ++m) {
            const int64_t j = m - 1;
            const float seg =
                partial ? dcsv[i] - dcsv[j]
                        : load_at(f.segsum, f.segsum.strides[0] * bb + f.segsum.strides[1] * h +
                                                f.segsum.strides[2] * c + f.segsum.strides[3] * i +
                                                f.segsum.strides[4] * j);
            acc += std::exp(seg) * dssda[((bh * nch + c) * C + j) * C + i];
            Q[i * C + m] = acc;
          }
        }
        float rev_cum = 0.f;  // sum_{t<m} F_t
        float cs_cum = 0.f;   // sum_{t>=m} E_t, filled backwards below
        for (int64_t m = L - 1; m >= 0; --m) {
          cs_cum += E[m];
          dadt[m] = cs_cum;
        }
        for (int64_t m = 0; m < L; ++m) {
          float seg_sum = 0.f;
          for (int64_t i = m; i < L; ++i) seg_sum += Q[i * C + m];
          dadt[m] += rev_cum + seg_sum + dda[bh * S + s0 + m];
          rev_cum += F[m];
          store_at(cp.dadt, cp.dadt.offset(bb, h, s0 + m), dadt[m]);
        }
      }
    }
}

}  // namespace mamba3::cpu
