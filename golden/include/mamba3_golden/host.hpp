// Host-side helpers shared by the tests and the self-check: deterministic random data, rounding
// to the I/O dtypes (fp16 / bf16 / fp32), byte buffers exposed as DLTensors, and the accuracy
// metrics and pass rule of SPEC.md section 3.
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include <dlpack/dlpack.h>

namespace mamba3::golden {

enum class IoType { F16, BF16, F32, F64, I32, I64 };
const char* io_name(IoType t);
int io_size(IoType t);
DLDataType io_dl(IoType t);

// Round a double to the nearest value representable in `t` (round-to-nearest-even), returned
// as double. Used so that the golden sees exactly the already-rounded inputs.
double round_to(double x, IoType t);
void encode(double x, IoType t, void* dst);  // stores round_to(x, t) in t's bit layout
double decode(const void* src, IoType t);

// A contiguous host buffer of one dtype plus a DLTensor describing it (optionally with custom
// strides over a larger allocation, to test non-contiguous inputs).
struct Buffer {
  IoType type = IoType::F32;
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;  // elements
  std::vector<unsigned char> bytes;
  DLTensor dl{};

  Buffer() = default;
  Buffer(IoType t, std::vector<int64_t> shape);  // compact, poisoned with NaN / 0x7f bytes
  // A view with the same logical shape whose innermost dimension is padded by `pad` elements
  // (so the tensor is not contiguous). Values are copied.
  Buffer padded(int64_t pad) const;
  int64_t numel() const;
  int64_t offset(const std::vector<int64_t>& idx) const;
  double get(int64_t flat) const;  // logical row-major flat index
  void set(int64_t flat, double v);
  std::vector<double> to_double() const;  // logical row-major
  static Buffer from_double(IoType t, std::vector<int64_t> shape, const std::vector<double>& v);
  void poison();                          // NaN for floats, 0x7f.. for ints
  DLTensor* tensor();                     // refreshes and returns dl (CPU device)
  Buffer(const Buffer&);
  Buffer& operator=(const Buffer&);
};

// Deterministic generator: uniform in [lo, hi), rounded to `t`.
std::vector<double> uniform(std::mt19937_64& rng, int64_t n, double lo, double hi, IoType t);

// SPEC.md section 3 metrics.
struct Accuracy {
  double rel_l2 = 0;      // ||cand - gold|| / ||gold||
  double max_rel = 0;     // max|cand - gold| / max|gold|
  double ref_rel_l2 = 0;  // the same metric for the float32 reference (dual benchmark)
  double ref_max_rel = 0;
  bool finite = true;
  bool pass = false;
  std::string metric;  // "rel_l2" or "max_rel" (outputs nearly zero by construction)
  double value() const { return metric == "max_rel" ? max_rel : rel_l2; }
  double ref_value() const { return metric == "max_rel" ? ref_max_rel : ref_rel_l2; }
};

// Tolerance for an output computed from inputs of I/O dtype `t`: 1e-5 fp32, 2e-3 fp16, 1e-2 bf16.
double tolerance_for(IoType t);
// Errors at or below this are rounding noise: max(tol/100, 4 float32 ulps = 4.8e-7).
double noise_floor(double tol);
// Compare a candidate with the float64 golden and the float32 reference (the same golden run in
// float on the same rounded inputs, its outputs rounded to the candidate's output dtype). Pass
// when the metric is <= tolerance_for(io) AND (<= 2 * the reference's error OR <= noise_floor(tol),
// where the reference happens to be nearly exact); NaN/Inf never pass.
Accuracy compare(const std::vector<double>& cand, const std::vector<double>& gold,
                 const std::vector<double>& ref32, IoType io, bool near_zero = false);

}  // namespace mamba3::golden
