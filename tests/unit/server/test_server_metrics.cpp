// ServerMetrics: record requests and MoE steps, read the text exposition back and check the series and their
// values; lint the exposition with promtool where it is installed. (Serving it over HTTP: test_http_server.)
#include "server/server_metrics.h"

#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace capserve::server {
namespace {

using Labels = std::map<std::string, std::string>;

constexpr const char* kModel = "tiny-moe";

MetricsOptions options(bool per_expert = true) {
  return {.model_name = kModel,
          .per_expert = per_expert,
          .max_context = 300,
          .version = "1.2.3",
          .git_commit = "abc",
          .build_type = "Release",
          .device = "cpu"};
}

// The value of the sample `name{labels}` (and model_name="tiny-moe", which every series carries) in a text
// exposition, or nullopt when absent.
std::optional<double> sample(const std::string& text, const std::string& name, Labels labels = {}) {
  labels.emplace("model_name", kModel);
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    const auto name_end = line.find_first_of("{ ");
    if (name_end == std::string::npos || line.compare(0, name_end, name) != 0 || name_end != name.size())
      continue;
    Labels found;
    std::size_t pos = name_end;
    if (line[pos] == '{') {
      ++pos;
      while (pos < line.size() && line[pos] != '}') {
        const auto eq = line.find('=', pos);
        const std::string key = line.substr(pos, eq - pos);
        std::string value;
        pos = eq + 2;  // past ="
        while (pos < line.size() && line[pos] != '"') {
          if (line[pos] == '\\') ++pos;
          value += line[pos++];
        }
        found[key] = value;
        ++pos;  // past the closing quote
        if (pos < line.size() && line[pos] == ',') ++pos;
      }
      ++pos;  // past }
    }
    if (found != labels) continue;
    return std::stod(line.substr(pos));
  }
  return std::nullopt;
}

double value(const std::string& text, const std::string& name, const Labels& labels = {}) {
  const auto v = sample(text, name, labels);
  std::string where = name + "{";
  for (const auto& [k, val] : labels) where += k + "=\"" + val + "\",";
  where += "}";
  EXPECT_TRUE(v.has_value()) << "no sample " << where;
  return v.value_or(-1);
}

parallel::MoeLayerStats layer_stats(std::int64_t layer, std::int64_t tokens, std::int64_t dropped,
                                    std::int64_t rerouted, std::vector<std::int64_t> expert_load,
                                    std::vector<std::int64_t> rank_load, std::int64_t wire_bytes, double t) {
  parallel::MoeLayerStats s;
  s.layer = layer;
  s.tokens = tokens;
  s.assignments = tokens * 2;
  s.dropped = dropped;
  s.rerouted = rerouted;
  s.expert_load = std::move(expert_load);
  s.rank_load = std::move(rank_load);
  s.wire_bytes = wire_bytes;
  s.scheduler_seconds = t;
  s.dispatch_seconds = 2 * t;
  s.expert_seconds = 3 * t;
  s.combine_seconds = 4 * t;
  return s;
}

class ServerMetricsTest : public ::testing::Test {
 protected:
  // MoE layers 1 and 3 (layer 0 and 2 dense), 4 experts on 2 ranks (experts 0,1 on rank 0).
  std::vector<std::int64_t> layers_{1, 3};
  ServerMetrics metrics_{layers_, 4, 2, options()};

