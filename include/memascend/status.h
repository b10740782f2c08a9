// memascend/status.h: the error model of MemAscend and the macros that propagate it.
//
// Every fallible public call returns absl::Status or absl::StatusOr<T>; nothing throws
// across the API. The codes mean the same thing everywhere (docs/errors.md):
//
//   kInvalidArgument     bad input: a size, an alignment, a name, an option. Nothing changed.
//   kResourceExhausted   a budget, pool, arena or volume is full. Retry after freeing.
//   kUnavailable         a transient I/O condition; the same request may succeed if retried.
//   kDataLoss            bytes are wrong or missing: short read, checksum mismatch, a torn or
//                        corrupt on-disk structure.
//   kFailedPrecondition  misuse of state (object closed, lease still held, a device that
//                        already holds a file system, a missing GPU) or a missing capability.
//   kNotFound / kAlreadyExists   names of tensors and objects.
//   kInternal            a MemAscend bug: an invariant did not hold.
//   other codes          an OS error mapped with absl::ErrnoToStatus; the message names the call.
//
// Example:
//
//   absl::StatusOr<Block> Stage(Pool& pool, std::size_t n) {
//     MEMASCEND_ASSIGN_OR_RETURN(Block block, pool.Allocate(n));
//     MEMASCEND_RETURN_IF_ERROR(Fill(block));
//     return block;
//   }
//
// Debian 12's Abseil (20220623) ships neither ABSL_RETURN_IF_ERROR nor
// ABSL_ASSIGN_OR_RETURN, hence these two macros.
//
// Thread-safety: macros only; no state.
#ifndef MEMASCEND_STATUS_H_
#define MEMASCEND_STATUS_H_

#include <utility>

#include <absl/status/status.h>
#include <absl/status/statusor.h>

namespace memascend::status_internal {

inline const absl::Status& AsStatus(const absl::Status& status) { return status; }

template <typename T>
const absl::Status& AsStatus(const absl::StatusOr<T>& status_or) {
  return status_or.status();
}

}  // namespace memascend::status_internal

#define MEMASCEND_STATUS_CONCAT_INNER_(a, b) a##b
#define MEMASCEND_STATUS_CONCAT_(a, b) MEMASCEND_STATUS_CONCAT_INNER_(a, b)

// Evaluates `expr` (an absl::Status or absl::StatusOr<T>) once; if it is not OK, returns
// its status from the enclosing function, which must return absl::Status or StatusOr<U>.
#define MEMASCEND_RETURN_IF_ERROR(expr)                                            \
  do {                                                                             \
    if (auto&& memascend_status_ = (expr); !memascend_status_.ok()) [[unlikely]] { \
      return ::memascend::status_internal::AsStatus(memascend_status_);            \
    }                                                                              \
  } while (false)

// Evaluates `rexpr` (an absl::StatusOr<T>) once; if it is OK, moves its value into
// `lhs` (a declaration such as `auto x` or an existing variable), otherwise returns its
// status. `lhs` must not contain an unparenthesised comma: use a type alias.
#define MEMASCEND_ASSIGN_OR_RETURN(lhs, rexpr)                                                   \
  MEMASCEND_ASSIGN_OR_RETURN_IMPL_(MEMASCEND_STATUS_CONCAT_(memascend_statusor_, __LINE__), lhs, \
                                   rexpr)

#define MEMASCEND_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, rexpr) \
  auto statusor = (rexpr);                                     \
  if (!statusor.ok()) [[unlikely]] {                           \
    return std::move(statusor).status();                       \
  }                                                            \
  lhs = std::move(statusor).value()

#endif  // MEMASCEND_STATUS_H_
