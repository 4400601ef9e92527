#pragma once
// Shared by every GPU test (label gpu): skip, with the reason, where no CUDA device can be used; random
// inputs and the relative error the tests bound.
//
//   TEST(Foo, Bar) {
//     CAPSERVE_REQUIRE_CUDA_DEVICE();
//     ...
//   }
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <random>
#include <string>
#include <vector>

namespace capserve::test {

// Why no CUDA device is usable here, or nothing when one is.
inline std::optional<std::string> cuda_device_unavailable() {
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess) return std::string("no CUDA device: ") + cudaGetErrorString(status);
  if (count == 0) return std::string("no CUDA device: cudaGetDeviceCount found 0 devices");
  return std::nullopt;
}

// Normal(0, sd) values.
template <class Rng>
std::vector<float> normal_vector(Rng& rng, std::size_t n, float sd = 1.0F) {
  std::normal_distribution<float> d(0.0F, sd);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

// ||out - ref|| / ||ref||, infinite when anything is not finite.
inline double relative_error(const std::vector<float>& out, const std::vector<float>& ref) {
  double num = 0.0;
  double den = 0.0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    if (!std::isfinite(out[i])) return INFINITY;
    const double d = static_cast<double>(out[i]) - ref[i];
    num += d * d;
    den += static_cast<double>(ref[i]) * ref[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

}  // namespace capserve::test

// GTEST_SKIP returns from the test body, so this must be a macro used there.
#define CAPSERVE_REQUIRE_CUDA_DEVICE()                                               \
  do {                                                                               \
    if (const auto capserve_no_device = ::capserve::test::cuda_device_unavailable()) \
      GTEST_SKIP() << *capserve_no_device;                                           \
  } while (false)
