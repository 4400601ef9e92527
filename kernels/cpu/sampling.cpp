// CpuBackend::sample: each row's logits adjusted (kernels/sampling.h: bitmask, banned ids, logit_bias,
// penalties), then temperature, min_p, top-k, top-p and one independent draw per row.
#include <algorithm>
#include <cmath>
#include <limits>
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

constexpr float kMinusInf = -std::numeric_limits<float>::infinity();

template <typename T>
std::span<const T> range_of(std::span<const T> all, IndexRange r) {
  return all.subspan(static_cast<std::size_t>(r.begin), static_cast<std::size_t>(r.end - r.begin));
}

}  // namespace

void CpuBackend::adjust_row(std::span<const float> raw, const SampleInputs& in, std::size_t r,
                            std::span<float> out) {
  const SampleControls& c = in.controls[r];
  const auto vocab = static_cast<std::int64_t>(raw.size());
  std::copy(raw.begin(), raw.end(), out.begin());
  if (!in.allowed.empty()) {
    const std::int32_t* mask = in.allowed.data() + static_cast<std::int64_t>(r) * allowed_words(vocab);
    for (std::int64_t i = 0; i < vocab; ++i) {
      if (!allowed_bit(mask, i)) out[static_cast<std::size_t>(i)] = kMinusInf;
    }
  }
  for (const std::int32_t id : range_of(in.banned, c.banned)) {
    if (id >= 0 && id < vocab) out[static_cast<std::size_t>(id)] = kMinusInf;
  }
  for (const LogitBias& b : range_of(in.biases, c.bias)) {
    if (b.token >= 0 && b.token < vocab) out[static_cast<std::size_t>(b.token)] += b.bias;
  }
  if (!c.penalized()) return;
  // counts_ is all zero between calls: only the history's ids are set here and cleared below.
  constexpr std::int32_t kInPrompt = 1 << 30;
  constexpr std::int32_t kDone = 1 << 29;
  constexpr std::int32_t kCount = kDone - 1;
  counts_.resize(static_cast<std::size_t>(vocab));
  const std::span<const std::int32_t> history = range_of(in.history, c.history);
  const auto prompt =
      static_cast<std::size_t>(std::min<std::int64_t>(c.prompt_tokens, c.history.end - c.history.begin));
  for (std::size_t i = 0; i < history.size(); ++i) {
    const std::int32_t id = history[i];
    if (id < 0 || id >= vocab) continue;
    std::int32_t& n = counts_[static_cast<std::size_t>(id)];
    n = i < prompt ? (n | kInPrompt) : n + 1;
  }
  for (const std::int32_t id : history) {
    if (id < 0 || id >= vocab) continue;
    std::int32_t& n = counts_[static_cast<std::size_t>(id)];
    if ((n & kDone) != 0) continue;
    float& l = out[static_cast<std::size_t>(id)];
    l = penalize(l, n & kCount, (n & kInPrompt) != 0, c);
    n |= kDone;
  }
  for (const std::int32_t id : history) {
    if (id >= 0 && id < vocab) counts_[static_cast<std::size_t>(id)] = 0;
  }
}

void CpuBackend::adjust_logits(const Tensor& logits, const SampleInputs& in, const Tensor& adjusted) {
  const std::int64_t rows = logits.dims() == 0 ? 0 : logits.dim(0);
  const std::int64_t vocab = logits.row_numel();
  if (static_cast<std::int64_t>(in.controls.size()) != rows || adjusted.numel() != logits.numel() ||
      (!in.allowed.empty() && static_cast<std::int64_t>(in.allowed.size()) != rows * allowed_words(vocab)))
    throw std::invalid_argument("adjust_logits: logits " + logits.shape_text() + ", " +
                                std::to_string(in.controls.size()) + " controls, " +
                                std::to_string(in.allowed.size()) + " bitmask words, adjusted " +
                                adjusted.shape_text());
  const std::span<const float> all = logits.host_span<const float>();
  const std::span<float> out = adjusted.host_span<float>();
  for (std::int64_t r = 0; r < rows; ++r) {
    check_sample_ranges(in.controls[static_cast<std::size_t>(r)], in);
    const auto at = static_cast<std::size_t>(r * vocab);
    adjust_row(all.subspan(at, static_cast<std::size_t>(vocab)), in, static_cast<std::size_t>(r),
               out.subspan(at, static_cast<std::size_t>(vocab)));
  }
}

