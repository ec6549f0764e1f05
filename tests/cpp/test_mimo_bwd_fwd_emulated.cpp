// The lean bf16 kernels of mamba3_mimo_bwd_fwd (src/cuda/mimo_bwd_fwd_lean.cuh: tensor-core
// products on pre-split bf16 operands) run on the host: the launch sequence of
// src/cuda/mimo_bwd_fwd.cu (lean K1 local scan and K2 segment states when the plan has several
// segments, lean K3 chunk pass, K5 deferred epilogue if planned, K4 partial reduction) through the
// CTA emulator of cta_emulator.hpp (NT std::threads per CTA, a rendezvous per warp for ldmatrix /
// mma.sync, CTAs one after another). So index math, barriers, the fragment bookkeeping of the
// tile products, the register state across chunks and segments, tails and the workspace layout
// are checked on machines without a GPU, at both thread counts of the lean kernels (256, 512:
// the plan's lean_nt) and with one and two state tiles per warp.
// The workspace and every CTA's shared memory are NaN-filled (a read before a write shows up as
// NaN), outputs are poisoned, segsum / da_cs_rev entries the operator must not read are NaN.
// Reference: the CPU backend through the C API on the same operands (itself checked against the
// float64 golden in test_mimo_bwd_fwd_cpu.cpp); the real kernels are checked against the golden
// on the GPU in test_mimo_bwd_fwd_cuda.cpp.
//
// Only in CUDA builds: the bodies use the CUDA headers' fp16 / bf16 conversions.
#ifdef MAMBA3_GOLDEN_CUDA

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "core/mimo_bwd_params.hpp"
#include "cta_emulator.hpp"
#include "cuda/mimo_bwd_fwd_kernels.cuh"
#include "cuda/mimo_bwd_fwd_lean.cuh"
#include "cuda/mimo_bwd_fwd_lean_specialized.cuh"
#include "host_operands.hpp"
#include "mamba3/mamba3.h"
#include "mamba3_golden/host.hpp"

