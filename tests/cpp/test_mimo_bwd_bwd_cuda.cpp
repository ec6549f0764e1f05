// CUDA backend of mamba3_mimo_bwd_bwd against the float64 golden (SPEC.md section 3).
//
// Tests that need a GPU skip themselves when none is present. The pairwise grid of the CPU suite
// (mimo_bwd_bwd_grid.hpp: dtypes, states / qk_dot dtype, output dtype, R, N, P, C, S with partial
// last chunks, the three dout layouts, D, GQA, B, rotary divisor, padded inputs) runs on the
// device: every one of the 12 outputs is compared with the golden (NaN-poisoned outputs, NaN in
// the segsum / da_cs_rev entries the operator must not read) and every call is repeated to check
// bitwise determinism. Further tests reach the kernels' internal paths: more chunks than scratch
// slots (the chunk kernel's grid-stride loop), long chunk scans, 512-row chunks (R 8, C 64), the
// largest N and P, odd sizes; the upstream reference shapes at a short sequence; arbitrary
// strides and byte offsets (bitwise equal to the compact run); CUDA-graph capture; the workspace
// contract; the shape-specialised planes K3 against the generic one (bitwise). The kernel bodies
// also run on the host in test_mimo_bwd_bwd_emulated.cpp.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "case_log.hpp"
#include "cuda_operands.hpp"
#include "mamba3/mamba3.h"
#include "mamba3_golden/host.hpp"
#include "mamba3_golden/mimo_cases.hpp"
#include "mimo_bwd_bwd_grid.hpp"

#ifdef MAMBA3_GOLDEN_CUDA
#include <cuda_runtime.h>
#endif

