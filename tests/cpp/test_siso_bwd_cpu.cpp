// CPU backend of the SISO backward operators against the float64 golden (SPEC.md section 3).
//
// The case grid is a pairwise covering array over every axis of the brief (dtypes, B, S, chunk,
// (G,H), N, A, varlen, d_ok_state / input states, padding): every pair of axis values that can
// occur together appears in at least one case, which keeps the suite small while every value of
// every axis is exercised. Each case compares every output with the golden and repeats the call
// to check bitwise determinism. Further tests cover what the grid cannot: arbitrary strides and
// byte offsets (bitwise equal to the compact run), independence from chunk_size, the parallel
// path, exact fp16/bf16 rounding of the stores, and hand-computed values.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "mamba3/mamba3.h"
#include "mamba3_golden/host.hpp"
#include "mamba3_golden/siso_cases.hpp"
#include "pairwise.hpp"
#include "case_log.hpp"

namespace {

using namespace mamba3::test;  // expect_pass, record, print_worst, WorstLog

using namespace mamba3::golden;

using mamba3::test::Assignment;
using mamba3::test::pairwise;

// Uneven sequence lengths summing to S: the first has length 1, the second is shorter than a
// chunk, later ones longer than a chunk where S allows, the last takes the rest.
std::vector<int64_t> split_lengths(int64_t S, int64_t nseq, int64_t chunk) {
  if (nseq == 1) return {S};
  std::vector<int64_t> lens;
  int64_t rem = S;
  for (int64_t i = 0; i + 1 < nseq; ++i) {
    const int64_t left_after = nseq - 1 - i;  // sequences still to place after this one
    int64_t want = i == 0 ? 1 : i == 1 ? chunk - 5 : chunk + 7;
    want = std::max<int64_t>(1, std::min(want, rem - left_after));
    lens.push_back(want);
    rem -= want;
  }
  lens.push_back(rem);
  return lens;
}

// ------------------------------------------------------------------ accuracy bookkeeping

// ------------------------------------------------------------------ compute_dqktheta grid

struct DtypeSet {
  IoType qk, grad, small;
};
const DtypeSet kDqkDtypes[] = {{IoType::F32, IoType::F32, IoType::F32},
                               {IoType::F16, IoType::F16, IoType::F16},
                               {IoType::BF16, IoType::BF16, IoType::BF16},
                               {IoType::BF16, IoType::BF16, IoType::F32},
                               {IoType::F16, IoType::F32, IoType::F32}};
const int64_t kB[] = {1, 2};
const int64_t kS[] = {1, 17, 64, 100, 256};
const int64_t kChunk[] = {16, 32, 64, 128, 256};
const int64_t kGH[][2] = {{1, 1}, {1, 4}, {2, 4}};
const int64_t kN[] = {16, 32, 64, 128, 256};
// Rotated pairs as a function of N: all of them (A = N/2), a quarter of the dims, one pair.
int64_t a_for(int mode, int64_t N) { return mode == 0 ? N / 2 : mode == 1 ? N / 4 : 1; }
const int64_t kNseq[] = {0, 1, 2, 3, 4};  // 0 = no cu_seqlens
const int64_t kPad[] = {0, 3};

enum DqkAxis { kAxDtype, kAxB, kAxS, kAxChunk, kAxGH, kAxN, kAxA, kAxVarlen, kAxDok, kAxPad };

std::vector<DqkthetaCase> dqktheta_grid() {
  const std::vector<int> sizes = {5, 2, 5, 5, 3, 5, 3, 5, 2, 2};
  auto ok = [](const Assignment& a) {
    const int nseq = a[kAxVarlen];
    if (nseq > 0 && a[kAxB] > 0) return false;  // varlen needs B == 1
    if (nseq > 0 && a[kAxS] >= 0 && kNseq[nseq] > kS[a[kAxS]]) return false;
    return true;
  };
  std::vector<DqkthetaCase> cases;
  uint64_t seed = 1;
  for (const Assignment& a : pairwise(sizes, ok, 20240601)) {
    DqkthetaCase c;
    c.qk = kDqkDtypes[a[kAxDtype]].qk;
    c.grad = kDqkDtypes[a[kAxDtype]].grad;
    c.small = kDqkDtypes[a[kAxDtype]].small;
    c.B = kB[a[kAxB]];
    c.S = kS[a[kAxS]];
    c.chunk = kChunk[a[kAxChunk]];
    c.G = kGH[a[kAxGH]][0];
    c.H = kGH[a[kAxGH]][1];
    c.N = kN[a[kAxN]];
    c.A = a_for(a[kAxA], c.N);
    if (kNseq[a[kAxVarlen]] > 0) c.seqlens = split_lengths(c.S, kNseq[a[kAxVarlen]], c.chunk);
    c.dok = a[kAxDok] == 1;
    c.pad = kPad[a[kAxPad]];
    c.seed = seed++;
    cases.push_back(c);
  }
  return cases;
}

TEST(SisoBwdCpu, DqkthetaGridMatchesGolden) {
  const std::vector<DqkthetaCase> cases = dqktheta_grid();
  WorstLog worst;
  for (const DqkthetaCase& c : cases) {
    const CaseReport r = run_dqktheta_case(c, Device::CPU, 2);
    expect_pass(r);
    record(worst, r);
  }
  std::printf("[ %zu compute_dqktheta cases ]\n", cases.size());
  print_worst("compute_dqktheta on cpu", worst);
}

TEST(SisoBwdCpu, DqkthetaGridCoversEveryAxisValue) {
  // Guard against a generator change that would silently drop a value of an axis.
  const std::vector<DqkthetaCase> cases = dqktheta_grid();
  auto seen = [&](auto pred) { return std::any_of(cases.begin(), cases.end(), pred); };
  for (const DtypeSet& d : kDqkDtypes)
    EXPECT_TRUE(seen([&](const DqkthetaCase& c) {
      return c.qk == d.qk && c.grad == d.grad && c.small == d.small;
    }));
  for (int64_t v : kB) EXPECT_TRUE(seen([&](const DqkthetaCase& c) { return c.B == v; })) << v;
  for (int64_t v : kS) EXPECT_TRUE(seen([&](const DqkthetaCase& c) { return c.S == v; })) << v;
  for (int64_t v : kChunk)
    EXPECT_TRUE(seen([&](const DqkthetaCase& c) { return c.chunk == v; })) << v;
  for (const auto& gh : kGH)
    EXPECT_TRUE(seen([&](const DqkthetaCase& c) { return c.G == gh[0] && c.H == gh[1]; }));
  for (int64_t v : kN) EXPECT_TRUE(seen([&](const DqkthetaCase& c) { return c.N == v; })) << v;
  EXPECT_TRUE(seen([](const DqkthetaCase& c) { return c.A == c.N / 2; }));
  EXPECT_TRUE(seen([](const DqkthetaCase& c) { return c.A < c.N / 2 && c.A > 1; }));
  EXPECT_TRUE(seen([](const DqkthetaCase& c) { return c.A == 1; }));
  for (size_t n = 1; n <= 4; ++n)
    EXPECT_TRUE(seen([&](const DqkthetaCase& c) { return c.seqlens.size() == n; })) << n;
  EXPECT_TRUE(seen([](const DqkthetaCase& c) {
    return std::count(c.seqlens.begin(), c.seqlens.end(), 1) > 0 && c.seqlens.size() > 1;
  }));
  EXPECT_TRUE(seen([](const DqkthetaCase& c) {
    return std::any_of(c.seqlens.begin(), c.seqlens.end(),
                       [&](int64_t l) { return l > 1 && l < c.chunk; });
  }));
  EXPECT_TRUE(seen([](const DqkthetaCase& c) { return c.dok && !c.seqlens.empty(); }));
  EXPECT_TRUE(seen([](const DqkthetaCase& c) { return c.dok && c.B == 2; }));
  EXPECT_TRUE(seen([](const DqkthetaCase& c) { return !c.dok; }));
  EXPECT_TRUE(seen([](const DqkthetaCase& c) { return c.pad > 0; }));
  EXPECT_TRUE(seen([](const DqkthetaCase& c) { return c.pad == 0; }));
}

// ------------------------------------------------------------------ compute_ddt grid

const IoType kIo[] = {IoType::F32, IoType::F16, IoType::BF16};
const int64_t kH[] = {1, 3, 4};
// 0: no input states; else (N, P) of the states.
const int64_t kNP[][2] = {{0, 0}, {16, 8}, {32, 16}, {64, 64}, {128, 32}, {256, 64}};
const int64_t kDdtPad[] = {0, 2};

enum DdtAxis { kDxIo, kDxStateIo, kDxB, kDxH, kDxS, kDxNP, kDxVarlen, kDxPad };

std::vector<DdtCase> ddt_grid() {
  const std::vector<int> sizes = {3, 3, 2, 3, 5, 6, 5, 2};
  auto ok = [](const Assignment& a) {
    const int nseq = a[kDxVarlen];
    if (nseq > 0 && a[kDxB] > 0) return false;
    if (nseq > 0 && a[kDxS] >= 0 && kNseq[nseq] > kS[a[kDxS]]) return false;
    if (a[kDxNP] == 0 && a[kDxStateIo] > 0) return false;  // state dtype only matters with states
    return true;
  };
  std::vector<DdtCase> cases;
  uint64_t seed = 101;
  for (const Assignment& a : pairwise(sizes, ok, 20240602)) {
    DdtCase c;
    c.io = kIo[a[kDxIo]];
    c.state_io = kIo[a[kDxStateIo]];
    c.B = kB[a[kDxB]];
    c.H = kH[a[kDxH]];
    c.S = kS[a[kDxS]];
    c.states = a[kDxNP] > 0;
    if (c.states) c.N = kNP[a[kDxNP]][0], c.P = kNP[a[kDxNP]][1];
    if (kNseq[a[kDxVarlen]] > 0) c.seqlens = split_lengths(c.S, kNseq[a[kDxVarlen]], 64);
    c.pad = kDdtPad[a[kDxPad]];
    c.seed = seed++;
    cases.push_back(c);
  }
  return cases;
}

TEST(SisoBwdCpu, DdtDtrapGridMatchesGolden) {
  const std::vector<DdtCase> cases = ddt_grid();
  WorstLog worst;
  for (const DdtCase& c : cases) {
    const CaseReport r = run_ddt_case(c, Device::CPU, 2);
    expect_pass(r);
    record(worst, r);
  }
  std::printf("[ %zu compute_ddt_dtrap_dinput_states cases ]\n", cases.size());
  print_worst("compute_ddt_dtrap_dinput_states on cpu", worst);
}

TEST(SisoBwdCpu, DdtGridCoversEveryAxisValue) {
  const std::vector<DdtCase> cases = ddt_grid();
  auto seen = [&](auto pred) { return std::any_of(cases.begin(), cases.end(), pred); };
  for (IoType t : kIo) {
    EXPECT_TRUE(seen([&](const DdtCase& c) { return c.io == t; }));
    EXPECT_TRUE(seen([&](const DdtCase& c) { return c.states && c.state_io == t; }));
  }
  for (int64_t v : kB) EXPECT_TRUE(seen([&](const DdtCase& c) { return c.B == v; })) << v;
  for (int64_t v : kH) EXPECT_TRUE(seen([&](const DdtCase& c) { return c.H == v; })) << v;
  for (int64_t v : kS) EXPECT_TRUE(seen([&](const DdtCase& c) { return c.S == v; })) << v;
  for (const auto& np : kNP)
    if (np[0] > 0)
      EXPECT_TRUE(seen([&](const DdtCase& c) { return c.states && c.N == np[0] && c.P == np[1]; }));
  EXPECT_TRUE(seen([](const DdtCase& c) { return !c.states; }));
  for (size_t n = 1; n <= 4; ++n) {
    EXPECT_TRUE(seen([&](const DdtCase& c) { return c.seqlens.size() == n; })) << n;
    EXPECT_TRUE(seen([&](const DdtCase& c) { return c.seqlens.size() == n && c.states; })) << n;
  }
  EXPECT_TRUE(seen([](const DdtCase& c) { return c.pad > 0 && c.states; }));
}

// ------------------------------------------------------------------ the parallel path

// Problems above the CPU backend's threading threshold (2^20 elements): same golden comparison,
// and two runs must be bitwise identical.
TEST(SisoBwdCpu, LargeProblemsUseThreadsAndStayExactAndDeterministic) {
  WorstLog worst;
  {
    DqkthetaCase c;
    c.B = 2, c.S = 2048, c.G = 1, c.H = 4, c.N = 128, c.A = 64, c.chunk = 64;
    c.qk = c.grad = IoType::BF16, c.small = IoType::F32;
    c.dok = true;
    c.seed = 9001;
    const CaseReport r = run_dqktheta_case(c, Device::CPU, 2);
    expect_pass(r);
    record(worst, r);
  }
  {
    DqkthetaCase c;
    c.B = 1, c.S = 3000, c.G = 2, c.H = 4, c.N = 64, c.A = 20, c.chunk = 128;
    c.seqlens = {1, 999, 2000};
    c.dok = true;
    c.pad = 1;
    c.seed = 9002;
    const CaseReport r = run_dqktheta_case(c, Device::CPU, 2);
    expect_pass(r);
    record(worst, r);
  }
  {
    DdtCase c;
    c.B = 1, c.H = 80, c.S = 16384, c.N = 64, c.P = 64;
    c.seqlens = {1, 4000, 12383};
    c.states = true;
    c.seed = 9003;
    const CaseReport r = run_ddt_case(c, Device::CPU, 2);
    expect_pass(r);
    record(worst, r);
  }
  print_worst("large cases on cpu", worst);
}

// ------------------------------------------------------------------ arbitrary strides

// A tensor in host memory with an arbitrary layout: dimensions stored in `order` (outermost
// first), every dimension padded, one dimension reversed (negative stride) and the first element
// reached through DLTensor::byte_offset.
struct Strided {
  IoType type = IoType::F32;
  std::vector<int64_t> shape, strides;
  std::vector<unsigned char> mem;
  int64_t origin = 0;  // element index of the logical element 0
  DLTensor dl{};

