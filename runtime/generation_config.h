#pragma once
// The generation defaults a checkpoint ships in generation_config.json: the sampling settings its authors
// recommend (used, as vLLM does, where a request leaves a field unset) and every id generation stops at.
#include <cstdint>
#include <filesystem>
#include <optional>
#include <vector>

namespace capserve::runtime {

struct GenerationDefaults {
  std::optional<float> temperature;
  std::optional<float> top_p;
  std::optional<std::int32_t> top_k;
  std::vector<std::int32_t> eos_token_ids;  // in the file's order
};

// The defaults in `dir`/generation_config.json; all unset when the file is absent. Throws LoadError naming
// the file and the key when it is malformed (not JSON, a wrong type, a value out of range).
GenerationDefaults read_generation_config(const std::filesystem::path& dir, std::int64_t vocab_size);

}  // namespace capserve::runtime