namespace {

using namespace mamba3::test;  // expect_pass, record, print_worst, WorstLog
using namespace mamba3::golden;

// ------------------------------------------------------------------ the grid

TEST(MimoBwdBwdCuda, GridMatchesGolden) {
  SKIP_WITHOUT_CUDA();
  const std::vector<MimoBwdBwdCase> cases = mimo_bb::grid();
  WorstLog worst;
  for (const MimoBwdBwdCase& c : cases) {
    const CaseReport r = run_mimo_bwd_bwd_case(c, Device::CUDA, 2);
    expect_pass(r);
    record(worst, r);
  }
  std::printf("[ %zu mimo_bwd_bwd cuda cases ]\n", cases.size());
  print_worst("mimo_bwd_bwd on cuda: grid", worst);
}

// ------------------------------------------------------------------ internal paths

MimoBwdBwdCase base_case(int64_t B, int64_t S, int64_t H, int64_t G, int64_t N, int64_t P,
                         int64_t R, int64_t C, IoType act, MimoDoutKind dout, uint64_t seed) {
  MimoBwdBwdCase c;
  c.B = B, c.S = S, c.H = H, c.G = G, c.N = N, c.P = P, c.R = R, c.chunk = C;
  c.act = act, c.cache = act, c.out = act;
  c.dout = dout;
  c.d = true;
  c.seed = seed;
  return c;
}

void run_all(const std::vector<MimoBwdBwdCase>& cases, const char* title, int repeats = 2) {
  WorstLog worst;
  for (const MimoBwdBwdCase& c : cases) {
    const CaseReport r = run_mimo_bwd_bwd_case(c, Device::CUDA, repeats);
    expect_pass(r);
    record(worst, r);
  }
  print_worst(title, worst);
}

// More chunks than the chunk kernel has scratch slots (kMaxSlots = 396): the grid-stride loop reuses slots;
// long reverse scans over the chunks of one (b, h).
TEST(MimoBwdBwdCuda, ManyChunks) {
  SKIP_WITHOUT_CUDA();
  run_all({base_case(2, 300, 4, 2, 32, 32, 2, 8, IoType::BF16, MimoDoutKind::ReduceO, 11),
           base_case(1, 517, 1, 1, 64, 32, 4, 16, IoType::F32, MimoDoutKind::PerRank, 12),
           base_case(3, 1000, 2, 1, 16, 32, 1, 8, IoType::F16, MimoDoutKind::Packed, 13)},
          "mimo_bwd_bwd on cuda: many chunks");
}

// The largest chunk rows (R 8 x C 64 = 512), the largest N and P, odd sizes (N not a multiple
// of 4, odd P, rank 3, N = 2), a single step.
TEST(MimoBwdBwdCuda, LargeAndOddSizes) {
  SKIP_WITHOUT_CUDA();
  std::vector<MimoBwdBwdCase> cases;
  cases.push_back(base_case(1, 70, 2, 1, 128, 64, 8, 64, IoType::F32, MimoDoutKind::PerRank, 21));
  cases.push_back(base_case(1, 45, 2, 2, 256, 256, 2, 16, IoType::BF16, MimoDoutKind::ReduceO, 22));
  cases.push_back(base_case(1, 40, 2, 1, 256, 128, 4, 32, IoType::F16, MimoDoutKind::Packed, 23));
  MimoBwdBwdCase c = base_case(2, 37, 3, 1, 6, 5, 3, 8, IoType::F32, MimoDoutKind::ReduceO, 24);
  c.rdd = 2;
  cases.push_back(c);
  c = base_case(1, 19, 2, 1, 2, 3, 2, 8, IoType::F16, MimoDoutKind::PerRank, 25);
  c.rdd = 2;
  cases.push_back(c);
  c = base_case(2, 1, 2, 1, 18, 7, 1, 16, IoType::BF16, MimoDoutKind::Packed, 26);
  c.rdd = 2;
  cases.push_back(c);
  run_all(cases, "mimo_bwd_bwd on cuda: large and odd sizes");
}

// The eleven upstream reference shapes (N, P, R, C) at a short sequence (B=1, H=2, S=150: whole
// and partial chunks), bf16 activations and caches, D, the three dout layouts in turn.
TEST(MimoBwdBwdCuda, ReferenceShapesShortSequence) {
  SKIP_WITHOUT_CUDA();
  const auto& shapes = kReferenceShapes;
  const MimoDoutKind layouts[] = {MimoDoutKind::ReduceO, MimoDoutKind::PerRank,
                                  MimoDoutKind::Packed};
  std::vector<MimoBwdBwdCase> cases;
  uint64_t seed = 51;
  int k = 0;
  for (const auto& s : shapes) {
    MimoBwdBwdCase c = base_case(1, 150, 2, 1, s[0], s[1], s[2], s[3], IoType::BF16,
                                 layouts[k++ % 3], seed++);
    c.param = IoType::F32, c.decay = IoType::F32;
    cases.push_back(c);
  }
  run_all(cases, "mimo_bwd_bwd on cuda: reference shapes");
}

// Several repeats of one call: every run bitwise identical (the harness adds the check).
TEST(MimoBwdBwdCuda, BitwiseRepeat) {
  SKIP_WITHOUT_CUDA();
  run_all({base_case(2, 200, 4, 2, 64, 64, 4, 16, IoType::BF16, MimoDoutKind::ReduceO, 61)},
          "mimo_bwd_bwd on cuda: repeats", 4);
}

// ------------------------------------------------------------------ device operands

#ifdef MAMBA3_GOLDEN_CUDA

using namespace mamba3::test::cuda_ops;

const char* kOutNames[] = {"dq",     "dk",  "dv",    "dmimo_v",    "dangles", "dfactor",
                           "dgamma", "dda", "dssda", "dda_cs_rev", "dda_cs",  "dd"};

// A full set of operands (17 inputs in argument order, 12 outputs); decays need not be
// consistent here (these tests compare runs of the backend with each other, not accuracy).
struct Operands {
  int64_t B, S, H, G, N, P, R, C, rdd = 4;
  MimoDoutKind layout;
  bool d;
  std::vector<Buffer> in, out;
  Operands(int64_t B_, int64_t S_, int64_t H_, int64_t G_, int64_t N_, int64_t P_, int64_t R_,
           int64_t C_, MimoDoutKind l, bool d_, IoType act, IoType od, uint64_t seed,
           IoType trap_t = IoType::F32)
      : B(B_), S(S_), H(H_), G(G_), N(N_), P(P_), R(R_), C(C_), layout(l), d(d_) {
    std::mt19937_64 rng(seed);
    const int64_t A = N / rdd, nch = (S + C - 1) / C;
    const IoType F = IoType::F32;
    const std::vector<int64_t> dshape =
        l == MimoDoutKind::ReduceO   ? std::vector<int64_t>{B, S, H, P}
        : l == MimoDoutKind::PerRank ? std::vector<int64_t>{B, S, R, H, P}
                                     : std::vector<int64_t>{B, H, S * R, P};
    in.push_back(rand_buf(rng, act, dshape, -1, 1));                       // dout
    in.push_back(rand_buf(rng, act, {B, S, R, G, N}, -1, 1));              // q
    in.push_back(rand_buf(rng, act, {B, S, R, G, N}, -1, 1));              // k
    in.push_back(rand_buf(rng, act, {B, S, H, P}, -1, 1));                 // v
    in.push_back(rand_buf(rng, F, {H, R, N}, -0.5, 0.5));                  // q_bias
    in.push_back(rand_buf(rng, F, {H, R, N}, -0.5, 0.5));                  // k_bias
    in.push_back(rand_buf(rng, F, {H, R, P}, -1, 1));                      // mimo_v
    in.push_back(rand_buf(rng, act, {B, H, nch, N, P}, -1, 1));            // states
    in.push_back(rand_buf(rng, act, {B, H, S, R, R}, -2, 2));              // qk_dot
    in.push_back(rand_buf(rng, F, {B, H, S}, -2, 0));                      // da_cs
    in.push_back(rand_buf(rng, F, {B, H, S}, -2, 0));                      // da_cs_rev
    in.push_back(rand_buf(rng, F, {B, H, S}, 0.05, 0.6));                  // dt
    in.push_back(rand_buf(rng, trap_t, {B, H, S}, -2, 2));                 // trap
    in.push_back(rand_buf(rng, F, {B, H, nch, C, C}, -2, 0));              // segsum
    in.push_back(rand_buf(rng, F, {B, S, H, A}, -3, 3));                   // angles
    in.push_back(l == MimoDoutKind::ReduceO ? rand_buf(rng, F, {H, R, P}, -1, 1) : Buffer());
    in.push_back(d ? rand_buf(rng, F, {H}, -1, 1) : Buffer());             // d
    out.emplace_back(od, std::vector<int64_t>{B, S * R, H, N});            // dq
    out.emplace_back(od, std::vector<int64_t>{B, S * R, H, N});            // dk
    out.emplace_back(od, std::vector<int64_t>{B, S, H, P});                // dv
    out.emplace_back(F, std::vector<int64_t>{B, H, R, P});                 // dmimo_v
    out.emplace_back(F, std::vector<int64_t>{B, S, H, A});                 // dangles
    for (int i = 0; i < 3; ++i) out.emplace_back(F, std::vector<int64_t>{B, H, S});
    out.emplace_back(F, std::vector<int64_t>{B, H, nch, C, C});            // dssda
    for (int i = 0; i < 2; ++i) out.emplace_back(F, std::vector<int64_t>{B, H, S});
    out.push_back(d ? Buffer(F, {B, H}) : Buffer());                       // dd
  }
};

// The operands on the device (optionally with reversed layouts and byte offsets) and the call.
struct OnDevice {
  Operands& o;
  std::vector<Buffer> hin, hout;  // host images in the device layout
  std::vector<std::unique_ptr<Dev>> din, dout;
  void* ws = nullptr;
  size_t ws_bytes = 0;
  bool reversed;
  OnDevice(Operands& op, bool reversed_layouts) : o(op), reversed(reversed_layouts) {
    for (const Buffer& b : o.in)
      hin.push_back(reversed && !b.shape.empty() ? reversed_layout(b) : b);
    for (const Buffer& b : o.out)
      hout.push_back(reversed && !b.shape.empty() ? reversed_layout(b) : b);
    const int64_t off = reversed ? 3 : 0;
    for (Buffer& b : hin) din.emplace_back(new Dev(&b, off));
    for (Buffer& b : hout) dout.emplace_back(new Dev(&b, off));
    std::vector<DLTensor*> i = ins(), u = outs();
    if (mamba3_mimo_bwd_bwd_workspace_size(i[0], i[1], i[2], i[3], i[4], i[5], i[6], i[7], i[8],
                                           i[9], i[10], i[11], i[12], i[13], i[14], i[15], i[16],
                                           o.C, o.rdd, u[0], u[1], u[2], u[3], u[4], u[5], u[6],
                                           u[7], u[8], u[9], u[10], u[11],
                                           &ws_bytes) != MAMBA3_OK)
      throw std::runtime_error(mamba3_last_error());
    ck(cudaMalloc(&ws, ws_bytes), "cudaMalloc workspace");
  }
  ~OnDevice() { cudaFree(ws); }
  std::vector<DLTensor*> ins() {
    std::vector<DLTensor*> v;
    for (auto& d : din) v.push_back(d->t());
    return v;
  }
  std::vector<DLTensor*> outs() {
    std::vector<DLTensor*> v;
    for (auto& d : dout) v.push_back(d->t());
    return v;
  }
  mamba3_status call(cudaStream_t st, size_t ws_given) {
    std::vector<DLTensor*> i = ins(), u = outs();
    return mamba3_mimo_bwd_bwd(i[0], i[1], i[2], i[3], i[4], i[5], i[6], i[7], i[8], i[9], i[10],
                               i[11], i[12], i[13], i[14], i[15], i[16], o.C, o.rdd, u[0], u[1],
                               u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], ws,
                               ws_given, st);
  }
  // Outputs as logical row-major bytes (absent ones empty).
  std::vector<std::vector<unsigned char>> results() const {
    std::vector<std::vector<unsigned char>> r;
    for (size_t k = 0; k < dout.size(); ++k) {
      if (!dout[k]->host) {
        r.emplace_back();
        continue;
      }
      const std::vector<unsigned char> raw = dout[k]->download();
      r.push_back(reversed ? compact_of(hout[k], raw) : raw);
    }
    return r;
  }
  void poison() {
    for (auto& d : dout) d->poison();
  }
};

