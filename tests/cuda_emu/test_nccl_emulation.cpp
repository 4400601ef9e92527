// The NCCL stand-in's contract checks under mpirun (label cuda-emu, 2 ranks, a GPU each): what would hang or
// corrupt data on GPUs fails with a message naming it — mismatched send and receive sizes, collectives issued
// in a different order on one rank, a send without a receive — and the failure stays on the communicator
// (ncclCommGetAsyncError). Non-blocking communicators: using one before its init or last operation left
// ncclInProgress fails.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>
#include <mpi.h>
#include <nccl.h>

#include <cstdint>
#include <string>
#include <vector>

#include "kernels/cuda/cuda_check.h"
#include "tests/mpi/mpi_gtest_main.h"

namespace capserve {
namespace {

using kernels::cuda::DeviceBuffer;

// One NCCL communicator over the world, on this rank's own emulated GPU; aborted at the end.
class NcclEmulation : public ::testing::Test {
 protected:
  NcclEmulation() {
    rank_ = test::mpi_world().rank();
    size_ = test::mpi_world().size();
    CAPSERVE_CUDA_CHECK(cudaSetDevice(rank_));
    ncclUniqueId id{};
    if (rank_ == 0) {
      EXPECT_EQ(ncclGetUniqueId(&id), ncclSuccess);
    }
    MPI_Bcast(&id, sizeof id, MPI_BYTE, 0, MPI_COMM_WORLD);
    EXPECT_EQ(ncclCommInitRank(&comm_, size_, id, rank_), ncclSuccess);
  }
  ~NcclEmulation() override { ncclCommAbort(comm_); }

  // The communicator's error after `rc`: both must name the failure.
  void expect_failed(ncclResult_t rc, ncclResult_t want, const std::string& message) {
    EXPECT_EQ(rc, want) << ncclGetErrorString(rc);
    const std::string last = ncclGetLastError(comm_);
    EXPECT_NE(last.find(message), std::string::npos) << last;
    ncclResult_t async = ncclSuccess;
    EXPECT_EQ(ncclCommGetAsyncError(comm_, &async), ncclSuccess);
    EXPECT_EQ(async, want);
  }

  int rank_ = 0;
  int size_ = 1;
  ncclComm_t comm_ = nullptr;
};

TEST_F(NcclEmulation, MismatchedSendAndReceiveSizesFail) {
  ASSERT_EQ(size_, 2);
  const int peer = 1 - rank_;
  DeviceBuffer<std::uint8_t> send(16);
  DeviceBuffer<std::uint8_t> recv(16);
  // Rank 0 sends 16 bytes, rank 1 expects 8.
  const std::size_t sent = rank_ == 0 ? 16 : 8;
  const std::size_t expected = 8;
  ASSERT_EQ(ncclGroupStart(), ncclSuccess);
  EXPECT_EQ(ncclSend(send.data(), sent, ncclUint8, peer, comm_, nullptr), ncclSuccess);
  EXPECT_EQ(ncclRecv(recv.data(), expected, ncclUint8, peer, comm_, nullptr), ncclSuccess);
  const ncclResult_t rc = ncclGroupEnd();
  if (rank_ == 1) {
    expect_failed(rc, ncclInvalidUsage, "expects 8 bytes from rank 0, which sent 16");
  } else {
    EXPECT_EQ(rc, ncclSuccess);
  }
}

TEST_F(NcclEmulation, CollectivesInADifferentOrderFail) {
  ASSERT_EQ(size_, 2);
  DeviceBuffer<std::int64_t> values(2);
  DeviceBuffer<std::int64_t> gathered(4);
  const auto allreduce = [&] {
    return ncclAllReduce(values.data(), values.data(), 2, ncclInt64, ncclSum, comm_, nullptr);
  };
  const auto allgather = [&] {
    return ncclAllGather(values.data(), gathered.data(), 2, ncclInt64, comm_, nullptr);
  };
  EXPECT_EQ(allreduce(), ncclSuccess);  // the first collective agrees
  // Then rank 1 gathers where rank 0 reduces: both ranks see it at once.
  const ncclResult_t rc = rank_ == 0 ? allreduce() : allgather();
  expect_failed(rc, ncclInvalidUsage, "collective #1 differs between ranks");
  // The communicator stays failed.
  EXPECT_EQ(allreduce(), ncclInvalidUsage);
}

TEST_F(NcclEmulation, ASendWithoutAReceiveFailsInsteadOfHanging) {
  ASSERT_EQ(size_, 2);
  DeviceBuffer<std::uint8_t> send(1 << 20);  // large: no eager completion
  if (rank_ == 0) {
    expect_failed(ncclSend(send.data(), send.size(), ncclUint8, 1, comm_, nullptr), ncclInvalidUsage,
                  "ncclSend to rank 1 on rank 0 found no matching ncclRecv");
  }
  EXPECT_TRUE(test::mpi_world().all_agree(true));
}

TEST_F(NcclEmulation, BuffersMustBeDeviceMemoryOfTheCurrentDevice) {
  std::int64_t host[2] = {1, 2};
  expect_failed(ncclAllReduce(host, host, 2, ncclInt64, ncclSum, comm_, nullptr), ncclInvalidArgument,
                "is not device memory");
}

TEST(NcclEmulationConfig, AConfigNotFromTheInitializerFails) {
  ncclUniqueId id{};
  ASSERT_EQ(ncclGetUniqueId(&id), ncclSuccess);  // local: the call fails before joining
  ncclConfig_t config{};
  ncclComm_t comm = nullptr;
  EXPECT_EQ(ncclCommInitRankConfig(&comm, 2, id, 0, &config), ncclInvalidArgument);
  EXPECT_EQ(comm, nullptr);
  EXPECT_NE(std::string(ncclGetLastError(nullptr)).find("NCCL_CONFIG_INITIALIZER"), std::string::npos);
}

// A non-blocking communicator (config.blocking = 0), whose init has returned ncclInProgress; destroyed at the
// end.
class NcclEmulationNonBlocking : public ::testing::Test {
 protected:
  NcclEmulationNonBlocking() {
    const int rank = test::mpi_world().rank();
    CAPSERVE_CUDA_CHECK(cudaSetDevice(rank));
    ncclUniqueId id{};
    if (rank == 0) {
      EXPECT_EQ(ncclGetUniqueId(&id), ncclSuccess);
    }
    MPI_Bcast(&id, sizeof id, MPI_BYTE, 0, MPI_COMM_WORLD);
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    EXPECT_EQ(ncclCommInitRankConfig(&comm_, test::mpi_world().size(), id, rank, &config), ncclInProgress);
  }
  ~NcclEmulationNonBlocking() override { EXPECT_EQ(ncclCommDestroy(comm_), ncclSuccess); }

