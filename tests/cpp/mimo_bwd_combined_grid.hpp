// The combined backward's case grid, shared by its CPU and CUDA suites
// (tests/cpp/test_mimo_bwd_combined_{cpu,cuda}.cpp): the first pass's pairwise grid
// (mimo_bwd_fwd_grid.hpp) with the combined case type, its own sequence lengths (tails included)
// and a cost model of both passes.
#pragma once

#include <cstdint>
#include <vector>

#include "mimo_bwd_fwd_grid.hpp"

namespace mamba3::test::mimo_cb {

const std::vector<int64_t> kS = {5, 33, 40, 50, 64, 100};

// Both passes' work per (b, h, step) in the cost model (the goldens cost a small multiple of it).
inline std::vector<golden::MimoCombinedCase> grid() {
  return mimo_bf::grid<golden::MimoCombinedCase>({kS, 1.5e8, 20240617, 1, 9, 2.5});
}

}  // namespace mamba3::test::mimo_cb
