#pragma once
// Which rank hosts which routed expert, per MoE layer. Every rank computes the same placement from the same
// inputs, so no placement is ever sent over the wire. Expert counts need not divide the rank count: the
// first E % R ranks host one expert more.
#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <vector>

namespace capserve::parallel {

class ExpertPlacement {
 public:
  // Rank r hosts a contiguous id range, the same on every layer.
  static ExpertPlacement contiguous(std::int64_t num_layers, std::int64_t num_experts, int num_ranks);
  // Expert e lives on rank e % R, the same on every layer.
  static ExpertPlacement round_robin(std::int64_t num_layers, std::int64_t num_experts, int num_ranks);
  // Per layer, experts sorted by measured load (heaviest first, ties by id) go one by one to the rank with
  // the least load so far among those still below their expert quota (the contiguous counts), ties to the
  // lower rank; then swaps between the most loaded rank and the others lower its load while they can. The
  // contiguous and round-robin placements, refined by the same swaps, are kept instead when their most
  // loaded rank is strictly lighter, so the result is never worse than either: per-rank loads as even as
  // greedy plus local search can make them, per-rank memory as even as the counts allow.
  // loads[layer] is empty (layer without routed experts: contiguous) or has num_experts entries.
  static ExpertPlacement balanced(std::span<const std::vector<double>> loads, std::int64_t num_experts,
                                  int num_ranks);
  // `balanced` over the per-layer routed loads in a statistics file written by `--moe-stats`
  // ({"layers": [{"layer": i, "routed_load": [...]}, ...]}); std::runtime_error naming the file and the
  // fault.
  static ExpertPlacement from_stats_file(const std::filesystem::path& path, std::int64_t num_layers,
                                         std::int64_t num_experts, int num_ranks);
  // "contiguous", "round-robin", or a path to a statistics file.
  static ExpertPlacement from_spec(const std::string& spec, std::int64_t num_layers, std::int64_t num_experts,
                                   int num_ranks);

  [[nodiscard]] int num_ranks() const { return num_ranks_; }
  [[nodiscard]] std::int64_t num_layers() const { return num_layers_; }
  [[nodiscard]] std::int64_t num_experts() const { return num_experts_; }
  [[nodiscard]] const std::string& kind() const { return kind_; }

  // owners(layer)[e] = the rank hosting expert e.
  [[nodiscard]] std::span<const std::int32_t> owners(std::int64_t layer) const;
  // The experts `rank` hosts on `layer`, ascending; an expert's position in this list is its local index.
  [[nodiscard]] std::span<const std::int32_t> local_experts(std::int64_t layer, int rank) const;
  // local_index(layer)[e] = e's position in its owner's local_experts list.
  [[nodiscard]] std::span<const std::int32_t> local_index(std::int64_t layer) const;
  // Per rank, the sum of expert_loads (num_experts entries) over the experts it hosts on `layer`.
  [[nodiscard]] std::vector<double> rank_loads(std::int64_t layer,
                                               const std::vector<double>& expert_loads) const;

 private:
  ExpertPlacement(std::string kind, std::int64_t num_layers, std::int64_t num_experts, int num_ranks);
  void finish_layer(std::int64_t layer);

  std::string kind_;
  std::int64_t num_layers_ = 0;
  std::int64_t num_experts_ = 0;
  int num_ranks_ = 1;
  std::vector<std::int32_t> owner_;        // [layers, experts]
  std::vector<std::int32_t> local_index_;  // [layers, experts]
  std::vector<std::int32_t> by_rank_;      // [layers, experts]: experts grouped by rank, ascending within
  std::vector<std::int64_t> rank_start_;   // [layers, ranks + 1]: offsets into by_rank_ per layer
};

}  // namespace capserve::parallel
