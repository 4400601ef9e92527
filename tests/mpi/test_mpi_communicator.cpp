#include <gtest/gtest.h>

#include <climits>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <vector>

#include "parallel/mpi_communicator.h"
#include "tests/mpi/mpi_gtest_main.h"
#include "tests/support/communicator_checks.h"

namespace capserve::parallel {
namespace {

using test::mpi_world;

TEST(MpiWorld, RanksMatchMpiCommWorld) {
  MpiWorld& world = mpi_world();
  int rank = -1;
  int size = -1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  EXPECT_EQ(world.rank(), rank);
  EXPECT_EQ(world.size(), size);
  // One node: the node-local group is the whole job.
  EXPECT_EQ(world.local_rank(), rank);
  EXPECT_EQ(world.local_size(), size);
  EXPECT_GE(world.thread_level(), MPI_THREAD_SERIALIZED);
}

TEST(MpiWorld, BroadcastFromEveryRoot) {
  MpiWorld& world = mpi_world();
  for (int root = 0; root < world.size(); ++root) {
    for (const std::size_t len : {std::size_t{0}, std::size_t{1}, std::size_t{1000}, std::size_t{3} << 20}) {
      std::vector<std::byte> bytes;
      if (world.rank() == root) {
        for (std::size_t i = 0; i < len; ++i) bytes.push_back(static_cast<std::byte>((i * 13 + root) & 0xff));
      } else {
        bytes.assign(17, std::byte{0x5A});  // stale contents are replaced, whatever their size
      }
      world.broadcast(bytes, root);
      ASSERT_EQ(bytes.size(), len) << "root " << root;  // same on every rank
      std::size_t wrong = 0;
      for (std::size_t i = 0; i < len; ++i)
        wrong += bytes[i] != static_cast<std::byte>((i * 13 + root) & 0xff);
      EXPECT_EQ(wrong, 0U) << "root " << root << " len " << len;
    }
  }
}

TEST(MpiWorld, GatherVariableSizesIncludingEmpty) {
  MpiWorld& world = mpi_world();
  const auto mine_of = [](int r) {
    std::vector<std::byte> v(static_cast<std::size_t>(r % 2 == 0 ? 3 * r : 70000 + r));  // rank 0: empty
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = static_cast<std::byte>((i + 7 * r) & 0xff);
    return v;
  };
  for (int root = 0; root < world.size(); ++root) {
    const std::vector<std::vector<std::byte>> all = world.gather(mine_of(world.rank()), root);
    if (world.rank() == root) {
      ASSERT_EQ(all.size(), static_cast<std::size_t>(world.size()));
      for (int r = 0; r < world.size(); ++r)
        EXPECT_EQ(all[static_cast<std::size_t>(r)], mine_of(r)) << "rank " << r;
    } else {
      EXPECT_TRUE(all.empty());
    }
  }
  // Every rank empty.
  const std::vector<std::vector<std::byte>> none = world.gather({}, 0);
  if (world.rank() == 0) {
    ASSERT_EQ(none.size(), static_cast<std::size_t>(world.size()));
    for (const auto& v : none) EXPECT_TRUE(v.empty());
  }
}

TEST(MpiWorld, AllAgreeIsLogicalAnd) {
  MpiWorld& world = mpi_world();
  EXPECT_TRUE(world.all_agree(true));
  EXPECT_FALSE(world.all_agree(false));
  for (int dissenter = 0; dissenter < world.size(); ++dissenter) {
    EXPECT_FALSE(world.all_agree(world.rank() != dissenter)) << "dissenter " << dissenter;
  }
  world.barrier();
}

TEST(MpiWorld, BadRootThrowsOnEveryRankWithoutCommunicating) {
  MpiWorld& world = mpi_world();
  std::vector<std::byte> bytes(3);
  EXPECT_THROW(world.broadcast(bytes, world.size()), std::invalid_argument);
  EXPECT_THROW(world.gather(bytes, -1), std::invalid_argument);
  EXPECT_TRUE(world.all_agree(true));  // still in step
}

TEST(MpiCommunicator, RankAndSizeOfTheWorld) {
  MpiCommunicator comm;
  EXPECT_EQ(comm.rank(), mpi_world().rank());
  EXPECT_EQ(comm.size(), mpi_world().size());
  EXPECT_EQ(comm.bytes_sent(), 0);
  int cmp = MPI_UNEQUAL;
  MPI_Comm_compare(comm.comm(), MPI_COMM_WORLD, &cmp);
  EXPECT_EQ(cmp, MPI_CONGRUENT);  // a duplicate, not MPI_COMM_WORLD itself
}

TEST(MpiCommunicator, EveryCollective) {
  MpiCommunicator comm;
  test::check_all_collectives(comm);
}

TEST(MpiCommunicator, AlltoallvUnevenAndZeroBlocksCountBytesSentToOthers) {
  MpiCommunicator comm;
  std::int64_t expect = 0;
  for (int round = 0; round < 8; ++round) {
    test::check_alltoallv_pattern(comm, round);
    for (int d = 0; d < comm.size(); ++d) {
      if (d != comm.rank()) expect += test::pattern_count(comm.rank(), d, round);
    }
    EXPECT_EQ(comm.bytes_sent(), expect);
  }
}

TEST(MpiCommunicator, ZeroLengthEverywhere) {
  MpiCommunicator comm;
  test::check_empty_collectives(comm);
  test::check_alltoallv_one_sender(comm);
  const int n = comm.size();
  EXPECT_EQ(comm.bytes_sent(), comm.rank() == 0 ? 1000 * (n - 1) + n * (n - 1) / 2 : 0);
}

TEST(MpiCommunicator, LargeBlocks) {
  MpiCommunicator comm;
  const int n = comm.size();
  const std::size_t block = std::size_t{1} << 20;  // well past the shared-memory eager limit
  std::vector<std::byte> send(block * static_cast<std::size_t>(n));
  for (std::size_t i = 0; i < send.size(); ++i)
    send[i] = static_cast<std::byte>((i / block * 29 + comm.rank() + i) & 0xff);
  const std::vector<std::int64_t> counts(static_cast<std::size_t>(n), static_cast<std::int64_t>(block));
  std::vector<std::byte> recv(send.size());
  comm.alltoallv(send, counts, recv, counts);
  std::size_t wrong = 0;
  for (int s = 0; s < n; ++s) {
    for (std::size_t i = 0; i < block; ++i) {
      const std::size_t at = static_cast<std::size_t>(s) * block + i;
      const std::size_t sent_at = static_cast<std::size_t>(comm.rank()) * block + i;
      wrong += recv[at] != static_cast<std::byte>((sent_at / block * 29 + s + sent_at) & 0xff);
    }
  }
  EXPECT_EQ(wrong, 0U);
  EXPECT_EQ(comm.bytes_sent(), static_cast<std::int64_t>(block) * (n - 1));
}

TEST(MpiCommunicator, TwoCommunicatorsDoNotMix) {
  MpiCommunicator a;
  MpiCommunicator b;
  test::check_alltoallv_pattern(a, 1);
  test::check_alltoallv_pattern(b, 2);
  test::check_allreduce_sum(b, 5);
  test::check_allgather(a, 3);
  EXPECT_GT(a.bytes_sent() + b.bytes_sent() + (a.size() == 1 ? 1 : 0), 0);
}

TEST(MpiCommunicator, BadArgumentsThrowOnEveryRankBeforeCommunicating) {
  MpiCommunicator comm;
  const auto n = static_cast<std::size_t>(comm.size());
  std::vector<std::byte> buf(4);
  const std::vector<std::int64_t> too_few(n + 1, 0);
  const std::vector<std::int64_t> zeros(n, 0);
  EXPECT_THROW(comm.alltoallv(buf, too_few, buf, zeros), std::invalid_argument);
  std::vector<std::int64_t> negative(n, 0);
  negative[0] = -1;
  EXPECT_THROW(comm.alltoallv(buf, negative, buf, zeros), std::invalid_argument);
  std::vector<std::int64_t> huge(n, 0);
  huge[0] = std::int64_t{INT_MAX} + 1;
  EXPECT_THROW(comm.alltoallv(buf, huge, buf, zeros), std::length_error);
  std::vector<std::int64_t> far(n, INT_MAX);  // each count fits, the last displacement does not (n > 2)
  if (n > 2) {
    EXPECT_THROW(comm.alltoallv(buf, far, buf, zeros), std::length_error);
  }
  std::vector<std::int64_t> too_much(n, 5);  // fits int, but more bytes than the span holds
  EXPECT_THROW(comm.alltoallv(buf, too_much, buf, zeros), std::invalid_argument);
  std::vector<std::int64_t> out(n + 1);
  EXPECT_THROW(comm.alltoall(zeros, out), std::invalid_argument);
  EXPECT_THROW(comm.allgather(zeros, out), std::invalid_argument);
  EXPECT_EQ(comm.bytes_sent(), 0);
  test::check_alltoall(comm);  // still in step
}

}  // namespace
}  // namespace capserve::parallel
