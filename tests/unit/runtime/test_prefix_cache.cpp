// The engine's prefix cache on every fixture architecture (the latent MLA cache included): a sequence started
// after a cached prefix computes only the rest and gives the logits and greedy tokens of the same sequence
// prefilled whole on an engine without the cache, with no capacity factor; with one, it gives those of the
// cached prefix's own sequence continued (runtime/README.md, "Prefix cache"). Then the step's refusals, the
// accounting of shared idle blocks, speculative rollback and MTP drafts with the cache on.
#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "kernels/cpu/cpu_backend.h"
#include "runtime/engine.h"
#include "runtime/model.h"
#include "tests/unit/runtime/fixture_models.h"

namespace capserve::runtime {
namespace {

using Tokens = std::vector<std::int32_t>;
// As the ragged-batch test: rows computed in other step shapes (here the prefix's K/V came from another
// sequence's step) agree to float rounding.
constexpr double kTolerance = 1e-5;
constexpr int kDecodeSteps = 8;
constexpr std::int64_t kBlock = 4;

// P (9 tokens: two whole blocks and one token of a third, which is computed again), A = P + X, B = P + Y.
// At most 16 tokens: the dynamic-rope fixture's max_position_embeddings, past which keys depend on the
// length of the step that wrote them (as with chunked prefill).
struct Sequences {
  Tokens a;
  Tokens b;
};

Sequences sequences(const std::string& fixture) {
  const nlohmann::json ref = testing::fixture_reference(fixture);
  const auto prompt = [&](int i) { return ref["prompts"][i]["input_ids"].get<Tokens>(); };
  const Tokens long_prompt = prompt(3);
  const Tokens p(long_prompt.begin(), long_prompt.begin() + 9);
  Sequences s{p, p};
  const Tokens x = prompt(2);
  const Tokens y = prompt(1);
  s.a.insert(s.a.end(), x.begin(), x.begin() + 3);
  s.b.insert(s.b.end(), y.begin(), y.begin() + 4);
  return s;
}

EngineOptions options(bool prefix_cache) {
  EngineOptions o;
  o.kv_block_size = kBlock;
  o.kv_blocks = 64;
  o.prefix_cache = prefix_cache;
  return o;
}

// What a sequence's step gave: its logits rows, then the greedy tokens of the decode steps after it.
struct Outcome {
  std::vector<std::vector<float>> rows;
  Tokens greedy;
};

Outcome run_sequence(Engine& engine, SequenceId seq, const Tokens& tokens, std::int64_t cached,
                     int decode_steps) {
  Outcome out;
  const auto vocab = static_cast<std::size_t>(engine.model().config().vocab_size);
  Engine::Work w{seq, tokens, true};
  w.cached = cached;
  const Status s = engine.step({&w, 1});
  EXPECT_TRUE(s.ok()) << s.message();
  const std::span<const float> logits = engine.logits();
  for (std::size_t r = 0; r < logits.size() / vocab; ++r) {
    const auto row = logits.subspan(r * vocab, vocab);
    out.rows.emplace_back(row.begin(), row.end());
  }
  Tokens next(tokens.size() - static_cast<std::size_t>(cached));  // one per logits row
  for (int d = 0; d < decode_steps; ++d) {
    engine.sample(std::vector<kernels::SampleControls>(next.size()), next);
    out.greedy.push_back(next.back());
    const Engine::Work decode{seq, std::span(&out.greedy.back(), 1)};
    EXPECT_TRUE(engine.step({&decode, 1}).ok());
    next.resize(1);
  }
  return out;
}

class PrefixCache : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    model_ = Model::load(testing::fixture_models_dir() / GetParam(), backend_);
    seqs_ = sequences(GetParam());
  }
  kernels::cpu::CpuBackend backend_{2};
  std::unique_ptr<Model> model_;
  Sequences seqs_;
};

