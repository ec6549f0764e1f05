// CUDA backend of mamba3_mimo_bwd_fwd against the float64 golden (SPEC.md section 3).
//
// Every test skips when no CUDA device is present. A pairwise grid over every axis of the brief
// (dtype sets, output dtype, R, N, P, C, S with partial last chunks, gate / norm, reduce-O or
// per-rank dout, D, GQA, B, rotary divisor, padded inputs) compares every output with the golden
// and repeats each call to check bitwise determinism. Further tests reach the kernels' internal
// paths on a device with about 227 KB of shared memory per block (H100/H200): many segments
// (local scan + segment combine), a P split of the state, the deferred epilogue (RMSNorm with a
// P split), chunks processed in step blocks; the upstream reference shapes at a short sequence;
// arbitrary strides and byte offsets (bitwise equal to the compact run); CUDA-graph capture; the
// workspace contract. A disabled-by-default benchmark times the reference shape
// (--gtest_also_run_disabled_tests); it asserts nothing about time.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <map>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "mamba3/mamba3.h"
#include "mamba3_golden/host.hpp"
#include "mamba3_golden/mimo_cases.hpp"
#include "mimo_bwd_fwd_grid.hpp"
#include "pairwise.hpp"
#include "case_log.hpp"
#include "cuda_operands.hpp"

#ifdef MAMBA3_GOLDEN_CUDA
#include <cuda_runtime.h>
#endif

