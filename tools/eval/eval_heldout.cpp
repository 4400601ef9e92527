// capserve-eval-heldout: per-domain held-out perplexity and expert routing of a model on the shared corpus,
// computed by the C++ runtime (its tokenizer, forward pass and per-step expert-load statistics), following
// the protocol of tools/measure_default_model.py; with --reference it prints the relative difference to the
// HF transformers figures.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <numeric>
#include <sstream>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "kernels/cpu/cpu_backend.h"
#include "runtime/engine.h"
#include "runtime/load_error.h"
#include "runtime/model.h"
#include "runtime/model_config.h"
#include "runtime/tokenizer/tokenizer.h"

namespace {

using capserve::runtime::Engine;

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw capserve::runtime::LoadError("cannot open " + path);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// The held-out part: from the line after the first '\n' at or after floor(size * (1 - fraction)).
std::string heldout_text(const std::string& data, double fraction) {
  const auto cut = static_cast<std::size_t>(std::floor(static_cast<double>(data.size()) * (1.0 - fraction)));
  const std::size_t nl = data.find('\n', cut);
  return nl == std::string::npos ? std::string() : data.substr(nl + 1);
}

struct DomainResult {
  std::int64_t windows = 0;
  double total_nll = 0.0;
  std::vector<std::int64_t> load;  // [layers, experts], text positions only
  [[nodiscard]] double perplexity() const { return std::exp(total_nll / static_cast<double>(windows * 255)); }
};

// The last step's routed tokens per expert, [layers, experts] (zero rows for dense layers).
std::vector<std::int64_t> routed_load(const capserve::runtime::Model& model) {
  const capserve::runtime::ModelConfig& c = model.config();
  std::vector<std::int64_t> load(static_cast<std::size_t>(c.num_layers * c.num_experts), 0);
  for (const auto& layer : model.last_moe_stats().layers)
    std::copy(layer.routed_load.begin(), layer.routed_load.end(), load.begin() + layer.layer * c.num_experts);
  return load;
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

}  // namespace

int main(int argc, char** argv) {
  using namespace capserve;
  CLI::App app{"Held-out perplexity and routing of a model on the shared corpus, by the C++ runtime"};
  std::string model_dir;
  std::string corpus_dir = "../shared/data/corpus";
  std::vector<std::string> domains = {"arxiv", "books", "code", "web", "wikipedia"};
  std::string reference;
  int window = 255;
  int batch_windows = 8;
  int threads = 2;
  double fraction = 0.05;
  app.add_option("--model", model_dir, "model directory (config, safetensors, tokenizer)")
      ->required()
      ->check(CLI::ExistingDirectory);
  app.add_option("--corpus", corpus_dir, "directory of <domain>.txt files")->check(CLI::ExistingDirectory);
  app.add_option("--domains", domains, "domains to evaluate");
  app.add_option("--reference", reference,
                 "HF figures (tools/results/default_model_eval.json) to compare with");
  app.add_option("--heldout-fraction", fraction, "held-out tail of each file");
  app.add_option("--window", window, "text tokens per window (after one <|endoftext|>)")
      ->check(CLI::PositiveNumber);
  app.add_option("--batch-windows", batch_windows, "windows per ragged step")->check(CLI::PositiveNumber);
  app.add_option("--threads", threads)->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);