TEST_P(PrefixCache, CacheOnEqualsCacheOffAtInfiniteCapacity) {
  Engine off(*model_, options(false));
  const Outcome whole = run_sequence(off, 1, seqs_.b, 0, kDecodeSteps);

  for (const bool a_running : {false, true}) {
    SCOPED_TRACE(a_running ? "A still running" : "A released");
    Engine on(*model_, options(true));
    const Engine::Work a{10, seqs_.a};
    ASSERT_TRUE(on.step({&a, 1}).ok());
    if (!a_running) on.release(10);
    const std::int64_t cached = on.cache().blocks().cached_prefix(seqs_.b);
    ASSERT_EQ(cached, 8);  // P's two whole blocks; its ninth token is in a block A wrote X into
    EXPECT_EQ(on.cache().blocks().idle_cached_blocks(seqs_.b, cached), a_running ? 0 : 2);
    const Outcome got = run_sequence(on, 11, seqs_.b, cached, 0);
    // Only the tokens after the cached prefix were computed, at their own positions.
    ASSERT_EQ(on.last_step_slices().size(), 1U);
    EXPECT_EQ(on.last_step_slices()[0].num_tokens, static_cast<std::int64_t>(seqs_.b.size()) - cached);
    EXPECT_EQ(on.last_step_slices()[0].start_pos, cached);
    ASSERT_EQ(got.rows.size(), seqs_.b.size() - static_cast<std::size_t>(cached));
    for (std::size_t r = 0; r < got.rows.size(); ++r) {
      EXPECT_LE(testing::relative_max_diff(got.rows[r], whole.rows[r + static_cast<std::size_t>(cached)]),
                kTolerance)
          << "position " << r + static_cast<std::size_t>(cached);
    }
    on.release(11);
    // The greedy continuation, from a fresh adoption of the same prefix.
    EXPECT_EQ(run_sequence(on, 12, seqs_.b, cached, kDecodeSteps).greedy, whole.greedy);
    EXPECT_EQ(on.length(12), static_cast<std::int64_t>(seqs_.b.size()) + kDecodeSteps);
  }
}

// With a capacity factor, which tokens share a step decides which expert slots are dropped, so the cached
// K/V are those of the step that computed them: B equals A's prefix continued with the rest of B (A rolled
// back to the cached prefix on an engine without the cache, then B's tail in a step of its own), exactly.
TEST_P(PrefixCache, AtAFiniteCapacityFactorEqualsTheCachedPrefixsSequenceContinued) {
  ParallelOptions parallel;
  parallel.capacity.gamma = {0.5};
  parallel.capacity.policy = parallel::CapacityPolicy::drop;
  const auto model = Model::load(testing::fixture_models_dir() / GetParam(), backend_, parallel);
  Engine on(*model, options(true));
  const Engine::Work a{10, seqs_.a};
  ASSERT_TRUE(on.step({&a, 1}).ok());
  std::int64_t dropped = 0;
  for (const Engine::MoeCounts& c : on.moe_counts()) dropped += c.dropped;
  EXPECT_GT(dropped, 0);  // the capacity factor binds: the claim is not the infinite-capacity one
  on.release(10);
  const std::int64_t cached = on.cache().blocks().cached_prefix(seqs_.b);
  ASSERT_EQ(cached, 8);
  const Outcome got = run_sequence(on, 11, seqs_.b, cached, kDecodeSteps);

  Engine off(*model, options(false));
  ASSERT_TRUE(off.step({&a, 1}).ok());
  off.truncate(10, cached);
  const Tokens tail(seqs_.b.begin() + cached, seqs_.b.end());
  const Outcome continued = run_sequence(off, 10, tail, 0, kDecodeSteps);
  ASSERT_EQ(got.rows.size(), continued.rows.size());
  for (std::size_t r = 0; r < got.rows.size(); ++r) EXPECT_EQ(got.rows[r], continued.rows[r]) << "row " << r;
  EXPECT_EQ(got.greedy, continued.greedy);
  // And not "B prefilled whole": its one step shares capacity between P and B's tail differently (0.1 to 0.9
  // of the largest logit on the fixtures at 0.5).
  Engine whole_engine(*model, options(false));
  const Outcome whole = run_sequence(whole_engine, 20, seqs_.b, 0, 0);
  double diff = 0.0;
  for (std::size_t r = 0; r < got.rows.size(); ++r) {
    diff = std::max(
        diff, testing::relative_max_diff(got.rows[r], whole.rows[r + static_cast<std::size_t>(cached)]));
  }
  EXPECT_GT(diff, kTolerance);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, PrefixCache, ::testing::ValuesIn(testing::fixture_model_names()),
                         [](const auto& info) { return info.param; });

