// The lean K3 of the first pass specialised to a shape of SPEC.md's grid and to the benchmark's
// contiguous layouts and dtypes (MbArgsCT<.., true>; see mimo_bwd_fwd_lean_specialized.cuh).
// Its own translation unit so that no TU compiles much longer than before.
#include "cuda/mimo_bwd_fwd_lean_specialized.cuh"

namespace mamba3::cuda::mimo {

// Which of these copies take k3_lean_body's fused build loads and the states copy from the hi
// plane (docs/PERF.md, session 19), checked where they are compiled.
static_assert(lean_fused_build_loads<MbArgsCT<128, 64, 4, 16, true>>(2) &&
              lean_fused_build_loads<MbArgsCT<128, 32, 4, 16, true>>(1) &&
              !lean_fused_build_loads<MbArgsCT<256, 64, 4, 8, true>>(4) &&
              !lean_fused_build_loads<MbArgsCT<64, 128, 4, 16, true>>(2) &&
              !lean_fused_build_loads<MbArgsCT<128, 64, 8, 8, true>>(2) &&
              !lean_fused_build_loads<MbArgsCT<128, 64, 4, 16>>(2) && !lean_fused_build_loads<MbArgs>(1));
static_assert(lean_states_from_planes<MbArgsCT<256, 64, 4, 8, true>>() &&
              !lean_states_from_planes<MbArgsCT<128, 32, 4, 16, true>>() &&
              !lean_states_from_planes<MbArgsCT<256, 64, 4, 8>>() && !lean_states_from_planes<MbArgs>());

bool lean_specialized_layout_k3(const MbArgs& a, int nt, int st, LeanLaunch* k3) {
  // The shapes of mimo_bwd_fwd_specialized_{a,b}.cu.
  return lean_specialized_layout_shape<16, 64, 4, 8>(a, nt, st, k3) ||
         lean_specialized_layout_shape<32, 64, 4, 16>(a, nt, st, k3) ||
         lean_specialized_layout_shape<64, 64, 4, 16>(a, nt, st, k3) ||
         lean_specialized_layout_shape<128, 64, 4, 16>(a, nt, st, k3) ||
         lean_specialized_layout_shape<256, 64, 4, 8>(a, nt, st, k3) ||
         lean_specialized_layout_shape<64, 128, 4, 16>(a, nt, st, k3) ||
         lean_specialized_layout_shape<128, 32, 4, 16>(a, nt, st, k3) ||
         lean_specialized_layout_shape<128, 128, 4, 8>(a, nt, st, k3) ||
         lean_specialized_layout_shape<128, 64, 8, 8>(a, nt, st, k3) ||
         lean_specialized_layout_shape<128, 64, 2, 32>(a, nt, st, k3) ||
         lean_specialized_layout_shape<128, 64, 1, 64>(a, nt, st, k3);
}

}  // namespace mamba3::cuda::mimo
