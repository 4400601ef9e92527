#pragma once
// The global names of transformers' chat-template environment: range, namespace, dict, raise_exception,
// strftime_now (and Jinja's joiner / cycler are not provided: no chat template uses them).
#include <optional>
#include <string_view>

#include "runtime/chat/jinja_value.h"

namespace capserve::runtime::jinja {

[[nodiscard]] std::optional<Value> find_global(std::string_view name);

}  // namespace capserve::runtime::jinja
