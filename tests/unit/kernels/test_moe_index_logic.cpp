// The MoE index logic (kernels/moe/index_logic.h) run by the host executor: the router's tie rules and
// sigmoid scores, the capacity selection key and radix rounds, tied gate scores, and the permutation against
// the grouping parallel::TokenDispatcher hands to the expert FFN, on random routings with empty steps and
// expert counts that do not divide the ranks, bit for bit. (The CPU path routes and schedules capacity with
// this very logic; tests/unit/parallel/test_capacity_stage.cpp checks the capacity decisions against a
// brute-force reference.)
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <numeric>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "kernels/backend.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/moe/host_executor.h"
#include "parallel/capacity_config.h"
#include "parallel/capacity_stage.h"
#include "parallel/expert_placement.h"
#include "parallel/self_communicator.h"
#include "parallel/token_dispatcher.h"
#include "runtime/moe_block.h"
#include "tests/support/expert_parallel.h"
#include "tests/support/thread_communicator.h"

namespace capserve {
namespace {

namespace moe = kernels::moe;

static_assert(static_cast<int>(moe::SlotState::kept) == static_cast<int>(parallel::SlotStatus::kept));
static_assert(static_cast<int>(moe::SlotState::dropped) == static_cast<int>(parallel::SlotStatus::dropped));
static_assert(static_cast<int>(moe::SlotState::rerouted) == static_cast<int>(parallel::SlotStatus::rerouted));

using Rng = std::mt19937_64;

std::int64_t uniform(Rng& rng, std::int64_t lo, std::int64_t hi) {
  return std::uniform_int_distribution<std::int64_t>(lo, hi)(rng);
}

// Logits on a coarse grid (many exact ties) or continuous.
// ---------------------------------------------------------------------------------------------------------
// Router.

// ---------------------------------------------------------------------------------------------------------
// Copies of replicated experts (EPLB).

TEST(MoeIndexLogic, EntriesTakeTheirExpertsCopiesInTurnOffsetByTheSalt) {
  // Expert 0 has copies 0..2, expert 1 copy 3, expert 2 copies 4..5; by hand, token t takes copy
  // (t + salt) mod copies.
  std::vector<std::int32_t> first{0, 3, 4, 6};
  std::vector<std::int32_t> experts{0, 2, 0, 1, 0, -1, 2, 0};  // [4 tokens, k = 2]
  std::vector<std::int32_t> copies(experts.size());
  kernels::cpu::CpuBackend backend(1);
  const auto tensor = [](std::vector<std::int32_t>& v, std::int64_t rows) {
    return kernels::Tensor::host(std::span<std::int32_t>(v),
                                 {rows, static_cast<std::int64_t>(v.size()) / rows});
  };
  backend.assign_copies(tensor(experts, 4), tensor(first, 1), 0, tensor(copies, 4));
  EXPECT_EQ(copies, (std::vector<std::int32_t>{0, 4, 1, 3, 2, -1, 5, 0}));
  backend.assign_copies(tensor(experts, 4), tensor(first, 1), 5, tensor(copies, 4));
  EXPECT_EQ(copies, (std::vector<std::int32_t>{2, 5, 0, 3, 1, -1, 4, 2})) << "rank 5 starts elsewhere";
  std::vector<std::int32_t> past{3, 0};
  EXPECT_THROW(backend.assign_copies(tensor(past, 1), tensor(first, 1), 0, tensor(copies, 4).rows(0, 1)),
               std::exception)
      << "expert 3 has no copies";
}

TEST(MoeIndexLogic, RouterTiesGoToTheLowerExpert) {
  const std::vector<float> logits = {1.0F, 3.0F, 3.0F, 0.0F, 3.0F};
  moe::RouterParams p;
  p.tokens = 1;
  p.num_experts = 5;
  p.top_k = 3;
  std::vector<float> probs(5);
  std::vector<std::int32_t> experts(3);
  std::vector<float> weights(3);
  moe::route_on_host(p, logits, {}, probs, experts, weights);
  EXPECT_EQ(experts, (std::vector<std::int32_t>{1, 2, 4}));
}

TEST(MoeIndexLogic, SigmoidRouterScoresEachExpertAlone) {
  const std::vector<float> logits = {0.0F, 2.0F, -1.0F, 2.0F};
  moe::RouterParams p;
  p.tokens = 1;
  p.num_experts = 4;
  p.top_k = 2;
  p.score = moe::RouterScore::sigmoid;
  p.normalize = true;
  std::vector<float> probs(4);
  std::vector<std::int32_t> experts(2);
  std::vector<float> weights(2);
  moe::route_on_host(p, logits, {}, probs, experts, weights);
  for (std::size_t e = 0; e < 4; ++e) EXPECT_FLOAT_EQ(probs[e], 1.0F / (1.0F + std::exp(-logits[e])));
  EXPECT_EQ(experts, (std::vector<std::int32_t>{1, 3}));
  EXPECT_FLOAT_EQ(weights[0], 0.5F);
  EXPECT_FLOAT_EQ(weights[1], 0.5F);
}

// ---------------------------------------------------------------------------------------------------------
// Capacity scheduler.

TEST(MoeIndexLogic, TiedGateScoresKeepExactlyCapacityByTokenPosition) {
  // Eight tokens with the same single expert and weight: capacity ceil(0.5 * 8 * 1 / 1) = 4 keeps tokens
  // 0..3.
  moe::CapacityInputs in;
  in.params.tokens = 8;
  in.params.top_k = 1;
  in.params.num_experts = 1;
  in.params.nbins = 1;
  in.params.total_tokens = 8;
  in.params.gamma = 0.5;
  const std::vector<float> probs(8, 1.0F);
  in.probs = probs;
  std::vector<std::int32_t> experts(8, 0);
  std::vector<float> weights(8, 1.0F);
  std::vector<std::uint8_t> status(8);
  const moe::CapacityTotals totals = moe::schedule_capacity_on_host(in, experts, weights, status);
  EXPECT_EQ(totals.dropped, 4);
  EXPECT_EQ(experts, (std::vector<std::int32_t>{0, 0, 0, 0, -1, -1, -1, -1}));
}

TEST(MoeIndexLogic, SelectionKeyOrdersByScoreThenEarlierToken) {
  using moe::ScoreKind;
  const auto key = [](std::uint64_t token, std::int64_t slot, float w) {
    return moe::selection_key(ScoreKind::gate, 0, 0, token, slot, 0, w, 2, 4);
  };
  EXPECT_GT(key(5, 0, 0.5F), key(0, 0, 0.25F));
  EXPECT_GT(key(0, 1, 0.5F), key(1, 0, 0.5F));
  EXPECT_GT(key(1, 0, 0.5F), key(1, 1, 0.5F));
  EXPECT_EQ(key(3, 1, -1.0F) >> 32, 0U);  // non-positive weights score 0
}

TEST(MoeIndexLogic, RadixRoundFixesTheThresholdDigit) {
  // 5 candidates need 3: buckets 9 (1 key), 7 (3 keys), 2 (1 key) -> digit 7, 2 still needed inside it.
  std::vector<std::int64_t> hist(256, 0);
  hist[9] = 1;
  hist[7] = 3;
  hist[2] = 1;
  moe::SelectState s = moe::begin_select(5, 3);
  ASSERT_EQ(s.unresolved, 1);
  moe::radix_resolve(s, hist.data(), 56);
  EXPECT_EQ(s.prefix, std::uint64_t{7} << 56);
  EXPECT_EQ(s.need, 2);
  EXPECT_EQ(s.unresolved, 1);
  // Exactly filled by the top bucket: resolved with that prefix as threshold.
  moe::SelectState exact = moe::begin_select(5, 1);
  moe::radix_resolve(exact, hist.data(), 56);
  EXPECT_EQ(exact.unresolved, 0);
  EXPECT_EQ(exact.threshold, std::uint64_t{9} << 56);
  EXPECT_EQ(moe::begin_select(2, 3).unresolved, 0);
  EXPECT_EQ(moe::begin_select(2, 0).take_none, 1);
}

// ---------------------------------------------------------------------------------------------------------
// Permute: the grouping TokenDispatcher hands to the expert FFN, recorded through a backend.

// The CPU backend with its expert FFN replaced by a recording one (nothing else is used).
class RecordingBackend final : public kernels::cpu::CpuBackend {
 public:
  RecordingBackend() : CpuBackend(1) {}

