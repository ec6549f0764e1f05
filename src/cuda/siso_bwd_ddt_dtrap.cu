// CUDA backend of compute_ddt_dtrap_dinput_states (seed 000).
//
// One launch on the caller's stream; with input states its blocks do two independent jobs (so
// that they overlap):
// * state blocks (only with input states; the leading blocks): per (sequence, head), copy
//   d_issm_state, compute d_input_v/d_input_k and the scalar's gradient dsc, and write ddt/dtrap
//   at the sequence's first position themselves. A warp issues the loads of all its rows before
//   using any, so a block pays one memory latency, not one per row. Generic layouts: one block
//   per (sequence, head). Contiguous 16-byte aligned state rows take the vector path
//   (ddt_state_vec: a cluster of kStateCluster blocks per (sequence, head) splitting the rows,
//   16-byte loads/stores, all rows of a thread in flight at once, row dots reduced together,
//   dsc carried to float64 precision, the blocks' column sums and dsc added through
//   distributed shared memory in rank order);
// * element blocks: ddt/dtrap from dscale, dgamma, dt, trap and dscale[t-1] of the same sequence
//   (0 at a sequence start; the neighbour is read by the thread that owns t-1 as well, so it
//   comes from L1/L2, not HBM). With float32 rows that are contiguous along S and 16-byte
//   aligned, a thread takes 4 positions with vector loads; otherwise one position each. They
//   skip the positions the state blocks write.
// Every output element thus has exactly one writer and every reduction a fixed order:
// deterministic, no atomics, no workspace.
// cu_seqlens values are clamped wherever they index memory.
#include <algorithm>
#include <cstring>

#include "core/error.hpp"
#include "cuda/common.cuh"
#include "cuda/cu_seqlens.cuh"
#include "cuda/siso_bwd.hpp"

#include <cooperative_groups.h>

namespace mamba3::cuda {
namespace {

namespace cgrp = cooperative_groups;

constexpr int kThreads = 256;
constexpr int kStateCluster = 2;  // CTAs per (sequence, head) on the vector state path

struct DdtArgs {
  int64_t B, H, S, P, N;
  int varlen, has_state;
  int t_ds, t_dg, t_dt, t_tr, t_st, t_ks, t_vs;
  const unsigned char *ds, *dg, *dt, *tr;
  int64_t ds_sb, ds_sh, ds_ss, dg_sb, dg_sh, dg_ss, dt_sb, dt_sh, dt_ss, tr_sb, tr_sh, tr_ss;
  float *ddt, *dtrap;
  int64_t ddt_sb, ddt_sh, ddt_ss, dtr_sb, dtr_sh, dtr_ss;
  const unsigned char* st;  // d_issm_state [nseq,H,P,N]
  int64_t st_sq, st_sh, st_sp, st_sn;
  const unsigned char* ks;  // input_k_state [nseq,H,N]
  int64_t ks_sq, ks_sh, ks_sn;
  const unsigned char* vs;  // input_v_state [nseq,H,P]
  int64_t vs_sq, vs_sh, vs_sp;
  unsigned char* ost;  // d_input_ssm_state (dtype of d_issm_state)
  int64_t ost_sq, ost_sh, ost_sp, ost_sn;
  float* oks;  // d_input_k_state
  int64_t oks_sq, oks_sh, oks_sn;
  float* ovs;  // d_input_v_state
  int64_t ovs_sq, ovs_sh, ovs_sp;
  CuSeqlens cu;
  int st_ng;             // vector state path: 16-byte column groups per row (see ddt_state_vec)
  int64_t state_blocks;  // leading blocks that do the state job
  int vec4;              // element job: 4 positions per thread (see the file comment)
};

__device__ __forceinline__ float sigmoid_acc(float x) { return 1.f / (1.f + expf(-x)); }

__device__ __forceinline__ float ld(const unsigned char* base, int dt, int64_t off) {
  return load_rt(base + off * dt_size(dt), dt);
}

// ddt/dtrap at one position from its inputs and dscale[t-1] (`prev`, 0 at a sequence start).
__device__ __forceinline__ void ddt_point(float ds, float dg, float dtv, float tr, float prev,
                                          float* ddt, float* dtrap) {
  const float lam = sigmoid_acc(tr);
  const float cur = dg + ds;
  *ddt = cur * lam + prev * (1.f - lam);
  *dtrap = (cur - prev) * dtv * lam * (1.f - lam);
}

// Element job, 4 positions per thread (float32, unit S stride, S % 4 == 0, 16-byte aligned rows).
__device__ __forceinline__ void ddt_elem_vec4(const DdtArgs& a, int64_t blk) {
  const int64_t e = blk * kThreads + threadIdx.x;  // index of a group of 4 positions
  const int64_t S4 = a.S >> 2;
  if (e >= a.B * a.H * S4) return;
  int64_t t, h, b;
  if (a.B * a.H * S4 <= 0x7fffffff) {
    const uint32_t e32 = static_cast<uint32_t>(e), s32 = static_cast<uint32_t>(S4);
    const uint32_t H32 = static_cast<uint32_t>(a.H), bh = e32 / s32;
    t = static_cast<int64_t>(e32 - bh * s32) * 4;
    b = bh / H32;
    h = bh - static_cast<uint32_t>(b) * H32;
  } else {
    const int64_t bh = e / S4;
    t = (e - bh * S4) * 4;
    b = bh / a.H;
    h = bh - b * a.H;
  }
  const float* ds = reinterpret_cast<const float*>(a.ds) + b * a.ds_sb + h * a.ds_sh + t;
  const float4 vds = __ldg(reinterpret_cast<const float4*>(ds));
  const float4 vdg = __ldg(reinterpret_cast<const float4*>(
      reinterpret_cast<const float*>(a.dg) + b * a.dg_sb + h * a.dg_sh + t));
  const float4 vdt = __ldg(reinterpret_cast<const float4*>(
      reinterpret_cast<const float*>(a.dt) + b * a.dt_sb + h * a.dt_sh + t));
  const float4 vtr = __ldg(reinterpret_cast<const float4*>(
      reinterpret_cast<const float*>(a.tr) + b * a.tr_sb + h * a.tr_sh + t));
  const float p0 = t > 0 ? __ldg(ds - 1) : 0.f;
  const float dsv[4] = {vds.x, vds.y, vds.z, vds.w}, dgv[4] = {vdg.x, vdg.y, vdg.z, vdg.w};
  const float dtv[4] = {vdt.x, vdt.y, vdt.z, vdt.w}, trv[4] = {vtr.x, vtr.y, vtr.z, vtr.w};
  const float pv[4] = {p0, vds.x, vds.y, vds.z};
  float o1[4], o2[4];
  unsigned skip = 0;  // bit j: position t+j starts a sequence and a state block writes it
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int64_t tj = t + j;
    bool start = tj == 0;
    if (a.varlen && !start) start = a.cu.at(a.cu.seq_of(tj)) == tj;
    if (start && a.has_state) skip |= 1u << j;
    ddt_point(dsv[j], dgv[j], dtv[j], trv[j], start ? 0.f : pv[j], &o1[j], &o2[j]);
  }
  float* pd = a.ddt + b * a.ddt_sb + h * a.ddt_sh + t;
  float* pt = a.dtrap + b * a.dtr_sb + h * a.dtr_sh + t;
  if (skip == 0) {
    *reinterpret_cast<float4*>(pd) = make_float4(o1[0], o1[1], o1[2], o1[3]);
    *reinterpret_cast<float4*>(pt) = make_float4(o2[0], o2[1], o2[2], o2[3]);
  } else {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if ((skip >> j) & 1u) continue;
      pd[j] = o1[j];
      pt[j] = o2[j];
    }
  }
}

