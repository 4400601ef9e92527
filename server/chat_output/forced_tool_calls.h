#pragma once
// tool_choice "required" or a named function: the output was constrained to the calls themselves (the
// server's constrained decoding; server/http/openai_request.cpp builds the constraint, as vLLM does), so it
// is parsed as that JSON, whatever format the chat template teaches:
// - a named function: the whole output is the function's arguments (a JSON object): one call, streamed as
//   argument fragments as the text comes; the choice ends "stop", as OpenAI's and vLLM's forced function
//   does;
// - "required": the output is a JSON array of {"name": ..., "parameters": {...}}: each element is a call,
//   emitted once complete (arguments re-serialised as vLLM does); the choice ends "tool_calls".
#include <memory>
#include <string>

#include "server/chat_output/tool_call_parser.h"

namespace capserve::server::chat_output {

struct ForcedToolChoice {
  std::string name;  // the named function; empty: "required"
};

std::unique_ptr<ToolCallParser> make_forced_tool_call_parser(const ForcedToolChoice& choice,
                                                             ToolCallOptions options);

}  // namespace capserve::server::chat_output
