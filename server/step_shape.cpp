#include "server/step_shape.h"

#include <algorithm>

namespace capserve::server {
namespace {

// A chunk of `tokens` after `before` cached tokens: token i attends to before + i + 1 positions.
std::int64_t chunk_pairs(std::int64_t before, std::int64_t tokens) {
  return tokens * before + tokens * (tokens + 1) / 2;
}

}  // namespace

std::span<const RankWork> StepShape::apply(const StepPlan& plan) {
  std::fill(work_.begin(), work_.end(), RankWork{});
  for (const std::uint64_t id : plan.frees) sequences_.erase(id);
  for (const SequenceStart& s : plan.starts) sequences_[s.id] = {s.rank, s.cached};
  const auto on = [&](std::uint64_t id) -> std::pair<Sequence*, RankWork*> {
    const auto it = sequences_.find(id);
    if (it == sequences_.end()) return {nullptr, nullptr};
    const auto rank = static_cast<std::size_t>(it->second.rank);
    return {&it->second, rank < work_.size() ? &work_[rank] : nullptr};
  };
  for (const PrefillChunk& c : plan.prefills) {
    const auto [seq, work] = on(c.id);
    if (work == nullptr) continue;
    work->tokens += c.tokens;
    work->attention_pairs += chunk_pairs(seq->length, c.tokens);
    seq->length += c.tokens;
  }
  for (std::size_t i = 0; i < plan.decodes.size(); ++i) {
    const auto [seq, work] = on(plan.decodes[i]);
    if (work == nullptr) continue;
    const std::int64_t tokens = 1 + (i < plan.max_drafts.size() ? plan.max_drafts[i] : 0);
    work->tokens += tokens;
    ++work->decodes;
    const std::int64_t pairs = chunk_pairs(seq->length, tokens);
    work->attention_pairs += pairs;
    work->decode_pairs += pairs;
    ++seq->length;
  }
  return work_;
}

}  // namespace capserve::server
