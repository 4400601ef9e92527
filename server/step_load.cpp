#include "server/step_load.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "server/batch_selector.h"

namespace capserve::server {
namespace {

double cosine(std::span<const float> a, std::span<const std::int64_t> b) {
  double ab = 0, aa = 0, bb = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    ab += static_cast<double>(a[i]) * static_cast<double>(b[i]);
    aa += static_cast<double>(a[i]) * static_cast<double>(a[i]);
    bb += static_cast<double>(b[i]) * static_cast<double>(b[i]);
  }
  return aa > 0 && bb > 0 ? ab / std::sqrt(aa * bb) : std::numeric_limits<double>::quiet_NaN();
}

// The mean over layers of each layer's per-rank max/mean: an MoE layer waits for its most loaded rank.
double layered_imbalance(std::span<const double> load, std::size_t ranks) {
  double sum = 0;
  const std::size_t layers = load.size() / ranks;
  for (std::size_t l = 0; l < layers; ++l) sum += imbalance(load.subspan(l * ranks, ranks));
  return layers > 0 ? sum / static_cast<double>(layers) : 1.0;
}

}  // namespace

StepLoad::StepLoad(int ranks, std::int64_t layers, ServerMetrics* metrics)
    : ranks_(static_cast<std::size_t>(ranks)),
      layers_(static_cast<std::size_t>(layers)),
      metrics_(metrics),
      decodes_(ranks_ * layers_, 0.0F),
      predicted_(ranks_ * layers_, 0.0F),
      realized_(ranks_ * layers_, 0) {}

void StepLoad::begin_step() {
  std::copy(decodes_.begin(), decodes_.end(), predicted_.begin());
}

void StepLoad::add(std::span<const float> prompt_load, double share) {
  for (std::size_t r = 0; r < predicted_.size() && r < prompt_load.size(); ++r)
    predicted_[r] += static_cast<float>(static_cast<double>(prompt_load[r]) * share);
}

void StepLoad::end_step(const parallel::MoeStepStats& stats, std::int64_t step_tokens,
                        std::int64_t next_decodes) {
  std::fill(realized_.begin(), realized_.end(), 0);
  const std::size_t layers = std::min(layers_, stats.layers.size());
  for (std::size_t l = 0; l < layers; ++l) {
    for (std::size_t r = 0; r < ranks_ && r < stats.layers[l].rank_routed_load.size(); ++r)
      realized_[l * ranks_ + r] = stats.layers[l].rank_routed_load[r];
  }
  const double similarity = cosine(predicted_, realized_);
  // An all-zero side (no predictor, or a step without routed tokens) has no direction to compare.
  if (metrics_ != nullptr && step_tokens > 0 && !std::isnan(similarity)) {
    metrics_->set_predictor_cosine(similarity);
    const std::vector<double> predicted(predicted_.begin(), predicted_.end());
    const std::vector<double> real(realized_.begin(), realized_.end());
    metrics_->set_selector_imbalance(layered_imbalance(predicted, ranks_), layered_imbalance(real, ranks_));
  }
  const double per_token = step_tokens > 0 ? 1.0 / static_cast<double>(step_tokens) : 0.0;
  for (std::size_t r = 0; r < realized_.size(); ++r)
    decodes_[r] =
        static_cast<float>(static_cast<double>(realized_[r]) * per_token * static_cast<double>(next_decodes));
}

}  // namespace capserve::server
