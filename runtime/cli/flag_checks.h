#pragma once
// Flag checks shared by the programs' command lines, for what CLI11 (2.1) gets wrong: its PositiveNumber /
// NonNegativeNumber print the whole range of a double ("not in range 0.000000 to 1797693134862...") instead
// of the rule; it reads `--flag=` (an empty value) as `--flag` followed by the next argument as its value,
// swallowing the next flag; a misspelt flag gets no suggestion ("The following arguments were not expected",
// or "--model is required" for `--modle`); and its CheckedTransformer shows its map in help and errors
// ("ENUM:value in {drop->1,...} OR {1,3,0,2}").
#include <algorithm>
#include <cstddef>
#include <functional>
#include <optional>
#include <span>
#include <sstream>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <CLI/CLI.hpp>

namespace capserve::runtime {

// Refuses a value below `min`: "--flag: must be at least 1, got 0".
inline CLI::Validator at_least(double min) {
  std::ostringstream text;
  text << min;
  const std::string shown = text.str();
  return {[min, shown](std::string& value) -> std::string {
            double v = 0;
            if (!CLI::detail::lexical_cast(value, v)) return "must be a number, got " + value;
            return v >= min ? "" : "must be at least " + shown + ", got " + value;
          },
          ">=" + shown};
}

// The first argument of the form `--name=` (nothing after '='), if any.
inline std::optional<std::string_view> flag_with_empty_value(std::span<char* const> args) {
  for (const char* arg : args) {
    const std::string_view a(arg);
    if (a.size() > 3 && a.starts_with("--") && a.back() == '=') return a;
  }
  return std::nullopt;
}

// Levenshtein distance: insertions, deletions and substitutions.
inline std::size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<std::size_t> row(b.size() + 1);
  for (std::size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    std::size_t diagonal = row[0];
    row[0] = i;
    for (std::size_t j = 1; j <= b.size(); ++j) {
      const std::size_t above = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = above;
    }
  }
  return row[b.size()];
}

// The long name (no dashes) of `app`'s option closest to `name` within two edits, among those `accept`
// allows (all when empty); "" when there is none.
inline std::string closest_flag(const CLI::App& app, std::string_view name,
                                const std::function<bool(const CLI::Option&)>& accept = {}) {
  std::string best;
  std::size_t best_distance = 3;
  for (const CLI::Option* opt : app.get_options()) {
    if (accept && !accept(*opt)) continue;
    for (const std::string& candidate : opt->get_lnames()) {
      if (const std::size_t d = edit_distance(name, candidate); d < best_distance) {
        best = candidate;
        best_distance = d;
      }
    }
  }
  return best;
}

// "unknown flag --modle (did you mean --model?)" for the first argument that looks like a long flag (before
// a bare `--`) but names no option of `app`; nullopt when every one is known.
inline std::optional<std::string> unknown_flag(const CLI::App& app, std::span<char* const> args) {
  for (const char* arg : args) {
    const std::string_view a(arg);
    if (a == "--") break;
    if (a.size() <= 2 || !a.starts_with("--")) continue;
    const std::string name(a.substr(2, a.find('=') - 2));
    if (app.get_option_no_throw("--" + name) != nullptr) continue;
    const std::string near = closest_flag(app, name);
    return "unknown flag --" + name + (near.empty() ? "" : " (did you mean --" + near + "?)");
  }
  return std::nullopt;
}

// An option taking one of `names`, each standing for a value of the enum E: help shows the names (and the
// default by name), a wrong value is "--flag: x is not one of: a, b, c".
template <typename E>
CLI::Option* add_enum_option(CLI::App& app, const std::string& flag, E& value, const std::string& description,
                             std::vector<std::pair<std::string, E>> names) {
  std::string list;
  std::string current;
  for (const auto& [name, v] : names) {
    list += (list.empty() ? "" : ", ") + name;
    if (v == value) current = name;
  }
  CLI::Validator by_name(
      [names, list](std::string& text) -> std::string {
        const auto found =
            std::find_if(names.begin(), names.end(), [&](const auto& n) { return n.first == text; });
        if (found == names.end()) return text + " is not one of: " + list;
        // CLI11 reads an enum from its underlying integer.
        text = std::to_string(static_cast<std::underlying_type_t<E>>(found->second));
        return "";
      },
      "");
  return app.add_option(flag, value, description + "; one of: " + list)
      ->type_name("NAME")
      ->transform(by_name)
      ->default_str(current);
}

}  // namespace capserve::runtime
