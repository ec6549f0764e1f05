// Helpers of the bad-input tests: a named set of argument buffers whose DLTensor descriptors a
// test edits one at a time (shape, dtype, device, presence), and the check that a call failed
// with MAMBA3_ERROR_INVALID_ARGUMENT and a message naming the argument.
#pragma once

#include <gtest/gtest.h>

#include <initializer_list>
#include <string>
#include <vector>

#include "mamba3/mamba3.h"
#include "mamba3_golden/host.hpp"

namespace mamba3::test {

using mamba3::golden::Buffer;
using mamba3::golden::IoType;

inline DLDataType dl_type(uint8_t code, uint8_t bits, uint16_t lanes = 1) {
  DLDataType d;
  d.code = code;
  d.bits = bits;
  d.lanes = lanes;
  return d;
}
inline const DLDataType kF16 = dl_type(kDLFloat, 16), kBF16 = dl_type(kDLBfloat, 16);
inline const DLDataType kF32 = dl_type(kDLFloat, 32), kF64 = dl_type(kDLFloat, 64);
inline const DLDataType kI32 = dl_type(kDLInt, 32), kI64 = dl_type(kDLInt, 64);

// A set of named arguments backed by host buffers. Each test case edits the DLTensor descriptors
// (shape, dtype, device, presence) of one argument of an otherwise valid call.
class Args {
 public:
  void add(const std::string& name, Buffer b, bool given = true) {
    names_.push_back(name);
    bufs_.push_back(std::move(b));
    given_.push_back(given);
    dl_.emplace_back();
    shapes_.emplace_back();
  }
  void reset() {
    for (size_t i = 0; i < bufs_.size(); ++i) {
      given_[i] = given_default(i);
      dl_[i] = *bufs_[i].tensor();
    }
  }
  int idx(const std::string& name) const {
    for (size_t i = 0; i < names_.size(); ++i)
      if (names_[i] == name) return static_cast<int>(i);
    ADD_FAILURE() << "unknown argument " << name;
    return 0;
  }
  DLTensor& t(const std::string& name) { return dl_[idx(name)]; }
  DLTensor* p(const std::string& name) {
    const int i = idx(name);
    return given_[i] ? &dl_[i] : nullptr;
  }
  // Describe `name` with another (compact) shape; the data is not touched by a failing call.
  void set_shape(const std::string& name, std::vector<int64_t> shape) {
    const int i = idx(name);
    shapes_[i] = std::move(shape);
    dl_[i].shape = shapes_[i].data();
    dl_[i].ndim = static_cast<int32_t>(shapes_[i].size());
    dl_[i].strides = nullptr;
  }
  std::vector<int64_t> shape(const std::string& name) {
    const DLTensor& d = t(name);
    return std::vector<int64_t>(d.shape, d.shape + d.ndim);
  }
  void drop(const std::string& name) { given_[idx(name)] = false; }
  void give(const std::string& name) { given_[idx(name)] = true; }
  void replace(const std::string& name, Buffer b) {
    const int i = idx(name);
    bufs_[i] = std::move(b);
    dl_[i] = *bufs_[i].tensor();
    given_[i] = true;
  }
  const std::vector<std::string>& names() const { return names_; }
  bool given(const std::string& name) const { return given_[idx(name)]; }

  std::vector<bool> defaults_;

 private:
  bool given_default(size_t i) const { return i < defaults_.size() ? defaults_[i] : true; }
  std::vector<std::string> names_;
  std::vector<Buffer> bufs_;
  std::vector<bool> given_;
  std::vector<DLTensor> dl_;
  std::vector<std::vector<int64_t>> shapes_;
};

inline Buffer zeros(IoType t, std::vector<int64_t> shape) {
  Buffer b(t, std::move(shape));
  for (int64_t i = 0; i < b.numel(); ++i) b.set(i, 0.0);
  return b;
}

inline Buffer index_buffer(IoType t, std::vector<double> v) {
  return Buffer::from_double(t, {static_cast<int64_t>(v.size())}, v);
}

// Checks status INVALID_ARGUMENT and that the message contains every one of `parts`.
inline ::testing::AssertionResult invalid(mamba3_status st,
                                          std::initializer_list<const char*> parts) {
  const std::string msg = mamba3_last_error();
  if (st != MAMBA3_ERROR_INVALID_ARGUMENT)
    return ::testing::AssertionFailure() << "status " << st << " (expected INVALID_ARGUMENT), "
                                         << "message: '" << msg << "'";
  for (const char* part : parts)
    if (msg.find(part) == std::string::npos)
      return ::testing::AssertionFailure() << "message '" << msg << "' lacks '" << part << "'";
  return ::testing::AssertionSuccess() << msg;
}

}  // namespace mamba3::test
