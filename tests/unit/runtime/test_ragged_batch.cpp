// A ragged batch (prefill chunks, whole prompts and decode tokens of several sequences in one step) gives the
// same logits as each sequence run alone.
#include <gtest/gtest.h>

#include "kernels/cpu/cpu_backend.h"
#include "runtime/engine.h"
#include "runtime/model.h"
#include "tests/unit/runtime/fixture_models.h"

namespace capserve {
namespace {

constexpr double kTolerance = 1e-5;
constexpr int kDecodeSteps = 6;

struct Script {
  int first_step = 0;                             // the step this sequence joins
  std::vector<std::vector<std::int32_t>> chunks;  // tokens appended per step, in order
};

// Every position's logits of a sequence fed chunk by chunk alone.
std::vector<std::vector<float>> run_alone(runtime::Engine& engine, const Script& script) {
  std::vector<std::vector<float>> rows;
  const auto vocab = static_cast<std::size_t>(engine.model().config().vocab_size);
  for (const auto& chunk : script.chunks) {
    const runtime::Engine::Work w{7, chunk, true};
    EXPECT_TRUE(engine.step(std::span(&w, 1)).ok());
    for (std::size_t r = 0; r < chunk.size(); ++r) {
      const auto row = engine.logits().subspan(r * vocab, vocab);
      rows.emplace_back(row.begin(), row.end());
    }
  }
  engine.release(7);
  return rows;
}

class RaggedBatch : public ::testing::TestWithParam<std::string> {};

TEST_P(RaggedBatch, EqualsEachSequenceAlone) {
  kernels::cpu::CpuBackend backend(2);
  const auto model = runtime::Model::load(testing::fixture_models_dir() / GetParam(), backend);
  runtime::Engine engine(*model, {});
  const auto vocab = static_cast<std::size_t>(model->config().vocab_size);
  const nlohmann::json ref = testing::fixture_reference(GetParam());
  const auto prompt = [&](int i) { return ref["prompts"][i]["input_ids"].get<std::vector<std::int32_t>>(); };

  // Sequence 0 is prefilled in two chunks; the others join later with whole prompts, then all decode
  // together.
  std::vector<Script> scripts(4);
  const std::vector<std::int32_t> long_prompt = prompt(3);
  scripts[0] = {
      0, {{long_prompt.begin(), long_prompt.begin() + 10}, {long_prompt.begin() + 10, long_prompt.end()}}};
  scripts[1] = {1, {prompt(1)}};
  scripts[2] = {2, {prompt(2)}};
  scripts[3] = {2, {prompt(0)}};
  for (Script& s : scripts) {
    for (int d = 0; d < kDecodeSteps; ++d)
      s.chunks.push_back({static_cast<std::int32_t>((37 * d + 11) % vocab)});
  }

  std::vector<std::vector<std::vector<float>>> alone;
  for (const Script& s : scripts) alone.push_back(run_alone(engine, s));

  std::vector<std::size_t> next_chunk(scripts.size(), 0);
  std::vector<std::size_t> next_row(scripts.size(), 0);
  for (int step = 0;; ++step) {
    std::vector<runtime::Engine::Work> work;
    std::vector<std::size_t> who;
    for (std::size_t i = 0; i < scripts.size(); ++i) {
      if (step < scripts[i].first_step || next_chunk[i] == scripts[i].chunks.size()) continue;
      work.push_back({100 + i, scripts[i].chunks[next_chunk[i]++], true});
      who.push_back(i);
    }
    if (work.empty()) break;
    ASSERT_TRUE(engine.step(work).ok());
    std::size_t row = 0;
    for (std::size_t w = 0; w < work.size(); ++w) {
      for (std::size_t r = 0; r < work[w].tokens.size(); ++r, ++row) {
        const std::size_t i = who[w];
        const auto got = engine.logits().subspan(row * vocab, vocab);
        EXPECT_LE(testing::relative_max_diff(got, alone[i][next_row[i]++]), kTolerance)
            << "sequence " << i << " step " << step;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, RaggedBatch, ::testing::ValuesIn(testing::fixture_model_names()),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace capserve
