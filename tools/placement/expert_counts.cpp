#include "tools/placement/expert_counts.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <fstream>
#include <numeric>
#include <stdexcept>

#include <nlohmann/json.hpp>

namespace capserve::tools {
namespace {

using nlohmann::json;

constexpr const char* kExpectedShapes =
    "expected one of: --moe-stats output {\"layers\": [{\"layer\": i, \"routed_load\": [...]}, ...]}; a "
    "counts "
    "file {model: {\"expert_counts\": {domain: {layer: [count per expert]}}}}; SGLang's expert-distribution "
    "dump {\"logical_count\": [layer][expert] or [step][layer][expert]}; a model measurement "
    "(tools/measure_default_model.py) {\"domains\": {domain: {\"expert_counts\": {layer: [...]}}}}";

class Reader {
 public:
  explicit Reader(const std::filesystem::path& path) : where_(path.string()) {}

  [[noreturn]] void fail(const std::string& what) const { throw std::runtime_error(where_ + ": " + what); }

  // A non-empty array of non-negative numbers; `what` names it in errors.
  std::vector<double> count_row(const json& row, const std::string& what) const {
    if (!row.is_array() || row.empty()) fail(what + " must be a non-empty array of counts, one per expert");
    std::vector<double> out;
    out.reserve(row.size());
    for (const json& v : row) {
      if (!v.is_number() || !std::isfinite(v.get<double>()) || v.get<double>() < 0)
        fail(what + ": counts must be non-negative numbers, got " + v.dump());
      out.push_back(v.get<double>());
    }
    return out;
  }

  // Every row has the same expert count; sets it.
  void check_experts(ExpertCounts& counts) const {
    for (const CountsGroup& g : counts.groups) {
      for (const CountsLayer& l : g.layers) {
        const auto n = static_cast<std::int64_t>(l.counts.size());
        if (counts.num_experts == 0) counts.num_experts = n;
        if (n != counts.num_experts)
          fail("layer " + std::to_string(l.layer) + (g.name == "all" ? "" : " of " + g.name) + " has " +
               std::to_string(n) + " experts, other layers " + std::to_string(counts.num_experts));
      }
    }
  }

 private:
  std::string where_;
};

std::int64_t layer_id(const Reader& reader, const std::string& text) {
  std::int64_t id = -1;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), id);
  if (error != std::errc() || end != text.data() + text.size() || id < 0)
    reader.fail("layer key \"" + text + "\" is not a layer number");
  return id;
}

ExpertCounts read_moe_stats(const Reader& reader, const json& doc) {
  ExpertCounts out{"moe-stats", 0, std::nullopt, {{"all", {}}}};
  std::int64_t tokens = 0;
  std::int64_t assignments = 0;
  for (const json& entry : doc.at("layers")) {
    if (!entry.is_object() || !entry.contains("layer") || !entry["layer"].is_number_integer() ||
        entry["layer"].get<std::int64_t>() < 0 || !entry.contains("routed_load"))
      reader.fail(
          "each entry of \"layers\" needs a non-negative integer \"layer\" and a \"routed_load\" array");
    const auto layer = entry["layer"].get<std::int64_t>();
    out.groups[0].layers.push_back(
        {layer, reader.count_row(entry["routed_load"], "layer " + std::to_string(layer) + " routed_load")});
    tokens += entry.value("tokens", std::int64_t{0});
    assignments += entry.value("assignments", std::int64_t{0});
  }
  std::sort(out.groups[0].layers.begin(), out.groups[0].layers.end(),
            [](const CountsLayer& a, const CountsLayer& b) { return a.layer < b.layer; });
  if (tokens > 0 && assignments > 0 && assignments % tokens == 0) out.top_k = assignments / tokens;
  return out;
}

