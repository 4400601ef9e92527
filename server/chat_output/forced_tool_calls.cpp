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

// Each element of the array is a call once its object is complete (an incomplete one waits for more text).
class RequiredToolCallParser final : public ToolCallParser {
 public:
  using ToolCallParser::ToolCallParser;

 protected:
  void scan(bool /*at_end*/, ChatDelta& out) override {
    while (true) {
      const std::string_view rest = std::string_view(buffer_).substr(done_);
      // Before an element only the array's brackets, commas and spaces: its '{' is the first.
      const std::size_t open = rest.find('{');
      if (open == std::string_view::npos) {
        done_ = buffer_.size();
        return;
      }
      const std::size_t length = json_container_end(rest.substr(open));
      if (length == std::string_view::npos) {
        done_ += open;
        return;
      }
      emit_json_call(rest.substr(open, length), "parameters", out);
      done_ += open + length;
    }
  }
};

}  // namespace

std::unique_ptr<ToolCallParser> make_forced_tool_call_parser(const ForcedToolChoice& choice,
                                                             ToolCallOptions options) {
  if (choice.name.empty()) return std::make_unique<RequiredToolCallParser>(options);
  return std::make_unique<NamedToolCallParser>(choice.name, options);
}

}  // namespace capserve::server::chat_output
