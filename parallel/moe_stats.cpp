#include "parallel/moe_stats.h"

#include <algorithm>
#include <numeric>

#include <nlohmann/json.hpp>

namespace capserve::parallel {
namespace {

void add_into(std::vector<std::int64_t>& dst, const std::vector<std::int64_t>& src) {
  if (dst.size() < src.size()) dst.resize(src.size(), 0);
  for (std::size_t i = 0; i < src.size(); ++i) dst[i] += src[i];
}

}  // namespace

double max_over_mean(std::span<const std::int64_t> loads) {
  if (loads.empty()) return 1.0;
  const std::int64_t total = std::accumulate(loads.begin(), loads.end(), std::int64_t{0});
  if (total == 0) return 1.0;
  const std::int64_t mx = *std::max_element(loads.begin(), loads.end());
  return static_cast<double>(mx) * static_cast<double>(loads.size()) / static_cast<double>(total);
}

StepStatsRecorder::StepStatsRecorder(std::vector<std::int64_t> moe_layers, std::int64_t num_experts,
                                     int num_ranks, std::int64_t num_copies) {
  local_.layers.resize(moe_layers.size());
  for (std::size_t i = 0; i < moe_layers.size(); ++i) {
    MoeLayerStats& s = local_.layers[i];
    s.layer = moe_layers[i];
    s.routed_load.assign(static_cast<std::size_t>(num_experts), 0);
    s.expert_load.assign(static_cast<std::size_t>(num_experts), 0);
    s.rank_routed_load.assign(static_cast<std::size_t>(num_ranks), 0);
    s.rank_load.assign(static_cast<std::size_t>(num_ranks), 0);
    s.routed_slot_load.assign(static_cast<std::size_t>(num_copies), 0);
    s.slot_load.assign(static_cast<std::size_t>(num_copies), 0);
  }
}

void StepStatsRecorder::begin_step() {
  for (MoeLayerStats& s : local_.layers) {
    s.tokens = s.assignments = s.dropped = s.rerouted = s.rows_dispatched = s.wire_bytes = 0;
    std::fill(s.routed_load.begin(), s.routed_load.end(), 0);
    std::fill(s.expert_load.begin(), s.expert_load.end(), 0);
    s.scheduler_seconds = s.dispatch_seconds = s.expert_seconds = s.combine_seconds = 0;
  }
}

void StepStatsRecorder::reduce(Communicator& comm) {
  packed_counts_.clear();
  packed_times_.clear();
  for (const MoeLayerStats& s : local_.layers) {
    packed_counts_.insert(packed_counts_.end(), {s.tokens, s.assignments, s.wire_bytes});
    packed_times_.insert(packed_times_.end(),
                         {s.scheduler_seconds, s.dispatch_seconds, s.expert_seconds, s.combine_seconds});
  }
  if (comm.size() > 1) {
    comm.allreduce_sum(packed_counts_);
    comm.allreduce_max(packed_times_);
  }
  std::size_t c = 0;
  std::size_t t = 0;
  for (MoeLayerStats& s : local_.layers) {
    for (std::int64_t* v : {&s.tokens, &s.assignments, &s.wire_bytes}) *v = packed_counts_[c++];
    for (double* v : {&s.scheduler_seconds, &s.dispatch_seconds, &s.expert_seconds, &s.combine_seconds})
      *v = packed_times_[t++];
  }
}

void StepStatsRecorder::add_reports(std::span<const std::int64_t> reports, const ExpertPlacement& placement) {
  std::size_t at = 0;
  for (MoeLayerStats& s : local_.layers) {
    const LayerReport layout{static_cast<std::int64_t>(s.routed_load.size()),
                             static_cast<std::int64_t>(s.slot_load.size())};
    const std::span<const std::int64_t> r = reports.subspan(at, static_cast<std::size_t>(layout.size()));
    at += r.size();
    s.dropped = r[LayerReport::kDropped];
    s.rerouted = r[LayerReport::kRerouted];
    s.rows_dispatched = r[LayerReport::kRowsSent];
    const auto e = s.routed_load.size();
    std::copy_n(r.begin() + LayerReport::kRoutedLoad, e, s.routed_load.begin());
    std::copy_n(r.begin() + layout.kept_load(), e, s.expert_load.begin());
    const auto copies = s.slot_load.size();
    std::copy_n(r.begin() + layout.routed_copy_load(), copies, s.routed_slot_load.begin());
    std::copy_n(r.begin() + layout.kept_copy_load(), copies, s.slot_load.begin());
    std::fill(s.rank_routed_load.begin(), s.rank_routed_load.end(), 0);
    std::fill(s.rank_load.begin(), s.rank_load.end(), 0);
    // The placement's owners are per slot: per expert without replication, per copy with.
    const std::vector<std::int64_t>& routed = copies > 0 ? s.routed_slot_load : s.routed_load;
    const std::vector<std::int64_t>& kept = copies > 0 ? s.slot_load : s.expert_load;
    const std::span<const std::int32_t> owners = placement.owners(s.layer);
    for (std::size_t x = 0; x < routed.size(); ++x) {
      s.rank_routed_load[static_cast<std::size_t>(owners[x])] += routed[x];
      s.rank_load[static_cast<std::size_t>(owners[x])] += kept[x];
    }
  }
}

void RunStats::add(const MoeStepStats& step) {
  ++steps_;
  if (totals_.layers.empty()) {
    totals_ = step;
    imbalance_sum_.assign(step.layers.size(), {});
    for (MoeLayerStats& s : totals_.layers) {
      s.tokens = s.assignments = s.dropped = s.rerouted = s.rows_dispatched = s.wire_bytes = 0;
      for (auto* v : {&s.routed_load, &s.expert_load, &s.rank_routed_load, &s.rank_load, &s.routed_slot_load,
                      &s.slot_load})
        std::fill(v->begin(), v->end(), 0);
      s.scheduler_seconds = s.dispatch_seconds = s.expert_seconds = s.combine_seconds = 0;
    }
  }
  for (std::size_t i = 0; i < step.layers.size(); ++i) {
    const MoeLayerStats& s = step.layers[i];
    MoeLayerStats& sum = totals_.layers[i];
    sum.tokens += s.tokens;
    sum.assignments += s.assignments;
    sum.dropped += s.dropped;
    sum.rerouted += s.rerouted;
    sum.rows_dispatched += s.rows_dispatched;
    sum.wire_bytes += s.wire_bytes;
    add_into(sum.routed_load, s.routed_load);
    add_into(sum.expert_load, s.expert_load);
    add_into(sum.rank_routed_load, s.rank_routed_load);
    add_into(sum.rank_load, s.rank_load);
    add_into(sum.routed_slot_load, s.routed_slot_load);
    add_into(sum.slot_load, s.slot_load);
    sum.scheduler_seconds += s.scheduler_seconds;
    sum.dispatch_seconds += s.dispatch_seconds;
    sum.expert_seconds += s.expert_seconds;
    sum.combine_seconds += s.combine_seconds;
    if (s.tokens > 0) {
      Imbalance& im = imbalance_sum_[i];
      im.expert += s.expert_imbalance();
      im.routed_expert += s.routed_expert_imbalance();
      im.rank += s.rank_imbalance();
      im.routed_rank += s.routed_rank_imbalance();
      ++im.steps;
    }
  }
}

std::string RunStats::to_json(const std::string& extra_config) const {
  nlohmann::json out;
  out["steps"] = steps_;
  out["config"] = extra_config;
  out["layers"] = nlohmann::json::array();
  for (std::size_t i = 0; i < totals_.layers.size(); ++i) {
    const MoeLayerStats& s = totals_.layers[i];
    const Imbalance& im = imbalance_sum_[i];
    const double n = im.steps > 0 ? static_cast<double>(im.steps) : 1.0;
    out["layers"].push_back(
        {{"layer", s.layer},
         {"tokens", s.tokens},
         {"assignments", s.assignments},
         {"kept", s.kept()},
         {"dropped", s.dropped},
         {"rerouted", s.rerouted},
         {"drop_fraction",
          s.assignments > 0 ? static_cast<double>(s.dropped) / static_cast<double>(s.assignments) : 0.0},
         {"routed_load", s.routed_load},
         {"expert_load", s.expert_load},
         {"rank_routed_load", s.rank_routed_load},
         {"rank_load", s.rank_load},
         {"mean_step_expert_max_over_mean", im.expert / n},
         {"mean_step_routed_expert_max_over_mean", im.routed_expert / n},
         {"mean_step_rank_max_over_mean", im.rank / n},
         {"mean_step_routed_rank_max_over_mean", im.routed_rank / n},
         {"rows_dispatched", s.rows_dispatched},
         {"wire_bytes", s.wire_bytes},
         {"scheduler_seconds", s.scheduler_seconds},
         {"dispatch_seconds", s.dispatch_seconds},
         {"expert_seconds", s.expert_seconds},
         {"combine_seconds", s.combine_seconds}});
    if (!s.slot_load.empty()) {
      out["layers"].back()["routed_slot_load"] = s.routed_slot_load;
      out["layers"].back()["slot_load"] = s.slot_load;
    }
  }
  return out.dump(1);
}

}  // namespace capserve::parallel
