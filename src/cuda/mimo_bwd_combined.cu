// CUDA backend of mamba3_mimo_bwd_combined (upstream's mamba_mimo_bwd_combined): the first pass
// (mimo_bwd_fwd.cu) and the second pass (mimo_bwd_bwd.cu) on float32 intermediates kept in the
// caller's workspace, then the reductions to the raw inputs' gradients that upstream runs as
// separate Triton kernels and torch sums. Formulas: golden/include/mamba3_golden/mimo_bwd_bwd.hpp
// (mimo_bwd_combined) and the CPU backend (src/cpu/mimo_bwd_combined.cpp), which this mirrors.
//
// With z (and no norm) the second pass takes the caller's dout and applies the gate as it loads
// it, dL/dy^r = dout (Phi^r) * silu(z Zeta^r) (bb::Args::gate): no gated per-rank copy is
// written and read back.
// Launches after the two passes (all deterministic: fixed-order sums, no atomics):
//   qk     dq / dk summed over the heads of each q/k group, written in the caller's dtype, and
//          per-(b, chunk) partial sums of the per-head gradients (the bias gradients): one
//          read of the per-head gradients for both. Where the second pass's K3 is the copy
//          specialised to these operands, K3 does both itself as it stores dq / dk (QkGroupOut,
//          mimo_bwd_bwd_chunk_planes.cuh: the same bits) and this launch is skipped: the
//          per-head gradients (B S R H N floats each) are then never written to DRAM and read
//          back.
//   bias   the segment partials summed in order (compensated) -> dq_bias, dk_bias.
//   batch  the per-batch parameter gradients summed over the batch (dmimo_v/o/z, dD, the norm
//          weight also over R).
//   time   one CTA per (b, h, chunk): ddt and dtrap from DFACTOR / DGAMMA, and dadt from DSSDA,
//          DDA_CS, DDA_CS_REV and DDA (the chunk sums behind da_cs, da_cs_rev and segsum).
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <initializer_list>

#include "core/error.hpp"
#include "core/mimo_combined_params.hpp"
#include "cuda/common.cuh"
#include "cuda/mimo_bwd.hpp"
#include "cuda/mimo_norm_dd_f64.hpp"

namespace mamba3::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kSegRows = 16;  // rows (b, t) per block of cb_qk's walk over a chunk
constexpr int kQkThreads = 128;
constexpr size_t kAlign = 256;

// A tensor as these kernels see it: byte pointer, runtime dtype, element strides (up to 5 dims).
struct View {
  unsigned char* p = nullptr;
  int dt = kF32;
  int64_t s[5] = {0, 0, 0, 0, 0};
};

View view_of(const TensorView& t) {
  View v;
  v.p = static_cast<unsigned char*>(t.data);
  v.dt = static_cast<int>(t.dtype);
  for (int i = 0; i < t.ndim && i < 5; ++i) v.s[i] = t.strides[i];
  return v;
}

__device__ __forceinline__ float ld(const View& v, int64_t off) {
  return load_rt(v.p + off * dt_size(v.dt), v.dt);
}
__device__ __forceinline__ void st(const View& v, int64_t off, float x) {
  store_rt(v.p + off * dt_size(v.dt), v.dt, x);
}
__device__ __forceinline__ float sigmoid_acc(float x) { return 1.f / (1.f + expf(-x)); }

// ------------------------------------------------------------------ kernels

struct QkArgs {
  int64_t B, S, R, H, G, N, C, nch;
  int64_t nseg;         // B * nch: one per (b, chunk)
  const float* src[2];  // per-head dq / dk [B, S*R, H, N] compact
  View out[2];          // dq / dk [B, S, R, G, N]
  float* part;          // [2][nseg][R*H*N] segment partials
};

