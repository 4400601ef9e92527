#pragma once
// The data-plane collectives between ranks, behind one interface: MPI on CPU (MpiCommunicator), NCCL on GPU
// later, a size-1 SelfCommunicator for single-process runs, and an in-process thread group for tests. Every
// rank of the group must call the same collectives in the same order, including ranks with nothing to send.
#include <cstddef>
#include <cstdint>
#include <span>

#include "parallel/sent_bytes.h"

namespace capserve::parallel {

class Communicator {
 public:
  virtual ~Communicator() = default;
  Communicator() = default;
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  [[nodiscard]] virtual int rank() const = 0;
  [[nodiscard]] virtual int size() const = 0;

  // Personalized exchange of one int64 per peer: recv[s] = what rank s put in its send[this rank].
  // send and recv have size() entries.
  virtual void alltoall(std::span<const std::int64_t> send, std::span<std::int64_t> recv) = 0;

  // Variable exchange of bytes: send holds size() consecutive blocks, block d (send_counts[d] bytes) going to
  // rank d; recv receives size() consecutive blocks, block s (recv_counts[s] bytes) from rank s. The counts
  // must agree pairwise (usually exchanged first with alltoall).
  virtual void alltoallv(std::span<const std::byte> send, std::span<const std::int64_t> send_counts,
                         std::span<std::byte> recv, std::span<const std::int64_t> recv_counts) = 0;

  // Element-wise sum (or max) over all ranks, in place; every rank passes the same length.
  virtual void allreduce_sum(std::span<std::int64_t> values) = 0;
  virtual void allreduce_max(std::span<double> values) = 0;

  // all[r * mine.size() + i] = rank r's mine[i]; every rank passes the same length.
  virtual void allgather(std::span<const std::int64_t> mine, std::span<std::int64_t> all) = 0;

  // Bytes this rank has sent to other ranks through alltoallv since construction (its own block excluded).
  [[nodiscard]] std::int64_t bytes_sent() const { return sent_.total(); }

 protected:
  void count_sent(std::span<const std::int64_t> send_counts) { sent_.add(send_counts, rank()); }

 private:
  SentBytes sent_;
};

}  // namespace capserve::parallel