void expect_finite(const Operands& op, const std::vector<std::vector<unsigned char>>& res) {
  for (size_t k = 0; k < res.size(); ++k) {
    if (op.out[k].shape.empty()) continue;
    Buffer chk = op.out[k];
    chk.bytes = res[k];
    for (double x : chk.to_double()) ASSERT_TRUE(std::isfinite(x)) << kOutNames[k];
  }
}

#endif  // MAMBA3_GOLDEN_CUDA

TEST(MimoBwdBwdCuda, ArbitraryStridesAndOffsetsGiveIdenticalBits) {
  SKIP_WITHOUT_CUDA();
#ifdef MAMBA3_GOLDEN_CUDA
  struct V {
    MimoDoutKind layout;
    bool d;
    int64_t S;
    IoType act, od;
  };
  for (const V& v : {V{MimoDoutKind::ReduceO, true, 37, IoType::BF16, IoType::F16},
                     V{MimoDoutKind::PerRank, false, 16, IoType::F32, IoType::F32},
                     V{MimoDoutKind::Packed, true, 29, IoType::F16, IoType::BF16}}) {
    Operands op(2, v.S, 4, 2, 32, 24, 2, 8, v.layout, v.d, v.act, v.od, 5 + v.S);
    OnDevice compact(op, false), strided(op, true);
    ASSERT_EQ(compact.call(nullptr, compact.ws_bytes), MAMBA3_OK) << mamba3_last_error();
    ASSERT_EQ(strided.call(nullptr, strided.ws_bytes), MAMBA3_OK) << mamba3_last_error();
    ck(cudaDeviceSynchronize(), "sync");
    const auto a = compact.results(), b = strided.results();
    for (size_t k = 0; k < a.size(); ++k)
      EXPECT_TRUE(a[k] == b[k]) << kOutNames[k] << " differs between compact and strided layouts";
    expect_finite(op, a);
  }
#endif
}

