#pragma once
// Next-token sampling controls, one per row of a batch's logits, as every backend's `sample` takes them.
#include <cstdint>

#include "kernels/host_device.h"

namespace capserve::kernels {

struct SampleControls {
  float temperature = 0.0F;  // 0 (or so small that logits / temperature overflow): greedy
  std::int32_t top_k = 0;    // 0: no top-k filter
  float top_p = 1.0F;        // 1: no top-p filter
  std::uint64_t seed = 0;
  std::uint64_t step = 0;  // numbers the draws of one seed: (seed, step) always draws the same token
};

// What `sample` writes for a row with a NaN or infinite logit at id i: no distribution to sample from.
CAPSERVE_HD constexpr std::int32_t non_finite_token(std::int32_t first_bad_id) {
  return -1 - first_bad_id;
}
CAPSERVE_HD constexpr bool is_non_finite_token(std::int32_t token) {
  return token < 0;
}
CAPSERVE_HD constexpr std::int32_t first_non_finite_id(std::int32_t token) {
  return -1 - token;
}

}  // namespace capserve::kernels
