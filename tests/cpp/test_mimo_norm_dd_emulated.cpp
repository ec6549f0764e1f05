// The float64 dD kernels of mamba3_mimo_bwd_combined with the fused norm
// (src/cuda/mimo_norm_dd_f64.cuh) run on the host, each CTA emulated by one std::thread per CUDA
// thread (cta_emulator.hpp), against the float64 golden's dD (golden mimo_bwd_combined<double>)
// on the same rounded inputs. Both are float64, so they must agree to the final float32 store:
// a wrong index, decay, tail rule or tile edge moves dD far more than that. The GPU runs the
// same bodies in test_mimo_bwd_combined_cuda.cpp (NormDdOnIllConditionedDraws).
//
// Only in CUDA builds: the bodies use the CUDA headers' fp16 / bf16 conversions.
#ifdef MAMBA3_GOLDEN_CUDA

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <vector>

#include "core/mimo_bwd_params.hpp"
#include "cta_emulator.hpp"
#include "cuda/mimo_norm_dd_f64.cuh"
#include "host_operands.hpp"  // view_of
#include "mamba3_golden/host.hpp"
#include "mamba3_golden/mimo.hpp"
#include "mamba3_golden/mimo_cases.hpp"
#include "mamba3_golden/mimo_bwd_bwd.hpp"

namespace mamba3::cuda::ndd {
int ndd_tid() { return test::emu::t_tid; }
int64_t ndd_bid() { return test::emu::t_bid; }
void ndd_sync() { test::emu::g_cta->bar.wait(); }

// The warp's float64 mma m8n8k4 (d += A B on its 8 x 8 tile): every lane deposits its A and B
// element (A[lane / 4][lane % 4], B[lane % 4][lane / 4]), the warp meets, and each lane sums
// its two elements D[lane / 4][2 (lane % 4) + e] over k in order, with fused multiply-adds.
void ndd_dmma884(double (&d)[2], double a, double b) {
  int s;
  test::emu::Warp& w = test::emu::collective_warp(s);
  const int l = test::emu::t_tid % 32, g = l / 4, q = l % 4;
  std::memcpy(&w.a[s][l][0], &a, sizeof a);
  std::memcpy(&w.b[s][l][0], &b, sizeof b);
  w.bar.wait();
  auto el = [&](const uint32_t* p) {
    double v;
    std::memcpy(&v, p, sizeof v);
    return v;
  };
  for (int e = 0; e < 2; ++e) {
    const int n = 2 * q + e;
    double acc = d[e];
    for (int k = 0; k < 4; ++k)
      acc = std::fma(el(&w.a[s][g * 4 + k][0]), el(&w.b[s][n * 4 + k][0]), acc);
    d[e] = acc;
  }
}
}  // namespace mamba3::cuda::ndd

