// The MoE index kernels' decisions, run on the host through the same thread bodies and launch sequences the
// CUDA kernels use (kernels/cuda/moe_index_emulation.h), against the CPU implementations: the router's top-k
// against runtime::route_softmax_topk, the capacity scheduler against parallel::CapacityScheduler (local
// scope), the permutation against the grouping parallel::TokenDispatcher hands to the expert FFN. Thousands
// of random routings, with ties made on purpose (logits on a coarse grid), empty steps, expert counts that do
// not divide the ranks, and every policy, score and granularity. Every comparison is bit for bit.
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
#include "kernels/cuda/moe_index_emulation.h"
#include "parallel/capacity_config.h"
#include "parallel/capacity_scheduler.h"
#include "parallel/expert_placement.h"
#include "parallel/self_communicator.h"
#include "parallel/token_dispatcher.h"
#include "runtime/moe_block.h"
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
std::vector<float> random_logits(Rng& rng, std::int64_t rows, std::int64_t experts) {
  std::vector<float> logits(static_cast<std::size_t>(rows * experts));
  const bool coarse = uniform(rng, 0, 1) == 0;
  const std::int64_t levels = uniform(rng, 1, 4);
  std::normal_distribution<float> normal(0.0F, 2.0F);
  for (float& l : logits) {
    l = coarse ? static_cast<float>(uniform(rng, 0, levels)) * 0.5F : normal(rng);
  }
  return logits;
}

std::vector<std::uint32_t> bits(std::span<const float> v) {
  std::vector<std::uint32_t> out(v.size());
  std::transform(v.begin(), v.end(), out.begin(), [](float f) { return std::bit_cast<std::uint32_t>(f); });
  return out;
}

// ---------------------------------------------------------------------------------------------------------
// Router.

TEST(MoeIndexLogic, RouterTopKEqualsTheCpuRouter) {
  Rng rng(7);
  for (int trial = 0; trial < 3000; ++trial) {
    const std::int64_t E = uniform(rng, 1, 24);
    const std::int64_t k = uniform(rng, 1, std::min<std::int64_t>(E, 8));
    const std::int64_t T = uniform(rng, 0, 40);
    runtime::RouterConfig router;
    // Group-limited routing where E splits into groups that can hold k experts.
    std::vector<std::int64_t> group_counts;
    for (std::int64_t g = 2; g <= E; ++g) {
      if (E % g == 0) group_counts.push_back(g);
    }
    if (!group_counts.empty() && uniform(rng, 0, 2) == 0) {
      router.n_group = group_counts[static_cast<std::size_t>(uniform(rng, 0, std::ssize(group_counts) - 1))];
      const std::int64_t min_groups = (k + E / router.n_group - 1) / (E / router.n_group);
      router.topk_group = uniform(rng, min_groups, router.n_group);
    }
    const bool normalize = uniform(rng, 0, 1) == 1;
    router.scaling = uniform(rng, 0, 1) == 1 ? 1.0 : 2.5;
    const std::vector<float> logits = random_logits(rng, T, E);

    runtime::Routing cpu;
    runtime::route_softmax_topk(logits, T, E, k, normalize, cpu, router);

    moe::RouterParams p;
    p.tokens = T;
    p.num_experts = E;
    p.top_k = k;
    p.n_group = router.n_group;
    p.topk_group = router.topk_group;
    p.normalize = normalize;
    p.scaling = static_cast<float>(router.scaling);
    std::vector<float> probs(static_cast<std::size_t>(T * E));
    std::vector<std::int32_t> experts(static_cast<std::size_t>(T * k));
    std::vector<float> weights(static_cast<std::size_t>(T * k));
    moe::emulate_router(p, logits, probs, experts, weights);

    SCOPED_TRACE("trial " + std::to_string(trial) + ": T=" + std::to_string(T) + " E=" + std::to_string(E) +
                 " k=" + std::to_string(k) + " groups=" + std::to_string(router.n_group) + "/" +
                 std::to_string(router.topk_group));
    ASSERT_EQ(bits(probs), bits(cpu.probs));
    ASSERT_EQ(experts, cpu.experts);
    ASSERT_EQ(bits(weights), bits(cpu.weights));
  }
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
  moe::emulate_router(p, logits, probs, experts, weights);
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
  moe::emulate_router(p, logits, probs, experts, weights);
  for (std::size_t e = 0; e < 4; ++e) EXPECT_FLOAT_EQ(probs[e], 1.0F / (1.0F + std::exp(-logits[e])));
  EXPECT_EQ(experts, (std::vector<std::int32_t>{1, 3}));
  EXPECT_FLOAT_EQ(weights[0], 0.5F);
  EXPECT_FLOAT_EQ(weights[1], 0.5F);
}

