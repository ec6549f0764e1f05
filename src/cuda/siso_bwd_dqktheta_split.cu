// compute_dqktheta, split-run kernel: the model's usual rotary layout (A = N/4 rotated pairs, i.e.
// rope on the first half of the head dimension) with 16-bit q/k/dq_in/dk_in/dq/dk, float32
// angles and row scalars, 8-byte aligned rows and 32-bit offsets. Everything else runs the
// kernels of siso_bwd_dqktheta.cu.
//
// Why a third kernel: the lean kernel spends ~240 warp instructions per (position, head) at
// N = 128 (ncu, H200), of which the arithmetic is ~90; the rest is per-item overhead (the
// dq/dk head sums through shared memory per item, the bias partials per (head, block), address
// arithmetic, the L2 prefetch) and the rotation of lanes that hold no rotated pair. The
// operator must move its bytes near the copy ceiling, which at ~55% issue efficiency leaves
// ~130 instructions per item. This kernel is laid out so that each reduction is cheap:
// * A lane owns 8 elements of one head's row in two runs of 4: [4c, 4c+4) in the rotated half and
//   [N/2 + 4c, N/2 + 4c + 4) in the plain half (c = lane's column, LPR = N/8 lanes per row). Every
//   lane rotates exactly two pairs (no lane computes a sin/cos it then discards), and a row is
//   read as two coalesced 8-byte-per-lane pieces.
// * The HR = 32 / LPR rows of a warp are HR different heads of the SAME position, and a warp keeps
//   its heads for the whole kernel: the q/k bias gradients are plain register sums (one per lane
//   for its head and columns), reduced once per CTA at the end.
// * dq/dk (sums over the heads of the group): when a warp holds all heads of the group (WH = 1,
//   e.g. N = 64 with 4 heads per group) by a transposed butterfly across its rows, each row
//   storing a quarter (at HR = 4), and each warp walks a contiguous range of rows; otherwise
//   each head's term goes to shared memory and the CTA sums the HG terms of each element in a
//   fixed order after a barrier per block of PB positions.
// * Each warp walks its positions with a two-deep register pipeline: the loads of the next
//   position are issued before the current one is computed, across head and block boundaries.
//   (Three-deep was slower in the block walk, session 12: B4 +7%; in the whole-group walk, bf16
//   only, it is an A/B option: faster when every call wrote the same output memory, 1.7% slower
//   at GQA with outputs rotating, sessions 37-38.) The whole-group walk keeps its q/k biases in
//   a shared-memory table (registers for the third buffer).
// * The CTAs' bias partials: in the block walk summed inside the kernel after a grid barrier when
//   the launch can be cooperative (every CTA resident), else by the shared bias reduction kernel;
//   the whole-group walk is a programmatic dependent launch and the reduction kernel sums its
//   partials, also a dependent launch (each launch gap overlaps the kernel before it).
// Deterministic: every sum has a fixed order, no atomics.
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <tuple>
#include <type_traits>

#include "core/error.hpp"
#include "cuda/common.cuh"
#include "cuda/cu_seqlens.cuh"
#include "cuda/siso_bwd_dqktheta_shared.cuh"

#include <cooperative_groups.h>

