#include "server/chat_output/tool_call_parser.h"

#include <utility>

#include <nlohmann/json.hpp>

namespace capserve::server::chat_output {
namespace {

using ordered_json = nlohmann::ordered_json;
constexpr std::size_t npos = std::string_view::npos;

bool is_space(char c) {
  return c == ' ' || c == '\n' || c == '\r' || c == '\t';
}

std::size_t skip_space(std::string_view text, std::size_t from, std::string_view also = {}) {
  while (from < text.size() && (is_space(text[from]) || also.find(text[from]) != npos)) ++from;
  return from;
}

std::string dump_scalar(const ordered_json& v) {
  return v.dump(-1, ' ', false, ordered_json::error_handler_t::replace);
}

void write_python(const ordered_json& v, std::string& out) {
  if (v.is_object()) {
    out += '{';
    bool first = true;
    for (const auto& [key, value] : v.items()) {
      if (!first) out += ", ";
      first = false;
      out += dump_scalar(ordered_json(key));
      out += ": ";
      write_python(value, out);
    }
    out += '}';
  } else if (v.is_array()) {
    out += '[';
    for (std::size_t i = 0; i < v.size(); ++i) {
      if (i > 0) out += ", ";
      write_python(v[i], out);
    }
    out += ']';
  } else {
    out += dump_scalar(v);
  }
}

// Hermes: <tool_call>JSON</tool_call>, any number; an unclosed last call counts when its JSON is whole.
class HermesParser final : public ToolCallParser {
 public:
  using ToolCallParser::ToolCallParser;

 private:
  static constexpr std::string_view kOpen = "<tool_call>", kClose = "</tool_call>";

  void scan(bool at_end, ChatDelta& out) override {
    for (;;) {
      const std::string_view rest = std::string_view(buffer_).substr(done_);
      if (!in_call_) {
        if (!text_until(kOpen, at_end, out)) return;
        in_call_ = true;
        continue;
      }
      const std::size_t close = rest.find(kClose);
      if (close == npos && !at_end) return;
      const std::string_view body = rest.substr(0, close);
      if (!emit_json_call(body, "arguments", out))
        emit_text(std::string(kOpen) + std::string(body) + std::string(close == npos ? "" : kClose), out);
      done_ += close == npos ? rest.size() : close + kClose.size();
      in_call_ = false;
    }
  }

  bool in_call_ = false;
};

// Mistral: [TOOL_CALLS] then a JSON list of calls; each call goes out as soon as its object is whole.
class MistralParser final : public ToolCallParser {
 public:
  using ToolCallParser::ToolCallParser;

 private:
  static constexpr std::string_view kMarker = "[TOOL_CALLS]";
  enum class State { text, list_open, list, ended };

  void scan(bool at_end, ChatDelta& out) override {
    for (;;) {
      const std::string_view rest = std::string_view(buffer_).substr(done_);
      switch (state_) {
        case State::text:
          if (!text_until(kMarker, at_end, out)) return;
          state_ = State::list_open;
          break;
        case State::list_open: {
          const std::size_t i = skip_space(rest, 0);
          done_ += i;
          if (i == rest.size()) return;
          if (rest[i] == '[') {
            ++done_;
            state_ = State::list;
          } else {
            emit_text(kMarker, out);  // not a list: the model's text, as written
            state_ = State::text;
          }
          break;
        }
        case State::list: {
          const std::size_t i = skip_space(rest, 0, ",");
          done_ += i;
          if (i == rest.size()) return;
          if (rest[i] == ']') {
            state_ = State::ended;
            break;
          }
          const std::size_t end = json_container_end(rest.substr(i));
          if (end == npos) {
            if (!at_end) return;
            emit_text(rest.substr(i), out);
            done_ += rest.size() - i;
            return;
          }
          if (!emit_json_call(rest.substr(i, end), "arguments", out)) emit_text(rest.substr(i, end), out);
          done_ += end;
          break;
        }
        case State::ended:
          done_ = buffer_.size();
          return;
      }
    }
  }

  // Mistral's ids: 9 letters and digits (its templates refuse others).
  std::string new_id() override {
    static constexpr std::string_view kAlphabet =
        "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
    std::string id(9, ' ');
    for (char& c : id) c = kAlphabet[ids_() % kAlphabet.size()];
    return id;
  }

  State state_ = State::text;
};

// Llama 3 JSON: an output that starts with `{` is calls, `{"name": ..., "parameters": {...}}` separated by
// `;`; any other output is content.
class Llama3JsonParser final : public ToolCallParser {
 public:
  using ToolCallParser::ToolCallParser;

 private:
  enum class State { start, calls, text };

