// The pairwise case grid over the first pass's inputs, shared by the mamba3_mimo_bwd_fwd suites
// (tests/cpp/test_mimo_bwd_fwd_{cpu,cuda}.cpp) and the combined backward's
// (test_mimo_bwd_combined_cpu.cpp): one set of axes, each suite choosing only its case type,
// sequence lengths, cost model, cost bound and seeds.
//
// A pairwise covering array over every axis of the brief (dtype sets, output dtype, R, N, P, C,
// S with partial last chunks, gate / norm, reduce-O or per-rank dout, D, GQA, B, rotary divisor,
// padded inputs): every pair of axis values appears in at least one case; a cost bound keeps the
// largest combinations out so the suites stay fast (the golden runs on the host for every case).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "mamba3_golden/host.hpp"
#include "mamba3_golden/mimo_cases.hpp"
#include "pairwise.hpp"

namespace mamba3::test::mimo_bf {

using golden::IoType;
using golden::MimoBwdFwdCase;

struct DtypeSet {
  IoType act, param, decay;
};
const DtypeSet kDtypes[] = {{IoType::F32, IoType::F32, IoType::F32},
                            {IoType::F16, IoType::F32, IoType::F32},
                            {IoType::BF16, IoType::F32, IoType::F32},
                            {IoType::F16, IoType::F16, IoType::F16},
                            {IoType::BF16, IoType::BF16, IoType::BF16}};
const IoType kOut[] = {IoType::F32, IoType::F16, IoType::BF16};
const int64_t kR[] = {1, 2, 4, 8};
const int64_t kN[] = {16, 32, 64, 128, 256};
const int64_t kP[] = {32, 64, 128};
const int64_t kC[] = {8, 16, 32, 64};
enum Gate { kNoGate, kGateZ, kGateZNorm };
const int64_t kGH[][2] = {{1, 1}, {1, 2}, {2, 4}};
const int64_t kB[] = {1, 2};
const int64_t kRdd[] = {2, 4};
const int64_t kPad[] = {0, 3};

enum Axis { kAxDtype, kAxOut, kAxR, kAxN, kAxP, kAxC, kAxS, kAxGate, kAxReduce, kAxD, kAxGH,
            kAxB, kAxRdd, kAxPad, kNumAxes };

struct GridOptions {
  std::vector<int64_t> S;     // sequence lengths (the S axis)
  double max_cost;            // cases above this many flops are left out
  uint64_t pairwise_seed;     // the covering array's seed
  uint64_t first_case_seed;   // input seeds are first_case_seed, +1, ...
  // Cost model: flops per (b, h, step) = state_flops R N P + chunk_flops min(C, S) R^2 (N + P).
  double state_flops = 4, chunk_flops = 0.5;
};

// Work of one case in flops (the operator's count; the golden and the float reference cost a
// small multiple of it). Unset axes count at their smallest value, so the bound only excludes
// combinations that are too large whatever the other axes are.
inline double case_cost(const Assignment& a, const GridOptions& o) {
  auto val = [&](int axis, const int64_t* values) {
    return double(values[a[axis] < 0 ? 0 : a[axis]]);
  };
  const double R = val(kAxR, kR), N = val(kAxN, kN), P = val(kAxP, kP), C = val(kAxC, kC);
  const double S = val(kAxS, o.S.data()), B = val(kAxB, kB);
  const double H = a[kAxGH] < 0 ? 1.0 : double(kGH[a[kAxGH]][1]);
  return B * H * S * (o.state_flops * R * N * P + o.chunk_flops * std::min(C, S) * R * R * (N + P));
}

// Case: MimoBwdFwdCase or golden::MimoCombinedCase (the same fields).
template <class Case = MimoBwdFwdCase>
std::vector<Case> grid(const GridOptions& o) {
  const std::vector<int> sizes = {5, 3, 4, 5, 3, 4, static_cast<int>(o.S.size()), 3, 2, 2, 3, 2, 2, 2};
  auto ok = [&](const Assignment& a) {
    // The norm sits between readout and reduce-O projection: it needs mimo_o (and the gate).
    if (a[kAxGate] == kGateZNorm && a[kAxReduce] == 1) return false;
    return case_cost(a, o) <= o.max_cost;
  };
  std::vector<Case> cases;
  uint64_t seed = o.first_case_seed;
  for (const Assignment& a : pairwise(sizes, ok, o.pairwise_seed)) {
    Case c;
    c.act = kDtypes[a[kAxDtype]].act;
    c.param = kDtypes[a[kAxDtype]].param;
    c.decay = kDtypes[a[kAxDtype]].decay;
    c.out = kOut[a[kAxOut]];
    c.R = kR[a[kAxR]];
    c.N = kN[a[kAxN]];
    c.P = kP[a[kAxP]];
    c.chunk = kC[a[kAxC]];
    c.S = o.S[a[kAxS]];
    c.z = a[kAxGate] != kNoGate;
    c.norm = a[kAxGate] == kGateZNorm;
    c.reduce_o = a[kAxReduce] == 0;
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

}  // namespace mamba3::test::mimo_bf
