// The expert-parallel model under mpirun -np 1..4 (and as a singleton), every committed fixture architecture:
//  - gamma = inf: each rank's sequences give the single-process model's logits (every prompt position and a
//    16-token greedy continuation), whether the prompts are spread over the ranks or all on rank 0 (the other
//    ranks then join every step with zero tokens), for the contiguous and the round-robin placement;
//  - the step's MoE statistics are global (identical on every rank) and match the single-process model's;
//  - global-scope capacity (drop and reroute; expert and device granularity): the kept set does not depend on
//    how the tokens are split over the ranks, so the logits, drop and reroute counts equal the one-rank run's
//    (device granularity: the same run with every token on rank 0, since its capacity is per rank);
//  - a token whose routed slots are all dropped still gets its shared expert, and dispatch moves exactly the
//    rows of the kept routed assignments (never shared-expert traffic);
//  - EPLB replicas (np >= 2) compute the same model, at gamma = inf and under global capacity, the copies
//    sharing their expert's tokens and each rank holding its slots' weights;
//  - each rank holds only its own routed experts (bytes, and resident pages printed);
//  - a step refused on one rank is an error there while the others' steps complete.
// np = 3 puts 8 experts (Mixtral, Qwen2-MoE) and 16 experts (OLMoE) on 3 ranks: expert counts the rank count
// does not divide (3+3+2 and 6+5+5), so the uneven placements and the ranks of unequal expert counts are
// exercised. Every test is collective: all ranks run the same steps; failures use EXPECT_* so that no rank
// leaves a collective early.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <limits>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "kernels/cpu/cpu_backend.h"
#include "parallel/mpi_communicator.h"
#include "parallel/self_communicator.h"
#include "runtime/architectures/architecture.h"
#include "runtime/engine.h"
#include "runtime/generator.h"
#include "runtime/load_error.h"
#include "runtime/model.h"
#include "runtime/model_weights.h"
#include "runtime/weights/checkpoint.h"
#include "tests/mpi/mpi_gtest_main.h"
#include "tests/support/replication_stats.h"
#include "tests/unit/runtime/fixture_models.h"