namespace {

using namespace mamba3::test;  // expect_pass, record, print_worst, WorstLog

using namespace mamba3::golden;
using mamba3::test::Assignment;
using mamba3::test::pairwise;

// ------------------------------------------------------------------ the grid

using namespace mimo_bf;  // the axes: kDtypes, kOut, kR, kN, kP, kC, kGH, kB, kRdd

const std::vector<int64_t> kS = {5, 33, 40, 50, 64, 100, 300};  // 5: one partial chunk; 300: segments

std::vector<MimoBwdFwdCase> grid() { return mimo_bf::grid({kS, 3e8, 20250117, 1001}); }

TEST(MimoBwdFwdCuda, GridMatchesGolden) {
  SKIP_WITHOUT_CUDA();
  const std::vector<MimoBwdFwdCase> cases = grid();
  WorstLog worst;
  for (const MimoBwdFwdCase& c : cases) {
    const CaseReport r = run_mimo_bwd_fwd_case(c, Device::CUDA, 2);
    expect_pass(r);
    record(worst, r);
  }
  std::printf("[ %zu mimo_bwd_fwd cuda cases ]\n", cases.size());
  print_worst("mimo_bwd_fwd on cuda: grid", worst);
}

// ------------------------------------------------------------------ internal paths

MimoBwdFwdCase base_case(int64_t B, int64_t S, int64_t H, int64_t N, int64_t P, int64_t R,
                         int64_t C, IoType act, uint64_t seed) {
  MimoBwdFwdCase c;
  c.B = B, c.S = S, c.H = H, c.G = 1, c.N = N, c.P = P, c.R = R, c.chunk = C;
  c.act = act, c.out = act;
  c.z = true, c.d = true;
  c.seed = seed;
  return c;
}

// One (b, h) and a long sequence: the chunk sequence is cut into many segments (local scan of
// the sub-segments, serial combine, then the chunk pass from the combined states).
TEST(MimoBwdFwdCuda, ManySegments) {
  SKIP_WITHOUT_CUDA();
  WorstLog worst;
  for (IoType t : {IoType::F32, IoType::BF16}) {
    MimoBwdFwdCase c = base_case(1, 1003, 1, 64, 64, 4, 8, t, 11);
    const CaseReport r = run_mimo_bwd_fwd_case(c, Device::CUDA, 2);
    expect_pass(r);
    record(worst, r);
    c = base_case(2, 517, 1, 32, 32, 2, 16, t, 12);
    c.reduce_o = false;
    const CaseReport r2 = run_mimo_bwd_fwd_case(c, Device::CUDA, 2);
    expect_pass(r2);
    record(worst, r2);
  }
  print_worst("mimo_bwd_fwd on cuda: many segments", worst);
}

// State [N, P] too large for one CTA's shared memory: P split across CTAs; with the RMSNorm the
// epilogue (which needs whole P rows) runs in its own kernel from Y in the workspace.
TEST(MimoBwdFwdCuda, StateSplitOverP) {
  SKIP_WITHOUT_CUDA();
  WorstLog worst;
  for (bool norm : {false, true})
    for (IoType t : {IoType::F32, IoType::BF16}) {
      MimoBwdFwdCase c = base_case(1, 70, 2, 256, 256, 2, 16, t, 21 + norm);
      c.norm = norm;
      const CaseReport r = run_mimo_bwd_fwd_case(c, Device::CUDA, 2);
      expect_pass(r);
      record(worst, r);
    }
  // P not a multiple of the tile width; odd rank.
  MimoBwdFwdCase c = base_case(2, 45, 2, 256, 200, 3, 16, IoType::F16, 23);
  const CaseReport r = run_mimo_bwd_fwd_case(c, Device::CUDA, 2);
  expect_pass(r);
  record(worst, r);
  print_worst("mimo_bwd_fwd on cuda: P split", worst);
}

// Chunk tiles too large for shared memory: each chunk runs in blocks of steps (queries block by
// block against the earlier key blocks).
TEST(MimoBwdFwdCuda, ChunkInStepBlocks) {
  SKIP_WITHOUT_CUDA();
  WorstLog worst;
  {
    MimoBwdFwdCase c = base_case(1, 150, 2, 256, 128, 4, 64, IoType::F32, 31);
    const CaseReport r = run_mimo_bwd_fwd_case(c, Device::CUDA, 2);
    expect_pass(r);
    record(worst, r);
  }
  {
    MimoBwdFwdCase c = base_case(1, 90, 2, 256, 128, 8, 64, IoType::BF16, 32);
    c.norm = true;
    const CaseReport r = run_mimo_bwd_fwd_case(c, Device::CUDA, 2);
    expect_pass(r);
    record(worst, r);
  }
  {
    MimoBwdFwdCase c = base_case(1, 77, 2, 128, 256, 8, 32, IoType::F16, 33);
    c.reduce_o = false;
    const CaseReport r = run_mimo_bwd_fwd_case(c, Device::CUDA, 2);
    expect_pass(r);
    record(worst, r);
  }
  print_worst("mimo_bwd_fwd on cuda: step blocks", worst);
}

// Odd sizes: N not a multiple of 4 (padded tiles), P not a multiple of 4, rank 3, one step.
TEST(MimoBwdFwdCuda, OddSizes) {
  SKIP_WITHOUT_CUDA();
  MimoBwdFwdCase c = base_case(2, 37, 3, 6, 5, 3, 8, IoType::F32, 41);
  c.rdd = 2;
  expect_pass(run_mimo_bwd_fwd_case(c, Device::CUDA, 2));
  c = base_case(1, 1, 2, 18, 7, 1, 16, IoType::BF16, 42);
  c.rdd = 2;
  c.norm = true;
  expect_pass(run_mimo_bwd_fwd_case(c, Device::CUDA, 2));
  c = base_case(1, 19, 2, 2, 3, 2, 8, IoType::F16, 43);
  c.rdd = 2;
  c.reduce_o = false;
  expect_pass(run_mimo_bwd_fwd_case(c, Device::CUDA, 2));
}

// The eleven upstream reference shapes (N, P, R, C) at a short sequence (B=1, H=2, S=160: whole
// and partial chunks), bf16 activations, gate and D.
TEST(MimoBwdFwdCuda, ReferenceShapesShortSequence) {
  SKIP_WITHOUT_CUDA();
  const auto& shapes = kReferenceShapes;
  WorstLog worst;
  uint64_t seed = 51;
  for (const auto& s : shapes) {
    MimoBwdFwdCase c = base_case(1, 160, 2, s[0], s[1], s[2], s[3], IoType::BF16, seed++);
    const CaseReport r = run_mimo_bwd_fwd_case(c, Device::CUDA, 2);
    expect_pass(r);
    record(worst, r);
  }
  print_worst("mimo_bwd_fwd on cuda: reference shapes", worst);
}

// ------------------------------------------------------------------ device operands

#ifdef MAMBA3_GOLDEN_CUDA

using namespace mamba3::test::cuda_ops;

// A full set of operands (inputs in the argument order, outputs) for the tests below.
struct MimoOperands {
  int64_t B, S, H, G, N, P, R, C, rdd = 4;
  bool reduce, z, norm;
  std::vector<Buffer> in, out;
  MimoOperands(int64_t B_, int64_t S_, int64_t H_, int64_t G_, int64_t N_, int64_t P_, int64_t R_,
               int64_t C_, bool reduce_, bool z_, bool norm_, IoType act, IoType od, uint64_t seed,
               IoType trap_t = IoType::F32)
      : B(B_), S(S_), H(H_), G(G_), N(N_), P(P_), R(R_), C(C_), reduce(reduce_), z(z_),
        norm(norm_) {
    std::mt19937_64 rng(seed);
    const int64_t A = N / rdd, nch = (S + C - 1) / C;
    const IoType F = IoType::F32;
    in.push_back(reduce ? rand_buf(rng, act, {B, S, H, P}, -1, 1)
                        : rand_buf(rng, act, {B, S, R, H, P}, -1, 1));          // dout
    in.push_back(rand_buf(rng, act, {B, S, R, G, N}, -1, 1));                  // q
    in.push_back(rand_buf(rng, act, {B, S, R, G, N}, -1, 1));                  // k
    in.push_back(rand_buf(rng, act, {B, S, H, P}, -1, 1));                     // v
    in.push_back(rand_buf(rng, F, {H, R, N}, -0.5, 0.5));                      // q_bias
    in.push_back(rand_buf(rng, F, {H, R, N}, -0.5, 0.5));                      // k_bias
    in.push_back(rand_buf(rng, F, {H, R, P}, -1, 1));                          // mimo_v
    in.push_back(reduce ? rand_buf(rng, F, {H, R, P}, -1, 1) : Buffer());      // mimo_o
    in.push_back(rand_buf(rng, F, {B, S, H, A}, -3, 3));                       // angles
    in.push_back(rand_buf(rng, F, {B, H, S}, -2, 0));                          // da_cs
    in.push_back(rand_buf(rng, F, {B, H, S}, -2, 0));                          // da_cs_rev
    in.push_back(rand_buf(rng, F, {B, H, S}, 0.05, 0.6));                      // dt
    in.push_back(rand_buf(rng, trap_t, {B, H, S}, -2, 2));                     // trap
    in.push_back(rand_buf(rng, F, {B, H, nch, C, C}, -2, 0));                  // segsum
    in.push_back(z ? rand_buf(rng, F, {H, R, P}, -1.5, 1.5) : Buffer());       // mimo_z
    in.push_back(rand_buf(rng, F, {H}, -1, 1));                                // d
    in.push_back(z ? rand_buf(rng, act, {B, S, H, P}, -2, 2) : Buffer());      // z
    in.push_back(norm ? rand_buf(rng, F, {H, P}, 0.5, 1.5) : Buffer());        // norm_weight
    out.emplace_back(od, std::vector<int64_t>{B, H, nch, N, P});                // states
    out.emplace_back(od, std::vector<int64_t>{B, H, S, R, R});                  // qk_dot
    out.push_back(reduce ? Buffer(F, {B, H, R, P}) : Buffer());                 // dmimo_o
    out.push_back(z ? Buffer(F, {B, H, R, P}) : Buffer());                      // dmimo_z
    out.push_back(z ? Buffer(od, {B, S, H, P}) : Buffer());                     // dz
    out.push_back(norm ? Buffer(F, {B, H, R, P}) : Buffer());                   // dnorm_weight
    out.push_back(norm ? Buffer(od, {B, H, S * R, P}) : Buffer());              // dout_pre_rms
  }
};

// The operands on the device (optionally with reversed layouts and byte offsets) and the call.
struct MimoDevice {
  MimoOperands& o;
  std::vector<Buffer> hin, hout;  // host images in the device layout
  std::vector<std::unique_ptr<Dev>> din, dout;
  void* ws = nullptr;
  size_t ws_bytes = 0;
  bool reversed;
  MimoDevice(MimoOperands& op, bool reversed_layouts) : o(op), reversed(reversed_layouts) {
    for (const Buffer& b : o.in) hin.push_back(reversed && !b.shape.empty() ? reversed_layout(b) : b);
    for (const Buffer& b : o.out) hout.push_back(reversed && !b.shape.empty() ? reversed_layout(b) : b);
    const int64_t off = reversed ? 3 : 0;
    for (Buffer& b : hin) din.emplace_back(new Dev(&b, off));
    for (Buffer& b : hout) dout.emplace_back(new Dev(&b, off));
    std::vector<DLTensor*> i = ins(), u = outs();
    if (mamba3_mimo_bwd_fwd_workspace_size(i[0], i[1], i[2], i[3], i[4], i[5], i[6], i[7], i[8],
                                           i[9], i[10], i[11], i[12], i[13], i[14], i[15], i[16],
                                           i[17], 1e-5, o.C, o.rdd, u[0], u[1], u[2], u[3], u[4],
                                           u[5], u[6], &ws_bytes) != MAMBA3_OK)
      throw std::runtime_error(mamba3_last_error());
    ck(cudaMalloc(&ws, ws_bytes), "cudaMalloc workspace");
  }
  ~MimoDevice() { cudaFree(ws); }
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
    return mamba3_mimo_bwd_fwd(i[0], i[1], i[2], i[3], i[4], i[5], i[6], i[7], i[8], i[9], i[10],
                               i[11], i[12], i[13], i[14], i[15], i[16], i[17], 1e-5, o.C, o.rdd,
                               u[0], u[1], u[2], u[3], u[4], u[5], u[6], ws, ws_given, st);
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
    for (auto& d : dout)
      if (d->host) ck(cudaMemset(d->ptr, 0x7f, d->host->bytes.size() + d->offset), "memset");
  }
};