// Element job, one position per thread (any dtypes and strides).
__device__ __forceinline__ void ddt_elem_one(const DdtArgs& a, int64_t blk) {
  {
    const int64_t e = blk * kThreads + threadIdx.x;
    const int64_t total = a.B * a.H * a.S;
    if (e >= total) return;
    int64_t t, h, b;
    if (total <= 0x7fffffff) {  // 32-bit division: the 64-bit one is a long subroutine
      const uint32_t e32 = static_cast<uint32_t>(e), S32 = static_cast<uint32_t>(a.S);
      const uint32_t H32 = static_cast<uint32_t>(a.H), bh = e32 / S32;
      t = e32 - bh * S32;
      b = bh / H32;
      h = bh - static_cast<uint32_t>(b) * H32;
    } else {
      const int64_t bh = e / a.S;
      t = e - bh * a.S;
      b = bh / a.H;
      h = bh - b * a.H;
    }
    bool start = t == 0;
    if (a.varlen && !start) start = a.cu.at(a.cu.seq_of(t)) == t;
    if (start && a.has_state) return;  // written by the sequence's state block
    const float ds = ld(a.ds, a.t_ds, b * a.ds_sb + h * a.ds_sh + t * a.ds_ss);
    const float dg = ld(a.dg, a.t_dg, b * a.dg_sb + h * a.dg_sh + t * a.dg_ss);
    const float dtv = ld(a.dt, a.t_dt, b * a.dt_sb + h * a.dt_sh + t * a.dt_ss);
    const float lam = sigmoid_acc(ld(a.tr, a.t_tr, b * a.tr_sb + h * a.tr_sh + t * a.tr_ss));
    const float prev =
        start ? 0.f : ld(a.ds, a.t_ds, b * a.ds_sb + h * a.ds_sh + (t - 1) * a.ds_ss);
    const float cur = dg + ds;
    a.ddt[b * a.ddt_sb + h * a.ddt_sh + t * a.ddt_ss] = cur * lam + prev * (1.f - lam);
    a.dtrap[b * a.dtr_sb + h * a.dtr_sh + t * a.dtr_ss] = (cur - prev) * dtv * lam * (1.f - lam);
  }
}