class PrefixCacheEngine : public ::testing::Test {
 protected:
  void SetUp() override { model_ = Model::load(testing::fixture_models_dir() / "olmoe_bf16", backend_); }
  kernels::cpu::CpuBackend backend_{2};
  std::unique_ptr<Model> model_;
};

TEST_F(PrefixCacheEngine, RefusesACachedPrefixItCannotTakeAndChangesNothing) {
  Engine on(*model_, options(true));
  const Tokens p = {5, 6, 7, 8, 9, 10, 11, 12, 13};
  const Engine::Work a{1, p};
  ASSERT_TRUE(on.step({&a, 1}).ok());
  const KvBlockManager& blocks = on.cache().blocks();
  const std::int64_t free_before = blocks.free_blocks();
  const Tokens eight(p.begin(), p.begin() + 8);
  const auto refused = [&](Engine& engine, SequenceId seq, const Tokens& tokens, std::int64_t cached) {
    Engine::Work w{seq, tokens};
    w.cached = cached;
    const Status s = engine.step({&w, 1});
    EXPECT_EQ(s.code(), StatusCode::invalid_argument) << "cached " << cached << ": " << s.message();
    EXPECT_EQ(engine.length(seq), seq == 1 ? 9 : 0);
    EXPECT_EQ(engine.cache().blocks().free_blocks(), free_before);
  };
  refused(on, 1, {14}, 4);                         // a sequence already started
  refused(on, 2, p, 6);                            // not whole blocks
  refused(on, 2, eight, 8);                        // nothing left to compute
  refused(on, 2, p, 12);                           // more than the tokens
  refused(on, 2, {5, 6, 7, 8, 1, 2, 3, 4, 0}, 8);  // the second block is not cached
  Engine off(*model_, options(false));
  ASSERT_TRUE(off.step({&a, 1}).ok());
  refused(off, 2, p, 4);  // no cache: nothing is cached
  Engine::Work ok{2, p};
  ok.cached = 8;
  ASSERT_TRUE(on.step({&ok, 1}).ok());
  EXPECT_EQ(on.length(2), 9);
}

// A cache of four blocks, all idle cached: P's (released first, so evicted first) and Q's.
std::unique_ptr<Engine> engine_with_p_and_q_idle(const Model& model, const Tokens& p, const Tokens& q) {
  EngineOptions o = options(true);
  o.kv_blocks = 4;
  auto engine = std::make_unique<Engine>(model, o);
  for (const SequenceId seq : {1, 2}) {
    const Engine::Work w{seq, seq == 1 ? p : q};
    EXPECT_TRUE(engine->step({&w, 1}).ok());
    engine->release(seq);
  }
  EXPECT_EQ(engine->cache().blocks().free_blocks(), 4);
  EXPECT_EQ(engine->cache().blocks().cached_blocks(), 4);
  return engine;
}

TEST_F(PrefixCacheEngine, OneStepAdoptsBeforeItReservesAndCountsSharedIdleBlocksOnce) {
  const Tokens p = {5, 6, 7, 8, 9, 10, 11, 12};
  const Tokens q = {20, 21, 22, 23, 24, 25, 26, 27};
  const Tokens fresh = {30, 31};
  Tokens b1 = p;
  b1.push_back(40);
  Tokens b2 = p;
  b2.push_back(41);
  const auto after_p = [](SequenceId seq, const Tokens& tokens) {
    Engine::Work w{seq, tokens};
    w.cached = 8;
    return w;
  };

  // Two sequences adopting P in one step: P's two blocks once and one new block each fit the four.
  const auto shared = engine_with_p_and_q_idle(*model_, p, q);
  const std::vector<Engine::Work> both = {after_p(4, b1), after_p(5, b2)};
  const Status s = shared->step(both);
  ASSERT_TRUE(s.ok()) << s.message();
  EXPECT_EQ(shared->cache().blocks().block_table(4)[0], shared->cache().blocks().block_table(5)[0]);
  EXPECT_EQ(shared->cache().blocks().evictions(), 2);  // Q's
  EXPECT_EQ(shared->cache().blocks().cached_prefix(q), 0);

  // A new sequence first in the step, its block reserved after the adoption after it: it evicts Q's tail,
  // not P's (the least recently released), which the adoption needs.
  const auto ordered = engine_with_p_and_q_idle(*model_, p, q);
  std::vector<Engine::Work> work = {{3, fresh}, after_p(4, b1), after_p(5, b2)};
  EXPECT_EQ(ordered->step(work).code(), StatusCode::resource_exhausted);  // 3 new blocks and P's 2
  EXPECT_EQ(ordered->cache().blocks().free_blocks(), 4);
  work.pop_back();
  const Status t = ordered->step(work);
  ASSERT_TRUE(t.ok()) << t.message();
  EXPECT_EQ(ordered->cache().blocks().free_blocks(), 0);
  EXPECT_EQ(ordered->cache().blocks().cached_prefix(p), 8);
  EXPECT_EQ(ordered->cache().blocks().cached_prefix(q), 0);
}

