// Token dispatcher: over in-process groups of 1..4 ranks with the real CPU backend, every token's output is
// the gate-weighted sum of its experts computed directly (in double, one token at a time), and what moved —
// rows, entries, bytes — matches counts derived independently from the routing and the placement.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "kernels/backend.h"
#include "kernels/cpu/cpu_backend.h"
#include "parallel/capacity_stage.h"
#include "parallel/expert_placement.h"
#include "parallel/self_communicator.h"
#include "parallel/token_dispatcher.h"
#include "tests/support/expert_parallel.h"
#include "tests/support/thread_communicator.h"

namespace capserve::parallel {
namespace {

static_assert(sizeof(TokenDispatcher::Entry) == 12, "the wire format of one dispatched assignment");

constexpr std::int64_t kHidden = 8;
constexpr std::int64_t kFfn = 4;

// E random SwiGLU experts in f32.
struct Experts {
  std::int64_t count = 0;
  std::vector<std::vector<float>> gate, up, down;  // [ffn, hidden], [ffn, hidden], [hidden, ffn]

  Experts(std::int64_t E, std::uint64_t seed) : count(E) {
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> n(0.0F, 0.5F);
    for (std::int64_t e = 0; e < E; ++e) {
      for (auto* w : {&gate, &up, &down}) {
        w->emplace_back(static_cast<std::size_t>(kFfn * kHidden));
        for (float& x : w->back()) x = n(rng);
      }
    }
  }

  static kernels::Tensor view(const std::vector<float>& w, std::int64_t rows, std::int64_t cols) {
    return kernels::weight_tensor(
        {kernels::DType::f32, reinterpret_cast<const std::byte*>(w.data()), rows, cols});
  }

  // The experts `rank` hosts, by local index.
  [[nodiscard]] std::vector<kernels::ExpertWeights> local(const ExpertPlacement& p, int rank) const {
    std::vector<kernels::ExpertWeights> out;
    for (const std::int32_t e : p.local_experts(0, rank)) {
      const auto i = static_cast<std::size_t>(e);
      out.push_back({view(gate[i], kFfn, kHidden), view(up[i], kFfn, kHidden), view(down[i], kHidden, kFfn)});
    }
    return out;
  }

