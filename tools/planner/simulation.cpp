#include "tools/planner/simulation.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <memory>
#include <optional>
#include <random>
#include <stdexcept>
#include <unordered_map>

#include "parallel/expert_placement.h"
#include "parallel/moe_stats.h"
#include "runtime/load_predictor.h"
#include "server/step_shape.h"
#include "server/step_trace.h"

namespace capserve::tools {
namespace {

using server::Clock;

// Where each expert's load lands: the placement's ranks, with EPLB replication an expert's load split evenly
// over its copies (slots).
class LoadPlacement {
 public:
  LoadPlacement(const SimConfig& config, const RoutingModel& routing)
      : ranks_(config.ranks), experts_(routing.experts()) {
    const std::vector<std::vector<double>> history = routing.pooled();
    if (config.redundant_per_rank > 0) {
      placement_.emplace(parallel::ExpertPlacement::replicated(history, experts_, config.ranks,
                                                               config.redundant_per_rank * config.ranks));
    } else if (config.placement == "balanced") {
      placement_.emplace(parallel::ExpertPlacement::balanced(history, experts_, config.ranks));
    } else if (config.placement == "contiguous") {
      placement_.emplace(parallel::ExpertPlacement::contiguous(routing.moe_layers(), experts_, config.ranks));
    } else {
      throw std::invalid_argument("placement " + config.placement + ": contiguous or balanced");
    }
    for (int r = 0; r < ranks_; ++r)
      slots_per_rank_ = std::max<std::int64_t>(
          slots_per_rank_, static_cast<std::int64_t>(placement_->local_experts(0, r).size()));
  }

  [[nodiscard]] std::int64_t slots_per_rank() const { return slots_per_rank_; }

  // Per rank, the load `expert_load` puts on layer `layer`'s ranks, and how many of its experts (slots)
  // have work.
  void fold(std::int64_t layer, std::span<const double> expert_load, std::span<double> rank_load,
            std::span<std::int64_t> active) const {
    std::fill(rank_load.begin(), rank_load.end(), 0.0);
    std::fill(active.begin(), active.end(), 0);
    const std::span<const std::int32_t> held = placement_->slot_experts(layer);
    const std::span<const std::int32_t> first = placement_->first_slots(layer);
    for (int r = 0; r < ranks_; ++r) {
      for (const std::int32_t slot : placement_->local_experts(layer, r)) {
        const auto expert = static_cast<std::size_t>(held[static_cast<std::size_t>(slot)]);
        if (expert_load[expert] <= 0) continue;
        rank_load[static_cast<std::size_t>(r)] += expert_load[expert] / (first[expert + 1] - first[expert]);
        ++active[static_cast<std::size_t>(r)];
      }
    }
  }

 private:
  int ranks_;
  std::int64_t experts_;
  std::optional<parallel::ExpertPlacement> placement_;
  std::int64_t slots_per_rank_ = 0;
};

// The batch selector's prediction in the planner: a prompt's tokens times its domain's mean routing, on the
// ranks that will compute it, in every MoE layer (the learned load map's role in the server). Planner
// prompts carry their domain as every token id.
class DomainLoadPredictor final : public runtime::LoadPredictor {
 public:
  DomainLoadPredictor(const RoutingModel& routing, const LoadPlacement& placement, int ranks)
      : layers_(routing.moe_layers()), ranks_(static_cast<std::size_t>(ranks)) {
    std::vector<double> rank_load(ranks_);
    std::vector<std::int64_t> active(ranks_);
    for (std::size_t d = 0; d < routing.domains().size(); ++d) {
      for (std::int64_t l = 0; l < layers_; ++l) {
        placement.fold(l, routing.share(static_cast<int>(d), l), rank_load, active);
        for (const double v : rank_load) per_token_.push_back(v * static_cast<double>(routing.top_k()));
      }
    }
  }

  void predict(std::span<const std::int32_t> prompt, std::span<float> rank_load) override {
    const std::size_t cells = static_cast<std::size_t>(layers_) * ranks_;
    const auto d = prompt.empty() ? 0 : static_cast<std::size_t>(prompt.front());
    for (std::size_t i = 0; i < cells && i < rank_load.size(); ++i)
      rank_load[i] = static_cast<float>(per_token_[d * cells + i] * static_cast<double>(prompt.size()));
  }
  [[nodiscard]] std::int64_t layers() const override { return layers_; }

