// capserve-eval-heldout: per-domain held-out perplexity, next-token accuracy (the task score: how often the
// model's most probable next token is the text's) and expert routing of a model on the shared corpus,
// computed by the C++ runtime (its tokenizer, forward pass and per-step expert-load statistics), following
// the protocol of tools/measure_default_model.py; with --reference it prints the relative difference to the
// HF transformers figures. Alone or under mpirun: every step is --batch-windows windows of one domain, split
// into contiguous shares over the ranks (data parallelism; the experts are spread by the placement flags),
// so the step's token order, and with it every global-scope capacity decision, does not depend on the
// number of ranks. --json writes the figures and the capacity scheduler's counts for tools/eval scripts.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <numeric>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "parallel/moe_stats.h"
#include "parallel/mpi_world.h"
#include "runtime/cli/parallel_flags.h"
#include "runtime/cli/rank_devices.h"
#include "runtime/cli/version.h"
#include "runtime/engine.h"
#include "runtime/load_error.h"
#include "runtime/model.h"
#include "runtime/model_config.h"
#include "runtime/tokenizer/tokenizer.h"
#include "tools/eval/heldout_corpus.h"

namespace {

namespace parallel = capserve::parallel;
namespace runtime = capserve::runtime;
using runtime::Engine;

struct Options {
  std::string model_dir;
  std::string corpus_dir = "../shared/data/corpus";
  std::vector<std::string> domains = {"arxiv", "books", "code", "web", "wikipedia"};
  std::string reference;
  std::string json_path;
  int window = 255;
  int batch_windows = 8;
  std::int64_t max_windows = 0;  // per domain; 0 = all
  int threads = 1;
  std::string device = "cpu";
  double fraction = 0.05;
  runtime::ParallelFlags parallel;
};

void add_options(CLI::App& app, Options& o) {
  app.add_option("--model", o.model_dir, "model directory (config, safetensors, tokenizer)")
      ->required()
      ->check(CLI::ExistingDirectory);
  app.add_option("--corpus", o.corpus_dir, "directory of <domain>.txt files")->check(CLI::ExistingDirectory);
  app.add_option("--domains", o.domains, "domains to evaluate");
  app.add_option("--reference", o.reference,
                 "HF figures (tools/results/default_model_eval.json) to compare with");
  app.add_option("--json", o.json_path,
                 "write per-domain perplexity and the capacity scheduler's counts as JSON (rank 0)");
  app.add_option("--heldout-fraction", o.fraction, "held-out tail of each file");
  app.add_option("--window", o.window, "text tokens per window (after one <|endoftext|>)")
      ->check(CLI::PositiveNumber);
  app.add_option("--batch-windows", o.batch_windows, "windows per ragged step, over all ranks")
      ->check(CLI::PositiveNumber);
  app.add_option("--max-windows", o.max_windows, "windows per domain, the first ones (0 = all)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--threads", o.threads, "CPU threads per rank")->check(CLI::PositiveNumber);
  runtime::add_device_flag(app, o.device);
  runtime::add_parallel_flags(app, o.parallel);
}

struct DomainResult {
  std::string name;
  std::vector<std::int32_t> ids;  // the held-out text's tokens
  std::int64_t windows = 0;
  std::int64_t tokens = 0;         // scored: windows * window
  double total_nll = 0.0;          // this rank's windows, then (after gather_scores, on rank 0) all of them
  std::int64_t correct = 0;        // positions whose most probable next token is the text's; likewise
  parallel::RunStats moe;          // this domain's steps, all ranks
  std::vector<std::int64_t> load;  // [layers, experts]: the router's choices at text positions
  [[nodiscard]] double perplexity() const { return std::exp(total_nll / static_cast<double>(tokens)); }
  [[nodiscard]] double accuracy() const { return static_cast<double>(correct) / static_cast<double>(tokens); }
};

std::vector<DomainResult> load_domains(const Options& o, const runtime::Tokenizer& tokenizer) {
  std::vector<DomainResult> results;
  for (const std::string& domain : o.domains) {
    DomainResult r;
    r.name = domain;
    const std::string text = capserve::tools::heldout_text(
        capserve::tools::read_corpus_file(o.corpus_dir + "/" + domain + ".txt"), o.fraction);
    if (auto s = tokenizer.encode(text, false, r.ids); !s.ok())
      throw runtime::LoadError(domain + ": " + s.message());
    r.windows = static_cast<std::int64_t>(r.ids.size()) / o.window;
    if (o.max_windows > 0) r.windows = std::min(r.windows, o.max_windows);
    r.tokens = r.windows * o.window;
    results.push_back(std::move(r));
  }
  return results;
}

// Routed tokens per expert, [layers, experts] (zero rows for dense layers), all ranks.
std::vector<std::int64_t> routed_load(const parallel::MoeStepStats& stats, const runtime::ModelConfig& c) {
  std::vector<std::int64_t> load(static_cast<std::size_t>(c.num_layers * c.num_experts), 0);
  for (const auto& layer : stats.layers)
    std::copy(layer.routed_load.begin(), layer.routed_load.end(), load.begin() + layer.layer * c.num_experts);
  return load;
}

// This rank's contiguous share [begin, end) of `count` windows.
std::pair<std::int64_t, std::int64_t> share(std::int64_t count, int rank, int ranks) {
  return {count * rank / ranks, count * (rank + 1) / ranks};
}

// Runs one domain's windows, `batch_windows` per step over all ranks (a collective: every rank runs the same
// number of steps, with no work when its share is empty).
void evaluate_domain(Engine& engine, const Options& o, int rank, int ranks, DomainResult& r) {
  const std::int32_t bos = 0;
  std::vector<std::vector<std::int32_t>> inputs;
  std::vector<Engine::Work> work;
  // Per logits row, the token that follows it: the same scoring as the server's prompt log-probabilities
  // (Engine::score), so each window's NLL is the sum of -log p(input[i + 1] | input[..i]) over its positions
  // 0..window-1; its last position scores nothing (token 0, ignored).
  std::vector<std::int32_t> next;
  runtime::TokenLogprobs scores;
  for (std::int64_t first = 0; first < r.windows; first += o.batch_windows) {
    const auto [begin, end] = share(std::min<std::int64_t>(o.batch_windows, r.windows - first), rank, ranks);
    inputs.assign(static_cast<std::size_t>(end - begin), {});
    work.clear();
    for (std::int64_t w = begin; w < end; ++w) {
      auto& in = inputs[static_cast<std::size_t>(w - begin)];
      in.push_back(bos);
      const auto text = r.ids.begin() + (first + w) * o.window;
      in.insert(in.end(), text, text + o.window);
      work.push_back({static_cast<runtime::SequenceId>(w + 1), in, true});
    }
    if (auto s = engine.step(work); !s.ok()) throw std::runtime_error(r.name + ": " + s.message());
    next.clear();
    for (const auto& in : inputs) {
      next.insert(next.end(), in.begin() + 1, in.end());
      next.push_back(0);
    }
    engine.score(next, 0, scores);
    const std::int64_t rows_per_window = o.window + 1;
    const std::span<const float> logits = engine.logits();
    const auto vocab = static_cast<std::size_t>(engine.model().config().vocab_size);
    for (std::size_t j = 0; j < inputs.size(); ++j) {
      for (std::int64_t i = 0; i < o.window; ++i) {
        const std::int64_t row = static_cast<std::int64_t>(j) * rows_per_window + i;
        r.total_nll -= static_cast<double>(scores.logprob(row));
        // The most probable token (the lowest id on ties, as greedy decoding picks) against the text's.
        const std::span<const float> p = logits.subspan(static_cast<std::size_t>(row) * vocab, vocab);
        const auto best = std::max_element(p.begin(), p.end()) - p.begin();
        if (best == inputs[j][static_cast<std::size_t>(i) + 1]) ++r.correct;
      }
      engine.release(work[j].seq);
    }
    r.moe.add(engine.last_moe_stats());
  }
}

// Position 0 (<|endoftext|> with no context) routes identically in every window: one probe step measures
// its load, to be taken out of each domain's. A collective; rank 0 runs the token.
std::vector<std::int64_t> bos_load(Engine& engine, const runtime::Model& model, int rank) {
  const std::vector<std::int32_t> lone{0};
  const Engine::Work lone_work{0, lone, false};
  if (auto s = engine.step(std::span(&lone_work, rank == 0 ? 1 : 0)); !s.ok())
    throw std::runtime_error(s.message());
  if (rank == 0) engine.release(0);
  return routed_load(engine.last_moe_stats(), model.config());
}

void set_text_load(const runtime::ModelConfig& c, std::span<const std::int64_t> bos, DomainResult& r) {
  r.load = routed_load(r.moe.totals(), c);
  for (std::size_t i = 0; i < bos.size(); ++i) r.load[i] -= r.windows * bos[i];
}

// Sums every rank's NLL and correct predictions of each domain into rank 0's results.
void gather_scores(parallel::MpiWorld& world, std::vector<DomainResult>& results) {
  std::vector<double> mine;
  for (const DomainResult& r : results)
    mine.insert(mine.end(), {r.total_nll, static_cast<double>(r.correct)});
  const auto gathered = world.gather(std::as_bytes(std::span(mine)), 0);
  if (world.rank() != 0) return;
  for (DomainResult& r : results) {
    r.total_nll = 0.0;
    r.correct = 0;
  }
  for (const std::vector<std::byte>& bytes : gathered) {
    std::vector<double> theirs(2 * results.size());
    std::memcpy(theirs.data(), bytes.data(), theirs.size() * sizeof(double));
    for (std::size_t i = 0; i < results.size(); ++i) {
      results[i].total_nll += theirs[2 * i];
      results[i].correct += static_cast<std::int64_t>(theirs[2 * i + 1]);
    }
  }
}

double cosine(std::span<const std::int64_t> a, std::span<const std::int64_t> b) {
  double ab = 0, aa = 0, bb = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    ab += static_cast<double>(a[i]) * static_cast<double>(b[i]);
    aa += static_cast<double>(a[i]) * static_cast<double>(a[i]);
    bb += static_cast<double>(b[i]) * static_cast<double>(b[i]);
  }
  return ab / std::sqrt(aa * bb);
}

