// CpuBackend::sample: next-token sampling in the order transformers applies the controls (temperature,
// top-k, top-p), one independent draw per row.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>

#include "kernels/cpu/cpu_backend.h"

namespace capserve::kernels::cpu {
namespace {

// splitmix64's finaliser: nearby (seed, step) pairs give unrelated generator states.
std::uint64_t mix64(std::uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

}  // namespace

void CpuBackend::sample(const Tensor& logits, std::span<const SampleControls> controls,
                        const Tensor& tokens) {
  const std::int64_t rows = logits.dims() == 0 ? 0 : logits.dim(0);
  if (static_cast<std::int64_t>(controls.size()) != rows || tokens.numel() != rows) {
    throw std::invalid_argument("sample: logits " + logits.shape_text() + ", " +
                                std::to_string(controls.size()) + " controls, tokens " + tokens.shape_text());
  }
  const auto vocab = static_cast<std::int32_t>(logits.row_numel());
  const std::span<const float> all = logits.host_span<const float>();
  const std::span<std::int32_t> out = tokens.host_span<std::int32_t>();
  for (std::int64_t r = 0; r < rows; ++r) {
    const SampleControls& c = controls[static_cast<std::size_t>(r)];
    const std::span<const float> row =
        all.subspan(static_cast<std::size_t>(r * vocab), static_cast<std::size_t>(vocab));
    std::int32_t& token = out[static_cast<std::size_t>(r)];
    std::int32_t best = 0;
    std::int32_t bad = -1;
    for (std::int32_t i = 0; i < vocab && bad < 0; ++i) {
      const float l = row[static_cast<std::size_t>(i)];
      if (!std::isfinite(l)) bad = i;
      if (l > row[static_cast<std::size_t>(best)]) best = i;
    }
    if (bad >= 0) {
      token = non_finite_token(bad);
      continue;
    }
    const float inv_t = 1.0F / c.temperature;
    // A temperature whose inverse overflows is the limit T -> 0: greedy.
    if (c.temperature == 0.0F || !std::isfinite(inv_t) || vocab == 0) {
      token = best;
      continue;
    }
    sample_order_.resize(static_cast<std::size_t>(vocab));
    std::iota(sample_order_.begin(), sample_order_.end(), 0);
    // Descending by logit, ties by id, so the candidate order never depends on the sort's stability.
    const auto better = [&](std::int32_t a, std::int32_t b) {
      const float la = row[static_cast<std::size_t>(a)];
      const float lb = row[static_cast<std::size_t>(b)];
      return la > lb || (la == lb && a < b);
    };
    std::int32_t keep = vocab;
    if (c.top_k > 0 && c.top_k < vocab) {
      keep = c.top_k;
      std::nth_element(sample_order_.begin(), sample_order_.begin() + keep, sample_order_.end(), better);
    }
    std::sort(sample_order_.begin(), sample_order_.begin() + keep, better);

    sample_probs_.resize(static_cast<std::size_t>(keep));
    // (l - max) / T, not l / T - max / T: the difference is exact for the best token (0, probability weight
    // 1), however small T is, where the two rounded products could differ by more than exp can take.
    const float top = row[static_cast<std::size_t>(sample_order_[0])];
    double sum = 0.0;
    for (std::int32_t i = 0; i < keep; ++i) {
      const auto p = static_cast<float>(std::exp(
          (row[static_cast<std::size_t>(sample_order_[static_cast<std::size_t>(i)])] - top) * inv_t));
      sample_probs_[static_cast<std::size_t>(i)] = p;
      sum += p;
    }
    if (c.top_p < 1.0F) {
      // Smallest prefix whose mass reaches top_p (always at least one token).
      double mass = 0.0;
      std::int32_t cut = 0;
      while (cut < keep) {
        mass += sample_probs_[static_cast<std::size_t>(cut)] / sum;
        ++cut;
        if (mass >= c.top_p) break;
      }
      keep = cut;
      sum = 0.0;
      for (std::int32_t i = 0; i < keep; ++i) sum += sample_probs_[static_cast<std::size_t>(i)];
    }
    std::mt19937_64 rng(mix64(c.seed ^ mix64(c.step + 0x9E3779B97F4A7C15ULL)));
    const double u = std::uniform_real_distribution<double>(0.0, sum)(rng);
    double acc = 0.0;
    token = sample_order_[static_cast<std::size_t>(keep - 1)];
    for (std::int32_t i = 0; i < keep; ++i) {
      acc += sample_probs_[static_cast<std::size_t>(i)];
      if (u < acc) {
        token = sample_order_[static_cast<std::size_t>(i)];
        break;
      }
    }
  }
}

}  // namespace capserve::kernels::cpu