 private:
  std::int64_t layers_;
  std::size_t ranks_;
  std::vector<double> per_token_;  // [domains, layers, ranks]
};

Clock::time_point at(Clock::time_point base, double seconds) {
  return base + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

double percentile(std::vector<double> v, double q) {
  if (v.empty()) return std::nan("");
  std::sort(v.begin(), v.end());
  // Nearest rank, as the load generator reports.
  const auto rank = static_cast<std::size_t>(std::ceil(q * static_cast<double>(v.size())));
  return v[std::min(v.size() - 1, rank == 0 ? 0 : rank - 1)];
}

nlohmann::json distribution(const std::vector<double>& v) {
  double sum = 0;
  for (const double x : v) sum += x;
  return {{"count", v.size()},
          {"mean", v.empty() ? std::nan("") : sum / static_cast<double>(v.size())},
          {"p50", percentile(v, 0.5)},
          {"p90", percentile(v, 0.9)},
          {"p99", percentile(v, 0.99)}};
}

}  // namespace

SimResult simulate(const SimConfig& config, const RoutingModel& routing, const StepCost& cost,
                   const std::vector<SimRequest>& requests) {
  if (config.ranks < 1) throw std::invalid_argument("ranks must be at least 1");
  if (cost.experts != routing.experts() || cost.top_k != routing.top_k() ||
      cost.moe_layers != routing.moe_layers())
    throw std::invalid_argument(
        "the step cost " + cost.name + " is for " + std::to_string(cost.moe_layers) + " MoE layers of " +
        std::to_string(cost.experts) + " experts top-" + std::to_string(cost.top_k) + "; the routing has " +
        std::to_string(routing.moe_layers()) + " of " + std::to_string(routing.experts()) + " top-" +
        std::to_string(routing.top_k()));
  const LoadPlacement placement(config, routing);
  DomainLoadPredictor predictor(routing, placement, config.ranks);
  server::SchedulerConfig scheduler_config = config.scheduler;
  scheduler_config.prefix_cache = false;
  scheduler_config.assignments_per_token = routing.top_k() * routing.moe_layers();
  server::Scheduler scheduler(scheduler_config, config.ranks, nullptr, config.predict ? &predictor : nullptr,
                              nullptr);

  const auto ranks = static_cast<std::size_t>(config.ranks);
  const auto layers = static_cast<std::size_t>(routing.moe_layers());
  const auto experts = static_cast<std::size_t>(routing.experts());
  std::mt19937_64 rng(config.seed);
  server::StepShape shape(config.ranks);
  SimResult out;
  out.requests.resize(requests.size());
  out.slots_per_rank = placement.slots_per_rank();

  struct Live {
    std::size_t index = 0;
    std::shared_ptr<server::Request> request;
    bool first_token = false;
  };
  struct Sequence {
    std::int32_t rank = 0;
    int domain = 0;
    std::int64_t prompt_left = 0;
  };
  std::vector<Live> live;
  std::unordered_map<std::uint64_t, Sequence> sequences;
  // Per step, reused.
  const std::size_t domains = routing.domains().size();
  std::vector<std::int64_t> domain_tokens(domains);
  std::vector<std::int64_t> rank_domain_tokens(ranks * domains), rank_tokens(ranks);  // local capacity's
  std::vector<std::int64_t> routed(experts);
  std::vector<double> kept(experts), routed_d(experts), rank_load(ranks), routed_rank(ranks);
  std::vector<std::int64_t> active(ranks), load_cells(layers * ranks), active_cells(layers * ranks),
      wire(layers), dropped_cells(layers);
  std::vector<server::StepResult> results(ranks);
  parallel::MoeStepStats stats;
  stats.layers.resize(layers);
  for (std::size_t l = 0; l < layers; ++l) {
    stats.layers[l].layer = static_cast<std::int64_t>(l);
    stats.layers[l].rank_load.assign(ranks, 0);
    stats.layers[l].rank_routed_load.assign(ranks, 0);
  }

  // Rows a token sends to other ranks in each layer: one per distinct rank among its top-k experts (the
  // exchange deduplicates per destination), expected over its domain's routing with its own rank any one of
  // them: sum over ranks of P(rank hit) * (R - 1) / R.
  std::vector<double> remote_rows;  // [domains, layers]
  for (std::size_t d = 0; d < routing.domains().size(); ++d) {
    for (std::size_t l = 0; l < layers; ++l) {
      placement.fold(static_cast<std::int64_t>(l),
                     routing.share(static_cast<int>(d), static_cast<std::int64_t>(l)), rank_load, active);
      double hit = 0;
      for (const double q : rank_load)
        hit += 1 - std::pow(1 - std::min(q, 1.0), static_cast<double>(routing.top_k()));
      remote_rows.push_back(hit * static_cast<double>(ranks - 1) / static_cast<double>(ranks));
    }
  }
  std::optional<server::StepTraceWriter> trace;
  if (!config.step_trace.empty()) trace.emplace(config.step_trace);
  const Clock::time_point base = Clock::now();
  double now = requests.empty() ? 0 : requests.front().at_s;
  const double first_arrival = now;
  std::size_t next = 0;
  double imbalance_sum = 0;
  std::int64_t imbalance_layers = 0;
  int idle_plans = 0;
  while (next < requests.size() || !scheduler.idle()) {
    for (; next < requests.size() && requests[next].at_s <= now; ++next) {
      const SimRequest& r = requests[next];
      runtime::SamplingParams params;
      params.max_new_tokens = r.output_tokens;
      auto request = std::make_shared<server::Request>(
          std::to_string(next),
          std::vector<std::int32_t>(static_cast<std::size_t>(r.prompt_tokens), r.domain), params,
          server::OutputForm{.text = false, .stop_strings = {}, .skip_special_tokens = true},
          Clock::time_point::max(), "", at(base, r.at_s));
      if (scheduler.submit(request).ok()) {
        live.push_back({next, std::move(request), false});
      } else {
        ++out.refused;  // the queue is full (the server answers RESOURCE_EXHAUSTED)
      }
    }
    const server::StepPlan plan = scheduler.plan(at(base, now));
    const std::span<const server::RankWork> work = shape.apply(plan);
    for (const std::uint64_t id : plan.frees) sequences.erase(id);
    if (!plan.has_work()) {
      if (next < requests.size() && scheduler.idle()) {
        now = std::max(now, requests[next].at_s);
      } else if (++idle_plans > 2) {
        if (next >= requests.size())
          throw std::runtime_error(
              "the scheduler admits nothing while requests wait (one larger than the "
              "KV cache of a rank?)");
        now = std::max(now, requests[next].at_s);
      }
      continue;
    }
    idle_plans = 0;
    for (const server::SequenceStart& s : plan.starts)
      sequences[s.id] = {s.rank, s.prompt.empty() ? 0 : s.prompt.front(),
                         static_cast<std::int64_t>(s.prompt.size()) - s.cached};

    // The step's tokens by domain, and each rank's results in its work order (chunks, then decodes).
    std::fill(domain_tokens.begin(), domain_tokens.end(), 0);
    std::fill(rank_domain_tokens.begin(), rank_domain_tokens.end(), 0);
    std::fill(rank_tokens.begin(), rank_tokens.end(), 0);
    const auto count = [&](const Sequence& s, std::int64_t tokens) {
      domain_tokens[static_cast<std::size_t>(s.domain)] += tokens;
      rank_domain_tokens[static_cast<std::size_t>(s.rank) * domains + static_cast<std::size_t>(s.domain)] +=
          tokens;
      rank_tokens[static_cast<std::size_t>(s.rank)] += tokens;
    };
    for (server::StepResult& r : results) {
      r.sequences.clear();
      r.tokens.clear();
    }
    std::int64_t step_tokens = 0;
    const auto emit = [&](std::uint64_t id, std::int32_t tokens) {
      server::StepResult& r = results[static_cast<std::size_t>(sequences.at(id).rank)];
      server::SequenceResult& s = r.sequences.emplace_back();
      s.id = id;
      s.tokens = tokens;
      for (std::int32_t i = 0; i < tokens; ++i) r.tokens.push_back(1);
    };
    for (const server::PrefillChunk& c : plan.prefills) {
      Sequence& s = sequences.at(c.id);
      count(s, c.tokens);
      step_tokens += c.tokens;
      s.prompt_left -= c.tokens;
      emit(c.id, s.prompt_left <= 0 ? 1 : 0);
      out.output_tokens += s.prompt_left <= 0 ? 1 : 0;
    }
    for (const std::uint64_t id : plan.decodes) {
      count(sequences.at(id), 1);
      ++step_tokens;
      emit(id, 1);
      ++out.output_tokens;
    }

    // Each MoE layer: routing drawn per domain (per rank and domain under local capacity), capacity per
    // expert over the step's tokens (or each rank's), placed on ranks.
    const bool bounded = std::isfinite(config.gamma);
    const auto capacity_of = [&](std::int64_t tokens) {
      return bounded ? std::ceil(config.gamma * static_cast<double>(tokens * routing.top_k()) /
                                 static_cast<double>(experts))
                     : std::numeric_limits<double>::infinity();
    };
    const bool local = bounded && config.local_capacity;
    for (std::size_t l = 0; l < layers; ++l) {
      double rows = 0;
      for (std::size_t d = 0; d < domains; ++d)
        rows += static_cast<double>(domain_tokens[d]) * remote_rows[d * layers + l];
      std::fill(routed_d.begin(), routed_d.end(), 0.0);
      std::fill(kept.begin(), kept.end(), 0.0);
      // One draw of the step's tokens over the ranks together, or one per rank bounded by its own capacity.
      for (std::size_t r = 0; r < (local ? ranks : 1); ++r) {
        std::fill(routed.begin(), routed.end(), 0);
        for (std::size_t d = 0; d < domains; ++d) {
          const std::int64_t tokens = local ? rank_domain_tokens[r * domains + d] : domain_tokens[d];
          if (tokens > 0)
            routing.draw(static_cast<int>(d), static_cast<std::int64_t>(l), tokens, rng, routed);
        }
        const double capacity = capacity_of(local ? rank_tokens[r] : step_tokens);
        for (std::size_t e = 0; e < experts; ++e) {
          routed_d[e] += static_cast<double>(routed[e]);
          kept[e] += std::min(static_cast<double>(routed[e]), capacity);
        }
      }
      dropped_cells[l] = 0;
      for (std::size_t e = 0; e < experts; ++e) {
        out.assignments += routed_d[e];
        out.dropped += routed_d[e] - kept[e];
        dropped_cells[l] += std::llround(routed_d[e] - kept[e]);
      }
      placement.fold(static_cast<std::int64_t>(l), routed_d, routed_rank, active);
      placement.fold(static_cast<std::int64_t>(l), kept, rank_load, active);
      parallel::MoeLayerStats& ls = stats.layers[l];
      ls.dropped = dropped_cells[l];
      for (std::size_t r = 0; r < ranks; ++r) {
        ls.rank_routed_load[r] = std::llround(routed_rank[r]);
        ls.rank_load[r] = std::llround(rank_load[r]);
        load_cells[l * ranks + r] = ls.rank_load[r];
        active_cells[l * ranks + r] = active[r];
      }
      // Rows to the other ranks and back (drops not deducted).
      wire[l] = std::llround(rows * static_cast<double>(cost.row_bytes) * 2.0);
      ls.wire_bytes = wire[l];
      imbalance_sum += parallel::max_over_mean(ls.rank_load);
      ++imbalance_layers;
    }
    const StepSeconds seconds =
        step_seconds(cost, {work, load_cells, active_cells, wire, dropped_cells, bounded && !local});
    if (trace && !trace->write(at(base, now), seconds.total, work, stats, active_cells))
      throw std::runtime_error("--step-trace: cannot write " + config.step_trace);
    now += seconds.total;
    out.busy_s += seconds.total;
    out.moe_s += seconds.moe;
    ++out.steps;
    scheduler.complete(results, stats, at(base, now));

    // What each request's client would have seen by the step's end.
    for (auto it = live.begin(); it != live.end();) {
      SimRequestOutcome& o = out.requests[it->index];
      const double arrival = requests[it->index].at_s;
      bool ended = false;
      while (std::optional<server::RequestEvent> e = it->request->try_next()) {
        if (!e->tokens.empty() && !it->first_token) {
          o.ttft_s = now - arrival;
          it->first_token = true;
        }
        if (e->terminal) {
          o.e2e_s = now - arrival;
          o.ok = *e->terminal == server::Terminal::ok_length || *e->terminal == server::Terminal::ok_stop;
          ended = true;
        }
      }
      it = ended ? live.erase(it) : it + 1;
    }
  }
  out.makespan_s = now - first_arrival;
  out.imbalance = imbalance_layers > 0 ? imbalance_sum / static_cast<double>(imbalance_layers) : 1.0;
  return out;
}

nlohmann::json summarize(const SimResult& r) {
  std::vector<double> ttft, e2e;
  std::int64_t ok = 0;
  for (const SimRequestOutcome& o : r.requests) {
    if (!o.ok) continue;
    ++ok;
    ttft.push_back(o.ttft_s);
    e2e.push_back(o.e2e_s);
  }
  return {
      {"requests", r.requests.size()},
      {"ok", ok},
      {"refused", r.refused},
      {"steps", r.steps},
      {"makespan_s", r.makespan_s},
      {"mean_step_s", r.steps > 0 ? r.busy_s / static_cast<double>(r.steps) : 0.0},
      {"busy_share", r.makespan_s > 0 ? r.busy_s / r.makespan_s : 0.0},
      {"moe_s", r.moe_s},
      {"busy_s", r.busy_s},
      {"output_tokens", r.output_tokens},
      {"output_tokens_per_s", r.makespan_s > 0 ? static_cast<double>(r.output_tokens) / r.makespan_s : 0.0},
      {"imbalance", r.imbalance},
      {"dropped_share", r.assignments > 0 ? r.dropped / r.assignments : 0.0},
      {"slots_per_rank", r.slots_per_rank},
      {"ttft_s", distribution(ttft)},
      {"e2e_s", distribution(e2e)}};
}

}  // namespace capserve::tools
