// Expert placement: every expert on exactly one rank, per-rank counts as even as the counts allow, the three
// views (owners, local_experts, local_index) consistent; balanced placement against a brute-force check of
// its greedy rule; statistics files and their errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "parallel/expert_placement.h"

namespace capserve::parallel {
namespace {

// Owners, local lists and local indices describe one and the same partition of the experts.
void expect_consistent(const ExpertPlacement& p) {
  for (std::int64_t l = 0; l < p.num_layers(); ++l) {
    const auto owners = p.owners(l);
    const auto index = p.local_index(l);
    ASSERT_EQ(static_cast<std::int64_t>(owners.size()), p.num_experts());
    ASSERT_EQ(static_cast<std::int64_t>(index.size()), p.num_experts());
    std::vector<int> seen(static_cast<std::size_t>(p.num_experts()), 0);
    for (int r = 0; r < p.num_ranks(); ++r) {
      const auto local = p.local_experts(l, r);
      EXPECT_TRUE(std::is_sorted(local.begin(), local.end())) << "layer " << l << " rank " << r;
      for (std::size_t i = 0; i < local.size(); ++i) {
        const auto e = static_cast<std::size_t>(local[i]);
        ASSERT_LT(e, seen.size());
        ++seen[e];
        EXPECT_EQ(owners[e], r) << "layer " << l << " expert " << e;
        EXPECT_EQ(index[e], static_cast<std::int32_t>(i)) << "layer " << l << " expert " << e;
      }
    }
    for (std::size_t e = 0; e < seen.size(); ++e) EXPECT_EQ(seen[e], 1) << "layer " << l << " expert " << e;
  }
}

std::vector<std::int64_t> counts(const ExpertPlacement& p, std::int64_t layer) {
  std::vector<std::int64_t> n;
  for (int r = 0; r < p.num_ranks(); ++r)
    n.push_back(static_cast<std::int64_t>(p.local_experts(layer, r).size()));
  return n;
}

// E / R each, the first E % R ranks one more.
std::vector<std::int64_t> quotas(std::int64_t E, int R) {
  std::vector<std::int64_t> q;
  for (int r = 0; r < R; ++r) q.push_back(E / R + (r < E % R ? 1 : 0));
  return q;
}

std::vector<double> rank_loads(const ExpertPlacement& p, std::int64_t layer,
                               const std::vector<double>& load) {
  std::vector<double> per(static_cast<std::size_t>(p.num_ranks()), 0.0);
  for (std::size_t e = 0; e < load.size(); ++e) per[static_cast<std::size_t>(p.owners(layer)[e])] += load[e];
  return per;
}

double max_of(const std::vector<double>& v) {
  return *std::max_element(v.begin(), v.end());
}

TEST(ExpertPlacement, ContiguousSixtyOnEight) {
  const ExpertPlacement p = ExpertPlacement::contiguous(3, 60, 8);
  EXPECT_EQ(p.kind(), "contiguous");
  EXPECT_EQ(p.num_ranks(), 8);
  EXPECT_EQ(p.num_layers(), 3);
  EXPECT_EQ(p.num_experts(), 60);
  expect_consistent(p);
  for (std::int64_t l = 0; l < 3; ++l) {
    EXPECT_EQ(counts(p, l), (std::vector<std::int64_t>{8, 8, 8, 8, 7, 7, 7, 7}));
    // Contiguous ranges in rank order.
    for (std::size_t e = 1; e < 60; ++e) EXPECT_LE(p.owners(l)[e - 1], p.owners(l)[e]);
  }
  EXPECT_EQ(p.local_experts(0, 4).front(), 32);
  EXPECT_EQ(p.local_experts(0, 7).back(), 59);
}

TEST(ExpertPlacement, RoundRobinSixtyOnEight) {
  const ExpertPlacement p = ExpertPlacement::round_robin(2, 60, 8);
  EXPECT_EQ(p.kind(), "round-robin");
  expect_consistent(p);
  EXPECT_EQ(counts(p, 1), (std::vector<std::int64_t>{8, 8, 8, 8, 7, 7, 7, 7}));
  for (std::size_t e = 0; e < 60; ++e) EXPECT_EQ(p.owners(1)[e], static_cast<std::int32_t>(e % 8));
  EXPECT_EQ(p.local_index(0)[59], 7);  // 3, 11, ..., 59 on rank 3: the eighth
}

TEST(ExpertPlacement, EveryShapeIsAPartitionWithEvenCounts) {
  for (const std::int64_t E : {1, 2, 3, 7, 10, 16, 60, 64}) {
    for (const int R : {1, 2, 3, 4, 5, 8, 11}) {
      std::mt19937_64 rng(static_cast<std::uint64_t>(E * 100 + R));
      std::vector<std::vector<double>> loads(2);
      for (std::int64_t e = 0; e < E; ++e) loads[1].push_back(static_cast<double>(rng() % 1000));
      for (const ExpertPlacement& p :
           {ExpertPlacement::contiguous(2, E, R), ExpertPlacement::round_robin(2, E, R),
            ExpertPlacement::balanced(loads, E, R)}) {
        SCOPED_TRACE(p.kind() + " E=" + std::to_string(E) + " R=" + std::to_string(R));
        expect_consistent(p);
        for (std::int64_t l = 0; l < 2; ++l) {
          const std::vector<std::int64_t> n = counts(p, l);
          EXPECT_LE(*std::max_element(n.begin(), n.end()) - *std::min_element(n.begin(), n.end()), 1);
          EXPECT_EQ(std::accumulate(n.begin(), n.end(), std::int64_t{0}), E);
          if (p.kind() != "round-robin") {
            EXPECT_EQ(n, quotas(E, R));
          }
        }
      }
    }
  }
}

TEST(ExpertPlacement, RejectsImpossibleShapes) {
  EXPECT_THROW(ExpertPlacement::contiguous(1, 8, 0), std::invalid_argument);
  EXPECT_THROW(ExpertPlacement::contiguous(1, 0, 2), std::invalid_argument);
  EXPECT_THROW(ExpertPlacement::round_robin(-1, 8, 2), std::invalid_argument);
  const std::vector<std::vector<double>> short_loads = {{1, 2, 3}};
  EXPECT_THROW(ExpertPlacement::balanced(short_loads, 4, 2), std::invalid_argument);
}

TEST(ExpertPlacement, BalancedSeparatesTheHeavyExperts) {
  // Experts 0..3 (contiguous: all on rank 0) carry almost all the load.
  const std::int64_t E = 16;
  const int R = 4;
  std::vector<double> load(E, 1.0);
  load[0] = 100;
  load[1] = 90;
  load[2] = 80;
  load[3] = 70;
  const std::vector<std::vector<double>> loads = {load, {}};
  const ExpertPlacement p = ExpertPlacement::balanced(loads, E, R);
  EXPECT_EQ(p.kind(), "balanced");
  expect_consistent(p);
  std::vector<std::int32_t> heavy_ranks;
  for (std::size_t e = 0; e < 4; ++e) heavy_ranks.push_back(p.owners(0)[e]);
  std::sort(heavy_ranks.begin(), heavy_ranks.end());
  EXPECT_EQ(heavy_ranks, (std::vector<std::int32_t>{0, 1, 2, 3}));
  EXPECT_EQ(counts(p, 0), quotas(E, R));
  const ExpertPlacement contiguous = ExpertPlacement::contiguous(2, E, R);
  EXPECT_LT(max_of(rank_loads(p, 0, load)), max_of(rank_loads(contiguous, 0, load)));
  EXPECT_DOUBLE_EQ(max_of(rank_loads(p, 0, load)), 103.0);  // 100 + three light experts
  // A layer without measurements stays contiguous.
  for (std::size_t e = 0; e < static_cast<std::size_t>(E); ++e)
    EXPECT_EQ(p.owners(1)[e], contiguous.owners(1)[e]);
}

// The greedy rule of the header, written out: heaviest first (ties by id), to the least loaded rank below its
// quota (ties to the lower rank).
std::vector<std::int32_t> greedy_owners(const std::vector<double>& load, int R) {
  const auto E = static_cast<std::int64_t>(load.size());
  std::vector<std::int32_t> order(static_cast<std::size_t>(E));
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](std::int32_t a, std::int32_t b) {
    return load[static_cast<std::size_t>(a)] != load[static_cast<std::size_t>(b)]
               ? load[static_cast<std::size_t>(a)] > load[static_cast<std::size_t>(b)]
               : a < b;
  });
  const std::vector<std::int64_t> q = quotas(E, R);
  std::vector<double> rank_load(static_cast<std::size_t>(R), 0.0);
  std::vector<std::int64_t> n(static_cast<std::size_t>(R), 0);
  std::vector<std::int32_t> owner(static_cast<std::size_t>(E), -1);
  for (const std::int32_t e : order) {
    int best = -1;
    for (int r = 0; r < R; ++r) {
      if (n[static_cast<std::size_t>(r)] == q[static_cast<std::size_t>(r)]) continue;
      if (best < 0 || rank_load[static_cast<std::size_t>(r)] < rank_load[static_cast<std::size_t>(best)])
        best = r;
    }
    owner[static_cast<std::size_t>(e)] = best;
    rank_load[static_cast<std::size_t>(best)] += load[static_cast<std::size_t>(e)];
    ++n[static_cast<std::size_t>(best)];
  }
  return owner;
}

