#pragma once
// The group of one: rank 0 of size 1, for single-process runs without MPI, on host memory or (given a copy
// function, e.g. a backend's) on a device's. Every collective is a copy (or nothing); the same argument
// checks as the other communicators, so code that is wrong for N ranks fails here too.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <span>
#include <stdexcept>
#include <string>

#include "parallel/communicator.h"

namespace capserve::parallel {

class SelfCommunicator final : public Communicator {
 public:
  // Copies src into dst (the same size) in memory of the communicator's device, ordered on `stream`.
  using Copy = std::function<void(std::span<std::byte> dst, std::span<const std::byte> src, Stream stream)>;

  // On host memory.
  SelfCommunicator() = default;
  // On memory of `device`, moved by `copy`.
  SelfCommunicator(kernels::Device device, Copy copy) : device_(device), copy_(std::move(copy)) {}

  [[nodiscard]] int rank() const override { return 0; }
  [[nodiscard]] int size() const override { return 1; }
  [[nodiscard]] kernels::Device device() const override { return device_; }

 protected:
  void do_alltoall(std::span<const std::int64_t> send, std::span<std::int64_t> recv, Stream stream) override {
    check_size(send.size(), 1, "alltoall", "send");
    check_size(recv.size(), 1, "alltoall", "recv");
    copy_(std::as_writable_bytes(recv), std::as_bytes(send), stream);
  }

  void do_alltoallv(std::span<const std::byte> send, std::span<const std::int64_t> send_counts,
                    std::span<std::byte> recv, std::span<const std::int64_t> recv_counts,
                    Stream stream) override {
    check_size(send_counts.size(), 1, "alltoallv", "send_counts");
    check_size(recv_counts.size(), 1, "alltoallv", "recv_counts");
    const std::int64_t n = send_counts[0];
    if (n < 0 || recv_counts[0] != n) {
      throw std::invalid_argument("SelfCommunicator::alltoallv: send_counts[0] = " + std::to_string(n) +
                                  " and recv_counts[0] = " + std::to_string(recv_counts[0]) +
                                  " must be equal and non-negative");
    }
    if (static_cast<std::uint64_t>(n) > send.size() || static_cast<std::uint64_t>(n) > recv.size()) {
      throw std::invalid_argument("SelfCommunicator::alltoallv: " + std::to_string(n) +
                                  " bytes, but send has " + std::to_string(send.size()) + " and recv " +
                                  std::to_string(recv.size()));
    }
    if (n > 0)
      copy_(recv.first(static_cast<std::size_t>(n)), send.first(static_cast<std::size_t>(n)), stream);
    count_sent(send_counts);  // nothing leaves this rank: stays 0
  }

  void do_allreduce_sum(std::span<std::int64_t> /*values*/, Stream /*stream*/) override {}
  void do_allreduce_max(std::span<double> /*values*/, Stream /*stream*/) override {}

  void do_allgather(std::span<const std::int64_t> mine, std::span<std::int64_t> all, Stream stream) override {
    check_size(all.size(), mine.size(), "allgather", "all");
    copy_(std::as_writable_bytes(all), std::as_bytes(mine), stream);
  }

 private:
  static void host_copy(std::span<std::byte> dst, std::span<const std::byte> src, Stream /*stream*/) {
    if (!src.empty()) std::memcpy(dst.data(), src.data(), src.size());
  }

  kernels::Device device_ = kernels::kCpu;
  Copy copy_ = host_copy;

  static void check_size(std::size_t got, std::size_t want, const char* op, const char* what) {
    if (got != want) {
      throw std::invalid_argument(std::string("SelfCommunicator::") + op + ": " + what + " has " +
                                  std::to_string(got) + " entries, expected " + std::to_string(want));
    }
  }
};

}  // namespace capserve::parallel
