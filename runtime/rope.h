#pragma once
// Rotary position embedding frequencies (rope_theta and the scaling types these models use), and the per-step
// cos/sin tables for the positions of a batch, computed once per step and shared by every layer.
#include <cstdint>
#include <span>
#include <vector>

#include "kernels/backend.h"
#include "runtime/model_config.h"

namespace capserve::runtime {

class Rope {
 public:
  // `dim`: the rotated dims of a head.
  Rope(std::int64_t dim, double theta, const RopeScaling& scaling);

  // Fills cos/sin [positions.size(), dim / 2] (grow-only buffers), both multiplied by the scaling's attention
  // factor (YaRN; 1 otherwise), as transformers does. Dynamic scaling: the rows of each sequence of `seqs`
  // whose length (its last new position + 1) exceeds the original maximum turn with the frequencies of that
  // length (computed in `scratch`, grow-only), so a row never depends on the other sequences of the
  // step; the keys cached by earlier steps keep the frequencies they were rotated with, as in transformers.
  // A sequence whose rows are decode rows (`decode_rows`, [rows] or empty: a sampled token and its draft
  // tokens) turns each row with its own length (its position + 1), as the one-token steps of decoding without
  // speculation would.
  void tables(std::span<const std::int32_t> positions, std::span<const kernels::SequenceSlice> seqs,
              std::span<const std::uint8_t> decode_rows, std::vector<float>& cos, std::vector<float>& sin,
              std::vector<float>& scratch) const;

  [[nodiscard]] std::span<const float> inv_freq() const { return inv_freq_; }

  // transformers' _compute_dynamic_ntk_parameters for a forward of `seq_len` > the original maximum, in its
  // float32 arithmetic: base = theta * (factor * seq_len / max - (factor - 1)) ^ (dim / (dim - 2)).
  void dynamic_inv_freq(std::int64_t seq_len, std::span<float> out) const;

 private:
  void fill(std::span<const std::int32_t> positions, std::size_t first, std::size_t count,
            std::span<const float> inv_freq, std::vector<float>& cos, std::vector<float>& sin) const;

  std::int64_t dim_;
  double theta_;
  RopeScaling scaling_;
  std::vector<float> inv_freq_;
  float attention_factor_ = 1.0F;
};

}  // namespace capserve::runtime
