// CUDA backend of compute_dqktheta (seed 000): gradients through the q/k biases, the interleaved
// rotary embedding and the angles.
//
// Three kernels write the same outputs and the same per-CTA bias partials: the split-run kernel
// (siso_bwd_dqktheta_split.cu) takes the model's usual layout (A = N/4, 16-bit activations); the
// lean kernel (see its comment further down) the other common layouts and dtypes; the pipelined
// kernel described here everything else.
//
// Design (memory-bound: ~6 bytes moved per FMA-pair of work, so the goal is one pass at HBM speed):
// * One persistent 16-warp CTA per SM. A CTA owns a contiguous range of rows (flattened (b, s)) of
//   one q/k head g and walks it in row blocks. Its warps are split WH x WR: WH warps take the
//   heads of the group in turn (warp wh: heads wh, wh+WH, ...), WR warps take different rows. A
//   lane covers 8 elements of a row (J chunks of VEC elements, chunk c = col + j*L with L lanes
//   per row), so a warp handles 32/L rows of one head per "item".
// * Items are streamed through a per-warp cp.async pipeline of D shared-memory slots: dq_in, dk_in,
//   angles and the row scalars (scale, gamma, dqk) of item i+D are in flight while item i is
//   computed; q/k rows travel the same way (once per row block) through a small ring of Dq slots.
//   Each input byte is read from HBM once; each lane reads back only what it (or, for the row
//   scalars, its row's first lane) copied, so the pipeline needs no block barriers.
// * The group's biases are staged once per CTA in shared memory as float32 (read every item).
// * dq/dk are summed over the heads of the group in registers, then (WH > 1) across the WH warps in
//   a fixed order through shared memory, and written once per row block.
// * dscale/dgamma are dot products over the row: shuffles among the row's L lanes.
// * Bias gradients: each item's dq_pre/dk_pre are reduce-scattered over the warp's rows with
//   shuffles and added into per-(head, column) accumulators that live for the whole CTA (shared
//   memory, or this CTA's workspace slot when they do not fit); each CTA writes one partial per
//   head and a second kernel sums the partials in a fixed order. No float atomics: bitwise
//   deterministic.
// * Slots of a row whose rotated pairs are all beyond A (A < N/2) skip sincos and the rotation:
//   the lane layout (VEC, J) is chosen so that whole slots fall on one side of 2A when possible.
// * Two variants of the kernel. FAST (float32 angles/scale/gamma/dqk, vector-aligned rows, 8/16/32
//   lanes per row, 32-bit offsets): every dtype and the lane count are compile-time. Generic
//   (anything else, VEC 2): small tensors through runtime-dtype helpers, and layouts the vector
//   path cannot read (non-unit innermost stride, misaligned rows) in "element mode", where big
//   tensors are read and written element by element through their strides (slower, never wrong).
#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "core/error.hpp"
#include "cuda/common.cuh"
#include "cuda/cu_seqlens.cuh"
#include "cuda/siso_bwd.hpp"
#include "cuda/siso_bwd_dqktheta_shared.cuh"

