#pragma once
// Hash maps keyed by std::string that can be looked up with a std::string_view without building a string.
#include <functional>
#include <string>
#include <string_view>
#include <unordered_map>

namespace capserve::runtime {

struct StringHash {
  using is_transparent = void;
  std::size_t operator()(std::string_view s) const noexcept { return std::hash<std::string_view>{}(s); }
};

template <class Value>
using StringMap = std::unordered_map<std::string, Value, StringHash, std::equal_to<>>;

}  // namespace capserve::runtime
