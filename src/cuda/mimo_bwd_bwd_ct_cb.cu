// The planes K1, K3 and the state chain of mimo_bwd_bwd specialised to the grid's shapes and
// the combined backward's contiguous layouts (kCtCombined: fp32 states, qk_dot, dq, dk; the Z
// gate; see mimo_bwd_bwd_ct.cuh).
#include "cuda/mimo_bwd_bwd_ct.cuh"

namespace mamba3::cuda::bb {

PlanesKernel ct_k1_combined(const Args& a) { return ct_k1_of<kCtCombined>(a); }
PlanesKernel ct_k3_combined(const Args& a) { return ct_k3_of<kCtCombined>(a); }
ChainKernel ct_chain_combined(const Args& a) { return ct_chain_of<kCtCombined>(a); }

}  // namespace mamba3::cuda::bb
