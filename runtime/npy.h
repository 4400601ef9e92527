#pragma once
// Minimal NumPy .npy (format 1.0/2.0) support for float32 C-order arrays: --dump-logits output and test
// fixtures.
#include <cstdint>
#include <filesystem>
#include <span>
#include <vector>

namespace capserve::runtime {

struct NpyArray {
  std::vector<std::int64_t> shape;
  std::vector<float> data;
};

// Throws LoadError on I/O failure.
void write_npy(const std::filesystem::path& path, std::span<const float> data,
               std::span<const std::int64_t> shape);

// Throws LoadError naming the file when it is not a little-endian float32 C-order .npy array.
NpyArray read_npy(const std::filesystem::path& path);

}  // namespace capserve::runtime
