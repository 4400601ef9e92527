#include "runtime/rope.h"

#include <algorithm>
#include <cmath>
#include <numbers>

namespace capserve::runtime {

Rope::Rope(std::int64_t dim, double theta, const RopeScaling& scaling)
    : dim_(dim),
      theta_(theta),
      scaling_(scaling),
      attention_factor_(static_cast<float>(scaling.attention_factor)) {
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
      case RopeScaling::Type::dynamic:  // up to the original maximum (tables() for longer sequences)
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

void Rope::dynamic_inv_freq(std::int64_t seq_len, std::span<float> out) const {
  // seq_len is an int64 tensor there and factor a Python float, so every step runs in float32, except the
  // power to the Python float dim / (dim - 2), which torch computes in double and rounds to float32 (this
  // order gives its values bit for bit).
  const auto factor = static_cast<float>(scaling_.factor);
  const float scale =
      factor * static_cast<float>(seq_len) / static_cast<float>(scaling_.original_max_position_embeddings) -
      static_cast<float>(scaling_.factor - 1.0);
  const auto stretch = static_cast<float>(
      std::pow(static_cast<double>(scale), static_cast<double>(dim_) / static_cast<double>(dim_ - 2)));
  const float base = static_cast<float>(theta_) * stretch;
  for (std::size_t i = 0; i < out.size(); ++i) {
    const float exponent = static_cast<float>(2 * i) / static_cast<float>(dim_);
    out[i] = 1.0F / std::pow(base, exponent);
  }
}

void Rope::fill(std::span<const std::int32_t> positions, std::size_t first, std::size_t count,
                std::span<const float> inv_freq, std::vector<float>& cos, std::vector<float>& sin) const {
  const std::size_t half = inv_freq.size();
  for (std::size_t t = first; t < first + count; ++t) {
    const auto p = static_cast<float>(positions[t]);
    for (std::size_t i = 0; i < half; ++i) {
      const float angle = p * inv_freq[i];  // float32 product, as transformers computes it
      cos[t * half + i] = std::cos(angle) * attention_factor_;
      sin[t * half + i] = std::sin(angle) * attention_factor_;
    }
  }
}

void Rope::tables(std::span<const std::int32_t> positions, std::span<const kernels::SequenceSlice> seqs,
                  std::span<const std::uint8_t> decode_rows, std::vector<float>& cos, std::vector<float>& sin,
                  std::vector<float>& scratch) const {
  const std::size_t half = inv_freq_.size();
  cos.resize(positions.size() * half);
  sin.resize(positions.size() * half);
  fill(positions, 0, positions.size(), inv_freq_, cos, sin);
  if (scaling_.type != RopeScaling::Type::dynamic) return;
  const auto dynamic = [&](std::size_t first, std::size_t count, std::int64_t seq_len) {
    if (static_cast<double>(seq_len) <= scaling_.original_max_position_embeddings) return;
    scratch.resize(half);
    dynamic_inv_freq(seq_len, scratch);
    fill(positions, first, count, scratch, cos, sin);
  };
  for (const kernels::SequenceSlice& seq : seqs) {
    if (seq.num_tokens == 0) continue;
    const auto first = static_cast<std::size_t>(seq.first_row);
    const auto count = static_cast<std::size_t>(seq.num_tokens);
    if (!decode_rows.empty() && decode_rows[first] != 0) {
      // Decode tokens (a sampled token and its drafts): each row as the one-token step that would have run it
      // without speculation, so verifying drafts never changes a token.
      for (std::size_t r = first; r < first + count; ++r) dynamic(r, 1, positions[r] + 1);
    } else {
      dynamic(first, count, positions[first + count - 1] + 1);
    }
  }
}

}  // namespace capserve::runtime
