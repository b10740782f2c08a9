// Collectives among memascend-train's data-parallel ranks (Note [data parallel] in
// data_parallel.cpp): MPI's on the CPU (MpiCommunicator, built with libopenmpi-dev), behind an
// interface the trainer alone uses, so another engine (NCCL for a GPU trainer) plugs in
// the same way. Every call is a collective: every rank makes it, in the same order.
//
// Thread-safety: one thread (the trainer's) calls a communicator. Lifetime: MPI is
// initialised by MpiCommunicator::Create and finalised when it is destroyed; one per
// process.
#ifndef MEMASCEND_EXAMPLES_OFFLOAD_TRAIN_COMM_H_
#define MEMASCEND_EXAMPLES_OFFLOAD_TRAIN_COMM_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include <absl/status/statusor.h>

namespace offload_train {

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Ranks of this job on this host (their volumes must not be one file).
  virtual int local_size() const = 0;

  // The element-wise sum of every rank's `data` (n floats) into rank `root`'s, in place;
  // the other ranks' `data` is only read.
  virtual absl::Status ReduceSum(float* data, std::size_t n, int root) = 0;
  // In place: rank r's `counts[r]` elements of `element_bytes` each, at element
  // `offsets[r]` of `data`, to every rank.
  virtual absl::Status AllGather(void* data, std::size_t element_bytes,
                                 std::span<const std::size_t> counts,
                                 std::span<const std::size_t> offsets) = 0;
  // Element-wise over the ranks, in place; every rank gets the same values.
  virtual absl::Status AllReduceSum(std::span<double> values) = 0;
  virtual absl::Status AllReduceMin(std::span<std::uint64_t> values) = 0;
  // Rank 0 gets every rank's `mine` (the same count on each), rank by rank, in `all`.
  virtual absl::Status GatherToRoot(std::span<const double> mine, std::span<double> all) = 0;
  virtual absl::Status Barrier() = 0;
  // Stops every rank of the job (after an error on this one, so that no rank waits in a
  // collective for it). Does not return.
  [[noreturn]] virtual void Abort(int code) = 0;

  // Bytes of payload this rank has sent: to a reduce, its data (the root's stays);
  // to an all-gather, its share once to each other rank; to the small all-reduces
  // and gathers, their values.
  std::uint64_t bytes_sent() const noexcept { return bytes_sent_; }

 protected:
  std::uint64_t bytes_sent_ = 0;
};

// Whether this process was started by an MPI launcher (mpirun, srun) as one of several.
bool LaunchedAsMpiRanks();
// Whether this build has MPI (MEMASCEND_TRAIN_HAVE_MPI).
bool HaveMpi();
// MPI_COMM_WORLD, with errors returned, not fatal. kUnimplemented in a build without MPI;
// kInternal if MPI fails to start.
absl::StatusOr<std::unique_ptr<Communicator>> MakeMpiCommunicator(int* argc, char*** argv);

}  // namespace offload_train

#endif  // MEMASCEND_EXAMPLES_OFFLOAD_TRAIN_COMM_H_
