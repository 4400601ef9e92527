#include "tools/loadgen/trace_lengths.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

namespace capserve::loadgen {
namespace {

nlohmann::json cuts_json(const Cuts& c) {
  return {
      {"requests", c.requests}, {"capped", c.capped}, {"tokens_cut", c.tokens_cut}, {"max_cut", c.max_cut}};
}

std::string cuts_text(const Cuts& c, const char* what) {
  std::string s = std::to_string(c.capped) + " of " + std::to_string(c.requests) + " " + what;
  if (c.capped > 0)
    s += " (" + std::to_string(c.tokens_cut) + " tokens cut in all, at most " + std::to_string(c.max_cut) +
         " from one)";
  return s;
}

}  // namespace

std::int64_t scaled_block_tokens(std::int64_t block_tokens, double factor) {
  return std::max<std::int64_t>(1, std::llround(static_cast<double>(block_tokens) * factor));
}

void scale_lengths(std::vector<TraceRecord>& rows, double factor, std::int64_t scaled_block) {
  if (!(factor > 0)) throw std::invalid_argument("length scale must be > 0");
  for (TraceRecord& r : rows) {
    r.context_tokens = std::llround(static_cast<double>(r.context_tokens) * factor);
    r.generated_tokens = std::llround(static_cast<double>(r.generated_tokens) * factor);
    if (!r.hash_ids.empty())
      r.context_tokens =
          std::min(r.context_tokens, static_cast<std::int64_t>(r.hash_ids.size()) * scaled_block);
  }
}

void Cuts::add(std::int64_t asked, std::int64_t granted) {
  ++requests;
  if (granted >= asked) return;
  ++capped;
  tokens_cut += asked - granted;
  max_cut = std::max(max_cut, asked - granted);
}

Lengths LengthCaps::fit(std::int64_t prompt, std::int64_t output) {
  Lengths l;
  std::int64_t output_limit = limits_.max_output_tokens;
  std::int64_t prompt_limit = limits_.max_prompt_tokens;
  if (limits_.context > 0) output_limit = std::min(output_limit, limits_.context - 1);
  l.output = std::clamp<std::int64_t>(output, 1, std::max<std::int64_t>(output_limit, 1));
  if (limits_.context > 0) prompt_limit = std::min(prompt_limit, limits_.context - l.output);
  l.prompt = std::clamp<std::int64_t>(prompt, 1, std::max<std::int64_t>(prompt_limit, 1));
  prompts_.add(prompt, l.prompt);
  outputs_.add(output, l.output);
  return l;
}

std::string LengthCaps::summary() const {
  std::string s = "capped " + cuts_text(prompts_, "prompts") + " to --max-prompt-tokens " +
                  std::to_string(limits_.max_prompt_tokens);
  if (limits_.context > 0)
    s += " and the " + std::to_string(limits_.context) + "-token context less the output";
  s +=
      ", " + cuts_text(outputs_, "outputs") + " to --max-tokens " + std::to_string(limits_.max_output_tokens);
  return s;
}

nlohmann::json LengthCaps::to_json() const {
  return {{"max_prompt_tokens", limits_.max_prompt_tokens},
          {"max_output_tokens", limits_.max_output_tokens},
          {"context", limits_.context},
          {"prompts", cuts_json(prompts_)},
          {"outputs", cuts_json(outputs_)}};
}

}  // namespace capserve::loadgen
