// mamba3-selfcheck: runs every operator on representative cases on the default device (CUDA when
// this build has it and a GPU is present, else CPU), compares every output with the float64
// golden and the float32 reference (SPEC.md section 3), prints a Markdown table and exits
// non-zero on any failure. Later operators add their cases here.
//
//   mamba3-selfcheck [--device cpu|cuda] [--quick] [--output report.md]
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "mamba3/mamba3.h"
#include "mamba3_golden/mimo_cases.hpp"
#include "mamba3_golden/siso_cases.hpp"

using namespace mamba3::golden;

namespace {

std::vector<DqkthetaCase> dqktheta_cases(bool quick) {
  std::vector<DqkthetaCase> v;
  auto add = [&](int64_t B, int64_t S, int64_t G, int64_t H, int64_t N, int64_t A, IoType t) {
    DqkthetaCase c;
    c.B = B, c.S = S, c.G = G, c.H = H, c.N = N, c.A = A;
    c.qk = c.grad = t;
    c.seed = v.size() + 1;
    v.push_back(c);
    return &v.back();
  };
  add(2, 100, 1, 4, 64, 16, IoType::F32);
  add(2, 100, 2, 4, 128, 64, IoType::BF16)->dok = true;
  add(1, 64, 1, 2, 256, 64, IoType::F16);
  if (!quick) {
    add(1, 17, 1, 1, 16, 8, IoType::F32);
    DqkthetaCase* c = add(1, 100, 1, 4, 32, 8, IoType::BF16);
    c->seqlens = {1, 30, 69};
    c->dok = true;
    add(2, 256, 1, 4, 128, 32, IoType::F16)->chunk = 32;
    add(4, 2048, 1, 32, 128, 32, IoType::BF16);  // the SISO reference shape
  }
  return v;
}

std::vector<DdtCase> ddt_cases(bool quick) {
  std::vector<DdtCase> v;
  auto add = [&](int64_t B, int64_t H, int64_t S, IoType t, bool states) {
    DdtCase c;
    c.B = B, c.H = H, c.S = S, c.io = t, c.states = states;
    c.N = 32, c.P = 16;
    c.seed = v.size() + 1;
    v.push_back(c);
    return &v.back();
  };
  add(2, 4, 100, IoType::F32, false);
  add(2, 4, 100, IoType::F32, true);
  if (!quick) {
    add(1, 3, 77, IoType::BF16, true)->seqlens = {5, 1, 71};
    add(2, 2, 64, IoType::F16, true)->state_io = IoType::BF16;
    add(4, 32, 2048, IoType::F32, false);
  }
  return v;
}

std::vector<MimoBwdFwdCase> mimo_bwd_fwd_cases(bool quick) {
  std::vector<MimoBwdFwdCase> v;
  auto add = [&](int64_t B, int64_t S, int64_t H, int64_t G, int64_t N, int64_t P, int64_t R,
                 int64_t C, IoType act) {
    MimoBwdFwdCase c;
    c.B = B, c.S = S, c.H = H, c.G = G, c.N = N, c.P = P, c.R = R, c.chunk = C;
    c.act = c.out = act;
    c.seed = v.size() + 1;
    v.push_back(c);
    return &v.back();
  };
  add(1, 128, 2, 1, 64, 64, 4, 16, IoType::F32)->d = true;
  MimoBwdFwdCase* c = add(2, 100, 4, 2, 128, 64, 2, 32, IoType::BF16);  // GQA, tail, gate + D
  c->z = c->d = true;
  c = add(1, 50, 2, 1, 32, 128, 8, 8, IoType::F16);  // per-rank dout, gate, tail
  c->reduce_o = false, c->z = true, c->rdd = 2;
  if (!quick) {
    c = add(1, 200, 2, 1, 128, 32, 4, 16, IoType::BF16);  // fused pre-gate RMSNorm
    c->z = c->d = c->norm = true;
    c->out = IoType::F32;
    add(1, 64, 1, 1, 256, 64, 4, 8, IoType::BF16);
    add(1, 96, 2, 1, 128, 64, 1, 64, IoType::F32)->d = true;
    add(1, 512, 4, 1, 128, 64, 4, 16, IoType::BF16)->z = true;  // an upstream grid shape, shorter
  }
  return v;
}

std::vector<MimoBwdBwdCase> mimo_bwd_bwd_cases(bool quick) {
  std::vector<MimoBwdBwdCase> v;
  auto add = [&](int64_t B, int64_t S, int64_t H, int64_t G, int64_t N, int64_t P, int64_t R,
                 int64_t C, IoType act) {
    MimoBwdBwdCase c;
    c.B = B, c.S = S, c.H = H, c.G = G, c.N = N, c.P = P, c.R = R, c.chunk = C;
    c.act = c.out = act;
    c.seed = v.size() + 1;
    v.push_back(c);
    return &v.back();
  };
  add(1, 128, 2, 1, 64, 64, 4, 16, IoType::F32)->d = true;
  MimoBwdBwdCase* c = add(2, 100, 4, 2, 128, 64, 2, 32, IoType::BF16);  // GQA, tail, D
  c->d = true, c->cache = IoType::BF16;
  c = add(1, 50, 2, 1, 32, 128, 8, 8, IoType::F16);  // per-rank dout, tail
  c->dout = MimoDoutKind::PerRank, c->rdd = 2;
  if (!quick) {
    c = add(1, 200, 2, 1, 128, 32, 4, 16, IoType::BF16);  // packed pre-RMS dout
    c->dout = MimoDoutKind::Packed, c->d = true, c->out = IoType::F32;
    add(1, 64, 1, 1, 256, 64, 4, 8, IoType::BF16);
    add(1, 96, 2, 1, 128, 64, 1, 64, IoType::F32)->d = true;
    add(1, 256, 4, 1, 128, 64, 4, 16, IoType::BF16)->cache = IoType::BF16;  // upstream-like
  }
  return v;
}

std::string fmt(double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3e", x);
  return buf;
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false;
  std::string device_arg, output;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--quick")) {
      quick = true;
    } else if (!std::strcmp(argv[i], "--device") && i + 1 < argc) {
      device_arg = argv[++i];
    } else if (!std::strcmp(argv[i], "--output") && i + 1 < argc) {
      output = argv[++i];
    } else {
      std::cerr << "usage: mamba3-selfcheck [--device cpu|cuda] [--quick] [--output FILE]\n";
      return 2;
    }
  }
  Device dev = cuda_available() ? Device::CUDA : Device::CPU;
  if (device_arg == "cpu") {
    dev = Device::CPU;
  } else if (device_arg == "cuda") {
    if (!cuda_available()) {
      std::cerr << "mamba3-selfcheck: --device cuda requested but "
                << (mamba3_has_cuda() ? "no CUDA device is present" : "this build has no CUDA")
                << "\n";
      return 2;
    }
    dev = Device::CUDA;
  } else if (!device_arg.empty()) {
    std::cerr << "mamba3-selfcheck: unknown device '" << device_arg << "'\n";
    return 2;
  }

  std::vector<CaseReport> reports;
  for (const auto& c : dqktheta_cases(quick)) reports.push_back(run_dqktheta_case(c, dev, 2));
  for (const auto& c : ddt_cases(quick)) reports.push_back(run_ddt_case(c, dev, 2));
  for (const auto& c : mimo_bwd_fwd_cases(quick))
    reports.push_back(run_mimo_bwd_fwd_case(c, dev, 2));
  for (const auto& c : mimo_bwd_bwd_cases(quick))
    reports.push_back(run_mimo_bwd_bwd_case(c, dev, 2));
  // The combined backward: the first pass's cases (gate, norm, per rank, D, GQA, tails).
  for (const auto& c : mimo_bwd_fwd_cases(quick))
    reports.push_back(run_mimo_bwd_combined_case(c, dev, 2));

  std::ostringstream md;
  md << "# mamba3-selfcheck\n\n"
     << "- library: " << mamba3_version() << ", device: " << device_name(dev)
     << ", mode: " << (quick ? "quick" : "full") << "\n"
     << "- rule: metric <= tol (1e-5 fp32, 2e-3 fp16, 1e-2 bf16) and <= 2x the fp32 reference's "
        "error (or <= max(tol/100, 4 fp32 ulps)); every output compared; outputs NaN-poisoned before each run; "
        "each case run twice and required bitwise identical\n\n"
     << "| op | case | dtype | output | out dtype | metric | value | fp32 ref | ratio | result | "
        "time ms |\n"
     << "|---|---|---|---|---|---|---:|---:|---:|---|---:|\n";
  int failures = 0;
  for (const auto& r : reports) {
    if (!r.error.empty()) {
      ++failures;
      md << "| " << r.op << " | " << r.case_name << " | " << r.dtype << " | (call) | - | - | - | - "
         << "| - | FAIL: " << r.error << " | - |\n";
      continue;
    }
    for (const auto& o : r.outputs) {
      if (!o.acc.pass) ++failures;
      const bool bit = o.acc.metric == "identical";
      const double ratio = o.acc.ref_value() > 0 ? o.acc.value() / o.acc.ref_value() : 0.0;
      md << "| " << r.op << " | " << r.case_name << " | " << r.dtype << " | " << o.name << " | "
         << o.dtype << " | " << o.acc.metric << " | " << (bit ? "-" : fmt(o.acc.value())) << " | "
         << (bit ? "-" : fmt(o.acc.ref_value())) << " | "
         << (bit ? "-" : (o.acc.ref_value() > 0 ? fmt(ratio) : "-")) << " | "
         << (o.acc.pass ? "PASS" : (o.acc.finite ? "FAIL" : "FAIL (non-finite)")) << " | "
         << fmt(r.time_ms) << " |\n";
    }
  }
  md << "\n**" << (failures ? "FAIL" : "PASS") << "**: " << reports.size() << " cases, "
     << failures << " failing rows\n";
  std::cout << md.str();
  if (!output.empty()) std::ofstream(output) << md.str();
  return failures ? 1 : 0;
}
