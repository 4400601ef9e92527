// HostStagedCommunicator on the CPU: "device" memory is host memory, and the mover defers every copy until
// the stream is synchronized or a mark is waited for, as a CUDA stream would. So a missing wait, a copy from
// the wrong offset or a staging buffer reused too early shows up as wrong bytes, here, without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "parallel/host_staged_communicator.h"
#include "parallel/mpi_communicator.h"
#include "tests/mpi/device_communicator_cases.h"
#include "tests/mpi/mpi_gtest_main.h"
#include "tests/support/communicator_checks.h"

namespace capserve::parallel {
namespace {

// A stream handle the tests pass around; never dereferenced.
Stream test_stream() {
  static int tag = 0;
  return reinterpret_cast<Stream>(&tag);
}

// One in-order "stream" of deferred host copies, with counters of what went which way.
class DeferredHostMover final : public MemoryMover {
 public:
  std::int64_t to_host = 0, to_device = 0, on_device = 0;  // bytes enqueued
  int allocations = 0, synchronizations = 0;

  [[nodiscard]] kernels::Device device() const override { return kernels::kCpu; }
  HostBuffer allocate_host(std::size_t bytes) override {
    // Staging is replaced only when no copy still uses it.
    EXPECT_TRUE(pending_.empty()) << pending_.size() << " copies pending while staging is reallocated";
    ++allocations;
    return {new std::byte[bytes], [](std::byte* p) { delete[] p; }};
  }
  void copy_to_host(std::span<std::byte> host, std::span<const std::byte> device, Stream stream) override {
    to_host += enqueue(host, device, stream);
  }
  void copy_to_device(std::span<std::byte> device, std::span<const std::byte> host, Stream stream) override {
    to_device += enqueue(device, host, stream);
  }
  void copy_on_device(std::span<std::byte> dst, std::span<const std::byte> src, Stream stream) override {
    on_device += enqueue(dst, src, stream);
  }
  void synchronize(Stream stream) override {
    EXPECT_EQ(stream, test_stream());
    ++synchronizations;
    run_until(done_ + pending_.size());
  }
  void mark(Stream stream) override {
    EXPECT_EQ(stream, test_stream());
    marked_ = done_ + pending_.size();
  }
  void wait_marked() override { run_until(marked_); }

  [[nodiscard]] std::size_t pending() const { return pending_.size(); }

 private:
  std::int64_t enqueue(std::span<std::byte> dst, std::span<const std::byte> src, Stream stream) {
    EXPECT_EQ(stream, test_stream());
    EXPECT_EQ(dst.size(), src.size());
    EXPECT_FALSE(src.empty()) << "empty copies are skipped";
    pending_.emplace_back([dst, src] { std::memcpy(dst.data(), src.data(), src.size()); });
    return static_cast<std::int64_t>(src.size());
  }
  void run_until(std::size_t k) {
    for (; done_ < k; ++done_) {
      pending_.front()();
      pending_.pop_front();
    }
  }

  std::deque<std::function<void()>> pending_;
  std::size_t done_ = 0;    // copies run so far
  std::size_t marked_ = 0;  // copies to run before wait_marked returns
};

// "Device" buffers are host vectors; download synchronizes the mover's stream first.
class HostDevice {
 public:
  explicit HostDevice(DeferredHostMover& mover) : mover_(mover) {}

  std::span<std::byte> upload(std::span<const std::byte> host) {
    buffers_.emplace_back(host.begin(), host.end());
    return buffers_.back();
  }
  std::vector<std::byte> download(std::span<const std::byte> device) {
    mover_.synchronize(test_stream());
    return {device.begin(), device.end()};
  }
  Stream stream() { return test_stream(); }

 private:
  DeferredHostMover& mover_;
  std::deque<std::vector<std::byte>> buffers_;  // stable addresses
};

// A HostStagedCommunicator over its own MpiCommunicator, with its mover and host device at hand. The device
// (the buffers) outlives the communicator, whose destructor still completes copies into them.
struct Staged {
  MpiCommunicator host;
  DeferredHostMover* mover;  // owned by comm
  HostDevice device;
  HostStagedCommunicator comm;

  Staged() : Staged(std::make_unique<DeferredHostMover>()) {}

 private:
  explicit Staged(std::unique_ptr<DeferredHostMover> m)
      : mover(m.get()), device(*m), comm(host, std::move(m)) {}
};

// The host-staged communicator seen as a host Communicator (every call waits for its copies), so the checks
// every Communicator must pass apply to it too.
class AsHostCommunicator final : public Communicator {
 public:
  explicit AsHostCommunicator(Staged& s) : s_(s) {}
  [[nodiscard]] int rank() const override { return s_.comm.rank(); }
  [[nodiscard]] int size() const override { return s_.comm.size(); }
  [[nodiscard]] kernels::Device device() const override { return kernels::kCpu; }

