#pragma once
// The data-plane collectives on device memory: the GPU counterpart of Communicator, with the same semantics
// (blocks in rank order, counts that agree pairwise, every rank joins every call, zero-count peers included)
// plus a stream. Backends: NcclCommunicator (one GPU per rank) and HostStagedCommunicator (MPI through host
// memory, for several ranks sharing one GPU).
//
// Every buffer argument is device memory of the calling rank's GPU (spans carry pointer and size only; the
// host never dereferences them); counts for alltoallv are host arrays. Calls enqueue their work on `stream`
// and return: results are ready for later work on that stream, not for the host. The NCCL backend never
// waits on the host; the host-staged one waits for its own device-to-host copies (MPI needs the bytes on the
// host), and for the copies back only at its next call (they read its staging buffers).
//
// The count exchange and the host. alltoallv's counts must be on the host: each ncclSend/ncclRecv takes its
// size as a host argument and a receive must match its send's size exactly, and the caller sizes the receive
// buffer from the received counts. When the counts are produced on the device (the router and the capacity
// scheduler run there), one round trip per exchange is unavoidable: alltoall_counts on the device, copy the
// received counts to the host, synchronize, then alltoallv. The alternative without it is alltoall_fixed:
// every peer's block has the same preallocated size, so no size depends on data. Capacity scheduling makes a
// bound known in advance (a rank receives at most its device capacity C_dev rows, so no single peer sends it
// more than C_dev), the counts travel on the device beside the data (alltoall_counts, never read by the
// host), and the receiving kernels read how much of each block is valid from them. The price is size() *
// bound rows of receive buffer and a full block on the wire per peer whatever the load, so it pays where
// blocks are small and the synchronization dominates (decode steps), not for large prefill batches.
#include <cstddef>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "parallel/sent_bytes.h"

// The CUDA runtime's stream type (cudaStream_t is CUstream_st*), named without including CUDA headers so that
// the interface and the host-staged logic build without CUDA.
struct CUstream_st;

namespace capserve::parallel {

using DeviceStream = CUstream_st*;

class DeviceCommunicator {
 public:
  virtual ~DeviceCommunicator() = default;
  DeviceCommunicator() = default;
  DeviceCommunicator(const DeviceCommunicator&) = delete;
  DeviceCommunicator& operator=(const DeviceCommunicator&) = delete;

  [[nodiscard]] virtual int rank() const = 0;
  [[nodiscard]] virtual int size() const = 0;

  // One int64 per peer: recv[s] = rank s's send[this rank]; send and recv are device arrays of size()
  // entries.
  virtual void alltoall_counts(std::span<const std::int64_t> send, std::span<std::int64_t> recv,
                               DeviceStream stream) = 0;

  // Variable exchange of bytes between device buffers: send holds size() consecutive blocks, block d
  // (send_counts[d] bytes) going to rank d; recv receives size() consecutive blocks, block s (recv_counts[s]
  // bytes) from rank s. The host count arrays must agree pairwise; send and recv must not overlap.
  virtual void alltoallv(std::span<const std::byte> send, std::span<const std::int64_t> send_counts,
                         std::span<std::byte> recv, std::span<const std::int64_t> recv_counts,
                         DeviceStream stream) = 0;

  // alltoallv with every block block_bytes long on every rank: no count depends on data, so nothing waits
  // for the host (see the header comment).
  void alltoall_fixed(std::span<const std::byte> send, std::span<std::byte> recv, std::int64_t block_bytes,
                      DeviceStream stream) {
    if (block_bytes < 0) {
      throw std::invalid_argument("DeviceCommunicator::alltoall_fixed: block_bytes is negative (" +
                                  std::to_string(block_bytes) + ")");
    }
    fixed_counts_.assign(static_cast<std::size_t>(size()), block_bytes);
    alltoallv(send, fixed_counts_, recv, fixed_counts_, stream);
  }

  // Element-wise sum (or max) over all ranks, in place on the device; every rank passes the same length.
  virtual void allreduce_sum(std::span<std::int64_t> values, DeviceStream stream) = 0;
  virtual void allreduce_max(std::span<double> values, DeviceStream stream) = 0;

  // all[r * mine.size() + i] = rank r's mine[i], device arrays; every rank passes the same length.
  virtual void allgather(std::span<const std::int64_t> mine, std::span<std::int64_t> all,
                         DeviceStream stream) = 0;

  // Bytes this rank has sent to other ranks through alltoallv (and alltoall_fixed) since construction, its
  // own block excluded.
  [[nodiscard]] std::int64_t bytes_sent() const { return sent_.total(); }

 protected:
  void count_sent(std::span<const std::int64_t> send_counts) { sent_.add(send_counts, rank()); }

 private:
  SentBytes sent_;
  std::vector<std::int64_t> fixed_counts_;
};

}  // namespace capserve::parallel
