// capserve-grammar-tool: compiles output constraints against a model's tokenizer and walks token sequences
// through them, printing the masks and their cost; tools/grammar/compare_xgrammar.py drives it against
// xgrammar, tools/grammar/bench_grammar.py for the cost figures.
// Each line of stdin is one JSON record:
//   {"constraint": {"json_schema": {...}} | {"json_object": true} | {"regex": "..."} | {"choice": [...]},
//    "tokens": [ids...]}
// where a JSON constraint may add "whitespace": "compact" or a number (at most that many at each place).
// and its output line is {"compile_ms", "accepted": [bool per token, the walk stops at the first refusal],
// "masks": [the mask before each token and after the last, hex words], "mask_us": [the time of each]}, or
// {"error": message} for a constraint that is refused.
#include <chrono>
#include <cstdio>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "runtime/cli/version.h"
#include "runtime/grammar/matcher.h"
#include "runtime/grammar/structured_output.h"
#include "runtime/tokenizer/tokenizer.h"

namespace {

using namespace capserve::runtime::grammar;
using Clock = std::chrono::steady_clock;

std::string hex_words(const std::vector<std::int32_t>& words) {
  std::string out;
  out.reserve(words.size() * 8);
  char buffer[9];
  for (const std::int32_t w : words) {
    std::snprintf(buffer, sizeof buffer, "%08x", static_cast<std::uint32_t>(w));
    out += buffer;
  }
  return out;
}

double micros(Clock::duration d) {
  return std::chrono::duration<double, std::micro>(d).count();
}

nlohmann::json run(const nlohmann::ordered_json& record,
                   const std::shared_ptr<const TokenVocabulary>& vocabulary) {
  auto constraint = parse_constraint(record.value("constraint", nlohmann::ordered_json::object()));
  if (!constraint.ok()) return {{"error", constraint.status().message()}};
  const auto start = Clock::now();
  auto compiled = compile(*constraint, vocabulary);
  const double compile_ms = micros(Clock::now() - start) / 1000;
  if (!compiled.ok()) return {{"error", compiled.status().message()}};
  GrammarMatcher matcher(*compiled);
  std::vector<std::int32_t> words(static_cast<std::size_t>(vocabulary->mask_words()));
  nlohmann::json masks = nlohmann::json::array();
  nlohmann::json mask_us = nlohmann::json::array();
  nlohmann::json accepted = nlohmann::json::array();
  const auto fill = [&] {
    const auto t0 = Clock::now();
    if (!matcher.fill_next_token_bitmask(words).ok()) return false;
    mask_us.push_back(micros(Clock::now() - t0));
    masks.push_back(hex_words(words));
    return true;
  };
  fill();
  for (const auto& id : record.value("tokens", nlohmann::ordered_json::array())) {
    const bool ok = matcher.accept_token(id.get<std::int32_t>());
    accepted.push_back(ok);
    if (!ok) break;
    fill();
  }
  return {{"compile_ms", compile_ms},
          {"accepted", accepted},
          {"masks", masks},
          {"mask_us", mask_us},
          {"terminated", matcher.is_terminated()},
          {"can_terminate", matcher.can_terminate()}};
}

}  // namespace

int main(int argc, char** argv) {
  capserve::runtime::log_to_stderr();
  CLI::App app{
      "Compile output constraints and print token masks along token sequences (JSON lines on stdin)"};
  capserve::runtime::add_common_flags(app, "capserve-grammar-tool");
  std::string model;
  app.add_option("--model", model, "model (tokenizer) directory")->required();
  if (const auto code = capserve::runtime::parse_flags(app, argc, argv, "capserve-grammar-tool", true))
    return *code;

  const auto tokenizer = capserve::runtime::Tokenizer::load(model);
  std::vector<std::int32_t> stops;
  if (tokenizer.eos_id()) stops.push_back(*tokenizer.eos_id());
  const auto vocabulary =
      std::make_shared<const TokenVocabulary>(TokenVocabulary::from_tokenizer(tokenizer, stops));
  std::string line;
  while (std::getline(std::cin, line)) {
    if (line.empty()) continue;
    const auto record = nlohmann::ordered_json::parse(line, nullptr, false);
    const nlohmann::json out =
        record.is_discarded() ? nlohmann::json{{"error", "not JSON"}} : run(record, vocabulary);
    std::cout << out.dump() << '\n' << std::flush;
  }
  return 0;
}
