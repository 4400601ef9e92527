#pragma once
// Reductions over a warp and over a thread block, for the .cu files' kernels. A block's reductions need one
// scratch slot per warp in shared memory; every thread of the block must call them (they contain barriers).
#include <cstdint>

#include "kernels/cuda/launch.h"

namespace capserve::kernels::cuda {

constexpr int kWarp = 32;

__device__ inline float warp_sum(float v) {
  for (int o = kWarp / 2; o > 0; o /= 2) v += __shfl_xor_sync(0xFFFFFFFFU, v, o);
  return v;
}

__device__ inline std::uint64_t warp_max_u64(std::uint64_t v) {
  for (int o = kWarp / 2; o > 0; o /= 2) {
    const std::uint64_t other = __shfl_xor_sync(0xFFFFFFFFU, v, o);
    v = other > v ? other : v;
  }
  return v;
}

// Sum over the block; every thread gets it.
__device__ inline float block_sum(float v, float* scratch) {
  v = warp_sum(v);
  const int warp = static_cast<int>(threadIdx.x) / kWarp;
  const int warps = static_cast<int>(blockDim.x) / kWarp;
  __syncthreads();  // scratch may still be read from the previous call
  if (threadIdx.x % kWarp == 0) scratch[warp] = v;
  __syncthreads();
  float total = 0.0F;
  for (int w = 0; w < warps; ++w) total += scratch[w];
  return total;
}

__device__ inline std::uint64_t block_max_u64(std::uint64_t v, std::uint64_t* scratch) {
  v = warp_max_u64(v);
  const int warp = static_cast<int>(threadIdx.x) / kWarp;
  const int warps = static_cast<int>(blockDim.x) / kWarp;
  __syncthreads();
  if (threadIdx.x % kWarp == 0) scratch[warp] = v;
  __syncthreads();
  std::uint64_t best = 0;
  for (int w = 0; w < warps; ++w) best = scratch[w] > best ? scratch[w] : best;
  return best;
}

}  // namespace capserve::kernels::cuda
