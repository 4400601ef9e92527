// gather_rank_hosts and mpi_transport on 1-4 ranks of one machine (and as a singleton): rank 0 learns every
// rank's host (this machine's name for all) and place among the ranks of that host; the transport line is the
// selection the tests' environment makes (tests/CMakeLists.txt: OMPI_MCA_pml=ob1, OMPI_MCA_btl=self,vader).
#include "parallel/rank_hosts.h"

#include <gtest/gtest.h>

#include "tests/mpi/mpi_gtest_main.h"

namespace capserve::parallel {
namespace {

TEST(RankHosts, RankZeroLearnsEveryRanksHostAndLocalRank) {
  MpiWorld& world = test::mpi_world();
  const std::vector<RankHost> hosts = gather_rank_hosts(world);
  if (world.rank() != 0) {
    EXPECT_TRUE(hosts.empty());
    return;
  }
  char name[MPI_MAX_PROCESSOR_NAME] = {};
  int len = 0;
  ASSERT_EQ(MPI_Get_processor_name(name, &len), MPI_SUCCESS);
  ASSERT_EQ(hosts.size(), static_cast<std::size_t>(world.size()));
  for (int r = 0; r < world.size(); ++r) {
    const RankHost& h = hosts[static_cast<std::size_t>(r)];
    EXPECT_EQ(h.host, std::string(name, static_cast<std::size_t>(len))) << "rank " << r;
    // One host: ranks are numbered alike within it (MPI_Comm_split_type keeps the order of world ranks).
    EXPECT_EQ(h.local_rank, r);
    EXPECT_EQ(h.local_size, world.size());
  }
}

TEST(RankHosts, TransportNamesTheEnvironmentsSelection) {
  EXPECT_EQ(mpi_transport(), "pml ob1, btl self,vader");
}

}  // namespace
}  // namespace capserve::parallel
