#pragma once
// One .safetensors file, memory-mapped read-only and fully validated on open: header length against the file
// size, header JSON, dtype, shape x dtype size = byte range, every range inside the data section, no two
// ranges overlapping.
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "kernels/dtype.h"

namespace capserve::runtime {

struct TensorInfo {
  std::string name;
  kernels::DType dtype = kernels::DType::f32;
  std::vector<std::int64_t> shape;
  const std::byte* data = nullptr;  // inside the mapping
  std::size_t nbytes = 0;
};

// "[2, 3]": a shape as error messages print it.
std::string shape_text(const std::vector<std::int64_t>& shape);

class SafetensorsFile {
 public:
  // Throws LoadError naming the path and what is wrong.
  static SafetensorsFile open(const std::filesystem::path& path);

  SafetensorsFile(SafetensorsFile&&) noexcept;
  SafetensorsFile& operator=(SafetensorsFile&&) noexcept;
  ~SafetensorsFile();

  [[nodiscard]] const std::filesystem::path& path() const { return path_; }
  [[nodiscard]] const std::vector<TensorInfo>& tensors() const { return tensors_; }
  [[nodiscard]] const TensorInfo* find(std::string_view name) const;

 private:
  struct Mapping;
  SafetensorsFile(std::filesystem::path path, std::unique_ptr<Mapping> mapping,
                  std::vector<TensorInfo> tensors);

  std::filesystem::path path_;
  std::unique_ptr<Mapping> mapping_;
  std::vector<TensorInfo> tensors_;  // sorted by name
};

}  // namespace capserve::runtime
