// flashmla/status.h — error reporting of the core library.
//
// Core entry points never throw across the library boundary: they return a
// `Status`. `ErrorKind` tells a binding which exception to raise:
//   kValue          -> Python ValueError          (bad shape, size, value)
//   kType           -> Python TypeError           (bad dtype)
//   kNotImplemented -> Python NotImplementedError (valid input, no backend for it)
//   kRuntime        -> Python RuntimeError        (device / launch failures)
#pragma once

#include <string>
#include <utility>

namespace flashmla {

enum class ErrorKind : int { kOk = 0, kValue, kType, kNotImplemented, kRuntime };

/// Name of the Python exception class an `ErrorKind` maps to ("ValueError", ...).
const char* error_kind_name(ErrorKind kind);

#if __cplusplus >= 201703L
#define FLASHMLA_NODISCARD [[nodiscard]]
#else
#define FLASHMLA_NODISCARD
#endif

/// Result of every core entry point (C++17 and later warn when one is ignored).
struct FLASHMLA_NODISCARD Status {
  ErrorKind kind = ErrorKind::kOk;
  std::string message;

  bool ok() const { return kind == ErrorKind::kOk; }
  static Status Ok() { return {}; }
  static Status Error(ErrorKind k, std::string msg) { return {k, std::move(msg)}; }
};

}  // namespace flashmla

/// Propagate a non-ok Status to the caller.
#define FLASHMLA_RETURN_IF_ERROR(expr)          \
  do {                                          \
    ::flashmla::Status _flashmla_st = (expr);   \
    if (!_flashmla_st.ok()) return _flashmla_st; \
  } while (0)
