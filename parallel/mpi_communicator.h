#pragma once
// The CPU data plane: the Communicator collectives as MPI collectives on a private duplicate of a
// communicator (MPI_COMM_WORLD by default), so its messages never match the control plane's. Needs an
// initialized MPI (an MpiWorld) for its whole lifetime. Like every MPI collective, calls on one
// MpiCommunicator must come from one thread at a time and in the same order on every rank. Each is started
// non-blocking and waited for with sleeps (mpi_wait.h), so a waiting rank leaves the core to the others.
#include <mpi.h>

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "parallel/communicator.h"

namespace capserve::parallel {

class MpiCommunicator final : public Communicator {
 public:
  MpiCommunicator() : MpiCommunicator(MPI_COMM_WORLD) {}
  // Collective over `parent`: MPI_Comm_dup.
  explicit MpiCommunicator(MPI_Comm parent);
  ~MpiCommunicator() override;  // MPI_Comm_free (before MPI_Finalize)

  [[nodiscard]] int rank() const override { return rank_; }
  [[nodiscard]] int size() const override { return size_; }
  [[nodiscard]] kernels::Device device() const override { return kernels::kCpu; }

  [[nodiscard]] MPI_Comm comm() const { return comm_; }

 protected:
  // The argument checks throw std::invalid_argument (wrong span sizes, negative or too few bytes) or
  // std::length_error (a count, displacement or length beyond INT_MAX) before any MPI call; the other ranks
  // then still wait in the collective, so the caller should treat these as fatal for the job.
  // Host memory: the stream is ignored, every call completes before it returns.
  void do_alltoall(std::span<const std::int64_t> send, std::span<std::int64_t> recv, Stream stream) override;
  void do_alltoallv(std::span<const std::byte> send, std::span<const std::int64_t> send_counts,
                    std::span<std::byte> recv, std::span<const std::int64_t> recv_counts,
                    Stream stream) override;
  void do_allreduce_sum(std::span<std::int64_t> values, Stream stream) override;
  void do_allreduce_max(std::span<double> values, Stream stream) override;
  void do_allgather(std::span<const std::int64_t> mine, std::span<std::int64_t> all, Stream stream) override;

 private:
  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0;
  int size_ = 1;
  // alltoallv's int counts and displacements, kept between calls.
  std::vector<int> send_counts_, send_displs_, recv_counts_, recv_displs_;
};

}  // namespace capserve::parallel