TEST(ExpertPlacement, BalancedBeatsContiguousOnSkewedLoads) {
  std::mt19937_64 rng(41);
  for (int trial = 0; trial < 300; ++trial) {
    const std::int64_t E = 4 + static_cast<std::int64_t>(rng() % 61);
    const int R = 2 + static_cast<int>(rng() % 7);
    // Zipf-like loads with exact ties (integers), popular experts in random positions.
    std::vector<double> load(static_cast<std::size_t>(E));
    for (std::int64_t e = 0; e < E; ++e)
      load[static_cast<std::size_t>(e)] = std::floor(1000.0 / static_cast<double>(e + 1));
    std::shuffle(load.begin(), load.end(), rng);
    const std::vector<std::vector<double>> loads = {load};
    const ExpertPlacement p = ExpertPlacement::balanced(loads, E, R);
    SCOPED_TRACE("E=" + std::to_string(E) + " R=" + std::to_string(R));
    expect_consistent(p);
    EXPECT_EQ(counts(p, 0), quotas(E, R));
    const double balanced_max = max_of(rank_loads(p, 0, load));
    EXPECT_LE(balanced_max, max_of(rank_loads(ExpertPlacement::contiguous(1, E, R), 0, load)));
    EXPECT_LE(balanced_max, max_of(rank_loads(ExpertPlacement::round_robin(1, E, R), 0, load)));
    // Never worse than the plain greedy rule.
    std::vector<double> greedy_load(static_cast<std::size_t>(R), 0.0);
    const std::vector<std::int32_t> greedy = greedy_owners(load, R);
    for (std::size_t e = 0; e < greedy.size(); ++e)
      greedy_load[static_cast<std::size_t>(greedy[e])] += load[e];
    EXPECT_LE(balanced_max, max_of(greedy_load));
    // Locally optimal: no swap of an expert on the (first) most loaded rank with a lighter one elsewhere
    // leaves both ranks below the current maximum.
    const std::vector<double> per = rank_loads(p, 0, load);
    const auto m = static_cast<std::int32_t>(std::max_element(per.begin(), per.end()) - per.begin());
    std::string improvable;
    for (std::size_t a = 0; a < load.size() && improvable.empty(); ++a) {
      if (p.owners(0)[a] != m) continue;
      for (std::size_t b = 0; b < load.size() && improvable.empty(); ++b) {
        const std::int32_t r = p.owners(0)[b];
        if (r == m || load[b] >= load[a]) continue;
        if (per[static_cast<std::size_t>(r)] + load[a] - load[b] < per[static_cast<std::size_t>(m)])
          improvable = "swapping experts " + std::to_string(a) + " and " + std::to_string(b) +
                       " would relieve rank " + std::to_string(m);
      }
    }
    EXPECT_TRUE(improvable.empty()) << improvable;
  }
}

