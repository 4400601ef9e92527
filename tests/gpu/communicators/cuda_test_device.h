#pragma once
// Device memory and a stream for the communicator checks of tests/mpi/device_communicator_cases.h (the
// TestDevice concept), on the current CUDA device; plus the skip for "fewer GPUs than ranks on this node".
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstddef>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "kernels/cuda/cuda_check.h"
#include "parallel/communicator.h"
#include "tests/gpu/gpu_test_support.h"
#include "tests/mpi/mpi_gtest_main.h"

namespace capserve::test {

class CudaTestDevice {
 public:
  CudaTestDevice() { CAPSERVE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking)); }
  ~CudaTestDevice() {
    cudaStreamSynchronize(stream_);
    buffers_.clear();
    cudaStreamDestroy(stream_);
  }
  CudaTestDevice(const CudaTestDevice&) = delete;
  CudaTestDevice& operator=(const CudaTestDevice&) = delete;

  // A new device buffer holding host's bytes, complete when this returns.
  std::span<std::byte> upload(std::span<const std::byte> host) {
    void* p = nullptr;
    CAPSERVE_CUDA_CHECK(cudaMalloc(&p, host.empty() ? 1 : host.size()));
    buffers_.emplace_back(static_cast<std::byte*>(p));
    if (!host.empty()) {
      CAPSERVE_CUDA_CHECK(cudaMemcpyAsync(p, host.data(), host.size(), cudaMemcpyHostToDevice, stream_));
    }
    CAPSERVE_CUDA_CHECK(cudaStreamSynchronize(stream_));
    return {static_cast<std::byte*>(p), host.size()};
  }

  // Waits for everything enqueued on stream(), then copies the buffer back.
  std::vector<std::byte> download(std::span<const std::byte> device) {
    CAPSERVE_CUDA_CHECK(cudaStreamSynchronize(stream_));
    std::vector<std::byte> host(device.size());
    if (!host.empty()) {
      CAPSERVE_CUDA_CHECK(
          cudaMemcpyAsync(host.data(), device.data(), device.size(), cudaMemcpyDeviceToHost, stream_));
      CAPSERVE_CUDA_CHECK(cudaStreamSynchronize(stream_));
    }
    return host;
  }

  parallel::Stream stream() { return stream_; }

 private:
  struct Free {
    void operator()(std::byte* p) const { cudaFree(p); }
  };
  cudaStream_t stream_ = nullptr;
  std::vector<std::unique_ptr<std::byte, Free>> buffers_;
};

// Why this node's ranks cannot each have a GPU of their own (NCCL's requirement), or nothing when they can.
inline std::optional<std::string> fewer_gpus_than_ranks() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) count = 0;
  const int ranks = mpi_world().local_size();
  if (count >= ranks) return std::nullopt;
  return std::to_string(ranks) + " ranks on this node but " + std::to_string(count) +
         " GPU(s): NCCL needs one GPU per rank (the host-staged tests cover several ranks on one GPU)";
}

}  // namespace capserve::test

// Skips a test (all ranks alike) unless every rank of the node has a GPU of its own.
#define CAPSERVE_REQUIRE_GPU_PER_RANK()                                          \
  do {                                                                           \
    CAPSERVE_REQUIRE_CUDA_DEVICE();                                              \
    if (const auto capserve_too_few = ::capserve::test::fewer_gpus_than_ranks()) \
      GTEST_SKIP() << *capserve_too_few;                                         \
  } while (false)