  void scan(bool at_end, ChatDelta& out) override {
    for (;;) {
      const std::string_view rest = std::string_view(buffer_).substr(done_);
      switch (state_) {
        case State::start: {
          const std::size_t i = skip_space(rest, 0);
          if (i == rest.size()) {
            if (at_end) state_ = State::text;  // only spaces: content
            if (!at_end) return;
            break;
          }
          state_ = rest[i] == '{' ? State::calls : State::text;
          if (state_ == State::calls) done_ += i;
          break;
        }
        case State::text:
          emit_text(rest, out);
          done_ = buffer_.size();
          return;
        case State::calls: {
          const std::size_t i = skip_space(rest, 0, ";");
          if (i == rest.size()) {
            done_ += i;
            return;
          }
          if (rest[i] != '{') {
            done_ += i;
            state_ = State::text;
            break;
          }
          const std::size_t end = json_container_end(rest.substr(i));
          if (end == npos) {
            if (!at_end) return;
            emit_text(rest.substr(i), out);
            done_ = buffer_.size();
            return;
          }
          if (!emit_json_call(rest.substr(i, end), "parameters", out)) emit_text(rest.substr(i, end), out);
          done_ += i + end;
          break;
        }
      }
    }
  }

  State state_ = State::start;
};

// DeepSeek V3 / R1 (TYPE<sep>NAME\n```json\nARGS\n```) and V3.1 (NAME<sep>ARGS) between call markers.
class DeepSeekV3Parser final : public ToolCallParser {
 public:
  using ToolCallParser::ToolCallParser;

 private:
  static constexpr std::string_view kCallsBegin = "<｜tool▁calls▁begin｜>",
                                    kCallsEnd = "<｜tool▁calls▁end｜>", kCallBegin = "<｜tool▁call▁begin｜>",
                                    kCallEnd = "<｜tool▁call▁end｜>", kSep = "<｜tool▁sep｜>",
                                    kFence = "\n```json\n";
  enum class State { text, calls, ended };

  void scan(bool at_end, ChatDelta& out) override {
    for (;;) {
      const std::string_view rest = std::string_view(buffer_).substr(done_);
      switch (state_) {
        case State::text:
          if (!text_until(kCallsBegin, at_end, out)) return;
          state_ = State::calls;
          break;
        case State::calls: {
          const std::size_t begin = rest.find(kCallBegin), calls_end = rest.find(kCallsEnd);
          if (calls_end != npos && (begin == npos || calls_end < begin)) {
            state_ = State::ended;
            break;
          }
          const std::size_t end = begin == npos ? npos : rest.find(kCallEnd, begin);
          if (end == npos) {
            if (at_end) {
              emit_text(rest, out);
              done_ = buffer_.size();
            }
            return;
          }
          const std::string_view body =
              rest.substr(begin + kCallBegin.size(), end - begin - kCallBegin.size());
          if (!emit_body(body, out)) emit_text(rest.substr(begin, end + kCallEnd.size() - begin), out);
          done_ += end + kCallEnd.size();
          break;
        }
        case State::ended:
          done_ = buffer_.size();
          return;
      }
    }
  }

  bool emit_body(std::string_view body, ChatDelta& out) {
    const std::size_t sep = body.find(kSep);
    if (sep == npos) return false;
    std::string_view name = body.substr(0, sep), arguments = body.substr(sep + kSep.size());
    if (const std::size_t fence = arguments.find(kFence); fence != npos) {
      name = arguments.substr(0, fence);
      arguments = arguments.substr(fence + kFence.size());
      while (!arguments.empty() && is_space(arguments.back())) arguments.remove_suffix(1);
      if (!arguments.ends_with("```")) return false;
      arguments.remove_suffix(3);
    }
    std::optional<std::string> dumped = python_json_dumps(arguments);
    if (name.empty() || !dumped) return false;
    emit_call(std::string(name), std::move(*dumped), out);
    return true;
  }