  std::vector<std::int64_t> offsets;
  std::vector<float> x;

  void grouped_expert_ffn(const kernels::Tensor& in_t, std::span<const std::int64_t> off,
                          std::span<const kernels::ExpertWeights> /*experts*/,
                          const kernels::Tensor& out_t) override {
    const std::span<const float> in = in_t.host_span<const float>();
    const std::span<float> out = out_t.host_span<float>();
    offsets.assign(off.begin(), off.end());
    x.assign(in.begin(), in.end());
    // A distinct function per group, so the combine's gate-weighted sum is checked against the right rows.
    const std::size_t hidden = off.back() > 0 ? in.size() / static_cast<std::size_t>(off.back()) : 0;
    for (std::size_t g = 0; g + 1 < off.size(); ++g) {
      for (auto row = static_cast<std::size_t>(off[g]); row < static_cast<std::size_t>(off[g + 1]); ++row) {
        for (std::size_t c = 0; c < hidden; ++c)
          out[row * hidden + c] = in[row * hidden + c] * static_cast<float>(g + 1) + static_cast<float>(c);
      }
    }
  }
};

// Random routing with dropped slots: each slot a distinct expert or -1.
std::vector<std::int32_t> random_assignments(Rng& rng, std::int64_t T, std::int64_t k, std::int64_t E) {
  std::vector<std::int32_t> experts(static_cast<std::size_t>(T * k));
  std::vector<std::int32_t> ids(static_cast<std::size_t>(E));
  for (std::int64_t t = 0; t < T; ++t) {
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), rng);
    for (std::int64_t s = 0; s < k; ++s)
      experts[static_cast<std::size_t>(t * k + s)] =
          uniform(rng, 0, 4) == 0 ? -1 : ids[static_cast<std::size_t>(s)];
  }
  return experts;
}

