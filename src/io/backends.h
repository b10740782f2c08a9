// io/backends.h: the factories of the I/O engine's backends.
#ifndef MEMASCEND_SRC_IO_BACKENDS_H_
#define MEMASCEND_SRC_IO_BACKENDS_H_

#include <memory>

#include <absl/status/statusor.h>

#include <memascend/io_engine.h>

namespace memascend::io_internal {

absl::StatusOr<std::unique_ptr<IoEngine>> MakeUringEngine(const IoEngineOptions& options);
absl::StatusOr<std::unique_ptr<IoEngine>> MakeThreadPoolEngine(const IoEngineOptions& options);
absl::StatusOr<std::unique_ptr<IoEngine>> MakeSyncEngine(const IoEngineOptions& options);

}  // namespace memascend::io_internal

#endif  // MEMASCEND_SRC_IO_BACKENDS_H_
