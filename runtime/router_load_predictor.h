#pragma once
// The load predictor the server runs (CAPS batch selection, server/README.md): the engine's router dry run
// (Engine::router_dry_run: embedding, RMSNorm and router of the first MoE layers, no attention, no experts)
// counts each expert's assignments, and the expert placement folds them into per-rank loads.
#include <cstdint>
#include <span>
#include <vector>

#include "parallel/expert_placement.h"
#include "runtime/engine.h"
#include "runtime/load_predictor.h"

namespace capserve::runtime {

class RouterLoadPredictor final : public LoadPredictor {
 public:
  // Covers the first `layers` MoE layers of the engine's model (all of them when it has fewer). `engine` and
  // `placement` (over the model's layers; its ranks are rank_load's entries) must outlive the predictor.
  RouterLoadPredictor(Engine& engine, const parallel::ExpertPlacement& placement, std::int64_t layers);

  // Not thread-safe with the engine's steps (the dry run shares its backend); allocates nothing once the
  // engine's dry-run buffers have grown to the longest prompt.
  void predict(std::span<const std::int32_t> prompt, std::span<float> rank_load) override;
  [[nodiscard]] std::int64_t layers() const override { return layers_; }

 private:
  Engine& engine_;
  const parallel::ExpertPlacement& placement_;
  std::int64_t layers_;
  std::int64_t experts_;
  std::vector<std::int64_t> counts_;  // [layers, experts], reused by every call
};

}  // namespace capserve::runtime
