#pragma once
// Block-quantized FP8 weights as DeepSeek-V3 ships them (`quantization_config.quant_method = "fp8"`): each
// linear weight stored as F8_E4M3 (the "fn" variant: no infinities, 0x7f / 0xff are NaN) with a
// `<name>_scale_inv` tensor of one scale per block of block_rows x block_cols elements; the weight is
// element x scale of its block. They are dequantized to bf16 when loaded: the kernels' weight types are
// f32 / f16 / bf16, and bf16 is what the released checkpoints' unquantized tensors use.
#include <cstdint>
#include <span>

#include "runtime/weights/safetensors_file.h"

namespace capserve::runtime {

struct Fp8BlockShape {
  std::int64_t rows = 128;
  std::int64_t cols = 128;
};

// The exact value of one E4M3FN byte.
float f8_e4m3_to_float(std::uint8_t byte);

// The scale tensor's shape for a [rows, cols] weight: one entry per (possibly partial) block.
std::int64_t fp8_scale_rows(std::int64_t rows, Fp8BlockShape block);
std::int64_t fp8_scale_cols(std::int64_t cols, Fp8BlockShape block);

// `out[r * cols + c]` = bf16 bits of (weight[r, c] x scale[r / block.rows, c / block.cols]) computed in f32
// and rounded to nearest even. `weight` is F8_E4M3 [rows, cols], `scale_inv` F32 or BF16 of the shape above
// (checked by the caller); `out` holds rows x cols elements.
void dequantize_fp8_blocks(const TensorInfo& weight, const TensorInfo& scale_inv, Fp8BlockShape block,
                           std::span<std::uint16_t> out);

}  // namespace capserve::runtime
