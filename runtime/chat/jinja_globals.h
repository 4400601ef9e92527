#pragma once
// The global names of transformers' chat-template environment: range, namespace, dict, raise_exception,
// strftime_now; Jinja's other default globals (cycler, joiner, lipsum) are refused when a template is
// compiled.
#include <optional>
#include <string_view>

#include "runtime/chat/jinja_value.h"

namespace capserve::runtime::jinja {

[[nodiscard]] std::optional<Value> find_global(std::string_view name);
// Why this engine refuses a Jinja2 default global (a template naming it does not compile); nullptr for any
// other name.
[[nodiscard]] const char* refused_global_reason(std::string_view name);

}  // namespace capserve::runtime::jinja