namespace mamba3::cuda {
namespace {

using namespace dqk;

constexpr int kWarpsMax = 16;        // warps per CTA (WH * WR <= 16)
constexpr int kTargetCtasPerSm = 1;  // grid = 1 CTA per SM
constexpr int kLanesPerElem = 8;     // elements per lane (VEC * J)

struct DqkArgs {
  // problem
  int64_t rows;  // B * S, rows flattened as b * S + s
  int64_t S;
  int G, HG, N, A;
  // plan
  int nchunks, L, lshift, RPW, WH, WR, RB;
  int ctas_per_g, D, Dq;
  int elem;       // element mode (see the file comment)
  int acc_smem;   // bias accumulators in shared memory (else in this CTA's workspace slot)
  int bias_smem;  // the group's biases staged in shared memory as float32 (else read per item)
  int rot_slots;  // bit j: slot j holds rotated pairs (j * L * VEC/2 < A)
  // shared memory layout, bytes
  int st_bytes, st_dk, st_ang, st_scal;  // one warp's pipeline slot; dq_in at offset 0
  int qk_bytes, qk_k;                    // one warp's q/k slot; q at offset 0
  int sm_qk, sm_acc, sm_bias, sm_red;    // regions (pipeline slots start at 0)
  // runtime dtypes of the tensors read through the runtime-dtype helpers
  int t_q, t_ang, t_sc, t_ga, t_dqk, t_qb, t_kb, t_dok, t_dsc, t_dga;
  int ang_vec, dang_vec, qb_vec, kb_vec;
  // tensors: byte pointers, strides in elements
  const unsigned char *q, *k;
  int64_t q_sb, q_ss, q_sg, q_sn, k_sb, k_ss, k_sg, k_sn;
  const unsigned char *dqi, *dki;
  int64_t dqi_sb, dqi_ss, dqi_sh, dqi_sn, dki_sb, dki_ss, dki_sh, dki_sn;
  unsigned char *dq, *dk;
  int64_t dq_sb, dq_ss, dq_sg, dq_sn, dk_sb, dk_ss, dk_sg, dk_sn;
  const unsigned char* ang;
  int64_t ang_sb, ang_ss, ang_sh, ang_sa;
  unsigned char* dang;
  int64_t dang_sb, dang_ss, dang_sh, dang_sa;
  const unsigned char *sc, *ga, *dqk;
  int64_t sc_sb, sc_sh, sc_ss, ga_sb, ga_sh, ga_ss, dqk_sb, dqk_sh, dqk_ss;
  unsigned char *dsc, *dga;
  int64_t dsc_sb, dsc_sh, dsc_ss, dga_sb, dga_sh, dga_ss;
  const unsigned char *qb, *kb;
  int64_t qb_sh, qb_sn, kb_sh, kb_sn;
  const unsigned char* dok;
  int64_t dok_sq, dok_sh, dok_sn;
  int has_dok, varlen;
  CuSeqlens cu;
  float* ws;
  // byte spans of the tensors read by 32-bit words of 2-byte elements (see copy_elem_word)
  uintptr_t ang_lo, ang_hi, sc_lo, sc_hi, ga_lo, ga_hi, dqk_lo, dqk_hi;
};

// VEC values of a bias row chunk (runtime dtype): vector loads when the row is contiguous and
// aligned, element loads otherwise; zeros for a chunk past N.
template <int VEC>
__device__ __forceinline__ void load_bias_chunk(const unsigned char* row, int dt, int64_t sn,
                                                bool vec, bool valid, int c, float* out) {
  if (!valid) {
#pragma unroll
    for (int e = 0; e < VEC; ++e) out[e] = 0.f;
    return;
  }
  if (vec) {
    if (dt == kF32) {
      constexpr int NB = VEC * 4, PB = NB < 16 ? NB : 16;
      uint32_t w[VEC];
#pragma unroll
      for (int p = 0; p < NB / PB; ++p) ld_global_words<PB>(row + c * NB + p * PB, w + p * PB / 4);
#pragma unroll
      for (int e = 0; e < VEC; ++e) out[e] = __uint_as_float(w[e]);
    } else {
      constexpr int NB = VEC * 2, PB = NB < 16 ? NB : 16;
      uint32_t w[VEC / 2];
#pragma unroll
      for (int p = 0; p < NB / PB; ++p) ld_global_words<PB>(row + c * NB + p * PB, w + p * PB / 4);
#pragma unroll
      for (int e = 0; e < VEC / 2; ++e) {
        out[2 * e] = bits_to_float(w[e] & 0xffffu, dt);
        out[2 * e + 1] = bits_to_float(w[e] >> 16, dt);
      }
    }
    return;
  }
  const int sz = dt_size(dt);
#pragma unroll
  for (int e = 0; e < VEC; ++e)
    out[e] = load_rt(row + (static_cast<int64_t>(c) * VEC + e) * sn * sz, dt);
}

// Reads one chunk (VEC elements of runtime dtype `dt`) that was copied in pieces of
// min(16, VEC*size) bytes, lane-interleaved: piece p of chunk j at ((j*PP + p)*32 + lane)*PB.
template <int VEC, int ES>
__device__ __forceinline__ void read_chunk_smem(const unsigned char* base, int j, int lane, int dt,
                                                float* out) {
  constexpr int CB = VEC * ES, PB = CB < 16 ? CB : 16, PP = CB / PB;
  uint32_t w[CB / 4];
#pragma unroll
  for (int p = 0; p < PP; ++p)
    ld_shared_words<PB>(base + ((j * PP + p) * 32 + lane) * PB, w + p * (PB / 4));
  if constexpr (ES == 4) {
#pragma unroll
    for (int e = 0; e < VEC; ++e) out[e] = __uint_as_float(w[e]);
  } else {
#pragma unroll
    for (int e = 0; e < VEC / 2; ++e) {
      out[2 * e] = bits_to_float(w[e] & 0xffffu, dt);
      out[2 * e + 1] = bits_to_float(w[e] >> 16, dt);
    }
  }
}

// Issues the copies of one chunk (CB bytes at src) into the lane-interleaved layout above.
template <int CB>
__device__ __forceinline__ void issue_chunk(unsigned char* base, int j, int lane,
                                            const unsigned char* src, bool valid,
                                            const unsigned char* dummy) {
  constexpr int PB = CB < 16 ? CB : 16, PP = CB / PB;
#pragma unroll
  for (int p = 0; p < PP; ++p)
    cp_async<PB>(smem_addr(base + ((j * PP + p) * 32 + lane) * PB), valid ? src + p * PB : dummy,
                 valid);
}

// Stores NV consecutive values of a row of Tg (vector store when `vec`, else element stores
// through the innermost stride `sn`). `p` points at the first element.
template <class Tg, int NV>
__device__ __forceinline__ void store_run(unsigned char* p, int64_t sn, bool vec, const float* v) {
  using E = Elem<Tg>;
  constexpr int NB = NV * E::kSize;
  if (vec) {
    uint32_t w[NB / 4];
    E::template pack<NV>(v, w);
    constexpr int PB = NB < 16 ? NB : 16;
#pragma unroll
    for (int q = 0; q < NB / PB; ++q) st_global_words<PB>(p + q * PB, w + q * (PB / 4));
  } else {
#pragma unroll
    for (int e = 0; e < NV; ++e) E::store1(p + e * sn * E::kSize, v[e]);
  }
}

// row = b * S + s -> (b, s) (B and S are below 2^31, checked on the host); 32-bit division when
// the row fits (64-bit division is a long subroutine).
__device__ __forceinline__ void split_row(int64_t row, int64_t S, int& b, int& s) {
  if (row <= 0x7fffffff) {
    const uint32_t r = static_cast<uint32_t>(row), d = static_cast<uint32_t>(S);
    const uint32_t q = r / d;
    b = static_cast<int>(q);
    s = static_cast<int>(r - q * d);
  } else {
    const int64_t q = row / S;
    b = static_cast<int>(q);
    s = static_cast<int>(row - q * S);
  }
}

constexpr int clog2(int x) { return x <= 1 ? 0 : 1 + clog2(x >> 1); }

// LT > 0: the FAST variant with LT lanes per row (compile-time, so that the row and column
// reductions unroll); LT == 0: the generic variant.
template <class Tg, int VEC, int J, int LT>
__global__ void __launch_bounds__(kWarpsMax * 32, 1)
    dqktheta_kernel(const __grid_constant__ DqkArgs a) {
  constexpr bool FAST = LT > 0;
  using E = Elem<Tg>;
  constexpr int kSz = E::kSize;
  constexpr int CB = VEC * kSz;  // bytes of one chunk of dq_in / dk_in
  constexpr int NP = VEC / 2;    // rotation pairs per chunk
  constexpr int AB = NP * 4;     // angle bytes per chunk in a slot (one word per pair)
  static_assert(VEC * J == kLanesPerElem, "8 elements per lane");
  // FAST: angles, scale, gamma, dqk (and dangles, dscale, dgamma) are float32 with vector-aligned
  // angle rows, big tensors are vector-aligned (no element mode) and every element offset fits in
  // 32 bits; the host only picks it when all of that holds. Otherwise the generic variant reads
  // those tensors through the runtime-dtype helpers.
  constexpr int kTa = FAST ? kF32 : -1;

  extern __shared__ __align__(16) unsigned char smem[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int wh = warp % a.WH, wr = warp / a.WH;
  const int L = FAST ? LT : a.L;
  const int lshift = FAST ? clog2(LT) : a.lshift;
  const int rl = lane >> lshift, col = lane & (L - 1);
  const int g = blockIdx.y, cta = blockIdx.x;
  const int64_t r_lo = a.rows * cta / a.ctas_per_g;
  const int64_t r_hi = a.rows * (cta + 1) / a.ctas_per_g;
  const int nrb = static_cast<int>((r_hi - r_lo + a.RB - 1) / a.RB);
  const int ipr = (a.HG - wh + a.WH - 1) / a.WH;  // heads of this warp per row block
  const int n_items = nrb * ipr;
  const int D = a.D;
  const int N = a.N;
  const int t_ang = FAST ? kF32 : a.t_ang;
  const int sza = dt_size(t_ang);
  const int szq = dt_size(a.t_q);

  // Element offset x*sx + y*sy + z*sz: 32-bit arithmetic in the FAST variant (the host checked
  // that every offset fits), 64-bit otherwise.
  auto off3 = [](int64_t x, int64_t sx, int64_t y, int64_t sy, int64_t z, int64_t sz) -> int64_t {
    if constexpr (FAST) {
      return static_cast<int64_t>(static_cast<int>(x) * static_cast<int>(sx) +
                                  static_cast<int>(y) * static_cast<int>(sy) +
                                  static_cast<int>(z) * static_cast<int>(sz));
    } else {
      return x * sx + y * sy + z * sz;
    }
  };

  int cidx[J];
  bool cval[J], rot[J];
#pragma unroll
  for (int j = 0; j < J; ++j) {
    cidx[j] = col + j * L;
    cval[j] = cidx[j] < a.nchunks;
    rot[j] = (a.rot_slots >> j) & 1;
  }

  unsigned char* const st_base = smem + warp * D * a.st_bytes;
  unsigned char* const qk_base = smem + a.sm_qk + warp * a.Dq * a.qk_bytes;
  float* const acc = a.acc_smem ? reinterpret_cast<float*>(smem + a.sm_acc)
                                : a.ws + static_cast<size_t>(g * a.ctas_per_g + cta) * a.HG * 2 * N;
  // The group's biases as float32, [head][q|k][N], staged once per CTA (read every item).
  float* const bias_s = reinterpret_cast<float*>(smem + a.sm_bias);
  {
    const int n_acc = (a.acc_smem ? a.WR : 1) * a.HG * 2 * N;
    for (int i = threadIdx.x; i < n_acc; i += blockDim.x) acc[i] = 0.f;
    if (a.bias_smem) {
      const int n_b = a.HG * 2 * N;
      for (int i = threadIdx.x; i < n_b; i += blockDim.x) {
        const int n = i % N, qk = (i / N) & 1;
        const int64_t h = static_cast<int64_t>(g) * a.HG + i / (2 * N);
        bias_s[i] = qk ? load_rt(a.kb + (h * a.kb_sh + n * a.kb_sn) * dt_size(a.t_kb), a.t_kb)
                       : load_rt(a.qb + (h * a.qb_sh + n * a.qb_sn) * dt_size(a.t_qb), a.t_qb);
      }
    }
  }
  __syncthreads();

  // ---------------------------------------------------------------- producer: one item's copies
  int ib = 0, is = 0;  // (b, s) of this lane's row in the row block being issued
  bool irv = false;
  auto issue = [&](int ik, int ijj, int slot) {
    const int head = wh + ijj * a.WH;
    const int64_t h = static_cast<int64_t>(g) * a.HG + head;
    if (ijj == 0) {  // items are issued in order: a new row block starts here
      const int64_t row = r_lo + static_cast<int64_t>(ik) * a.RB + wr * a.RPW + rl;
      irv = row < r_hi;
      split_row(irv ? row : r_lo, a.S, ib, is);
    }
    const bool rv = irv;
    const int b = ib, s = is;
    unsigned char* sl = st_base + slot * a.st_bytes;
    if (FAST || !a.elem) {
      const unsigned char* pq = a.dqi + off3(b, a.dqi_sb, s, a.dqi_ss, h, a.dqi_sh) * kSz;
      const unsigned char* pk = a.dki + off3(b, a.dki_sb, s, a.dki_ss, h, a.dki_sh) * kSz;
#pragma unroll
      for (int j = 0; j < J; ++j) {
        const bool v = rv && cval[j];
        issue_chunk<CB>(sl, j, lane, pq + cidx[j] * CB, v, a.dqi);
        issue_chunk<CB>(sl + a.st_dk, j, lane, pk + cidx[j] * CB, v, a.dki);
      }
    }
    const unsigned char* pa = a.ang + off3(b, a.ang_sb, s, a.ang_ss, h, a.ang_sh) * sza;
#pragma unroll
    for (int j = 0; j < J; ++j) {
      if (!rot[j]) continue;
      unsigned char* dst = sl + a.st_ang + (j * 32 + lane) * AB;
      const int p0 = cidx[j] * NP;
      if (FAST || a.ang_vec) {
        // A % NP == 0 here, so a chunk's pairs are all valid or all past A.
        const bool v = rv && cval[j] && p0 < a.A;
        const unsigned char* src = v ? pa + p0 * sza : a.ang;
        if (FAST || sza == 4) {
          cp_async<NP * 4>(smem_addr(dst), src, v);
        } else if constexpr (NP * 2 >= 4) {
          cp_async<NP * 2>(smem_addr(dst), src, v);
        }
      } else {
#pragma unroll
        for (int t = 0; t < NP; ++t) {
          const int p = p0 + t;
          copy_elem_word(smem_addr(dst + 4 * t), pa + static_cast<int64_t>(p) * a.ang_sa * sza,
                         t_ang, rv && cval[j] && p < a.A, a.ang_lo, a.ang_hi);
        }
      }
    }
    if (col == 0) {
      unsigned char* ss = sl + a.st_scal;
      const unsigned char* p0 =
          a.sc + off3(b, a.sc_sb, h, a.sc_sh, s, a.sc_ss) * (FAST ? 4 : dt_size(a.t_sc));
      const unsigned char* p1 =
          a.ga + off3(b, a.ga_sb, h, a.ga_sh, s, a.ga_ss) * (FAST ? 4 : dt_size(a.t_ga));
      const unsigned char* p2 =
          a.dqk + off3(b, a.dqk_sb, h, a.dqk_sh, s, a.dqk_ss) * (FAST ? 4 : dt_size(a.t_dqk));
      if constexpr (FAST) {
        cp_async<4>(smem_addr(ss + (0 * a.RPW + rl) * 4), rv ? p0 : a.sc, rv);
        cp_async<4>(smem_addr(ss + (1 * a.RPW + rl) * 4), rv ? p1 : a.ga, rv);
        cp_async<4>(smem_addr(ss + (2 * a.RPW + rl) * 4), rv ? p2 : a.dqk, rv);
      } else {
        copy_elem_word(smem_addr(ss + (0 * a.RPW + rl) * 4), p0, a.t_sc, rv, a.sc_lo, a.sc_hi);
        copy_elem_word(smem_addr(ss + (1 * a.RPW + rl) * 4), p1, a.t_ga, rv, a.ga_lo, a.ga_hi);
        copy_elem_word(smem_addr(ss + (2 * a.RPW + rl) * 4), p2, a.t_dqk, rv, a.dqk_lo, a.dqk_hi);
      }
    }
    if (ijj == 0 && (FAST || !a.elem)) {
      unsigned char* qs = qk_base + (ik % a.Dq) * a.qk_bytes;
      const unsigned char* pq = a.q + off3(b, a.q_sb, s, a.q_ss, g, a.q_sg) * szq;
      const unsigned char* pk = a.k + off3(b, a.k_sb, s, a.k_ss, g, a.k_sg) * szq;
#pragma unroll
      for (int j = 0; j < J; ++j) {
        const bool v = rv && cval[j];
        if (szq == 4) {
          issue_chunk<VEC * 4>(qs, j, lane, pq + cidx[j] * VEC * 4, v, a.q);
          issue_chunk<VEC * 4>(qs + a.qk_k, j, lane, pk + cidx[j] * VEC * 4, v, a.k);
        } else {
          issue_chunk<VEC * 2>(qs, j, lane, pq + cidx[j] * VEC * 2, v, a.q);
          issue_chunk<VEC * 2>(qs + a.qk_k, j, lane, pk + cidx[j] * VEC * 2, v, a.k);
        }
      }
    }
  };

  // ---------------------------------------------------------------- pipeline prologue
  int ik = 0, ijj = 0;  // next item to issue (row block, head index)
  auto advance = [&](int& kk, int& jj) {
    if (++jj == ipr) jj = 0, ++kk;
  };
  for (int i = 0; i < D; ++i) {
    if (i < n_items) {
      issue(ik, ijj, i);
      advance(ik, ijj);
    }
    cp_async_commit();
  }

  // ---------------------------------------------------------------- consumer
  float qf[J][VEC], kf[J][VEC], accq[J][VEC], acck[J][VEC];
#pragma unroll
  for (int j = 0; j < J; ++j)
#pragma unroll
    for (int e = 0; e < VEC; ++e) qf[j][e] = kf[j][e] = accq[j][e] = acck[j][e] = 0.f;
  int cur_b = 0, cur_s = 0;  // this lane's row in the row block being consumed
  bool cur_rv = false;
  int dok_seq = -1;
  int ck = 0, cjj = 0, cslot = 0;

  for (int it = 0; it < n_items; ++it) {
    const int head = wh + cjj * a.WH;
    const int64_t h = static_cast<int64_t>(g) * a.HG + head;

    // Biases: from the CTA's float32 copy, or (when it did not fit) straight from global memory,
    // issued before the pipeline wait so that their latency overlaps it.
    float bq[J][VEC], bk[J][VEC];
    if (a.bias_smem) {
      const float* sq = bias_s + static_cast<size_t>(head) * 2 * N;
#pragma unroll
      for (int j = 0; j < J; ++j) {
        if (cval[j]) {
#pragma unroll
          for (int e = 0; e < VEC; e += (VEC >= 4 ? 4 : 2)) {
            if constexpr (VEC >= 4) {
              const float4 x = *reinterpret_cast<const float4*>(sq + cidx[j] * VEC + e);
              const float4 y = *reinterpret_cast<const float4*>(sq + N + cidx[j] * VEC + e);
              bq[j][e] = x.x, bq[j][e + 1] = x.y, bq[j][e + 2] = x.z, bq[j][e + 3] = x.w;
              bk[j][e] = y.x, bk[j][e + 1] = y.y, bk[j][e + 2] = y.z, bk[j][e + 3] = y.w;
            } else {
              const float2 x = *reinterpret_cast<const float2*>(sq + cidx[j] * VEC + e);
              const float2 y = *reinterpret_cast<const float2*>(sq + N + cidx[j] * VEC + e);
              bq[j][e] = x.x, bq[j][e + 1] = x.y;
              bk[j][e] = y.x, bk[j][e + 1] = y.y;
            }
          }
        } else {
#pragma unroll
          for (int e = 0; e < VEC; ++e) bq[j][e] = bk[j][e] = 0.f;
        }
      }
    } else {
#pragma unroll
      for (int j = 0; j < J; ++j) {
        load_bias_chunk<VEC>(a.qb + h * a.qb_sh * dt_size(a.t_qb), a.t_qb, a.qb_sn, a.qb_vec,
                             cval[j], cidx[j], bq[j]);
        load_bias_chunk<VEC>(a.kb + h * a.kb_sh * dt_size(a.t_kb), a.t_kb, a.kb_sn, a.kb_vec,
                             cval[j], cidx[j], bk[j]);
      }
    }

    cp_async_wait_dyn(D - 1);
    __syncwarp();
    const unsigned char* sl = st_base + cslot * a.st_bytes;

    if (cjj == 0) {  // first item of a row block: this lane's row, q and k
      const int64_t row = r_lo + static_cast<int64_t>(ck) * a.RB + wr * a.RPW + rl;
      cur_rv = row < r_hi;
      split_row(cur_rv ? row : r_lo, a.S, cur_b, cur_s);
      if (FAST || !a.elem) {
        const unsigned char* qs = qk_base + (ck % a.Dq) * a.qk_bytes;
#pragma unroll
        for (int j = 0; j < J; ++j) {
          if (szq == 4) {
            read_chunk_smem<VEC, 4>(qs, j, lane, kF32, qf[j]);
            read_chunk_smem<VEC, 4>(qs + a.qk_k, j, lane, kF32, kf[j]);
          } else {
            read_chunk_smem<VEC, 2>(qs, j, lane, a.t_q, qf[j]);
            read_chunk_smem<VEC, 2>(qs + a.qk_k, j, lane, a.t_q, kf[j]);
          }
        }
      } else {
        const unsigned char* pq = a.q + (cur_b * a.q_sb + cur_s * a.q_ss + g * a.q_sg) * szq;
        const unsigned char* pk = a.k + (cur_b * a.k_sb + cur_s * a.k_ss + g * a.k_sg) * szq;
#pragma unroll
        for (int j = 0; j < J; ++j)
#pragma unroll
          for (int e = 0; e < VEC; ++e) {
            const int64_t n = static_cast<int64_t>(cidx[j]) * VEC + e;
            const bool v = cur_rv && cval[j];
            qf[j][e] = v ? load_rt(pq + n * a.q_sn * szq, a.t_q) : 0.f;
            kf[j][e] = v ? load_rt(pk + n * a.k_sn * szq, a.t_q) : 0.f;
          }
      }
#pragma unroll
      for (int j = 0; j < J; ++j)
#pragma unroll
        for (int e = 0; e < VEC; ++e) accq[j][e] = acck[j][e] = 0.f;
      dok_seq = -1;
      if (a.has_dok && cur_rv) {
        if (!a.varlen) {
          if (cur_s == a.S - 1) dok_seq = cur_b;
        } else {
          const int i = a.cu.seq_of(cur_s);
          if (a.cu.at(i + 1) - 1 == cur_s) dok_seq = i;
        }
      }
    }

    // Row scalars (copied by the row's first lane).
    float scv, gav, dqkv;
    {
      const unsigned char* ss = sl + a.st_scal;
      const uint32_t w0 = *reinterpret_cast<const uint32_t*>(ss + (0 * a.RPW + rl) * 4);
      const uint32_t w1 = *reinterpret_cast<const uint32_t*>(ss + (1 * a.RPW + rl) * 4);
      const uint32_t w2 = *reinterpret_cast<const uint32_t*>(ss + (2 * a.RPW + rl) * 4);
      if constexpr (FAST) {
        scv = __uint_as_float(w0);
        gav = __uint_as_float(w1);
        dqkv = __uint_as_float(w2);
      } else {
        auto bit1 = [&](const unsigned char* base, int64_t sb, int64_t sh, int64_t sss) {
          return static_cast<uint32_t>(((reinterpret_cast<uintptr_t>(base) >> 1) +
                                        static_cast<uintptr_t>(cur_b * sb + h * sh + cur_s * sss)) &
                                       1u);
        };
        scv = word_elem_to_float(w0, a.t_sc,
                                 a.t_sc == kF32 ? 0u : bit1(a.sc, a.sc_sb, a.sc_sh, a.sc_ss));
        gav = word_elem_to_float(w1, a.t_ga,
                                 a.t_ga == kF32 ? 0u : bit1(a.ga, a.ga_sb, a.ga_sh, a.ga_ss));
        dqkv = word_elem_to_float(w2, a.t_dqk,
                                  a.t_dqk == kF32 ? 0u : bit1(a.dqk, a.dqk_sb, a.dqk_sh, a.dqk_ss));
      }
    }

    // dq_in, dk_in.
    float dqv[J][VEC], dkv[J][VEC];
    if (FAST || !a.elem) {
#pragma unroll
      for (int j = 0; j < J; ++j) {
        read_chunk_smem<VEC, kSz>(sl, j, lane, E::kDt, dqv[j]);
        read_chunk_smem<VEC, kSz>(sl + a.st_dk, j, lane, E::kDt, dkv[j]);
      }
    } else {
      const unsigned char* pq = a.dqi + (cur_b * a.dqi_sb + cur_s * a.dqi_ss + h * a.dqi_sh) * kSz;
      const unsigned char* pk = a.dki + (cur_b * a.dki_sb + cur_s * a.dki_ss + h * a.dki_sh) * kSz;
#pragma unroll
      for (int j = 0; j < J; ++j)
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          const int64_t n = static_cast<int64_t>(cidx[j]) * VEC + e;
          const bool v = cur_rv && cval[j];
          dqv[j][e] = v ? E::load1(pq + n * a.dqi_sn * kSz) : 0.f;
          dkv[j][e] = v ? E::load1(pk + n * a.dki_sn * kSz) : 0.f;
        }
    }

    // Angles of the rotated slots (zero, i.e. no rotation, for pairs past A).
    float th[J][NP];
    {
#pragma unroll
      for (int j = 0; j < J; ++j) {
#pragma unroll
        for (int t = 0; t < NP; ++t) th[j][t] = 0.f;
        if (!rot[j]) continue;
        uint32_t w[NP];
        ld_shared_words<AB>(sl + a.st_ang + (j * 32 + lane) * AB, w);
        if (kTa == kF32 || t_ang == kF32) {
#pragma unroll
          for (int t = 0; t < NP; ++t) th[j][t] = __uint_as_float(w[t]);
        } else if (a.ang_vec) {
#pragma unroll
          for (int t = 0; t < NP; ++t)
            th[j][t] = bits_to_float((w[t >> 1] >> ((t & 1) * 16)) & 0xffffu, t_ang);
        } else {
          const uintptr_t abase =
              (reinterpret_cast<uintptr_t>(a.ang) >> 1) +
              static_cast<uintptr_t>(cur_b * a.ang_sb + cur_s * a.ang_ss + h * a.ang_sh);
#pragma unroll
          for (int t = 0; t < NP; ++t) {
            const int64_t p = static_cast<int64_t>(cidx[j]) * NP + t;
            const uint32_t bit =
                static_cast<uint32_t>((abase + static_cast<uintptr_t>(p * a.ang_sa)) & 1u);
            th[j][t] = word_elem_to_float(w[t], t_ang, bit);
          }
        }
      }
    }

    // ------------------------------------------------------------ the pair arithmetic
    // With dqr = rot^-1(dq_in), dkr = rot^-1(dk_in):
    //   dq_pre = dqr + dqk*gamma*kb, dk_pre = scale*dkr (+ rot^-1(d_ok_state)) + dqk*gamma*qb,
    //   dscale = dkr . kb (= dk_in . rot(kb)), dgamma = dqk * (qb . kb),
    //   dangle = qb0*dqr1 - qb1*dqr0 + kb0*dksr1 - kb1*dksr0 (dksr = rot^-1 of the scaled dk).
    const float gd = dqkv * gav;
    float dsc = 0.f, qkd = 0.f;
    float dqp[J][VEC], dkp[J][VEC], dang[J][NP];
#pragma unroll
    for (int j = 0; j < J; ++j) {
      if (rot[j]) {
#pragma unroll
        for (int t = 0; t < NP; ++t) {
          const float qb0 = qf[j][2 * t] + bq[j][2 * t], qb1 = qf[j][2 * t + 1] + bq[j][2 * t + 1];
          const float kb0 = kf[j][2 * t] + bk[j][2 * t], kb1 = kf[j][2 * t + 1] + bk[j][2 * t + 1];
          float sn, cs;
          sincosf(th[j][t], &sn, &cs);
          const float x0 = dqv[j][2 * t], x1 = dqv[j][2 * t + 1];
          const float y0 = dkv[j][2 * t], y1 = dkv[j][2 * t + 1];
          const float dqr0 = fmaf(x0, cs, x1 * sn), dqr1 = fmaf(x1, cs, -(x0 * sn));
          const float dkr0 = fmaf(y0, cs, y1 * sn), dkr1 = fmaf(y1, cs, -(y0 * sn));
          dsc = fmaf(dkr0, kb0, fmaf(dkr1, kb1, dsc));
          qkd = fmaf(qb0, kb0, fmaf(qb1, kb1, qkd));
          const float k0 = scv * dkr0, k1 = scv * dkr1;
          dqp[j][2 * t] = fmaf(gd, kb0, dqr0);
          dqp[j][2 * t + 1] = fmaf(gd, kb1, dqr1);
          dkp[j][2 * t] = fmaf(gd, qb0, k0);
          dkp[j][2 * t + 1] = fmaf(gd, qb1, k1);
          dang[j][t] = fmaf(qb0, dqr1, -(qb1 * dqr0)) + fmaf(kb0, k1, -(kb1 * k0));
        }
      } else {
#pragma unroll
        for (int t = 0; t < NP; ++t) {
          const float qb0 = qf[j][2 * t] + bq[j][2 * t], qb1 = qf[j][2 * t + 1] + bq[j][2 * t + 1];
          const float kb0 = kf[j][2 * t] + bk[j][2 * t], kb1 = kf[j][2 * t + 1] + bk[j][2 * t + 1];
          const float y0 = dkv[j][2 * t], y1 = dkv[j][2 * t + 1];
          dsc = fmaf(y0, kb0, fmaf(y1, kb1, dsc));
          qkd = fmaf(qb0, kb0, fmaf(qb1, kb1, qkd));
          dqp[j][2 * t] = fmaf(gd, kb0, dqv[j][2 * t]);
          dqp[j][2 * t + 1] = fmaf(gd, kb1, dqv[j][2 * t + 1]);
          dkp[j][2 * t] = fmaf(gd, qb0, scv * y0);
          dkp[j][2 * t + 1] = fmaf(gd, qb1, scv * y1);
          dang[j][t] = 0.f;
        }
      }
    }

    // d_ok_state enters dk (and so dk_bias and dangles) at a sequence's last position, unscaled.
    if (dok_seq >= 0) {
      const unsigned char* po =
          a.dok + (static_cast<int64_t>(dok_seq) * a.dok_sq + h * a.dok_sh) * dt_size(a.t_dok);
#pragma unroll
      for (int j = 0; j < J; ++j) {
        if (!cval[j]) continue;
        float o[VEC];
        load_bias_chunk<VEC>(po, a.t_dok, a.dok_sn, false, true, cidx[j], o);
#pragma unroll
        for (int t = 0; t < NP; ++t) {
          float or0 = o[2 * t], or1 = o[2 * t + 1];
          if (rot[j]) {
            float sn, cs;
            sincosf(th[j][t], &sn, &cs);
            or0 = fmaf(o[2 * t], cs, o[2 * t + 1] * sn);
            or1 = fmaf(o[2 * t + 1], cs, -(o[2 * t] * sn));
            const float kb0 = kf[j][2 * t] + bk[j][2 * t],
                        kb1 = kf[j][2 * t + 1] + bk[j][2 * t + 1];
            dang[j][t] += fmaf(kb0, or1, -(kb1 * or0));
          }
          dkp[j][2 * t] += or0;
          dkp[j][2 * t + 1] += or1;
        }
      }
    }

    // dscale / dgamma: reduce over the row's L lanes (L is a power of two; unrolled, predicated).
#pragma unroll
    for (int m = 1; m < 32; m <<= 1) {
      if (m < L) {
        dsc += __shfl_xor_sync(0xffffffffu, dsc, m);
        qkd += __shfl_xor_sync(0xffffffffu, qkd, m);
      }
    }
    if (col == 0 && cur_rv) {
      if constexpr (FAST) {
        *reinterpret_cast<float*>(a.dsc + off3(cur_b, a.dsc_sb, h, a.dsc_sh, cur_s, a.dsc_ss) * 4) =
            dsc;
        *reinterpret_cast<float*>(a.dga + off3(cur_b, a.dga_sb, h, a.dga_sh, cur_s, a.dga_ss) * 4) =
            dqkv * qkd;
      } else {
        store_rt(a.dsc + (cur_b * a.dsc_sb + h * a.dsc_sh + cur_s * a.dsc_ss) * dt_size(a.t_dsc),
                 a.t_dsc, dsc);
        store_rt(a.dga + (cur_b * a.dga_sb + h * a.dga_sh + cur_s * a.dga_ss) * dt_size(a.t_dga),
                 a.t_dga, dqkv * qkd);
      }
    }

    // dangles of the rotated slots.
    if (cur_rv) {
      unsigned char* pd = a.dang + off3(cur_b, a.dang_sb, cur_s, a.dang_ss, h, a.dang_sh) * sza;
#pragma unroll
      for (int j = 0; j < J; ++j) {
        if (!rot[j] || !cval[j]) continue;
        const int p0 = cidx[j] * NP;
        if (FAST || a.dang_vec) {
          if (p0 < a.A) {
            if (FAST || sza == 4) {
              uint32_t w[NP];
#pragma unroll
              for (int t = 0; t < NP; ++t) w[t] = __float_as_uint(dang[j][t]);
              st_global_words<NP * 4>(pd + p0 * 4, w);
            } else if constexpr (NP >= 2) {
              uint32_t w[NP / 2];
#pragma unroll
              for (int t = 0; t < NP / 2; ++t)
                w[t] = float_to_bits(dang[j][2 * t], t_ang) |
                       (float_to_bits(dang[j][2 * t + 1], t_ang) << 16);
              st_global_words<NP * 2>(pd + p0 * 2, w);
            }
          }
        } else {
#pragma unroll
          for (int t = 0; t < NP; ++t)
            if (p0 + t < a.A)
              store_rt(pd + static_cast<int64_t>(p0 + t) * a.dang_sa * sza, t_ang, dang[j][t]);
        }
      }
    }

    // Bias partials: reduce-scatter the 16 values (dq_pre 0..7, dk_pre 8..15) over the warp's
    // rows; the lane keeps values [base, base + nv) summed over the rows, then adds them into the
    // CTA's accumulators of this head (always by the same lane: deterministic).
    {
      float v[16];
#pragma unroll
      for (int j = 0; j < J; ++j)
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          v[j * VEC + e] = dqp[j][e];
          v[8 + j * VEC + e] = dkp[j][e];
        }
      int base = 0;
#pragma unroll
      for (int kstep = 0; kstep < 4; ++kstep) {
        const int m = 16 >> kstep;
        constexpr int kHalf0 = 8;
        const int half = kHalf0 >> kstep;
        if (m >= L) {
          const bool up = (lane & m) != 0;
#pragma unroll
          for (int i = 0; i < (kHalf0 >> kstep); ++i) {
            const float send = up ? v[i] : v[i + (kHalf0 >> kstep)];
            const float keep = up ? v[i + (kHalf0 >> kstep)] : v[i];
            v[i] = keep + __shfl_xor_sync(0xffffffffu, send, m);
          }
          if (up) base += half;
        }
      }
      // One lane per row (L == 1): a last plain step over lane pairs, after which both lanes of
      // a pair hold the same sum and only the even one adds it.
      if (L == 1) v[0] += __shfl_xor_sync(0xffffffffu, v[0], 1);
      const int nv = L >= 2 ? (L >> 1) : ((lane & 1) ? 0 : 1);
      float* accp = acc + static_cast<size_t>((wr * a.HG + head) * 2) * N;
      if (VEC >= 4 && nv >= 4) {
#pragma unroll
        for (int q4 = 0; q4 < 4; ++q4) {
          if (q4 * 4 >= nv) break;
          const int gi = base + q4 * 4;
          const int e8 = gi & 7, jx = e8 / VEC, c = col + jx * L;
          if (c < a.nchunks) {
            float4* p = reinterpret_cast<float4*>(accp + (gi >> 3) * N + c * VEC + (e8 % VEC));
            float4 t4 = *p;
            t4.x += v[q4 * 4 + 0];
            t4.y += v[q4 * 4 + 1];
            t4.z += v[q4 * 4 + 2];
            t4.w += v[q4 * 4 + 3];
            *p = t4;
          }
        }
      } else {
#pragma unroll
        for (int i = 0; i < 16; ++i) {
          if (i >= nv) break;
          const int gi = base + i;
          const int e8 = gi & 7, jx = e8 / VEC, c = col + jx * L;
          if (c < a.nchunks) accp[(gi >> 3) * N + c * VEC + (e8 % VEC)] += v[i];
        }
      }
    }

#pragma unroll
    for (int j = 0; j < J; ++j)
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        accq[j][e] += dqp[j][e];
        acck[j][e] += dkp[j][e];
      }

