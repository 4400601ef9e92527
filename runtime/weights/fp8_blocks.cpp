#include "runtime/weights/fp8_blocks.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>

#include "kernels/cpu/weight_convert.h"

namespace capserve::runtime {
namespace {

// All 256 values, decoded once: 1 sign bit, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 is
// subnormal; S.1111.111 is NaN and there is no infinity.
std::array<float, 256> make_f8_table() {
  std::array<float, 256> t{};
  for (int b = 0; b < 256; ++b) {
    const int exponent = (b >> 3) & 0xf;
    const int mantissa = b & 0x7;
    float v = 0.0f;
    if (exponent == 0xf && mantissa == 0x7) {
      v = std::numeric_limits<float>::quiet_NaN();
    } else if (exponent == 0) {
      v = std::ldexp(static_cast<float>(mantissa), -9);  // mantissa / 8 * 2^-6
    } else {
      v = std::ldexp(1.0f + static_cast<float>(mantissa) / 8.0f, exponent - 7);
    }
    t[static_cast<std::size_t>(b)] = (b & 0x80) != 0 ? -v : v;
  }
  return t;
}

const std::array<float, 256>& f8_table() {
  static const std::array<float, 256> table = make_f8_table();
  return table;
}

std::uint16_t f32_to_bf16_nearest_even(float f) {
  const auto bits = std::bit_cast<std::uint32_t>(f);
  if (std::isnan(f)) return static_cast<std::uint16_t>((bits >> 16) | 0x40);  // stays a (quiet) NaN
  const std::uint32_t rounding = 0x7fff + ((bits >> 16) & 1);
  return static_cast<std::uint16_t>((bits + rounding) >> 16);
}

float scale_at(const TensorInfo& scale_inv, std::int64_t index) {
  if (scale_inv.dtype == kernels::DType::bf16) {
    std::uint16_t h = 0;
    std::memcpy(&h, scale_inv.data + index * 2, 2);
    return kernels::cpu::bf16_to_f32(h);
  }
  float f = 0.0f;
  std::memcpy(&f, scale_inv.data + index * 4, 4);
  return f;
}

}  // namespace

float f8_e4m3_to_float(std::uint8_t byte) {
  return f8_table()[byte];
}

std::int64_t fp8_scale_rows(std::int64_t rows, Fp8BlockShape block) {
  return (rows + block.rows - 1) / block.rows;
}

std::int64_t fp8_scale_cols(std::int64_t cols, Fp8BlockShape block) {
  return (cols + block.cols - 1) / block.cols;
}

void dequantize_fp8_blocks(const TensorInfo& weight, const TensorInfo& scale_inv, Fp8BlockShape block,
                           std::span<std::uint16_t> out) {
  const std::int64_t rows = weight.shape.size() == 2 ? weight.shape[0] : 1;
  const std::int64_t cols = weight.shape.back();
  const std::int64_t scale_cols = fp8_scale_cols(cols, block);
  const std::array<float, 256>& table = f8_table();
  const auto* in = reinterpret_cast<const std::uint8_t*>(weight.data);
  for (std::int64_t r = 0; r < rows; ++r) {
    const std::int64_t scale_row = (r / block.rows) * scale_cols;
    for (std::int64_t c0 = 0; c0 < cols; c0 += block.cols) {
      const float scale = scale_at(scale_inv, scale_row + c0 / block.cols);
      const std::int64_t c1 = std::min(cols, c0 + block.cols);
      for (std::int64_t c = c0; c < c1; ++c) {
        out[static_cast<std::size_t>(r * cols + c)] =
            f32_to_bf16_nearest_even(table[in[r * cols + c]] * scale);
      }
    }
  }
}

}  // namespace capserve::runtime
