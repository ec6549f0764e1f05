// The float64 dD of mamba3_mimo_bwd_combined with the fused norm: kernels over the bodies of
// mimo_norm_dd_f64.cuh (why float64 and the stages: there), launched by mimo_bwd_combined.cu.
#include <algorithm>
#include <cstdint>

#include "core/error.hpp"
#include "cuda/common.cuh"
#include "cuda/mimo_norm_dd_f64.cuh"
#include "cuda/mimo_norm_dd_f64.hpp"

namespace mamba3::cuda {
namespace {

using ndd::kThreads;

__global__ void __launch_bounds__(kThreads)
    ndd_increment_kernel(const __grid_constant__ ndd::Args a) {
  extern __shared__ __align__(16) unsigned char ndd_inc_smem[];
  ndd::increment_body(a, ndd_inc_smem);
}
__global__ void __launch_bounds__(kThreads)
    ndd_scan_kernel(const __grid_constant__ ndd::Args a) {
  ndd::scan_body(a);
}
__global__ void __launch_bounds__(kThreads)
    ndd_readout_kernel(const __grid_constant__ ndd::Args a) {
  extern __shared__ __align__(16) unsigned char ndd_read_smem[];
  ndd::readout_body(a, ndd_read_smem);
}
// DA: the activations' dtype code of a compiled specialization, -1 for the runtime dtypes
// (ndd::fast_act_dtype; 4 instantiations of each whole-chunk kernel).
template <int DA>
__global__ void __launch_bounds__(kThreads)
    ndd_increment_fast_kernel(const __grid_constant__ ndd::Args a) {
  extern __shared__ __align__(16) unsigned char ndd_incf_smem[];
  ndd::increment_fast_body<DA, ndd::par_dtype(DA)>(a, ndd_incf_smem);
}
// MB: the blocks per SM it is compiled for. MB 2 (128 registers) where two blocks fit in shared
// memory, else MB 1 (164 registers, no spills): session 43 timed both at every grid shape
// (H100): MB 2 1.3 ms faster at N16 C8 (two blocks per SM), MB 1 1-3% faster at the other ten
// (one block per SM by shared memory, where the cap only costs spills).
template <int DA, int MB>
__global__ void __launch_bounds__(kThreads, MB)
    ndd_readout_fast_kernel(const __grid_constant__ ndd::Args a) {
  extern __shared__ __align__(16) unsigned char ndd_readf_smem[];
  ndd::readout_fast_body<DA, ndd::par_dtype(DA)>(a, ndd_readf_smem);
}
__global__ void __launch_bounds__(kThreads)
    ndd_final_kernel(const __grid_constant__ ndd::Args a) {
  ndd::final_body(a);
}

ndd::View nview(const TensorView& t) {
  ndd::View v;
  v.p = static_cast<const unsigned char*>(t.data);
  v.dt = static_cast<int>(t.dtype);
  for (int i = 0; i < t.ndim && i < 5; ++i) v.s[i] = t.strides[i];
  return v;
}

unsigned grid_of(int64_t n) {
  if (n < 1 || n >= (int64_t{1} << 31))
    MAMBA3_FAIL(MAMBA3_ERROR_UNSUPPORTED, "mimo_bwd_combined: float64 dD grid of ", n, " blocks");
  return static_cast<unsigned>(n);
}

// The chunk kernels' shared memory limit (the H100 / H200 opt-in maximum per block).
constexpr size_t kNormDdMaxSmem = 227 * 1024;
// Shared memory per SM (H100 / H200) and what the runtime reserves per block.
constexpr size_t kSmSmem = 228 * 1024, kBlockReservedSmem = 1024;

// The kernels' arguments over the first pass's params (has_norm, has_d) and a workspace of
// norm_dd_f64_workspace_bytes (256-byte aligned in the combined backward's layout).
ndd::Args norm_dd_f64_args(const MimoBwdFwdParams& f, void* workspace) {
  ndd::Args a;
  a.B = f.B, a.S = f.S, a.H = f.H, a.G = f.G, a.N = f.N, a.P = f.P, a.R = f.R, a.C = f.C;
  a.nch = f.nchunks, a.A = f.A, a.eps = f.norm_eps;
  a.q = nview(f.q), a.k = nview(f.k), a.q_bias = nview(f.q_bias), a.k_bias = nview(f.k_bias);
  a.mimo_v = nview(f.mimo_v), a.mimo_o = nview(f.mimo_o), a.mimo_z = nview(f.mimo_z);
  a.v = nview(f.v), a.dout = nview(f.dout), a.z = nview(f.z), a.angles = nview(f.angles);
  a.da_cs = nview(f.da_cs), a.da_cs_rev = nview(f.da_cs_rev), a.dt = nview(f.dt);
  a.trap = nview(f.trap), a.segsum = nview(f.segsum), a.d = nview(f.d);
  a.norm_weight = nview(f.norm_weight);
  double* ws = static_cast<double*>(workspace);
  a.states = ws;
  a.part = ws + f.B * f.H * f.nchunks * f.N * f.P;
  a.tile = ndd::readout_smem(a, 16) <= kNormDdMaxSmem ? 16 : 8;
  a.fast = ndd::fast_ok(a, kNormDdMaxSmem);
  return a;
}

}  // namespace

size_t norm_dd_f64_workspace_bytes(const MimoBwdFwdParams& f) {
  return sizeof(double) * static_cast<size_t>(f.B * f.H * f.nchunks * (f.N * f.P + 1));
}

void norm_dd_f64(const MimoBwdFwdParams& f, void* workspace, const TensorView& dd,
                 cudaStream_t st) {
  ndd::Args a = norm_dd_f64_args(f, workspace);
  a.dd = static_cast<unsigned char*>(dd.data);
  a.dd_dt = static_cast<int>(dd.dtype);
  a.dd_s = dd.strides[0];
  const int64_t BH = f.B * f.H;
  if (a.fast) {  // the whole-chunk kernels (fast_ok: the smem limit is checked there)
    const size_t inc_smem = ndd::fast_increment_smem(a), rd_smem = ndd::fast_readout_smem(a);
    const bool two_blocks = 2 * (rd_smem + kBlockReservedSmem) <= kSmSmem;
    ndd::with_act_dtype(a, [&](auto da) {
      constexpr int DA = decltype(da)::value;
      const auto readout = two_blocks ? &ndd_readout_fast_kernel<DA, 2>
                                      : &ndd_readout_fast_kernel<DA, 1>;
      set_smem(reinterpret_cast<const void*>(&ndd_increment_fast_kernel<DA>), f.device_id,
               inc_smem, "mimo_bwd_combined: float64 dD increment kernel smem");
      set_smem(reinterpret_cast<const void*>(readout), f.device_id, rd_smem,
               "mimo_bwd_combined: float64 dD readout kernel smem");
      if (f.nchunks > 1) {
        ndd_increment_fast_kernel<DA><<<grid_of(BH * (f.nchunks - 1)), kThreads, inc_smem, st>>>(a);
        check_launch("mimo_bwd_combined: float64 dD increment kernel");
      }
      ndd_scan_kernel<<<grid_of(BH * ((f.N * f.P + kThreads - 1) / kThreads)), kThreads, 0, st>>>(
          a);
      check_launch("mimo_bwd_combined: float64 dD scan kernel");
      readout<<<grid_of(BH * f.nchunks), kThreads, rd_smem, st>>>(a);
      check_launch("mimo_bwd_combined: float64 dD readout kernel");
    });
  } else {
    const size_t inc_smem = ndd::increment_smem(a), rd_smem = ndd::readout_smem(a, a.tile);
    if (inc_smem > kNormDdMaxSmem || rd_smem > kNormDdMaxSmem)  // (not reached: N, P <= 256)
      MAMBA3_FAIL(MAMBA3_ERROR_UNSUPPORTED, "mimo_bwd_combined: the float64 dD kernels need ",
                  inc_smem, " / ", rd_smem, " bytes of shared memory (at most ", kNormDdMaxSmem,
                  ")");
    set_smem(reinterpret_cast<const void*>(&ndd_increment_kernel), f.device_id, inc_smem,
             "mimo_bwd_combined: float64 dD increment kernel smem");
    set_smem(reinterpret_cast<const void*>(&ndd_readout_kernel), f.device_id, rd_smem,
             "mimo_bwd_combined: float64 dD readout kernel smem");
    if (f.nchunks > 1) {
      ndd_increment_kernel<<<grid_of(BH * (f.nchunks - 1) * ndd::slabs(a)), kThreads, inc_smem,
                             st>>>(a);
      check_launch("mimo_bwd_combined: float64 dD increment kernel");
    }
    ndd_scan_kernel<<<grid_of(BH * ((f.N * f.P + kThreads - 1) / kThreads)), kThreads, 0, st>>>(a);
    check_launch("mimo_bwd_combined: float64 dD scan kernel");
    ndd_readout_kernel<<<grid_of(BH * f.nchunks), kThreads, rd_smem, st>>>(a);
    check_launch("mimo_bwd_combined: float64 dD readout kernel");
  }
  ndd_final_kernel<<<grid_of((f.H + kThreads - 1) / kThreads), kThreads, 0, st>>>(a);
  check_launch("mimo_bwd_combined: float64 dD final kernel");
}

}  // namespace mamba3::cuda