#endif  // MAMBA3_GOLDEN_CUDA

TEST(MimoBwdFwdCuda, ArbitraryStridesAndOffsetsGiveIdenticalBits) {
  SKIP_WITHOUT_CUDA();
#ifdef MAMBA3_GOLDEN_CUDA
  const char* names[] = {"states", "qk_dot", "dmimo_o", "dmimo_z", "dz", "dnorm_weight",
                         "dout_pre_rms"};
  struct V {
    bool reduce, z, norm;
    int64_t S;
    IoType act, od;
  };
  for (const V& v : {V{true, true, true, 37, IoType::BF16, IoType::F16},
                     V{true, false, false, 16, IoType::F32, IoType::F32},
                     V{false, true, false, 29, IoType::F16, IoType::BF16},
                     V{false, false, false, 8, IoType::BF16, IoType::F32}}) {
    MimoOperands op(2, v.S, 4, 2, 32, 24, 2, 8, v.reduce, v.z, v.norm, v.act, v.od, 5 + v.S);
    MimoDevice compact(op, false), strided(op, true);
    ASSERT_EQ(compact.call(nullptr, compact.ws_bytes), MAMBA3_OK) << mamba3_last_error();
    ASSERT_EQ(strided.call(nullptr, strided.ws_bytes), MAMBA3_OK) << mamba3_last_error();
    ck(cudaDeviceSynchronize(), "sync");
    const auto a = compact.results(), b = strided.results();
    for (size_t k = 0; k < a.size(); ++k) {
      EXPECT_TRUE(a[k] == b[k]) << names[k] << " differs between compact and strided layouts";
      if (!op.out[k].shape.empty()) {
        Buffer chk = op.out[k];
        chk.bytes = a[k];
        for (double x : chk.to_double()) ASSERT_TRUE(std::isfinite(x)) << names[k];
      }
    }
  }
#endif
}