// State job of (sequence i, head h) = idx; column sums in registers for N <= 32*U.
template <int U>
__device__ __forceinline__ void ddt_state_block(const DdtArgs& a, int64_t idx) {
  __shared__ float part[kThreads / 32];
  const int64_t i = idx / a.H, h = idx % a.H;
  const int64_t b = a.varlen ? 0 : i;
  int64_t t0 = 0;
  if (a.varlen) {
    t0 = a.cu.at(i);
    t0 = t0 < 0 ? 0 : (t0 > a.S - 1 ? a.S - 1 : t0);
  }
  const float dt0 = ld(a.dt, a.t_dt, b * a.dt_sb + h * a.dt_sh + t0 * a.dt_ss);
  const float lam0 = sigmoid_acc(ld(a.tr, a.t_tr, b * a.tr_sb + h * a.tr_sh + t0 * a.tr_ss));
  const float scalar = dt0 * (1.f - lam0);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int stsz = dt_size(a.t_st);
  const unsigned char* d = a.st + (i * a.st_sq + h * a.st_sh) * stsz;
  unsigned char* od = a.ost + (i * a.ost_sq + h * a.ost_sh) * stsz;
  const unsigned char* kv = a.ks + (i * a.ks_sq + h * a.ks_sh) * dt_size(a.t_ks);
  const unsigned char* vv = a.vs + (i * a.vs_sq + h * a.vs_sh) * dt_size(a.t_vs);

  // Rows p (one warp each): copy d_issm, d_input_v[p] = scalar * sum_n d[p,n] k[n], this warp's
  // part of dsc = sum_p v[p] * (sum_n d[p,n] k[n]) and, for N <= 256 with contiguous rows, this
  // warp's part of the column sums sum_p d[p,n] v[p] (lane-owned columns n = lane + 32u, in
  // registers): d_issm is read once. Otherwise the columns are summed in a second,
  // column-parallel pass.
  constexpr int kMaxU = U;
  __shared__ float colpart[kThreads / 32][32 * kMaxU];
  const bool regcols = a.N <= 32 * kMaxU && a.st_sn == 1 && a.ost_sn == 1;
  float kr[kMaxU], ca[kMaxU];
#pragma unroll
  for (int u = 0; u < kMaxU; ++u) {
    const int64_t n = lane + 32 * u;
    kr[u] = regcols && n < a.N ? ld(kv, a.t_ks, n * a.ks_sn) : 0.f;
    ca[u] = 0.f;
  }
  float dsc_w = 0.f;
  if (regcols) {
    // Batches of kR rows per warp: every load of a batch is issued before any is used.
    constexpr int kR = U >= 8 ? 2 : (U >= 4 ? 4 : 8), kW = kThreads / 32;
    const unsigned char* const drow0 = d;
    for (int64_t pb = warp; pb < a.P; pb += kR * kW) {
      uint32_t w[kR][kMaxU];
      float vpr[kR];
#pragma unroll
      for (int r = 0; r < kR; ++r) {
        const int64_t p = pb + r * kW;
        vpr[r] = p < a.P ? ld(vv, a.t_vs, p * a.vs_sp) : 0.f;
        const unsigned char* drow = drow0 + p * a.st_sp * stsz;
#pragma unroll
        for (int u = 0; u < kMaxU; ++u) {
          const int n = lane + 32 * u;
          w[r][u] = 0u;
          if (p < a.P && n < a.N)
            w[r][u] = stsz == 4 ? __ldg(reinterpret_cast<const unsigned int*>(drow + n * 4))
                                : __ldg(reinterpret_cast<const unsigned short*>(drow + n * 2));
        }
      }
#pragma unroll
      for (int r = 0; r < kR; ++r) {
        const int64_t p = pb + r * kW;
        if (p >= a.P) break;
        unsigned char* orow = od + p * a.ost_sp * stsz;
        float acc = 0.f;
#pragma unroll
        for (int u = 0; u < kMaxU; ++u) {
          const int n = lane + 32 * u;
          if (n < a.N) {
            float x;
            if (stsz == 4) {
              *reinterpret_cast<unsigned int*>(orow + n * 4) = w[r][u];
              x = __uint_as_float(w[r][u]);
            } else {
              *reinterpret_cast<unsigned short*>(orow + n * 2) =
                  static_cast<unsigned short>(w[r][u]);
              x = bits_to_float(w[r][u], a.t_st);
            }
            acc = fmaf(x, kr[u], acc);
            ca[u] = fmaf(x, vpr[r], ca[u]);
          }
        }
#pragma unroll
        for (int m = 16; m >= 1; m >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, m);
        if (lane == 0) {
          a.ovs[i * a.ovs_sq + h * a.ovs_sh + p * a.ovs_sp] = scalar * acc;
          dsc_w = fmaf(vpr[r], acc, dsc_w);
        }
      }
    }
  } else {
    for (int64_t p = warp; p < a.P; p += kThreads / 32) {
      const float vp = ld(vv, a.t_vs, p * a.vs_sp);
      float acc = 0.f;
      for (int64_t n = lane; n < a.N; n += 32) {
        const unsigned char* src = d + (p * a.st_sp + n * a.st_sn) * stsz;
        unsigned char* dst = od + (p * a.ost_sp + n * a.ost_sn) * stsz;
        float x;
        if (stsz == 4) {
          const uint32_t wv = __ldg(reinterpret_cast<const unsigned int*>(src));
          *reinterpret_cast<unsigned int*>(dst) = wv;
          x = __uint_as_float(wv);
        } else {
          const uint32_t wv = __ldg(reinterpret_cast<const unsigned short*>(src));
          *reinterpret_cast<unsigned short*>(dst) = static_cast<unsigned short>(wv);
          x = bits_to_float(wv, a.t_st);
        }
        acc = fmaf(x, ld(kv, a.t_ks, n * a.ks_sn), acc);
      }
#pragma unroll
      for (int m = 16; m >= 1; m >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, m);
      if (lane == 0) {
        a.ovs[i * a.ovs_sq + h * a.ovs_sh + p * a.ovs_sp] = scalar * acc;
        dsc_w = fmaf(vp, acc, dsc_w);
      }
    }
  }
  if (lane == 0) part[warp] = dsc_w;
  if (regcols) {
#pragma unroll
    for (int u = 0; u < kMaxU; ++u) colpart[warp][lane + 32 * u] = ca[u];
  }
  __syncthreads();

  // Columns n: d_input_k[n] = scalar * sum_p d[p,n] v[p] (warp parts added in warp order, or
  // p in order in the column-parallel pass).
  for (int64_t n = threadIdx.x; n < a.N; n += kThreads) {
    float acc = 0.f;
    if (regcols) {
#pragma unroll
      for (int w = 0; w < kThreads / 32; ++w) acc += colpart[w][n];
    } else {
      for (int64_t p = 0; p < a.P; ++p)
        acc = fmaf(ld(d, a.t_st, p * a.st_sp + n * a.st_sn), ld(vv, a.t_vs, p * a.vs_sp), acc);
    }
    a.oks[i * a.oks_sq + h * a.oks_sh + n * a.oks_sn] = scalar * acc;
  }

  if (threadIdx.x == 0) {
    float dsc = 0.f;
#pragma unroll
    for (int w = 0; w < kThreads / 32; ++w) dsc += part[w];
    // The first position: no dscale[t-1] term, plus the input-state term.
    const float ds = ld(a.ds, a.t_ds, b * a.ds_sb + h * a.ds_sh + t0 * a.ds_ss);
    const float dg = ld(a.dg, a.t_dg, b * a.dg_sb + h * a.dg_sh + t0 * a.dg_ss);
    const float cur = dg + ds;
    const float l1 = lam0 * (1.f - lam0);
    a.ddt[b * a.ddt_sb + h * a.ddt_sh + t0 * a.ddt_ss] = cur * lam0 + dsc * (1.f - lam0);
    a.dtrap[b * a.dtr_sb + h * a.dtr_sh + t0 * a.dtr_ss] = cur * dt0 * l1 + dsc * (-dt0) * l1;
  }
}