namespace mamba3::cuda::dqk {
namespace {

constexpr int kUnits = 4;  // positions per warp per block (even: the pipeline alternates 2 buffers)

struct SplitArgs : DqkTensors {
  int WH, WR, PB, nblk;
  uint32_t q_ssb, gi_ssb;  // q/k and dq_in/dk_in position strides in bytes (the walk's steps)
  // From a batch row's last position to the next row's first: stride_b - (S - 1) stride_s per
  // offset (q/k, dq_in/dk_in in bytes), modulo 2^32 (the sum lands on a valid offset).
  uint32_t wrq, wrg, wra, wrs;
  int tab_off;  // float offset of the bias table in shared memory (whole-group layout)
  // fused: launched cooperatively; after a grid barrier the CTAs also sum the bias partials into
  // dq_bias / dk_bias (else bias_reduce_kernel does, as for the other kernels).
  int fused;
  float *dqb, *dkb;
  int64_t dqb_sh, dqb_sn, dkb_sh, dkb_sn;
};

// This lane's head and column terms of the walk's offsets (LaneOff) and its row-scalar pointer.
// q/k and dq_in/dk_in: byte offsets (the host checks that every byte offset of those tensors
// fits in 31 bits); angles/dangles: element offsets. Unsigned, so that base + offset is a
// zero-extending add (no sign word per address). The row scalars' head term stays in `rs` (and
// is added again for the dscale / dgamma stores): one register less, which the whole-group
// walk's three-deep pipeline needs (it spilled with a fourth lane term).
struct LaneOff {
  uint32_t q, g, a;
};
struct LanePtrs {
  LaneOff o;
  const float* rs;  // scale, gamma or dqk by the lane's column, at the lane's head
};

// A position (flattened row = b * S + s) of the walk, with this lane's offsets into q/k (bytes),
// dq_in/dk_in (bytes) and angles/dangles (elements), head and column terms included, and the
// row scalars' element offset without its head term: the walk advances them by constant
// strides, and the loads and stores use them as they are. A position past the last row is
// marked invalid and points at a valid row (row 0, or the walk's previous one), so that its loads
// need no branch (their values are never used for an output).
struct Pos {
  int b, s;
  uint32_t oq, og, oa, os;
  bool val;
};

// The same offsets as b * stride_b + s * stride_s + lane term, in 32 bits (they all fit).
__device__ __forceinline__ void pos_offsets(Pos& p, const SplitArgs& a, const LaneOff& l) {
  const uint32_t b = static_cast<uint32_t>(p.b), s = static_cast<uint32_t>(p.s);
  p.oq = l.q + 2u * (b * static_cast<uint32_t>(a.q_sb) + s * static_cast<uint32_t>(a.q_ss));
  p.og = l.g + 2u * (b * static_cast<uint32_t>(a.gi_sb) + s * static_cast<uint32_t>(a.gi_ss));
  p.oa = l.a + b * static_cast<uint32_t>(a.an_sb) + s * static_cast<uint32_t>(a.an_ss);
  p.os = b * static_cast<uint32_t>(a.sm_sb) + s * static_cast<uint32_t>(a.sm_ss);
}

// One position further along s: every offset plus its stride (q/k and dq_in/dk_in in bytes).
__device__ __forceinline__ void pos_advance(Pos& p, const SplitArgs& a) {
  p.oq += a.q_ssb, p.og += a.gi_ssb;
  p.oa += static_cast<uint32_t>(a.an_ss), p.os += static_cast<uint32_t>(a.sm_ss);
}

// `lim`: the end of the rows this warp walks (a.rows, or the end of its range).
__device__ __forceinline__ Pos pos_of(int row, int lim, const SplitArgs& a, const LaneOff& l) {
  Pos p;
  p.val = row < lim;
  const uint32_t r = p.val ? static_cast<uint32_t>(row) : 0u;
  const uint32_t q = r / static_cast<uint32_t>(a.S);
  p.b = static_cast<int>(q);
  p.s = static_cast<int>(r - q * static_cast<uint32_t>(a.S));
  pos_offsets(p, a, l);
  return p;
}

// The next row: offsets advanced by one position, or across a batch row's end by the host's
// wrap deltas (no division, no lane terms: the walks keep no lane terms live for this). Past
// `lim` the position is invalid and keeps the previous one's offsets (a valid row, so its loads
// need no branch either).
__device__ __forceinline__ Pos pos_next(Pos p, int row_next, int lim, const SplitArgs& a) {
  if (row_next >= lim) {
    p.val = false;
    return p;
  }
  if (++p.s == a.S) {
    p.s = 0, ++p.b;
    p.oq += a.wrq, p.og += a.wrg, p.oa += a.wra, p.os += a.wrs;
  } else {
    pos_advance(p, a);
  }
  return p;
}

// One position's inputs for this lane: runs 0 and 1 as two 16-bit pairs each (words 0-1, 2-3).
// rs: one of the head's row scalars, by the lane's column (0: scale, 1: gamma, else dqk); the
// row's lanes get all three by shuffles (one register per buffer instead of three).
struct Buf {
  uint32_t q[4], k[4], x[4], y[4];
  uint32_t an[2];
  float rs;
};

// `L1::no_allocate` loads for the streamed rows (dq_in, dk_in, angles: read once), taken by the
// block walk only when a CTA walks few blocks (run_split). Measured on an H100 with each call's
// outputs in fresh memory (session 37): B1 (4 blocks per CTA) -2.1%, B2 (8) +0.2%, the
// whole-group walk at GQA +4.2%; B4 / B8 (16, 62 blocks) +1.6% (session 36, where the outputs'
// memory made no difference). When every call writes the same output memory
// (a loop over one shape, as the caching allocator serves it) they looked 12-16% faster at GQA
// and B1: the previous call's outputs then stay in L2 and are overwritten there, never written
// back; these loads only shifted which lines L2 kept (docs/PERF.md, session 37).
// The asm is not volatile, so the compiler schedules it as it does __ldg: the inputs are
// read-only while the kernel runs. A kernel that waits for a previous one before its loads
// (pdl_wait) would need it volatile, or it could be moved above the wait.
template <bool kNA>
__device__ __forceinline__ void ld_row8(const void* p, uint32_t* w) {
  if constexpr (kNA)
    asm("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(w[0]), "=r"(w[1]) : "l"(p));
  else
    ld_global_words<8>(p, w);
}

template <int N, bool kNA>
__device__ __forceinline__ void load_unit(const SplitArgs& a, const LanePtrs& l, const Pos& p,
                                          Buf& u) {
  constexpr int kH = N / 2 * 2;  // byte offset of run 1
  ld_global_words<8>(a.q + p.oq, u.q);
  ld_global_words<8>(a.q + p.oq + kH, u.q + 2);
  ld_global_words<8>(a.k + p.oq, u.k);
  ld_global_words<8>(a.k + p.oq + kH, u.k + 2);
  ld_row8<kNA>(a.dqi + p.og, u.x);
  ld_row8<kNA>(a.dqi + p.og + kH, u.x + 2);
  ld_row8<kNA>(a.dki + p.og, u.y);
  ld_row8<kNA>(a.dki + p.og + kH, u.y + 2);
  ld_row8<kNA>(a.ang + p.oa, u.an);
  u.rs = __ldg(l.rs + p.os);
}

// kDepth 0: the block walk, head terms summed in shared memory, two-deep pipeline (1: the same
// with no-allocate loads, for grids whose CTAs walk few blocks). kDepth 2 or 3:
// every warp holds all heads of the group (WH = 1): dq/dk summed across the warp's rows, each warp
// walks a contiguous range of rows with a kDepth-deep pipeline. kDok (block walk): d_ok_state
// given, a compile-time flag (without it no per-position test). The whole-group walk is only
// instantiated with kDok and tests a.has_dok at run time: without the d_ok_state code its
// three-deep pipeline spilled (ptxas scheduled the loads differently).
template <class Tg, int N, int kDepth, bool kDok>
__global__ void __launch_bounds__(512, 1) dqk_split_kernel(const __grid_constant__ SplitArgs a) {
  using E = Elem<Tg>;
  constexpr bool kWhole = kDepth >= 2;
  constexpr bool kBlockNA = kDepth == 1;  // the block walk with no-allocate loads
  constexpr int LPR = N / 8, HR = 32 / LPR;
  constexpr int N4 = N / 4;  // float4 per (position, q|k) row of the head terms
  extern __shared__ __align__(16) float smem[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int WH = kWhole ? 1 : a.WH, HG = kWhole ? HR : a.HG, PB = a.PB;
  const int wh = warp % WH, wr = warp / WH;
  const int hr = lane / LPR, col = lane % LPR;
  const int g = blockIdx.y;
  const int head = wh * HR + hr;  // within the group
  const int h = g * HG + head;
  LanePtrs lp;
  lp.o.q = static_cast<uint32_t>((g * a.q_sg + 4 * col) * 2);
  lp.o.g = static_cast<uint32_t>((h * a.gi_sh + 4 * col) * 2);
  lp.o.a = static_cast<uint32_t>(h * a.an_sh + 2 * col);
  lp.rs = (col == 0 ? a.sc : col == 1 ? a.ga : a.dqk) + static_cast<int64_t>(h) * a.sm_sh;
  // The whole-group walk may be a programmatic dependent launch (run_split): nothing global
  // before this wait (a no-op after a plain launch).
  if constexpr (kWhole) pdl_wait();

  // Block walk: this lane's bias columns in registers (float32; any dtype and stride). All 16
  // raw loads are issued before the first conversion (with load_rt per element each load waited
  // for the previous one: ~16 L2 round trips before the first position, ncu / timeline of B4).
  float bqr[8], bkr[8];
  if constexpr (!kWhole) {
    uint32_t uq[8], uk[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const int64_t n = e < 4 ? 4 * col + e : N / 2 + 4 * col + e - 4;
      uq[e] = load_bits_rt(a.qb + (h * a.qb_sh + n * a.qb_sn) * dt_size(a.t_qb), a.t_qb);
      uk[e] = load_bits_rt(a.kb + (h * a.kb_sh + n * a.kb_sn) * dt_size(a.t_kb), a.t_kb);
    }
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      bqr[e] = bits_to_float(uq[e], a.t_qb);
      bkr[e] = bits_to_float(uk[e], a.t_kb);
    }
  }
  // Whole-group walk: the group's q/k biases as float32 in shared memory, [head][q|k][N], read
  // back as float4 per run at each position: the 16 registers go to the three-deep pipeline.
  // The same float values as a load per lane. (Filled while the first loads are in flight.)
  float* const btab = smem + a.tab_off;
  auto fill_bias_table = [&] {
    const int NV = HG * 2 * N;
    constexpr int kF = 8;  // loads in flight per thread
    for (int i0 = threadIdx.x; i0 < NV; i0 += kF * blockDim.x) {
      uint32_t v[kF];  // raw bits: every load in flight before the first conversion
#pragma unroll
      for (int u = 0; u < kF; ++u) {
        const int i = i0 + u * static_cast<int>(blockDim.x);
        const int64_t hh = g * HG + i / (2 * N), n = i % N;
        v[u] = 0u;
        if (i < NV)
          v[u] = (i / N) & 1
                     ? load_bits_rt(a.kb + (hh * a.kb_sh + n * a.kb_sn) * dt_size(a.t_kb), a.t_kb)
                     : load_bits_rt(a.qb + (hh * a.qb_sh + n * a.qb_sn) * dt_size(a.t_qb), a.t_qb);
      }
#pragma unroll
      for (int u = 0; u < kF; ++u) {
        const int i = i0 + u * static_cast<int>(blockDim.x);
        if (i < NV) btab[i] = bits_to_float(v[u], (i / N) & 1 ? a.t_kb : a.t_qb);
      }
    }
    __syncthreads();
  };
  // This lane's bias runs: q run 0, run 1 at lb[0], lb[N4 / 2]; k's at lb[N4], lb[N4 + N4 / 2].
  const float4* const lb = reinterpret_cast<const float4*>(btab) + head * 2 * N4 + col;
  float sq[8], sk[8];  // this lane's q/k bias gradient terms, summed over all its positions
#pragma unroll
  for (int e = 0; e < 8; ++e) sq[e] = sk[e] = 0.f;

  // One position: everything but the dq/dk head sum, which `dqdk` receives (dq run 0, run 1, dk
  // run 0, run 1).
  auto compute = [&](const Pos& p, const Buf& u, float* dqdk) {
    float qf[8], kf[8], x[8], y[8];
    E::template unpack<8>(u.q, qf);
    E::template unpack<8>(u.k, kf);
    E::template unpack<8>(u.x, x);
    E::template unpack<8>(u.y, y);
    float bq[8], bk[8];
    if constexpr (!kWhole) {
#pragma unroll
      for (int e = 0; e < 8; ++e) bq[e] = bqr[e], bk[e] = bkr[e];
    } else {
      const float4 q0 = lb[0], q1 = lb[N4 / 2], k0 = lb[N4], k1 = lb[N4 + N4 / 2];
      bq[0] = q0.x, bq[1] = q0.y, bq[2] = q0.z, bq[3] = q0.w;
      bq[4] = q1.x, bq[5] = q1.y, bq[6] = q1.z, bq[7] = q1.w;
      bk[0] = k0.x, bk[1] = k0.y, bk[2] = k0.z, bk[3] = k0.w;
      bk[4] = k1.x, bk[5] = k1.y, bk[6] = k1.z, bk[7] = k1.w;
    }
    const float scl = __shfl_sync(0xffffffffu, u.rs, 0, LPR);
    const float gam = __shfl_sync(0xffffffffu, u.rs, 1, LPR);
    const float dqk = __shfl_sync(0xffffffffu, u.rs, 2, LPR);
    const float gd = dqk * gam;
    float dsc = 0.f, qkd = 0.f, dan[2], sn[2], cs[2];
    float* dqp = dqdk;
    float* dkp = dqdk + 8;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float qb0 = qf[2 * i] + bq[2 * i], qb1 = qf[2 * i + 1] + bq[2 * i + 1];
      const float kb0 = kf[2 * i] + bk[2 * i], kb1 = kf[2 * i + 1] + bk[2 * i + 1];
      float dqr0 = x[2 * i], dqr1 = x[2 * i + 1], dkr0 = y[2 * i], dkr1 = y[2 * i + 1];
      if (i < 2) {  // run 0: rotated pairs 2c + i
        fast_sincos(__uint_as_float(u.an[i]), &sn[i], &cs[i]);
        dqr0 = fmaf(x[2 * i], cs[i], x[2 * i + 1] * sn[i]);
        dqr1 = fmaf(x[2 * i + 1], cs[i], -(x[2 * i] * sn[i]));
        dkr0 = fmaf(y[2 * i], cs[i], y[2 * i + 1] * sn[i]);
        dkr1 = fmaf(y[2 * i + 1], cs[i], -(y[2 * i] * sn[i]));
      }
      const PairTerms pt = pair_terms(qb0, qb1, kb0, kb1, dqr0, dqr1, dkr0, dkr1, scl, gd, dsc, qkd);
      dqp[2 * i] = pt.dq0, dqp[2 * i + 1] = pt.dq1;
      dkp[2 * i] = pt.dk0, dkp[2 * i + 1] = pt.dk1;
      if (i < 2) dan[i] = pt.dan;
    }
    // d_ok_state enters dk (and so dk_bias and dangles) at a sequence's last position.
    if (kDok && (!kWhole || a.has_dok) && p.val) {
      int dseq = -1;
      if (!a.varlen) {
        if (p.s == a.S - 1) dseq = p.b;
      } else {
        const int i = a.cu.seq_of(p.s);
        if (a.cu.at(i + 1) - 1 == p.s) dseq = i;
      }
      if (dseq >= 0) {
        const int dsz = dt_size(a.t_dok);
        const unsigned char* po = a.dok + (static_cast<int64_t>(dseq) * a.dok_sq + h * a.dok_sh) * dsz;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int64_t n = i < 2 ? 4 * col + 2 * i : N / 2 + 4 * col + 2 * (i - 2);
          const float o0 = load_rt(po + n * a.dok_sn * dsz, a.t_dok);
          const float o1 = load_rt(po + (n + 1) * a.dok_sn * dsz, a.t_dok);
          float or0 = o0, or1 = o1;
          if (i < 2) {
            or0 = fmaf(o0, cs[i], o1 * sn[i]);
            or1 = fmaf(o1, cs[i], -(o0 * sn[i]));
            const float kb0 = kf[2 * i] + bk[2 * i], kb1 = kf[2 * i + 1] + bk[2 * i + 1];
            dan[i] += fmaf(kb0, or1, -(kb1 * or0));
          }
          dkp[2 * i] += or0;
          dkp[2 * i + 1] += or1;
        }
      }
    }
    // dscale and the q.k dot of dgamma: one transposed butterfly over the row; lane 0 of the row
    // ends with dscale, lane LPR/2 with the dot.
    float rv[2] = {dsc, qkd};
    row_reduce_t<2, LPR / 2>(rv, col);
    if (p.val) {
      const uint32_t os = p.os + static_cast<uint32_t>(h * a.sm_sh);
      if (col == 0) a.dsc[os] = rv[0];
      if (col == LPR / 2) a.dga[os] = dqk * rv[0];
      *reinterpret_cast<float2*>(a.dang + p.oa) = make_float2(dan[0], dan[1]);
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        sq[e] += dqp[e];
        sk[e] += dkp[e];
      }
    }
  };

