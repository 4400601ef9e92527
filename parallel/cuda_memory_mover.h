#pragma once
// MemoryMover with the CUDA runtime: cudaMemcpyAsync on the caller's stream, page-locked host buffers
// (cudaMallocHost, so the copies are truly asynchronous), and one event for mark()/wait_marked(). Built only
// with CUDA (capserve_parallel_cuda); the header itself needs no CUDA headers.
#include <cstddef>
#include <span>

#include "parallel/memory_mover.h"

struct CUevent_st;

namespace capserve::parallel {

class CudaMemoryMover final : public MemoryMover {
 public:
  // Creates the event on the current device; use the mover with streams and memory of that device.
  CudaMemoryMover();
  ~CudaMemoryMover() override;

  [[nodiscard]] kernels::Device device() const override { return {kernels::DeviceKind::cuda, device_}; }
  [[nodiscard]] HostBuffer allocate_host(std::size_t bytes) override;
  void copy_to_host(std::span<std::byte> host, std::span<const std::byte> device, Stream stream) override;
  void copy_to_device(std::span<std::byte> device, std::span<const std::byte> host, Stream stream) override;
  void copy_on_device(std::span<std::byte> dst, std::span<const std::byte> src, Stream stream) override;
  void synchronize(Stream stream) override;
  void mark(Stream stream) override;
  void wait_marked() override;

 private:
  int device_ = 0;
  CUevent_st* marked_ = nullptr;  // owned: cudaEventDestroy
};

}  // namespace capserve::parallel
