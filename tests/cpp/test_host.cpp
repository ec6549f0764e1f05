// Host helpers of the golden library: software fp16/bf16 rounding, Buffer layout and the
// accuracy rule (SPEC.md section 3).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>

#include "mamba3_golden/host.hpp"

using namespace mamba3::golden;

namespace {

uint16_t bits16(double x, IoType t) {
  uint16_t b = 0;
  encode(x, t, &b);
  return b;
}
double from16(uint16_t b, IoType t) { return decode(&b, t); }
const double kInf = std::numeric_limits<double>::infinity();

}  // namespace

TEST(HostRounding, HalfKnownValues) {
  EXPECT_EQ(bits16(1.0, IoType::F16), 0x3C00);
  EXPECT_EQ(bits16(-2.0, IoType::F16), 0xC000);
  EXPECT_EQ(bits16(0.1, IoType::F16), 0x2E66);
  EXPECT_EQ(round_to(0.1, IoType::F16), 0.0999755859375);
  EXPECT_EQ(bits16(65504.0, IoType::F16), 0x7BFF);
  EXPECT_EQ(bits16(0.0, IoType::F16), 0x0000);
  EXPECT_EQ(bits16(-0.0, IoType::F16), 0x8000);
  EXPECT_EQ(bits16(std::ldexp(1.0, -14), IoType::F16), 0x0400);  // smallest normal
  EXPECT_EQ(from16(0x3555, IoType::F16), 0.333251953125);
  EXPECT_EQ(from16(0x7BFF, IoType::F16), 65504.0);
  EXPECT_EQ(from16(0xFC00, IoType::F16), -kInf);
  EXPECT_TRUE(std::isnan(from16(0x7E00, IoType::F16)));
}

TEST(HostRounding, HalfTiesToEven) {
  // 1 + 2^-11 lies halfway between 1 (even mantissa) and 1 + 2^-10 (odd): goes down.
  EXPECT_EQ(round_to(1.0 + std::ldexp(1.0, -11), IoType::F16), 1.0);
  // 1 + 3*2^-11 lies halfway between 1 + 2^-10 (odd) and 1 + 2^-9 (even): goes up.
  EXPECT_EQ(round_to(1.0 + 3 * std::ldexp(1.0, -11), IoType::F16), 1.0 + std::ldexp(1.0, -9));
  // Just above a tie rounds up.
  EXPECT_EQ(round_to(1.0 + std::ldexp(1.0, -11) + std::ldexp(1.0, -30), IoType::F16),
            1.0 + std::ldexp(1.0, -10));
  EXPECT_EQ(round_to(-(1.0 + std::ldexp(1.0, -11)), IoType::F16), -1.0);
  EXPECT_EQ(round_to(2049.0, IoType::F16), 2048.0);
  EXPECT_EQ(round_to(2051.0, IoType::F16), 2052.0);
}

TEST(HostRounding, HalfSubnormals) {
  const double tiny = std::ldexp(1.0, -24);  // smallest subnormal
  EXPECT_EQ(bits16(tiny, IoType::F16), 0x0001);
  EXPECT_EQ(round_to(tiny / 2, IoType::F16), 0.0);                   // tie -> 0 (even)
  EXPECT_EQ(round_to(tiny * 0.5000001, IoType::F16), tiny);          // above tie
  EXPECT_EQ(round_to(tiny * 1.5, IoType::F16), 2 * tiny);            // tie 1|2 -> 2
  EXPECT_EQ(round_to(tiny * 2.5, IoType::F16), 2 * tiny);            // tie 2|3 -> 2
  EXPECT_EQ(bits16(1023 * tiny, IoType::F16), 0x03FF);               // largest subnormal
  EXPECT_EQ(bits16(1023.5 * tiny, IoType::F16), 0x0400);             // rounds into normals
  EXPECT_EQ(from16(0x0001, IoType::F16), tiny);
  EXPECT_EQ(from16(0x8200, IoType::F16), -512 * tiny);
  EXPECT_EQ(round_to(std::ldexp(1.0, -40), IoType::F16), 0.0);
  EXPECT_TRUE(std::signbit(round_to(-std::ldexp(1.0, -40), IoType::F16)));
}

