#include "runtime/speculative/speculation_config.h"

#include <stdexcept>
#include <string>

#include "runtime/speculative/mtp_drafter.h"
#include "runtime/speculative/ngram_drafter.h"

namespace capserve::runtime {

std::string why_speculation_invalid(const SpeculationConfig& config) {
  if (config.method == SpeculationConfig::Method::ngram && config.ngram_min > config.ngram_max) {
    return "--ngram-min (" + std::to_string(config.ngram_min) + ") must not exceed --ngram-max (" +
           std::to_string(config.ngram_max) + ")";
  }
  return {};
}

std::unique_ptr<Drafter> make_drafter(const SpeculationConfig& config, Engine& engine) {
  if (std::string why = why_speculation_invalid(config); !why.empty()) throw std::invalid_argument(why);
  switch (config.method) {
    case SpeculationConfig::Method::none:
      return nullptr;
    case SpeculationConfig::Method::ngram:
      return std::make_unique<NgramDrafter>(config.num_tokens, config.ngram_min, config.ngram_max);
    case SpeculationConfig::Method::mtp:
      return std::make_unique<MtpDrafter>(engine, config.num_tokens);
  }
  throw std::invalid_argument("unknown speculation method");
}

}  // namespace capserve::runtime