namespace capserve {
namespace {

namespace fs = std::filesystem;
using parallel::CapacityGranularity;
using parallel::CapacityPolicy;
using parallel::MoeStepStats;
using runtime::Engine;
using runtime::Model;
using runtime::ParallelOptions;

constexpr double kTolerance = 1e-5;  // max|diff| <= 1e-5 * max|reference logit|
constexpr std::int64_t kGreedyTokens = 16;
constexpr double kInf = std::numeric_limits<double>::infinity();

runtime::SamplingParams greedy() {
  runtime::SamplingParams p;
  p.max_new_tokens = kGreedyTokens;
  return p;
}

ParallelOptions options(const std::string& placement, double gamma = kInf,
                        CapacityPolicy policy = CapacityPolicy::drop,
                        CapacityGranularity granularity = CapacityGranularity::expert) {
  ParallelOptions o;
  o.placement = placement;
  o.capacity.gamma = {gamma};
  o.capacity.policy = policy;
  o.capacity.granularity = granularity;
  o.capacity.scope = parallel::CapacityScope::global;
  return o;
}

std::string describe(const ParallelOptions& o) {
  return o.placement + " " + parallel::describe(o.capacity);
}

// ---- prompts and how they are split over the ranks ----

// The fixture's 4 prompts (1, 5, 13 and 29 tokens) plus 3 of random ids (7, 2 and 37 tokens), the same on
// every rank.
std::vector<std::vector<std::int32_t>> prompt_set(const std::string& fixture, std::int64_t vocab) {
  std::vector<std::vector<std::int32_t>> prompts;
  const nlohmann::json reference = testing::fixture_reference(fixture);
  for (const auto& p : reference["prompts"])
    prompts.push_back(p["input_ids"].get<std::vector<std::int32_t>>());
  std::uint64_t state = 0x2545F4914F6CDD1DULL;
  for (const std::size_t len : {7, 2, 37}) {
    std::vector<std::int32_t> ids;
    for (std::size_t i = 0; i < len; ++i) {
      state = state * 6364136223846793005ULL + 1442695040888963407ULL;
      ids.push_back(static_cast<std::int32_t>((state >> 33) % static_cast<std::uint64_t>(vocab)));
    }
    prompts.push_back(std::move(ids));
  }
  return prompts;
}

enum class Split { spread, rank0 };

const char* name(Split s) {
  return s == Split::spread ? "spread" : "all-on-rank-0";
}

// The prompts in global token order: rank 0's, then rank 1's, ... of the spread split (prompt i on rank
// i % ranks). Both splits use this order, so a token's global index (the capacity scheduler's tie-break) is
// the same in every run and in the one-rank references.
std::vector<std::size_t> global_order(std::size_t n, int ranks) {
  std::vector<std::size_t> order;
  for (int r = 0; r < ranks; ++r) {
    for (std::size_t i = 0; i < n; ++i) {
      if (static_cast<int>(i % static_cast<std::size_t>(ranks)) == r) order.push_back(i);
    }
  }
  return order;
}

// The prompts `rank` runs, in order.
std::vector<std::size_t> my_prompts(std::size_t n, int ranks, int rank, Split split) {
  std::vector<std::size_t> mine;
  for (const std::size_t i : global_order(n, ranks)) {
    const int owner = split == Split::spread ? static_cast<int>(i % static_cast<std::size_t>(ranks)) : 0;
    if (owner == rank) mine.push_back(i);
  }
  return mine;
}

// ---- one run: a prefill step with every position's logits, then a greedy generation ----

struct PromptResult {
  bool present = false;
  std::vector<float> prompt_logits;  // [len, vocab]
  std::int64_t dropped = 0;          // prefill step: slots dropped / rerouted for this prompt's tokens
  std::int64_t rerouted = 0;
  std::vector<std::int32_t> tokens;  // greedy continuation
  std::vector<float> gen_logits;     // [tokens, vocab]
};

struct RunResult {
  std::vector<PromptResult> prompts;  // by prompt index; present only for the prompts this rank ran
  MoeStepStats prefill_stats;
};

RunResult run(Engine& engine, const std::vector<std::vector<std::int32_t>>& all,
              const std::vector<std::size_t>& mine, const std::string& where) {
  const auto vocab = static_cast<std::size_t>(engine.model().config().vocab_size);
  RunResult out;
  out.prompts.resize(all.size());
  std::vector<Engine::Work> work;
  for (std::size_t j = 0; j < mine.size(); ++j) work.push_back({1000 + j, all[mine[j]], true});
  const runtime::Status s = engine.step(work);
  EXPECT_TRUE(s.ok()) << where << ": " << s.message();
  out.prefill_stats = engine.last_moe_stats();
  std::size_t row = 0;
  for (std::size_t j = 0; j < mine.size() && s.ok(); ++j) {
    PromptResult& p = out.prompts[mine[j]];
    p.present = true;
    const std::size_t len = all[mine[j]].size();
    const auto rows = engine.logits().subspan(row * vocab, len * vocab);
    p.prompt_logits.assign(rows.begin(), rows.end());
    p.dropped = engine.moe_counts()[j].dropped;
    p.rerouted = engine.moe_counts()[j].rerouted;
    row += len;
  }
  for (std::size_t j = 0; j < mine.size(); ++j) engine.release(1000 + j);

  std::vector<std::vector<std::int32_t>> prompts;
  for (const std::size_t i : mine) prompts.push_back(all[i]);
  const std::vector<runtime::SamplingParams> params(prompts.size(), greedy());
  std::vector<runtime::Generation> gen;
  const runtime::Status g = runtime::generate(engine, prompts, params, true, gen);
  EXPECT_TRUE(g.ok()) << where << ": " << g.message();
  for (std::size_t j = 0; j < mine.size() && g.ok(); ++j) {
    out.prompts[mine[j]].tokens = gen[j].tokens;
    out.prompts[mine[j]].gen_logits = gen[j].logits;
  }
  return out;
}

// Per layer, the global dropped/rerouted counts and expert loads of two runs' steps.
void expect_same_layer_counts(const parallel::MoeStepStats& got, const parallel::MoeStepStats& ref,
                              const std::string& where) {
  for (std::size_t l = 0; l < std::min(got.layers.size(), ref.layers.size()); ++l) {
    const auto& g = got.layers[l];
    const auto& r = ref.layers[l];
    EXPECT_EQ(g.dropped, r.dropped) << where << ", layer " << g.layer;
    EXPECT_EQ(g.rerouted, r.rerouted) << where << ", layer " << g.layer;
    EXPECT_EQ(g.expert_load, r.expert_load) << where << ", layer " << g.layer;
  }
}

// Every prompt `got` holds against the same prompt in `ref`.
void expect_same_sequences(const RunResult& got, const RunResult& ref, const std::string& where) {
  for (std::size_t i = 0; i < got.prompts.size(); ++i) {
    const PromptResult& g = got.prompts[i];
    if (!g.present) continue;
    const PromptResult& r = ref.prompts[i];
    if (!r.present) {
      ADD_FAILURE() << where << ": prompt " << i << " missing from the reference";
      continue;
    }
    const std::string what = where + ", prompt " + std::to_string(i);
    EXPECT_EQ(g.prompt_logits.size(), r.prompt_logits.size()) << what;
    if (g.prompt_logits.size() == r.prompt_logits.size()) {
      EXPECT_LE(testing::relative_max_diff(g.prompt_logits, r.prompt_logits), kTolerance)
          << what << ": logits of the prompt positions";
    }
    EXPECT_EQ(g.dropped, r.dropped) << what << ": slots dropped in the prefill step";
    EXPECT_EQ(g.rerouted, r.rerouted) << what << ": slots rerouted in the prefill step";
    EXPECT_EQ(g.tokens, r.tokens) << what << ": greedy tokens";
    if (g.tokens == r.tokens && g.gen_logits.size() == r.gen_logits.size()) {
      EXPECT_LE(testing::relative_max_diff(g.gen_logits, r.gen_logits), kTolerance)
          << what << ": logits of the greedy continuation";
    }
  }
}

// ---- moving results between ranks ----

template <typename T>
void put(std::vector<std::byte>& out, const std::vector<T>& v) {
  const std::uint64_t n = v.size();
  const auto* p = reinterpret_cast<const std::byte*>(&n);
  out.insert(out.end(), p, p + sizeof n);
  const auto* d = reinterpret_cast<const std::byte*>(v.data());
  out.insert(out.end(), d, d + n * sizeof(T));
}

template <typename T>
std::vector<T> take(const std::vector<std::byte>& in, std::size_t& at) {
  std::uint64_t n = 0;
  std::memcpy(&n, in.data() + at, sizeof n);
  at += sizeof n;
  std::vector<T> v(n);
  if (n > 0) std::memcpy(v.data(), in.data() + at, n * sizeof(T));
  at += n * sizeof(T);
  return v;
}

// The prompts `root` ran (its result.prompts), on every rank.
RunResult broadcast_prompts(const RunResult& mine, int root) {
  parallel::MpiWorld& world = test::mpi_world();
  std::vector<std::byte> bytes;
  if (world.rank() == root) {
    for (std::size_t i = 0; i < mine.prompts.size(); ++i) {
      const PromptResult& p = mine.prompts[i];
      if (!p.present) continue;
      put(bytes, std::vector<std::int64_t>{static_cast<std::int64_t>(i), p.dropped, p.rerouted});
      put(bytes, p.prompt_logits);
      put(bytes, p.tokens);
      put(bytes, p.gen_logits);
    }
  }
  world.broadcast(bytes, root);
  RunResult out;
  out.prompts.resize(mine.prompts.size());
  for (std::size_t at = 0; at < bytes.size();) {
    const auto head = take<std::int64_t>(bytes, at);
    PromptResult& p = out.prompts[static_cast<std::size_t>(head[0])];
    p.present = true;
    p.dropped = head[1];
    p.rerouted = head[2];
    p.prompt_logits = take<float>(bytes, at);
    p.tokens = take<std::int32_t>(bytes, at);
    p.gen_logits = take<float>(bytes, at);
  }
  return out;
}

std::vector<std::int64_t> pack(const MoeStepStats& stats) {
  std::vector<std::int64_t> v;
  for (const parallel::MoeLayerStats& s : stats.layers) {
    v.insert(v.end(),
             {s.layer, s.tokens, s.assignments, s.dropped, s.rerouted, s.rows_dispatched, s.wire_bytes});
    for (const auto* loads : {&s.routed_load, &s.expert_load, &s.rank_routed_load, &s.rank_load}) {
      v.push_back(static_cast<std::int64_t>(loads->size()));
      v.insert(v.end(), loads->begin(), loads->end());
    }
    for (const double t : {s.scheduler_seconds, s.dispatch_seconds, s.expert_seconds, s.combine_seconds})
      v.push_back(std::bit_cast<std::int64_t>(t));
  }
  return v;
}

// `mine` is the same on every rank (collective).
void expect_same_on_every_rank(parallel::Communicator& comm, const std::vector<std::int64_t>& mine,
                               const std::string& what) {
  const auto n = static_cast<std::size_t>(comm.size());
  const auto len = static_cast<std::int64_t>(mine.size());
  std::vector<std::int64_t> lens(n);
  comm.allgather(std::span<const std::int64_t>(&len, 1), lens);
  const bool same_length = std::all_of(lens.begin(), lens.end(), [&](std::int64_t l) { return l == len; });
  EXPECT_TRUE(same_length) << what << ": differs in size between ranks";
  if (!same_length) return;  // every rank sees the same lengths: all return here together
  std::vector<std::int64_t> all(n * mine.size());
  comm.allgather(mine, all);
  for (std::size_t r = 0; r < n; ++r) {
    EXPECT_TRUE(
        std::equal(mine.begin(), mine.end(), all.begin() + static_cast<std::ptrdiff_t>(r * mine.size())))
        << what << ": rank " << r << " differs from rank " << comm.rank();
  }
}

std::int64_t sum_over_ranks(parallel::Communicator& comm, std::int64_t v) {
  comm.allreduce_sum(std::span<std::int64_t>(&v, 1));
  return v;
}

std::int64_t total(const std::vector<std::int64_t>& v) {
  std::int64_t s = 0;
  for (const std::int64_t x : v) s += x;
  return s;
}

// The owner of expert e under the named placement, computed here from its definition: round-robin e % R;
// contiguous ranges, the first E % R ranks one expert more.
int expected_owner(const std::string& placement, std::int64_t e, std::int64_t experts, int ranks) {
  if (placement == "round-robin") return static_cast<int>(e % ranks);
  const std::int64_t base = experts / ranks;
  const std::int64_t extra = experts % ranks;
  const std::int64_t big = extra * (base + 1);
  return static_cast<int>(e < big ? e / (base + 1) : extra + (e - big) / base);
}

// The capacity invariants of parallel/README.md, from a step's global statistics: no bin (expert or rank)
// above its capacity; drop keeps exactly min(load, C) per bin; every slot that lost its original expert is
// either dropped or rerouted.
void expect_capacity_invariants(const MoeStepStats& stats, const parallel::CapacityConfig& cap,
                                const parallel::ExpertPlacement& placement, std::int64_t experts,
                                std::int64_t top_k, const std::string& where) {
  const bool device = cap.granularity == CapacityGranularity::device;
  for (const parallel::MoeLayerStats& s : stats.layers) {
    const std::string what = where + ", layer " + std::to_string(s.layer);
    const double gamma = cap.gamma_for(s.layer);
    const std::vector<std::int64_t>& routed = device ? s.rank_routed_load : s.routed_load;
    const std::vector<std::int64_t>& computed = device ? s.rank_load : s.expert_load;
    std::int64_t overflow = 0;
    for (std::size_t b = 0; b < routed.size(); ++b) {
      // ceil(gamma * N_bar * experts in the bin), with the exact integer product first (as the scheduler
      // does).
      const std::int64_t in_bin =
          device ? static_cast<std::int64_t>(placement.local_experts(s.layer, static_cast<int>(b)).size())
                 : 1;
      const auto c = static_cast<std::int64_t>(
          std::ceil(gamma * static_cast<double>(s.tokens * top_k * in_bin) / static_cast<double>(experts)));
      overflow += std::max<std::int64_t>(0, routed[b] - c);
      EXPECT_LE(computed[b], c) << what << ", bin " << b;
      if (cap.policy == CapacityPolicy::drop) {
        EXPECT_EQ(computed[b], std::min(routed[b], c)) << what << ", bin " << b;
      }
    }
    if (cap.policy == CapacityPolicy::drop) {
      EXPECT_EQ(s.dropped, overflow) << what;
      EXPECT_EQ(s.rerouted, 0) << what;
    } else {
      EXPECT_EQ(s.dropped + s.rerouted, overflow) << what;
    }
    EXPECT_EQ(s.assignments, s.tokens * top_k) << what;
    EXPECT_EQ(total(s.expert_load), s.assignments - s.dropped) << what;
    EXPECT_EQ(total(s.rank_load), s.assignments - s.dropped) << what;
    // A dispatched row carries 1..top_k kept assignments.
    EXPECT_LE(s.rows_dispatched, s.kept()) << what;
    EXPECT_GE(s.rows_dispatched * top_k, s.kept()) << what;
  }
}

// ---- fixture copies with some tensors zeroed ----

// A private copy of a fixture directory in which every tensor whose name satisfies `zero` holds zeros;
// removed on destruction.
class ZeroedFixture {
 public:
  ZeroedFixture(const fs::path& from, const std::string& tag,
                const std::function<bool(const std::string&)>& zero)
      : dir_(fs::temp_directory_path() /
             ("capserve_test_mpi_model_" + std::to_string(::getpid()) + "_" + tag)) {
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    for (const auto& entry : fs::directory_iterator(from)) {
      const fs::path dst = dir_ / entry.path().filename();
      if (entry.path().extension() != ".safetensors") {
        fs::copy_file(entry.path(), dst);
        continue;
      }
      std::ifstream in(entry.path(), std::ios::binary);
      std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      std::uint64_t header_len = 0;
      std::memcpy(&header_len, bytes.data(), sizeof header_len);  // little-endian on every supported host
      const std::size_t base = sizeof header_len + header_len;
      const nlohmann::json header = nlohmann::json::parse(bytes.begin() + sizeof header_len,
                                                          bytes.begin() + static_cast<std::ptrdiff_t>(base));
      for (const auto& [tensor, info] : header.items()) {
        // An FP8 weight's block scales stay: its zeroed elements dequantize to zero whatever the scale.
        if (tensor == "__metadata__" || tensor.ends_with("_scale_inv") || !zero(tensor)) continue;
        const auto offsets = info["data_offsets"].get<std::vector<std::size_t>>();
        std::fill(bytes.begin() + static_cast<std::ptrdiff_t>(base + offsets[0]),
                  bytes.begin() + static_cast<std::ptrdiff_t>(base + offsets[1]), 0);
        ++zeroed_;
      }
      std::ofstream(dst, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    }
  }
  ~ZeroedFixture() {
    std::error_code ignored;
    fs::remove_all(dir_, ignored);
  }
  ZeroedFixture(const ZeroedFixture&) = delete;
  ZeroedFixture& operator=(const ZeroedFixture&) = delete;

  [[nodiscard]] const fs::path& dir() const { return dir_; }
  [[nodiscard]] int zeroed() const { return zeroed_; }

 private:
  fs::path dir_;
  int zeroed_ = 0;
};

// ---- memory ----

// kB of /proc/self/status's `key` (e.g. "VmRSS").
std::int64_t status_kb(const std::string& key) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(key + ":", 0) == 0) return std::stoll(line.substr(key.size() + 1));
  }
  return -1;
}

