#pragma once
// Shared by every GPU test (label gpu): skip, with the reason, where no CUDA device can be used.
//
//   TEST(Foo, Bar) {
//     CAPSERVE_REQUIRE_CUDA_DEVICE();
//     ...
//   }
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <optional>
#include <string>

namespace capserve::test {

// Why no CUDA device is usable here, or nothing when one is.
inline std::optional<std::string> cuda_device_unavailable() {
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess) return std::string("no CUDA device: ") + cudaGetErrorString(status);
  if (count == 0) return std::string("no CUDA device: cudaGetDeviceCount found 0 devices");
  return std::nullopt;
}

}  // namespace capserve::test

// GTEST_SKIP returns from the test body, so this must be a macro used there.
#define CAPSERVE_REQUIRE_CUDA_DEVICE()                                               \
  do {                                                                               \
    if (const auto capserve_no_device = ::capserve::test::cuda_device_unavailable()) \
      GTEST_SKIP() << *capserve_no_device;                                           \
  } while (false)