void print_perplexity(const std::vector<DomainResult>& results, const std::string& reference) {
  nlohmann::json ref;
  if (!reference.empty()) ref = runtime::read_json_file(reference);
  std::printf("%-10s %8s %12s %12s %12s %10s\n", "domain", "windows", "perplexity", "HF ppl", "rel diff",
              "accuracy");
  for (const DomainResult& r : results) {
    double hf = NAN;
    if (!ref.is_null()) hf = ref["domains"][r.name]["perplexity"].get<double>();
    std::printf("%-10s %8lld %12.4f %12.4f %12.2e %10.4f\n", r.name.c_str(),
                static_cast<long long>(r.windows), r.perplexity(), hf, std::fabs(r.perplexity() - hf) / hf,
                r.accuracy());
  }
}

void print_routing(const std::vector<DomainResult>& results, const runtime::ModelConfig& c) {
  std::printf("\nrouting (text positions): max/mean tokens per expert, per layer\n%-10s", "domain");
  for (std::int64_t l = 0; l < c.num_layers; ++l) std::printf("  layer %-3lld", static_cast<long long>(l));
  std::printf("\n");
  for (const DomainResult& r : results) {
    std::printf("%-10s", r.name.c_str());
    for (std::int64_t l = 0; l < c.num_layers; ++l) {
      const std::span<const std::int64_t> row(r.load.data() + l * c.num_experts,
                                              static_cast<std::size_t>(c.num_experts));
      const double total = static_cast<double>(std::accumulate(row.begin(), row.end(), std::int64_t{0}));
      std::printf("  %9.3f", total == 0 ? 0.0
                                        : static_cast<double>(*std::max_element(row.begin(), row.end())) /
                                              (total / static_cast<double>(c.num_experts)));
    }
    std::printf("\n");
  }
}

