#pragma once
// CUDA emulation internals shared by its translation units: the per-thread last error (with a detailed
// message), the device-memory registry, the counters and the current device.
#include <cuda_runtime_api.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "cuda_emu.h"

namespace capserve::cuda_emu::detail {

// Records `code` with its detail as this thread's last error (cudaGetLastError) and returns it;
// cudaGetErrorString(code) then appends the detail.
cudaError_t fail(cudaError_t code, std::string detail);

// The error a launch or call left for cudaGetLastError / cudaPeekAtLastError.
cudaError_t last_error(bool clear);

// Where a pointer lies.
enum class MemoryKind : std::uint8_t { none, device, pinned_host, freed_device };
struct MemoryRange {
  MemoryKind kind = MemoryKind::none;
  std::uintptr_t begin = 0;
  std::size_t bytes = 0;
  int device = 0;
};
MemoryRange find_memory(const void* p);

// Empty when [p, p + bytes) lies in one live allocation of `kind` (device or pinned_host); else why not.
std::string check_range(const void* p, std::size_t bytes, MemoryKind kind, const char* role);

// Empty when p is null or points into live device or page-locked host memory; else why a device would fault.
std::string check_device_pointer(const void* p);

// Null when the device's memory (CAPSERVE_CUDA_EMU_DEVICE_MEMORY_MIB, default 80 GiB) would be exceeded.
void* allocate_device(std::size_t bytes, int device);
std::size_t device_memory_total();
std::size_t device_memory_in_use(int device);
void* allocate_pinned(std::size_t bytes);
// False when p is not the start of a live allocation of `kind`.
bool release(void* p, MemoryKind kind);

// While it lives, inside_emulation() is true on this thread.
class EmulationScope {
 public:
  EmulationScope();
  ~EmulationScope();
  EmulationScope(const EmulationScope&) = delete;
  EmulationScope& operator=(const EmulationScope&) = delete;
};

// One more of a counter (thread-safe).
void count(std::int64_t Counters::*field);

// Empty when kernels may be queued on `stream` from this thread now; else why not.
std::string check_launch_stream(cudaStream_t stream);
// The device `stream` belongs to (the current one for the null and per-thread streams); -1 for a stream
// that is not live.
int stream_device(cudaStream_t stream);
// The most dynamic shared memory a launch of `kernel` may ask for (48 KB unless raised by
// cudaFuncSetAttribute).
int max_dynamic_shared(const void* kernel);

// Device work on a stream that never completes: an NCCL send or receive whose peer died, whose kernel waits
// forever on a GPU. Until `released` (ncclCommAbort), cudaStreamQuery of the stream says cudaErrorNotReady
// and host waits on it (cudaStreamSynchronize; cudaDeviceSynchronize and cudaMemcpy on its device) block;
// they give up after nccl_timeout() seconds with cudaErrorLaunchTimeout naming `why`, where a GPU would wait
// forever. Work queued behind it still runs at once (on whatever its buffers hold).
struct StreamHang {
  std::atomic<bool> released{false};
  std::string why;
};
std::shared_ptr<StreamHang> hang_stream(cudaStream_t stream, std::string why);
// Seconds the NCCL stand-in waits for a peer, and a host wait for a hung stream, before failing
// (CAPSERVE_CUDA_EMU_NCCL_TIMEOUT_S, default 30).
double nccl_timeout();
int current_device();
int device_count();

}  // namespace capserve::cuda_emu::detail
