#pragma once
// Checks of a Communicator against MpiCommunicator on the same random inputs, byte for byte: shared by
// the MPI tests (HostStagedCommunicator with a host "device", tests/mpi) and the GPU tests (NCCL and
// host-staged on real device memory, tests/gpu/communicators). Each function is collective: call it on every
// rank. They use EXPECT_* and never return early, so a failure on one rank cannot leave the others waiting.
#include <gtest/gtest.h>

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "parallel/communicator.h"
#include "parallel/mpi_communicator.h"

namespace capserve::test {

// Device memory as the checks use it: upload makes a new device buffer (owned by the device object) holding
// `host`; download waits for stream() and returns a device buffer's bytes.
template <typename D>
concept TestDevice = requires(D d, std::span<const std::byte> bytes) {
  { d.upload(bytes) } -> std::same_as<std::span<std::byte>>;
  { d.download(bytes) } -> std::same_as<std::vector<std::byte>>;
  { d.stream() } -> std::same_as<parallel::Stream>;
};

template <typename T, TestDevice D>
std::span<T> upload_values(D& device, const std::vector<T>& values) {
  const std::span<std::byte> bytes = device.upload(std::as_bytes(std::span(values)));
  return {reinterpret_cast<T*>(bytes.data()), values.size()};
}

template <typename T, TestDevice D>
std::vector<T> download_values(D& device, std::span<const T> values) {
  const std::vector<std::byte> bytes = device.download(std::as_bytes(values));
  std::vector<T> out(values.size());
  if (!out.empty()) std::memcpy(out.data(), bytes.data(), bytes.size());
  return out;
}

inline std::vector<std::byte> random_bytes(std::size_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<std::byte> out(n);
  for (std::byte& b : out) b = static_cast<std::byte>(rng() & 0xff);
  return out;
}

// A count matrix every rank builds alike (same seed): counts[s * n + d] bytes go from rank s to rank d.
struct AlltoallvCase {
  std::string name;
  std::vector<std::int64_t> counts;
};

inline std::vector<AlltoallvCase> alltoallv_cases(int n, std::uint64_t seed) {
  const auto nn = static_cast<std::size_t>(n) * static_cast<std::size_t>(n);
  std::mt19937_64 rng(seed);
  const auto random_matrix = [&](std::int64_t max, int zero_percent) {
    std::vector<std::int64_t> m(nn);
    for (std::int64_t& c : m) {
      c = static_cast<int>(rng() % 100) < zero_percent ? 0 : 1 + static_cast<std::int64_t>(rng() % max);
    }
    return m;
  };
  std::vector<AlltoallvCase> cases;
  cases.push_back({"random", random_matrix(5000, 30)});
  cases.push_back({"random large", random_matrix(std::int64_t{1} << 20, 50)});
  AlltoallvCase idle{"one idle rank", random_matrix(3000, 10)};
  const int quiet = static_cast<int>(seed % static_cast<std::uint64_t>(n));
  for (int r = 0; r < n; ++r) {
    idle.counts[static_cast<std::size_t>(quiet * n + r)] = 0;
    idle.counts[static_cast<std::size_t>(r * n + quiet)] = 0;
  }
  cases.push_back(idle);
  AlltoallvCase own_only{"own block only", std::vector<std::int64_t>(nn, 0)};
  AlltoallvCase others_only{"no own block", random_matrix(3000, 0)};
  for (int r = 0; r < n; ++r) {
    own_only.counts[static_cast<std::size_t>(r * n + r)] = 1 + static_cast<std::int64_t>(rng() % 3000);
    others_only.counts[static_cast<std::size_t>(r * n + r)] = 0;
  }
  cases.push_back(own_only);
  cases.push_back(others_only);
  cases.push_back({"all zero", std::vector<std::int64_t>(nn, 0)});
  cases.push_back({"one byte each", std::vector<std::int64_t>(nn, 1)});
  return cases;
}

// Extra bytes after the blocks: send's are never sent, recv's are never written.
constexpr std::size_t kSlack = 61;
constexpr std::byte kPoison{0xEE};

// The device communicator's alltoallv equals MpiCommunicator's on every case: received bytes, the untouched
// slack after them, and the growth of bytes_sent.
template <TestDevice D>
void check_alltoallv_against_mpi(parallel::Communicator& comm, parallel::MpiCommunicator& ref, D& device,
                                 std::uint64_t seed) {
  const int n = comm.size();
  const int me = comm.rank();
  for (const AlltoallvCase& c : alltoallv_cases(n, seed)) {
    std::vector<std::int64_t> send_counts(static_cast<std::size_t>(n)),
        recv_counts(static_cast<std::size_t>(n));
    std::int64_t send_total = 0;
    std::int64_t recv_total = 0;
    for (int r = 0; r < n; ++r) {
      send_counts[static_cast<std::size_t>(r)] = c.counts[static_cast<std::size_t>(me * n + r)];
      recv_counts[static_cast<std::size_t>(r)] = c.counts[static_cast<std::size_t>(r * n + me)];
      send_total += send_counts[static_cast<std::size_t>(r)];
      recv_total += recv_counts[static_cast<std::size_t>(r)];
    }
    const std::vector<std::byte> send = random_bytes(static_cast<std::size_t>(send_total) + kSlack,
                                                     seed * 7919 + static_cast<std::uint64_t>(me));
    std::vector<std::byte> want(static_cast<std::size_t>(recv_total) + kSlack, kPoison);
    const std::int64_t ref_before = ref.bytes_sent();
    ref.alltoallv(send, send_counts, want, recv_counts);

    const std::int64_t before = comm.bytes_sent();
    const std::span<std::byte> d_send = device.upload(send);
    const std::span<std::byte> d_recv = device.upload(std::vector<std::byte>(want.size(), kPoison));
    comm.alltoallv(d_send, send_counts, d_recv, recv_counts, device.stream());
    const std::vector<std::byte> got = device.download(d_recv);

    std::size_t wrong = 0;
    std::size_t first_wrong = got.size();
    for (std::size_t i = 0; i < got.size(); ++i) {
      if (got[i] == want[i]) continue;
      ++wrong;
      if (first_wrong == got.size()) first_wrong = i;
    }
    EXPECT_EQ(wrong, 0U) << "rank " << me << ", case '" << c.name << "': " << wrong << " of " << got.size()
                         << " bytes differ, the first at " << first_wrong;
    EXPECT_EQ(comm.bytes_sent() - before, ref.bytes_sent() - ref_before) << "rank " << me << ", " << c.name;
  }
}

// alltoall_fixed equals MpiCommunicator's alltoallv with every block the same size.
template <TestDevice D>
void check_alltoall_fixed_against_mpi(parallel::Communicator& comm, parallel::MpiCommunicator& ref, D& device,
                                      std::uint64_t seed) {
  const int n = comm.size();
  const int me = comm.rank();
  for (const std::int64_t block : {std::int64_t{0}, std::int64_t{1}, std::int64_t{4099}}) {
    const std::size_t total = static_cast<std::size_t>(block) * static_cast<std::size_t>(n);
    const std::vector<std::byte> send = random_bytes(total, seed + 31 * static_cast<std::uint64_t>(me + 1));
    const std::vector<std::int64_t> counts(static_cast<std::size_t>(n), block);
    std::vector<std::byte> want(total + kSlack, kPoison);
    ref.alltoallv(send, counts, want, counts);
    const std::int64_t before = comm.bytes_sent();
    const std::span<std::byte> d_send = device.upload(send);
    const std::span<std::byte> d_recv = device.upload(std::vector<std::byte>(want.size(), kPoison));
    comm.alltoall_fixed(d_send, d_recv, block, device.stream());
    EXPECT_EQ(device.download(d_recv), want) << "rank " << me << ", block " << block;
    EXPECT_EQ(comm.bytes_sent() - before, block * (n - 1)) << "rank " << me << ", block " << block;
  }
}

// alltoall, both allreduces and allgather on random values (lengths 0, 1 and more) equal
// MpiCommunicator's results exactly.
template <TestDevice D>
void check_small_collectives_against_mpi(parallel::Communicator& comm, parallel::MpiCommunicator& ref,
                                         D& device, std::uint64_t seed) {
  const int n = comm.size();
  const int me = comm.rank();
  std::mt19937_64 rng(seed * 104729 + static_cast<std::uint64_t>(me));
  const auto random_int64 = [&rng](std::size_t len) {
    std::vector<std::int64_t> v(len);
    for (std::int64_t& x : v) x = static_cast<std::int64_t>(rng() >> 8) - (std::int64_t{1} << 54);
    return v;
  };

  const std::vector<std::int64_t> counts = random_int64(static_cast<std::size_t>(n));
  std::vector<std::int64_t> want_counts(counts.size());
  ref.alltoall(counts, want_counts);
  const std::span<std::int64_t> d_counts = upload_values(device, counts);
  const std::span<std::int64_t> d_counts_in =
      upload_values(device, std::vector<std::int64_t>(counts.size(), -1));
  comm.alltoall(d_counts, d_counts_in, device.stream());
  EXPECT_EQ(download_values<std::int64_t>(device, d_counts_in), want_counts) << "alltoall, rank " << me;

  for (const std::size_t len : {std::size_t{0}, std::size_t{1}, std::size_t{1000}}) {
    std::vector<std::int64_t> sums = random_int64(len);
    const std::span<std::int64_t> d_sums = upload_values(device, sums);
    ref.allreduce_sum(sums);
    comm.allreduce_sum(d_sums, device.stream());
    EXPECT_EQ(download_values<std::int64_t>(device, d_sums), sums)
        << "allreduce_sum, rank " << me << ", " << len;

    std::vector<double> maxes(len);
    std::uniform_real_distribution<double> real(-1e6, 1e6);
    for (std::size_t i = 0; i < len; ++i) {
      maxes[i] = i % 7 == 3 ? -std::numeric_limits<double>::infinity() : real(rng);
    }
    const std::span<double> d_maxes = upload_values(device, maxes);
    ref.allreduce_max(maxes);
    comm.allreduce_max(d_maxes, device.stream());
    EXPECT_EQ(download_values<double>(device, d_maxes), maxes) << "allreduce_max, rank " << me << ", " << len;

    const std::vector<std::int64_t> mine = random_int64(len);
    std::vector<std::int64_t> want_all(len * static_cast<std::size_t>(n));
    ref.allgather(mine, want_all);
    const std::span<std::int64_t> d_mine = upload_values(device, mine);
    const std::span<std::int64_t> d_all =
        upload_values(device, std::vector<std::int64_t>(want_all.size(), -7));
    comm.allgather(d_mine, d_all, device.stream());
    EXPECT_EQ(download_values<std::int64_t>(device, d_all), want_all)
        << "allgather, rank " << me << ", " << len;
  }
}

// Every rank passes the same wrong arguments: every rank throws before anything moves (bytes_sent unchanged),
// and the group is still in step afterwards.
template <TestDevice D>
void check_argument_errors(parallel::Communicator& comm, D& device) {
  const int n = comm.size();
  const int me = comm.rank();
  const auto un = static_cast<std::size_t>(n);
  const parallel::Stream stream = device.stream();
  const std::span<std::byte> buf = device.upload(std::vector<std::byte>(64 * un, std::byte{1}));
  const std::int64_t before = comm.bytes_sent();
  const std::vector<std::int64_t> ones(un, 1);

  EXPECT_THROW(comm.alltoallv(buf, std::vector<std::int64_t>(un + 1, 1), buf, ones, stream),
               std::invalid_argument);
  EXPECT_THROW(comm.alltoallv(buf, ones, buf, std::vector<std::int64_t>(un - 1, 1), stream),
               std::invalid_argument);
  std::vector<std::int64_t> negative = ones;
  negative.back() = -1;
  EXPECT_THROW(comm.alltoallv(buf, negative, buf, ones, stream), std::invalid_argument);
  const std::vector<std::int64_t> too_many(un, 65);  // 65 * n bytes of 64 * n
  EXPECT_THROW(comm.alltoallv(buf, too_many, buf, too_many, stream), std::invalid_argument);
  std::vector<std::int64_t> own_differs = ones;
  own_differs[static_cast<std::size_t>(me)] = 2;
  EXPECT_THROW(comm.alltoallv(buf, ones, buf, own_differs, stream), std::invalid_argument);
  EXPECT_THROW(comm.alltoall_fixed(buf, buf, -1, stream), std::invalid_argument);
  EXPECT_THROW(comm.alltoall_fixed(buf, buf, 65, stream), std::invalid_argument);

  const std::span<std::int64_t> values{reinterpret_cast<std::int64_t*>(buf.data()), un};
  EXPECT_THROW(comm.alltoall(values.first(un - 1), values, stream), std::invalid_argument);
  EXPECT_THROW(comm.alltoall(values, values.subspan(1), stream), std::invalid_argument);
  EXPECT_THROW(comm.allgather(values.first(1), values.first(un - 1), stream), std::invalid_argument);
  EXPECT_EQ(comm.bytes_sent(), before) << "rank " << me;

  // Still in step: a real exchange works.
  const std::span<std::byte> recv = device.upload(std::vector<std::byte>(un, kPoison));
  comm.alltoallv(buf, ones, recv, ones, stream);
  EXPECT_EQ(device.download(recv), std::vector<std::byte>(un, std::byte{1})) << "rank " << me;
}

}  // namespace capserve::test
