#include "runtime/generation_config.h"

#include <cmath>
#include <string>

#include "runtime/json_file.h"
#include "runtime/load_error.h"

namespace capserve::runtime {

GenerationDefaults read_generation_config(const std::filesystem::path& dir, std::int64_t vocab_size) {
  GenerationDefaults d;
  const std::filesystem::path path = dir / "generation_config.json";
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) return d;
  const nlohmann::json json = read_json_file(path);
  const auto fail = [&](const std::string& key, const std::string& what) {
    throw LoadError(path.string() + ": key '" + key + "' " + what);
  };
  if (!json.is_object()) throw LoadError(path.string() + ": must be a JSON object");
  const auto number = [&](const char* key, double low, double high) -> std::optional<float> {
    const auto it = json.find(key);
    if (it == json.end() || it->is_null()) return std::nullopt;
    if (!it->is_number()) fail(key, "must be a number, got " + std::string(it->type_name()));
    const double v = it->get<double>();
    if (!std::isfinite(v) || v < low || v > high)
      fail(key, "must be in [" + std::to_string(low) + ", " + std::to_string(high) + "], got " + it->dump());
    return static_cast<float>(v);
  };
  d.temperature = number("temperature", 0.0, 1e6);
  d.top_p = number("top_p", 0.0, 1.0);
  if (const auto it = json.find("top_k"); it != json.end() && !it->is_null()) {
    if (!it->is_number_integer() || it->get<std::int64_t>() < 0 || it->get<std::int64_t>() > vocab_size)
      fail("top_k", "must be an integer in [0, " + std::to_string(vocab_size) + "], got " + it->dump());
    d.top_k = it->get<std::int32_t>();
  }
  if (const auto it = json.find("eos_token_id"); it != json.end() && !it->is_null()) {
    const auto add = [&](const nlohmann::json& id) {
      if (!id.is_number_integer() || id.get<std::int64_t>() < 0 || id.get<std::int64_t>() >= vocab_size)
        fail("eos_token_id",
             "must be token ids in [0, " + std::to_string(vocab_size) + "), got " + it->dump());
      d.eos_token_ids.push_back(id.get<std::int32_t>());
    };
    if (it->is_array()) {
      for (const nlohmann::json& id : *it) add(id);
    } else {
      add(*it);
    }
  }
  return d;
}

}  // namespace capserve::runtime
