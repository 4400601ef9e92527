#pragma once
// Collective checks that every Communicator must pass, shared by the unit tests (SelfCommunicator,
// ThreadGroup) and the MPI tests (MpiCommunicator under mpirun). Each function is itself collective: call it
// on every rank of the group. They use EXPECT_* (thread-safe in GoogleTest) and never return early, so a
// failure on one rank cannot leave the others waiting in a collective.
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

#include "parallel/communicator.h"

namespace capserve::test {

// Bytes rank s sends to rank d in round `round`: uneven, and zero for about a quarter of the pairs.
inline std::int64_t pattern_count(int s, int d, int round) {
  return (s * 3 + d * 5 + round) % 4 * (1 + s);
}

inline std::byte pattern_byte(int s, int d, std::int64_t i) {
  return static_cast<std::byte>((s * 31 + d * 7 + static_cast<int>(i)) & 0xff);
}

// alltoallv with uneven and zero blocks; bytes_sent grows by exactly the bytes sent to other ranks.
inline void check_alltoallv_pattern(parallel::Communicator& comm, int round) {
  const int n = comm.size();
  const int me = comm.rank();
  std::vector<std::int64_t> send_counts(static_cast<std::size_t>(n));
  std::vector<std::int64_t> recv_counts(static_cast<std::size_t>(n));
  std::vector<std::byte> send;
  std::int64_t to_others = 0;
  std::int64_t recv_total = 0;
  for (int d = 0; d < n; ++d) {
    const std::int64_t c = pattern_count(me, d, round);
    send_counts[static_cast<std::size_t>(d)] = c;
    for (std::int64_t i = 0; i < c; ++i) send.push_back(pattern_byte(me, d, i));
    if (d != me) to_others += c;
    recv_counts[static_cast<std::size_t>(d)] = pattern_count(d, me, round);
    recv_total += recv_counts[static_cast<std::size_t>(d)];
  }
  std::vector<std::byte> recv(static_cast<std::size_t>(recv_total), std::byte{0xEE});
  const std::int64_t before = comm.bytes_sent();
  comm.alltoallv(send, send_counts, recv, recv_counts);
  EXPECT_EQ(comm.bytes_sent() - before, to_others) << "rank " << me << " round " << round;
  std::size_t at = 0;
  for (int s = 0; s < n; ++s) {
    for (std::int64_t i = 0; i < recv_counts[static_cast<std::size_t>(s)]; ++i, ++at) {
      EXPECT_EQ(recv[at], pattern_byte(s, me, i)) << "rank " << me << " byte " << i << " from rank " << s;
    }
  }
}

// Every block empty, the spans themselves empty (null data).
inline void check_alltoallv_empty(parallel::Communicator& comm) {
  const std::vector<std::int64_t> zeros(static_cast<std::size_t>(comm.size()), 0);
  const std::int64_t before = comm.bytes_sent();
  comm.alltoallv({}, zeros, {}, zeros);
  EXPECT_EQ(comm.bytes_sent(), before);
}

// Only rank 0 sends (to every rank, itself included); the others send nothing and still join.
inline void check_alltoallv_one_sender(parallel::Communicator& comm) {
  const int n = comm.size();
  const int me = comm.rank();
  std::vector<std::int64_t> send_counts(static_cast<std::size_t>(n), 0);
  std::vector<std::int64_t> recv_counts(static_cast<std::size_t>(n), 0);
  std::vector<std::byte> send;
  if (me == 0) {
    for (int d = 0; d < n; ++d) {
      send_counts[static_cast<std::size_t>(d)] = 1000 + d;
      for (int i = 0; i < 1000 + d; ++i) send.push_back(pattern_byte(0, d, i));
    }
  }
  recv_counts[0] = 1000 + me;
  std::vector<std::byte> recv(static_cast<std::size_t>(1000 + me));
  comm.alltoallv(send, send_counts, recv, recv_counts);
  for (std::size_t i = 0; i < recv.size(); ++i) {
    EXPECT_EQ(recv[i], pattern_byte(0, me, static_cast<std::int64_t>(i))) << "rank " << me << " byte " << i;
  }
}

inline void check_alltoall(parallel::Communicator& comm) {
  const int n = comm.size();
  const int me = comm.rank();
  std::vector<std::int64_t> send(static_cast<std::size_t>(n));
  for (int d = 0; d < n; ++d) send[static_cast<std::size_t>(d)] = 1000 * me + d - (std::int64_t{1} << 40);
  std::vector<std::int64_t> recv(static_cast<std::size_t>(n), -1);
  comm.alltoall(send, recv);
  for (int s = 0; s < n; ++s) {
    EXPECT_EQ(recv[static_cast<std::size_t>(s)], 1000 * s + me - (std::int64_t{1} << 40))
        << "rank " << me << " from " << s;
  }
}

inline void check_allreduce_sum(parallel::Communicator& comm, std::size_t len) {
  const int n = comm.size();
  const int me = comm.rank();
  std::vector<std::int64_t> values(len);
  for (std::size_t i = 0; i < len; ++i)
    values[i] = (me + 1) * static_cast<std::int64_t>(i) - (std::int64_t{1} << 35);
  comm.allreduce_sum(values);
  const std::int64_t ranks = n;
  for (std::size_t i = 0; i < len; ++i) {
    const std::int64_t want =
        ranks * (ranks + 1) / 2 * static_cast<std::int64_t>(i) - ranks * (std::int64_t{1} << 35);
    EXPECT_EQ(values[i], want) << "rank " << me << " element " << i;
  }
}

inline void check_allreduce_max(parallel::Communicator& comm) {
  const int n = comm.size();
  const int me = comm.rank();
  // [0]: the largest rank wins; [1]: rank 0 wins; [2]: all negative; [3]: -inf everywhere but the last rank.
  std::vector<double> values = {0.5 * me, -1.0 * me, -3.5 - me,
                                me == n - 1 ? 1e300 : -std::numeric_limits<double>::infinity()};
  comm.allreduce_max(values);
  EXPECT_EQ(values[0], 0.5 * (n - 1));
  EXPECT_EQ(values[1], 0.0);
  EXPECT_EQ(values[2], -3.5);
  EXPECT_EQ(values[3], 1e300);
}

inline void check_allgather(parallel::Communicator& comm, std::size_t len) {
  const int n = comm.size();
  const int me = comm.rank();
  std::vector<std::int64_t> mine(len);
  for (std::size_t i = 0; i < len; ++i) mine[i] = 100 * me + static_cast<std::int64_t>(i);
  std::vector<std::int64_t> all(len * static_cast<std::size_t>(n), -1);
  comm.allgather(mine, all);
  for (int r = 0; r < n; ++r) {
    for (std::size_t i = 0; i < len; ++i) {
      EXPECT_EQ(all[static_cast<std::size_t>(r) * len + i], 100 * r + static_cast<std::int64_t>(i))
          << "rank " << me << " entry " << r << "/" << i;
    }
  }
}

// Zero-length spans in every collective that allows them.
inline void check_empty_collectives(parallel::Communicator& comm) {
  comm.allreduce_sum({});
  comm.allreduce_max({});
  comm.allgather({}, {});
  check_alltoallv_empty(comm);
}

// Everything above, in one sequence (several alltoallv rounds, so bytes_sent accumulates).
inline void check_all_collectives(parallel::Communicator& comm) {
  const std::int64_t before = comm.bytes_sent();
  std::int64_t to_others = 0;
  for (int round = 0; round < 4; ++round) {
    check_alltoallv_pattern(comm, round);
    for (int d = 0; d < comm.size(); ++d) {
      if (d != comm.rank()) to_others += pattern_count(comm.rank(), d, round);
    }
  }
  EXPECT_EQ(comm.bytes_sent() - before, to_others);
  check_alltoallv_empty(comm);
  check_alltoallv_one_sender(comm);
  check_alltoall(comm);
  check_allreduce_sum(comm, 1);
  check_allreduce_sum(comm, 1000);
  check_allreduce_max(comm);
  check_allgather(comm, 1);
  check_allgather(comm, 7);
  check_empty_collectives(comm);
}

}  // namespace capserve::test