// Resident kB of this process's file mappings under `dir` (the mmapped checkpoint shards), from smaps.
std::int64_t mapped_resident_kb(const fs::path& dir) {
  const std::string prefix = fs::canonical(dir).string() + "/";
  std::ifstream in("/proc/self/smaps");
  std::string line;
  bool inside = false;
  std::int64_t kb = 0;
  while (std::getline(in, line)) {
    std::istringstream fields(line);
    std::string first;
    fields >> first;
    if (first.empty()) continue;
    if (first.back() != ':') {  // a mapping's header line: "start-end perms offset dev inode [path]"
      inside = line.find(prefix) != std::string::npos;
    } else if (inside && first == "Rss:") {
      std::int64_t v = 0;
      fields >> v;
      kb += v;
    }
  }
  return kb;
}

std::int64_t bytes_of(const kernels::ExpertWeights& e) {
  return static_cast<std::int64_t>(e.gate.bytes() + e.up.bytes() + e.down.bytes());
}

// ---- the tests ----

class MpiModel : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    dir_ = testing::fixture_models_dir() / GetParam();
    single_ = Model::load(dir_, backend_);
    prompts_ = prompt_set(GetParam(), single_->config().vocab_size);
  }

  [[nodiscard]] std::int64_t moe_layers() const {
    std::int64_t n = 0;
    for (const bool m : single_->config().layer_is_moe) n += m ? 1 : 0;
    return n;
  }

  // The prompts in `order`.
  [[nodiscard]] std::vector<std::vector<std::int32_t>> select(const std::vector<std::size_t>& order) const {
    std::vector<std::vector<std::int32_t>> out;
    for (const std::size_t i : order) out.push_back(prompts_[i]);
    return out;
  }

  // The same run, on one process, of every prompt in global token order; indexed like a distributed run.
  RunResult reference_run(Engine& engine, int ranks, const std::string& where) {
    return run(engine, prompts_, global_order(prompts_.size(), ranks), where);
  }

  fs::path dir_;
  std::unique_ptr<Model> single_;
  std::vector<std::vector<std::int32_t>> prompts_;
  kernels::cpu::CpuBackend backend_{1};
  parallel::MpiCommunicator comm_;  // collective: every rank constructs it in every test
};

