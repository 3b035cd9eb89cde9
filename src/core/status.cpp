#include "flashmla/status.h"

namespace flashmla {

const char* error_kind_name(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::kOk: return "Ok";
    case ErrorKind::kValue: return "ValueError";
    case ErrorKind::kType: return "TypeError";
    case ErrorKind::kNotImplemented: return "NotImplementedError";
    case ErrorKind::kRuntime: return "RuntimeError";
  }
  return "RuntimeError";
}

}  // namespace flashmla