// {domain: {layer: [counts]}} into groups (domains in file order, layers ascending).
std::vector<CountsGroup> read_domains(const Reader& reader, const json& domains, const std::string& what) {
  if (!domains.is_object() || domains.empty())
    reader.fail(what + " must be an object {domain: {layer: [...]}}");
  std::vector<CountsGroup> out;
  for (const auto& [domain, layers] : domains.items()) {
    if (!layers.is_object() || layers.empty())
      reader.fail(what + "." + domain + " must be an object {layer: [count per expert]}");
    CountsGroup g{domain, {}};
    for (const auto& [key, row] : layers.items())
      g.layers.push_back({layer_id(reader, key), reader.count_row(row, what + "." + domain + "." + key)});
    std::sort(g.layers.begin(), g.layers.end(),
              [](const CountsLayer& a, const CountsLayer& b) { return a.layer < b.layer; });
    out.push_back(std::move(g));
  }
  return out;
}

double total(const std::vector<double>& v) {
  return std::accumulate(v.begin(), v.end(), 0.0);
}

ExpertCounts read_counts_file(const Reader& reader, const json& doc, const std::string& model_key) {
  std::string key = model_key;
  std::string models;
  for (const auto& [name, _] : doc.items()) models += (models.empty() ? "" : ", ") + name;
  if (key.empty()) {
    if (doc.size() != 1) reader.fail("holds several models (" + models + "): name one (--counts-model)");
    key = doc.begin().key();
  }
  if (!doc.contains(key)) reader.fail("has no model \"" + key + "\" (it has: " + models + ")");
  const json& model = doc[key];
  if (!model.is_object() || !model.contains("expert_counts"))
    reader.fail("model \"" + key + "\" has no \"expert_counts\"; " + kExpectedShapes);
  ExpertCounts out{"counts", 0, std::nullopt,
                   read_domains(reader, model["expert_counts"], key + ".expert_counts")};
  // Top-k: every token counts k times in expert_counts and once in expert_counts_top1.
  if (model.contains("expert_counts_top1")) {
    const std::vector<CountsGroup> top1 =
        read_domains(reader, model["expert_counts_top1"], key + ".expert_counts_top1");
    std::optional<std::int64_t> k;
    bool consistent = true;
    for (const CountsGroup& g : out.groups) {
      const auto t =
          std::find_if(top1.begin(), top1.end(), [&](const CountsGroup& x) { return x.name == g.name; });
      if (t == top1.end()) continue;
      for (const CountsLayer& l : g.layers) {
        const auto tl = std::find_if(t->layers.begin(), t->layers.end(),
                                     [&](const CountsLayer& x) { return x.layer == l.layer; });
        if (tl == t->layers.end() || total(tl->counts) <= 0) continue;
        const double ratio = total(l.counts) / total(tl->counts);
        const auto rounded = static_cast<std::int64_t>(std::llround(ratio));
        if (rounded < 1 || std::abs(ratio - static_cast<double>(rounded)) > 1e-9 || (k && *k != rounded))
          consistent = false;
        k = rounded;
      }
    }
    if (consistent) out.top_k = k;
  }
  return out;
}

// tools/measure_default_model.py's measurement: {"domains": {domain: {"expert_counts": {layer: [...]}}},
// "config": {"num_experts_per_tok": k}, ...}.
ExpertCounts read_model_eval(const Reader& reader, const json& doc) {
  const json& domains = doc.at("domains");
  if (!domains.is_object() || domains.empty()) reader.fail("\"domains\" must be an object {domain: {...}}");
  json counts = json::object();
  for (const auto& [domain, entry] : domains.items()) {
    if (!entry.is_object() || !entry.contains("expert_counts"))
      reader.fail("domain " + domain + " has no \"expert_counts\"");
    counts[domain] = entry["expert_counts"];
  }
  ExpertCounts out{"model-eval", 0, std::nullopt, read_domains(reader, counts, "domains")};
  if (const auto c = doc.find("config"); c != doc.end() && c->contains("num_experts_per_tok"))
    out.top_k = c->at("num_experts_per_tok").get<std::int64_t>();
  return out;
}

