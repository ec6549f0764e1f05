// The CUDA kernels of mamba3_mimo_bwd_bwd (src/cuda/mimo_bwd_bwd_kernels.cuh, and K3's planes
// kernel mimo_bwd_bwd_chunk_planes.cuh with its tensor-core products) run on the host: each CTA
// is emulated by one std::thread per CUDA thread (cta_emulator.hpp; blocks one after another),
// so index math, barriers, workspace layout, tails and the grid-stride slot reuse are checked
// on machines without a GPU. The workspace is NaN-filled first (a read before a write shows up
// as NaN), outputs are poisoned, segsum / da_cs_rev entries the operator must not read are NaN.
// Reference: the CPU backend through the C API on the same operands (itself checked against the
// float64 golden in test_mimo_bwd_bwd_cpu.cpp); the real kernels are checked against the golden
// on the GPU in test_mimo_bwd_bwd_cuda.cpp.
//
// Only in CUDA builds: the bodies use the CUDA headers' fp16 / bf16 conversions.
#ifdef MAMBA3_GOLDEN_CUDA

#include <gtest/gtest.h>

#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "core/mimo_bwd_bwd_params.hpp"
#include "cta_emulator.hpp"
#include "cuda/mimo_bwd_bwd_chunk_planes.cuh"
#include "cuda/mimo_bwd_bwd_kernels.cuh"
#include "cuda/mimo_bwd_bwd_state_chain.cuh"
#include "host_operands.hpp"
#include "mamba3/mamba3.h"
#include "mamba3_golden/host.hpp"
#include "mamba3_golden/mimo_bwd_bwd.hpp"

// ------------------------------------------------------------------ the emulated primitives

// The CTA emulator's thread index and barrier (the same ones its warp-collective instructions
// use, which the planes kernel calls).
namespace mamba3::cuda::bb {
namespace {

int64_t g_nblocks = 0;

}  // namespace

int bb_tid() { return test::emu::t_tid; }
int64_t bb_bid() { return test::emu::t_bid; }
int64_t bb_nblocks() { return g_nblocks; }
void bb_sync() { test::emu::g_cta->bar.wait(); }

}  // namespace mamba3::cuda::bb