  // down(silu(gate x) * up x) in double.
  [[nodiscard]] std::vector<double> apply(std::int64_t e, const float* x) const {
    const auto i = static_cast<std::size_t>(e);
    std::vector<double> a(kFfn);
    for (std::int64_t f = 0; f < kFfn; ++f) {
      double g = 0;
      double u = 0;
      for (std::int64_t c = 0; c < kHidden; ++c) {
        g += static_cast<double>(gate[i][static_cast<std::size_t>(f * kHidden + c)]) * x[c];
        u += static_cast<double>(up[i][static_cast<std::size_t>(f * kHidden + c)]) * x[c];
      }
      a[static_cast<std::size_t>(f)] = g / (1.0 + std::exp(-g)) * u;
    }
    std::vector<double> y(kHidden, 0.0);
    for (std::int64_t c = 0; c < kHidden; ++c)
      for (std::int64_t f = 0; f < kFfn; ++f)
        y[static_cast<std::size_t>(c)] +=
            static_cast<double>(down[i][static_cast<std::size_t>(c * kFfn + f)]) *
            a[static_cast<std::size_t>(f)];
    return y;
  }
};

// One layer call of a step: all ranks' tokens in global order.
struct Step {
  std::int64_t T = 0;
  std::int64_t k = 1;
  std::vector<std::int64_t> split;    // tokens per rank
  std::vector<float> h;               // [T, hidden]
  std::vector<std::int32_t> experts;  // [T, k], -1 = dropped
  std::vector<float> weights;         // [T, k]
};

// What one rank saw.
struct RankResult {
  std::vector<float> out;
  DispatchCounters counters;
  std::int64_t bytes = 0;  // growth of comm.bytes_sent() over the call
};

std::vector<std::int64_t> offsets_of(const std::vector<std::int64_t>& split) {
  std::vector<std::int64_t> off(split.size() + 1, 0);
  for (std::size_t r = 0; r < split.size(); ++r) off[r + 1] = off[r] + split[r];
  return off;
}

// The fixed-size exchange's bounds of a step, from its routing: the most rows and entries any rank sends any
// peer, the most slots any expert gets; `slack` more of each.
runtime::ExchangeForm blocks_for(const Step& s, const ExpertPlacement& placement, std::int64_t slack) {
  const int np = placement.num_ranks();
  const auto owners = placement.owners(0);
  const std::vector<std::int64_t> off = offsets_of(s.split);
  std::vector<std::int64_t> load(owners.size(), 0);
  parallel::CapacityStage::FixedBounds b;
  for (int a = 0; a < np; ++a) {
    std::vector<std::int64_t> rows(static_cast<std::size_t>(np), 0);
    std::vector<std::int64_t> entries(static_cast<std::size_t>(np), 0);
    for (std::int64_t t = off[static_cast<std::size_t>(a)]; t < off[static_cast<std::size_t>(a) + 1]; ++t) {
      std::vector<bool> hit(static_cast<std::size_t>(np), false);
      for (std::int64_t q = 0; q < s.k; ++q) {
        const std::int32_t e = s.experts[static_cast<std::size_t>(t * s.k + q)];
        if (e < 0) continue;
        const auto d = static_cast<std::size_t>(owners[static_cast<std::size_t>(e)]);
        ++entries[d];
        ++load[static_cast<std::size_t>(e)];
        if (!hit[d]) ++rows[d];
        hit[d] = true;
      }
    }
    b.rows = std::max(b.rows, *std::max_element(rows.begin(), rows.end()));
    b.entries = std::max(b.entries, *std::max_element(entries.begin(), entries.end()));
  }
  b.expert_rows = *std::max_element(load.begin(), load.end());
  b.rows += slack;
  b.entries += slack;
  b.expert_rows += slack;
  runtime::ExchangeForm form;
  form.fixed = b;
  return form;
}

// Runs the steps in order on one dispatcher per rank (buffers reused across calls); with `slack` >= 0 in the
// fixed-size exchange, blocks that much larger than the step needs.
std::vector<std::vector<RankResult>> run(const std::vector<Step>& steps, const ExpertPlacement& placement,
                                         const Experts& experts, std::int64_t slack = -1) {
  const int np = placement.num_ranks();
  std::vector<std::vector<RankResult>> results(steps.size(),
                                               std::vector<RankResult>(static_cast<std::size_t>(np)));
  const auto rank_fn = [&](Communicator& comm) {
    const int r = comm.rank();
    kernels::cpu::CpuBackend backend(1);
    TokenDispatcher dispatcher(comm);
    const std::vector<kernels::ExpertWeights> local = experts.local(placement, r);
    const PlacementTables tables(backend, placement, r);
    testing::ExpertParallelLayer layer{backend, dispatcher, tables.layer(0), local};
    for (std::size_t i = 0; i < steps.size(); ++i) {
      const Step& s = steps[i];
      const std::int64_t first = offsets_of(s.split)[static_cast<std::size_t>(r)];
      const std::int64_t n = s.split[static_cast<std::size_t>(r)];
      RankResult& res = results[i][static_cast<std::size_t>(r)];
      res.out.assign(static_cast<std::size_t>(n * kHidden), 12345.0F);  // must be overwritten
      const std::int64_t before = comm.bytes_sent();
      if (slack >= 0) layer.form = blocks_for(s, placement, slack);
      layer.run(std::span<const float>(s.h).subspan(static_cast<std::size_t>(first * kHidden),
                                                    static_cast<std::size_t>(n * kHidden)),
                n, kHidden, s.k,
                std::span<const std::int32_t>(s.experts).subspan(static_cast<std::size_t>(first * s.k),
                                                                 static_cast<std::size_t>(n * s.k)),
                std::span<const float>(s.weights).subspan(static_cast<std::size_t>(first * s.k),
                                                          static_cast<std::size_t>(n * s.k)),
                res.out);
      res.bytes = comm.bytes_sent() - before;
      res.counters = dispatcher.counters();
    }
  };
  if (np == 1) {
    SelfCommunicator comm;
    rank_fn(comm);
  } else {
    test::run_ranks(np, rank_fn);
  }
  return results;
}

// Checks outputs against the direct sum and the counters/bytes against the routing (the fixed-size
// exchange: bytes of full blocks, `slack` larger than the step needs).
void check(const std::vector<Step>& steps, const ExpertPlacement& placement, const Experts& experts,
           const std::vector<std::vector<RankResult>>& results, const std::string& what,
           std::int64_t slack = -1) {
  const int np = placement.num_ranks();
  const auto owners = placement.owners(0);
  for (std::size_t i = 0; i < steps.size(); ++i) {
    const Step& s = steps[i];
    const std::vector<std::int64_t> off = offsets_of(s.split);
    SCOPED_TRACE(what + " step " + std::to_string(i));
    // rows[a][b]: tokens of rank a with at least one expert on rank b; entries[a][b]: their slots there.
    std::vector<std::vector<std::int64_t>> rows(static_cast<std::size_t>(np),
                                                std::vector<std::int64_t>(static_cast<std::size_t>(np), 0));
    auto entries = rows;
    for (int a = 0; a < np; ++a) {
      for (std::int64_t t = off[static_cast<std::size_t>(a)]; t < off[static_cast<std::size_t>(a) + 1]; ++t) {
        std::vector<bool> hit(static_cast<std::size_t>(np), false);
        for (std::int64_t q = 0; q < s.k; ++q) {
          const std::int32_t e = s.experts[static_cast<std::size_t>(t * s.k + q)];
          if (e < 0) continue;
          const auto b = static_cast<std::size_t>(owners[static_cast<std::size_t>(e)]);
          ++entries[static_cast<std::size_t>(a)][b];
          hit[b] = true;
        }
        for (int b = 0; b < np; ++b)
          rows[static_cast<std::size_t>(a)][static_cast<std::size_t>(b)] +=
              hit[static_cast<std::size_t>(b)] ? 1 : 0;
      }
    }
    for (int r = 0; r < np; ++r) {
      const auto ur = static_cast<std::size_t>(r);
      const RankResult& res = results[i][ur];
      std::int64_t rows_out = 0;
      std::int64_t rows_remote = 0;
      std::int64_t entries_out = 0;
      std::int64_t rows_in = 0;
      std::int64_t bytes = 0;
      for (int b = 0; b < np; ++b) {
        const auto ub = static_cast<std::size_t>(b);
        rows_out += rows[ur][ub];
        entries_out += entries[ur][ub];
        rows_in += rows[ub][ur];
        if (b == r) continue;
        rows_remote += rows[ur][ub];
        bytes += rows[ur][ub] * kHidden * static_cast<std::int64_t>(sizeof(float)) +            // rows out
                 entries[ur][ub] * static_cast<std::int64_t>(sizeof(TokenDispatcher::Entry)) +  // dispatch
                 rows[ub][ur] * kHidden * static_cast<std::int64_t>(sizeof(float));             // combine
      }
      if (slack < 0) {
        EXPECT_EQ(res.counters.rows_sent, rows_out) << "rank " << r;
        EXPECT_EQ(res.counters.rows_sent_remote, rows_remote) << "rank " << r;
        EXPECT_EQ(res.counters.assignments_sent, entries_out) << "rank " << r;
        EXPECT_EQ(res.counters.rows_received, rows_in) << "rank " << r;
      } else {
        const parallel::CapacityStage::FixedBounds b = *blocks_for(s, placement, slack).fixed;
        bytes = (np - 1) * (2 * b.rows * kHidden * static_cast<std::int64_t>(sizeof(float)) +
                            b.entries * static_cast<std::int64_t>(sizeof(TokenDispatcher::Entry)));
      }
      EXPECT_EQ(res.bytes, bytes) << "rank " << r;
      EXPECT_EQ(res.counters.wire_bytes, bytes) << "rank " << r;

      // Outputs.
      for (std::int64_t t = off[ur]; t < off[ur + 1]; ++t) {
        std::vector<double> want(kHidden, 0.0);
        double scale = 0.0;
        bool any = false;
        for (std::int64_t q = 0; q < s.k; ++q) {
          const std::int32_t e = s.experts[static_cast<std::size_t>(t * s.k + q)];
          if (e < 0) continue;
          any = true;
          const double w = s.weights[static_cast<std::size_t>(t * s.k + q)];
          const std::vector<double> y = experts.apply(e, s.h.data() + t * kHidden);
          for (std::int64_t c = 0; c < kHidden; ++c) {
            want[static_cast<std::size_t>(c)] += w * y[static_cast<std::size_t>(c)];
            scale = std::max(scale, std::fabs(w * y[static_cast<std::size_t>(c)]));
          }
        }
        for (std::int64_t c = 0; c < kHidden; ++c) {
          const float got = res.out[static_cast<std::size_t>((t - off[ur]) * kHidden + c)];
          if (!any) {
            EXPECT_EQ(got, 0.0F) << "token " << t << " with every slot dropped, column " << c;
          } else {
            EXPECT_NEAR(got, want[static_cast<std::size_t>(c)], 1e-5 * std::max(scale, 1e-3))
                << "rank " << r << " token " << t << " column " << c;
          }
        }
      }
    }
  }
}

Step random_step(std::mt19937_64& rng, std::int64_t T, std::int64_t k, std::int64_t E, int np, double drop) {
  Step s;
  s.T = T;
  s.k = k;
  // Random split with empty ranks.
  std::vector<std::int64_t> cuts = {0, T};
  for (int r = 1; r < np; ++r)
    cuts.push_back(static_cast<std::int64_t>(rng() % static_cast<std::uint64_t>(T + 1)));
  std::sort(cuts.begin(), cuts.end());
  for (int r = 0; r < np; ++r)
    s.split.push_back(cuts[static_cast<std::size_t>(r) + 1] - cuts[static_cast<std::size_t>(r)]);
  std::normal_distribution<float> n(0.0F, 1.0F);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  s.h.resize(static_cast<std::size_t>(T * kHidden));
  for (float& x : s.h) x = n(rng);
  std::vector<std::int32_t> ids(static_cast<std::size_t>(E));
  for (std::int64_t t = 0; t < T; ++t) {
    for (std::size_t e = 0; e < ids.size(); ++e) ids[e] = static_cast<std::int32_t>(e);
    std::shuffle(ids.begin(), ids.end(), rng);
    const bool all_dropped = u(rng) < 0.1;
    for (std::int64_t q = 0; q < k; ++q) {
      const bool dropped = all_dropped || u(rng) < drop;
      s.experts.push_back(dropped ? -1 : ids[static_cast<std::size_t>(q)]);
      s.weights.push_back(dropped ? 0.0F : static_cast<float>(u(rng)));
    }
  }
  return s;
}

TEST(TokenDispatcher, MatchesTheDirectSumOnOneToFourRanks) {
  const Experts experts(6, 1);
  std::mt19937_64 rng(2);
  for (int np = 1; np <= 4; ++np) {
    for (const char* kind : {"contiguous", "round-robin"}) {
      const ExpertPlacement placement = ExpertPlacement::from_spec(kind, 1, 6, np);
      std::vector<Step> steps;
      for (const std::int64_t k : {1, 2, 3, 6, 4})
        steps.push_back(random_step(rng, 1 + static_cast<std::int64_t>(rng() % 40), k, 6, np, 0.2));
      steps.push_back(random_step(rng, 0, 2, 6, np, 0.0));  // nobody has tokens
      steps.push_back(random_step(rng, 3, 2, 6, np, 0.0));  // fewer tokens than ranks
      check(steps, placement, experts, run(steps, placement, experts),
            std::string(kind) + " np=" + std::to_string(np));
    }
  }
}

// The fixed-size exchange (send_blocks / combine_blocks) with blocks exactly as large as the step needs, and
// larger: the same sums, full blocks on the wire.
TEST(TokenDispatcher, FixedSizeBlocksMatchTheDirectSumOnOneToFourRanks) {
  const Experts experts(6, 11);
  std::mt19937_64 rng(12);
  for (int np = 1; np <= 4; ++np) {
    for (const char* kind : {"contiguous", "round-robin"}) {
      const ExpertPlacement placement = ExpertPlacement::from_spec(kind, 1, 6, np);
      std::vector<Step> steps;
      for (const std::int64_t k : {1, 2, 6, 4})
        steps.push_back(random_step(rng, 1 + static_cast<std::int64_t>(rng() % 40), k, 6, np, 0.2));
      steps.push_back(random_step(rng, 0, 2, 6, np, 0.0));
      for (const std::int64_t slack : {0, 3}) {
        check(steps, placement, experts, run(steps, placement, experts, slack),
              std::string(kind) + " np=" + std::to_string(np) + " slack=" + std::to_string(slack), slack);
      }
    }
  }
}

// Blocks too small for the routing (a bound that did not hold) lose rows: the overflow says how many.
TEST(TokenDispatcher, FixedSizeBlocksTooSmallReportTheirOverflow) {
  const Experts experts(4, 13);
  std::mt19937_64 rng(14);
  const ExpertPlacement placement = ExpertPlacement::contiguous(1, 4, 1);
  const Step s = random_step(rng, 12, 2, 4, 1, 0.0);
  kernels::cpu::CpuBackend backend(1);
  SelfCommunicator comm;
  TokenDispatcher dispatcher(comm);
  const std::vector<kernels::ExpertWeights> local = experts.local(placement, 0);
  const PlacementTables tables(backend, placement, 0);
  testing::ExpertParallelLayer layer{backend, dispatcher, tables.layer(0), local};
  layer.form = blocks_for(s, placement, 0);
  const std::int64_t exact_rows = layer.form.fixed->rows;
  layer.form.fixed->rows -= 2;
  layer.form.fixed->expert_rows -= 1;
  std::int64_t overflow = 0;
  layer.form.overflow = kernels::Tensor::host(std::span(&overflow, 1), {1});
  std::vector<float> out(static_cast<std::size_t>(s.T * kHidden));
  layer.run(s.h, s.T, kHidden, s.k, s.experts, s.weights, out);
  ASSERT_GE(exact_rows, 3) << "rows enough to lose two";
  // At least the two rows past the rank's block (the experts' blocks may overflow too).
  EXPECT_GE(overflow, 2);
}

TEST(TokenDispatcher, ManyRowsPerExpertTakeTheGemmPath) {
  // More than 32 rows for one expert on one rank: the backend's BLAS path.
  const Experts experts(6, 3);
  std::mt19937_64 rng(4);
  for (int np = 1; np <= 4; ++np) {
    const ExpertPlacement placement = ExpertPlacement::contiguous(1, 6, np);
    std::vector<Step> steps = {random_step(rng, 150, 2, 6, np, 0.05), random_step(rng, 90, 6, 6, np, 0.0)};
    check(steps, placement, experts, run(steps, placement, experts), "np=" + std::to_string(np));
  }
}

TEST(TokenDispatcher, RanksWithoutExperts) {
  // 3 experts on 4 ranks: rank 3 hosts none and still joins every exchange.
  const Experts experts(3, 5);
  std::mt19937_64 rng(6);
  const ExpertPlacement placement = ExpertPlacement::contiguous(1, 3, 4);
  ASSERT_TRUE(placement.local_experts(0, 3).empty());
  std::vector<Step> steps = {random_step(rng, 20, 2, 3, 4, 0.1), random_step(rng, 7, 3, 3, 4, 0.0)};
  check(steps, placement, experts, run(steps, placement, experts), "3 experts on 4 ranks");
}

TEST(TokenDispatcher, AllDroppedTokensGetZeros) {
  const Experts experts(6, 7);
  const ExpertPlacement placement = ExpertPlacement::round_robin(1, 6, 2);
  Step s;
  s.T = 4;
  s.k = 2;
  s.split = {3, 1};
  s.h.assign(static_cast<std::size_t>(4 * kHidden), 1.5F);
  s.experts = {-1, -1, 0, -1, -1, -1, -1, -1};
  s.weights = {0, 0, 0.5F, 0, 0, 0, 0, 0};
  const std::vector<Step> steps = {s};
  const auto results = run(steps, placement, experts);
  check(steps, placement, experts, results, "all dropped");
  for (const float x : results[0][1].out) EXPECT_EQ(x, 0.0F);
  EXPECT_EQ(results[0][1].counters.rows_sent, 0);
  EXPECT_EQ(results[0][0].counters.rows_sent, 1);
}

TEST(TokenDispatcher, OneRowPerDestinationRank) {
  // E = 6 on 2 ranks (0-2 | 3-5). Rank 0's token 0 uses experts 3, 4, 5 — all on rank 1: ONE row of hidden
  // floats, three entries. Token 1 uses 0 (local) and 5 (remote): one local row, one remote row.
  const Experts experts(6, 8);
  const ExpertPlacement placement = ExpertPlacement::contiguous(1, 6, 2);
  Step s;
  s.T = 2;
  s.k = 3;
  s.split = {2, 0};
  std::mt19937_64 rng(9);
  std::normal_distribution<float> n(0.0F, 1.0F);
  s.h.resize(2 * kHidden);
  for (float& x : s.h) x = n(rng);
  s.experts = {4, 3, 5, 0, -1, 5};
  s.weights = {0.5F, 0.3F, 0.2F, 0.6F, 0.0F, 0.4F};
  const std::vector<Step> steps = {s};
  const auto results = run(steps, placement, experts);
  check(steps, placement, experts, results, "one row per destination");
  const DispatchCounters& r0 = results[0][0].counters;
  EXPECT_EQ(r0.rows_sent, 3);
  EXPECT_EQ(r0.rows_sent_remote, 2);
  EXPECT_EQ(r0.assignments_sent, 5);
  constexpr auto kRow = static_cast<std::int64_t>(kHidden * sizeof(float));
  constexpr auto kEntry = static_cast<std::int64_t>(sizeof(TokenDispatcher::Entry));
  EXPECT_EQ(results[0][0].bytes, 2 * kRow + 4 * kEntry);  // rank 1 returns its 2 rows: its bytes, not ours
  EXPECT_EQ(results[0][1].counters.rows_received, 2);
  EXPECT_EQ(results[0][1].bytes, 2 * kRow);
  EXPECT_EQ(results[0][1].counters.rows_sent, 0);
}

TEST(TokenDispatcher, SingleRankMovesNothingOverTheWire) {
  const Experts experts(6, 10);
  std::mt19937_64 rng(11);
  const ExpertPlacement placement = ExpertPlacement::contiguous(1, 6, 1);
  const std::vector<Step> steps = {random_step(rng, 25, 3, 6, 1, 0.1)};
  const auto results = run(steps, placement, experts);
  check(steps, placement, experts, results, "np=1");
  EXPECT_EQ(results[0][0].bytes, 0);
  EXPECT_EQ(results[0][0].counters.rows_sent_remote, 0);
}

}  // namespace
}  // namespace capserve::parallel
