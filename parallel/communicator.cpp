#include "parallel/communicator.h"

#include <stdexcept>
#include <string>

namespace capserve::parallel {
namespace {

void check_device(const Communicator& comm, const kernels::Tensor& t, const char* op) {
  if (t.device() != comm.device()) {
    throw std::invalid_argument(std::string("Communicator::") + op + ": a tensor on " +
                                to_string(t.device()) + " for a communicator on " + to_string(comm.device()));
  }
}

// A tensor's elements of type T on the communicator's device, as the span the collectives take.
template <typename T>
std::span<T> elements(const Communicator& comm, const kernels::Tensor& t, const char* op) {
  if (t.empty()) return {};
  check_device(comm, t, op);
  return {t.ptr<T>(), static_cast<std::size_t>(t.numel())};
}

std::span<std::byte> bytes(const Communicator& comm, const kernels::Tensor& t, const char* op) {
  if (t.empty()) return {};
  check_device(comm, t, op);
  return {static_cast<std::byte*>(t.data()), t.bytes()};
}

}  // namespace

void Communicator::alltoall(const kernels::Tensor& send, const kernels::Tensor& recv, Stream stream) {
  do_alltoall(elements<const std::int64_t>(*this, send, "alltoall"),
              elements<std::int64_t>(*this, recv, "alltoall"), stream);
}

void Communicator::alltoallv(const kernels::Tensor& send, std::span<const std::int64_t> send_counts,
                             const kernels::Tensor& recv, std::span<const std::int64_t> recv_counts,
                             Stream stream) {
  do_alltoallv(bytes(*this, send, "alltoallv"), send_counts, bytes(*this, recv, "alltoallv"), recv_counts,
               stream);
}

void Communicator::allreduce_sum(const kernels::Tensor& values, Stream stream) {
  do_allreduce_sum(elements<std::int64_t>(*this, values, "allreduce_sum"), stream);
}

void Communicator::allgather(const kernels::Tensor& mine, const kernels::Tensor& all, Stream stream) {
  do_allgather(elements<const std::int64_t>(*this, mine, "allgather"),
               elements<std::int64_t>(*this, all, "allgather"), stream);
}

void Communicator::alltoall_fixed(std::span<const std::byte> send, std::span<std::byte> recv,
                                  std::int64_t block_bytes, Stream stream) {
  if (block_bytes < 0) {
    throw std::invalid_argument("Communicator::alltoall_fixed: block_bytes is negative (" +
                                std::to_string(block_bytes) + ")");
  }
  fixed_counts_.assign(static_cast<std::size_t>(size()), block_bytes);
  do_alltoallv(send, fixed_counts_, recv, fixed_counts_, stream);
}

}  // namespace capserve::parallel