// One thread per (which, segment, r, g, quad of columns n0..n0+3), the quad index fastest: a
// warp reads whole 16-byte pieces of the per-head rows. A segment is one chunk of one batch
// (rows c C .. of batch b), walked in blocks of kSegRows rows: per block the thread keeps the
// block's row sums in registers while it walks the heads of its group in ascending h (the CPU
// backend's order), so the group sums and the bias partials come from one read. Each head's
// partial is the sum over the chunk's rows in row order from 0 (carried across the blocks in
// `part`, which only this thread writes): the same values and order as the second pass's K3
// where it does this reduction itself (QkGroupOut), so both give the same bits (but for
// subnormal group sums, which K3's L2 adds flush to zero).
// (Was: one thread per column over 32 rows, scalar loads, R G N threads per segment: 0.82 ms
// at B4 S2048 H16 R4 N128 for 537 MB, 16 of 64 threads busy per warp at N16.)
// Vec: N % 4 == 0, 16-byte aligned quads (compact, 256-byte aligned buffers); a compile-time
// choice so that the row loads are not split by a branch each.
template <bool Vec>
__global__ void __launch_bounds__(kQkThreads) cb_qk_kernel(const __grid_constant__ QkArgs a) {
  const int64_t nq = (a.N + 3) / 4, per_seg = a.R * a.G * nq;
  const int64_t id = blockIdx.x * int64_t{kQkThreads} + threadIdx.x;
  if (id >= 2 * a.nseg * per_seg) return;
  const int64_t q = id % per_seg, ws = id / per_seg;
  const int64_t seg = ws % a.nseg, which = ws / a.nseg;
  const int64_t n0 = (q % nq) * 4, g = (q / nq) % a.G, r = q / (nq * a.G);
  const int cnt = static_cast<int>(a.N - n0 < 4 ? a.N - n0 : 4);
  const int64_t hpg = a.H / a.G, rhn = a.R * a.H * a.N;
  const int64_t b = seg / a.nch, t_first = (seg % a.nch) * a.C;
  const int64_t t_end = a.S - t_first < a.C ? a.S : t_first + a.C;
  const float* src = a.src[which];
  const View& o = a.out[which];
  const int64_t rstride = a.R * a.H * a.N;  // between consecutive (b, t) rows of src
  for (int64_t t0 = t_first; t0 < t_end; t0 += kSegRows) {
    const int rows = t_end - t0 < kSegRows ? static_cast<int>(t_end - t0) : kSegRows;
    const int64_t row0 = b * a.S + t0;  // (b, t) row of src
    float4 rs[kSegRows];  // the group sums of the block's rows
#pragma unroll
    for (int i = 0; i < kSegRows; ++i) rs[i] = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int64_t h = g * hpg; h < (g + 1) * hpg; ++h) {
      const float* col = src + (row0 * a.R + r) * a.H * a.N + h * a.N + n0;
      float* pp = a.part + (which * a.nseg + seg) * rhn + (r * a.H + h) * a.N + n0;
      float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
      if (t0 > t_first) {  // the head's sum over the segment's earlier blocks
        if constexpr (Vec)
          acc = *reinterpret_cast<const float4*>(pp);
        else
          acc = make_float4(pp[0], cnt > 1 ? pp[1] : 0.f, cnt > 2 ? pp[2] : 0.f,
                            cnt > 3 ? pp[3] : 0.f);
      }
      // All kSegRows loads first, unconditionally (rows past the end re-read the last row): a
      // load under `i < rows` was issued only after the previous row's adds, one DRAM round
      // trip each.
      float4 xs[kSegRows];
#pragma unroll
      for (int i = 0; i < kSegRows; ++i) {
        const float* c = col + (i < rows ? i : rows - 1) * rstride;
        if constexpr (Vec)
          xs[i] = *reinterpret_cast<const float4*>(c);
        else
          xs[i] =
              make_float4(c[0], cnt > 1 ? c[1] : 0.f, cnt > 2 ? c[2] : 0.f, cnt > 3 ? c[3] : 0.f);
      }
      // The group sums start from the first head's values themselves (not 0 + them: -0 stays),
      // as K3's bulk copies do.
      const bool first = h == g * hpg;
#pragma unroll
      for (int i = 0; i < kSegRows; ++i) {
        if (i < rows) {
          const float4 x = xs[i];
          if (first)
            rs[i] = x;
          else
            rs[i].x += x.x, rs[i].y += x.y, rs[i].z += x.z, rs[i].w += x.w;
          acc.x += x.x, acc.y += x.y, acc.z += x.z, acc.w += x.w;
        }
      }
      if constexpr (Vec) {
        *reinterpret_cast<float4*>(pp) = acc;
      } else {
        const float v[4] = {acc.x, acc.y, acc.z, acc.w};
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (e < cnt) pp[e] = v[e];
      }
    }
#pragma unroll
    for (int i = 0; i < kSegRows; ++i) {
      if (i < rows) {
        const int64_t base = b * o.s[0] + (t0 + i) * o.s[1] + r * o.s[2] + g * o.s[3] + n0 * o.s[4];
        const float v[4] = {rs[i].x, rs[i].y, rs[i].z, rs[i].w};
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (e < cnt) st(o, base + e * o.s[4], v[e]);
      }
    }
  }
}

