// StepLoad: a step's predicted load per (MoE layer, rank), and the comparison with the realized one. The
// prediction is the decodes' expected load plus each admitted prompt's share; after the step the realized
// load of every balanced layer is what the next step's decodes are expected to weigh per token; the imbalance
// the metrics report is the mean over layers of each layer's max/mean rank load (a layer waits for its
// busiest rank), not the max/mean over all cells.
#include "server/step_load.h"

#include <gtest/gtest.h>

#include <sstream>
#include <string>
#include <vector>

#include "server/server_metrics.h"

namespace capserve::server {
namespace {

// The value of the first sample of `name` in a text exposition.
double sample(const std::string& text, const std::string& name) {
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind(name + "{", 0) == 0) return std::stod(line.substr(line.rfind(' ') + 1));
  }
  ADD_FAILURE() << name << " not in the exposition";
  return 0;
}

parallel::MoeStepStats realized(const std::vector<std::vector<std::int64_t>>& per_layer) {
  parallel::MoeStepStats stats;
  for (std::size_t l = 0; l < per_layer.size(); ++l) {
    parallel::MoeLayerStats s;
    s.layer = static_cast<std::int64_t>(2 * l + 1);
    s.rank_routed_load = per_layer[l];
    stats.layers.push_back(s);
  }
  return stats;
}

TEST(StepLoad, PredictsPerLayerAndRankAndComparesLayerByLayer) {
  const std::vector<std::int64_t> layers{1, 3};
  ServerMetrics metrics(layers, 4, 2,
                        {.model_name = "m",
                         .per_expert = false,
                         .max_context = 64,
                         .version = "v",
                         .git_commit = "c",
                         .build_type = "Release",
                         .device = "cpu"});
  StepLoad load(2, 2, &metrics);  // 2 ranks, 2 balanced layers: [layer 0: r0 r1, layer 1: r0 r1]
  load.begin_step();
  EXPECT_EQ(std::vector<float>(load.predicted().begin(), load.predicted().end()),
            (std::vector<float>{0, 0, 0, 0}));
  load.add(std::vector<float>{8, 0, 2, 6}, 0.5);  // half of a prompt this step
  load.add(std::vector<float>{0, 4, 2, 2}, 1.0);
  EXPECT_EQ(std::vector<float>(load.predicted().begin(), load.predicted().end()),
            (std::vector<float>{4, 4, 3, 5}));

  // Realized over 8 tokens: layer 0 [6, 2] (max/mean 1.5), layer 1 [4, 4] (1.0): the mean over layers
  // is 1.25; over all four cells it would be 6 / 4 = 1.5. Predicted: layer 0 [4, 4] (1.0), layer 1 [3, 5]
  // (1.25).
  load.end_step(realized({{6, 2}, {4, 4}}), 8, 4);
  const std::string text = metrics.exposition();
  EXPECT_DOUBLE_EQ(sample(text, "capserve_batch_selector_realized_imbalance"), 1.25);
  EXPECT_DOUBLE_EQ(sample(text, "capserve_batch_selector_predicted_imbalance"), 1.125);

  // Next step: 4 decodes expected to weigh as the realized load per token, layer by layer.
  load.begin_step();
  EXPECT_EQ(std::vector<float>(load.predicted().begin(), load.predicted().end()),
            (std::vector<float>{3, 1, 2, 2}));
}

}  // namespace
}  // namespace capserve::server