  // dq, dk of a position held by a warp with all heads of the group: sums across its HR rows by
  // a transposed butterfly (each exchange sends half of the remaining values: 16 - 16 / HR
  // shuffles instead of 16 log2 HR), after which row r holds the full sums of the 16 / HR values
  // from offset sel(r) (bit j of r selects the upper half at exchange j) and stores them. The
  // same additions as a plain butterfly ((h0 + h1) + (h2 + h3) at HR = 4): same bits.
  auto store_whole = [&](const Pos& p, float* v) {
    xor_reduce_t<16, LPR, true>(v, lane);  // across the rows: masks LPR, 2 LPR, ..., 16
    constexpr int KV = 16 / HR;  // values per lane after the exchanges
    int sel = 0;
#pragma unroll
    for (int m = LPR, half = 8; m < 32; m <<= 1, half >>= 1)
      if (lane & m) sel += half;
    if (p.val) {
      // v[0..16): dq run 0, run 1, dk run 0, run 1 (4 values each); this lane's KV values start
      // at sel: tensor sel / 8, run (sel / 4) % 2, element offset sel % 4 in the run.
      const int oo = (p.b * a.go_sb + p.s * a.go_ss + g * a.go_sg + 4 * col) * 2;  // bytes
      static_assert(KV >= 2, "HR <= 8");
      uint32_t w[KV / 2];
      E::template pack<KV>(v, w);
      if constexpr (KV >= 4) {
#pragma unroll
        for (int r = 0; r < KV / 4; ++r) {
          const int vi = sel + 4 * r;
          st_global_words<8>((vi & 8 ? a.dk : a.dq) + oo + ((vi / 4) % 2) * N, w + 2 * r);
        }
      } else {
        st_global_words<4>((sel & 8 ? a.dk : a.dq) + oo + ((sel / 4) % 2) * N + (sel % 4) * 2, w);
      }
    }
  };
  // This head's dq/dk terms of block position pb into shared memory, [pb][q|k][head][N]: the heads
  // of one element are N floats apart (a compile-time stride for the summing loop).
  // Element offset of each block position's dq/dk row (-1: past the end), for the summing threads.
  int* const row_off = reinterpret_cast<int*>(smem + static_cast<size_t>(PB) * 2 * HG * N);
  auto stage_terms = [&](int pb, const Pos& p, const float* v) {
    if (wh == 0 && lane == 0)
      row_off[pb] = p.val ? p.b * a.go_sb + p.s * a.go_ss + g * a.go_sg : -1;
    float4* r = reinterpret_cast<float4*>(smem) + (static_cast<size_t>(pb) * 2 * HG + head) * N4;
    float4* rk = r + static_cast<size_t>(HG) * N4;
    r[col] = make_float4(v[0], v[1], v[2], v[3]);
    r[N4 / 2 + col] = make_float4(v[4], v[5], v[6], v[7]);
    rk[col] = make_float4(v[8], v[9], v[10], v[11]);
    rk[N4 / 2 + col] = make_float4(v[12], v[13], v[14], v[15]);
  };