struct BiasArgs {
  int64_t R, H, N, nseg;
  const float* part;
  View out[2];  // dq_bias / dk_bias [H, R, N]
};

// grid: (ceil(R*H*N / 32), 2), kThreads threads: per 32 consecutive bias entries, each of the
// kBiasParts warps sums one contiguous range of the segments for its 32 entries (a lane per
// entry: 128-byte rows; compensated, the loads issued kBiasAhead at a time: the sum is a
// dependent chain, the loads are not), then warp 0 adds the kBiasParts (sum, compensation) pairs
// in warp order (compensated). Fixed order: deterministic. (Was one thread per entry over all
// the segments: 64 CTAs, latency-bound, 0.09 ms at B4 S2048 H16 R4 N128 C8 for 67 MB.)
constexpr int kBiasAhead = 8;
constexpr int kBiasParts = kThreads / 32;
__global__ void __launch_bounds__(kThreads) cb_bias_kernel(const __grid_constant__ BiasArgs a) {
  __shared__ float s_sum[kBiasParts][32], s_comp[kBiasParts][32];
  const int64_t rhn = a.R * a.H * a.N;
  const int lane = static_cast<int>(threadIdx.x) & 31, w = static_cast<int>(threadIdx.x) >> 5;
  const int64_t col = blockIdx.x * int64_t{32} + lane;
  const int which = blockIdx.y;
  const int64_t per = (a.nseg + kBiasParts - 1) / kBiasParts;
  const int64_t k_begin = w * per, k_end = k_begin + per < a.nseg ? k_begin + per : a.nseg;
  float s = 0.f, c = 0.f;  // Kahan: the partials are many (B*nchunks) and of mixed sign
  if (col < rhn) {
    const float* part = a.part + which * a.nseg * rhn + col;
    for (int64_t k0 = k_begin; k0 < k_end; k0 += kBiasAhead) {
      float v[kBiasAhead];
#pragma unroll
      for (int u = 0; u < kBiasAhead; ++u) v[u] = k0 + u < k_end ? part[(k0 + u) * rhn] : 0.f;
#pragma unroll
      for (int u = 0; u < kBiasAhead; ++u) {
        if (k0 + u < k_end) {
          const float y = v[u] - c;
          const float t = s + y;
          c = (t - s) - y;
          s = t;
        }
      }
    }
  }
  s_sum[w][lane] = s, s_comp[w][lane] = c;
  __syncthreads();
  if (w != 0 || col >= rhn) return;
  float S = 0.f, Cc = 0.f;
  for (int p = 0; p < kBiasParts; ++p) {
    const float y = (s_sum[p][lane] - s_comp[p][lane]) - Cc;
    const float t = S + y;
    Cc = (t - S) - y;
    S = t;
  }
  const int64_t n = col % a.N, h = (col / a.N) % a.H, r = col / (a.N * a.H);
  const View& o = a.out[which];
  st(o, h * o.s[0] + r * o.s[1] + n * o.s[2], S);
}

struct BatchArgs {
  int64_t B, H, R, P;
  const float* dmv;  // each [B, H, R, P] compact (dd [B, H]); nullptr when absent
  const float* dmo;
  const float* dmz;
  const float* dnw;
  const float* dd;
  View o_dmv, o_dmo, o_dmz, o_dnw, o_dd;
};

