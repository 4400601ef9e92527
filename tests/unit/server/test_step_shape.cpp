// StepShape: each rank's work in a step read from the plans alone (tokens, decodes, attention query-key
// pairs, the decodes' share), and the step trace written from it (--step-trace): one JSON line per step with
// the active experts per layer and rank the placement implies.
#include "server/step_shape.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "parallel/expert_placement.h"
#include "server/step_trace.h"

namespace capserve::server {
namespace {

SequenceStart start(std::uint64_t id, std::int32_t rank, std::int64_t prompt, std::int64_t cached) {
  return {.id = id,
          .rank = rank,
          .prompt = std::vector<std::int32_t>(static_cast<std::size_t>(prompt), 7),
          .cached = cached,
          .params = {}};
}

TEST(StepShape, CountsTokensAndAttentionPairsPerRankAcrossChunksAndDecodes) {
  StepShape shape(2);
  // Sequence 1 on rank 0: 20-token prompt with 16 cached, its last 4 tokens now. Sequence 2 on rank 1: a
  // 10-token prompt in two chunks of 6 and 4.
  StepPlan first;
  first.starts = {start(1, 0, 20, 16), start(2, 1, 10, 0)};
  first.prefills = {{1, 4}, {2, 6}};
  auto work = shape.apply(first);
  // Token i of a chunk after b cached tokens attends to b + i + 1 positions.
  EXPECT_EQ(work[0].tokens, 4);
  EXPECT_EQ(work[0].attention_pairs, 4 * 16 + 10);
  EXPECT_EQ(work[1].tokens, 6);
  EXPECT_EQ(work[1].attention_pairs, 21);
  EXPECT_EQ(work[0].decode_pairs + work[1].decode_pairs, 0);

  StepPlan second;
  second.prefills = {{2, 4}};
  second.decodes = {1};
  work = shape.apply(second);
  EXPECT_EQ(work[0].tokens, 1);
  EXPECT_EQ(work[0].decodes, 1);
  EXPECT_EQ(work[0].attention_pairs, 21);  // its 20 cached tokens and itself
  EXPECT_EQ(work[0].decode_pairs, 21);
  EXPECT_EQ(work[1].attention_pairs, 4 * 6 + 10);

  // A decode verifying 2 drafts computes 3 tokens; the cache grows by the kept token only (rank 0 learns
  // the rest from the results, which the shape does not follow).
  StepPlan third;
  third.decodes = {1, 2};
  third.max_drafts = {2, 0};
  work = shape.apply(third);
  EXPECT_EQ(work[0].tokens, 3);
  EXPECT_EQ(work[0].attention_pairs, 3 * 21 + 6);
  EXPECT_EQ(work[1].tokens, 1);
  EXPECT_EQ(work[1].attention_pairs, 11);

  // Freed sequences and ids it never saw cost nothing.
  StepPlan fourth;
  fourth.frees = {1};
  fourth.decodes = {1, 9};
  work = shape.apply(fourth);
  EXPECT_EQ(work[0].tokens + work[1].tokens, 0);
}

TEST(StepTrace, WritesOneJsonLinePerStepWithTheActiveExpertsOfThePlacement) {
  const auto placement =
      parallel::ExpertPlacement::contiguous(1, 4, 2);  // rank 0: experts 0, 1; rank 1: 2, 3
  parallel::MoeStepStats stats;
  parallel::MoeLayerStats layer;
  layer.layer = 0;
  layer.expert_load = {3, 0, 1, 1};
  layer.rank_load = {3, 2};
  layer.dropped = 1;
  layer.wire_bytes = 4096;
  stats.layers.push_back(layer);
  std::vector<std::int64_t> active;
  active_experts(stats, placement, active);
  EXPECT_EQ(active, (std::vector<std::int64_t>{1, 2}));

  const auto path = std::filesystem::temp_directory_path() / "capserve_test_step_trace.jsonl";
  const std::vector<RankWork> work{{.tokens = 3, .decodes = 1, .attention_pairs = 9, .decode_pairs = 4},
                                   {.tokens = 2, .decodes = 2, .attention_pairs = 5, .decode_pairs = 5}};
  {
    StepTraceWriter trace(path);
    const auto t0 = std::chrono::steady_clock::now();
    EXPECT_TRUE(trace.write(t0, 0.25, work, stats, active));
    EXPECT_TRUE(trace.write(t0 + std::chrono::milliseconds(500), 0.125, work, stats, active));
  }
  std::ifstream in(path);
  std::vector<nlohmann::json> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(nlohmann::json::parse(line));
  std::filesystem::remove(path);
  ASSERT_EQ(lines.size(), 2U);
  EXPECT_DOUBLE_EQ(lines[0]["start_s"].get<double>(), 0.0);
  EXPECT_DOUBLE_EQ(lines[1]["start_s"].get<double>(), 0.5);
  EXPECT_DOUBLE_EQ(lines[1]["seconds"].get<double>(), 0.125);
  EXPECT_EQ(lines[0]["tokens"], nlohmann::json({3, 2}));
  EXPECT_EQ(lines[0]["decodes"], nlohmann::json({1, 2}));
  EXPECT_EQ(lines[0]["attention_pairs"], nlohmann::json({9, 5}));
  EXPECT_EQ(lines[0]["decode_pairs"], nlohmann::json({4, 5}));
  EXPECT_EQ(lines[0]["expert_load"], nlohmann::json({{3, 2}}));
  EXPECT_EQ(lines[0]["active_experts"], nlohmann::json({{1, 2}}));
  EXPECT_EQ(lines[0]["dropped"], nlohmann::json({1}));
  EXPECT_EQ(lines[0]["wire_bytes"], nlohmann::json({4096}));
}

TEST(StepTrace, ALineThatCannotBeWrittenIsReportedNotThrown) {
  if (!std::filesystem::exists("/dev/full")) GTEST_SKIP() << "no /dev/full";
  StepTraceWriter trace("/dev/full");  // every write fails: no space left
  const std::vector<RankWork> work(2);
  EXPECT_FALSE(trace.write(std::chrono::steady_clock::now(), 0.1, work, parallel::MoeStepStats{}, {}));
}

TEST(StepTrace, AFileThatCannotBeCreatedIsNamed) {
  try {
    StepTraceWriter trace("/nonexistent-dir/steps.jsonl");
    FAIL() << "created";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent-dir/steps.jsonl"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace capserve::server
