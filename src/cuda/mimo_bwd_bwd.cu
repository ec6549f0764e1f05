// CUDA backend of mamba3_mimo_bwd_bwd (seed 001): host entry points and kernel launches. The
// design (four kernels, workspace layout) is described in mimo_bwd_bwd_kernels.cuh, which holds
// the kernel bodies and the launch plan.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "core/error.hpp"
#include "cuda/common.cuh"
#include "cuda/mimo_bwd.hpp"
#include "cuda/mimo_bwd_bwd_chunk_planes.cuh"
#include "cuda/mimo_bwd_bwd_ct.cuh"
#include "cuda/mimo_bwd_bwd_kernels.cuh"

namespace mamba3::cuda {
namespace {

using bb::Args;
using bb::kThreads;

__global__ void __launch_bounds__(kThreads) bb_increment_kernel(const __grid_constant__ Args a) {
  extern __shared__ float smem[];
  bb::increment_body(a, smem);
}

// 4 CTAs per SM (<= 64 registers, no spills; ~53 KB of shared memory each at N128 P64 R4 C16).
__global__ void __launch_bounds__(bb::kIncPlanesThreads, bb::kIncPlanesMinBlocks)
    bb_increment_planes_kernel(const __grid_constant__ Args a) {
  extern __shared__ __align__(16) unsigned char inc_planes_smem[];
  bb::increment_planes_body(a, inc_planes_smem);
}

__global__ void __launch_bounds__(kThreads) bb_angle_table_kernel(const __grid_constant__ Args a) {
  bb::angle_table_body(a);
}

__global__ void __launch_bounds__(kThreads) bb_scan_kernel(const __grid_constant__ Args a) {
  bb::scan_body(a);
}

// 3 CTAs per SM (<= 85 registers; a few bytes spill): latency-bound, it gains more from the
// extra resident warps (11.5 vs 14.5 ms at N128 P64 R4 C16 on an H200) than the spill costs.
__global__ void __launch_bounds__(kThreads, 3) bb_chunk_kernel(const __grid_constant__ Args a) {
  __shared__ bb::ChunkShared sh;
  bb::chunk_body(a, sh);
}

// One CTA per SM: its planes take most of the shared memory.
__global__ void __launch_bounds__(bb::kPlanesThreads, 1)
    bb_chunk_planes_kernel(const __grid_constant__ Args a) {
  extern __shared__ __align__(16) unsigned char planes_smem[];
  bb::chunk_planes_body(a, planes_smem);
}

__global__ void __launch_bounds__(kThreads) bb_reduce_kernel(const __grid_constant__ Args a) {
  bb::reduce_body(a);
}

// ---- The planes K1 and K3 specialised to one shape (bb::ArgsCT, in
// mimo_bwd_bwd_chunk_planes.cuh so that the host-emulated tests run the same bodies), compiled
// in mimo_bwd_bwd_ct_{shape,bb,cb}.cu (mimo_bwd_bwd_ct.cuh) for the shapes of SPEC.md's
// benchmark grid only; every other shape runs the generic kernels. MAMBA3_BB_SPECIALIZED=0
// forces the generic ones for both.
using bb::PlanesKernel;
struct PlanesKernels {
  PlanesKernel k1, k3;
};

// The generic kernels.
PlanesKernel generic_k1() {
  return {reinterpret_cast<const void*>(bb_increment_planes_kernel),
          [](const Args& a, unsigned grid, int nt, int smem, cudaStream_t st) {
            bb_increment_planes_kernel<<<grid, nt, smem, st>>>(a);
          }};
}
PlanesKernel generic_k3() {
  return {reinterpret_cast<const void*>(bb_chunk_planes_kernel),
          [](const Args& a, unsigned grid, int nt, int smem, cudaStream_t st) {
            bb_chunk_planes_kernel<<<grid, nt, smem, st>>>(a);
          }};
}

// The kernels bb::k3_kind picks, K1 of the same kind (MAMBA3_BB_SPECIALIZED=0 forces the
// generic ones for both; K1 is generic at N16, see bb::ct_k1_entry). The K3 of the combined
// backward's operands does the q / k group sums where bb::ct_qk_group says so: there only when
// asked (Args::qk_group), else that shape's shape-only K3.
PlanesKernels planes_kernels(const Args& a) {
  PlanesKernels pk{generic_k1(), generic_k3()}, ct;
  switch (bb::k3_kind(a)) {
    case bb::K3Kind::kGeneric:
      return pk;
    case bb::K3Kind::kShape:
      ct = {bb::ct_k1_shape(a), bb::ct_k3_shape(a)};
      break;
    case bb::K3Kind::kShapeLayout:
      ct = {bb::ct_k1_bwd_bwd(a), bb::ct_k3_bwd_bwd(a)};
      break;
    case bb::K3Kind::kShapeLayoutCombined:
      ct = {bb::ct_k1_combined(a), a.qk_group || !bb::ct_qk_group(a.N) ? bb::ct_k3_combined(a)
                                                                         : bb::ct_k3_shape(a)};
      break;
  }
  if (ct.k1.kernel) pk.k1 = ct.k1;
  if (ct.k3.kernel) pk.k3 = ct.k3;
  return pk;
}

// The state chain kernel replacing K1 + K2 where one exists (the contiguous-layout sets of the
// specialised shapes, more than one chunk; MAMBA3_BB_CHAIN=0: never), else {}.
bb::ChainKernel chain_kernel(const Args& a, const bb::Plan& pl) {
  if (!pl.planes || pl.grid1 == 0 || !bb::chain_allowed_by_env()) return {};
  switch (bb::k3_kind(a)) {
    case bb::K3Kind::kShapeLayout:
      return bb::ct_chain_bwd_bwd(a);
    case bb::K3Kind::kShapeLayoutCombined:
      return bb::ct_chain_combined(a);
    default:
      return {};
  }
}

bool qk_group_allowed_by_env() {
  const char* e = std::getenv("MAMBA3_CB_QK_GROUP");
  return e == nullptr || e[0] != '0';
}

}  // namespace

size_t mimo_bwd_bwd_workspace_bytes(const MimoBwdBwdParams& p) { return bb::make_plan(p).bytes; }

void mimo_bwd_bwd(const MimoBwdBwdParams& p, void* workspace, size_t workspace_bytes,
                  void* stream) {
  mimo_bwd_bwd(p, workspace, workspace_bytes, stream, nullptr);
}

bool mimo_bwd_bwd(const MimoBwdBwdParams& p, void* workspace, size_t workspace_bytes,
                  void* stream, const QkGroupOut* group) {
  const bb::Plan pl = bb::make_plan(p);
  MAMBA3_CHECK_ARG(workspace != nullptr && workspace_bytes >= pl.bytes, "workspace: ",
                   workspace_bytes, " bytes at ", workspace, " given, mimo_bwd_bwd needs ",
                   pl.bytes, " bytes of device memory (see mamba3_mimo_bwd_bwd_workspace_size)");
  for (const TensorView* t :
       {&p.dout, &p.q, &p.k, &p.v, &p.q_bias, &p.k_bias, &p.mimo_v, &p.states, &p.qk_dot,
        &p.da_cs, &p.da_cs_rev, &p.dt, &p.trap, &p.segsum, &p.angles, &p.mimo_o, &p.d, &p.dq,
        &p.dk, &p.dv, &p.dmimo_v, &p.dangles, &p.dfactor, &p.dgamma, &p.dda, &p.dssda,
        &p.dda_cs_rev, &p.dda_cs, &p.dd})
    check_element_aligned(*t);
  DeviceGuard guard(p.device_id);
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  Args a = bb::make_args(p, pl, workspace);
  if (group != nullptr && qk_group_allowed_by_env())
    bb::set_qk_group(a, group->dq, group->dk, group->part);
  const DeviceProps& dev = device_props(p.device_id);
  // Checked before anything is launched (the plan, like the workspace query, knows no device).
  if (pl.planes && static_cast<int64_t>(dev.smem_optin) < pl.ply.bytes)
    MAMBA3_FAIL(MAMBA3_ERROR_UNSUPPORTED, "mimo_bwd_bwd: the chunk kernel needs ", pl.ply.bytes,
                " bytes of shared memory per block, this device allows ", dev.smem_optin,
                " (MAMBA3_BB_PLANES=0 selects the kernel that needs less)");

  const PlanesKernels pk = pl.planes ? planes_kernels(a) : PlanesKernels{};
  if (pl.grid_cs > 0) {
    bb_angle_table_kernel<<<static_cast<unsigned>(pl.grid_cs), kThreads, 0, st>>>(a);
    check_launch("mimo_bwd_bwd: angle table kernel");
  }
  const bb::ChainKernel ck = chain_kernel(a, pl);
  if (ck.k.kernel) {
    // K1 and K2 in one: dS_c straight into the slab.
    set_smem(ck.k.kernel, p.device_id, static_cast<size_t>(ck.smem),
             "mimo_bwd_bwd: cudaFuncSetAttribute(state chain kernel)");
    ck.k.launch(a, static_cast<unsigned>(int64_t{a.B} * a.H * ck.per_bh), bb::kChainThreads,
                ck.smem, st);
    check_launch("mimo_bwd_bwd: state chain kernel");
  } else if (pl.grid1 > 0 && pl.planes) {
    set_smem(pk.k1.kernel, p.device_id, pl.ply.inc_bytes,
             "mimo_bwd_bwd: cudaFuncSetAttribute(planes increment kernel)");
    pk.k1.launch(a, static_cast<unsigned>(pl.grid1), bb::kIncPlanesThreads,
                 static_cast<int>(pl.ply.inc_bytes), st);
    check_launch("mimo_bwd_bwd: planes state increment kernel");
  } else if (pl.grid1 > 0) {
    bb_increment_kernel<<<static_cast<unsigned>(pl.grid1), kThreads, pl.smem1, st>>>(a);
    check_launch("mimo_bwd_bwd: state increment kernel");
  }
  if (!ck.k.kernel) {
    bb_scan_kernel<<<static_cast<unsigned>(pl.grid2), kThreads, 0, st>>>(a);
    check_launch("mimo_bwd_bwd: dstate scan kernel");
  }
  bool grouped = false;  // K3 did the q / k group sums
  if (pl.planes) {
    const int smem = static_cast<int>(pl.ply.bytes);
    // One CTA per SM (its shared memory), grid-stride over the chunks.
    const int64_t grid = std::min<int64_t>(pl.grid3, dev.sms);
    set_smem(pk.k3.kernel, p.device_id, pl.ply.bytes,
             "mimo_bwd_bwd: cudaFuncSetAttribute(planes chunk kernel)");
    pk.k3.launch(a, static_cast<unsigned>(grid), bb::kPlanesThreads, smem, st);
    check_launch("mimo_bwd_bwd: planes chunk kernel");
    // (planes_kernels takes that kernel only where k3_kind picks the combined layouts.)
    grouped = a.qk_group && bb::ct_qk_group(a.N) && pk.k3.kernel == bb::ct_k3_combined(a).kernel;
  } else {
    bb_chunk_kernel<<<static_cast<unsigned>(pl.grid3), kThreads, 0, st>>>(a);
    check_launch("mimo_bwd_bwd: chunk kernel");
  }
  bb_reduce_kernel<<<static_cast<unsigned>(pl.grid4), kThreads, 0, st>>>(a);
  check_launch("mimo_bwd_bwd: partials reduction kernel");
  return grouped;
}

}  // namespace mamba3::cuda
