#include "kernels/cuda/stream_wait.h"

#include <algorithm>
#include <chrono>
#include <thread>

#include "kernels/cuda/cuda_check.h"

namespace capserve::kernels::cuda {

namespace {

// Polls `query` (cudaStreamQuery or cudaEventQuery) until it finds the work done, running `check` between
// polls.
template <class Query>
void poll(const Query& query, const std::function<void()>& check) {
  constexpr std::chrono::milliseconds kSpin{2};
  constexpr std::chrono::microseconds kFirstPause{20};
  constexpr std::chrono::microseconds kMaxPause{1000};
  const auto start = std::chrono::steady_clock::now();
  std::chrono::microseconds pause = kFirstPause;
  for (;;) {
    const cudaError_t rc = query();
    if (rc == cudaSuccess) return;
    if (rc != cudaErrorNotReady) CAPSERVE_CUDA_CHECK(rc);
    check();
    if (std::chrono::steady_clock::now() - start < kSpin) {
      std::this_thread::yield();
      continue;
    }
    std::this_thread::sleep_for(pause);
    pause = std::min(2 * pause, kMaxPause);
  }
}

}  // namespace

void wait_for_stream(cudaStream_t stream, const std::function<void()>& check) {
  if (!check) {
    CAPSERVE_CUDA_CHECK(cudaStreamSynchronize(stream));
    return;
  }
  poll([stream] { return cudaStreamQuery(stream); }, check);
}

void wait_for_event(cudaEvent_t event, const std::function<void()>& check) {
  if (!check) {
    CAPSERVE_CUDA_CHECK(cudaEventSynchronize(event));
    return;
  }
  poll([event] { return cudaEventQuery(event); }, check);
}

}  // namespace capserve::kernels::cuda