 protected:
  void do_alltoall(std::span<const std::int64_t> send, std::span<std::int64_t> recv,
                   parallel::Stream /*stream*/) override {
    s_.comm.alltoall(send, recv, test_stream());
    s_.mover->synchronize(test_stream());
  }
  void do_alltoallv(std::span<const std::byte> send, std::span<const std::int64_t> send_counts,
                    std::span<std::byte> recv, std::span<const std::int64_t> recv_counts,
                    parallel::Stream /*stream*/) override {
    s_.comm.alltoallv(send, send_counts, recv, recv_counts, test_stream());
    s_.mover->synchronize(test_stream());
    count_sent(send_counts);
  }
  void do_allreduce_sum(std::span<std::int64_t> values, parallel::Stream /*stream*/) override {
    s_.comm.allreduce_sum(values, test_stream());
    s_.mover->synchronize(test_stream());
  }
  void do_allreduce_max(std::span<double> values, parallel::Stream /*stream*/) override {
    s_.comm.allreduce_max(values, test_stream());
    s_.mover->synchronize(test_stream());
  }
  void do_allgather(std::span<const std::int64_t> mine, std::span<std::int64_t> all,
                    parallel::Stream /*stream*/) override {
    s_.comm.allgather(mine, all, test_stream());
    s_.mover->synchronize(test_stream());
  }