  void record() {
    metrics_.observe_time_to_first_token(0.2);
    metrics_.observe_time_to_first_token(3.0);
    metrics_.observe_inter_token_latency(0.04);
    metrics_.observe_end_to_end_latency(5.5);
    metrics_.observe_queue_time(0.0005);
    metrics_.set_requests_running(3);
    metrics_.set_requests_waiting(7);
    metrics_.add_prompt_tokens(120);
    metrics_.add_prompt_tokens(30);
    metrics_.add_generation_tokens(64);
    metrics_.count_outcome(Outcome::stop);
    metrics_.count_outcome(Outcome::stop);
    metrics_.count_outcome(Outcome::length);
    metrics_.count_outcome(Outcome::error);
    metrics_.count_error("RESOURCE_EXHAUSTED");
    metrics_.count_error("NOT_A_CODE");

    // Step 1: 10 tokens, top-2 -> 20 assignments per layer.
    parallel::MoeStepStats s1;
    s1.layers.push_back(layer_stats(1, 10, 3, 1, {8, 4, 3, 2}, {12, 5}, 1000, 0.001));
    s1.layers.push_back(layer_stats(3, 10, 0, 0, {5, 5, 5, 5}, {10, 10}, 2000, 0.002));
    metrics_.record_step(s1);
    // Step 2: 6 tokens; layer 3 listed first (not in model order) to exercise the lookup.
    parallel::MoeStepStats s2;
    s2.layers.push_back(layer_stats(3, 6, 2, 2, {1, 2, 3, 4}, {3, 7}, 500, 0.004));
    s2.layers.push_back(layer_stats(1, 6, 1, 0, {4, 4, 2, 1}, {8, 3}, 300, 0.003));
    // A layer the metrics were not told about is ignored.
    s2.layers.push_back(layer_stats(7, 6, 5, 5, {1, 1, 1, 1}, {2, 2}, 9, 0.1));
    metrics_.record_step(s2);

    metrics_.observe_selector_decision(3e-6);
    metrics_.observe_selector_decision(0.002);
    metrics_.set_selector_imbalance(1.25, 1.4);
    metrics_.set_predictor_cosine(0.93);
  }
};

TEST_F(ServerMetricsTest, ExposesEverySeriesBeforeAnythingIsRecorded) {
  const std::string text = metrics_.exposition();
  EXPECT_EQ(value(text, "capserve_requests_total", {{"finish_reason", "cancelled"}}), 0);
  EXPECT_EQ(value(text, "capserve_request_errors_total", {{"code", "DEADLINE_EXCEEDED"}}), 0);
  EXPECT_EQ(value(text, "capserve_moe_expert_tokens_total", {{"layer", "3"}, {"expert", "3"}}), 0);
  EXPECT_EQ(value(text, "capserve_moe_rank_tokens_total", {{"layer", "1"}, {"rank", "1"}}), 0);
  EXPECT_EQ(value(text, "capserve_moe_phase_seconds_total", {{"layer", "1"}, {"phase", "scheduler"}}), 0);
  EXPECT_EQ(value(text, "capserve_moe_rank_imbalance", {{"layer", "3"}}), 1);
  EXPECT_EQ(value(text, "capserve_time_to_first_token_seconds_count"), 0);
  // Not measured yet.
  EXPECT_TRUE(std::isnan(value(text, "capserve_predictor_load_cosine")));
  EXPECT_TRUE(std::isnan(value(text, "capserve_batch_selector_realized_imbalance")));
  // Only the layers, experts and ranks given exist.
  EXPECT_FALSE(sample(text, "capserve_moe_dropped_assignments_total", {{"layer", "0"}}));
  EXPECT_FALSE(sample(text, "capserve_moe_expert_tokens_total", {{"layer", "1"}, {"expert", "4"}}));
}

