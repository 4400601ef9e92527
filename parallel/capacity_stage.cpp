#include "parallel/capacity_stage.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include <stdexcept>
#include "kernels/moe/index_logic.h"

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

CapacityStage::CapacityStage(CapacityConfig config, Communicator& data, Communicator& control)
    : config_(std::move(config)), comm_(data), control_(control) {
  if (config_.policy != CapacityPolicy::none) {
    any_active_ =
        std::any_of(config_.gamma.begin(), config_.gamma.end(), [](double g) { return std::isfinite(g); });
  }
}

void CapacityStage::begin_step(std::int64_t local_tokens, std::int64_t exempt_tokens) {
  local_tokens_ = local_tokens;
  token_offset_ = 0;
  total_tokens_ = local_tokens;
  max_rank_tokens_ = local_tokens;
  any_exempt_ = exempt_tokens > 0;
  if (!any_active_ || !global()) return;
  const auto ranks = static_cast<std::size_t>(comm_.size());
  const std::int64_t mine[2] = {local_tokens, exempt_tokens};
  gathered_.resize(2 * ranks);
  control_.allgather(mine, gathered_);
  total_tokens_ = 0;
  max_rank_tokens_ = 0;
  any_exempt_ = false;
  for (std::size_t r = 0; r < ranks; ++r) {
    if (r < static_cast<std::size_t>(comm_.rank())) token_offset_ += gathered_[2 * r];
    total_tokens_ += gathered_[2 * r];
    max_rank_tokens_ = std::max(max_rank_tokens_, gathered_[2 * r]);
    any_exempt_ = any_exempt_ || gathered_[2 * r + 1] > 0;
  }
}

namespace {

CapacityStage::FixedBounds bounds_for(double gamma, std::int64_t total_tokens, std::int64_t rank_tokens,
                                      std::int64_t top_k, std::int64_t num_experts,
                                      std::int64_t peer_experts) {
  const std::int64_t per_expert = kernels::moe::bin_capacity(gamma, total_tokens, top_k, 1, num_experts);
  const std::int64_t per_peer = peer_experts * per_expert;
  return {std::min(rank_tokens, per_peer), std::min(rank_tokens * std::min(top_k, peer_experts), per_peer),
          per_expert};
}

}  // namespace

std::optional<CapacityStage::FixedBounds> CapacityStage::fixed_bounds(std::int64_t layer, std::int64_t top_k,
                                                                      std::int64_t num_experts,
                                                                      std::int64_t peer_experts) const {
  if (!config_.active(layer) || config_.granularity != CapacityGranularity::expert || any_exempt_ ||
      (config_.scope == CapacityScope::local && comm_.size() > 1))
    return std::nullopt;
  return bounds_for(config_.gamma_for(layer), total_tokens_, max_rank_tokens_, top_k, num_experts,
                    peer_experts);
}

std::optional<CapacityStage::FixedBounds> CapacityStage::largest_fixed_bounds(
    std::int64_t tokens, std::int64_t top_k, std::int64_t num_experts, std::int64_t peer_experts) const {
  if (!any_active_ || config_.granularity != CapacityGranularity::expert ||
      (config_.scope == CapacityScope::local && comm_.size() > 1))
    return std::nullopt;
  std::optional<FixedBounds> largest;
  for (const double gamma : config_.gamma) {
    if (!std::isfinite(gamma)) continue;
    const FixedBounds b = bounds_for(gamma, tokens, tokens, top_k, num_experts, peer_experts);
    if (!largest) largest = b;
    largest->rows = std::max(largest->rows, b.rows);
    largest->entries = std::max(largest->entries, b.entries);
    largest->expert_rows = std::max(largest->expert_rows, b.expert_rows);
  }
  return largest;
}

void CapacityStage::apply(kernels::Backend& backend, std::int64_t layer, const LayerTables& tables,
                          const LayerRouting& r) {
  if (!config_.active(layer)) {
    backend.zero(r.status);
    backend.zero(r.totals);
    return;
  }
  const std::int64_t tokens = r.experts.dims() == 0 ? 0 : r.experts.dim(0);
  const std::int64_t num_experts = r.probs.row_numel();
  if (tables.bin_experts.numel() != comm_.size() || tables.num_experts != num_experts)
    throw std::invalid_argument("capacity stage: the placement does not match the communicator or the model");
  if (!tables.first_slots.empty() &&
      (config_.granularity == CapacityGranularity::device || config_.policy == CapacityPolicy::expanded))
    throw std::invalid_argument(
        "capacity stage: device granularity and expanded reroute need one rank per expert, not replicas");
  if (tokens != local_tokens_)
    throw std::logic_error("capacity stage: begin_step was given another token count");

  const bool device = config_.granularity == CapacityGranularity::device;
  kernels::CapacityCall call;
  moe::CapacityParams& p = call.params;
  p.tokens = tokens;
  p.top_k = r.experts.row_numel();
  p.num_experts = num_experts;
  p.nbins = device ? comm_.size() : num_experts;
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
    call.owners = tables.owners;
    call.bin_experts = tables.bin_experts;
  }
  call.local_list = tables.local_list;
  call.probs = r.probs;
  call.exempt = r.exempt;
  call.experts = r.experts;
  call.weights = r.weights;
  call.status = r.status;
  call.totals = r.totals;
  if (global()) {
    call.allreduce_sum = [this, &backend](const kernels::Tensor& values) {
      comm_.allreduce_sum(values, backend.stream());
    };
  }
  backend.schedule_capacity(call);
}

}  // namespace capserve::parallel
