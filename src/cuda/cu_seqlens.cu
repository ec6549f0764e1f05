#include <vector>

#include "core/check.hpp"
#include "cuda/common.cuh"
#include "cuda/cu_seqlens.cuh"

namespace mamba3::cuda {

void validate_cu_seqlens(const TensorView& cu, int64_t total, cudaStream_t stream) {
  if (stream_capturing(stream)) return;  // trusted under graph capture (see the header)
  const int64_t n = cu.shape[0];
  const int64_t es = dtype_size(cu.dtype);
  const int64_t stride = cu.strides[0];
  // Copy the contiguous byte range that holds all entries (a strided view copies its gaps too).
  const int64_t first = stride >= 0 ? 0 : (n - 1) * stride;
  const int64_t span = (n - 1) * (stride >= 0 ? stride : -stride) + 1;
  std::vector<unsigned char> host(static_cast<size_t>(span * es));
  const unsigned char* src = static_cast<const unsigned char*>(cu.data) + first * es;
  check_cuda(cudaMemcpyAsync(host.data(), src, host.size(), cudaMemcpyDeviceToHost, stream),
             "cu_seqlens: copying the values to the host for validation");
  check_cuda(cudaStreamSynchronize(stream), "cu_seqlens: synchronising for validation");
  TensorView hv = cu;
  hv.data = host.data() - first * es;  // same element addressing as on the device
  hv.device = DeviceKind::CPU;
  check_cu_seqlens_values_host(hv, total);
}

CuSeqlens make_cu_seqlens(const TensorView& cu) {
  CuSeqlens c;
  if (!cu.present()) return c;
  c.ptr = cu.data;
  c.stride = cu.strides[0];
  c.is64 = cu.dtype == DType::I64;
  c.n = static_cast<int>(cu.shape[0]);
  return c;
}

}  // namespace mamba3::cuda