// One thread per output entry over the concatenation dmimo_v | dmimo_o | dmimo_z | dnorm | dD.
__global__ void __launch_bounds__(kThreads) cb_batch_kernel(const __grid_constant__ BatchArgs a) {
  int64_t i = blockIdx.x * int64_t{kThreads} + threadIdx.x;
  const int64_t hrp = a.H * a.R * a.P, hp = a.H * a.P;
  const float* srcs[3] = {a.dmv, a.dmo, a.dmz};
  const View* outs[3] = {&a.o_dmv, &a.o_dmo, &a.o_dmz};
  for (int k = 0; k < 3; ++k) {
    if (i < hrp) {
      if (srcs[k] == nullptr) return;
      float s = 0.f;
      for (int64_t b = 0; b < a.B; ++b) s += srcs[k][b * hrp + i];
      const int64_t p = i % a.P, r = (i / a.P) % a.R, h = i / (a.P * a.R);
      const View& o = *outs[k];
      st(o, h * o.s[0] + r * o.s[1] + p * o.s[2], s);
      return;
    }
    i -= hrp;
  }
  if (i < hp) {
    if (a.dnw == nullptr) return;
    const int64_t p = i % a.P, h = i / a.P;
    float s = 0.f;
    for (int64_t b = 0; b < a.B; ++b)
      for (int64_t r = 0; r < a.R; ++r) s += a.dnw[((b * a.H + h) * a.R + r) * a.P + p];
    st(a.o_dnw, h * a.o_dnw.s[0] + p * a.o_dnw.s[1], s);
    return;
  }
  i -= hp;
  if (i < a.H && a.dd != nullptr) {
    float s = 0.f;
    for (int64_t b = 0; b < a.B; ++b) s += a.dd[b * a.H + i];
    st(a.o_dd, i * a.o_dd.s[0], s);
  }
}

struct TimeArgs {
  int64_t B, H, S, C, nch;
  View dt, trap, da_cs, da_cs_rev, segsum;
  // second-pass outputs, compact f32: [B, H, S] and dssda [B, H, nch, C, C]
  const float *dfac, *dgam, *dda, *drev, *dcs, *dssda;
  View ddt, dtrap, dadt;
};

// One CTA of kTimeThreads per (b, h, chunk); thread m < L owns position s0 + m.
//   ddt_t   = lam_t (DGAMMA_t + DFACTOR_t) + (1 - lam_t) DFACTOR_{t-1}
//   dtrap_t = lam_t (1 - lam_t) dt_t (DGAMMA_t + DFACTOR_t - DFACTOR_{t-1})
//   dadt_m  = sum_{t>=m} e^{da_cs_t} DDA_CS_t + sum_{t<m} e^{da_cs_rev_t} DDA_CS_REV_t
//           + sum_{j<m<=i} e^{segsum_ij} DSSDA_ji + DDA_m
// (adt_m enters da_cs_t for t >= m, da_cs_rev_t for t < m, and segsum_ij for j < m <= i).
// In a partial last chunk da_cs_rev and segsum are rebuilt from the edge-extended da_cs, as the
// first pass's tail contract says. The C x C weights are filled by all kTimeThreads threads,
// kTimeAhead entries per thread with their loads issued first (with one warp pair per chunk and
// a global load per entry in turn, C = 64 took 64 DRAM round trips per CTA: 0.15 ms at B4 S2048
// H16).
// Threads: time_threads(C) (>= C: C <= 64 by the params); shared memory: time_smem_bytes(C), sized to C so that small
// chunks keep many CTAs per SM.
// The segsum term of position m is a rectangle of the weights (j < m <= i): kTimeSplit threads
// per position sum interleaved columns i, their partials added in order (one thread per
// position did up to C^2 / 4 dependent adds: 1024 at C = 64).
constexpr int kTimeThreads = 256, kTimeAhead = 4, kTimeSplit = 4;
unsigned time_threads(int64_t C) {  // >= kTimeSplit C (C <= 64)
  return static_cast<unsigned>(std::min<int64_t>(
      kTimeThreads, std::max<int64_t>({64, C * C / kTimeAhead, kTimeSplit * C})));
}
size_t time_smem_bytes(int64_t C) {
  return static_cast<size_t>(3 * C + C * (C + 1) + kTimeSplit * C) * sizeof(float);
}