  // Register pipeline buffers (Cb: three-deep whole-group walk only).
  Buf A, B, Cb;
  if constexpr (kWhole) {
    // Each warp walks a contiguous range [r0, r1) of rows, the grid's warps splitting the rows
    // evenly (no block granularity: at the GQA shape ~8 rows per warp in all).
    const int nw = static_cast<int>(gridDim.x * (blockDim.x >> 5));
    const int gw = static_cast<int>(blockIdx.x * (blockDim.x >> 5)) + warp;
    const int r0 = static_cast<int>(static_cast<int64_t>(a.rows) * gw / nw);
    const int r1 = static_cast<int>(static_cast<int64_t>(a.rows) * (gw + 1) / nw);
    Pos P0 = pos_of(r0, r1, a, lp.o);
    load_unit<N, false>(a, lp, P0, A);
    fill_bias_table();  // while those loads are in flight
    int row = r0;
    if constexpr (kDepth == 3) {
      Pos P1 = pos_next(P0, r0 + 1, r1, a);
      load_unit<N, false>(a, lp, P1, B);
      // Row `row`: load row + 2 into `fill`, compute `row` from `use`.
      auto step = [&](const Buf& use, Buf& fill) {
        const Pos P2 = pos_next(P1, row + 2, r1, a);
        load_unit<N, false>(a, lp, P2, fill);
        float v[16];
        compute(P0, use, v);
        store_whole(P0, v);
        P0 = P1, P1 = P2;
        ++row;
      };
      // Whole rounds of three, then the one or two rows left (no exit test between the steps
      // of a round: it cost registers).
      for (int n = (r1 - r0) / 3; n > 0; --n) {
        step(A, Cb);
        step(B, A);
        step(Cb, B);
      }
      if (row < r1) step(A, Cb);
      if (row < r1) step(B, A);
    } else {
      // Two-deep: row `row` computed while row + 1 loads.
      auto step = [&](const Buf& use, Buf& fill) {
        const Pos P1 = pos_next(P0, row + 1, r1, a);
        load_unit<N, false>(a, lp, P1, fill);
        float v[16];
        compute(P0, use, v);
        store_whole(P0, v);
        P0 = P1;
        ++row;
      };
      for (int n = (r1 - r0) / 2; n > 0; --n) {
        step(A, B);
        step(B, A);
      }
      if (row < r1) step(A, B);
    }
  } else {
    const int stride = static_cast<int>(gridDim.x);
    int blk = blockIdx.x;
    Pos P = pos_of(blk * PB + wr * kUnits, a.rows, a, lp.o);
    load_unit<N, kBlockNA>(a, lp, P, A);
    for (; blk < a.nblk; blk += stride) {
      const int row0 = blk * PB + wr * kUnits;
      // The warp's units of this block all in the batch row of unit 0 and before the end (the
      // usual case): each next position is the previous one's offsets plus the strides, no
      // tests per position.
      const bool inner = row0 + kUnits <= a.rows && P.s + kUnits <= a.S;
      // Unit i of the block: prefetch unit i+1 (or the next block's first) into `fill`, compute
      // unit i from `use`.
      auto step = [&](int i, const Buf& use, Buf& fill) {
        Pos Pn;
        if (i + 1 < kUnits) {
          if (inner) {
            Pn = P;
            ++Pn.s;
            pos_advance(Pn, a);
          } else {
            Pn = pos_next(P, row0 + i + 1, a.rows, a);
          }
        } else {
          Pn = pos_of(blk + stride < a.nblk ? (blk + stride) * PB + wr * kUnits : a.rows, a.rows,
                      a, lp.o);
        }
        load_unit<N, kBlockNA>(a, lp, Pn, fill);
        float v[16];
        compute(P, use, v);
        stage_terms(wr * kUnits + i, P, v);
        P = Pn;
      };
      static_assert(kUnits % 2 == 0, "the pipeline alternates two buffers");
#pragma unroll
      for (int i = 0; i < kUnits; i += 2) {
        step(i, A, B);
        step(i + 1, B, A);
      }
      {
        // dq/dk of the block: the HG head terms of each element summed as four interleaved
        // chains (heads h = j mod 4), then (0 + 1) + (2 + 3): a fixed order, and no 31-deep
        // dependent chain for every thread to wait on between two barriers. Two elements per task
        // so that every thread has work. HG is a power of two >= 2 here (see run_split).
        __syncthreads();
        const int tasks = PB * N;  // (position, q|k, element pair)
        for (int t = threadIdx.x; t < tasks; t += blockDim.x) {
          const int c2 = t % (N / 2), qk = (t / (N / 2)) & 1, pb = t / N;
          const float2* src = reinterpret_cast<const float2*>(smem) +
                              static_cast<size_t>(pb * 2 + qk) * HG * (N / 2) + c2;
          float2 s;
          if (HG == 2) {
            const float2 u0 = src[0], u1 = src[N / 2];
            s = make_float2(u0.x + u1.x, u0.y + u1.y);
          } else {
            // kHG: HG at compile time (0: at run time). HG = 32 (the B4 / B8 layout: 32 heads
            // per group at N = 128) is unrolled whole: no loop counter or remainder code in a
            // part that every thread runs once per block. The same chains in the same order.
            auto chains = [&](auto khg) {
              constexpr int kHG = decltype(khg)::value;
              const int hg = kHG > 0 ? kHG : HG;
              float2 c[4] = {src[0], src[N / 2], src[2 * (N / 2)], src[3 * (N / 2)]};
#pragma unroll(kHG > 0 ? 64 : 2)
              for (int hh = 4; hh < hg; hh += 4) {
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                  const float2 u = src[(hh + j) * (N / 2)];
                  c[j].x += u.x, c[j].y += u.y;
                }
              }
              return make_float2((c[0].x + c[1].x) + (c[2].x + c[3].x),
                                 (c[0].y + c[1].y) + (c[2].y + c[3].y));
            };
            s = HG == 32 ? chains(std::integral_constant<int, 32>{})
                         : chains(std::integral_constant<int, 0>{});
          }
          const int off = row_off[pb];
          if (off >= 0) {
            const float v2[2] = {s.x, s.y};
            uint32_t w;
            E::template pack<2>(v2, &w);
            *reinterpret_cast<uint32_t*>((qk ? a.dk : a.dq) + static_cast<int64_t>(off + 2 * c2) * 2) = w;
          }
        }
        __syncthreads();
      }
    }
  }

  // This CTA's bias partial: the WR warps of each head summed in order.
  const int NV = HG * 2 * N;  // bias values of the group
  float* out = a.ws + (static_cast<size_t>(g) * gridDim.x + blockIdx.x) * NV;
  auto put = [&](float* r) {
    *reinterpret_cast<float4*>(r + 4 * col) = make_float4(sq[0], sq[1], sq[2], sq[3]);
    *reinterpret_cast<float4*>(r + N / 2 + 4 * col) = make_float4(sq[4], sq[5], sq[6], sq[7]);
    *reinterpret_cast<float4*>(r + N + 4 * col) = make_float4(sk[0], sk[1], sk[2], sk[3]);
    *reinterpret_cast<float4*>(r + N + N / 2 + 4 * col) = make_float4(sk[4], sk[5], sk[6], sk[7]);
  };
  if (a.WR == 1) {
    // One warp per head (B4 / B8): its lanes hold the whole partial, stored as it is (the same
    // values as through shared memory, without its two barriers).
    put(out + static_cast<size_t>(head) * 2 * N);
  } else {
    __syncthreads();
    float* fin = smem;  // [WR][HG][q|k][N]
    put(fin + (static_cast<size_t>(wr) * HG + head) * 2 * N);
    __syncthreads();
    for (int i = threadIdx.x; i < NV; i += blockDim.x) {
      float s = fin[i];
      for (int w = 1; w < a.WR; ++w) s += fin[static_cast<size_t>(w) * NV + i];
      out[i] = s;
    }
  }
  if (!a.fused) return;

  // Every CTA's partial written: CTA x of group g sums the partials of its slice [e0, e1) of the
  // group's values. Thread t takes value e0 + t % VW (consecutive threads, consecutive values:
  // coalesced) and the CTAs c = t / VW + J u (J = threads / VW splits, a thread's loads all in
  // flight together); the J split sums meet in shared memory and are added in split order: a
  // fixed order (deterministic). Why not one thread per value: ~130 dependent-latency loads each.
  // kB = 17 loads per round: one L2 round trip at the usual grids (C <= 17 J: 132 CTAs with
  // J = 8 at B4 / B8, 66 at GQA; with 8 per round it took 3 / 2 after the grid barrier). Each
  // thread adds its CTAs in increasing c whatever kB is, and the unused slots add +0.f to a sum
  // that starts at +0.f (never -0.f): the same bits as with any other kB.
  cooperative_groups::this_grid().sync();
  const int C = static_cast<int>(gridDim.x), nt = static_cast<int>(blockDim.x);
  const int e0 = static_cast<int>(static_cast<int64_t>(NV) * blockIdx.x / C);
  const int e1 = static_cast<int>(static_cast<int64_t>(NV) * (blockIdx.x + 1) / C);
  const int VW = std::min(nt, std::max(32, (e1 - e0 + 31) / 32 * 32));  // values per pass
  const int J = nt / VW, tj = static_cast<int>(threadIdx.x) / VW;
  const float* part = a.ws + static_cast<size_t>(g) * C * NV;
  float* split = smem;  // [J][VW]
  for (int base = e0; base < e1; base += VW) {
    const int e = base + static_cast<int>(threadIdx.x) % VW;
    float acc = 0.f;
    if (tj < J && e < e1) {
      constexpr int kB = 17;
      for (int c0 = tj; c0 < C; c0 += kB * J) {
        float v[kB];
#pragma unroll
        for (int u = 0; u < kB; ++u) {
          const int c = c0 + u * J;
          v[u] = c < C ? __ldcg(part + static_cast<size_t>(c) * NV + e) : 0.f;
        }
#pragma unroll
        for (int u = 0; u < kB; ++u) acc += v[u];
      }
    }
    if (tj < J) split[tj * VW + threadIdx.x % VW] = acc;
    __syncthreads();
    if (static_cast<int>(threadIdx.x) < VW && e < e1) {
      float sum = split[threadIdx.x];
      for (int q = 1; q < J; ++q) sum += split[q * VW + threadIdx.x];
      const int hh = g * HG + e / (2 * N), qk = (e / N) & 1, n = e % N;
      if (qk)
        a.dkb[hh * a.dkb_sh + n * a.dkb_sn] = sum;
      else
        a.dqb[hh * a.dqb_sh + n * a.dqb_sn] = sum;
    }
    __syncthreads();
  }
}