// ---------------------------------------------------------------------------------------------------------
// Capacity scheduler.

// Rank `rank` of `size` in local scope: any collective is a bug.
class NoCollectives final : public parallel::Communicator {
 public:
  NoCollectives(int rank, int size) : rank_(rank), size_(size) {}
  [[nodiscard]] int rank() const override { return rank_; }
  [[nodiscard]] int size() const override { return size_; }
  void alltoall(std::span<const std::int64_t> /*send*/, std::span<std::int64_t> /*recv*/) override { fail(); }
  void alltoallv(std::span<const std::byte> /*send*/, std::span<const std::int64_t> /*send_counts*/,
                 std::span<std::byte> /*recv*/, std::span<const std::int64_t> /*recv_counts*/) override {
    fail();
  }
  void allreduce_sum(std::span<std::int64_t> /*values*/) override { fail(); }
  void allreduce_max(std::span<double> /*values*/) override { fail(); }
  void allgather(std::span<const std::int64_t> /*mine*/, std::span<std::int64_t> /*all*/) override { fail(); }

 private:
  [[noreturn]] static void fail() { throw std::logic_error("local scope must not communicate"); }
  int rank_;
  int size_;
};

moe::ScoreKind to_kind(parallel::DropScore s) {
  switch (s) {
    case parallel::DropScore::gate:
      return moe::ScoreKind::gate;
    case parallel::DropScore::order:
      return moe::ScoreKind::order;
    case parallel::DropScore::reverse_order:
      return moe::ScoreKind::reverse_order;
    case parallel::DropScore::random:
      return moe::ScoreKind::random;
  }
  return moe::ScoreKind::gate;
}

moe::RerouteKind to_kind(parallel::CapacityPolicy p) {
  switch (p) {
    case parallel::CapacityPolicy::reroute:
      return moe::RerouteKind::reroute;
    case parallel::CapacityPolicy::expanded:
      return moe::RerouteKind::expanded;
    case parallel::CapacityPolicy::none:
    case parallel::CapacityPolicy::drop:
      break;
  }
  return moe::RerouteKind::none;
}

struct CapacityCase {
  parallel::CapacityConfig config;
  std::int64_t T = 0, k = 1, E = 1, layers = 1, layer = 0;
  int ranks = 1, rank = 0;
  bool round_robin = false;
  bool normalized = false;
  float scaling = 1.0F;
  std::vector<float> probs;
  std::vector<std::int32_t> experts;
  std::vector<float> weights;
  std::vector<std::uint8_t> exempt;

  [[nodiscard]] std::string describe() const {
    std::ostringstream s;
    s << "T=" << T << " k=" << k << " E=" << E << " ranks=" << ranks << " rank=" << rank
      << (round_robin ? " round-robin" : " contiguous") << " layer=" << layer << " normalized=" << normalized
      << " scaling=" << scaling << " exempt=" << !exempt.empty() << " " << parallel::describe(config);
    return s.str();
  }
};

