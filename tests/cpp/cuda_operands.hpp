// Device-side operands for the CUDA suites that call the C API directly
// (test_mimo_bwd_{fwd,bwd}_cuda.cpp): a host Buffer uploaded behind an optional byte offset,
// random buffers, and the reversed-dimension layout used by the stride tests. Only in builds
// with the CUDA golden harness (MAMBA3_GOLDEN_CUDA).
#pragma once

#ifdef MAMBA3_GOLDEN_CUDA

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "mamba3/mamba3.h"
#include "mamba3_golden/host.hpp"

namespace mamba3::test::cuda_ops {

using golden::Buffer;
using golden::IoType;
using golden::io_size;
using golden::uniform;

inline void ck(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

// A host Buffer's bytes on the device, described by a DLTensor with the Buffer's shape and
// strides, optionally behind a byte offset of `offset_elems` elements.
struct Dev {
  Buffer* host = nullptr;
  void* ptr = nullptr;
  size_t offset = 0;
  DLTensor dl{};
  Dev() = default;
  explicit Dev(Buffer* b, int64_t offset_elems = 0) : host(b) {
    if (!b || b->shape.empty()) {
      host = nullptr;
      return;
    }
    offset = static_cast<size_t>(offset_elems * io_size(b->type));
    ck(cudaMalloc(&ptr, b->bytes.size() + offset), "cudaMalloc");
    ck(cudaMemset(ptr, 0x7f, b->bytes.size() + offset), "cudaMemset");
    upload();
  }
  Dev(const Dev&) = delete;
  Dev& operator=(const Dev&) = delete;
  ~Dev() {
    if (ptr) cudaFree(ptr);
  }
  void upload() {
    ck(cudaMemcpy(static_cast<char*>(ptr) + offset, host->bytes.data(), host->bytes.size(),
                  cudaMemcpyHostToDevice),
       "upload");
  }
  std::vector<unsigned char> download() const {
    std::vector<unsigned char> out(host->bytes.size());
    ck(cudaMemcpy(out.data(), static_cast<char*>(ptr) + offset, out.size(),
                  cudaMemcpyDeviceToHost),
       "download");
    return out;
  }
  void poison() {
    if (host) ck(cudaMemset(ptr, 0xff, host->bytes.size() + offset), "poison");  // NaN
  }
  DLTensor* t() {
    if (!host) return nullptr;
    dl = *host->tensor();
    dl.data = ptr;
    dl.byte_offset = offset;
    dl.device = DLDevice{kDLCUDA, 0};
    return &dl;
  }
};

inline Buffer rand_buf(std::mt19937_64& rng, IoType t, std::vector<int64_t> shape, double lo, double hi) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return Buffer::from_double(t, std::move(shape), uniform(rng, n, lo, hi, t));
}

// The same buffer with its dimensions stored in reverse order (every stride differs from the
// compact one): values copied, compact_of() maps back.
inline Buffer reversed_layout(const Buffer& src) {
  Buffer b = src;
  const int nd = static_cast<int>(src.shape.size());
  std::vector<int64_t> strides(nd);
  int64_t s = 1;
  for (int d = 0; d < nd; ++d) strides[d] = s, s *= src.shape[d];
  b.strides = strides;
  b.bytes.assign(src.bytes.size(), 0x7f);
  const int es = io_size(src.type);
  for (int64_t i = 0; i < src.numel(); ++i) {
    int64_t flat = i, off = 0;
    for (int d = nd - 1; d >= 0; --d) off += (flat % src.shape[d]) * strides[d], flat /= src.shape[d];
    std::copy_n(src.bytes.data() + i * es, es, b.bytes.data() + off * es);
  }
  return b;
}

inline std::vector<unsigned char> compact_of(const Buffer& rev, const std::vector<unsigned char>& bytes) {
  const int nd = static_cast<int>(rev.shape.size());
  const int es = io_size(rev.type);
  std::vector<unsigned char> out(bytes.size());
  for (int64_t i = 0; i < rev.numel(); ++i) {
    int64_t flat = i, off = 0;
    for (int d = nd - 1; d >= 0; --d) off += (flat % rev.shape[d]) * rev.strides[d], flat /= rev.shape[d];
    std::copy_n(bytes.data() + off * es, es, out.data() + i * es);
  }
  return out;
}

// Captures call() (one operator call on `st`, returning its status) into a CUDA graph after
// poison() and replays the graph twice: every replay must leave results() bitwise equal to
// `eager` (no allocation, no host synchronisation inside the call).
template <class Call, class Poison, class Results, class R>
void expect_graph_replays_match(cudaStream_t st, Call call, Poison poison, Results results,
                                const R& eager) {
  poison();
  ck(cudaDeviceSynchronize(), "sync");
  cudaGraph_t graph;
  ck(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal), "begin capture");
  const mamba3_status s = call();
  const std::string err = mamba3_last_error();
  ck(cudaStreamEndCapture(st, &graph), "end capture");
  ASSERT_EQ(s, MAMBA3_OK) << err;
  cudaGraphExec_t exec;
  ck(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
  for (int rep = 0; rep < 2; ++rep) {
    ck(cudaGraphLaunch(exec, st), "graph launch");
    ck(cudaStreamSynchronize(st), "sync");
    EXPECT_TRUE(results() == eager) << "graph replay " << rep << " differs from the eager run";
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
}

// The results of one call of dev (poisoned outputs, default stream): as the library runs by
// default, then with environment switch `name` (read by the library at every call) set to "0".
// For the tests that require two code paths to give the same bits.
using OutputBytes = std::vector<std::vector<unsigned char>>;  // per output, row-major bytes
template <class Device>
std::pair<OutputBytes, OutputBytes> results_default_and_switched_off(Device& dev,
                                                                     const char* name) {
  auto run = [&] {
    dev.poison();
    const mamba3_status st = dev.call(nullptr, dev.ws_bytes);
    if (st != MAMBA3_OK) throw std::runtime_error(mamba3_last_error());
    ck(cudaDeviceSynchronize(), "sync");
    return dev.results();
  };
  OutputBytes on = run();
  setenv(name, "0", 1);
  OutputBytes off;
  try {
    off = run();
  } catch (...) {
    unsetenv(name);
    throw;
  }
  unsetenv(name);
  return {on, off};
}

}  // namespace mamba3::test::cuda_ops

#endif  // MAMBA3_GOLDEN_CUDA