  State state_ = State::text;
};

}  // namespace

std::string_view format_name(ToolCallFormat format) {
  switch (format) {
    case ToolCallFormat::hermes:
      return "hermes";
    case ToolCallFormat::mistral:
      return "mistral";
    case ToolCallFormat::llama3_json:
      return "llama3_json";
    case ToolCallFormat::deepseek_v3:
      return "deepseek_v3";
  }
  return "";
}

std::optional<ToolCallFormat> tool_call_format_named(std::string_view name) {
  for (const ToolCallFormat f : {ToolCallFormat::hermes, ToolCallFormat::mistral, ToolCallFormat::llama3_json,
                                 ToolCallFormat::deepseek_v3})
    if (format_name(f) == name) return f;
  return std::nullopt;
}

std::optional<ToolCallFormat> detect_tool_call_format(std::string_view source) {
  if (source.find("<tool_call>") != npos) return ToolCallFormat::hermes;
  if (source.find("[TOOL_CALLS]") != npos) return ToolCallFormat::mistral;
  if (source.find("<｜tool▁calls▁begin｜>") != npos) return ToolCallFormat::deepseek_v3;
  if (source.find("<|python_tag|>") != npos) return ToolCallFormat::llama3_json;
  return std::nullopt;
}

void ToolCallParser::feed(std::string_view text, ChatDelta& out) {
  buffer_.append(text);
  scan(false, out);
  buffer_.erase(0, done_);
  done_ = 0;
}

void ToolCallParser::finish(ChatDelta& out) {
  scan(true, out);
  buffer_.clear();
  done_ = 0;
}

std::string ToolCallParser::new_id() {
  static constexpr std::string_view kHex = "0123456789abcdef";
  std::string id = "chatcmpl-tool-";
  for (int i = 0; i < 32; ++i) id += kHex[ids_() % 16];
  return id;
}

bool ToolCallParser::emit_json_call(std::string_view object, std::string_view arguments_key, ChatDelta& out) {
  const ordered_json call = ordered_json::parse(object, nullptr, false);
  if (call.is_discarded() || !call.is_object()) return false;
  const auto name = call.find("name");
  auto arguments = call.find(arguments_key);
  if (arguments == call.end()) arguments = call.find("arguments");
  if (name == call.end() || !name->is_string() || name->get_ref<const std::string&>().empty() ||
      arguments == call.end())
    return false;
  std::string text;
  if (arguments->is_string()) {
    text = arguments->get<std::string>();  // already JSON text
  } else {
    write_python(*arguments, text);
  }
  emit_call(name->get<std::string>(), std::move(text), out);
  return true;
}

void ToolCallParser::emit_call(std::string name, std::string arguments, ChatDelta& out) {
  if (dropped_) return;
  if (!options_.parallel && calls_ == 1) {
    dropped_ = true;
    return;
  }
  out.tool_calls.push_back({calls_, new_id(), std::move(name), std::move(arguments)});
  ++calls_;
}

void ToolCallParser::emit_arguments(std::string_view fragment, ChatDelta& out) const {
  if (dropped_ || calls_ == 0) return;
  out.tool_calls.push_back({calls_ - 1, {}, {}, std::string(fragment)});
}

void ToolCallParser::emit_text(std::string_view text, ChatDelta& out) const {
  if (calls_ == 0 && !dropped_) out.content.append(text);
}

bool ToolCallParser::text_until(std::string_view marker, bool at_end, ChatDelta& out) {
  const std::string_view rest = std::string_view(buffer_).substr(done_);
  const std::size_t at = rest.find(marker);
  if (at == npos) {
    const std::size_t take = rest.size() - (at_end ? 0 : partial_marker(rest, marker));
    emit_text(rest.substr(0, take), out);
    done_ += take;
    return false;
  }
  emit_text(rest.substr(0, at), out);
  done_ += at + marker.size();
  return true;
}

std::unique_ptr<ToolCallParser> make_tool_call_parser(ToolCallFormat format, ToolCallOptions options) {
  switch (format) {
    case ToolCallFormat::hermes:
      return std::make_unique<HermesParser>(options);
    case ToolCallFormat::mistral:
      return std::make_unique<MistralParser>(options);
    case ToolCallFormat::llama3_json:
      return std::make_unique<Llama3JsonParser>(options);
    case ToolCallFormat::deepseek_v3:
      return std::make_unique<DeepSeekV3Parser>(options);
  }
  return nullptr;
}

std::size_t json_container_end(std::string_view text) {
  int depth = 0;
  bool in_string = false, escaped = false;
  for (std::size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (escaped) {
        escaped = false;
      } else if (c == '\\') {
        escaped = true;
      } else if (c == '"') {
        in_string = false;
      }
    } else if (c == '"') {
      in_string = true;
    } else if (c == '{' || c == '[') {
      ++depth;
    } else if ((c == '}' || c == ']') && --depth == 0) {
      return i + 1;
    }
  }
  return npos;
}

std::optional<std::string> python_json_dumps(std::string_view json_text) {
  const ordered_json value = ordered_json::parse(json_text, nullptr, false);
  if (value.is_discarded()) return std::nullopt;
  std::string out;
  write_python(value, out);
  return out;
}

std::size_t partial_marker(std::string_view text, std::string_view marker) {
  for (std::size_t n = std::min(text.size(), marker.size() - 1); n > 0; --n)
    if (text.ends_with(marker.substr(0, n))) return n;
  return 0;
}

}  // namespace capserve::server::chat_output