CapacityCase random_case(Rng& rng) {
  CapacityCase c;
  c.E = uniform(rng, 1, 20);
  c.k = uniform(rng, 1, std::min<std::int64_t>(c.E, 4));
  c.T = uniform(rng, 0, 10) == 0 ? 0 : uniform(rng, 1, 120);
  c.ranks = static_cast<int>(uniform(rng, 1, 4));
  c.rank = static_cast<int>(uniform(rng, 0, c.ranks - 1));
  c.round_robin = uniform(rng, 0, 1) == 1;
  c.layers = uniform(rng, 1, 3);
  c.layer = uniform(rng, 0, c.layers - 1);
  static constexpr double kGammas[] = {0.1, 0.25, 1.0 / 3.0, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 3.0};
  std::vector<double> gamma;
  const bool per_layer = uniform(rng, 0, 1) == 1;
  for (std::int64_t l = 0; l < (per_layer ? c.layers : 1); ++l)
    gamma.push_back(kGammas[uniform(rng, 0, std::ssize(kGammas) - 1)]);
  c.config.gamma = gamma;
  static constexpr parallel::CapacityPolicy kPolicies[] = {
      parallel::CapacityPolicy::drop, parallel::CapacityPolicy::reroute, parallel::CapacityPolicy::expanded};
  c.config.policy = kPolicies[uniform(rng, 0, 2)];
  c.config.granularity =
      uniform(rng, 0, 1) == 1 ? parallel::CapacityGranularity::device : parallel::CapacityGranularity::expert;
  c.config.scope = parallel::CapacityScope::local;
  static constexpr parallel::DropScore kScores[] = {
      parallel::DropScore::gate, parallel::DropScore::gate, parallel::DropScore::order,
      parallel::DropScore::reverse_order, parallel::DropScore::random};
  c.config.score = kScores[uniform(rng, 0, 4)];
  c.config.rounds = uniform(rng, 1, 3);
  c.config.local_experts = uniform(rng, 1, 3);
  c.config.renormalize_after_drop = uniform(rng, 0, 3) == 0;
  c.config.seed = static_cast<std::uint64_t>(uniform(rng, 0, 1000));
  c.normalized = uniform(rng, 0, 1) == 1;
  c.scaling = uniform(rng, 0, 2) == 0 ? 1.5F : 1.0F;

  // A real router's output on random logits: ties in probabilities and gate weights come from the grid.
  const std::vector<float> logits = random_logits(rng, c.T, c.E);
  runtime::Routing routing;
  runtime::RouterConfig router;
  router.scaling = c.scaling;
  runtime::route_softmax_topk(logits, c.T, c.E, c.k, c.normalized, routing, router);
  c.probs = routing.probs;
  c.experts = routing.experts;
  c.weights = routing.weights;
  if (uniform(rng, 0, 4) == 0) {
    c.exempt.resize(static_cast<std::size_t>(c.T));
    for (auto& x : c.exempt) x = uniform(rng, 0, 3) == 0 ? 1 : 0;
  }
  return c;
}

struct Outcome {
  std::vector<std::int32_t> experts;
  std::vector<std::uint32_t> weight_bits;
  std::vector<std::uint8_t> status;
  std::int64_t dropped = 0;
  std::int64_t rerouted = 0;
};

parallel::ExpertPlacement placement_of(const CapacityCase& c) {
  return c.round_robin ? parallel::ExpertPlacement::round_robin(c.layers, c.E, c.ranks)
                       : parallel::ExpertPlacement::contiguous(c.layers, c.E, c.ranks);
}

