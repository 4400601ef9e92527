#pragma once
// `capserve --config FILE.json`: a flat JSON object whose keys are the long flag names without dashes
// ({"port": 50051, "capacity-factor": "1.5", "batch-selector": "greedy"}); arrays give repeated values,
// true/false flags. Command-line flags override the file. Plugged into CLI11 as its config formatter.
#include <istream>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

namespace capserve::server {

class JsonConfig : public CLI::Config {
 public:
  std::string to_config(const CLI::App* app, bool default_also, bool, std::string) const override {
    nlohmann::json out = nlohmann::json::object();
    for (const CLI::Option* opt : app->get_options()) {
      if (opt->get_lnames().empty() || opt->get_lnames().front() == "config" || !opt->get_configurable())
        continue;
      const std::string name = opt->get_lnames().front();
      if (opt->count() > 0) {
        out[name] = opt->results().size() == 1 ? nlohmann::json(opt->results().front())
                                               : nlohmann::json(opt->results());
      } else if (default_also && !opt->get_default_str().empty()) {
        out[name] = opt->get_default_str();
      }
    }
    return out.dump(2);
  }

  std::vector<CLI::ConfigItem> from_config(std::istream& input) const override {
    nlohmann::json json;
    try {
      json = nlohmann::json::parse(input);
    } catch (const nlohmann::json::exception& e) {
      throw CLI::ConversionError("--config: not valid JSON (" + std::string(e.what()) + ")");
    }
    if (!json.is_object()) throw CLI::ConversionError("--config: the file must hold one JSON object");
    std::vector<CLI::ConfigItem> items;
    for (const auto& [key, value] : json.items()) {
      CLI::ConfigItem item;
      item.name = key;
      if (value.is_array()) {
        for (const auto& v : value) item.inputs.push_back(scalar(key, v));
      } else {
        item.inputs.push_back(scalar(key, value));
      }
      items.push_back(std::move(item));
    }
    return items;
  }

 private:
  static std::string scalar(const std::string& key, const nlohmann::json& v) {
    if (v.is_string()) return v.get<std::string>();
    if (v.is_boolean()) return v.get<bool>() ? "true" : "false";
    if (v.is_number()) return v.dump();
    throw CLI::ConversionError("--config: \"" + key +
                               "\" must be a string, number, boolean or an array of them");
  }
};

}  // namespace capserve::server