// Transposed butterfly (as in the dqktheta kernel) with a run-time first mask m = NG/2 >= K/2:
// K values summed over the NG lanes of a row; each exchange moves half of the remaining values.
// Afterwards lane cg holds in v[0] the sum of value cg / (NG / K). Fixed order.
template <int K>
__device__ __forceinline__ void row_reduce_rt(double* v, int cg, int m) {
  if constexpr (K > 1) {
    const bool up = (cg & m) != 0;
#pragma unroll
    for (int j = 0; j < K / 2; ++j) {
      const double send = up ? v[j] : v[j + K / 2];
      const double keep = up ? v[j + K / 2] : v[j];
      v[j] = keep + __shfl_xor_sync(0xffffffffu, send, m);
    }
    row_reduce_rt<K / 2>(v, cg, m >> 1);
  } else {
    for (; m >= 1; m >>= 1) v[0] += __shfl_xor_sync(0xffffffffu, v[0], m);
  }
}

// State job, vector path (d_issm_state rows contiguous along N and 16-byte aligned, N*size a
// multiple of 16 with NG = N*size/16 a power of two <= 32): thread (rs, cg) = (tid / NG, tid % NG)
// owns the 16-byte column group cg of its block's rows number rs, rs + RS, ... (RS = 256 / NG;
// block `rank` of the cluster takes the rows p = rank + kStateCluster * q). Every load of the
// block (the state rows in batches of up to R per thread, k, v, dt, trap, dscale, dgamma at the
// first position) is issued before any is used, so a block pays about one memory latency.
// Row dots are summed over the NG lanes of a row with shuffles, the column sums over the RS row
// slots with shuffles, then across warps in shared memory, then across the cluster's blocks in
// rank order; dsc likewise: fixed orders throughout (deterministic).
template <int ES, int R>
__device__ __forceinline__ void ddt_state_vec(const DdtArgs& a, int64_t sidx) {
  constexpr int EV = 16 / ES;  // elements per 16-byte group
  // A cluster of kStateCluster CTAs shares one (sequence, head): CTA `rank` takes the rows
  // p = rank, rank + kStateCluster, ...; the column sums and dsc of the cluster's CTAs meet
  // through distributed shared memory in rank order.
  cgrp::cluster_group cluster = cgrp::this_cluster();
  const int rank = static_cast<int>(sidx % kStateCluster);
  const int64_t idx = sidx / kStateCluster;
  __shared__ float colloc[32 * EV];  // this CTA's column sums
  __shared__ double dscloc;          // this CTA's part of dsc
  __shared__ float colw[kThreads / 32][32 * EV];  // per warp: its column sums (NG * EV <= 32*EV)
  __shared__ double partw[kThreads / 32];
  __shared__ float cur0[2];  // dscale, dgamma at the first position (parked by thread 0)
  const int64_t i = idx / a.H, h = idx % a.H;
  const int64_t b = a.varlen ? 0 : i;
  int64_t t0 = 0;
  if (a.varlen) {
    t0 = a.cu.at(i);
    t0 = t0 < 0 ? 0 : (t0 > a.S - 1 ? a.S - 1 : t0);
  }
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int NG = a.st_ng, RS = kThreads / NG;
  const int cg = tid & (NG - 1), rs = tid / NG;
  // Scalars of the first position (all threads; the same addresses: one request per warp).
  const float dt0 = ld(a.dt, a.t_dt, b * a.dt_sb + h * a.dt_sh + t0 * a.dt_ss);
  const float tr0 = ld(a.tr, a.t_tr, b * a.tr_sb + h * a.tr_sh + t0 * a.tr_ss);
  float ds0 = 0.f, dg0 = 0.f;
  if (tid == 0) {
    ds0 = ld(a.ds, a.t_ds, b * a.ds_sb + h * a.ds_sh + t0 * a.ds_ss);
    dg0 = ld(a.dg, a.t_dg, b * a.dg_sb + h * a.dg_sh + t0 * a.dg_ss);
  }
  const unsigned char* d = a.st + (i * a.st_sq + h * a.st_sh) * ES + cg * 16;
  unsigned char* od = a.ost + (i * a.ost_sq + h * a.ost_sh) * ES + cg * 16;
  const unsigned char* kv = a.ks + (i * a.ks_sq + h * a.ks_sh) * dt_size(a.t_ks);
  const unsigned char* vv = a.vs + (i * a.vs_sq + h * a.vs_sh) * dt_size(a.t_vs);
  float kr[EV];
#pragma unroll
  for (int e = 0; e < EV; ++e) kr[e] = ld(kv, a.t_ks, (cg * EV + e) * a.ks_sn);
  const int64_t st_row = a.st_sp * ES, ost_row = a.ost_sp * ES;

  float ca[EV];
#pragma unroll
  for (int e = 0; e < EV; ++e) ca[e] = 0.f;
  double dsc_t = 0.0;  // v[p] * rowdot[p] of the rows whose dot this lane ends up holding
  const float lam0 = sigmoid_acc(tr0);
  const float scalar = dt0 * (1.f - lam0);
  const int64_t PQ = (a.P - rank + kStateCluster - 1) / kStateCluster;  // this CTA's rows
  if (tid == 0 && PQ <= 0) cur0[0] = ds0, cur0[1] = dg0;
  // Uniform trip count across the warp (row slots of one warp differ when NG < 32).
  for (int64_t p0 = 0; p0 < PQ; p0 += static_cast<int64_t>(R) * RS) {
    uint4 w[R];
    float vp[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int64_t p = rank + kStateCluster * (p0 + rs + static_cast<int64_t>(r) * RS);
      if (p < a.P) {
        w[r] = __ldg(reinterpret_cast<const uint4*>(d + p * st_row));
        vp[r] = ld(vv, a.t_vs, p * a.vs_sp);
      } else {
        w[r] = make_uint4(0u, 0u, 0u, 0u);
        vp[r] = 0.f;
      }
    }
    if (tid == 0 && p0 == 0) {  // after this thread's loads are issued: frees registers
      cur0[0] = ds0, cur0[1] = dg0;
    }
    // Rows in halves of RH = R/2 (fewer float64 values live at once).
    constexpr int RH = R / 2;
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      double rd[RH];
#pragma unroll
      for (int r2 = 0; r2 < RH; ++r2) {
        const int r = hf * RH + r2;
        const int64_t p = rank + kStateCluster * (p0 + rs + static_cast<int64_t>(r) * RS);
        if (p < a.P) *reinterpret_cast<uint4*>(od + p * ost_row) = w[r];
        const uint32_t ww[4] = {w[r].x, w[r].y, w[r].z, w[r].w};
        float x[EV];
#pragma unroll
        for (int e = 0; e < EV; ++e)
          x[e] = ES == 4 ? __uint_as_float(ww[e])
                         : bits_to_float((ww[e / 2] >> (16 * (e & 1))) & 0xffffu, a.t_st);
        // Row dots carried to float64 precision: dsc = sum_p v[p] * rowdot[p] often cancels,
        // and its error reaches ddt/dtrap at the sequence start directly. This lane's part:
        // exact products (TwoProduct via fma) summed with TwoSum into hi + lo (the _rn
        // intrinsics are never contracted), then the lanes' parts are added in float64.
        float hi = 0.f, lo = 0.f;
#pragma unroll
        for (int e = 0; e < EV; ++e) {
          const float pr = __fmul_rn(x[e], kr[e]);
          const float pe = fmaf(x[e], kr[e], -pr);
          const float sm = __fadd_rn(hi, pr);
          const float bp = __fsub_rn(sm, hi);
          lo = __fadd_rn(lo, __fadd_rn(__fadd_rn(__fsub_rn(hi, __fsub_rn(sm, bp)),
                                                 __fsub_rn(pr, bp)),
                                       pe));
          hi = sm;
          ca[e] = fmaf(x[e], vp[r], ca[e]);
        }
        rd[r2] = static_cast<double>(hi) + static_cast<double>(lo);
      }
      // Row dots over the NG lanes of each row (NG divides 32: a row is inside one warp).
      if (NG >= RH) {
        // All RH rows at once (see row_reduce_rt): lane cg then holds row cg / (NG / RH).
        row_reduce_rt<RH>(rd, cg, NG >> 1);
        const int grp = NG / RH;
        if (cg % grp == 0) {
          const int r2 = cg / grp;
          float vr = 0.f;
#pragma unroll
          for (int u = 0; u < RH; ++u)
            if (u == r2) vr = vp[hf * RH + u];
          const int64_t p =
              rank + kStateCluster * (p0 + rs + static_cast<int64_t>(hf * RH + r2) * RS);
          if (p < a.P) {
            a.ovs[i * a.ovs_sq + h * a.ovs_sh + p * a.ovs_sp] =
                scalar * static_cast<float>(rd[0]);
            dsc_t = fma(static_cast<double>(vr), rd[0], dsc_t);
          }
        }
      } else {
#pragma unroll
        for (int r2 = 0; r2 < RH; ++r2) {
          double acc = rd[r2];
          for (int m = 1; m < NG; m <<= 1) acc += __shfl_xor_sync(0xffffffffu, acc, m);
          const int64_t p =
              rank + kStateCluster * (p0 + rs + static_cast<int64_t>(hf * RH + r2) * RS);
          if (cg == 0 && p < a.P) {
            a.ovs[i * a.ovs_sq + h * a.ovs_sh + p * a.ovs_sp] = scalar * static_cast<float>(acc);
            dsc_t = fma(static_cast<double>(vp[hf * RH + r2]), acc, dsc_t);
          }
        }
      }
    }
  }
  // Column sums: the warp's row slots (lanes with the same cg), then warps in order.
  for (int m = NG; m < 32; m <<= 1) {
#pragma unroll
    for (int e = 0; e < EV; ++e) ca[e] += __shfl_xor_sync(0xffffffffu, ca[e], m);
  }
  for (int m = 1; m < 32; m <<= 1) dsc_t += __shfl_xor_sync(0xffffffffu, dsc_t, m);
  if (lane < NG) {
#pragma unroll
    for (int e = 0; e < EV; ++e) colw[warp][lane * EV + e] = ca[e];
  }
  if (lane == 0) partw[warp] = dsc_t;
  __syncthreads();
  for (int n = tid; n < a.N; n += kThreads) {
    float s = 0.f;
#pragma unroll
    for (int w2 = 0; w2 < kThreads / 32; ++w2) s += colw[w2][n];
    colloc[n] = s;
  }
  if (tid == 0) {
    double d = 0.0;
#pragma unroll
    for (int w2 = 0; w2 < kThreads / 32; ++w2) d += partw[w2];
    dscloc = d;
  }
  cluster.sync();  // every CTA's colloc/dscloc written
  // Columns n = rank, rank + CL, ...: the CTAs' sums added in rank order.
  for (int n = rank + kStateCluster * tid; n < a.N; n += kStateCluster * kThreads) {
    float s = 0.f;
#pragma unroll
    for (int c = 0; c < kStateCluster; ++c) s += cluster.map_shared_rank(colloc, c)[n];
    a.oks[i * a.oks_sq + h * a.oks_sh + n * a.oks_sn] = scalar * s;
  }
  if (rank == 0 && tid == 0) {
    double dsc = 0.0;
#pragma unroll
    for (int c = 0; c < kStateCluster; ++c) dsc += *cluster.map_shared_rank(&dscloc, c);
    // The first position in float64 from the float32 inputs (one value per sequence and head).
    const double cur = static_cast<double>(cur0[1]) + static_cast<double>(cur0[0]);
    const double l = 1.0 / (1.0 + exp(-static_cast<double>(tr0))), l1 = l * (1.0 - l);
    a.ddt[b * a.ddt_sb + h * a.ddt_sh + t0 * a.ddt_ss] =
        static_cast<float>(cur * l + dsc * (1.0 - l));
    a.dtrap[b * a.dtr_sb + h * a.dtr_sh + t0 * a.dtr_ss] =
        static_cast<float>((cur - dsc) * static_cast<double>(dt0) * l1);
  }
  cluster.sync();  // the other CTAs' shared memory stays alive until read
}