// The CPU scheduler's decisions for one rank's share of the case, through `comm`.
Outcome run_cpu(const CapacityCase& c, parallel::Communicator& comm) {
  const parallel::ExpertPlacement placement = placement_of(c);
  parallel::CapacityScheduler scheduler(c.config, comm);
  scheduler.begin_step(c.T);
  Outcome o;
  o.experts = c.experts;
  std::vector<float> weights = c.weights;
  std::vector<parallel::SlotStatus> status(c.experts.size());
  parallel::LayerRouting r{c.T,     c.k,    c.E,      c.probs,      o.experts,
                           weights, status, c.exempt, c.normalized, c.scaling};
  const parallel::LayerCounts counts = scheduler.apply(c.layer, placement, r);
  o.weight_bits = bits(weights);
  for (const auto s : status) o.status.push_back(static_cast<std::uint8_t>(s));
  o.dropped = counts.dropped;
  o.rerouted = counts.rerouted;
  return o;
}

Outcome run_cpu(const CapacityCase& c) {
  parallel::SelfCommunicator self;
  NoCollectives silent(c.rank, c.ranks);
  return run_cpu(c, c.ranks == 1 ? static_cast<parallel::Communicator&>(self) : silent);
}

// total_tokens / token_offset / allreduce_sum: global scope (the local defaults: this rank alone).
Outcome run_emulated(const CapacityCase& c, std::int64_t total_tokens = -1, std::int64_t token_offset = 0,
                     std::function<void(std::span<std::int64_t>)> allreduce_sum = {}) {
  const parallel::ExpertPlacement placement = placement_of(c);
  const bool device = c.config.granularity == parallel::CapacityGranularity::device;
  moe::CapacityInputs in;
  moe::CapacityParams& p = in.params;
  p.tokens = c.T;
  p.top_k = c.k;
  p.num_experts = c.E;
  p.nbins = device ? c.ranks : c.E;
  p.total_tokens = total_tokens < 0 ? c.T : total_tokens;
  p.token_offset = token_offset;
  in.allreduce_sum = std::move(allreduce_sum);
  p.gamma = c.config.gamma_for(c.layer);
  p.reroute = to_kind(c.config.policy);
  p.rounds = c.config.rounds;
  p.local_experts = c.config.local_experts;
  p.score = to_kind(c.config.score);
  p.seed = c.config.seed;
  p.layer = c.layer;
  p.normalized = c.normalized;
  p.scaling = c.scaling;
  p.renormalize_after_drop = c.config.renormalize_after_drop;
  std::vector<std::int32_t> bin_experts;
  if (device) {
    in.owners = placement.owners(c.layer);
    for (int r = 0; r < c.ranks; ++r)
      bin_experts.push_back(static_cast<std::int32_t>(placement.local_experts(c.layer, r).size()));
    in.bin_experts = bin_experts;
  }
  in.local_list = placement.local_experts(c.layer, c.rank);
  in.probs = c.probs;
  in.exempt = c.exempt;
  Outcome o;
  o.experts = c.experts;
  std::vector<float> weights = c.weights;
  o.status.assign(c.experts.size(), 0xFF);
  const moe::CapacityTotals totals = moe::emulate_capacity(in, o.experts, weights, o.status);
  o.weight_bits = bits(weights);
  o.dropped = totals.dropped;
  o.rerouted = totals.rerouted;
  return o;
}

TEST(MoeIndexLogic, CapacitySchedulerDecisionsAreBitIdentical) {
  Rng rng(2024);
  std::int64_t dropped = 0;
  std::int64_t rerouted = 0;
  std::int64_t empty = 0;
  for (int trial = 0; trial < 4000; ++trial) {
    const CapacityCase c = random_case(rng);
    SCOPED_TRACE("trial " + std::to_string(trial) + ": " + c.describe());
    const Outcome cpu = run_cpu(c);
    const Outcome emu = run_emulated(c);
    ASSERT_EQ(emu.status, cpu.status);
    ASSERT_EQ(emu.experts, cpu.experts);
    ASSERT_EQ(emu.weight_bits, cpu.weight_bits);
    ASSERT_EQ(emu.dropped, cpu.dropped);
    ASSERT_EQ(emu.rerouted, cpu.rerouted);
    dropped += cpu.dropped;
    rerouted += cpu.rerouted;
    empty += c.T == 0 ? 1 : 0;
  }
  // The random cases exercise what they are meant to.
  EXPECT_GT(dropped, 10000);
  EXPECT_GT(rerouted, 2000);
  EXPECT_GT(empty, 100);
}

