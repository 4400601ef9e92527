#include "server/chat_output/forced_tool_calls.h"

#include <utility>

namespace capserve::server::chat_output {
namespace {

class NamedToolCallParser final : public ToolCallParser {
 public:
  NamedToolCallParser(std::string name, ToolCallOptions options)
      : ToolCallParser(options), name_(std::move(name)) {}

  [[nodiscard]] bool ends_in_tool_calls() const override { return false; }

 protected:
  void scan(bool at_end, ChatDelta& out) override {
    const std::string_view text = std::string_view(buffer_).substr(done_);
    // The call opens with the first text (or at the end of an empty output: no arguments were written).
    if (!started_ && (!text.empty() || at_end)) {
      emit_call(name_, std::string(text), out);
      started_ = true;
    } else if (!text.empty()) {
      emit_arguments(text, out);
    }
    done_ = buffer_.size();
  }

 private:
  std::string name_;
  bool started_ = false;
};

// Scans the array once, keeping its place between feeds: depth and string state, and where the element being
// read starts (relative to done_, which feed() moves to the buffer's front).
class RequiredToolCallParser final : public ToolCallParser {
 public:
  using ToolCallParser::ToolCallParser;

 protected:
  void scan(bool /*at_end*/, ChatDelta& out) override {
    for (std::size_t i = done_ + scanned_; i < buffer_.size(); ++i) {
      const char c = buffer_[i];
      if (in_string_) {
        if (escaped_) {
          escaped_ = false;
        } else if (c == '\\') {
          escaped_ = true;
        } else if (c == '"') {
          in_string_ = false;
        }
        continue;
      }
      if (c == '"') {
        in_string_ = true;
      } else if (c == '{' || c == '[') {
        if (++depth_ == 2 && c == '{') element_ = i - done_;
      } else if (c == '}' || c == ']') {
        if (--depth_ == 1 && c == '}') {
          const std::size_t start = done_ + element_;
          emit_json_call(std::string_view(buffer_).substr(start, i + 1 - start), "parameters", out);
          done_ = i + 1;
        }
      }
    }
    // What is left is an element being written (kept from its start) or separators.
    if (depth_ < 2) done_ = buffer_.size();
    scanned_ = buffer_.size() - done_;
  }

 private:
  int depth_ = 0;
  bool in_string_ = false;
  bool escaped_ = false;
  std::size_t element_ = 0;  // where the current element starts, after done_ (valid while depth_ >= 2)
  std::size_t scanned_ = 0;  // bytes after done_ already scanned
};

}  // namespace

std::unique_ptr<ToolCallParser> make_forced_tool_call_parser(const ForcedToolChoice& choice,
                                                             ToolCallOptions options) {
  if (choice.name.empty()) return std::make_unique<RequiredToolCallParser>(options);
  return std::make_unique<NamedToolCallParser>(choice.name, options);
}

}  // namespace capserve::server::chat_output
