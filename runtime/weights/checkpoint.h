#pragma once
// A Hugging Face checkpoint directory: `model.safetensors`, or shards listed in
// `model.safetensors.index.json`. Architectures fetch tensors by name with their expected shape; every
// fetched tensor is marked used so that `check_all_used` can reject a checkpoint carrying tensors the
// architecture does not know. Block-quantized FP8 weights (runtime/weights/fp8_blocks.h) are fetched with
// their `_scale_inv` tensors: as stored for a backend that keeps FP8 (get_stored), or as bf16, dequantized on
// fetch into memory the checkpoint owns (get).
#include <cstdint>
#include <filesystem>
#include <initializer_list>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "kernels/dtype.h"
#include "runtime/weights/fp8_blocks.h"
#include "runtime/weights/safetensors_file.h"

namespace capserve::runtime {

class Checkpoint {
 public:
  // Throws LoadError: no safetensors file, a malformed index (bad JSON, missing weight_map, a listed shard
  // that is missing, a tensor the index places in a shard that lacks it, a tensor present in two shards), or
  // a bad shard. `fp8` is the block shape of config.json's FP8 quantization; without it an F8_E4M3 tensor is
  // refused when fetched.
  static Checkpoint open(const std::filesystem::path& dir, std::optional<Fp8BlockShape> fp8 = std::nullopt);

  [[nodiscard]] bool contains(std::string_view name) const;

  // The tensor with exactly this shape ({n} for a vector, {rows, cols} for a matrix). Throws LoadError naming
  // the file and tensor when it is missing or has another shape.
  // An F8_E4M3 tensor comes back dequantized to bf16 (its scale tensor checked and marked used too).
  kernels::WeightView get(std::string_view name, std::initializer_list<std::int64_t> shape);
  // `get` without the dequantization: an F8_E4M3 tensor comes back as its bytes in the mapping with its
  // scales (WeightView::scales, F32 or BF16 as stored), for a backend that keeps FP8 (Backend::keeps_fp8).
  kernels::WeightView get_stored(std::string_view name, std::initializer_list<std::int64_t> shape);
  // `get` widened exactly to f32 (from BF16 or F16, or an FP8 matrix's bf16 dequantization) into memory the
  // checkpoint owns: converters store small f32 tensors in either half type.
  kernels::WeightView get_f32(std::string_view name, std::initializer_list<std::int64_t> shape);
  // What `get` checks and marks, without reading or dequantizing the data (other ranks' experts).
  void check(std::string_view name, std::initializer_list<std::int64_t> shape);
  // Frees the dequantized or widened copy behind a view `get` or `get_f32` returned, once a device holds its
  // own copy (no-op for a view into the mapping).
  void release(const kernels::WeightView& view);

  // Throws LoadError listing every tensor never fetched with `get` (name and file), if any.
  void check_all_used() const;

  [[nodiscard]] const std::filesystem::path& dir() const { return dir_; }

 private:
  Checkpoint(std::filesystem::path dir, std::vector<SafetensorsFile> files, std::optional<Fp8BlockShape> fp8);
  // The tensor, its shape checked and it (and an FP8 weight's scale tensor) marked used.
  const TensorInfo& checked(std::string_view name, const std::vector<std::int64_t>& shape);
  const TensorInfo& fp8_scale_of(const std::string& name, const TensorInfo& weight);

  std::filesystem::path dir_;
  std::vector<SafetensorsFile> files_;
  std::unordered_map<std::string, const TensorInfo*> by_name_;
  std::unordered_map<std::string, std::size_t> file_of_;  // tensor name -> index into files_
  std::unordered_set<std::string> used_;
  std::optional<Fp8BlockShape> fp8_;
  std::unordered_map<const std::byte*, std::vector<std::uint16_t>> dequantized_;  // bf16, by data pointer
  std::unordered_map<const std::byte*, std::vector<float>> widened_;              // by data pointer
};

}  // namespace capserve::runtime
