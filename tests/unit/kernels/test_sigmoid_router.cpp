// The sigmoid router (DeepSeek-V3-style scores: each expert's own sigmoid, no softmax) of the shared index
// logic, run by the host executor, against a reference written from the definition: per token the sigmoid of
// every logit; with group-limited routing the topk_group groups with the best single score (ties to the lower
// group) are eligible; the top-k eligible experts by score (ties to the lower id); weights = their scores,
// divided by their sum when normalising, times the scaling factor.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "kernels/moe/host_executor.h"

namespace capserve::kernels {
namespace {

struct Reference {
  std::vector<float> probs;
  std::vector<std::int32_t> experts;
  std::vector<float> weights;
};

Reference reference_route(const moe::RouterParams& p, const std::vector<float>& logits) {
  Reference r;
  const std::int64_t E = p.num_experts;
  const std::int64_t group_size = E / p.n_group;
  for (std::int64_t t = 0; t < p.tokens; ++t) {
    std::vector<float> score(static_cast<std::size_t>(E));
    for (std::int64_t e = 0; e < E; ++e)
      score[static_cast<std::size_t>(e)] =
          1.0F / (1.0F + std::exp(-logits[static_cast<std::size_t>(t * E + e)]));
    r.probs.insert(r.probs.end(), score.begin(), score.end());
    std::vector<std::int64_t> groups(static_cast<std::size_t>(p.n_group));
    std::iota(groups.begin(), groups.end(), 0);
    const auto group_best = [&](std::int64_t g) {
      return *std::max_element(score.begin() + g * group_size, score.begin() + (g + 1) * group_size);
    };
    std::stable_sort(groups.begin(), groups.end(),
                     [&](std::int64_t a, std::int64_t b) { return group_best(a) > group_best(b); });
    std::vector<std::int64_t> eligible;
    for (std::int64_t i = 0; i < p.topk_group; ++i) {
      const std::int64_t g = groups[static_cast<std::size_t>(i)];
      for (std::int64_t e = g * group_size; e < (g + 1) * group_size; ++e) eligible.push_back(e);
    }
    std::sort(eligible.begin(), eligible.end());
    std::stable_sort(eligible.begin(), eligible.end(), [&](std::int64_t a, std::int64_t b) {
      return score[static_cast<std::size_t>(a)] > score[static_cast<std::size_t>(b)];
    });
    float sum = 0.0F;
    for (std::int64_t s = 0; s < p.top_k; ++s)
      sum += score[static_cast<std::size_t>(eligible[static_cast<std::size_t>(s)])];
    for (std::int64_t s = 0; s < p.top_k; ++s) {
      const std::int64_t e = eligible[static_cast<std::size_t>(s)];
      float w = score[static_cast<std::size_t>(e)];
      if (p.normalize) w /= sum;
      r.experts.push_back(static_cast<std::int32_t>(e));
      r.weights.push_back(w * p.scaling);
    }
  }
  return r;
}

TEST(SigmoidRouter, HostExecutorEqualsTheDefinition) {
  std::mt19937_64 rng(113);
  std::normal_distribution<float> normal(0.0F, 2.0F);
  for (int trial = 0; trial < 200; ++trial) {
    moe::RouterParams p;
    p.score = moe::RouterScore::sigmoid;
    p.n_group = std::vector<std::int64_t>{1, 2, 4, 8}[static_cast<std::size_t>(trial % 4)];
    p.num_experts = p.n_group * (2 + trial % 5);
    p.topk_group = 1 + trial % p.n_group;
    const std::int64_t eligible = p.topk_group * (p.num_experts / p.n_group);
    p.top_k = 1 + trial % std::min<std::int64_t>(eligible, 6);
    p.tokens = 1 + trial % 17;
    p.normalize = trial % 2 == 0;
    p.scaling = trial % 3 == 0 ? 2.5F : 1.0F;
    std::vector<float> logits(static_cast<std::size_t>(p.tokens * p.num_experts));
    for (float& l : logits) l = trial % 5 == 0 ? std::round(normal(rng)) : normal(rng);  // rounded: many ties
    std::vector<float> probs(logits.size());
    std::vector<std::int32_t> experts(static_cast<std::size_t>(p.tokens * p.top_k));
    std::vector<float> weights(experts.size());
    moe::route_on_host(p, logits, {}, probs, experts, weights);
    const Reference want = reference_route(p, logits);
    EXPECT_EQ(probs, want.probs) << "trial " << trial;
    EXPECT_EQ(experts, want.experts) << "trial " << trial;
    for (std::size_t i = 0; i < weights.size(); ++i)
      EXPECT_FLOAT_EQ(weights[i], want.weights[i]) << "trial " << trial << " slot " << i;
  }
}

}  // namespace
}  // namespace capserve::kernels
