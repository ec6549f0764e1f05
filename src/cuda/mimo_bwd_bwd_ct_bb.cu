// The planes K1, K3 and the state chain of mimo_bwd_bwd specialised to the grid's shapes and
// the benchmark's contiguous layouts (kCtBwdBwd; see mimo_bwd_bwd_ct.cuh).
#include "cuda/mimo_bwd_bwd_ct.cuh"

namespace mamba3::cuda::bb {

PlanesKernel ct_k1_bwd_bwd(const Args& a) { return ct_k1_of<kCtBwdBwd>(a); }
PlanesKernel ct_k3_bwd_bwd(const Args& a) { return ct_k3_of<kCtBwdBwd>(a); }
ChainKernel ct_chain_bwd_bwd(const Args& a) { return ct_chain_of<kCtBwdBwd>(a); }

}  // namespace mamba3::cuda::bb