TEST(HostRounding, HalfOverflowAndSpecials) {
  EXPECT_EQ(round_to(65519.99, IoType::F16), 65504.0);
  EXPECT_EQ(round_to(65520.0, IoType::F16), kInf);  // tie with 65536 (even) -> overflow
  EXPECT_EQ(round_to(-1e6, IoType::F16), -kInf);
  EXPECT_EQ(bits16(1e6, IoType::F16), 0x7C00);
  EXPECT_EQ(bits16(-kInf, IoType::F16), 0xFC00);
  const uint16_t nb = bits16(std::numeric_limits<double>::quiet_NaN(), IoType::F16);
  EXPECT_EQ(nb & 0x7C00, 0x7C00);
  EXPECT_NE(nb & 0x03FF, 0);
  EXPECT_TRUE(std::isnan(round_to(std::nan(""), IoType::F16)));
}

TEST(HostRounding, Bf16KnownValues) {
  EXPECT_EQ(bits16(1.0, IoType::BF16), 0x3F80);
  EXPECT_EQ(bits16(-1.0, IoType::BF16), 0xBF80);
  EXPECT_EQ(bits16(M_PI, IoType::BF16), 0x4049);
  EXPECT_EQ(round_to(M_PI, IoType::BF16), 3.140625);
  EXPECT_EQ(round_to(1.0 + std::ldexp(1.0, -8), IoType::BF16), 1.0);  // tie -> even
  EXPECT_EQ(round_to(1.0 + 3 * std::ldexp(1.0, -8), IoType::BF16), 1.0 + std::ldexp(1.0, -6));
  EXPECT_EQ(from16(0x7F7F, IoType::BF16), std::ldexp(2.0 - std::ldexp(1.0, -7), 127));
  // Largest finite float32 is beyond the bf16 overflow tie.
  EXPECT_EQ(round_to(std::numeric_limits<float>::max(), IoType::BF16), kInf);
  EXPECT_EQ(bits16(-1e300, IoType::BF16), 0xFF80);
  // Subnormals: smallest is 2^-133; half of it ties to 0.
  EXPECT_EQ(bits16(std::ldexp(1.0, -133), IoType::BF16), 0x0001);
  EXPECT_EQ(round_to(std::ldexp(1.0, -134), IoType::BF16), 0.0);
  EXPECT_EQ(round_to(3 * std::ldexp(1.0, -134), IoType::BF16), std::ldexp(1.0, -132));
  EXPECT_TRUE(std::isnan(from16(bits16(std::nan(""), IoType::BF16), IoType::BF16)));
}

// Every finite 16-bit pattern survives decode -> encode, and decode is monotone in the
// magnitude bits (so the formats are decoded consistently with their ordering).
TEST(HostRounding, ExhaustiveRoundTrip) {
  for (IoType t : {IoType::F16, IoType::BF16}) {
    double prev = -1;
    for (uint32_t b = 0; b < 0x8000; ++b) {
      const double v = from16(static_cast<uint16_t>(b), t);
      if (std::isnan(v)) continue;
      EXPECT_EQ(bits16(v, t), b) << io_name(t) << " pattern " << b;
      EXPECT_EQ(bits16(-v, t), b | 0x8000) << io_name(t) << " pattern " << b;
      EXPECT_GT(v, prev) << io_name(t) << " pattern " << b;
      prev = v;
    }
  }
}