  try {
    const auto model = runtime::Model::load(model_dir);
    const runtime::Tokenizer tokenizer = runtime::Tokenizer::load(model_dir);
    const runtime::ModelConfig& c = model->config();
    kernels::cpu::CpuBackend backend(threads);
    runtime::EngineOptions options;
    options.kv_blocks = batch_windows * ((window + 1) / options.kv_block_size + 1);
    Engine engine(*model, backend, options);
    const auto vocab = static_cast<std::size_t>(c.vocab_size);
    const auto cells = static_cast<std::size_t>(c.num_layers * c.num_experts);
    const std::int32_t bos = 0;

    // Position 0 (<|endoftext|> with no context) routes identically in every window; its load is subtracted.
    const std::vector<std::int32_t> lone{bos};
    const Engine::Work lone_work{0, lone, false};
    if (auto s = engine.step(std::span(&lone_work, 1)); !s.ok()) throw std::runtime_error(s.message());
    const std::vector<std::int64_t> bos_load = routed_load(*model);
    engine.release(0);

    std::vector<std::pair<std::string, DomainResult>> results;
    for (const std::string& domain : domains) {
      const std::string text = heldout_text(read_file(corpus_dir + "/" + domain + ".txt"), fraction);
      std::vector<std::int32_t> ids;
      if (auto s = tokenizer.encode(text, false, ids); !s.ok())
        throw std::runtime_error(domain + ": " + s.message());
      DomainResult r;
      r.windows = static_cast<std::int64_t>(ids.size()) / window;
      r.load.assign(cells, 0);
      std::vector<std::vector<std::int32_t>> inputs;
      for (std::int64_t first = 0; first < r.windows; first += batch_windows) {
        const std::int64_t count = std::min<std::int64_t>(batch_windows, r.windows - first);
        inputs.assign(static_cast<std::size_t>(count), {});
        std::vector<Engine::Work> work;
        for (std::int64_t w = 0; w < count; ++w) {
          auto& in = inputs[static_cast<std::size_t>(w)];
          in.push_back(bos);
          const auto begin = ids.begin() + (first + w) * window;
          in.insert(in.end(), begin, begin + window);
          work.push_back({static_cast<runtime::SequenceId>(w + 1), in, true});
        }
        if (auto s = engine.step(work); !s.ok()) throw std::runtime_error(s.message());
        const auto logits = engine.logits();
        for (std::int64_t w = 0; w < count; ++w) {
          const auto& in = inputs[static_cast<std::size_t>(w)];
          for (int i = 0; i < window; ++i) {
            const auto row = logits.subspan(
                (static_cast<std::size_t>(w) * (window + 1) + static_cast<std::size_t>(i)) * vocab, vocab);
            const float mx = *std::max_element(row.begin(), row.end());
            double sum = 0.0;
            for (const float v : row) sum += std::exp(static_cast<double>(v - mx));
            r.total_nll +=
                std::log(sum) -
                static_cast<double>(row[static_cast<std::size_t>(in[static_cast<std::size_t>(i) + 1])] - mx);
          }
          engine.release(static_cast<runtime::SequenceId>(w + 1));
        }
        const std::vector<std::int64_t> load = routed_load(*model);
        for (std::size_t i = 0; i < cells; ++i) r.load[i] += load[i] - count * bos_load[i];
      }
      results.emplace_back(domain, std::move(r));
    }

    nlohmann::json ref;
    if (!reference.empty()) ref = runtime::read_json_file(reference);
    std::printf("%-10s %8s %12s %12s %12s\n", "domain", "windows", "perplexity", "HF ppl", "rel diff");
    for (const auto& [domain, r] : results) {
      double hf = NAN;
      if (!ref.is_null()) hf = ref["domains"][domain]["perplexity"].get<double>();
      std::printf("%-10s %8lld %12.4f %12.4f %12.2e\n", domain.c_str(), static_cast<long long>(r.windows),
                  r.perplexity(), hf, std::fabs(r.perplexity() - hf) / hf);
    }
    std::printf("\nrouting (text positions): max/mean tokens per expert, per layer\n%-10s", "domain");
    for (std::int64_t l = 0; l < c.num_layers; ++l) std::printf("  layer %-3lld", static_cast<long long>(l));
    std::printf("\n");
    for (const auto& [domain, r] : results) {
      std::printf("%-10s", domain.c_str());
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
    std::printf("\nlowest cosine between two domains' expert-load vectors, per layer\n");
    for (std::int64_t l = 0; l < c.num_layers; ++l) {
      double lowest = 2.0;
      std::string pair;
      for (std::size_t a = 0; a < results.size(); ++a) {
        for (std::size_t b = a + 1; b < results.size(); ++b) {
          const auto off = static_cast<std::size_t>(l * c.num_experts);
          const auto n = static_cast<std::size_t>(c.num_experts);
          const double cs = cosine(std::span(results[a].second.load).subspan(off, n),
                                   std::span(results[b].second.load).subspan(off, n));
          if (cs < lowest) {
            lowest = cs;
            pair = results[a].first + "/" + results[b].first;
          }
        }
      }
      std::printf("layer %lld: %.4f (%s)\n", static_cast<long long>(l), lowest, pair.c_str());
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "capserve-eval-heldout: %s\n", e.what());
    return 1;
  }
  return 0;
}
