// CUDA backend of the SISO backward operators against the float64 golden (SPEC.md section 3).
//
// Every test skips when no CUDA device is present (and the file builds without CUDA). The case
// grid crosses the main axes (dtype sets x N x (G,H)) and cycles the others (B, S, chunk, A,
// varlen, d_ok_state / input states, padding) through them; each case compares every output with
// the golden after NaN-poisoning and repeats the call to check bitwise determinism. Further tests
// target the kernel's internal paths: every lane layout (VEC 8/4/2, one lane per row, element mode
// for unaligned rows), head splits (1 to 128 heads per q/k head, uneven ones, bias accumulators in
// the workspace), many short sequences, large shapes, CUDA-graph capture, cu_seqlens validation
// and the workspace contract. A disabled-by-default benchmark prints timings of the reference
// shapes (--gtest_also_run_disabled_tests); it asserts nothing about time.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "mamba3/mamba3.h"
#include "mamba3_golden/host.hpp"
#include "mamba3_golden/siso_cases.hpp"
#include "case_log.hpp"

#ifdef MAMBA3_GOLDEN_CUDA
#include <cuda_runtime.h>
#endif

namespace {

using namespace mamba3::test;  // expect_pass, record, print_worst, WorstLog

using namespace mamba3::golden;

// Uneven sequence lengths summing to S (first of length 1, then shorter and longer than a chunk).
std::vector<int64_t> split_lengths(int64_t S, int64_t nseq) {
  if (nseq <= 1) return {S};
  std::vector<int64_t> lens;
  int64_t rem = S;
  for (int64_t i = 0; i + 1 < nseq; ++i) {
    const int64_t left_after = nseq - 1 - i;
    int64_t want = i == 0 ? 1 : i == 1 ? 27 : 71;
    want = std::max<int64_t>(1, std::min(want, rem - left_after));
    lens.push_back(want);
    rem -= want;
  }
  lens.push_back(rem);
  return lens;
}

// ------------------------------------------------------------------ compute_dqktheta

struct DtypeSet {
  IoType qk, grad, small;
};
const DtypeSet kDqkDtypes[] = {{IoType::F32, IoType::F32, IoType::F32},
                               {IoType::F16, IoType::F16, IoType::F16},
                               {IoType::BF16, IoType::BF16, IoType::BF16},
                               {IoType::BF16, IoType::BF16, IoType::F32},
                               {IoType::F16, IoType::F32, IoType::F32}};
const int64_t kS[] = {1, 17, 64, 100, 256};
const int64_t kN[] = {16, 32, 64, 128, 256};
const int64_t kGH[][2] = {{1, 1}, {1, 4}, {2, 4}};
const int64_t kChunk[] = {16, 32, 64, 128, 256};
const int64_t kPad[] = {0, 3, 8};  // 3: rows misaligned (element mode); 8: aligned, not contiguous

std::vector<DqkthetaCase> dqktheta_grid() {
  std::vector<DqkthetaCase> cases;
  int i = 0;
  for (const DtypeSet& d : kDqkDtypes)
    for (int64_t N : kN)
      for (const auto& gh : kGH) {
        DqkthetaCase c;
        c.qk = d.qk, c.grad = d.grad, c.small = d.small;
        c.N = N, c.G = gh[0], c.H = gh[1];
        c.B = 1 + (i % 2);
        c.S = kS[(i / 2 + i / 7) % 5];
        c.chunk = kChunk[i % 5];
        const int amode = (i / 3) % 3;
        c.A = amode == 0 ? N / 2 : amode == 1 ? N / 4 : 1;
        const int64_t nseq = c.B == 1 ? (i / 2) % 5 : 0;
        if (nseq > 0 && nseq <= c.S) c.seqlens = split_lengths(c.S, nseq);
        c.dok = (i / 4) % 2 == 1;
        c.pad = kPad[(i / 5) % 3];
        c.seed = 1000 + i;
        cases.push_back(c);
        ++i;
      }
  return cases;
}

TEST(SisoBwdCuda, DqkthetaGridMatchesGolden) {
  SKIP_WITHOUT_CUDA();
  const auto cases = dqktheta_grid();
  WorstLog worst;
  for (const DqkthetaCase& c : cases) {
    const CaseReport r = run_dqktheta_case(c, Device::CUDA, 2);
    expect_pass(r);
    record(worst, r);
  }
  std::printf("[ %zu compute_dqktheta cases ]\n", cases.size());
  print_worst("compute_dqktheta on cuda", worst);
}

TEST(SisoBwdCuda, DqkthetaGridCoversEveryAxisValue) {
  const auto cases = dqktheta_grid();
  auto seen = [&](auto pred) { return std::any_of(cases.begin(), cases.end(), pred); };
  for (int64_t v : kS) EXPECT_TRUE(seen([&](const DqkthetaCase& c) { return c.S == v; })) << v;
  for (int64_t v : kPad) EXPECT_TRUE(seen([&](const DqkthetaCase& c) { return c.pad == v; })) << v;
  for (int64_t b = 1; b <= 2; ++b)
    EXPECT_TRUE(seen([&](const DqkthetaCase& c) { return c.B == b; })) << b;
  for (size_t n = 1; n <= 4; ++n)
    EXPECT_TRUE(seen([&](const DqkthetaCase& c) { return c.seqlens.size() == n; })) << n;
  EXPECT_TRUE(seen([](const DqkthetaCase& c) { return c.dok && !c.seqlens.empty(); }));
  EXPECT_TRUE(seen([](const DqkthetaCase& c) { return c.dok && c.B == 2; }));
  EXPECT_TRUE(seen([](const DqkthetaCase& c) { return c.A == c.N / 2; }));
  EXPECT_TRUE(seen([](const DqkthetaCase& c) { return c.A == c.N / 4; }));
  EXPECT_TRUE(seen([](const DqkthetaCase& c) { return c.A == 1; }));
}

DqkthetaCase dqk(int64_t B, int64_t S, int64_t G, int64_t H, int64_t N, int64_t A, IoType qk,
                 IoType grad, IoType small, uint64_t seed) {
  DqkthetaCase c;
  c.B = B, c.S = S, c.G = G, c.H = H, c.N = N, c.A = A;
  c.qk = qk, c.grad = grad, c.small = small;
  c.seed = seed;
  return c;
}

// Lane layouts and their edge cases: VEC 8 (A = N/2), 4 (A = N/4), 2 (N % 4 != 0), one lane per
// row (N <= 8), idle lanes (N not a power of two), angles by element (A odd), N = 250.
TEST(SisoBwdCuda, DqkthetaLaneLayouts) {
  SKIP_WITHOUT_CUDA();
  const IoType F = IoType::F32, H = IoType::F16, BF = IoType::BF16;
  const std::vector<DqkthetaCase> cases = {
      dqk(2, 33, 1, 2, 2, 1, F, F, F, 1),       dqk(1, 40, 1, 3, 4, 2, BF, BF, F, 2),
      dqk(2, 19, 1, 2, 6, 3, H, H, H, 3),       dqk(1, 50, 1, 2, 6, 2, F, BF, BF, 4),
      dqk(2, 21, 1, 4, 8, 4, BF, BF, BF, 5),    dqk(1, 37, 2, 4, 8, 1, F, F, F, 6),
      dqk(2, 23, 1, 2, 18, 9, F, F, F, 7),      dqk(1, 29, 1, 2, 18, 4, BF, BF, BF, 8),
      dqk(2, 31, 1, 2, 20, 5, H, H, H, 9),      dqk(1, 45, 1, 3, 20, 10, F, H, F, 10),
      dqk(2, 26, 1, 2, 48, 12, BF, BF, F, 11),  dqk(1, 41, 1, 2, 96, 24, F, F, F, 12),
      dqk(1, 39, 1, 2, 96, 48, H, F, H, 13),    dqk(2, 17, 1, 2, 250, 125, F, F, F, 14),
      dqk(1, 22, 1, 2, 250, 7, BF, BF, BF, 15), dqk(1, 35, 1, 2, 256, 128, BF, F, BF, 16),
      dqk(1, 27, 1, 2, 64, 31, F, F, F, 17),    dqk(2, 33, 1, 2, 128, 33, H, H, F, 18),
      dqk(1, 60, 1, 1, 130, 65, F, F, F, 19),   dqk(1, 60, 1, 2, 12, 6, BF, BF, BF, 20),
  };
  WorstLog worst;
  for (DqkthetaCase c : cases) {
    for (bool dok : {false, true}) {
      c.dok = dok;
      const CaseReport r = run_dqktheta_case(c, Device::CUDA, 2);
      expect_pass(r);
      record(worst, r);
    }
  }
  print_worst("compute_dqktheta (lane layouts) on cuda", worst);
}

// Heads per q/k head from 1 to 128: warp splits 1..8 along heads (uneven when it does not
// divide), 2 row groups, and bias accumulators in the workspace when shared memory is too small.
TEST(SisoBwdCuda, DqkthetaHeadSplits) {
  SKIP_WITHOUT_CUDA();
  const IoType F = IoType::F32, BF = IoType::BF16;
  std::vector<DqkthetaCase> cases = {
      dqk(2, 45, 1, 3, 64, 16, BF, BF, F, 21),   dqk(1, 70, 2, 10, 32, 8, F, F, F, 22),
      dqk(2, 33, 1, 12, 64, 32, BF, BF, BF, 23), dqk(1, 64, 1, 32, 128, 32, BF, BF, F, 24),
      dqk(1, 40, 2, 14, 16, 4, F, F, F, 25),     dqk(1, 24, 1, 64, 256, 128, BF, BF, F, 26),
      dqk(1, 20, 1, 128, 256, 64, F, F, F, 27),  dqk(2, 30, 3, 3, 64, 16, BF, BF, BF, 28),
      dqk(1, 50, 1, 9, 40, 10, F, BF, F, 29),
  };
  cases[3].dok = true;
  cases[6].dok = true;
  WorstLog worst;
  for (const DqkthetaCase& c : cases) {
    const CaseReport r = run_dqktheta_case(c, Device::CUDA, 2);
    expect_pass(r);
    record(worst, r);
  }
  print_worst("compute_dqktheta (head splits) on cuda", worst);
}

// Runs every case without and with d_ok_state (the latter as varlen with 3 sequences when B = 1
// and S allows), checking each against the golden, and prints the worst errors under `label`.
void run_with_and_without_dok(const std::vector<DqkthetaCase>& cases, const char* label) {
  WorstLog worst;
  for (DqkthetaCase c : cases) {
    for (int variant = 0; variant < 2; ++variant) {
      c.dok = variant == 1;
      if (variant == 1 && c.B == 1 && c.S >= 3) c.seqlens = split_lengths(c.S, 3);
      const CaseReport r = run_dqktheta_case(c, Device::CUDA, 2);
      expect_pass(r);
      record(worst, r);
    }
  }
  print_worst(label, worst);
}

// The lean kernel (one dtype for q/k/dq_in/dk_in, float32 angles and row scalars) for every N
// it takes and f16/bf16/f32 I/O, 1 to 16 heads per q/k head (all warps on heads, or split
// between heads and rows), partial last blocks, varlen and d_ok_state; next to cases of the same
// shapes that fall back to the pipelined kernel (float16 row scalars, odd A).
TEST(SisoBwdCuda, DqkthetaLeanAndFallbackPaths) {
  SKIP_WITHOUT_CUDA();
  const IoType F = IoType::F32, H = IoType::F16, BF = IoType::BF16;
  std::vector<DqkthetaCase> cases = {
      dqk(2, 37, 1, 2, 16, 8, H, H, F, 51),      dqk(1, 53, 2, 6, 32, 4, H, H, F, 52),
      dqk(2, 29, 1, 5, 64, 16, H, H, F, 53),     dqk(1, 67, 1, 16, 128, 32, H, H, F, 54),
      dqk(2, 19, 2, 8, 256, 64, H, H, F, 55),    dqk(1, 45, 1, 1, 256, 128, BF, BF, F, 56),
      dqk(2, 31, 1, 3, 128, 64, F, F, F, 57),    dqk(1, 77, 4, 4, 16, 2, BF, BF, F, 58),
      dqk(1, 67, 1, 16, 128, 32, H, H, H, 59),   dqk(2, 29, 1, 5, 64, 15, BF, BF, F, 60),
  };
  run_with_and_without_dok(cases, "compute_dqktheta (lean and fallback paths) on cuda");
}

// The split-run kernel (A = N/4, 16-bit q/k/dq_in/dk_in, float32 angles and row scalars) for
// every N it takes: warps holding all heads of the group (dq/dk by shuffles; 8 heads per warp at
// N = 32, 1 at N = 256) and groups spread over 2-16 warps (dq/dk through shared memory, with 1-8
// warps per head along the rows), single positions, partial last blocks, CTAs walking many
// blocks, varlen and d_ok_state, bias sums inside the kernel or in the separate reduction; plus
// same-shape cases it must leave to the lean kernel (heads per group not a multiple of the heads
// a warp holds, A != N/4).
TEST(SisoBwdCuda, DqkthetaSplitRunPaths) {
  SKIP_WITHOUT_CUDA();
  const IoType F = IoType::F32, H = IoType::F16, BF = IoType::BF16;
  std::vector<DqkthetaCase> cases = {
      dqk(2, 37, 1, 8, 32, 8, BF, BF, F, 71),    dqk(1, 45, 1, 16, 32, 8, H, H, F, 72),
      dqk(2, 29, 2, 8, 64, 16, BF, BF, F, 73),   dqk(1, 53, 1, 8, 64, 16, H, H, F, 74),
      dqk(1, 19, 1, 64, 64, 16, BF, BF, F, 75),  dqk(2, 33, 1, 2, 128, 32, BF, BF, F, 76),
      dqk(1, 41, 1, 32, 128, 32, H, H, F, 77),   dqk(2, 17, 1, 16, 128, 32, BF, BF, F, 78),
      dqk(1, 1, 1, 4, 128, 32, BF, BF, F, 79),   dqk(1, 700, 2, 8, 128, 32, BF, BF, F, 80),
      dqk(2, 23, 1, 1, 256, 64, H, H, F, 81),    dqk(1, 31, 1, 16, 256, 64, BF, BF, F, 82),
      dqk(2, 5, 3, 6, 128, 32, BF, BF, F, 83),   dqk(1, 39, 1, 6, 128, 32, BF, BF, F, 84),
      dqk(2, 27, 1, 4, 128, 64, BF, BF, F, 85),  dqk(1, 300, 4, 16, 64, 16, BF, BF, F, 86),
      // 5 q/k heads: 53 CTAs each would exceed the 264 resident ones, so the bias partials are
      // summed by the separate reduction kernel instead of inside the cooperative kernel.
      dqk(1, 2000, 5, 10, 128, 32, BF, BF, F, 87),
  };
  run_with_and_without_dok(cases, "compute_dqktheta (split-run kernel) on cuda");
}

// Many short sequences (length 1 included) with d_ok_state: most rows are a sequence's last.
TEST(SisoBwdCuda, DqkthetaManyShortSequences) {
  SKIP_WITHOUT_CUDA();
  DqkthetaCase c = dqk(1, 0, 1, 4, 64, 16, IoType::BF16, IoType::BF16, IoType::F32, 31);
  c.seqlens = {1, 1, 2, 3, 1, 5, 8, 1, 13, 2, 1, 40, 1, 1, 7};
  for (int64_t l : c.seqlens) c.S += l;
  c.dok = true;
  expect_pass(run_dqktheta_case(c, Device::CUDA, 2));
  c.qk = c.grad = c.small = IoType::F32;
  c.N = 128, c.A = 64, c.G = 2, c.H = 2;
  expect_pass(run_dqktheta_case(c, Device::CUDA, 2));
}

// Shapes large enough for every CTA to walk many row blocks, including the reference shape's
// dtypes and a GQA shape.
TEST(SisoBwdCuda, DqkthetaLargeShapes) {
  SKIP_WITHOUT_CUDA();
  const IoType F = IoType::F32, BF = IoType::BF16;
  std::vector<DqkthetaCase> cases = {
      dqk(1, 2048, 1, 32, 128, 32, BF, BF, F, 41),
      dqk(2, 1024, 4, 16, 64, 16, BF, BF, F, 42),
      dqk(1, 3000, 1, 8, 128, 64, F, F, F, 43),
  };
  cases[0].dok = true;
  cases[2].seqlens = {1000, 1, 999, 1000};
  cases[2].dok = true;
  WorstLog worst;
  for (const DqkthetaCase& c : cases) {
    const CaseReport r = run_dqktheta_case(c, Device::CUDA, 2);
    expect_pass(r);
    record(worst, r);
    std::printf("  [%s] %.3f ms (one call, untuned harness timing)\n", c.describe().c_str(),
                r.time_ms);
  }
  print_worst("compute_dqktheta (large) on cuda", worst);
}

// ------------------------------------------------------------------
// compute_ddt_dtrap_dinput_states

const IoType kIo[] = {IoType::F32, IoType::F16, IoType::BF16};
const int64_t kDdtH[] = {1, 3, 4};
const int64_t kNP[][2] = {{0, 0}, {16, 8}, {32, 16}, {64, 64}, {128, 32}, {256, 64}, {7, 5}};

std::vector<DdtCase> ddt_grid() {
  std::vector<DdtCase> cases;
  int i = 0;
  for (IoType io : kIo)
    for (const auto& np : kNP)
      for (int64_t S : kS) {
        DdtCase c;
        c.io = io;
        c.state_io = kIo[(i / 3) % 3];
        c.B = 1 + (i % 2);
        c.H = kDdtH[(i / 2) % 3];
        c.S = S;
        c.states = np[0] > 0;
        if (c.states) c.N = np[0], c.P = np[1];
        const int64_t nseq = c.B == 1 ? (i / 2) % 5 : 0;
        if (nseq > 0 && nseq <= S) c.seqlens = split_lengths(S, nseq);
        c.pad = (i / 4) % 2 ? 2 : 0;
        c.seed = 2000 + i;
        cases.push_back(c);
        ++i;
      }
  return cases;
}

TEST(SisoBwdCuda, DdtDtrapGridMatchesGolden) {
  SKIP_WITHOUT_CUDA();
  const auto cases = ddt_grid();
  WorstLog worst;
  for (const DdtCase& c : cases) {
    const CaseReport r = run_ddt_case(c, Device::CUDA, 2);
    expect_pass(r);
    record(worst, r);
  }
  std::printf("[ %zu compute_ddt_dtrap_dinput_states cases ]\n", cases.size());
  print_worst("compute_ddt_dtrap_dinput_states on cuda", worst);
}

TEST(SisoBwdCuda, DdtGridCoversEveryAxisValue) {
  const auto cases = ddt_grid();
  auto seen = [&](auto pred) { return std::any_of(cases.begin(), cases.end(), pred); };
  for (IoType t : kIo) {
    EXPECT_TRUE(seen([&](const DdtCase& c) { return c.io == t; }));
    EXPECT_TRUE(seen([&](const DdtCase& c) { return c.states && c.state_io == t; }));
  }
  for (int64_t h : kDdtH) EXPECT_TRUE(seen([&](const DdtCase& c) { return c.H == h; })) << h;
  for (size_t n = 1; n <= 4; ++n) {
    EXPECT_TRUE(seen([&](const DdtCase& c) { return c.seqlens.size() == n; })) << n;
    EXPECT_TRUE(seen([&](const DdtCase& c) { return c.seqlens.size() == n && c.states; })) << n;
  }
  EXPECT_TRUE(seen([](const DdtCase& c) { return c.pad > 0 && c.states; }));
  EXPECT_TRUE(seen([](const DdtCase& c) { return c.B == 2 && c.states; }));
}

TEST(SisoBwdCuda, DdtLargeAndManySequences) {
  SKIP_WITHOUT_CUDA();
  DdtCase big;
  big.B = 4, big.H = 32, big.S = 2048, big.states = true, big.N = 128, big.P = 64;
  big.seed = 3001;
  const CaseReport r = run_ddt_case(big, Device::CUDA, 2);
  expect_pass(r);
  std::printf("  [%s] %.3f ms (one call, untuned harness timing)\n", big.describe().c_str(),
              r.time_ms);
  DdtCase many;
  many.B = 1, many.H = 3, many.states = true, many.N = 32, many.P = 16;
  many.io = IoType::BF16, many.state_io = IoType::F16;
  many.seqlens = {1, 1, 2, 5, 1, 64, 3, 1, 100, 1};
  many.S = 0;
  for (int64_t l : many.seqlens) many.S += l;
  many.seed = 3002;
  expect_pass(run_ddt_case(many, Device::CUDA, 2));
  many.states = false;
  expect_pass(run_ddt_case(many, Device::CUDA, 2));
  // N > 256: the column sums take the column-parallel pass.
  DdtCase wide;
  wide.B = 2, wide.H = 3, wide.S = 40, wide.states = true, wide.N = 300, wide.P = 12;
  wide.io = IoType::F16, wide.state_io = IoType::F32, wide.pad = 2, wide.seed = 3003;
  expect_pass(run_ddt_case(wide, Device::CUDA, 2));
}

#ifdef MAMBA3_GOLDEN_CUDA

// ------------------------------------------------------------------ direct device tests

void ck(cudaError_t e, const char* what) {
  ASSERT_EQ(e, cudaSuccess) << what << ": " << cudaGetErrorString(e);
}

// A device copy of a host Buffer (same byte layout), exposed as a CUDA DLTensor.
struct Dev {
  Buffer* host = nullptr;
  void* ptr = nullptr;
  DLTensor dl{};
  std::vector<int64_t> shape, strides;
  explicit Dev(Buffer& b) : host(&b) {
    const size_t n = std::max<size_t>(b.bytes.size(), 1);
    if (cudaMalloc(&ptr, n) != cudaSuccess) throw std::runtime_error("cudaMalloc");
    if (!b.bytes.empty() &&
        cudaMemcpy(ptr, b.bytes.data(), b.bytes.size(), cudaMemcpyHostToDevice) != cudaSuccess)
      throw std::runtime_error("upload");
    dl = *b.tensor();
    shape = b.shape;
    strides = b.strides;
    dl.shape = shape.data();
    dl.strides = strides.empty() ? nullptr : strides.data();
    dl.data = ptr;
    dl.device = DLDevice{kDLCUDA, 0};
  }
  ~Dev() { cudaFree(ptr); }
  Dev(const Dev&) = delete;
  Dev& operator=(const Dev&) = delete;
  DLTensor* t() { return &dl; }
  std::vector<unsigned char> download() const {
    std::vector<unsigned char> out(host->bytes.size());
    if (!out.empty()) cudaMemcpy(out.data(), ptr, out.size(), cudaMemcpyDeviceToHost);
    return out;
  }
};

Buffer rand_buf(std::mt19937_64& rng, IoType t, std::vector<int64_t> shape, double lo, double hi) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return Buffer::from_double(t, shape, uniform(rng, n, lo, hi, t));
}

