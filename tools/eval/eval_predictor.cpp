// capserve-eval-predictor: how well a load predictor foresees where a batch's expert load lands, per MoE
// layer and rank count, on held-out batches of the shared corpus. The truth is the routed load of each
// batch's real prefill (Engine::last_moe_stats). Two predictors side by side:
// - dry run: what the server's batch selector runs (runtime/router_load_predictor.h, --dry-run-layers): each
//   prompt's embeddings through the router of every MoE layer, without attention;
// - learned: the server's load map (runtime/load_map.h, --load-map), a linear map from the dry run's counts
//   (all layers, per token) to each layer's expert load, fitted by ridge regression on batches of the
//   corpus's training part; --write-map saves it for the server.
// Batches are from one domain each (the domain-clustered traffic batch selection exploits) or mixed; the
// experts are placed contiguously over R ranks as the server places them. Per layer and R: mean predicted and
// realised per-rank max/mean, their correlation over the batches, the mean absolute error and how often the
// predicted hottest rank is the real one; then the selector's view, the predicted mean over layers of the
// per-rank max/mean against the realised one.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <functional>
#include <memory>
#include <numeric>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "kernels/cpu/cpu_backend.h"
#include "parallel/expert_placement.h"
#include "runtime/cli/version.h"
#include "runtime/engine.h"
#include "runtime/load_map.h"
#include "runtime/model.h"
#include "runtime/router_load_predictor.h"
#include "runtime/tokenizer/tokenizer.h"
#include "tools/eval/heldout_corpus.h"