    // ------------------------------------------------------------ end of a row block: dq, dk
    if (cjj == ipr - 1) {
      if (a.WH == 1) {
        if (cur_rv) {
          unsigned char* pq = a.dq + off3(cur_b, a.dq_sb, cur_s, a.dq_ss, g, a.dq_sg) * kSz;
          unsigned char* pk = a.dk + off3(cur_b, a.dk_sb, cur_s, a.dk_ss, g, a.dk_sg) * kSz;
#pragma unroll
          for (int j = 0; j < J; ++j) {
            if (!cval[j]) continue;
            const int64_t n0 = static_cast<int64_t>(cidx[j]) * VEC;
            store_run<Tg, VEC>(pq + n0 * a.dq_sn * kSz, a.dq_sn, FAST || !a.elem, accq[j]);
            store_run<Tg, VEC>(pk + n0 * a.dk_sn * kSz, a.dk_sn, FAST || !a.elem, acck[j]);
          }
        }
      } else {
        // Sum the WH warps' partials of the same rows in a fixed order (warp 0 first).
        float4* red = reinterpret_cast<float4*>(smem + a.sm_red);
        {
          float vv[16];
#pragma unroll
          for (int j = 0; j < J; ++j)
#pragma unroll
            for (int e = 0; e < VEC; ++e) {
              vv[j * VEC + e] = accq[j][e];
              vv[8 + j * VEC + e] = acck[j][e];
            }
#pragma unroll
          for (int p = 0; p < 4; ++p)
            red[(warp * 4 + p) * 32 + lane] =
                make_float4(vv[4 * p], vv[4 * p + 1], vv[4 * p + 2], vv[4 * p + 3]);
        }
        __syncthreads();
        const int64_t rowb = r_lo + static_cast<int64_t>(ck) * a.RB + wr * a.RPW;
        for (int pos = wh * 32 + lane; pos < 128; pos += 32 * a.WH) {
          const int p = pos >> 5, sl2 = pos & 31;
          float4 s4 = red[((wr * a.WH) * 4 + p) * 32 + sl2];
          for (int w2 = 1; w2 < a.WH; ++w2) {
            const float4 t4 = red[((wr * a.WH + w2) * 4 + p) * 32 + sl2];
            s4.x += t4.x, s4.y += t4.y, s4.z += t4.z, s4.w += t4.w;
          }
          const int64_t row2 = rowb + (sl2 >> lshift);
          if (row2 >= r_hi) continue;
          const int col2 = sl2 & (L - 1);
          int b2, s2;
          split_row(row2, a.S, b2, s2);
          const bool isk = p >= 2;
          unsigned char* base = isk ? a.dk + off3(b2, a.dk_sb, s2, a.dk_ss, g, a.dk_sg) * kSz
                                    : a.dq + off3(b2, a.dq_sb, s2, a.dq_ss, g, a.dq_sg) * kSz;
          const int64_t sn = isk ? a.dk_sn : a.dq_sn;
          const float vals[4] = {s4.x, s4.y, s4.z, s4.w};
          const int e8 = (p & 1) * 4;
          if constexpr (VEC >= 4) {
            const int c = col2 + (e8 / VEC) * L;
            if (c < a.nchunks)
              store_run<Tg, 4>(base + (static_cast<int64_t>(c) * VEC + e8 % VEC) * sn * kSz, sn,
                               FAST || !a.elem, vals);
          } else {
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
              const int c = col2 + (e8 / 2 + hh) * L;
              if (c < a.nchunks)
                store_run<Tg, 2>(base + static_cast<int64_t>(c) * 2 * sn * kSz, sn, FAST || !a.elem,
                                 vals + 2 * hh);
            }
          }
        }
        __syncthreads();
      }
    }