TEST_P(MpiModel, GammaInfEqualsSingleProcess) {
  const int ranks = comm_.size();
  const int rank = comm_.rank();
  const runtime::ModelConfig& c = single_->config();
  if (ranks == 3) {
    EXPECT_NE(c.num_experts % 3, 0) << "np = 3 is here to place an expert count that 3 does not divide";
  }
  Engine single_engine(*single_, {});
  const RunResult ref = reference_run(single_engine, ranks, "single process");
  for (const std::string placement : {"contiguous", "round-robin"}) {
    const auto model = Model::load(dir_, backend_, comm_, options(placement));
    // The placement is the documented one, and a rank holds 1 + E / R or E / R experts.
    for (std::int64_t e = 0; e < c.num_experts; ++e) {
      EXPECT_EQ(model->placement().owners(0)[static_cast<std::size_t>(e)],
                expected_owner(placement, e, c.num_experts, ranks))
          << placement << ", expert " << e;
    }
    const auto local = static_cast<std::int64_t>(model->placement().local_experts(0, rank).size());
    EXPECT_EQ(local, c.num_experts / ranks + (rank < c.num_experts % ranks ? 1 : 0)) << placement;
    Engine engine(*model, {});
    for (const Split split : {Split::spread, Split::rank0}) {
      const std::string where = GetParam() + ", " + placement + ", " + name(split) + ", rank " +
                                std::to_string(rank) + " of " + std::to_string(ranks);
      const RunResult got = run(engine, prompts_, my_prompts(prompts_.size(), ranks, rank, split), where);
      expect_same_sequences(got, ref, where);
      std::int64_t wire = 0;
      for (const auto& s : got.prefill_stats.layers) wire += s.wire_bytes;
      if (ranks > 1) {
        EXPECT_GT(wire, 0) << where << ": no hidden row crossed ranks";
      } else {
        EXPECT_EQ(wire, 0) << where;
      }
    }
  }
}

TEST_P(MpiModel, StepStatisticsAreGlobalAndMatchSingleProcess) {
  const int ranks = comm_.size();
  const int rank = comm_.rank();
  const runtime::ModelConfig& c = single_->config();
  Engine single_engine(*single_, {});
  const std::vector<std::size_t> order = global_order(prompts_.size(), ranks);
  std::vector<Engine::Work> all_work;
  std::int64_t tokens = 0;
  for (std::size_t j = 0; j < order.size(); ++j) {
    all_work.push_back({j, prompts_[order[j]], false});
    tokens += static_cast<std::int64_t>(prompts_[order[j]].size());
  }
  ASSERT_TRUE(single_engine.step(all_work).ok());  // no collective: same outcome on every rank
  const MoeStepStats ref = single_engine.last_moe_stats();
  ASSERT_EQ(static_cast<std::int64_t>(ref.layers.size()), moe_layers());

  for (const std::string placement : {"contiguous", "round-robin"}) {
    const std::string where = GetParam() + ", " + placement + ", rank " + std::to_string(rank);
    const auto model = Model::load(dir_, backend_, comm_, options(placement));
    Engine engine(*model, {});
    std::vector<Engine::Work> work;
    for (const std::size_t i : my_prompts(prompts_.size(), ranks, rank, Split::spread))
      work.push_back({i, prompts_[i], false});
    const runtime::Status st = engine.step(work);
    EXPECT_TRUE(st.ok()) << where << ": " << st.message();
    const MoeStepStats& stats = engine.last_moe_stats();
    expect_same_on_every_rank(comm_, pack(stats), where + ": last_moe_stats");
    EXPECT_EQ(stats.layers.size(), ref.layers.size()) << where;
    for (std::size_t l = 0; l < std::min(stats.layers.size(), ref.layers.size()); ++l) {
      const parallel::MoeLayerStats& s = stats.layers[l];
      const parallel::MoeLayerStats& r = ref.layers[l];
      const std::string what = where + ", layer " + std::to_string(s.layer);
      EXPECT_EQ(s.layer, r.layer) << what;
      EXPECT_EQ(s.tokens, tokens) << what;
      EXPECT_EQ(s.assignments, tokens * c.top_k) << what;
      EXPECT_EQ(s.routed_load, r.routed_load) << what << ": the router's choices differ from one process's";
      EXPECT_EQ(s.expert_load, s.routed_load) << what << ": gamma = inf changes nothing";
      EXPECT_EQ(s.dropped, 0) << what;
      EXPECT_EQ(s.rerouted, 0) << what;
      std::vector<std::int64_t> per_rank(static_cast<std::size_t>(ranks), 0);
      for (std::int64_t e = 0; e < c.num_experts; ++e) {
        per_rank[static_cast<std::size_t>(expected_owner(placement, e, c.num_experts, ranks))] +=
            s.expert_load[static_cast<std::size_t>(e)];
      }
      EXPECT_EQ(s.rank_load, per_rank) << what << ": per-rank load is not the sum of its experts' loads";
      EXPECT_EQ(s.rank_routed_load, per_rank) << what;
      EXPECT_EQ(total(s.rank_load), s.assignments) << what;
      // One process: one row per token. Several: one per token and destination rank, at most top_k.
      EXPECT_EQ(r.rows_dispatched, tokens) << what;
      EXPECT_EQ(r.wire_bytes, 0) << what;
      EXPECT_GE(s.rows_dispatched, tokens) << what;
      EXPECT_LE(s.rows_dispatched, tokens * std::min<std::int64_t>(c.top_k, ranks)) << what;
      if (ranks == 1) {
        EXPECT_EQ(s.wire_bytes, 0) << what;
      }
    }
  }
}