__global__ void __launch_bounds__(kTimeThreads) cb_time_kernel(const __grid_constant__ TimeArgs a) {
  extern __shared__ float tsm[];
  const int ldw = static_cast<int>(a.C) + 1;
  float *dcs = tsm, *E = tsm + a.C, *F = tsm + 2 * a.C;
  float* W = tsm + 3 * a.C;  // W[j ldw + i] = e^{segsum_ij} DSSDA_ji (j < i)
  float* Wsum = W + a.C * ldw;  // [C][kTimeSplit] partial rectangle sums
  const int nt = blockDim.x;
  const int64_t c = blockIdx.x % a.nch, bh = blockIdx.x / a.nch;
  const int64_t h = bh % a.H, b = bh / a.H;
  const int64_t s0 = c * a.C;
  const int L = static_cast<int>(a.S - s0 < a.C ? a.S - s0 : a.C);
  const bool partial = L < a.C;
  const int m = threadIdx.x;
  const int64_t row = bh * a.S;
  if (m < L) {
    const int64_t t = s0 + m;
    const float dtv = ld(a.dt, b * a.dt.s[0] + h * a.dt.s[1] + t * a.dt.s[2]);
    const float lam = sigmoid_acc(ld(a.trap, b * a.trap.s[0] + h * a.trap.s[1] + t * a.trap.s[2]));
    const float both = a.dgam[row + t] + a.dfac[row + t];
    const float prev = t > 0 ? a.dfac[row + t - 1] : 0.f;
    st(a.ddt, b * a.ddt.s[0] + h * a.ddt.s[1] + t * a.ddt.s[2], lam * both + (1.f - lam) * prev);
    st(a.dtrap, b * a.dtrap.s[0] + h * a.dtrap.s[1] + t * a.dtrap.s[2],
       lam * (1.f - lam) * dtv * (both - prev));
    dcs[m] = ld(a.da_cs, b * a.da_cs.s[0] + h * a.da_cs.s[1] + t * a.da_cs.s[2]);
  }
  __syncthreads();
  if (m < L) {
    const int64_t t = s0 + m;
    E[m] = expf(dcs[m]) * a.dcs[row + t];
    const float rev =
        partial ? dcs[L - 1] - dcs[m]
                : ld(a.da_cs_rev, b * a.da_cs_rev.s[0] + h * a.da_cs_rev.s[1] + t * a.da_cs_rev.s[2]);
    F[m] = expf(rev) * a.drev[row + t];
  }
  const float* dss = a.dssda + (bh * a.nch + c) * a.C * a.C;
  const int64_t seg0 = b * a.segsum.s[0] + h * a.segsum.s[1] + c * a.segsum.s[2];
  for (int idx0 = m; idx0 < L * L; idx0 += kTimeAhead * nt) {
    float seg[kTimeAhead], ds[kTimeAhead];
#pragma unroll
    for (int u = 0; u < kTimeAhead; ++u) {  // loads first
      const int idx = idx0 + u * nt;
      const int i = idx % L, j = idx / L;  // consecutive threads: consecutive i (DSSDA's last dim)
      seg[u] = ds[u] = 0.f;
      if (idx < L * L && j < i) {
        seg[u] = partial ? dcs[i] - dcs[j]
                         : ld(a.segsum, seg0 + i * a.segsum.s[3] + j * a.segsum.s[4]);
        ds[u] = dss[j * a.C + i];
      }
    }
#pragma unroll
    for (int u = 0; u < kTimeAhead; ++u) {
      const int idx = idx0 + u * nt;
      const int i = idx % L, j = idx / L;
      if (idx < L * L) W[j * ldw + i] = j < i ? expf(seg[u]) * ds[u] : 0.f;
    }
  }
  __syncthreads();
  {
    const int pm = m / kTimeSplit, q = m % kTimeSplit;
    if (pm < L) {
      float part = 0.f;
      for (int i = pm + q; i < L; i += kTimeSplit)
        for (int j = 0; j < pm; ++j) part += W[j * ldw + i];
      Wsum[m] = part;
    }
  }
  __syncthreads();
  if (m >= L) return;
  float acc = 0.f;
  for (int t = m; t < L; ++t) acc += E[t];
  for (int t = 0; t < m; ++t) acc += F[t];
  for (int q = 0; q < kTimeSplit; ++q) acc += Wsum[m * kTimeSplit + q];
  acc += a.dda[row + s0 + m];
  st(a.dadt, b * a.dadt.s[0] + h * a.dadt.s[1] + (s0 + m) * a.dadt.s[2], acc);
}