// The planes K1 and K3 specialised to the reference shapes (compile-time N, P, R, C) give the
// bits of the generic planes K1 and K3 (MAMBA3_BB_SPECIALIZED=0) at each of those shapes, whole
// and partial chunks, the three dout layouts in turn; then with the benchmark's operands
// (reduce-O, contiguous, bf16 trap and outputs: bench/bench_mimo_bwd.py's bwd_bwd), which take
// the K1 and K3 specialised to the contiguous layouts too (bb::ArgsCT<.., bb::kCtBwdBwd>; the plan
// test MimoBwdBwdEmulated.PlanPicksContiguousLayoutKernel checks that choice for these dtypes):
// their bits against the generic kernels, against the shape-only copies
// (MAMBA3_BB_CT_LAYOUT=0) and with K1 + K2 for the state chain kernel that these operands take
// (MAMBA3_BB_CHAIN=0); the combined backward's operand set: MimoBwdCombinedCuda.
// ContiguousLayoutKernelGivesIdenticalBits.
TEST(MimoBwdBwdCuda, SpecializedKernelGivesIdenticalBits) {
  SKIP_WITHOUT_CUDA();
#ifdef MAMBA3_GOLDEN_CUDA
  const auto& shapes = kReferenceShapes;
  const MimoDoutKind layouts[] = {MimoDoutKind::ReduceO, MimoDoutKind::PerRank,
                                  MimoDoutKind::Packed};
  int k = 0;
  for (const auto& s : shapes) {
    Operands op(2, 150, 2, 1, s[0], s[1], s[2], s[3], layouts[k % 3], k % 2 == 0, IoType::BF16,
                IoType::BF16, 71 + k);
    ++k;
    OnDevice dev(op, false);
    const auto [spec, gen] = results_default_and_switched_off(dev, "MAMBA3_BB_SPECIALIZED");
    for (size_t j = 0; j < spec.size(); ++j)
      EXPECT_TRUE(spec[j] == gen[j]) << kOutNames[j] << " differs at N" << s[0] << " P" << s[1]
                                     << " R" << s[2] << " C" << s[3];
    expect_finite(op, spec);
  }
  k = 0;
  for (const auto& s : shapes) {
    Operands op(2, 150, 2, 1, s[0], s[1], s[2], s[3], MimoDoutKind::ReduceO, k % 2 == 0,
                IoType::BF16, IoType::BF16, 171 + k, IoType::BF16);
    ++k;
    OnDevice dev(op, false);
    const auto [spec, gen] = results_default_and_switched_off(dev, "MAMBA3_BB_SPECIALIZED");
    for (size_t j = 0; j < spec.size(); ++j)
      EXPECT_TRUE(spec[j] == gen[j]) << kOutNames[j] << " differs at N" << s[0] << " P" << s[1]
                                     << " R" << s[2] << " C" << s[3]
                                     << " (contiguous layouts)";
    // ... and those of the shape-only copy (MAMBA3_BB_CT_LAYOUT=0).
    const auto [cl, shape] = results_default_and_switched_off(dev, "MAMBA3_BB_CT_LAYOUT");
    for (size_t j = 0; j < cl.size(); ++j)
      EXPECT_TRUE(cl[j] == shape[j] && cl[j] == spec[j])
          << kOutNames[j] << " differs from the shape-only K3 at N" << s[0] << " P" << s[1]
          << " R" << s[2] << " C" << s[3];
    // ... and those of K1 + K2 in place of the state chain kernel (MAMBA3_BB_CHAIN=0).
    const auto [ch, k12] = results_default_and_switched_off(dev, "MAMBA3_BB_CHAIN");
    for (size_t j = 0; j < ch.size(); ++j)
      EXPECT_TRUE(ch[j] == k12[j] && ch[j] == spec[j])
          << kOutNames[j] << " differs with K1 + K2 for the state chain at N" << s[0] << " P"
          << s[1] << " R" << s[2] << " C" << s[3];
    expect_finite(op, spec);
  }
#endif
}