    // Recycle the slot just consumed for item it + D (all lanes are done reading it).
    __syncwarp();
    if (it + D < n_items) {
      issue(ik, ijj, cslot);
      advance(ik, ijj);
    }
    cp_async_commit();
    cslot = cslot + 1 == D ? 0 : cslot + 1;
    advance(ck, cjj);
  }
  cp_async_wait<0>();

  // ---------------------------------------------------------------- this CTA's bias partial
  __syncthreads();
  if (a.acc_smem) {
    float* out = a.ws + static_cast<size_t>(g * a.ctas_per_g + cta) * a.HG * 2 * N;
    const int n = a.HG * 2 * N;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
      float s = acc[i];
      for (int w = 1; w < a.WR; ++w) s += acc[w * n + i];
      out[i] = s;
    }
  }
}

// Sums the per-CTA bias partials ws[g][c][head][2][N] over c in a fixed order:
// warp w adds c = w, w+8, ... in order, then warp 0 adds the 8 warp sums in order.
__global__ void __launch_bounds__(256)
    bias_reduce_kernel(const float* __restrict__ ws, int ctas_per_g, int HG, int N, int H,
                       float* dqb, int64_t dqb_sh, int64_t dqb_sn, float* dkb, int64_t dkb_sh,
                       int64_t dkb_sn) {
  __shared__ float part[8][32];
  // After the split kernel this is a programmatic dependent launch: wait for the partials'
  // writer (a no-op after a plain launch). Then let a dependent launched after this one (the
  // next call's split kernel) become resident; it waits for this kernel before its first global
  // access.
  pdl_wait();
  pdl_launch_dependents();
  const int tiles = (N + 31) / 32;
  int idx = blockIdx.x;
  const int tile = idx % tiles;
  idx /= tiles;
  const int qk = idx % 2;
  const int h = idx / 2;
  if (h >= H) return;
  const int g = h / HG, head = h - g * HG;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int n = tile * 32 + lane;
  float s = 0.f;
  if (n < N) {
    const float* p = ws + (static_cast<size_t>(g) * ctas_per_g * HG + head) * 2 * N + qk * N + n;
    const size_t step = static_cast<size_t>(HG) * 2 * N;
    // Batches of kB partials: all loads of a batch are issued before they are added (in order),
    // so the warp waits on memory once per batch, not once per partial.
    constexpr int kB = 16;
    for (int c0 = warp; c0 < ctas_per_g; c0 += 8 * kB) {
      float v[kB];
#pragma unroll
      for (int j = 0; j < kB; ++j) {
        const int c = c0 + 8 * j;
        v[j] = c < ctas_per_g ? __ldcs(p + c * step) : 0.f;
      }
#pragma unroll
      for (int j = 0; j < kB; ++j) s += v[j];
    }
  }
  part[warp][lane] = s;
  __syncthreads();
  if (warp == 0 && n < N) {
    float t = part[0][lane];
#pragma unroll
    for (int w = 1; w < 8; ++w) t += part[w][lane];
    if (qk == 0)
      dqb[h * dqb_sh + n * dqb_sn] = t;
    else
      dkb[h * dkb_sh + n * dkb_sn] = t;
  }
}

