#pragma once
// The one parser of JSON that clients send (an HTTP request body; a gRPC JSON field: tools, tool_calls,
// chat_template_kwargs). A document may nest at most kMaxClientJsonDepth arrays and objects. The depth is
// checked by a SAX pre-scan that stops at the first level past the limit, before any value is built: nlohmann
// builds, copies and compares values recursively, so a deep document (a few hundred kilobytes of '[') would
// otherwise overflow the stack of whichever thread parses it. The limit also keeps every accepted value
// within what the chat template engine renders (its tojson and value conversion stop at 256 levels), so a
// deep document is the client's error (INVALID_ARGUMENT naming the field), never the template's.
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "runtime/status.h"

namespace capserve::server {

// Arrays and objects nested in one client document, the document itself included: generous for real tool
// schemas (each schema level is two JSON levels: "properties" and the property), far below any stack risk.
inline constexpr int kMaxClientJsonDepth = 64;

// The document `text` when it is one valid JSON document nesting at most kMaxClientJsonDepth levels; else
// INVALID_ARGUMENT. `field` names the document in errors ("tools", "messages[0].tool_calls"); empty for an
// HTTP body, whose errors then name the top-level key at fault (the status's field) and the path below it
// (the message, e.g. "messages[0].tool_calls[0]...: ..."). Json: nlohmann::json, or nlohmann::ordered_json to
// keep object keys in the client's order (templates show them in that order).
template <typename Json>
runtime::StatusOr<Json> parse_client_json(std::string_view text, const std::string& field);
template <>
runtime::StatusOr<nlohmann::json> parse_client_json(std::string_view text, const std::string& field);
template <>
runtime::StatusOr<nlohmann::ordered_json> parse_client_json(std::string_view text, const std::string& field);

}  // namespace capserve::server