  // Polls ncclCommGetAsyncError until it is no longer ncclInProgress: the result.
  ncclResult_t poll_until_done() {
    ncclResult_t state = ncclInProgress;
    while (state == ncclInProgress) EXPECT_EQ(ncclCommGetAsyncError(comm_, &state), ncclSuccess);
    return state;
  }
  ncclResult_t poll_once() {
    ncclResult_t state = ncclSuccess;
    EXPECT_EQ(ncclCommGetAsyncError(comm_, &state), ncclSuccess);
    return state;
  }
  std::string last_error() const { return ncclGetLastError(comm_); }

  ncclComm_t comm_ = nullptr;
};

TEST_F(NcclEmulationNonBlocking, UsingTheCommunicatorBeforeItsInitCompletedFails) {
  DeviceBuffer<std::int64_t> values(2);
  const auto allreduce = [&] {
    return ncclAllReduce(values.data(), values.data(), 2, ncclInt64, ncclSum, comm_, nullptr);
  };
  EXPECT_EQ(allreduce(), ncclInvalidUsage);
  EXPECT_NE(last_error().find("ncclAllReduce: the communicator is still initialising"), std::string::npos)
      << last_error();
  // Not kept as the communicator's error: polling completes the init, and then the call works.
  EXPECT_EQ(poll_until_done(), ncclSuccess);
  std::vector<std::int64_t> host{1, test::mpi_world().rank()};
  CAPSERVE_CUDA_CHECK(cudaMemcpy(values.data(), host.data(), values.bytes(), cudaMemcpyHostToDevice));
  EXPECT_EQ(allreduce(), ncclInProgress);
  EXPECT_EQ(poll_until_done(), ncclSuccess);
  CAPSERVE_CUDA_CHECK(cudaMemcpy(host.data(), values.data(), values.bytes(), cudaMemcpyDeviceToHost));
  const int n = test::mpi_world().size();
  EXPECT_EQ(host, (std::vector<std::int64_t>{n, n * (n - 1) / 2}));
}

TEST_F(NcclEmulationNonBlocking, NotPollingAfterGroupEndIsCaught) {
  ASSERT_EQ(poll_until_done(), ncclSuccess);
  const int peer = 1 - test::mpi_world().rank();
  DeviceBuffer<std::uint8_t> send(8);
  DeviceBuffer<std::uint8_t> recv(8);
  DeviceBuffer<std::int64_t> values(1);
  ASSERT_EQ(ncclGroupStart(), ncclSuccess);
  EXPECT_EQ(ncclSend(send.data(), 8, ncclUint8, peer, comm_, nullptr), ncclSuccess);
  EXPECT_EQ(ncclRecv(recv.data(), 8, ncclUint8, peer, comm_, nullptr), ncclSuccess);
  EXPECT_EQ(ncclGroupEnd(), ncclInProgress);
  EXPECT_EQ(poll_once(), ncclInProgress);  // one poll is not enough: poll while it says ncclInProgress
  EXPECT_EQ(ncclAllReduce(values.data(), values.data(), 1, ncclInt64, ncclSum, comm_, nullptr),
            ncclInvalidUsage);
  EXPECT_NE(last_error().find("ncclAllReduce: the communicator's previous operation is still ncclInProgress"),
            std::string::npos)
      << last_error();
  EXPECT_EQ(poll_until_done(), ncclSuccess);
  EXPECT_EQ(ncclAllReduce(values.data(), values.data(), 1, ncclInt64, ncclSum, comm_, nullptr),
            ncclInProgress);
  EXPECT_EQ(poll_until_done(), ncclSuccess);
}

}  // namespace
}  // namespace capserve