TEST_P(MpiModel, GlobalCapacityIsIndependentOfTheTokenSplit) {
  const int ranks = comm_.size();
  const int rank = comm_.rank();
  const runtime::ModelConfig& c = single_->config();
  std::int64_t dropped_at_gamma_1 = 0;
  for (const double gamma : {1.0, 1.5}) {
    for (const CapacityPolicy policy : {CapacityPolicy::drop, CapacityPolicy::reroute}) {
      for (const CapacityGranularity granularity :
           {CapacityGranularity::expert, CapacityGranularity::device}) {
        const ParallelOptions opts = options("contiguous", gamma, policy, granularity);
        const std::string config = GetParam() + ", " + describe(opts) + ", rank " + std::to_string(rank) +
                                   " of " + std::to_string(ranks);
        const auto model = Model::load(dir_, backend_, comm_, opts);
        Engine engine(*model, {});
        // Expert capacity depends only on the step's global token count, so one rank holding every token is
        // the reference. Device capacity is per rank (C_dev scales with the experts a rank hosts), so there
        // the reference is this rank count with every token on rank 0.
        const bool one_rank_reference = granularity == CapacityGranularity::expert || ranks == 1;
        RunResult ref;
        if (one_rank_reference) {
          parallel::SelfCommunicator self;
          const auto ref_model = Model::load(dir_, backend_, self, opts);
          Engine ref_engine(*ref_model, {});
          ref = reference_run(ref_engine, ranks, config + ", one rank");
        }
        for (const Split split : {Split::rank0, Split::spread}) {
          const std::string where = config + ", " + name(split);
          const RunResult got = run(engine, prompts_, my_prompts(prompts_.size(), ranks, rank, split), where);
          expect_capacity_invariants(got.prefill_stats, opts.capacity, model->placement(), c.num_experts,
                                     c.top_k, where);
          if (one_rank_reference) {
            // The global counts of the prefill step too.
            EXPECT_EQ(got.prefill_stats.layers.size(), ref.prefill_stats.layers.size()) << where;
            expect_same_layer_counts(got.prefill_stats, ref.prefill_stats, where);
            expect_same_sequences(got, ref, where);
          } else if (split == Split::rank0) {
            ref = broadcast_prompts(got, 0);
            ref.prefill_stats = got.prefill_stats;
          } else {
            EXPECT_EQ(pack(got.prefill_stats).size(), pack(ref.prefill_stats).size()) << where;
            expect_same_layer_counts(got.prefill_stats, ref.prefill_stats, where);
            expect_same_sequences(got, ref, where + " vs all-on-rank-0");
          }
          if (gamma == 1.0 && policy == CapacityPolicy::drop && granularity == CapacityGranularity::expert &&
              split == Split::spread) {
            for (const auto& s : got.prefill_stats.layers) dropped_at_gamma_1 += s.dropped;
          }
          if (granularity == CapacityGranularity::expert && split == Split::spread) {
            // Expert capacity bounds every expert, so these steps exchanged in fixed-size blocks; the counted
            // exchange computes the same.
            runtime::EngineOptions counted_options;
            counted_options.fixed_exchange_tokens = 0;
            Engine counted(*model, counted_options);
            const RunResult by_counts =
                run(counted, prompts_, my_prompts(prompts_.size(), ranks, rank, split), where + ", counted");
            expect_same_layer_counts(got.prefill_stats, by_counts.prefill_stats,
                                     where + ", blocks vs counted");
            expect_same_sequences(got, by_counts, where + ", blocks vs counted");
          }
        }
      }
    }
  }
  // Otherwise the comparisons above would be those of gamma = inf.
  EXPECT_GT(dropped_at_gamma_1, 0) << "gamma = 1 dropped nothing: the capacity test is vacuous";
  if (rank == 0) {
    std::printf("[ capacity ] %s np=%d: gamma=1 drop/expert dropped %lld slots in the prefill step\n",
                GetParam().c_str(), ranks, static_cast<long long>(dropped_at_gamma_1));
  }
}

// EPLB replication (--redundant-experts: ExpertPlacement::replicated, one extra copy per rank) changes where
// an expert's tokens are computed, never what: the sequences are the single-process model's at gamma = inf,
// and under global capacity (which decides on experts, before copies are chosen) the unreplicated model's,
// in the fixed-size and the counted exchange. The copies share their expert's tokens, a rank's load is the
// sum of its copies', and each rank holds the weights of its own slots only. Replicas with a capacity that
// needs one rank per expert are refused.
TEST_P(MpiModel, ReplicatedExpertsComputeTheSameModel) {
  const int ranks = comm_.size();
  const int rank = comm_.rank();
  if (ranks < 2) GTEST_SKIP() << "replicas need at least two ranks";
  const runtime::ModelConfig& c = single_->config();
  const fs::path stats = testing::write_hot_expert_stats(
      fs::temp_directory_path() / ("capserve_replication_" + std::to_string(::getpid()) + ".json"),
      single_->moe_layers(), c.num_experts);
  ParallelOptions replicated = options(stats.string());
  replicated.redundant_experts = ranks;
  const std::string config = GetParam() + ", " + std::to_string(ranks) + " redundant, rank " +
                             std::to_string(rank) + " of " + std::to_string(ranks);
  const auto model = Model::load(dir_, backend_, comm_, replicated);
  const parallel::ExpertPlacement& p = model->placement();
  ASSERT_TRUE(p.replicated()) << config;
  EXPECT_EQ(p.num_slots(), c.num_experts + ranks) << config;
  for (const std::int64_t l : model->moe_layers()) {
    const std::span<const std::int32_t> first = p.first_slots(l);
    EXPECT_GE(first[1] - first[0], 2) << config << ", layer " << l << ": the hottest expert has copies";
    const std::vector<std::int32_t> hosted = p.hosted_experts(l, rank);
    EXPECT_EQ(std::set<std::int32_t>(hosted.begin(), hosted.end()).size(), hosted.size()) << config;
    EXPECT_EQ(model->layer(l).moe.experts.size(), hosted.size())
        << config << ", layer " << l << ": this rank's expert weights are its slots'";
  }

  Engine single_engine(*single_, {});
  const RunResult ref = reference_run(single_engine, ranks, "single process");
  Engine engine(*model, {});
  std::int64_t split_experts = 0;
  for (const Split split : {Split::spread, Split::rank0}) {
    const std::string where = config + ", " + name(split);
    const RunResult got = run(engine, prompts_, my_prompts(prompts_.size(), ranks, rank, split), where);
    expect_same_sequences(got, ref, where);
    expect_same_on_every_rank(comm_, pack(got.prefill_stats), where + ": last_moe_stats");
    for (const parallel::MoeLayerStats& s : got.prefill_stats.layers) {
      const std::string what = where + ", layer " + std::to_string(s.layer);
      ASSERT_EQ(static_cast<std::int64_t>(s.slot_load.size()), p.num_slots()) << what;
      const std::span<const std::int32_t> first = p.first_slots(s.layer);
      for (std::int64_t e = 0; e < c.num_experts; ++e) {
        std::int64_t routed = 0;
        std::int64_t kept = 0;
        std::int64_t busy = 0;
        for (std::int32_t x = first[e]; x < first[e + 1]; ++x) {
          routed += s.routed_slot_load[static_cast<std::size_t>(x)];
          kept += s.slot_load[static_cast<std::size_t>(x)];
          busy += s.slot_load[static_cast<std::size_t>(x)] > 0 ? 1 : 0;
        }
        EXPECT_EQ(routed, s.routed_load[static_cast<std::size_t>(e)]) << what << ", expert " << e;
        EXPECT_EQ(kept, s.expert_load[static_cast<std::size_t>(e)]) << what << ", expert " << e;
        split_experts += busy > 1 ? 1 : 0;
      }
      std::vector<std::int64_t> per_rank(static_cast<std::size_t>(ranks), 0);
      for (std::int64_t x = 0; x < p.num_slots(); ++x)
        per_rank[static_cast<std::size_t>(p.owners(s.layer)[static_cast<std::size_t>(x)])] +=
            s.slot_load[static_cast<std::size_t>(x)];
      EXPECT_EQ(s.rank_load, per_rank) << what << ": a rank's load is its copies'";
      EXPECT_EQ(total(s.rank_load), s.assignments) << what;
    }
  }
  EXPECT_GT(split_experts, 0) << config << ": no expert's tokens were shared by its copies";

  // Global capacity, replicated or not: the same kept set, so the same sequences and counts.
  for (const bool counted : {false, true}) {
    ParallelOptions bounded = options(stats.string(), 1.0, CapacityPolicy::reroute);
    bounded.redundant_experts = ranks;
    const std::string where = config + ", gamma 1 reroute" + (counted ? ", counted exchange" : "");
    const auto capped = Model::load(dir_, backend_, comm_, bounded);
    const auto plain =
        Model::load(dir_, backend_, comm_, options("contiguous", 1.0, CapacityPolicy::reroute));
    runtime::EngineOptions engine_options;
    if (counted) engine_options.fixed_exchange_tokens = 0;
    Engine capped_engine(*capped, engine_options);
    Engine plain_engine(*plain, engine_options);
    const std::vector<std::size_t> mine = my_prompts(prompts_.size(), ranks, rank, Split::spread);
    const RunResult want = run(plain_engine, prompts_, mine, where + ", unreplicated");
    const RunResult got = run(capped_engine, prompts_, mine, where);
    expect_same_layer_counts(got.prefill_stats, want.prefill_stats, where);
    expect_same_sequences(got, want, where);
  }

  ParallelOptions by_device = options(stats.string(), 1.0, CapacityPolicy::drop, CapacityGranularity::device);
  by_device.redundant_experts = ranks;
  EXPECT_THROW((void)Model::load(dir_, backend_, comm_, by_device), runtime::LoadError) << config;
  ParallelOptions expanded = options(stats.string(), 1.0, CapacityPolicy::expanded);
  expanded.redundant_experts = ranks;
  EXPECT_THROW((void)Model::load(dir_, backend_, comm_, expanded), runtime::LoadError) << config;
  fs::remove(stats);
}

