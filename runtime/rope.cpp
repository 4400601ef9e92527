#include "runtime/rope.h"

#include <algorithm>
#include <cmath>
#include <numbers>

namespace capserve::runtime {

Rope::Rope(std::int64_t dim, double theta, const RopeScaling& scaling)
    : attention_factor_(static_cast<float>(scaling.attention_factor)) {
  const std::int64_t half = dim / 2;
  inv_freq_.resize(static_cast<std::size_t>(half));
  // YaRN (transformers' _compute_yarn_parameters): pairs that turn more than beta_fast times over the
  // original context keep their frequency, those turning fewer than beta_slow times are interpolated (divided
  // by the factor), and a linear ramp over the pair index [low, high] blends the two in between.
  double ramp_low = 0.0;
  double ramp_high = 0.0;
  if (scaling.type == RopeScaling::Type::yarn) {
    const auto correction_dim = [&](double rotations) {
      return static_cast<double>(dim) *
             std::log(scaling.original_max_position_embeddings / (rotations * 2.0 * std::numbers::pi)) /
             (2.0 * std::log(theta));
    };
    ramp_low = correction_dim(scaling.beta_fast);
    ramp_high = correction_dim(scaling.beta_slow);
    if (scaling.truncate) {
      ramp_low = std::floor(ramp_low);
      ramp_high = std::ceil(ramp_high);
    }
    ramp_low = std::max(ramp_low, 0.0);
    ramp_high = std::min(ramp_high, static_cast<double>(dim - 1));
    if (ramp_low == ramp_high) ramp_high += 0.001;  // as transformers: no division by zero
  }
  for (std::int64_t i = 0; i < half; ++i) {
    // Same float32 exponent as transformers: arange(0, dim, 2).float() / dim.
    const float exponent = static_cast<float>(2 * i) / static_cast<float>(dim);
    double f = 1.0 / std::pow(theta, static_cast<double>(exponent));
    switch (scaling.type) {
      case RopeScaling::Type::none:
        break;
      case RopeScaling::Type::linear:
        f /= scaling.factor;
        break;
      case RopeScaling::Type::llama3: {
        const double low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor;
        const double high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor;
        const double wavelen = 2.0 * std::numbers::pi / f;
        if (wavelen > low_wavelen) {
          f /= scaling.factor;
        } else if (wavelen >= high_wavelen) {
          const double smooth =
              (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) /
              (scaling.high_freq_factor - scaling.low_freq_factor);
          f = (1.0 - smooth) * f / scaling.factor + smooth * f;
        }
        break;
      }
      case RopeScaling::Type::yarn: {
        const double ramp =
            std::clamp((static_cast<double>(i) - ramp_low) / (ramp_high - ramp_low), 0.0, 1.0);
        f = f / scaling.factor * ramp + f * (1.0 - ramp);
        break;
      }
    }
    inv_freq_[static_cast<std::size_t>(i)] = static_cast<float>(f);
  }
}

void Rope::tables(std::span<const std::int32_t> positions, std::vector<float>& cos,
                  std::vector<float>& sin) const {
  const std::size_t half = inv_freq_.size();
  cos.resize(positions.size() * half);
  sin.resize(positions.size() * half);
  for (std::size_t t = 0; t < positions.size(); ++t) {
    const auto p = static_cast<float>(positions[t]);
    for (std::size_t i = 0; i < half; ++i) {
      const float angle = p * inv_freq_[i];  // float32 product, as transformers computes it
      cos[t * half + i] = std::cos(angle) * attention_factor_;
      sin[t * half + i] = std::sin(angle) * attention_factor_;
    }
  }
}

}  // namespace capserve::runtime