// Random doubles over the whole range: the result is a nearest representable value, with ties
// to the even pattern.
TEST(HostRounding, RandomNearestEven) {
  std::mt19937_64 rng(7);
  for (IoType t : {IoType::F16, IoType::BF16}) {
    const int emin = t == IoType::F16 ? -26 : -135, emax = t == IoType::F16 ? 16 : 128;
    for (int it = 0; it < 200000; ++it) {
      const double m = 1.0 + static_cast<double>(rng() >> 11) * 0x1.0p-53;
      const int e = emin + static_cast<int>(rng() % (emax - emin + 1));
      const double x = std::ldexp(m, e) * ((rng() & 1) ? -1 : 1);
      const uint16_t b = bits16(x, t);
      const double r = from16(b, t);
      ASSERT_EQ(round_to(x, t), r);
      if (std::isinf(r)) {
        const uint16_t maxb = t == IoType::F16 ? 0x7BFF : 0x7F7F;
        const double maxf = from16(maxb, t);
        const double ulp = maxf - from16(maxb - 1, t);
        ASSERT_GE(std::fabs(x), maxf + ulp / 2) << x;
        continue;
      }
      const uint16_t mag = b & 0x7FFF;
      const double err = std::fabs(x - r);
      // Neighbours with the same sign (below zero the neighbour is the other sign's smallest).
      const double up = std::fabs(from16(static_cast<uint16_t>(mag + 1), t));
      const double down = mag ? std::fabs(from16(static_cast<uint16_t>(mag - 1), t)) : 0.0;
      const double ax = std::fabs(x);
      if (!std::isinf(up)) {
        ASSERT_LE(err, std::fabs(ax - up)) << x;
      }
      ASSERT_LE(err, std::fabs(ax - down)) << x;
      if (err == std::fabs(ax - up) || (mag && err == std::fabs(ax - down))) {
        ASSERT_EQ(mag & 1, 0) << "tie not to even at " << x;
      }
    }
  }
}

#ifdef __FLT16_MAX__
// Where the compiler has a native half type, its conversion (IEEE round-to-nearest-even) is an
// independent reference.
TEST(HostRounding, HalfMatchesNativeConversion) {
  std::mt19937_64 rng(11);
  for (int it = 0; it < 200000; ++it) {
    const double m = 1.0 + static_cast<double>(rng() >> 11) * 0x1.0p-53;
    const int e = -27 + static_cast<int>(rng() % 45);
    const double x = std::ldexp(m, e) * ((rng() & 1) ? -1 : 1);
    const _Float16 h = static_cast<_Float16>(x);
    uint16_t hb;
    std::memcpy(&hb, &h, 2);
    ASSERT_EQ(bits16(x, IoType::F16), hb) << x;
  }
}
#endif

TEST(HostRounding, OtherTypes) {
  EXPECT_EQ(round_to(0.1, IoType::F32), static_cast<double>(0.1f));
  EXPECT_EQ(round_to(0.1, IoType::F64), 0.1);
  EXPECT_EQ(round_to(2.5, IoType::I32), 2.0);
  unsigned char buf[8];
  encode(-123456789012.0, IoType::I64, buf);
  EXPECT_EQ(decode(buf, IoType::I64), -123456789012.0);
  encode(0.1, IoType::F32, buf);
  EXPECT_EQ(decode(buf, IoType::F32), static_cast<double>(0.1f));
  EXPECT_EQ(io_size(IoType::BF16), 2);
  EXPECT_EQ(io_dl(IoType::BF16).code, kDLBfloat);
  EXPECT_EQ(io_dl(IoType::I64).bits, 64);
}

TEST(HostBuffer, CompactLayoutAndPoison) {
  Buffer f(IoType::F16, {2, 3, 4});
  EXPECT_EQ(f.numel(), 24);
  EXPECT_EQ(f.strides, (std::vector<int64_t>{12, 4, 1}));
  EXPECT_EQ(f.bytes.size(), 48u);
  for (int64_t i = 0; i < f.numel(); ++i) EXPECT_TRUE(std::isnan(f.get(i)));
  Buffer n(IoType::I32, {5});
  for (unsigned char c : n.bytes) EXPECT_EQ(c, 0x7f);
  EXPECT_EQ(n.get(0), 0x7f7f7f7f);
  Buffer l(IoType::I64, {2});
  EXPECT_EQ(l.get(1), static_cast<double>(0x7f7f7f7f7f7f7f7fLL));
}

