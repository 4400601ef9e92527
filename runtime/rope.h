#pragma once
// Rotary position embedding frequencies (rope_theta and the scaling types these models use), and the per-step
// cos/sin tables for the positions of a batch, computed once per step and shared by every layer.
#include <cstdint>
#include <span>
#include <vector>

#include "runtime/model_config.h"

namespace capserve::runtime {

class Rope {
 public:
  Rope(std::int64_t head_dim, double theta, const RopeScaling& scaling);

  // Fills cos/sin [positions.size(), head_dim / 2] (grow-only buffers).
  void tables(std::span<const std::int32_t> positions, std::vector<float>& cos,
              std::vector<float>& sin) const;

  [[nodiscard]] std::span<const float> inv_freq() const { return inv_freq_; }

 private:
  std::vector<float> inv_freq_;
};

}  // namespace capserve::runtime
