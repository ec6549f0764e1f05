// The planes K1 and K3 of mimo_bwd_bwd specialised to the grid's shapes only (K3: kCtShape; see
// mimo_bwd_bwd_ct.cuh).
#include "cuda/mimo_bwd_bwd_ct.cuh"

namespace mamba3::cuda::bb {

PlanesKernel ct_k1(const Args& a) {
#define MAMBA3_BB_CT_K1(n, p, r, c)                                   \
  if (a.N == n && a.P == p && a.R == r && a.C == c && a.A == n / 4) \
    return ct_k1_entry<n, p, r, c>();
  MAMBA3_BB_CT_SHAPES(MAMBA3_BB_CT_K1)
#undef MAMBA3_BB_CT_K1
  return {};
}

PlanesKernel ct_k3_shape(const Args& a) { return ct_k3_of<kCtShape>(a); }

}  // namespace mamba3::cuda::bb