TEST(HostBuffer, PaddedStridesAndValues) {
  std::mt19937_64 rng(3);
  const std::vector<int64_t> shape{2, 3, 4};
  const auto v = uniform(rng, 24, -1, 1, IoType::BF16);
  Buffer b = Buffer::from_double(IoType::BF16, shape, v);
  EXPECT_EQ(b.to_double(), v);
  Buffer p = b.padded(3);
  EXPECT_EQ(p.shape, shape);
  EXPECT_EQ(p.strides, (std::vector<int64_t>{21, 7, 1}));
  EXPECT_GE(p.bytes.size(), static_cast<size_t>(2 * 21 * 2));
  EXPECT_EQ(p.to_double(), v);
  EXPECT_EQ(p.offset({1, 2, 3}), 21 + 14 + 3);
  EXPECT_EQ(p.get(23), decode(p.bytes.data() + 2 * (21 + 14 + 3), IoType::BF16));
  // The pad elements are poisoned, not zero.
  EXPECT_TRUE(std::isnan(decode(p.bytes.data() + 2 * 4, IoType::BF16)));
  DLTensor* t = p.tensor();
  EXPECT_EQ(t->ndim, 3);
  EXPECT_EQ(t->strides, p.strides.data());
  EXPECT_EQ(t->shape, p.shape.data());
  EXPECT_EQ(t->data, p.bytes.data());
  EXPECT_EQ(t->device.device_type, kDLCPU);
  EXPECT_EQ(t->dtype.code, kDLBfloat);
  EXPECT_EQ(t->strides[1], 7);

  // One dimension: elements are spread so that the tensor is not contiguous either.
  Buffer one = Buffer::from_double(IoType::F32, {5}, {1, 2, 3, 4, 5});
  Buffer onep = one.padded(2);
  EXPECT_EQ(onep.strides, (std::vector<int64_t>{3}));
  EXPECT_EQ(onep.to_double(), (std::vector<double>{1, 2, 3, 4, 5}));
}

TEST(HostBuffer, CopiesPointAtTheirOwnStorage) {
  Buffer a = Buffer::from_double(IoType::F32, {2, 2}, {1, 2, 3, 4});
  a.tensor();
  Buffer b(a);
  EXPECT_EQ(b.dl.data, b.bytes.data());
  EXPECT_EQ(b.dl.shape, b.shape.data());
  EXPECT_EQ(b.dl.strides, b.strides.data());
  Buffer c;
  c = a;
  EXPECT_EQ(c.dl.data, c.bytes.data());
  EXPECT_NE(c.dl.data, a.dl.data);
  c.set(0, 9);
  EXPECT_EQ(a.get(0), 1.0);
  EXPECT_EQ(c.tensor()->shape[1], 2);
}

TEST(HostUniform, DeterministicRoundedInRange) {
  std::mt19937_64 r1(5), r2(5);
  const auto a = uniform(r1, 1000, -2, 3, IoType::F16);
  const auto b = uniform(r2, 1000, -2, 3, IoType::F16);
  EXPECT_EQ(a, b);
  for (double x : a) {
    EXPECT_GE(x, -2);
    EXPECT_LE(x, 3);
    EXPECT_EQ(round_to(x, IoType::F16), x);
  }
}

