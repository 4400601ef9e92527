#include "parallel/cuda_memory_mover.h"

#include <cuda_runtime_api.h>

#include <new>

#include "kernels/cuda/cuda_check.h"

namespace capserve::parallel {
namespace {

void free_pinned(std::byte* p) {
  cudaFreeHost(p);  // a failure here has no one to report to; the memory is lost either way
}

}  // namespace

CudaMemoryMover::CudaMemoryMover() {
  CAPSERVE_CUDA_CHECK(cudaGetDevice(&device_));
  CAPSERVE_CUDA_CHECK(cudaEventCreateWithFlags(&marked_, cudaEventDisableTiming));
}

CudaMemoryMover::~CudaMemoryMover() {
  cudaEventDestroy(marked_);
}

MemoryMover::HostBuffer CudaMemoryMover::allocate_host(std::size_t bytes) {
  void* p = nullptr;
  const cudaError_t rc = cudaMallocHost(&p, bytes);
  if (rc == cudaErrorMemoryAllocation) throw std::bad_alloc();
  CAPSERVE_CUDA_CHECK(rc);
  return {static_cast<std::byte*>(p), free_pinned};
}

void CudaMemoryMover::copy_to_host(std::span<std::byte> host, std::span<const std::byte> device,
                                   Stream stream) {
  CAPSERVE_CUDA_CHECK(
      cudaMemcpyAsync(host.data(), device.data(), device.size(), cudaMemcpyDeviceToHost, stream));
}

void CudaMemoryMover::copy_to_device(std::span<std::byte> device, std::span<const std::byte> host,
                                     Stream stream) {
  CAPSERVE_CUDA_CHECK(
      cudaMemcpyAsync(device.data(), host.data(), host.size(), cudaMemcpyHostToDevice, stream));
}

void CudaMemoryMover::copy_on_device(std::span<std::byte> dst, std::span<const std::byte> src,
                                     Stream stream) {
  CAPSERVE_CUDA_CHECK(cudaMemcpyAsync(dst.data(), src.data(), src.size(), cudaMemcpyDeviceToDevice, stream));
}

void CudaMemoryMover::synchronize(Stream stream) {
  CAPSERVE_CUDA_CHECK(cudaStreamSynchronize(stream));
}

void CudaMemoryMover::mark(Stream stream) {
  CAPSERVE_CUDA_CHECK(cudaEventRecord(marked_, stream));
}

void CudaMemoryMover::wait_marked() {
  CAPSERVE_CUDA_CHECK(cudaEventSynchronize(marked_));
}

}  // namespace capserve::parallel
