#pragma once
// The host's wait for a stream's work. cudaStreamSynchronize cannot be interrupted: work that never completes
// (an NCCL kernel waiting for a peer rank that died) keeps the host there until the step watchdog. With a
// check, the host polls instead and runs the check between polls; the check throws to end a wait that the
// work can no longer finish (NcclCommunicator::check_async_error, which first aborts the communicator: that
// ends its kernels, so the stream can go on).
#include <cuda_runtime_api.h>

#include <functional>

namespace capserve::kernels::cuda {

// Returns once the work queued on `stream` so far has completed; throws CudaError on a CUDA error, or what
// `check` throws. Without a check: cudaStreamSynchronize. With one: cudaStreamQuery, yielding the core
// between polls for the first 2 ms (a decode step's waits are short, and a sleep would add its length to the
// step), then sleeping between polls, the pause doubling from 20 us to 1 ms.
void wait_for_stream(cudaStream_t stream, const std::function<void()>& check);
// The same for the work queued before `event` was recorded (cudaEventSynchronize without a check, else
// cudaEventQuery polls).
void wait_for_event(cudaEvent_t event, const std::function<void()>& check);

}  // namespace capserve::kernels::cuda
