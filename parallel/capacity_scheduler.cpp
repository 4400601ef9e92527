#include "parallel/capacity_scheduler.h"

#include "kernels/cuda/moe_index_logic.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <stdexcept>
#include <string>

namespace capserve::parallel {
namespace {

using kernels::moe::kLow32;

// The selection key is shared with the CUDA scheduler (kernels/cuda/moe_index_logic.h), so both order
// assignments identically.
kernels::moe::ScoreKind score_kind(DropScore score) {
  switch (score) {
    case DropScore::order:
      return kernels::moe::ScoreKind::order;
    case DropScore::reverse_order:
      return kernels::moe::ScoreKind::reverse_order;
    case DropScore::random:
      return kernels::moe::ScoreKind::random;
    case DropScore::gate:
      break;
  }
  return kernels::moe::ScoreKind::gate;
}

}  // namespace

CapacityScheduler::CapacityScheduler(CapacityConfig config, Communicator& comm)
    : config_(std::move(config)), comm_(comm) {
  if (config_.policy != CapacityPolicy::none) {
    any_active_ =
        std::any_of(config_.gamma.begin(), config_.gamma.end(), [](double g) { return std::isfinite(g); });
  }
}

void CapacityScheduler::begin_step(std::int64_t local_tokens) {
  local_tokens_ = local_tokens;
  token_offset_ = 0;
  total_tokens_ = local_tokens;
  if (!any_active_ || !global()) return;
  gathered_.resize(static_cast<std::size_t>(comm_.size()));
  comm_.allgather(std::span<const std::int64_t>(&local_tokens, 1), gathered_);
  token_offset_ = std::accumulate(gathered_.begin(), gathered_.begin() + comm_.rank(), std::int64_t{0});
  total_tokens_ = std::accumulate(gathered_.begin(), gathered_.end(), std::int64_t{0});
}

std::uint64_t CapacityScheduler::key(std::int64_t layer, std::int64_t token, std::int64_t slot,
                                     std::int32_t expert, float weight, std::int64_t top_k,
                                     std::int64_t num_experts) const {
  return kernels::moe::selection_key(score_kind(config_.score), config_.seed, layer,
                                     static_cast<std::uint64_t>(token_offset_ + token), slot, expert, weight,
                                     top_k, num_experts);
}

void CapacityScheduler::select_per_bin(std::int64_t nbins, std::span<const std::int64_t> capacity) {
  const auto n = static_cast<std::size_t>(nbins);
  threshold_.assign(n, 0);
  take_none_.assign(n, 0);
  prefix_.assign(n, 0);
  need_.assign(n, 0);
  hist_row_.assign(n, -1);
  unresolved_.clear();
  for (std::size_t b = 0; b < n; ++b) {
    if (counts_[b] <= capacity[b]) continue;  // everything fits: threshold 0 keeps all
    if (capacity[b] <= 0) {
      take_none_[b] = 1;
      continue;
    }
    need_[b] = capacity[b];
    unresolved_.push_back(static_cast<std::int32_t>(b));
  }
  const std::size_t candidates = cand_key_.size();
  // Radix select from the top byte down: each round fixes one more byte of each full bin's threshold key.
  for (int shift = 56; !unresolved_.empty(); shift -= 8) {
    for (std::size_t i = 0; i < unresolved_.size(); ++i)
      hist_row_[static_cast<std::size_t>(unresolved_[i])] = static_cast<std::int32_t>(i);
    hist_.assign(unresolved_.size() * 256, 0);
    const std::uint64_t high_mask = shift == 56 ? 0 : ~std::uint64_t{0} << (shift + 8);
    for (std::size_t i = 0; i < candidates; ++i) {
      const auto b = static_cast<std::size_t>(cand_bin_[i]);
      const std::int32_t row = hist_row_[b];
      if (row < 0 || (cand_key_[i] & high_mask) != prefix_[b]) continue;
      ++hist_[static_cast<std::size_t>(row) * 256 + ((cand_key_[i] >> shift) & 0xFF)];
    }
    if (global()) comm_.allreduce_sum(hist_);
    std::size_t still = 0;
    for (std::size_t i = 0; i < unresolved_.size(); ++i) {
      const auto b = static_cast<std::size_t>(unresolved_[i]);
      hist_row_[b] = -1;
      std::int64_t above = 0;
      for (int d = 255; d >= 0; --d) {
        const std::int64_t c = hist_[i * 256 + static_cast<std::size_t>(d)];
        if (above + c < need_[b]) {
          above += c;
          continue;
        }
        prefix_[b] |= static_cast<std::uint64_t>(d) << shift;
        if (above + c == need_[b]) {
          threshold_[b] = prefix_[b];  // the whole bucket fits: keep it and everything above
        } else {
          need_[b] -= above;
          unresolved_[still++] = static_cast<std::int32_t>(b);
        }
        break;
      }
    }
    unresolved_.resize(still);
    if (shift == 0 && !unresolved_.empty())
      throw std::logic_error("capacity scheduler: selection keys are not unique");
  }
  cand_keep_.resize(candidates);
  for (std::size_t i = 0; i < candidates; ++i) {
    const auto b = static_cast<std::size_t>(cand_bin_[i]);
    cand_keep_[i] = take_none_[b] == 0 && cand_key_[i] >= threshold_[b] ? 1 : 0;
  }
}

LayerCounts CapacityScheduler::apply(std::int64_t layer, const ExpertPlacement& placement, LayerRouting& r) {
  const std::int64_t T = r.tokens;
  const std::int64_t k = r.top_k;
  const std::int64_t E = r.num_experts;
  const auto slots = static_cast<std::size_t>(T * k);
  std::fill(r.status.begin(), r.status.begin() + static_cast<std::ptrdiff_t>(slots), SlotStatus::kept);
  if (!config_.active(layer)) return {};
  if (placement.num_ranks() != comm_.size() || placement.num_experts() != E)
    throw std::invalid_argument(
        "capacity scheduler: the placement does not match the communicator or the model");
  if (T != local_tokens_)
    throw std::logic_error("capacity scheduler: begin_step was given another token count");
  if (static_cast<std::uint64_t>(total_tokens_) * static_cast<std::uint64_t>(k) > kLow32)
    throw std::length_error("capacity scheduler: more than 2^32 assignments in one step");

  const bool device = config_.granularity == CapacityGranularity::device;
  const std::int64_t nbins = device ? placement.num_ranks() : E;
  const std::span<const std::int32_t> owners = placement.owners(layer);
  const auto bin_of = [&](std::int32_t e) { return device ? owners[static_cast<std::size_t>(e)] : e; };

  // Capacities from the step's tokens over the scope: ceil(gamma * N_bar * experts in the bin) with
  // N_bar = T * k / E, evaluated as gamma * (T * k * n) / E. The integer product is exact, so there is one
  // rounding in the product with gamma and one in the division: when gamma * T * k * n / E is a whole number
  // (for any gamma with a short binary fraction: 0.25, 0.75, 1.25, ...) the quotient is exact and the ceiling
  // cannot round it up. (gamma * (T * k / E) * n rounds three times: 0.25 * (84 / 19) * 19 is
  // 21.000000000000004, a device capacity of 22 instead of 21.)
  const double gamma = config_.gamma_for(layer);
  capacity_.resize(static_cast<std::size_t>(nbins));
  for (std::int64_t b = 0; b < nbins; ++b) {
    const std::int64_t experts_in_bin =
        device ? static_cast<std::int64_t>(placement.local_experts(layer, static_cast<int>(b)).size()) : 1;
    const std::int64_t assignments = total_tokens_ * k * experts_in_bin;
    capacity_[static_cast<std::size_t>(b)] = static_cast<std::int64_t>(
        std::ceil(gamma * static_cast<double>(assignments) / static_cast<double>(E)));
  }

  original_.assign(r.experts.begin(), r.experts.begin() + static_cast<std::ptrdiff_t>(slots));
  denominator_.resize(static_cast<std::size_t>(T));
  original_weight_sum_.resize(static_cast<std::size_t>(T));
  for (std::int64_t t = 0; t < T; ++t) {
    float p = 0.0F;
    float w = 0.0F;
    for (std::int64_t s = 0; s < k; ++s) {
      p += r.probs[static_cast<std::size_t>(t * E + r.experts[static_cast<std::size_t>(t * k + s)])];
      w += r.weights[static_cast<std::size_t>(t * k + s)];
    }
    denominator_[static_cast<std::size_t>(t)] = p;
    original_weight_sum_[static_cast<std::size_t>(t)] = w;
  }

  // Drop: every assignment of a scheduled token competes; exempt ones are kept and use up capacity first.
  counts_.assign(static_cast<std::size_t>(2 * nbins), 0);
  cand_bin_.clear();
  cand_key_.clear();
  cand_slot_.clear();
  for (std::int64_t t = 0; t < T; ++t) {
    const bool exempt = !r.exempt.empty() && r.exempt[static_cast<std::size_t>(t)] != 0;
    for (std::int64_t s = 0; s < k; ++s) {
      const std::size_t slot = static_cast<std::size_t>(t * k + s);
      const std::int32_t e = r.experts[slot];
      const auto b = static_cast<std::size_t>(bin_of(e));
      if (exempt) {
        ++counts_[static_cast<std::size_t>(nbins) + b];
        continue;
      }
      ++counts_[b];
      cand_bin_.push_back(static_cast<std::int32_t>(b));
      cand_key_.push_back(key(layer, t, s, e, r.weights[slot], k, E));
      cand_slot_.push_back(static_cast<std::int64_t>(slot));
    }
  }
  if (global()) comm_.allreduce_sum(counts_);
  room_.resize(static_cast<std::size_t>(nbins));
  cand_capacity_.resize(static_cast<std::size_t>(nbins));
  for (std::int64_t b = 0; b < nbins; ++b) {
    const auto i = static_cast<std::size_t>(b);
    const std::int64_t exempt = counts_[static_cast<std::size_t>(nbins) + i];
    cand_capacity_[i] = std::max<std::int64_t>(0, capacity_[i] - exempt);
    const std::int64_t kept = exempt + std::min(counts_[i], cand_capacity_[i]);
    room_[i] = std::max<std::int64_t>(0, capacity_[i] - kept);
  }
  select_per_bin(nbins, cand_capacity_);
  for (std::size_t i = 0; i < cand_slot_.size(); ++i) {
    if (cand_keep_[i] != 0) continue;
    const auto slot = static_cast<std::size_t>(cand_slot_[i]);
    r.experts[slot] = -1;
    r.weights[slot] = 0.0F;
    r.status[slot] = SlotStatus::dropped;
  }

  if (config_.policy == CapacityPolicy::reroute || config_.policy == CapacityPolicy::expanded)
    reroute(layer, placement, r);

  LayerCounts counts;
  for (std::int64_t t = 0; t < T; ++t) {
    float kept_sum = 0.0F;
    bool lost = false;
    for (std::int64_t s = 0; s < k; ++s) {
      const SlotStatus st = r.status[static_cast<std::size_t>(t * k + s)];
      counts.dropped += st == SlotStatus::dropped ? 1 : 0;
      counts.rerouted += st == SlotStatus::rerouted ? 1 : 0;
      lost = lost || st == SlotStatus::dropped;
      kept_sum += r.weights[static_cast<std::size_t>(t * k + s)];
    }
    if (config_.renormalize_after_drop && lost && kept_sum > 0.0F) {
      const float f = original_weight_sum_[static_cast<std::size_t>(t)] / kept_sum;
      for (std::int64_t s = 0; s < k; ++s) r.weights[static_cast<std::size_t>(t * k + s)] *= f;
    }
  }
  return counts;
}

void CapacityScheduler::reroute(std::int64_t layer, const ExpertPlacement& placement, LayerRouting& r) {
  const std::int64_t T = r.tokens;
  const std::int64_t k = r.top_k;
  const std::int64_t E = r.num_experts;
  const bool device = config_.granularity == CapacityGranularity::device;
  const std::int64_t nbins = device ? placement.num_ranks() : E;
  const std::span<const std::int32_t> owners = placement.owners(layer);
  const auto bin_of = [&](std::int32_t e) { return device ? owners[static_cast<std::size_t>(e)] : e; };
  const bool expanded = config_.policy == CapacityPolicy::expanded;
  const std::int64_t m = config_.local_experts;
  const auto prob = [&](std::int64_t t, std::int32_t e) {
    return r.probs[static_cast<std::size_t>(t * E + e)];
  };
  const auto in_row = [](const std::int32_t* row, std::int64_t n, std::int32_t e) {
    return std::find(row, row + n, e) != row + n;
  };

  // Expanded drop: each token's fallback set is its m most probable experts on this rank outside its top-k.
  if (expanded) {
    const std::span<const std::int32_t> local = placement.local_experts(layer, comm_.rank());
    local_choice_.assign(static_cast<std::size_t>(T * m), -1);
    for (std::int64_t t = 0; t < T; ++t) {
      std::int32_t* choice = local_choice_.data() + t * m;
      const std::int32_t* orig = original_.data() + t * k;
      for (std::int64_t j = 0; j < m; ++j) {
        std::int32_t best = -1;
        for (const std::int32_t e : local) {
          if (in_row(orig, k, e) || in_row(choice, j, e)) continue;
          if (best < 0 || prob(t, e) > prob(t, best)) best = e;
        }
        choice[j] = best;
      }
    }
  }

  for (std::int64_t round = 0; round < config_.rounds; ++round) {
    cand_bin_.clear();
    cand_key_.clear();
    cand_slot_.clear();
    cand_expert_.clear();
    counts_.assign(static_cast<std::size_t>(nbins), 0);
    for (std::int64_t t = 0; t < T; ++t) {
      const std::size_t first_candidate = cand_expert_.size();
      for (std::int64_t s = 0; s < k; ++s) {
        const auto slot = static_cast<std::size_t>(t * k + s);
        if (r.status[slot] != SlotStatus::dropped) continue;
        // Not an expert this token already chose (originally, by an earlier reroute, or in this round).
        const auto taken = [&](std::int32_t e) {
          return in_row(original_.data() + t * k, k, e) || in_row(r.experts.data() + t * k, k, e) ||
                 std::find(cand_expert_.begin() + static_cast<std::ptrdiff_t>(first_candidate),
                           cand_expert_.end(), e) != cand_expert_.end();
        };
        std::int32_t best = -1;
        const auto consider = [&](std::int32_t e) {
          if (e < 0 || room_[static_cast<std::size_t>(bin_of(e))] <= 0 || taken(e)) return;
          if (best < 0 || prob(t, e) > prob(t, best)) best = e;
        };
        if (expanded) {
          for (std::int64_t j = 0; j < m; ++j) consider(local_choice_[static_cast<std::size_t>(t * m + j)]);
        } else {
          for (std::int32_t e = 0; e < E; ++e) consider(e);
        }
        if (best < 0) continue;
        const float p = prob(t, best);
        const float w = (r.normalized ? p / denominator_[static_cast<std::size_t>(t)] : p) * r.scaling;
        const auto b = static_cast<std::size_t>(bin_of(best));
        ++counts_[b];
        cand_bin_.push_back(static_cast<std::int32_t>(b));
        cand_key_.push_back(key(layer, t, s, best, w, k, E));
        cand_slot_.push_back(static_cast<std::int64_t>(slot));
        cand_expert_.push_back(best);
      }
    }
    if (global()) comm_.allreduce_sum(counts_);
    if (std::all_of(counts_.begin(), counts_.end(), [](std::int64_t c) { return c == 0; })) break;
    select_per_bin(nbins, room_);
    for (std::size_t i = 0; i < cand_slot_.size(); ++i) {
      if (cand_keep_[i] == 0) continue;
      const auto slot = static_cast<std::size_t>(cand_slot_[i]);
      const std::int64_t t = cand_slot_[i] / k;
      const std::int32_t e = cand_expert_[i];
      const float p = prob(t, e);
      r.experts[slot] = e;
      r.weights[slot] = (r.normalized ? p / denominator_[static_cast<std::size_t>(t)] : p) * r.scaling;
      r.status[slot] = SlotStatus::rerouted;
    }
    for (std::int64_t b = 0; b < nbins; ++b) {
      const auto i = static_cast<std::size_t>(b);
      room_[i] -= std::min(counts_[i], room_[i]);
    }
  }
}

}  // namespace capserve::parallel
