// NcclCommunicator under mpirun (label gpu) against MpiCommunicator on the same random inputs, byte for byte.
// Skips without a CUDA device (there, only the failure to start is tested), and where this node has fewer
// GPUs than ranks (there, the refusal is tested).
#include <gtest/gtest.h>

#include <cuda_runtime_api.h>

#include <cstdint>
#include <numeric>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "parallel/mpi_communicator.h"
#include "parallel/nccl_communicator.h"
#include "tests/gpu/communicators/cuda_test_device.h"
#include "tests/gpu/gpu_test_support.h"
#include "tests/mpi/device_communicator_cases.h"
#include "tests/mpi/mpi_gtest_main.h"

namespace capserve::parallel {
namespace {

// GTEST_SKIP returns from the test body, so this must be a macro used there; every rank of the node skips
// alike.
TEST(NcclCommunicator, SelectsTheGpuOfItsLocalRank) {
  CAPSERVE_REQUIRE_GPU_PER_RANK();
  NcclCommunicator comm(test::mpi_world());
  int count = 0;
  int current = -1;
  ASSERT_EQ(cudaGetDeviceCount(&count), cudaSuccess);
  ASSERT_EQ(cudaGetDevice(&current), cudaSuccess);
  EXPECT_EQ(comm.device().index, test::mpi_world().local_rank() % count);
  EXPECT_EQ(current, comm.device().index);
  EXPECT_EQ(comm.rank(), test::mpi_world().rank());
  EXPECT_EQ(comm.size(), test::mpi_world().size());
  EXPECT_EQ(comm.bytes_sent(), 0);
}

TEST(NcclCommunicator, AlltoallvEqualsMpiOnRandomCases) {
  CAPSERVE_REQUIRE_GPU_PER_RANK();
  NcclCommunicator comm(test::mpi_world());
  test::CudaTestDevice device;
  MpiCommunicator ref;
  for (std::uint64_t seed = 1; seed <= 3; ++seed) test::check_alltoallv_against_mpi(comm, ref, device, seed);
  EXPECT_EQ(comm.bytes_sent(), ref.bytes_sent());
}

TEST(NcclCommunicator, AlltoallFixedAndSmallCollectivesEqualMpi) {
  CAPSERVE_REQUIRE_GPU_PER_RANK();
  NcclCommunicator comm(test::mpi_world());
  test::CudaTestDevice device;
  MpiCommunicator ref;
  test::check_alltoall_fixed_against_mpi(comm, ref, device, 3);
  for (std::uint64_t seed = 1; seed <= 2; ++seed)
    test::check_small_collectives_against_mpi(comm, ref, device, seed);
}

TEST(NcclCommunicator, ArgumentErrorsThrowOnEveryRank) {
  CAPSERVE_REQUIRE_GPU_PER_RANK();
  NcclCommunicator comm(test::mpi_world());
  test::CudaTestDevice device;
  test::check_argument_errors(comm, device);
}

// A thread other than the constructor's starts on device 0, whatever GPU this rank uses: every call must make
// the communicator's device current itself.
TEST(NcclCommunicator, WorksFromAnotherThread) {
  CAPSERVE_REQUIRE_GPU_PER_RANK();
  NcclCommunicator comm(test::mpi_world());
  test::CudaTestDevice device;
  const int n = comm.size();
  const int me = comm.rank();
  std::vector<std::int64_t> counts(static_cast<std::size_t>(n));
  std::vector<std::byte> send;
  std::vector<std::byte> want;
  for (int r = 0; r < n; ++r) {
    counts[static_cast<std::size_t>(r)] = 1 + r + me;  // symmetric: what r sends me, I send r
    send.insert(send.end(), static_cast<std::size_t>(1 + r + me), static_cast<std::byte>(me * 16 + r));
    want.insert(want.end(), static_cast<std::size_t>(1 + r + me), static_cast<std::byte>(r * 16 + me));
  }
  const std::span<std::byte> d_send = device.upload(send);
  const std::span<std::byte> d_recv = device.upload(std::vector<std::byte>(want.size()));
  std::string error;
  std::thread worker([&] {
    try {
      comm.alltoallv(d_send, counts, d_recv, counts, device.stream());
    } catch (const std::exception& e) {
      error = e.what();
    }
  });
  worker.join();
  EXPECT_EQ(error, "");
  ASSERT_TRUE(test::mpi_world().all_agree(error.empty()));
  EXPECT_EQ(device.download(d_recv), want);
}

// Rank 0 sends rank 1 more than rank 1 expects: rank 1's exchange fails, rank 0's completes. NCCL reports
// rank 1's failure to rank 0 only asynchronously, so rank 0's next call must poll for it and throw rather
// than wait forever in a collective rank 1 never joins.
TEST(NcclCommunicator, APeersFailureStopsTheNextCall) {
  CAPSERVE_REQUIRE_GPU_PER_RANK();
  const int n = test::mpi_world().size();
  if (n < 2) GTEST_SKIP() << "needs two ranks";
  NcclCommunicator comm(test::mpi_world());
  test::CudaTestDevice device;
  const int me = comm.rank();
  std::vector<std::int64_t> send_counts(static_cast<std::size_t>(n), 0);
  std::vector<std::int64_t> recv_counts(static_cast<std::size_t>(n), 0);
  if (me == 0) send_counts[1] = 2;
  if (me == 1) recv_counts[0] = 1;
  const std::span<std::byte> d_send = device.upload(std::vector<std::byte>(2));
  const std::span<std::byte> d_recv = device.upload(std::vector<std::byte>(2));
  const auto total = [](const std::vector<std::int64_t>& counts) {
    return static_cast<std::size_t>(std::accumulate(counts.begin(), counts.end(), std::int64_t{0}));
  };
  bool threw = false;
  try {
    comm.alltoallv(d_send.first(total(send_counts)), send_counts, d_recv.first(total(recv_counts)),
                   recv_counts, device.stream());
  } catch (const std::runtime_error&) {
    threw = true;
  }
  // Ranks 2 and up have nothing to exchange: they throw only if rank 1's failure reached them first.
  if (me < 2) {
    EXPECT_EQ(threw, me == 1);
  }
  EXPECT_FALSE(test::mpi_world().all_agree(!threw));  // every rank knows; now rank 0 calls again
  if (me == 0) {
    std::vector<std::int64_t> values{1};
    const std::span<std::byte> d_values = device.upload(std::as_bytes(std::span(values)));
    EXPECT_THROW(comm.allreduce_sum({reinterpret_cast<std::int64_t*>(d_values.data()), 1}, device.stream()),
                 std::runtime_error);
  }
}

TEST(NcclCommunicator, RefusesTwoRanksOnOneGpuNamingTheFix) {
  CAPSERVE_REQUIRE_CUDA_DEVICE();
  if (!test::fewer_gpus_than_ranks()) GTEST_SKIP() << "every rank of this node has a GPU of its own";
  try {
    NcclCommunicator comm(test::mpi_world());
    ADD_FAILURE() << "NcclCommunicator accepted two ranks on one GPU";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("HostStagedCommunicator"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(test::mpi_world().all_agree(true));  // every rank threw, and all are still in step
}

// The one test that runs where there is no GPU: set-up fails on every rank together, naming the reason.
TEST(NcclCommunicator, WithoutADeviceThrowsOnEveryRank) {
  if (!test::cuda_device_unavailable()) GTEST_SKIP() << "a CUDA device is present";
  try {
    NcclCommunicator comm(test::mpi_world());
    ADD_FAILURE() << "NcclCommunicator started without a CUDA device";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("no CUDA device"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(test::mpi_world().all_agree(true));
}

}  // namespace
}  // namespace capserve::parallel
