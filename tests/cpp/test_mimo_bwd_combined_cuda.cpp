// CUDA backend of mamba3_mimo_bwd_combined against the float64 golden mimo_bwd_combined (SPEC.md
// section 3's rule for each of the 15 gradients).
//
// Tests that need a GPU skip themselves when none is present. The pairwise grid of the CPU suite
// (mimo_bwd_combined_grid.hpp: dtype sets, output dtype, R, N, P, C, S with partial last chunks,
// gate / norm, reduce-O or per-rank dout, D, GQA, B, rotary divisor, padded inputs) runs on the
// device with NaN-poisoned outputs, NaN where the operator must not read, and a bitwise repeat.
// Further cases reach the reduction kernels' edges: many row segments for the bias sums (B*S
// far above the 32-row segment), wide groups (H/G = 8), long chunk scans, the largest rows
// (R 8 x C 64), odd sizes, a single step, and the eleven reference shapes at a short sequence.
// CUDA-graph capture, strided inputs and a side stream are tested through the PyTorch front end
// (tests/python/test_mimo_bwd_combined_cuda.py).
#include <gtest/gtest.h>

#include <cstdio>
#include <vector>

#include "case_log.hpp"
#include "mamba3/mamba3.h"
#include "mamba3_golden/host.hpp"
#include "mamba3_golden/mimo_cases.hpp"
#include "mimo_bwd_combined_grid.hpp"

namespace {

using namespace mamba3::test;  // expect_pass, record, print_worst, WorstLog
using namespace mamba3::golden;

TEST(MimoBwdCombinedCuda, GridMatchesGolden) {
  SKIP_WITHOUT_CUDA();
  const std::vector<MimoCombinedCase> cases = mimo_cb::grid();
  WorstLog worst;
  for (const MimoCombinedCase& c : cases) {
    const CaseReport r = run_mimo_bwd_combined_case(c, Device::CUDA, 2);
    expect_pass(r);
    record(worst, r);
  }
  std::printf("[ %zu mimo_bwd_combined cuda cases ]\n", cases.size());
  print_worst("mimo_bwd_combined on cuda: grid", worst);
}

MimoCombinedCase make(int64_t B, int64_t S, int64_t H, int64_t G, int64_t N, int64_t P, int64_t R,
                      int64_t C, IoType act, bool z, bool norm, bool reduce_o, bool d,
                      uint64_t seed) {
  MimoCombinedCase c;
  c.B = B, c.S = S, c.H = H, c.G = G, c.N = N, c.P = P, c.R = R, c.chunk = C;
  c.act = act, c.out = act;
  c.z = z, c.norm = norm, c.reduce_o = reduce_o, c.d = d;
  c.seed = seed;
  return c;
}

void run_all(const std::vector<MimoCombinedCase>& cases, const char* title, int repeats = 2) {
  WorstLog worst;
  for (const MimoCombinedCase& c : cases) {
    const CaseReport r = run_mimo_bwd_combined_case(c, Device::CUDA, repeats);
    expect_pass(r);
    record(worst, r);
  }
  print_worst(title, worst);
}

// Many 32-row segments in the bias sums (B*S = 2000 and 1034, a partial last segment), eight
// heads per q/k group, long reverse scans, every gate / layout variant once.
TEST(MimoBwdCombinedCuda, ManySegmentsAndWideGroups) {
  SKIP_WITHOUT_CUDA();
  const IoType BF = IoType::BF16, F32 = IoType::F32, F16 = IoType::F16;
  run_all({make(2, 1000, 8, 1, 32, 32, 2, 16, BF, true, false, true, true, 31),
           make(1, 1034, 8, 2, 16, 32, 4, 8, F32, true, true, true, true, 32),
           make(2, 517, 2, 1, 64, 32, 1, 32, F16, true, false, false, false, 33),
           make(1, 300, 4, 4, 32, 64, 4, 16, BF, false, false, true, true, 34),
           make(1, 260, 2, 1, 16, 32, 2, 64, F32, false, false, false, true, 35)},
          "mimo_bwd_combined on cuda: many segments, wide groups");
}

// The largest chunk rows (R 8 x C 64), the largest N and P, odd sizes, a single step.
TEST(MimoBwdCombinedCuda, LargeAndOddSizes) {
  SKIP_WITHOUT_CUDA();
  const IoType BF = IoType::BF16, F32 = IoType::F32, F16 = IoType::F16;
  std::vector<MimoCombinedCase> cases = {
      make(1, 70, 2, 1, 128, 64, 8, 64, F32, true, false, false, true, 41),
      make(1, 45, 2, 2, 256, 128, 2, 16, BF, true, true, true, true, 42),
      make(2, 1, 2, 1, 16, 32, 2, 8, F16, true, true, true, true, 43),
      make(2, 37, 3, 1, 16, 32, 1, 8, F32, true, false, true, false, 44)};
  cases.back().rdd = 2;
  run_all(cases, "mimo_bwd_combined on cuda: large and odd sizes");
}

// The eleven upstream reference shapes (N, P, R, C) at a short sequence (B=1, H=2, S=150: whole
// and partial chunks), bf16 activations, the gate and D on, reduce-O (as upstream's benchmark
// runs it), the fused norm on every third shape.
TEST(MimoBwdCombinedCuda, ReferenceShapesShortSequence) {
  SKIP_WITHOUT_CUDA();
  const auto& shapes = kReferenceShapes;
  std::vector<MimoCombinedCase> cases;
  uint64_t seed = 51;
  int k = 0;
  for (const auto& s : shapes)
    cases.push_back(make(1, 150, 2, 1, s[0], s[1], s[2], s[3], IoType::BF16, true, k++ % 3 == 2,
                         true, true, seed++));
  run_all(cases, "mimo_bwd_combined on cuda: reference shapes");
}

TEST(MimoBwdCombinedCuda, BitwiseRepeat) {
  SKIP_WITHOUT_CUDA();
  run_all({make(2, 200, 4, 2, 64, 64, 4, 16, IoType::BF16, true, false, true, true, 61)},
          "mimo_bwd_combined on cuda: repeats", 4);
}

}  // namespace