  Strided(IoType t, std::vector<int64_t> shp, std::vector<int> order, int64_t pad, int flip)
      : type(t), shape(std::move(shp)) {
    const int nd = static_cast<int>(shape.size());
    strides.assign(nd, 0);
    int64_t cur = 1;
    for (int i = nd - 1; i >= 0; --i) {
      const int d = order[i];
      strides[d] = cur;
      cur *= shape[d] + pad;
    }
    origin = 5;  // a few leading elements, so that byte_offset is not 0
    if (flip >= 0 && flip < nd) {
      origin += (shape[flip] - 1) * strides[flip];
      strides[flip] = -strides[flip];
    }
    mem.assign(static_cast<size_t>((cur + 2 * 5) * io_size(t)), 0xff);  // 0xff..: NaN / -1
    dl.data = mem.data();
    dl.device = DLDevice{kDLCPU, 0};
    dl.ndim = nd;
    dl.dtype = io_dl(t);
    dl.shape = shape.data();
    dl.strides = strides.data();
    dl.byte_offset = static_cast<uint64_t>(origin * io_size(t));
  }
  // The descriptor, re-pointed at this object's storage (the object may have been moved).
  DLTensor* t() {
    dl.data = mem.data();
    dl.shape = shape.data();
    dl.strides = strides.data();
    return &dl;
  }
  int64_t elem(int64_t flat) const {
    int64_t off = origin;
    for (int d = static_cast<int>(shape.size()) - 1; d >= 0; --d) {
      off += (flat % shape[d]) * strides[d];
      flat /= shape[d];
    }
    return off;
  }
  int64_t numel() const {
    int64_t n = 1;
    for (int64_t s : shape) n *= s;
    return n;
  }
  void fill_from(const Buffer& b) {
    const int es = io_size(type);
    for (int64_t i = 0; i < numel(); ++i)
      std::memcpy(mem.data() + elem(i) * es, b.bytes.data() + b.offset(unflatten(i)) * es, es);
  }
  // The logical elements as compact bytes (to compare with a compact run bit for bit).
  std::vector<unsigned char> compact_bytes() const {
    const int es = io_size(type);
    std::vector<unsigned char> r(static_cast<size_t>(numel() * es));
    for (int64_t i = 0; i < numel(); ++i) std::memcpy(r.data() + i * es, mem.data() + elem(i) * es, es);
    return r;
  }
  std::vector<int64_t> unflatten(int64_t flat) const {
    std::vector<int64_t> idx(shape.size());
    for (int d = static_cast<int>(shape.size()) - 1; d >= 0; --d) {
      idx[d] = flat % shape[d];
      flat /= shape[d];
    }
    return idx;
  }
};

// A different layout for each tensor (chosen by its position in the argument list).
Strided exotic(IoType t, const std::vector<int64_t>& shape, int which) {
  const int nd = static_cast<int>(shape.size());
  std::vector<int> order(nd);
  for (int i = 0; i < nd; ++i) order[i] = i;
  std::mt19937 rng(which * 7919 + 13);
  std::shuffle(order.begin(), order.end(), rng);
  return Strided(t, shape, order, 1 + which % 3, nd > 1 ? which % nd : (which % 2 ? 0 : -1));
}

Buffer random_buffer(std::mt19937_64& rng, IoType t, std::vector<int64_t> shape, double lo,
                     double hi) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return Buffer::from_double(t, std::move(shape), uniform(rng, n, lo, hi, t));
}