void CpuBackend::sample(const Tensor& logits, const SampleInputs& in, const Tensor& tokens) {
  const std::int64_t rows = logits.dims() == 0 ? 0 : logits.dim(0);
  if (static_cast<std::int64_t>(in.controls.size()) != rows || tokens.numel() != rows) {
    throw std::invalid_argument("sample: logits " + logits.shape_text() + ", " +
                                std::to_string(in.controls.size()) + " controls, tokens " +
                                tokens.shape_text());
  }
  const auto vocab = static_cast<std::int32_t>(logits.row_numel());
  if (!in.allowed.empty() && static_cast<std::int64_t>(in.allowed.size()) != rows * allowed_words(vocab))
    throw std::invalid_argument("sample: an allowed-token bitmask of " + std::to_string(in.allowed.size()) +
                                " words for " + std::to_string(rows) + " rows of vocabulary " +
                                std::to_string(vocab));
  const std::span<const float> all = logits.host_span<const float>();
  const std::span<std::int32_t> out = tokens.host_span<std::int32_t>();
  adjusted_.resize(static_cast<std::size_t>(vocab));
  for (std::int64_t r = 0; r < rows; ++r) {
    const SampleControls& c = in.controls[static_cast<std::size_t>(r)];
    check_sample_ranges(c, in);
    const std::span<const float> raw =
        all.subspan(static_cast<std::size_t>(r * vocab), static_cast<std::size_t>(vocab));
    std::int32_t& token = out[static_cast<std::size_t>(r)];
    const auto bad = std::find_if(raw.begin(), raw.end(), [](float l) { return !std::isfinite(l); });
    if (bad != raw.end()) {
      token = non_finite_token(static_cast<std::int32_t>(bad - raw.begin()));
      continue;
    }
    const std::span<float> row(adjusted_);
    adjust_row(raw, in, static_cast<std::size_t>(r), row);
    const auto best = static_cast<std::int32_t>(std::max_element(row.begin(), row.end()) - row.begin());
    if (vocab == 0 || row[static_cast<std::size_t>(best)] == kMinusInf) {
      token = kNoAllowedToken;
      continue;
    }
    const float inv_t = 1.0F / c.temperature;
    // A temperature whose inverse overflows is the limit T -> 0: greedy.
    if (c.temperature == 0.0F || !std::isfinite(inv_t)) {
      token = best;
      continue;
    }
    // (l - max) / T, not l / T - max / T: the difference is exact for the best token (0, probability weight
    // 1), however small T is, where the two rounded products could differ by more than exp can take.
    const float top = row[static_cast<std::size_t>(best)];
    const auto weight = [&](std::int32_t id) {
      return static_cast<float>(std::exp((row[static_cast<std::size_t>(id)] - top) * inv_t));
    };
    // Candidates: the allowed tokens min_p keeps (weight relative to the best one's, which is 1; the best one
    // always).
    sample_order_.clear();
    for (std::int32_t i = 0; i < vocab; ++i) {
      if (i == best ||
          (row[static_cast<std::size_t>(i)] != kMinusInf && (c.min_p <= 0.0F || weight(i) >= c.min_p)))
        sample_order_.push_back(i);
    }
    // Descending by logit, ties by id, so the candidate order never depends on the sort's stability.
    const auto better = [&](std::int32_t a, std::int32_t b) {
      const float la = row[static_cast<std::size_t>(a)];
      const float lb = row[static_cast<std::size_t>(b)];
      return la > lb || (la == lb && a < b);
    };
    auto keep = static_cast<std::int32_t>(sample_order_.size());
    if (c.top_k > 0 && c.top_k < keep) {
      keep = c.top_k;
      std::nth_element(sample_order_.begin(), sample_order_.begin() + keep, sample_order_.end(), better);
    }
    std::sort(sample_order_.begin(), sample_order_.begin() + keep, better);

    sample_probs_.resize(static_cast<std::size_t>(keep));
    double sum = 0.0;
    for (std::int32_t i = 0; i < keep; ++i) {
      const float p = weight(sample_order_[static_cast<std::size_t>(i)]);
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
