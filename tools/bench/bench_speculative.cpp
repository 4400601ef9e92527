// capserve-bench-speculative: decode tokens/s with and without speculative decoding, side by side in one run
// (plain and speculative generations alternate, so machine noise hits both), at each batch size and capacity
// factor asked; with the drafts' acceptance per position, whether greedy output stayed identical, and (at a
// finite capacity factor) what expert drops did to acceptance. Real prompts from a JSONL file
// (../shared/data/prompts), tokenized with the model's tokenizer. Writes a JSON and a Markdown table.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "kernels/cpu/cpu_backend.h"
#include "parallel/capacity_config.h"
#include "parallel/self_communicator.h"
#include "runtime/cli/flag_checks.h"
#include "runtime/cli/speculation_flags.h"
#include "runtime/cli/version.h"
#include "runtime/engine.h"
#include "runtime/generator.h"
#include "runtime/model.h"
#include "runtime/tokenizer/tokenizer.h"

namespace {

using namespace capserve;
using Clock = std::chrono::steady_clock;
using Tokens = std::vector<std::int32_t>;

struct Run {
  double seconds = 0.0;
  std::int64_t tokens = 0;
  std::vector<runtime::Generation> out;
  runtime::SpeculationStats stats;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

Run generate_timed(runtime::Engine& engine, const std::vector<Tokens>& prompts,
                   const runtime::SamplingParams& p, runtime::Drafter* drafter) {
  Run r;
  const std::vector<runtime::SamplingParams> params(prompts.size(), p);
  const auto t0 = Clock::now();
  if (const runtime::Status s = runtime::generate(engine, prompts, params, false, r.out, drafter, &r.stats);
      !s.ok())
    throw std::runtime_error(s.message());
  r.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  for (const auto& g : r.out) r.tokens += static_cast<std::int64_t>(g.tokens.size());
  return r;
}

std::vector<Tokens> load_prompts(const std::string& file, const std::string& field,
                                 const runtime::Tokenizer& tok, std::size_t count) {
  std::ifstream in(file);
  if (!in) throw std::runtime_error("cannot read " + file);
  std::vector<Tokens> prompts;
  std::string line;
  while (prompts.size() < count && std::getline(in, line)) {
    const nlohmann::json j = nlohmann::json::parse(line);
    Tokens ids;
    if (const runtime::Status s = tok.encode(j.at(field).get<std::string>(), true, ids); !s.ok())
      throw std::runtime_error(s.message());
    prompts.push_back(std::move(ids));
  }
  if (prompts.size() < count)
    throw std::runtime_error(file + " has fewer than " + std::to_string(count) + " lines");
  return prompts;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"capserve-bench-speculative: decode tokens/s with and without speculative decoding"};
  runtime::log_to_stderr();
  runtime::add_common_flags(app, "capserve-bench-speculative");
  std::string model_dir = std::string(CAPSERVE_SOURCE_DIR) + "/deploy/models/capserve-moe-tiny";
  std::string prompts_file = std::string(CAPSERVE_SOURCE_DIR) + "/../shared/data/prompts/humaneval.jsonl";
  std::string field = "prompt";
  std::vector<std::int64_t> batches{1, 16};
  std::vector<std::string> gammas{"inf", "1.5"};
  std::int64_t new_tokens = 96;
  int reps = 3;
  int threads = 1;
  std::string out_prefix;
  runtime::SpeculationConfig speculation;
  speculation.method = runtime::SpeculationConfig::Method::ngram;
  app.add_option("--model", model_dir, "checkpoint directory")->capture_default_str();
  app.add_option("--prompts", prompts_file, "JSONL file of prompts")->capture_default_str();
  app.add_option("--field", field, "the JSON field holding each prompt's text")->capture_default_str();
  app.add_option("--batch", batches, "batch sizes (prompts decoded together)")->capture_default_str();
  app.add_option("--capacity-factor", gammas, "capacity factors gamma (inf = no drops)")
      ->capture_default_str();
  app.add_option("--max-new-tokens", new_tokens, "greedy tokens per prompt (no stop token)")
      ->capture_default_str();
  app.add_option("--reps", reps, "alternating plain/speculative repetitions")->capture_default_str();
  app.add_option("--threads", threads, "CPU threads")->capture_default_str();
  app.add_option("--out", out_prefix, "write OUT.json and OUT.md");
  runtime::add_speculation_flags(app, speculation);
  if (const std::optional<int> exit_code =
          runtime::parse_flags(app, argc, argv, "capserve-bench-speculative", true))
    return *exit_code;