// ------------------------------------------------------------------ workspace and set-up

unsigned blocks(int64_t n, int per = kThreads) {
  return static_cast<unsigned>(std::max<int64_t>(1, (n + per - 1) / per));
}

// The float32 intermediates, the two passes' own workspace (one region: they run one after the
// other on the stream) and the bias partials, carved from the caller's workspace.
struct Layout {
  MimoBwdFwdParams f;
  MimoBwdBwdParams b;
  float *dqh = nullptr, *dkh = nullptr, *dmv = nullptr, *dmo = nullptr,
        *dmz = nullptr, *dnw = nullptr, *dd = nullptr, *dfac = nullptr, *dgam = nullptr,
        *dda = nullptr, *drev = nullptr, *dcs = nullptr, *dssda = nullptr, *part = nullptr;
  void* ndd = nullptr;  // the float64 dD's workspace (fused norm and D)
  void* sub = nullptr;
  size_t sub_bytes = 0;
  int64_t nseg = 0;
  size_t bytes = 0;  // total, alignment slack included
};

// `base` is the caller's workspace (or a stand-in when only the size is wanted).
Layout make_layout(const MimoCombinedParams& cp, unsigned char* base) {
  Layout l;
  MimoBwdFwdParams& f = l.f;
  f = cp.fwd;
  const int64_t B = f.B, S = f.S, H = f.H, N = f.N, P = f.P, R = f.R, C = f.C, nch = f.nchunks;
  unsigned char* aligned = reinterpret_cast<unsigned char*>(
      (reinterpret_cast<uintptr_t>(base) + kAlign - 1) / kAlign * kAlign);
  size_t used = 0;
  auto take = [&](int64_t floats) {
    float* p = reinterpret_cast<float*>(aligned + used);
    used += (static_cast<size_t>(floats) * sizeof(float) + kAlign - 1) / kAlign * kAlign;
    return p;
  };
  auto view = [&](float* p, std::initializer_list<int64_t> shape, const char* name) {
    return compact_f32_view(p, shape, name, DeviceKind::CUDA, f.device_id);
  };

  // first pass
  f.output_dtype = DType::F32;
  f.states = view(take(B * H * nch * N * P), {B, H, nch, N, P}, "states");
  f.qk_dot = view(take(B * H * S * R * R), {B, H, S, R, R}, "qk_dot");
  if (f.reduce_o) {
    l.dmo = take(B * H * R * P);
    f.dmimo_o = view(l.dmo, {B, H, R, P}, "dmimo_o");
  }
  if (f.has_z) {
    l.dmz = take(B * H * R * P);
    f.dmimo_z = view(l.dmz, {B, H, R, P}, "dmimo_z");
    f.dz = cp.dz;
  }
  if (f.has_norm) {
    l.dnw = take(B * H * R * P);
    f.dnorm_weight = view(l.dnw, {B, H, R, P}, "dnorm_weight");
    f.dout_pre_rms = view(take(B * H * S * R * P), {B, H, S * R, P}, "dout_pre_rms");
  }

  // second pass
  MimoBwdBwdParams& b = l.b;
  b.B = B, b.S = S, b.H = H, b.G = f.G, b.N = N, b.P = P, b.R = R, b.C = C, b.nchunks = nch;
  b.rotary_dim_divisor = f.rotary_dim_divisor, b.A = f.A, b.has_d = f.has_d;
  b.device = DeviceKind::CUDA, b.device_id = f.device_id;
  b.q = f.q, b.k = f.k, b.v = f.v, b.q_bias = f.q_bias, b.k_bias = f.k_bias, b.mimo_v = f.mimo_v;
  b.states = f.states, b.qk_dot = f.qk_dot, b.da_cs = f.da_cs, b.da_cs_rev = f.da_cs_rev;
  b.dt = f.dt, b.trap = f.trap, b.segsum = f.segsum, b.angles = f.angles, b.d = f.d;
  if (f.has_norm) {  // dL/dy^r is the first pass's pre-RMS dout
    b.dout = f.dout_pre_rms;
    b.dout_layout = MimoDout::Packed;
  } else if (f.has_z) {  // the second pass applies the gate as it loads dout (Args::gate)
    b.dout = f.dout;
    b.mimo_o = f.mimo_o;
    b.dout_layout = f.reduce_o ? MimoDout::ReduceO : MimoDout::PerRank;
    b.z = f.z, b.mimo_z = f.mimo_z;
  } else {
    b.dout = f.dout;
    b.mimo_o = f.mimo_o;
    b.dout_layout = f.reduce_o ? MimoDout::ReduceO : MimoDout::PerRank;
  }
  l.dqh = take(B * S * R * H * N);
  l.dkh = take(B * S * R * H * N);
  b.dq = view(l.dqh, {B, S * R, H, N}, "dq");
  b.dk = view(l.dkh, {B, S * R, H, N}, "dk");
  b.dv = cp.dv;
  l.dmv = take(B * H * R * P);
  b.dmimo_v = view(l.dmv, {B, H, R, P}, "dmimo_v");
  b.dangles = cp.dangles;
  l.dfac = take(B * H * S);
  l.dgam = take(B * H * S);
  l.dda = take(B * H * S);
  l.drev = take(B * H * S);
  l.dcs = take(B * H * S);
  l.dssda = take(B * H * nch * C * C);
  b.dfactor = view(l.dfac, {B, H, S}, "dfactor");
  b.dgamma = view(l.dgam, {B, H, S}, "dgamma");
  b.dda = view(l.dda, {B, H, S}, "dda");
  b.dda_cs_rev = view(l.drev, {B, H, S}, "dda_cs_rev");
  b.dda_cs = view(l.dcs, {B, H, S}, "dda_cs");
  b.dssda = view(l.dssda, {B, H, nch, C, C}, "dssda");
  if (f.has_d) {
    l.dd = take(B * H);
    b.dd = view(l.dd, {B, H}, "dd");
  }

  // reductions
  l.nseg = B * nch;  // one bias partial per (b, chunk) and head
  l.part = take(2 * l.nseg * R * H * N);
  if (f.has_norm && f.has_d)  // (take's 256-byte alignment suits the doubles)
    l.ndd = take(static_cast<int64_t>(norm_dd_f64_workspace_bytes(f) / sizeof(float)));

  // the passes' own workspace
  l.sub_bytes = std::max(mimo_bwd_fwd_workspace_bytes(f), mimo_bwd_bwd_workspace_bytes(l.b));
  l.sub = aligned + used;
  used += l.sub_bytes;
  l.bytes = used + kAlign;
  return l;
}

}  // namespace

