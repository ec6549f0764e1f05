// CUDA backend of compute_ddt_dtrap_dinput_states (seed 000).
//
// One launch on the caller's stream; with input states its blocks do two independent jobs (so
// that they overlap):
// * state blocks (only with input states; the first nseq*H blocks): one per (sequence, head),
//   copies d_issm_state, computes d_input_v/d_input_k and the scalar's gradient dsc, and writes
//   ddt/dtrap at the sequence's first position itself. A warp issues the loads of all its rows
//   before using any, so a block pays one memory latency, not one per row;
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

namespace mamba3::cuda {
namespace {

constexpr int kThreads = 256;

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

// Without input states: the element job alone, at a higher occupancy.
__global__ void __launch_bounds__(kThreads, 4) ddt_elem_kernel(const __grid_constant__ DdtArgs a) {
  if (a.vec4)
    ddt_elem_vec4(a, blockIdx.x);
  else
    ddt_elem_one(a, blockIdx.x);
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
  a.state_blocks = p.has_state ? p.nseq * p.H : 0;
  const int64_t blocks = a.state_blocks + (total + kThreads - 1) / kThreads;
  MAMBA3_CHECK_ARG(blocks <= 0x7fffffff, "dscale: B*H*S=", p.B * p.H * p.S, " and nseq*H=",
                   a.state_blocks, " are too large for one launch");
  if (blocks > 0) {
    const int64_t U = p.has_state ? (p.N + 31) / 32 : 1;
    if (!p.has_state)
      ddt_elem_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, st>>>(a);
    else if (U <= 1)
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