// ------------------------------------------------------------------ the lean kernel
//
// The common case (all of q, k, dq_in, dk_in, dq, dk of one dtype with vector-aligned contiguous
// rows; angles and the row scalars float32; every offset below 2^31) runs this simpler kernel,
// which spends far fewer instructions per row than the pipelined one above (the op is
// instruction bound there, not memory bound):
// * A lane owns VE contiguous elements of a row (VE = 4, or 8 for N = 256 and, in the WIDE
//   variant, for N = 64/128 with A % 4 == 0 and 16-byte rows), so one row of N elements spans
//   LPR = N/VE lanes and a warp holds RPW = 32/LPR rows. Loads are plain vector loads straight
//   into registers.
// * A CTA of W = WH x WR warps walks blocks of PB = WR*RPW*T positions of one q/k head g. Warp
//   (wh, wr) takes heads wh, wh+WH, ... of the group for its RPW*T positions: q/k are loaded once
//   per block, dq/dk accumulate over the heads in registers and the WH warps' sums meet once per
//   block in shared memory (fixed order). Per head, the T positions' loads are all issued before
//   any is used; then (when a warp has >= 2 heads per block) the next item's rows are
//   prefetched into L2, which holds no register.
// * dscale/dgamma of the T positions: one transposed butterfly over the row's lanes.
// * Bias partials: summed over the T positions in registers, then added once per (block, head)
//   into lane-private shared-memory accumulators (each address has one writer: deterministic); at
//   the end each CTA writes one partial per head and bias_reduce_kernel sums them in fixed order.
// * 16-bit dq_in/dk_in take the hardware sin/cos after reducing the angle to [-pi, pi] (abs error
//   ~1e-6, far below the 16-bit tolerances); float32 dq_in keeps the precise sincosf.
constexpr int kLeanWarps = 8;

struct LeanArgs : DqkTensors {
  int A, WH, WR, PB, nblk;
  int pf;  // L2 prefetch of each warp's next item (see the kernel)
};

// WIDE (N = 64, 128 with A % 4 == 0): 8 elements per lane instead of 4, so the per-row work of a
// lane (addresses, scalars, shuffles, stores) is spread over twice the elements.
template <int N, int DT, bool WIDE = false>
struct LeanGeom {
  static constexpr int LPR = WIDE ? N / 8 : (N / 4 < 32 ? N / 4 : 32);  // lanes per row
  static constexpr int VE = N / LPR;                   // elements per lane (4 or 8)
  static constexpr int NP = VE / 2;                    // rotation pairs per lane
  static constexpr int RPW = 32 / LPR;                 // rows per warp
  // Positions per warp row per block: as many as the registers allow without spilling.
  static constexpr int T = VE == 4 ? (DT == kBF16 ? 4 : 2) : (DT == kBF16 ? 2 : 1);
};

__device__ __forceinline__ void prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}