// The lean kernels specialised to the reference shapes (compile-time N, P, R, C) give the bits
// of the generic lean kernels (MAMBA3_MIMO_SPECIALIZED=0) at each of those shapes (R1 C64 since
// session 16, after lean_scores' diagonal product was kept from an FMA contraction): reduce-O with
// the gate (bf16 dz: the specialised epilogue), with the gate and the norm, per-rank dout without
// the gate; whole and partial chunks.
TEST(MimoBwdFwdCuda, SpecializedKernelsGiveIdenticalBits) {
  SKIP_WITHOUT_CUDA();
#ifdef MAMBA3_GOLDEN_CUDA
  const auto& shapes = kReferenceShapes;
  struct V {
    bool reduce, z, norm;
  };
  const V variants[] = {{true, true, false}, {true, true, true}, {false, false, false}};
  int k = 0;
  for (const auto& s : shapes) {
    for (const V& v : variants) {
      MimoOperands op(2, 150, 2, 1, s[0], s[1], s[2], s[3], v.reduce, v.z, v.norm, IoType::BF16,
                      IoType::BF16, 91 + k++);
      MimoDevice dev(op, false);
      const auto [spec, gen] = results_default_and_switched_off(dev, "MAMBA3_MIMO_SPECIALIZED");
      for (size_t j = 0; j < spec.size(); ++j)
        EXPECT_TRUE(spec[j] == gen[j]) << "output " << j << " differs at N" << s[0] << " P"
                                       << s[1] << " R" << s[2] << " C" << s[3] << " reduce "
                                       << v.reduce << " z " << v.z << " norm " << v.norm;
    }
  }
  // The benchmark's bwd_fwd operands (bench/bench_mimo_bwd.py: bf16 activations, outputs and
  // trap, fp32 parameters and decays, reduce-O with Z and D, no norm, contiguous), which take
  // the K3 and K1 specialised to the contiguous layouts too (MbArgsCT<.., true>; K1 where the
  // plan has segments): their bits equal the shape-only copies' (MAMBA3_MIMO_CT_LAYOUT=0) and
  // the generic kernels' (MAMBA3_MIMO_SPECIALIZED=0).
  for (const auto& s : shapes) {
    MimoOperands op(2, 150, 2, 1, s[0], s[1], s[2], s[3], true, true, false, IoType::BF16,
                    IoType::BF16, 191 + k++, IoType::BF16);
    MimoDevice dev(op, false);
    const auto [ct, shape_only] = results_default_and_switched_off(dev, "MAMBA3_MIMO_CT_LAYOUT");
    const auto [ct2, gen] = results_default_and_switched_off(dev, "MAMBA3_MIMO_SPECIALIZED");
    for (size_t j = 0; j < ct.size(); ++j) {
      EXPECT_TRUE(ct[j] == shape_only[j]) << "output " << j << " differs (contiguous-layout K3 vs "
                                          << "shape-only) at N" << s[0] << " P" << s[1] << " R"
                                          << s[2] << " C" << s[3];
      EXPECT_TRUE(ct2[j] == gen[j]) << "output " << j << " differs (contiguous-layout K3 vs "
                                    << "generic) at N" << s[0] << " P" << s[1] << " R" << s[2]
                                    << " C" << s[3];
    }
  }
#endif
}

