#pragma once
// Reading stored weight elements as fp32 and rounding fp32 to a stored type, on the device, for kernels
// templated on the weight type (float, __nv_bfloat16 or __half).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "kernels/cuda/launch.h"

namespace capserve::kernels::cuda {

__device__ inline float widen(const float* p, std::int64_t i) {
  return p[i];
}
__device__ inline float widen(const __nv_bfloat16* p, std::int64_t i) {
  return __bfloat162float(p[i]);
}
__device__ inline float widen(const __half* p, std::int64_t i) {
  return __half2float(p[i]);
}

__device__ inline void narrow(float v, float* out) {
  *out = v;
}
__device__ inline void narrow(float v, __nv_bfloat16* out) {
  *out = __float2bfloat16(v);
}
__device__ inline void narrow(float v, __half* out) {
  *out = __float2half(v);
}

}  // namespace capserve::kernels::cuda