template <class Tg, int N, bool WIDE>
__global__ void __launch_bounds__(kLeanWarps * 32, 2)
    dqk_lean_kernel(const __grid_constant__ LeanArgs a) {
  using E = Elem<Tg>;
  using Gm = LeanGeom<N, Elem<Tg>::kDt, WIDE>;
  // dscale/dgamma of all T positions reduced together (see row_reduce_t) when they fit the row.
  constexpr bool kJointReduce = 2 * Gm::T <= Gm::LPR;
  constexpr int LPR = Gm::LPR, VE = Gm::VE, NP = Gm::NP, RPW = Gm::RPW, T = Gm::T;
  constexpr int kSz = E::kSize;
  constexpr int RBY = VE * kSz;              // bytes of a lane's run of a row
  constexpr int PBY = RBY < 16 ? RBY : 16;   // bytes per vector access
  constexpr int NW = RBY / 4;                // words per run
  constexpr int C4 = VE / 4;                 // float4 pieces per run
  constexpr bool kFastTrig = kSz == 2;

  extern __shared__ __align__(16) unsigned char smem[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int WH = a.WH, HG = a.HG;
  const int wh = warp % WH, wr = warp / WH;
  const int rl = lane / LPR, col = lane % LPR;
  const int n0 = col * VE;
  const bool rot = col * NP < a.A;  // all of this lane's pairs rotate, or none (A % NP == 0)
  const int g = blockIdx.y;
  float* const bias_s = reinterpret_cast<float*>(smem);  // [HG][q|k][N]
  float* const acc = bias_s + HG * 2 * N;                // [WR][HG][q|k][N]
  float4* const red = reinterpret_cast<float4*>(acc + a.WR * HG * 2 * N);  // [W][T][2*C4][32]

  for (int i = threadIdx.x; i < HG * 2 * N; i += blockDim.x) {
    const int n = i % N, qk = (i / N) & 1;
    const int64_t h = static_cast<int64_t>(g) * HG + i / (2 * N);
    bias_s[i] = qk ? load_rt(a.kb + (h * a.kb_sh + n * a.kb_sn) * dt_size(a.t_kb), a.t_kb)
                   : load_rt(a.qb + (h * a.qb_sh + n * a.qb_sn) * dt_size(a.t_qb), a.t_qb);
  }
  for (int i = threadIdx.x; i < a.WR * HG * 2 * N; i += blockDim.x) acc[i] = 0.f;
  __syncthreads();

  for (int blk = blockIdx.x; blk < a.nblk; blk += gridDim.x) {
    // This lane's T positions: row offsets of the head-indexed tensors (without the head term).
    int ogi[T], oan[T], osm[T], dseq[T];
    bool val[T];
    float qf[T][VE], kf[T][VE];
#pragma unroll
    for (int t = 0; t < T; ++t) {
      const int row = blk * a.PB + (wr * T + t) * RPW + rl;
      val[t] = row < a.rows;
      const int r = val[t] ? row : 0;
      const int b = static_cast<int>(static_cast<uint32_t>(r) / static_cast<uint32_t>(a.S));
      const int s = r - b * a.S;
      ogi[t] = b * a.gi_sb + s * a.gi_ss;
      oan[t] = b * a.an_sb + s * a.an_ss;
      osm[t] = b * a.sm_sb + s * a.sm_ss;
      dseq[t] = -1;
      if (a.has_dok && val[t]) {
        if (!a.varlen) {
          if (s == a.S - 1) dseq[t] = b;
        } else {
          const int i = a.cu.seq_of(s);
          if (a.cu.at(i + 1) - 1 == s) dseq[t] = i;
        }
      }
      uint32_t wq[NW], wk[NW];
      const int oq = b * a.q_sb + s * a.q_ss + g * a.q_sg + n0;
#pragma unroll
      for (int p = 0; p < NW * 4 / PBY; ++p) {
        if (val[t]) {
          ld_global_words<PBY>(a.q + static_cast<int64_t>(oq) * kSz + p * PBY, wq + p * (PBY / 4));
          ld_global_words<PBY>(a.k + static_cast<int64_t>(oq) * kSz + p * PBY, wk + p * (PBY / 4));
        } else {
#pragma unroll
          for (int w = 0; w < PBY / 4; ++w) wq[p * (PBY / 4) + w] = wk[p * (PBY / 4) + w] = 0u;
        }
      }
      E::template unpack<VE>(wq, qf[t]);
      E::template unpack<VE>(wk, kf[t]);
    }

    for (int head = wh; head < HG; head += WH) {
      const int h = g * HG + head;
      // Issue every load of this head's T positions first.
      uint32_t wdq[T][NW], wdk[T][NW], wan[T][NP];
      float scv[T], gav[T], dqkv[T];
#pragma unroll
      for (int t = 0; t < T; ++t) {
        const int og = ogi[t] + h * a.gi_sh + n0;
        const int oa = oan[t] + h * a.an_sh + col * NP;
        const int os = osm[t] + h * a.sm_sh;
#pragma unroll
        for (int p = 0; p < NW * 4 / PBY; ++p) {
          if (val[t]) {
            const int64_t ob = static_cast<int64_t>(og) * kSz + p * PBY;
            ld_global_words<PBY>(a.dqi + ob, wdq[t] + p * (PBY / 4));
            ld_global_words<PBY>(a.dki + ob, wdk[t] + p * (PBY / 4));
          } else {
#pragma unroll
            for (int w = 0; w < PBY / 4; ++w)
              wdq[t][p * (PBY / 4) + w] = wdk[t][p * (PBY / 4) + w] = 0u;
          }
        }
        if (val[t] && rot) {
          ld_global_words<NP * 4>(a.ang + oa, wan[t]);
        } else {
#pragma unroll
          for (int i = 0; i < NP; ++i) wan[t][i] = 0u;
        }
        scv[t] = val[t] ? __ldg(a.sc + os) : 0.f;
        gav[t] = val[t] ? __ldg(a.ga + os) : 0.f;
        dqkv[t] = val[t] ? __ldg(a.dqk + os) : 0.f;
      }
      // L2 prefetch of this warp's next item (its next head in this block, or its first head in
      // its next block), so that the loads of the next item wait on L2 rather than on HBM. A
      // prefetch holds no register; it changes no result.
      if (a.pf) {
        int nh = head + WH;
        const bool nb = nh >= HG;  // warp-uniform
        if (nb) nh = wh;
        const int blk2 = blk + static_cast<int>(gridDim.x);
        if (!nb || blk2 < a.nblk) {
          const int hh = g * HG + nh;
#pragma unroll
          for (int t = 0; t < T; ++t) {
            bool v2 = val[t];
            int og2 = ogi[t], oa2 = oan[t], os2 = osm[t];
            if (nb) {
              const int row = blk2 * a.PB + (wr * T + t) * RPW + rl;
              v2 = row < a.rows;
              const int r = v2 ? row : 0;
              const int b = static_cast<int>(static_cast<uint32_t>(r) / static_cast<uint32_t>(a.S));
              const int s = r - b * a.S;
              og2 = b * a.gi_sb + s * a.gi_ss;
              oa2 = b * a.an_sb + s * a.an_ss;
              os2 = b * a.sm_sb + s * a.sm_ss;
            }
            if (v2) {
              const int64_t ob = static_cast<int64_t>(og2 + hh * a.gi_sh + n0) * kSz;
              prefetch_l2(a.dqi + ob);
              prefetch_l2(a.dki + ob);
              if (rot) prefetch_l2(a.ang + oa2 + hh * a.an_sh + col * NP);
              if (col == 0) {
                const int os = os2 + hh * a.sm_sh;
                prefetch_l2(a.sc + os);
                prefetch_l2(a.ga + os);
                prefetch_l2(a.dqk + os);
              }
            }
          }
        }
      }
      float bq[VE], bk[VE], sq[VE], sk[VE];
      {
        const float* sb = bias_s + head * 2 * N + n0;
#pragma unroll
        for (int c = 0; c < C4; ++c) {
          const float4 x = *reinterpret_cast<const float4*>(sb + 4 * c);
          const float4 y = *reinterpret_cast<const float4*>(sb + N + 4 * c);
          bq[4 * c] = x.x, bq[4 * c + 1] = x.y, bq[4 * c + 2] = x.z, bq[4 * c + 3] = x.w;
          bk[4 * c] = y.x, bk[4 * c + 1] = y.y, bk[4 * c + 2] = y.z, bk[4 * c + 3] = y.w;
        }
#pragma unroll
        for (int e = 0; e < VE; ++e) sq[e] = sk[e] = 0.f;
      }

      float rv[2 * T];  // kJointReduce: dsc, qkd of each position
#pragma unroll
      for (int t = 0; t < T; ++t) {
        float x[VE], y[VE];
        E::template unpack<VE>(wdq[t], x);
        E::template unpack<VE>(wdk[t], y);
        const float scl = scv[t], gd = dqkv[t] * gav[t];
        float dsc = 0.f, qkd = 0.f;
        float dqp[VE], dkp[VE], dan[NP], sn[NP], cs[NP];
#pragma unroll
        for (int i = 0; i < NP; ++i) {
          const float th = __uint_as_float(wan[t][i]);
          if constexpr (kFastTrig) {
            fast_sincos(th, &sn[i], &cs[i]);
          } else {
            sincosf(th, &sn[i], &cs[i]);
          }
          // Lanes past 2A do not rotate (branch-free: the warp runs one path).
          sn[i] = rot ? sn[i] : 0.f;
          cs[i] = rot ? cs[i] : 1.f;
          const float qb0 = qf[t][2 * i] + bq[2 * i], qb1 = qf[t][2 * i + 1] + bq[2 * i + 1];
          const float kb0 = kf[t][2 * i] + bk[2 * i], kb1 = kf[t][2 * i + 1] + bk[2 * i + 1];
          const float x0 = x[2 * i], x1 = x[2 * i + 1], y0 = y[2 * i], y1 = y[2 * i + 1];
          const float dqr0 = fmaf(x0, cs[i], x1 * sn[i]), dqr1 = fmaf(x1, cs[i], -(x0 * sn[i]));
          const float dkr0 = fmaf(y0, cs[i], y1 * sn[i]), dkr1 = fmaf(y1, cs[i], -(y0 * sn[i]));
          const PairTerms pt =
              pair_terms(qb0, qb1, kb0, kb1, dqr0, dqr1, dkr0, dkr1, scl, gd, dsc, qkd);
          dqp[2 * i] = pt.dq0, dqp[2 * i + 1] = pt.dq1;
          dkp[2 * i] = pt.dk0, dkp[2 * i + 1] = pt.dk1;
          dan[i] = pt.dan;
        }
        // d_ok_state enters dk (and so dk_bias and dangles) at a sequence's last position.
        if (dseq[t] >= 0) {
          const unsigned char* po =
              a.dok + (static_cast<int64_t>(dseq[t]) * a.dok_sq + h * a.dok_sh) * dt_size(a.t_dok);
#pragma unroll
          for (int i = 0; i < NP; ++i) {
            const float o0 = load_rt(po + (n0 + 2 * i) * a.dok_sn * dt_size(a.t_dok), a.t_dok);
            const float o1 = load_rt(po + (n0 + 2 * i + 1) * a.dok_sn * dt_size(a.t_dok), a.t_dok);
            const float or0 = fmaf(o0, cs[i], o1 * sn[i]), or1 = fmaf(o1, cs[i], -(o0 * sn[i]));
            const float kb0 = kf[t][2 * i] + bk[2 * i], kb1 = kf[t][2 * i + 1] + bk[2 * i + 1];
            if (rot) dan[i] += fmaf(kb0, or1, -(kb1 * or0));
            dkp[2 * i] += or0;
            dkp[2 * i + 1] += or1;
          }
        }
        if constexpr (kJointReduce) {
          rv[2 * t] = dsc;
          rv[2 * t + 1] = qkd;
        } else {
#pragma unroll
          for (int m = 1; m < LPR; m <<= 1) {
            dsc += __shfl_xor_sync(0xffffffffu, dsc, m);
            qkd += __shfl_xor_sync(0xffffffffu, qkd, m);
          }
          const int os = osm[t] + h * a.sm_sh;
          if (col == 0 && val[t]) {
            a.dsc[os] = dsc;
            a.dga[os] = dqkv[t] * qkd;
          }
        }
        if (rot && val[t]) {
          uint32_t w[NP];
#pragma unroll
          for (int i = 0; i < NP; ++i) w[i] = __float_as_uint(dan[i]);
          st_global_words<NP * 4>(a.dang + oan[t] + h * a.an_sh + col * NP, w);
        }
#pragma unroll
        for (int e = 0; e < VE; ++e) {
          sq[e] += dqp[e];
          sk[e] += dkp[e];
        }
        // dq/dk summed over this warp's heads in its lane-private shared-memory slots
        // (registers are the limit here).
        float4* const rq = red + ((warp * T + t) * 2 * C4) * 32 + lane;
#pragma unroll
        for (int c = 0; c < C4; ++c) {
          float4 u = make_float4(dqp[4 * c], dqp[4 * c + 1], dqp[4 * c + 2], dqp[4 * c + 3]);
          float4 v = make_float4(dkp[4 * c], dkp[4 * c + 1], dkp[4 * c + 2], dkp[4 * c + 3]);
          if (head != wh) {
            const float4 u0 = rq[c * 32], v0 = rq[(C4 + c) * 32];
            u.x += u0.x, u.y += u0.y, u.z += u0.z, u.w += u0.w;
            v.x += v0.x, v.y += v0.y, v.z += v0.z, v.w += v0.w;
          }
          rq[c * 32] = u;
          rq[(C4 + c) * 32] = v;
        }
      }
      if constexpr (kJointReduce) {
        // Lane col holds value col / (LPR / 2T): position t = that / 2, dscale (even) or the dot
        // q.k of dgamma (odd); the first lane of each such group stores it.
        row_reduce_t<2 * T, LPR / 2>(rv, col);
        constexpr int kGrp = LPR / (2 * T);
        const int idx = col / kGrp;
        if (col % kGrp == 0) {
          const int t = idx >> 1;
          bool vt = false;
          int os = 0;
          float dq = 0.f;
#pragma unroll
          for (int u = 0; u < T; ++u)
            if (u == t) vt = val[u], os = osm[u], dq = dqkv[u];
          if (vt) {
            os += h * a.sm_sh;
            if (idx & 1)
              a.dga[os] = dq * rv[0];
            else
              a.dsc[os] = rv[0];
          }
        }
      }
      // Bias partial of this head: sum the warp's rows (fixed butterfly), then one lane per
      // column adds it into this warp-row's accumulators.
#pragma unroll
      for (int m = LPR; m < 32; m <<= 1)
#pragma unroll
        for (int e = 0; e < VE; ++e) {
          sq[e] += __shfl_xor_sync(0xffffffffu, sq[e], m);
          sk[e] += __shfl_xor_sync(0xffffffffu, sk[e], m);
        }
      if (rl == 0) {
        float* pa = acc + (wr * HG + head) * 2 * N + n0;
#pragma unroll
        for (int c = 0; c < C4; ++c) {
          float4* p = reinterpret_cast<float4*>(pa + 4 * c);
          float4* pk = reinterpret_cast<float4*>(pa + N + 4 * c);
          float4 u = *p, v = *pk;
          u.x += sq[4 * c], u.y += sq[4 * c + 1], u.z += sq[4 * c + 2], u.w += sq[4 * c + 3];
          v.x += sk[4 * c], v.y += sk[4 * c + 1], v.z += sk[4 * c + 2], v.w += sk[4 * c + 3];
          *p = u;
          *pk = v;
        }
      }
    }

    // dq, dk of the block: the WH warps' sums of the same positions added in a fixed order
    // (wh = 0 first).
    {
      __syncthreads();
      const int items = a.WR * T * 2 * C4 * 32;
      for (int i = threadIdx.x; i < items; i += blockDim.x) {
        const int ln = i & 31;
        int rest = i >> 5;
        const int c = rest % (2 * C4);
        rest /= 2 * C4;
        const int t = rest % T, wr2 = rest / T;
        const int row = blk * a.PB + (wr2 * T + t) * RPW + ln / LPR;
        if (row >= a.rows) continue;
        const float4* src = red + ((wr2 * WH * T + t) * 2 * C4 + c) * 32 + ln;
        float4 sum = *src;
        for (int w2 = 1; w2 < WH; ++w2) {
          const float4 u = src[w2 * T * 2 * C4 * 32];
          sum.x += u.x, sum.y += u.y, sum.z += u.z, sum.w += u.w;
        }
        const int b = static_cast<int>(static_cast<uint32_t>(row) / static_cast<uint32_t>(a.S));
        const int s = row - b * a.S;
        const int n = (ln % LPR) * VE + (c % C4) * 4;
        unsigned char* base = c < C4 ? a.dq : a.dk;
        const float v4[4] = {sum.x, sum.y, sum.z, sum.w};
        uint32_t w[kSz];
        E::template pack<4>(v4, w);
        st_global_words<4 * kSz>(
            base + static_cast<int64_t>(b * a.go_sb + s * a.go_ss + g * a.go_sg + n) * kSz, w);
      }
      __syncthreads();
    }
  }

  // This CTA's bias partial: the WR warp-rows' accumulators summed in order.
  __syncthreads();
  float* out = a.ws + (static_cast<size_t>(g) * gridDim.x + blockIdx.x) * HG * 2 * N;
  for (int i = threadIdx.x; i < HG * 2 * N; i += blockDim.x) {
    float s = acc[i];
    for (int w = 1; w < a.WR; ++w) s += acc[w * HG * 2 * N + i];
    out[i] = s;
  }
}

// ------------------------------------------------------------------ host side: the plan

struct Plan {
  int VEC = 8, J = 1;
  bool elem = false;
  int nchunks = 0, L = 1, lshift = 0, RPW = 32;
  int WH = 1, WR = 1, W = 1, RB = 1;
  int rot_slots = 0;
  int D = 2, Dq = 1;
  bool acc_smem = true, bias_smem = true;
  bool fast = false;  // the FAST kernel variant applies (see the kernel)
  int st_bytes = 0, st_dk = 0, st_ang = 0, st_scal = 0, qk_bytes = 0, qk_k = 0;
  int sm_qk = 0, sm_acc = 0, sm_bias = 0, sm_red = 0;
  size_t smem = 0;
  int ctas_per_g = 1;
};

int ilog2(int x) {
  int r = 0;
  while ((1 << r) < x) ++r;
  return r;
}

// Heads per group and warps split (WH along heads, WR along rows).
void warp_split(int64_t HG, int* WH, int* WR) {
  *WH = static_cast<int>(std::min<int64_t>(HG, kWarpsMax));
  *WR = kWarpsMax / *WH;
}




int lanes_per_row(int64_t nchunks, int J) {
  const int64_t per = (nchunks + J - 1) / J;
  int L = 1;
  while (L < per) L <<= 1;
  return L;
}

// Relative cost per row of a lane layout: L lanes execute J slots of VEC/2 pairs each, rotated
// slots (sincos + rotation) costing ~3x the plain ones, plus a per-slot overhead.
int64_t layout_cost(int64_t N, int64_t A, int VEC, int J) {
  const int64_t nchunks = N / VEC;
  const int L = lanes_per_row(nchunks, J);
  int64_t per_lane = 0;
  for (int j = 0; j < J; ++j) {
    const bool rot = static_cast<int64_t>(j) * L * (VEC / 2) < A;
    per_lane += (rot ? 56 : 18) * (VEC / 2) + 12;
  }
  return per_lane * L;
}

constexpr size_t kWsAlign = 256;

size_t align_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

// Shared-memory layout for the plan's lane layout, depth, accumulator and bias placement.
size_t layout(Plan& p, int64_t HG, int64_t N, int szg, int szq) {
  const int CB = p.elem ? 0 : p.VEC * szg;
  const int AB = (p.VEC / 2) * 4;
  const int big = p.J * 32 * CB;
  p.st_dk = big;
  p.st_ang = 2 * big;
  p.st_scal = p.st_ang + p.J * 32 * AB;
  p.st_bytes = static_cast<int>(align_up(p.st_scal + 3 * p.RPW * 4, 16));
  const int qkb = p.elem ? 0 : p.J * 32 * p.VEC * szq;
  p.qk_k = qkb;
  p.qk_bytes = 2 * qkb;
  size_t off = static_cast<size_t>(p.W) * p.D * p.st_bytes;
  p.sm_qk = static_cast<int>(off);
  off += static_cast<size_t>(p.W) * p.Dq * p.qk_bytes;
  p.sm_acc = static_cast<int>(off);
  if (p.acc_smem) off += static_cast<size_t>(p.WR) * HG * 2 * N * 4;
  off = align_up(off, 16);
  p.sm_bias = static_cast<int>(off);
  if (p.bias_smem) off += static_cast<size_t>(HG) * 2 * N * 4;
  off = align_up(off, 16);
  p.sm_red = static_cast<int>(off);
  if (p.WH > 1) off += static_cast<size_t>(p.W) * 4 * 32 * 16;
  p.smem = off;
  return off;
}

Plan make_plan(const DqkthetaParams& p, int device, int sms) {
  Plan pl;
  const int64_t N = p.N, A = p.A, HG = p.H / p.G;
  const int szg = dtype_size(p.dq_in.dtype), szq = dtype_size(p.q.dtype);

  // Lane layout. The FAST variant (float32 small tensors, see the kernel) takes the cheaper of
  // VEC 8 / 4 when every big tensor can be read in such chunks, rows have 8, 16 or 32 lanes and
  // every element offset fits in 32 bits; everything else runs the generic variant with VEC 2
  // (element mode when even 2-element chunks are misaligned).
  auto f32 = [](const TensorView& v) { return v.dtype == DType::F32; };
  bool fast_ok = f32(p.angles) && f32(p.scale) && f32(p.gamma) && f32(p.dqk);
  for (const TensorView* v : {&p.q, &p.k, &p.dq_in, &p.dk_in, &p.dq, &p.dk, &p.angles, &p.dangles,
                              &p.scale, &p.gamma, &p.dqk, &p.dscale, &p.dgamma})
    fast_ok = fast_ok && offsets_fit_int32(*v);
  auto vectorizable = [&](int VEC) {
    if (N % VEC) return false;
    bool ok = true;
    for (const TensorView* v : {&p.dq_in, &p.dk_in, &p.dq, &p.dk})
      ok = ok && rows_vectorizable(*v, std::min(16, VEC * szg));
    for (const TensorView* v : {&p.q, &p.k})
      ok = ok && rows_vectorizable(*v, std::min(16, VEC * szq));
    return ok;
  };
  bool found = false;
  int64_t best = 0;
  for (int VEC : {8, 4}) {
    const int J = kLanesPerElem / VEC;
    const int L = lanes_per_row(N / VEC, J);
    const int64_t ang_bytes = (VEC / 2) * 4;
    if (!fast_ok || !vectorizable(VEC) || (L != 8 && L != 16 && L != 32) || A % (VEC / 2) != 0 ||
        !rows_vectorizable(p.angles, ang_bytes) || !rows_vectorizable(p.dangles, ang_bytes))
      continue;
    const int64_t c = layout_cost(N, A, VEC, J);
    if (!found || c < best) found = true, best = c, pl.VEC = VEC, pl.J = J;
  }
  pl.fast = found;
  if (!found) pl.VEC = 2, pl.J = 4, pl.elem = !vectorizable(2);
  pl.nchunks = static_cast<int>(N / pl.VEC);
  pl.L = lanes_per_row(pl.nchunks, pl.J);
  pl.lshift = ilog2(pl.L);
  pl.RPW = 32 / pl.L;
  warp_split(HG, &pl.WH, &pl.WR);
  pl.W = pl.WH * pl.WR;
  pl.RB = pl.WR * pl.RPW;
  pl.rot_slots = 0;
  for (int j = 0; j < pl.J; ++j)
    if (static_cast<int64_t>(j) * pl.L * (pl.VEC / 2) < A) pl.rot_slots |= 1 << j;

  // Pipeline depth and shared-memory placement (one CTA per SM): prefer a 4-3 deep pipeline with
  // the bias accumulators and the float32 biases in shared memory; then without the staged
  // biases; then a 2-deep pipeline; last, accumulators in the workspace.
  const DeviceProps& dp = device_props(device);
  const size_t budget =
      static_cast<size_t>(std::max(0, std::min(dp.smem_optin, dp.smem_per_sm - dp.smem_reserved)));
  const int ipr_min = static_cast<int>(HG / pl.WH);
  auto try_cfg = [&](int D, bool acc_smem, bool bias_smem) {
    Plan t = pl;
    t.D = D;
    t.Dq = std::min(D, (D + ipr_min - 1) / ipr_min);
    t.acc_smem = acc_smem;
    t.bias_smem = bias_smem;
    if (layout(t, HG, N, szg, szq) > budget) return false;
    pl = t;
    return true;
  };
  bool ok = false;
  for (bool bias_smem : {true, false})
    for (int D = 4; D >= 3 && !ok; --D) ok = try_cfg(D, true, bias_smem);
  if (!ok) ok = try_cfg(2, true, true) || try_cfg(2, true, false);
  if (!ok && pl.WR == 1)
    for (int D = 4; D >= 2 && !ok; --D) ok = try_cfg(D, false, true) || try_cfg(D, false, false);
  if (!ok)
    MAMBA3_FAIL(MAMBA3_ERROR_INTERNAL, "compute_dqktheta: no shared-memory plan fits (N=", N,
                ", heads per group=", HG, ")");

  const int64_t rbs = (p.B * p.S + pl.RB - 1) / pl.RB;
  pl.ctas_per_g =
      static_cast<int>(std::min<int64_t>(
          ctas_per_group_bound(p.G, sms, p.B * p.S, kTargetCtasPerSm), rbs));
  return pl;
}

// ------------------------------------------------------------------ host side: the lean path

struct LeanPlan {
  bool wide = false;
  int WH = 1, WR = 1, T = 1, RPW = 1, nblk = 0, ctas_per_g = 1;
  size_t smem = 0;
};

template <int N, bool WIDE = false>
void lean_geom(int dt, int* T, int* RPW, int* VE) {
  *T = dt == kF32    ? LeanGeom<N, kF32, WIDE>::T
       : dt == kBF16 ? LeanGeom<N, kBF16, WIDE>::T
                     : LeanGeom<N, kF16, WIDE>::T;
  *RPW = LeanGeom<N, kF32, WIDE>::RPW, *VE = LeanGeom<N, kF32, WIDE>::VE;
}

// Whether the lean kernel takes these arguments (see its comment), and its plan.
bool make_lean_plan(const DqkthetaParams& p, int device, int sms, bool wide, LeanPlan* lp) {
  const int64_t N = p.N, HG = p.H / p.G;
  const int es0 = static_cast<int>(p.dq_in.dtype);
  int T = 0, RPW = 0, VE = 0;
  switch (N) {
    case 16: lean_geom<16>(es0, &T, &RPW, &VE); break;
    case 32: lean_geom<32>(es0, &T, &RPW, &VE); break;
    case 64:
      wide ? lean_geom<64, true>(es0, &T, &RPW, &VE) : lean_geom<64>(es0, &T, &RPW, &VE);
      break;
    case 128:
      wide ? lean_geom<128, true>(es0, &T, &RPW, &VE) : lean_geom<128>(es0, &T, &RPW, &VE);
      break;
    case 256: lean_geom<256>(es0, &T, &RPW, &VE); break;
    default: return false;
  }
  if (p.A % (VE / 2) != 0) return false;
  const int64_t es = dtype_size(p.dq_in.dtype);
  if (!dqk_tensors_fit(p, std::min<int64_t>(16, VE * es), VE / 2 * 4)) return false;

  if (wide && (VE != 8 || (N != 64 && N != 128))) return false;
  lp->wide = wide;
  lp->WH = static_cast<int>(std::min<int64_t>(HG, kLeanWarps));
  lp->WR = kLeanWarps / lp->WH;
  lp->T = T, lp->RPW = RPW;
  const int W = lp->WH * lp->WR;
  lp->smem = static_cast<size_t>(HG) * 2 * N * 4 * (1 + lp->WR) +
             static_cast<size_t>(W) * T * 2 * VE * 32 * 4;
  const DeviceProps& dp = device_props(device);
  const size_t per_sm = static_cast<size_t>(std::max(0, dp.smem_per_sm));
  const size_t optin = static_cast<size_t>(std::max(0, dp.smem_optin));
  const size_t rsv = static_cast<size_t>(std::max(0, dp.smem_reserved));
  int occ = 0;
  if (lp->smem <= optin && 2 * (lp->smem + rsv) <= per_sm)
    occ = 2;
  else if (lp->smem <= optin && lp->smem + rsv <= per_sm)
    occ = 1;
  if (occ == 0) return false;
  const int64_t PB = static_cast<int64_t>(lp->WR) * RPW * T;
  lp->nblk = static_cast<int>((p.B * p.S + PB - 1) / PB);
  lp->ctas_per_g = static_cast<int>(
      std::min<int64_t>(ctas_per_group_bound(p.G, sms, p.B * p.S, occ), lp->nblk));
  return true;
}

template <class Tg, int N, bool WIDE = false>
void launch_lean_n(const LeanPlan& lp, const LeanArgs& a, dim3 grid, cudaStream_t st,
                   int device) {
  ensure_dynamic_smem<dqk_lean_kernel<Tg, N, WIDE>>(device, lp.smem);
  dqk_lean_kernel<Tg, N, WIDE><<<grid, lp.WH * lp.WR * 32, lp.smem, st>>>(a);
  check_launch("compute_dqktheta: lean kernel launch");
}

template <class Tg>
void launch_lean(const LeanPlan& lp, const LeanArgs& a, int N, dim3 grid, cudaStream_t st,
                 int device) {
  switch (N) {
    case 16: return launch_lean_n<Tg, 16>(lp, a, grid, st, device);
    case 32: return launch_lean_n<Tg, 32>(lp, a, grid, st, device);
    case 64:
      return lp.wide ? launch_lean_n<Tg, 64, true>(lp, a, grid, st, device)
                     : launch_lean_n<Tg, 64>(lp, a, grid, st, device);
    case 128:
      return lp.wide ? launch_lean_n<Tg, 128, true>(lp, a, grid, st, device)
                     : launch_lean_n<Tg, 128>(lp, a, grid, st, device);
    default: return launch_lean_n<Tg, 256>(lp, a, grid, st, device);
  }
}

// Runs the lean kernel when it applies; returns the CTAs per q/k head it used (0: not taken).
int run_lean(const DqkthetaParams& p, float* ws, int sms, cudaStream_t st) {
  LeanPlan lp;
  // The wide lane layout where it applies (N = 64, 128, A % 4 == 0, 16-byte rows), else 4
  // elements per lane. MAMBA3_DQK_WIDE=0 forces the latter (A/B measurements).
  static const bool kWideOk = [] {
    const char* v = std::getenv("MAMBA3_DQK_WIDE");
    return !(v && v[0] == '0');
  }();
  if (!(kWideOk && make_lean_plan(p, p.device_id, sms, true, &lp)) &&
      !make_lean_plan(p, p.device_id, sms, false, &lp))
    return 0;
  LeanArgs a;
  std::memset(&a, 0, sizeof(a));
  fill_dqk_tensors(a, p, ws);
  a.A = static_cast<int>(p.A);
  a.WH = lp.WH, a.WR = lp.WR, a.PB = lp.WR * lp.RPW * lp.T, a.nblk = lp.nblk;
  // MAMBA3_DQK_PF=0 turns the L2 prefetch off (A/B measurements).
  static const int kPf = [] {
    const char* v = std::getenv("MAMBA3_DQK_PF");
    return v && v[0] == '0' ? 0 : 1;
  }();
  // Only when a warp has at least two heads per block (HG >= 2*WH): measured +2-4% at H/G = 32,
  // but -5% at H/G = 4, where every prefetch crosses to the next block.
  a.pf = kPf && a.HG >= 2 * a.WH;
  const dim3 grid(static_cast<unsigned>(lp.ctas_per_g), static_cast<unsigned>(p.G));
  const int N = static_cast<int>(p.N);
  switch (p.dq_in.dtype) {
    case DType::F32:
      launch_lean<float>(lp, a, N, grid, st, p.device_id);
      break;
    case DType::BF16:
      launch_lean<__nv_bfloat16>(lp, a, N, grid, st, p.device_id);
      break;
    default:
      launch_lean<__half>(lp, a, N, grid, st, p.device_id);
      break;
  }
  return lp.ctas_per_g;
}

template <class Tg, int VEC, int J, int LT>
void launch_dqk(const Plan& pl, const DqkArgs& a, dim3 grid, cudaStream_t st, int device) {
  ensure_dynamic_smem<dqktheta_kernel<Tg, VEC, J, LT>>(device, pl.smem);
  dqktheta_kernel<Tg, VEC, J, LT><<<grid, pl.W * 32, pl.smem, st>>>(a);
  check_launch("compute_dqktheta: kernel launch");
}

template <class Tg>
void launch_dqk_vec(const Plan& pl, const DqkArgs& a, dim3 grid, cudaStream_t st, int device) {
  // Instantiated: FAST for VEC 8 / 4 with 8, 16 or 32 lanes per row (N = 64, 128, 256 and the
  // even N in between), the generic variant with VEC 2 for everything else.
  if (!pl.fast) return launch_dqk<Tg, 2, 4, 0>(pl, a, grid, st, device);
  switch (pl.VEC * 100 + pl.L) {
    case 808:
      return launch_dqk<Tg, 8, 1, 8>(pl, a, grid, st, device);
    case 816:
      return launch_dqk<Tg, 8, 1, 16>(pl, a, grid, st, device);
    case 832:
      return launch_dqk<Tg, 8, 1, 32>(pl, a, grid, st, device);
    case 408:
      return launch_dqk<Tg, 4, 2, 8>(pl, a, grid, st, device);
    case 416:
      return launch_dqk<Tg, 4, 2, 16>(pl, a, grid, st, device);
    case 432:
      return launch_dqk<Tg, 4, 2, 32>(pl, a, grid, st, device);
    default:
      MAMBA3_FAIL(MAMBA3_ERROR_INTERNAL, "compute_dqktheta: no FAST instantiation for VEC=", pl.VEC,
                  ", L=", pl.L);
  }
}

// Sums the per-CTA bias partials of either kernel into dq_bias / dk_bias. pdl: as a
// programmatic dependent launch (scheduled while the partials' writer finishes).
void launch_bias_reduce(const DqkthetaParams& p, const float* ws, int ctas_per_g, cudaStream_t st,
                        bool pdl = false) {
  const int tiles = static_cast<int>((p.N + 31) / 32);
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(p.H * 2 * tiles));
  cfg.blockDim = dim3(256);
  cfg.stream = st;
  cudaLaunchAttribute attr[1] = {pdl_attr()};
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
  check_cuda(cudaLaunchKernelEx(&cfg, bias_reduce_kernel, ws, ctas_per_g,
                                static_cast<int>(p.H / p.G), static_cast<int>(p.N),
                                static_cast<int>(p.H), static_cast<float*>(p.dq_bias.data),
                                static_cast<int64_t>(p.dq_bias.strides[0]),
                                static_cast<int64_t>(p.dq_bias.strides[1]),
                                static_cast<float*>(p.dk_bias.data),
                                static_cast<int64_t>(p.dk_bias.strides[0]),
                                static_cast<int64_t>(p.dk_bias.strides[1])),
             "compute_dqktheta: bias reduction launch");
}

}  // namespace