// Captured into a CUDA graph (no allocation, no host synchronisation) and replayed: bitwise the
// eager results.
TEST(MimoBwdBwdCuda, GraphCaptureMatchesEager) {
  SKIP_WITHOUT_CUDA();
#ifdef MAMBA3_GOLDEN_CUDA
  Operands op(1, 300, 2, 1, 64, 64, 4, 16, MimoDoutKind::ReduceO, true, IoType::BF16,
              IoType::BF16, 9);
  OnDevice dev(op, false);
  cudaStream_t st;
  ck(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), "stream");
  ASSERT_EQ(dev.call(st, dev.ws_bytes), MAMBA3_OK) << mamba3_last_error();
  ck(cudaStreamSynchronize(st), "sync");
  const auto eager = dev.results();
  expect_finite(op, eager);
  expect_graph_replays_match(
      st, [&] { return dev.call(st, dev.ws_bytes); }, [&] { dev.poison(); },
      [&] { return dev.results(); }, eager);
  cudaStreamDestroy(st);
#endif
}

TEST(MimoBwdBwdCuda, WorkspaceContract) {
  SKIP_WITHOUT_CUDA();
#ifdef MAMBA3_GOLDEN_CUDA
  Operands op(2, 100, 2, 1, 32, 32, 2, 8, MimoDoutKind::PerRank, true, IoType::BF16,
              IoType::F32, 3);
  OnDevice dev(op, false);
  EXPECT_GT(dev.ws_bytes, 0u);
  EXPECT_EQ(dev.call(nullptr, dev.ws_bytes - 1), MAMBA3_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(mamba3_last_error()).find("workspace"), std::string::npos)
      << mamba3_last_error();
  void* saved = dev.ws;
  dev.ws = nullptr;
  EXPECT_EQ(dev.call(nullptr, dev.ws_bytes), MAMBA3_ERROR_INVALID_ARGUMENT);
  dev.ws = saved;
  ASSERT_EQ(dev.call(nullptr, dev.ws_bytes), MAMBA3_OK) << mamba3_last_error();
  ck(cudaDeviceSynchronize(), "sync");
  const auto aligned = dev.results();
  // A workspace that is not 256-byte aligned is fine, and gives the same bits.
  ck(cudaFree(dev.ws), "free");
  void* big = nullptr;
  ck(cudaMalloc(&big, dev.ws_bytes + 64), "cudaMalloc");
  dev.ws = static_cast<char*>(big) + 4;
  dev.poison();
  EXPECT_EQ(dev.call(nullptr, dev.ws_bytes), MAMBA3_OK) << mamba3_last_error();
  ck(cudaDeviceSynchronize(), "sync");
  EXPECT_TRUE(dev.results() == aligned);
  dev.ws = big;  // freed by the destructor
#endif
}