ExpertCounts read_sglang(const Reader& reader, const json& doc) {
  const json& lc = doc.at("logical_count");
  const auto shape_error = [&] {
    reader.fail("\"logical_count\" must be [layer][expert] or [step][layer][expert] counts");
  };
  if (!lc.is_array() || lc.empty() || !lc[0].is_array() || lc[0].empty()) shape_error();
  ExpertCounts out{"sglang", 0, std::nullopt, {{"all", {}}}};
  std::vector<CountsLayer>& layers = out.groups[0].layers;
  const bool per_step = lc[0][0].is_array();
  const json one_step = json::array({lc});
  for (const json& step : per_step ? lc : one_step) {
    if (!step.is_array() || (!layers.empty() && step.size() != layers.size())) shape_error();
    for (std::size_t l = 0; l < step.size(); ++l) {
      std::vector<double> row = reader.count_row(step[l], "logical_count layer " + std::to_string(l));
      if (l == layers.size()) {
        layers.push_back({static_cast<std::int64_t>(l), std::move(row)});
        continue;
      }
      if (row.size() != layers[l].counts.size()) shape_error();
      for (std::size_t e = 0; e < row.size(); ++e) layers[l].counts[e] += row[e];
    }
  }
  return out;
}

}  // namespace

ExpertCounts read_expert_counts(const std::filesystem::path& path, const std::string& model_key) {
  const Reader reader(path);
  std::ifstream in(path);
  if (!in) reader.fail("cannot open");
  json doc;
  try {
    doc = json::parse(in);
  } catch (const json::parse_error& e) {
    reader.fail(std::string("not valid JSON (") + e.what() + ")");
  }
  if (!doc.is_object() || doc.empty())
    reader.fail(std::string("not an expert-count file; ") + kExpectedShapes);
  ExpertCounts out;
  if (doc.contains("logical_count")) {
    out = read_sglang(reader, doc);
  } else if (doc.contains("domains") && doc.contains("routing")) {
    out = read_model_eval(reader, doc);
  } else if (doc.contains("layers") && doc["layers"].is_array()) {
    out = read_moe_stats(reader, doc);
  } else if (std::all_of(doc.begin(), doc.end(), [](const json& v) { return v.is_object(); })) {
    out = read_counts_file(reader, doc, model_key);
  } else {
    reader.fail(std::string("not an expert-count file; ") + kExpectedShapes);
  }
  if (out.groups.front().layers.empty()) reader.fail("has no layers");
  reader.check_experts(out);
  for (const CountsGroup& g : out.groups) {
    const auto same_layer = [](const CountsLayer& a, const CountsLayer& b) { return a.layer == b.layer; };
    const auto& first = out.groups.front().layers;
    if (!std::equal(g.layers.begin(), g.layers.end(), first.begin(), first.end(), same_layer))
      reader.fail("domain " + g.name + " has other layers than " + out.groups.front().name);
    if (std::adjacent_find(g.layers.begin(), g.layers.end(), same_layer) != g.layers.end())
      reader.fail("a layer appears twice");
  }
  return out;
}

std::vector<std::vector<double>> summed_layer_counts(const ExpertCounts& counts,
                                                     std::span<const std::string> groups) {
  std::vector<std::vector<double>> out(
      static_cast<std::size_t>(counts.groups.front().layers.back().layer + 1));
  const auto add = [&](const CountsGroup& g) {
    for (const CountsLayer& l : g.layers) {
      std::vector<double>& sum = out[static_cast<std::size_t>(l.layer)];
      sum.resize(l.counts.size(), 0.0);
      for (std::size_t e = 0; e < l.counts.size(); ++e) sum[e] += l.counts[e];
    }
  };
  if (groups.empty()) {
    for (const CountsGroup& g : counts.groups) add(g);
    return out;
  }
  for (const std::string& name : groups) {
    const auto g = std::find_if(counts.groups.begin(), counts.groups.end(),
                                [&](const CountsGroup& x) { return x.name == name; });
    if (g == counts.groups.end()) {
      std::string names;
      for (const CountsGroup& x : counts.groups) names += (names.empty() ? "" : ", ") + x.name;
      throw std::runtime_error("no domain \"" + name + "\" in the counts (they have: " + names + ")");
    }
    add(*g);
  }
  return out;
}

}  // namespace capserve::tools