namespace {

using namespace mamba3::golden;
namespace mimo = mamba3::cuda::mimo;
namespace emu = mamba3::test::emu;

// ------------------------------------------------------------------ the launch sequence

using Body = void (*)(const mimo::MbArgs&, float*);

template <int NT, int ST>
void k1_lean(const mimo::MbArgs& a, float* sm) {
  mimo::k1_lean_body<NT, ST>(a, sm);
}
template <int NT, int ST>
void k3_lean(const mimo::MbArgs& a, float* sm) {
  mimo::k3_lean_body<NT, ST>(a, sm);
}

// The instantiation per (thread count, state tiles per warp), as lean_k1 / lean_k3 of the .cu.
template <int NT>
Body lean_nt(bool k1, int st) {
  switch (st) {
    case 1: return k1 ? k1_lean<NT, 1> : k3_lean<NT, 1>;
    case 2: return k1 ? k1_lean<NT, 2> : k3_lean<NT, 2>;
    case 4: return k1 ? k1_lean<NT, 4> : k3_lean<NT, 4>;
    default: return k1 ? k1_lean<NT, 8> : k3_lean<NT, 8>;
  }
}
Body lean_body(bool k1, int nt, int st) {
  return nt == 256 ? lean_nt<256>(k1, st) : lean_nt<512>(k1, st);
}

// K3 (K1 if K1) specialised to shape (N, P, R, C) and the benchmark's contiguous layouts
// (MbArgsCT<.., true>, as mimo_bwd_fwd_specialized_{c,d}.cu's kernels), at the plan's NT, ST.
template <bool K1, int N, int P, int R, int C>
void lean_ct_layout(const mimo::MbArgs& a, float* sm) {
  constexpr int NT = mimo::lean_nt_rule(N), ST = mimo::lean_state_tiles(N, P, NT);
  mimo::MbArgsCT<N, P, R, C, true> c;
  c.set(a);
  if constexpr (K1) mimo::k1_lean_body<NT, ST>(c, sm);
  else mimo::k3_lean_body<NT, ST>(c, sm);
}
// The shapes the bits test runs (nullptr for any other).
Body lean_body_ct_layout(bool k1, const mimo::MbArgs& a) {
  if (a.N == 128 && a.P == 64 && a.R == 4 && a.C == 16)
    return k1 ? lean_ct_layout<true, 128, 64, 4, 16> : lean_ct_layout<false, 128, 64, 4, 16>;
  if (a.N == 16 && a.P == 64 && a.R == 4 && a.C == 8)
    return k1 ? lean_ct_layout<true, 16, 64, 4, 8> : lean_ct_layout<false, 16, 64, 4, 8>;
  if (a.N == 128 && a.P == 64 && a.R == 1 && a.C == 64)
    return k1 ? lean_ct_layout<true, 128, 64, 1, 64> : lean_ct_layout<false, 128, 64, 1, 64>;
  return nullptr;
}

const float kNaN = std::numeric_limits<float>::quiet_NaN();

// One launch of a body with `bytes` of dynamic shared memory, NaN-filled before every CTA.
void launch_smem(int64_t grid, int nt, size_t bytes, Body body, const mimo::MbArgs& a) {
  std::vector<float> sm(bytes / sizeof(float) + 1, kNaN);
  emu::launch(
      grid, nt, [&] { body(a, sm.data()); },
      [&](int64_t) { std::fill(sm.begin(), sm.end(), kNaN); });
}

// Runs the kernels exactly as src/cuda/mimo_bwd_fwd.cu's mimo_bwd_fwd launches them (lean path).
// ct_layout: K1 and K3 are the copies specialised to the shape and the contiguous layouts (which
// must apply: lean_ct_layout_ok and a compiled shape at the plan's thread count and state tiles).
void emulate(const mamba3::MimoBwdFwdParams& p, const mimo::MbPlan& pl, bool ct_layout = false) {
  std::vector<float> ws(pl.ws_total / sizeof(float) + 1, kNaN);
  mimo::MbArgs a{};
  mimo::mb_set_tensors(p, &a);
  mimo::apply_plan(mimo::mb_problem(p), pl, ws.data(), &a);
  // The carved regions stay inside the workspace.
  const uintptr_t end = reinterpret_cast<uintptr_t>(ws.data()) + pl.ws_total;
  for (const float* r : {a.ws_local, a.ws_dec, a.ws_enter, a.ws_part, a.ws_y})
    if (r) ASSERT_LE(reinterpret_cast<uintptr_t>(r), end);
  if (pl.ws_y) {
    ASSERT_LE(reinterpret_cast<uintptr_t>(a.ws_y) + pl.ws_y, end);
  } else {
    ASSERT_LE(reinterpret_cast<uintptr_t>(a.ws_part) + pl.ws_part, end);
  }

  const int64_t BH = p.B * p.H;
  const Body k1 = ct_layout ? lean_body_ct_layout(true, a) : lean_body(true, pl.nt, pl.lean);
  if (pl.nseg > 1) {
    ASSERT_NE(k1, nullptr);
    launch_smem(BH * pl.npt * pl.nsub, pl.nt, pl.smem1, k1, a);
    const int64_t per_bh = (p.N * p.P + mimo::kNT - 1) / mimo::kNT;
    emu::launch(BH * per_bh, mimo::kNT, [&] { mimo::k2_body(a); });
  }
  Body k3 = lean_body(false, pl.nt, pl.lean);
  if (ct_layout) {
    ASSERT_TRUE(mimo::lean_ct_layout_ok(a)) << "operands outside the contiguous-layout K3";
    k3 = lean_body_ct_layout(false, a);
    ASSERT_NE(k3, nullptr) << "no contiguous-layout K3 in this test for the shape";
    ASSERT_EQ(pl.nt, mimo::lean_nt_rule(p.N));
    ASSERT_EQ(pl.lean, mimo::lean_state_tiles(p.N, p.P, pl.nt));
  }
  launch_smem(BH * pl.npt * pl.nseg, pl.nt, pl.smem3, k3, a);
  if (pl.defer_epi)
    launch_smem(BH * pl.nseg, mimo::kNT, pl.smem5,
                [](const mimo::MbArgs& args, float* sm) { mimo::k5_body(args, sm); }, a);
  if (p.reduce_o || p.has_z) {
    const int64_t n = BH * p.R * p.P;
    emu::launch((n + mimo::kNT - 1) / mimo::kNT, mimo::kNT, [&] { mimo::k4_body(a); });
  }
}

// ------------------------------------------------------------------ operands

using mamba3::test::rand_buf;
using mamba3::test::view_of;

struct Shape {
  int64_t B, S, H, G, N, P, R, C, rdd;
  bool reduce_o, z, d, norm;
  int64_t pad;
  IoType decay, out;
  int lean_nt;        // the plan's preferred thread count (256 or 512)
  int sms = 132;      // the device's SM count (the segment plan depends on it)
  int want_st = 0;    // expected state tiles per warp (0: any)
  bool want_segments = false;  // expect nseg > 1 (K1 and K2 run)
  int want_defer = -1;         // expect the epilogue's exchange deferred (1) or not (0)
  // The benchmark's operands (bf16 trap, the other decays fp32 with decay = F32): also run K3's
  // contiguous-layout copy (MbArgsCT<.., true>) and require its outputs bitwise equal to the
  // generic kernel's.
  bool ct_bits = false;
};

std::string describe(const Shape& s) {
  char buf[256];
  std::snprintf(buf, sizeof buf,
                "B%lld S%lld H%lld G%lld N%lld P%lld R%lld C%lld rdd%lld%s%s%s%s pad%lld "
                "decay=%s out=%s nt=%d sms=%d",
                static_cast<long long>(s.B), static_cast<long long>(s.S),
                static_cast<long long>(s.H), static_cast<long long>(s.G),
                static_cast<long long>(s.N), static_cast<long long>(s.P),
                static_cast<long long>(s.R), static_cast<long long>(s.C),
                static_cast<long long>(s.rdd), s.reduce_o ? " reduce-O" : " per-rank",
                s.z ? " z" : "", s.d ? " D" : "", s.norm ? " norm" : "",
                static_cast<long long>(s.pad), io_name(s.decay), io_name(s.out), s.lean_nt, s.sms);
  return buf;
}

const char* kNames[] = {"states", "qk_dot", "dmimo_o", "dmimo_z", "dz", "dnorm_weight",
                        "dout_pre_rms"};

// bf16 spacing at |x| (normal range).
double bf16_ulp(double x) {
  const double ax = std::max(std::fabs(x), std::ldexp(1.0, -126));
  return std::ldexp(1.0, std::ilogb(ax) - 7);
}

void check_case(const Shape& s, uint64_t seed) {
  SCOPED_TRACE(describe(s));
  const auto t_start = std::chrono::steady_clock::now();
  const int64_t B = s.B, S = s.S, H = s.H, G = s.G, N = s.N, P = s.P, R = s.R, C = s.C;
  const int64_t A = N / s.rdd, nch = (S + C - 1) / C;
  const IoType F = IoType::F32, BF = IoType::BF16;
  std::mt19937_64 rng(seed);
  // Inputs in the C API's order; absent optionals stay empty.
  std::vector<Buffer> in;
  in.push_back(s.reduce_o ? rand_buf(rng, BF, {B, S, H, P}, -1, 1, s.pad)
                          : rand_buf(rng, BF, {B, S, R, H, P}, -1, 1, s.pad));  // dout
  in.push_back(rand_buf(rng, BF, {B, S, R, G, N}, -1, 1, s.pad));               // q
  in.push_back(rand_buf(rng, BF, {B, S, R, G, N}, -1, 1, s.pad));               // k
  in.push_back(rand_buf(rng, BF, {B, S, H, P}, -1, 1, s.pad));                  // v
  in.push_back(rand_buf(rng, F, {H, R, N}, -0.5, 0.5, s.pad));                  // q_bias
  in.push_back(rand_buf(rng, F, {H, R, N}, -0.5, 0.5, s.pad));                  // k_bias
  in.push_back(rand_buf(rng, F, {H, R, P}, -1, 1, s.pad));                      // mimo_v
  in.push_back(s.reduce_o ? rand_buf(rng, F, {H, R, P}, -1, 1, s.pad) : Buffer());  // mimo_o
  in.push_back(rand_buf(rng, s.decay, {B, S, H, A}, -3, 3, s.pad));             // angles
  // Decays consistent with one adt <= 0 (as the forward would produce them), rounded to their
  // dtype; NaN where the operator must not read (segsum on and above the diagonal, and a
  // partial last chunk's segsum and da_cs_rev).
  Buffer dt = rand_buf(rng, s.decay, {B, H, S}, 0.05, 0.6, 0);
  std::vector<double> dacs(B * H * S), rev(B * H * S), seg(B * H * nch * C * C);
  {
    const std::vector<double> dtv = dt.to_double();
    const double nan = std::numeric_limits<double>::quiet_NaN();
    const bool partial = S % C != 0;
    std::uniform_real_distribution<double> ua(0.1, 1.5);
    std::vector<double> adt(B * H * S);
    for (int64_t i = 0; i < B * H * S; ++i) adt[i] = -ua(rng) * dtv[i];
    for (int64_t bh = 0; bh < B * H; ++bh)
      for (int64_t c = 0; c < nch; ++c) {
        const int64_t s0 = c * C, L = std::min(C, S - s0);
        const bool tail = partial && c == nch - 1;
        double run = 0;
        for (int64_t i = 0; i < L; ++i) dacs[bh * S + s0 + i] = run += adt[bh * S + s0 + i];
        for (int64_t i = 0; i < L; ++i)
          rev[bh * S + s0 + i] = tail ? nan : round_to(run - dacs[bh * S + s0 + i], s.decay);
        for (int64_t i = 0; i < C; ++i)
          for (int64_t j = 0; j < C; ++j) {
            double v = nan;
            if (j < i && i < L && !tail) {
              double sum = 0;  // over (j, i]
              for (int64_t u = j + 1; u <= i; ++u) sum += adt[bh * S + s0 + u];
              v = round_to(sum, s.decay);
            }
            seg[((bh * nch + c) * C + i) * C + j] = v;
          }
      }
    for (double& x : dacs) x = round_to(x, s.decay);
  }
  auto from = [&](std::vector<int64_t> shape, const std::vector<double>& v) {
    Buffer b = Buffer::from_double(s.decay, std::move(shape), v);
    return s.pad > 0 ? b.padded(s.pad) : b;
  };
  in.push_back(from({B, H, S}, dacs));                                          // da_cs
  in.push_back(from({B, H, S}, rev));                                           // da_cs_rev
  in.push_back(s.pad > 0 ? dt.padded(s.pad) : dt);                              // dt
  in.push_back(rand_buf(rng, s.ct_bits ? BF : s.decay, {B, H, S}, -2, 2, s.pad));  // trap
  in.push_back(from({B, H, nch, C, C}, seg));                                   // segsum
  in.push_back(s.z ? rand_buf(rng, F, {H, R, P}, -1.5, 1.5, s.pad) : Buffer());  // mimo_z
  in.push_back(s.d ? rand_buf(rng, F, {H}, -1, 1, s.pad) : Buffer());           // d
  in.push_back(s.z ? rand_buf(rng, BF, {B, S, H, P}, -2, 2, s.pad) : Buffer());  // z
  in.push_back(s.norm ? rand_buf(rng, F, {H, P}, 0.5, 1.5, s.pad) : Buffer());  // norm_weight
  const double eps = 1e-5;

  auto outputs = [&] {  // poisoned (NaN)
    std::vector<Buffer> out;
    out.emplace_back(s.out, std::vector<int64_t>{B, H, nch, N, P});                      // states
    out.emplace_back(s.out, std::vector<int64_t>{B, H, S, R, R});                        // qk_dot
    out.push_back(s.reduce_o ? Buffer(F, {B, H, R, P}) : Buffer());                      // dmimo_o
    out.push_back(s.z ? Buffer(F, {B, H, R, P}) : Buffer());                             // dmimo_z
    out.push_back(s.z ? Buffer(s.out, {B, S, H, P}) : Buffer());                         // dz
    out.push_back(s.norm ? Buffer(F, {B, H, R, P}) : Buffer());                          // dnorm_w
    out.push_back(s.norm ? Buffer(s.out, {B, H, S * R, P}) : Buffer());                  // dout_pre
    return out;
  };

  // Reference: the CPU backend.
  std::vector<DLTensor*> ci;
  for (Buffer& b : in) ci.push_back(b.shape.empty() ? nullptr : b.tensor());
  std::vector<Buffer> ref = outputs();
  {
    std::vector<DLTensor*> co;
    for (Buffer& b : ref) co.push_back(b.shape.empty() ? nullptr : b.tensor());
    ASSERT_EQ(mamba3_mimo_bwd_fwd(ci[0], ci[1], ci[2], ci[3], ci[4], ci[5], ci[6], ci[7], ci[8],
                                  ci[9], ci[10], ci[11], ci[12], ci[13], ci[14], ci[15], ci[16],
                                  ci[17], eps, C, s.rdd, co[0], co[1], co[2], co[3], co[4], co[5],
                                  co[6], nullptr, 0, nullptr),
              MAMBA3_OK)
        << mamba3_last_error();
  }

  // The checked params the C API would build (make_mimo_bwd_fwd_params is internal to the
  // library; the CPU call above validated the same operands).
  std::vector<Buffer> got = outputs();
  mamba3::MimoBwdFwdParams p;
  p.B = B, p.S = S, p.H = H, p.G = G, p.N = N, p.P = P, p.R = R, p.C = C, p.nchunks = nch;
  p.rotary_dim_divisor = s.rdd, p.A = A;
  p.reduce_o = s.reduce_o, p.has_z = s.z, p.has_d = s.d, p.has_norm = s.norm, p.norm_eps = eps;
  p.output_dtype = s.out == F ? mamba3::DType::F32 : mamba3::DType::BF16;
  p.device = mamba3::DeviceKind::CPU;
  mamba3::TensorView* ins[] = {&p.dout,   &p.q,      &p.k,      &p.v,         &p.q_bias,
                               &p.k_bias, &p.mimo_v, &p.mimo_o, &p.angles,    &p.da_cs,
                               &p.da_cs_rev, &p.dt,  &p.trap,   &p.segsum,    &p.mimo_z,
                               &p.d,      &p.z,      &p.norm_weight};
  mamba3::TensorView* outs[] = {&p.states, &p.qk_dot,       &p.dmimo_o,     &p.dmimo_z,
                                &p.dz,     &p.dnorm_weight, &p.dout_pre_rms};
  for (size_t i = 0; i < in.size(); ++i) *ins[i] = view_of(in[i]);
  for (size_t i = 0; i < got.size(); ++i) *outs[i] = view_of(got[i]);

  // The plan must take the lean path at the requested thread count.
  mimo::MbDevice dev;
  dev.sms = s.sms;
  const mimo::MbPlan pl = mimo::make_mimo_plan(mimo::mb_problem(p), dev, s.lean_nt);
  ASSERT_TRUE(pl.ok);
  ASSERT_GT(pl.lean, 0) << "the plan does not take the lean path";
  ASSERT_EQ(pl.nt, s.lean_nt);
  ASSERT_EQ(pl.defer_epi, 0);
  if (s.want_st) EXPECT_EQ(pl.lean, s.want_st) << "state tiles per warp";
  if (s.want_segments) EXPECT_GT(pl.nseg, 1) << "segments";
  if (s.want_defer >= 0)
    EXPECT_EQ(pl.l3.ered == pl.l3.ScT, s.want_defer != 0) << "exchange deferred (Sc planes)";
  // Pair loads with even strides, loads of four elements with strides multiples of 4.
  EXPECT_EQ(mimo::mb_problem(p).lean_vec, s.pad % 2 == 0);
  EXPECT_EQ(mimo::mb_problem(p).lean_vec4, s.pad % 4 == 0);
  emulate(p, pl);
  if (s.ct_bits) {
    // The same operands through the contiguous-layout K1 and K3: every output byte equal.
    std::vector<Buffer> ct = outputs();
    for (size_t i = 0; i < ct.size(); ++i) *outs[i] = view_of(ct[i]);
    emulate(p, pl, true);
    for (size_t i = 0; i < got.size(); ++i) *outs[i] = view_of(got[i]);
    for (size_t k = 0; k < got.size(); ++k) {
      if (got[k].shape.empty()) continue;
      size_t diff = 0;
      for (size_t i = 0; i < got[k].bytes.size(); ++i) diff += got[k].bytes[i] != ct[k].bytes[i];
      EXPECT_EQ(diff, 0u) << kNames[k] << ": bytes differ between the generic and the "
                          << "contiguous-layout K1 / K3";
    }
  }

  // Against the CPU backend: bf16 outputs within bf16 rounding, fp32 outputs to the products'
  // ~2^-16 (hi + lo split operands).
  for (size_t k = 0; k < got.size(); ++k) {
    if (got[k].shape.empty()) continue;
    const std::vector<double> g = got[k].to_double(), r = ref[k].to_double();
    double num = 0, den = 0, maxd = 0, maxr = 0;
    for (size_t i = 0; i < g.size(); ++i) maxr = std::max(maxr, std::fabs(r[i]));
    size_t bad = 0, far = 0;
    double worst_ulps = 0;
    for (size_t i = 0; i < g.size(); ++i) {
      if (!std::isfinite(g[i])) {
        ++bad;
        continue;
      }
      const double d = std::fabs(g[i] - r[i]);
      num += d * d;
      den += r[i] * r[i];
      maxd = std::max(maxd, d);
      if (got[k].type == IoType::BF16) {
        // Both sides round an fp32 value to bf16: they may land one bf16 step apart (two near a
        // binade edge); more only where the value is a cancellation far below the tensor's scale.
        const double ulps = d / bf16_ulp(std::max(std::fabs(g[i]), std::fabs(r[i])));
        if (std::fabs(r[i]) > 1e-3 * maxr) worst_ulps = std::max(worst_ulps, ulps);
        if (d > 2 * bf16_ulp(std::max(std::fabs(g[i]), std::fabs(r[i]))) + 1e-4 * maxr) ++far;
      }
    }
    const double rel = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
    EXPECT_EQ(bad, 0u) << kNames[k] << ": non-finite elements (unwritten or NaN read)";
    if (got[k].type == IoType::BF16) {
      EXPECT_LE(rel, 1e-2) << kNames[k];
      EXPECT_EQ(far, 0u) << kNames[k] << ": elements more than 2 bf16 steps from the CPU backend's"
                         << " (worst " << worst_ulps << " steps)";
    } else {
      EXPECT_LE(rel, 1e-4) << kNames[k];
    }
    std::printf("  %-13s rel_l2 %.2e  max_abs %.2e (max |ref| %.2e)%s\n", kNames[k], rel, maxd,
                maxr,
                got[k].type == IoType::BF16
                    ? (" worst " + std::to_string(worst_ulps) + " bf16 steps").c_str()
                    : "");
  }
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
  std::printf("[ %s: nt %d, %d state tile(s)/warp, nseg %d (L3 %d, nsub %d), %.2f s ]\n",
              describe(s).c_str(), pl.nt, pl.lean, pl.nseg, pl.L3, pl.nsub, secs);
}

const IoType kF = IoType::F32, kBF = IoType::BF16;

// Reduce-O with the gate, the fused RMSNorm and D; a partial last chunk (20 = 2 x 8 + 4); C R =
// 16 rows; both thread counts (one state tile per warp).
TEST(MimoBwdFwdEmulated, GateNormPartialChunk) {
  for (int nt : {256, 512}) {
    Shape s{1, 20, 2, 1, 16, 16, 2, 8, 4, true, true, true, true, 0, kF, kBF, nt};
    s.want_st = 1;
    check_case(s, 11 + nt);
  }
}

// Per-rank dout with the gate (no norm, no D), GQA (G = 2 groups of one head), C R = 32 rows,
// N = 48 (the q / k tile builder's non-dividing thread split), padded inputs (odd strides: the
// 2-byte loads instead of pairs), bf16 decays (runtime-typed scalar loads), fp32 outputs.
TEST(MimoBwdFwdEmulated, PerRankDoutPaddedInputs) {
  Shape s{2, 16, 2, 2, 48, 16, 4, 8, 4, false, true, false, false, 1, kBF, kF, 512};
  check_case(s, 21);
}

// Inputs padded by two elements per row (even strides, not multiples of 4): the lean kernels'
// pair loads (MbArgs::lean_ld 1) instead of their 8-byte loads; rotary divisor 2 (every column
// pair rotates).
TEST(MimoBwdFwdEmulated, PairLoadsPaddedInputs) {
  Shape s{1, 24, 2, 1, 32, 16, 2, 8, 2, true, true, true, false, 2, kF, kBF, 512};
  check_case(s, 51);
}

// Several K3 segments: the lean K1 local scans from a zero state, K2's chaining into the states
// entering each segment, K3 from those states and K4 over the per-segment partials. A device
// with 4 SMs makes the plan take 4 segments of 2 chunks (6 sub-segments) at this small size;
// the last chunk is partial (60 = 7 x 8 + 4). On the H200 the plan cuts 5 chunks into 5
// segments (one chunk each), here with the gate and the norm over C R = 32 rows.
TEST(MimoBwdFwdEmulated, SegmentedScan) {
  Shape s{1, 60, 2, 1, 16, 32, 4, 8, 4, true, false, true, false, 0, kF, kF, 256};
  s.sms = 4, s.want_segments = true;
  check_case(s, 31);
  Shape h{1, 40, 2, 1, 32, 32, 4, 8, 4, true, true, true, true, 0, kF, kBF, 512};
  h.want_segments = true;
  check_case(h, 32);
}

// Two state tiles per warp (N = P = 64: 16 tiles over the 8 warps of 256 threads), with 512
// threads one; no gate and per-rank dout: K3 alone (no epilogue, no K4).
TEST(MimoBwdFwdEmulated, TwoStateTilesPerWarp) {
  for (int nt : {256, 512}) {
    Shape s{1, 13, 1, 1, 64, 64, 2, 8, 2, false, false, true, false, 0, kF, kBF, nt};
    s.want_st = nt == 256 ? 2 : 1;
    check_case(s, 41 + nt);
  }
}

// Reduce-O with the gate and no norm (the benchmark and training case, which the lean K3
// epilogue runs through its own compile-time copy) at every rank count the lean path takes
// (R = 1, 2, 4, 8: the copy's per-rank registers), both thread counts, a partial last chunk
// (37 = 4 x 8 + 5, 2 x 16 + 5), bf16 dz, and once fp32 dz (which takes the generic code).
TEST(MimoBwdFwdEmulated, GateNoNormRanks) {
  struct Rc {
    int64_t R, C;
    int nt;
    IoType out;
  };
  for (const Rc& rc : {Rc{1, 16, 256, kBF}, Rc{2, 8, 512, kBF}, Rc{4, 8, 256, kBF},
                       Rc{4, 16, 512, kF}, Rc{8, 8, 512, kBF}, Rc{8, 8, 256, kBF}}) {
    Shape s{1, 37, 2, 1, 16, 16, rc.R, rc.C, 4, true, true, true, false, 0, kF, rc.out, rc.nt};
    check_case(s, 61 + rc.R * 8 + rc.nt);
  }
}

// The benchmark shape's N, P, R, C (reduce-O, the gate, no norm, bf16 dz; 512 threads, two
// state tiles per warp) on a short sequence with a partial last chunk (37 = 2 x 16 + 5): the
// lean K3's deferred epilogue sums (lean_defer_sums: its Sc planes hold the exchange) and its
// early scalar and angle loads (C A = NT), in one segment of three chunks (a one-SM device)
// and in the plan's segments.
TEST(MimoBwdFwdEmulated, ReferenceShapeShortSequence) {
  for (int sms : {1, 132}) {
    Shape s{1, 37, 1, 1, 128, 64, 4, 16, 4, true, true, true, false, 0, kF, kBF, 512};
    s.sms = sms, s.want_st = 2;
    check_case(s, 71 + sms);
  }
}

// The epilogue's exchange deferred to the next chunk's first barrier (its partials in the Sc
// planes, enlarged where those are smaller: C R = 32 at 256 threads, R = 8 without the norm)
// and not (R = 8 with the norm: three kinds of 8 x 512 partials do not fit beside the tiles in
// the H200's shared memory); a partial last chunk (21 = 2 x 8 + 5), one segment.
TEST(MimoBwdFwdEmulated, ExchangeDeferredOrNot) {
  struct Dc {
    int64_t N, P, R, C;
    bool norm;
    int nt, defer;
  };
  for (const Dc& d : {Dc{16, 64, 4, 8, false, 256, 1}, Dc{128, 64, 8, 8, false, 512, 1},
                      Dc{128, 64, 8, 8, true, 512, 0}}) {
    Shape s{1, 21, 1, 1, d.N, d.P, d.R, d.C, 4, true, true, true, d.norm, 0, kF, kBF, d.nt};
    s.sms = 1, s.want_defer = d.defer;
    check_case(s, 81 + d.R + d.norm);
  }
}

// The lean K3 and K1 specialised to the benchmark's contiguous layouts and dtypes (MbArgsCT<.., true>:
// bf16 q, k, v, z, dout and outputs, fp32 angles, segsum, da_cs, dt, bf16 trap; reduce-O with the
// gate and D, no norm) gives the generic kernel's bits, at the benchmark's N128 P64 R4 C16 (in
// one segment and in the plan's segments) and at a C = 8 shape (N16 P64 R4 C8, 256 threads),
// with a partial last chunk. The GPU check: MimoBwdFwdCuda.SpecializedKernelsGiveIdenticalBits.
TEST(MimoBwdFwdEmulated, ContiguousLayoutKernelsGiveIdenticalBits) {
  for (int sms : {1, 132}) {
    Shape s{1, 37, 1, 1, 128, 64, 4, 16, 4, true, true, true, false, 0, kF, kBF, 512};
    s.sms = sms, s.want_st = 2, s.ct_bits = true;
    s.want_segments = sms > 1;  // K1 runs
    check_case(s, 91 + sms);
  }
  Shape c8{1, 21, 2, 1, 16, 64, 4, 8, 4, true, true, true, false, 0, kF, kBF, 256};
  c8.ct_bits = true;
  check_case(c8, 95);
  // N128 P64 R1 C64 (specialised since session 16): a whole chunk and a partial one.
  Shape r1{1, 100, 1, 1, 128, 64, 1, 64, 4, true, true, true, false, 0, kF, kBF, 512};
  r1.want_st = 2, r1.ct_bits = true;
  check_case(r1, 97);
}

}  // namespace

#endif  // MAMBA3_GOLDEN_CUDA