 private:
  Staged& s_;
};

TEST(HostStagedCommunicator, PassesEveryCommunicatorCheck) {
  Staged s;
  AsHostCommunicator comm(s);
  EXPECT_EQ(comm.rank(), test::mpi_world().rank());
  EXPECT_EQ(comm.size(), test::mpi_world().size());
  test::check_all_collectives(comm);
  EXPECT_EQ(s.comm.bytes_sent(), comm.bytes_sent());
}

TEST(HostStagedCommunicator, AlltoallvEqualsMpiOnRandomCases) {
  Staged s;
  MpiCommunicator ref;
  for (std::uint64_t seed = 1; seed <= 4; ++seed)
    test::check_alltoallv_against_mpi(s.comm, ref, s.device, seed);
  EXPECT_EQ(s.comm.bytes_sent(), ref.bytes_sent());
}

TEST(HostStagedCommunicator, AlltoallFixedEqualsMpi) {
  Staged s;
  MpiCommunicator ref;
  test::check_alltoall_fixed_against_mpi(s.comm, ref, s.device, 11);
}

TEST(HostStagedCommunicator, SmallCollectivesEqualMpi) {
  Staged s;
  MpiCommunicator ref;
  for (std::uint64_t seed = 1; seed <= 3; ++seed)
    test::check_small_collectives_against_mpi(s.comm, ref, s.device, seed);
}

TEST(HostStagedCommunicator, ArgumentErrorsThrowOnEveryRankBeforeAnyCopy) {
  Staged s;
  const std::span<std::byte> warm = s.device.upload(std::vector<std::byte>(8));
  s.device.download(warm);
  const std::int64_t copies = s.mover->to_host + s.mover->to_device + s.mover->on_device;
  test::check_argument_errors(s.comm, s.device);
  // Only the final valid exchange copied: n - 1 bytes each way through the host, one on the device.
  const std::int64_t n = s.comm.size();
  EXPECT_EQ(s.mover->to_host + s.mover->to_device + s.mover->on_device - copies, 2 * (n - 1) + 1);
}

// The own block never leaves the device, the other blocks cross the host exactly once each way, the host
// waits once (only when something is staged), and staging grows to the largest exchange so far and stays.
TEST(HostStagedCommunicator, StagesOnlyOtherRanksBlocksAndGrowsOnly) {
  Staged s;
  const int n = s.comm.size();
  const int me = s.comm.rank();
  const DeferredHostMover& mover = *s.mover;
  std::size_t send_staging = 0;
  std::size_t recv_staging = 0;
  for (std::uint64_t seed = 5; seed <= 7; ++seed) {
    for (const test::AlltoallvCase& c : test::alltoallv_cases(n, seed)) {
      std::vector<std::int64_t> sc(static_cast<std::size_t>(n)), rc(static_cast<std::size_t>(n));
      std::int64_t send_total = 0;
      std::int64_t recv_total = 0;
      for (int r = 0; r < n; ++r) {
        sc[static_cast<std::size_t>(r)] = c.counts[static_cast<std::size_t>(me * n + r)];
        rc[static_cast<std::size_t>(r)] = c.counts[static_cast<std::size_t>(r * n + me)];
        send_total += sc[static_cast<std::size_t>(r)];
        recv_total += rc[static_cast<std::size_t>(r)];
      }
      const std::int64_t own = sc[static_cast<std::size_t>(me)];
      const std::span<std::byte> send =
          s.device.upload(std::vector<std::byte>(static_cast<std::size_t>(send_total)));
      const std::span<std::byte> recv =
          s.device.upload(std::vector<std::byte>(static_cast<std::size_t>(recv_total)));
      s.device.download(recv);  // start from an idle stream
      const std::int64_t to_host = mover.to_host;
      const std::int64_t to_device = mover.to_device;
      const std::int64_t on_device = mover.on_device;
      const int synchronizations = mover.synchronizations;
      const int allocations = mover.allocations;
      s.comm.alltoallv(send, sc, recv, rc, test_stream());
      EXPECT_EQ(mover.to_host - to_host, send_total - own) << c.name;
      EXPECT_EQ(mover.to_device - to_device, recv_total - own) << c.name;
      EXPECT_EQ(mover.on_device - on_device, own) << c.name;
      EXPECT_EQ(mover.synchronizations - synchronizations, send_total > own ? 1 : 0) << c.name;
      const int grown = (static_cast<std::size_t>(send_total - own) > send_staging ? 1 : 0) +
                        (static_cast<std::size_t>(recv_total - own) > recv_staging ? 1 : 0);
      EXPECT_EQ(mover.allocations - allocations, grown) << c.name;
      send_staging = std::max(send_staging, static_cast<std::size_t>(send_total - own));
      recv_staging = std::max(recv_staging, static_cast<std::size_t>(recv_total - own));
      EXPECT_EQ(s.comm.send_staging_bytes(), send_staging) << c.name;
      EXPECT_EQ(s.comm.recv_staging_bytes(), recv_staging) << c.name;
    }
  }
}

// Calls back to back without waiting for the stream: the copies back of one call still read the staging
// buffers when the next begins. The next call must wait for them before its host collective overwrites the
// staging, also where it stages nothing to send (and so never synchronizes).
TEST(HostStagedCommunicator, BackToBackCallsWaitForTheCopiesBack) {
  Staged s;
  MpiCommunicator ref;
  const int n = s.comm.size();
  const int me = s.comm.rank();
  const auto un = static_cast<std::size_t>(n);
  // First: every rank sends 100 + d bytes to every rank d. Second: only rank 0 sends, 50 bytes to each.
  std::vector<std::int64_t> first_send(un), first_recv(un, 100 + me), second_send(un, me == 0 ? 50 : 0),
      second_recv(un, 0);
  for (int d = 0; d < n; ++d) first_send[static_cast<std::size_t>(d)] = 100 + d;
  second_recv[0] = 50;
  const std::vector<std::byte> send1 = test::random_bytes(un * 100 + un * (un - 1) / 2, 17 + me);
  const std::vector<std::byte> send2 = test::random_bytes(me == 0 ? un * 50 : 0, 23);
  std::vector<std::byte> want1(un * static_cast<std::size_t>(100 + me));
  std::vector<std::byte> want2(50);
  ref.alltoallv(send1, first_send, want1, first_recv);
  ref.alltoallv(send2, second_send, want2, second_recv);
  std::vector<std::int64_t> sums(5, me + 1);
  ref.allreduce_sum(sums);

  const std::span<std::byte> d_send1 = s.device.upload(send1);
  const std::span<std::byte> d_send2 = s.device.upload(send2);
  const std::span<std::byte> d_recv1 = s.device.upload(std::vector<std::byte>(want1.size(), test::kPoison));
  const std::span<std::byte> d_recv2 = s.device.upload(std::vector<std::byte>(want2.size(), test::kPoison));
  const std::span<std::int64_t> d_sums = test::upload_values(s.device, std::vector<std::int64_t>(5, me + 1));
  s.comm.alltoallv(d_send1, first_send, d_recv1, first_recv, test_stream());
  s.comm.alltoallv(d_send2, second_send, d_recv2, second_recv, test_stream());
  s.comm.allreduce_sum(d_sums, test_stream());
  EXPECT_GT(s.mover->pending(), 0U);  // the last copies back are still queued
  EXPECT_EQ(s.device.download(d_recv1), want1) << "rank " << me;
  EXPECT_EQ(s.device.download(d_recv2), want2) << "rank " << me;
  EXPECT_EQ(test::download_values<std::int64_t>(s.device, d_sums), sums) << "rank " << me;
}

TEST(HostStagedCommunicator, DestructorWaitsForTheCopiesBack) {
  std::vector<std::int64_t> values(3, 2);
  {
    Staged s;
    s.comm.allreduce_sum(values, test_stream());
  }
  EXPECT_EQ(values, std::vector<std::int64_t>(3, 2 * test::mpi_world().size()));
}

}  // namespace
}  // namespace capserve::parallel