TEST(MoeIndexLogic, PermuteEqualsTheDispatchersGroupingOnOneRank) {
  Rng rng(99);
  for (int trial = 0; trial < 1500; ++trial) {
    const std::int64_t E = uniform(rng, 1, 12);
    const std::int64_t k = uniform(rng, 1, std::min<std::int64_t>(E, 4));
    const std::int64_t T = uniform(rng, 0, 10) == 0 ? 0 : uniform(rng, 1, 200);
    const std::int64_t hidden = 2;
    const std::vector<std::int32_t> experts = random_assignments(rng, T, k, E);
    std::vector<float> weights(experts.size());
    for (float& w : weights) w = static_cast<float>(uniform(rng, 1, 8)) * 0.125F;
    std::vector<float> h(static_cast<std::size_t>(T * hidden));
    for (std::int64_t t = 0; t < T; ++t) {
      h[static_cast<std::size_t>(t * hidden)] = static_cast<float>(t);
      h[static_cast<std::size_t>(t * hidden + 1)] = 0.5F;
    }
    const parallel::ExpertPlacement placement = parallel::ExpertPlacement::contiguous(1, E, 1);
    const std::vector<kernels::ExpertWeights> local(static_cast<std::size_t>(E));
    parallel::SelfCommunicator self;
    parallel::TokenDispatcher dispatcher(self);
    RecordingBackend backend;
    std::vector<float> out(static_cast<std::size_t>(T * hidden));
    const parallel::PlacementTables tables(backend, placement, 0);
    testing::ExpertParallelLayer layer{backend, dispatcher, tables.layer(0), local};
    layer.run(h, T, hidden, k, experts, weights, out);

    moe::PermuteParams p;
    p.tokens = T;
    p.top_k = k;
    p.num_groups = E;
    p.chunk = uniform(rng, 1, 64);
    const moe::PermuteResult perm = moe::permute_on_host(p, experts, {}, {});
    SCOPED_TRACE("trial " + std::to_string(trial) + ": T=" + std::to_string(T) + " E=" + std::to_string(E) +
                 " k=" + std::to_string(k) + " chunk=" + std::to_string(p.chunk));
    ASSERT_EQ(perm.offsets, backend.offsets);
    ASSERT_EQ(perm.row_token.size(), backend.x.size() / hidden);
    for (std::size_t row = 0; row < perm.row_token.size(); ++row)
      ASSERT_EQ(static_cast<float>(perm.row_token[row]), backend.x[row * hidden]) << "row " << row;
    // Every kept slot has a row holding its token, and the combine through `position` gives the
    // dispatcher's output.
    for (std::int64_t t = 0; t < T; ++t) {
      for (std::int64_t c = 0; c < hidden; ++c) {
        float acc = 0.0F;
        for (std::int64_t s = 0; s < k; ++s) {
          const std::int64_t row = perm.position[static_cast<std::size_t>(t * k + s)];
          ASSERT_EQ(row >= 0, experts[static_cast<std::size_t>(t * k + s)] >= 0);
          if (row < 0) continue;
          ASSERT_EQ(perm.row_token[static_cast<std::size_t>(row)], t);
          const auto g = static_cast<float>(experts[static_cast<std::size_t>(t * k + s)] + 1);
          acc += weights[static_cast<std::size_t>(t * k + s)] *
                 (h[static_cast<std::size_t>(t * hidden + c)] * g + static_cast<float>(c));
        }
        ASSERT_NEAR(out[static_cast<std::size_t>(t * hidden + c)], acc, 1e-5F * (1.0F + std::fabs(acc)));
      }
    }
  }
}

