#pragma once
// The data-plane collectives between ranks, behind one interface over memory of the communicator's device:
// host memory for MpiCommunicator (MPI), SelfCommunicator (a group of one) and the tests' in-process thread
// group; GPU memory with a stream for NcclCommunicator (one GPU per rank) and HostStagedCommunicator (MPI
// through host memory, for ranks sharing a GPU). Every rank of the group must call the same collectives in
// the same order, including ranks with nothing to send.
//
// The interface is on tensors of device() (kernels/tensor.h) plus a stream (null on the host, and ignored
// there): calls enqueue their work on the stream and return; results are ready for later work on that stream.
// Host communicators complete the call before returning. The span forms are the same calls on raw memory of
// device(), for callers that hold none in tensors (and for doubles, a type tensors do not carry).
//
// The count exchange and the host. alltoallv's counts are host arrays: each ncclSend/ncclRecv takes its size
// as a host argument and a receive must match its send's size exactly, and the caller sizes the receive
// buffer from the received counts. When the counts are produced on the device (the router and the capacity
// scheduler run there), one round trip per exchange is unavoidable: alltoall on the device, copy the received
// counts to the host, synchronize, then alltoallv (runtime/README.md: the MoE layer's one report copy). The
// alternative without it is alltoall_fixed: every peer's block has the same preallocated size, so no size
// depends on data. Capacity scheduling makes a bound known in advance (a rank receives at most its device
// capacity C_dev rows, so no single peer sends it more than C_dev), the counts travel on the device beside
// the data (alltoall, never read by the host), and the receiving kernels read how much of each block is valid
// from them. The price is size() * bound rows of receive buffer and a full block on the wire per peer
// whatever the load, so it pays where blocks are small and the synchronization dominates (decode steps), not
// for large prefill batches.
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "kernels/tensor.h"
#include "parallel/sent_bytes.h"

namespace capserve::parallel {

using kernels::Stream;

class Communicator {
 public:
  virtual ~Communicator() = default;
  Communicator() = default;
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  [[nodiscard]] virtual int rank() const = 0;
  [[nodiscard]] virtual int size() const = 0;
  // Where the data of every call lives.
  [[nodiscard]] virtual kernels::Device device() const = 0;

  // Personalized exchange of one int64 per peer: recv[s] = what rank s put in its send[this rank]; send and
  // recv are int64 [size()].
  void alltoall(const kernels::Tensor& send, const kernels::Tensor& recv, Stream stream);
  // Variable exchange of bytes: send holds size() consecutive blocks, block d (send_counts[d] bytes) going to
  // rank d; recv receives size() consecutive blocks, block s (recv_counts[s] bytes) from rank s. The host
  // count arrays must agree pairwise (usually exchanged first with alltoall); send and recv must not overlap.
  // Any element type: the counts are bytes.
  void alltoallv(const kernels::Tensor& send, std::span<const std::int64_t> send_counts,
                 const kernels::Tensor& recv, std::span<const std::int64_t> recv_counts, Stream stream);
  // Element-wise sum over all ranks, in place, int64; every rank passes the same length.
  void allreduce_sum(const kernels::Tensor& values, Stream stream);
  // all[r * mine.size() + i] = rank r's mine[i], int64; every rank passes the same length.
  void allgather(const kernels::Tensor& mine, const kernels::Tensor& all, Stream stream);

  // The same calls on raw memory of device().
  void alltoall(std::span<const std::int64_t> send, std::span<std::int64_t> recv, Stream stream = nullptr) {
    do_alltoall(send, recv, stream);
  }
  void alltoallv(std::span<const std::byte> send, std::span<const std::int64_t> send_counts,
                 std::span<std::byte> recv, std::span<const std::int64_t> recv_counts,
                 Stream stream = nullptr) {
    do_alltoallv(send, send_counts, recv, recv_counts, stream);
  }
  void allreduce_sum(std::span<std::int64_t> values, Stream stream = nullptr) {
    do_allreduce_sum(values, stream);
  }
  // Element-wise max over all ranks, in place.
  void allreduce_max(std::span<double> values, Stream stream = nullptr) { do_allreduce_max(values, stream); }
  void allgather(std::span<const std::int64_t> mine, std::span<std::int64_t> all, Stream stream = nullptr) {
    do_allgather(mine, all, stream);
  }

  // alltoallv with every block block_bytes long on every rank: no count depends on data, so nothing waits for
  // the host (see the header comment).
  void alltoall_fixed(std::span<const std::byte> send, std::span<std::byte> recv, std::int64_t block_bytes,
                      Stream stream = nullptr);

  // Bytes this rank has sent to other ranks through alltoallv since construction (its own block excluded).
  [[nodiscard]] std::int64_t bytes_sent() const { return sent_.total(); }

 protected:
  // The collectives on memory of device(), after the tensor forms' device and type checks.
  virtual void do_alltoall(std::span<const std::int64_t> send, std::span<std::int64_t> recv,
                           Stream stream) = 0;
  virtual void do_alltoallv(std::span<const std::byte> send, std::span<const std::int64_t> send_counts,
                            std::span<std::byte> recv, std::span<const std::int64_t> recv_counts,
                            Stream stream) = 0;
  virtual void do_allreduce_sum(std::span<std::int64_t> values, Stream stream) = 0;
  virtual void do_allreduce_max(std::span<double> values, Stream stream) = 0;
  virtual void do_allgather(std::span<const std::int64_t> mine, std::span<std::int64_t> all,
                            Stream stream) = 0;

  void count_sent(std::span<const std::int64_t> send_counts) { sent_.add(send_counts, rank()); }

 private:
  SentBytes sent_;
  std::vector<std::int64_t> fixed_counts_;
};

}  // namespace capserve::parallel
