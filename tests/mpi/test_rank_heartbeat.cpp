// RankHeartbeat on 1-4 ranks: rank 0 hears every other rank (none is silent while all run), silence is
// measured against the allowance given, and destruction takes every rank's last message (no hang, nothing
// unmatched at MPI_Finalize).
#include "parallel/rank_heartbeat.h"

#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include "tests/mpi/mpi_gtest_main.h"

namespace capserve::parallel {
namespace {

using namespace std::chrono_literals;

TEST(RankHeartbeat, RankZeroHearsEveryRank) {
  MpiWorld& world = test::mpi_world();
  if (world.thread_level() != MPI_THREAD_MULTIPLE) GTEST_SKIP() << "MPI grants no MPI_THREAD_MULTIPLE";
  RankHeartbeat heartbeat(world, 20ms);
  if (world.rank() == 0) {
    for (int i = 0; i < 30; ++i) {
      heartbeat.poll();
      std::this_thread::sleep_for(10ms);
    }
    EXPECT_TRUE(heartbeat.silent_ranks(200ms).empty());
    // Nothing can have been heard within no time at all: every other rank counts as silent.
    EXPECT_EQ(heartbeat.silent_ranks(0ms).size(), static_cast<std::size_t>(world.size() - 1));
  }
  world.barrier();
}

}  // namespace
}  // namespace capserve::parallel
