#include "server/rank_worker.h"

namespace capserve::server {

StepResult RankWorker::run(const StepPlan& plan) {
  for (const std::uint64_t id : plan.frees) {
    if (sequences_.erase(id) > 0) engine_.release(id);
  }
  work_.clear();
  work_ids_.clear();
  for (const SequenceStart& s : plan.starts) {
    if (s.rank != rank_) continue;
    runtime::SamplingParams params;
    params.temperature = s.temperature;
    params.top_k = s.top_k;
    params.top_p = s.top_p;
    params.seed = s.seed;
    sequences_.insert_or_assign(s.id, Sequence{params, 0, 0});
    work_.push_back({s.id, s.prompt, false});
    work_ids_.push_back(s.id);
  }
  for (const std::uint64_t id : plan.decodes) {
    const auto it = sequences_.find(id);
    if (it == sequences_.end()) continue;  // another rank's
    work_.push_back({id, std::span<const std::int32_t>(&it->second.last, 1), false});
    work_ids_.push_back(id);
  }

  StepResult result;
  const runtime::Status status = engine_.step(work_);
  if (!status.ok()) {
    // The refused sequences are dropped here; rank 0 ends their requests with the error.
    for (std::size_t i = 0; i < work_ids_.size(); ++i) {
      if (sequences_.erase(work_ids_[i]) > 0) engine_.release(work_ids_[i]);
    }
    result.ok = false;
    result.error = status.message();
    return result;
  }
  controls_.clear();
  for (const std::uint64_t id : work_ids_) {
    Sequence& seq = sequences_.at(id);
    controls_.push_back(runtime::sample_controls(seq.params, seq.drawn++));
  }
  tokens_.resize(work_ids_.size());
  engine_.sample(controls_, tokens_);
  const auto counts = engine_.moe_counts();
  result.sequences.reserve(work_ids_.size());
  for (std::size_t i = 0; i < work_ids_.size(); ++i) {
    Sequence& seq = sequences_.at(work_ids_[i]);
    // A failed sequence stays until rank 0 frees it with the request it ends.
    const bool failed = kernels::is_non_finite_token(tokens_[i]);
    if (!failed) seq.last = tokens_[i];
    result.sequences.push_back({work_ids_[i], seq.last, counts[i].dropped, counts[i].rerouted,
                                failed ? SequenceFailure::non_finite_logits : SequenceFailure::none});
  }
  return result;
}

}  // namespace capserve::server
