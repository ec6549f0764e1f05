// CPU backend of mamba3_mimo_bwd_bwd against the float64 golden (SPEC.md section 3).
//
// The case grid (mimo_bwd_bwd_grid.hpp, shared with the CUDA suite) is a pairwise covering
// array over every axis of the brief. Each case compares all 12 outputs with the golden (the harness
// NaN-fills the segsum / da_cs_rev entries the operator must not read, and poisons the outputs)
// and repeats the call to check bitwise determinism. Further tests cover what the grid cannot:
// arbitrary strides and byte offsets (bitwise equal to the compact run), S = 1, the threaded
// path on a larger problem, and the refusal of CUDA tensors by a build without the CUDA backend.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "case_log.hpp"
#include "mamba3/mamba3.h"
#include "mamba3_golden/host.hpp"
#include "mamba3_golden/mimo_cases.hpp"
#include "mimo_bwd_bwd_grid.hpp"
#include "pairwise.hpp"

namespace {

using namespace mamba3::test;  // expect_pass, record, print_worst, WorstLog
using namespace mamba3::golden;
using mamba3::test::Assignment;
using mamba3::test::pairwise;

// ------------------------------------------------------------------ the grid (shared)

using namespace mamba3::test::mimo_bb;  // kDtypes ... kPad, DtypeSet, grid()

TEST(MimoBwdBwdCpu, GridMatchesGolden) {
  const std::vector<MimoBwdBwdCase> cases = grid();
  WorstLog worst;
  for (const MimoBwdBwdCase& c : cases) {
    const CaseReport r = run_mimo_bwd_bwd_case(c, Device::CPU, 2);
    expect_pass(r);
    record(worst, r);
  }
  std::printf("[ %zu mimo_bwd_bwd cases ]\n", cases.size());
  print_worst("mimo_bwd_bwd on cpu", worst);
}

TEST(MimoBwdBwdCpu, GridCoversEveryAxisValue) {
  // Guard against a generator or cost-bound change that would silently drop a value of an axis.
  const std::vector<MimoBwdBwdCase> cases = grid();
  auto seen = [&](auto pred) { return std::any_of(cases.begin(), cases.end(), pred); };
  using Case = MimoBwdBwdCase;
  for (const DtypeSet& d : kDtypes)
    EXPECT_TRUE(seen(
        [&](const Case& c) { return c.act == d.act && c.param == d.param && c.decay == d.decay; }));
  for (IoType t : kCache) EXPECT_TRUE(seen([&](const Case& c) { return c.cache == t; }));
  for (IoType t : kOut) EXPECT_TRUE(seen([&](const Case& c) { return c.out == t; }));
  for (int64_t v : kR) EXPECT_TRUE(seen([&](const Case& c) { return c.R == v; })) << v;
  for (int64_t v : kN) EXPECT_TRUE(seen([&](const Case& c) { return c.N == v; })) << v;
  for (int64_t v : kP) EXPECT_TRUE(seen([&](const Case& c) { return c.P == v; })) << v;
  for (int64_t v : kC) EXPECT_TRUE(seen([&](const Case& c) { return c.chunk == v; })) << v;
  for (int64_t v : kS) EXPECT_TRUE(seen([&](const Case& c) { return c.S == v; })) << v;
  for (MimoDoutKind l : kLayout) EXPECT_TRUE(seen([&](const Case& c) { return c.dout == l; }));
  // Tails: S in {33, 40, 50, 100} with C 16 and 32 (every one of these pairs ends in a partial
  // chunk).
  for (int64_t s : {33, 40, 50, 100})
    for (int64_t ch : {16, 32})
      EXPECT_TRUE(seen([&](const Case& c) { return c.S == s && c.chunk == ch; })) << s << " " << ch;
  EXPECT_TRUE(seen([](const Case& c) { return c.S % c.chunk == 0; }));
  EXPECT_TRUE(seen([](const Case& c) { return c.S < c.chunk; }));
  for (MimoDoutKind l : kLayout)
    EXPECT_TRUE(seen([&](const Case& c) { return c.dout == l && c.S % c.chunk != 0; }));
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
  EXPECT_TRUE(seen([](const Case& c) { return c.R == 8 && c.chunk == 64; }));
}

// ------------------------------------------------------------------ edge sizes, threading

TEST(MimoBwdBwdCpu, SingleStep) {
  for (MimoDoutKind l : kLayout) {
    MimoBwdBwdCase c;
    c.B = 2, c.S = 1, c.H = 2, c.N = 16, c.P = 32, c.R = 2, c.chunk = 8, c.d = true, c.dout = l;
    expect_pass(run_mimo_bwd_bwd_case(c, Device::CPU, 2));
  }
}

// Large enough for several threads (B*H items); the result must still match the golden and be
// bitwise reproducible.
TEST(MimoBwdBwdCpu, ThreadedPathMatchesGolden) {
  MimoBwdBwdCase c;
  c.B = 2, c.S = 200, c.H = 4, c.G = 2, c.N = 64, c.P = 64, c.R = 4, c.chunk = 16;
  c.act = IoType::BF16, c.cache = IoType::BF16, c.out = IoType::BF16, c.d = true;
  c.seed = 77;
  expect_pass(run_mimo_bwd_bwd_case(c, Device::CPU, 3));
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

// The operator's arguments for B=2 H=4 G=2 N=16 P=8 R=2 C=8, random values (the decay inputs
// need not be consistent: only layout independence is checked).
struct Problem {
  static constexpr int64_t B = 2, H = 4, G = 2, N = 16, P = 8, R = 2, C = 8, rdd = 4, A = 4;
  int64_t S;
  MimoDoutKind layout;
  bool has_d;
  std::vector<Buffer> in, out;
  Problem(MimoDoutKind l, bool d, int64_t S_) : S(S_), layout(l), has_d(d) {
    const int64_t nch = (S + C - 1) / C;
    std::mt19937_64 rng(static_cast<int>(l) * 8 + d * 4 + S);
    const std::vector<int64_t> dshape =
        l == MimoDoutKind::ReduceO   ? std::vector<int64_t>{B, S, H, P}
        : l == MimoDoutKind::PerRank ? std::vector<int64_t>{B, S, R, H, P}
                                     : std::vector<int64_t>{B, H, S * R, P};
    in.push_back(random_buffer(rng, IoType::BF16, dshape, -1, 1));             // dout
    in.push_back(random_buffer(rng, IoType::F16, {B, S, R, G, N}, -1, 1));     // q
    in.push_back(random_buffer(rng, IoType::F16, {B, S, R, G, N}, -1, 1));     // k
    in.push_back(random_buffer(rng, IoType::F32, {B, S, H, P}, -1, 1));        // v
    in.push_back(random_buffer(rng, IoType::F32, {H, R, N}, -0.5, 0.5));       // q_bias
    in.push_back(random_buffer(rng, IoType::BF16, {H, R, N}, -0.5, 0.5));      // k_bias
    in.push_back(random_buffer(rng, IoType::F32, {H, R, P}, -1, 1));           // mimo_v
    in.push_back(random_buffer(rng, IoType::BF16, {B, H, nch, N, P}, -1, 1));  // states
    in.push_back(random_buffer(rng, IoType::F32, {B, H, S, R, R}, -2, 2));     // qk_dot
    in.push_back(random_buffer(rng, IoType::F32, {B, H, S}, -2, 0));           // da_cs
    in.push_back(random_buffer(rng, IoType::F32, {B, H, S}, -2, 0));           // da_cs_rev
    in.push_back(random_buffer(rng, IoType::F16, {B, H, S}, 0.05, 0.6));       // dt
    in.push_back(random_buffer(rng, IoType::F32, {B, H, S}, -2, 2));           // trap
    in.push_back(random_buffer(rng, IoType::F32, {B, H, nch, C, C}, -2, 0));   // segsum
    in.push_back(random_buffer(rng, IoType::F32, {B, S, H, A}, -3, 3));        // angles
    in.push_back(l == MimoDoutKind::ReduceO ? random_buffer(rng, IoType::F32, {H, R, P}, -1, 1)
                                            : Buffer());                       // mimo_o
    in.push_back(d ? random_buffer(rng, IoType::F32, {H}, -1, 1) : Buffer());  // d
    out.emplace_back(IoType::F16, std::vector<int64_t>{B, S * R, H, N});       // dq
    out.emplace_back(IoType::BF16, std::vector<int64_t>{B, S * R, H, N});      // dk
    out.emplace_back(IoType::F32, std::vector<int64_t>{B, S, H, P});           // dv
    out.emplace_back(IoType::F32, std::vector<int64_t>{B, H, R, P});           // dmimo_v
    out.emplace_back(IoType::F32, std::vector<int64_t>{B, S, H, A});           // dangles
    for (int i = 0; i < 3; ++i) out.emplace_back(IoType::F32, std::vector<int64_t>{B, H, S});
    out.emplace_back(IoType::F32, std::vector<int64_t>{B, H, nch, C, C});  // dssda
    for (int i = 0; i < 2; ++i) out.emplace_back(IoType::F32, std::vector<int64_t>{B, H, S});
    out.push_back(d ? Buffer(IoType::F32, {B, H}) : Buffer());  // dd
  }
  static mamba3_status call(const std::vector<DLTensor*>& i, const std::vector<DLTensor*>& o) {
    return mamba3_mimo_bwd_bwd(i[0], i[1], i[2], i[3], i[4], i[5], i[6], i[7], i[8], i[9], i[10],
                               i[11], i[12], i[13], i[14], i[15], i[16], C, rdd, o[0], o[1], o[2],
                               o[3], o[4], o[5], o[6], o[7], o[8], o[9], o[10], o[11], nullptr, 0,
                               nullptr);
  }
};

const char* kOutNames[] = {"dq",     "dk",  "dv",    "dmimo_v",    "dangles", "dfactor",
                           "dgamma", "dda", "dssda", "dda_cs_rev", "dda_cs",  "dd"};

void layout_check(MimoDoutKind l, bool d, int64_t S) {
  Problem pr(l, d, S);
  std::vector<DLTensor*> ci, co;
  for (Buffer& b : pr.in) ci.push_back(b.numel() && !b.shape.empty() ? b.tensor() : nullptr);
  for (Buffer& b : pr.out) co.push_back(b.numel() && !b.shape.empty() ? b.tensor() : nullptr);
  ASSERT_EQ(Problem::call(ci, co), MAMBA3_OK) << mamba3_last_error();

  std::vector<Strided> xin, xout;
  for (Buffer& b : pr.in) xin.emplace_back(b);
  for (Buffer& b : pr.out) xout.emplace_back(b);
  std::vector<DLTensor*> si, so;
  for (size_t i = 0; i < pr.in.size(); ++i) si.push_back(ci[i] ? xin[i].t() : nullptr);
  for (size_t i = 0; i < pr.out.size(); ++i) so.push_back(co[i] ? xout[i].t() : nullptr);
  ASSERT_EQ(Problem::call(si, so), MAMBA3_OK) << mamba3_last_error();
  for (size_t i = 0; i < pr.out.size(); ++i) {
    if (!co[i]) continue;
    EXPECT_TRUE(xout[i].compact_bytes() == pr.out[i].bytes)
        << kOutNames[i] << " differs between compact and strided layouts";
    for (double x : pr.out[i].to_double()) ASSERT_TRUE(std::isfinite(x)) << kOutNames[i];
  }
}

TEST(MimoBwdBwdCpu, ArbitraryStridesAndOffsetsGiveIdenticalBits) {
  layout_check(MimoDoutKind::ReduceO, true, 19);
  layout_check(MimoDoutKind::PerRank, false, 16);
  layout_check(MimoDoutKind::Packed, true, 13);
}

// A build without the CUDA backend refuses CUDA tensors (the CPU backend never runs on their
// device memory). The CUDA backend itself is tested in test_mimo_bwd_bwd_cuda.cpp.
TEST(MimoBwdBwdCpu, CudaTensorsAreRefusedWithoutTheCudaBackend) {
  if (mamba3_has_cuda()) GTEST_SKIP() << "this build has the CUDA backend";
  Problem pr(MimoDoutKind::ReduceO, true, 12);
  std::vector<DLTensor*> ci, co;
  for (Buffer& b : pr.in) ci.push_back(b.numel() && !b.shape.empty() ? b.tensor() : nullptr);
  for (Buffer& b : pr.out) co.push_back(b.numel() && !b.shape.empty() ? b.tensor() : nullptr);
  for (DLTensor* t : ci)
    if (t) t->device = DLDevice{kDLCUDA, 0};
  for (DLTensor* t : co) t->device = DLDevice{kDLCUDA, 0};
  const std::vector<unsigned char> before = pr.out[0].bytes;
  EXPECT_EQ(Problem::call(ci, co), MAMBA3_ERROR_UNSUPPORTED);
  const std::string msg = mamba3_last_error();
  EXPECT_NE(msg.find("mimo_bwd_bwd"), std::string::npos) << msg;
  EXPECT_NE(msg.find("CUDA"), std::string::npos) << msg;
  EXPECT_NE(msg.find("no CUDA backend"), std::string::npos) << msg;
  EXPECT_TRUE(pr.out[0].bytes == before);  // nothing written
  size_t bytes = 7;
  EXPECT_EQ(mamba3_mimo_bwd_bwd_workspace_size(ci[0], ci[1], ci[2], ci[3], ci[4], ci[5], ci[6],
                                               ci[7], ci[8], ci[9], ci[10], ci[11], ci[12], ci[13],
                                               ci[14], ci[15], ci[16], Problem::C, Problem::rdd,
                                               co[0], co[1], co[2], co[3], co[4], co[5], co[6],
                                               co[7], co[8], co[9], co[10], co[11], &bytes),
            MAMBA3_ERROR_UNSUPPORTED);
}

}  // namespace
