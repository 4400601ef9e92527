#pragma once
// `capserve --config FILE.json`: a flat JSON object whose keys are the long flag names without dashes
// ({"port": 50051, "capacity-factor": "1.5", "batch-selector": "greedy"}); arrays give repeated values,
// true/false flags. Command-line flags override the file. Plugged into CLI11 as its config formatter; it
// checks every key against the program's flags, so that a typo ({"max-runing": 8}) is an error naming the key
// instead of a setting silently ignored, and every value against its flag's kind.
#include <cstdint>
#include <istream>
#include <string>
#include <string_view>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "runtime/cli/flag_checks.h"

namespace capserve::server {

class JsonConfig : public CLI::Config {
 public:
  // `app` (which owns this formatter, so outlives it) names the keys the file may hold.
  explicit JsonConfig(const CLI::App& app) : app_(&app) {}

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
      throw CLI::ConfigError("--config: not valid JSON (" + std::string(e.what()) + ")");
    }
    if (!json.is_object()) throw CLI::ConfigError("--config: the file must hold one JSON object");
    std::vector<CLI::ConfigItem> items;
    for (const auto& [key, value] : json.items()) {
      const CLI::Option* opt = find(key);
      if (opt == nullptr) throw CLI::ConfigError("--config: unknown key \"" + key + "\"" + suggestion(key));
      CLI::ConfigItem item;
      item.name = key;
      if (value.is_array()) {
        if (opt->get_items_expected_max() <= 1)
          throw CLI::ConfigError("--config: \"" + key + "\" takes one value, not an array");
        for (const auto& v : value) item.inputs.push_back(scalar(key, *opt, v));
      } else {
        item.inputs.push_back(scalar(key, *opt, value));
      }
      items.push_back(std::move(item));
    }
    return items;
  }

 private:
  // The flag `key` names, if the file may set it (not --config itself, --help or --version).
  [[nodiscard]] const CLI::Option* find(const std::string& key) const {
    if (key == "config" || key == "help" || key == "version") return nullptr;
    const CLI::Option* opt = app_->get_option_no_throw("--" + key);
    return opt != nullptr && opt->get_configurable() ? opt : nullptr;
  }

  // " (did you mean \"max-running\"?)" for the closest flag the file may set within two edits, else "".
  [[nodiscard]] std::string suggestion(const std::string& key) const {
    const std::string best = runtime::closest_flag(*app_, key, [this](const CLI::Option& opt) {
      return !opt.get_lnames().empty() && find(opt.get_lnames().front()) != nullptr;
    });
    return best.empty() ? "" : " (did you mean \"" + best + "\"?)";
  }

  // One value as CLI11 reads it from a command line, refused when its JSON type cannot be what the flag
  // takes: flags take true/false; options a string or a number (a number-valued option: a number, or a string
  // that is one, e.g. "1.5").
  static std::string scalar(const std::string& key, const CLI::Option& opt, const nlohmann::json& v) {
    const auto refuse = [&](const std::string& what) {
      return CLI::ConfigError("--config: \"" + key + "\" " + what + ", got " + v.dump());
    };
    if (opt.get_expected_max() == 0) {
      if (!v.is_boolean()) throw refuse("is a flag: true or false");
      return v.get<bool>() ? "true" : "false";
    }
    if (!v.is_string() && !v.is_number()) throw refuse("takes a string or a number");
    const std::string text = v.is_string() ? v.get<std::string>() : v.dump();
    const std::string type = opt.get_type_name().substr(0, opt.get_type_name().find(':'));
    if (type == "INT" || type == "UINT") {
      std::int64_t n = 0;
      if (!CLI::detail::lexical_cast(text, n) || (type == "UINT" && n < 0))
        throw refuse(type == "UINT" ? "must be a non-negative integer" : "must be an integer");
    } else if (type == "FLOAT") {
      double x = 0;
      if (!CLI::detail::lexical_cast(text, x)) throw refuse("must be a number");
    }
    return text;
  }

  const CLI::App* app_;
};

}  // namespace capserve::server
