#include "parallel/nccl_communicator.h"

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <map>
#include <span>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "kernels/cuda/cuda_check.h"

namespace capserve::parallel {
namespace {

constexpr const char* kWho = "NcclCommunicator";

std::string nccl_error(ncclResult_t rc, ncclComm_t comm, const char* what) {
  std::string message = std::string(kWho) + ": " + what + " failed: " + ncclGetErrorString(rc);
  const char* last = ncclGetLastError(comm);
  if (last != nullptr && *last != '\0') message += std::string(" (") + last + ")";
  return message;
}

std::string uuid_text(const std::vector<std::byte>& uuid) {
  std::string text = "GPU-";
  char hex[3];
  for (const std::byte b : uuid) {
    std::snprintf(hex, sizeof hex, "%02x", static_cast<unsigned>(b));
    text += hex;
  }
  return text;
}

// On rank 0: why these GPUs (one UUID per rank) cannot host an NCCL communicator, or "" when every rank has
// its own.
std::string shared_gpu_error(const std::vector<std::vector<std::byte>>& uuids, int devices, int local_size) {
  std::map<std::string, int> first_rank;
  for (int r = 0; r < static_cast<int>(uuids.size()); ++r) {
    const auto [at, fresh] = first_rank.emplace(uuid_text(uuids[static_cast<std::size_t>(r)]), r);
    if (fresh) continue;
    return std::string(kWho) + ": ranks " + std::to_string(at->second) + " and " + std::to_string(r) +
           " both use GPU " + at->first +
           " (each rank takes GPU local_rank % GPUs of its node; rank 0's node has " +
           std::to_string(devices) + " GPU(s) for " + std::to_string(local_size) +
           " rank(s)), and NCCL refuses two ranks on one GPU. Start at most one rank per GPU, or use "
           "HostStagedCommunicator (MPI through host memory) to run several ranks on one GPU";
  }
  return {};
}

// Polls ncclCommGetAsyncError while it says ncclInProgress, sleeping `pause` between polls, until `deadline`:
// the communicator's state (ncclInProgress only at the deadline), or the poll's own error.
ncclResult_t wait_while_in_progress(ncclComm_t comm, std::chrono::steady_clock::time_point deadline,
                                    std::chrono::microseconds pause) {
  for (;;) {
    ncclResult_t state = ncclSuccess;
    if (const ncclResult_t rc = ncclCommGetAsyncError(comm, &state); rc != ncclSuccess) return rc;
    if (state != ncclInProgress || std::chrono::steady_clock::now() >= deadline) return state;
    std::this_thread::sleep_for(pause);
  }
}

std::string seconds_text(std::chrono::milliseconds duration) {
  std::ostringstream text;
  text << std::chrono::duration<double>(duration).count() << " s";
  return text.str();
}

}  // namespace

NcclCommunicator::NcclCommunicator(MpiWorld& world, std::chrono::milliseconds init_deadline)
    : rank_(world.rank()), size_(world.size()), uncaught_at_start_(std::uncaught_exceptions()) {
  // Every step ends with all ranks agreeing, so that a failure on one rank throws on all of them instead of
  // leaving the others waiting in the next collective.
  const auto agree = [&world, this](const std::string& error) {
    if (world.all_agree(error.empty())) return;
    throw std::runtime_error(error.empty()
                                 ? std::string(kWho) + ": rank " + std::to_string(rank_) +
                                       ": another rank failed to set up (see its message)"
                                 : std::string(kWho) + ": rank " + std::to_string(rank_) + ": " + error);
  };

  counts_layout_.assign(std::vector<std::int64_t>(static_cast<std::size_t>(size_), sizeof(std::int64_t)),
                        size_, kWho, "counts");

  int devices = 0;
  const cudaError_t count_rc = cudaGetDeviceCount(&devices);
  agree(count_rc != cudaSuccess
            ? std::string("no CUDA device: cudaGetDeviceCount failed: ") + cudaGetErrorString(count_rc)
        : devices == 0 ? std::string("no CUDA device: cudaGetDeviceCount found none")
                       : std::string());

  device_ = world.local_rank() % devices;
  cudaDeviceProp properties{};
  std::string error;
  try {
    CAPSERVE_CUDA_CHECK(cudaSetDevice(device_));
    CAPSERVE_CUDA_CHECK(cudaGetDeviceProperties(&properties, device_));
  } catch (const std::runtime_error& e) {
    error = e.what();
  }
  agree(error);

  const std::vector<std::vector<std::byte>> uuids =
      world.gather(std::as_bytes(std::span(properties.uuid.bytes)), 0);
  std::vector<std::byte> verdict;
  if (rank_ == 0) {
    const std::string why = shared_gpu_error(uuids, devices, world.local_size());
    verdict.resize(why.size());
    std::memcpy(verdict.data(), why.data(), why.size());
  }
  world.broadcast(verdict, 0);
  if (!verdict.empty()) {
    throw std::runtime_error(std::string(reinterpret_cast<const char*>(verdict.data()), verdict.size()));
  }

  // Rank 0's id, or its error message, tagged by the first byte.
  std::vector<std::byte> id_message;
  ncclUniqueId id{};
  if (rank_ == 0) {
    const ncclResult_t rc = ncclGetUniqueId(&id);
    const std::string payload = rc == ncclSuccess ? std::string(reinterpret_cast<const char*>(&id), sizeof id)
                                                  : nccl_error(rc, nullptr, "ncclGetUniqueId");
    id_message.resize(payload.size() + 1);
    id_message[0] = std::byte{rc == ncclSuccess ? std::uint8_t{1} : std::uint8_t{0}};
    std::memcpy(id_message.data() + 1, payload.data(), payload.size());
  }
  world.broadcast(id_message, 0);
  if (id_message.at(0) != std::byte{1}) {
    throw std::runtime_error(
        std::string(reinterpret_cast<const char*>(id_message.data()) + 1, id_message.size() - 1));
  }
  std::memcpy(&id, id_message.data() + 1, sizeof id);

  // Non-blocking, so that a rank that never joins cannot keep this one waiting forever.
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t comm = nullptr;
  ncclResult_t init_rc = ncclCommInitRankConfig(&comm, size_, id, rank_, &config);
  if (comm != nullptr && init_rc == ncclInProgress) {
    init_rc = wait_while_in_progress(comm, std::chrono::steady_clock::now() + init_deadline,
                                     std::chrono::milliseconds(1));
    if (init_rc == ncclInProgress) {
      ncclCommAbort(comm);
      // No agreement with the other ranks here: the missing one would never answer.
      throw std::runtime_error(std::string(kWho) + ": rank " + std::to_string(rank_) +
                               ": NCCL initialisation (ncclCommInitRankConfig) did not complete within " +
                               seconds_text(init_deadline) + ": waited for all " + std::to_string(size_) +
                               " ranks to join the communicator (a rank died or hangs after the id "
                               "broadcast); aborted it");
    }
  }
  const std::string init_error =
      init_rc == ncclSuccess ? std::string() : nccl_error(init_rc, comm, "ncclCommInitRankConfig");
  if (init_rc == ncclSuccess) {
    comm_ = comm;
  } else if (comm != nullptr) {
    ncclCommAbort(comm);
  }
  if (!world.all_agree(init_rc == ncclSuccess)) {
    if (comm_ != nullptr) ncclCommAbort(comm_);
    comm_ = nullptr;
    throw std::runtime_error(!init_error.empty()
                                 ? init_error
                                 : std::string(kWho) + ": ncclCommInitRankConfig failed on another rank");
  }
}

NcclCommunicator::~NcclCommunicator() {
  if (comm_ == nullptr) return;
  if (failed_ || std::uncaught_exceptions() > uncaught_at_start_) {
    ncclCommAbort(comm_);
  } else {
    ncclCommDestroy(comm_);
  }
}

void NcclCommunicator::check(int result, const char* what) {
  const auto rc = static_cast<ncclResult_t>(result);
  if (rc == ncclSuccess) return;
  failed_ = true;
  throw std::runtime_error(nccl_error(rc, comm_, what));
}

void NcclCommunicator::abort(const std::string& why) {
  aborted_ = std::string(kWho) + ": rank " + std::to_string(rank_) + " of " + std::to_string(size_) +
             " (GPU " + std::to_string(device_) + "): " + why +
             "; aborted the communicator (ncclCommAbort): a peer rank died or the network failed, so its "
             "collectives can never complete";
  failed_ = true;
  ncclCommAbort(comm_);
  comm_ = nullptr;
  throw std::runtime_error(aborted_);
}

void NcclCommunicator::check_async_error() {
  if (comm_ == nullptr) throw std::runtime_error(aborted_);
  ncclResult_t state = ncclSuccess;
  const ncclResult_t rc = ncclCommGetAsyncError(comm_, &state);
  if (rc == ncclSuccess && (state == ncclSuccess || state == ncclInProgress)) return;
  const ncclResult_t error = rc != ncclSuccess ? rc : state;
  const char* last = ncclGetLastError(comm_);
  abort(
      std::string("NCCL reported an error while the host waited for device work (ncclCommGetAsyncError): ") +
      ncclGetErrorString(error) + (last != nullptr && *last != '\0' ? std::string(" (") + last + ")" : ""));
}

void NcclCommunicator::begin_call() {
  if (comm_ == nullptr) throw std::runtime_error(aborted_);
  CAPSERVE_CUDA_CHECK(cudaSetDevice(device_));
  // Errors of earlier work (a peer that failed, a network error) show only here; going on would wait forever
  // for the failed rank. Work still ncclInProgress (another thread's call) is waited for first.
  complete(ncclInProgress, "earlier work (ncclCommGetAsyncError)");
}

void NcclCommunicator::complete(int result, const char* what) {
  const auto rc = static_cast<ncclResult_t>(result);
  if (rc != ncclInProgress) {
    check(rc, what);
    return;
  }
  check(wait_while_in_progress(comm_, std::chrono::steady_clock::time_point::max(),
                               std::chrono::microseconds(20)),
        what);
}

void NcclCommunicator::exchange(std::span<const std::byte> send, const BlockLayout& send_layout,
                                std::span<std::byte> recv, const BlockLayout& recv_layout, Stream stream) {
  begin_call();
  if (send_layout.count(rank_) > 0) {
    const std::span<const std::byte> from = send_layout.block(send, rank_);
    CAPSERVE_CUDA_CHECK(cudaMemcpyAsync(recv_layout.block(recv, rank_).data(), from.data(), from.size(),
                                        cudaMemcpyDeviceToDevice, stream));
  }
  check(ncclGroupStart(), "ncclGroupStart");
  try {
    // Zero-count pairs are skipped on both sides, since the counts agree pairwise.
    for (int peer = 0; peer < size_; ++peer) {
      if (peer == rank_) continue;
      if (send_layout.count(peer) > 0) {
        const std::span<const std::byte> block = send_layout.block(send, peer);
        check(ncclSend(block.data(), block.size(), ncclUint8, peer, comm_, stream), "ncclSend");
      }
      if (recv_layout.count(peer) > 0) {
        const std::span<std::byte> block = recv_layout.block(recv, peer);
        check(ncclRecv(block.data(), block.size(), ncclUint8, peer, comm_, stream), "ncclRecv");
      }
    }
  } catch (...) {
    ncclGroupEnd();  // closes the group; NCCL drops a group in which a call failed
    throw;
  }
  complete(ncclGroupEnd(), "ncclGroupEnd");
}

void NcclCommunicator::do_alltoall(std::span<const std::int64_t> send, std::span<std::int64_t> recv,
                                   Stream stream) {
  const auto n = static_cast<std::size_t>(size_);
  check_entries(send.size(), n, "NcclCommunicator::alltoall", "send");
  check_entries(recv.size(), n, "NcclCommunicator::alltoall", "recv");
  exchange(std::as_bytes(send), counts_layout_, std::as_writable_bytes(recv), counts_layout_, stream);
}

void NcclCommunicator::do_alltoallv(std::span<const std::byte> send,
                                    std::span<const std::int64_t> send_counts, std::span<std::byte> recv,
                                    std::span<const std::int64_t> recv_counts, Stream stream) {
  static constexpr const char* kOp = "NcclCommunicator::alltoallv";
  send_layout_.assign(send_counts, size_, kOp, "send_counts");
  recv_layout_.assign(recv_counts, size_, kOp, "recv_counts");
  check_alltoallv(send_layout_, send.size(), recv_layout_, recv.size(), rank_, kOp);
  exchange(send, send_layout_, recv, recv_layout_, stream);
  count_sent(send_counts);
}

// Zero-length reductions and gathers enqueue nothing: every rank passes the same length, so all skip
// together.
void NcclCommunicator::do_allreduce_sum(std::span<std::int64_t> values, Stream stream) {
  if (values.empty()) return;
  begin_call();
  complete(ncclAllReduce(values.data(), values.data(), values.size(), ncclInt64, ncclSum, comm_, stream),
           "ncclAllReduce (sum)");
}

void NcclCommunicator::do_allreduce_max(std::span<double> values, Stream stream) {
  if (values.empty()) return;
  begin_call();
  complete(ncclAllReduce(values.data(), values.data(), values.size(), ncclFloat64, ncclMax, comm_, stream),
           "ncclAllReduce (max)");
}

void NcclCommunicator::do_allgather(std::span<const std::int64_t> mine, std::span<std::int64_t> all,
                                    Stream stream) {
  check_entries(all.size(), mine.size() * static_cast<std::size_t>(size_), "NcclCommunicator::allgather",
                "all");
  if (mine.empty()) return;
  begin_call();
  complete(ncclAllGather(mine.data(), all.data(), mine.size(), ncclInt64, comm_, stream), "ncclAllGather");
}

}  // namespace capserve::parallel
