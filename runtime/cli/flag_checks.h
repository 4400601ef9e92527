#pragma once
// Flag checks shared by the programs' command lines, for what CLI11 (2.1) gets wrong: its PositiveNumber /
// NonNegativeNumber print the whole range of a double ("not in range 0.000000 to 1797693134862...") instead
// of the rule, and it reads `--flag=` (an empty value) as `--flag` followed by the next argument as its
// value, swallowing the next flag.
#include <optional>
#include <span>
#include <sstream>
#include <string>
#include <string_view>

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

}  // namespace capserve::runtime
