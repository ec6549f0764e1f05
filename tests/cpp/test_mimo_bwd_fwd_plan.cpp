// The launch plan of the CUDA first pass (src/cuda/mimo_bwd_fwd_kernels.cuh), on the host: the
// lean bf16 kernels' thread count (256 or 512: MbPlan::nt) and, for that count, the lean
// eligibility and state tiles per warp. The lean kernel bodies themselves run against the
// golden on the GPU (test_mimo_bwd_fwd_cuda.cpp) and, with emulated ldmatrix / mma.sync,
// against the CPU backend on the host (test_mimo_bwd_fwd_emulated.cpp).
//
// Only in CUDA builds: the header includes the CUDA fp16 / bf16 headers.
#ifdef MAMBA3_GOLDEN_CUDA

#include <gtest/gtest.h>

#include <cstdint>
#include <string>

#include "cuda/mimo_bwd_fwd_kernels.cuh"

namespace {

namespace mimo = mamba3::cuda::mimo;

struct Shape {
  int N, P, R, C;
};

// The 11 benchmark shapes (bench/bench_mimo_bwd.py, docs/PERF.md).
const Shape kBench[] = {{16, 64, 4, 8},   {32, 64, 4, 16},  {64, 64, 4, 16}, {128, 64, 4, 16},
                        {256, 64, 4, 8},  {64, 128, 4, 16}, {128, 32, 4, 16}, {128, 128, 4, 8},
                        {128, 64, 8, 8},  {128, 64, 2, 32}, {128, 64, 1, 64}};

mimo::MbProblem problem(const Shape& s, bool bf16 = true) {
  mimo::MbProblem pr;
  pr.B = 2, pr.S = 2048, pr.H = 16, pr.G = 1;
  pr.N = s.N, pr.P = s.P, pr.R = s.R, pr.C = s.C, pr.A = s.N / 4;
  pr.reduce_o = true, pr.has_z = true, pr.has_d = true, pr.has_norm = true;
  pr.act16 = true;
  pr.act_dt = bf16 ? static_cast<int>(mamba3::DType::BF16) : static_cast<int>(mamba3::DType::F16);
  pr.lean_io = bf16;
  pr.lean_vec = true;
  return pr;
}

std::string name(const Shape& s, int pref) {
  return "N=" + std::to_string(s.N) + " P=" + std::to_string(s.P) + " R=" + std::to_string(s.R) +
         " C=" + std::to_string(s.C) + " lean_nt=" + std::to_string(pref);
}

// State tiles per warp written out: 16 x 16 tiles of [N][P] over nt / 32 warps, rounded up to
// 1, 2, 4 or 8 (0: more than 8).
int expected_st(int N, int P, int nt) {
  const int tiles = (N / 16) * (P / 16), warps = nt / 32;
  for (int st = 1; st <= 8; st *= 2)
    if (st * warps >= tiles) return st;
  return 0;
}

// The lean path's conditions at nt threads, shared memory aside.
bool lean_ok(const Shape& s, int nt) {
  const int T = s.C * s.R;
  return (s.R & (s.R - 1)) == 0 && nt % s.P == 0 && (T == 16 || T == 32 || T == 64) &&
         s.N % 16 == 0 && s.P % 16 == 0 && expected_st(s.N, s.P, nt) > 0;
}

TEST(MimoBwdFwdPlan, ParsesTheThreadCountOverride) {
  EXPECT_EQ(mimo::parse_lean_nt(nullptr), 0);
  EXPECT_EQ(mimo::parse_lean_nt(""), 0);
  EXPECT_EQ(mimo::parse_lean_nt("256"), 256);
  EXPECT_EQ(mimo::parse_lean_nt("512"), 512);
  for (const char* bad : {"128", "1024", "384", "256 ", " 512", "0256", "abc", "-1"})
    EXPECT_EQ(mimo::parse_lean_nt(bad), -1) << bad;
}

TEST(MimoBwdFwdPlan, ProvisionalRule) {
  EXPECT_EQ(mimo::lean_nt_rule(16), 256);
  EXPECT_EQ(mimo::lean_nt_rule(32), 512);
  EXPECT_EQ(mimo::lean_nt_rule(256), 512);
}

// On the H200 (the default MbDevice) every benchmark shape runs the lean kernels with either
// thread count; the default takes 256 only at N = 16.
TEST(MimoBwdFwdPlan, BenchmarkShapesOnH200) {
  const mimo::MbDevice h200;
  for (const Shape& s : kBench) {
    for (int pref : {0, 256, 512}) {
      const mimo::MbPlan pl = mimo::make_mimo_plan(problem(s), h200, pref);
      const int nt = pref ? pref : (s.N <= 16 ? 256 : 512);
      ASSERT_TRUE(pl.ok) << name(s, pref);
      EXPECT_EQ(pl.nt, nt) << name(s, pref);
      EXPECT_EQ(pl.lean, expected_st(s.N, s.P, nt)) << name(s, pref);
      // (the exchange deferred, in the Sc planes, for the three kinds: problem() has the norm)
      const int defer_slots = pl.l3.ered == pl.l3.ScT ? 3 : 0;
      EXPECT_EQ(pl.smem3, static_cast<size_t>(mimo::layout_lean(s.N, s.P, s.R, s.C, s.N / 4, true,
                                                                 pl.l3.ang >= 0, true, nt,
                                                                 defer_slots)
                                                   .total) * 4)
          << name(s, pref);
      // The cos / sin table fits at every benchmark shape (the weights share the Y tile).
      EXPECT_GE(pl.l3.ang, 0) << name(s, pref);
    }
  }
  // The exchange is deferred at the C R = 32 shapes (enlarged Sc planes) and, without the norm,
  // at R = 8 (with it, its 3 R 512 floats do not fit there).
  for (const Shape& s : {Shape{256, 64, 4, 8}, Shape{128, 128, 4, 8}, Shape{128, 64, 4, 16}}) {
    const mimo::MbPlan pl = mimo::make_mimo_plan(problem(s), h200);
    EXPECT_EQ(pl.l3.ered, pl.l3.ScT) << name(s, 0);
  }
  {
    mimo::MbProblem pr = problem({128, 64, 8, 8});
    EXPECT_NE(mimo::make_mimo_plan(pr, h200).l3.ered, mimo::make_mimo_plan(pr, h200).l3.ScT);
    pr.has_norm = false;
    EXPECT_EQ(mimo::make_mimo_plan(pr, h200).l3.ered, mimo::make_mimo_plan(pr, h200).l3.ScT);
  }
  // Spelled out: the smallest shape, and the shapes where 8 warps need 8 state tiles.
  EXPECT_EQ(mimo::make_mimo_plan(problem({16, 64, 4, 8}), h200).lean, 1);
  EXPECT_EQ(mimo::make_mimo_plan(problem({16, 64, 4, 8}), h200, 512).lean, 1);
  EXPECT_EQ(mimo::make_mimo_plan(problem({256, 64, 4, 8}), h200, 256).lean, 8);
  EXPECT_EQ(mimo::make_mimo_plan(problem({256, 64, 4, 8}), h200).lean, 4);
  EXPECT_EQ(mimo::make_mimo_plan(problem({128, 128, 4, 8}), h200, 256).lean, 8);
}

// Where 256 threads cannot run the lean kernels, the plan falls back to 512 (the rule's
// choice and the override alike).
TEST(MimoBwdFwdPlan, FallsBackTo512) {
  const mimo::MbDevice h200;
  // N P = 32768: 128 state tiles, 16 per warp with 8 warps (its tiles do not fit the H200's
  // shared memory with either count).
  EXPECT_EQ(mimo::lean_state_tiles(256, 128, 256), 0);
  EXPECT_EQ(mimo::lean_state_tiles(256, 128, 512), 8);
  // N = 192, P = 128: 96 state tiles, 12 per warp with 8 warps, 6 (rounded to 8) with 16.
  for (int pref : {0, 256, 512}) {
    const mimo::MbPlan pl = mimo::make_mimo_plan(problem({192, 128, 2, 8}), h200, pref);
    ASSERT_TRUE(pl.ok);
    EXPECT_EQ(pl.nt, 512) << pref;
    EXPECT_EQ(pl.lean, 8) << pref;
  }
  // P = 512 does not divide 256 threads (the epilogue's thread -> column map).
  for (int pref : {0, 256}) {
    const mimo::MbPlan pl = mimo::make_mimo_plan(problem({16, 512, 2, 8}), h200, pref);
    ASSERT_TRUE(pl.ok);
    EXPECT_EQ(pl.nt, 512) << pref;
    EXPECT_EQ(pl.lean, 2) << pref;
  }
  // N = 16, P = 256: 16 state tiles, 2 per warp with 8 warps (the most at N = 16 and 256).
  EXPECT_EQ(mimo::make_mimo_plan(problem({16, 256, 2, 8}), h200).nt, 256);
  EXPECT_EQ(mimo::make_mimo_plan(problem({16, 256, 2, 8}), h200).lean, 2);
}

// Shared memory is checked for the thread count that runs: the exchange buffers shrink with 256
// threads, so a device can fit the lean layout with 256 and not with 512. The rule keeps 512
// (the general kernels) above N = 16; the override takes 256.
TEST(MimoBwdFwdPlan, SharedMemoryIsCheckedForTheChosenCount) {
  const Shape s{32, 16, 8, 8};  // T = 64, small tiles: the exchange buffer is its own region
  const int A = s.N / 4;
  const int t256 = mimo::layout_lean(s.N, s.P, s.R, s.C, A, true, true, true, 256).total * 4;
  const int t512 = mimo::layout_lean(s.N, s.P, s.R, s.C, A, true, true, true, 512).total * 4;
  ASSERT_LT(t256, t512);
  mimo::MbDevice dev;
  dev.smem_optin = t256;
  const mimo::MbPlan rule = mimo::make_mimo_plan(problem(s), dev);
  ASSERT_TRUE(rule.ok);
  EXPECT_EQ(rule.lean, 0);
  EXPECT_EQ(rule.nt, mimo::kNT);
  const mimo::MbPlan forced = mimo::make_mimo_plan(problem(s), dev, 256);
  ASSERT_TRUE(forced.ok);
  EXPECT_EQ(forced.nt, 256);
  EXPECT_EQ(forced.lean, 1);
  EXPECT_LE(forced.smem3, static_cast<size_t>(t256));
}

// A grid of sizes under a device with room for any tiling: the plan's choice equals the
// conditions written out above, and the general kernels keep kNT.
TEST(MimoBwdFwdPlan, ThreadCountAndStateTilesOverAGrid) {
  mimo::MbDevice big;
  big.smem_optin = big.smem_per_sm = 1 << 30;
  int lean256 = 0, lean512 = 0, general = 0;
  for (int N : {8, 16, 32, 48, 64, 128, 256, 512})
    for (int P : {8, 16, 32, 48, 64, 96, 128, 256, 512})
      for (int R : {1, 2, 3, 4, 8})
        for (int C : {8, 16, 32, 64})
          for (int pref : {0, 256, 512})
            for (bool bf16 : {true, false}) {
              const Shape s{N, P, R, C};
              const mimo::MbPlan pl = mimo::make_mimo_plan(problem(s, bf16), big, pref);
              ASSERT_TRUE(pl.ok) << name(s, pref);
              const int want = pref ? pref : (N <= 16 ? 256 : 512);
              const int nt = !bf16 ? 0 : lean_ok(s, want) ? want : lean_ok(s, 512) ? 512 : 0;
              if (nt == 0) {
                EXPECT_EQ(pl.lean, 0) << name(s, pref);
                EXPECT_EQ(pl.nt, mimo::kNT) << name(s, pref);
                ++general;
                continue;
              }
              EXPECT_EQ(pl.nt, nt) << name(s, pref);
              EXPECT_EQ(pl.lean, expected_st(N, P, nt)) << name(s, pref);
              ++(nt == 256 ? lean256 : lean512);
            }
  EXPECT_GT(lean256, 0);
  EXPECT_GT(lean512, 0);
  EXPECT_GT(general, 0);
}

}  // namespace

#endif  // MAMBA3_GOLDEN_CUDA