// The workspace-size query and the argument checks of the CUDA path run on the host: they work
// in a CUDA build on a machine without a GPU (the tensors are only described, never touched).
TEST(MimoBwdBwdCuda, WorkspaceQueryAndChecksNeedNoDevice) {
  if (!mamba3_has_cuda()) GTEST_SKIP() << "this build has no CUDA backend";
  const int64_t B = 2, S = 20, H = 2, G = 1, N = 16, P = 8, R = 2, C = 8, A = 4, nch = 3;
  const IoType F = IoType::F32;
  std::vector<Buffer> in, out;
  in.emplace_back(F, std::vector<int64_t>{B, S, R, H, P});  // dout (per rank)
  in.emplace_back(F, std::vector<int64_t>{B, S, R, G, N});  // q
  in.emplace_back(F, std::vector<int64_t>{B, S, R, G, N});  // k
  in.emplace_back(F, std::vector<int64_t>{B, S, H, P});     // v
  in.emplace_back(F, std::vector<int64_t>{H, R, N});
  in.emplace_back(F, std::vector<int64_t>{H, R, N});
  in.emplace_back(F, std::vector<int64_t>{H, R, P});
  in.emplace_back(F, std::vector<int64_t>{B, H, nch, N, P});
  in.emplace_back(F, std::vector<int64_t>{B, H, S, R, R});
  for (int i = 0; i < 4; ++i) in.emplace_back(F, std::vector<int64_t>{B, H, S});
  in.emplace_back(F, std::vector<int64_t>{B, H, nch, C, C});
  in.emplace_back(F, std::vector<int64_t>{B, S, H, A});
  out.emplace_back(F, std::vector<int64_t>{B, S * R, H, N});
  out.emplace_back(F, std::vector<int64_t>{B, S * R, H, N});
  out.emplace_back(F, std::vector<int64_t>{B, S, H, P});
  out.emplace_back(F, std::vector<int64_t>{B, H, R, P});
  out.emplace_back(F, std::vector<int64_t>{B, S, H, A});
  for (int i = 0; i < 3; ++i) out.emplace_back(F, std::vector<int64_t>{B, H, S});
  out.emplace_back(F, std::vector<int64_t>{B, H, nch, C, C});
  for (int i = 0; i < 2; ++i) out.emplace_back(F, std::vector<int64_t>{B, H, S});
  std::vector<DLTensor*> ci, co;
  for (Buffer& b : in) ci.push_back(b.tensor());
  for (Buffer& b : out) co.push_back(b.tensor());
  for (DLTensor* t : ci) t->device = DLDevice{kDLCUDA, 0};
  for (DLTensor* t : co) t->device = DLDevice{kDLCUDA, 0};
  size_t bytes = 0;
  ASSERT_EQ(mamba3_mimo_bwd_bwd_workspace_size(ci[0], ci[1], ci[2], ci[3], ci[4], ci[5], ci[6],
                                               ci[7], ci[8], ci[9], ci[10], ci[11], ci[12],
                                               ci[13], ci[14], nullptr, nullptr, C, 4, co[0],
                                               co[1], co[2], co[3], co[4], co[5], co[6], co[7],
                                               co[8], co[9], co[10], nullptr, &bytes),
            MAMBA3_OK)
      << mamba3_last_error();
  EXPECT_GT(bytes, 0u);
  // Too small a workspace is refused before anything is launched.
  EXPECT_EQ(mamba3_mimo_bwd_bwd(ci[0], ci[1], ci[2], ci[3], ci[4], ci[5], ci[6], ci[7], ci[8],
                                ci[9], ci[10], ci[11], ci[12], ci[13], ci[14], nullptr, nullptr, C,
                                4, co[0], co[1], co[2], co[3], co[4], co[5], co[6], co[7], co[8],
                                co[9], co[10], nullptr, nullptr, bytes, nullptr),
            MAMBA3_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(mamba3_last_error()).find("workspace"), std::string::npos)
      << mamba3_last_error();
}

}  // namespace