// U: see ddt_state_block (the state job's register arrays scale with it, so the launch picks the
// smallest U that fits N and the element job keeps a high occupancy).
template <int U>
__global__ void __launch_bounds__(kThreads, 2) ddt_kernel(const __grid_constant__ DdtArgs a) {
  const int64_t blk = blockIdx.x;
  if (blk < a.state_blocks) {
    ddt_state_block<U>(a, blk);
  } else if (a.vec4) {
    ddt_elem_vec4(a, blk - a.state_blocks);
  } else {
    ddt_elem_one(a, blk - a.state_blocks);
  }
}

// Input states on the vector path (ES: bytes per state element), launched in clusters of
// kStateCluster CTAs.
// Float32 states fit 64 registers (4 CTAs per SM: the reference shape's 2*128 state CTAs and 256
// element CTAs run in one wave); 16-bit states need 80 (3 CTAs per SM).
template <int ES>
__global__ void __launch_bounds__(kThreads, ES == 4 ? 4 : 3)
    ddt_vec_kernel(const __grid_constant__ DdtArgs a) {
  pdl_wait();
  const int64_t blk = blockIdx.x;
  if (blk < a.state_blocks) {
    ddt_state_vec<ES, 4>(a, blk);
  } else if (a.vec4) {
    ddt_elem_vec4(a, blk - a.state_blocks);
  } else {
    ddt_elem_one(a, blk - a.state_blocks);
  }
}

