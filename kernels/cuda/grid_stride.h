#pragma once
// Launch shape of the element-wise kernels: 256 threads per block and enough blocks to fill the device; each
// thread strides over the rest of the elements.
#include <cstdint>

namespace capserve::kernels::cuda {

constexpr int kGridStrideThreads = 256;

inline unsigned grid_stride_blocks(std::int64_t n) {
  constexpr std::int64_t kMaxBlocks = 4096;
  const std::int64_t b = (n + kGridStrideThreads - 1) / kGridStrideThreads;
  return static_cast<unsigned>(b < 1 ? 1 : (b > kMaxBlocks ? kMaxBlocks : b));
}

}  // namespace capserve::kernels::cuda
