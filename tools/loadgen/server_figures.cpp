#include "tools/loadgen/server_figures.h"

#include <algorithm>
#include <vector>

namespace capserve::loadgen {
namespace {

using LabelMatch = std::vector<std::pair<std::string, std::string>>;

std::optional<double> delta(const Scrape& before, const Scrape& after, std::string_view name,
                            const LabelMatch& match = {}) {
  const std::optional<double> a = after.sum(name, match);
  if (!a) return std::nullopt;
  return *a - before.sum(name, match).value_or(0);
}

std::map<std::string, double> delta_by_label(const Scrape& before, const Scrape& after, std::string_view name,
                                             const std::string& label) {
  std::map<std::string, double> out = after.by_label(name, label);
  for (const auto& [k, v] : before.by_label(name, label)) out[k] -= v;
  return out;
}

// Mean of a histogram over the run: delta(_sum) / delta(_count).
std::optional<double> histogram_mean(const Scrape& before, const Scrape& after, const std::string& name,
                                     const LabelMatch& match = {}) {
  const std::optional<double> sum = delta(before, after, name + "_sum", match);
  const std::optional<double> count = delta(before, after, name + "_count", match);
  if (!sum || !count || *count <= 0) return std::nullopt;
  return *sum / *count;
}

}  // namespace

ServerFigures server_figures(const Scrape& before, const Scrape& after) {
  ServerFigures f;
  f.unreadable_lines = after.unreadable_lines;
  f.moe_steps = delta(before, after, "capserve_moe_steps_total");
  f.assignments = delta(before, after, "capserve_moe_assignments_total");
  f.dropped = delta(before, after, "capserve_moe_dropped_assignments_total");
  f.rerouted = delta(before, after, "capserve_moe_rerouted_assignments_total");
  f.generation_tokens = delta(before, after, "capserve_generation_tokens_total");
  f.prompt_tokens = delta(before, after, "capserve_prompt_tokens_total");
  f.prefill_tokens_computed = delta(before, after, "capserve_prefill_tokens_computed_total");
  f.prefix_cache_query_tokens = delta(before, after, "capserve_prefix_cache_query_tokens_total");
  f.prefix_cache_hit_tokens = delta(before, after, "capserve_prefix_cache_hit_tokens_total");
  f.prefix_cache_query_blocks = delta(before, after, "capserve_prefix_cache_query_blocks_total");
  f.prefix_cache_hit_blocks = delta(before, after, "capserve_prefix_cache_hit_blocks_total");
  f.prefix_cache_evictions = delta(before, after, "capserve_prefix_cache_evictions_total");
  f.imbalance_last_by_layer = after.by_label("capserve_moe_rank_imbalance", "layer");

  // The run's imbalance per layer: max/mean over ranks of the tokens each rank computed during the run.
  std::map<std::string, std::vector<double>> rank_tokens;
  for (const Sample& s : after.samples) {
    if (s.name != "capserve_moe_rank_tokens_total") continue;
    const auto layer = s.labels.find("layer");
    const auto rank = s.labels.find("rank");
    if (layer == s.labels.end() || rank == s.labels.end()) continue;
    double v = s.value;
    for (const Sample& b : before.samples) {
      if (b.name == s.name && b.labels == s.labels) v -= b.value;
    }
    rank_tokens[layer->second].push_back(v);
  }
  for (const auto& [layer, loads] : rank_tokens) {
    double total = 0;
    for (const double v : loads) total += v;
    if (total <= 0) continue;
    const double mean = total / static_cast<double>(loads.size());
    f.imbalance_run_by_layer[layer] = *std::max_element(loads.begin(), loads.end()) / mean;
  }

  f.imbalance_mean = histogram_mean(before, after, "capserve_moe_rank_imbalance_ratio");
  f.predictor_cosine = histogram_mean(before, after, "capserve_predictor_step_load_cosine");
  f.selector_predicted_imbalance =
      histogram_mean(before, after, "capserve_batch_selector_step_imbalance_ratio", {{"kind", "predicted"}});
  f.selector_realized_imbalance =
      histogram_mean(before, after, "capserve_batch_selector_step_imbalance_ratio", {{"kind", "realized"}});
  f.selector_decision_mean_s = histogram_mean(before, after, "capserve_batch_selector_decision_seconds");
  f.selector_decisions = delta(before, after, "capserve_batch_selector_decision_seconds_count");
  f.ttft_mean_s = histogram_mean(before, after, "capserve_time_to_first_token_seconds");
  f.itl_mean_s = histogram_mean(before, after, "capserve_inter_token_latency_seconds");
  f.e2e_mean_s = histogram_mean(before, after, "capserve_end_to_end_latency_seconds");
  f.queue_time_mean_s = histogram_mean(before, after, "capserve_queue_time_seconds");
  f.requests_by_finish_reason = delta_by_label(before, after, "capserve_requests_total", "finish_reason");
  for (const auto& [code, n] : delta_by_label(before, after, "capserve_request_errors_total", "code")) {
    if (n != 0) f.errors_by_code[code] = n;
  }
  return f;
}

}  // namespace capserve::loadgen
