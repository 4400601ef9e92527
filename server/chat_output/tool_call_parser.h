#pragma once
// Tool calls in a model's output text, in the formats chat templates teach (named as vLLM's
// --tool-call-parser names them):
// - hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number (Hermes 2 Pro, Qwen 2.5 /
// 3,
//   GLM, SmolLM3 ...);
// - mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (Mistral v0.3, Nemo, Large 2407);
// - llama3_json: the output is `{"name": ..., "parameters": {...}}` objects separated by `;` (Llama 3.1
// / 3.3,
//   after the <|python_tag|> that decoding drops);
// - deepseek_v3: `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\nARGS\n```
//   <｜tool▁call▁end｜>...<｜tool▁calls▁end｜>` (V3, R1), and V3.1's
//   `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS <｜tool▁call▁end｜>`.
// Text in, deltas out: feed() the text as it comes, finish() at the end; the deltas of any split of a text
// add up to those of the whole. Text before the first call is content; after a call, only further calls count
// (as vLLM). A call whose JSON does not parse stays content, as the model wrote it. Arguments are
// re-serialised as vLLM does (Python's json.dumps: `{"k": v}`, the model's key order, non-ASCII as is) and go
// out in one fragment once the call is complete.
#include <cstdint>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <string_view>

#include "server/chat_output/chat_delta.h"

namespace capserve::server::chat_output {

enum class ToolCallFormat { hermes, mistral, llama3_json, deepseek_v3 };

// vLLM's name of the format, and the format of a name (nullopt: none of them).
std::string_view format_name(ToolCallFormat format);
std::optional<ToolCallFormat> tool_call_format_named(std::string_view name);
// The format a chat template teaches its model, from the markers its source holds (nullopt: none).
std::optional<ToolCallFormat> detect_tool_call_format(std::string_view template_source);

struct ToolCallOptions {
  bool parallel = true;    // false: calls after the first are dropped (parallel_tool_calls: false)
  std::uint64_t seed = 0;  // of the call ids (random per choice in the server, fixed in tests)
};

class ToolCallParser {
 public:
  explicit ToolCallParser(ToolCallOptions options) : ids_(options.seed), options_(options) {}
  virtual ~ToolCallParser() = default;
  ToolCallParser(const ToolCallParser&) = delete;
  ToolCallParser& operator=(const ToolCallParser&) = delete;

  void feed(std::string_view text, ChatDelta& out);
  void finish(ChatDelta& out);
  // Calls so far (kept ones).
  [[nodiscard]] std::size_t calls() const { return calls_; }
  // Whether the choice's finish_reason is "tool_calls" (when it stopped of itself): when there is a call.
  [[nodiscard]] virtual bool ends_in_tool_calls() const { return calls_ > 0; }

 protected:
  // Consumes what it can decide of buffer_ from done_ (all of it when at_end), advancing done_.
  virtual void scan(bool at_end, ChatDelta& out) = 0;
  virtual std::string new_id();
  // A call parsed from a JSON object with "name" and `arguments_key` (or "arguments"); false: not a call.
  bool emit_json_call(std::string_view object, std::string_view arguments_key, ChatDelta& out);
  void emit_call(std::string name, std::string arguments, ChatDelta& out);
  // A further fragment of the last call's arguments.
  void emit_arguments(std::string_view fragment, ChatDelta& out) const;
  // Text outside calls: content before the first call, dropped after it.
  void emit_text(std::string_view text, ChatDelta& out) const;
  // Emits buffer_'s text from done_ up to `marker` and consumes both: true. Without the marker, emits what
  // cannot begin it (all of it when at_end) and returns false.
  bool text_until(std::string_view marker, bool at_end, ChatDelta& out);

  std::string buffer_;
  std::size_t done_ = 0;
  std::mt19937_64 ids_;

 private:
  ToolCallOptions options_;
  std::size_t calls_ = 0;
  bool dropped_ = false;  // a call beyond the first with parallel false: the rest is dropped too
};

std::unique_ptr<ToolCallParser> make_tool_call_parser(ToolCallFormat format, ToolCallOptions options);

// Python's json.dumps(value, ensure_ascii=False) of a JSON text, keeping its key order; nullopt when the text
// is not JSON.
std::optional<std::string> python_json_dumps(std::string_view json_text);

// The length of the JSON object or array that starts `text` (strings and escapes skipped), npos while it is
// incomplete.
std::size_t json_container_end(std::string_view text);

// Bytes at the end of `text` that begin `marker` (a proper prefix of it): held back while more may come.
std::size_t partial_marker(std::string_view text, std::string_view marker);

}  // namespace capserve::server::chat_output