TEST(MoeIndexLogic, GlobalScopeDecisionsAreBitIdenticalOnEveryRank) {
  // The step's tokens split over 2..4 in-process ranks; each rank runs CapacityScheduler in global scope,
  // then the emulation with the same allreduces (counts and radix histograms) through the same communicator.
  Rng rng(77);
  for (int trial = 0; trial < 300; ++trial) {
    CapacityCase c = random_case(rng);
    c.config.scope = parallel::CapacityScope::global;
    c.ranks = static_cast<int>(uniform(rng, 2, 4));
    std::vector<std::int64_t> first{0};
    for (int r = 0; r < c.ranks; ++r) {
      const std::int64_t left = c.T - first.back();
      first.push_back(first.back() + (r + 1 == c.ranks ? left : uniform(rng, 0, left)));
    }
    SCOPED_TRACE("trial " + std::to_string(trial) + ": " + c.describe());
    std::vector<Outcome> cpu(static_cast<std::size_t>(c.ranks));
    std::vector<Outcome> emu(static_cast<std::size_t>(c.ranks));
    test::run_ranks(c.ranks, [&](parallel::Communicator& comm) {
      const auto r = static_cast<std::size_t>(comm.rank());
      CapacityCase mine = c;
      mine.rank = comm.rank();
      mine.T = first[r + 1] - first[r];
      const auto slice = [&](const auto& v, std::int64_t width) {
        using T = typename std::decay_t<decltype(v)>::value_type;
        return std::vector<T>(v.begin() + first[r] * width, v.begin() + first[r + 1] * width);
      };
      mine.probs = slice(c.probs, c.E);
      mine.experts = slice(c.experts, c.k);
      mine.weights = slice(c.weights, c.k);
      if (!c.exempt.empty()) mine.exempt = slice(c.exempt, 1);

      cpu[r] = run_cpu(mine, comm);
      emu[r] =
          run_emulated(mine, c.T, first[r], [&comm](std::span<std::int64_t> v) { comm.allreduce_sum(v); });
    });
    for (std::size_t r = 0; r < cpu.size(); ++r) {
      SCOPED_TRACE("rank " + std::to_string(r));
      ASSERT_EQ(emu[r].status, cpu[r].status);
      ASSERT_EQ(emu[r].experts, cpu[r].experts);
      ASSERT_EQ(emu[r].weight_bits, cpu[r].weight_bits);
      ASSERT_EQ(emu[r].dropped, cpu[r].dropped);
      ASSERT_EQ(emu[r].rerouted, cpu[r].rerouted);
    }
  }
}

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
  const moe::CapacityTotals totals = moe::emulate_capacity(in, experts, weights, status);
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
    dispatcher.run(h, T, hidden, k, experts, weights, {placement.owners(0), placement.local_index(0), local},
                   backend, out);

    moe::PermuteParams p;
    p.tokens = T;
    p.top_k = k;
    p.num_groups = E;
    p.chunk = uniform(rng, 1, 64);
    const moe::PermuteResult perm = moe::emulate_permute(p, experts, {}, {});
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
      dispatcher.run(h, T, hidden, k, mine, weights,
                     {placement.owners(0), placement.local_index(0), weights_of}, backend, out);
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
          moe::emulate_permute(p, experts, placement.owners(0), placement.local_index(0));
      SCOPED_TRACE("trial " + std::to_string(trial) + " rank " + std::to_string(r));
      ASSERT_EQ(perm.offsets, offsets[static_cast<std::size_t>(r)]);
      std::vector<float> tokens(perm.row_token.begin(), perm.row_token.end());
      ASSERT_EQ(tokens, rows[static_cast<std::size_t>(r)]);
    }
  }
}

}  // namespace
}  // namespace capserve
