// Bad input of mamba3_mimo_bwd_fwd and mamba3_mimo_bwd_bwd (SPEC.md section 3): every malformed
// call returns MAMBA3_ERROR_INVALID_ARGUMENT with a message that names the offending argument;
// nothing crashes and nothing silently falls back to another backend. The workspace-size entry
// points validate the same way.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "bad_input_args.hpp"
#include "mamba3/mamba3.h"
#include "mamba3_golden/host.hpp"

namespace {

using namespace mamba3::test;

// Valid problem: B=2 S=12 H=4 G=2 N=16 P=8 R=2 C=8 (two chunks, the last partial), divisor 4
// (A=4). Options: reduce-O (mimo_o) or per-rank dout, gate (z, mimo_z), D, pre-gate norm.
class Mimo {
 public:
  static constexpr int64_t B = 2, S = 12, H = 4, G = 2, N = 16, P = 8, R = 2, C = 8, A = 4;
  static constexpr int64_t nch = 2;
  int64_t chunk = C, rdd = 4;
  double eps = 1e-5;
  bool reduce, gate, norm;
  Args a;

  explicit Mimo(bool reduce_ = true, bool gate_ = true, bool norm_ = true)
      : reduce(reduce_), gate(gate_), norm(norm_) {
    a.add("dout",
          reduce ? zeros(IoType::BF16, {B, S, H, P}) : zeros(IoType::BF16, {B, S, R, H, P}));
    a.add("q", zeros(IoType::BF16, {B, S, R, G, N}));
    a.add("k", zeros(IoType::BF16, {B, S, R, G, N}));
    a.add("v", zeros(IoType::F16, {B, S, H, P}));
    a.add("q_bias", zeros(IoType::F32, {H, R, N}));
    a.add("k_bias", zeros(IoType::F32, {H, R, N}));
    a.add("mimo_v", zeros(IoType::F32, {H, R, P}));
    a.add("mimo_o", zeros(IoType::F32, {H, R, P}));
    a.add("angles", zeros(IoType::F32, {B, S, H, A}));
    a.add("da_cs", zeros(IoType::F32, {B, H, S}));
    a.add("da_cs_rev", zeros(IoType::F32, {B, H, S}));
    a.add("dt", zeros(IoType::F32, {B, H, S}));
    a.add("trap", zeros(IoType::BF16, {B, H, S}));
    a.add("segsum", zeros(IoType::F32, {B, H, nch, C, C}));
    a.add("mimo_z", zeros(IoType::F32, {H, R, P}));
    a.add("d", zeros(IoType::F32, {H}));
    a.add("z", zeros(IoType::BF16, {B, S, H, P}));
    a.add("norm_weight", zeros(IoType::F32, {H, P}));
    a.add("states", Buffer(IoType::BF16, {B, H, nch, N, P}));
    a.add("qk_dot", Buffer(IoType::BF16, {B, H, S, R, R}));
    a.add("dmimo_o", Buffer(IoType::F32, {B, H, R, P}));
    a.add("dmimo_z", Buffer(IoType::F32, {B, H, R, P}));
    a.add("dz", Buffer(IoType::BF16, {B, S, H, P}));
    a.add("dnorm_weight", Buffer(IoType::F32, {B, H, R, P}));
    a.add("dout_pre_rms", Buffer(IoType::BF16, {B, H, S * R, P}));
    a.defaults_.assign(a.names().size(), true);
    for (const char* n : {"mimo_o", "dmimo_o"}) a.defaults_[a.idx(n)] = reduce;
    for (const char* n : {"mimo_z", "z", "dmimo_z", "dz"}) a.defaults_[a.idx(n)] = gate;
    for (const char* n : {"norm_weight", "dnorm_weight", "dout_pre_rms"})
      a.defaults_[a.idx(n)] = norm;
    a.reset();
  }
  mamba3_status call() {
    return mamba3_mimo_bwd_fwd(
        a.p("dout"), a.p("q"), a.p("k"), a.p("v"), a.p("q_bias"), a.p("k_bias"), a.p("mimo_v"),
        a.p("mimo_o"), a.p("angles"), a.p("da_cs"), a.p("da_cs_rev"), a.p("dt"), a.p("trap"),
        a.p("segsum"), a.p("mimo_z"), a.p("d"), a.p("z"), a.p("norm_weight"), eps, chunk, rdd,
        a.p("states"), a.p("qk_dot"), a.p("dmimo_o"), a.p("dmimo_z"), a.p("dz"),
        a.p("dnorm_weight"), a.p("dout_pre_rms"), nullptr, 0, nullptr);
  }
  mamba3_status workspace(size_t* bytes) {
    return mamba3_mimo_bwd_fwd_workspace_size(
        a.p("dout"), a.p("q"), a.p("k"), a.p("v"), a.p("q_bias"), a.p("k_bias"), a.p("mimo_v"),
        a.p("mimo_o"), a.p("angles"), a.p("da_cs"), a.p("da_cs_rev"), a.p("dt"), a.p("trap"),
        a.p("segsum"), a.p("mimo_z"), a.p("d"), a.p("z"), a.p("norm_weight"), eps, chunk, rdd,
        a.p("states"), a.p("qk_dot"), a.p("dmimo_o"), a.p("dmimo_z"), a.p("dz"),
        a.p("dnorm_weight"), a.p("dout_pre_rms"), bytes);
  }
  // Runs the operator and the workspace query; both must fail the same way.
  ::testing::AssertionResult invalid_both(std::initializer_list<const char*> parts) {
    ::testing::AssertionResult r = invalid(call(), parts);
    if (!r) return r;
    size_t bytes = 0;
    return invalid(workspace(&bytes), parts);
  }
};

const std::vector<std::string> kRequired = {"dout",   "q",      "k",      "v",     "q_bias",
                                            "k_bias", "mimo_v", "angles", "da_cs", "da_cs_rev",
                                            "dt",     "trap",   "segsum", "states", "qk_dot"};
// Tensors whose every dimension is checked against sizes taken from others (q gives B,S,R,G,N;
// v gives H,P), so a wrong size is reported against themselves.
const std::vector<std::string> kDerived = {
    "dout",   "k",      "q_bias", "k_bias", "mimo_v",  "mimo_o",  "angles",       "da_cs",
    "da_cs_rev", "dt",  "trap",   "segsum", "mimo_z",  "d",       "z",            "norm_weight",
    "states", "qk_dot", "dmimo_o", "dmimo_z", "dz",    "dnorm_weight", "dout_pre_rms"};

TEST(BadInputMimoBwdFwd, ValidBaselineSucceeds) {
  for (bool reduce : {true, false})
    for (bool gate : {true, false})
      for (bool norm : {true, false}) {
        if (norm && !(reduce && gate)) continue;
        Mimo m(reduce, gate, norm);
        ASSERT_EQ(m.call(), MAMBA3_OK) << mamba3_last_error();
        size_t bytes = 1;
        ASSERT_EQ(m.workspace(&bytes), MAMBA3_OK) << mamba3_last_error();
        EXPECT_EQ(bytes, 0u);  // the CPU backend needs no workspace
      }
  // All chunk sizes, both divisors, S a multiple of C.
  for (int64_t c : {8, 16, 32, 64}) {
    Mimo m;
    m.chunk = c;
    const int64_t nch = (Mimo::S + c - 1) / c;
    m.a.replace("segsum", zeros(IoType::F32, {Mimo::B, Mimo::H, nch, c, c}));
    m.a.replace("states", Buffer(IoType::BF16, {Mimo::B, Mimo::H, nch, Mimo::N, Mimo::P}));
    EXPECT_EQ(m.call(), MAMBA3_OK) << c << ": " << mamba3_last_error();
  }
  Mimo m;
  m.rdd = 2;
  m.a.replace("angles", zeros(IoType::F32, {Mimo::B, Mimo::S, Mimo::H, Mimo::N / 2}));
  EXPECT_EQ(m.call(), MAMBA3_OK) << mamba3_last_error();
}

TEST(BadInputMimoBwdFwd, WorkspaceBytesPointerIsRequired) {
  Mimo m;
  EXPECT_TRUE(invalid(m.workspace(nullptr), {"workspace_bytes"}));
}

TEST(BadInputMimoBwdFwd, NullRequiredTensor) {
  for (const std::string& name : kRequired) {
    Mimo m;
    m.a.drop(name);
    EXPECT_TRUE(m.invalid_both({(name + " is required").c_str()})) << name;
  }
}

TEST(BadInputMimoBwdFwd, NullDataPointer) {
  for (const std::string& name : {"q", "segsum", "norm_weight", "states", "dout_pre_rms"}) {
    Mimo m;
    m.a.t(name).data = nullptr;
    EXPECT_TRUE(m.invalid_both({(name + ":").c_str(), "NULL"})) << name;
  }
}

TEST(BadInputMimoBwdFwd, WrongRank) {
  Mimo probe;
  for (const std::string& name : probe.a.names()) {
    for (int delta : {+1, -1}) {
      Mimo m;
      std::vector<int64_t> s = m.a.shape(name);
      if (delta > 0)
        s.push_back(1);
      else
        s.pop_back();
      m.a.set_shape(name, s);
      EXPECT_TRUE(m.invalid_both({(name + ":").c_str(), "rank"})) << name << " " << delta;
    }
  }
}

TEST(BadInputMimoBwdFwd, WrongShape) {
  for (const std::string& name : kDerived) {
    Mimo probe;
    const std::vector<int64_t> base = probe.a.shape(name);
    for (size_t dim = 0; dim < base.size(); ++dim) {
      Mimo m;
      std::vector<int64_t> s = base;
      s[dim] += 1;
      m.a.set_shape(name, s);
      EXPECT_TRUE(m.invalid_both({(name + ":").c_str(), "shape"})) << name << " dim " << dim;
    }
  }
  // Per-rank dout must be [B,S,R,H,P]: the reduce-O shape is refused (and vice versa).
  Mimo pr(false, true, false);
  pr.a.set_shape("dout", {Mimo::B, Mimo::S, Mimo::H, Mimo::P});
  EXPECT_TRUE(pr.invalid_both({"dout:", "rank 5"}));
  Mimo ro;
  ro.a.set_shape("dout", {Mimo::B, Mimo::S, Mimo::R, Mimo::H, Mimo::P});
  EXPECT_TRUE(ro.invalid_both({"dout:", "rank 4"}));
  // The size-defining tensors: a size that disagrees with them is reported where it shows.
  Mimo m;
  m.a.set_shape("q", {2, 13, 2, 2, 16});  // S=13 while everything else has S=12
  EXPECT_TRUE(m.invalid_both({"S=13"}));
  Mimo v;
  v.a.set_shape("v", {2, 12, 4, 9});  // P=9
  EXPECT_TRUE(v.invalid_both({"P=9"}));
}

TEST(BadInputMimoBwdFwd, WrongInputDtype) {
  struct Case {
    const char* name;
    DLDataType t;
  };
  for (const Case& c :
       {Case{"dout", kF64}, Case{"q", kI32}, Case{"k", kF64}, Case{"v", kI64},
        Case{"q_bias", kF64}, Case{"k_bias", kI32}, Case{"mimo_v", kF64}, Case{"mimo_o", kI32},
        Case{"angles", kF64}, Case{"da_cs", kI64}, Case{"da_cs_rev", kF64}, Case{"dt", kI32},
        Case{"trap", kF64}, Case{"segsum", kI32}, Case{"mimo_z", kF64}, Case{"d", kI64},
        Case{"z", kF64}, Case{"norm_weight", kI32}, Case{"q", dl_type(kDLFloat, 8)},
        Case{"v", dl_type(kDLUInt, 16)}, Case{"dt", dl_type(kDLFloat, 32, 4)}}) {
    Mimo m;
    m.a.t(c.name).dtype = c.t;
    EXPECT_TRUE(m.invalid_both({(std::string(c.name) + ":").c_str()})) << c.name;
  }
}

TEST(BadInputMimoBwdFwd, WrongOutputDtype) {
  struct Case {
    const char* name;
    DLDataType t;
    const char* part;
  };
  // states sets the output dtype (here bf16); qk_dot, dz, dout_pre_rms follow it; the three
  // per-batch parameter gradients are float32.
  for (const Case& c :
       {Case{"states", kF64, "states:"}, Case{"states", kI32, "states:"},
        Case{"qk_dot", kF32, "taken from states"}, Case{"qk_dot", kF16, "taken from states"},
        Case{"dz", kF32, "taken from states"}, Case{"dout_pre_rms", kF16, "taken from states"},
        Case{"dmimo_o", kBF16, "dmimo_o:"}, Case{"dmimo_z", kF16, "dmimo_z:"},
        Case{"dnorm_weight", kF64, "dnorm_weight:"}}) {
    Mimo m;
    m.a.t(c.name).dtype = c.t;
    EXPECT_TRUE(m.invalid_both({(std::string(c.name) + ":").c_str(), "dtype", c.part})) << c.name;
  }
  // A different output dtype is fine when all four agree.
  Mimo m;
  for (const char* n : {"states", "qk_dot", "dz", "dout_pre_rms"}) m.a.t(n).dtype = kF16;
  EXPECT_EQ(m.call(), MAMBA3_OK) << mamba3_last_error();
}

TEST(BadInputMimoBwdFwd, HeadsNotMultipleOfGroups) {
  Mimo m;
  for (const char* name : {"q", "k"}) m.a.set_shape(name, {2, 12, 2, 3, 16});  // G=3, H=4
  EXPECT_TRUE(m.invalid_both({"H % G", "H=4", "G=3"}));
}

// Shapes of a problem with another N (q, k, biases, angles, states follow it).
void set_n(Mimo& m, int64_t N, int64_t rdd) {
  m.rdd = rdd;
  for (const char* name : {"q", "k"}) m.a.set_shape(name, {2, 12, 2, 2, N});
  for (const char* name : {"q_bias", "k_bias"}) m.a.set_shape(name, {4, 2, N});
  m.a.set_shape("angles", {2, 12, 4, N / rdd});
  m.a.set_shape("states", {2, 4, 2, N, 8});
}

TEST(BadInputMimoBwdFwd, HeadDimNotAllowed) {
  {
    Mimo m;
    set_n(m, 15, 4);
    EXPECT_TRUE(m.invalid_both({"N=15", "even"}));
  }
  {
    Mimo m;
    set_n(m, 258, 2);
    EXPECT_TRUE(m.invalid_both({"N=258", "256"}));
  }
  {
    Mimo m;  // N=18 is even but has no quarter for rotary_dim_divisor 4
    set_n(m, 18, 4);
    EXPECT_TRUE(m.invalid_both({"N=18", "rotary_dim_divisor=4"}));
  }
  {
    Mimo m;  // angles with N/2 pairs under divisor 4 (A > N/4)
    m.a.set_shape("angles", {2, 12, 4, 8});
    EXPECT_TRUE(m.invalid_both({"angles:", "A=4", "rotary_dim_divisor"}));
  }
}

TEST(BadInputMimoBwdFwd, RankOrValueDimTooLarge) {
  {
    Mimo m;
    for (const char* name : {"q", "k"}) m.a.set_shape(name, {2, 12, 9, 2, 16});
    EXPECT_TRUE(m.invalid_both({"R=9", "8"}));
  }
  {
    Mimo m;
    m.a.set_shape("v", {2, 12, 4, 257});
    EXPECT_TRUE(m.invalid_both({"P=257", "256"}));
  }
}

TEST(BadInputMimoBwdFwd, ChunkSizeNotAllowed) {
  for (int64_t c : {0, -16, 1, 4, 12, 48, 128, 256}) {
    Mimo m;
    m.chunk = c;
    EXPECT_TRUE(m.invalid_both({"chunk_size"})) << c;
  }
}

TEST(BadInputMimoBwdFwd, RotaryDivisorNotAllowed) {
  for (int64_t r : {0, 1, 3, 8, -2}) {
    Mimo m;
    m.rdd = r;
    EXPECT_TRUE(m.invalid_both({"rotary_dim_divisor"})) << r;
  }
}

TEST(BadInputMimoBwdFwd, GateNeedsZAndMimoZ) {
  {
    Mimo m(true, true, false);
    m.a.drop("mimo_z");
    EXPECT_TRUE(m.invalid_both({"z and mimo_z", "mimo_z is NULL"}));
  }
  {
    Mimo m(true, true, false);
    m.a.drop("z");
    EXPECT_TRUE(m.invalid_both({"z and mimo_z", "z is NULL"}));
  }
}

TEST(BadInputMimoBwdFwd, NormNeedsReduceOAndGate) {
  {
    Mimo m(false, true, false);  // per rank
    for (const char* n : {"norm_weight", "dnorm_weight", "dout_pre_rms"}) m.a.give(n);
    EXPECT_TRUE(m.invalid_both({"norm_weight", "requires mimo_o"}));
  }
  {
    Mimo m(true, false, false);  // no gate
    for (const char* n : {"norm_weight", "dnorm_weight", "dout_pre_rms"}) m.a.give(n);
    EXPECT_TRUE(m.invalid_both({"norm_weight", "requires z and mimo_z"}));
  }
  for (double eps : {0.0, -1e-5, std::numeric_limits<double>::quiet_NaN(),
                     std::numeric_limits<double>::infinity()}) {
    Mimo m;
    m.eps = eps;
    EXPECT_TRUE(m.invalid_both({"norm_eps"})) << eps;
  }
  Mimo m(true, true, false);  // eps is not read without the norm
  m.eps = -1;
  EXPECT_EQ(m.call(), MAMBA3_OK) << mamba3_last_error();
}

// Each optional output exists exactly when its input does.
TEST(BadInputMimoBwdFwd, OutputsPresentExactlyWithTheirInputs) {
  struct Case {
    const char* output;
    const char* input;
  };
  for (const Case& c : {Case{"dmimo_o", "mimo_o"}, Case{"dmimo_z", "z"}, Case{"dz", "z"},
                        Case{"dnorm_weight", "norm_weight"}, Case{"dout_pre_rms", "norm_weight"}}) {
    Mimo m;
    m.a.drop(c.output);
    EXPECT_TRUE(m.invalid_both({(std::string(c.output) + " is required when " + c.input).c_str()}))
        << c.output;
  }
  {
    Mimo m(false, false, false);
    m.a.give("dmimo_o");
    EXPECT_TRUE(m.invalid_both({"dmimo_o must be NULL when mimo_o is NULL"}));
  }
  for (const char* out : {"dmimo_z", "dz"}) {
    Mimo m(true, false, false);
    m.a.give(out);
    EXPECT_TRUE(m.invalid_both({(std::string(out) + " must be NULL when z is NULL").c_str()}));
  }
  for (const char* out : {"dnorm_weight", "dout_pre_rms"}) {
    Mimo m(true, true, false);
    m.a.give(out);
    EXPECT_TRUE(
        m.invalid_both({(std::string(out) + " must be NULL when norm_weight is NULL").c_str()}));
  }
}

TEST(BadInputMimoBwdFwd, ZeroSizes) {
  {
    Mimo m;
    m.a.set_shape("q", {2, 0, 2, 2, 16});
    EXPECT_TRUE(m.invalid_both({"q:", ">= 1"}));
  }
  {
    Mimo m;
    m.a.set_shape("v", {2, 12, 0, 8});
    EXPECT_TRUE(m.invalid_both({"v:", ">= 1"}));
  }
}

TEST(BadInputMimoBwdFwd, MixedDevices) {
  Mimo probe;
  for (const std::string& name : probe.a.names()) {
    if (name == "q") continue;
    Mimo m;
    m.a.t(name).device = DLDevice{kDLCUDA, 0};
    EXPECT_TRUE(m.invalid_both({(name + " is on cuda:0").c_str(), "q is on cpu:0", "same device"}))
        << name;
  }
  Mimo m;
  m.a.t("q").device = DLDevice{kDLCUDA, 0};
  EXPECT_TRUE(m.invalid_both({"is on cpu:0", "q is on cuda:0", "same device"}));
  Mimo g;
  for (const std::string& name : g.a.names()) g.a.t(name).device = DLDevice{kDLCUDA, 0};
  g.a.t("dout_pre_rms").device = DLDevice{kDLCUDA, 1};
  EXPECT_TRUE(g.invalid_both({"dout_pre_rms is on cuda:1", "same device"}));
}

TEST(BadInputMimoBwdFwd, UnsupportedDeviceType) {
  for (const char* name : {"q", "segsum", "norm_weight", "dz"}) {
    for (DLDeviceType dt : {kDLOpenCL, kDLVulkan, kDLMetal, kDLROCM}) {
      Mimo m;
      m.a.t(name).device = DLDevice{dt, 0};
      EXPECT_TRUE(m.invalid_both({(std::string(name) + ":").c_str(), "device type"})) << name;
    }
  }
}

TEST(BadInputMimoBwdFwd, AllOnCudaWithoutCudaBackendIsUnsupported) {
  if (mamba3_has_cuda()) GTEST_SKIP() << "this build has the CUDA backend";
  Mimo m;
  for (const std::string& name : m.a.names()) m.a.t(name).device = DLDevice{kDLCUDA, 0};
  EXPECT_EQ(m.call(), MAMBA3_ERROR_UNSUPPORTED);
  EXPECT_NE(std::string(mamba3_last_error()).find("CUDA"), std::string::npos)
      << mamba3_last_error();
  size_t bytes = 0;
  EXPECT_EQ(m.workspace(&bytes), MAMBA3_ERROR_UNSUPPORTED);
}

}  // namespace

