#include "runtime/router_load_predictor.h"

#include <algorithm>
#include <stdexcept>
#include <string>
#include <utility>

namespace capserve::runtime {

LoadMapShape load_map_shape(const Model& model) {
  return {model.config().architecture, static_cast<std::int64_t>(model.moe_layers().size()),
          model.config().num_experts, model.config().top_k};
}

RouterLoadPredictor::RouterLoadPredictor(Engine& engine, const parallel::ExpertPlacement& placement,
                                         std::int64_t layers, std::optional<LoadMap> map)
    : engine_(engine),
      placement_(placement),
      map_(std::move(map)),
      layers_(std::min<std::int64_t>(map_ ? map_->shape().moe_layers : layers,
                                     static_cast<std::int64_t>(engine.model().moe_layers().size()))),
      experts_(engine.model().config().num_experts),
      counts_(static_cast<std::size_t>(layers_ * experts_), 0),
      per_token_(map_ ? counts_.size() : 0),
      mapped_(per_token_.size()),
      expert_load_(static_cast<std::size_t>(experts_)),
      layer_load_(static_cast<std::size_t>(placement.num_ranks())) {
  if (placement.num_experts() != experts_)
    throw std::invalid_argument("RouterLoadPredictor: the placement has " +
                                std::to_string(placement.num_experts()) + " experts, the model " +
                                std::to_string(experts_));
  if (map_ && !(map_->shape() == load_map_shape(engine.model())))
    throw std::invalid_argument(
        "RouterLoadPredictor: the load map was fitted for a " + map_->shape().architecture + " model of " +
        std::to_string(map_->shape().moe_layers) + " MoE layers x " + std::to_string(map_->shape().experts) +
        " experts top-" + std::to_string(map_->shape().top_k) + ", not this one");
}

void RouterLoadPredictor::predict(std::span<const std::int32_t> prompt, std::span<float> rank_load) {
  const auto ranks = static_cast<std::size_t>(placement_.num_ranks());
  if (rank_load.size() != static_cast<std::size_t>(layers_) * ranks)
    throw std::invalid_argument("RouterLoadPredictor::predict: " + std::to_string(rank_load.size()) +
                                " entries for " + std::to_string(layers_) + " layers x " +
                                std::to_string(ranks) + " ranks");
  // The dry run adds into its counts.
  std::fill(counts_.begin(), counts_.end(), 0);
  engine_.router_dry_run(prompt, layers_, counts_);
  const auto tokens = static_cast<double>(prompt.size());
  if (map_ && tokens > 0) {
    for (std::size_t i = 0; i < counts_.size(); ++i) per_token_[i] = static_cast<double>(counts_[i]) / tokens;
    map_->predict(per_token_, mapped_);
  }
  const std::span<const std::int64_t> moe_layers = engine_.model().moe_layers();
  for (std::int64_t l = 0; l < layers_; ++l) {
    for (std::int64_t e = 0; e < experts_; ++e) {
      const auto i = static_cast<std::size_t>(l * experts_ + e);
      // A map's prediction can dip below zero for an expert it expects idle: no load, not a negative one.
      expert_load_[static_cast<std::size_t>(e)] =
          map_ ? std::max(0.0, mapped_[i] * tokens) : static_cast<double>(counts_[i]);
    }
    // On the ranks hosting each expert, split evenly over its copies when replicated.
    std::fill(layer_load_.begin(), layer_load_.end(), 0.0);
    placement_.add_rank_loads(moe_layers[static_cast<std::size_t>(l)], expert_load_, layer_load_);
    std::transform(layer_load_.begin(), layer_load_.end(),
                   rank_load.begin() + static_cast<std::ptrdiff_t>(l) * static_cast<std::ptrdiff_t>(ranks),
                   [](double v) { return static_cast<float>(v); });
  }
}

}  // namespace capserve::runtime