// Captured into a CUDA graph (no allocation, no host synchronisation) and replayed: bitwise the
// eager results.
TEST(MimoBwdFwdCuda, GraphCaptureMatchesEager) {
  SKIP_WITHOUT_CUDA();
#ifdef MAMBA3_GOLDEN_CUDA
  MimoOperands op(1, 300, 2, 1, 64, 64, 4, 16, true, true, true, IoType::BF16, IoType::BF16, 9);
  MimoDevice dev(op, false);
  cudaStream_t st;
  ck(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), "stream");
  ASSERT_EQ(dev.call(st, dev.ws_bytes), MAMBA3_OK) << mamba3_last_error();
  ck(cudaStreamSynchronize(st), "sync");
  const auto eager = dev.results();
  expect_graph_replays_match(
      st, [&] { return dev.call(st, dev.ws_bytes); }, [&] { dev.poison(); },
      [&] { return dev.results(); }, eager);
  cudaStreamDestroy(st);
#endif
}

TEST(MimoBwdFwdCuda, WorkspaceContract) {
  SKIP_WITHOUT_CUDA();
#ifdef MAMBA3_GOLDEN_CUDA
  MimoOperands op(2, 100, 2, 1, 32, 32, 2, 8, true, true, false, IoType::BF16, IoType::F32, 3);
  MimoDevice dev(op, false);
  EXPECT_GT(dev.ws_bytes, 0u);
  EXPECT_EQ(dev.call(nullptr, dev.ws_bytes - 1), MAMBA3_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(mamba3_last_error()).find("workspace"), std::string::npos)
      << mamba3_last_error();
  void* saved = dev.ws;
  dev.ws = nullptr;
  EXPECT_EQ(dev.call(nullptr, dev.ws_bytes), MAMBA3_ERROR_INVALID_ARGUMENT);
  dev.ws = saved;
  // A workspace that is not 256-byte aligned is fine.
  char* base = static_cast<char*>(dev.ws);
  ck(cudaFree(base), "free");
  void* big = nullptr;
  ck(cudaMalloc(&big, dev.ws_bytes + 64), "cudaMalloc");
  dev.ws = static_cast<char*>(big) + 4;
  EXPECT_EQ(dev.call(nullptr, dev.ws_bytes), MAMBA3_OK) << mamba3_last_error();
  ck(cudaDeviceSynchronize(), "sync");
  dev.ws = big;  // freed by the destructor
#endif
}

