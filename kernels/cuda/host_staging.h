#pragma once
// How host bytes reach one CUDA device without the host waiting: a copy from pageable memory makes the host
// wait (the runtime stages it itself), so every host-to-device copy goes through page-locked memory owned
// here. A fixed ring of cudaMallocHost memory split into chunks, each with an event recorded after the copies
// that read it: the ring is reused without allocating, and a chunk is refilled only once the device has read
// it (the host waits only when it laps copies the device has not done yet, e.g. a weight upload larger than
// the ring, which so streams through it chunk after chunk). A device mirror of the same size gives small
// staged arrays (a step's block tables, positions, sampling controls) a device home whose reuse the stream
// orders by itself.
#include <cuda_runtime_api.h>

#include <cstddef>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "kernels/buffer.h"

namespace capserve::kernels::cuda {

class HostStaging {
 public:
  // `device` (device memory of the staging's device) sets the ring's size; chunks of bytes / chunks each.
  HostStaging(Buffer device, int chunks);
  ~HostStaging();
  HostStaging(const HostStaging&) = delete;
  HostStaging& operator=(const HostStaging&) = delete;

  // Queues the copy of `src` into device memory at `dst` on `stream`, in chunk-sized pieces; `src` may change
  // as soon as this returns.
  void copy(std::span<const std::byte> src, void* dst, cudaStream_t stream);
  // `src` copied into the device mirror on `stream`: valid for the kernels queued after it on the stream
  // until about the ring's size more has been staged. std::length_error above one chunk.
  [[nodiscard]] void* stage(std::span<const std::byte> src, cudaStream_t stream);
  [[nodiscard]] std::size_t chunk_bytes() const { return chunk_bytes_; }
  // Run between polls while the host waits for the device to have read a chunk it laps (the backend's wait
  // check, stream_wait.h): a stream stalled behind NCCL work of a dead peer then throws instead of hanging.
  void set_wait_check(std::function<void()> check) { wait_check_ = std::move(check); }

 private:
  // Offset of `bytes` contiguous bytes in the ring (at most one chunk), the chunk entered ready for reuse.
  std::size_t take(std::size_t bytes, cudaStream_t stream);

  struct PinnedFree {
    void operator()(std::byte* p) const noexcept { cudaFreeHost(p); }
  };

  Buffer device_;
  std::byte* mirror_ = nullptr;                  // device_'s memory
  std::unique_ptr<std::byte, PinnedFree> host_;  // page-locked, as many bytes as the chunks
  std::size_t chunk_bytes_ = 0;
  std::size_t current_ = 0;        // the chunk being filled
  std::size_t used_ = 0;           // its bytes taken
  std::vector<cudaEvent_t> read_;  // per chunk: recorded after the copies that read it
  std::vector<char> pending_;      // per chunk: read_ recorded and not yet seen complete
  std::function<void()> wait_check_;
};

}  // namespace capserve::kernels::cuda