using SplitKernel = void (*)(SplitArgs);

// The instantiation for (Tg, N, depth, dok) with its dynamic shared-memory limit raised to `smem`.
template <class Tg, int N, int kDepth, bool kDok>
SplitKernel prepared_at(int device, size_t smem) {
  ensure_dynamic_smem<dqk_split_kernel<Tg, N, kDepth, kDok>>(device, smem);
  return dqk_split_kernel<Tg, N, kDepth, kDok>;
}

// depth: 0 the block walk (1: with no-allocate loads); 2 or 3 the whole-group walk (d_ok_state
// tested at run time); three-deep for bf16 only (f16 spilled), an A/B option.
template <class Tg, int N>
SplitKernel prepared(int depth, bool dok, int device, size_t smem) {
  if (depth == 0)
    return dok ? prepared_at<Tg, N, 0, true>(device, smem)
               : prepared_at<Tg, N, 0, false>(device, smem);
  if (depth == 1)
    return dok ? prepared_at<Tg, N, 1, true>(device, smem)
               : prepared_at<Tg, N, 1, false>(device, smem);
  if constexpr (std::is_same<Tg, __nv_bfloat16>::value)
    if (depth == 3) return prepared_at<Tg, N, 3, true>(device, smem);
  return prepared_at<Tg, N, 2, true>(device, smem);
}

