// capserve-bench-moe-layer: time of the MoE layer (capacity scheduler + dispatch + expert compute + combine,
// slowest rank) against the capacity factor gamma, every configuration side by side in one run, interleaved
// round-robin across repetitions. Run under `mpirun -np N`; rank 0 prints the table and writes JSON (read by
// tools/bench/bench_moe_layer.py).
//
//   --mode synthetic  a large random layer (default 64 experts top-8, hidden 2048, expert FFN 1024, bf16
//                     weights, each rank allocating only its own experts) whose routing follows the real
//                     per-domain OLMoE expert counts: each token's top-k is drawn with inclusion probability
//                     k * count[e] / sum(count) per expert (ordered systematic sampling over a random
//                     permutation: exactly k distinct experts, exact marginals), router logits put those k on
//                     top with random gaps, then the runtime's own softmax + top-k (route_softmax_topk). One
//                     step = one domain burst = one layer call per count layer in the file (0, 7, 15).
//                     Default 512 tokens per rank: with 2 ranks a step has 1024 tokens, a mean of 128 rows
//                     per expert, so even the experts capped at gamma = 1 stay above the CPU backend's
//                     32-row switch to its sgemm path (time then tracks rows, not the direct kernel's
//                     per-row cost); it is a prefill-sized burst; and a layer call takes ~0.7 s on one
//                     core, so 19 configurations x 6 domains x 5 repetitions fit in ~20 minutes.
//   --mode model      the default model on bursts of one domain's held-out corpus text (windows of
//                     <|endoftext|> + 255 tokens); the MoE time is Engine::last_moe_stats() (scheduler +
//                     dispatch + expert + combine, each the slowest rank's) summed over the MoE layers.
//
// Ideal ratio of a configuration = sum over layers of the largest rank load under gamma = inf / the same
// under the configuration, a rank's load being the (token, expert) assignments its experts compute.
#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <limits>
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "kernels/cpu/cpu_backend.h"
#include "kernels/moe/host_executor.h"
#include "parallel/capacity_config.h"
#include "parallel/capacity_stage.h"
#include "parallel/expert_placement.h"
#include "parallel/mpi_communicator.h"
#include "parallel/mpi_world.h"
#include "parallel/token_dispatcher.h"
#include "runtime/cli/flag_checks.h"
#include "runtime/cli/rank_devices.h"
#include "runtime/cli/version.h"
#include "runtime/engine.h"
#include "runtime/load_error.h"
#include "runtime/model.h"
#include "runtime/moe_block.h"
#include "runtime/tokenizer/tokenizer.h"
#include "tools/placement/expert_counts.h"

