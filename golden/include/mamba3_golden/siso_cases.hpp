// Test/self-check harness for the SISO backward operators: one "case" = sizes + dtypes + options.
// run_*_case() draws deterministic random inputs rounded to the case's dtypes, computes the float64
// golden and the float32 reference from exactly those rounded values, runs the operator through the
// public C API on the chosen device with NaN-poisoned outputs, and compares every output with the
// SPEC.md section 3 rule. Used by the GoogleTest suites (CPU and CUDA) and by mamba3-selfcheck.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "mamba3_golden/host.hpp"

namespace mamba3::golden {

enum class Device { CPU, CUDA };
const char* device_name(Device d);
// True when this build has the CUDA runtime linked and a CUDA device is present.
bool cuda_available();

struct DqkthetaCase {
  int64_t B = 1, S = 64, G = 1, H = 1, N = 64, A = 32, chunk = 64;
  IoType qk = IoType::F32;     // q, k, q_bias, k_bias
  IoType grad = IoType::F32;   // dq_in, dk_in (and so dq, dk)
  IoType small = IoType::F32;  // scale, gamma, dqk, angles, d_ok_state (and dangles/dscale/dgamma)
  std::vector<int64_t> seqlens;  // varlen lengths (then B must be 1 and their sum is S)
  bool dok = false;              // pass d_ok_state
  int64_t pad = 0;               // pad the innermost dim of every input (non-contiguous views)
  uint64_t seed = 1;
  std::string describe() const;  // e.g. "B2 S64 G1 H4 N64 A32 C64 bf16/bf16/f32 dok varlen[3,61]"
};

struct DdtCase {
  int64_t B = 1, H = 1, S = 64, N = 16, P = 8;
  IoType io = IoType::F32;        // dscale, dgamma, dt, trap
  IoType state_io = IoType::F32;  // d_issm_state, input_k_state, input_v_state
  std::vector<int64_t> seqlens;
  bool states = false;
  int64_t pad = 0;
  uint64_t seed = 1;
  std::string describe() const;
};

struct OutputReport {
  std::string name;
  std::string dtype;
  Accuracy acc;
};

struct CaseReport {
  std::string op;
  std::string case_name;
  std::string dtype;  // the case's main I/O dtype
  Device device = Device::CPU;
  std::vector<OutputReport> outputs;
  std::string error;   // non-empty when the call itself failed (status + mamba3_last_error())
  double time_ms = 0;  // one call (CUDA: device time of the launch, events; CPU: wall clock)
  bool pass() const;
  std::string first_failure() const;  // human-readable, for test messages
};

// Runs the case `repeats` times and also checks that all runs are bitwise identical (recorded as
// an extra output row "bitwise_repeat" when repeats > 1).
CaseReport run_dqktheta_case(const DqkthetaCase& c, Device dev, int repeats = 1);
CaseReport run_ddt_case(const DdtCase& c, Device dev, int repeats = 1);

}  // namespace mamba3::golden
