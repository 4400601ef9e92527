#pragma once
// Communicator over NCCL, one GPU per rank. Bootstrapped over MPI: rank 0 makes the ncclUniqueId and
// MpiWorld broadcasts it; each rank takes GPU (local rank % GPUs on its node) as its current device.
// alltoallv is one NCCL group of ncclSend/ncclRecv, one pair per peer with a non-zero count (the own block is
// a device-to-device copy); nothing in any call waits on the host.
//
// NCCL (<= 2.29) refuses two ranks on one GPU. The constructor checks this first (by GPU UUID, across nodes)
// and fails on every rank with a message naming the fix: HostStagedCommunicator for several ranks per GPU.
// Streams passed to the calls must belong to this communicator's device; any thread may call (each call makes
// that device current on the calling thread).
//
// The communicator is non-blocking (ncclConfig_t::blocking = 0): initialisation is polled up to a deadline,
// so a rank that dies or hangs after the id broadcast makes the others throw instead of waiting forever, and
// every call polls ncclCommGetAsyncError until its operation leaves ncclInProgress, as NCCL requires.
//
// A host that waits for device work including these collectives (CudaBackend's to_host) polls
// check_async_error while it waits: a peer that died leaves this rank's NCCL kernels waiting forever, and
// only NCCL's asynchronous error tells, so the wait ends with an error instead of at the step watchdog.
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include "parallel/block_layout.h"
#include "parallel/communicator.h"
#include "parallel/mpi_world.h"

struct ncclComm;  // ncclComm_t is ncclComm*

namespace capserve::parallel {

class NcclCommunicator final : public Communicator {
 public:
  static constexpr std::chrono::milliseconds kDefaultInitDeadline{120'000};

  // Collective over the whole world. Throws std::runtime_error on every rank when any rank has no CUDA
  // device, two ranks share a GPU, or NCCL fails to initialize. When NCCL's initialisation has not completed
  // within `init_deadline` (some rank never joined), aborts it and throws on this rank alone, naming the
  // rank, the deadline and what it waited for: the ranks then are out of step, and the job must end.
  explicit NcclCommunicator(MpiWorld& world, std::chrono::milliseconds init_deadline = kDefaultInitDeadline);
  // ncclCommDestroy; ncclCommAbort instead after an NCCL error or while an exception unwinds (the other ranks
  // may never reach a matching call).
  ~NcclCommunicator() override;

  [[nodiscard]] int rank() const override { return rank_; }
  [[nodiscard]] int size() const override { return size_; }
  // The CUDA device this rank uses (made current by the constructor).
  [[nodiscard]] kernels::Device device() const override { return {kernels::DeviceKind::cuda, device_}; }

  // For a host waiting on device work that includes this communicator's collectives (between polls of the
  // stream; runtime/cli/cuda_rank_devices.cpp gives it to CudaBackend). Returns while NCCL reports no error.
  // On an asynchronous error (a peer rank that died, a network failure) it aborts the communicator, which
  // ends its kernels so that the stream goes on, and throws std::runtime_error naming NCCL, this rank and
  // NCCL's message; every later call throws the same. Not concurrently with this communicator's other calls.
  void check_async_error();

 protected:
  // Argument errors throw std::invalid_argument or std::length_error before anything is enqueued; NCCL and
  // CUDA errors throw std::runtime_error naming the call, with NCCL's last error message, as does an
  // asynchronous error of earlier work (polled at the start of every call).
  void do_alltoall(std::span<const std::int64_t> send, std::span<std::int64_t> recv, Stream stream) override;
  void do_alltoallv(std::span<const std::byte> send, std::span<const std::int64_t> send_counts,
                    std::span<std::byte> recv, std::span<const std::int64_t> recv_counts,
                    Stream stream) override;
  void do_allreduce_sum(std::span<std::int64_t> values, Stream stream) override;
  void do_allreduce_max(std::span<double> values, Stream stream) override;
  void do_allgather(std::span<const std::int64_t> mine, std::span<std::int64_t> all, Stream stream) override;

 private:
  // One grouped exchange of the blocks of two checked layouts.
  void exchange(std::span<const std::byte> send, const BlockLayout& send_layout, std::span<std::byte> recv,
                const BlockLayout& recv_layout, Stream stream);
  // First in every call, from whatever thread: makes this communicator's device current, and throws on an
  // asynchronous error of earlier work (ncclCommGetAsyncError: e.g. a peer failed).
  void begin_call();
  // Throws on an NCCL error (result is an ncclResult_t) and marks the communicator for ncclCommAbort.
  void check(int result, const char* what);
  // check() for a call that may return ncclInProgress (every call of a non-blocking communicator outside a
  // group): then polls until its operation completed, pausing briefly between polls (the step watchdog covers
  // a hang).
  void complete(int result, const char* what);
  // ncclCommAbort now (not in the destructor): throws std::runtime_error with `why`, kept for later calls.
  [[noreturn]] void abort(const std::string& why);

  int rank_ = 0;
  int size_ = 1;
  int device_ = 0;
  int uncaught_at_start_ = 0;
  bool failed_ = false;
  ncclComm* comm_ = nullptr;  // owned; null after abort()
  std::string aborted_;       // abort()'s message
  BlockLayout send_layout_, recv_layout_;
  BlockLayout counts_layout_;  // alltoall: one int64 per rank
};

}  // namespace capserve::parallel
