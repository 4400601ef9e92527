// The emulation under ThreadSanitizer (test_cuda_emu_tsan, label cuda-emu): each CUDA thread is a TSan fiber
// and only what CUDA orders is published, so a read of shared memory another thread wrote without a barrier
// between is a data-race report, and a correctly synchronised kernel runs without one.
// RaceDetection.MissingSyncthreadsIsReported is run alone by a ctest whose pass condition is the report.
#include <gtest/gtest.h>

#include <numeric>
#include <vector>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/launch.h"

namespace capserve {
namespace {

using kernels::cuda::DeviceBuffer;
using kernels::cuda::launch;

constexpr int kThreads = 128;

// out[i] = in[i - 1] through shared memory; `synced` false leaves out the barrier between the writes and the
// reads of the neighbours' slots.
__global__ void shift_kernel(const int* in, int* out, bool synced) {
  __shared__ int values[kThreads];
  const int i = static_cast<int>(threadIdx.x);
  values[i] = in[i];
  if (synced) __syncthreads();
  out[i] = i > 0 ? values[i - 1] : 0;
}

// Per warp: a count of odd inputs through shared atomics, then each lane reads its neighbour's input
// through shared memory after __syncwarp.
__global__ void warp_kernel(const int* in, int* out) {
  __shared__ int odd;
  __shared__ int values[kThreads];
  const int i = static_cast<int>(threadIdx.x);
  if (i == 0) odd = 0;
  __syncthreads();
  if (in[i] % 2 != 0) atomicAdd(&odd, 1);
  values[i] = in[i];
  __syncwarp();
  const int lane = i % 32;
  const int neighbour = values[i - lane + (lane + 1) % 32];
  __syncthreads();
  out[i] = neighbour + 1000 * odd;
}

std::vector<int> run(bool synced, bool warp) {
  std::vector<int> in(kThreads);
  std::iota(in.begin(), in.end(), 1);
  DeviceBuffer<int> d_in(in.size());
  DeviceBuffer<int> d_out(in.size());
  CAPSERVE_CUDA_CHECK(cudaMemcpy(d_in.data(), in.data(), d_in.bytes(), cudaMemcpyHostToDevice));
  if (warp) {
    launch(warp_kernel, 1, kThreads, 0, nullptr, d_in.data(), d_out.data());
  } else {
    launch(shift_kernel, 1, kThreads, 0, nullptr, d_in.data(), d_out.data(), synced);
  }
  CAPSERVE_CUDA_CHECK_LAUNCH();
  std::vector<int> out(in.size());
  CAPSERVE_CUDA_CHECK(cudaMemcpy(out.data(), d_out.data(), d_out.bytes(), cudaMemcpyDeviceToHost));
  return out;
}

TEST(RaceDetection, SyncthreadsOrdersSharedMemory) {
  const std::vector<int> out = run(true, false);
  for (int i = 0; i < kThreads; ++i) EXPECT_EQ(out[static_cast<std::size_t>(i)], i);  // in[i - 1] = i
}

TEST(RaceDetection, AtomicsAndSyncwarpAreNoRace) {
  const std::vector<int> out = run(true, true);
  for (int i = 0; i < kThreads; ++i) {
    const int lane = i % 32;
    EXPECT_EQ(out[static_cast<std::size_t>(i)], i - lane + (lane + 1) % 32 + 1 + 1000 * kThreads / 2);
  }
}

TEST(RaceDetection, MissingSyncthreadsIsReported) {
  run(false, false);  // the check is TSan's report (the ctest's pass condition)
}

}  // namespace
}  // namespace capserve