namespace {

using namespace mamba3::golden;
namespace bb = mamba3::cuda::bb;

// A launch of `grid` CTAs of `nthreads` threads, one CTA after another.
template <class F>
void launch(int64_t grid, int nthreads, F body) {
  bb::g_nblocks = grid;
  mamba3::test::emu::launch(grid, nthreads, body);
}

// Which K3 the plan must take: chunk_body over the scratch slots, or the planes kernel (PlanesCT:
// its specialised copy, bb::ArgsCT, for the first run of check_case, the generic one for the
// second: their outputs must have the same bits; PlanesCTL: the same with the copy specialised
// to the contiguous layouts of one operand set too, ArgsCT<.., kCtBwdBwd or kCtCombined>,
// which the first run's operands must select; PlanesCTShape: those operands, but the copy
// specialised to the shape only, as MAMBA3_BB_CT_LAYOUT=0).
enum class K3 { Slots, Planes, PlanesCT, PlanesCTL, PlanesCTShape };

// Which contiguous-layout operand set a meets (bb::kCtShape: none).
bb::CtSet ct_set(const bb::Args& a) {
  return bb::ct_layout_ok(a, bb::kCtBwdBwd)     ? bb::kCtBwdBwd
         : bb::ct_layout_ok(a, bb::kCtCombined) ? bb::kCtCombined
                                                : bb::kCtShape;
}

// The specialised K1 (k1) or K3 of operand set CL on a (as bb::ct_k1_entry / ct_k3_entry).
template <int N, int P, int R, int C, int CL>
void launch_planes_cl(const bb::Args& a, int64_t grid, unsigned char* smem, bool k1) {
  auto s = std::make_unique<bb::ArgsCT<N, P, R, C, CL>>();
  if constexpr (CL == bb::kCtShape)
    static_cast<bb::Args&>(*s) = a;
  else
    s->set(a);
  if (k1)
    launch(grid, bb::kIncPlanesThreads, [&] { bb::increment_planes_body(*s, smem); });
  else
    launch(grid, bb::kPlanesThreads, [&] { bb::chunk_planes_body(*s, smem); });
}

// Runs K1 (k1) or K3 specialised to (N, P, R, C) when a has that shape (rotary divisor 4, as
// the device kernels), and to the contiguous layouts of the operand set a meets unless
// shape_only (as mimo_bwd_bwd.cu picks: bb::k3_kind); false otherwise.
template <int N, int P, int R, int C>
bool launch_planes_ct(const bb::Args& a, int64_t grid, unsigned char* smem, bool shape_only,
                      bool k1 = false) {
  if (a.N != N || a.P != P || a.R != R || a.C != C || a.A != N / 4) return false;
  const bb::CtSet set = shape_only ? bb::kCtShape : ct_set(a);
  if (set == bb::kCtBwdBwd)
    launch_planes_cl<N, P, R, C, bb::kCtBwdBwd>(a, grid, smem, k1);
  else if (set == bb::kCtCombined)
    launch_planes_cl<N, P, R, C, bb::kCtCombined>(a, grid, smem, k1);
  else
    launch_planes_cl<N, P, R, C, bb::kCtShape>(a, grid, smem, k1);
  return true;
}

// The state chain kernel (K1 + K2 in one) of shape (N, P, R, C) and the contiguous-layout set a
// meets, as mimo_bwd_bwd.cu launches it (bb::ct_chain_*: B H chain_blocks_per_bh CTAs); false
// where a has another shape or meets no such set.
template <int N, int P, int R, int C>
bool launch_chain_ct(const bb::Args& a) {
  if (a.N != N || a.P != P || a.R != R || a.C != C || a.A != N / 4) return false;
  const bb::CtSet set = ct_set(a);
  if (set == bb::kCtShape) return false;
  auto run = [&](auto cl) {
    using AT = bb::ArgsCT<N, P, R, C, decltype(cl)::value>;
    std::vector<unsigned char> smem(bb::chain_smem_bytes<AT>(), 0xff);
    const int64_t grid = int64_t{a.B} * a.H * bb::chain_blocks_per_bh<AT>();
    auto s = std::make_unique<AT>();
    s->set(a);
    launch(grid, bb::kChainThreads, [&] { bb::state_chain_body(*s, smem.data()); });
  };
  if (set == bb::kCtBwdBwd)
    run(std::integral_constant<int, bb::kCtBwdBwd>{});
  else
    run(std::integral_constant<int, bb::kCtCombined>{});
  return true;
}

// Runs the four kernels exactly as src/cuda/mimo_bwd_bwd.cu launches them. scalar_loads: the
// planes kernels' pair loads and stores replaced by their two-access fallback (what other
// layouts take).
// The combined backward's q / k group outputs (bb::set_qk_group): dq, dk [B, S, R, G, N] and
// the bias partials [2][B nch][R H N].
struct QkGroupBufs {
  mamba3::TensorView dq, dk;
  float* part;
};

void emulate(const mamba3::MimoBwdBwdParams& p, int64_t max_slots, K3 k3,
             bool scalar_loads = false, const QkGroupBufs* grp = nullptr) {
  const bb::Plan pl = bb::make_plan(p, max_slots, k3 != K3::Slots);
  ASSERT_EQ(pl.planes, k3 != K3::Slots) << "the plan does not take the requested K3";
  std::vector<float> ws(pl.bytes / sizeof(float) + 1, std::numeric_limits<float>::quiet_NaN());
  bb::Args a = bb::make_args(p, pl, ws.data());
  if (grp != nullptr) bb::set_qk_group(a, grp->dq, grp->dk, grp->part);
  if (scalar_loads)
    a.vec_q = a.vec_k = a.vec_v = a.vec_dout = a.vec_states = a.vec_dq = a.vec_dk = 0;
  ASSERT_LE(reinterpret_cast<uintptr_t>(a.ws_slot + pl.nslots * pl.slot_floats),
            reinterpret_cast<uintptr_t>(ws.data()) + pl.bytes);
  if (pl.grid_cs > 0) launch(pl.grid_cs, bb::kThreads, [&] { bb::angle_table_body(a); });
  const bool spec =
      (k3 == K3::PlanesCT || k3 == K3::PlanesCTL || k3 == K3::PlanesCTShape) && !scalar_loads;
  // K1 + K2 as the state chain kernel where the device takes it (the contiguous-layout K3).
  const bool chain = pl.grid1 > 0 && pl.planes && k3 == K3::PlanesCTL && !scalar_loads &&
                     bb::chain_allowed_by_env();
  if (chain) {
    ASSERT_TRUE((launch_chain_ct<128, 64, 4, 16>(a) || launch_chain_ct<256, 64, 4, 8>(a) ||
                 launch_chain_ct<64, 128, 4, 16>(a) || launch_chain_ct<128, 64, 2, 32>(a) ||
                 launch_chain_ct<128, 64, 1, 64>(a) || launch_chain_ct<128, 128, 4, 8>(a)))
        << "no state chain kernel of this shape and layout in the test";
  } else if (pl.grid1 > 0 && pl.planes) {
    std::vector<unsigned char> smem(static_cast<size_t>(pl.ply.inc_bytes), 0xff);
    // K1 specialised with K3 (as mimo_bwd_bwd.cu: the test's shapes are not N16).
    if (spec) {
      const bool shape_only = k3 == K3::PlanesCTShape;
      unsigned char* sm = smem.data();
      ASSERT_TRUE((launch_planes_ct<128, 64, 4, 16>(a, pl.grid1, sm, shape_only, true) ||
                   launch_planes_ct<256, 64, 4, 8>(a, pl.grid1, sm, shape_only, true) ||
                   launch_planes_ct<128, 64, 2, 32>(a, pl.grid1, sm, shape_only, true) ||
                   launch_planes_ct<64, 128, 4, 16>(a, pl.grid1, sm, shape_only, true) ||
                   launch_planes_ct<128, 64, 1, 64>(a, pl.grid1, sm, shape_only, true) ||
                   launch_planes_ct<128, 128, 4, 8>(a, pl.grid1, sm, shape_only, true)))
          << "no specialised K1 of this shape in the test";
    } else {
      launch(pl.grid1, bb::kIncPlanesThreads,
             [&] { bb::increment_planes_body(a, smem.data()); });
    }
  } else if (pl.grid1 > 0) {
    std::vector<float> smem(pl.smem1 / sizeof(float), std::numeric_limits<float>::quiet_NaN());
    launch(pl.grid1, bb::kThreads, [&] { bb::increment_body(a, smem.data()); });
  }
  if (!chain) launch(pl.grid2, bb::kThreads, [&] { bb::scan_body(a); });
  if (pl.planes) {
    // 0xff bytes: NaN as fp32 and as bf16 (a read before a write shows up).
    std::vector<unsigned char> smem(static_cast<size_t>(pl.ply.bytes), 0xff);
    // The device launches one CTA per SM (grid-stride); max_slots stands in for the SM count.
    const int64_t grid = std::min(pl.grid3, max_slots);
    if (spec) {
      ASSERT_EQ(ct_set(a) != bb::kCtShape, k3 != K3::PlanesCT)
          << "the operands do not select the requested specialisation";
      const bool shape_only = k3 == K3::PlanesCTShape;
      // The combined backward's copy does the q / k group sums (mimo_bwd_bwd.cu runs it only
      // when they are asked for).
      ASSERT_TRUE(shape_only || ct_set(a) != bb::kCtCombined || !bb::ct_qk_group(a.N) ||
                  grp != nullptr)
          << "the combined backward's K3 needs the q / k group outputs";
      ASSERT_TRUE((launch_planes_ct<128, 64, 4, 16>(a, grid, smem.data(), shape_only) ||
                   launch_planes_ct<256, 64, 4, 8>(a, grid, smem.data(), shape_only) ||
                   launch_planes_ct<128, 64, 2, 32>(a, grid, smem.data(), shape_only) ||
                   launch_planes_ct<64, 128, 4, 16>(a, grid, smem.data(), shape_only) ||
                   launch_planes_ct<128, 64, 1, 64>(a, grid, smem.data(), shape_only) ||
                   launch_planes_ct<128, 128, 4, 8>(a, grid, smem.data(), shape_only)))
          << "no specialised K3 of this shape in the test";
    } else {
      launch(grid, bb::kPlanesThreads, [&] { bb::chunk_planes_body(a, smem.data()); });
    }
  } else {
    auto sh = std::make_unique<bb::ChunkShared>();
    launch(pl.grid3, bb::kThreads, [&] { bb::chunk_body(a, *sh); });
  }
  launch(pl.grid4, bb::kThreads, [&] { bb::reduce_body(a); });
}

using mamba3::test::rand_buf;
using mamba3::test::view_of;

enum Layout { kReduceO, kPerRank, kPacked };

struct Shape {
  int64_t B, S, H, G, N, P, R, C, rdd;
  Layout layout;
  bool d;
  int64_t pad;
  IoType act, out;
  bool dout_f32 = false;  // fp32 dout with 16-bit q, k, v (what the combined backward hands over)
  // The benchmark's dtypes (bench/bench_mimo_bwd.py's bwd_bwd: fp32 biases and dt, bf16 states,
  // qk_dot and trap), with act = out = BF16: what ArgsCT<.., kCtBwdBwd> is specialised to.
  bool bench_dtypes = false;
  // The combined backward's operands of the second pass (mimo_bwd_combined.cu with z, no norm;
  // bench_dtypes on, act = out = BF16, reduce-O): fp32 states, qk_dot (its first pass's) and
  // dq, dk (its per-head workspace), and the Z gate (bb::Args::gate: a bf16 z, fp32 mimo_z),
  // what ArgsCT<.., kCtCombined> is specialised to. The references take the gated dout as a
  // per-rank fp32 dout, dout mimo_o^r silu(z mimo_z^r) (in double).
  bool combined = false;
};

const char* kNames[] = {"dq",     "dk",  "dv",    "dmimo_v",    "dangles", "dfactor",
                        "dgamma", "dda", "dssda", "dda_cs_rev", "dda_cs",  "dd"};

void check_case(const Shape& s, uint64_t seed, int64_t max_slots = bb::kMaxSlots,
                K3 k3 = K3::Slots) {
  if (k3 != K3::Slots && !bb::planes_allowed_by_env())
    GTEST_SKIP() << "MAMBA3_BB_PLANES=0: the plan never takes the planes kernels";
  SCOPED_TRACE("B" + std::to_string(s.B) + " S" + std::to_string(s.S) + " H" +
               std::to_string(s.H) + " G" + std::to_string(s.G) + " N" + std::to_string(s.N) +
               " P" + std::to_string(s.P) + " R" + std::to_string(s.R) + " C" +
               std::to_string(s.C) + " layout" + std::to_string(s.layout) +
               (k3 == K3::Planes     ? " planes"
                : k3 == K3::PlanesCT  ? " planes (specialised)"
                : k3 == K3::PlanesCTL ? " planes (specialised, contiguous layouts)"
                                      : ""));
  const int64_t B = s.B, S = s.S, H = s.H, G = s.G, N = s.N, P = s.P, R = s.R, C = s.C;
  const int64_t A = N / s.rdd, nch = (S + C - 1) / C;
  std::mt19937_64 rng(seed);
  const IoType F = IoType::F32;
  std::vector<Buffer> in;
  const std::vector<int64_t> dshape = s.layout == kReduceO   ? std::vector<int64_t>{B, S, H, P}
                                      : s.layout == kPerRank ? std::vector<int64_t>{B, S, R, H, P}
                                                             : std::vector<int64_t>{B, H, S * R, P};
  in.push_back(rand_buf(rng, s.dout_f32 ? IoType::F32 : s.act, dshape, -1, 1, s.pad));  // dout
  in.push_back(rand_buf(rng, s.act, {B, S, R, G, N}, -1, 1, s.pad));      // q
  in.push_back(rand_buf(rng, s.act, {B, S, R, G, N}, -1, 1, s.pad));      // k
  in.push_back(rand_buf(rng, s.act, {B, S, H, P}, -1, 1, s.pad));         // v
  in.push_back(rand_buf(rng, F, {H, R, N}, -0.5, 0.5, s.pad));            // q_bias
  in.push_back(rand_buf(rng, s.bench_dtypes ? F : s.act, {H, R, N}, -0.5, 0.5,
                        s.pad));  // k_bias
  in.push_back(rand_buf(rng, F, {H, R, P}, -1, 1, s.pad));                // mimo_v
  in.push_back(rand_buf(rng, s.combined ? F : s.act, {B, H, nch, N, P}, -1, 1,
                        s.pad));  // states
  in.push_back(rand_buf(rng, s.bench_dtypes && !s.combined ? IoType::BF16 : F, {B, H, S, R, R},
                        -2, 2, s.pad));  // qk_dot
  // Decays consistent with one adt <= 0 (as the first pass would see them).
  std::vector<double> adt(B * H * S), dacs(B * H * S), rev(B * H * S), seg(B * H * nch * C * C);
  for (double& x : adt) x = -std::uniform_real_distribution<double>(0.02, 0.4)(rng);
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const bool partial = S % C != 0;
  for (int64_t bh = 0; bh < B * H; ++bh)
    for (int64_t c = 0; c < nch; ++c) {
      const int64_t s0 = c * C, L = std::min(C, S - s0);
      double run = 0;
      for (int64_t i = 0; i < L; ++i) dacs[bh * S + s0 + i] = run += adt[bh * S + s0 + i];
      for (int64_t i = 0; i < L; ++i)
        rev[bh * S + s0 + i] = partial && c == nch - 1 ? nan : run - dacs[bh * S + s0 + i];
      for (int64_t i = 0; i < C; ++i)
        for (int64_t j = 0; j < C; ++j) {
          const bool valid = j < i && i < L && !(partial && c == nch - 1);
          seg[((bh * nch + c) * C + i) * C + j] =
              valid ? dacs[bh * S + s0 + i] - dacs[bh * S + s0 + j] : nan;
        }
    }
  auto from = [&](std::vector<int64_t> shape, const std::vector<double>& v) {
    Buffer b = Buffer::from_double(F, std::move(shape), v);
    return s.pad > 0 ? b.padded(s.pad) : b;
  };
  in.push_back(from({B, H, S}, dacs));                                   // da_cs
  in.push_back(from({B, H, S}, rev));                                    // da_cs_rev
  in.push_back(rand_buf(rng, s.bench_dtypes ? F : s.act, {B, H, S}, 0.05, 0.6,
                        s.pad));  // dt
  in.push_back(rand_buf(rng, s.bench_dtypes ? IoType::BF16 : F, {B, H, S}, -2, 2,
                        s.pad));  // trap
  in.push_back(from({B, H, nch, C, C}, seg));                            // segsum
  in.push_back(rand_buf(rng, F, {B, S, H, A}, -3, 3, s.pad));            // angles
  in.push_back(s.layout == kReduceO ? rand_buf(rng, F, {H, R, P}, -1, 1, s.pad) : Buffer());
  in.push_back(s.d ? rand_buf(rng, F, {H}, -1, 1, s.pad) : Buffer());
  // The gate's z and mimo_z (drawn last: the other cases' operands stay as they were), and the
  // gated dout as a per-rank fp32 dout for the references.
  Buffer zb, mzb, gated;
  std::vector<double> gated_d;
  if (s.combined) {
    zb = rand_buf(rng, s.act, {B, S, H, P}, -2, 2, s.pad);
    mzb = rand_buf(rng, F, {H, R, P}, -1.5, 1.5, s.pad);
    const std::vector<double> dd = in[0].to_double(), mo = in[15].to_double(),
                              zd = zb.to_double(), mz = mzb.to_double();
    gated_d.resize(B * S * R * H * P);
    for (int64_t bt = 0; bt < B * S; ++bt)
      for (int64_t r = 0; r < R; ++r)
        for (int64_t h = 0; h < H; ++h)
          for (int64_t q = 0; q < P; ++q) {
            const double x = zd[(bt * H + h) * P + q] * mz[(h * R + r) * P + q];
            gated_d[((bt * R + r) * H + h) * P + q] =
                dd[(bt * H + h) * P + q] * mo[(h * R + r) * P + q] * x / (1 + std::exp(-x));
          }
    gated = Buffer::from_double(F, {B, S, R, H, P}, gated_d);
  }

  auto outputs = [&] {
    std::vector<Buffer> out;
    const IoType oq = s.combined ? F : s.out;
    out.emplace_back(oq, std::vector<int64_t>{B, S * R, H, N});  // dq
    out.emplace_back(oq, std::vector<int64_t>{B, S * R, H, N});  // dk
    out.emplace_back(s.out, std::vector<int64_t>{B, S, H, P});      // dv
    out.emplace_back(F, std::vector<int64_t>{B, H, R, P});          // dmimo_v
    out.emplace_back(F, std::vector<int64_t>{B, S, H, A});          // dangles
    for (int i = 0; i < 3; ++i) out.emplace_back(F, std::vector<int64_t>{B, H, S});
    out.emplace_back(F, std::vector<int64_t>{B, H, nch, C, C});  // dssda
    for (int i = 0; i < 2; ++i) out.emplace_back(F, std::vector<int64_t>{B, H, S});
    out.push_back(s.d ? Buffer(F, {B, H}) : Buffer());  // dd
    return out;
  };
  std::vector<DLTensor*> ci;
  for (Buffer& b : in) ci.push_back(b.shape.empty() ? nullptr : b.tensor());
  if (s.combined) ci[0] = gated.tensor(), ci[15] = nullptr;  // (the reference's dout)
  // The checked params the C API would build (make_mimo_bwd_bwd_params is internal to the
  // library; the CPU call below validates the same operands).
  auto call_params = [&](std::vector<Buffer>& out) {
    mamba3::MimoBwdBwdParams p;
    p.B = B, p.S = S, p.H = H, p.G = G, p.N = N, p.P = P, p.R = R, p.C = C, p.nchunks = nch;
    p.rotary_dim_divisor = s.rdd, p.A = A, p.has_d = s.d, p.device = mamba3::DeviceKind::CPU;
    p.dout_layout = s.layout == kReduceO   ? mamba3::MimoDout::ReduceO
                    : s.layout == kPerRank ? mamba3::MimoDout::PerRank
                                           : mamba3::MimoDout::Packed;
    mamba3::TensorView* ins[] = {&p.dout,   &p.q,      &p.k,     &p.v,         &p.q_bias, &p.k_bias,
                                 &p.mimo_v, &p.states, &p.qk_dot, &p.da_cs,   &p.da_cs_rev,
                                 &p.dt,     &p.trap,   &p.segsum, &p.angles,  &p.mimo_o, &p.d};
    mamba3::TensorView* outs[] = {&p.dq,      &p.dk,      &p.dv,     &p.dmimo_v,
                                  &p.dangles, &p.dfactor, &p.dgamma, &p.dda,
                                  &p.dssda,   &p.dda_cs_rev, &p.dda_cs, &p.dd};
    for (size_t i = 0; i < in.size(); ++i) *ins[i] = view_of(in[i]);
    for (size_t i = 0; i < out.size(); ++i) *outs[i] = view_of(out[i]);
    if (s.combined) p.z = view_of(zb), p.mimo_z = view_of(mzb);
    return p;
  };

  // Reference: the CPU backend.
  std::vector<Buffer> ref = outputs();
  {
    std::vector<DLTensor*> co;
    for (Buffer& b : ref) co.push_back(b.shape.empty() ? nullptr : b.tensor());
    ASSERT_EQ(mamba3_mimo_bwd_bwd(ci[0], ci[1], ci[2], ci[3], ci[4], ci[5], ci[6], ci[7], ci[8],
                                  ci[9], ci[10], ci[11], ci[12], ci[13], ci[14], ci[15], ci[16],
                                  C, s.rdd, co[0], co[1], co[2], co[3], co[4], co[5], co[6],
                                  co[7], co[8], co[9], co[10], co[11], nullptr, 0, nullptr),
              MAMBA3_OK)
        << mamba3_last_error();
  }
  std::vector<Buffer> got = outputs(), again = outputs();
  // The combined backward's K3 (K3::PlanesCTL with its operands) sums dq / dk over the q / k
  // groups and writes the bias partials instead of per-head dq / dk (bb::Args::qk_group):
  // checked below against those sums of the shape-only K3's per-head outputs.
  const bool grouped = k3 == K3::PlanesCTL && s.combined && bb::ct_qk_group(static_cast<int>(N));
  Buffer gdq(F, {B, S, R, G, N}), gdk(F, {B, S, R, G, N});
  std::vector<float> gpart(2 * B * nch * R * H * N, std::numeric_limits<float>::quiet_NaN());
  QkGroupBufs grp{view_of(gdq), view_of(gdk), gpart.data()};
  emulate(call_params(got), max_slots, k3, false, grouped ? &grp : nullptr);
  // The second run with the planes kernels' scalar-load fallback: the same bits expected (pair
  // loads or not, the same values enter the same arithmetic), and run-to-run determinism.
  emulate(call_params(again), max_slots, k3, /*scalar_loads=*/true);
  // The contiguous-layout K3: also the bits of the shape-only copy (MAMBA3_BB_CT_LAYOUT=0).
  std::vector<Buffer> shape_only;
  if (k3 == K3::PlanesCTL) {
    shape_only = outputs();
    emulate(call_params(shape_only), max_slots, K3::PlanesCTShape);
  }
  if (testing::Test::HasFatalFailure()) return;
  if (grouped) {
    // The group sums, the heads' values added in ascending h, and the per-(b, h, chunk) sums over
    // the chunk's steps from 0 in step order (the combined backward's cb_qk): the same bits.
    const int64_t HG = H / G, nseg = B * nch;
    const Buffer* srcs[2] = {&shape_only[0], &shape_only[1]};
    const Buffer* outs[2] = {&gdq, &gdk};
    for (int w = 0; w < 2; ++w) {
      const std::vector<double> src = srcs[w]->to_double(), o = outs[w]->to_double();
      auto at = [&](int64_t b, int64_t t, int64_t r, int64_t h, int64_t n) {
        return static_cast<float>(src[(((b * S + t) * R + r) * H + h) * N + n]);
      };
      int64_t bad_sum = 0, bad_part = 0;
      for (int64_t b = 0; b < B; ++b)
        for (int64_t t = 0; t < S; ++t)
          for (int64_t r = 0; r < R; ++r)
            for (int64_t g = 0; g < G; ++g)
              for (int64_t n = 0; n < N; ++n) {
                float sum = at(b, t, r, g * HG, n);
                for (int64_t hh = 1; hh < HG; ++hh) sum += at(b, t, r, g * HG + hh, n);
                const float got_v = static_cast<float>(o[(((b * S + t) * R + r) * G + g) * N + n]);
                bad_sum += std::memcmp(&sum, &got_v, sizeof(float)) != 0;
              }
      for (int64_t b = 0; b < B; ++b)
        for (int64_t c = 0; c < nch; ++c)
          for (int64_t r = 0; r < R; ++r)
            for (int64_t h = 0; h < H; ++h)
              for (int64_t n = 0; n < N; ++n) {
                float sum = 0.f;
                for (int64_t t = c * C; t < std::min(S, c * C + C); ++t) sum += at(b, t, r, h, n);
                const float got_v = gpart[((w * nseg + b * nch + c) * R + r) * H * N + h * N + n];
                bad_part += std::memcmp(&sum, &got_v, sizeof(float)) != 0;
              }
      EXPECT_EQ(bad_sum, 0) << kNames[w] << ": group sums differ from the per-head outputs'";
      EXPECT_EQ(bad_part, 0) << kNames[w] << ": bias partials differ from the per-head outputs'";
    }
    // The per-head values (which the grouped K3 does not keep) for the comparisons below.
    got[0] = shape_only[0], got[1] = shape_only[1];
  }
  // Against the CPU backend (same fp32 algebra: tight; the planes kernel's products round their
  // operands to hi + lo bf16 pairs, ~2^-17 each: fp32 outputs to 1e-4 as the first pass's lean
  // kernels in test_mimo_bwd_fwd_emulated.cpp) ...
  const double tol = s.out == IoType::F32 ? (k3 != K3::Slots ? 1e-4 : 2e-5)
                     : s.out == IoType::F16 ? 2e-3
                                            : 1e-2;
  for (size_t k = 0; k < got.size(); ++k) {
    if (got[k].shape.empty()) continue;
    EXPECT_TRUE(got[k].bytes == again[k].bytes)
        << kNames[k] << ": two runs differ (the second with scalar loads)";
    if (!shape_only.empty())
      EXPECT_TRUE(got[k].bytes == shape_only[k].bytes)
          << kNames[k] << ": the contiguous-layout K3 differs from the shape-only one";
    const std::vector<double> g = got[k].to_double(), r = ref[k].to_double();
    double num = 0, den = 0, maxd = 0, maxr = 0;
    size_t bad = 0;
    for (size_t i = 0; i < g.size(); ++i) {
      if (!std::isfinite(g[i])) {
        ++bad;
        continue;
      }
      num += (g[i] - r[i]) * (g[i] - r[i]);
      den += r[i] * r[i];
      maxd = std::max(maxd, std::fabs(g[i] - r[i]));
      maxr = std::max(maxr, std::fabs(r[i]));
    }
    EXPECT_EQ(bad, 0u) << kNames[k] << ": non-finite elements (unwritten or NaN read)";
    const bool near_zero = k == 4 || k == 7;  // dangles, dda: max_rel as the harness
    const double rel = near_zero ? (maxr > 0 ? maxd / maxr : maxd)
                                 : (den > 0 ? std::sqrt(num / den) : std::sqrt(num));
    EXPECT_LE(rel, near_zero ? 1e-4 : tol) << kNames[k];
  }

  // ... and against the float64 golden under the SPEC.md rule (the float32 golden as the dual
  // reference), as the device tests judge the real kernels.
  MimoInputs<double> gi;
  gi.B = B, gi.S = S, gi.H = H, gi.G = G, gi.N = N, gi.P = P, gi.R = R;
  gi.rotary_dim_divisor = s.rdd, gi.chunk_size = C;
  gi.dout = in[0].to_double(), gi.q = in[1].to_double(), gi.k = in[2].to_double();
  gi.v = in[3].to_double(), gi.q_bias = in[4].to_double(), gi.k_bias = in[5].to_double();
  gi.mimo_v = in[6].to_double();
  gi.da_cs = in[9].to_double(), gi.da_cs_rev = in[10].to_double(), gi.dt = in[11].to_double();
  gi.trap = in[12].to_double(), gi.segsum = in[13].to_double(), gi.angles = in[14].to_double();
  if (s.layout == kReduceO && !s.combined) gi.mimo_o = in[15].to_double();
  if (s.combined) gi.dout = gated_d;
  if (s.d) gi.D = in[16].to_double();
  const std::vector<double> states = in[7].to_double(), qk = in[8].to_double();
  auto to_f = [](const std::vector<double>& v) { return std::vector<float>(v.begin(), v.end()); };
  MimoInputs<float> fi;
  fi.B = B, fi.S = S, fi.H = H, fi.G = G, fi.N = N, fi.P = P, fi.R = R;
  fi.rotary_dim_divisor = s.rdd, fi.chunk_size = C;
  fi.dout = to_f(gi.dout), fi.q = to_f(gi.q), fi.k = to_f(gi.k), fi.v = to_f(gi.v);
  fi.q_bias = to_f(gi.q_bias), fi.k_bias = to_f(gi.k_bias), fi.mimo_v = to_f(gi.mimo_v);
  fi.da_cs = to_f(gi.da_cs), fi.da_cs_rev = to_f(gi.da_cs_rev), fi.dt = to_f(gi.dt);
  fi.trap = to_f(gi.trap), fi.segsum = to_f(gi.segsum), fi.angles = to_f(gi.angles);
  fi.mimo_o = to_f(gi.mimo_o), fi.D = to_f(gi.D);
  const MimoDoutLayout lay = s.combined              ? MimoDoutLayout::PerRank
                             : s.layout == kReduceO ? MimoDoutLayout::ReduceO
                             : s.layout == kPerRank ? MimoDoutLayout::PerRank
                                                    : MimoDoutLayout::Packed;
  const MimoBwdBwdOutputs<double> gold = mimo_bwd_bwd(gi, states, qk, lay);
  const MimoBwdBwdOutputs<float> ref32 = mimo_bwd_bwd(fi, to_f(states), to_f(qk), lay);
  const std::vector<double>* golds[] = {&gold.dq,      &gold.dk,     &gold.dv,    &gold.dmimo_v,
                                        &gold.dangles, &gold.dfactor, &gold.dgamma, &gold.dda,
                                        &gold.dssda,   &gold.dda_cs_rev, &gold.dda_cs, &gold.dd};
  const std::vector<float>* refs[] = {&ref32.dq,      &ref32.dk,      &ref32.dv,
                                      &ref32.dmimo_v, &ref32.dangles, &ref32.dfactor,
                                      &ref32.dgamma,  &ref32.dda,     &ref32.dssda,
                                      &ref32.dda_cs_rev, &ref32.dda_cs, &ref32.dd};
  const IoType io = s.act == IoType::F32 && s.out == IoType::F32 ? IoType::F32
                    : s.act == IoType::BF16 || s.out == IoType::BF16 ? IoType::BF16
                                                                      : IoType::F16;
  for (size_t k = 0; k < got.size(); ++k) {
    if (got[k].shape.empty()) continue;
    std::vector<double> r(refs[k]->size());
    for (size_t i = 0; i < r.size(); ++i) r[i] = round_to((*refs[k])[i], got[k].type);
    const Accuracy acc = compare(got[k].to_double(), *golds[k], r, io, k == 4 || k == 7);
    EXPECT_TRUE(acc.pass) << kNames[k] << " vs golden: " << acc.metric << " " << acc.value()
                          << " (fp32 reference " << acc.ref_value() << ")";
  }
}

TEST(MimoBwdBwdEmulated, KernelBodiesMatchTheCpuBackend) {
  const IoType F = IoType::F32, H16 = IoType::F16, BF = IoType::BF16;
  uint64_t seed = 1;
  // B  S   H  G  N   P   R  C  rdd layout     D      pad act out
  for (const Shape& s : {Shape{2, 37, 4, 2, 16, 8, 2, 8, 4, kReduceO, true, 0, F, F},
                         Shape{1, 20, 2, 1, 16, 8, 2, 16, 2, kPerRank, false, 3, H16, F},
                         Shape{2, 13, 2, 2, 8, 12, 4, 8, 4, kPacked, true, 0, BF, F},
                         Shape{1, 5, 1, 1, 6, 5, 3, 8, 2, kReduceO, true, 2, F, H16},
                         Shape{1, 16, 2, 1, 2, 3, 1, 8, 2, kPerRank, true, 0, F, BF},
                         // 16-bit activations with N, P, C R multiples of 16: the plan's tensor-
                         // core layout (rows padded to 16 with zeros: a partial last chunk of
                         // 5 x 2 rows), here through the FFMA tiles on the host
                         Shape{1, 37, 2, 1, 16, 32, 2, 8, 4, kReduceO, true, 0, BF, F},
                         Shape{2, 21, 2, 2, 32, 16, 4, 8, 2, kPacked, false, 1, H16, BF}})
    check_case(s, seed++);
}

// More chunks than K3 CTAs: the grid-stride loop reuses each CTA's scratch slot (the cap is
// lowered to 3 CTAs here; the device tests reach the real cap of kMaxSlots = 396), many chunks per (b, h).
TEST(MimoBwdBwdEmulated, GridStrideOverManyChunks) {
  check_case(Shape{1, 83, 2, 1, 8, 4, 2, 8, 4, kReduceO, true, 0, IoType::F32, IoType::F32}, 41,
             3);
  check_case(Shape{2, 50, 2, 2, 16, 8, 1, 16, 2, kPacked, false, 1, IoType::BF16, IoType::F32},
             43, 5);
}

// Rank 8 with 64-step chunks (512 rows per chunk), a partial last chunk.
TEST(MimoBwdBwdEmulated, LargestChunkRows) {
  check_case(Shape{1, 70, 1, 1, 16, 8, 8, 64, 4, kPerRank, true, 0, IoType::F32, IoType::F32}, 42);
}

// K3 on the planes kernel (bf16 hi/lo operand planes, mma products, 512 threads): chunks of
// T = C R = 16, 32 and 64 rows, partial last chunks, the three dout layouts, with and without D,
// GQA (G < H), bf16 activations (the planes kernels' only ones), padded inputs (odd strides:
// the scalar-load fallback), 16-bit outputs, an fp32 dout.
TEST(MimoBwdBwdEmulated, PlanesKernelMatchesTheCpuBackend) {
  const IoType F = IoType::F32, H16 = IoType::F16, BF = IoType::BF16;
  uint64_t seed = 101;
  // B  S   H  G  N   P   R  C  rdd layout     D      pad act out
  for (const Shape& s : {Shape{1, 21, 2, 1, 32, 16, 2, 8, 4, kReduceO, true, 0, BF, F},    // T 16
                         Shape{1, 40, 2, 2, 16, 32, 4, 8, 2, kPerRank, false, 1, BF, BF},  // T 32
                         Shape{2, 23, 2, 1, 32, 32, 4, 16, 4, kPacked, true, 0, BF, F},    // T 64
                         Shape{1, 19, 1, 1, 16, 16, 1, 64, 2, kReduceO, true, 0, BF, F},  // R 1
                         Shape{1, 13, 2, 2, 64, 16, 8, 8, 4, kReduceO, false, 2, BF, H16},  // R 8
                         Shape{1, 18, 2, 1, 32, 16, 2, 8, 2, kPerRank, true, 0, BF, F, true}})
    check_case(s, seed++, bb::kMaxSlots, K3::Planes);
}

// The planes kernel with two dqh / dkh tiles per warp (T N = 8192) and two dx tiles per warp
// (T P = 8192).
TEST(MimoBwdBwdEmulated, PlanesKernelTwoTilesPerWarp) {
  const IoType F = IoType::F32, BF = IoType::BF16;
  check_case(Shape{1, 20, 1, 1, 128, 16, 4, 16, 4, kPerRank, true, 0, BF, F}, 201, bb::kMaxSlots,
             K3::Planes);
  check_case(Shape{1, 12, 1, 1, 16, 128, 2, 32, 2, kReduceO, true, 0, BF, F}, 202, bb::kMaxSlots,
             K3::Planes);
}

// The planes kernel at the reference shape N128 P64 R4 C16 (a full chunk and a partial one).
TEST(MimoBwdBwdEmulated, PlanesKernelReferenceShape) {
  check_case(Shape{1, 20, 1, 1, 128, 64, 4, 16, 4, kReduceO, true, 0, IoType::BF16, IoType::F32},
             301, bb::kMaxSlots, K3::Planes);
}

// A shape whose shared memory has no room for the per-chunk (sin, cos) table (N128 R1 C64:
// phases 0 and 3 read the workspace's table of the whole sequence, Args::ws_cs, which the plan
// then adds), a full and a partial chunk.
TEST(MimoBwdBwdEmulated, PlanesKernelWithoutAngleTable) {
  mamba3::MimoBwdBwdParams p;
  p.N = 128, p.P = 64, p.R = 1, p.C = 64, p.A = 32;
  ASSERT_LT(bb::planes_layout(p.N, p.P, p.R, p.C, p.A).cs, 0);
  ASSERT_GE(bb::planes_layout(128, 64, 4, 16, 32).cs, 0);  // the reference shape has it
  check_case(Shape{1, 100, 1, 1, 128, 64, 1, 64, 4, kReduceO, true, 0, IoType::BF16, IoType::F32},
             401, bb::kMaxSlots, K3::Planes);
}

// The specialised planes K3 (bb::ArgsCT: the device's kernels at SPEC.md's grid shapes, whose
// phase-0 rows are loaded a chunk ahead) against the generic one (check_case's second run, with
// scalar loads): the same bits. Two CTAs over several chunks each (the loads for the next
// chunk), full and partial chunks, reduce-O and per-rank dout.
TEST(MimoBwdBwdEmulated, PlanesKernelSpecialisedGivesIdenticalBits) {
  const IoType F = IoType::F32, BF = IoType::BF16;
  check_case(Shape{1, 37, 2, 1, 128, 64, 4, 16, 4, kReduceO, true, 0, BF, F}, 501, 2,
             K3::PlanesCT);
  check_case(Shape{1, 20, 1, 1, 256, 64, 4, 8, 4, kPerRank, true, 0, BF, F}, 502, 1,
             K3::PlanesCT);
  // R2 C32 (64 rows per chunk at two ranks: the shape where bwd_bwd is closest to upstream), the
  // last chunk partial.
  check_case(Shape{1, 70, 1, 1, 128, 64, 2, 32, 4, kReduceO, true, 0, BF, F}, 503, 2,
             K3::PlanesCT);
}

// check_case of the K3 specialised to the contiguous layouts, with the benchmark's operand set
// (combined: the combined backward's), over max_slots CTAs.
void check_contiguous(Shape s, bool combined, uint64_t seed, int64_t max_slots) {
  s.bench_dtypes = true;
  s.combined = combined;
  check_case(s, seed, max_slots, K3::PlanesCTL);
}

// The planes K3 specialised to the shape and to the contiguous layouts and dtypes of the
// benchmark (bb::ArgsCT<.., kCtBwdBwd>: compile-time dtypes, strides and flags, 32-bit offsets)
// against the generic one and the shape-only one: the same bits. Batches and heads (the
// runtime strides), full and partial chunks, several chunks per CTA; fp32 and bf16 outputs.
// The first run also takes the state chain kernel for K1 + K2 (as the device does with these
// operands), the others K1 and K2: the same bits there too.
TEST(MimoBwdBwdEmulated, PlanesKernelContiguousLayoutGivesIdenticalBits) {
  const IoType BF = IoType::BF16;
  check_contiguous({2, 37, 2, 1, 128, 64, 4, 16, 4, kReduceO, true, 0, BF, BF}, false, 511, 2);
  check_contiguous({1, 20, 2, 2, 256, 64, 4, 8, 4, kReduceO, false, 0, BF, BF}, false, 512, 3);
  // Seven chunks, the last partial: the state chain's two register sets and plane buffers
  // alternate over more chunks than its pipeline is deep.
  check_contiguous({1, 100, 1, 1, 128, 64, 4, 16, 4, kReduceO, true, 0, BF, BF}, false, 513, 2);
  // N64 P128 R4 C16: a shape without PairTiles whose copy pairs its phase 1 and dx tiles
  // (bb::PairKQ, bb::PairDx; N128 R4 C16 above has PairKQ only, N256 C8 neither).
  check_contiguous({1, 37, 2, 1, 64, 128, 4, 16, 4, kReduceO, true, 0, BF, BF}, false, 514, 2);
  // N128 R2 C32 and R1 C64: several DQ / DK tasks per thread, each task's q / k loaded a task
  // ahead in whole chunks (bb::Pf3); the last chunk partial (the tasks one at a time).
  check_contiguous({1, 70, 1, 1, 128, 64, 2, 32, 4, kReduceO, true, 0, BF, BF}, false, 515, 2);
  check_contiguous({1, 140, 1, 1, 128, 64, 1, 64, 4, kReduceO, true, 0, BF, BF}, false, 516, 2);
}

// The same for the combined backward's operand set (bb::ArgsCT<.., kCtCombined>: fp32 states,
// qk_dot, dq, dk; the Z gate on a bf16 z), against the generic and the shape-only K3: the same
// bits; and against the CPU backend and the golden with the gate folded into a per-rank dout.
// The first run takes the state chain kernel (the gated dPhiO rows) for K1 + K2, as above.
TEST(MimoBwdBwdEmulated, PlanesKernelCombinedLayoutGivesIdenticalBits) {
  const IoType BF = IoType::BF16;
  check_contiguous({2, 37, 2, 1, 128, 64, 4, 16, 4, kReduceO, true, 0, BF, BF}, true, 521, 2);
  check_contiguous({1, 20, 2, 2, 256, 64, 4, 8, 4, kReduceO, false, 0, BF, BF}, true, 522, 3);
  check_contiguous({1, 37, 2, 1, 64, 128, 4, 16, 4, kReduceO, true, 0, BF, BF}, true, 523, 2);
  check_contiguous({1, 140, 1, 1, 128, 64, 1, 64, 4, kReduceO, true, 0, BF, BF}, true, 524, 2);
  // N128 P128 C8: the gated chain's 2 x 2 block split (bb::ChainSplit's Gate); three chunks,
  // the last partial.
  check_contiguous({1, 21, 2, 1, 128, 128, 4, 8, 4, kReduceO, true, 0, BF, BF}, true, 525, 2);
}

// The planes kernel walks several chunks per CTA (the device launches one CTA per SM; here 3)
// and prefetches the next one's inputs.
TEST(MimoBwdBwdEmulated, PlanesKernelGridStride) {
  check_case(Shape{2, 50, 2, 1, 16, 16, 1, 16, 2, kPacked, true, 1, IoType::BF16, IoType::F32},
             44, 3, K3::Planes);
}

// The plan takes the planes kernel for SPEC.md's grid at bf16 q, k, v (its planes fit the
// shared memory), and not for fp16 or fp32 activations, non-power-of-two dims or rows it cannot
// tile.
TEST(MimoBwdBwdEmulated, PlanPicksPlanesKernel) {
  if (!bb::planes_allowed_by_env())
    GTEST_SKIP() << "MAMBA3_BB_PLANES=0: the plan never takes the planes kernels";
  using mamba3::DType;
  auto plan = [](DType qkv, int64_t N, int64_t P, int64_t R, int64_t C) {
    mamba3::MimoBwdBwdParams p;
    p.B = 1, p.S = 64, p.H = 1, p.G = 1, p.N = N, p.P = P, p.R = R, p.C = C;
    p.nchunks = (p.S + C - 1) / C;
    p.A = N / 4;
    p.q.dtype = p.k.dtype = p.v.dtype = p.dout.dtype = qkv;
    return bb::make_plan(p);
  };
  const int64_t grid[][4] = {{16, 64, 4, 8},   {32, 64, 4, 16},  {64, 64, 4, 16},
                             {128, 64, 4, 16}, {256, 64, 4, 8},  {64, 128, 4, 16},
                             {128, 32, 4, 16}, {128, 128, 4, 8}, {128, 64, 8, 8},
                             {128, 64, 2, 32}, {128, 64, 1, 64}};
  for (const auto& g : grid) {
    const bb::Plan pl = plan(DType::BF16, g[0], g[1], g[2], g[3]);
    EXPECT_TRUE(pl.planes) << "N" << g[0] << " P" << g[1] << " R" << g[2] << " C" << g[3]
                           << ": " << pl.ply.bytes << " bytes of shared memory";
    EXPECT_LE(pl.ply.bytes, bb::kPlanesSmemMax);
    EXPECT_EQ(pl.nslots, 0);
    // The workspace's (sin, cos) table exactly where shared memory has none (N128 R1 C64).
    EXPECT_EQ(pl.n_cs > 0, pl.ply.cs < 0) << "N" << g[0] << " P" << g[1] << " R" << g[2];
    EXPECT_FALSE(plan(DType::F32, g[0], g[1], g[2], g[3]).planes);
    EXPECT_FALSE(plan(DType::F16, g[0], g[1], g[2], g[3]).planes);
  }
  EXPECT_FALSE(plan(DType::BF16, 128, 64, 8, 16).planes);  // 128 rows per chunk
  EXPECT_FALSE(plan(DType::BF16, 64, 64, 1, 8).planes);    // 8 rows per chunk
  EXPECT_FALSE(plan(DType::BF16, 48, 64, 2, 8).planes);    // N not a power of two
  EXPECT_FALSE(plan(DType::BF16, 64, 48, 2, 8).planes);    // P not a power of two
  EXPECT_TRUE(plan(DType::BF16, 64, 64, 2, 8).planes);     // (the same with powers of two)
}

// Which planes K3 the launch takes (bb::k3_kind, as mimo_bwd_bwd.cu): at SPEC.md's grid shapes
// with the benchmark's operands (bench/bench_mimo_bwd.py's bwd_bwd: contiguous, aligned, its
// dtypes, reduce-O dout) the copy specialised to the shape and the contiguous layouts; any other
// dtype, layout, stride, alignment or a gate keeps the shape-specialised copy; shapes off the
// grid the generic kernel.
TEST(MimoBwdBwdEmulated, PlanPicksContiguousLayoutKernel) {
  if (!bb::planes_allowed_by_env())
    GTEST_SKIP() << "MAMBA3_BB_PLANES=0: the plan never takes the planes kernels";
  if (!bb::specialized_allowed_by_env())
    GTEST_SKIP() << "MAMBA3_BB_SPECIALIZED=0: the launch never takes the specialised kernels";
  using mamba3::DType;
  using K = bb::K3Kind;
  const DType F = DType::F32, BF = DType::BF16;
  // Fake, aligned device addresses (make_args reads none of them), one per tensor.
  uintptr_t next = uintptr_t{1} << 20;
  auto tv = [&](DType dt, std::vector<int64_t> shape) {
    mamba3::TensorView t;
    t.data = reinterpret_cast<void*>(next);
    next += uintptr_t{1} << 32;
    t.dtype = dt;
    t.ndim = static_cast<int>(shape.size());
    int64_t st = 1;
    for (int i = t.ndim - 1; i >= 0; --i) t.shape[i] = shape[i], t.strides[i] = st, st *= shape[i];
    return t;
  };
  auto params = [&](int64_t N, int64_t P, int64_t R, int64_t C) {
    mamba3::MimoBwdBwdParams p;
    const int64_t B = 2, S = 100, H = 4, G = 2, nch = (S + C - 1) / C, A = N / 4;
    p.B = B, p.S = S, p.H = H, p.G = G, p.N = N, p.P = P, p.R = R, p.C = C, p.nchunks = nch;
    p.A = A, p.has_d = true, p.dout_layout = mamba3::MimoDout::ReduceO;
    p.dout = tv(BF, {B, S, H, P}), p.q = tv(BF, {B, S, R, G, N}), p.k = tv(BF, {B, S, R, G, N});
    p.v = tv(BF, {B, S, H, P}), p.q_bias = tv(F, {H, R, N}), p.k_bias = tv(F, {H, R, N});
    p.mimo_v = tv(F, {H, R, P}), p.mimo_o = tv(F, {H, R, P});
    p.states = tv(BF, {B, H, nch, N, P}), p.qk_dot = tv(BF, {B, H, S, R, R});
    p.da_cs = tv(F, {B, H, S}), p.da_cs_rev = tv(F, {B, H, S}), p.dt = tv(F, {B, H, S});
    p.trap = tv(BF, {B, H, S}), p.segsum = tv(F, {B, H, nch, C, C});
    p.angles = tv(F, {B, S, H, A}), p.d = tv(F, {H});
    p.dq = tv(BF, {B, S * R, H, N}), p.dk = tv(BF, {B, S * R, H, N}), p.dv = tv(BF, {B, S, H, P});
    p.dmimo_v = tv(F, {B, H, R, P}), p.dangles = tv(F, {B, S, H, A});
    p.dfactor = tv(F, {B, H, S}), p.dgamma = tv(F, {B, H, S}), p.dda = tv(F, {B, H, S});
    p.dssda = tv(F, {B, H, nch, C, C}), p.dda_cs_rev = tv(F, {B, H, S});
    p.dda_cs = tv(F, {B, H, S}), p.dd = tv(F, {B, H});
    return p;
  };
  auto kind = [](const mamba3::MimoBwdBwdParams& p) {
    const bb::Plan pl = bb::make_plan(p);
    EXPECT_TRUE(pl.planes);
    return bb::k3_kind(bb::make_args(p, pl, reinterpret_cast<void*>(uintptr_t{1} << 12)));
  };
  const int64_t grid[][4] = {{16, 64, 4, 8},   {32, 64, 4, 16},  {64, 64, 4, 16},
                             {128, 64, 4, 16}, {256, 64, 4, 8},  {64, 128, 4, 16},
                             {128, 32, 4, 16}, {128, 128, 4, 8}, {128, 64, 8, 8},
                             {128, 64, 2, 32}, {128, 64, 1, 64}};
  for (const auto& g : grid) {
    SCOPED_TRACE("N" + std::to_string(g[0]) + " P" + std::to_string(g[1]) + " R" +
                 std::to_string(g[2]) + " C" + std::to_string(g[3]));
    EXPECT_EQ(kind(params(g[0], g[1], g[2], g[3])), K::kShapeLayout);
    mamba3::MimoBwdBwdParams p = params(g[0], g[1], g[2], g[3]);
    p.has_d = false, p.d = mamba3::TensorView{}, p.dd = mamba3::TensorView{};
    EXPECT_EQ(kind(p), K::kShapeLayout) << "without d";
  }
  // One change at a time, at N128 P64 R4 C16: the shape-specialised copy.
  using Pm = mamba3::MimoBwdBwdParams;
  using Edit = void (*)(Pm&);
  const std::pair<const char*, Edit> edits[] = {
      {"fp32 dout (the combined backward)", [](Pm& p) { p.dout.dtype = DType::F32; }},
      {"fp32 states", [](Pm& p) { p.states.dtype = DType::F32; }},
      {"fp32 dq, dk", [](Pm& p) { p.dq.dtype = p.dk.dtype = DType::F32; }},
      {"fp32 dv", [](Pm& p) { p.dv.dtype = DType::F32; }},
      {"bf16 q_bias", [](Pm& p) { p.q_bias.dtype = DType::BF16; }},
      {"bf16 dt", [](Pm& p) { p.dt.dtype = DType::BF16; }},
      {"fp32 qk_dot", [](Pm& p) { p.qk_dot.dtype = DType::F32; }},
      {"fp32 trap", [](Pm& p) { p.trap.dtype = DType::F32; }},
      {"bf16 dangles", [](Pm& p) { p.dangles.dtype = DType::BF16; }},
      {"padded q rows",
       [](Pm& p) {
         for (int i = 0; i < 3; ++i) p.q.strides[i] *= 2;
         p.q.strides[3] += 8;
       }},
      {"transposed segsum", [](Pm& p) { std::swap(p.segsum.strides[3], p.segsum.strides[4]); }},
      {"strided dssda", [](Pm& p) { p.dssda.strides[4] = 2; }},
      {"padded states",
       [](Pm& p) {
         for (int i = 0; i < 4; ++i) p.states.strides[i] += 2;
       }},
      {"q base off quads", [](Pm& p) { p.q.data = static_cast<char*>(p.q.data) + 4; }},
      {"per-rank dout", [](Pm& p) {
         p.dout_layout = mamba3::MimoDout::PerRank;
         p.mimo_o = mamba3::TensorView{};
         const int64_t st[] = {p.S * p.R * p.H * p.P, p.R * p.H * p.P, p.H * p.P, p.P, 1};
         p.dout.ndim = 5;
         for (int i = 0; i < 5; ++i) p.dout.strides[i] = st[i];
         p.dout.shape[0] = p.B, p.dout.shape[1] = p.S, p.dout.shape[2] = p.R;
         p.dout.shape[3] = p.H, p.dout.shape[4] = p.P;
       }},
  };
  for (const auto& [what, edit] : edits) {
    mamba3::MimoBwdBwdParams p = params(128, 64, 4, 16);
    edit(p);
    EXPECT_EQ(kind(p), K::kShape) << what;
  }
  {  // the gate alone (what the combined backward's z adds)
    mamba3::MimoBwdBwdParams p = params(128, 64, 4, 16);
    p.z = tv(DType::BF16, {p.B, p.S, p.H, p.P}), p.mimo_z = tv(DType::F32, {p.H, p.R, p.P});
    EXPECT_EQ(kind(p), K::kShape) << "gate";
  }
  // The combined backward's operands (mimo_bwd_combined.cu with z, no norm: fp32 states,
  // qk_dot, dq, dk, the gate): its own contiguous-layout copy at every grid shape ...
  auto combined = [&](int64_t N, int64_t P, int64_t R, int64_t C) {
    mamba3::MimoBwdBwdParams p = params(N, P, R, C);
    p.states = tv(F, {p.B, p.H, p.nchunks, N, P}), p.qk_dot = tv(F, {p.B, p.H, p.S, R, R});
    p.dq = tv(F, {p.B, p.S * R, p.H, N}), p.dk = tv(F, {p.B, p.S * R, p.H, N});
    p.z = tv(BF, {p.B, p.S, p.H, P}), p.mimo_z = tv(F, {p.H, R, P});
    return p;
  };
  for (const auto& g : grid)
    EXPECT_EQ(kind(combined(g[0], g[1], g[2], g[3])), K::kShapeLayoutCombined)
        << "combined N" << g[0] << " P" << g[1] << " R" << g[2] << " C" << g[3];
  // ... and the shape-only copy when one of them differs.
  const std::pair<const char*, Edit> cb_edits[] = {
      {"no gate", [](Pm& p) { p.z = p.mimo_z = mamba3::TensorView{}; }},
      {"bf16 states", [](Pm& p) { p.states.dtype = DType::BF16; }},
      {"bf16 qk_dot", [](Pm& p) { p.qk_dot.dtype = DType::BF16; }},
      {"bf16 dq, dk", [](Pm& p) { p.dq.dtype = p.dk.dtype = DType::BF16; }},
      {"fp32 dout", [](Pm& p) { p.dout.dtype = DType::F32; }},
      {"fp32 z", [](Pm& p) { p.z.dtype = DType::F32; }},
      {"bf16 mimo_z", [](Pm& p) { p.mimo_z.dtype = DType::BF16; }},
      {"padded z rows", [](Pm& p) {
         for (int i = 0; i < 3; ++i) p.z.strides[i] *= 2;
       }},
  };
  for (const auto& [what, edit] : cb_edits) {
    mamba3::MimoBwdBwdParams p = combined(128, 64, 4, 16);
    edit(p);
    EXPECT_EQ(kind(p), K::kShape) << "combined, " << what;
  }
  // MAMBA3_BB_CT_LAYOUT=0: the shape-specialised copy.
  setenv("MAMBA3_BB_CT_LAYOUT", "0", 1);
  const K off = kind(params(128, 64, 4, 16)), cb_off = kind(combined(128, 64, 4, 16));
  unsetenv("MAMBA3_BB_CT_LAYOUT");
  EXPECT_EQ(off, K::kShape) << "MAMBA3_BB_CT_LAYOUT=0";
  EXPECT_EQ(cb_off, K::kShape) << "MAMBA3_BB_CT_LAYOUT=0, combined";
  // Off the grid (no specialised copies): the generic kernel, contiguous or not.
  EXPECT_EQ(kind(params(64, 64, 2, 8)), K::kGeneric);
  EXPECT_EQ(kind(params(64, 64, 4, 8)), K::kGeneric);
}

// The plan's choice of tensor-core products (3xTF32): 16-bit q, k and v (dout of any dtype:
// the combined backward passes an fp32 one), and N, P and the chunk's rows C R multiples of 16;
// fp32 q, k or v keep the FFMA tiles (they must match the float32 reference itself).
TEST(MimoBwdBwdEmulated, PlanPicksTensorCoresFor16BitQkv) {
  using mamba3::DType;
  auto plan = [](DType qkv, DType dout, int64_t N, int64_t P, int64_t R, int64_t C) {
    mamba3::MimoBwdBwdParams p;
    p.B = 1, p.S = 64, p.H = 1, p.G = 1, p.N = N, p.P = P, p.R = R, p.C = C;
    p.nchunks = (p.S + C - 1) / C;
    p.A = N / 4;
    p.q.dtype = p.k.dtype = p.v.dtype = qkv;
    p.dout.dtype = dout;
    return bb::make_plan(p);
  };
  EXPECT_TRUE(plan(DType::BF16, DType::BF16, 128, 64, 4, 16).tc);
  EXPECT_TRUE(plan(DType::F16, DType::F32, 64, 32, 2, 8).tc);   // fp32 dout
  EXPECT_FALSE(plan(DType::F32, DType::BF16, 128, 64, 4, 16).tc);  // fp32 q, k, v
  EXPECT_FALSE(plan(DType::BF16, DType::BF16, 24, 64, 4, 16).tc);  // N % 16
  EXPECT_FALSE(plan(DType::BF16, DType::BF16, 64, 40, 4, 16).tc);  // P % 16
  EXPECT_FALSE(plan(DType::BF16, DType::BF16, 64, 64, 1, 8).tc);   // C R = 8 rows
  // K1's row tiles are whole mma k-steps (multiples of 8 rows) under its shared-memory budget.
  EXPECT_EQ(plan(DType::BF16, DType::BF16, 256, 64, 8, 64).k1_rows % 8, 0);
}

}  // namespace

#endif  // MAMBA3_GOLDEN_CUDA
