#include "kernels/cuda/host_readback.h"

#include <cstring>
#include <stdexcept>

#include "kernels/cuda/cuda_check.h"

namespace capserve::kernels::cuda {

void HostReadback::grow(std::size_t bytes) {
  if (outstanding()) throw std::logic_error("HostReadback::grow with copies outstanding");
  if (bytes <= capacity_) return;
  void* p = nullptr;
  CAPSERVE_CUDA_CHECK(cudaMallocHost(&p, bytes));
  pinned_.reset(static_cast<std::byte*>(p));
  capacity_ = bytes;
}

void HostReadback::queue(const void* src, std::span<std::byte> dst, cudaStream_t stream) {
  if (!fits(dst.size())) throw std::logic_error("HostReadback::queue: the copy does not fit");
  CAPSERVE_CUDA_CHECK(
      cudaMemcpyAsync(pinned_.get() + used_, src, dst.size(), cudaMemcpyDeviceToHost, stream));
  copies_.push_back({used_, dst});
  used_ += room(dst.size());
}

void HostReadback::deliver() {
  for (const Copy& c : copies_) std::memcpy(c.dst.data(), pinned_.get() + c.offset, c.dst.size());
  copies_.clear();
  used_ = 0;
}

}  // namespace capserve::kernels::cuda
