// CPU backend of mamba3_mimo_bwd_fwd against the float64 golden (SPEC.md section 3).
//
// The case grid is a pairwise covering array over every axis of the brief (input dtypes, output
// dtype, R, N, P, C, S with partial last chunks, gate / norm, reduce-O or per-rank dout, D, GQA,
// B, rotary divisor, padded inputs): every pair of axis values that can occur together appears in
// at least one case, and a cost bound keeps the largest combinations out so the suite stays fast.
// Each case compares every output with the golden (the harness NaN-fills the segsum / da_cs_rev
// entries the operator must not read) and repeats the call to check bitwise determinism. Further
// tests cover what the grid cannot: arbitrary strides and byte offsets (bitwise equal to the
// compact run), S = 1, and the threaded path on a larger problem.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <map>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "mamba3/mamba3.h"
#include "mamba3_golden/host.hpp"
#include "mamba3_golden/mimo_cases.hpp"
#include "mimo_bwd_fwd_grid.hpp"
#include "pairwise.hpp"
#include "case_log.hpp"

namespace {

using namespace mamba3::test;  // expect_pass, record, print_worst, WorstLog

using namespace mamba3::golden;
using mamba3::test::Assignment;
using mamba3::test::pairwise;

// ------------------------------------------------------------------ accuracy bookkeeping

// ------------------------------------------------------------------ the grid

using namespace mimo_bf;  // the axes: kDtypes, kOut, kR, kN, kP, kC, kGH, kB, kRdd

const std::vector<int64_t> kS = {5, 33, 40, 50, 64, 100};  // 5: one partial chunk; 64: whole chunks for all C

std::vector<MimoBwdFwdCase> grid() { return mimo_bf::grid({kS, 1.5e8, 20240603, 1}); }

TEST(MimoBwdFwdCpu, GridMatchesGolden) {
  const std::vector<MimoBwdFwdCase> cases = grid();
  WorstLog worst;
  for (const MimoBwdFwdCase& c : cases) {
    const CaseReport r = run_mimo_bwd_fwd_case(c, Device::CPU, 2);
    expect_pass(r);
    record(worst, r);
  }
  std::printf("[ %zu mimo_bwd_fwd cases ]\n", cases.size());
  print_worst("mimo_bwd_fwd on cpu", worst);
}

TEST(MimoBwdFwdCpu, GridCoversEveryAxisValue) {
  // Guard against a generator or cost-bound change that would silently drop a value of an axis.
  const std::vector<MimoBwdFwdCase> cases = grid();
  auto seen = [&](auto pred) { return std::any_of(cases.begin(), cases.end(), pred); };
  using Case = MimoBwdFwdCase;
  for (const DtypeSet& d : kDtypes)
    EXPECT_TRUE(seen([&](const Case& c) {
      return c.act == d.act && c.param == d.param && c.decay == d.decay;
    }));
  for (IoType t : kOut) EXPECT_TRUE(seen([&](const Case& c) { return c.out == t; }));
  for (int64_t v : kR) EXPECT_TRUE(seen([&](const Case& c) { return c.R == v; })) << v;
  for (int64_t v : kN) EXPECT_TRUE(seen([&](const Case& c) { return c.N == v; })) << v;
  for (int64_t v : kP) EXPECT_TRUE(seen([&](const Case& c) { return c.P == v; })) << v;
  for (int64_t v : kC) EXPECT_TRUE(seen([&](const Case& c) { return c.chunk == v; })) << v;
  for (int64_t v : kS) EXPECT_TRUE(seen([&](const Case& c) { return c.S == v; })) << v;
  // Tails: S in {33, 40, 50, 100} with C 16 and 32 (every one of these pairs ends in a partial
  // chunk).
  for (int64_t s : {33, 40, 50, 100})
    for (int64_t ch : {16, 32})
      EXPECT_TRUE(seen([&](const Case& c) { return c.S == s && c.chunk == ch; })) << s << " " << ch;
  EXPECT_TRUE(seen([](const Case& c) { return c.S % c.chunk == 0; }));
  EXPECT_TRUE(seen([](const Case& c) { return c.S < c.chunk; }));
  EXPECT_TRUE(seen([](const Case& c) { return !c.z; }));
  EXPECT_TRUE(seen([](const Case& c) { return c.z && !c.norm && c.reduce_o; }));
  EXPECT_TRUE(seen([](const Case& c) { return c.z && !c.reduce_o; }));
  EXPECT_TRUE(seen([](const Case& c) { return !c.z && !c.reduce_o; }));
  EXPECT_TRUE(seen([](const Case& c) { return c.norm; }));
  EXPECT_TRUE(seen([](const Case& c) { return c.norm && c.S % c.chunk != 0; }));
  EXPECT_TRUE(seen([](const Case& c) { return c.d; }));
  EXPECT_TRUE(seen([](const Case& c) { return !c.d; }));
  for (const auto& gh : kGH)
    EXPECT_TRUE(seen([&](const Case& c) { return c.G == gh[0] && c.H == gh[1]; }));
  for (int64_t v : kB) EXPECT_TRUE(seen([&](const Case& c) { return c.B == v; })) << v;
  for (int64_t v : kRdd) EXPECT_TRUE(seen([&](const Case& c) { return c.rdd == v; })) << v;
  EXPECT_TRUE(seen([](const Case& c) { return c.pad > 0; }));
  EXPECT_TRUE(seen([](const Case& c) { return c.pad == 0; }));
  // The largest head sizes meet the largest rank somewhere (not only tiny combinations).
  EXPECT_TRUE(seen([](const Case& c) { return c.R == 8 && c.N >= 128; }));
  EXPECT_TRUE(seen([](const Case& c) { return c.N == 256 && c.P == 128; }));
}

// ------------------------------------------------------------------ edge sizes, threading

TEST(MimoBwdFwdCpu, SingleStep) {
  for (bool reduce : {true, false}) {
    MimoBwdFwdCase c;
    c.B = 2, c.S = 1, c.H = 2, c.N = 16, c.P = 32, c.R = 2, c.chunk = 8, c.z = true, c.d = true;
    c.reduce_o = reduce;
    c.norm = reduce;
    expect_pass(run_mimo_bwd_fwd_case(c, Device::CPU, 2));
  }
}

// Large enough for several threads (B*H items); the result must still match the golden and be
// bitwise reproducible.
TEST(MimoBwdFwdCpu, ThreadedPathMatchesGolden) {
  MimoBwdFwdCase c;
  c.B = 2, c.S = 200, c.H = 4, c.G = 2, c.N = 64, c.P = 64, c.R = 4, c.chunk = 16;
  c.act = IoType::BF16, c.out = IoType::BF16, c.z = true, c.d = true, c.norm = true;
  c.seed = 77;
  expect_pass(run_mimo_bwd_fwd_case(c, Device::CPU, 3));
}

// ------------------------------------------------------------------ layouts

// A tensor stored with its dimensions in reverse order in memory (so every stride differs from
// the compact one) behind a byte offset; values copied from a compact Buffer.
struct Strided {
  IoType type;
  std::vector<int64_t> shape, strides;
  std::vector<unsigned char> bytes;
  int64_t offset_elems = 3;
  DLTensor dl{};

