// Pieces shared by the operator case harnesses (golden/src/*_cases.cpp): operands uploaded to the
// chosen device, a launch context (stream, workspace, timing), NaN-poisoned outputs, and the
// comparison of one output with the float64 golden and the float32 reference.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "mamba3/mamba3.h"
#include "mamba3_golden/host.hpp"
#include "mamba3_golden/siso_cases.hpp"

#ifdef MAMBA3_GOLDEN_CUDA
#include <cuda_runtime.h>
#endif

namespace mamba3::golden::cases {

#ifdef MAMBA3_GOLDEN_CUDA
inline void cuda_ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}
#endif

// One operand as the operator sees it: the host Buffer (source of truth for values and the
// place results are downloaded to) plus, on CUDA, a device copy with the same byte layout.
class Operand {
 public:
  Operand(Buffer* host, Device dev) : host_(host), dev_(dev) {
    dl_ = *host_->tensor();
#ifdef MAMBA3_GOLDEN_CUDA
    if (dev_ == Device::CUDA) {
      const size_t n = host_->bytes.size();
      cuda_ok(cudaMalloc(&dptr_, n ? n : 1), "cudaMalloc");
      cuda_ok(cudaMemcpy(dptr_, host_->bytes.data(), n, cudaMemcpyHostToDevice), "upload");
      dl_.data = dptr_;
      dl_.device = DLDevice{kDLCUDA, 0};
    }
#endif
  }
  ~Operand() {
#ifdef MAMBA3_GOLDEN_CUDA
    if (dptr_) cudaFree(dptr_);
#endif
  }
  Operand(const Operand&) = delete;
  Operand& operator=(const Operand&) = delete;
  DLTensor* dl() { return &dl_; }
  void download() {
#ifdef MAMBA3_GOLDEN_CUDA
    if (dev_ == Device::CUDA)
      cuda_ok(cudaMemcpy(host_->bytes.data(), dptr_, host_->bytes.size(), cudaMemcpyDeviceToHost),
              "download");
#endif
  }

 private:
  Buffer* host_;
  Device dev_;
  DLTensor dl_{};
  void* dptr_ = nullptr;
};

// Device scratch (workspace, stream) for one call.
struct Launch {
  Device dev;
  void* stream = nullptr;
  void* workspace = nullptr;
  explicit Launch(Device d) : dev(d) {
#ifdef MAMBA3_GOLDEN_CUDA
    if (dev == Device::CUDA) {
      cudaStream_t s;
      cuda_ok(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
      stream = s;
    }
#endif
  }
  void alloc_workspace(size_t bytes) {
#ifdef MAMBA3_GOLDEN_CUDA
    if (dev == Device::CUDA && bytes) cuda_ok(cudaMalloc(&workspace, bytes), "cudaMalloc workspace");
#else
    (void)bytes;
#endif
  }
  ~Launch() {
#ifdef MAMBA3_GOLDEN_CUDA
    if (workspace) cudaFree(workspace);
    if (stream) cudaStreamDestroy(static_cast<cudaStream_t>(stream));
#endif
  }
  // Runs f() and returns its time in ms (device events on CUDA, wall clock on CPU).
  template <class F>
  double timed(F&& f) {
#ifdef MAMBA3_GOLDEN_CUDA
    if (dev == Device::CUDA) {
      cudaEvent_t a, b;
      cuda_ok(cudaEventCreate(&a), "event");
      cuda_ok(cudaEventCreate(&b), "event");
      auto s = static_cast<cudaStream_t>(stream);
      cuda_ok(cudaEventRecord(a, s), "event record");
      f();
      cuda_ok(cudaEventRecord(b, s), "event record");
      cuda_ok(cudaStreamSynchronize(s), "stream sync");
      float ms = 0;
      cuda_ok(cudaEventElapsedTime(&ms, a, b), "elapsed");
      cudaEventDestroy(a);
      cudaEventDestroy(b);
      return ms;
    }
#endif
    auto t0 = std::chrono::steady_clock::now();
    f();
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  }
};

// Input of the operator: values drawn, rounded to `t`, stored (optionally padded).
inline Buffer make_input(std::mt19937_64& rng, IoType t, std::vector<int64_t> shape, double lo,
                         double hi, int64_t pad) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  Buffer b = Buffer::from_double(t, shape, uniform(rng, n, lo, hi, t));
  return pad > 0 ? b.padded(pad) : b;
}

inline Buffer make_output(IoType t, std::vector<int64_t> shape) {
  Buffer b(t, std::move(shape));
  b.poison();
  return b;
}

template <class T>
std::vector<T> cast(const std::vector<double>& v) {
  return std::vector<T>(v.begin(), v.end());
}

// Rounds the float32 reference's outputs to the candidate's output dtype (fair dual benchmark).
inline std::vector<double> ref_as(const std::vector<float>& v, IoType t) {
  std::vector<double> r(v.size());
  for (size_t i = 0; i < v.size(); ++i) r[i] = round_to(static_cast<double>(v[i]), t);
  return r;
}

inline void add_output(CaseReport& rep, const char* name, const Buffer& cand,
                       const std::vector<double>& gold, const std::vector<float>& ref, IoType io,
                       bool near_zero = false) {
  OutputReport o;
  o.name = name;
  o.dtype = io_name(cand.type);
  o.acc = compare(cand.to_double(), gold, ref_as(ref, cand.type), io, near_zero);
  rep.outputs.push_back(o);
}

inline void add_bitwise(CaseReport& rep, bool identical) {
  OutputReport o;
  o.name = "bitwise_repeat";
  o.dtype = "-";
  o.acc.metric = "identical";
  o.acc.pass = identical;
  o.acc.finite = true;
  rep.outputs.push_back(o);
}

inline std::string status_message(mamba3_status st) {
  return "status " + std::to_string(static_cast<int>(st)) + ": " + mamba3_last_error();
}

// The strictest (smallest-tolerance) I/O dtype among those that feed an output decides its
// tolerance: an fp32 output computed from bf16 inputs is judged at the bf16 tolerance.
inline IoType loosest(IoType a, IoType b) {
  auto rank = [](IoType t) { return t == IoType::BF16 ? 2 : t == IoType::F16 ? 1 : 0; };
  return rank(a) >= rank(b) ? a : b;
}

}  // namespace mamba3::golden::cases