// One-token sequences, each alone in its context: with gamma = 0.25 most tokens lose every routed slot in
// every MoE layer; their logits must be those of the model with all routed experts zeroed (the routed part
// is exactly 0, the shared expert and the residual remain), and, where the model has a shared expert, differ
// from the model with the shared expert zeroed too.
TEST_P(MpiModel, DroppedTokensKeepSharedExpertAndResidual) {
  const int ranks = comm_.size();
  const int rank = comm_.rank();
  const runtime::ModelConfig& c = single_->config();
  const auto vocab = static_cast<std::size_t>(c.vocab_size);
  const runtime::TensorNames names =
      runtime::find_architecture(runtime::read_json_file(dir_ / "config.json")).tensor_names();
  const std::string routed_part = "." + names.expert_prefix;
  const std::string shared_part = names.shared_expert_prefix.empty() ? "" : "." + names.shared_expert_prefix;
  const bool has_shared = c.shared_expert_intermediate_size > 0;
  EXPECT_EQ(has_shared, !shared_part.empty());
  const std::string tag = GetParam() + "_r" + std::to_string(rank);
  const ZeroedFixture no_routed(dir_, tag + "_no_routed", [&](const std::string& t) {
    return t.find(routed_part) != std::string::npos;
  });
  const ZeroedFixture no_moe(dir_, tag + "_no_moe", [&](const std::string& t) {
    return t.find(routed_part) != std::string::npos ||
           (!shared_part.empty() && t.find(shared_part) != std::string::npos);
  });
  // The checkpoint's multi-token-prediction MoE layers hold experts too (zeroed alike, never loaded).
  const auto mtp_moe_layers = std::ranges::count(c.mtp_layer_is_moe, true);
  const std::int64_t stored_moe_layers = moe_layers() + mtp_moe_layers;
  EXPECT_EQ(no_routed.zeroed(), 3 * c.num_experts * stored_moe_layers);
  EXPECT_EQ(no_moe.zeroed(), (3 * c.num_experts + (has_shared ? 3 : 0)) * stored_moe_layers);

  constexpr std::size_t kTokens = 48;
  std::vector<std::vector<std::int32_t>> one_token;
  for (std::size_t i = 0; i < kTokens; ++i)
    one_token.push_back({static_cast<std::int32_t>((i * 37 + 5) % vocab)});
  const std::vector<std::size_t> order = global_order(kTokens, ranks);
  const std::vector<std::size_t> mine = my_prompts(kTokens, ranks, rank, Split::spread);

  // References (gamma = inf, one process): every one-token sequence's logits.
  const auto logits_of = [&](Model& m) {
    Engine e(m, {});
    std::vector<Engine::Work> work;
    for (std::size_t j = 0; j < order.size(); ++j) work.push_back({j, one_token[order[j]], false});
    const runtime::Status st = e.step(work);
    EXPECT_TRUE(st.ok()) << st.message();
    std::vector<std::vector<float>> by_prompt(kTokens);
    for (std::size_t j = 0; j < order.size() && st.ok(); ++j) {
      const auto row = e.logits().subspan(j * vocab, vocab);
      by_prompt[order[j]].assign(row.begin(), row.end());
    }
    return by_prompt;
  };
  const auto full = logits_of(*single_);
  const auto without_routed = logits_of(*Model::load(no_routed.dir(), backend_));
  const auto without_moe = logits_of(*Model::load(no_moe.dir(), backend_));
  double zeroing_changed = 0;
  for (std::size_t i = 0; i < kTokens; ++i)
    zeroing_changed = std::max(zeroing_changed, testing::relative_max_diff(full[i], without_routed[i]));
  EXPECT_GT(zeroing_changed, 1e-3)
      << "zeroing the routed experts changed nothing: the check below is vacuous";

  const ParallelOptions opts = options("contiguous", 0.25, CapacityPolicy::drop);
  const auto model = Model::load(dir_, backend_, comm_, opts);
  Engine engine(*model, {});
  std::vector<Engine::Work> work;
  for (const std::size_t i : mine) work.push_back({i, one_token[i], false});
  const runtime::Status st = engine.step(work);
  EXPECT_TRUE(st.ok()) << st.message();
  expect_capacity_invariants(engine.last_moe_stats(), opts.capacity, model->placement(), c.num_experts,
                             c.top_k, GetParam() + ", gamma 0.25");
  std::int64_t all_dropped = 0;
  for (std::size_t j = 0; j < mine.size() && st.ok(); ++j) {
    const std::size_t i = mine[j];
    EXPECT_LE(engine.moe_counts()[j].dropped, c.top_k * moe_layers());
    if (engine.moe_counts()[j].dropped != c.top_k * moe_layers()) continue;
    ++all_dropped;
    const auto got = engine.logits().subspan(j * vocab, vocab);
    const std::string what =
        GetParam() + ", token " + std::to_string(one_token[i][0]) + " (every slot dropped)";
    EXPECT_LE(testing::relative_max_diff(got, without_routed[i]), kTolerance)
        << what << ": not the model without its routed experts";
    if (has_shared) {
      EXPECT_GT(testing::relative_max_diff(got, without_moe[i]), 1e-3)
          << what << ": the shared expert's contribution is missing";
    }
  }
  const std::int64_t all_dropped_total = sum_over_ranks(comm_, all_dropped);
  EXPECT_GT(all_dropped_total, 0) << "no token lost all its routed slots: the check is vacuous";
  if (rank == 0) {
    std::printf("[ shared   ] %s np=%d: %lld of %zu one-token sequences lost every routed slot\n",
                GetParam().c_str(), ranks, static_cast<long long>(all_dropped_total), kTokens);
  }
}