namespace {

namespace parallel = capserve::parallel;
namespace runtime = capserve::runtime;
using Prompt = std::vector<std::int32_t>;

struct Options {
  std::string model_dir;
  std::string corpus_dir = "../shared/data/corpus";
  std::vector<std::string> domains = {"arxiv", "books", "code", "web", "wikipedia"};
  std::vector<int> ranks = {2, 4, 8};
  std::int64_t prompt_tokens = 128;
  std::int64_t batch_prompts = 8;
  std::int64_t batches_per_domain = 6;         // held-out, one-domain; as many mixed
  std::int64_t train_batches_per_domain = 24;  // the learned map's, from the training part
  double ridge = 1e-3;
  int threads = static_cast<int>(std::max(1U, std::thread::hardware_concurrency()));
  std::string json_path;
  std::string map_path;
};

// A batch's expert loads per token, [moe layers, experts]: the dry run's and the real prefill's.
using BatchLoads = runtime::LoadMap::Sample;

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

// Prompts of `prompt_tokens` tokens from each domain's held-out or training part, `count` per domain.
std::vector<std::vector<Prompt>> load_prompts(const Options& o, const runtime::Tokenizer& tok, bool heldout,
                                              std::size_t count) {
  std::vector<std::vector<Prompt>> prompts;
  const auto n = static_cast<std::size_t>(o.prompt_tokens);
  for (const std::string& domain : o.domains) {
    const std::string data = capserve::tools::read_corpus_file(o.corpus_dir + "/" + domain + ".txt");
    // The training part is long: its first prompts are enough (about 4 bytes a token).
    const std::string text = heldout ? capserve::tools::heldout_text(data, 0.05)
                                     : capserve::tools::training_text(data, 0.05).substr(0, count * n * 8);
    std::vector<std::int32_t> ids;
    if (auto s = tok.encode(text, false, ids); !s.ok()) throw std::runtime_error(domain + ": " + s.message());
    auto& mine = prompts.emplace_back();
    for (std::size_t at = 0; at + n <= ids.size() && mine.size() < count; at += n)
      mine.emplace_back(ids.begin() + static_cast<std::ptrdiff_t>(at),
                        ids.begin() + static_cast<std::ptrdiff_t>(at + n));
    if (mine.size() < count)
      throw std::runtime_error(domain + ": " + std::to_string(mine.size()) + " prompts, " +
                               std::to_string(count) + " needed");
  }
  return prompts;
}

BatchLoads measure(runtime::Engine& engine, const std::vector<Prompt>& batch) {
  const runtime::Model& model = engine.model();
  const auto layers = static_cast<std::int64_t>(model.moe_layers().size());
  const auto size = static_cast<std::size_t>(layers * model.config().num_experts);
  std::vector<std::int64_t> counts(size, 0);
  double tokens = 0;
  for (const Prompt& prompt : batch) {
    engine.router_dry_run(prompt, layers, counts);
    tokens += static_cast<double>(prompt.size());
  }
  BatchLoads b;
  for (const std::int64_t c : counts) b.dry_run.push_back(static_cast<double>(c) / tokens);
  std::vector<runtime::Engine::Work> work;
  for (std::size_t i = 0; i < batch.size(); ++i)
    work.push_back({static_cast<runtime::SequenceId>(i + 1), batch[i]});
  if (auto s = engine.step(work); !s.ok()) throw std::runtime_error("prefill: " + s.message());
  for (const auto& layer : engine.last_moe_stats().layers) {
    for (const std::int64_t c : layer.routed_load) b.routed.push_back(static_cast<double>(c) / tokens);
  }
  for (const auto& w : work) engine.release(w.seq);
  return b;
}

// `per_domain` batches from each domain, then as many mixed ones (prompt j of mixed batch k from domain
// (k + j) mod D), from prompts[d] in order.
std::vector<BatchLoads> measure_batches(runtime::Engine& engine,
                                        const std::vector<std::vector<Prompt>>& prompts,
                                        std::size_t per_domain, std::size_t batch_prompts) {
  std::vector<BatchLoads> batches;
  const std::size_t D = prompts.size();
  for (std::size_t d = 0; d < D; ++d) {
    for (std::size_t k = 0; k < per_domain; ++k) {
      const auto first = prompts[d].begin() + static_cast<std::ptrdiff_t>(k * batch_prompts);
      batches.push_back(measure(engine, {first, first + static_cast<std::ptrdiff_t>(batch_prompts)}));
    }
  }
  for (std::size_t k = 0; k < D * per_domain; ++k) {
    std::vector<Prompt> batch;
    for (std::size_t j = 0; j < batch_prompts; ++j)
      batch.push_back(prompts[(k + j) % D][per_domain * batch_prompts + (k * batch_prompts + j) / D]);
    batches.push_back(measure(engine, batch));
  }
  return batches;
}

// One layer's per-expert loads folded onto the ranks that own them.
std::vector<double> rank_loads(std::span<const double> expert_loads, std::span<const std::int32_t> owners,
                               int ranks) {
  std::vector<double> out(static_cast<std::size_t>(ranks), 0.0);
  for (std::size_t e = 0; e < expert_loads.size(); ++e)
    out[static_cast<std::size_t>(owners[e])] += expert_loads[e];
  return out;
}

double max_over_mean(const std::vector<double>& loads) {
  const double m = mean(loads);
  return m > 0 ? *std::max_element(loads.begin(), loads.end()) / m : 1.0;
}

std::size_t hottest(const std::vector<double>& loads) {
  return static_cast<std::size_t>(std::max_element(loads.begin(), loads.end()) - loads.begin());
}

struct LayerScore {
  double predicted = 0, realised = 0, r = 0, mae = 0, hit = 0;
  std::vector<double> per_batch;  // predicted max/mean per batch
};

// A predictor's per-layer per-rank max/mean over the batches, against the realised one (`realised[b]`).
LayerScore score(const std::vector<std::vector<double>>& predicted, const std::vector<BatchLoads>& batches,
                 std::size_t layer, std::size_t experts, std::span<const std::int32_t> owners, int ranks) {
  LayerScore s;
  std::vector<double> real;
  double hits = 0;
  for (std::size_t i = 0; i < batches.size(); ++i) {
    const auto p = rank_loads(std::span(predicted[i]).subspan(layer * experts, experts), owners, ranks);
    const auto r = rank_loads(std::span(batches[i].routed).subspan(layer * experts, experts), owners, ranks);
    s.per_batch.push_back(max_over_mean(p));
    real.push_back(max_over_mean(r));
    hits += hottest(p) == hottest(r) ? 1 : 0;
    s.mae += std::abs(s.per_batch.back() - real.back()) / static_cast<double>(batches.size());
  }
  s.predicted = mean(s.per_batch);
  s.realised = mean(real);
  s.r = pearson(s.per_batch, real);
  s.hit = hits / static_cast<double>(batches.size());
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  runtime::log_to_stderr();
  CLI::App app{
      "How well the router dry run, and a map learned from it, predict each MoE layer's per-rank load"};
  runtime::add_common_flags(app, "capserve-eval-predictor");
  Options o;
  app.add_option("--model", o.model_dir, "model directory (config, safetensors, tokenizer)")->required();
  app.add_option("--corpus-dir", o.corpus_dir, "the shared corpus")->capture_default_str();
  app.add_option("--ranks", o.ranks, "rank counts the experts are placed over")->capture_default_str();
  app.add_option("--prompt-tokens", o.prompt_tokens, "tokens per prompt")->capture_default_str();
  app.add_option("--batch-prompts", o.batch_prompts, "prompts per batch")->capture_default_str();
  app.add_option("--batches-per-domain", o.batches_per_domain,
                 "held-out one-domain batches per domain (and as many mixed)")
      ->capture_default_str();
  app.add_option("--train-batches-per-domain", o.train_batches_per_domain,
                 "training-part batches per domain the learned map is fitted on (and as many mixed)")
      ->capture_default_str();
  app.add_option("--ridge", o.ridge, "the learned map's ridge penalty")->capture_default_str();
  app.add_option("--threads", o.threads, "CPU threads")->capture_default_str();
  app.add_option("--json", o.json_path, "write the figures here");
  app.add_option("--write-map", o.map_path,
                 "write the learned map here (the server's --load-map; capserve_load_map.json in the model "
                 "directory is found on its own)");
  CLI11_PARSE(app, argc, argv);

  try {
    capserve::kernels::cpu::CpuBackend backend(o.threads);
    const auto model = runtime::Model::load(o.model_dir, backend);
    const runtime::ModelConfig& c = model->config();
    runtime::EngineOptions engine_options;
    engine_options.kv_blocks = o.batch_prompts * (o.prompt_tokens / engine_options.kv_block_size + 1);
    runtime::Engine engine(*model, engine_options);
    const runtime::Tokenizer tokenizer = runtime::Tokenizer::load(o.model_dir);
    const auto B = static_cast<std::size_t>(o.batch_prompts);
    const auto train_k = static_cast<std::size_t>(o.train_batches_per_domain);
    const auto test_k = static_cast<std::size_t>(o.batches_per_domain);
    const std::vector<BatchLoads> train =
        measure_batches(engine, load_prompts(o, tokenizer, false, 2 * train_k * B), train_k, B);
    const std::vector<BatchLoads> batches =
        measure_batches(engine, load_prompts(o, tokenizer, true, 2 * test_k * B), test_k, B);
    const runtime::LoadMap learned = runtime::LoadMap::fit(runtime::load_map_shape(*model), train, o.ridge);
    if (!o.map_path.empty()) {
      learned.write(o.map_path, "capserve-eval-predictor: ridge " + std::to_string(o.ridge) + " on " +
                                    std::to_string(train.size()) + " batches of " +
                                    std::to_string(o.batch_prompts) + " prompts x " +
                                    std::to_string(o.prompt_tokens) + " tokens from the training part of " +
                                    o.corpus_dir + " (one-domain and mixed)");
      std::printf("wrote the load map to %s\n", o.map_path.c_str());
    }

    std::vector<std::vector<double>> dry_run, fitted;
    for (const BatchLoads& b : batches) {
      dry_run.push_back(b.dry_run);
      fitted.emplace_back(b.dry_run.size());
      learned.predict(b.dry_run, fitted.back());
    }
    const std::span<const std::int64_t> moe_layers = model->moe_layers();
    const std::size_t L = moe_layers.size();
    const auto E = static_cast<std::size_t>(c.num_experts);
    nlohmann::json out{{"model", o.model_dir},
                       {"experts", c.num_experts},
                       {"top_k", c.top_k},
                       {"moe_layers", L},
                       {"test_batches", batches.size()},
                       {"train_batches", train.size()},
                       {"batch_prompts", B},
                       {"prompt_tokens", o.prompt_tokens},
                       {"per_layer", nlohmann::json::array()},
                       {"selector", nlohmann::json::array()}};
    std::printf(
        "held-out: %zu batches of %zu prompts x %lld tokens (half one-domain, half mixed); the learned map "
        "fitted on %zu training-part batches; %zu MoE layers, %lld experts, top-%lld\n",
        batches.size(), B, static_cast<long long>(o.prompt_tokens), train.size(), L,
        static_cast<long long>(c.num_experts), static_cast<long long>(c.top_k));
    std::printf(
        "\nper layer, per-rank max/mean (means over the batches): realised; dry run and learned: predicted, "
        "Pearson r with the realised over the batches, MAE, hottest rank hit\n");
    std::printf(
        "| ranks | layer | realised | dry run | r | MAE | hit | learned | r | MAE | hit |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|\n");
    for (const int R : o.ranks) {
      const auto placement = parallel::ExpertPlacement::contiguous(c.num_layers, c.num_experts, R);
      std::vector<double> real_mean(batches.size(), 0.0), dry_mean(batches.size(), 0.0),
          fitted_mean(batches.size(), 0.0);
      for (std::size_t l = 0; l < L; ++l) {
        const auto owners = placement.owners(moe_layers[l]);
        const LayerScore d = score(dry_run, batches, l, E, owners, R);
        const LayerScore f = score(fitted, batches, l, E, owners, R);
        std::vector<double> real;
        for (std::size_t i = 0; i < batches.size(); ++i) {
          const double r =
              max_over_mean(rank_loads(std::span(batches[i].routed).subspan(l * E, E), owners, R));
          real_mean[i] += r / static_cast<double>(L);
          dry_mean[i] += d.per_batch[i] / static_cast<double>(L);
          fitted_mean[i] += f.per_batch[i] / static_cast<double>(L);
        }
        std::printf("| %d | %zu | %.3f | %.3f | %.2f | %.3f | %.0f%% | %.3f | %.2f | %.3f | %.0f%% |\n", R, l,
                    d.realised, d.predicted, d.r, d.mae, 100 * d.hit, f.predicted, f.r, f.mae, 100 * f.hit);
        for (const auto& [name, s] : {std::pair{"dry_run", &d}, std::pair{"learned", &f}}) {
          out["per_layer"].push_back({{"ranks", R},
                                      {"layer", l},
                                      {"predictor", name},
                                      {"realised_max_over_mean", s->realised},
                                      {"predicted_max_over_mean", s->predicted},
                                      {"pearson_r", s->r},
                                      {"mae", s->mae},
                                      {"hottest_rank_hit", s->hit}});
        }
      }
      out["selector"].push_back({{"ranks", R},
                                 {"dry_run_pearson_r", pearson(dry_mean, real_mean)},
                                 {"learned_pearson_r", pearson(fitted_mean, real_mean)}});
    }
    std::printf(
        "\nthe selector's view: the mean over layers of the per-rank max/mean, predicted vs realised, "
        "Pearson r "
        "over the batches\n| ranks | dry run | learned |\n|---|---|---|\n");
    for (const auto& s : out["selector"])
      std::printf("| %d | %.2f | %.2f |\n", s["ranks"].get<int>(), s["dry_run_pearson_r"].get<double>(),
                  s["learned_pearson_r"].get<double>());
    if (!o.json_path.empty()) std::ofstream(o.json_path) << out.dump(1) << "\n";
  } catch (const std::exception& e) {
    std::fprintf(stderr, "capserve-eval-predictor: %s\n", e.what());
    return 1;
  }
  return 0;
}
