// Shape-specialised lean kernels of the first pass, second half of SPEC.md's grid (see
// mimo_bwd_fwd_lean_specialized.cuh).
#include "cuda/mimo_bwd_fwd_lean_specialized.cuh"

namespace mamba3::cuda::mimo {

bool lean_specialized_b(const MbArgs& a, int nt, int st, LeanPair* out) {
  return lean_specialized_shape<128, 32, 4, 16>(a, nt, st, out) ||
         lean_specialized_shape<128, 128, 4, 8>(a, nt, st, out) ||
         lean_specialized_shape<128, 64, 8, 8>(a, nt, st, out) ||
         lean_specialized_shape<128, 64, 2, 32>(a, nt, st, out) ||
         // Left out until session 16: its dmimo_o, dmimo_z, dnorm_weight (and a few bf16 dz)
         // differed in their last bits from the generic kernels' on the H200 (docs/PERF.md,
         // session 10), an FMA contraction of the scores' diagonal that R = 1 as a constant
         // allowed; lean_scores now rounds that product first (mb_fmul_rn).
         lean_specialized_shape<128, 64, 1, 64>(a, nt, st, out);
}

}  // namespace mamba3::cuda::mimo
