// The memory plan (runtime/memory_plan.h) against what loading really holds: for every fixture on 1 to 4
// ranks (the MTP layer loaded or not; with EPLB replicas, one extra expert copy per rank), the plan's weight
// bytes per rank equal ModelWeights::bytes of a real load on the CPU backend (3 ranks: experts that do not
// divide evenly) and its KV bytes the engine's KvCache
// allocation; its FP8 rule equals the FP8 fixture's stored types; and DeepSeek-V3's released config on 8
// ranks of 141 GB fits with FP8 kept and does not fit dequantized to bf16.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <stdexcept>
#include <string>

#include "kernels/cpu/cpu_backend.h"
#include "runtime/engine.h"
#include "runtime/memory_plan.h"
#include "runtime/model.h"
#include "runtime/model_weights.h"
#include "runtime/weights/checkpoint.h"
#include "runtime/weights/safetensors_file.h"
#include "tests/support/replication_stats.h"
#include "tests/support/thread_communicator.h"
#include "tests/unit/runtime/fixture_models.h"

namespace capserve::runtime {
namespace {

namespace fs = std::filesystem;

constexpr std::int64_t kBlocks = 6;

fs::path deepseek_v3_config() {
  return testing::fixture_models_dir().parent_path() / "configs" / "deepseek_v3" / "config.json";
}

std::int64_t held(const RankMemoryPlan& r, WeightKind kind) {
  return r.weights[static_cast<std::size_t>(kind)];
}

class PlanAgainstLoad : public ::testing::TestWithParam<std::string> {
 protected:
  fs::path dir() const { return testing::fixture_models_dir() / GetParam(); }
};

TEST_P(PlanAgainstLoad, WeightAndKvBytesPerRankEqualARealLoad) {
  const ModelDescription model = read_model_config(dir() / "config.json");
  const ModelConfig& c = model.config;
  Checkpoint checkpoint = Checkpoint::open(dir(), c.fp8_blocks);
  std::vector<std::int64_t> moe_layer_ids;
  for (std::int64_t l = 0; l < c.num_layers; ++l)
    if (c.layer_is_moe[static_cast<std::size_t>(l)]) moe_layer_ids.push_back(l);
  const fs::path stats = testing::write_hot_expert_stats(
      fs::temp_directory_path() / ("capserve_plan_replication_" + GetParam() + ".json"), moe_layer_ids,
      c.num_experts);
  int checked = 0;
  for (const int ranks : {1, 2, 3, 4}) {
    if (ranks > c.num_experts) continue;
    for (const bool mtp : {false, true}) {
      for (const std::int64_t redundant : {std::int64_t{0}, std::int64_t{ranks}}) {
        if (mtp && c.mtp_layer_is_moe.size() != 1) continue;
        if (redundant > 0 && ranks == 1) continue;  // one rank holds one copy of each expert
        SCOPED_TRACE("ranks " + std::to_string(ranks) + (mtp ? ", MTP layer loaded" : "") + ", " +
                     std::to_string(redundant) + " redundant experts");
        MemoryPlanOptions options;
        if (redundant > 0) {
          options.placement = stats.string();
          options.redundant_experts = redundant;
        }
        options.ranks = ranks;
        options.device = false;
        options.mtp = mtp;
        options.present = [&](std::string_view name) { return checkpoint.contains(name); };
        options.kv_dtype = kernels::DType::f32;
        options.kv_blocks = kBlocks;
        options.device_memory = std::int64_t{1} << 40;
        const MemoryPlan plan = plan_memory(c, model.names, options);
        ASSERT_EQ(plan.ranks.size(), static_cast<std::size_t>(ranks));

        test::ThreadGroup group(ranks);
        std::int64_t experts = 0;
        for (int r = 0; r < ranks; ++r) {
          kernels::cpu::CpuBackend backend(1);
          ParallelOptions parallel;
          parallel.mtp = mtp;
          parallel.placement = options.placement;
          parallel.redundant_experts = redundant;
          const auto loaded = Model::load(dir(), backend, group.rank(r), parallel);
          EngineOptions engine_options;
          engine_options.kv_blocks = kBlocks;
          const Engine engine(*loaded, engine_options);
          const RankMemoryPlan& planned = plan.ranks[static_cast<std::size_t>(r)];
          EXPECT_EQ(planned.weight_bytes(), loaded->weights().bytes) << "rank " << r;
          EXPECT_EQ(planned.kv_bytes, engine.cache().bytes()) << "rank " << r;
          EXPECT_EQ(plan.kv_bytes_per_token * engine.cache().shape().block_size * kBlocks,
                    engine.cache().bytes());
          std::int64_t local = 0;
          for (std::int64_t l = 0; l < c.num_layers + loaded->mtp_layers(); ++l)
            local += static_cast<std::int64_t>(loaded->layer(l).moe.experts.size());
          EXPECT_EQ(planned.experts, local) << "rank " << r;
          EXPECT_GT(held(planned, WeightKind::routed_experts), 0);
          EXPECT_EQ(held(planned, WeightKind::mtp_layers) > 0, mtp);
          experts += local;
        }
        const std::int64_t moe_layers =
            std::count(c.layer_is_moe.begin(), c.layer_is_moe.end(), true) +
            (mtp ? std::count(c.mtp_layer_is_moe.begin(), c.mtp_layer_is_moe.end(), true) : 0);
        // Every slot on exactly one rank: each expert once, plus the copies.
        EXPECT_EQ(experts, moe_layers * (c.num_experts + redundant));
        ++checked;
      }
    }
  }
  fs::remove(stats);
  EXPECT_GE(checked, 7);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, PlanAgainstLoad, ::testing::ValuesIn(testing::fixture_model_names()),
                         [](const auto& info) { return info.param; });

// Which tensors the plan takes to be FP8 (kept: one byte each plus an f32 scale per block) against the types
// the FP8 fixture really stores, tensor by tensor of the loader's walk.
TEST(MemoryPlan, KeptFp8BytesFollowTheCheckpointsStoredTypes) {
  const fs::path dir = testing::fixture_models_dir() / "deepseek_v3_fp8";
  const ModelDescription model = read_model_config(dir / "config.json");
  const ModelConfig& c = model.config;
  ASSERT_TRUE(c.fp8_blocks);
  const SafetensorsFile file = SafetensorsFile::open(dir / "model.safetensors");
  for (const bool device : {false, true}) {
    MemoryPlanOptions options;
    options.ranks = 2;
    options.device = device;
    options.mtp = true;
    options.fp8 = Fp8Holding::keep_fp8;
    options.kv_blocks = 1;
    options.device_memory = std::int64_t{1} << 40;
    const MemoryPlan plan = plan_memory(c, model.names, options);
    ParallelOptions parallel;
    parallel.mtp = true;
    const parallel::ExpertPlacement placement = model_placement(c, parallel, 2);
    for (int rank = 0; rank < 2; ++rank) {
      std::int64_t expected = 0;
      int fp8 = 0;
      for (const WeightShape& w : model_weight_shapes(c, model.names, placement, rank, true,
                                                      [](std::string_view) { return true; })) {
        const TensorInfo* t = file.find(w.name);
        ASSERT_NE(t, nullptr) << w.name;
        const std::int64_t numel = w.rows * w.cols;
        if (t->dtype == kernels::DType::f8_e4m3 && w.name.find("kv_b_proj") != std::string::npos) {
          ASSERT_EQ(w.fetch, WeightFetch::bf16) << w.name << ": latent attention takes it in bf16";
          expected += numel * 2;
        } else if (t->dtype == kernels::DType::f8_e4m3) {
          ASSERT_EQ(w.fetch, WeightFetch::as_stored) << w.name;
          ++fp8;
          expected +=
              numel + fp8_scale_rows(w.rows, *c.fp8_blocks) * fp8_scale_cols(w.cols, *c.fp8_blocks) * 4;
        } else if (w.fetch == WeightFetch::f32 || (w.fetch == WeightFetch::router && device)) {
          expected += numel * 4;
        } else {
          expected += numel * static_cast<std::int64_t>(kernels::dtype_size(t->dtype));
        }
      }
      EXPECT_GT(fp8, 0);
      EXPECT_EQ(plan.ranks[static_cast<std::size_t>(rank)].weight_bytes(), expected)
          << "rank " << rank << (device ? " on a device" : " on the CPU");
    }
  }
}

// 8 ranks of 141 GB, a tenth kept back, FP8 held as `fp8`.
MemoryPlanOptions h200_node(Fp8Holding fp8) {
  MemoryPlanOptions options;
  options.ranks = 8;
  options.fp8 = fp8;
  options.device_memory = parse_byte_size("141GB");
  options.reserve = options.device_memory / 10;
  return options;
}

MemoryPlan deepseek_v3_on_8_h200(Fp8Holding fp8) {
  const ModelDescription model = read_model_config(deepseek_v3_config());
  MemoryPlanOptions options = h200_node(fp8);
  options.max_batched_tokens = 8192;
  return plan_memory(model.config, model.names, options);
}

TEST(MemoryPlan, DeepSeekV3ReleasedConfigParsesAsPublished) {
  const ModelConfig c = read_model_config(deepseek_v3_config()).config;
  EXPECT_EQ(c.architecture, "DeepseekV3ForCausalLM");
  EXPECT_EQ(c.hidden_size, 7168);
  EXPECT_EQ(c.num_layers, 61);
  EXPECT_EQ(std::count(c.layer_is_moe.begin(), c.layer_is_moe.end(), false), 3);
  EXPECT_EQ(c.num_experts, 256);
  EXPECT_EQ(c.shared_expert_intermediate_size, 2048);
  EXPECT_EQ(c.top_k, 8);
  EXPECT_EQ(c.moe_intermediate_size, 2048);
  EXPECT_EQ(c.dense_intermediate_size, 18432);
  ASSERT_TRUE(c.mla);
  EXPECT_EQ(c.mla->q_lora_rank, 1536);
  EXPECT_EQ(c.mla->kv_lora_rank, 512);
  EXPECT_EQ(c.mla->qk_nope_head_dim, 128);
  EXPECT_EQ(c.mla->qk_rope_head_dim, 64);
  EXPECT_EQ(c.mla->v_head_dim, 128);
  EXPECT_EQ(c.num_heads, 128);
  EXPECT_EQ(c.vocab_size, 129280);
  EXPECT_EQ(c.mtp_layer_is_moe, std::vector<bool>{true});
  ASSERT_TRUE(c.fp8_blocks);
  EXPECT_EQ(c.fp8_blocks->rows, 128);
  EXPECT_EQ(c.fp8_blocks->cols, 128);
  EXPECT_EQ(c.rope_scaling.type, RopeScaling::Type::yarn);
  EXPECT_EQ(c.rope_scaling.factor, 40.0);
  EXPECT_EQ(c.torch_dtype, kernels::DType::bf16);
}

TEST(MemoryPlan, DeepSeekV3FitsEightH200sWithFp8KeptAndNotDequantized) {
  const MemoryPlan kept = deepseek_v3_on_8_h200(Fp8Holding::keep_fp8);
  const MemoryPlan bf16 = deepseek_v3_on_8_h200(Fp8Holding::dequantize_bf16);
  // The bf16 latent cache: (512 + 64) values of 2 bytes per layer, 61 layers.
  EXPECT_EQ(kept.kv_bytes_per_token, 576 * 2 * 61);
  for (const MemoryPlan* plan : {&kept, &bf16}) {
    for (const RankMemoryPlan& r : plan->ranks) {
      EXPECT_EQ(r.experts, 58 * 256 / 8);
      EXPECT_EQ(held(r, WeightKind::mtp_layers), 0);  // not loaded without --mtp
    }
  }
  const RankMemoryPlan& k = kept.ranks.front();
  const RankMemoryPlan& b = bf16.ranks.front();
  // Unquantized in both: embeddings and head in bf16, routers widened to f32 on a device (with their f32
  // correction biases).
  EXPECT_EQ(held(k, WeightKind::embedding), 129280LL * 7168 * 2);
  EXPECT_EQ(held(b, WeightKind::lm_head), 129280LL * 7168 * 2);
  EXPECT_EQ(held(k, WeightKind::routers), 58LL * (256 * 7168 * 4 + 256 * 4));
  // Projections: 32 experts x 58 layers x 3 matrices of 2048 x 7168, 2 bytes dequantized, 1 byte plus a
  // scale per 128 x 128 block kept.
  const std::int64_t expert_elements = 32LL * 58 * 3 * 2048 * 7168;
  EXPECT_EQ(held(b, WeightKind::routed_experts), expert_elements * 2);
  EXPECT_EQ(held(k, WeightKind::routed_experts), expert_elements + expert_elements / (128 * 128) * 4);

  EXPECT_TRUE(kept.fits());
  EXPECT_GE(kept.kv_tokens(), 100'000);
  for (const RankMemoryPlan& r : kept.ranks)
    EXPECT_LE(r.weight_bytes() + kept.options.reserve + kept.kv_tokens() * kept.kv_bytes_per_token,
              kept.options.device_memory);
  EXPECT_FALSE(bf16.fits());
  EXPECT_GT(b.weight_bytes(), bf16.options.device_memory);  // the weights alone overflow
  EXPECT_EQ(bf16.kv_tokens(), 0);
}

// A fixed --kv-blocks fits when it holds the model's whole context and fits the room the weights leave.
TEST(MemoryPlan, AFixedBlockCountFitsOnlyWhenItHoldsAContextAndFitsTheRoom) {
  const ModelDescription model = read_model_config(deepseek_v3_config());
  MemoryPlanOptions options = h200_node(Fp8Holding::keep_fp8);
  const std::int64_t room = plan_memory(model.config, model.names, options).ranks.front().kv_room;
  const std::int64_t context_blocks = 163840 / 16;
  const std::int64_t block_bytes = 576 * 2 * 61 * 16;
  ASSERT_GT(room, context_blocks * block_bytes);
  for (const auto& [blocks, fits] :
       {std::pair{context_blocks - 1, false}, std::pair{context_blocks, true},
        std::pair{room / block_bytes, true}, std::pair{room / block_bytes + 1, false}}) {
    options.kv_blocks = blocks;
    const MemoryPlan plan = plan_memory(model.config, model.names, options);
    EXPECT_EQ(plan.fits(), fits) << blocks << " blocks";
    EXPECT_EQ(plan.kv_blocks(), blocks);
    EXPECT_EQ(plan.ranks.front().kv_bytes, blocks * block_bytes);
  }
}

TEST(MemoryPlan, MtpLayersAddTheirWeightsAndACacheLayer) {
  const ModelDescription model = read_model_config(deepseek_v3_config());
  MemoryPlanOptions options = h200_node(Fp8Holding::keep_fp8);
  options.reserve = 0;
  options.mtp = true;
  const MemoryPlan with = plan_memory(model.config, model.names, options);
  EXPECT_EQ(with.kv_bytes_per_token, 576 * 2 * 62);
  // Its own embed_tokens and shared_head.head (bf16, as released), 32 experts, eh_proj in bf16 ...
  EXPECT_GT(held(with.ranks.front(), WeightKind::mtp_layers), 2 * 129280LL * 7168 * 2 + 7168LL * 14336 * 2);
  EXPECT_EQ(with.ranks.front().experts, 59 * 256 / 8);
  // ... which a checkpoint without those copies does without.
  options.present = [](std::string_view name) {
    return !name.ends_with("embed_tokens.weight") || name == "model.embed_tokens.weight";
  };
  const MemoryPlan shared = plan_memory(model.config, model.names, options);
  EXPECT_EQ(
      held(with.ranks.front(), WeightKind::mtp_layers) - held(shared.ranks.front(), WeightKind::mtp_layers),
      129280LL * 7168 * 2);
}

TEST(MemoryPlan, RefusesWhatItCannotPlan) {
  const ModelDescription model = read_model_config(deepseek_v3_config());
  MemoryPlanOptions options;
  EXPECT_THROW(plan_memory(model.config, model.names, options), std::invalid_argument);  // no memory
  options.device_memory = 1;
  ModelConfig untyped = model.config;
  untyped.torch_dtype.reset();
  EXPECT_THROW(plan_memory(untyped, model.names, options), std::invalid_argument);
  const MemoryPlan tiny = plan_memory(model.config, model.names, options);
  EXPECT_FALSE(tiny.fits());
  EXPECT_EQ(tiny.kv_blocks(), 0);
}

TEST(MemoryPlan, ParsesByteSizes) {
  EXPECT_EQ(parse_byte_size("141GB"), 141'000'000'000);
  EXPECT_EQ(parse_byte_size("141G"), 141'000'000'000);
  EXPECT_EQ(parse_byte_size("80GiB"), std::int64_t{80} << 30);
  EXPECT_EQ(parse_byte_size("1.5kib"), 1536);
  EXPECT_EQ(parse_byte_size("4096"), 4096);
  EXPECT_EQ(parse_byte_size("2TB"), 2'000'000'000'000);
  for (const char* bad : {"", "GB", "12XB", "-3GB", "1e9", "1.2.3GB"})
    EXPECT_THROW(parse_byte_size(bad), std::invalid_argument) << bad;
}

}  // namespace
}  // namespace capserve::runtime