size_t mimo_bwd_combined_workspace_bytes(const MimoCombinedParams& p) {
  // Any aligned stand-in gives the same sizes: no pointer is dereferenced.
  return make_layout(p, reinterpret_cast<unsigned char*>(kAlign)).bytes;
}

void mimo_bwd_combined(const MimoCombinedParams& cp, void* workspace, size_t workspace_bytes,
                       void* stream) {
  const size_t need = mimo_bwd_combined_workspace_bytes(cp);
  MAMBA3_CHECK_ARG(workspace != nullptr && workspace_bytes >= need, "workspace: ",
                   workspace_bytes, " bytes at ", workspace, " given, mimo_bwd_combined needs ",
                   need, " bytes of device memory (see mamba3_mimo_bwd_combined_workspace_size)");
  for (const TensorView* t : {&cp.dq, &cp.dk, &cp.dv, &cp.dadt, &cp.ddt, &cp.dtrap, &cp.dq_bias,
                              &cp.dk_bias, &cp.dmimo_v, &cp.dmimo_z, &cp.dmimo_o, &cp.dangles,
                              &cp.dd, &cp.dz, &cp.dnorm_weight})
    check_element_aligned(*t);
  Layout l = make_layout(cp, static_cast<unsigned char*>(workspace));
  const MimoBwdFwdParams& f = l.f;
  DeviceGuard guard(f.device_id);
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  const int64_t B = f.B, S = f.S, H = f.H, G = f.G, N = f.N, P = f.P, R = f.R;

  mimo_bwd_fwd(f, l.sub, l.sub_bytes, stream);

  // The second pass does the q / k group sums itself where its K3 can (QkGroupOut; same bits
  // as cb_qk), else cb_qk reads its per-head dq / dk back.
  QkGroupOut grp;
  grp.dq = cp.dq, grp.dk = cp.dk, grp.part = l.part;
  const bool grouped = mimo_bwd_bwd(l.b, l.sub, l.sub_bytes, stream, &grp);

  {
    if (!grouped) {
      QkArgs q;
      q.B = B, q.S = S, q.R = R, q.H = H, q.G = G, q.N = N, q.C = f.C, q.nch = f.nchunks;
      q.nseg = l.nseg;
      q.src[0] = l.dqh, q.src[1] = l.dkh;
      q.out[0] = view_of(cp.dq), q.out[1] = view_of(cp.dk);
      q.part = l.part;
      const int64_t qk_threads = 2 * l.nseg * R * G * ((N + 3) / 4);
      if (N % 4 == 0)
        cb_qk_kernel<true><<<blocks(qk_threads, kQkThreads), kQkThreads, 0, st>>>(q);
      else
        cb_qk_kernel<false><<<blocks(qk_threads, kQkThreads), kQkThreads, 0, st>>>(q);
      check_launch("mimo_bwd_combined: q/k group-sum kernel");
    }
    BiasArgs bi;
    bi.R = R, bi.H = H, bi.N = N, bi.nseg = l.nseg, bi.part = l.part;
    bi.out[0] = view_of(cp.dq_bias), bi.out[1] = view_of(cp.dk_bias);
    cb_bias_kernel<<<dim3(blocks(R * H * N, 32), 2), kThreads, 0, st>>>(bi);
    check_launch("mimo_bwd_combined: bias reduction kernel");
  }
  {
    BatchArgs ba;
    ba.B = B, ba.H = H, ba.R = R, ba.P = P;
    ba.dmv = l.dmv, ba.dmo = l.dmo, ba.dmz = l.dmz, ba.dnw = l.dnw, ba.dd = l.dd;
    ba.o_dmv = view_of(cp.dmimo_v);
    if (l.dmo) ba.o_dmo = view_of(cp.dmimo_o);
    if (l.dmz) ba.o_dmz = view_of(cp.dmimo_z);
    if (l.dnw) ba.o_dnw = view_of(cp.dnorm_weight);
    if (l.dd) ba.o_dd = view_of(cp.dd);
    if (l.ndd) ba.dd = nullptr;  // dD comes from norm_dd_f64 below
    cb_batch_kernel<<<blocks(3 * H * R * P + H * P + H), kThreads, 0, st>>>(ba);
    check_launch("mimo_bwd_combined: batch reduction kernel");
  }
  {
    TimeArgs t;
    t.B = B, t.H = H, t.S = S, t.C = f.C, t.nch = f.nchunks;
    t.dt = view_of(f.dt), t.trap = view_of(f.trap), t.da_cs = view_of(f.da_cs);
    t.da_cs_rev = view_of(f.da_cs_rev), t.segsum = view_of(f.segsum);
    t.dfac = l.dfac, t.dgam = l.dgam, t.dda = l.dda, t.drev = l.drev, t.dcs = l.dcs;
    t.dssda = l.dssda;
    t.ddt = view_of(cp.ddt), t.dtrap = view_of(cp.dtrap), t.dadt = view_of(cp.dadt);
    cb_time_kernel<<<static_cast<unsigned>(B * H * f.nchunks), time_threads(f.C),
                     time_smem_bytes(f.C), st>>>(t);
    check_launch("mimo_bwd_combined: dt / trap / adt kernel");
  }
  // With the fused norm dD is recomputed from the inputs in float64: the second pass's float32
  // sum of dout_pre_rms . x is ill-conditioned there (mimo_norm_dd_f64.cuh, docs/ACCURACY.md).
  if (l.ndd) norm_dd_f64(f, l.ndd, cp.dd, st);
}

}  // namespace mamba3::cuda
