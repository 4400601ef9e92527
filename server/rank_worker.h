#pragma once
// One rank's side of the server's step loop: applies a StepPlan to its engine (releases, prefills of the new
// sequences placed on this rank, decodes of its running ones), samples each of its sequences' next token and
// reports them, with their log-probabilities for the sequences that ask. Every rank runs every step, with no
// work if it has none: the forward pass is a collective. With a drafter (speculative decoding) each decode
// also verifies the drafts proposed from its sequence's history, as runtime/generator.cpp does, and reports
// every token the verification keeps.
#include <cstdint>
#include <unordered_map>
#include <vector>

#include "runtime/engine.h"
#include "runtime/sampler.h"
#include "runtime/speculative/drafter.h"
#include "server/step_plan.h"

namespace capserve::server {

class RankWorker {
 public:
  // `drafter` (optional, outliving the worker): speculative decoding, with up to drafter->max_drafts() drafts
  // per decode as each plan allows.
  RankWorker(runtime::Engine& engine, int rank, runtime::Drafter* drafter = nullptr)
      : engine_(engine), rank_(rank), drafter_(drafter) {}

  StepResult run(const StepPlan& plan);

  [[nodiscard]] std::size_t sequences() const { return sequences_.size(); }

 private:
  struct Sequence {
    runtime::SamplingParams params;
    std::int32_t last = 0;
    std::uint64_t drawn = 0;            // tokens sampled so far: the next draw's step
    std::vector<std::int32_t> history;  // with a drafter: prompt, then the kept tokens
  };

  // Places this step's decodes of this rank in work_ (after the prefills), each with its drafts.
  void plan_decodes(const StepPlan& plan);

  // Logits rows of work item i.
  [[nodiscard]] std::size_t rows_of(std::size_t item) const;
  // Draws of work item i: its last rows (a prefill draws from its last row only; a decode from every row).
  [[nodiscard]] std::size_t draws_of(std::size_t item) const;
  // Scores every logits row's next token (targets_) with the step's largest top_k, in one engine call.
  void score(std::int64_t top_k);
  // Appends row's scored token and its first top_count alternatives to the result.
  void report(std::uint64_t id, std::int32_t top_count, std::size_t row, bool prompt,
              StepResult& result) const;

  runtime::Engine& engine_;
  int rank_;
  runtime::Drafter* drafter_;
  std::unordered_map<std::uint64_t, Sequence> sequences_;
  // Per step, reused.
  std::vector<runtime::Engine::Work> work_;
  std::vector<std::uint64_t> work_ids_;
  std::size_t prefills_ = 0;  // work_'s first items; the decodes follow
  // With a drafter: each decode's fed tokens ([last, drafts...], max_drafts() + 1 slots per decode), the
  // drafter's slots and its counts, one per decode.
  std::vector<std::int32_t> feed_;
  std::vector<runtime::DraftSlot> slots_;
  std::vector<std::int64_t> draft_counts_;
  std::vector<kernels::SampleControls> controls_;
  std::vector<std::int32_t> tokens_;
  std::vector<std::int32_t> targets_;
  runtime::TokenLogprobs scores_;
};

}  // namespace capserve::server
