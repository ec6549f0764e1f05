// The combined backward's case grid, shared by its CPU and CUDA suites
// (tests/cpp/test_mimo_bwd_combined_{cpu,cuda}.cpp): the first pass's pairwise grid
// (mimo_bwd_fwd_grid.hpp) with the combined case type, its own sequence lengths (tails included)
// and a cost model of both passes.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "mimo_bwd_fwd_grid.hpp"

namespace mamba3::test::mimo_cb {

const std::vector<int64_t> kS = {5, 33, 40, 50, 64, 100};

// Both passes' work per (b, h, step) in the cost model (the goldens cost a small multiple of it).
inline std::vector<golden::MimoCombinedCase> grid() {
  return mimo_bf::grid<golden::MimoCombinedCase>({kS, 1.5e8, 20240617, 1, 9, 2.5});
}

// Thirty draws of the fused pre-gate norm with D on which dD = sum dout_pre_rms . x is
// ill-conditioned in float32 on some (1/120 .. 1/5200 of sum |dout_pre_rms| |x|): the
// NormDdOnIllConditionedDraws tests of both backends (docs/ACCURACY.md).
inline std::vector<golden::MimoCombinedCase> norm_dd_draws() {
  std::vector<golden::MimoCombinedCase> v;
  for (int s = 0; s < 60; s += 2) {
    golden::MimoCombinedCase c;
    const int64_t Rs[] = {1, 2, 4}, Ns[] = {16, 32}, Ps[] = {32, 64, 128}, Ss[] = {5, 33, 40, 64};
    c.R = Rs[s % 3], c.N = Ns[(s / 3) % 2], c.P = Ps[(s / 6) % 3], c.chunk = 16;
    c.S = Ss[(s / 5) % 4], c.B = 2, c.H = 1;
    c.z = c.norm = c.d = c.reduce_o = true;
    c.seed = 2000 + s;
    v.push_back(c);
  }
  return v;
}

// Runs norm_dd_draws() on `dev`, each `repeats` times, every output against the golden; prints
// the worst dd and returns each failing draw's first failure.
inline std::vector<std::string> run_norm_dd_draws(golden::Device dev, int repeats) {
  std::vector<std::string> fails;
  double worst = 0, worst_ref = 0;
  const std::vector<golden::MimoCombinedCase> draws = norm_dd_draws();
  for (const golden::MimoCombinedCase& c : draws) {
    const golden::CaseReport r = golden::run_mimo_bwd_combined_case(c, dev, repeats);
    for (const golden::OutputReport& o : r.outputs)
      if (o.name == "dd" && o.acc.rel_l2 > worst)
        worst = o.acc.rel_l2, worst_ref = o.acc.ref_rel_l2;
    if (!r.pass()) fails.push_back(r.first_failure());
  }
  std::printf("[ %zu of %zu norm cases pass; worst dd rel_l2 %.2e (its float32 reference %.2e) ]\n",
              draws.size() - fails.size(), draws.size(), worst, worst_ref);
  return fails;
}

}  // namespace mamba3::test::mimo_cb