TEST_F(ServerMetricsTest, ScrapedValuesMatchWhatWasRecorded) {
  record();
  const std::string text = metrics_.exposition();

  // Request latencies: bucket boundaries are cumulative, 1 ms .. 7680 s (60 s between tokens).
  EXPECT_EQ(value(text, "capserve_time_to_first_token_seconds_count"), 2);
  EXPECT_DOUBLE_EQ(value(text, "capserve_time_to_first_token_seconds_sum"), 3.2);
  EXPECT_EQ(value(text, "capserve_time_to_first_token_seconds_bucket", {{"le", "0.25"}}), 1);
  EXPECT_EQ(value(text, "capserve_time_to_first_token_seconds_bucket", {{"le", "5"}}), 2);
  EXPECT_EQ(value(text, "capserve_time_to_first_token_seconds_bucket", {{"le", "60"}}), 2);
  EXPECT_EQ(value(text, "capserve_time_to_first_token_seconds_bucket", {{"le", "7680"}}), 2);
  EXPECT_FALSE(sample(text, "capserve_inter_token_latency_seconds_bucket", {{"le", "120"}}));
  EXPECT_EQ(value(text, "capserve_time_to_first_token_seconds_bucket", {{"le", "+Inf"}}), 2);
  EXPECT_EQ(value(text, "capserve_queue_time_seconds_bucket", {{"le", "0.001"}}), 1);
  EXPECT_EQ(value(text, "capserve_inter_token_latency_seconds_count"), 1);
  EXPECT_EQ(value(text, "capserve_end_to_end_latency_seconds_bucket", {{"le", "5"}}), 0);
  EXPECT_EQ(value(text, "capserve_end_to_end_latency_seconds_bucket", {{"le", "10"}}), 1);

  EXPECT_EQ(value(text, "capserve_requests_running"), 3);
  EXPECT_EQ(value(text, "capserve_requests_waiting"), 7);
  EXPECT_EQ(value(text, "capserve_prompt_tokens_total"), 150);
  EXPECT_EQ(value(text, "capserve_generation_tokens_total"), 64);
  EXPECT_EQ(value(text, "capserve_requests_total", {{"finish_reason", "stop"}}), 2);
  EXPECT_EQ(value(text, "capserve_requests_total", {{"finish_reason", "length"}}), 1);
  EXPECT_EQ(value(text, "capserve_requests_total", {{"finish_reason", "cancelled"}}), 0);
  EXPECT_EQ(value(text, "capserve_requests_total", {{"finish_reason", "error"}}), 1);
  EXPECT_EQ(value(text, "capserve_request_errors_total", {{"code", "RESOURCE_EXHAUSTED"}}), 1);
  EXPECT_EQ(value(text, "capserve_request_errors_total", {{"code", "OTHER"}}), 1);
  EXPECT_EQ(value(text, "capserve_request_errors_total", {{"code", "INTERNAL"}}), 0);
  EXPECT_FALSE(sample(text, "capserve_request_errors_total", {{"code", "NOT_A_CODE"}}));

  // MoE: sums over the two steps, per layer; layer 7 (unknown) left out.
  EXPECT_EQ(value(text, "capserve_moe_steps_total"), 2);
  EXPECT_EQ(value(text, "capserve_moe_dropped_assignments_total", {{"layer", "1"}}), 3 + 1);
  EXPECT_EQ(value(text, "capserve_moe_dropped_assignments_total", {{"layer", "3"}}), 0 + 2);
  EXPECT_EQ(value(text, "capserve_moe_rerouted_assignments_total", {{"layer", "1"}}), 1 + 0);
  EXPECT_EQ(value(text, "capserve_moe_rerouted_assignments_total", {{"layer", "3"}}), 0 + 2);
  EXPECT_EQ(value(text, "capserve_moe_assignments_total", {{"layer", "1"}}), 20 + 12);
  EXPECT_EQ(value(text, "capserve_moe_assignments_total", {{"layer", "3"}}), 20 + 12);
  EXPECT_FALSE(sample(text, "capserve_moe_dropped_assignments_total", {{"layer", "7"}}));
  const std::vector<std::vector<double>> expert_tokens{{8 + 4, 4 + 4, 3 + 2, 2 + 1},
                                                       {5 + 1, 5 + 2, 5 + 3, 5 + 4}};
  for (std::size_t l = 0; l < 2; ++l) {
    for (std::size_t e = 0; e < 4; ++e) {
      EXPECT_EQ(value(text, "capserve_moe_expert_tokens_total",
                      {{"layer", std::to_string(layers_[l])}, {"expert", std::to_string(e)}}),
                expert_tokens[l][e])
          << "layer " << layers_[l] << " expert " << e;
    }
  }
  EXPECT_EQ(value(text, "capserve_moe_rank_tokens_total", {{"layer", "1"}, {"rank", "0"}}), 12 + 8);
  EXPECT_EQ(value(text, "capserve_moe_rank_tokens_total", {{"layer", "3"}, {"rank", "1"}}), 10 + 7);
  // Last step's max/mean per rank: layer 1 {8, 3} -> 8/5.5, layer 3 {3, 7} -> 7/5.
  EXPECT_NEAR(value(text, "capserve_moe_rank_imbalance", {{"layer", "1"}}), 8 / 5.5, 1e-9);
  EXPECT_NEAR(value(text, "capserve_moe_rank_imbalance", {{"layer", "3"}}), 7 / 5.0, 1e-9);
  // Every (layer, step) observed once: 12/8.5, 1, 1.4, 8/5.5.
  EXPECT_EQ(value(text, "capserve_moe_rank_imbalance_ratio_count"), 4);
  EXPECT_EQ(value(text, "capserve_moe_rank_imbalance_ratio_bucket", {{"le", "1"}}), 1);
  EXPECT_EQ(value(text, "capserve_moe_rank_imbalance_ratio_bucket", {{"le", "1.3"}}), 1);
  EXPECT_EQ(value(text, "capserve_moe_rank_imbalance_ratio_bucket", {{"le", "1.5"}}), 4);
  EXPECT_NEAR(value(text, "capserve_moe_phase_seconds_total", {{"layer", "1"}, {"phase", "scheduler"}}),
              0.004, 1e-12);
  EXPECT_NEAR(value(text, "capserve_moe_phase_seconds_total", {{"layer", "1"}, {"phase", "dispatch"}}), 0.008,
              1e-12);
  EXPECT_NEAR(value(text, "capserve_moe_phase_seconds_total", {{"layer", "3"}, {"phase", "expert"}}), 0.018,
              1e-12);
  EXPECT_NEAR(value(text, "capserve_moe_phase_seconds_total", {{"layer", "3"}, {"phase", "combine"}}), 0.024,
              1e-12);
  EXPECT_EQ(value(text, "capserve_moe_alltoall_bytes_total", {{"layer", "1"}}), 1300);
  EXPECT_EQ(value(text, "capserve_moe_alltoall_bytes_total", {{"layer", "3"}}), 2500);

  // Batch selection.
  EXPECT_EQ(value(text, "capserve_batch_selector_decision_seconds_count"), 2);
  EXPECT_EQ(value(text, "capserve_batch_selector_decision_seconds_bucket", {{"le", "5e-06"}}), 1);
  EXPECT_EQ(value(text, "capserve_batch_selector_decision_seconds_bucket", {{"le", "0.0025"}}), 2);
  EXPECT_EQ(value(text, "capserve_batch_selector_predicted_imbalance"), 1.25);
  EXPECT_EQ(value(text, "capserve_batch_selector_realized_imbalance"), 1.4);
  EXPECT_EQ(value(text, "capserve_predictor_load_cosine"), 0.93);
  EXPECT_EQ(value(text, "capserve_batch_selector_step_imbalance_ratio_sum", {{"kind", "predicted"}}), 1.25);
  EXPECT_EQ(value(text, "capserve_batch_selector_step_imbalance_ratio_count", {{"kind", "realized"}}), 1);
  EXPECT_EQ(value(text, "capserve_batch_selector_step_imbalance_ratio_bucket",
                  {{"kind", "realized"}, {"le", "1.3"}}),
            0);
  EXPECT_EQ(value(text, "capserve_batch_selector_step_imbalance_ratio_bucket",
                  {{"kind", "realized"}, {"le", "1.5"}}),
            1);
  EXPECT_NEAR(value(text, "capserve_predictor_step_load_cosine_sum"), 0.93, 1e-12);
  EXPECT_EQ(value(text, "capserve_predictor_step_load_cosine_bucket", {{"le", "0.95"}}), 1);
  EXPECT_EQ(value(text, "capserve_predictor_step_load_cosine_bucket", {{"le", "0.9"}}), 0);
}

