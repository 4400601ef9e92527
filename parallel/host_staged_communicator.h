#pragma once
// Communicator through host memory: device-to-host copies into grow-only staging buffers, one wait for
// them, the collective of a host Communicator (MpiCommunicator) on the staged bytes, copies back to the
// device (not waited for). Made for several ranks sharing one GPU, which NCCL (<= 2.29) refuses, so that
// multi-rank GPU runs work on a one-GPU machine; slower than NCCL by the host round trip and the extra
// copies.
//
// alltoallv stages only the blocks for other ranks: this rank's own block is one device-to-device copy, and
// the host collective moves zero bytes for it. The copies go through a MemoryMover (CudaMemoryMover on a GPU;
// a host implementation in the tests), so all of the block and staging arithmetic runs without a GPU.
//
// Like the host communicator, calls must come from one thread at a time and in the same order on every rank.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "parallel/block_layout.h"
#include "parallel/communicator.h"
#include "parallel/memory_mover.h"

namespace capserve::parallel {

class HostStagedCommunicator final : public Communicator {
 public:
  // host must outlive this communicator; its rank and size are this communicator's.
  HostStagedCommunicator(Communicator& host, std::unique_ptr<MemoryMover> mover);
  // Waits for the last copies back to the device, which read the staging buffers (and write the caller's
  // buffers: those must still exist).
  ~HostStagedCommunicator() override;

  [[nodiscard]] int rank() const override { return host_.rank(); }
  [[nodiscard]] int size() const override { return host_.size(); }
  [[nodiscard]] kernels::Device device() const override { return mover_->device(); }

  // Bytes of host staging held (outgoing, incoming): the largest staged amounts so far, never shrinking.
  [[nodiscard]] std::size_t send_staging_bytes() const { return send_staging_.bytes; }
  [[nodiscard]] std::size_t recv_staging_bytes() const { return recv_staging_.bytes; }

 protected:
  // Argument errors throw std::invalid_argument or std::length_error before anything is copied or sent.
  void do_alltoall(std::span<const std::int64_t> send, std::span<std::int64_t> recv, Stream stream) override;
  void do_alltoallv(std::span<const std::byte> send, std::span<const std::int64_t> send_counts,
                    std::span<std::byte> recv, std::span<const std::int64_t> recv_counts,
                    Stream stream) override;
  void do_allreduce_sum(std::span<std::int64_t> values, Stream stream) override;
  void do_allreduce_max(std::span<double> values, Stream stream) override;
  void do_allgather(std::span<const std::int64_t> mine, std::span<std::int64_t> all, Stream stream) override;

 private:
  struct Staging {
    MemoryMover::HostBuffer buffer{nullptr, nullptr};
    std::size_t bytes = 0;
  };

  // The first `bytes` bytes of `staging`, reallocated (contents dropped) when it is smaller.
  std::span<std::byte> stage(Staging& staging, std::size_t bytes);
  // values (device) -> send staging -> host collective `op` in place -> back into values.
  template <typename T, typename Op>
  void staged_in_place(std::span<T> values, Stream stream, Op op);

  Communicator& host_;
  std::unique_ptr<MemoryMover> mover_;
  Staging send_staging_, recv_staging_;
  BlockLayout send_layout_, recv_layout_;
  // The counts the host collective sees: this rank's own block zeroed (it never leaves the device).
  std::vector<std::int64_t> staged_send_counts_, staged_recv_counts_;
};

}  // namespace capserve::parallel
