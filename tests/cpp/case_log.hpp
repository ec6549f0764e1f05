// Helpers shared by the operator test suites that run cases through the golden harness: the pass
// check (every output passes and the bitwise-repeat row is present), the per-output record of the
// worst accuracy seen, and its printout; plus the skip for CUDA suites on machines without a GPU.
#pragma once

#include <gtest/gtest.h>

#include <cstdio>
#include <limits>
#include <map>
#include <string>

#include "mamba3_golden/siso_cases.hpp"

#define SKIP_WITHOUT_CUDA()                                                                   \
  do {                                                                                        \
    if (!::mamba3::golden::cuda_available()) GTEST_SKIP() << "no CUDA device in this machine"; \
  } while (0)

namespace mamba3::test {

inline void expect_pass(const golden::CaseReport& r) {
  EXPECT_TRUE(r.pass()) << r.first_failure();
  bool has_bitwise = false;
  for (const golden::OutputReport& o : r.outputs) has_bitwise |= o.name == "bitwise_repeat";
  if (r.error.empty()) EXPECT_TRUE(has_bitwise) << "no determinism check in " << r.case_name;
}

struct Worst {
  double value = 0, ref = 0, ratio = 0;  // worst metric, its reference, worst metric/reference
  std::string value_case, ratio_case;
};
using WorstLog = std::map<std::string, Worst>;  // keyed by "output (dtype)"

inline void record(WorstLog& worst, const golden::CaseReport& r) {
  for (const golden::OutputReport& o : r.outputs) {
    if (o.name == "bitwise_repeat") continue;
    Worst& w = worst[o.name + " (" + o.dtype + ")"];
    const double v = o.acc.value(), ref = o.acc.ref_value();
    if (v >= w.value) w.value = v, w.ref = ref, w.value_case = r.case_name;
    const double ratio = ref > 0 ? v / ref : (v > 0 ? std::numeric_limits<double>::infinity() : 0);
    if (ratio >= w.ratio) w.ratio = ratio, w.ratio_case = r.case_name;
  }
}

// Prints "[ worst accuracy of <title> ]" and one line per output.
inline void print_worst(const std::string& title, const WorstLog& worst) {
  std::printf("[ worst accuracy of %s ]\n", title.c_str());
  for (const auto& kv : worst)
    std::printf("  %-28s metric %.3e (ref %.3e) in [%s]; worst metric/ref %.3f in [%s]\n",
                kv.first.c_str(), kv.second.value, kv.second.ref, kv.second.value_case.c_str(),
                kv.second.ratio, kv.second.ratio_case.c_str());
}

}  // namespace mamba3::test
