#pragma once
// Exact widening of stored weight elements to float32 (bf16 is the top half of an f32; f16 is decoded per
// IEEE 754).
#include <bit>
#include <cstdint>
#include <cstring>

#include "kernels/dtype.h"

namespace capserve::kernels::cpu {

inline float bf16_to_f32(std::uint16_t h) {
  return std::bit_cast<float>(static_cast<std::uint32_t>(h) << 16);
}

inline float f16_to_f32(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000U) << 16;
  const std::uint32_t exp = (h >> 10) & 0x1FU;
  std::uint32_t mant = h & 0x3FFU;
  if (exp == 0x1FU) return std::bit_cast<float>(sign | 0x7F800000U | (mant << 13));  // inf / nan
  if (exp != 0) return std::bit_cast<float>(sign | ((exp + 112U) << 23) | (mant << 13));
  if (mant == 0) return std::bit_cast<float>(sign);
  // Subnormal f16: normalize into an f32 exponent.
  std::uint32_t e = 113;
  while ((mant & 0x400U) == 0) {
    mant <<= 1;
    --e;
  }
  return std::bit_cast<float>(sign | (e << 23) | ((mant & 0x3FFU) << 13));
}

template <DType D>
inline float load_element(const std::byte* base, std::int64_t i) {
  if constexpr (D == DType::f32) {
    float v;
    std::memcpy(&v, base + i * 4, 4);
    return v;
  } else {
    std::uint16_t h;
    std::memcpy(&h, base + i * 2, 2);
    if constexpr (D == DType::bf16) {
      return bf16_to_f32(h);
    } else {
      return f16_to_f32(h);
    }
  }
}

// Widens `count` elements starting at element `first` of a stored array into out.
void convert_to_f32(DType dtype, const std::byte* base, std::int64_t first, std::int64_t count, float* out);

}  // namespace capserve::kernels::cpu
