#pragma once
// One rank's side of the server's step loop: applies a StepPlan to its engine (releases, prefills of the new
// sequences placed on this rank, decodes of its running ones), samples each of its sequences' next token and
// reports them, with their log-probabilities for the sequences that ask. Every rank runs every step, with no
// work if it has none: the forward pass is a collective.
#include <cstdint>
#include <unordered_map>
#include <vector>

#include "runtime/engine.h"
#include "runtime/sampler.h"
#include "server/step_plan.h"

namespace capserve::server {

class RankWorker {
 public:
  RankWorker(runtime::Engine& engine, int rank) : engine_(engine), rank_(rank) {}

  StepResult run(const StepPlan& plan);

  [[nodiscard]] std::size_t sequences() const { return sequences_.size(); }

 private:
  struct Sequence {
    runtime::SamplingParams params;
    std::int32_t last = 0;
    std::uint64_t drawn = 0;  // tokens sampled so far: the next draw's step
  };

  // Logits rows of work item i.
  [[nodiscard]] std::size_t rows_of(std::size_t item) const;
  // Scores every logits row's next token (targets_) with the step's largest top_k, in one engine call.
  void score(std::int64_t top_k);
  // Appends row's scored token and its first top_count alternatives to the result.
  void report(std::uint64_t id, std::int32_t top_count, std::size_t row, bool prompt,
              StepResult& result) const;

  runtime::Engine& engine_;
  int rank_;
  std::unordered_map<std::uint64_t, Sequence> sequences_;
  // Per step, reused.
  std::vector<runtime::Engine::Work> work_;
  std::vector<std::uint64_t> work_ids_;
  std::vector<kernels::SampleControls> controls_;
  std::vector<std::int32_t> tokens_;
  std::vector<std::int32_t> targets_;
  runtime::TokenLogprobs scores_;
};

}  // namespace capserve::server