std::vector<unsigned char> buffer_bytes(const Buffer& b) { return b.bytes; }  // compact buffers

void dqktheta_layout_check(bool varlen, bool dok, int64_t chunk_exotic) {
  const int64_t B = varlen ? 1 : 2, S = 37, G = 2, H = 4, N = 32, A = 11;
  const std::vector<int64_t> lens = {1, 20, 16};
  const int64_t nseq = varlen ? 3 : B;
  std::mt19937_64 rng(varlen * 2 + dok + 77);
  std::vector<Buffer> in = {
      random_buffer(rng, IoType::BF16, {B, S, G, N}, -1, 1),   // q
      random_buffer(rng, IoType::BF16, {B, S, G, N}, -1, 1),   // k
      random_buffer(rng, IoType::F32, {B, H, S}, 0.5, 1.5),    // scale
      random_buffer(rng, IoType::F16, {B, H, S}, 0, 0.5),      // gamma
      random_buffer(rng, IoType::F32, {H, N}, -0.5, 0.5),      // q_bias
      random_buffer(rng, IoType::BF16, {H, N}, -0.5, 0.5),     // k_bias
      random_buffer(rng, IoType::F32, {B, S, H, A}, 0, 6.28),  // angles
      random_buffer(rng, IoType::F16, {B, S, H, N}, -1, 1),    // dq_in
      random_buffer(rng, IoType::F16, {B, S, H, N}, -1, 1),    // dk_in
      random_buffer(rng, IoType::BF16, {B, H, S}, -1, 1),      // dqk
      random_buffer(rng, IoType::F32, {nseq, H, N}, -1, 1),    // d_ok_state
  };
  Buffer cu = Buffer::from_double(IoType::I64, {4}, {0, 1, 21, 37});
  (void)lens;
  const std::vector<std::pair<IoType, std::vector<int64_t>>> out_spec = {
      {IoType::F16, {B, S, G, N}},  {IoType::F16, {B, S, G, N}}, {IoType::F32, {H, N}},
      {IoType::F32, {H, N}},        {IoType::F32, {B, S, H, A}}, {IoType::F32, {B, H, S}},
      {IoType::F16, {B, H, S}}};

  // Compact run.
  std::vector<Buffer> out;
  for (const auto& s : out_spec) out.emplace_back(s.first, s.second);
  ASSERT_EQ(mamba3_compute_dqktheta(in[0].tensor(), in[1].tensor(), in[2].tensor(), in[3].tensor(),
                                    in[4].tensor(), in[5].tensor(), in[6].tensor(), in[7].tensor(),
                                    in[8].tensor(), in[9].tensor(), dok ? in[10].tensor() : nullptr,
                                    64, varlen ? cu.tensor() : nullptr, out[0].tensor(),
                                    out[1].tensor(), out[2].tensor(), out[3].tensor(),
                                    out[4].tensor(), out[5].tensor(), out[6].tensor(), nullptr, 0,
                                    nullptr),
            MAMBA3_OK)
      << mamba3_last_error();

  // The same values in exotic layouts, another chunk size.
  std::vector<Strided> xin, xout;
  for (size_t i = 0; i < in.size(); ++i) {
    xin.push_back(exotic(in[i].type, in[i].shape, static_cast<int>(i)));
    xin.back().fill_from(in[i]);
  }
  Strided xcu(IoType::I64, {4}, {0}, 2, -1);
  xcu.fill_from(cu);
  for (size_t i = 0; i < out_spec.size(); ++i)
    xout.push_back(exotic(out_spec[i].first, out_spec[i].second, static_cast<int>(20 + i)));
  ASSERT_EQ(mamba3_compute_dqktheta(xin[0].t(), xin[1].t(), xin[2].t(), xin[3].t(), xin[4].t(),
                                    xin[5].t(), xin[6].t(), xin[7].t(), xin[8].t(), xin[9].t(),
                                    dok ? xin[10].t() : nullptr, chunk_exotic,
                                    varlen ? xcu.t() : nullptr, xout[0].t(), xout[1].t(),
                                    xout[2].t(), xout[3].t(), xout[4].t(), xout[5].t(),
                                    xout[6].t(), nullptr, 0, nullptr),
            MAMBA3_OK)
      << mamba3_last_error();
  const char* names[] = {"dq", "dk", "dq_bias", "dk_bias", "dangles", "dscale", "dgamma"};
  for (size_t i = 0; i < out.size(); ++i) {
    EXPECT_TRUE(xout[i].compact_bytes() == buffer_bytes(out[i]))
        << names[i] << " differs between compact and strided layouts (varlen=" << varlen
        << " dok=" << dok << ")";
    for (double v : out[i].to_double()) ASSERT_TRUE(std::isfinite(v)) << names[i];
  }
}