// ------------------------------------------------------------------ benchmark (disabled)

// Median time of the reference shape B=4, S=2048, H=16, G=1, N=128, P=64, R=4, C=16 (bf16
// activations and outputs, f32 parameters and decays, D; with and without the gate; and once with
// f32 activations, which take the FFMA path): 20 timed calls after 3 warm-up calls, CUDA events.
// Prints; asserts nothing about time.
TEST(MimoBwdFwdCuda, DISABLED_BenchmarkReferenceShape) {
  SKIP_WITHOUT_CUDA();
#ifdef MAMBA3_GOLDEN_CUDA
  for (int variant = 0; variant < 3; ++variant) {
    const bool z = variant != 1;
    const IoType act = variant == 2 ? IoType::F32 : IoType::BF16;
    MimoOperands op(4, 2048, 16, 1, 128, 64, 4, 16, true, z, false, act, act, 1);
    MimoDevice dev(op, false);
    cudaEvent_t e0, e1;
    ck(cudaEventCreate(&e0), "event");
    ck(cudaEventCreate(&e1), "event");
    for (int i = 0; i < 3; ++i) ASSERT_EQ(dev.call(nullptr, dev.ws_bytes), MAMBA3_OK) << mamba3_last_error();
    std::vector<float> ms;
    for (int i = 0; i < 20; ++i) {
      ck(cudaEventRecord(e0, nullptr), "record");
      ASSERT_EQ(dev.call(nullptr, dev.ws_bytes), MAMBA3_OK);
      ck(cudaEventRecord(e1, nullptr), "record");
      ck(cudaEventSynchronize(e1), "sync");
      float t = 0;
      ck(cudaEventElapsedTime(&t, e0, e1), "elapsed");
      ms.push_back(t);
    }
    std::sort(ms.begin(), ms.end());
    // Back to back (the launch overhead of one call hidden behind the previous one).
    ck(cudaEventRecord(e0, nullptr), "record");
    for (int i = 0; i < 20; ++i) ASSERT_EQ(dev.call(nullptr, dev.ws_bytes), MAMBA3_OK);
    ck(cudaEventRecord(e1, nullptr), "record");
    ck(cudaEventSynchronize(e1), "sync");
    float total = 0;
    ck(cudaEventElapsedTime(&total, e0, e1), "elapsed");
    // Counted work: the useful products of the chunk pass per chunk of T = C R rows (inter-chunk
    // readout and state update 2 T N P FMA each, causal scores T^2 N / 2, intra-chunk T^2 P / 2;
    // the local scan's repeated state updates are overhead, not counted). Bytes: every input read
    // once and every output written once (bf16 activations and outputs, f32 decays and angles).
    const double B = 4, S = 2048, H = 16, N = 128, P = 64, R = 4, C = 16, T = C * R;
    const double nch = S / C;
    const double flops = B * H * nch * (4 * T * N * P + T * T * N + T * T * P);
    const double es = act == IoType::F32 ? 4.0 : 2.0;
    const double bytes = es * (2 * B * S * R * N + (z ? 4 : 2) * B * S * H * P) +
                         4.0 * (4 * B * H * S + B * S * H * N / 4 + B * H * nch * C * C) +
                         es * (B * H * nch * N * P + B * H * S * R * R);
    std::printf("[ mimo_bwd_fwd B4 S2048 H16 G1 N128 P64 R4 C16 %s%s: median %.3f ms (min %.3f, "
                "max %.3f) over 20; back to back %.3f ms per call; %.1f TFLOP/s on the chunk-pass "
                "count, %.0f GB/s on the compulsory bytes; workspace %.1f MB ]\n",
                io_name(act), z ? " z D" : " D", ms[10], ms[0], ms[19], total / 20, flops / (ms[10] * 1e9),
                bytes / (ms[10] * 1e6), dev.ws_bytes / 1e6);
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
  }
#endif
}

}  // namespace