TEST_F(PrefixCacheEngine, SpeculativeRollbackUncachesRejectedPositions) {
  Engine on(*model_, options(true));
  const Tokens prompt = {5, 6, 7, 8, 9, 10};
  const Engine::Work w{1, prompt};
  ASSERT_TRUE(on.step({&w, 1}).ok());
  const KvBlockManager& blocks = on.cache().blocks();
  EXPECT_EQ(blocks.cached_blocks(), 1);
  // A sampled token and two drafts fill the second block and start a third.
  const Tokens verify = {11, 12, 13};
  Engine::Work v{1, verify};
  v.decode = true;
  ASSERT_TRUE(on.step({&v, 1}).ok());
  EXPECT_EQ(blocks.cached_blocks(), 2);
  on.truncate(1, 7);  // only the sampled token kept
  EXPECT_EQ(blocks.cached_blocks(), 1);
  EXPECT_EQ(blocks.cached_prefix(Tokens{5, 6, 7, 8, 9, 10, 11, 12}), 4);
  const Tokens sampled = {14};
  const Engine::Work next{1, sampled};
  ASSERT_TRUE(on.step({&next, 1}).ok());
  EXPECT_EQ(blocks.cached_prefix(Tokens{5, 6, 7, 8, 9, 10, 11, 14}), 8);
}

TEST(PrefixCacheMtp, DraftBlocksAreTakenAndFreedNeverCached) {
  kernels::cpu::CpuBackend backend(1);
  ParallelOptions parallel;
  parallel.mtp = true;
  const auto model = Model::load(testing::fixture_models_dir() / "deepseek_v3", backend, parallel);
  Engine on(*model, options(true));
  const Tokens prompt = {5, 6, 7, 8, 9, 10, 11, 12};
  const Engine::Work w{1, prompt};
  ASSERT_TRUE(on.step({&w, 1}).ok());
  const KvBlockManager& blocks = on.cache().blocks();
  const std::int64_t free_before = blocks.free_blocks();
  ASSERT_EQ(blocks.cached_blocks(), 2);
  const Tokens next = {6, 7, 8, 9, 10, 11, 12, 13};
  const Engine::DraftWork catch_up{1, 0, next, 0, false};
  ASSERT_TRUE(on.draft_step(0, Engine::DraftInput::step_hidden, {&catch_up, 1}).ok());
  // A chain row past the sequence's length takes a third block for its MTP K/V.
  const Tokens chain = {14};
  const Engine::DraftWork draft{1, 8, chain, 0, false};
  ASSERT_TRUE(on.draft_step(0, Engine::DraftInput::draft_hidden, {&draft, 1}).ok());
  EXPECT_EQ(blocks.free_blocks(), free_before - 1);
  EXPECT_EQ(blocks.cached_blocks(), 2);
  on.end_drafts();
  EXPECT_EQ(blocks.free_blocks(), free_before);
  EXPECT_EQ(blocks.cached_blocks(), 2);
  EXPECT_EQ(blocks.cached_prefix(Tokens{5, 6, 7, 8, 9, 10, 11, 12, 14, 15, 16, 17}), 8);
}

}  // namespace
}  // namespace capserve::runtime