TEST(SisoBwdCpu, DqkthetaArbitraryStridesAndChunkSizeGiveIdenticalBits) {
  dqktheta_layout_check(false, false, 16);
  dqktheta_layout_check(false, true, 256);
  dqktheta_layout_check(true, true, 32);
  dqktheta_layout_check(true, false, 128);
}

void ddt_layout_check(bool varlen, bool states) {
  const int64_t B = varlen ? 1 : 2, H = 3, S = 29, N = 12, P = 10;
  const int64_t nseq = varlen ? 4 : B;
  std::mt19937_64 rng(varlen * 2 + states + 5);
  std::vector<Buffer> in = {
      random_buffer(rng, IoType::F32, {B, H, S}, -1, 1),        // dscale
      random_buffer(rng, IoType::BF16, {B, H, S}, -1, 1),       // dgamma
      random_buffer(rng, IoType::F16, {B, H, S}, 0.01, 0.5),    // dt
      random_buffer(rng, IoType::F32, {B, H, S}, -3, 3),        // trap
      random_buffer(rng, IoType::F16, {nseq, H, P, N}, -1, 1),  // d_issm_state
      random_buffer(rng, IoType::BF16, {nseq, H, N}, -1, 1),    // input_k_state
      random_buffer(rng, IoType::F32, {nseq, H, P}, -1, 1),     // input_v_state
  };
  Buffer cu = Buffer::from_double(IoType::I32, {5}, {0, 1, 2, 10, 29});
  const std::vector<std::pair<IoType, std::vector<int64_t>>> out_spec = {
      {IoType::F32, {B, H, S}}, {IoType::F32, {B, H, S}}, {IoType::F16, {nseq, H, P, N}},
      {IoType::F32, {nseq, H, N}}, {IoType::F32, {nseq, H, P}}};
  const size_t nout = states ? 5 : 2;
  std::vector<Buffer> out;
  for (const auto& s : out_spec) out.emplace_back(s.first, s.second);
  auto opt = [&](std::vector<Buffer>& v, size_t i) { return states ? v[i].tensor() : nullptr; };
  ASSERT_EQ(mamba3_compute_ddt_dtrap_dinput_states(
                in[0].tensor(), in[1].tensor(), in[2].tensor(), in[3].tensor(), opt(in, 4),
                opt(in, 5), opt(in, 6), varlen ? cu.tensor() : nullptr, out[0].tensor(),
                out[1].tensor(), opt(out, 2), opt(out, 3), opt(out, 4), nullptr),
            MAMBA3_OK)
      << mamba3_last_error();

  std::vector<Strided> xin, xout;
  for (size_t i = 0; i < in.size(); ++i) {
    xin.push_back(exotic(in[i].type, in[i].shape, static_cast<int>(i + 3)));
    xin.back().fill_from(in[i]);
  }
  Strided xcu(IoType::I32, {5}, {0}, 3, -1);
  xcu.fill_from(cu);
  for (size_t i = 0; i < out_spec.size(); ++i)
    xout.push_back(exotic(out_spec[i].first, out_spec[i].second, static_cast<int>(40 + i)));
  auto xopt = [&](std::vector<Strided>& v, size_t i) { return states ? v[i].t() : nullptr; };
  ASSERT_EQ(mamba3_compute_ddt_dtrap_dinput_states(
                xin[0].t(), xin[1].t(), xin[2].t(), xin[3].t(), xopt(xin, 4), xopt(xin, 5),
                xopt(xin, 6), varlen ? xcu.t() : nullptr, xout[0].t(), xout[1].t(),
                xopt(xout, 2), xopt(xout, 3), xopt(xout, 4), nullptr),
            MAMBA3_OK)
      << mamba3_last_error();
  const char* names[] = {"ddt", "dtrap", "d_input_ssm_state", "d_input_k_state",
                         "d_input_v_state"};
  for (size_t i = 0; i < nout; ++i) {
    EXPECT_TRUE(xout[i].compact_bytes() == buffer_bytes(out[i]))
        << names[i] << " differs between compact and strided layouts (varlen=" << varlen
        << " states=" << states << ")";
    for (double v : out[i].to_double()) ASSERT_TRUE(std::isfinite(v)) << names[i];
  }
  if (states) {  // d_input_ssm_state is a copy of d_issm_state, bit for bit
    EXPECT_TRUE(buffer_bytes(out[2]) == buffer_bytes(in[4]));
  }
}