// `promtool check metrics` on an exposition: its exit status and what it printed.
std::pair<int, std::string> promtool_check(const std::filesystem::path& promtool, const std::string& text) {
  const auto file =
      std::filesystem::temp_directory_path() / ("capserve_metrics_" + std::to_string(::getpid()) + ".txt");
  std::ofstream(file) << text;
  const std::string cmd = promtool.string() + " check metrics < " + file.string() + " 2>&1";
  FILE* pipe = ::popen(cmd.c_str(), "r");
  if (pipe == nullptr) throw std::runtime_error("cannot run " + cmd);
  std::string output;
  char buf[512];
  while (std::fgets(buf, sizeof buf, pipe) != nullptr) output += buf;
  const int status = ::pclose(pipe);
  std::filesystem::remove(file);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, output};
}

TEST_F(ServerMetricsTest, ExpositionPassesPromtool) {
  const std::filesystem::path promtool = "/usr/bin/promtool";
  if (!std::filesystem::exists(promtool)) {
    GTEST_SKIP()
        << "promtool not found at " << promtool
        << ": install the Debian package `prometheus` (deploy/install_deps.sh does) to lint /metrics";
  }
  // The linter is live: a counter without _total fails.
  EXPECT_NE(promtool_check(promtool, "# HELP x_bytes x\n# TYPE x_bytes counter\nx_bytes 1\n").first, 0);

  const auto [fresh_rc, fresh_out] = promtool_check(promtool, metrics_.exposition());
  EXPECT_EQ(fresh_rc, 0) << "promtool check metrics (nothing recorded yet):\n" << fresh_out;
  record();
  const auto [rc, out] = promtool_check(promtool, metrics_.exposition());
  EXPECT_EQ(rc, 0) << "promtool check metrics:\n" << out;
}