TEST(HostCompare, PassFailRule) {
  const std::vector<double> g{1, -2, 3, 4};
  // Exact candidate passes.
  Accuracy a = compare(g, g, g, IoType::F32);
  EXPECT_TRUE(a.pass);
  EXPECT_EQ(a.rel_l2, 0);
  EXPECT_EQ(a.metric, "rel_l2");

  // Error within tolerance and within 2x the reference's error.
  std::vector<double> c = g, r = g;
  c[2] += 3e-5;  // ||e|| / ||g|| = 3e-5 / sqrt(30) ~ 5.5e-6
  r[1] += 2e-5;
  a = compare(c, g, r, IoType::F32);
  EXPECT_NEAR(a.rel_l2, 3e-5 / std::sqrt(30.0), 1e-12);
  EXPECT_NEAR(a.ref_rel_l2, 2e-5 / std::sqrt(30.0), 1e-12);
  EXPECT_TRUE(a.pass);
  // Worse than 2x the reference (and above tolerance/100) fails.
  r = g;
  r[1] += 1e-6;
  a = compare(c, g, r, IoType::F32);
  EXPECT_FALSE(a.pass);
  // A nearly exact reference does not fail a candidate within tolerance/100.
  c = g;
  c[0] += 5e-8;
  a = compare(c, g, g, IoType::F32);
  EXPECT_TRUE(a.pass);
  // Above the tolerance fails even if the reference is as bad.
  c = g;
  c[0] += 1e-3;
  a = compare(c, g, c, IoType::F32);
  EXPECT_FALSE(a.pass);
  a = compare(c, g, c, IoType::BF16);  // 1e-3/sqrt(30) < 1e-2
  EXPECT_TRUE(a.pass);
  EXPECT_DOUBLE_EQ(tolerance_for(IoType::F16), 2e-3);
  EXPECT_DOUBLE_EQ(tolerance_for(IoType::BF16), 1e-2);
  EXPECT_DOUBLE_EQ(tolerance_for(IoType::F32), 1e-5);
}

TEST(HostCompare, NonFiniteNeverPasses) {
  const std::vector<double> g{1, 2, 3};
  std::vector<double> c = g;
  c[1] = std::nan("");
  Accuracy a = compare(c, g, g, IoType::BF16);
  EXPECT_FALSE(a.finite);
  EXPECT_FALSE(a.pass);
  c[1] = kInf;
  a = compare(c, g, c, IoType::BF16);
  EXPECT_FALSE(a.pass);
  a = compare(c, g, g, IoType::BF16, true);
  EXPECT_FALSE(a.pass);
  // Size mismatch (an output not produced) fails too.
  a = compare({1, 2}, g, g, IoType::F32);
  EXPECT_FALSE(a.pass);
}

TEST(HostCompare, NearZeroUsesMaxRel) {
  const std::vector<double> g{1e-3, -4, 2, 0};
  std::vector<double> c = g;
  c[0] += 3e-5;  // max_rel = 7.5e-6 (rel_l2 would be smaller)
  Accuracy a = compare(c, g, c, IoType::F32, true);
  EXPECT_EQ(a.metric, "max_rel");
  EXPECT_NEAR(a.max_rel, 7.5e-6, 1e-15);
  EXPECT_NEAR(a.value(), 7.5e-6, 1e-15);
  EXPECT_NEAR(a.ref_value(), 7.5e-6, 1e-15);
  EXPECT_TRUE(a.pass);
  c[0] += 3e-5;  // 1.5e-5 > tolerance
  a = compare(c, g, g, IoType::F32, true);
  EXPECT_FALSE(a.pass);
}

TEST(HostCompare, ZeroGoldenUsesAbsoluteError) {
  const std::vector<double> g(4, 0.0);
  std::vector<double> c(4, 0.0);
  Accuracy a = compare(c, g, g, IoType::F32);
  EXPECT_TRUE(a.pass);
  c[3] = 3e-6;
  a = compare(c, g, c, IoType::F32);
  EXPECT_NEAR(a.rel_l2, 3e-6, 1e-18);
  EXPECT_TRUE(a.pass);
  c[3] = 1.0;
  a = compare(c, g, c, IoType::F32);
  EXPECT_FALSE(a.pass);
}
