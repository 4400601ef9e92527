#pragma once
// Reading stored weight elements as fp32 and rounding fp32 to a stored type, on the device, for kernels
// templated on the weight type (float, __nv_bfloat16 or __half); FP8 (E4M3) bytes as fp32.
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

// The exact value of an E4M3FN byte (1 sign bit, 4 exponent bits of bias 7, 3 mantissa bits; exponent 0
// subnormal, S.1111.111 NaN, no infinity), built from its bits: the same values as the checkpoint's table
// (runtime/weights/fp8_blocks.h).
__device__ inline float widen_f8_e4m3(std::uint8_t byte) {
  const unsigned sign = (static_cast<unsigned>(byte) & 0x80U) << 24;
  const unsigned exponent = (static_cast<unsigned>(byte) >> 3) & 0xFU;
  const unsigned mantissa = static_cast<unsigned>(byte) & 0x7U;
  if (exponent == 0)  // mantissa x 2^-9, exact in f32
    return __uint_as_float(sign | __float_as_uint(static_cast<float>(mantissa) * 0.001953125F));
  if (exponent == 0xFU && mantissa == 0x7U) return __uint_as_float(sign | 0x7FC00000U);
  return __uint_as_float(sign | ((exponent + 120U) << 23) | (mantissa << 20));
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