  try {
    if (speculation.method == runtime::SpeculationConfig::Method::none)
      throw std::invalid_argument("--speculative none: nothing to compare");
    const runtime::Tokenizer tokenizer = runtime::Tokenizer::load(model_dir);
    const std::vector<Tokens> all =
        load_prompts(prompts_file, field, tokenizer,
                     static_cast<std::size_t>(*std::max_element(batches.begin(), batches.end())));
    runtime::SamplingParams greedy;
    greedy.max_new_tokens = new_tokens;
    runtime::SamplingParams prefill_only = greedy;
    prefill_only.max_new_tokens = 1;
    nlohmann::json results = nlohmann::json::array();
    std::string table =
        "| gamma | batch | plain decode tok/s | speculative decode tok/s | ratio, median (min..max) | "
        "kept/verified per "
        "position | "
        "kept rate | greedy output identical |\n|---|---|---|---|---|---|---|---|\n";
    for (const std::string& gamma : gammas) {
      kernels::cpu::CpuBackend backend(threads);
      runtime::ParallelOptions options;
      options.capacity.gamma = *parallel::parse_gamma(gamma);
      options.mtp = runtime::loads_mtp_layers(speculation);
      parallel::SelfCommunicator comm;
      const auto model = runtime::Model::load(model_dir, backend, comm, options);
      runtime::Engine engine(*model, {});
      const auto drafter = runtime::make_drafter(speculation, engine);
      for (const std::int64_t batch : batches) {
        const std::vector<Tokens> prompts(all.begin(), all.begin() + batch);
        std::vector<double> plain_rates, spec_rates, ratios;
        runtime::SpeculationStats stats;
        bool identical = true;
        for (int r = 0; r < reps; ++r) {
          // Decode time: a run's time minus a prefill-only run's; the order alternates so drift hits both.
          const Run prefill = generate_timed(engine, prompts, prefill_only, nullptr);
          const bool plain_first = r % 2 == 0;
          const Run first = generate_timed(engine, prompts, greedy, plain_first ? nullptr : drafter.get());
          const Run second = generate_timed(engine, prompts, greedy, plain_first ? drafter.get() : nullptr);
          const Run& plain = plain_first ? first : second;
          const Run& spec = plain_first ? second : first;
          // The prefill's token is not a decode token.
          plain_rates.push_back(static_cast<double>(plain.tokens - batch) /
                                (plain.seconds - prefill.seconds));
          spec_rates.push_back(static_cast<double>(spec.tokens - batch) / (spec.seconds - prefill.seconds));
          ratios.push_back(spec_rates.back() / plain_rates.back());
          for (std::size_t i = 0; i < plain.out.size(); ++i)
            identical = identical && plain.out[i].tokens == spec.out[i].tokens;
          stats.add(spec.stats);
        }
        const double plain_rate = median(plain_rates);
        const double spec_rate = median(spec_rates);
        const double ratio = median(ratios);
        const auto [low, high] = std::minmax_element(ratios.begin(), ratios.end());
        std::string positions;
        for (std::size_t j = 0; j < stats.proposed.size(); ++j) {
          if (j > 0) positions += ' ';
          positions += std::to_string(stats.accepted[j]);
          positions += '/';
          positions += std::to_string(stats.proposed[j]);
        }
        const double kept_rate = stats.total_proposed() > 0 ? static_cast<double>(stats.total_accepted()) /
                                                                  static_cast<double>(stats.total_proposed())
                                                            : 0.0;
        results.push_back({{"gamma", gamma},
                           {"batch", batch},
                           {"plain_decode_tokens_per_s", plain_rate},
                           {"speculative_decode_tokens_per_s", spec_rate},
                           {"ratio_median", ratio},
                           {"ratio_min", *low},
                           {"ratio_max", *high},
                           {"verified_per_position", stats.proposed},
                           {"kept_per_position", stats.accepted},
                           {"kept_rate", kept_rate},
                           {"greedy_identical", identical}});
        char row[512];
        std::snprintf(row, sizeof row, "| %s | %lld | %.1f | %.1f | %.2f (%.2f..%.2f) | %s | %.3f | %s |\n",
                      gamma.c_str(), static_cast<long long>(batch), plain_rate, spec_rate, ratio, *low, *high,
                      positions.c_str(), kept_rate, identical ? "yes" : "no");
        table += row;
        std::fputs(row, stdout);
        std::fflush(stdout);
      }
    }
    if (!out_prefix.empty()) {
      const bool ngram = speculation.method == runtime::SpeculationConfig::Method::ngram;
      const std::string drafter_name = ngram ? "n-gram" : "MTP";
      nlohmann::json doc{{"model", model_dir},
                         {"prompts", prompts_file},
                         {"max_new_tokens", new_tokens},
                         {"reps", reps},
                         {"threads", threads},
                         {"drafter", drafter_name},
                         {"num_speculative_tokens", speculation.num_tokens},
                         {"results", results}};
      if (ngram) doc["ngram"] = {speculation.ngram_min, speculation.ngram_max};
      std::ofstream(out_prefix + ".json") << doc.dump(1) << "\n";
      std::ofstream(out_prefix + ".md")
          << "# capserve-bench-speculative\n\n"
          << "Decode tokens/s of greedy generation without and with speculative decoding (" << drafter_name
          << " drafter, k = " << speculation.num_tokens
          << (ngram ? ", n-grams " + std::to_string(speculation.ngram_min) + ".." +
                          std::to_string(speculation.ngram_max)
                    : std::string())
          << "), side by side (plain and speculative runs alternate, " << reps
          << " repetitions), on the CPU backend (" << threads << " thread" << (threads == 1 ? "" : "s")
          << "), " << new_tokens << " new tokens per prompt, "
          << "prompts from " << std::filesystem::path(prompts_file).filename().string() << ", model "
          << std::filesystem::path(model_dir).filename().string()
          << ". Decode time is a run's time minus a prefill-only run's; rates and ratios are medians over "
             "the repetitions, the ratio's range beside it. \"kept/verified per position\" "
             "counts "
          << "the drafts at each draft position; \"greedy output identical\" compares the tokens with and "
          << "without speculation (at a finite capacity factor the verifying steps carry more tokens, so the "
          << "capacity and the drops differ and so may the tokens).\n\n"
          << table;
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "capserve-bench-speculative: %s\n", e.what());
    return 1;
  }
  return 0;
}
