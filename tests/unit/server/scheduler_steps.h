#pragma once
// Drives a Scheduler without ranks, as the ranks would answer its plans: every prefill chunk that ends its
// prompt and every decode samples the given token, earlier chunks sample nothing. Shared by the tests of the
// scheduler and of the front ends over it.
#include <cstdint>
#include <span>
#include <unordered_map>

#include <gtest/gtest.h>

#include "server/scheduler.h"

namespace capserve::server {

// Appends sequence `id`'s one kept token to a step result.
inline void add_token(StepResult& result, std::uint64_t id, std::int32_t token) {
  result.sequences.push_back({id, 1, 0, 0});
  result.tokens.push_back(token);
}

class SchedulerSteps {
 public:
  explicit SchedulerSteps(Scheduler& scheduler) : scheduler_(scheduler) {}

  // Plans and completes one step; returns its plan.
  StepPlan step(std::int32_t token) {
    StepPlan plan = scheduler_.plan(Clock::now());
    for (const SequenceStart& s : plan.starts)
      left_[s.id] = static_cast<std::int64_t>(s.prompt.size()) - s.cached;
    StepResult result;
    for (const PrefillChunk& c : plan.prefills) {
      left_[c.id] -= c.tokens;
      EXPECT_GE(left_[c.id], 0) << "a chunk past its prompt";
      if (left_[c.id] == 0) {
        add_token(result, c.id, token);
      } else {
        result.sequences.push_back({c.id, 0, 0, 0});
      }
    }
    for (const std::uint64_t id : plan.decodes) add_token(result, id, token);
    scheduler_.complete(std::span<const StepResult>(&result, 1), {}, Clock::now());
    return plan;
  }

 private:
  Scheduler& scheduler_;
  std::unordered_map<std::uint64_t, std::int64_t> left_;  // prompt tokens not yet prefilled, per sequence
};

}  // namespace capserve::server
