#include "parallel/capacity_stage.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <stdexcept>

#include "kernels/moe/host_executor.h"

namespace capserve::parallel {
namespace {

namespace moe = kernels::moe;

moe::ScoreKind score_kind(DropScore score) {
  switch (score) {
    case DropScore::order:
      return moe::ScoreKind::order;
    case DropScore::reverse_order:
      return moe::ScoreKind::reverse_order;
    case DropScore::random:
      return moe::ScoreKind::random;
    case DropScore::gate:
      break;
  }
  return moe::ScoreKind::gate;
}

moe::RerouteKind reroute_kind(CapacityPolicy policy) {
  switch (policy) {
    case CapacityPolicy::reroute:
      return moe::RerouteKind::reroute;
    case CapacityPolicy::expanded:
      return moe::RerouteKind::expanded;
    case CapacityPolicy::none:
    case CapacityPolicy::drop:
      break;
  }
  return moe::RerouteKind::none;
}

// The index logic writes moe::SlotState into the SlotStatus array.
static_assert(static_cast<int>(SlotStatus::kept) == static_cast<int>(moe::SlotState::kept) &&
              static_cast<int>(SlotStatus::dropped) == static_cast<int>(moe::SlotState::dropped) &&
              static_cast<int>(SlotStatus::rerouted) == static_cast<int>(moe::SlotState::rerouted));

}  // namespace

CapacityStage::CapacityStage(CapacityConfig config, Communicator& comm)
    : config_(std::move(config)), comm_(comm) {
  if (config_.policy != CapacityPolicy::none) {
    any_active_ =
        std::any_of(config_.gamma.begin(), config_.gamma.end(), [](double g) { return std::isfinite(g); });
  }
}

void CapacityStage::begin_step(std::int64_t local_tokens) {
  local_tokens_ = local_tokens;
  token_offset_ = 0;
  total_tokens_ = local_tokens;
  if (!any_active_ || !global()) return;
  gathered_.resize(static_cast<std::size_t>(comm_.size()));
  comm_.allgather(std::span<const std::int64_t>(&local_tokens, 1), gathered_);
  token_offset_ = std::accumulate(gathered_.begin(), gathered_.begin() + comm_.rank(), std::int64_t{0});
  total_tokens_ = std::accumulate(gathered_.begin(), gathered_.end(), std::int64_t{0});
}

LayerCounts CapacityStage::apply(std::int64_t layer, const ExpertPlacement& placement, LayerRouting& r) {
  const auto slots = static_cast<std::size_t>(r.tokens * r.top_k);
  std::fill(r.status.begin(), r.status.begin() + static_cast<std::ptrdiff_t>(slots), SlotStatus::kept);
  if (!config_.active(layer)) return {};
  if (placement.num_ranks() != comm_.size() || placement.num_experts() != r.num_experts)
    throw std::invalid_argument("capacity stage: the placement does not match the communicator or the model");
  if (r.tokens != local_tokens_)
    throw std::logic_error("capacity stage: begin_step was given another token count");

  const bool device = config_.granularity == CapacityGranularity::device;
  moe::CapacityInputs in;
  moe::CapacityParams& p = in.params;
  p.tokens = r.tokens;
  p.top_k = r.top_k;
  p.num_experts = r.num_experts;
  p.nbins = device ? placement.num_ranks() : r.num_experts;
  p.total_tokens = total_tokens_;
  p.token_offset = token_offset_;
  p.gamma = config_.gamma_for(layer);
  p.reroute = reroute_kind(config_.policy);
  p.rounds = config_.rounds;
  p.local_experts = config_.local_experts;
  p.score = score_kind(config_.score);
  p.seed = config_.seed;
  p.layer = layer;
  p.normalized = r.normalized;
  p.scaling = r.scaling;
  p.renormalize_after_drop = config_.renormalize_after_drop;
  if (device) {
    in.owners = placement.owners(layer);
    bin_experts_.clear();
    for (int rank = 0; rank < placement.num_ranks(); ++rank)
      bin_experts_.push_back(static_cast<std::int32_t>(placement.local_experts(layer, rank).size()));
    in.bin_experts = bin_experts_;
  }
  in.local_list = placement.local_experts(layer, comm_.rank());
  in.probs = r.probs;
  in.exempt = r.exempt;
  if (global()) in.allreduce_sum = [this](std::span<std::int64_t> values) { comm_.allreduce_sum(values); };
  in.workspace = &workspace_;
  static_assert(sizeof(SlotStatus) == sizeof(std::uint8_t));
  const moe::CapacityTotals totals = moe::schedule_capacity_on_host(
      in, r.experts, r.weights, std::span(reinterpret_cast<std::uint8_t*>(r.status.data()), r.status.size()));
  return {totals.dropped, totals.rerouted};
}

}  // namespace capserve::parallel
