#include <gtest/gtest.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "parallel/self_communicator.h"
#include "tests/support/communicator_checks.h"
#include "tests/support/thread_communicator.h"

namespace capserve::parallel {
namespace {

using capserve::test::run_ranks;

TEST(SelfCommunicator, IsRankZeroOfOne) {
  SelfCommunicator comm;
  EXPECT_EQ(comm.rank(), 0);
  EXPECT_EQ(comm.size(), 1);
  EXPECT_EQ(comm.bytes_sent(), 0);
}

TEST(SelfCommunicator, EveryCollective) {
  SelfCommunicator comm;
  test::check_all_collectives(comm);
  EXPECT_EQ(comm.bytes_sent(), 0);  // its own block never counts
}

TEST(SelfCommunicator, CopiesAndLeavesReductionsAlone) {
  SelfCommunicator comm;
  const std::vector<std::byte> send = {std::byte{1}, std::byte{2}, std::byte{3}};
  std::vector<std::byte> recv(3);
  const std::vector<std::int64_t> counts = {3};
  comm.alltoallv(send, counts, recv, counts);
  EXPECT_EQ(recv, send);
  std::vector<std::int64_t> sum = {5, -7};
  comm.allreduce_sum(sum);
  EXPECT_EQ(sum, (std::vector<std::int64_t>{5, -7}));
  std::vector<double> max = {-1.5};
  comm.allreduce_max(max);
  EXPECT_EQ(max[0], -1.5);
}

TEST(SelfCommunicator, RejectsBadArguments) {
  SelfCommunicator comm;
  std::vector<std::byte> buf(4);
  const std::vector<std::int64_t> two = {2};
  const std::vector<std::int64_t> three = {3};
  const std::vector<std::int64_t> eight = {8};
  const std::vector<std::int64_t> pair = {1, 1};
  EXPECT_THROW(comm.alltoallv(buf, two, buf, three), std::invalid_argument);
  EXPECT_THROW(comm.alltoallv(buf, eight, buf, eight), std::invalid_argument);
  EXPECT_THROW(comm.alltoallv(buf, pair, buf, pair), std::invalid_argument);
  std::vector<std::int64_t> out(2);
  EXPECT_THROW(comm.alltoall(pair, out), std::invalid_argument);
  EXPECT_THROW(comm.allgather(pair, std::span<std::int64_t>(out.data(), 1)), std::invalid_argument);
}

class ThreadGroupTest : public ::testing::TestWithParam<int> {};

TEST_P(ThreadGroupTest, RanksAndSize) {
  const int n = GetParam();
  std::vector<std::atomic<int>> seen(static_cast<std::size_t>(n));
  run_ranks(n, [&](Communicator& comm) {
    EXPECT_EQ(comm.size(), n);
    ++seen[static_cast<std::size_t>(comm.rank())];
  });
  for (const auto& s : seen) EXPECT_EQ(s.load(), 1);
}

TEST_P(ThreadGroupTest, EveryCollective) {
  run_ranks(GetParam(), [](Communicator& comm) { test::check_all_collectives(comm); });
}

TEST_P(ThreadGroupTest, AlltoallvUnevenAndZeroBlocksCountBytesSentToOthers) {
  const int n = GetParam();
  run_ranks(n, [n](Communicator& comm) {
    std::int64_t expect = 0;
    for (int round = 0; round < 8; ++round) {
      test::check_alltoallv_pattern(comm, round);
      for (int d = 0; d < n; ++d) {
        if (d != comm.rank()) expect += test::pattern_count(comm.rank(), d, round);
      }
      EXPECT_EQ(comm.bytes_sent(), expect);
    }
  });
}

// The tensor forms: the same collectives on tensors of the communicator's device; a tensor of another device
// is refused before anything is exchanged.
TEST_P(ThreadGroupTest, TensorFormsAndTheirDeviceCheck) {
  const int n = GetParam();
  run_ranks(n, [n](Communicator& comm) {
    const auto r = static_cast<std::int64_t>(comm.rank());
    std::vector<std::int64_t> send(static_cast<std::size_t>(n)), recv(static_cast<std::size_t>(n), -1);
    for (int d = 0; d < n; ++d) send[static_cast<std::size_t>(d)] = 100 * r + d;
    comm.alltoall(kernels::Tensor::host(std::span<const std::int64_t>(send), {n}),
                  kernels::Tensor::host(std::span(recv), {n}), nullptr);
    for (int s = 0; s < n; ++s) EXPECT_EQ(recv[static_cast<std::size_t>(s)], 100 * s + r);

    std::vector<float> rows(static_cast<std::size_t>(2 * n), static_cast<float>(r));
    std::vector<float> got(rows.size(), -1.0F);
    const std::vector<std::int64_t> counts(static_cast<std::size_t>(n), 2 * sizeof(float));
    comm.alltoallv(kernels::Tensor::host(std::span<const float>(rows), {n, 2}), counts,
                   kernels::Tensor::host(std::span(got), {n, 2}), counts, nullptr);
    for (int s = 0; s < n; ++s) EXPECT_EQ(got[static_cast<std::size_t>(2 * s + 1)], static_cast<float>(s));

    std::int64_t value = r + 1;
    comm.allreduce_sum(kernels::Tensor::host(std::span<std::int64_t>(&value, 1), {1}), nullptr);
    EXPECT_EQ(value, n * (n + 1) / 2);
    std::vector<std::int64_t> all(static_cast<std::size_t>(n));
    comm.allgather(kernels::Tensor::host(std::span<const std::int64_t>(&r, 1), {1}),
                   kernels::Tensor::host(std::span(all), {n}), nullptr);
    for (int s = 0; s < n; ++s) EXPECT_EQ(all[static_cast<std::size_t>(s)], s);

    const kernels::Tensor on_gpu(send.data(), kernels::DType::i64, {kernels::DeviceKind::cuda, 0}, {n});
    EXPECT_THROW(comm.allreduce_sum(on_gpu, nullptr), std::invalid_argument);
  });
}

TEST_P(ThreadGroupTest, ZeroLengthEverywhere) {
  run_ranks(GetParam(), [](Communicator& comm) {
    test::check_empty_collectives(comm);
    test::check_alltoallv_one_sender(comm);
    EXPECT_EQ(comm.bytes_sent(),
              comm.rank() == 0 ? 1000 * (comm.size() - 1) + comm.size() * (comm.size() - 1) / 2 : 0);
  });
}

// Many mixed rounds: the rendezvous must not let a fast rank overtake a slow one.
TEST_P(ThreadGroupTest, ManyRoundsStayInStep) {
  run_ranks(GetParam(), [](Communicator& comm) {
    for (int round = 0; round < 300; ++round) {
      std::vector<std::int64_t> v = {round, comm.rank()};
      comm.allreduce_sum(v);
      EXPECT_EQ(v[0], static_cast<std::int64_t>(round) * comm.size());
      EXPECT_EQ(v[1], static_cast<std::int64_t>(comm.size()) * (comm.size() - 1) / 2);
      test::check_alltoallv_pattern(comm, round);
    }
  });
}

TEST_P(ThreadGroupTest, AThrowingRankIsReportedAndNobodyHangs) {
  const int n = GetParam();
  EXPECT_THROW(run_ranks(n,
                         [n](Communicator& comm) {
                           if (comm.rank() == n - 1) throw std::domain_error("rank failed");
                           std::vector<std::int64_t> v = {1};
                           comm.allreduce_sum(v);
                           comm.allreduce_sum(v);
                         }),
               std::domain_error);
}

TEST_P(ThreadGroupTest, MismatchedCollectivesThrowEverywhere) {
  const int n = GetParam();
  if (n == 1) GTEST_SKIP() << "needs two ranks";
  std::atomic<int> threw = 0;
  EXPECT_THROW(run_ranks(n,
                         [&](Communicator& comm) {
                           std::vector<std::int64_t> v(static_cast<std::size_t>(comm.size()), 1);
                           try {
                             if (comm.rank() == 1) {
                               comm.allreduce_sum(v);
                             } else {
                               std::vector<std::int64_t> out(v.size());
                               comm.alltoall(v, out);
                             }
                           } catch (const std::logic_error&) {
                             ++threw;
                             throw;
                           }
                         }),
               std::logic_error);
  EXPECT_EQ(threw.load(), n);
}

TEST_P(ThreadGroupTest, DisagreeingCountsThrowEverywhere) {
  const int n = GetParam();
  std::atomic<int> threw = 0;
  EXPECT_THROW(run_ranks(n,
                         [&](Communicator& comm) {
                           const std::vector<std::int64_t> send_counts(static_cast<std::size_t>(n), 1);
                           std::vector<std::int64_t> recv_counts(static_cast<std::size_t>(n), 1);
                           if (comm.rank() == 0) recv_counts[0] = 0;  // rank 0 sends itself 1 byte
                           std::vector<std::byte> send(static_cast<std::size_t>(n));
                           std::vector<std::byte> recv(static_cast<std::size_t>(n));
                           try {
                             comm.alltoallv(send, send_counts, recv, recv_counts);
                           } catch (const std::invalid_argument&) {
                             ++threw;
                             throw;
                           }
                         }),
               std::invalid_argument);
  EXPECT_EQ(threw.load(), n);
}

TEST_P(ThreadGroupTest, ARankThatReturnsEarlyMakesTheOthersThrow) {
  const int n = GetParam();
  if (n == 1) GTEST_SKIP() << "needs two ranks";
  EXPECT_THROW(run_ranks(n,
                         [](Communicator& comm) {
                           std::vector<std::int64_t> v = {1};
                           comm.allreduce_sum(v);
                           if (comm.rank() == 0) return;
                           comm.allreduce_sum(v);
                         }),
               test::RankLeftError);
}

TEST_P(ThreadGroupTest, RejectsBadLocalArguments) {
  const int n = GetParam();
  EXPECT_THROW(run_ranks(n,
                         [](Communicator& comm) {
                           const std::vector<std::int64_t> counts(static_cast<std::size_t>(comm.size()), 4);
                           std::vector<std::byte> small(1);
                           comm.alltoallv(small, counts, small,
                                          counts);  // counts add up to more than the spans
                         }),
               std::invalid_argument);
}

INSTANTIATE_TEST_SUITE_P(Ranks, ThreadGroupTest, ::testing::Values(1, 2, 3, 4),
                         [](const ::testing::TestParamInfo<int>& info) {
                           std::string name = "n";
                           name += std::to_string(info.param);
                           return name;
                         });

TEST(ThreadGroup, RankAccessorAndBadSize) {
  test::ThreadGroup group(3);
  EXPECT_EQ(group.size(), 3);
  EXPECT_EQ(group.rank(2).rank(), 2);
  EXPECT_EQ(group.rank(2).size(), 3);
  EXPECT_THROW(test::ThreadGroup(0), std::invalid_argument);
}

}  // namespace
}  // namespace capserve::parallel
