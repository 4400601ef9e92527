#pragma once
// A learned load predictor's map: from a prompt's router dry-run counts per token (every MoE layer, without
// attention: what Engine::router_dry_run gives) to its expected routed load per token of every expert in
// every MoE layer. The dry run sees where the first layer's load goes but barely the deeper layers', where
// the imbalance is (tools/results/predictor_eval.md); a linear map fitted by ridge regression on observed
// routing recovers most of it for a few thousand multiply-adds per prompt. Fitted per checkpoint by
// capserve-eval-predictor --write-map and kept beside the model (capserve_load_map.json).
#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <vector>

namespace capserve::runtime {

// The model shape a map belongs to: it is refused for any other.
struct LoadMapShape {
  std::string architecture;
  std::int64_t moe_layers = 0;
  std::int64_t experts = 0;
  std::int64_t top_k = 0;
  bool operator==(const LoadMapShape&) const = default;
};

class LoadMap {
 public:
  // One observation: a batch's dry-run counts per token ([moe_layers, experts]) and its real routed load per
  // token ([moe_layers, experts]).
  struct Sample {
    std::vector<double> dry_run;
    std::vector<double> routed;
  };

  // Ridge regression y = [x, 1] W over `samples` (at least one), penalty `ridge` per sample on every weight
  // (the intercept's too: it keeps the system definite however few samples there are).
  static LoadMap fit(const LoadMapShape& shape, std::span<const Sample> samples, double ridge);
  // std::runtime_error naming the file and the fault (unreadable, not a map, sizes that disagree).
  static LoadMap read(const std::filesystem::path& path);
  // `provenance` says what it was fitted on, for whoever reads the file.
  void write(const std::filesystem::path& path, const std::string& provenance) const;

  [[nodiscard]] const LoadMapShape& shape() const { return shape_; }
  [[nodiscard]] std::int64_t size() const { return shape_.moe_layers * shape_.experts; }
  // out[moe layer * experts + e] = the expected routed load per token of expert e; dry_run and out have
  // size() entries. Allocates nothing.
  void predict(std::span<const double> dry_run, std::span<double> out) const;

 private:
  LoadMap(LoadMapShape shape, double ridge, std::vector<double> weights);

  LoadMapShape shape_;
  double ridge_ = 0;
  std::vector<double>
      weights_;  // [size() + 1, size()]: row i is input i's weights, the last row the intercept
};

}  // namespace capserve::runtime