TEST(ExpertPlacement, BalancedIsNeverWorseThanContiguous) {
  // 9 experts on 8 ranks: rank 0 hosts two, the others one. Expert 2 carries the most load. Contiguous puts
  // it alone on rank 1 (max 100). Greedy alone sends it to rank 0 — every rank is empty, ties go to the lower
  // rank — where the lightest expert must follow it: max 115.
  const std::vector<double> load = {15, 20, 100, 50, 45, 40, 35, 30, 25};
  const std::vector<std::vector<double>> loads = {load};
  const ExpertPlacement p = ExpertPlacement::balanced(loads, 9, 8);
  expect_consistent(p);
  EXPECT_EQ(counts(p, 0), quotas(9, 8));
  EXPECT_EQ(max_of(rank_loads(ExpertPlacement::contiguous(1, 9, 8), 0, load)), 100.0);
  EXPECT_LE(max_of(rank_loads(p, 0, load)), 100.0);
  EXPECT_EQ(p.local_experts(0, p.owners(0)[2]).size(), 1U) << "the dominant expert shares its rank";
}

// ---------------------------------------------------------------------------------------------------------
// Statistics files.

class PlacementFile : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           ("capserve_placement_" + std::to_string(::testing::UnitTest::GetInstance()->random_seed()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  std::filesystem::path write(const std::string& name, const std::string& text) {
    const std::filesystem::path path = dir_ / name;
    std::ofstream(path) << text;
    return path;
  }

  // The error of from_stats_file; fails the test when there is none.
  static std::string error_of(const std::filesystem::path& path, std::int64_t layers, std::int64_t experts,
                              int ranks) {
    try {
      (void)ExpertPlacement::from_stats_file(path, layers, experts, ranks);
    } catch (const std::runtime_error& e) {
      return e.what();
    }
    ADD_FAILURE() << path << " was accepted";
    return {};
  }

  std::filesystem::path dir_;
};

TEST_F(PlacementFile, ReadsTheLoadsOfEachLayer) {
  const std::filesystem::path path = write("stats.json", R"({"layers": [
      {"layer": 1, "routed_load": [1, 1, 1, 1, 50, 40, 1, 1], "other": "ignored"},
      {"layer": 0, "routed_load": [9, 8, 7, 6, 0, 0, 0, 0.5]}], "steps": 3})");
  const ExpertPlacement p = ExpertPlacement::from_stats_file(path, 3, 8, 2);
  EXPECT_EQ(p.kind(), "balanced");
  expect_consistent(p);
  EXPECT_NE(p.owners(1)[4], p.owners(1)[5]);
  EXPECT_NE(p.owners(0)[0], p.owners(0)[1]);
  const std::vector<std::vector<double>> loads = {{9, 8, 7, 6, 0, 0, 0, 0.5}, {1, 1, 1, 1, 50, 40, 1, 1}, {}};
  const ExpertPlacement want = ExpertPlacement::balanced(loads, 8, 2);
  for (std::int64_t l = 0; l < 3; ++l) {
    EXPECT_TRUE(std::equal(want.owners(l).begin(), want.owners(l).end(), p.owners(l).begin())) << l;
  }
  // Layer 2 is absent: contiguous.
  EXPECT_EQ(counts(p, 2), (std::vector<std::int64_t>{4, 4}));
  EXPECT_EQ(p.owners(2)[3], 0);
  EXPECT_EQ(p.owners(2)[4], 1);
  // from_spec with a path reads the file.
  const ExpertPlacement q = ExpertPlacement::from_spec(path.string(), 3, 8, 2);
  EXPECT_TRUE(std::equal(q.owners(1).begin(), q.owners(1).end(), p.owners(1).begin()));
}

