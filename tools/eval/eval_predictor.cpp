// capserve-eval-predictor: how well the batch selector's load predictor foresees where a batch's expert load
// lands, per MoE layer and rank count. The predictor (runtime/router_load_predictor.h, --dry-run-layers) runs
// each prompt's embeddings through the router of the first MoE layers without attention; the truth is the
// routed load of the same batch's real prefill (Engine::last_moe_stats). Batches of held-out corpus prompts,
// each either from one domain (the case batch selection exploits: domain-clustered traffic) or mixed; the
// experts placed contiguously over R ranks as the server places them. Per layer and R: the mean predicted and
// realised per-rank max/mean, their correlation over the batches, the mean absolute error, and how often the
// predicted hottest rank is the real one. And the server's aggregate prediction (per-rank loads summed over
// the first L dry-run layers, what RouterLoadPredictor gives the selector) against the realised mean of the
// per-layer max/mean, for every L.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <memory>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "kernels/cpu/cpu_backend.h"
#include "parallel/expert_placement.h"
#include "parallel/moe_stats.h"
#include "runtime/cli/version.h"
#include "runtime/engine.h"
#include "runtime/model.h"
#include "runtime/tokenizer/tokenizer.h"
#include "tools/eval/heldout_corpus.h"

namespace {

namespace parallel = capserve::parallel;
namespace runtime = capserve::runtime;

struct Options {
  std::string model_dir;
  std::string corpus_dir = "../shared/data/corpus";
  std::vector<std::string> domains = {"arxiv", "books", "code", "web", "wikipedia"};
  std::vector<int> ranks = {2, 4, 8};
  std::int64_t prompt_tokens = 128;
  std::int64_t batch_prompts = 8;
  std::int64_t batches_per_domain = 6;  // clustered; as many mixed batches per domain
  int threads = static_cast<int>(std::max(1U, std::thread::hardware_concurrency()));
  std::string json_path;
};

// A batch's expert loads, [moe layers, experts]: the dry run's and the real prefill's.
struct BatchLoads {
  std::string kind;  // the domain, or "mixed"
  std::vector<std::int64_t> predicted;
  std::vector<std::int64_t> realised;
};

double pearson(const std::vector<double>& x, const std::vector<double>& y) {
  const auto n = static_cast<double>(x.size());
  const double mx = std::accumulate(x.begin(), x.end(), 0.0) / n;
  const double my = std::accumulate(y.begin(), y.end(), 0.0) / n;
  double sxy = 0, sxx = 0, syy = 0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    sxy += (x[i] - mx) * (y[i] - my);
    sxx += (x[i] - mx) * (x[i] - mx);
    syy += (y[i] - my) * (y[i] - my);
  }
  return sxx > 0 && syy > 0 ? sxy / std::sqrt(sxx * syy) : 0.0;
}

double mean(const std::vector<double>& v) {
  return std::accumulate(v.begin(), v.end(), 0.0) / static_cast<double>(v.size());
}

// Layer l's expert loads folded onto the ranks that own them.
std::vector<std::int64_t> rank_loads(std::span<const std::int64_t> expert_loads,
                                     std::span<const std::int32_t> owners, int ranks) {
  std::vector<std::int64_t> out(static_cast<std::size_t>(ranks), 0);
  for (std::size_t e = 0; e < expert_loads.size(); ++e)
    out[static_cast<std::size_t>(owners[e])] += expert_loads[e];
  return out;
}

std::size_t hottest(const std::vector<std::int64_t>& loads) {
  return static_cast<std::size_t>(std::max_element(loads.begin(), loads.end()) - loads.begin());
}

// Held-out prompts of `prompt_tokens` tokens, per domain.
std::vector<std::vector<std::vector<std::int32_t>>> load_prompts(const Options& o,
                                                                 const runtime::Tokenizer& tok) {
  std::vector<std::vector<std::vector<std::int32_t>>> prompts;
  const auto needed = static_cast<std::size_t>(2 * o.batches_per_domain * o.batch_prompts);
  for (const std::string& domain : o.domains) {
    const std::string text = capserve::tools::heldout_text(
        capserve::tools::read_corpus_file(o.corpus_dir + "/" + domain + ".txt"), 0.05);
    std::vector<std::int32_t> ids;
    if (auto s = tok.encode(text, false, ids); !s.ok()) throw std::runtime_error(domain + ": " + s.message());
    auto& mine = prompts.emplace_back();
    for (std::size_t at = 0;
         at + static_cast<std::size_t>(o.prompt_tokens) <= ids.size() && mine.size() < needed;
         at += static_cast<std::size_t>(o.prompt_tokens))
      mine.emplace_back(
          ids.begin() + static_cast<std::ptrdiff_t>(at),
          ids.begin() + static_cast<std::ptrdiff_t>(at + static_cast<std::size_t>(o.prompt_tokens)));
    if (mine.size() < needed)
      throw std::runtime_error(domain + ": " + std::to_string(mine.size()) + " held-out prompts, " +
                               std::to_string(needed) + " needed");
  }
  return prompts;
}

