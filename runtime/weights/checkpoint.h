#pragma once
// A Hugging Face checkpoint directory: `model.safetensors`, or shards listed in
// `model.safetensors.index.json`. Architectures fetch tensors by name with their expected shape; every
// fetched tensor is marked used so that `check_all_used` can reject a checkpoint carrying tensors the
// architecture does not know.
#include <cstdint>
#include <filesystem>
#include <initializer_list>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "kernels/dtype.h"
#include "runtime/weights/safetensors_file.h"

namespace capserve::runtime {

class Checkpoint {
 public:
  // Throws LoadError: no safetensors file, a malformed index (bad JSON, missing weight_map, a listed shard
  // that is missing, a tensor the index places in a shard that lacks it, a tensor present in two shards), or
  // a bad shard.
  static Checkpoint open(const std::filesystem::path& dir);

  [[nodiscard]] bool contains(std::string_view name) const;

  // The tensor with exactly this shape ({n} for a vector, {rows, cols} for a matrix). Throws LoadError naming
  // the file and tensor when it is missing or has another shape.
  kernels::WeightView get(std::string_view name, std::initializer_list<std::int64_t> shape);

  // Throws LoadError listing every tensor never fetched with `get` (name and file), if any.
  void check_all_used() const;

  [[nodiscard]] const std::filesystem::path& dir() const { return dir_; }

 private:
  Checkpoint(std::filesystem::path dir, std::vector<SafetensorsFile> files);

  std::filesystem::path dir_;
  std::vector<SafetensorsFile> files_;
  std::unordered_map<std::string, const TensorInfo*> by_name_;
  std::unordered_map<std::string, std::size_t> file_of_;  // tensor name -> index into files_
  std::unordered_set<std::string> used_;
};

}  // namespace capserve::runtime