void print_cosines(const std::vector<DomainResult>& results, const runtime::ModelConfig& c) {
  std::printf("\nlowest cosine between two domains' expert-load vectors, per layer\n");
  const auto n = static_cast<std::size_t>(c.num_experts);
  for (std::int64_t l = 0; l < c.num_layers; ++l) {
    const auto off = static_cast<std::size_t>(l * c.num_experts);
    double lowest = 2.0;
    std::string pair;
    for (std::size_t a = 0; a < results.size(); ++a) {
      for (std::size_t b = a + 1; b < results.size(); ++b) {
        const double cs =
            cosine(std::span(results[a].load).subspan(off, n), std::span(results[b].load).subspan(off, n));
        if (cs < lowest) {
          lowest = cs;
          pair = results[a].name + "/" + results[b].name;
        }
      }
    }
    std::printf("layer %lld: %.4f (%s)\n", static_cast<long long>(l), lowest, pair.c_str());
  }
}

double fraction_of(std::int64_t part, std::int64_t whole) {
  return whole == 0 ? 0.0 : static_cast<double>(part) / static_cast<double>(whole);
}

// Assignment slots summed over the MoE layers.
nlohmann::json slot_totals(const parallel::MoeStepStats& stats) {
  std::int64_t assignments = 0, dropped = 0, rerouted = 0;
  for (const auto& l : stats.layers) {
    assignments += l.assignments;
    dropped += l.dropped;
    rerouted += l.rerouted;
  }
  return {{"assignments", assignments},
          {"dropped", dropped},
          {"rerouted", rerouted},
          {"drop_fraction", fraction_of(dropped, assignments)},
          {"reroute_fraction", fraction_of(rerouted, assignments)}};
}