TEST(SisoBwdCpu, DdtArbitraryStridesGiveIdenticalBits) {
  for (bool varlen : {false, true})
    for (bool states : {false, true}) ddt_layout_check(varlen, states);
}

// ------------------------------------------------------------------ rounding of the stores

// With k = (1, 0), zero biases, dqk = 1 and theta = 0, dgamma = RNE(q0) exactly and
// dscale = RNE(dk_in0) exactly (every other product is an exact 0 or 1 factor), so the fp16 and
// bf16 stores can be checked bit for bit over special and random float32 values.
std::vector<float> rounding_probe_values() {
  // (-0 is left out: a sum that starts from +0 returns +0 for it, which is not a rounding matter.)
  std::vector<float> v = {0.f, 1.f, -1.f, 65504.f, 65519.99f, 65520.f, 65536.f, -70000.f,
                          6.103515625e-05f,        // smallest normal half
                          5.9604644775390625e-08f,  // smallest subnormal half
                          2.98023223876953125e-08f, // half of it: tie to even -> 0
                          2.98023259e-08f,          // just above the tie -> smallest subnormal
                          8.940697e-08f,            // 1.5 ulp subnormal: tie -> 2 ulp
                          1e-30f, -1e-45f, 3.4028235e38f, -3.4028235e38f,
                          std::numeric_limits<float>::infinity(),
                          -std::numeric_limits<float>::infinity(),
                          std::numeric_limits<float>::quiet_NaN(),
                          std::numeric_limits<float>::denorm_min(), 1.00390625f, 1.01171875f,
                          1.0009765625f, 1.0029296875f, 1.00048828125f, 1.00146484375f};
  // Exact ties for bf16 and f16 at many exponents, and random bit patterns.
  for (int e = -20; e <= 20; ++e) {
    v.push_back(std::ldexp(1.f + 1.f / 256.f, e));        // bf16 tie, rounds to even (down)
    v.push_back(std::ldexp(1.f + 3.f / 256.f, e));        // bf16 tie, rounds up
    v.push_back(std::ldexp(1.f + 1.f / 2048.f, e));       // f16 tie down
    v.push_back(std::ldexp(1.f + 3.f / 2048.f, e));       // f16 tie up
  }
  std::mt19937 rng(4242);
  for (int i = 0; i < 4000; ++i) {
    uint32_t u = rng();
    if (i % 2) u = (u & 0x80000000u) | ((u & 0x7fffffffu) % 0x48000000u);  // mostly half range
    float f;
    std::memcpy(&f, &u, 4);
    v.push_back(f);
  }
  return v;
}