// All operands of one compute_dqktheta + compute_ddt call pair (varlen, d_ok_state, states).
struct SisoBwdOperands {
  int64_t S, G = 1, H = 4, N = 64, A = 16, P = 32;
  std::vector<int64_t> cu_values;
  Buffer q, k, scale, gamma, qb, kb, angles, dqi, dki, dqk, dok, cu;
  Buffer dq, dk, dqb, dkb, dang, dsc, dga;
  Buffer dt, trap, dissm, kst, vst, ddt, dtrap, dis, dks, dvs;
  explicit SisoBwdOperands(std::vector<int64_t> cuv) : cu_values(std::move(cuv)) {
    S = cu_values.back();
    const int64_t nseq = static_cast<int64_t>(cu_values.size()) - 1;
    std::mt19937_64 rng(77);
    const IoType BF = IoType::BF16, F = IoType::F32;
    q = rand_buf(rng, BF, {1, S, G, N}, -1, 1);
    k = rand_buf(rng, BF, {1, S, G, N}, -1, 1);
    scale = rand_buf(rng, F, {1, H, S}, 0.5, 1.5);
    gamma = rand_buf(rng, F, {1, H, S}, 0, 0.5);
    qb = rand_buf(rng, BF, {H, N}, -0.5, 0.5);
    kb = rand_buf(rng, BF, {H, N}, -0.5, 0.5);
    angles = rand_buf(rng, F, {1, S, H, A}, 0, 6.28);
    dqi = rand_buf(rng, BF, {1, S, H, N}, -1, 1);
    dki = rand_buf(rng, BF, {1, S, H, N}, -1, 1);
    dqk = rand_buf(rng, F, {1, H, S}, -1, 1);
    dok = rand_buf(rng, F, {nseq, H, N}, -1, 1);
    cu = Buffer::from_double(IoType::I32, {nseq + 1},
                             std::vector<double>(cu_values.begin(), cu_values.end()));
    dq = Buffer(BF, {1, S, G, N}), dk = Buffer(BF, {1, S, G, N});
    dqb = Buffer(F, {H, N}), dkb = Buffer(F, {H, N});
    dang = Buffer(F, {1, S, H, A}), dsc = Buffer(F, {1, H, S}), dga = Buffer(F, {1, H, S});
    dt = rand_buf(rng, F, {1, H, S}, 0.01, 0.5);
    trap = rand_buf(rng, F, {1, H, S}, -3, 3);
    dissm = rand_buf(rng, BF, {nseq, H, P, N}, -1, 1);
    kst = rand_buf(rng, BF, {nseq, H, N}, -1, 1);
    vst = rand_buf(rng, BF, {nseq, H, P}, -1, 1);
    ddt = Buffer(F, {1, H, S}), dtrap = Buffer(F, {1, H, S});
    dis = Buffer(BF, {nseq, H, P, N}), dks = Buffer(F, {nseq, H, N}), dvs = Buffer(F, {nseq, H, P});
  }
};