namespace {

using namespace capserve;
using Clock = std::chrono::steady_clock;
using nlohmann::json;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// One contender: a capacity configuration.
struct Contender {
  std::string label;
  parallel::CapacityConfig config;
  double gamma = std::numeric_limits<double>::infinity();
};

std::string gamma_text(double g) {
  if (!std::isfinite(g)) return "inf";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", g);
  return buf;
}

// gamma = inf first (the baseline), then drop by gate at every gamma and granularity, then reroute R and
// expanded m at the reroute gammas.
std::vector<Contender> make_contenders(const std::vector<double>& gammas,
                                       const std::vector<double>& reroute_gammas,
                                       const std::vector<std::string>& granularities, std::int64_t rounds,
                                       std::int64_t local_experts) {
  using namespace parallel;
  std::vector<Contender> out;
  out.push_back({"inf", CapacityConfig{}, std::numeric_limits<double>::infinity()});
  const auto add = [&](CapacityPolicy policy, const std::string& gran, double g) {
    CapacityConfig c;
    c.gamma = {g};
    c.policy = policy;
    const auto granularity = parse_granularity(gran);
    if (!granularity) throw std::runtime_error("unknown granularity " + gran);
    c.granularity = *granularity;
    c.rounds = rounds;
    c.local_experts = local_experts;
    std::string label = to_string(policy);
    if (policy == CapacityPolicy::reroute) label += " R=" + std::to_string(rounds);
    if (policy == CapacityPolicy::expanded) label += " m=" + std::to_string(local_experts);
    label += " " + gran + " " + gamma_text(g);
    out.push_back({label, c, g});
  };
  for (const std::string& gran : granularities) {
    for (const double g : gammas) add(CapacityPolicy::drop, gran, g);
  }
  for (const CapacityPolicy p : {CapacityPolicy::reroute, CapacityPolicy::expanded}) {
    for (const std::string& gran : granularities) {
      for (const double g : reroute_gammas) add(p, gran, g);
    }
  }
  return out;
}

// What one step of one contender measured; times are the slowest rank's.
struct StepResult {
  // Slowest rank's scheduler + dispatch + expert + combine (model mode: the sum of the phase maxima).
  double total = 0;
  double scheduler = 0, dispatch = 0, expert = 0, combine = 0;
  double step_wall = 0;  // model mode: the whole forward step, slowest rank
  // Synthetic mode: the fastest rank's scheduler and expert times. The scheduler's first collective absorbs
  // the ranks' arrival skew, so the slowest rank's scheduler time includes waiting; the fastest rank's is
  // close to the scheduler's own cost.
  double scheduler_min = 0, expert_min = 0;
  // Model mode, from the timed communicator, each the largest over ranks: time in the first collective of
  // each MoE layer (waiting for the other ranks to arrive), the part of it inside the scheduler, and the
  // scheduler's collectives in all; arrival_min is the smallest rank's arrival time.
  double arrival = 0, arrival_in_scheduler = 0, scheduler_comm = 0, arrival_min = 0;
  // Model mode, each the largest over ranks of the rank's own figure: its MoE time (sum of its phases), the
  // same less its arrival waits, and its scheduler time less the arrival wait inside the scheduler.
  double moe_rank = 0, moe_net = 0, scheduler_net = 0;
  // Per layer: largest rank load (assignments computed), over all ranks.
  std::vector<std::int64_t> max_rank_load;
  std::vector<std::vector<std::int64_t>> expert_load;  // per layer: assignments each expert computed
  std::int64_t assignments = 0, dropped = 0, rerouted = 0;
  std::int64_t wire_bytes = 0;
};

// All reps of one (domain, contender).
struct Cell {
  std::vector<StepResult> reps;
};

json summarize(const std::vector<std::string>& domains, const std::vector<Contender>& contenders,
               const std::vector<std::vector<Cell>>& cells, double per_call_divisor, const json& meta) {
  json results = json::array();
  const auto med = [](const Cell& c, double StepResult::*f) {
    std::vector<double> v;
    for (const StepResult& r : c.reps) v.push_back(r.*f);
    return median(v);
  };
  const auto load_sum = [](const Cell& c) {
    const auto& l = c.reps.front().max_rank_load;
    return std::accumulate(l.begin(), l.end(), std::int64_t{0});
  };
  // Per domain, then "all" (sums of the domains' medians and loads).
  for (std::size_t d = 0; d <= domains.size(); ++d) {
    const bool all = d == domains.size();
    double base_t = 0;
    double base_load = 0;
    double base_net = 0;
    // Per layer call: pooled rows average over their domains too.
    const double calls = per_call_divisor * (all ? static_cast<double>(domains.size()) : 1.0);
    for (std::size_t dd = 0; dd < domains.size(); ++dd) {
      if (!all && dd != d) continue;
      base_t += med(cells[dd][0], &StepResult::total);
      base_load += static_cast<double>(load_sum(cells[dd][0]));
      base_net += med(cells[dd][0], &StepResult::moe_net);
    }
    for (std::size_t c = 0; c < contenders.size(); ++c) {
      double t = 0, sched = 0, disp = 0, expert = 0, comb = 0, wall = 0, load = 0, sched_min = 0,
             expert_min = 0, arrival = 0, arrival_sched = 0, sched_comm = 0, arrival_min = 0, moe_rank = 0,
             moe_net = 0, sched_net = 0;
      std::int64_t assignments = 0, dropped = 0, rerouted = 0, wire = 0;
      json per_rep = json::array();
      for (std::size_t dd = 0; dd < domains.size(); ++dd) {
        if (!all && dd != d) continue;
        const Cell& cell = cells[dd][c];
        t += med(cell, &StepResult::total);
        sched += med(cell, &StepResult::scheduler);
        disp += med(cell, &StepResult::dispatch);
        expert += med(cell, &StepResult::expert);
        comb += med(cell, &StepResult::combine);
        wall += med(cell, &StepResult::step_wall);
        sched_min += med(cell, &StepResult::scheduler_min);
        expert_min += med(cell, &StepResult::expert_min);
        arrival += med(cell, &StepResult::arrival);
        arrival_sched += med(cell, &StepResult::arrival_in_scheduler);
        sched_comm += med(cell, &StepResult::scheduler_comm);
        arrival_min += med(cell, &StepResult::arrival_min);
        moe_rank += med(cell, &StepResult::moe_rank);
        moe_net += med(cell, &StepResult::moe_net);
        sched_net += med(cell, &StepResult::scheduler_net);
        load += static_cast<double>(load_sum(cell));
        const StepResult& first = cell.reps.front();
        assignments += first.assignments;
        dropped += first.dropped;
        rerouted += first.rerouted;
        wire += first.wire_bytes;
        if (!all) {
          for (const StepResult& r : cell.reps) per_rep.push_back(r.total);
        }
      }
      const double speedup = base_t / t;
      const double ideal = base_load / load;
      json row = {{"domain", all ? "all" : domains[d]},
                  {"config", contenders[c].label},
                  {"policy", parallel::to_string(contenders[c].config.policy)},
                  {"granularity", parallel::to_string(contenders[c].config.granularity)},
                  {"gamma", std::isfinite(contenders[c].gamma) ? json(contenders[c].gamma) : json("inf")},
                  {"layer_ms", 1e3 * t / calls},
                  {"scheduler_ms", 1e3 * sched / calls},
                  {"dispatch_ms", 1e3 * disp / calls},
                  {"expert_ms", 1e3 * expert / calls},
                  {"combine_ms", 1e3 * comb / calls},
                  {"measured_speedup", speedup},
                  {"ideal_ratio", ideal},
                  {"measured_over_ideal", speedup / ideal},
                  {"scheduler_share", sched / t},
                  {"dropped_fraction", static_cast<double>(dropped) / static_cast<double>(assignments)},
                  {"rerouted_fraction", static_cast<double>(rerouted) / static_cast<double>(assignments)},
                  {"max_rank_load_sum", load},
                  {"assignments", assignments},
                  {"wire_bytes", wire}};
      if (meta.value("mode", "") == "model") {
        row["step_ms"] = 1e3 * wall / (all ? static_cast<double>(domains.size()) : 1.0);
        row["arrival_wait_ms"] = 1e3 * arrival / calls;
        row["arrival_wait_min_ms"] = 1e3 * arrival_min / calls;
        row["arrival_wait_in_scheduler_ms"] = 1e3 * arrival_sched / calls;
        row["scheduler_comm_ms"] = 1e3 * sched_comm / calls;
        // Per rank: its own MoE time, and the same less the time it waited for the other ranks to arrive at
        // each layer's first collective; its scheduler time less that wait where the scheduler took it.
        // Each the slowest rank's (median over the repetitions).
        row["layer_rank_ms"] = 1e3 * moe_rank / calls;
        row["layer_net_ms"] = 1e3 * moe_net / calls;
        row["scheduler_net_ms"] = 1e3 * sched_net / calls;
        row["scheduler_net_share"] = sched_net / moe_net;
        row["measured_speedup_net"] = base_net / moe_net;
        row["measured_net_over_ideal"] = base_net / moe_net / ideal;
      } else {
        row["scheduler_min_ms"] = 1e3 * sched_min / calls;
        row["expert_min_ms"] = 1e3 * expert_min / calls;
        row["scheduler_min_share"] = sched_min / t;
      }
      if (!all) {
        row["rep_total_s"] = per_rep;
        row["expert_load"] = cells[d][c].reps.front().expert_load;
      }
      results.push_back(row);
    }
  }
  return results;
}

void print_table(const json& results, const std::string& unit_note) {
  std::printf("%-10s %-26s %10s %8s %8s %9s %7s %8s %8s\n", "domain", "config", "layer ms", "speedup",
              "ideal", "meas/ideal", "sched%", "dropped%", "rerout%");
  for (const json& r : results) {
    std::printf("%-10s %-26s %10.2f %8.3f %8.3f %9.3f %6.2f%% %7.2f%% %7.2f%%\n",
                r["domain"].get<std::string>().c_str(), r["config"].get<std::string>().c_str(),
                r["layer_ms"].get<double>(), r["measured_speedup"].get<double>(),
                r["ideal_ratio"].get<double>(), r["measured_over_ideal"].get<double>(),
                100 * r["scheduler_share"].get<double>(), 100 * r["dropped_fraction"].get<double>(),
                100 * r["rerouted_fraction"].get<double>());
  }
  std::printf("(%s)\n", unit_note.c_str());
}

// ---------------------------------------------------------------------------------------------------------
// Synthetic layer.

std::uint64_t mix64(std::uint64_t x) {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

// Router logits [tokens, E] whose softmax top-k follows inclusion probabilities pi (sum k, each <= 1).
void synth_logits(std::span<const double> pi, std::int64_t tokens, std::int64_t k, std::mt19937_64& rng,
                  std::vector<float>& logits) {
  const auto E = static_cast<std::int64_t>(pi.size());
  logits.resize(static_cast<std::size_t>(tokens * E));
  std::vector<std::int32_t> perm(static_cast<std::size_t>(E));
  std::vector<std::int32_t> chosen;
  std::uniform_real_distribution<double> unif(0.0, 1.0);
  std::normal_distribution<float> normal(0.0F, 1.0F);
  std::exponential_distribution<float> gap(1.0F);
  for (std::int64_t t = 0; t < tokens; ++t) {
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    // Ordered systematic sampling: points u, u+1, ..., u+k-1 on the cumulative pi of the permuted experts.
    chosen.clear();
    const double u = unif(rng);
    double cum = 0.0;
    std::int64_t next = 0;
    for (const std::int32_t e : perm) {
      const double lo = cum;
      cum += pi[static_cast<std::size_t>(e)];
      if (next < k && lo <= u + static_cast<double>(next) && u + static_cast<double>(next) < cum) {
        chosen.push_back(e);
        ++next;
      }
    }
    // Rounding at the very end of the cumulative sum: fill up with unchosen experts (practically never).
    for (std::int64_t e = 0; static_cast<std::int64_t>(chosen.size()) < k && e < E; ++e) {
      if (std::find(chosen.begin(), chosen.end(), e) == chosen.end())
        chosen.push_back(static_cast<std::int32_t>(e));
    }
    float* row = logits.data() + t * E;
    float top_other = -std::numeric_limits<float>::infinity();
    for (std::int64_t e = 0; e < E; ++e) {
      row[e] = normal(rng);
      if (std::find(chosen.begin(), chosen.end(), e) == chosen.end()) top_other = std::max(top_other, row[e]);
    }
    for (const std::int32_t e : chosen) row[e] = top_other + 0.05F + gap(rng);
  }
}

// This rank's tokens of one layer: router probabilities, top-k experts and weights (pristine).
struct SyntheticLayerData {
  std::vector<float> probs;
  std::vector<std::int32_t> experts;
  std::vector<float> weights;
};

// Top-k of the synthetic routing: the flag, else what the counts file tells; never a guess.
std::int64_t synthetic_top_k(std::int64_t flag, const tools::ExpertCounts& counts,
                             const std::string& counts_path, const std::string& counts_model) {
  const std::int64_t k = flag > 0 ? flag : counts.top_k.value_or(0);
  if (k == 0) {
    throw std::runtime_error("cannot tell the top-k of " + counts_path +
                             (counts.format == "counts" ? " (" + counts_model + ")" : "") +
                             ": the file does not record it; pass --top-k");
  }
  if (k > counts.num_experts) {
    throw std::runtime_error("top-k " + std::to_string(k) + " exceeds the " +
                             std::to_string(counts.num_experts) + " experts of " + counts_path);
  }
  return k;
}

int run_synthetic(parallel::MpiWorld& world, parallel::MpiCommunicator& comm, const std::string& counts_path,
                  const std::string& counts_model, std::int64_t top_k_flag, std::vector<std::string> domains,
                  std::vector<std::string> count_layers, std::int64_t tokens, std::int64_t hidden,
                  std::int64_t ffn, int reps, int warmup, std::uint64_t seed,
                  const std::vector<Contender>& contenders, int threads,
                  const std::vector<std::int64_t>& expert_cost_rows, const std::string& out_path) {
  const int rank = world.rank();
  const int ranks = world.size();
  const tools::ExpertCounts counts = tools::read_expert_counts(counts_path, counts_model);
  if (domains.empty()) {
    for (const tools::CountsGroup& g : counts.groups) domains.push_back(g.name);
  }
  if (count_layers.empty()) {
    for (const tools::CountsLayer& l : counts.groups.front().layers)
      count_layers.push_back(std::to_string(l.layer));
  }
  // counts_of[d][l]: the counts of domain d on count layer l (every domain has the same layers).
  std::vector<std::vector<const std::vector<double>*>> counts_of;
  for (const std::string& domain : domains) {
    const auto g = std::find_if(counts.groups.begin(), counts.groups.end(),
                                [&](const tools::CountsGroup& x) { return x.name == domain; });
    if (g == counts.groups.end()) throw std::runtime_error(counts_path + ": no domain \"" + domain + "\"");
    std::vector<const std::vector<double>*>& rows = counts_of.emplace_back();
    for (const std::string& layer : count_layers) {
      const auto l = std::find_if(g->layers.begin(), g->layers.end(), [&](const tools::CountsLayer& x) {
        return std::to_string(x.layer) == layer;
      });
      if (l == g->layers.end())
        throw std::runtime_error(counts_path + ": no layer " + layer + " in " + domain);
      rows.push_back(&l->counts);
    }
  }
  const std::int64_t E = counts.num_experts;
  const std::int64_t k = synthetic_top_k(top_k_flag, counts, counts_path, counts_model);
  const auto L = static_cast<std::int64_t>(count_layers.size());

  // Placement: contiguous, the same on every layer; the layers share one set of expert weights (each rank
  // allocates only its own experts).
  const parallel::ExpertPlacement placement = parallel::ExpertPlacement::contiguous(L, E, ranks);
  const std::span<const std::int32_t> local = placement.local_experts(0, rank);
  const auto n_local = static_cast<std::int64_t>(local.size());
  const std::int64_t per_matrix = ffn * hidden;
  std::vector<std::uint16_t> weight_store(static_cast<std::size_t>(n_local * 3 * per_matrix));
  {
    // bf16 of uniform(-a, a), a = sqrt(3 / hidden) (unit-variance outputs for unit-variance inputs).
    const float a = std::sqrt(3.0F / static_cast<float>(hidden));
    std::uint64_t s = mix64(seed ^ (0xABCDULL + static_cast<std::uint64_t>(rank)));
    for (std::uint16_t& w : weight_store) {
      s = mix64(s);
      const float u = static_cast<float>(s >> 40) * (1.0F / 16777216.0F);
      w = static_cast<std::uint16_t>(std::bit_cast<std::uint32_t>(a * (2.0F * u - 1.0F)) >> 16);
    }
  }
  std::vector<kernels::ExpertWeights> local_weights;
  for (std::int64_t i = 0; i < n_local; ++i) {
    const auto* base = reinterpret_cast<const std::byte*>(weight_store.data() + i * 3 * per_matrix);
    const std::size_t mat_bytes = static_cast<std::size_t>(per_matrix) * 2;
    local_weights.push_back(
        {kernels::weight_tensor({kernels::DType::bf16, base, ffn, hidden}),
         kernels::weight_tensor({kernels::DType::bf16, base + mat_bytes, ffn, hidden}),
         kernels::weight_tensor({kernels::DType::bf16, base + 2 * mat_bytes, hidden, ffn})});
  }

  // Routing of this rank's tokens per (domain, layer), fixed for the run; random hidden states.
  std::vector<std::vector<SyntheticLayerData>> data(domains.size());
  std::vector<float> logits;
  for (std::size_t d = 0; d < domains.size(); ++d) {
    for (std::int64_t l = 0; l < L; ++l) {
      const std::vector<double>& c = *counts_of[d][static_cast<std::size_t>(l)];
      const double total = std::accumulate(c.begin(), c.end(), 0.0);
      if (total <= 0)
        throw std::runtime_error(counts_path + ": " + domains[d] + " layer " +
                                 count_layers[static_cast<std::size_t>(l)] + " has no counts");
      std::vector<double> pi(static_cast<std::size_t>(E));
      for (std::int64_t e = 0; e < E; ++e)
        pi[static_cast<std::size_t>(e)] =
            std::min(1.0, static_cast<double>(k) * c[static_cast<std::size_t>(e)] / total);
      std::mt19937_64 rng(mix64(seed ^ mix64(d * 1000 + static_cast<std::uint64_t>(l) * 10 +
                                             static_cast<std::uint64_t>(rank) * 7919 + 1)));
      synth_logits(pi, tokens, k, rng, logits);
      SyntheticLayerData layer{std::vector<float>(static_cast<std::size_t>(tokens * E)),
                               std::vector<std::int32_t>(static_cast<std::size_t>(tokens * k)),
                               std::vector<float>(static_cast<std::size_t>(tokens * k))};
      runtime::ModelConfig router;
      router.num_experts = E;
      router.top_k = k;
      kernels::moe::route_on_host(runtime::router_params(router, tokens), logits, {}, layer.probs,
                                  layer.experts, layer.weights);
      data[d].push_back(std::move(layer));
    }
  }
  std::vector<float> h(static_cast<std::size_t>(tokens * hidden));
  {
    std::mt19937_64 rng(mix64(seed + 17 + static_cast<std::uint64_t>(rank)));
    std::normal_distribution<float> normal(0.0F, 1.0F);
    for (float& v : h) v = normal(rng);
  }
  std::vector<float> out(static_cast<std::size_t>(tokens * hidden));

  kernels::cpu::CpuBackend backend(threads);
  parallel::TokenDispatcher dispatcher(comm);
  const parallel::PlacementTables tables(backend, placement, rank);
  runtime::MoeScratch scratch;
  std::int64_t totals[2] = {0, 0};
  std::vector<std::unique_ptr<parallel::CapacityStage>> schedulers;
  for (const Contender& c : contenders) {
    if (const std::string why = c.config.validate(L); !why.empty()) throw std::runtime_error(why);
    schedulers.push_back(std::make_unique<parallel::CapacityStage>(c.config, comm));
  }

  // Work copies of the routing (the scheduler edits it in place).
  const auto slots = static_cast<std::size_t>(tokens * k);
  std::vector<std::vector<std::int32_t>> experts(static_cast<std::size_t>(L));
  std::vector<std::vector<float>> weights(static_cast<std::size_t>(L));
  std::vector<parallel::SlotStatus> status(slots);
  std::vector<std::int64_t> loads(static_cast<std::size_t>(L * E));
  std::vector<double> times(7);
  std::vector<std::int64_t> sums(4);

  const auto run_step = [&](std::size_t d, std::size_t c) {
    for (std::int64_t l = 0; l < L; ++l) {
      const SyntheticLayerData& r = data[d][static_cast<std::size_t>(l)];
      experts[static_cast<std::size_t>(l)] = r.experts;
      weights[static_cast<std::size_t>(l)] = r.weights;
    }
    parallel::CapacityStage& sched = *schedulers[c];
    std::int64_t dropped = 0, rerouted = 0, wire = 0;
    double t_sched = 0, t_disp = 0, t_exp = 0, t_comb = 0;
    world.barrier();
    const auto t0 = Clock::now();
    sched.begin_step(tokens);
    t_sched += seconds_since(t0);
    for (std::int64_t l = 0; l < L; ++l) {
      const auto li = static_cast<std::size_t>(l);
      using kernels::Tensor;
      const Tensor expert_ids = Tensor::host(std::span(experts[li]), {tokens, k});
      const Tensor gate = Tensor::host(std::span(weights[li]), {tokens, k});
      const parallel::LayerRouting routing{
          Tensor::host(std::span<const float>(data[d][li].probs), {tokens, E}),
          expert_ids,
          gate,
          Tensor::host(std::span(reinterpret_cast<std::uint8_t*>(status.data()), status.size()), {tokens, k}),
          {},
          Tensor::host(std::span<std::int64_t>(totals), {2}),
          false,
          1.0F};
      const auto ts = Clock::now();
      sched.apply(backend, l, tables.layer(l), routing);
      t_sched += seconds_since(ts);
      t_exp += runtime::expert_parallel_stages(backend, dispatcher, tables.layer(l), local_weights,
                                               Tensor::host(std::span<const float>(h), {tokens, hidden}),
                                               expert_ids, gate, scratch,
                                               Tensor::host(std::span(out), {tokens, hidden}));
      const parallel::DispatchCounters& m = dispatcher.counters();
      t_disp += m.dispatch_seconds;
      t_comb += m.combine_seconds;
      wire += m.wire_bytes;
      dropped += totals[0];
      rerouted += totals[1];
    }
    const double total = seconds_since(t0);
    // Outside the timed region: slowest rank's times, global loads and counts.
    times = {total, t_sched, t_disp, t_exp, t_comb, -t_sched, -t_exp};
    comm.allreduce_max(times);
    std::fill(loads.begin(), loads.end(), 0);
    for (std::int64_t l = 0; l < L; ++l) {
      for (const std::int32_t e : experts[static_cast<std::size_t>(l)]) {
        if (e >= 0) ++loads[static_cast<std::size_t>(l * E + e)];
      }
    }
    comm.allreduce_sum(loads);
    sums = {tokens * k * L, dropped, rerouted, wire};
    comm.allreduce_sum(sums);
    StepResult res;
    res.total = times[0];
    res.scheduler = times[1];
    res.dispatch = times[2];
    res.expert = times[3];
    res.combine = times[4];
    res.scheduler_min = -times[5];
    res.expert_min = -times[6];
    res.assignments = sums[0];
    res.dropped = sums[1];
    res.rerouted = sums[2];
    res.wire_bytes = sums[3];
    for (std::int64_t l = 0; l < L; ++l) {
      std::vector<std::int64_t> rank_load(static_cast<std::size_t>(ranks), 0);
      const auto owners = placement.owners(l);
      for (std::int64_t e = 0; e < E; ++e)
        rank_load[static_cast<std::size_t>(owners[static_cast<std::size_t>(e)])] +=
            loads[static_cast<std::size_t>(l * E + e)];
      res.max_rank_load.push_back(*std::max_element(rank_load.begin(), rank_load.end()));
      res.expert_load.emplace_back(loads.begin() + l * E, loads.begin() + (l + 1) * E);
    }
    return res;
  };

  // Warm-up: every contender once on the first domain (pages in the weights, grows every buffer).
  for (int w = 0; w < warmup; ++w) {
    for (std::size_t c = 0; c < contenders.size(); ++c) (void)run_step(0, c);
  }
  // The grouped expert FFN's cost per expert against its row count, on rank 0 alone (the other ranks wait at
  // the barrier): the kernel-level reason why time is not proportional to load. Best of 3, over up to 8
  // experts at a time.
  json expert_cost = json::array();
  if (expert_cost_rows.size() > 0) {
    if (rank == 0) {
      const std::int64_t group = std::min<std::int64_t>(8, n_local);
      const std::int64_t max_rows = *std::max_element(expert_cost_rows.begin(), expert_cost_rows.end());
      std::vector<float> x(static_cast<std::size_t>(group * max_rows * hidden), 0.5F);
      std::vector<float> y(x.size());
      std::vector<std::int64_t> offsets(static_cast<std::size_t>(group + 1));
      for (const std::int64_t n : expert_cost_rows) {
        for (std::int64_t e = 0; e <= group; ++e) offsets[static_cast<std::size_t>(e)] = e * n;
        const auto rows = static_cast<std::size_t>(group * n * hidden);
        double best = std::numeric_limits<double>::infinity();
        for (int r = 0; r < 4; ++r) {
          const auto t0 = Clock::now();
          backend.grouped_expert_ffn(
              kernels::Tensor::host(std::span(x.data(), rows), {group * n, hidden}), offsets,
              std::span<const kernels::ExpertWeights>(local_weights.data(), static_cast<std::size_t>(group)),
              kernels::Tensor::host(std::span(y.data(), rows), {group * n, hidden}));
          if (r > 0) best = std::min(best, seconds_since(t0));
        }
        expert_cost.push_back({{"rows", n}, {"ms", 1e3 * best / static_cast<double>(group)}});
      }
    }
    world.barrier();
  }

  std::vector<std::vector<Cell>> cells(domains.size(), std::vector<Cell>(contenders.size()));
  const auto t_run = Clock::now();
  for (int rep = 0; rep < reps; ++rep) {
    for (std::size_t d = 0; d < domains.size(); ++d) {
      // Round-robin over the contenders, starting one further each repetition.
      for (std::size_t i = 0; i < contenders.size(); ++i) {
        const std::size_t c = (i + static_cast<std::size_t>(rep)) % contenders.size();
        cells[d][c].reps.push_back(run_step(d, c));
      }
      if (rank == 0) {
        std::fprintf(stderr, "rep %d/%d domain %s done (%.0f s)\n", rep + 1, reps, domains[d].c_str(),
                     seconds_since(t_run));
      }
    }
  }

  if (rank != 0) return 0;
  json meta = {{"mode", "synthetic"},
               {"ranks", ranks},
               {"threads_per_rank", threads},
               {"experts", E},
               {"top_k", k},
               {"hidden", hidden},
               {"expert_ffn", ffn},
               {"tokens_per_rank", tokens},
               {"count_layers", count_layers},
               {"domains", domains},
               {"counts_file", counts_path},
               {"counts_model", counts_model},
               {"counts_format", counts.format},
               {"reps", reps},
               {"warmup", warmup},
               {"placement", "contiguous"},
               {"scope", "global"},
               {"score", "gate"},
               {"weights", "bf16, random, one set shared by the layer calls"},
               {"expert_cost", expert_cost}};
  const json results = summarize(domains, contenders, cells, static_cast<double>(L), meta);
  print_table(results,
              "layer ms = slowest rank's scheduler+dispatch+expert+combine per layer call, median of " +
                  std::to_string(reps) +
                  " reps; speedup = t(inf)/t(config); ideal = max rank load "
                  "before / after");
  json doc = {{"meta", meta}, {"results", results}};
  if (!out_path.empty()) {
    std::ofstream f(out_path);
    f << doc.dump(1) << "\n";
  }
  return 0;
}

// ---------------------------------------------------------------------------------------------------------
// Default model on corpus bursts.

// The model's data-plane communicator, timing every collective on this rank, so that the time a rank
// spends waiting for the other ranks to arrive at a layer can be told apart from the scheduler's own cost:
// the first collective of each MoE layer (the scheduler's count allreduce when capacity is on, the
// dispatcher's first count exchange when it is off) absorbs the ranks' arrival skew.
class TimingCommunicator final : public parallel::Communicator {
 public:
  explicit TimingCommunicator(parallel::Communicator& inner) : inner_(inner) {}
  [[nodiscard]] int rank() const override { return inner_.rank(); }
  [[nodiscard]] int size() const override { return inner_.size(); }
  [[nodiscard]] kernels::Device device() const override { return inner_.device(); }

  void clear() {
    events_.clear();
    last_max_input_.clear();
  }

 protected:
  void do_alltoall(std::span<const std::int64_t> send, std::span<std::int64_t> recv,
                   parallel::Stream stream) override {
    const auto t0 = Clock::now();
    inner_.alltoall(send, recv, stream);
    events_.push_back({'a', seconds_since(t0)});
  }
  void do_alltoallv(std::span<const std::byte> send, std::span<const std::int64_t> send_counts,
                    std::span<std::byte> recv, std::span<const std::int64_t> recv_counts,
                    parallel::Stream stream) override {
    const auto t0 = Clock::now();
    inner_.alltoallv(send, send_counts, recv, recv_counts, stream);
    count_sent(send_counts);
    events_.push_back({'v', seconds_since(t0)});
  }
  void do_allreduce_sum(std::span<std::int64_t> values, parallel::Stream stream) override {
    const auto t0 = Clock::now();
    inner_.allreduce_sum(values, stream);
    events_.push_back({'s', seconds_since(t0)});
  }
  void do_allreduce_max(std::span<double> values, parallel::Stream stream) override {
    last_max_input_.assign(values.begin(), values.end());
    const auto t0 = Clock::now();
    inner_.allreduce_max(values, stream);
    events_.push_back({'m', seconds_since(t0)});
  }
  void do_allgather(std::span<const std::int64_t> mine, std::span<std::int64_t> all,
                    parallel::Stream stream) override {
    const auto t0 = Clock::now();
    inner_.allgather(mine, all, stream);
    events_.push_back({'g', seconds_since(t0)});
  }

 public:
  // One forward's collectives on this rank: begin_step's allgather (capacity on), per MoE layer the
  // scheduler's allreduces then the dispatcher's alltoall, alltoall, alltoallv x 3, and at the end the
  // statistics' allreduce_sum + allreduce_max.
  struct Split {
    double arrival = 0;               // first collective of each layer, summed over layers
    double scheduler_comm = 0;        // all the scheduler's collectives (allgather included)
    double arrival_in_scheduler = 0;  // the part of `arrival` spent inside the scheduler
    // This rank's own phase times, summed over the MoE layers: the statistics' allreduce_max input
    // (scheduler, dispatch, expert, combine per layer) as it was before the reduction.
    double moe_local = 0;
    double scheduler_local = 0;
  };
  [[nodiscard]] Split split() const {
    Split out;
    for (std::size_t i = 0; i < last_max_input_.size(); ++i) {
      out.moe_local += last_max_input_[i];
      if (i % 4 == 0) out.scheduler_local += last_max_input_[i];
    }
    std::size_t end = events_.size();
    if (end >= 2 && events_[end - 1].kind == 'm' && events_[end - 2].kind == 's') end -= 2;
    bool layer_start = true;
    int dispatch_calls = 0;
    for (std::size_t i = 0; i < end; ++i) {
      const Event& e = events_[i];
      if (e.kind == 'g') {
        out.scheduler_comm += e.seconds;
        continue;
      }
      if (e.kind == 's') {
        out.scheduler_comm += e.seconds;
        if (layer_start) {
          out.arrival += e.seconds;
          out.arrival_in_scheduler += e.seconds;
        }
        layer_start = false;
        continue;
      }
      if (layer_start) out.arrival += e.seconds;  // capacity off: the dispatcher's first exchange
      layer_start = false;
      if (++dispatch_calls == 5) {  // alltoall, alltoall, alltoallv (entries, rows), alltoallv (combine)
        dispatch_calls = 0;
        layer_start = true;
      }
    }
    return out;
  }

 private:
  struct Event {
    char kind;
    double seconds;
  };
  parallel::Communicator& inner_;
  std::vector<Event> events_;
  std::vector<double> last_max_input_;
};

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw runtime::LoadError("cannot open " + path);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// The held-out tail of a corpus file (the protocol of tools/measure_default_model.py).
std::string heldout_text(const std::string& data, double fraction) {
  const auto cut = static_cast<std::size_t>(std::floor(static_cast<double>(data.size()) * (1.0 - fraction)));
  const std::size_t nl = data.find('\n', cut);
  return nl == std::string::npos ? std::string() : data.substr(nl + 1);
}

int run_model(parallel::MpiWorld& world, parallel::MpiCommunicator& comm, const std::string& model_dir,
              const std::string& corpus_dir, const std::vector<std::string>& domains, int windows_per_rank,
              int window, int reps, int warmup, const std::vector<Contender>& contenders, int threads,
              const std::string& device, const std::string& out_path) {
  const int rank = world.rank();
  const int ranks = world.size();
  // The data plane timed; on the CPU it is the control plane too (one MPI communicator for both).
  const runtime::RankDevices devices = runtime::make_rank_devices(device, threads, world);
  TimingCommunicator timed(devices.data_plane());
  parallel::Communicator& control = devices.data ? *devices.control : timed;
  std::vector<std::unique_ptr<runtime::Model>> models;
  for (const Contender& c : contenders) {
    runtime::ParallelOptions options;
    options.capacity = c.config;
    models.push_back(runtime::Model::load(model_dir, *devices.backend, timed, control, options));
  }
  runtime::EngineOptions engine_options;
  engine_options.kv_blocks = windows_per_rank * ((window + 1) / engine_options.kv_block_size + 2);
  std::vector<std::unique_ptr<runtime::Engine>> engines;
  for (auto& m : models) engines.push_back(std::make_unique<runtime::Engine>(*m, engine_options));

  // Each rank's burst of a domain: windows [rank * W, (rank + 1) * W) of the held-out text.
  const runtime::Tokenizer tokenizer = runtime::Tokenizer::load(model_dir);
  std::vector<std::vector<std::vector<std::int32_t>>> bursts;
  for (const std::string& domain : domains) {
    const std::string text = heldout_text(read_text(corpus_dir + "/" + domain + ".txt"), 0.05);
    std::vector<std::int32_t> ids;
    if (auto s = tokenizer.encode(text, false, ids); !s.ok())
      throw std::runtime_error(domain + ": " + s.message());
    const std::int64_t available = static_cast<std::int64_t>(ids.size()) / window;
    if (available < static_cast<std::int64_t>(windows_per_rank) * ranks)
      throw std::runtime_error(domain + ": too few held-out windows");
    std::vector<std::vector<std::int32_t>> burst;
    for (int w = 0; w < windows_per_rank; ++w) {
      const std::int64_t j = static_cast<std::int64_t>(rank) * windows_per_rank + w;
      std::vector<std::int32_t> in{0};
      in.insert(in.end(), ids.begin() + j * window, ids.begin() + (j + 1) * window);
      burst.push_back(std::move(in));
    }
    bursts.push_back(std::move(burst));
  }

  runtime::SequenceId next_id = 1;
  std::vector<double> wall(8);
  const auto run_step = [&](std::size_t d, std::size_t c) {
    std::vector<runtime::Engine::Work> work;
    for (const auto& in : bursts[d]) work.push_back({next_id++, in, false});
    world.barrier();
    const auto t0 = Clock::now();
    timed.clear();
    if (auto s = engines[c]->step(work); !s.ok()) throw std::runtime_error(s.message());
    const double step_seconds = seconds_since(t0);
    for (const auto& w : work) engines[c]->release(w.seq);
    const TimingCommunicator::Split split = timed.split();
    wall = {step_seconds,
            split.arrival,
            split.arrival_in_scheduler,
            split.scheduler_comm,
            -split.arrival,
            split.moe_local,
            split.moe_local - split.arrival,
            split.scheduler_local - split.arrival_in_scheduler};
    comm.allreduce_max(wall);
    StepResult res;
    res.step_wall = wall[0];
    res.arrival = wall[1];
    res.arrival_in_scheduler = wall[2];
    res.scheduler_comm = wall[3];
    res.arrival_min = -wall[4];
    res.moe_rank = wall[5];
    res.moe_net = wall[6];
    res.scheduler_net = wall[7];
    for (const parallel::MoeLayerStats& s : engines[c]->last_moe_stats().layers) {
      res.scheduler += s.scheduler_seconds;
      res.dispatch += s.dispatch_seconds;
      res.expert += s.expert_seconds;
      res.combine += s.combine_seconds;
      res.assignments += s.assignments;
      res.dropped += s.dropped;
      res.rerouted += s.rerouted;
      res.wire_bytes += s.wire_bytes;
      res.max_rank_load.push_back(*std::max_element(s.rank_load.begin(), s.rank_load.end()));
      res.expert_load.push_back(s.expert_load);
    }
    res.total = res.scheduler + res.dispatch + res.expert + res.combine;
    return res;
  };

  for (int w = 0; w < warmup; ++w) {
    for (std::size_t c = 0; c < contenders.size(); ++c) (void)run_step(0, c);
  }
  std::vector<std::vector<Cell>> cells(domains.size(), std::vector<Cell>(contenders.size()));
  for (int rep = 0; rep < reps; ++rep) {
    for (std::size_t d = 0; d < domains.size(); ++d) {
      for (std::size_t i = 0; i < contenders.size(); ++i) {
        const std::size_t c = (i + static_cast<std::size_t>(rep)) % contenders.size();
        cells[d][c].reps.push_back(run_step(d, c));
      }
    }
  }

  if (rank != 0) return 0;
  const runtime::ModelConfig& mc = models.front()->config();
  const auto moe_layers = static_cast<double>(engines.front()->last_moe_stats().layers.size());
  json meta = {{"mode", "model"},
               {"model", model_dir},
               {"ranks", ranks},
               {"threads_per_rank", threads},
               {"experts", mc.num_experts},
               {"top_k", mc.top_k},
               {"hidden", mc.hidden_size},
               {"moe_layers", moe_layers},
               {"windows_per_rank", windows_per_rank},
               {"window_tokens", window + 1},
               {"tokens_per_rank", windows_per_rank * (window + 1)},
               {"domains", domains},
               {"corpus", corpus_dir},
               {"reps", reps},
               {"warmup", warmup},
               {"placement", models.front()->placement().kind()},
               {"scope", "global"},
               {"score", "gate"}};
  const json results = summarize(domains, contenders, cells, moe_layers, meta);
  print_table(results,
              "layer ms = sum over phases of the slowest rank's time (last_moe_stats), per MoE layer, "
              "median of " +
                  std::to_string(reps) + " reps");
  json doc = {{"meta", meta}, {"results", results}};
  if (!out_path.empty()) {
    std::ofstream f(out_path);
    f << doc.dump(1) << "\n";
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  capserve::runtime::log_to_stderr();
  std::optional<parallel::MpiWorld> world;
  if (!parallel::start_mpi(world, argc, argv, "capserve-bench-moe-layer")) return 1;
  CLI::App app{"MoE layer time (scheduler + dispatch + experts + combine, slowest rank) vs capacity factor"};
  capserve::runtime::add_common_flags(app, "capserve-bench-moe-layer");
  std::string mode = "synthetic";
  std::string out_path;
  int threads = 1;
  int reps = 5;
  int warmup = 1;
  std::uint64_t seed = 1;
  std::vector<double> gammas = {3, 2, 1.5, 1.25, 1};
  std::vector<double> reroute_gammas = {1.25, 1};
  std::vector<std::string> granularities = {"expert", "device"};
  std::int64_t rounds = 1;
  std::int64_t local_experts = 1;
  // synthetic
  // Defaults in the source tree known at build time, so the tool runs from any directory.
  std::string counts_path = CAPSERVE_SOURCE_DIR "/../shared/data/routing/olmoe_mixtral_expert_counts.json";
  std::string counts_model = "olmoe";
  std::int64_t top_k = 0;
  bool no_expert_cost = false;
  std::vector<std::string> domains;
  std::vector<std::string> count_layers;
  std::int64_t tokens = 512;
  std::int64_t hidden = 2048;
  std::int64_t ffn = 1024;
  std::vector<std::int64_t> expert_cost_rows = {1,  2,   4,   8,   16,  24,  32,  33,  40,  48,  64,
                                                96, 128, 160, 192, 256, 320, 384, 512, 768, 1024};
  // model
  std::string model_dir = CAPSERVE_SOURCE_DIR "/deploy/models/capserve-moe-tiny";
  std::string device = "cpu";
  std::string corpus_dir = CAPSERVE_SOURCE_DIR "/../shared/data/corpus";
  int windows_per_rank = 4;
  int window = 255;

  app.add_option("--mode", mode, "synthetic | model")->check(CLI::IsMember({"synthetic", "model"}));
  app.add_option("--out", out_path, "JSON results (rank 0)");
  app.add_option("--threads", threads, "CPU threads per rank")->check(CLI::PositiveNumber);
  app.add_option("--reps", reps, "measured repetitions (median)")->check(CLI::PositiveNumber);
  app.add_option("--warmup", warmup, "warm-up passes over the contenders")->check(CLI::NonNegativeNumber);
  app.add_option("--seed", seed);
  app.add_option("--gammas", gammas, "drop gammas (besides inf)")->delimiter(',');
  app.add_option("--reroute-gammas", reroute_gammas, "gammas for reroute and expanded")->delimiter(',');
  app.add_option("--granularities", granularities, "expert,device")->delimiter(',');
  app.add_option("--rounds", rounds, "reroute rounds R")->check(CLI::PositiveNumber);
  app.add_option("--local-experts", local_experts, "expanded m")->check(CLI::PositiveNumber);
  app.add_option(
         "--counts", counts_path,
         "routing counts: a counts file {model: {expert_counts: ...}}, --moe-stats output or SGLang's "
         "{\"logical_count\": ...} dump")
      ->check(CLI::ExistingFile)
      ->capture_default_str();
  app.add_option("--counts-model", counts_model, "model key in a counts file (ignored by the other formats)")
      ->capture_default_str();
  app.add_option(
         "--top-k", top_k,
         "synthetic: experts per token (default: from the counts file; an error where it does not tell)")
      ->check(CLI::PositiveNumber);
  app.add_option("--domains", domains, "domains (default: all in the counts file / the five corpus domains)")
      ->delimiter(',');
  app.add_option("--count-layers", count_layers, "count-file layers, one layer call each (default all)")
      ->delimiter(',');
  app.add_option("--tokens", tokens, "synthetic: tokens per rank per step")->check(CLI::PositiveNumber);
  app.add_option("--hidden", hidden)->check(CLI::PositiveNumber);
  app.add_option("--ffn", ffn, "expert FFN width")->check(CLI::PositiveNumber);
  app.add_option("--expert-cost-rows", expert_cost_rows,
                 "synthetic: row counts at which to time one expert's FFN alone")
      ->delimiter(',')
      ->check(CLI::PositiveNumber);
  app.add_flag("--no-expert-cost", no_expert_cost, "synthetic: skip timing one expert's FFN alone");
  app.add_option("--model", model_dir)->check(CLI::ExistingDirectory)->capture_default_str();
  runtime::add_device_flag(app, device);
  app.add_option("--corpus", corpus_dir)->check(CLI::ExistingDirectory)->capture_default_str();
  app.add_option("--windows-per-rank", windows_per_rank)->check(CLI::PositiveNumber);
  app.add_option("--window", window, "text tokens per window (after one <|endoftext|>)")
      ->check(CLI::PositiveNumber);
  if (const auto bad = runtime::flag_with_empty_value({argv + 1, static_cast<std::size_t>(argc - 1)})) {
    if (world->rank() == 0)
      std::fprintf(stderr, "capserve-bench-moe-layer: %.*s has an empty value\n",
                   static_cast<int>(bad->size()), bad->data());
    return 2;
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return world->rank() == 0 ? app.exit(e) : (e.get_exit_code() == 0 ? 0 : 2);
  }

  try {
    parallel::MpiCommunicator comm;
    const std::vector<Contender> contenders =
        make_contenders(gammas, reroute_gammas, granularities, rounds, local_experts);
    if (mode == "synthetic") {
      if (device != "cpu")
        throw std::invalid_argument("--device " + device +
                                    ": the synthetic mode runs on the CPU (--mode model)");
      if (no_expert_cost) expert_cost_rows.clear();
      return run_synthetic(*world, comm, counts_path, counts_model, top_k, domains, count_layers, tokens,
                           hidden, ffn, reps, warmup, seed, contenders, threads, expert_cost_rows, out_path);
    }
    if (domains.empty()) domains = {"arxiv", "books", "code", "web", "wikipedia"};
    return run_model(*world, comm, model_dir, corpus_dir, domains, windows_per_rank, window, reps, warmup,
                     contenders, threads, device, out_path);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "capserve-bench-moe-layer: rank %d: %s\n", world->rank(), e.what());
    world->abort(1);
  }
}
