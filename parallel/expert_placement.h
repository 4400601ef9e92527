#pragma once
// Which rank hosts which routed expert, per MoE layer. Every rank computes the same placement from the same
// inputs, so no placement is ever sent over the wire. The placement is over slots: a slot is one copy of an
// expert's weights on one rank. Without replication slot s holds expert s; with EPLB-style replication
// (`replicated`) the hottest experts have several slots on distinct ranks, an expert's slots are
// consecutive, and its tokens are split over them (kernels/moe/dispatch_logic.h, AssignCopies). Slot counts
// need not divide the rank count: the first S % R ranks host one slot more.
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
  // EPLB: per layer, `redundant` extra slots for the experts with the highest load per copy (at most one
  // copy per rank; replicate_hot_experts), then the slots placed as `balanced` places experts, with no two
  // copies of one expert on one rank (the round-robin start always allows that). A layer without loads
  // spreads its extra slots evenly over the experts. Every layer has num_experts + redundant slots.
  static ExpertPlacement replicated(std::span<const std::vector<double>> loads, std::int64_t num_experts,
                                    int num_ranks, std::int64_t redundant);
  // `balanced` (`replicated` when redundant > 0) over the per-layer routed loads in a statistics file written
  // by `--moe-stats` ({"layers": [{"layer": i, "routed_load": [...]}, ...]}); std::runtime_error naming the
  // file and the fault.
  static ExpertPlacement from_stats_file(const std::filesystem::path& path, std::int64_t num_layers,
                                         std::int64_t num_experts, int num_ranks, std::int64_t redundant = 0);
  // "contiguous", "round-robin", or a path to a statistics file; redundant slots need the file (they are
  // chosen from measured loads).
  static ExpertPlacement from_spec(const std::string& spec, std::int64_t num_layers, std::int64_t num_experts,
                                   int num_ranks, std::int64_t redundant = 0);

  [[nodiscard]] int num_ranks() const { return num_ranks_; }
  [[nodiscard]] std::int64_t num_layers() const { return num_layers_; }
  [[nodiscard]] std::int64_t num_experts() const { return num_experts_; }
  // Slots per layer: num_experts plus the redundant copies.
  [[nodiscard]] std::int64_t num_slots() const { return num_slots_; }
  [[nodiscard]] bool replicated() const { return num_slots_ > num_experts_; }
  [[nodiscard]] const std::string& kind() const { return kind_; }

  // owners(layer)[s] = the rank hosting slot s.
  [[nodiscard]] std::span<const std::int32_t> owners(std::int64_t layer) const;
  // The slots `rank` hosts on `layer`, ascending; a slot's position in this list is its local index (the
  // order of the rank's expert weights).
  [[nodiscard]] std::span<const std::int32_t> local_experts(std::int64_t layer, int rank) const;
  // local_index(layer)[s] = s's position in its owner's local_experts list.
  [[nodiscard]] std::span<const std::int32_t> local_index(std::int64_t layer) const;
  // slot_experts(layer)[s] = the expert slot s holds (ascending in s).
  [[nodiscard]] std::span<const std::int32_t> slot_experts(std::int64_t layer) const;
  // first_slots(layer)[e] = expert e's first slot, num_experts + 1 entries: e's copies are
  // [first_slots[e], first_slots[e + 1]).
  [[nodiscard]] std::span<const std::int32_t> first_slots(std::int64_t layer) const;
  // The experts `rank` holds weights for on `layer`, ascending (its slots' experts).
  [[nodiscard]] std::vector<std::int32_t> hosted_experts(std::int64_t layer, int rank) const;
  // Per rank, the load `expert_loads` (num_experts entries) puts on `layer`, each expert's load split evenly
  // over its copies; add_rank_loads adds into rank_loads (num_ranks entries) without allocating.
  [[nodiscard]] std::vector<double> rank_loads(std::int64_t layer,
                                               std::span<const double> expert_loads) const;
  void add_rank_loads(std::int64_t layer, std::span<const double> expert_loads,
                      std::span<double> rank_loads) const;

 private:
  ExpertPlacement(std::string kind, std::int64_t num_layers, std::int64_t num_experts, int num_ranks,
                  std::int64_t num_slots);
  // Sets `layer`'s slot owners (and, replicated, which expert each slot holds) and derives the rest.
  void set_layer(std::int64_t layer, std::span<const std::int32_t> owner,
                 std::span<const std::int32_t> slot_expert);

  std::string kind_;
  std::int64_t num_layers_ = 0;
  std::int64_t num_experts_ = 0;
  int num_ranks_ = 1;
  std::int64_t num_slots_ = 0;
  std::vector<std::int32_t> owner_;        // [layers, slots]
  std::vector<std::int32_t> local_index_;  // [layers, slots]
  std::vector<std::int32_t> by_rank_;      // [layers, slots]: slots grouped by rank, ascending within
  std::vector<std::int64_t> rank_start_;   // [layers, ranks + 1]: offsets into by_rank_ per layer
  std::vector<std::int32_t> slot_expert_;  // [layers, slots]
  std::vector<std::int32_t> first_slot_;   // [layers, experts + 1]
};

}  // namespace capserve::parallel
