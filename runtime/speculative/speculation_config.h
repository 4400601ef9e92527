#pragma once
// Which drafter a program runs (the --speculative flags of capserve and capserve-generate,
// runtime/cli/speculation_flags.h), and the drafter it makes.
#include <cstdint>
#include <memory>
#include <string>

#include "runtime/engine.h"
#include "runtime/speculative/drafter.h"

namespace capserve::runtime {

struct SpeculationConfig {
  enum class Method : std::int32_t { none, ngram, mtp };
  Method method = Method::none;
  std::int64_t num_tokens = 3;  // k: drafts per sequence and step
  std::int64_t ngram_min = 1;
  std::int64_t ngram_max = 4;
};

// Empty when the combination is usable, else why not, naming the flags (checked before anything loads).
std::string why_speculation_invalid(const SpeculationConfig& config);

// nullptr for Method::none; std::invalid_argument with why_speculation_invalid's message, or for MTP when
// `engine`'s model was loaded without its MTP layers (load it with ParallelOptions::mtp =
// loads_mtp_layers(config)). The engine must outlive the drafter.
std::unique_ptr<Drafter> make_drafter(const SpeculationConfig& config, Engine& engine);
// Whether the model must be loaded with its multi-token-prediction layers.
[[nodiscard]] inline bool loads_mtp_layers(const SpeculationConfig& config) {
  return config.method == SpeculationConfig::Method::mtp;
}

}  // namespace capserve::runtime
