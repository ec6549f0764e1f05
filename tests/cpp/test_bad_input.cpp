// Bad input (SPEC.md section 3): every malformed call of the two SISO backward operators returns
// MAMBA3_ERROR_INVALID_ARGUMENT with a message that names the offending argument; nothing crashes
// and nothing silently falls back to another backend.
#include <gtest/gtest.h>

#include <initializer_list>
#include <string>
#include <vector>

#include "mamba3/mamba3.h"
#include "mamba3_golden/host.hpp"
#include "bad_input_args.hpp"

namespace {

using namespace mamba3::test;  // Args, zeros, index_buffer, invalid, dtype constants

// ============================================================== compute_dqktheta

// Valid problem: B=2 S=8 G=2 H=4 N=8 A=3 (or B=1 varlen with cu_seqlens [0,3,8]).
class Dqk {
 public:
  static constexpr int64_t S = 8, G = 2, H = 4, N = 8, A = 3;
  int64_t B;
  int64_t chunk = 64;
  Args a;

  explicit Dqk(bool varlen = false, bool dok = false) : B(varlen ? 1 : 2) {
    const int64_t nseq = varlen ? 2 : B;
    a.add("q", zeros(IoType::BF16, {B, S, G, N}));
    a.add("k", zeros(IoType::BF16, {B, S, G, N}));
    a.add("scale", zeros(IoType::F32, {B, H, S}));
    a.add("gamma", zeros(IoType::F32, {B, H, S}));
    a.add("q_bias", zeros(IoType::F32, {H, N}));
    a.add("k_bias", zeros(IoType::F32, {H, N}));
    a.add("angles", zeros(IoType::F32, {B, S, H, A}));
    a.add("dq_in", zeros(IoType::F16, {B, S, H, N}));
    a.add("dk_in", zeros(IoType::F16, {B, S, H, N}));
    a.add("dqk", zeros(IoType::F32, {B, H, S}));
    a.add("d_ok_state", zeros(IoType::F32, {nseq, H, N}));
    a.add("cu_seqlens", index_buffer(IoType::I32, {0, 3, 8}));
    a.add("dq", Buffer(IoType::F16, {B, S, G, N}));
    a.add("dk", Buffer(IoType::F16, {B, S, G, N}));
    a.add("dq_bias", Buffer(IoType::F32, {H, N}));
    a.add("dk_bias", Buffer(IoType::F32, {H, N}));
    a.add("dangles", Buffer(IoType::F32, {B, S, H, A}));
    a.add("dscale", Buffer(IoType::F32, {B, H, S}));
    a.add("dgamma", Buffer(IoType::F32, {B, H, S}));
    a.defaults_.assign(a.names().size(), true);
    a.defaults_[a.idx("d_ok_state")] = dok;
    a.defaults_[a.idx("cu_seqlens")] = varlen;
    a.reset();
  }
  mamba3_status call() {
    return mamba3_compute_dqktheta(a.p("q"), a.p("k"), a.p("scale"), a.p("gamma"), a.p("q_bias"),
                                   a.p("k_bias"), a.p("angles"), a.p("dq_in"), a.p("dk_in"),
                                   a.p("dqk"), a.p("d_ok_state"), chunk, a.p("cu_seqlens"),
                                   a.p("dq"), a.p("dk"), a.p("dq_bias"), a.p("dk_bias"),
                                   a.p("dangles"), a.p("dscale"), a.p("dgamma"), nullptr, 0,
                                   nullptr);
  }
};

const std::vector<std::string> kDqkRequired = {"q",  "k",       "scale",   "gamma",   "q_bias",
                                               "k_bias", "angles", "dq_in", "dk_in", "dqk",
                                               "dq", "dk", "dq_bias", "dk_bias", "dangles",
                                               "dscale", "dgamma"};
// Tensors whose every dimension is checked against sizes taken from other arguments (q gives
// B,S,G,N; scale gives H; angles gives A), so a wrong size is reported against themselves.
const std::vector<std::string> kDqkDerived = {"k",     "gamma", "q_bias",  "k_bias",  "dq_in",
                                              "dk_in", "dqk",   "dq",      "dk",      "dq_bias",
                                              "dk_bias", "dangles", "dscale", "dgamma", "d_ok_state"};

TEST(BadInputDqktheta, ValidBaselineSucceeds) {
  for (bool varlen : {false, true})
    for (bool dok : {false, true}) {
      Dqk d(varlen, dok);
      ASSERT_EQ(d.call(), MAMBA3_OK) << mamba3_last_error();
    }
}

TEST(BadInputDqktheta, NullRequiredTensor) {
  for (const std::string& name : kDqkRequired) {
    Dqk d;
    d.a.drop(name);
    EXPECT_TRUE(invalid(d.call(), {(name + " is required").c_str()})) << name;
  }
}

TEST(BadInputDqktheta, NullDataPointer) {
  for (const std::string& name : {"q", "angles", "dq", "dgamma"}) {
    Dqk d;
    d.a.t(name).data = nullptr;
    EXPECT_TRUE(invalid(d.call(), {(name + ":").c_str(), "NULL"})) << name;
  }
}

TEST(BadInputDqktheta, WrongRank) {
  for (const std::string& name : kDqkRequired) {
    Dqk d;
    std::vector<int64_t> s = d.a.shape(name);
    s.push_back(1);  // one extra dimension
    d.a.set_shape(name, s);
    EXPECT_TRUE(invalid(d.call(), {(name + ":").c_str(), "rank"})) << name;
    Dqk e;
    std::vector<int64_t> s2 = e.a.shape(name);
    s2.pop_back();  // one dimension short
    e.a.set_shape(name, s2);
    EXPECT_TRUE(invalid(e.call(), {(name + ":").c_str(), "rank"})) << name;
  }
  Dqk d(false, true);
  d.a.set_shape("d_ok_state", {2, 4});
  EXPECT_TRUE(invalid(d.call(), {"d_ok_state:", "rank"}));
  Dqk v(true);
  v.a.set_shape("cu_seqlens", {3, 1});
  EXPECT_TRUE(invalid(v.call(), {"cu_seqlens:", "rank"}));
}

TEST(BadInputDqktheta, WrongShape) {
  for (const std::string& name : kDqkDerived) {
    Dqk probe(false, true);
    const std::vector<int64_t> base = probe.a.shape(name);
    for (size_t dim = 0; dim < base.size(); ++dim) {
      Dqk d(false, true);
      std::vector<int64_t> s = base;
      s[dim] += 1;
      d.a.set_shape(name, s);
      EXPECT_TRUE(invalid(d.call(), {(name + ":").c_str(), "shape"})) << name << " dim " << dim;
    }
  }
  // The size-defining tensors: a size that disagrees with them is reported where it shows.
  Dqk d;
  d.a.set_shape("q", {2, 9, 2, 8});  // S=9 while everything else has S=8
  EXPECT_TRUE(invalid(d.call(), {"S=9"}));
}

TEST(BadInputDqktheta, WrongInputDtype) {
  struct Case {
    const char* name;
    DLDataType t;
  };
  for (const Case& c : {Case{"q", kF64}, Case{"q", kI32}, Case{"k", kF32}, Case{"scale", kI32},
                        Case{"gamma", kF64}, Case{"q_bias", kI64}, Case{"k_bias", kF64},
                        Case{"angles", kI32}, Case{"dq_in", kF64}, Case{"dk_in", kBF16},
                        Case{"dqk", kF64}, Case{"q", dl_type(kDLFloat, 8)},
                        Case{"scale", dl_type(kDLUInt, 8)}, Case{"dqk", dl_type(kDLFloat, 32, 4)}}) {
    Dqk d;
    d.a.t(c.name).dtype = c.t;
    EXPECT_TRUE(invalid(d.call(), {(std::string(c.name) + ":").c_str()})) << c.name;
  }
  Dqk d(false, true);
  d.a.t("d_ok_state").dtype = kI32;
  EXPECT_TRUE(invalid(d.call(), {"d_ok_state:", "dtype"}));
  Dqk v(true);
  v.a.t("cu_seqlens").dtype = kF32;
  EXPECT_TRUE(invalid(v.call(), {"cu_seqlens:", "dtype"}));
}

TEST(BadInputDqktheta, WrongOutputDtype) {
  struct Case {
    const char* name;
    DLDataType t;
  };
  // dq/dk follow dq_in (f16), dangles/dscale/dgamma follow angles/scale/gamma (f32), biases f32.
  for (const Case& c : {Case{"dq", kF32}, Case{"dq", kBF16}, Case{"dk", kF32}, Case{"dq_bias", kF16},
                        Case{"dk_bias", kBF16}, Case{"dangles", kF16}, Case{"dscale", kBF16},
                        Case{"dgamma", kF16}, Case{"dgamma", kF64}}) {
    Dqk d;
    d.a.t(c.name).dtype = c.t;
    EXPECT_TRUE(invalid(d.call(), {(std::string(c.name) + ":").c_str(), "dtype"})) << c.name;
  }
}

TEST(BadInputDqktheta, HeadsNotMultipleOfGroups) {
  Dqk d;
  for (const char* name : {"q", "k", "dq", "dk"}) d.a.set_shape(name, {2, 8, 3, 8});  // G=3, H=4
  EXPECT_TRUE(invalid(d.call(), {"H % G", "H=4", "G=3"}));
}

TEST(BadInputDqktheta, OddOrTooLargeHeadDim) {
  {
    Dqk d;
    for (const char* name : {"q", "k", "dq", "dk"}) d.a.set_shape(name, {2, 8, 2, 7});
    for (const char* name : {"dq_in", "dk_in"}) d.a.set_shape(name, {2, 8, 4, 7});
    for (const char* name : {"q_bias", "k_bias", "dq_bias", "dk_bias"}) d.a.set_shape(name, {4, 7});
    EXPECT_TRUE(invalid(d.call(), {"N=7", "even"}));
  }
  {
    Dqk d;
    d.a.set_shape("q", {2, 8, 2, 258});
    EXPECT_TRUE(invalid(d.call(), {"N=258", "256"}));
  }
}

TEST(BadInputDqktheta, TooManyRotatedPairs) {
  for (int64_t A : {5, 0}) {  // N/2 = 4
    Dqk d;
    d.a.set_shape("angles", {2, 8, 4, A});
    d.a.set_shape("dangles", {2, 8, 4, A});
    EXPECT_TRUE(invalid(d.call(), {"angles:", ("A=" + std::to_string(A)).c_str()})) << A;
  }
}

TEST(BadInputDqktheta, ChunkSizeNotAllowed) {
  for (int64_t c : {0, -64, 1, 8, 48, 96, 512}) {
    Dqk d;
    d.chunk = c;
    EXPECT_TRUE(invalid(d.call(), {"chunk_size"})) << c;
  }
}

// cu_seqlens values (B=1, S=8, nseq=2 unless the case changes the length).
void expect_bad_cu(IoType t, std::vector<double> cu, std::initializer_list<const char*> parts) {
  Dqk d(true);
  d.a.replace("cu_seqlens", index_buffer(t, cu));
  EXPECT_TRUE(invalid(d.call(), parts)) << io_name(t);
}

TEST(BadInputDqktheta, CuSeqlensValues) {
  for (IoType t : {IoType::I32, IoType::I64}) {
    expect_bad_cu(t, {0, 5, 5}, {"cu_seqlens", "increasing"});
    expect_bad_cu(t, {0, 6, 3, 8}, {"cu_seqlens", "increasing"});
    expect_bad_cu(t, {1, 4, 8}, {"cu_seqlens", "start at 0"});
    expect_bad_cu(t, {-1, 4, 8}, {"cu_seqlens", "start at 0"});
    expect_bad_cu(t, {0, 4, 7}, {"cu_seqlens", "last entry", "8"});
    expect_bad_cu(t, {0, 4, 9}, {"cu_seqlens", "last entry", "8"});
    expect_bad_cu(t, {0}, {"cu_seqlens", "at least 2"});
  }
}

TEST(BadInputDqktheta, CuSeqlensNeedsBatchOne) {
  Dqk d;  // B=2
  d.a.give("cu_seqlens");
  EXPECT_TRUE(invalid(d.call(), {"cu_seqlens", "B=1", "B=2"}));
}

TEST(BadInputDqktheta, DokStateMustMatchSequenceCount) {
  Dqk d(true, true);  // 2 sequences
  d.a.replace("cu_seqlens", index_buffer(IoType::I64, {0, 2, 5, 8}));  // now 3
  EXPECT_TRUE(invalid(d.call(), {"d_ok_state:", "nseq=3"}));
}

TEST(BadInputDqktheta, MixedDevices) {
  for (bool varlen : {false, true}) {
    Dqk probe(varlen, true);
    for (const std::string& name : probe.a.names()) {
      if (name == "q" || !probe.a.given(name)) continue;
      Dqk d(varlen, true);
      d.a.t(name).device = DLDevice{kDLCUDA, 0};
      EXPECT_TRUE(invalid(d.call(), {(name + " is on cuda:0").c_str(), "q is on cpu:0",
                                     "same device"}))
          << name;
    }
  }
  // The first tensor on the GPU: the CPU ones are named against it.
  Dqk d;
  d.a.t("q").device = DLDevice{kDLCUDA, 0};
  EXPECT_TRUE(invalid(d.call(), {"q is on cuda:0", "same device"}));
  // Two GPUs.
  Dqk g;
  for (const std::string& name : g.a.names()) g.a.t(name).device = DLDevice{kDLCUDA, 0};
  g.a.t("dangles").device = DLDevice{kDLCUDA, 1};
  EXPECT_TRUE(invalid(g.call(), {"dangles is on cuda:1", "same device"}));
}

TEST(BadInputDqktheta, UnsupportedDeviceType) {
  for (const char* name : {"q", "dk_in", "dgamma"}) {
    for (DLDeviceType dt : {kDLOpenCL, kDLVulkan, kDLMetal, kDLROCM}) {
      Dqk d;
      d.a.t(name).device = DLDevice{dt, 0};
      EXPECT_TRUE(invalid(d.call(), {(std::string(name) + ":").c_str(), "device type"})) << name;
    }
  }
}

TEST(BadInputDqktheta, AllOnCudaWithoutCudaBackendIsUnsupported) {
  if (mamba3_has_cuda()) GTEST_SKIP() << "this build has the CUDA backend";
  Dqk d;
  for (const std::string& name : d.a.names()) d.a.t(name).device = DLDevice{kDLCUDA, 0};
  EXPECT_EQ(d.call(), MAMBA3_ERROR_UNSUPPORTED);
  EXPECT_NE(std::string(mamba3_last_error()).find("CUDA"), std::string::npos)
      << mamba3_last_error();
}

// ============================================================== compute_ddt_dtrap_dinput_states

// Valid problem: B=2 H=3 S=8, states N=4 P=5 (or B=1 varlen [0,3,8]).
class Ddt {
 public:
  static constexpr int64_t H = 3, S = 8, N = 4, P = 5;
  int64_t B;
  Args a;
  explicit Ddt(bool varlen = false, bool states = true) : B(varlen ? 1 : 2) {
    const int64_t nseq = varlen ? 2 : B;
    a.add("dscale", zeros(IoType::BF16, {B, H, S}));
    a.add("dgamma", zeros(IoType::F32, {B, H, S}));
    a.add("dt", zeros(IoType::F16, {B, H, S}));
    a.add("trap", zeros(IoType::F32, {B, H, S}));
    a.add("d_issm_state", zeros(IoType::BF16, {nseq, H, P, N}));
    a.add("input_k_state", zeros(IoType::F32, {nseq, H, N}));
    a.add("input_v_state", zeros(IoType::F16, {nseq, H, P}));
    a.add("cu_seqlens", index_buffer(IoType::I64, {0, 3, 8}));
    a.add("ddt", Buffer(IoType::F32, {B, H, S}));
    a.add("dtrap", Buffer(IoType::F32, {B, H, S}));
    a.add("d_input_ssm_state", Buffer(IoType::BF16, {nseq, H, P, N}));
    a.add("d_input_k_state", Buffer(IoType::F32, {nseq, H, N}));
    a.add("d_input_v_state", Buffer(IoType::F32, {nseq, H, P}));
    a.defaults_.assign(a.names().size(), true);
    a.defaults_[a.idx("cu_seqlens")] = varlen;
    for (const char* s : {"d_issm_state", "input_k_state", "input_v_state", "d_input_ssm_state",
                          "d_input_k_state", "d_input_v_state"})
      a.defaults_[a.idx(s)] = states;
    a.reset();
  }
  mamba3_status call() {
    return mamba3_compute_ddt_dtrap_dinput_states(
        a.p("dscale"), a.p("dgamma"), a.p("dt"), a.p("trap"), a.p("d_issm_state"),
        a.p("input_k_state"), a.p("input_v_state"), a.p("cu_seqlens"), a.p("ddt"), a.p("dtrap"),
        a.p("d_input_ssm_state"), a.p("d_input_k_state"), a.p("d_input_v_state"), nullptr);
  }
};

TEST(BadInputDdt, ValidBaselineSucceeds) {
  for (bool varlen : {false, true})
    for (bool states : {false, true}) {
      Ddt d(varlen, states);
      ASSERT_EQ(d.call(), MAMBA3_OK) << mamba3_last_error();
    }
}

TEST(BadInputDdt, NullRequiredTensor) {
  for (const std::string& name : {"dscale", "dgamma", "dt", "trap", "ddt", "dtrap"}) {
    Ddt d;
    d.a.drop(name);
    EXPECT_TRUE(invalid(d.call(), {(name + " is required").c_str()})) << name;
  }
}

TEST(BadInputDdt, StatesPartlyGiven) {
  for (const char* name : {"input_k_state", "input_v_state"}) {
    Ddt d;
    d.a.drop(name);
    EXPECT_TRUE(invalid(d.call(), {name, "required when d_issm_state is given"})) << name;
  }
  for (const char* name : {"d_input_ssm_state", "d_input_k_state", "d_input_v_state"}) {
    Ddt d;
    d.a.drop(name);
    EXPECT_TRUE(invalid(d.call(), {(std::string(name) + " is required").c_str()})) << name;
  }
  for (const char* name : {"input_k_state", "input_v_state", "d_input_ssm_state",
                           "d_input_k_state", "d_input_v_state"}) {
    Ddt d(false, false);
    d.a.give(name);
    EXPECT_TRUE(invalid(d.call(), {(std::string(name) + " must be NULL").c_str()})) << name;
  }
}

TEST(BadInputDdt, WrongRank) {
  for (const std::string& name : {"dscale", "dgamma", "dt", "trap", "ddt", "dtrap", "d_issm_state",
                                  "input_k_state", "input_v_state", "d_input_ssm_state",
                                  "d_input_k_state", "d_input_v_state"}) {
    Ddt d;
    std::vector<int64_t> s = d.a.shape(name);
    s.push_back(2);
    d.a.set_shape(name, s);
    EXPECT_TRUE(invalid(d.call(), {(name + ":").c_str(), "rank"})) << name;
  }
}

TEST(BadInputDdt, WrongShape) {
  // dscale gives B,H,S and d_issm_state gives P,N: every other tensor is checked against them.
  for (const std::string& name : {"dgamma", "dt", "trap", "ddt", "dtrap", "input_k_state",
                                  "input_v_state", "d_input_ssm_state", "d_input_k_state",
                                  "d_input_v_state"}) {
    Ddt probe;
    const std::vector<int64_t> base = probe.a.shape(name);
    for (size_t dim = 0; dim < base.size(); ++dim) {
      Ddt d;
      std::vector<int64_t> s = base;
      s[dim] += 1;
      d.a.set_shape(name, s);
      EXPECT_TRUE(invalid(d.call(), {(name + ":").c_str(), "shape"})) << name << " dim " << dim;
    }
  }
  for (size_t dim : {0, 1}) {  // d_issm_state's nseq and H are checked against the others
    Ddt d;
    std::vector<int64_t> s = d.a.shape("d_issm_state");
    s[dim] += 1;
    d.a.set_shape("d_issm_state", s);
    EXPECT_TRUE(invalid(d.call(), {"d_issm_state:", "shape"})) << dim;
  }
}

TEST(BadInputDdt, WrongDtype) {
  struct Case {
    const char* name;
    DLDataType t;
  };
  for (const Case& c :
       {Case{"dscale", kF64}, Case{"dgamma", kI32}, Case{"dt", kI64}, Case{"trap", kF64},
        Case{"d_issm_state", kI32}, Case{"input_k_state", kF64}, Case{"input_v_state", kI32},
        Case{"ddt", kF16}, Case{"ddt", kBF16}, Case{"dtrap", kF64}, Case{"d_input_ssm_state", kF32},
        Case{"d_input_k_state", kF16}, Case{"d_input_v_state", kBF16},
        Case{"trap", dl_type(kDLFloat, 32, 2)}}) {
    Ddt d;
    d.a.t(c.name).dtype = c.t;
    EXPECT_TRUE(invalid(d.call(), {(std::string(c.name) + ":").c_str()})) << c.name;
  }
}

TEST(BadInputDdt, CuSeqlens) {
  for (IoType t : {IoType::I32, IoType::I64}) {
    struct Case {
      std::vector<double> cu;
      const char* part;
    };
    for (const Case& c : {Case{{0, 5, 5}, "increasing"}, Case{{0, 6, 3, 8}, "increasing"},
                          Case{{2, 4, 8}, "start at 0"}, Case{{0, 3, 7}, "last entry"},
                          Case{{0, 3, 10}, "last entry"}, Case{{0}, "at least 2"}}) {
      Ddt d(true, false);
      d.a.replace("cu_seqlens", index_buffer(t, c.cu));
      EXPECT_TRUE(invalid(d.call(), {"cu_seqlens", c.part})) << c.part;
    }
  }
  Ddt b(false, false);  // B=2
  b.a.give("cu_seqlens");
  EXPECT_TRUE(invalid(b.call(), {"cu_seqlens", "B=1"}));
  Ddt f(true, false);
  f.a.t("cu_seqlens").dtype = kF64;
  EXPECT_TRUE(invalid(f.call(), {"cu_seqlens:", "dtype"}));
  // States are per sequence: 3 sequences but states for 2.
  Ddt s(true, true);
  s.a.replace("cu_seqlens", index_buffer(IoType::I32, {0, 1, 2, 8}));
  EXPECT_TRUE(invalid(s.call(), {"d_issm_state:", "nseq=3"}));
}

TEST(BadInputDdt, MixedDevices) {
  for (bool varlen : {false, true}) {
    Ddt probe(varlen, true);
    for (const std::string& name : probe.a.names()) {
      if (name == "dscale" || !probe.a.given(name)) continue;
      Ddt d(varlen, true);
      d.a.t(name).device = DLDevice{kDLCUDA, 0};
      EXPECT_TRUE(invalid(d.call(), {(name + " is on cuda:0").c_str(), "dscale is on cpu:0",
                                     "same device"}))
          << name;
    }
  }
  Ddt d;
  d.a.t("dscale").device = DLDevice{kDLCUDA, 0};
  EXPECT_TRUE(invalid(d.call(), {"dscale is on cuda:0", "same device"}));
}

TEST(BadInputDdt, UnsupportedDeviceType) {
  for (const char* name : {"dscale", "trap", "d_input_v_state"}) {
    Ddt d;
    d.a.t(name).device = DLDevice{kDLMetal, 0};
    EXPECT_TRUE(invalid(d.call(), {(std::string(name) + ":").c_str(), "device type"})) << name;
  }
}

TEST(BadInputDdt, AllOnCudaWithoutCudaBackendIsUnsupported) {
  if (mamba3_has_cuda()) GTEST_SKIP() << "this build has the CUDA backend";
  Ddt d;
  for (const std::string& name : d.a.names()) d.a.t(name).device = DLDevice{kDLCUDA, 0};
  EXPECT_EQ(d.call(), MAMBA3_ERROR_UNSUPPORTED);
  EXPECT_NE(std::string(mamba3_last_error()).find("CUDA"), std::string::npos)
      << mamba3_last_error();
}

}  // namespace