TEST(MoeIndexLogic, PermuteEqualsTheDispatchersGroupingOnEveryRank) {
  // Several ranks: rank r's grouped rows come from the sources in rank order, each in (token, slot) order —
  // the emulated permute of the concatenated routing restricted to r's experts.
  Rng rng(5);
  for (int trial = 0; trial < 150; ++trial) {
    const int ranks = static_cast<int>(uniform(rng, 2, 4));
    const std::int64_t E = uniform(rng, 1, 11);
    const std::int64_t k = uniform(rng, 1, std::min<std::int64_t>(E, 3));
    const std::int64_t hidden = 1;
    const parallel::ExpertPlacement placement = uniform(rng, 0, 1) == 1
                                                    ? parallel::ExpertPlacement::round_robin(1, E, ranks)
                                                    : parallel::ExpertPlacement::contiguous(1, E, ranks);
    std::vector<std::int64_t> split(static_cast<std::size_t>(ranks));
    for (auto& n : split) n = uniform(rng, 0, 3) == 0 ? 0 : uniform(rng, 1, 40);
    std::vector<std::int64_t> first(static_cast<std::size_t>(ranks) + 1, 0);
    for (int r = 0; r < ranks; ++r)
      first[static_cast<std::size_t>(r) + 1] =
          first[static_cast<std::size_t>(r)] + split[static_cast<std::size_t>(r)];
    const std::int64_t total = first.back();
    const std::vector<std::int32_t> experts = random_assignments(rng, total, k, E);
    std::vector<std::vector<std::int64_t>> offsets(static_cast<std::size_t>(ranks));
    std::vector<std::vector<float>> rows(static_cast<std::size_t>(ranks));
    test::run_ranks(ranks, [&](parallel::Communicator& comm) {
      const auto r = static_cast<std::size_t>(comm.rank());
      const std::int64_t T = split[r];
      const std::span<const std::int32_t> mine(experts.data() + first[r] * k,
                                               static_cast<std::size_t>(T * k));
      std::vector<float> weights(mine.size(), 1.0F);
      std::vector<float> h(static_cast<std::size_t>(T));
      for (std::int64_t t = 0; t < T; ++t) h[static_cast<std::size_t>(t)] = static_cast<float>(first[r] + t);
      const std::span<const std::int32_t> local = placement.local_experts(0, comm.rank());
      const std::vector<kernels::ExpertWeights> weights_of(local.size());
      parallel::TokenDispatcher dispatcher(comm);
      RecordingBackend backend;
      std::vector<float> out(static_cast<std::size_t>(T));
      const parallel::PlacementTables tables(backend, placement, comm.rank());
      testing::ExpertParallelLayer layer{backend, dispatcher, tables.layer(0), weights_of};
      layer.run(h, T, hidden, k, mine, weights, out);
      offsets[r] = backend.offsets;
      rows[r] = backend.x;
    });
    for (int r = 0; r < ranks; ++r) {
      moe::PermuteParams p;
      p.tokens = total;
      p.top_k = k;
      p.num_groups = static_cast<std::int64_t>(placement.local_experts(0, r).size());
      p.chunk = uniform(rng, 1, 32);
      p.rank = r;
      const moe::PermuteResult perm =
          moe::permute_on_host(p, experts, placement.owners(0), placement.local_index(0));
      SCOPED_TRACE("trial " + std::to_string(trial) + " rank " + std::to_string(r));
      ASSERT_EQ(perm.offsets, offsets[static_cast<std::size_t>(r)]);
      std::vector<float> tokens(perm.row_token.begin(), perm.row_token.end());
      ASSERT_EQ(tokens, rows[static_cast<std::size_t>(r)]);
    }
  }
}

}  // namespace
}  // namespace capserve
