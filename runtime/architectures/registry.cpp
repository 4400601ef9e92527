#include <array>

#include "runtime/architectures/architecture.h"
#include "runtime/load_error.h"

namespace capserve::runtime {

const Architecture& find_architecture(const nlohmann::json& config) {
  const std::array<const Architecture*, 6> known = {&mixtral_architecture(),     &olmoe_architecture(),
                                                    &qwen2_moe_architecture(),   &qwen3_moe_architecture(),
                                                    &deepseek_v2_architecture(), &deepseek_v3_architecture()};
  std::string supported;
  for (const Architecture* a : known) supported += (supported.empty() ? "" : ", ") + std::string(a->hf_class);

  const auto it = config.find("architectures");
  if (it == config.end() || !it->is_array() || it->empty() || !it->front().is_string()) {
    throw LoadError("config.json: key 'architectures' is missing or not a list of strings (supported: " +
                    supported + ")");
  }
  const auto name = it->front().get<std::string>();
  for (const Architecture* a : known) {
    if (a->hf_class == name) return *a;
  }
  throw LoadError("config.json: architecture '" + name + "' is not supported (supported: " + supported + ")");
}

}  // namespace capserve::runtime