void rounding_check(IoType gamma_t, IoType scale_t) {
  const std::vector<float> vals = rounding_probe_values();
  const int64_t S = static_cast<int64_t>(vals.size()), N = 2;
  Buffer q(IoType::F32, {1, S, 1, N}), k(IoType::F32, {1, S, 1, N});
  Buffer scale(scale_t, {1, 1, S}), gamma(gamma_t, {1, 1, S}), dqk(IoType::F32, {1, 1, S});
  Buffer qb(IoType::F32, {1, N}), kb(IoType::F32, {1, N}), ang(IoType::F32, {1, S, 1, 1});
  Buffer dqi(IoType::F32, {1, S, 1, N}), dki(IoType::F32, {1, S, 1, N});
  for (int64_t n = 0; n < N; ++n) qb.set(n, 0.0), kb.set(n, 0.0);
  for (int64_t s = 0; s < S; ++s) {
    q.set(s * N, vals[s]);
    q.set(s * N + 1, 0.0);
    k.set(s * N, 1.0);
    k.set(s * N + 1, 0.0);
    scale.set(s, 1.0);
    gamma.set(s, 0.0);
    dqk.set(s, 1.0);
    ang.set(s, 0.0);
    dqi.set(s * N, 0.0);
    dqi.set(s * N + 1, 0.0);
    dki.set(s * N, vals[s]);
    dki.set(s * N + 1, 0.0);
  }
  Buffer dq(IoType::F32, {1, S, 1, N}), dk(IoType::F32, {1, S, 1, N});
  Buffer dqb(IoType::F32, {1, N}), dkb(IoType::F32, {1, N}), dang(IoType::F32, {1, S, 1, 1});
  Buffer dsc(scale_t, {1, 1, S}), dga(gamma_t, {1, 1, S});
  ASSERT_EQ(mamba3_compute_dqktheta(q.tensor(), k.tensor(), scale.tensor(), gamma.tensor(),
                                    qb.tensor(), kb.tensor(), ang.tensor(), dqi.tensor(),
                                    dki.tensor(), dqk.tensor(), nullptr, 64, nullptr, dq.tensor(),
                                    dk.tensor(), dqb.tensor(), dkb.tensor(), dang.tensor(),
                                    dsc.tensor(), dga.tensor(), nullptr, 0, nullptr),
            MAMBA3_OK)
      << mamba3_last_error();
  int bad = 0;
  for (int64_t s = 0; s < S && bad < 10; ++s) {
    for (const auto& [buf, t, what] :
         {std::make_tuple(&dga, gamma_t, "dgamma"), std::make_tuple(&dsc, scale_t, "dscale")}) {
      uint16_t got, want;
      std::memcpy(&got, buf->bytes.data() + s * 2, 2);
      encode(static_cast<double>(vals[s]), t, &want);
      const bool got_nan = std::isnan(decode(&got, t));
      const bool ok = std::isnan(vals[s]) ? got_nan : (got == want || (vals[s] == 0.f && (got & 0x7fff) == 0));
      if (!ok) {
        ++bad;
        ADD_FAILURE() << what << " " << io_name(t) << " store of " << vals[s] << " (0x" << std::hex
                      << [&] { uint32_t u; std::memcpy(&u, &vals[s], 4); return u; }()
                      << "): got 0x" << got << ", want 0x" << want << std::dec;
      }
    }
  }
}

TEST(SisoBwdCpu, HalfAndBfloat16StoresRoundToNearestEven) {
  rounding_check(IoType::F16, IoType::BF16);
  rounding_check(IoType::BF16, IoType::F16);
}

// ------------------------------------------------------------------ hand-computed values

