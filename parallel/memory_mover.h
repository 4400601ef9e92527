#pragma once
// The copies HostStagedCommunicator needs, behind an interface: CudaMemoryMover does them with the CUDA
// runtime (cudaMemcpyAsync, pinned host memory, an event); a host implementation, where "device" memory is
// host memory, lets the whole staging logic run and be tested on machines without a GPU.
//
// Copies are enqueued on a stream in order and may complete later: the host may read what a copy_to_host
// wrote only after synchronize(stream), and may overwrite the host memory a copy_to_device reads only after
// the work up to a mark() is done (wait_marked()).
#include <cstddef>
#include <memory>
#include <span>

#include "parallel/communicator.h"

namespace capserve::parallel {

class MemoryMover {
 public:
  // Host memory that asynchronous copies may use (page-locked with CUDA), freed by its own deleter.
  using HostBuffer = std::unique_ptr<std::byte[], void (*)(std::byte*)>;

  virtual ~MemoryMover() = default;
  MemoryMover() = default;
  MemoryMover(const MemoryMover&) = delete;
  MemoryMover& operator=(const MemoryMover&) = delete;

  // The device whose memory the copies move ("device" memory is host memory in the tests' mover).
  [[nodiscard]] virtual kernels::Device device() const = 0;

  // A host buffer of `bytes` bytes (bytes > 0).
  [[nodiscard]] virtual HostBuffer allocate_host(std::size_t bytes) = 0;

  // Enqueue a copy of src.size() bytes (dst has the same size) on stream.
  virtual void copy_to_host(std::span<std::byte> host, std::span<const std::byte> device, Stream stream) = 0;
  virtual void copy_to_device(std::span<std::byte> device, std::span<const std::byte> host,
                              Stream stream) = 0;
  virtual void copy_on_device(std::span<std::byte> dst, std::span<const std::byte> src, Stream stream) = 0;

  // Block the host until everything enqueued on stream so far has finished.
  virtual void synchronize(Stream stream) = 0;

  // Remember the point after everything enqueued on stream so far (replacing any earlier mark); wait_marked()
  // blocks the host until that point has been passed (at once when nothing was marked).
  virtual void mark(Stream stream) = 0;
  virtual void wait_marked() = 0;
};

}  // namespace capserve::parallel