BatchLoads measure(runtime::Engine& engine, const std::vector<std::vector<std::int32_t>>& batch,
                   std::string kind) {
  const runtime::Model& model = engine.model();
  const auto layers = static_cast<std::int64_t>(model.moe_layers().size());
  const std::int64_t experts = model.config().num_experts;
  BatchLoads b{std::move(kind), std::vector<std::int64_t>(static_cast<std::size_t>(layers * experts), 0), {}};
  for (const auto& prompt : batch) engine.router_dry_run(prompt, layers, b.predicted);
  std::vector<runtime::Engine::Work> work;
  for (std::size_t i = 0; i < batch.size(); ++i)
    work.push_back({static_cast<runtime::SequenceId>(i + 1), batch[i]});
  if (auto s = engine.step(work); !s.ok()) throw std::runtime_error("prefill: " + s.message());
  const parallel::MoeStepStats& stats = engine.last_moe_stats();
  for (const auto& layer : stats.layers)
    b.realised.insert(b.realised.end(), layer.routed_load.begin(), layer.routed_load.end());
  for (const auto& w : work) engine.release(w.seq);
  return b;
}

}  // namespace

int main(int argc, char** argv) {
  runtime::log_to_stderr();
  CLI::App app{"How well the router dry run predicts each MoE layer's per-rank load"};
  runtime::add_common_flags(app, "capserve-eval-predictor");
  Options o;
  app.add_option("--model", o.model_dir, "model directory (config, safetensors, tokenizer)")->required();
  app.add_option("--corpus-dir", o.corpus_dir, "the shared corpus")->capture_default_str();
  app.add_option("--ranks", o.ranks, "rank counts the experts are placed over")->capture_default_str();
  app.add_option("--prompt-tokens", o.prompt_tokens, "tokens per prompt")->capture_default_str();
  app.add_option("--batch-prompts", o.batch_prompts, "prompts per batch")->capture_default_str();
  app.add_option("--batches-per-domain", o.batches_per_domain,
                 "one-domain batches per domain (and as many mixed)")
      ->capture_default_str();
  app.add_option("--threads", o.threads, "CPU threads")->capture_default_str();
  app.add_option("--json", o.json_path, "write the figures here");
  CLI11_PARSE(app, argc, argv);

  try {
    capserve::kernels::cpu::CpuBackend backend(o.threads);
    const auto model = runtime::Model::load(o.model_dir, backend);
    const runtime::ModelConfig& c = model->config();
    runtime::EngineOptions engine_options;
    engine_options.kv_blocks = o.batch_prompts * (o.prompt_tokens / engine_options.kv_block_size + 1);
    runtime::Engine engine(*model, engine_options);
    const auto prompts = load_prompts(o, runtime::Tokenizer::load(o.model_dir));

    std::vector<BatchLoads> batches;
    const auto B = static_cast<std::size_t>(o.batch_prompts);
    for (std::size_t d = 0; d < o.domains.size(); ++d) {
      for (std::int64_t k = 0; k < o.batches_per_domain; ++k) {
        const auto first = prompts[d].begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(k) * B);
        batches.push_back(measure(engine, {first, first + static_cast<std::ptrdiff_t>(B)}, o.domains[d]));
      }
    }
    // Mixed batches: prompt j of batch k from domain (k + j) mod D, from the prompts the clustered ones left.
    const std::size_t D = o.domains.size();
    for (std::size_t k = 0; k < D * static_cast<std::size_t>(o.batches_per_domain); ++k) {
      std::vector<std::vector<std::int32_t>> batch;
      for (std::size_t j = 0; j < B; ++j) {
        const std::size_t d = (k + j) % D;
        batch.push_back(prompts[d][static_cast<std::size_t>(o.batches_per_domain) * B + (k * B + j) / D]);
      }
      batches.push_back(measure(engine, batch, "mixed"));
    }

    const std::span<const std::int64_t> moe_layers = model->moe_layers();
    const auto L = moe_layers.size();
    const auto E = static_cast<std::size_t>(c.num_experts);
    nlohmann::json out{{"model", o.model_dir},
                       {"experts", c.num_experts},
                       {"top_k", c.top_k},
                       {"moe_layers", L},
                       {"batches", batches.size()},
                       {"batch_prompts", o.batch_prompts},
                       {"prompt_tokens", o.prompt_tokens},
                       {"per_layer", nlohmann::json::array()},
                       {"aggregate", nlohmann::json::array()}};
    std::printf(
        "%zu batches of %lld prompts x %lld tokens (%zu one-domain, %zu mixed), %zu MoE layers, %lld "
        "experts, top-%lld\n",
        batches.size(), static_cast<long long>(o.batch_prompts), static_cast<long long>(o.prompt_tokens),
        D * static_cast<std::size_t>(o.batches_per_domain),
        D * static_cast<std::size_t>(o.batches_per_domain), L, static_cast<long long>(c.num_experts),
        static_cast<long long>(c.top_k));
    std::printf(
        "\nper layer: predicted vs realised per-rank max/mean (means over batches), Pearson r, MAE, hottest "
        "rank hit\n");
    std::printf(
        "| ranks | layer | predicted | realised | r | MAE | hottest hit |\n|---|---|---|---|---|---|---|\n");
    for (const int R : o.ranks) {
      const auto placement = parallel::ExpertPlacement::contiguous(c.num_layers, c.num_experts, R);
      // realised per-layer imbalance per batch, for the aggregate table
      std::vector<std::vector<double>> real_by_layer(L);
      for (std::size_t l = 0; l < L; ++l) {
        const auto owners = placement.owners(moe_layers[l]);
        std::vector<double> pred, real;
        double hits = 0;
        for (const BatchLoads& b : batches) {
          const auto p = rank_loads(std::span(b.predicted).subspan(l * E, E), owners, R);
          const auto r = rank_loads(std::span(b.realised).subspan(l * E, E), owners, R);
          pred.push_back(parallel::max_over_mean(p));
          real.push_back(parallel::max_over_mean(r));
          hits += hottest(p) == hottest(r) ? 1 : 0;
        }
        real_by_layer[l] = real;
        double mae = 0;
        for (std::size_t i = 0; i < pred.size(); ++i)
          mae += std::abs(pred[i] - real[i]) / static_cast<double>(pred.size());
        const double r = pearson(pred, real);
        const double hit = hits / static_cast<double>(batches.size());
        std::printf("| %d | %zu | %.3f | %.3f | %.2f | %.3f | %.0f%% |\n", R, l, mean(pred), mean(real), r,
                    mae, 100 * hit);
        out["per_layer"].push_back({{"ranks", R},
                                    {"layer", l},
                                    {"predicted_max_over_mean", mean(pred)},
                                    {"realised_max_over_mean", mean(real)},
                                    {"pearson_r", r},
                                    {"mae", mae},
                                    {"hottest_rank_hit", hit}});
      }
      // The selector's view: the dry run of the first `depth` layers summed per rank, against the realised
      // mean over all layers of each layer's max/mean.
      std::vector<double> real_mean(batches.size(), 0.0);
      for (std::size_t i = 0; i < batches.size(); ++i) {
        for (std::size_t l = 0; l < L; ++l) real_mean[i] += real_by_layer[l][i] / static_cast<double>(L);
      }
      for (std::size_t depth = 1; depth <= L; ++depth) {
        std::vector<double> pred;
        for (const BatchLoads& b : batches) {
          std::vector<std::int64_t> sum(static_cast<std::size_t>(R), 0);
          for (std::size_t l = 0; l < depth; ++l) {
            const auto p =
                rank_loads(std::span(b.predicted).subspan(l * E, E), placement.owners(moe_layers[l]), R);
            for (std::size_t q = 0; q < sum.size(); ++q) sum[q] += p[q];
          }
          pred.push_back(parallel::max_over_mean(sum));
        }
        out["aggregate"].push_back(
            {{"ranks", R}, {"dry_run_layers", depth}, {"pearson_r", pearson(pred, real_mean)}});
      }
    }
    std::printf(
        "\nthe selector's prediction (--dry-run-layers L: per-rank loads summed over the first L layers) vs "
        "the "
        "realised mean per-layer max/mean: Pearson r over the batches\n| ranks |");
    for (std::size_t depth = 1; depth <= L; ++depth) std::printf(" L=%zu |", depth);
    std::printf("\n|---|");
    for (std::size_t depth = 1; depth <= L; ++depth) std::printf("---|");
    for (std::size_t i = 0; i < out["aggregate"].size(); ++i) {
      const auto& a = out["aggregate"][i];
      if (a["dry_run_layers"] == 1) std::printf("\n| %d |", a["ranks"].get<int>());
      std::printf(" %.2f |", a["pearson_r"].get<double>());
    }
    std::printf("\n");
    if (!o.json_path.empty()) std::ofstream(o.json_path) << out.dump(1) << "\n";
  } catch (const std::exception& e) {
    std::fprintf(stderr, "capserve-eval-predictor: %s\n", e.what());
    return 1;
  }
  return 0;
}