// ================================================================== mamba3_mimo_bwd_bwd

namespace {

using namespace mamba3::test;

// Valid problem: B=2 S=12 H=4 G=2 N=16 P=8 R=2 C=8 (two chunks, the last partial), divisor 4
// (A=4). Options: the dout layout (reduce-O with mimo_o, per rank, packed) and D.
class MimoBB {
 public:
  static constexpr int64_t B = 2, S = 12, H = 4, G = 2, N = 16, P = 8, R = 2, C = 8, A = 4;
  static constexpr int64_t nch = 2;
  enum Layout { kReduceO, kPerRank, kPacked };
  int64_t chunk = C, rdd = 4;
  Args a;

  explicit MimoBB(Layout layout = kReduceO, bool has_d = true) {
    a.add("dout", layout == kReduceO   ? zeros(IoType::BF16, {B, S, H, P})
                  : layout == kPerRank ? zeros(IoType::BF16, {B, S, R, H, P})
                                       : zeros(IoType::F32, {B, H, S * R, P}));
    a.add("q", zeros(IoType::BF16, {B, S, R, G, N}));
    a.add("k", zeros(IoType::BF16, {B, S, R, G, N}));
    a.add("v", zeros(IoType::F16, {B, S, H, P}));
    a.add("q_bias", zeros(IoType::F32, {H, R, N}));
    a.add("k_bias", zeros(IoType::F32, {H, R, N}));
    a.add("mimo_v", zeros(IoType::F32, {H, R, P}));
    a.add("states", zeros(IoType::BF16, {B, H, nch, N, P}));
    a.add("qk_dot", zeros(IoType::F32, {B, H, S, R, R}));
    a.add("da_cs", zeros(IoType::F32, {B, H, S}));
    a.add("da_cs_rev", zeros(IoType::F32, {B, H, S}));
    a.add("dt", zeros(IoType::F32, {B, H, S}));
    a.add("trap", zeros(IoType::BF16, {B, H, S}));
    a.add("segsum", zeros(IoType::F32, {B, H, nch, C, C}));
    a.add("angles", zeros(IoType::F32, {B, S, H, A}));
    a.add("mimo_o", zeros(IoType::F32, {H, R, P}));
    a.add("d", zeros(IoType::F32, {H}));
    a.add("dq", Buffer(IoType::BF16, {B, S * R, H, N}));
    a.add("dk", Buffer(IoType::F16, {B, S * R, H, N}));
    a.add("dv", Buffer(IoType::F32, {B, S, H, P}));
    a.add("dmimo_v", Buffer(IoType::F32, {B, H, R, P}));
    a.add("dangles", Buffer(IoType::F32, {B, S, H, A}));
    a.add("dfactor", Buffer(IoType::F32, {B, H, S}));
    a.add("dgamma", Buffer(IoType::F32, {B, H, S}));
    a.add("dda", Buffer(IoType::F32, {B, H, S}));
    a.add("dssda", Buffer(IoType::F32, {B, H, nch, C, C}));
    a.add("dda_cs_rev", Buffer(IoType::F32, {B, H, S}));
    a.add("dda_cs", Buffer(IoType::F32, {B, H, S}));
    a.add("dd", Buffer(IoType::F32, {B, H}));
    a.defaults_.assign(a.names().size(), true);
    a.defaults_[a.idx("mimo_o")] = layout == kReduceO;
    a.defaults_[a.idx("d")] = a.defaults_[a.idx("dd")] = has_d;
    a.reset();
  }
  mamba3_status call() {
    return mamba3_mimo_bwd_bwd(
        a.p("dout"), a.p("q"), a.p("k"), a.p("v"), a.p("q_bias"), a.p("k_bias"), a.p("mimo_v"),
        a.p("states"), a.p("qk_dot"), a.p("da_cs"), a.p("da_cs_rev"), a.p("dt"), a.p("trap"),
        a.p("segsum"), a.p("angles"), a.p("mimo_o"), a.p("d"), chunk, rdd, a.p("dq"), a.p("dk"),
        a.p("dv"), a.p("dmimo_v"), a.p("dangles"), a.p("dfactor"), a.p("dgamma"), a.p("dda"),
        a.p("dssda"), a.p("dda_cs_rev"), a.p("dda_cs"), a.p("dd"), nullptr, 0, nullptr);
  }
  mamba3_status workspace(size_t* bytes) {
    return mamba3_mimo_bwd_bwd_workspace_size(
        a.p("dout"), a.p("q"), a.p("k"), a.p("v"), a.p("q_bias"), a.p("k_bias"), a.p("mimo_v"),
        a.p("states"), a.p("qk_dot"), a.p("da_cs"), a.p("da_cs_rev"), a.p("dt"), a.p("trap"),
        a.p("segsum"), a.p("angles"), a.p("mimo_o"), a.p("d"), chunk, rdd, a.p("dq"), a.p("dk"),
        a.p("dv"), a.p("dmimo_v"), a.p("dangles"), a.p("dfactor"), a.p("dgamma"), a.p("dda"),
        a.p("dssda"), a.p("dda_cs_rev"), a.p("dda_cs"), a.p("dd"), bytes);
  }
  // Runs the operator and the workspace query; both must fail the same way.
  ::testing::AssertionResult invalid_both(std::initializer_list<const char*> parts) {
    ::testing::AssertionResult r = invalid(call(), parts);
    if (!r) return r;
    size_t bytes = 0;
    return invalid(workspace(&bytes), parts);
  }
};

const std::vector<std::string> kBBRequired = {
    "dout",   "q",     "k",       "v",       "q_bias",     "k_bias", "mimo_v", "states",
    "qk_dot", "da_cs", "da_cs_rev", "dt",    "trap",       "segsum", "angles", "dq",
    "dk",     "dv",    "dmimo_v", "dangles", "dfactor",    "dgamma", "dda",    "dssda",
    "dda_cs_rev", "dda_cs"};
// Tensors whose every dimension is checked against sizes taken from others (q gives B,S,R,G,N;
// v gives H,P), so a wrong size is reported against themselves.
const std::vector<std::string> kBBDerived = {
    "dout",    "k",       "q_bias",  "k_bias", "mimo_v",  "states", "qk_dot",     "da_cs",
    "da_cs_rev", "dt",    "trap",    "segsum", "angles",  "mimo_o", "d",          "dq",
    "dk",      "dv",      "dmimo_v", "dangles", "dfactor", "dgamma", "dda",       "dssda",
    "dda_cs_rev", "dda_cs", "dd"};

TEST(BadInputMimoBwdBwd, ValidBaselineSucceeds) {
  for (auto layout : {MimoBB::kReduceO, MimoBB::kPerRank, MimoBB::kPacked})
    for (bool d : {true, false}) {
      MimoBB m(layout, d);
      ASSERT_EQ(m.call(), MAMBA3_OK) << mamba3_last_error();
      size_t bytes = 1;
      ASSERT_EQ(m.workspace(&bytes), MAMBA3_OK) << mamba3_last_error();
      EXPECT_EQ(bytes, 0u);  // the CPU backend needs no workspace
    }
  for (int64_t c : {8, 16, 32, 64}) {  // all chunk sizes
    MimoBB m;
    m.chunk = c;
    const int64_t nch = (MimoBB::S + c - 1) / c;
    m.a.replace("segsum", zeros(IoType::F32, {MimoBB::B, MimoBB::H, nch, c, c}));
    m.a.replace("dssda", Buffer(IoType::F32, {MimoBB::B, MimoBB::H, nch, c, c}));
    m.a.replace("states", zeros(IoType::F32, {MimoBB::B, MimoBB::H, nch, MimoBB::N, MimoBB::P}));
    EXPECT_EQ(m.call(), MAMBA3_OK) << c << ": " << mamba3_last_error();
  }
  MimoBB m;  // divisor 2
  m.rdd = 2;
  m.a.replace("angles", zeros(IoType::F32, {MimoBB::B, MimoBB::S, MimoBB::H, MimoBB::N / 2}));
  m.a.replace("dangles", Buffer(IoType::F32, {MimoBB::B, MimoBB::S, MimoBB::H, MimoBB::N / 2}));
  EXPECT_EQ(m.call(), MAMBA3_OK) << mamba3_last_error();
}

TEST(BadInputMimoBwdBwd, WorkspaceBytesPointerIsRequired) {
  MimoBB m;
  EXPECT_TRUE(invalid(m.workspace(nullptr), {"workspace_bytes"}));
}

TEST(BadInputMimoBwdBwd, NullRequiredTensor) {
  for (const std::string& name : kBBRequired) {
    MimoBB m;
    m.a.drop(name);
    EXPECT_TRUE(m.invalid_both({(name + " is required").c_str()})) << name;
  }
}

TEST(BadInputMimoBwdBwd, NullDataPointer) {
  for (const std::string& name : {"q", "states", "qk_dot", "dssda", "dd"}) {
    MimoBB m;
    m.a.t(name).data = nullptr;
    EXPECT_TRUE(m.invalid_both({(name + ":").c_str(), "NULL"})) << name;
  }
}

TEST(BadInputMimoBwdBwd, WrongRank) {
  MimoBB probe;
  for (const std::string& name : probe.a.names()) {
    for (int delta : {+1, -1}) {
      MimoBB m;
      std::vector<int64_t> s = m.a.shape(name);
      if (delta > 0)
        s.push_back(1);
      else
        s.pop_back();
      m.a.set_shape(name, s);
      EXPECT_TRUE(m.invalid_both({(name + ":").c_str(), "rank"})) << name << " " << delta;
    }
  }
}

TEST(BadInputMimoBwdBwd, WrongShape) {
  for (auto layout : {MimoBB::kReduceO, MimoBB::kPacked})
    for (const std::string& name : kBBDerived) {
      MimoBB probe(layout);
      if (!probe.a.given(name)) continue;
      const std::vector<int64_t> base = probe.a.shape(name);
      for (size_t dim = 0; dim < base.size(); ++dim) {
        MimoBB m(layout);
        std::vector<int64_t> s = base;
        s[dim] += 1;
        m.a.set_shape(name, s);
        EXPECT_TRUE(m.invalid_both({(name + ":").c_str(), "shape"})) << name << " dim " << dim;
      }
    }
  // The size-defining tensors: a size that disagrees with them is reported where it shows.
  MimoBB m;
  m.a.set_shape("q", {2, 13, 2, 2, 16});  // S=13 while everything else has S=12
  EXPECT_TRUE(m.invalid_both({"S=13"}));
  MimoBB v;
  v.a.set_shape("v", {2, 12, 4, 9});  // P=9
  EXPECT_TRUE(v.invalid_both({"P=9"}));
}

// The dout layout follows mimo_o and dout's rank: reduce-O [B,S,H,P] with mimo_o; without it,
// per rank [B,S,R,H,P] or packed [B,H,S*R,P]. A dout that fits none is named with the choices.
TEST(BadInputMimoBwdBwd, DoutLayout) {
  {
    MimoBB m(MimoBB::kReduceO);  // per-rank dout while mimo_o is given
    m.a.replace("dout",
                zeros(IoType::BF16, {MimoBB::B, MimoBB::S, MimoBB::R, MimoBB::H, MimoBB::P}));
    EXPECT_TRUE(m.invalid_both({"dout:", "mimo_o", "rank 4 [B,S,H,P]"}));
  }
  {
    MimoBB m(MimoBB::kPerRank);  // a reduce-O dout without mimo_o reads as a (wrong) packed one
    m.a.replace("dout", zeros(IoType::BF16, {MimoBB::B, MimoBB::S, MimoBB::H, MimoBB::P}));
    EXPECT_TRUE(m.invalid_both({"dout:", "S*R="}));
  }
  {
    MimoBB m(MimoBB::kPacked);
    m.a.set_shape("dout", {MimoBB::B, MimoBB::H * MimoBB::S * MimoBB::R * MimoBB::P});
    EXPECT_TRUE(m.invalid_both({"dout:", "rank 5 [B,S,R,H,P]", "rank 4 [B,H,S*R,P]"}));
  }
  {
    MimoBB m(MimoBB::kPacked);  // [B,H,S,R*P] is not the packed layout
    m.a.set_shape("dout", {MimoBB::B, MimoBB::H, MimoBB::S, MimoBB::R * MimoBB::P});
    EXPECT_TRUE(m.invalid_both({"dout:", "[B=2,H=4,S*R=24,P=8]"}));
  }
}

TEST(BadInputMimoBwdBwd, WrongInputDtype) {
  struct Case {
    const char* name;
    DLDataType t;
  };
  for (const Case& c :
       {Case{"dout", kF64}, Case{"q", kI32}, Case{"k", kF64}, Case{"v", kI64},
        Case{"q_bias", kF64}, Case{"k_bias", kI32}, Case{"mimo_v", kF64}, Case{"states", kF64},
        Case{"qk_dot", kI32}, Case{"da_cs", kI64}, Case{"da_cs_rev", kF64}, Case{"dt", kI32},
        Case{"trap", kF64}, Case{"segsum", kI32}, Case{"angles", kF64}, Case{"mimo_o", kI32},
        Case{"d", kI64}, Case{"q", dl_type(kDLFloat, 8)}, Case{"dt", dl_type(kDLFloat, 32, 4)}}) {
    MimoBB m;
    m.a.t(c.name).dtype = c.t;
    EXPECT_TRUE(m.invalid_both({(std::string(c.name) + ":").c_str()})) << c.name;
  }
}

TEST(BadInputMimoBwdBwd, WrongOutputDtype) {
  // dq / dk / dv: any of f16, bf16, f32, each on its own; everything else float32.
  for (const char* name : {"dq", "dk", "dv"})
    for (DLDataType t : {kF64, kI32}) {
      MimoBB m;
      m.a.t(name).dtype = t;
      EXPECT_TRUE(m.invalid_both({(std::string(name) + ":").c_str(), "dtype"})) << name;
    }
  for (const char* name : {"dmimo_v", "dangles", "dfactor", "dgamma", "dda", "dssda",
                           "dda_cs_rev", "dda_cs", "dd"})
    for (DLDataType t : {kBF16, kF16, kF64}) {
      MimoBB m;
      m.a.t(name).dtype = t;
      EXPECT_TRUE(m.invalid_both({(std::string(name) + ":").c_str(), "expected dtype float32"}))
          << name;
    }
  MimoBB m;  // (buffers of the new dtypes: the call writes them)
  using B = MimoBB;
  m.a.replace("dq", Buffer(IoType::F32, {B::B, B::S * B::R, B::H, B::N}));
  m.a.replace("dk", Buffer(IoType::BF16, {B::B, B::S * B::R, B::H, B::N}));
  m.a.replace("dv", Buffer(IoType::BF16, {B::B, B::S, B::H, B::P}));
  EXPECT_EQ(m.call(), MAMBA3_OK) << mamba3_last_error();
}

TEST(BadInputMimoBwdBwd, DdPresentExactlyWithD) {
  {
    MimoBB m;
    m.a.drop("dd");
    EXPECT_TRUE(m.invalid_both({"dd is required when d is given"}));
  }
  {
    MimoBB m(MimoBB::kReduceO, false);
    m.a.give("dd");
    EXPECT_TRUE(m.invalid_both({"dd must be NULL when d is NULL"}));
  }
}

TEST(BadInputMimoBwdBwd, HeadsNotMultipleOfGroups) {
  MimoBB m;
  for (const char* name : {"q", "k"}) m.a.set_shape(name, {2, 12, 2, 3, 16});  // G=3, H=4
  EXPECT_TRUE(m.invalid_both({"H % G", "H=4", "G=3"}));
}

// Shapes of a problem with another N (q, k, biases, angles, states, dq, dk, dangles follow it).
void set_n(MimoBB& m, int64_t N, int64_t rdd) {
  m.rdd = rdd;
  for (const char* name : {"q", "k"}) m.a.set_shape(name, {2, 12, 2, 2, N});
  for (const char* name : {"q_bias", "k_bias"}) m.a.set_shape(name, {4, 2, N});
  for (const char* name : {"angles", "dangles"}) m.a.set_shape(name, {2, 12, 4, N / rdd});
  for (const char* name : {"dq", "dk"}) m.a.set_shape(name, {2, 24, 4, N});
  m.a.set_shape("states", {2, 4, 2, N, 8});
}

TEST(BadInputMimoBwdBwd, HeadDimNotAllowed) {
  {
    MimoBB m;
    set_n(m, 15, 4);
    EXPECT_TRUE(m.invalid_both({"N=15", "even"}));
  }
  {
    MimoBB m;
    set_n(m, 258, 2);
    EXPECT_TRUE(m.invalid_both({"N=258", "256"}));
  }
  {
    MimoBB m;  // N=18 is even but has no quarter for rotary_dim_divisor 4
    set_n(m, 18, 4);
    EXPECT_TRUE(m.invalid_both({"N=18", "rotary_dim_divisor=4"}));
  }
  {
    MimoBB m;  // angles with N/2 pairs under divisor 4
    m.a.set_shape("angles", {2, 12, 4, 8});
    EXPECT_TRUE(m.invalid_both({"angles:", "A=4", "rotary_dim_divisor"}));
  }
}

TEST(BadInputMimoBwdBwd, RankOrValueDimTooLarge) {
  {
    MimoBB m;
    for (const char* name : {"q", "k"}) m.a.set_shape(name, {2, 12, 9, 2, 16});
    EXPECT_TRUE(m.invalid_both({"R=9", "8"}));
  }
  {
    MimoBB m;
    m.a.set_shape("v", {2, 12, 4, 257});
    EXPECT_TRUE(m.invalid_both({"P=257", "256"}));
  }
}

TEST(BadInputMimoBwdBwd, ChunkSizeNotAllowed) {
  for (int64_t c : {0, -16, 1, 4, 12, 48, 128}) {
    MimoBB m;
    m.chunk = c;
    EXPECT_TRUE(m.invalid_both({"chunk_size"})) << c;
  }
}

TEST(BadInputMimoBwdBwd, RotaryDivisorNotAllowed) {
  for (int64_t r : {0, 1, 3, 8, -2}) {
    MimoBB m;
    m.rdd = r;
    EXPECT_TRUE(m.invalid_both({"rotary_dim_divisor"})) << r;
  }
}

TEST(BadInputMimoBwdBwd, ZeroSizes) {
  MimoBB m;
  m.a.set_shape("q", {2, 0, 2, 2, 16});
  EXPECT_TRUE(m.invalid_both({"q:", ">= 1"}));
  MimoBB v;
  v.a.set_shape("v", {2, 12, 0, 8});
  EXPECT_TRUE(v.invalid_both({"v:", ">= 1"}));
}

TEST(BadInputMimoBwdBwd, MixedDevices) {
  MimoBB probe;
  for (const std::string& name : probe.a.names()) {
    if (name == "q") continue;
    MimoBB m;
    m.a.t(name).device = DLDevice{kDLCUDA, 0};
    EXPECT_TRUE(m.invalid_both({(name + " is on cuda:0").c_str(), "q is on cpu:0", "same device"}))
        << name;
  }
  MimoBB g;
  for (const std::string& name : g.a.names()) g.a.t(name).device = DLDevice{kDLCUDA, 0};
  g.a.t("dd").device = DLDevice{kDLCUDA, 1};
  EXPECT_TRUE(g.invalid_both({"dd is on cuda:1", "same device"}));
}

TEST(BadInputMimoBwdBwd, UnsupportedDeviceType) {
  for (const char* name : {"q", "states", "dssda"}) {
    MimoBB m;
    m.a.t(name).device = DLDevice{kDLOpenCL, 0};
    EXPECT_TRUE(m.invalid_both({(std::string(name) + ":").c_str(), "device type"})) << name;
  }
}

// A build without the CUDA backend refuses CUDA tensors (never the CPU path on device memory).
TEST(BadInputMimoBwdBwd, AllOnCudaWithoutCudaBackendIsUnsupported) {
  if (mamba3_has_cuda()) GTEST_SKIP() << "this build has the CUDA backend";
  MimoBB m;
  for (const std::string& name : m.a.names()) m.a.t(name).device = DLDevice{kDLCUDA, 0};
  EXPECT_EQ(m.call(), MAMBA3_ERROR_UNSUPPORTED);
  const std::string msg = mamba3_last_error();
  EXPECT_NE(msg.find("mimo_bwd_bwd"), std::string::npos) << msg;
  EXPECT_NE(msg.find("no CUDA backend"), std::string::npos) << msg;
  size_t bytes = 0;
  EXPECT_EQ(m.workspace(&bytes), MAMBA3_ERROR_UNSUPPORTED);
}

}  // namespace
