#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "runtime/load_error.h"
#include "runtime/npy.h"

namespace capserve::runtime {
namespace {

std::filesystem::path temp_file(const std::string& name) {
  return std::filesystem::temp_directory_path() /
         ("capserve_test_npy_" + std::to_string(::getpid()) + "_" + name);
}

TEST(Npy, RoundTrip) {
  const auto path = temp_file("rt.npy");
  const std::vector<float> data = {1.5F, -2.0F, 3.25F, 0.0F, 7.0F, 1e-8F};
  const std::int64_t shape[2] = {2, 3};
  write_npy(path, data, shape);
  const NpyArray a = read_npy(path);
  EXPECT_EQ(a.shape, (std::vector<std::int64_t>{2, 3}));
  EXPECT_EQ(a.data, data);
  EXPECT_EQ(std::filesystem::file_size(path) % 64, (data.size() * 4) % 64);  // header padded to 64 bytes
  std::filesystem::remove(path);
}

TEST(Npy, RejectsWhatItCannotRead) {
  const auto path = temp_file("bad.npy");
  { std::ofstream(path) << "not numpy"; }
  EXPECT_THROW(read_npy(path), LoadError);
  {
    std::ofstream out(path, std::ios::binary);
    const std::string header = "{'descr': '<f8', 'fortran_order': False, 'shape': (2,), }";
    out.write("\x93NUMPY\x01\x00", 8);
    const char len[2] = {static_cast<char>(header.size()), 0};
    out.write(len, 2);
    out << header;
  }
  try {
    read_npy(path);
    FAIL() << "float64 accepted";
  } catch (const LoadError& e) {
    EXPECT_NE(std::string(e.what()).find("float32"), std::string::npos);
  }
  EXPECT_THROW(read_npy(temp_file("missing.npy")), LoadError);
  std::filesystem::remove(path);
}

}  // namespace
}  // namespace capserve::runtime
