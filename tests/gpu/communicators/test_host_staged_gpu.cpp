// HostStagedCommunicator on real device memory (CudaMemoryMover) under mpirun (label gpu), every rank of the
// node on GPU local_rank % GPUs, so at np 2 and 4 on a one-GPU machine the ranks share it: the case NCCL
// refuses. Checked against MpiCommunicator byte for byte; skips without a CUDA device.
#include <gtest/gtest.h>

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>

#include "parallel/cuda_memory_mover.h"
#include "parallel/host_staged_communicator.h"
#include "parallel/mpi_communicator.h"
#include "tests/gpu/communicators/cuda_test_device.h"
#include "tests/gpu/gpu_test_support.h"
#include "tests/mpi/device_communicator_cases.h"
#include "tests/mpi/mpi_gtest_main.h"

namespace capserve::parallel {
namespace {

// The current device set first, so that the mover's event and the test stream belong to it.
struct OnGpu {
  int device = [] {
    int count = 0;
    CAPSERVE_CUDA_CHECK(cudaGetDeviceCount(&count));
    const int d = test::mpi_world().local_rank() % count;
    CAPSERVE_CUDA_CHECK(cudaSetDevice(d));
    return d;
  }();
  test::CudaTestDevice memory;
  MpiCommunicator host;
  HostStagedCommunicator comm{host, std::make_unique<CudaMemoryMover>()};
  MpiCommunicator ref;
};

TEST(HostStagedCommunicatorOnGpu, AlltoallvEqualsMpiOnRandomCases) {
  CAPSERVE_REQUIRE_CUDA_DEVICE();
  OnGpu g;
  for (std::uint64_t seed = 1; seed <= 3; ++seed)
    test::check_alltoallv_against_mpi(g.comm, g.ref, g.memory, seed);
  EXPECT_EQ(g.comm.bytes_sent(), g.ref.bytes_sent());
}

TEST(HostStagedCommunicatorOnGpu, AlltoallFixedAndSmallCollectivesEqualMpi) {
  CAPSERVE_REQUIRE_CUDA_DEVICE();
  OnGpu g;
  test::check_alltoall_fixed_against_mpi(g.comm, g.ref, g.memory, 3);
  for (std::uint64_t seed = 1; seed <= 2; ++seed)
    test::check_small_collectives_against_mpi(g.comm, g.ref, g.memory, seed);
}

TEST(HostStagedCommunicatorOnGpu, ArgumentErrorsThrowOnEveryRank) {
  CAPSERVE_REQUIRE_CUDA_DEVICE();
  OnGpu g;
  test::check_argument_errors(g.comm, g.memory);
}

}  // namespace
}  // namespace capserve::parallel
