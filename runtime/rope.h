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
  // `dim`: the rotated dims of a head.
  Rope(std::int64_t dim, double theta, const RopeScaling& scaling);

  // Fills cos/sin [positions.size(), dim / 2] (grow-only buffers), both multiplied by the scaling's attention
  // factor (YaRN; 1 otherwise), as transformers does.
  void tables(std::span<const std::int32_t> positions, std::vector<float>& cos,
              std::vector<float>& sin) const;

  [[nodiscard]] std::span<const float> inv_freq() const { return inv_freq_; }

 private:
  std::vector<float> inv_freq_;
  float attention_factor_ = 1.0F;
};

}  // namespace capserve::runtime
