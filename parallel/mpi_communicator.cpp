#include "parallel/mpi_communicator.h"

#include "parallel/mpi_call.h"
#include "parallel/mpi_wait.h"

#include <climits>
#include <stdexcept>
#include <string>

namespace capserve::parallel {
namespace {

void check(int rc, const char* what) {
  mpi::check(rc, "MpiCommunicator", what);
}

// Every collective is started non-blocking and waited for with sleeps (parallel/mpi_wait.h).
void complete(MPI_Request& request, const char* what) {
  mpi::wait(request, mpi::kStepWait, "MpiCommunicator", what);
}
using mpi::address;

int int_count(std::size_t n, const char* op) {
  if (n > static_cast<std::size_t>(INT_MAX)) {
    throw std::length_error(std::string("MpiCommunicator::") + op + ": " + std::to_string(n) +
                            " elements exceed the MPI int count limit (" + std::to_string(INT_MAX) + ")");
  }
  return static_cast<int>(n);
}

void check_size(std::size_t got, std::size_t want, const char* op, const char* what) {
  if (got != want) {
    throw std::invalid_argument(std::string("MpiCommunicator::") + op + ": " + what + " has " +
                                std::to_string(got) + " entries, expected " + std::to_string(want));
  }
}

// counts (one per rank, in bytes) -> int counts and displacements of consecutive blocks; returns the total
// bytes.
std::int64_t to_int_blocks(std::span<const std::int64_t> counts, std::vector<int>& out_counts,
                           std::vector<int>& out_displs, const char* what) {
  out_counts.resize(counts.size());
  out_displs.resize(counts.size());
  std::int64_t offset = 0;
  for (std::size_t r = 0; r < counts.size(); ++r) {
    const std::int64_t c = counts[r];
    if (c < 0) {
      throw std::invalid_argument(std::string("MpiCommunicator::alltoallv: ") + what + "[" +
                                  std::to_string(r) + "] is negative (" + std::to_string(c) + ")");
    }
    if (c > INT_MAX || offset > INT_MAX) {
      throw std::length_error(std::string("MpiCommunicator::alltoallv: ") + what + "[" + std::to_string(r) +
                              "] = " + std::to_string(c) + " bytes at displacement " +
                              std::to_string(offset) + " exceeds the MPI int count limit (" +
                              std::to_string(INT_MAX) + "); send less per step");
    }
    out_counts[r] = static_cast<int>(c);
    out_displs[r] = static_cast<int>(offset);
    offset += c;
  }
  return offset;
}

}  // namespace

MpiCommunicator::MpiCommunicator(MPI_Comm parent) {
  check(MPI_Comm_dup(parent, &comm_), "MPI_Comm_dup");
  check(MPI_Comm_rank(comm_, &rank_), "MPI_Comm_rank");
  check(MPI_Comm_size(comm_, &size_), "MPI_Comm_size");
}

MpiCommunicator::~MpiCommunicator() {
  if (comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
}

void MpiCommunicator::do_alltoall(std::span<const std::int64_t> send, std::span<std::int64_t> recv,
                                  Stream /*stream*/) {
  const auto n = static_cast<std::size_t>(size_);
  check_size(send.size(), n, "alltoall", "send");
  check_size(recv.size(), n, "alltoall", "recv");
  MPI_Request request = MPI_REQUEST_NULL;
  check(MPI_Ialltoall(send.data(), 1, MPI_INT64_T, recv.data(), 1, MPI_INT64_T, comm_, &request),
        "MPI_Ialltoall");
  complete(request, "MPI_Ialltoall");
}

void MpiCommunicator::do_alltoallv(std::span<const std::byte> send, std::span<const std::int64_t> send_counts,
                                   std::span<std::byte> recv, std::span<const std::int64_t> recv_counts,
                                   Stream /*stream*/) {
  const auto n = static_cast<std::size_t>(size_);
  check_size(send_counts.size(), n, "alltoallv", "send_counts");
  check_size(recv_counts.size(), n, "alltoallv", "recv_counts");
  const std::int64_t send_total = to_int_blocks(send_counts, send_counts_, send_displs_, "send_counts");
  const std::int64_t recv_total = to_int_blocks(recv_counts, recv_counts_, recv_displs_, "recv_counts");
  if (static_cast<std::uint64_t>(send_total) > send.size() ||
      static_cast<std::uint64_t>(recv_total) > recv.size()) {
    throw std::invalid_argument("MpiCommunicator::alltoallv: the counts add up to " +
                                std::to_string(send_total) + " bytes to send and " +
                                std::to_string(recv_total) + " to receive, but send has " +
                                std::to_string(send.size()) + " and recv " + std::to_string(recv.size()));
  }
  MPI_Request request = MPI_REQUEST_NULL;
  check(MPI_Ialltoallv(address(send.data()), send_counts_.data(), send_displs_.data(), MPI_BYTE,
                       address(recv.data()), recv_counts_.data(), recv_displs_.data(), MPI_BYTE, comm_,
                       &request),
        "MPI_Ialltoallv");
  complete(request, "MPI_Ialltoallv");
  count_sent(send_counts);
}

void MpiCommunicator::do_allreduce_sum(std::span<std::int64_t> values, Stream /*stream*/) {
  const int n = int_count(values.size(), "allreduce_sum");
  MPI_Request request = MPI_REQUEST_NULL;
  check(MPI_Iallreduce(MPI_IN_PLACE, address(values.data()), n, MPI_INT64_T, MPI_SUM, comm_, &request),
        "MPI_Iallreduce");
  complete(request, "MPI_Iallreduce");
}

void MpiCommunicator::do_allreduce_max(std::span<double> values, Stream /*stream*/) {
  const int n = int_count(values.size(), "allreduce_max");
  MPI_Request request = MPI_REQUEST_NULL;
  check(MPI_Iallreduce(MPI_IN_PLACE, address(values.data()), n, MPI_DOUBLE, MPI_MAX, comm_, &request),
        "MPI_Iallreduce");
  complete(request, "MPI_Iallreduce");
}

void MpiCommunicator::do_allgather(std::span<const std::int64_t> mine, std::span<std::int64_t> all,
                                   Stream /*stream*/) {
  const int n = int_count(mine.size(), "allgather");
  check_size(all.size(), mine.size() * static_cast<std::size_t>(size_), "allgather", "all");
  MPI_Request request = MPI_REQUEST_NULL;
  check(MPI_Iallgather(address(mine.data()), n, MPI_INT64_T, address(all.data()), n, MPI_INT64_T, comm_,
                       &request),
        "MPI_Iallgather");
  complete(request, "MPI_Iallgather");
}

}  // namespace capserve::parallel
