#ifndef HIMOE_COMMON_STATUS_MACROS_H_
#define HIMOE_COMMON_STATUS_MACROS_H_

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define HIMOE_STATUS_CONCAT_INNER_(a, b) a##b
#define HIMOE_STATUS_CONCAT_(a, b) HIMOE_STATUS_CONCAT_INNER_(a, b)

// Returns from the enclosing function if `expr` yields a non-OK status.
#define HIMOE_RETURN_IF_ERROR(expr)                \
  do {                                             \
    ::absl::Status himoe_status_ = (expr);         \
    if (!himoe_status_.ok()) return himoe_status_; \
  } while (false)

// HIMOE_ASSIGN_OR_RETURN(lhs, expr): evaluates the StatusOr `expr`, returns
// its status on error, otherwise moves the value into `lhs` (which may declare).
#define HIMOE_ASSIGN_OR_RETURN(lhs, expr) \
  HIMOE_ASSIGN_OR_RETURN_IMPL_(HIMOE_STATUS_CONCAT_(himoe_statusor_, __LINE__), lhs, expr)
#define HIMOE_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, expr)  \
  auto statusor = (expr);                                  \
  if (!statusor.ok()) return std::move(statusor).status(); \
  lhs = std::move(statusor).value()

#endif  // HIMOE_COMMON_STATUS_MACROS_H_