  explicit Strided(const Buffer& src) : type(src.type), shape(src.shape) {
    if (shape.empty()) return;  // an absent optional argument
    const int nd = static_cast<int>(shape.size());
    strides.assign(nd, 1);
    int64_t s = 1;
    for (int d = 0; d < nd; ++d) {  // dimension 0 is innermost in memory
      strides[d] = s;
      s *= shape[d];
    }
    bytes.assign(static_cast<size_t>((s + offset_elems) * io_size(type)), 0x7f);
    const int64_t n = src.numel();
    for (int64_t i = 0; i < n; ++i) encode(src.get(i), type, elem(i));
  }
  unsigned char* elem(int64_t flat) {
    int64_t off = offset_elems;
    for (int d = static_cast<int>(shape.size()) - 1; d >= 0; --d) {
      off += (flat % shape[d]) * strides[d];
      flat /= shape[d];
    }
    return bytes.data() + off * io_size(type);
  }
  DLTensor* t() {
    dl.data = bytes.data();
    dl.byte_offset = static_cast<uint64_t>(offset_elems * io_size(type));
    dl.device = DLDevice{kDLCPU, 0};
    dl.ndim = static_cast<int32_t>(shape.size());
    dl.dtype = io_dl(type);
    dl.shape = shape.data();
    dl.strides = strides.data();
    return &dl;
  }
  // The logical row-major bytes (for comparison with a compact Buffer).
  std::vector<unsigned char> compact_bytes() {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    std::vector<unsigned char> out(static_cast<size_t>(n * io_size(type)));
    for (int64_t i = 0; i < n; ++i)
      std::copy_n(elem(i), io_size(type), out.data() + i * io_size(type));
    return out;
  }
};

Buffer random_buffer(std::mt19937_64& rng, IoType t, std::vector<int64_t> shape, double lo,
                     double hi) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return Buffer::from_double(t, std::move(shape), uniform(rng, n, lo, hi, t));
}