TEST_F(ServerMetricsTest, EverySampleCarriesTheModelName) {
  record();
  std::istringstream in(metrics_.exposition());
  std::string line;
  int samples = 0;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    ++samples;
    EXPECT_NE(line.find("model_name=\"tiny-moe\""), std::string::npos) << line;
  }
  EXPECT_GT(samples, 100);
}

TEST_F(ServerMetricsTest, BuildInfoNamesTheBuild) {
  EXPECT_EQ(
      value(metrics_.exposition(), "capserve_build_info",
            {{"version", "1.2.3"}, {"git_commit", "abc"}, {"build_type", "Release"}, {"device", "cpu"}}),
      1);
}

TEST_F(ServerMetricsTest, KvCacheUsageIsTheShareOfAllRanksBlocks) {
  const std::vector<std::int64_t> used{30, 10};
  metrics_.set_kv_cache_usage(used, 100);
  const std::string text = metrics_.exposition();
  EXPECT_DOUBLE_EQ(value(text, "capserve_kv_cache_usage_ratio"), 0.2);
  EXPECT_EQ(value(text, "capserve_kv_cache_used_blocks", {{"rank", "0"}}), 30);
  EXPECT_EQ(value(text, "capserve_kv_cache_used_blocks", {{"rank", "1"}}), 10);
  EXPECT_EQ(value(text, "capserve_kv_cache_total_blocks"), 100);
}

TEST_F(ServerMetricsTest, RequestLengthsAndPhases) {
  metrics_.observe_request_lengths(7, 1);
  metrics_.observe_request_lengths(120, 300);
  metrics_.observe_prefill_time(0.3);
  metrics_.observe_decode_time(4000);
  const std::string text = metrics_.exposition();
  // 1, 2, 5, ... up to the first bound at or past max_context (300): 500.
  EXPECT_EQ(value(text, "capserve_request_prompt_tokens_bucket", {{"le", "5"}}), 0);
  EXPECT_EQ(value(text, "capserve_request_prompt_tokens_bucket", {{"le", "10"}}), 1);
  EXPECT_EQ(value(text, "capserve_request_prompt_tokens_bucket", {{"le", "200"}}), 2);
  EXPECT_EQ(value(text, "capserve_request_generation_tokens_bucket", {{"le", "1"}}), 1);
  EXPECT_EQ(value(text, "capserve_request_generation_tokens_bucket", {{"le", "500"}}), 2);
  EXPECT_FALSE(sample(text, "capserve_request_generation_tokens_bucket", {{"le", "1000"}}));
  EXPECT_EQ(value(text, "capserve_request_generation_tokens_sum"), 301);
  EXPECT_EQ(value(text, "capserve_request_prefill_time_seconds_bucket", {{"le", "0.5"}}), 1);
  EXPECT_EQ(value(text, "capserve_request_decode_time_seconds_bucket", {{"le", "3840"}}), 0);
  EXPECT_EQ(value(text, "capserve_request_decode_time_seconds_bucket", {{"le", "7680"}}), 1);
}

TEST(ServerMetricsShape, PerExpertSeriesOnlyWhenAsked) {
  const std::vector<std::int64_t> layers{0, 1};
  ServerMetrics metrics(layers, 256, 2, options(false));
  parallel::MoeStepStats step;
  step.layers.push_back(layer_stats(0, 4, 0, 0, std::vector<std::int64_t>(256, 1), {4, 4}, 0, 0));
  metrics.record_step(step);
  const std::string text = metrics.exposition();
  EXPECT_EQ(text.find("capserve_moe_expert_tokens_total"), std::string::npos);
  EXPECT_EQ(value(text, "capserve_moe_rank_tokens_total", {{"layer", "0"}, {"rank", "1"}}), 4);
}

TEST(ServerMetricsShape, RejectsBadShapes) {
  const std::vector<std::int64_t> twice{2, 2};
  EXPECT_THROW(ServerMetrics(twice, 2, 1, options()), std::invalid_argument);
  const std::vector<std::int64_t> layers{0};
  EXPECT_THROW(ServerMetrics(layers, 2, 0, options()), std::invalid_argument);
  MetricsOptions unnamed = options();
  unnamed.model_name.clear();
  EXPECT_THROW(ServerMetrics(layers, 2, 1, unnamed), std::invalid_argument);
}

}  // namespace
}  // namespace capserve::server