struct SisoBwdDevice {
  SisoBwdOperands& o;
  Dev q, k, scale, gamma, qb, kb, angles, dqi, dki, dqk, dok, cu;
  Dev dq, dk, dqb, dkb, dang, dsc, dga;
  Dev dt, trap, dissm, kst, vst, ddt, dtrap, dis, dks, dvs;
  void* ws = nullptr;
  size_t ws_bytes = 0;
  explicit SisoBwdDevice(SisoBwdOperands& op)
      : o(op),
        q(op.q),
        k(op.k),
        scale(op.scale),
        gamma(op.gamma),
        qb(op.qb),
        kb(op.kb),
        angles(op.angles),
        dqi(op.dqi),
        dki(op.dki),
        dqk(op.dqk),
        dok(op.dok),
        cu(op.cu),
        dq(op.dq),
        dk(op.dk),
        dqb(op.dqb),
        dkb(op.dkb),
        dang(op.dang),
        dsc(op.dsc),
        dga(op.dga),
        dt(op.dt),
        trap(op.trap),
        dissm(op.dissm),
        kst(op.kst),
        vst(op.vst),
        ddt(op.ddt),
        dtrap(op.dtrap),
        dis(op.dis),
        dks(op.dks),
        dvs(op.dvs) {
    if (mamba3_compute_dqktheta_workspace_size(q.t(), scale.t(), 64, cu.t(), &ws_bytes) !=
        MAMBA3_OK)
      throw std::runtime_error(mamba3_last_error());
    if (cudaMalloc(&ws, ws_bytes) != cudaSuccess) throw std::runtime_error("cudaMalloc ws");
  }
  ~SisoBwdDevice() { cudaFree(ws); }
  mamba3_status dqktheta(cudaStream_t st, size_t ws_given) {
    return mamba3_compute_dqktheta(q.t(), k.t(), scale.t(), gamma.t(), qb.t(), kb.t(), angles.t(),
                                   dqi.t(), dki.t(), dqk.t(), dok.t(), 64, cu.t(), dq.t(), dk.t(),
                                   dqb.t(), dkb.t(), dang.t(), dsc.t(), dga.t(), ws, ws_given, st);
  }
  mamba3_status ddt_call(cudaStream_t st) {
    return mamba3_compute_ddt_dtrap_dinput_states(dsc.t(), dga.t(), dt.t(), trap.t(), dissm.t(),
                                                  kst.t(), vst.t(), cu.t(), ddt.t(), dtrap.t(),
                                                  dis.t(), dks.t(), dvs.t(), st);
  }
  std::vector<std::vector<unsigned char>> outputs() const {
    return {dq.download(),    dk.download(),  dqb.download(), dkb.download(),
            dang.download(),  dsc.download(), dga.download(), ddt.download(),
            dtrap.download(), dis.download(), dks.download(), dvs.download()};
  }
  void poison_outputs() {
    for (const Dev* d : {&dq, &dk, &dqb, &dkb, &dang, &dsc, &dga, &ddt, &dtrap, &dis, &dks, &dvs})
      cudaMemset(d->ptr, 0x7f, d->host->bytes.size());
  }
};

