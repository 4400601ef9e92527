#pragma once
// One rank's side of the server's step loop: applies a StepPlan to its engine (releases, prefill chunks of
// its sequences — a new one's first chunk after the prefix its cache holds — and decodes of its running
// ones), samples the next token of each sequence whose prompt is in and reports them, with their
// log-probabilities for the sequences that ask. Every rank runs every step, with no work if it has none: the
// forward pass is a collective. With a drafter (speculative decoding) each decode also verifies the drafts
// proposed from its sequence's history, as runtime/generator.cpp does, and reports every token the
// verification keeps. A sequence with an output constraint (SamplingParams::constraint) draws each token
// under its grammar's mask and the grammar follows the tokens kept.
#include <cstdint>
#include <memory>
#include <unordered_map>
#include <vector>

#include "runtime/engine.h"
#include "runtime/grammar/grammar_cache.h"
#include "runtime/grammar/matcher.h"
#include "runtime/sampler.h"
#include "runtime/speculative/drafter.h"
#include "server/step_plan.h"

namespace capserve::server {

class RankWorker {
 public:
  // `drafter` (optional, outliving the worker): speculative decoding, with up to drafter->max_drafts() drafts
  // per decode as each plan allows. `grammars` (optional, outliving the worker): the output constraints'
  // compiled grammars; without it a constrained sequence fails at its first draw.
  RankWorker(runtime::Engine& engine, int rank, runtime::Drafter* drafter = nullptr,
             runtime::grammar::GrammarCache* grammars = nullptr)
      : engine_(engine), rank_(rank), drafter_(drafter), grammars_(grammars) {}

  StepResult run(const StepPlan& plan);

  [[nodiscard]] std::size_t sequences() const { return sequences_.size(); }

 private:
  struct Sequence {
    runtime::SamplingParams params;
    std::vector<std::int32_t> prompt;
    std::int64_t cached = 0;     // prompt tokens its first chunk takes from the prefix cache
    std::int64_t prefilled = 0;  // prompt tokens in the cache (cached ones included)
    std::int32_t last = 0;
    std::uint64_t drawn = 0;              // tokens sampled so far: the next draw's step
    std::vector<std::int32_t> history;    // with a drafter: prompt, then the kept tokens
    std::vector<std::int32_t> generated;  // with a penalty: the kept tokens, which it counts
    // With an output constraint: where its grammar stands (null with `constraint_failed`).
    std::unique_ptr<runtime::grammar::GrammarMatcher> matcher;
    bool constraint_failed = false;
  };
  // What work item i is: a prefill chunk of prompt positions [begin, end) (it draws once at the prompt's end,
  // else never), or a decode (it draws from every row).
  struct Item {
    std::uint64_t id = 0;
    bool prefill = false;
    std::int64_t begin = 0, end = 0;
  };

  // Places this step's prefill chunks of this rank in work_, in the plan's order.
  void plan_prefills(const StepPlan& plan);

  // Places this step's decodes of this rank in work_ (after the prefills), each with its drafts.
  void plan_decodes(const StepPlan& plan);

  // Logits rows of work item i.
  [[nodiscard]] std::size_t rows_of(std::size_t item) const;
  // Draws of work item i: its last rows (a prefill's last chunk draws from its last row only, an earlier
  // chunk draws nothing; a decode draws from every row).
  [[nodiscard]] std::size_t draws_of(std::size_t item) const;
  // The matcher of a new sequence's output constraint, if it has one.
  void start_constraint(std::uint64_t id, Sequence& seq);
  // Before the draws: each constrained sequence's draw rows take only what its grammar allows there.
  void constrain_draws();
  // Scores every logits row's next token (targets_) with the step's largest top_k, in one engine call.
  void score(std::int64_t top_k);
  // Appends row's scored token and its first top_count alternatives to the result.
  void report(std::uint64_t id, std::int32_t top_count, std::size_t row, bool prompt,
              StepResult& result) const;

  runtime::Engine& engine_;
  int rank_;
  runtime::Drafter* drafter_;
  runtime::grammar::GrammarCache* grammars_;
  std::unordered_map<std::uint64_t, Sequence> sequences_;
  // Per step, reused.
  std::vector<runtime::Engine::Work> work_;
  std::vector<Item> items_;   // [i]: work_[i]'s sequence and kind
  std::size_t prefills_ = 0;  // work_'s first items; the decodes follow
  // With a drafter: each decode's fed tokens ([last, drafts...], max_drafts() + 1 slots per decode), the
  // drafter's slots and its counts, one per decode.
  std::vector<std::int32_t> feed_;
  std::vector<runtime::DraftSlot> slots_;
  std::vector<std::int64_t> draft_counts_;
  runtime::SampleBatch batch_;
  std::vector<std::int32_t> tokens_;
  std::vector<std::int32_t> targets_;
  runtime::TokenLogprobs scores_;
};

}  // namespace capserve::server
