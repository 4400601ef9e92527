// DeepSeek-V2 beyond the HF parity tests: the latent KV cache's size against the expanded K/V form, the
// absorbed form of multi-head latent attention against the expanded one through whole generations,
// group-limited routing with DeepSeek's weight rules, and the shared experts under capacity drop.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "kernels/cpu/cpu_backend.h"
#include "kernels/moe/host_executor.h"
#include "parallel/capacity_config.h"
#include "parallel/capacity_stage.h"
#include "parallel/expert_placement.h"
#include "parallel/self_communicator.h"
#include "parallel/token_dispatcher.h"
#include "runtime/architectures/architecture.h"
#include "runtime/engine.h"
#include "runtime/generator.h"
#include "runtime/model.h"
#include "runtime/model_weights.h"
#include "runtime/moe_block.h"
#include "runtime/weights/checkpoint.h"
#include "tests/unit/runtime/fixture_models.h"

namespace capserve::runtime {
namespace {

std::vector<std::string> deepseek_fixtures() {
  std::vector<std::string> names;
  for (const std::string& name : testing::fixture_model_names()) {
    if (testing::fixture_reference(name)["architecture"] == "DeepseekV2ForCausalLM") names.push_back(name);
  }
  return names;
}

// What the expanded form would cache per token and layer: every head's key (nope + rope dims) and value.
std::int64_t expanded_bytes_per_token_per_layer(const ModelConfig& c) {
  const MlaConfig& m = *c.mla;
  return c.num_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim) *
         static_cast<std::int64_t>(sizeof(float));
}

class DeepSeek : public ::testing::TestWithParam<std::string> {
 protected:
  std::filesystem::path dir() const { return testing::fixture_models_dir() / GetParam(); }
  kernels::cpu::CpuBackend backend_{2};
};

TEST_P(DeepSeek, CacheHoldsOneLatentRowPerTokenAndLayer) {
  const auto model = Model::load(dir(), backend_);
  const ModelConfig& c = model->config();
  const Engine engine(*model, {16, 64});
  const KvCacheShape& shape = engine.cache().shape();
  ASSERT_TRUE(shape.latent());
  const std::int64_t latent = (c.mla->kv_lora_rank + c.mla->qk_rope_head_dim) * 4;
  EXPECT_EQ(shape.bytes_per_token_per_layer(), latent);
  EXPECT_EQ(engine.cache().bytes(), c.num_layers * 64 * 16 * latent) << "nothing but the latent rows";
  // 4 heads of 16 + 16 key dims and 16 value dims: 768 bytes expanded, 192 as latent + rope key.
  EXPECT_EQ(expanded_bytes_per_token_per_layer(c), 768);
  EXPECT_EQ(latent, 192);
}

// The released DeepSeek-V2-Lite: kv_lora_rank 512, qk_rope_head_dim 64, 16 heads, qk_nope_head_dim 128,
// v_head_dim 128, 27 layers (float32 cache, as this runtime keeps it; bf16 halves both).
TEST(LatentCache, DeepSeekV2LiteBytesPerToken) {
  ModelConfig c;
  c.num_layers = 27;
  c.num_heads = 16;
  c.mla = MlaConfig{0, 512, 128, 64, 128};
  const KvCacheShape shape = kv_cache_shape(c, 16, 1);
  EXPECT_EQ(shape.bytes_per_token_per_layer(), 2304);       // (512 + 64) x 4
  EXPECT_EQ(expanded_bytes_per_token_per_layer(c), 20480);  // 16 x (128 + 64 + 128) x 4
  EXPECT_EQ(c.num_layers * shape.bytes_per_token_per_layer(), 62208);
  EXPECT_EQ(c.num_layers * expanded_bytes_per_token_per_layer(c), 552960);
}

// Prefill, then greedy decode, with every layer's attention forced into one form: the logits agree at every
// step and both continuations are transformers' own.
TEST_P(DeepSeek, AbsorbedDecodeEqualsExpanded) {
  const auto absorbed = Model::load(dir(), backend_);
  const auto expanded = Model::load(dir(), backend_);
  Engine a(*absorbed, {});
  Engine e(*expanded, {});
  a.set_latent_form(kernels::LatentForm::absorbed);
  e.set_latent_form(kernels::LatentForm::expanded);
  const nlohmann::json prompt = testing::fixture_reference(GetParam())["prompts"][3];
  const auto ids = prompt["input_ids"].get<std::vector<std::int32_t>>();
  const auto expected = prompt["greedy_ids"].get<std::vector<std::int32_t>>();
  const auto vocab = static_cast<std::size_t>(absorbed->config().vocab_size);
  std::vector<std::int32_t> next = ids;
  for (std::size_t step = 0; step <= expected.size(); ++step) {
    const Engine::Work work{1, next, false};
    ASSERT_TRUE(a.step(std::span(&work, 1)).ok());
    ASSERT_TRUE(e.step(std::span(&work, 1)).ok());
    ASSERT_EQ(a.logits().size(), vocab);
    EXPECT_LE(testing::relative_max_diff(a.logits(), e.logits()), 1e-5) << "step " << step;
    if (step == expected.size()) break;
    const auto argmax = [](std::span<const float> row) {
      return static_cast<std::int32_t>(std::max_element(row.begin(), row.end()) - row.begin());
    };
    EXPECT_EQ(argmax(a.logits()), expected[step]) << "absorbed, step " << step;
    EXPECT_EQ(argmax(e.logits()), expected[step]) << "expanded, step " << step;
    next = {expected[step]};
  }
}

// gamma = 0.25 with drop keeps at most ceil(0.25 * T * k / E) slots per expert, so most of a layer's routed
// slots go, and many tokens lose all of theirs. Every token's output is still exactly its shared experts plus
// its kept routed experts: the shared experts are local dense compute, outside the scheduler and the
// dispatcher.
TEST_P(DeepSeek, SharedExpertsSurviveCapacityDropForEveryToken) {
  const nlohmann::json json = read_json_file(dir() / "config.json");
  const Architecture& arch = find_architecture(json);
  const ModelConfig c = arch.parse_config(ConfigReader(json));
  Checkpoint ckpt = Checkpoint::open(dir());
  const auto placement = parallel::ExpertPlacement::contiguous(c.num_layers, c.num_experts, 1);
  const ModelWeights weights = load_model_weights(ckpt, c, arch.tensor_names(), placement, 0, backend_);
  std::int64_t layer = 0;
  while (!c.layer_is_moe[static_cast<std::size_t>(layer)]) ++layer;
  const MoeWeights& moe = weights.layers[static_cast<std::size_t>(layer)].moe;
  ASSERT_EQ(moe.shared.size(), 1U);
  EXPECT_TRUE(moe.shared_gate.empty());

  const std::int64_t rows = 40;
  const std::int64_t hidden = c.hidden_size;
  std::vector<float> h(static_cast<std::size_t>(rows * hidden));
  for (std::size_t i = 0; i < h.size(); ++i) h[i] = std::sin(0.37F * static_cast<float>(i));
  parallel::SelfCommunicator comm;
  parallel::CapacityConfig capacity;
  capacity.gamma = {0.25};
  capacity.policy = parallel::CapacityPolicy::drop;
  parallel::CapacityStage scheduler(capacity, comm);
  parallel::TokenDispatcher dispatcher(comm);
  const parallel::PlacementTables tables(backend_, placement, 0);
  // Counted, then in fixed-size blocks (the capacity factor bounds every expert): the same outputs.
  for (const std::int64_t fixed_max_tokens : {std::int64_t{0}, std::int64_t{1024}}) {
    SCOPED_TRACE(fixed_max_tokens == 0 ? "counted exchange" : "fixed-size exchange");
    scheduler.begin_step(rows);
    parallel::MoeLayerStats stats;
    const parallel::LayerReport layout{c.num_experts};
    std::vector<std::int64_t> report(static_cast<std::size_t>(layout.size() + 2 * rows + 1), 0);
    using kernels::Tensor;
    const Tensor report_t = Tensor::host(std::span(report), {static_cast<std::int64_t>(report.size())});
    MoeLayerContext context{layer,
                            tables.layer(layer),
                            scheduler,
                            dispatcher,
                            {},
                            stats,
                            report_t.rows(0, layout.size()),
                            report_t.rows(layout.size(), rows),
                            report_t.rows(layout.size() + rows, rows),
                            report_t.rows(layout.size() + 2 * rows, 1),
                            fixed_max_tokens};
    MoeScratch scratch;
    std::vector<float> out(h.size());
    moe_block(backend_, c, moe, Tensor::host(std::span(h), {rows, hidden}),
              Tensor::host(std::span(out), {rows, hidden}), scratch, context);
    EXPECT_GT(report[parallel::LayerReport::kDropped], rows * c.top_k / 2);
    EXPECT_EQ(report.back(), 0) << "rows past their blocks";
    const auto chosen =
        scratch.experts.view(kernels::DType::i32, {rows, c.top_k}).host_span<const std::int32_t>();
    const auto gates = scratch.weights.view(kernels::DType::f32, {rows, c.top_k}).host_span<const float>();

    // Shared experts of every row, and each kept routed expert of each row, computed on their own.
    std::vector<float> shared(h.size());
    const std::int64_t whole[2] = {0, rows};
    backend_.grouped_expert_ffn(Tensor::host(std::span(h), {rows, hidden}), whole, moe.shared,
                                Tensor::host(std::span(shared), {rows, hidden}));
    std::vector<float> one(static_cast<std::size_t>(hidden));
    std::int64_t lost_all = 0;
    for (std::int64_t t = 0; t < rows; ++t) {
      const std::span<const float> row(h.data() + t * hidden, static_cast<std::size_t>(hidden));
      std::vector<double> want(shared.begin() + t * hidden, shared.begin() + (t + 1) * hidden);
      std::int64_t kept = 0;
      for (std::int64_t s = 0; s < c.top_k; ++s) {
        const std::int32_t e = chosen[static_cast<std::size_t>(t * c.top_k + s)];
        if (e < 0) continue;
        ++kept;
        const std::int64_t single[2] = {0, 1};
        backend_.grouped_expert_ffn(Tensor::host(row, {1, hidden}), single,
                                    std::span(&moe.experts[static_cast<std::size_t>(e)], 1),
                                    Tensor::host(std::span(one), {1, hidden}));
        const float w = gates[static_cast<std::size_t>(t * c.top_k + s)];
        for (std::int64_t i = 0; i < hidden; ++i)
          want[static_cast<std::size_t>(i)] += w * one[static_cast<std::size_t>(i)];
      }
      lost_all += kept == 0 ? 1 : 0;
      double scale = 0;
      for (const double v : want) scale = std::max(scale, std::fabs(v));
      ASSERT_GT(scale, 0.0);
      for (std::int64_t i = 0; i < hidden; ++i) {
        EXPECT_NEAR(out[static_cast<std::size_t>(t * hidden + i)], want[static_cast<std::size_t>(i)],
                    1e-5 * scale)
            << "token " << t << " (" << kept << " routed slots kept)";
      }
    }
    EXPECT_GT(lost_all, 0) << "no token lost every routed slot: the check is weaker than meant";
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, DeepSeek, ::testing::ValuesIn(deepseek_fixtures()),
                         [](const auto& info) { return info.param; });

// group_limited_greedy: 8 experts in 4 groups of 2, the best 2 groups (by their best expert) eligible. Plain
// top-3 would take expert 6 (group 3); within groups 0 and 1 the third is expert 1 (tied with 3: the lower
// id). Weights are the full softmax's probabilities times routed_scaling_factor.
TEST(DeepSeekRouting, GroupLimitedTopKStaysInTheBestGroups) {
  const std::vector<float> logits = {5.0F, 0.0F, 4.9F, 0.0F, 0.0F, 0.0F, 4.8F, 4.7F};
  RouterConfig router;
  router.n_group = 4;
  router.topk_group = 2;
  router.scaling = 2.5;
  struct Routing {
    std::vector<float> probs = std::vector<float>(8);
    std::vector<std::int32_t> experts = std::vector<std::int32_t>(3);
    std::vector<float> weights = std::vector<float>(3);
  } out;
  ModelConfig config;
  config.num_experts = 8;
  config.top_k = 3;
  config.router = router;
  kernels::moe::route_on_host(router_params(config, 1), logits, {}, out.probs, out.experts, out.weights);
  EXPECT_EQ(out.experts, (std::vector<std::int32_t>{0, 2, 1}));
  double sum = 0;
  for (const float p : out.probs) sum += p;
  EXPECT_NEAR(sum, 1.0, 1e-6);
  for (std::size_t s = 0; s < 3; ++s)
    EXPECT_FLOAT_EQ(out.weights[s], 2.5F * out.probs[static_cast<std::size_t>(out.experts[s])]);

  config.router = {};
  kernels::moe::route_on_host(router_params(config, 1), logits, {}, out.probs, out.experts, out.weights);
  EXPECT_EQ(out.experts, (std::vector<std::int32_t>{0, 2, 6})) << "without group limiting";
}

}  // namespace
}  // namespace capserve::runtime
