#include "runtime/router_load_predictor.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace capserve::runtime {

RouterLoadPredictor::RouterLoadPredictor(Engine& engine, const parallel::ExpertPlacement& placement,
                                         std::int64_t layers)
    : engine_(engine),
      placement_(placement),
      layers_(std::min<std::int64_t>(layers, static_cast<std::int64_t>(engine.model().moe_layers().size()))),
      experts_(engine.model().config().num_experts),
      counts_(static_cast<std::size_t>(layers_ * experts_), 0) {
  if (placement.num_experts() != experts_)
    throw std::invalid_argument("RouterLoadPredictor: the placement has " +
                                std::to_string(placement.num_experts()) + " experts, the model " +
                                std::to_string(experts_));
}

void RouterLoadPredictor::predict(std::span<const std::int32_t> prompt, std::span<float> rank_load) {
  std::fill(rank_load.begin(), rank_load.end(), 0.0F);
  // The dry run adds into its counts.
  std::fill(counts_.begin(), counts_.end(), 0);
  engine_.router_dry_run(prompt, layers_, counts_);
  const std::span<const std::int64_t> moe_layers = engine_.model().moe_layers();
  for (std::int64_t l = 0; l < layers_; ++l) {
    const std::span<const std::int32_t> owners = placement_.owners(moe_layers[static_cast<std::size_t>(l)]);
    for (std::int64_t e = 0; e < experts_; ++e)
      rank_load[static_cast<std::size_t>(owners[static_cast<std::size_t>(e)])] +=
          static_cast<float>(counts_[static_cast<std::size_t>(l * experts_ + e)]);
  }
}

}  // namespace capserve::runtime