void write_json(const std::string& path, const Options& o, const runtime::Model& model, int ranks,
                const std::vector<DomainResult>& results, const parallel::RunStats& run) {
  nlohmann::json domains = nlohmann::json::object();
  double nll = 0.0;
  std::int64_t tokens = 0;
  std::int64_t correct = 0;
  for (const DomainResult& r : results) {
    domains[r.name] = {{"perplexity", r.perplexity()},
                       {"accuracy", r.accuracy()},
                       {"correct", r.correct},
                       {"windows", r.windows},
                       {"tokens", r.tokens},
                       {"total_nll", r.total_nll},
                       {"moe", slot_totals(r.moe.totals())}};
    nll += r.total_nll;
    tokens += r.tokens;
    correct += r.correct;
  }
  // The run's sums, plus its per-layer statistics in the --moe-stats format (drop fraction, loads, ...).
  nlohmann::json moe = slot_totals(run.totals());
  const std::string config = parallel::describe(model.capacity());
  moe["layers"] = nlohmann::json::parse(run.to_json(config))["layers"];
  const nlohmann::json j = {{"model", o.model_dir},
                            {"capacity", config},
                            {"placement", model.placement().kind()},
                            {"ranks", ranks},
                            {"window", o.window},
                            {"batch_windows", o.batch_windows},
                            {"max_windows", o.max_windows},
                            {"heldout_fraction", o.fraction},
                            {"domains", domains},
                            {"all",
                             {{"perplexity", std::exp(nll / static_cast<double>(tokens))},
                              {"accuracy", static_cast<double>(correct) / static_cast<double>(tokens)},
                              {"tokens", tokens}}},
                            {"moe", moe}};
  std::ofstream file(path);
  file << j.dump(1) << "\n";
  if (!file) throw std::runtime_error("cannot write " + path);
}

}  // namespace

int main(int argc, char** argv) {
  capserve::runtime::log_to_stderr();
  std::optional<parallel::MpiWorld> world;
  if (!parallel::start_mpi(world, argc, argv, "capserve-eval-heldout")) return 1;
  const int rank = world->rank();
  const int ranks = world->size();
  CLI::App app{"Held-out perplexity and routing of a model on the shared corpus, by the C++ runtime"};
  capserve::runtime::add_common_flags(app, "capserve-eval-heldout");
  Options o;
  o.threads = static_cast<int>(
      std::max(1U, std::thread::hardware_concurrency() / static_cast<unsigned>(world->local_size())));
  add_options(app, o);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return rank == 0 ? app.exit(e) : (e.get_exit_code() == 0 ? 0 : 2);
  }

  // Everything that can fail before the first collective is agreed on, so that no rank is left waiting.
  runtime::RankDevices devices;
  std::unique_ptr<runtime::Model> model;
  std::vector<DomainResult> results;
  std::string failure;
  try {
    devices = runtime::make_rank_devices(o.device, o.threads, *world);
    model = devices.load(o.model_dir, runtime::finish_parallel_flags(o.parallel));
    results = load_domains(o, runtime::Tokenizer::load(o.model_dir));
  } catch (const std::exception& e) {
    failure = e.what();
  }
  if (!failure.empty()) std::fprintf(stderr, "capserve-eval-heldout: rank %d: %s\n", rank, failure.c_str());
  if (!world->all_agree(failure.empty())) return 1;

  try {
    runtime::EngineOptions options;
    options.kv_blocks = o.batch_windows * ((o.window + 1) / options.kv_block_size + 1);
    Engine engine(*model, options);
    for (DomainResult& r : results) evaluate_domain(engine, o, rank, ranks, r);
    const parallel::RunStats run = engine.run_stats();  // before the probe step
    const std::vector<std::int64_t> bos = bos_load(engine, *model, rank);
    for (DomainResult& r : results) set_text_load(model->config(), bos, r);
    gather_scores(*world, results);
    if (rank != 0) return 0;
    print_perplexity(results, o.reference);
    print_routing(results, model->config());
    print_cosines(results, model->config());
    if (!o.json_path.empty()) write_json(o.json_path, o, *model, ranks, results, run);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "capserve-eval-heldout: rank %d: %s\n", rank, e.what());
    if (ranks > 1) world->abort(1);
    return 1;
  }
  return 0;
}
