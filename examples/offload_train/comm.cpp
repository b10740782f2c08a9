#include "comm.h"

#include <climits>
#include <cstdlib>
#include <vector>

#include <fmt/format.h>

#ifdef MEMASCEND_TRAIN_HAVE_MPI
#include <mpi.h>
#endif

namespace offload_train {

bool LaunchedAsMpiRanks() {
  for (const char* name : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "MPI_LOCALNRANKS"}) {
    const char* v = std::getenv(name);
    if (v != nullptr && std::atoi(v) > 1) return true;
  }
  return false;
}

#ifndef MEMASCEND_TRAIN_HAVE_MPI

bool HaveMpi() { return false; }

absl::StatusOr<std::unique_ptr<Communicator>> MakeMpiCommunicator(int*, char***) {
  return absl::UnimplementedError(
      "this memascend-train was built without MPI: install libopenmpi-dev (Debian) and "
      "rebuild to train data-parallel under mpirun");
}

#else

bool HaveMpi() { return true; }

namespace {

// An MPI error code as a status naming the call.
absl::Status Check(int rc, const char* what) {
  if (rc == MPI_SUCCESS) return absl::OkStatus();
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, text, &len);
  return absl::InternalError(
      fmt::format("{}: {}", what, std::string(text, static_cast<std::size_t>(len))));
}

class MpiCommunicator final : public Communicator {
 public:
  MpiCommunicator(int rank, int size, int local_size)
      : rank_(rank), size_(size), local_size_(local_size) {}
  ~MpiCommunicator() override { MPI_Finalize(); }
  MpiCommunicator(const MpiCommunicator&) = delete;
  MpiCommunicator& operator=(const MpiCommunicator&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  int local_size() const override { return local_size_; }

  absl::Status ReduceSum(float* data, std::size_t n, int root) override {
    constexpr std::size_t kMax = std::size_t{1} << 30;  // MPI counts are ints
    for (std::size_t at = 0; at < n; at += kMax) {
      const int count = static_cast<int>(std::min(kMax, n - at));
      const int rc =
          rank_ == root
              ? MPI_Reduce(MPI_IN_PLACE, data + at, count, MPI_FLOAT, MPI_SUM, root, MPI_COMM_WORLD)
              : MPI_Reduce(data + at, nullptr, count, MPI_FLOAT, MPI_SUM, root, MPI_COMM_WORLD);
      if (absl::Status s = Check(rc, "MPI_Reduce"); !s.ok()) return s;
    }
    if (rank_ != root) bytes_sent_ += n * sizeof(float);
    return absl::OkStatus();
  }

  absl::Status AllGather(void* data, std::size_t element_bytes, std::span<const std::size_t> counts,
                         std::span<const std::size_t> offsets) override {
    if (counts.size() != static_cast<std::size_t>(size_) || offsets.size() != counts.size())
      return absl::InvalidArgumentError("all-gather: one count and offset per rank");
    std::vector<int> c(counts.size()), o(offsets.size());
    for (std::size_t r = 0; r < counts.size(); ++r) {
      if (counts[r] > INT_MAX || offsets[r] > INT_MAX) {
        return absl::UnimplementedError(fmt::format(
            "all-gather of {} elements at {}: beyond MPI's int counts", counts[r], offsets[r]));
      }
      c[r] = static_cast<int>(counts[r]);
      o[r] = static_cast<int>(offsets[r]);
    }
    MPI_Datatype element;
    if (absl::Status s =
            Check(MPI_Type_contiguous(static_cast<int>(element_bytes), MPI_BYTE, &element),
                  "MPI_Type_contiguous");
        !s.ok())
      return s;
    MPI_Type_commit(&element);
    const int rc = MPI_Allgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, data, c.data(), o.data(),
                                  element, MPI_COMM_WORLD);
    MPI_Type_free(&element);
    if (absl::Status s = Check(rc, "MPI_Allgatherv"); !s.ok()) return s;
    bytes_sent_ += counts[static_cast<std::size_t>(rank_)] * element_bytes *
                   static_cast<std::uint64_t>(size_ - 1);
    return absl::OkStatus();
  }

  absl::Status AllReduceSum(std::span<double> values) override {
    bytes_sent_ += values.size() * sizeof(double);
    return Check(MPI_Allreduce(MPI_IN_PLACE, values.data(), static_cast<int>(values.size()),
                               MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD),
                 "MPI_Allreduce");
  }
  absl::Status AllReduceMin(std::span<std::uint64_t> values) override {
    bytes_sent_ += values.size() * sizeof(std::uint64_t);
    return Check(MPI_Allreduce(MPI_IN_PLACE, values.data(), static_cast<int>(values.size()),
                               MPI_UINT64_T, MPI_MIN, MPI_COMM_WORLD),
                 "MPI_Allreduce");
  }
  absl::Status GatherToRoot(std::span<const double> mine, std::span<double> all) override {
    if (rank_ == 0 && all.size() != mine.size() * static_cast<std::size_t>(size_))
      return absl::InvalidArgumentError("gather: the root's buffer is not one share per rank");
    bytes_sent_ += rank_ == 0 ? 0 : mine.size() * sizeof(double);
    return Check(MPI_Gather(mine.data(), static_cast<int>(mine.size()), MPI_DOUBLE,
                            rank_ == 0 ? all.data() : nullptr, static_cast<int>(mine.size()),
                            MPI_DOUBLE, 0, MPI_COMM_WORLD),
                 "MPI_Gather");
  }
  absl::Status Barrier() override { return Check(MPI_Barrier(MPI_COMM_WORLD), "MPI_Barrier"); }
  [[noreturn]] void Abort(int code) override {
    MPI_Abort(MPI_COMM_WORLD, code);
    std::_Exit(code);  // MPI_Abort does not return; should it, this process still stops
  }

 private:
  int rank_, size_, local_size_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Communicator>> MakeMpiCommunicator(int* argc, char*** argv) {
  int provided = 0;
  // Only the trainer's thread calls MPI (the kernels' and the store's threads never do).
  if (absl::Status s =
          Check(MPI_Init_thread(argc, argv, MPI_THREAD_FUNNELED, &provided), "MPI_Init_thread");
      !s.ok())
    return s;
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  int rank = 0, size = 1, local = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  MPI_Comm node;
  if (MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node) ==
      MPI_SUCCESS) {
    MPI_Comm_size(node, &local);
    MPI_Comm_free(&node);
  }
  return std::unique_ptr<Communicator>(new MpiCommunicator(rank, size, local));
}

#endif  // MEMASCEND_TRAIN_HAVE_MPI

}  // namespace offload_train
