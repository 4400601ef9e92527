// capserve-bench-grammar: the cost of structured output on the default model, and what it writes. Runs the
// schemas of a corpus in batches (every sequence of a batch under its own schema), greedy decoding with the
// grammar's mask applied to the host logits, and reports per schema the compile time and the output text
// (JSON lines on stdout, for tools/grammar/validate_outputs.py), then on stderr the per-step figures of the
// steps that ran a full batch: the engine's decode step, and the grammar's share (masks filled and tokens
// accepted for every row).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "kernels/cpu/cpu_backend.h"
#include "runtime/cli/version.h"
#include "runtime/engine.h"
#include "runtime/grammar/matcher.h"
#include "runtime/grammar/structured_output.h"
#include "runtime/model.h"
#include "runtime/tokenizer/tokenizer.h"

namespace {

using namespace capserve::runtime;
using Clock = std::chrono::steady_clock;

double ms(Clock::duration d) {
  return std::chrono::duration<double, std::milli>(d).count();
}

struct Sequence {
  std::string name;
  std::unique_ptr<grammar::GrammarMatcher> matcher;
  std::vector<std::int32_t> tokens;
  bool done = false;
};

}  // namespace

int main(int argc, char** argv) {
  log_to_stderr();
  CLI::App app{"Structured output on the default model: outputs and per-step cost"};
  add_common_flags(app, "capserve-bench-grammar");
  std::string model_dir = "deploy/models/capserve-moe-tiny";
  std::string corpus_file = "tests/fixtures/grammar/schemas.json";
  int batch = 16;
  int max_tokens = 256;
  int threads = 2;
  std::string whitespace = "compact";
  app.add_option("--model", model_dir, "model directory");
  app.add_option("--corpus", corpus_file, "schemas: [{name, schema}]");
  app.add_option("--batch", batch, "sequences per batch")->check(CLI::PositiveNumber);
  app.add_option("--max-tokens", max_tokens, "new tokens per sequence at most")->check(CLI::PositiveNumber);
  app.add_option("--threads", threads, "CPU threads")->check(CLI::PositiveNumber);
  app.add_option("--whitespace", whitespace, "JSON whitespace: any, compact, or at most N at each place");
  if (const auto code = parse_flags(app, argc, argv, "capserve-bench-grammar", true)) return *code;

  const Tokenizer tokenizer = Tokenizer::load(model_dir);
  capserve::kernels::cpu::CpuBackend backend(threads);
  const auto model = Model::load(model_dir, backend);
  const auto vocab_rows = static_cast<std::size_t>(model->config().vocab_size);
  const auto vocabulary = std::make_shared<const grammar::TokenVocabulary>(
      grammar::TokenVocabulary::from_tokenizer(tokenizer, model->config().eos_token_ids));
  Engine engine(*model, EngineOptions{});
  const auto corpus = nlohmann::ordered_json::parse(std::ifstream(corpus_file));

  std::vector<std::int32_t> prompt;
  if (!tokenizer.encode("<|user|>\nWrite a JSON value.\n<|assistant|>\n", true, prompt).ok()) return 1;
  std::vector<std::int32_t> words(static_cast<std::size_t>(vocabulary->mask_words()));
  double full_steps = 0, step_ms = 0, grammar_ms = 0, compile_total = 0, compile_max = 0;
  SequenceId next_id = 0;
  for (std::size_t first = 0; first < corpus.size(); first += static_cast<std::size_t>(batch)) {
    std::vector<Sequence> seqs;
    std::vector<Engine::Work> work;
    std::vector<SequenceId> ids;
    for (std::size_t i = first; i < std::min(corpus.size(), first + static_cast<std::size_t>(batch)); ++i) {
      grammar::OutputConstraint constraint;
      constraint.kind = grammar::OutputConstraint::Kind::json_schema;
      constraint.schema = corpus[i]["schema"];
      if (whitespace == "compact") {
        constraint.json.whitespace = grammar::JsonWhitespace::compact;
      } else if (whitespace != "any") {
        constraint.json.whitespace = grammar::JsonWhitespace::at_most;
        constraint.json.max_whitespace = std::stoll(whitespace);
      }
      const auto start = Clock::now();
      auto compiled = grammar::compile(constraint, vocabulary);
      const double compile_ms = ms(Clock::now() - start);
      if (!compiled.ok()) {
        std::cout << nlohmann::json{{"name", corpus[i]["name"].get<std::string>()},
                                    {"error", compiled.status().message()}}
                  << '\n';
        continue;
      }
      compile_total += compile_ms;
      compile_max = std::max(compile_max, compile_ms);
      Sequence seq;
      seq.name = corpus[i]["name"].get<std::string>();
      seq.matcher = std::make_unique<grammar::GrammarMatcher>(*compiled);
      seqs.push_back(std::move(seq));
      std::cout << nlohmann::json{{"name", seqs.back().name}, {"compile_ms", compile_ms}} << '\n';
      ids.push_back(next_id++);
      work.push_back({ids.back(), prompt});
    }
    std::vector<std::int32_t> last(seqs.size());
    std::vector<std::size_t> rows;  // work item -> sequence
    for (std::size_t s = 0; s < seqs.size(); ++s) rows.push_back(s);
    while (!work.empty()) {
      const bool full = static_cast<int>(work.size()) == batch && work[0].decode;
      const auto step_start = Clock::now();
      if (const Status status = engine.step(work); !status.ok()) {
        std::fprintf(stderr, "step: %s\n", status.message().c_str());
        return 1;
      }
      const std::span<const float> logits = engine.logits();
      const double step_time = ms(Clock::now() - step_start);
      double grammar_time = 0;
      std::vector<Engine::Work> next;
      std::vector<std::size_t> next_rows;
      for (std::size_t w = 0; w < work.size(); ++w) {
        Sequence& seq = seqs[rows[w]];
        const auto t0 = Clock::now();
        if (!seq.matcher->fill_next_token_bitmask(words).ok()) return 1;
        grammar_time += ms(Clock::now() - t0);
        // Greedy over the allowed tokens.
        const float* row = logits.data() + w * vocab_rows;
        std::int32_t best = -1;
        for (std::size_t id = 0; id < std::min(vocab_rows, static_cast<std::size_t>(vocabulary->size()));
             ++id) {
          const bool allowed = (static_cast<std::uint32_t>(words[id / 32]) >> (id % 32)) & 1U;
          if (allowed && (best < 0 || row[id] > row[static_cast<std::size_t>(best)]))
            best = static_cast<std::int32_t>(id);
        }
        const auto t1 = Clock::now();
        const bool accepted = best >= 0 && seq.matcher->accept_token(best);
        grammar_time += ms(Clock::now() - t1);
        if (!accepted) {
          std::fprintf(stderr, "%s: no token allowed or accepted\n", seq.name.c_str());
          return 1;
        }
        seq.tokens.push_back(best);
        if (seq.matcher->is_terminated() || static_cast<int>(seq.tokens.size()) >= max_tokens) {
          engine.release(ids[rows[w]]);
          continue;
        }
        last[rows[w]] = best;
        next.push_back({ids[rows[w]], std::span(&last[rows[w]], 1), false, true});
        next_rows.push_back(rows[w]);
      }
      if (full) {
        ++full_steps;
        step_ms += step_time;
        grammar_ms += grammar_time;
      }
      work = std::move(next);
      rows = std::move(next_rows);
    }
    for (const auto& seq : seqs) {
      std::cout << nlohmann::json{{"name", seq.name},
                                  {"text", tokenizer.decode(seq.tokens, true)},
                                  {"tokens", seq.tokens.size()},
                                  {"terminated", seq.matcher->is_terminated()}}
                << '\n';
    }
  }
  std::fprintf(
      stderr,
      "compile: mean %.2f ms, max %.2f ms over %zu schemas\n"
      "decode steps at batch %d: %.0f, engine step %.3f ms, grammar (masks + accepts, all rows) %.3f ms "
      "= %.1f%% of the step\n",
      compile_total / static_cast<double>(corpus.size()), compile_max, corpus.size(), batch, full_steps,
      step_ms / full_steps, grammar_ms / full_steps, 100.0 * grammar_ms / step_ms);
  return 0;
}
