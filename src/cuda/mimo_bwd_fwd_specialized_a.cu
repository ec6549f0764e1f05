// Shape-specialised lean kernels of the first pass, first half of SPEC.md's grid (see
// mimo_bwd_fwd_lean_specialized.cuh).
#include "cuda/mimo_bwd_fwd_lean_specialized.cuh"

namespace mamba3::cuda::mimo {

bool lean_specialized_a(const MbArgs& a, int nt, int st, LeanPair* out) {
  return lean_specialized_shape<16, 64, 4, 8>(a, nt, st, out) ||
         lean_specialized_shape<32, 64, 4, 16>(a, nt, st, out) ||
         lean_specialized_shape<64, 64, 4, 16>(a, nt, st, out) ||
         lean_specialized_shape<128, 64, 4, 16>(a, nt, st, out) ||
         lean_specialized_shape<256, 64, 4, 8>(a, nt, st, out) ||
         lean_specialized_shape<64, 128, 4, 16>(a, nt, st, out);
}

}  // namespace mamba3::cuda::mimo
