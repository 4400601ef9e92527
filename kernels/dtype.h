#pragma once
// Element types: the float types weights are stored in (checkpoints), and the integer types of token ids,
// offsets and flags. Activations are float32 on the CPU path. F8_E4M3 is a block-quantized weight (a
// WeightView or Tensor carrying its BlockScales): a backend that keeps FP8 (Backend::keeps_fp8, the CUDA
// backend) takes it into its linear layers; for the others the checkpoint dequantizes it to bf16 when loaded
// (runtime/weights/fp8_blocks.h).
#include <cstddef>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>

namespace capserve::kernels {

enum class DType : std::uint8_t { f32, f16, bf16, i32, i64, u8, f8_e4m3 };

constexpr std::size_t dtype_size(DType t) {
  switch (t) {
    case DType::f32:
    case DType::i32:
      return 4;
    case DType::f16:
    case DType::bf16:
      return 2;
    case DType::i64:
      return 8;
    case DType::u8:
    case DType::f8_e4m3:
      return 1;
  }
  return 0;
}

// The types every backend takes a weight in (f8_e4m3 only with its BlockScales, where Backend::keeps_fp8).
constexpr bool is_float(DType t) {
  return t == DType::f32 || t == DType::f16 || t == DType::bf16;
}

constexpr std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::f32:
      return "F32";
    case DType::f16:
      return "F16";
    case DType::bf16:
      return "BF16";
    case DType::i32:
      return "I32";
    case DType::i64:
      return "I64";
    case DType::u8:
      return "U8";
    case DType::f8_e4m3:
      return "F8_E4M3";
  }
  return "?";
}

// Parses a safetensors dtype string of a weight type ("F32", "F16", "BF16", "F8_E4M3").
constexpr std::optional<DType> parse_dtype(std::string_view s) {
  if (s == "F8_E4M3") return DType::f8_e4m3;
  if (s == "F32") return DType::f32;
  if (s == "F16") return DType::f16;
  if (s == "BF16") return DType::bf16;
  return std::nullopt;
}

// The scales of a block-quantized weight (DType::f8_e4m3, the "fn" variant): element (r, c) stands for its
// stored value times scale[r / block_rows, c / block_cols] of a row-major [ceil(rows / block_rows),
// ceil(cols / block_cols)] matrix of `dtype` (f32 or bf16 in a checkpoint; a device keeps f32). The last
// block of a row or column may be partial. Empty (data null) for every other weight.
struct BlockScales {
  DType dtype = DType::f32;
  const void* data = nullptr;
  std::int64_t block_rows = 0;
  std::int64_t block_cols = 0;

  [[nodiscard]] bool empty() const { return data == nullptr; }
  // The scale matrix's shape for a [rows, cols] weight.
  [[nodiscard]] std::int64_t grid_rows(std::int64_t rows) const {
    return (rows + block_rows - 1) / block_rows;
  }
  [[nodiscard]] std::int64_t grid_cols(std::int64_t cols) const {
    return (cols + block_cols - 1) / block_cols;
  }
};

// A read-only row-major matrix in its stored dtype, usually pointing straight into an mmapped checkpoint.
// Linear weights use Hugging Face's [out_features, in_features] layout. A vector is a 1-row matrix.
struct WeightView {
  WeightView() = default;
  WeightView(DType dtype_, const std::byte* data_, std::int64_t rows_, std::int64_t cols_,
             BlockScales scales_ = {})
      : dtype(dtype_), data(data_), rows(rows_), cols(cols_), scales(scales_) {}

  DType dtype = DType::f32;
  const std::byte* data = nullptr;
  std::int64_t rows = 0;
  std::int64_t cols = 0;
  BlockScales scales;  // only for f8_e4m3

  [[nodiscard]] bool empty() const { return data == nullptr; }
  [[nodiscard]] std::int64_t numel() const { return rows * cols; }
  // Rows [first, first + count); a block-scaled weight only from a block's first row (its scale rows
  // follow), std::invalid_argument otherwise.
  [[nodiscard]] WeightView row_range(std::int64_t first, std::int64_t count) const {
    WeightView part{dtype, data + static_cast<std::size_t>(first * cols) * dtype_size(dtype), count, cols,
                    scales};
    if (!scales.empty()) {
      if (first % scales.block_rows != 0)
        throw std::invalid_argument("WeightView::row_range: row " + std::to_string(first) +
                                    " inside a block of " + std::to_string(scales.block_rows) + " rows");
      part.scales.data = static_cast<const std::byte*>(scales.data) +
                         static_cast<std::size_t>(first / scales.block_rows * scales.grid_cols(cols)) *
                             dtype_size(scales.dtype);
    }
    return part;
  }
  // Elements [first, first + count) of a vector.
  [[nodiscard]] WeightView element_range(std::int64_t first, std::int64_t count) const {
    return {dtype, data + static_cast<std::size_t>(first) * dtype_size(dtype), 1, count};
  }
};

}  // namespace capserve::kernels