TEST_F(PlacementFile, MissingFile) {
  const std::filesystem::path path = dir_ / "absent.json";
  const std::string e = error_of(path, 2, 4, 2);
  EXPECT_NE(e.find(path.string()), std::string::npos) << e;
  EXPECT_NE(e.find("cannot open"), std::string::npos) << e;
}

TEST_F(PlacementFile, BadJson) {
  const std::filesystem::path path = write("bad.json", R"({"layers": [ {"layer": 0, )");
  const std::string e = error_of(path, 2, 4, 2);
  EXPECT_NE(e.find(path.string()), std::string::npos) << e;
  EXPECT_NE(e.find("not valid JSON"), std::string::npos) << e;
}

TEST_F(PlacementFile, NoLayersArray) {
  for (const char* text : {R"([1, 2])", R"({"layer": []})", R"({"layers": {"layer": 0}})"}) {
    const std::string e = error_of(write("shape.json", text), 2, 4, 2);
    EXPECT_NE(e.find("\"layers\" array"), std::string::npos) << text << ": " << e;
  }
}

TEST_F(PlacementFile, MalformedLayerEntry) {
  for (const char* text : {R"({"layers": [{"routed_load": [1, 2, 3, 4]}]})",
                           R"({"layers": [{"layer": 0.5, "routed_load": [1, 2, 3, 4]}]})",
                           R"({"layers": [{"layer": 0, "routed_load": 7}]})", R"({"layers": [3]})"}) {
    const std::string e = error_of(write("entry.json", text), 2, 4, 2);
    EXPECT_NE(e.find("integer \"layer\""), std::string::npos) << text << ": " << e;
  }
}

