#pragma once
// Per-layer, per-expert routing counts read from the files the tools meet, whatever wrote them:
//   - our statistics, as `--moe-stats` writes them: {"layers": [{"layer": i, "routed_load": [...], "tokens",
//     "assignments"}, ...]} (one group "all"; top-k = assignments / tokens);
//   - the shared counts files: {model: {"expert_counts": {domain: {layer: [count per expert]}},
//     "expert_counts_top1": ...}} (one group per domain; top-k = sum of counts / sum of top-1 counts, where
//     the file has both);
//   - SGLang's expert-distribution dump (stat mode, as JSON): {"logical_count": [layer][expert]} or
//     [step][layer][expert], summed over the steps (one group "all"; top-k unknown);
//   - a model measurement by tools/measure_default_model.py (tools/results/*_eval.json): {"domains": {domain:
//     {"expert_counts": {layer: [...]}}}, "config": {"num_experts_per_tok": k}} (one group per domain).
#include <cstdint>
#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace capserve::tools {

struct CountsLayer {
  std::int64_t layer = 0;
  std::vector<double> counts;  // one per expert
};

struct CountsGroup {
  std::string name;                 // a domain, or "all"
  std::vector<CountsLayer> layers;  // ascending layer ids, the same in every group
};

struct ExpertCounts {
  std::string format;  // "moe-stats", "counts", "sglang", "model-eval"
  std::int64_t num_experts = 0;
  std::optional<std::int64_t> top_k;  // when the file tells
  std::vector<CountsGroup> groups;
};

// Reads any of the formats above; `model_key` picks the model of a shared counts file (may be empty when the
// file has one model). Throws std::runtime_error naming the file, the fault and the expected shapes.
ExpertCounts read_expert_counts(const std::filesystem::path& path, const std::string& model_key);

// The counts of the named groups (all when `groups` is empty) summed per layer, indexed by layer id up to the
// largest one; layers the file does not have are empty. Throws std::runtime_error for an unknown group.
std::vector<std::vector<double>> summed_layer_counts(const ExpertCounts& counts,
                                                     std::span<const std::string> groups);

}  // namespace capserve::tools