// compute_dqktheta on a problem small enough to write out: B=1, S=2, G=1, H=2, N=4, A=1, with
// d_ok_state (one sequence, last position 1). Expected values from the formulas of the brief,
// evaluated here in double.
TEST(SisoBwdCpu, DqkthetaHandComputed) {
  const int64_t S = 2, H = 2, N = 4;
  const double q[S][N] = {{0.5, -1.0, 0.25, 2.0}, {1.5, 0.75, -0.5, 1.0}};
  const double k[S][N] = {{-0.25, 0.5, 1.0, -1.5}, {2.0, -0.5, 0.125, 0.5}};
  const double qbias[H][N] = {{0.125, 0.0, -0.25, 0.5}, {-0.5, 0.25, 0.0, 0.0}};
  const double kbias[H][N] = {{0.0, 0.5, 0.25, -0.125}, {0.25, 0.0, -0.5, 1.0}};
  const double theta[S][H] = {{0.3, -1.2}, {2.5, 0.7}};
  const double scale[H][S] = {{0.9, 1.1}, {1.3, 0.6}};
  const double gamma[H][S] = {{0.2, 0.4}, {0.1, 0.3}};
  const double dqk[H][S] = {{0.5, -0.25}, {1.0, 0.75}};
  double dq_in[S][H][N], dk_in[S][H][N], dok[H][N];
  for (int s = 0; s < S; ++s)
    for (int h = 0; h < H; ++h)
      for (int n = 0; n < N; ++n) {
        dq_in[s][h][n] = 0.125 * ((s * 7 + h * 3 + n * 5) % 9) - 0.5;
        dk_in[s][h][n] = 0.25 * ((s * 5 + h * 11 + n * 3) % 7) - 0.75;
      }
  for (int h = 0; h < H; ++h)
    for (int n = 0; n < N; ++n) dok[h][n] = 0.5 - 0.25 * ((h + 2 * n) % 5);

  // Expected, straight from the formulas.
  double e_dq[S][N] = {}, e_dk[S][N] = {}, e_dqb[H][N] = {}, e_dkb[H][N] = {};
  double e_dang[S][H] = {}, e_dsc[H][S] = {}, e_dga[H][S] = {};
  for (int s = 0; s < S; ++s)
    for (int h = 0; h < H; ++h) {
      double qb[N], kb[N], dks[N];
      for (int n = 0; n < N; ++n) qb[n] = q[s][n] + qbias[h][n], kb[n] = k[s][n] + kbias[h][n];
      const double c = std::cos(theta[s][h]), sn = std::sin(theta[s][h]);
      double dot = 0;
      for (int n = 0; n < N; ++n) dot += qb[n] * kb[n];
      e_dga[h][s] = dqk[h][s] * dot;
      const double krot[N] = {kb[0] * c - kb[1] * sn, kb[0] * sn + kb[1] * c, kb[2], kb[3]};
      for (int n = 0; n < N; ++n) e_dsc[h][s] += dk_in[s][h][n] * krot[n];
      for (int n = 0; n < N; ++n) dks[n] = dk_in[s][h][n] * scale[h][s] + (s == S - 1 ? dok[h][n] : 0);
      const double w = dqk[h][s] * gamma[h][s];
      const double* g = dq_in[s][h];
      const double dqp[N] = {g[0] * c + g[1] * sn + w * kb[0], -g[0] * sn + g[1] * c + w * kb[1],
                             g[2] + w * kb[2], g[3] + w * kb[3]};
      const double dkp[N] = {dks[0] * c + dks[1] * sn + w * qb[0],
                             -dks[0] * sn + dks[1] * c + w * qb[1], dks[2] + w * qb[2],
                             dks[3] + w * qb[3]};
      for (int n = 0; n < N; ++n) {
        e_dq[s][n] += dqp[n];
        e_dk[s][n] += dkp[n];
        e_dqb[h][n] += dqp[n];
        e_dkb[h][n] += dkp[n];
      }
      e_dang[s][h] = g[0] * (-qb[0] * sn - qb[1] * c) + g[1] * (qb[0] * c - qb[1] * sn) +
                     dks[0] * (-kb[0] * sn - kb[1] * c) + dks[1] * (kb[0] * c - kb[1] * sn);
    }

  Buffer bq(IoType::F32, {1, S, 1, N}), bk(IoType::F32, {1, S, 1, N});
  Buffer bsc(IoType::F32, {1, H, S}), bga(IoType::F32, {1, H, S}), bdqk(IoType::F32, {1, H, S});
  Buffer bqb(IoType::F32, {H, N}), bkb(IoType::F32, {H, N}), bang(IoType::F32, {1, S, H, 1});
  Buffer bdqi(IoType::F32, {1, S, H, N}), bdki(IoType::F32, {1, S, H, N});
  Buffer bdok(IoType::F32, {1, H, N});
  for (int s = 0; s < S; ++s) {
    for (int n = 0; n < N; ++n) bq.set(s * N + n, q[s][n]), bk.set(s * N + n, k[s][n]);
    for (int h = 0; h < H; ++h) {
      bsc.set(h * S + s, scale[h][s]);
      bga.set(h * S + s, gamma[h][s]);
      bdqk.set(h * S + s, dqk[h][s]);
      bang.set(s * H + h, theta[s][h]);
      for (int n = 0; n < N; ++n) {
        bdqi.set((s * H + h) * N + n, dq_in[s][h][n]);
        bdki.set((s * H + h) * N + n, dk_in[s][h][n]);
      }
    }
  }
  for (int h = 0; h < H; ++h)
    for (int n = 0; n < N; ++n) {
      bqb.set(h * N + n, qbias[h][n]);
      bkb.set(h * N + n, kbias[h][n]);
      bdok.set(h * N + n, dok[h][n]);
    }
  Buffer dq(IoType::F32, {1, S, 1, N}), dk(IoType::F32, {1, S, 1, N});
  Buffer dqb(IoType::F32, {H, N}), dkb(IoType::F32, {H, N}), dang(IoType::F32, {1, S, H, 1});
  Buffer dsc(IoType::F32, {1, H, S}), dga(IoType::F32, {1, H, S});
  ASSERT_EQ(mamba3_compute_dqktheta(bq.tensor(), bk.tensor(), bsc.tensor(), bga.tensor(),
                                    bqb.tensor(), bkb.tensor(), bang.tensor(), bdqi.tensor(),
                                    bdki.tensor(), bdqk.tensor(), bdok.tensor(), 32, nullptr,
                                    dq.tensor(), dk.tensor(), dqb.tensor(), dkb.tensor(),
                                    dang.tensor(), dsc.tensor(), dga.tensor(), nullptr, 0, nullptr),
            MAMBA3_OK)
      << mamba3_last_error();
  const double tol = 2e-6;
  for (int s = 0; s < S; ++s)
    for (int n = 0; n < N; ++n) {
      EXPECT_NEAR(dq.get(s * N + n), e_dq[s][n], tol) << "dq " << s << ',' << n;
      EXPECT_NEAR(dk.get(s * N + n), e_dk[s][n], tol) << "dk " << s << ',' << n;
    }
  for (int h = 0; h < H; ++h) {
    for (int n = 0; n < N; ++n) {
      EXPECT_NEAR(dqb.get(h * N + n), e_dqb[h][n], tol) << "dq_bias " << h << ',' << n;
      EXPECT_NEAR(dkb.get(h * N + n), e_dkb[h][n], tol) << "dk_bias " << h << ',' << n;
    }
    for (int s = 0; s < S; ++s) {
      EXPECT_NEAR(dang.get(s * H + h), e_dang[s][h], tol) << "dangles " << s << ',' << h;
      EXPECT_NEAR(dsc.get(h * S + s), e_dsc[h][s], tol) << "dscale " << h << ',' << s;
      EXPECT_NEAR(dga.get(h * S + s), e_dga[h][s], tol) << "dgamma " << h << ',' << s;
    }
  }
}