TEST_F(PlacementFile, WrongExpertCount) {
  const std::filesystem::path path =
      write("count.json", R"({"layers": [{"layer": 1, "routed_load": [1, 2, 3]}]})");
  const std::string e = error_of(path, 2, 4, 2);
  EXPECT_NE(e.find("layer 1 has 3 loads"), std::string::npos) << e;
  EXPECT_NE(e.find("4 experts"), std::string::npos) << e;
}

TEST_F(PlacementFile, LayerOutOfRange) {
  for (const char* text : {R"({"layers": [{"layer": 2, "routed_load": [1, 2, 3, 4]}]})",
                           R"({"layers": [{"layer": -1, "routed_load": [1, 2, 3, 4]}]})"}) {
    const std::string e = error_of(write("range.json", text), 2, 4, 2);
    EXPECT_NE(e.find("outside the model's 2 layers"), std::string::npos) << text << ": " << e;
  }
}

TEST_F(PlacementFile, DuplicateLayer) {
  const std::filesystem::path path = write("dup.json", R"({"layers": [
      {"layer": 1, "routed_load": [1, 2, 3, 4]}, {"layer": 0, "routed_load": [1, 2, 3, 4]},
      {"layer": 1, "routed_load": [4, 3, 2, 1]}]})");
  const std::string e = error_of(path, 2, 4, 2);
  EXPECT_NE(e.find("layer 1 appears twice"), std::string::npos) << e;
}

TEST_F(PlacementFile, NegativeOrNonNumericLoad) {
  for (const char* text : {R"({"layers": [{"layer": 0, "routed_load": [1, -2, 3, 4]}]})",
                           R"({"layers": [{"layer": 0, "routed_load": [1, "2", 3, 4]}]})"}) {
    const std::string e = error_of(write("neg.json", text), 2, 4, 2);
    EXPECT_NE(e.find("non-negative numbers"), std::string::npos) << text << ": " << e;
  }
}

TEST(ExpertPlacement, RankLoadsSumEachRanksExperts) {
  const ExpertPlacement p = ExpertPlacement::round_robin(1, 5, 2);  // rank 0: 0, 2, 4; rank 1: 1, 3
  EXPECT_EQ(p.rank_loads(0, std::vector<double>{1, 10, 100, 1000, 10000}),
            (std::vector<double>{10101, 1010}));
  EXPECT_THROW((void)p.rank_loads(0, std::vector<double>{1, 2}), std::invalid_argument);
}

TEST(ExpertPlacementSpec, NamesAndPaths) {
  const ExpertPlacement c = ExpertPlacement::from_spec("contiguous", 2, 10, 4);
  EXPECT_EQ(c.kind(), "contiguous");
  EXPECT_EQ(counts(c, 0), (std::vector<std::int64_t>{3, 3, 2, 2}));
  const ExpertPlacement r = ExpertPlacement::from_spec("round-robin", 2, 10, 4);
  EXPECT_EQ(r.kind(), "round-robin");
  EXPECT_EQ(r.owners(1)[9], 1);
  // Anything else is a statistics file: a typo names the file it could not open.
  try {
    (void)ExpertPlacement::from_spec("round_robin", 2, 10, 4);
    ADD_FAILURE() << "a misspelt placement was accepted";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("round_robin"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace capserve::parallel
