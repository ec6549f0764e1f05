// Host helpers: software rounding to fp16 / bf16, DLTensor-backed buffers, random data and the
// accuracy rule of SPEC.md section 3.
#include "mamba3_golden/host.hpp"

#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>

namespace mamba3::golden {

const char* io_name(IoType t) {
  switch (t) {
    case IoType::F16: return "float16";
    case IoType::BF16: return "bfloat16";
    case IoType::F32: return "float32";
    case IoType::F64: return "float64";
    case IoType::I32: return "int32";
    case IoType::I64: return "int64";
  }
  return "?";
}

int io_size(IoType t) {
  switch (t) {
    case IoType::F16:
    case IoType::BF16: return 2;
    case IoType::F32:
    case IoType::I32: return 4;
    case IoType::F64:
    case IoType::I64: return 8;
  }
  return 0;
}

DLDataType io_dl(IoType t) {
  DLDataType d{};
  d.lanes = 1;
  d.bits = static_cast<uint8_t>(8 * io_size(t));
  switch (t) {
    case IoType::F16:
    case IoType::F32:
    case IoType::F64: d.code = kDLFloat; break;
    case IoType::BF16: d.code = kDLBfloat; break;
    case IoType::I32:
    case IoType::I64: d.code = kDLInt; break;
  }
  return d;
}

namespace {

bool is_float(IoType t) { return t != IoType::I32 && t != IoType::I64; }

// Binary format with `mbits` stored mantissa bits and normal exponents in [emin, emax].
struct Fmt {
  int mbits, emin, emax;
};
constexpr Fmt kHalf{10, -14, 15};
constexpr Fmt kBf16{7, -126, 127};

// Round-to-nearest-even of a finite double to the format, done on the double itself: the spacing
// of representable values around |x| is a power of two, so x / quantum is exact and nearbyint
// (default rounding mode: ties to even) does the rounding. Subnormals share the quantum of the
// smallest normal binade; results beyond the largest finite value become inf.
double round_fmt(double x, const Fmt& f) {
  if (std::isnan(x) || std::isinf(x) || x == 0.0) return x;
  int e2 = 0;
  std::frexp(std::fabs(x), &e2);  // |x| = m * 2^e2, m in [0.5, 1): leading bit has exponent e2-1
  const int lead = std::max(e2 - 1, f.emin);
  const double quantum = std::ldexp(1.0, lead - f.mbits);
  const double r = std::nearbyint(x / quantum) * quantum;
  const double maxfinite = std::ldexp(2.0 - std::ldexp(1.0, -f.mbits), f.emax);
  if (std::fabs(r) > maxfinite) return std::copysign(std::numeric_limits<double>::infinity(), x);
  return r;
}

uint16_t half_bits(double x) {
  if (std::isnan(x)) return 0x7E00;
  const double r = round_fmt(x, kHalf);
  const uint16_t sign = std::signbit(r) ? 0x8000 : 0;
  const double a = std::fabs(r);
  if (std::isinf(a)) return sign | 0x7C00;
  if (a == 0.0) return sign;
  int e2 = 0;
  std::frexp(a, &e2);
  const int e = e2 - 1;
  if (e < kHalf.emin) {  // subnormal: value = mant * 2^-24
    return sign | static_cast<uint16_t>(std::ldexp(a, 24));
  }
  const uint16_t mant = static_cast<uint16_t>(std::ldexp(a, -e) * 1024.0 - 1024.0);
  return sign | static_cast<uint16_t>((e + 15) << 10) | mant;
}

double half_value(uint16_t h) {
  const double sign = (h & 0x8000) ? -1.0 : 1.0;
  const int ex = (h >> 10) & 0x1F;
  const int mant = h & 0x3FF;
  if (ex == 0x1F) return mant ? std::numeric_limits<double>::quiet_NaN() : sign * INFINITY;
  if (ex == 0) return sign * std::ldexp(static_cast<double>(mant), -24);
  return sign * std::ldexp(1.0 + mant / 1024.0, ex - 15);
}

uint16_t bf16_bits(double x) {
  if (std::isnan(x)) return std::signbit(x) ? 0xFFC0 : 0x7FC0;
  // The rounded value is exactly representable in float32, so the cast is exact and the
  // bfloat16 pattern is its upper half.
  const float f = static_cast<float>(round_fmt(x, kBf16));
  uint32_t u = 0;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>(u >> 16);
}

double bf16_value(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f = 0;
  std::memcpy(&f, &u, 4);
  return f;
}

}  // namespace

double round_to(double x, IoType t) {
  switch (t) {
    case IoType::F16: return std::isnan(x) ? x : round_fmt(x, kHalf);
    case IoType::BF16: return std::isnan(x) ? x : round_fmt(x, kBf16);
    case IoType::F32: return static_cast<double>(static_cast<float>(x));  // hardware RNE
    case IoType::F64: return x;
    case IoType::I32: return static_cast<double>(static_cast<int32_t>(std::nearbyint(x)));
    case IoType::I64: return static_cast<double>(static_cast<int64_t>(std::nearbyint(x)));
  }
  return x;
}

void encode(double x, IoType t, void* dst) {
  switch (t) {
    case IoType::F16: {
      const uint16_t h = half_bits(x);
      std::memcpy(dst, &h, 2);
      return;
    }
    case IoType::BF16: {
      const uint16_t b = bf16_bits(x);
      std::memcpy(dst, &b, 2);
      return;
    }
    case IoType::F32: {
      const float f = static_cast<float>(x);
      std::memcpy(dst, &f, 4);
      return;
    }
    case IoType::F64: std::memcpy(dst, &x, 8); return;
    case IoType::I32: {
      const int32_t i = static_cast<int32_t>(std::nearbyint(x));
      std::memcpy(dst, &i, 4);
      return;
    }
    case IoType::I64: {
      const int64_t i = static_cast<int64_t>(std::nearbyint(x));
      std::memcpy(dst, &i, 8);
      return;
    }
  }
}

double decode(const void* src, IoType t) {
  switch (t) {
    case IoType::F16: {
      uint16_t h;
      std::memcpy(&h, src, 2);
      return half_value(h);
    }
    case IoType::BF16: {
      uint16_t b;
      std::memcpy(&b, src, 2);
      return bf16_value(b);
    }
    case IoType::F32: {
      float f;
      std::memcpy(&f, src, 4);
      return f;
    }
    case IoType::F64: {
      double d;
      std::memcpy(&d, src, 8);
      return d;
    }
    case IoType::I32: {
      int32_t i;
      std::memcpy(&i, src, 4);
      return i;
    }
    case IoType::I64: {
      int64_t i;
      std::memcpy(&i, src, 8);
      return static_cast<double>(i);
    }
  }
  return 0;
}

// ---------------------------------------------------------------------------------- Buffer

Buffer::Buffer(IoType t, std::vector<int64_t> shp) : type(t), shape(std::move(shp)) {
  strides.assign(shape.size(), 1);
  for (int64_t d = static_cast<int64_t>(shape.size()) - 2; d >= 0; --d)
    strides[d] = strides[d + 1] * shape[d + 1];
  bytes.resize(static_cast<size_t>(numel() * io_size(t)));
  poison();
}

Buffer::Buffer(const Buffer& o) : type(o.type), shape(o.shape), strides(o.strides), bytes(o.bytes) {
  tensor();  // dl must point into this object's vectors, not the source's
}

Buffer& Buffer::operator=(const Buffer& o) {
  if (this != &o) {
    type = o.type;
    shape = o.shape;
    strides = o.strides;
    bytes = o.bytes;
    tensor();
  }
  return *this;
}

Buffer Buffer::padded(int64_t pad) const {
  Buffer r;
  r.type = type;
  r.shape = shape;
  const int64_t nd = static_cast<int64_t>(shape.size());
  r.strides.assign(shape.size(), 1);
  if (nd == 1) {
    // A single dimension has no row pitch to pad: spread the elements instead.
    r.strides[0] = 1 + pad;
  } else if (nd >= 2) {
    r.strides[nd - 2] = shape[nd - 1] + pad;
    for (int64_t d = nd - 3; d >= 0; --d) r.strides[d] = r.strides[d + 1] * shape[d + 1];
  }
  // Allocation = one past the furthest addressed element (at least the padded extent).
  int64_t span = 1;
  if (numel() == 0) {
    span = 0;
  } else {
    for (int64_t d = 0; d < nd; ++d) span += (shape[d] - 1) * r.strides[d];
    if (nd >= 1) span += pad;  // keep the trailing pad so every row has the same pitch
  }
  r.bytes.resize(static_cast<size_t>(span * io_size(type)));
  r.poison();
  const int64_t n = numel();
  for (int64_t i = 0; i < n; ++i) r.set(i, get(i));
  r.tensor();
  return r;
}

int64_t Buffer::numel() const {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

int64_t Buffer::offset(const std::vector<int64_t>& idx) const {
  int64_t off = 0;
  for (size_t d = 0; d < idx.size() && d < strides.size(); ++d) off += idx[d] * strides[d];
  return off;
}

namespace {
// Element offset of logical row-major index `flat`.
int64_t flat_offset(const std::vector<int64_t>& shape, const std::vector<int64_t>& strides,
                    int64_t flat) {
  int64_t off = 0;
  for (int64_t d = static_cast<int64_t>(shape.size()) - 1; d >= 0; --d) {
    const int64_t s = shape[d];
    off += (flat % s) * strides[d];
    flat /= s;
  }
  return off;
}
}  // namespace

double Buffer::get(int64_t flat) const {
  const int64_t off = flat_offset(shape, strides, flat);
  return decode(bytes.data() + off * io_size(type), type);
}

void Buffer::set(int64_t flat, double v) {
  const int64_t off = flat_offset(shape, strides, flat);
  encode(v, type, bytes.data() + off * io_size(type));
}

std::vector<double> Buffer::to_double() const {
  const int64_t n = numel();
  std::vector<double> r(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) r[i] = get(i);
  return r;
}

Buffer Buffer::from_double(IoType t, std::vector<int64_t> shape, const std::vector<double>& v) {
  Buffer b(t, std::move(shape));
  if (static_cast<int64_t>(v.size()) != b.numel())
    throw std::invalid_argument("Buffer::from_double: value count does not match the shape");
  for (int64_t i = 0; i < b.numel(); ++i) b.set(i, v[i]);
  b.tensor();
  return b;
}

void Buffer::poison() {
  if (is_float(type)) {
    const int sz = io_size(type);
    unsigned char nan[8];
    encode(std::numeric_limits<double>::quiet_NaN(), type, nan);
    for (size_t i = 0; i + sz <= bytes.size(); i += sz) std::memcpy(bytes.data() + i, nan, sz);
  } else {
    std::memset(bytes.data(), 0x7f, bytes.size());
  }
}

DLTensor* Buffer::tensor() {
  dl.data = bytes.empty() ? nullptr : bytes.data();
  dl.device = DLDevice{kDLCPU, 0};
  dl.ndim = static_cast<int32_t>(shape.size());
  dl.dtype = io_dl(type);
  dl.shape = shape.empty() ? nullptr : shape.data();
  dl.strides = strides.empty() ? nullptr : strides.data();
  dl.byte_offset = 0;
  return &dl;
}

// ---------------------------------------------------------------------------------- data

std::vector<double> uniform(std::mt19937_64& rng, int64_t n, double lo, double hi, IoType t) {
  // 53 random bits -> [0,1) by hand, so values do not depend on the standard library's
  // distribution implementation.
  std::vector<double> r(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const double u = static_cast<double>(rng() >> 11) * 0x1.0p-53;
    r[i] = round_to(lo + (hi - lo) * u, t);
  }
  return r;
}

// ---------------------------------------------------------------------------------- accuracy

double tolerance_for(IoType t) {
  switch (t) {
    case IoType::F16: return 2e-3;
    case IoType::BF16: return 1e-2;
    default: return 1e-5;
  }
}

namespace {
// rel_l2 and max_rel of `c` against `g`; a zero golden gives absolute errors instead (there is
// no scale to divide by).
void metrics(const std::vector<double>& c, const std::vector<double>& g, double& rel_l2,
             double& max_rel) {
  long double se = 0, sg = 0;
  double me = 0, mg = 0;
  for (size_t i = 0; i < g.size(); ++i) {
    const double e = c[i] - g[i];
    se += static_cast<long double>(e) * e;
    sg += static_cast<long double>(g[i]) * g[i];
    if (!(std::fabs(e) <= me)) me = std::fabs(e);  // NaN propagates into me
    mg = std::max(mg, std::fabs(g[i]));
  }
  const double ne = std::sqrt(static_cast<double>(se));
  const double ng = std::sqrt(static_cast<double>(sg));
  rel_l2 = ng > 0 ? ne / ng : ne;
  max_rel = mg > 0 ? me / mg : me;
}
}  // namespace

// Below this error the 2x-reference comparison is a ratio of two rounding noises: 1% of the
// tolerance, but never less than 4 float32 ulps (4 * 2^-23 = 4.8e-7). Measured: for a
// single-value fp32 output, any summation order other than the reference's fails a 2x rule with
// a sub-ulp floor in 12-15% of random cases.
double noise_floor(double tol) { return std::max(tol / 100.0, 4.0 * 0x1p-23); }

Accuracy compare(const std::vector<double>& cand, const std::vector<double>& gold,
                 const std::vector<double>& ref32, IoType io, bool near_zero) {
  Accuracy a;
  a.metric = near_zero ? "max_rel" : "rel_l2";
  if (cand.size() != gold.size()) {
    a.finite = false;
    a.rel_l2 = a.max_rel = std::numeric_limits<double>::infinity();
    a.pass = false;
    return a;
  }
  for (double v : cand)
    if (!std::isfinite(v)) a.finite = false;
  metrics(cand, gold, a.rel_l2, a.max_rel);
  // Without a reference (empty ref32) only the absolute tolerance applies.
  const bool have_ref = ref32.size() == gold.size();
  if (have_ref) metrics(ref32, gold, a.ref_rel_l2, a.ref_max_rel);
  const double tol = tolerance_for(io);
  const double v = a.value();
  const bool within_tol = v <= tol;
  const bool vs_ref = !have_ref || v <= 2.0 * a.ref_value() || v <= noise_floor(tol);
  a.pass = a.finite && within_tol && vs_ref;
  return a;
}

}  // namespace mamba3::golden