// compute_ddt_dtrap_dinput_states, hand-computed: one varlen row with sequences [0,2) and [2,5),
// H=1, states N=3, P=2.
TEST(SisoBwdCpu, DdtHandComputed) {
  const int64_t S = 5, N = 3, P = 2;
  const double dscale[S] = {0.5, -1.0, 0.25, 2.0, -0.75};
  const double dgamma[S] = {1.0, 0.5, -0.5, 0.125, 1.5};
  const double dt[S] = {0.1, 0.2, 0.3, 0.05, 0.4};
  const double trap[S] = {0.0, 1.0, -2.0, 0.5, 3.0};
  const int64_t starts[2] = {0, 2};
  const double kst[2][N] = {{0.5, -1.0, 2.0}, {1.0, 0.25, -0.5}};
  const double vst[2][P] = {{1.5, -0.5}, {-1.0, 2.0}};
  double dissm[2][P][N];
  for (int i = 0; i < 2; ++i)
    for (int p = 0; p < P; ++p)
      for (int n = 0; n < N; ++n) dissm[i][p][n] = 0.25 * ((i * 5 + p * 3 + n) % 6) - 0.5;

  auto sig = [](double x) { return 1 / (1 + std::exp(-x)); };
  double e_ddt[S], e_dtrap[S], e_dk[2][N] = {}, e_dv[2][P] = {};
  for (int t = 0; t < S; ++t) {
    const bool start = t == 0 || t == 2;
    const double dsp = start ? 0 : dscale[t - 1];
    const double lam = sig(trap[t]);
    e_ddt[t] = (dgamma[t] + dscale[t]) * lam + dsp * (1 - lam);
    e_dtrap[t] = ((dgamma[t] + dscale[t]) * dt[t] - dsp * dt[t]) * lam * (1 - lam);
  }
  for (int i = 0; i < 2; ++i) {
    const int64_t t0 = starts[i];
    const double lam0 = sig(trap[t0]), scalar = dt[t0] * (1 - lam0);
    double dsc = 0;
    for (int p = 0; p < P; ++p)
      for (int n = 0; n < N; ++n) {
        e_dv[i][p] += scalar * dissm[i][p][n] * kst[i][n];
        e_dk[i][n] += scalar * dissm[i][p][n] * vst[i][p];
        dsc += dissm[i][p][n] * vst[i][p] * kst[i][n];
      }
    e_ddt[t0] += dsc * (1 - lam0);
    e_dtrap[t0] += dsc * (-dt[t0]) * lam0 * (1 - lam0);
  }

  Buffer bds(IoType::F32, {1, 1, S}), bdg(IoType::F32, {1, 1, S}), bdt(IoType::F32, {1, 1, S}),
      btr(IoType::F32, {1, 1, S});
  for (int t = 0; t < S; ++t)
    bds.set(t, dscale[t]), bdg.set(t, dgamma[t]), bdt.set(t, dt[t]), btr.set(t, trap[t]);
  Buffer bis(IoType::F32, {2, 1, P, N}), bk(IoType::F32, {2, 1, N}), bv(IoType::F32, {2, 1, P});
  for (int i = 0; i < 2; ++i) {
    for (int p = 0; p < P; ++p) {
      bv.set(i * P + p, vst[i][p]);
      for (int n = 0; n < N; ++n) bis.set((i * P + p) * N + n, dissm[i][p][n]);
    }
    for (int n = 0; n < N; ++n) bk.set(i * N + n, kst[i][n]);
  }
  Buffer cu = Buffer::from_double(IoType::I32, {3}, {0, 2, 5});
  Buffer ddt(IoType::F32, {1, 1, S}), dtrap(IoType::F32, {1, 1, S});
  Buffer dis(IoType::F32, {2, 1, P, N}), dks(IoType::F32, {2, 1, N}), dvs(IoType::F32, {2, 1, P});
  ASSERT_EQ(mamba3_compute_ddt_dtrap_dinput_states(
                bds.tensor(), bdg.tensor(), bdt.tensor(), btr.tensor(), bis.tensor(), bk.tensor(),
                bv.tensor(), cu.tensor(), ddt.tensor(), dtrap.tensor(), dis.tensor(), dks.tensor(),
                dvs.tensor(), nullptr),
            MAMBA3_OK)
      << mamba3_last_error();
  const double tol = 1e-6;
  for (int t = 0; t < S; ++t) {
    EXPECT_NEAR(ddt.get(t), e_ddt[t], tol) << "ddt " << t;
    EXPECT_NEAR(dtrap.get(t), e_dtrap[t], tol) << "dtrap " << t;
  }
  for (int i = 0; i < 2; ++i) {
    for (int n = 0; n < N; ++n) EXPECT_NEAR(dks.get(i * N + n), e_dk[i][n], tol) << "dk " << i;
    for (int p = 0; p < P; ++p) EXPECT_NEAR(dvs.get(i * P + p), e_dv[i][p], tol) << "dv " << i;
  }
  EXPECT_TRUE(dis.bytes == bis.bytes);
}

}  // namespace
