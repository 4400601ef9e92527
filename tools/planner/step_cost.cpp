#include "tools/planner/step_cost.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <stdexcept>

namespace capserve::tools {
namespace {

// The time of work spread over ranks: the slowest rank, or on shared cores the total over the cores when
// that is longer.
class Phase {
 public:
  explicit Phase(int cores) : cores_(cores) {}
  void add(double seconds) {
    slowest_ = std::max(slowest_, seconds);
    total_ += seconds;
  }
  [[nodiscard]] double seconds() const { return cores_ > 0 ? std::max(slowest_, total_ / cores_) : slowest_; }

 private:
  int cores_;
  double slowest_ = 0;
  double total_ = 0;
};

double number(const nlohmann::json& j, const char* key, const std::filesystem::path& path) {
  if (!j.contains(key) || !j.at(key).is_number() || !std::isfinite(j.at(key).get<double>()) ||
      j.at(key).get<double>() < 0)
    throw std::runtime_error(path.string() + ": \"" + key + "\" must be a non-negative number");
  return j.at(key).get<double>();
}

}  // namespace

StepSeconds step_seconds(const StepCost& cost, const StepWork& work) {
  const std::size_t ranks = work.ranks.size();
  Phase dense(cost.cores);
  for (const server::RankWork& r : work.ranks)
    dense.add(cost.token * static_cast<double>(r.tokens) +
              cost.pair * static_cast<double>(r.attention_pairs) +
              cost.decode_pair * static_cast<double>(r.decode_pairs));
  double moe = 0;
  const std::size_t layers = ranks == 0 ? 0 : work.expert_load.size() / ranks;
  for (std::size_t l = 0; l < layers; ++l) {
    Phase experts(cost.cores);
    for (std::size_t r = 0; r < ranks; ++r) {
      const double compute = cost.assignment * static_cast<double>(work.expert_load[l * ranks + r]);
      const double weights = cost.active_expert * static_cast<double>(work.active_experts[l * ranks + r]);
      experts.add(cost.expert_time == ExpertTime::sum ? compute + weights : std::max(compute, weights));
    }
    const double wire = l < work.wire_bytes.size() ? static_cast<double>(work.wire_bytes[l]) : 0.0;
    const bool dropped = l < work.dropped.size() && work.dropped[l] > 0;
    const double capacity =
        work.capacity ? cost.capacity_layer + (dropped ? cost.capacity_refine : 0.0) : 0.0;
    moe += cost.layer + capacity + experts.seconds() + cost.wire_byte * wire / static_cast<double>(ranks);
  }
  return {cost.step + dense.seconds() + moe, moe};
}

StepCost read_step_cost(const std::filesystem::path& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error("cannot read the step cost file " + path.string());
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    throw std::runtime_error(path.string() + ": not JSON: " + e.what());
  }
  if (!j.is_object() || !j.contains("model") || !j.contains("seconds") || !j["model"].is_object() ||
      !j["seconds"].is_object())
    throw std::runtime_error(path.string() + ": expected {\"name\", \"model\": {...}, \"seconds\": {...}}");
  StepCost c;
  c.name = j.value("name", path.stem().string());
  const nlohmann::json& m = j["model"];
  c.moe_layers = static_cast<std::int64_t>(number(m, "moe_layers", path));
  c.experts = static_cast<std::int64_t>(number(m, "experts", path));
  c.top_k = static_cast<std::int64_t>(number(m, "top_k", path));
  c.row_bytes = static_cast<std::int64_t>(number(m, "row_bytes", path));
  if (c.moe_layers < 1 || c.experts < 1 || c.top_k < 1 || c.top_k > c.experts)
    throw std::runtime_error(path.string() + ": the model needs moe_layers >= 1 and 1 <= top_k <= experts");
  c.cores = static_cast<int>(number(j, "cores", path));
  const std::string expert_time = j.value("expert_time", "sum");
  if (expert_time != "sum" && expert_time != "roofline")
    throw std::runtime_error(path.string() + ": \"expert_time\" is sum or roofline");
  c.expert_time = expert_time == "sum" ? ExpertTime::sum : ExpertTime::roofline;
  const nlohmann::json& s = j["seconds"];
  c.step = number(s, "step", path);
  c.token = number(s, "token", path);
  c.pair = number(s, "pair", path);
  c.decode_pair = number(s, "decode_pair", path);
  c.layer = number(s, "layer", path);
  c.assignment = number(s, "assignment", path);
  c.active_expert = number(s, "active_expert", path);
  c.wire_byte = number(s, "wire_byte", path);
  c.capacity_layer = number(s, "capacity_layer", path);
  c.capacity_refine = number(s, "capacity_refine", path);
  if (j.contains("assumptions")) c.assumptions = j["assumptions"].get<std::vector<std::string>>();
  return c;
}

nlohmann::json to_json(const StepCost& c) {
  return {{"name", c.name},
          {"model",
           {{"moe_layers", c.moe_layers},
            {"experts", c.experts},
            {"top_k", c.top_k},
            {"row_bytes", c.row_bytes}}},
          {"cores", c.cores},
          {"expert_time", c.expert_time == ExpertTime::sum ? "sum" : "roofline"},
          {"seconds",
           {{"step", c.step},
            {"token", c.token},
            {"pair", c.pair},
            {"decode_pair", c.decode_pair},
            {"layer", c.layer},
            {"assignment", c.assignment},
            {"active_expert", c.active_expert},
            {"wire_byte", c.wire_byte},
            {"capacity_layer", c.capacity_layer},
            {"capacity_refine", c.capacity_refine}}},
          {"assumptions", c.assumptions}};
}

}  // namespace capserve::tools