size_t dqktheta_workspace_bytes(int64_t B, int64_t S, int64_t G, int64_t H, int64_t N,
                                int device_id) {
  if (B <= 0 || S <= 0 || G <= 0 || H <= 0 || N <= 0) return 0;
  const int sms = sm_count(device_id);
  const int64_t HG = (H + G - 1) / G;
  const int64_t floats = G * ctas_per_group_bound(G, sms, B * S, kMaxCtasPerSm) * HG * 2 * N;
  return static_cast<size_t>(floats) * sizeof(float) + kWsAlign;
}

void compute_dqktheta(const DqkthetaParams& p, void* workspace, size_t workspace_bytes,
                      void* stream) {
  DeviceGuard guard(p.device_id);
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  const int sms = sm_count(p.device_id);
  const size_t need = dqktheta_workspace_bytes(p.B, p.S, p.G, p.H, p.N, p.device_id);
  MAMBA3_CHECK_ARG(workspace != nullptr && workspace_bytes >= need, "workspace: ", workspace_bytes,
                   " bytes at ", workspace, " given, compute_dqktheta needs ", need,
                   " bytes of device memory (see mamba3_compute_dqktheta_workspace_size)");
  MAMBA3_CHECK_ARG(p.G <= 65535, "q: G=", p.G, " q/k heads exceed the CUDA grid limit 65535");
  MAMBA3_CHECK_ARG(p.B < (int64_t(1) << 31) && p.S < (int64_t(1) << 31), "q: B=", p.B,
                   " and S=", p.S, " must each be below 2^31");
  for (const TensorView* v :
       {&p.q, &p.k, &p.scale, &p.gamma, &p.q_bias, &p.k_bias, &p.angles, &p.dq_in, &p.dk_in, &p.dqk,
        &p.d_ok_state, &p.dq, &p.dk, &p.dq_bias, &p.dk_bias, &p.dangles, &p.dscale, &p.dgamma})
    check_element_aligned(*v);
  if (p.varlen) validate_cu_seqlens(p.cu_seqlens, p.S, st);

  float* const ws =
      reinterpret_cast<float*>(align_up(reinterpret_cast<uintptr_t>(workspace), kWsAlign));
  bool biases_done = false;
  if (const int split_ctas = run_split(p, ws, sms, st, &biases_done)) {
    // After the split kernel as a programmatic dependent: correct after any launch of it (the
    // reduction waits for it at pdl_wait), and it hides the launch gap.
    if (!biases_done) launch_bias_reduce(p, ws, split_ctas, st, /*pdl=*/true);
    return;
  }
  if (const int lean_ctas = run_lean(p, ws, sms, st)) {
    launch_bias_reduce(p, ws, lean_ctas, st);
    return;
  }

  const Plan pl = make_plan(p, p.device_id, sms);
  DqkArgs a;
  std::memset(&a, 0, sizeof(a));
  a.rows = p.B * p.S;
  a.S = p.S;
  a.G = static_cast<int>(p.G);
  a.HG = static_cast<int>(p.H / p.G);
  a.N = static_cast<int>(p.N);
  a.A = static_cast<int>(p.A);
  a.nchunks = pl.nchunks, a.L = pl.L, a.lshift = pl.lshift, a.RPW = pl.RPW;
  a.WH = pl.WH, a.WR = pl.WR, a.RB = pl.RB;
  a.ctas_per_g = pl.ctas_per_g, a.D = pl.D, a.Dq = pl.Dq;
  a.elem = pl.elem, a.acc_smem = pl.acc_smem, a.bias_smem = pl.bias_smem;
  a.rot_slots = pl.rot_slots;
  a.st_bytes = pl.st_bytes, a.st_dk = pl.st_dk, a.st_ang = pl.st_ang, a.st_scal = pl.st_scal;
  a.qk_bytes = pl.qk_bytes, a.qk_k = pl.qk_k;
  a.sm_qk = pl.sm_qk, a.sm_acc = pl.sm_acc, a.sm_bias = pl.sm_bias, a.sm_red = pl.sm_red;

  auto dt = [](const TensorView& v) { return static_cast<int>(v.dtype); };
  auto cptr = [](const TensorView& v) { return static_cast<const unsigned char*>(v.data); };
  auto mptr = [](const TensorView& v) { return static_cast<unsigned char*>(v.data); };
  a.t_q = dt(p.q), a.t_ang = dt(p.angles), a.t_sc = dt(p.scale), a.t_ga = dt(p.gamma);
  a.t_dqk = dt(p.dqk), a.t_qb = dt(p.q_bias), a.t_kb = dt(p.k_bias);
  a.t_dok = p.has_dok ? dt(p.d_ok_state) : kF32;
  a.t_dsc = dt(p.dscale), a.t_dga = dt(p.dgamma);

  const int NP = pl.VEC / 2;
  const int64_t ang_bytes = NP * dtype_size(p.angles.dtype);
  a.ang_vec = ang_bytes >= 4 && p.A % NP == 0 && rows_vectorizable(p.angles, ang_bytes);
  a.dang_vec = ang_bytes >= 4 && p.A % NP == 0 && rows_vectorizable(p.dangles, ang_bytes);
  a.qb_vec =
      rows_vectorizable(p.q_bias, std::min<int64_t>(16, pl.VEC * dtype_size(p.q_bias.dtype)));
  a.kb_vec =
      rows_vectorizable(p.k_bias, std::min<int64_t>(16, pl.VEC * dtype_size(p.k_bias.dtype)));

  auto s = [](const TensorView& v, int d) { return v.strides[d]; };
  a.q = cptr(p.q), a.q_sb = s(p.q, 0), a.q_ss = s(p.q, 1), a.q_sg = s(p.q, 2), a.q_sn = s(p.q, 3);
  a.k = cptr(p.k), a.k_sb = s(p.k, 0), a.k_ss = s(p.k, 1), a.k_sg = s(p.k, 2), a.k_sn = s(p.k, 3);
  a.dqi = cptr(p.dq_in), a.dqi_sb = s(p.dq_in, 0), a.dqi_ss = s(p.dq_in, 1);
  a.dqi_sh = s(p.dq_in, 2), a.dqi_sn = s(p.dq_in, 3);
  a.dki = cptr(p.dk_in), a.dki_sb = s(p.dk_in, 0), a.dki_ss = s(p.dk_in, 1);
  a.dki_sh = s(p.dk_in, 2), a.dki_sn = s(p.dk_in, 3);
  a.dq = mptr(p.dq), a.dq_sb = s(p.dq, 0), a.dq_ss = s(p.dq, 1), a.dq_sg = s(p.dq, 2);
  a.dq_sn = s(p.dq, 3);
  a.dk = mptr(p.dk), a.dk_sb = s(p.dk, 0), a.dk_ss = s(p.dk, 1), a.dk_sg = s(p.dk, 2);
  a.dk_sn = s(p.dk, 3);
  a.ang = cptr(p.angles), a.ang_sb = s(p.angles, 0), a.ang_ss = s(p.angles, 1);
  a.ang_sh = s(p.angles, 2), a.ang_sa = s(p.angles, 3);
  a.dang = mptr(p.dangles), a.dang_sb = s(p.dangles, 0), a.dang_ss = s(p.dangles, 1);
  a.dang_sh = s(p.dangles, 2), a.dang_sa = s(p.dangles, 3);
  a.sc = cptr(p.scale), a.sc_sb = s(p.scale, 0), a.sc_sh = s(p.scale, 1), a.sc_ss = s(p.scale, 2);
  a.ga = cptr(p.gamma), a.ga_sb = s(p.gamma, 0), a.ga_sh = s(p.gamma, 1), a.ga_ss = s(p.gamma, 2);
  a.dqk = cptr(p.dqk), a.dqk_sb = s(p.dqk, 0), a.dqk_sh = s(p.dqk, 1), a.dqk_ss = s(p.dqk, 2);
  a.dsc = mptr(p.dscale), a.dsc_sb = s(p.dscale, 0), a.dsc_sh = s(p.dscale, 1);
  a.dsc_ss = s(p.dscale, 2);
  a.dga = mptr(p.dgamma), a.dga_sb = s(p.dgamma, 0), a.dga_sh = s(p.dgamma, 1);
  a.dga_ss = s(p.dgamma, 2);
  a.qb = cptr(p.q_bias), a.qb_sh = s(p.q_bias, 0), a.qb_sn = s(p.q_bias, 1);
  a.kb = cptr(p.k_bias), a.kb_sh = s(p.k_bias, 0), a.kb_sn = s(p.k_bias, 1);
  a.has_dok = p.has_dok;
  if (p.has_dok) {
    a.dok = cptr(p.d_ok_state), a.dok_sq = s(p.d_ok_state, 0), a.dok_sh = s(p.d_ok_state, 1);
    a.dok_sn = s(p.d_ok_state, 2);
  }
  a.varlen = p.varlen;
  a.cu = make_cu_seqlens(p.cu_seqlens);
  a.ws = reinterpret_cast<float*>(align_up(reinterpret_cast<uintptr_t>(workspace), kWsAlign));
  byte_span(p.angles, &a.ang_lo, &a.ang_hi);
  byte_span(p.scale, &a.sc_lo, &a.sc_hi);
  byte_span(p.gamma, &a.ga_lo, &a.ga_hi);
  byte_span(p.dqk, &a.dqk_lo, &a.dqk_hi);

  const dim3 grid(static_cast<unsigned>(pl.ctas_per_g), static_cast<unsigned>(p.G));
  switch (p.dq_in.dtype) {
    case DType::F32:
      launch_dqk_vec<float>(pl, a, grid, st, p.device_id);
      break;
    case DType::BF16:
      launch_dqk_vec<__nv_bfloat16>(pl, a, grid, st, p.device_id);
      break;
    default:
      launch_dqk_vec<__half>(pl, a, grid, st, p.device_id);
      break;
  }

  launch_bias_reduce(p, a.ws, pl.ctas_per_g, st);
}

}  // namespace mamba3::cuda