// Both operators captured into one CUDA graph (varlen: cu_seqlens validation is skipped under
// capture; no allocation or synchronisation may happen) give bitwise the eager results.
TEST(SisoBwdCuda, GraphCaptureMatchesEager) {
  SKIP_WITHOUT_CUDA();
  SisoBwdOperands op({0, 1, 30, 31, 100, 163});
  SisoBwdDevice dev(op);
  cudaStream_t st;
  ck(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), "stream");
  ASSERT_EQ(dev.dqktheta(st, dev.ws_bytes), MAMBA3_OK) << mamba3_last_error();
  ASSERT_EQ(dev.ddt_call(st), MAMBA3_OK) << mamba3_last_error();
  ck(cudaStreamSynchronize(st), "sync");
  const auto eager = dev.outputs();

  dev.poison_outputs();
  ck(cudaDeviceSynchronize(), "sync");
  cudaGraph_t graph;
  ck(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal), "begin capture");
  const mamba3_status s1 = dev.dqktheta(st, dev.ws_bytes);
  const std::string e1 = mamba3_last_error();
  const mamba3_status s2 = dev.ddt_call(st);
  const std::string e2 = mamba3_last_error();
  ck(cudaStreamEndCapture(st, &graph), "end capture");
  ASSERT_EQ(s1, MAMBA3_OK) << e1;
  ASSERT_EQ(s2, MAMBA3_OK) << e2;
  cudaGraphExec_t exec;
  ck(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
  for (int rep = 0; rep < 2; ++rep) {
    ck(cudaGraphLaunch(exec, st), "graph launch");
    ck(cudaStreamSynchronize(st), "sync");
    EXPECT_TRUE(dev.outputs() == eager) << "graph replay " << rep << " differs from the eager run";
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(st);
}

// Device cu_seqlens values are validated (outside graph capture) and named in the error.
TEST(SisoBwdCuda, InvalidCuSeqlensRejected) {
  SKIP_WITHOUT_CUDA();
  const std::vector<std::pair<std::vector<int32_t>, const char*>> bad = {
      {{0, 40, 30, 100}, "strictly increasing"},
      {{0, 40, 40, 100}, "strictly increasing"},
      {{5, 40, 70, 100}, "start at 0"},
      {{0, 40, 70, 99}, "last entry"}};
  for (const auto& [vals, what] : bad) {
    SisoBwdOperands op({0, 40, 70, 100});
    SisoBwdDevice dev(op);
    ck(cudaMemcpy(dev.cu.ptr, vals.data(), vals.size() * 4, cudaMemcpyHostToDevice), "cu");
    EXPECT_EQ(dev.dqktheta(nullptr, dev.ws_bytes), MAMBA3_ERROR_INVALID_ARGUMENT);
    std::string msg = mamba3_last_error();
    EXPECT_NE(msg.find("cu_seqlens"), std::string::npos) << msg;
    EXPECT_NE(msg.find(what), std::string::npos) << msg;
    EXPECT_EQ(dev.ddt_call(nullptr), MAMBA3_ERROR_INVALID_ARGUMENT);
    msg = mamba3_last_error();
    EXPECT_NE(msg.find("cu_seqlens"), std::string::npos) << msg;
    EXPECT_NE(msg.find(what), std::string::npos) << msg;
  }
}

TEST(SisoBwdCuda, WorkspaceContract) {
  SKIP_WITHOUT_CUDA();
  SisoBwdOperands op({0, 64});
  SisoBwdDevice dev(op);
  EXPECT_GT(dev.ws_bytes, 0u);
  EXPECT_EQ(dev.dqktheta(nullptr, dev.ws_bytes - 1), MAMBA3_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(mamba3_last_error()).find("workspace"), std::string::npos)
      << mamba3_last_error();
  EXPECT_EQ(dev.dqktheta(nullptr, dev.ws_bytes), MAMBA3_OK) << mamba3_last_error();
  ck(cudaDeviceSynchronize(), "sync");
}

// ------------------------------------------------------------------ benchmark (disabled)

struct BenchTensor {
  void* ptr = nullptr;
  DLTensor dl{};
  std::vector<int64_t> shape;
  size_t bytes = 0;
  BenchTensor(IoType t, std::vector<int64_t> shp, std::mt19937_64& rng, double lo, double hi)
      : shape(std::move(shp)) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    bytes = static_cast<size_t>(n) * io_size(t);
    std::vector<unsigned char> host(bytes);
    std::uniform_real_distribution<double> u(lo, hi);
    // A few thousand random values tiled over the tensor: realistic magnitudes, fast to make.
    std::vector<unsigned char> tile(4096 * io_size(t));
    for (int i = 0; i < 4096; ++i) encode(u(rng), t, tile.data() + i * io_size(t));
    for (size_t off = 0; off < bytes; off += tile.size())
      std::memcpy(host.data() + off, tile.data(), std::min(tile.size(), bytes - off));
    cudaMalloc(&ptr, bytes);
    cudaMemcpy(ptr, host.data(), bytes, cudaMemcpyHostToDevice);
    dl.data = ptr;
    dl.device = DLDevice{kDLCUDA, 0};
    dl.ndim = static_cast<int32_t>(shape.size());
    dl.dtype = io_dl(t);
    dl.shape = shape.data();
  }
  ~BenchTensor() { cudaFree(ptr); }
  DLTensor* t() { return &dl; }
};

