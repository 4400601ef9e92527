#pragma once
// Flag validators shared by the programs' command lines. CLI11's own PositiveNumber/NonNegativeNumber print
// the whole range of a double ("not in range 0.000000 to 1797693134862...") instead of the rule.
#include <sstream>
#include <string>

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

}  // namespace capserve::runtime
