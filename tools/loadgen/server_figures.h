#pragma once
// What the server's /metrics says about a run: counters as differences between a scrape before and one after
// the run, gauges as they are after it. Names are server/server_metrics.cpp's; a metric the server does not
// export is left out (nullopt / empty), never reported as zero.
#include <map>
#include <optional>
#include <string>

#include "tools/loadgen/prometheus_text.h"

namespace capserve::loadgen {

struct ServerFigures {
  std::optional<double> moe_steps;
  std::optional<double> assignments;
  std::optional<double> dropped;
  std::optional<double> rerouted;
  std::optional<double> generation_tokens;
  std::optional<double> prompt_tokens;
  // The prefix cache: prompt tokens actually prefilled, and what lookups asked and found (tokens, blocks).
  std::optional<double> prefill_tokens_computed;
  std::optional<double> prefix_cache_query_tokens;
  std::optional<double> prefix_cache_hit_tokens;
  std::optional<double> prefix_cache_query_blocks;
  std::optional<double> prefix_cache_hit_blocks;
  std::optional<double> prefix_cache_evictions;
  // Per-rank load imbalance (max/mean, after capacity).
  std::map<std::string, double> imbalance_last_by_layer;  // the gauge after the run (last step), per layer
  std::map<std::string, double> imbalance_run_by_layer;   // from the per-rank token counters over the run
  std::optional<double> imbalance_mean;                   // mean over the run's steps and layers (histogram)
  // Means over the run's steps: the predictor's per-rank load cosine, and the batch's per-rank imbalance
  // over the dry-run layers as predicted at admission and as realized.
  std::optional<double> predictor_cosine;
  std::optional<double> selector_predicted_imbalance;
  std::optional<double> selector_realized_imbalance;
  std::optional<double> selector_decision_mean_s;
  std::optional<double> selector_decisions;  // admissions where the selector chose (not FCFS)
  std::optional<double> ttft_mean_s;
  std::optional<double> itl_mean_s;
  std::optional<double> e2e_mean_s;
  std::optional<double> queue_time_mean_s;
  std::map<std::string, double> requests_by_finish_reason;
  std::map<std::string, double> errors_by_code;  // non-zero only
  std::size_t unreadable_lines = 0;
};

ServerFigures server_figures(const Scrape& before, const Scrape& after);

}  // namespace capserve::loadgen
