// capserve-bench-batch-selector: decision time of the CAPS batch selector per strategy, side by side in one
// run, at the operating point (window 256, batch 64, 8 ranks x 64 experts). Each request's predicted
// load is a per-expert count vector drawn from the real OLMoE per-domain routing counts (semantic bursts:
// runs of one domain) folded through a contiguous placement into per-rank loads, as the server does. Prints
// p50/p99/max per strategy and the aggregate imbalance each reaches.
#include <time.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <random>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "runtime/cli/version.h"
#include "runtime/json_file.h"
#include "server/batch_selector.h"

namespace {

using capserve::server::BatchSelector;
using capserve::server::Candidate;
using capserve::server::SelectionStrategy;

struct Request {
  std::vector<float> load;  // per rank
  std::int64_t tokens = 0;
};

// This thread's CPU time: unlike wall time it leaves out preemption by other processes on a shared machine.
double thread_cpu_us() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) * 1e6 + static_cast<double>(ts.tv_nsec) * 1e-3;
}

double percentile(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  return v[static_cast<std::size_t>(p * static_cast<double>(v.size() - 1))];
}

}  // namespace

int main(int argc, char** argv) {
  capserve::runtime::log_to_stderr();
  CLI::App app{"Decision time of the CAPS batch selector"};
  capserve::runtime::add_common_flags(app, "capserve-bench-batch-selector");
  std::string counts_path = "../shared/data/routing/olmoe_mixtral_expert_counts.json";
  std::int64_t window = 256;
  std::int64_t batch = 64;
  std::int64_t ranks = 8;
  std::int64_t decisions = 2000;
  std::string json_out;
  app.add_option("--routing-counts", counts_path)->check(CLI::ExistingFile);
  app.add_option("--window", window)->check(CLI::PositiveNumber);
  app.add_option("--batch", batch, "admissions per decision")->check(CLI::PositiveNumber);
  app.add_option("--ranks", ranks)->check(CLI::PositiveNumber);
  app.add_option("--decisions", decisions)->check(CLI::PositiveNumber);
  app.add_option("--json", json_out, "write the figures as JSON");
  CLI11_PARSE(app, argc, argv);

  // Per-domain expert distributions of OLMoE layer 7 (64 experts, top-8).
  const nlohmann::json counts = capserve::runtime::read_json_file(counts_path);
  const nlohmann::json& by_domain = counts.at("olmoe").at("expert_counts");
  std::vector<std::discrete_distribution<int>> domains;
  std::int64_t experts = 0;
  for (const auto& [domain, layers] : by_domain.items()) {
    const std::vector<double> c = layers.at("7").get<std::vector<double>>();
    experts = static_cast<std::int64_t>(c.size());
    domains.emplace_back(c.begin(), c.end());
  }
  const std::int64_t per_rank = experts / ranks;
  std::mt19937_64 rng(1);
  // A request: 32..512 prompt tokens, 8 experts each (with repetition: a count sketch), folded per rank.
  const auto make_request = [&](std::size_t domain) {
    Request r;
    r.tokens = std::uniform_int_distribution<std::int64_t>(32, 512)(rng);
    r.load.assign(static_cast<std::size_t>(ranks), 0.0F);
    for (std::int64_t t = 0; t < r.tokens * 8; t += 8) {
      for (int s = 0; s < 8; ++s) r.load[static_cast<std::size_t>(domains[domain](rng) / per_rank)] += 1.0F;
    }
    return r;
  };
  // A pool of requests in semantic bursts of 8 from one domain.
  std::vector<Request> pool;
  for (std::size_t i = 0; pool.size() < 4096; ++i) {
    const std::size_t domain = (i / 8) % domains.size();
    pool.push_back(make_request(domain));
  }

  const SelectionStrategy strategies[] = {SelectionStrategy::fcfs, SelectionStrategy::greedy,
                                          SelectionStrategy::power_of_d, SelectionStrategy::lpt_balanced,
                                          SelectionStrategy::random};
  std::map<SelectionStrategy, std::vector<double>> micros;
  std::map<SelectionStrategy, std::vector<double>> cpu_micros;
  std::map<SelectionStrategy, double> imbalance_sum;
  std::map<SelectionStrategy, BatchSelector> selectors;
  for (const SelectionStrategy s : strategies) {
    capserve::server::SelectorConfig config;
    config.strategy = s;
    config.window = window;
    config.min_queue_depth = 1;
    config.max_wait_ms = 1e9;
    selectors.emplace(s, BatchSelector(config, ranks));
  }
  std::vector<Candidate> candidates(static_cast<std::size_t>(window));
  std::vector<float> running(static_cast<std::size_t>(ranks));
  for (std::int64_t d = 0; d < decisions; ++d) {
    // The same queue and running load for every strategy; strategies interleaved so noise hits all alike.
    const auto offset = static_cast<std::size_t>(rng() % (pool.size() - static_cast<std::size_t>(window)));
    for (std::int64_t i = 0; i < window; ++i) {
      const Request& r = pool[offset + static_cast<std::size_t>(i)];
      candidates[static_cast<std::size_t>(i)] = {r.tokens, (r.tokens + 15) / 16,
                                                 static_cast<double>(window - i), r.load};
    }
    for (float& v : running) v = static_cast<float>(std::uniform_int_distribution<int>(0, 4000)(rng));
    const capserve::server::AdmissionBudget budget{batch, 1 << 30, 1 << 30};
    for (const SelectionStrategy s : strategies) {
      const double cpu_start = thread_cpu_us();
      const auto start = std::chrono::steady_clock::now();
      const auto selection = selectors.at(s).select(candidates, running, budget, start);
      const double us =
          std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count();
      cpu_micros[s].push_back(thread_cpu_us() - cpu_start);
      micros[s].push_back(us);
      imbalance_sum[s] += selection.predicted_imbalance;
    }
  }
  nlohmann::json out;
  std::printf("window %lld, batch %lld, %lld ranks x %lld experts, %lld decisions\n",
              static_cast<long long>(window), static_cast<long long>(batch), static_cast<long long>(ranks),
              static_cast<long long>(experts), static_cast<long long>(decisions));
  std::printf("%-13s %9s %9s %9s %12s %12s %18s\n", "strategy", "p50 us", "p99 us", "max us", "cpu p50 us",
              "cpu p99 us", "mean max/mean load");
  for (const SelectionStrategy s : strategies) {
    const auto& v = micros[s];
    const double p50 = percentile(v, 0.5);
    const double p99 = percentile(v, 0.99);
    const double mx = *std::max_element(v.begin(), v.end());
    const double imb = imbalance_sum[s] / static_cast<double>(decisions);
    const double cpu50 = percentile(cpu_micros[s], 0.5);
    const double cpu99 = percentile(cpu_micros[s], 0.99);
    std::printf("%-13s %9.1f %9.1f %9.1f %12.1f %12.1f %18.4f\n", capserve::server::to_string(s).c_str(), p50,
                p99, mx, cpu50, cpu99, imb);
    out[capserve::server::to_string(s)] = {{"p50_us", p50},       {"p99_us", p99},
                                           {"max_us", mx},        {"cpu_p50_us", cpu50},
                                           {"cpu_p99_us", cpu99}, {"mean_imbalance", imb}};
  }
  if (!json_out.empty()) {
    out["config"] = {{"window", window},
                     {"batch", batch},
                     {"ranks", ranks},
                     {"experts", experts},
                     {"decisions", decisions}};
    std::FILE* f = std::fopen(json_out.c_str(), "w");
    if (f == nullptr) return 1;
    std::fputs(out.dump(1).c_str(), f);
    std::fclose(f);
  }
  return 0;
}