// One token per step, on rank s % R: expert_load then says exactly which experts computed it, so the rows
// dispatched (one per token and destination rank) and the wire bytes (the row out and back to each other
// rank, plus one entry per remote expert) follow from the routing alone. Device capacity at gamma = 0.25
// keeps one slot per rank, so there are drops whenever two of the token's experts share a rank.
TEST_P(MpiModel, DispatchMovesOnlyKeptRoutedAssignments) {
  const int ranks = comm_.size();
  const int rank = comm_.rank();
  const runtime::ModelConfig& c = single_->config();
  const auto row_bytes = c.hidden_size * static_cast<std::int64_t>(sizeof(float));
  const auto entry_bytes = static_cast<std::int64_t>(sizeof(parallel::TokenDispatcher::Entry));
  std::int64_t dropped = 0;
  for (const std::string placement : {"contiguous", "round-robin"}) {
    const ParallelOptions opts = options(placement, 0.25, CapacityPolicy::drop, CapacityGranularity::device);
    const auto model = Model::load(dir_, backend_, comm_, opts);
    Engine engine(*model, {});
    for (int step = 0; step < 8; ++step) {
      const int src = step % ranks;
      const std::vector<std::int32_t> token{static_cast<std::int32_t>((step * 53 + 11) % c.vocab_size)};
      std::vector<Engine::Work> work;
      if (rank == src) work.push_back({7, token, false});
      const runtime::Status st = engine.step(work);
      EXPECT_TRUE(st.ok()) << st.message();
      for (const parallel::MoeLayerStats& s : engine.last_moe_stats().layers) {
        const std::string what = GetParam() + ", " + placement + ", step " + std::to_string(step) +
                                 ", layer " + std::to_string(s.layer);
        EXPECT_EQ(s.tokens, 1) << what;
        EXPECT_EQ(total(s.routed_load), c.top_k) << what;
        std::set<int> destinations;
        std::int64_t kept = 0;
        std::int64_t remote_entries = 0;
        for (std::int64_t e = 0; e < c.num_experts; ++e) {
          const std::int64_t load = s.expert_load[static_cast<std::size_t>(e)];
          EXPECT_LE(load, s.routed_load[static_cast<std::size_t>(e)]) << what << ": drop moved a slot";
          if (load == 0) continue;
          const int owner = model->placement().owners(s.layer)[static_cast<std::size_t>(e)];
          kept += load;
          destinations.insert(owner);
          remote_entries += owner != src ? load : 0;
        }
        EXPECT_EQ(s.dropped, c.top_k - kept) << what;
        EXPECT_LE(s.dropped, s.assignments) << what;
        EXPECT_EQ(s.rerouted, 0) << what;
        EXPECT_EQ(s.rows_dispatched, static_cast<std::int64_t>(destinations.size())) << what;
        const auto remote_rows =
            static_cast<std::int64_t>(destinations.size()) - (destinations.contains(src) ? 1 : 0);
        EXPECT_EQ(s.wire_bytes, 2 * remote_rows * row_bytes + remote_entries * entry_bytes) << what;
        dropped += s.dropped;
      }
      engine.release(7);
    }
  }
  EXPECT_GT(dropped, 0) << "device capacity dropped nothing: the drop half of the check is vacuous";
}

// Each rank keeps only its own routed experts: their bytes are the placement's share of the total. The
// resident memory after a forward (process RSS and the checkpoint mapping's resident pages) is printed next
// to a single-process model's; at these fixture sizes page granularity and fault-around blur it, so only the
// byte counts are asserted.
TEST_P(MpiModel, EachRankHoldsOnlyItsRoutedExperts) {
  const int ranks = comm_.size();
  const int rank = comm_.rank();
  const runtime::ModelConfig c = single_->config();
  const std::int64_t moe_layer_count = moe_layers();
  single_.reset();  // only the model measured maps the checkpoint

  const nlohmann::json json = runtime::read_json_file(dir_ / "config.json");
  const runtime::Architecture& arch = runtime::find_architecture(json);
  const runtime::TensorNames names = arch.tensor_names();
  const auto expert_bytes = [&](const parallel::ExpertPlacement& placement, int r) {
    runtime::Checkpoint ckpt = runtime::Checkpoint::open(dir_, c.fp8_blocks);
    const runtime::ModelWeights w = runtime::load_model_weights(ckpt, c, names, placement, r, backend_);
    std::int64_t bytes = 0;
    std::int64_t count = 0;
    for (const runtime::LayerWeights& l : w.layers) {
      for (const kernels::ExpertWeights& e : l.moe.experts) {
        bytes += bytes_of(e);
        ++count;
      }
    }
    return std::pair{bytes, count};
  };
  const auto one_rank = parallel::ExpertPlacement::contiguous(c.num_layers, c.num_experts, 1);
  const auto [all_bytes, all_count] = expert_bytes(one_rank, 0);
  EXPECT_EQ(all_count, c.num_experts * moe_layer_count);

  std::vector<Engine::Work> work;
  for (const std::size_t i : my_prompts(prompts_.size(), ranks, rank, Split::spread))
    work.push_back({i, prompts_[i], false});

  const std::int64_t rss_before = status_kb("VmRSS");
  std::int64_t dist_mapped = 0;
  std::int64_t dist_rss = 0;
  {
    const auto model = Model::load(dir_, backend_, comm_, options("contiguous"));
    Engine engine(*model, {});
    EXPECT_TRUE(engine.step(work).ok());
    dist_mapped = mapped_resident_kb(dir_);
    dist_rss = status_kb("VmRSS");
    const auto [bytes, count] = expert_bytes(model->placement(), rank);
    std::int64_t hosted = 0;
    for (std::int64_t l = 0; l < c.num_layers; ++l) {
      if (c.layer_is_moe[static_cast<std::size_t>(l)])
        hosted += static_cast<std::int64_t>(model->placement().local_experts(l, rank).size());
    }
    EXPECT_EQ(count, hosted);
    EXPECT_EQ(bytes * all_count, all_bytes * count) << "experts differ in size";
    EXPECT_EQ(sum_over_ranks(comm_, bytes), all_bytes) << "every routed expert is held by exactly one rank";
    // ~1/np: within one expert per layer of an even share.
    const std::int64_t per_expert = all_bytes / all_count;
    EXPECT_LE(std::abs(bytes * ranks - all_bytes), ranks * per_expert * moe_layer_count);
    std::printf("[ memory   ] %s np=%d rank %d: routed experts %lld of %lld bytes (%.1f%%, 1/np = %.1f%%)\n",
                GetParam().c_str(), ranks, rank, static_cast<long long>(bytes),
                static_cast<long long>(all_bytes),
                100.0 * static_cast<double>(bytes) / static_cast<double>(all_bytes), 100.0 / ranks);
  }
  std::int64_t single_mapped = 0;
  {
    const auto model = Model::load(dir_, backend_);
    Engine engine(*model, {});
    std::vector<Engine::Work> all;
    for (std::size_t i = 0; i < prompts_.size(); ++i) all.push_back({i, prompts_[i], false});
    EXPECT_TRUE(engine.step(all).ok());
    single_mapped = mapped_resident_kb(dir_);
  }
  std::uintmax_t file_bytes = 0;
  for (const auto& entry : fs::directory_iterator(dir_)) {
    if (entry.path().extension() == ".safetensors") file_bytes += entry.file_size();
  }
  std::printf(
      "[ memory   ] %s np=%d rank %d: checkpoint resident after a forward %lld kB distributed, %lld kB "
      "single process (files %ju kB); VmRSS %lld kB before load, %lld kB after the distributed forward\n",
      GetParam().c_str(), ranks, rank, static_cast<long long>(dist_mapped),
      static_cast<long long>(single_mapped), file_bytes / 1024, static_cast<long long>(rss_before),
      static_cast<long long>(dist_rss));
}

