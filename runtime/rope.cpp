#include "runtime/rope.h"

#include <cmath>
#include <numbers>

namespace capserve::runtime {

Rope::Rope(std::int64_t head_dim, double theta, const RopeScaling& scaling) {
  const std::int64_t half = head_dim / 2;
  inv_freq_.resize(static_cast<std::size_t>(half));
  for (std::int64_t i = 0; i < half; ++i) {
    // Same float32 exponent as transformers: arange(0, dim, 2).float() / dim.
    const float exponent = static_cast<float>(2 * i) / static_cast<float>(head_dim);
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
      cos[t * half + i] = std::cos(angle);
      sin[t * half + i] = std::sin(angle);
    }
  }
}

}  // namespace capserve::runtime