// Without input states: the element job alone, at a higher occupancy.
__global__ void __launch_bounds__(kThreads, 4) ddt_elem_kernel(const __grid_constant__ DdtArgs a) {
  pdl_wait();
  if (a.vec4)
    ddt_elem_vec4(a, blockIdx.x);
  else
    ddt_elem_one(a, blockIdx.x);
}

// 16-byte column groups per row of the state tensors when the vector state path takes them
// (contiguous rows, 16-byte aligned base and outer strides, N*size a multiple of 16 giving a
// power of two <= 32 groups); 0 otherwise.
int state_vec_groups(const DdtDtrapParams& p) {
  const int64_t es = dtype_size(p.d_issm_state.dtype);
  if ((p.N * es) % 16 != 0) return 0;
  const int64_t ng = p.N * es / 16;
  if (ng < 1 || ng > 32 || (ng & (ng - 1)) != 0) return 0;
  for (const TensorView* v : {&p.d_issm_state, &p.d_input_ssm_state}) {
    if (v->strides[3] != 1 || !aligned_to(v->data, 16)) return 0;
    for (int d = 0; d < 3; ++d)
      if (v->shape[d] > 1 && (v->strides[d] * es) % 16 != 0) return 0;
  }
  return static_cast<int>(ng);
}

}  // namespace

