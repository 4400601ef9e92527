// A peer rank that dies while this rank waits for device work including NCCL collectives (label cuda-emu, np
// 2, a GPU each): the rank devices of --device cuda (capserve_open_cuda_devices: CudaBackend with
// NcclCommunicator), and the NCCL stand-in's crash_at_next_nccl_exchange on rank 1. On a GPU rank 0's
// exchange kernels would then wait forever and its to_host with them; the stand-in hangs its stream likewise
// (giving up after CAPSERVE_CUDA_EMU_NCCL_TIMEOUT_S, with a message saying so). The wait must instead poll
// NCCL's asynchronous error and end by aborting the communicator, naming NCCL and the dead rank. Its own
// program: afterwards the ranks are out of step, as in a job that must end.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <vector>

#include "cuda_emu.h"
#include "runtime/cli/cuda_rank_devices.h"
#include "tests/mpi/mpi_gtest_main.h"

namespace capserve {
namespace {

using kernels::Buffer;
using kernels::DType;
using kernels::HostSync;
using kernels::Tensor;

TEST(NcclPeerFailure, AWaitOnAnExchangeWithADeadPeerThrowsNamingNcclInsteadOfHanging) {
  const int n = test::mpi_world().size();
  const int me = test::mpi_world().rank();
  if (n != 2) GTEST_SKIP() << "runs at np 2";
  runtime::RankDevices devices;
  capserve_open_cuda_devices(&devices, &test::mpi_world());
  kernels::Backend& backend = *devices.backend;
  parallel::Communicator& data = devices.data_plane();
  Buffer send_slot, recv_slot;
  const Tensor send = backend.scratch(send_slot, DType::i64, {2});
  const Tensor recv = backend.scratch(recv_slot, DType::i64, {2});
  const std::vector<std::int64_t> mine = {10 * me, 10 * me + 1};
  backend.from_host(std::as_bytes(std::span(mine)), send);
  std::vector<std::int64_t> got(2);
  // A healthy exchange first: the same wait ends normally.
  data.alltoall(send, recv, backend.stream());
  backend.to_host(recv, std::as_writable_bytes(std::span(got)), HostSync::moe_dispatch);
  EXPECT_EQ(got, (std::vector<std::int64_t>{me, 10 + me}));

  if (me == 1) {
    cuda_emu::crash_at_next_nccl_exchange();
    EXPECT_THROW(data.alltoall(send, recv, backend.stream()), std::runtime_error);  // it "died" there
  } else {
    data.alltoall(send, recv, backend.stream());  // enqueued: on a GPU its kernels now wait for rank 1
    const auto start = std::chrono::steady_clock::now();
    std::string message;
    try {
      backend.to_host(recv, std::as_writable_bytes(std::span(got)), HostSync::moe_dispatch);
    } catch (const std::runtime_error& e) {
      message = e.what();
    }
    const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::printf("rank 0: to_host ended after %.2f s: %s\n", elapsed,
                message.empty() ? "no exception" : message.c_str());
    EXPECT_NE(message.find("NcclCommunicator: rank 0 of 2 (GPU 0): NCCL reported an error while the host "
                           "waited for device work (ncclCommGetAsyncError): remote process exited or there "
                           "was a network error (rank 1 failed: the process died in an exchange"),
              std::string::npos)
        << message;
    EXPECT_NE(message.find("aborted the communicator (ncclCommAbort)"), std::string::npos) << message;
    // Aborted: a later collective throws the same at once instead of waiting for rank 1.
    try {
      data.alltoall(send, recv, backend.stream());
      ADD_FAILURE() << "a collective on the aborted communicator was accepted";
    } catch (const std::runtime_error& e) {
      EXPECT_EQ(std::string(e.what()), message);
    }
  }
  EXPECT_TRUE(
      test::mpi_world().all_agree(true));  // the control plane still works; MPI_Finalize must not hang
}

}  // namespace
}  // namespace capserve
