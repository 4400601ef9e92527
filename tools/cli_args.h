#pragma once
// Command-line checks CLI11 (2.1) does not make: it reads `--flag=` (an empty value) as `--flag` and then
// takes the next argument as the value, swallowing the next flag.
#include <optional>
#include <span>
#include <string_view>

namespace capserve::tools {

// The first argument of the form `--name=` (nothing after '='), if any.
inline std::optional<std::string_view> flag_with_empty_value(std::span<char* const> args) {
  for (const char* arg : args) {
    const std::string_view a(arg);
    if (a.size() > 3 && a.starts_with("--") && a.back() == '=') return a;
  }
  return std::nullopt;
}

}  // namespace capserve::tools