void compute_ddt_dtrap_dinput_states(const DdtDtrapParams& p, void* stream) {
  DeviceGuard guard(p.device_id);
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  for (const TensorView* v :
       {&p.dscale, &p.dgamma, &p.dt, &p.trap, &p.d_issm_state, &p.input_k_state, &p.input_v_state,
        &p.ddt, &p.dtrap, &p.d_input_ssm_state, &p.d_input_k_state, &p.d_input_v_state})
    check_element_aligned(*v);
  if (p.varlen) validate_cu_seqlens(p.cu_seqlens, p.S, st);

  DdtArgs a;
  std::memset(&a, 0, sizeof(a));
  a.B = p.B, a.H = p.H, a.S = p.S, a.P = p.P, a.N = p.N;
  a.varlen = p.varlen;
  a.has_state = p.has_state;
  auto dt = [](const TensorView& v) { return static_cast<int>(v.dtype); };
  auto cptr = [](const TensorView& v) { return static_cast<const unsigned char*>(v.data); };
  auto s = [](const TensorView& v, int d) { return v.strides[d]; };
  a.t_ds = dt(p.dscale), a.t_dg = dt(p.dgamma), a.t_dt = dt(p.dt), a.t_tr = dt(p.trap);
  a.ds = cptr(p.dscale), a.ds_sb = s(p.dscale, 0), a.ds_sh = s(p.dscale, 1),
  a.ds_ss = s(p.dscale, 2);
  a.dg = cptr(p.dgamma), a.dg_sb = s(p.dgamma, 0), a.dg_sh = s(p.dgamma, 1),
  a.dg_ss = s(p.dgamma, 2);
  a.dt = cptr(p.dt), a.dt_sb = s(p.dt, 0), a.dt_sh = s(p.dt, 1), a.dt_ss = s(p.dt, 2);
  a.tr = cptr(p.trap), a.tr_sb = s(p.trap, 0), a.tr_sh = s(p.trap, 1), a.tr_ss = s(p.trap, 2);
  a.ddt = static_cast<float*>(p.ddt.data);
  a.ddt_sb = s(p.ddt, 0), a.ddt_sh = s(p.ddt, 1), a.ddt_ss = s(p.ddt, 2);
  a.dtrap = static_cast<float*>(p.dtrap.data);
  a.dtr_sb = s(p.dtrap, 0), a.dtr_sh = s(p.dtrap, 1), a.dtr_ss = s(p.dtrap, 2);
  if (p.has_state) {
    a.t_st = dt(p.d_issm_state), a.t_ks = dt(p.input_k_state), a.t_vs = dt(p.input_v_state);
    a.st = cptr(p.d_issm_state);
    a.st_sq = s(p.d_issm_state, 0), a.st_sh = s(p.d_issm_state, 1);
    a.st_sp = s(p.d_issm_state, 2), a.st_sn = s(p.d_issm_state, 3);
    a.ks = cptr(p.input_k_state);
    a.ks_sq = s(p.input_k_state, 0), a.ks_sh = s(p.input_k_state, 1),
    a.ks_sn = s(p.input_k_state, 2);
    a.vs = cptr(p.input_v_state);
    a.vs_sq = s(p.input_v_state, 0), a.vs_sh = s(p.input_v_state, 1),
    a.vs_sp = s(p.input_v_state, 2);
    a.ost = static_cast<unsigned char*>(p.d_input_ssm_state.data);
    a.ost_sq = s(p.d_input_ssm_state, 0), a.ost_sh = s(p.d_input_ssm_state, 1);
    a.ost_sp = s(p.d_input_ssm_state, 2), a.ost_sn = s(p.d_input_ssm_state, 3);
    a.oks = static_cast<float*>(p.d_input_k_state.data);
    a.oks_sq = s(p.d_input_k_state, 0), a.oks_sh = s(p.d_input_k_state, 1);
    a.oks_sn = s(p.d_input_k_state, 2);
    a.ovs = static_cast<float*>(p.d_input_v_state.data);
    a.ovs_sq = s(p.d_input_v_state, 0), a.ovs_sh = s(p.d_input_v_state, 1);
    a.ovs_sp = s(p.d_input_v_state, 2);
  }
  a.cu = make_cu_seqlens(p.cu_seqlens);

  // Element job: 4 positions per thread when every [B,H,S] tensor is float32, contiguous along
  // S with S % 4 == 0 and 16-byte aligned rows.
  bool vec4 = p.S % 4 == 0;
  for (const TensorView* v : {&p.dscale, &p.dgamma, &p.dt, &p.trap, &p.ddt, &p.dtrap}) {
    vec4 = vec4 && v->dtype == DType::F32 && v->strides[2] == 1 && aligned_to(v->data, 16);
    for (int d = 0; d < 2; ++d) vec4 = vec4 && (v->shape[d] <= 1 || v->strides[d] % 4 == 0);
  }
  a.vec4 = vec4;
  const int64_t total = vec4 ? p.B * p.H * (p.S / 4) : p.B * p.H * p.S;
  a.st_ng = p.has_state ? state_vec_groups(p) : 0;
  // The vector state path runs kStateCluster CTAs (one cluster) per (sequence, head), and the
  // grid is then a whole number of clusters (the padding blocks find no work).
  const int64_t cl = a.st_ng > 0 ? kStateCluster : 1;
  a.state_blocks = p.has_state ? cl * p.nseq * p.H : 0;
  int64_t blocks = a.state_blocks + (total + kThreads - 1) / kThreads;
  blocks = (blocks + cl - 1) / cl * cl;
  MAMBA3_CHECK_ARG(blocks <= 0x7fffffff, "dscale: B*H*S=", p.B * p.H * p.S, " and nseq*H=",
                   a.state_blocks, " are too large for one launch");
  if (blocks > 0) {
    const int64_t U = p.has_state ? (p.N + 31) / 32 : 1;
    // The element-only and vector-state kernels take programmatic dependent launch (they run
    // in a few microseconds, comparable to a launch gap): on the H200 3.8 -> 2.8 us without
    // states and 8.1 -> 7.0 us with them at B4 S2048 H32. Without the early trigger
    // (griddepcontrol.launch_dependents at the kernel's top): with it, 9.3 us with states.
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(static_cast<unsigned>(blocks));
    cfg.blockDim = dim3(kThreads);
    cfg.dynamicSmemBytes = 0;
    cfg.stream = st;
    cudaLaunchAttribute attr[2];
    attr[0] = pdl_attr();
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    if (!p.has_state) {
      check_cuda(cudaLaunchKernelEx(&cfg, ddt_elem_kernel, a),
                 "compute_ddt_dtrap_dinput_states: kernel launch");
    } else if (a.st_ng > 0) {
      attr[1].id = cudaLaunchAttributeClusterDimension;
      attr[1].val.clusterDim.x = kStateCluster;
      attr[1].val.clusterDim.y = 1;
      attr[1].val.clusterDim.z = 1;
      cfg.numAttrs = 2;
      if (dtype_size(p.d_issm_state.dtype) == 4)
        check_cuda(cudaLaunchKernelEx(&cfg, ddt_vec_kernel<4>, a),
                   "compute_ddt_dtrap_dinput_states: kernel launch");
      else
        check_cuda(cudaLaunchKernelEx(&cfg, ddt_vec_kernel<2>, a),
                   "compute_ddt_dtrap_dinput_states: kernel launch");
    } else if (U <= 1)
      ddt_kernel<1><<<static_cast<unsigned>(blocks), kThreads, 0, st>>>(a);
    else if (U <= 2)
      ddt_kernel<2><<<static_cast<unsigned>(blocks), kThreads, 0, st>>>(a);
    else if (U <= 4)
      ddt_kernel<4><<<static_cast<unsigned>(blocks), kThreads, 0, st>>>(a);
    else
      ddt_kernel<8><<<static_cast<unsigned>(blocks), kThreads, 0, st>>>(a);
    check_launch("compute_ddt_dtrap_dinput_states: kernel launch");
  }
}

}  // namespace mamba3::cuda