// A step refused on one rank (bad token id, or too few KV blocks) is an error on that rank only; it still
// joins the step's collectives with zero tokens, so the other ranks' steps complete with the right logits,
// and the next step runs normally everywhere. Also with capacity on, whose scheduler adds collectives.
TEST_P(MpiModel, StepRefusedOnOneRankOnly) {
  const int ranks = comm_.size();
  const int rank = comm_.rank();
  const int bad = ranks > 1 ? 1 : 0;
  const runtime::ModelConfig& c = single_->config();
  const auto vocab = static_cast<std::size_t>(c.vocab_size);
  for (const double gamma : {kInf, 1.0}) {
    const ParallelOptions opts = options("contiguous", gamma);
    const std::string where = GetParam() + ", " + describe(opts) + ", rank " + std::to_string(rank);
    // Rank r's prompt: the fixture's prompt r % 4; the reference runs the good ranks' prompts, in rank order.
    const auto prompt_of = [&](int r) { return prompts_[static_cast<std::size_t>(r % 4)]; };
    parallel::SelfCommunicator self;
    const auto ref_model = Model::load(dir_, backend_, self, opts);
    Engine ref_engine(*ref_model, {});
    std::vector<std::vector<std::int32_t>> ref_prompts;
    for (int r = 0; r < ranks; ++r) {
      if (r != bad) ref_prompts.push_back(prompt_of(r));
    }
    std::vector<Engine::Work> ref_work;
    for (std::size_t j = 0; j < ref_prompts.size(); ++j) ref_work.push_back({j, ref_prompts[j], false});
    EXPECT_TRUE(ref_engine.step(ref_work).ok());

    const auto model = Model::load(dir_, backend_, comm_, opts);
    {
      Engine engine(*model, {});
      const std::vector<std::int32_t> invalid{3, static_cast<std::int32_t>(c.vocab_size)};
      const std::vector<std::int32_t> mine = rank == bad ? invalid : prompt_of(rank);
      const Engine::Work w{1, mine, false};
      const runtime::Status st = engine.step(std::span(&w, 1));
      if (rank == bad) {
        EXPECT_EQ(st.code(), runtime::StatusCode::invalid_argument) << where << ": " << st.message();
        EXPECT_EQ(engine.length(1), 0) << where << ": a refused step changed the sequence";
      } else {
        EXPECT_TRUE(st.ok()) << where << ": " << st.message();
        const int j = rank < bad ? rank : rank - 1;  // index among the good ranks
        if (st.ok()) {
          EXPECT_LE(
              testing::relative_max_diff(
                  engine.logits(), ref_engine.logits().subspan(static_cast<std::size_t>(j) * vocab, vocab)),
              kTolerance)
              << where;
        }
      }
      std::int64_t good_tokens = 0;
      for (const auto& p : ref_prompts) good_tokens += static_cast<std::int64_t>(p.size());
      for (const auto& s : engine.last_moe_stats().layers)
        EXPECT_EQ(s.tokens, good_tokens) << where << ", layer " << s.layer << ": not the good ranks' tokens";
      // The next step runs everywhere: the refused rank starts its sequence, the others decode one token.
      const std::vector<std::int32_t> next = rank == bad ? prompt_of(rank) : std::vector<std::int32_t>{17};
      const Engine::Work w2{1, next, false};
      const runtime::Status st2 = engine.step(std::span(&w2, 1));
      EXPECT_TRUE(st2.ok()) << where << ", next step: " << st2.message();
    }
    {
      // Too few KV blocks on the bad rank only (every rank has 2 blocks of 16 tokens).
      Engine engine(*model, {16, 2});
      std::vector<std::int32_t> mine = prompt_of(rank == bad ? 3 : rank);  // 29 tokens fit
      if (rank == bad) {
        const std::vector<std::int32_t> again = mine;
        mine.insert(mine.end(), again.begin(), again.end());  // 58 do not
      }
      const Engine::Work w{1, mine, false};
      const runtime::Status st = engine.step(std::span(&w, 1));
      if (rank == bad) {
        EXPECT_EQ(st.code(), runtime::StatusCode::resource_exhausted) << where << ": " << st.message();
        EXPECT_EQ(engine.cache().blocks().free_blocks(), 2) << where;
      } else {
        EXPECT_TRUE(st.ok()) << where << ": " << st.message();
      }
    }
    {
      // A step with no work on any rank: zero tokens everywhere, still a valid (collective) step.
      Engine engine(*model, {});
      const runtime::Status st = engine.step({});
      EXPECT_TRUE(st.ok()) << where << ": " << st.message();
      for (const auto& s : engine.last_moe_stats().layers) {
        EXPECT_EQ(s.tokens, 0) << where << ", layer " << s.layer;
        EXPECT_EQ(s.dropped, 0) << where << ", layer " << s.layer;
        EXPECT_EQ(s.rows_dispatched, 0) << where << ", layer " << s.layer;
      }
    }
    {
      // generate: the bad rank's error is its own; the others stop with an internal error; none hangs.
      Engine engine(*model, {});
      const std::vector<std::vector<std::int32_t>> mine{rank == bad ? std::vector<std::int32_t>{-1}
                                                                    : prompt_of(rank)};
      const std::vector<runtime::SamplingParams> params(1, greedy());
      std::vector<runtime::Generation> out;
      const runtime::Status st = runtime::generate(engine, mine, params, false, out);
      if (rank == bad) {
        EXPECT_EQ(st.code(), runtime::StatusCode::invalid_argument) << where << ": " << st.message();
      } else {
        EXPECT_EQ(st.code(), runtime::StatusCode::internal) << where << ": " << st.message();
      }
      EXPECT_EQ(engine.length(0), 0) << where << ": generate left a sequence behind";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, MpiModel, ::testing::ValuesIn(testing::fixture_model_names()),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace capserve