template <class F>
double median_us(cudaStream_t st, F&& f, int iters = 30) {
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  for (int i = 0; i < 3; ++i) f();
  std::vector<double> t;
  for (int i = 0; i < iters; ++i) {
    cudaEventRecord(a, st);
    f();
    cudaEventRecord(b, st);
    cudaEventSynchronize(b);
    float ms = 0;
    cudaEventElapsedTime(&ms, a, b);
    t.push_back(ms * 1000.0);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

TEST(SisoBwdCuda, DISABLED_Benchmark) {
  SKIP_WITHOUT_CUDA();
  cudaStream_t st;
  ck(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), "stream");
  // Copy ceiling: device-to-device copy of 1 GiB (read + write bytes counted).
  double ceiling = 0;
  {
    const size_t n = size_t(1) << 30;
    void *x = nullptr, *y = nullptr;
    cudaMalloc(&x, n);
    cudaMalloc(&y, n);
    const double us = median_us(
        st, [&] { cudaMemcpyAsync(y, x, n, cudaMemcpyDeviceToDevice, st); }, 10);
    ceiling = 2.0 * n / (us * 1e-6) / 1e12;
    cudaFree(x);
    cudaFree(y);
    std::printf("[ copy ceiling %.3f TB/s ]\n", ceiling);
  }
  struct Shape {
    int64_t B, S, G, H, N, A;
  };
  const IoType BF = IoType::BF16, F = IoType::F32;
  for (const Shape& s : {Shape{4, 2048, 1, 32, 128, 32}, Shape{8, 4096, 1, 32, 128, 32},
                         Shape{2, 2048, 4, 16, 64, 16}, Shape{4, 2048, 1, 32, 128, 64}}) {
    std::mt19937_64 rng(5);
    BenchTensor q(BF, {s.B, s.S, s.G, s.N}, rng, -1, 1), k(BF, {s.B, s.S, s.G, s.N}, rng, -1, 1);
    BenchTensor scale(F, {s.B, s.H, s.S}, rng, 0.5, 1.5), gamma(F, {s.B, s.H, s.S}, rng, 0, 0.5);
    BenchTensor qb(F, {s.H, s.N}, rng, -0.5, 0.5), kb(F, {s.H, s.N}, rng, -0.5, 0.5);
    BenchTensor ang(F, {s.B, s.S, s.H, s.A}, rng, 0, 6.28);
    BenchTensor dqi(BF, {s.B, s.S, s.H, s.N}, rng, -1, 1),
        dki(BF, {s.B, s.S, s.H, s.N}, rng, -1, 1);
    BenchTensor dqk(F, {s.B, s.H, s.S}, rng, -1, 1);
    BenchTensor dq(BF, {s.B, s.S, s.G, s.N}, rng, 0, 1), dk(BF, {s.B, s.S, s.G, s.N}, rng, 0, 1);
    BenchTensor dqb(F, {s.H, s.N}, rng, 0, 1), dkb(F, {s.H, s.N}, rng, 0, 1);
    BenchTensor dang(F, {s.B, s.S, s.H, s.A}, rng, 0, 1);
    BenchTensor dsc(F, {s.B, s.H, s.S}, rng, 0, 1), dga(F, {s.B, s.H, s.S}, rng, 0, 1);
    size_t wsb = 0;
    ASSERT_EQ(mamba3_compute_dqktheta_workspace_size(q.t(), scale.t(), 64, nullptr, &wsb),
              MAMBA3_OK);
    void* ws = nullptr;
    cudaMalloc(&ws, wsb);
    mamba3_status status = MAMBA3_OK;
    const double us = median_us(st, [&] {
      status =
          mamba3_compute_dqktheta(q.t(), k.t(), scale.t(), gamma.t(), qb.t(), kb.t(), ang.t(),
                                  dqi.t(), dki.t(), dqk.t(), nullptr, 64, nullptr, dq.t(), dk.t(),
                                  dqb.t(), dkb.t(), dang.t(), dsc.t(), dga.t(), ws, wsb, st);
    });
    ASSERT_EQ(status, MAMBA3_OK) << mamba3_last_error();
    size_t bytes = 0;
    for (BenchTensor* t : {&q, &k, &scale, &gamma, &qb, &kb, &ang, &dqi, &dki, &dqk, &dq, &dk, &dqb,
                           &dkb, &dang, &dsc, &dga})
      bytes += t->bytes;
    const double tbs = bytes / (us * 1e-6) / 1e12;
    std::printf(
        "[ compute_dqktheta B=%lld S=%lld G=%lld H=%lld N=%lld A=%lld: %.1f us, %.1f MB, "
        "%.3f TB/s = %.1f%% of copy ceiling; workspace %.2f MB ]\n",
        (long long)s.B, (long long)s.S, (long long)s.G, (long long)s.H, (long long)s.N,
        (long long)s.A, us, bytes / 1e6, tbs, 100 * tbs / ceiling, wsb / 1e6);
    cudaFree(ws);
  }
  {
    const int64_t B = 4, H = 32, S = 2048, N = 128, P = 64;
    std::mt19937_64 rng(6);
    BenchTensor ds(F, {B, H, S}, rng, -1, 1), dg(F, {B, H, S}, rng, -1, 1);
    BenchTensor dt(F, {B, H, S}, rng, 0.01, 0.5), tr(F, {B, H, S}, rng, -3, 3);
    BenchTensor ddt(F, {B, H, S}, rng, 0, 1), dtr(F, {B, H, S}, rng, 0, 1);
    BenchTensor dis(F, {B, H, P, N}, rng, -1, 1), kst(F, {B, H, N}, rng, -1, 1);
    BenchTensor vst(F, {B, H, P}, rng, -1, 1), odis(F, {B, H, P, N}, rng, 0, 1);
    BenchTensor odk(F, {B, H, N}, rng, 0, 1), odv(F, {B, H, P}, rng, 0, 1);
    mamba3_status status = MAMBA3_OK;
    const double us0 = median_us(st, [&] {
      status = mamba3_compute_ddt_dtrap_dinput_states(ds.t(), dg.t(), dt.t(), tr.t(), nullptr,
                                                      nullptr, nullptr, nullptr, ddt.t(), dtr.t(),
                                                      nullptr, nullptr, nullptr, st);
    });
    ASSERT_EQ(status, MAMBA3_OK) << mamba3_last_error();
    const double us1 = median_us(st, [&] {
      status = mamba3_compute_ddt_dtrap_dinput_states(ds.t(), dg.t(), dt.t(), tr.t(), dis.t(),
                                                      kst.t(), vst.t(), nullptr, ddt.t(), dtr.t(),
                                                      odis.t(), odk.t(), odv.t(), st);
    });
    ASSERT_EQ(status, MAMBA3_OK) << mamba3_last_error();
    const double b0 = 6.0 * B * H * S * 4, b1 = b0 + 2.0 * B * H * P * N * 4;
    std::printf(
        "[ compute_ddt_dtrap B=4 S=2048 H=32: %.1f us (%.3f TB/s); with states N=128 "
        "P=64: %.1f us (%.3f TB/s) ]\n",
        us0, b0 / (us0 * 1e-6) / 1e12, us1, b1 / (us1 * 1e-6) / 1e12);
  }
  cudaStreamDestroy(st);
}

#endif  // MAMBA3_GOLDEN_CUDA

}  // namespace
