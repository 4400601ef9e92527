#pragma once
// The load predictor the server runs (CAPS batch selection, server/README.md): the engine's router dry run
// (Engine::router_dry_run: embedding, RMSNorm and router of the MoE layers, no attention, no experts) counts
// each expert's assignments per layer; a learned map (load_map.h), when the model has one, turns those counts
// into every MoE layer's expected load; the expert placement folds each layer's loads into per-rank loads.
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "parallel/expert_placement.h"
#include "runtime/engine.h"
#include "runtime/load_map.h"
#include "runtime/load_predictor.h"

namespace capserve::runtime {

class RouterLoadPredictor final : public LoadPredictor {
 public:
  // Without a map: the dry run's counts of the first `layers` MoE layers (all of them when the model has
  // fewer). With `map` (its shape must be the model's; std::invalid_argument otherwise): every MoE layer,
  // `layers` unused. `engine` and `placement` (over the model's layers; its ranks are rank_load's columns)
  // must outlive the predictor.
  RouterLoadPredictor(Engine& engine, const parallel::ExpertPlacement& placement, std::int64_t layers,
                      std::optional<LoadMap> map = std::nullopt);

  // Not thread-safe with the engine's steps (the dry run shares its backend); allocates nothing once the
  // engine's dry-run buffers have grown to the longest prompt.
  void predict(std::span<const std::int32_t> prompt, std::span<float> rank_load) override;
  [[nodiscard]] std::int64_t layers() const override { return layers_; }
  [[nodiscard]] bool learned() const { return map_.has_value(); }

 private:
  Engine& engine_;
  const parallel::ExpertPlacement& placement_;
  std::optional<LoadMap> map_;
  std::int64_t layers_;
  std::int64_t experts_;
  std::vector<std::int64_t> counts_;  // [layers, experts], reused by every call
  std::vector<double> per_token_;     // the map's input and
  std::vector<double> mapped_;        // output, [layers, experts]
  std::vector<double> expert_load_;   // [experts] and
  std::vector<double> layer_load_;    // [ranks]: one layer's prediction, reused by every call
};

// The shape a load map of `model` must have.
LoadMapShape load_map_shape(const Model& model);

}  // namespace capserve::runtime