void layout_check(bool reduce, bool z, bool norm, int64_t S) {
  const int64_t B = 2, H = 4, G = 2, N = 16, P = 8, R = 2, C = 8, rdd = 4, A = N / rdd;
  const int64_t nch = (S + C - 1) / C;
  std::mt19937_64 rng(reduce * 4 + z * 2 + norm + S);
  // Inputs in the operator's argument order; absent optionals stay empty.
  std::vector<Buffer> in;
  in.push_back(reduce ? random_buffer(rng, IoType::BF16, {B, S, H, P}, -1, 1)
                      : random_buffer(rng, IoType::BF16, {B, S, R, H, P}, -1, 1));  // dout
  in.push_back(random_buffer(rng, IoType::F16, {B, S, R, G, N}, -1, 1));             // q
  in.push_back(random_buffer(rng, IoType::F16, {B, S, R, G, N}, -1, 1));             // k
  in.push_back(random_buffer(rng, IoType::F32, {B, S, H, P}, -1, 1));                // v
  in.push_back(random_buffer(rng, IoType::F32, {H, R, N}, -0.5, 0.5));               // q_bias
  in.push_back(random_buffer(rng, IoType::BF16, {H, R, N}, -0.5, 0.5));              // k_bias
  in.push_back(random_buffer(rng, IoType::F32, {H, R, P}, -1, 1));                   // mimo_v
  in.push_back(reduce ? random_buffer(rng, IoType::F32, {H, R, P}, -1, 1) : Buffer());  // mimo_o
  in.push_back(random_buffer(rng, IoType::F32, {B, S, H, A}, -3, 3));                // angles
  in.push_back(random_buffer(rng, IoType::F32, {B, H, S}, -2, 0));                   // da_cs
  in.push_back(random_buffer(rng, IoType::F32, {B, H, S}, -2, 0));                   // da_cs_rev
  in.push_back(random_buffer(rng, IoType::F16, {B, H, S}, 0.05, 0.6));               // dt
  in.push_back(random_buffer(rng, IoType::F32, {B, H, S}, -2, 2));                   // trap
  in.push_back(random_buffer(rng, IoType::F32, {B, H, nch, C, C}, -2, 0));           // segsum
  in.push_back(z ? random_buffer(rng, IoType::F32, {H, R, P}, -1.5, 1.5) : Buffer());  // mimo_z
  in.push_back(random_buffer(rng, IoType::F32, {H}, -1, 1));                         // d
  in.push_back(z ? random_buffer(rng, IoType::BF16, {B, S, H, P}, -2, 2) : Buffer());  // z
  in.push_back(norm ? random_buffer(rng, IoType::F32, {H, P}, 0.5, 1.5) : Buffer());  // norm_w
  const IoType od = IoType::F16;
  std::vector<Buffer> out;
  out.emplace_back(od, std::vector<int64_t>{B, H, nch, N, P});                      // states
  out.emplace_back(od, std::vector<int64_t>{B, H, S, R, R});                        // qk_dot
  out.push_back(reduce ? Buffer(IoType::F32, {B, H, R, P}) : Buffer());             // dmimo_o
  out.push_back(z ? Buffer(IoType::F32, {B, H, R, P}) : Buffer());                  // dmimo_z
  out.push_back(z ? Buffer(od, {B, S, H, P}) : Buffer());                           // dz
  out.push_back(norm ? Buffer(IoType::F32, {B, H, R, P}) : Buffer());               // dnorm_weight
  out.push_back(norm ? Buffer(od, {B, H, S * R, P}) : Buffer());                    // dout_pre_rms

  auto call = [&](std::vector<DLTensor*> i, std::vector<DLTensor*> o) {
    return mamba3_mimo_bwd_fwd(i[0], i[1], i[2], i[3], i[4], i[5], i[6], i[7], i[8], i[9], i[10],
                               i[11], i[12], i[13], i[14], i[15], i[16], i[17], 1e-5, C, rdd, o[0],
                               o[1], o[2], o[3], o[4], o[5], o[6], nullptr, 0, nullptr);
  };
  std::vector<DLTensor*> ci, co;
  for (Buffer& b : in) ci.push_back(b.numel() && !b.shape.empty() ? b.tensor() : nullptr);
  for (Buffer& b : out) co.push_back(b.numel() && !b.shape.empty() ? b.tensor() : nullptr);
  ASSERT_EQ(call(ci, co), MAMBA3_OK) << mamba3_last_error();

  std::vector<Strided> xin, xout;
  for (Buffer& b : in) xin.emplace_back(b);
  for (Buffer& b : out) xout.emplace_back(b);
  std::vector<DLTensor*> si, so;
  for (size_t i = 0; i < in.size(); ++i) si.push_back(ci[i] ? xin[i].t() : nullptr);
  for (size_t i = 0; i < out.size(); ++i) so.push_back(co[i] ? xout[i].t() : nullptr);
  ASSERT_EQ(call(si, so), MAMBA3_OK) << mamba3_last_error();
  const char* names[] = {"states", "qk_dot", "dmimo_o", "dmimo_z", "dz", "dnorm_weight",
                         "dout_pre_rms"};
  for (size_t i = 0; i < out.size(); ++i) {
    if (!co[i]) continue;
    EXPECT_TRUE(xout[i].compact_bytes() == out[i].bytes)
        << names[i] << " differs between compact and strided layouts";
    for (double x : out[i].to_double()) ASSERT_TRUE(std::isfinite(x)) << names[i];
  }
}

TEST(MimoBwdFwdCpu, ArbitraryStridesAndOffsetsGiveIdenticalBits) {
  layout_check(true, true, true, 19);
  layout_check(true, false, false, 16);
  layout_check(false, true, false, 13);
  layout_check(false, false, false, 8);
}

}  // namespace
