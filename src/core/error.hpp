// Errors raised inside the library. The C API converts them into a status code and a message
// readable through mamba3_last_error(); nothing else crosses the C boundary.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

#include "mamba3/mamba3.h"

namespace mamba3 {

class Error : public std::runtime_error {
 public:
  Error(mamba3_status status, const std::string& msg) : std::runtime_error(msg), status_(status) {}
  mamba3_status status() const { return status_; }

 private:
  mamba3_status status_;
};

namespace detail {
inline void append(std::ostringstream&) {}
template <class T, class... Rest>
void append(std::ostringstream& os, const T& v, const Rest&... rest) {
  os << v;
  append(os, rest...);
}
}  // namespace detail

template <class... Args>
std::string str_cat(const Args&... args) {
  std::ostringstream os;
  detail::append(os, args...);
  return os.str();
}

// Throws MAMBA3_ERROR_INVALID_ARGUMENT with the concatenated message unless `cond` holds.
#define MAMBA3_CHECK_ARG(cond, ...)                                                         \
  do {                                                                                      \
    if (!(cond))                                                                            \
      throw ::mamba3::Error(MAMBA3_ERROR_INVALID_ARGUMENT, ::mamba3::str_cat(__VA_ARGS__)); \
  } while (0)

#define MAMBA3_FAIL(status, ...) throw ::mamba3::Error((status), ::mamba3::str_cat(__VA_ARGS__))

}  // namespace mamba3