template <class Tg>
SplitKernel kernel_for(int N, int depth, bool dok, int device, size_t smem) {
  switch (N) {
    case 32: return prepared<Tg, 32>(depth, dok, device, smem);
    case 64: return prepared<Tg, 64>(depth, dok, device, smem);
    case 128: return prepared<Tg, 128>(depth, dok, device, smem);
    default: return prepared<Tg, 256>(depth, dok, device, smem);
  }
}

// Resident CTAs per SM of `kern` (occupancy calculator), cached per (kernel, device, CTA shape):
// the launch path makes no runtime query after the first call of a shape.
int resident_ctas(SplitKernel kern, int device, int threads, size_t smem) {
  static std::mutex mu;
  static std::map<std::tuple<const void*, int, int, size_t>, int> cache;
  std::lock_guard<std::mutex> lock(mu);
  const auto key = std::make_tuple(reinterpret_cast<const void*>(kern), device, threads, smem);
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  int n = 0;
  check_cuda(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kern, threads, smem),
             "compute_dqktheta: occupancy of the split-run kernel");
  cache[key] = n;
  return n;
}

}  // namespace

int run_split(const DqkthetaParams& p, float* ws, int sms, cudaStream_t st, bool* biases_done) {
  *biases_done = false;
  // MAMBA3_DQK_SPLIT=0 turns this kernel off (A/B measurements against the lean kernel).
  static const bool kOn = [] {
    const char* v = std::getenv("MAMBA3_DQK_SPLIT");
    return !(v && v[0] == '0');
  }();
  const int64_t N = p.N, HG = p.H / p.G;
  if (!kOn || (N != 32 && N != 64 && N != 128 && N != 256) || 4 * p.A != N) return 0;
  const DType tg = p.dq_in.dtype;
  if (tg != DType::BF16 && tg != DType::F16) return 0;
  if (!dqk_tensors_fit(p, 8, 8)) return 0;
  // The kernel forms byte offsets of the 16-bit tensors in 32 bits.
  for (const TensorView* v : {&p.q, &p.k, &p.dq_in, &p.dk_in, &p.dq, &p.dk})
    if (!offsets_fit_int32(*v, 2)) return 0;

  // Warps: WH cover the group's heads (HR per warp), WR split the positions. A warp with all
  // heads (WH = 1) needs no shared memory for dq/dk: 8 warps, several CTAs per SM; otherwise 16
  // warps share the head terms of PB positions in shared memory (one CTA per SM).
  const int HR = static_cast<int>(256 / N);
  if (HG % HR != 0) return 0;
  const int WH = static_cast<int>(HG / HR);
  if (WH > 16 || (16 % WH) != 0) return 0;
  const int W = WH == 1 ? 8 : 16;
  const int WR = W / WH;
  const int PB = WR * kUnits;
  // Block walk: head terms [PB][2][HG][N] floats and the PB row offsets behind them. Whole-group
  // walk: the bias table [HG][2][N] floats. The bias partials [WR][HG][2][N] at the end reuse
  // the space.
  const size_t terms = WH > 1 ? static_cast<size_t>(HG) * PB * 2 * N + PB : 0;
  const size_t tab = WH == 1 ? static_cast<size_t>(HG) * 2 * N : 0;
  const size_t fin = static_cast<size_t>(WR) * HG * 2 * N * 4;
  const size_t smem = std::max((terms + tab) * 4, fin);
  const DeviceProps& dp = device_props(p.device_id);
  const size_t optin = static_cast<size_t>(std::max(0, dp.smem_optin));
  const size_t per_sm = static_cast<size_t>(std::max(0, dp.smem_per_sm));
  const size_t rsv = static_cast<size_t>(std::max(0, dp.smem_reserved));
  if (smem > optin || smem + rsv > per_sm) return 0;
  // CTAs per SM: the kernel's registers allow one 16-warp or two 8-warp CTAs (launch bounds 512).
  const int occ = static_cast<int>(std::min<size_t>(
      {static_cast<size_t>(W == 16 ? 1 : kMaxCtasPerSm), per_sm / (smem + rsv)}));
  const int64_t rows = p.B * p.S;
  const int64_t nblk = (rows + PB - 1) / PB;
  int ctas = static_cast<int>(std::min<int64_t>(ctas_per_group_bound(p.G, sms, rows, occ), nblk));
  // The bias sums inside the kernel need every CTA resident at once (cooperative launch): the
  // grid must fit what the occupancy calculator allows; otherwise they run as a second kernel.
  // MAMBA3_DQK_WHOLE_DEPTH=3: the whole-group walk three-deep for bf16 (A/B; same bits). Two-deep
  // measured faster at GQA with outputs rotating (H100: session 37, 20.72 -> 20.40 us
  // cooperative, 19.96 -> 19.52 as a dependent launch; session 38, 19.88 -> 19.51 / 19.58).
  static const int kWholeDepth = [] {
    const char* v = std::getenv("MAMBA3_DQK_WHOLE_DEPTH");
    return v && v[0] == '3' ? 3 : 2;
  }();
  // The block walk's no-allocate loads at <= kNaMaxBlocks blocks per CTA (see ld_row8);
  // MAMBA3_DQK_NA_BLOCKS=k sets the bound (A/B; 0 = never).
  static const int64_t kNaMaxBlocks = [] {
    const char* v = std::getenv("MAMBA3_DQK_NA_BLOCKS");
    return v ? static_cast<int64_t>(std::atoll(v)) : int64_t{4};
  }();
  const int depth = WH == 1 ? kWholeDepth : ((nblk + ctas - 1) / ctas <= kNaMaxBlocks ? 1 : 0);
  const bool dok = p.has_dok != 0;
  const SplitKernel kern =
      tg == DType::BF16
          ? kernel_for<__nv_bfloat16>(static_cast<int>(N), depth, dok, p.device_id, smem)
          : kernel_for<__half>(static_cast<int>(N), depth, dok, p.device_id, smem);
  const int resident = resident_ctas(kern, p.device_id, W * 32, smem);
  // The whole-group walk (GQA): a programmatic dependent launch, its partials summed by the
  // reduction kernel (also a programmatic dependent), so that each launch gap overlaps the
  // kernel before it (GQA 20.72 -> 19.96 us with outputs rotating, H100, session 37); the block
  // walk keeps the cooperative launch (as a dependent it lost 3-7% at B1-B8, session 36).
  // MAMBA3_DQK_WG_PDL=0: the whole-group walk cooperative too (A/B).
  static const bool kWgPdl = [] {
    const char* v = std::getenv("MAMBA3_DQK_WG_PDL");
    return !(v && v[0] == '0');
  }();
  const bool pdl = WH == 1 && kWgPdl;
  const bool fused = !pdl && dp.coop_launch && static_cast<int64_t>(ctas) * p.G <=
                                                   static_cast<int64_t>(resident) * sms;

  SplitArgs a;
  std::memset(&a, 0, sizeof(a));
  fill_dqk_tensors(a, p, ws);
  a.WH = WH, a.WR = WR, a.PB = PB, a.nblk = static_cast<int>(nblk);
  // The walk's byte strides and wrap deltas, modulo 2^32 (every offset they reach fits).
  a.q_ssb = static_cast<uint32_t>(p.q.strides[1] * 2);
  a.gi_ssb = static_cast<uint32_t>(p.dq_in.strides[1] * 2);
  auto wrap = [&](int64_t sb, int64_t ss, int64_t bytes) {
    return static_cast<uint32_t>(static_cast<uint64_t>((sb - (p.S - 1) * ss) * bytes));
  };
  a.wrq = wrap(p.q.strides[0], p.q.strides[1], 2);
  a.wrg = wrap(p.dq_in.strides[0], p.dq_in.strides[1], 2);
  a.wra = wrap(p.angles.strides[0], p.angles.strides[1], 1);
  a.wrs = wrap(p.scale.strides[0], p.scale.strides[2], 1);
  a.tab_off = 0;  // the table only in the whole-group walk, which has no head terms
  a.fused = fused;
  a.dqb = static_cast<float*>(p.dq_bias.data), a.dkb = static_cast<float*>(p.dk_bias.data);
  a.dqb_sh = p.dq_bias.strides[0], a.dqb_sn = p.dq_bias.strides[1];
  a.dkb_sh = p.dk_bias.strides[0], a.dkb_sn = p.dk_bias.strides[1];

  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(ctas), static_cast<unsigned>(p.G));
  cfg.blockDim = dim3(static_cast<unsigned>(W * 32));
  cfg.dynamicSmemBytes = smem;
  cfg.stream = st;
  cudaLaunchAttribute attr[1];
  if (pdl) {
    attr[0] = pdl_attr();
  } else {
    attr[0].id = cudaLaunchAttributeCooperative;
    attr[0].val.cooperative = 1;
  }
  cfg.attrs = attr;
  cfg.numAttrs = fused || pdl ? 1 : 0;
  cudaError_t e = cudaLaunchKernelEx(&cfg, kern, a);
  if (e == cudaErrorCooperativeLaunchTooLarge && fused) {
    // Fewer SMs available than the device has (e.g. an MPS limit): the same kernel without the
    // grid barrier, its partials summed by the reduction kernel.
    cudaGetLastError();
    a.fused = 0;
    cfg.numAttrs = 0;
    e = cudaLaunchKernelEx(&cfg, kern, a);
  }
  check_cuda(e, "compute_dqktheta: split-run kernel launch");
  *biases_done = a.fused != 0;
  return ctas;
}

}  // namespace mamba3::cuda::dqk