namespace {

using namespace mamba3::golden;
namespace ndd = mamba3::cuda::ndd;
using mamba3::test::view_of;

struct NddCase {
  int64_t B, S, H, G, N, P, R, C, rdd;
  IoType act;
  int tile;  // 16, or 8 (the readout's tile where 16 rows would not fit)
  int64_t pad;
  uint64_t seed;
};

ndd::View nview(const mamba3::TensorView& t) {
  ndd::View v;
  v.p = static_cast<const unsigned char*>(t.data);
  v.dt = static_cast<int>(t.dtype);
  for (int i = 0; i < t.ndim && i < 5; ++i) v.s[i] = t.strides[i];
  return v;
}

// Runs the four kernels on the host (the whole-chunk kernels when `fast`) and returns dD [H];
// gold: the golden's.
void run_case(const NddCase& c, bool fast, bool spec, std::vector<float>& got,
              std::vector<double>& gold) {
  const int64_t B = c.B, S = c.S, H = c.H, G = c.G, N = c.N, P = c.P, R = c.R, C = c.C;
  const int64_t A = N / c.rdd, nch = (S + C - 1) / C;
  // The combined backward's inputs as its golden-checked cases draw them (NaN where the operator
  // must not read: segsum on and above the diagonal and in a partial last chunk, da_cs_rev there).
  MimoCombinedCase mc;
  mc.B = B, mc.S = S, mc.H = H, mc.G = G, mc.N = N, mc.P = P, mc.R = R, mc.chunk = C;
  mc.rdd = c.rdd, mc.act = c.act, mc.pad = c.pad;
  mc.z = mc.norm = mc.d = mc.reduce_o = true;
  std::mt19937_64 rng(c.seed);
  MimoFwdInputs in = make_mimo_fwd_inputs(mc, rng);
  gold = mimo_bwd_combined(in.gi).dd;
  const double nan = std::numeric_limits<double>::quiet_NaN();

  ndd::Args a;
  a.B = B, a.S = S, a.H = H, a.G = G, a.N = N, a.P = P, a.R = R, a.C = C, a.nch = nch, a.A = A;
  a.eps = 1e-5;
  a.tile = c.tile;
  a.fast = fast;
  a.q = nview(view_of(in.q)), a.k = nview(view_of(in.k)), a.q_bias = nview(view_of(in.qb));
  a.k_bias = nview(view_of(in.kb)), a.mimo_v = nview(view_of(in.mv));
  a.mimo_o = nview(view_of(in.mo)), a.mimo_z = nview(view_of(in.mz)), a.v = nview(view_of(in.v));
  a.dout = nview(view_of(in.dout)), a.z = nview(view_of(in.z));
  a.angles = nview(view_of(in.angles)), a.da_cs = nview(view_of(in.da_cs));
  a.da_cs_rev = nview(view_of(in.da_cs_rev)), a.dt = nview(view_of(in.dt));
  a.trap = nview(view_of(in.trap)), a.segsum = nview(view_of(in.segsum));
  a.d = nview(view_of(in.d));
  a.norm_weight = nview(view_of(in.nw));
  // NaN-filled workspace: a read before a write shows up in dD.
  std::vector<double> ws(B * H * nch * (N * P + 1), nan);
  a.states = ws.data();
  a.part = ws.data() + B * H * nch * N * P;
  got.assign(H, nan);
  a.dd = reinterpret_cast<unsigned char*>(got.data());
  a.dd_dt = 2;
  a.dd_s = 1;
  std::vector<unsigned char> smem(
      fast ? std::max(ndd::fast_increment_smem(a), ndd::fast_readout_smem(a))
           : std::max(ndd::increment_smem(a), ndd::readout_smem(a, a.tile)));
  const std::function<void(int64_t)> poison = [&](int64_t) {
    for (size_t i = 0; i + sizeof(double) <= smem.size(); i += sizeof(double))
      *reinterpret_cast<double*>(smem.data() + i) = nan;
  };
  namespace emu = mamba3::test::emu;
  // The whole-chunk kernels: the runtime-dtype bodies, or (spec) the compiled dtype
  // specialization the CUDA launcher picks for these tensors.
  auto inc_fast = [&] { ndd::increment_fast_body(a, smem.data()); };
  auto rd_fast = [&] { ndd::readout_fast_body(a, smem.data()); };
  std::function<void()> inc_spec, rd_spec;
  if (spec) {
    EXPECT_GE(ndd::fast_act_dtype(a), 0) << "no specialization takes these dtypes";
    ndd::with_act_dtype(a, [&](auto da) {
      constexpr int DA = decltype(da)::value, DP = ndd::par_dtype(DA);
      inc_spec = [&] { ndd::increment_fast_body<DA, DP>(a, smem.data()); };
      rd_spec = [&] { ndd::readout_fast_body<DA, DP>(a, smem.data()); };
    });
  }
  if (nch > 1 && fast)
    emu::launch(B * H * (nch - 1), ndd::kThreads,
                spec ? inc_spec : std::function<void()>(inc_fast), poison);
  if (nch > 1 && !fast)
    emu::launch(B * H * (nch - 1) * ndd::slabs(a), ndd::kThreads,
                [&] { ndd::increment_body(a, smem.data()); }, poison);
  emu::launch(B * H * ((N * P + ndd::kThreads - 1) / ndd::kThreads), ndd::kThreads,
              [&] { ndd::scan_body(a); });
  if (fast)
    emu::launch(B * H * nch, ndd::kThreads, spec ? rd_spec : std::function<void()>(rd_fast),
                poison);
  else
    emu::launch(B * H * nch, ndd::kThreads, [&] { ndd::readout_body(a, smem.data()); }, poison);
  emu::launch((H + ndd::kThreads - 1) / ndd::kThreads, ndd::kThreads, [&] { ndd::final_body(a); });
}

void check(const NddCase& c, bool fast, int n, bool spec = false) {
  std::vector<float> got;
  std::vector<double> gold;
  run_case(c, fast, spec, got, gold);
  for (int64_t h = 0; h < c.H; ++h) {
    const double err = std::fabs(static_cast<double>(got[h]) - gold[h]);
    // The float32 store of a float64 sum: half an ulp, and a little for the order of sums.
    EXPECT_LE(err, 7e-8 * std::fabs(gold[h]) + 1e-12)
        << (fast ? (spec ? "whole-chunk (dtype-specialized)" : "whole-chunk") : "generic")
        << " case " << n << " head " << h << ": " << got[h]
        << " against " << gold[h];
  }
}

const IoType BF = IoType::BF16, F16 = IoType::F16, F32 = IoType::F32;

// The generic kernels: whole and partial chunks, one chunk, GQA, every R (R 3: a step's ranks
// across two row tiles), P dividing 256 or not (P = 48: idle threads), several increment slabs
// (N P > 16 kThreads), 16- and 8-row readout tiles with partial tiles, padded rows, fp32 / bf16
// / fp16.
TEST(MimoNormDdEmulated, GenericKernelsMatchTheFloat64Golden) {
  const NddCase cases[] = {
      {2, 37, 2, 1, 16, 32, 2, 16, 4, BF, 16, 0, 11},   // partial last chunk
      {1, 40, 4, 2, 32, 16, 4, 8, 2, F32, 16, 2, 12},   // GQA, P 16, padded
      {1, 5, 1, 1, 16, 48, 1, 16, 4, F16, 16, 0, 13},   // one partial chunk, P 48
      {1, 24, 2, 1, 16, 64, 3, 8, 4, BF, 8, 0, 14},     // R 3: steps across tiles, 8-row tiles
      {1, 24, 2, 1, 16, 64, 3, 8, 4, BF, 16, 0, 17},    // R 3, 16-row tiles
      {1, 33, 1, 1, 64, 256, 1, 16, 2, BF, 16, 0, 15},  // several slabs (P 256: 16 n per slab)
      {1, 17, 1, 1, 16, 32, 8, 8, 4, F32, 16, 0, 16},   // R 8
  };
  int n = 0;
  for (const NddCase& c : cases) check(c, false, n++);
  std::printf("[ %d float64 dD cases, generic kernels ]\n", n);
}

// The whole-chunk kernels (fast_ok shapes; float64 mma tiles): partial chunks, GQA, R 1 .. 8
// and R 3 (a step's ranks across 8-row tiles), several U strips per warp, two Y strips per warp
// (P = 128), T = 64 with C = 64, padded rows.
TEST(MimoNormDdEmulated, WholeChunkKernelsMatchTheFloat64Golden) {
  const NddCase cases[] = {
      {2, 37, 2, 1, 16, 32, 2, 16, 4, BF, 16, 0, 21},   // partial last chunk
      {1, 40, 4, 2, 32, 16, 4, 8, 2, F32, 16, 2, 22},   // GQA, P 16, padded
      {1, 5, 1, 1, 16, 48, 1, 16, 4, F16, 16, 0, 23},   // one partial chunk, P 48
      {1, 24, 2, 1, 16, 32, 3, 8, 4, BF, 16, 0, 24},    // R 3
      {1, 20, 1, 1, 128, 64, 8, 8, 4, BF, 16, 0, 25},   // R 8, T 64, two U strips per warp
      {1, 70, 1, 1, 32, 128, 1, 64, 4, BF, 16, 0, 26},  // C 64, two Y blocks per thread
  };
  int n = 0;
  for (const NddCase& c : cases) {
    ndd::Args a;  // (the shape fields fast_ok reads)
    a.N = c.N, a.P = c.P, a.R = c.R, a.C = c.C;
    ASSERT_TRUE(ndd::fast_ok(a, 227 * 1024)) << "case " << n;
    check(c, true, n, false);
    check(c, true, n++, true);
  }
  std::printf("[ %d float64 dD cases, whole-chunk kernels ]\n", n);
}

}  // namespace

#endif  // MAMBA3_GOLDEN_CUDA
