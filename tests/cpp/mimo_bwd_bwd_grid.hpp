// The pairwise case grid of mamba3_mimo_bwd_bwd, shared by the CPU and CUDA suites
// (tests/cpp/test_mimo_bwd_bwd_{cpu,cuda}.cpp) so both backends meet exactly the same cases.
//
// A pairwise covering array over every axis of the brief (input dtypes, the dtype of the first
// pass's states / qk_dot, the dq / dk / dv dtype, R, N, P, C, S with partial last chunks, the
// three dout layouts, D, GQA, B, rotary divisor, padded inputs): every pair of axis values appears
// in at least one case, and a cost bound keeps the largest combinations out so the suites stay
// fast (the golden runs on the host for every case).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "mamba3_golden/host.hpp"
#include "mamba3_golden/mimo_cases.hpp"
#include "pairwise.hpp"

namespace mamba3::test::mimo_bb {

using golden::IoType;
using golden::MimoBwdBwdCase;
using golden::MimoDoutKind;

struct DtypeSet {
  IoType act, param, decay;
};
const DtypeSet kDtypes[] = {{IoType::F32, IoType::F32, IoType::F32},
                            {IoType::F16, IoType::F32, IoType::F32},
                            {IoType::BF16, IoType::F32, IoType::F32},
                            {IoType::F16, IoType::F16, IoType::F16},
                            {IoType::BF16, IoType::BF16, IoType::BF16}};
const IoType kCache[] = {IoType::F32, IoType::BF16, IoType::F16};  // states / qk_dot
const IoType kOut[] = {IoType::F32, IoType::F16, IoType::BF16};    // dq / dk / dv
const int64_t kR[] = {1, 2, 4, 8};
const int64_t kN[] = {16, 32, 64, 128, 256};
const int64_t kP[] = {32, 64, 128};
const int64_t kC[] = {8, 16, 32, 64};
const int64_t kS[] = {5, 33, 40, 50, 64, 100};  // 5: one partial chunk; 64: whole chunks for all C
const MimoDoutKind kLayout[] = {MimoDoutKind::ReduceO, MimoDoutKind::PerRank, MimoDoutKind::Packed};
const int64_t kGH[][2] = {{1, 1}, {1, 2}, {2, 4}};
const int64_t kB[] = {1, 2};
const int64_t kRdd[] = {2, 4};
const int64_t kPad[] = {0, 3};

enum Axis {
  kAxDtype,
  kAxCache,
  kAxOut,
  kAxR,
  kAxN,
  kAxP,
  kAxC,
  kAxS,
  kAxLayout,
  kAxD,
  kAxGH,
  kAxB,
  kAxRdd,
  kAxPad,
  kNumAxes
};

// Work of one case in flops (the operator's count; the goldens cost a small multiple of it).
// Unset axes count at their smallest value, so the bound only excludes combinations that are
// too large whatever the other axes are.
inline double case_cost(const Assignment& a) {
  auto val = [&](int axis, const int64_t* values) {
    return double(values[a[axis] < 0 ? 0 : a[axis]]);
  };
  const double R = val(kAxR, kR), N = val(kAxN, kN), P = val(kAxP, kP), C = val(kAxC, kC);
  const double S = val(kAxS, kS), B = val(kAxB, kB);
  const double H = a[kAxGH] < 0 ? 1.0 : double(kGH[a[kAxGH]][1]);
  return B * H * S * (5 * R * N * P + 2 * std::min(C, S) * R * R * (N + P));
}
constexpr double kMaxCaseCost = 1.5e8;

inline std::vector<MimoBwdBwdCase> grid() {
  const std::vector<int> sizes = {5, 3, 3, 4, 5, 3, 4, 6, 3, 2, 3, 2, 2, 2};
  auto ok = [](const Assignment& a) { return case_cost(a) <= kMaxCaseCost; };
  std::vector<MimoBwdBwdCase> cases;
  uint64_t seed = 1;
  for (const Assignment& a : pairwise(sizes, ok, 20240611)) {
    MimoBwdBwdCase c;
    c.act = kDtypes[a[kAxDtype]].act;
    c.param = kDtypes[a[kAxDtype]].param;
    c.decay = kDtypes[a[kAxDtype]].decay;
    c.cache = kCache[a[kAxCache]];
    c.out = kOut[a[kAxOut]];
    c.R = kR[a[kAxR]];
    c.N = kN[a[kAxN]];
    c.P = kP[a[kAxP]];
    c.chunk = kC[a[kAxC]];
    c.S = kS[a[kAxS]];
    c.dout = kLayout[a[kAxLayout]];
    c.d = a[kAxD] == 1;
    c.G = kGH[a[kAxGH]][0];
    c.H = kGH[a[kAxGH]][1];
    c.B = kB[a[kAxB]];
    c.rdd = kRdd[a[kAxRdd]];
    c.pad = kPad[a[kAxPad]];
    c.seed = seed++;
    cases.push_back(c);
  }
  return cases;
}

}  // namespace mamba3::test::mimo_bb
