// NcclCommunicator's initialisation under mpirun against the NCCL stand-in (label cuda-emu, np 2 and 4): a
// rank that hangs after the id broadcast (delay_next_nccl_init) makes the others throw at their deadline
// instead of waiting forever. Its own program: afterwards the ranks are out of step, as in a job that must
// end.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <stdexcept>
#include <string>

#include "cuda_emu.h"
#include "parallel/nccl_communicator.h"
#include "tests/mpi/mpi_gtest_main.h"

namespace capserve::parallel {
namespace {

TEST(NcclCommunicatorInit, ARankThatNeverJoinsMakesTheOthersThrowAtTheDeadline) {
  const int n = test::mpi_world().size();
  const int me = test::mpi_world().rank();
  if (n < 2) GTEST_SKIP() << "needs two ranks";
  constexpr std::chrono::milliseconds kDeadline{2000};
  constexpr double kMarginS = 1.0;
  // Rank 1 joins only long after everyone's deadline, its own included: it never joins in time.
  if (me == 1) cuda_emu::delay_next_nccl_init(std::chrono::seconds(10));
  const auto start = std::chrono::steady_clock::now();
  std::string message;
  try {
    NcclCommunicator comm(test::mpi_world(), kDeadline);
  } catch (const std::runtime_error& e) {
    message = e.what();
  }
  const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("rank %d: the constructor ended after %.2f s (deadline 2 s): %s\n", me, elapsed,
              message.empty() ? "no exception" : message.c_str());
  EXPECT_NE(message.find("NcclCommunicator: rank " + std::to_string(me) +
                         ": NCCL initialisation (ncclCommInitRankConfig) did not complete within 2 s: waited "
                         "for all " +
                         std::to_string(n) + " ranks to join the communicator"),
            std::string::npos)
      << message;
  EXPECT_GE(elapsed, 2.0);
  EXPECT_LT(elapsed, 2.0 + kMarginS);
  EXPECT_TRUE(
      test::mpi_world().all_agree(true));  // the control plane still works; MPI_Finalize must not hang
}

}  // namespace
}  // namespace capserve::parallel
