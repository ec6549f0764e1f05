// The planes K1 and K3 of mimo_bwd_bwd specialised to the grid's shapes only (kCtShape; see
// mimo_bwd_bwd_ct.cuh).
#include "cuda/mimo_bwd_bwd_ct.cuh"

namespace mamba3::cuda::bb {

PlanesKernel ct_k1_shape(const Args& a) { return ct_k1_of<kCtShape>(a); }
PlanesKernel ct_k3_shape(const Args& a) { return ct_k3_of<kCtShape>(a); }

}  // namespace mamba3::cuda::bb
