#pragma once
// Status-style results for operations whose failure a caller must handle (a step that does not fit the cache,
// a request beyond the context length), as opposed to load-time LoadError.
#include <string>
#include <utility>

namespace capserve::runtime {

enum class StatusCode { ok, invalid_argument, resource_exhausted, internal };

class [[nodiscard]] Status {
 public:
  Status() = default;
  static Status invalid_argument(std::string message) {
    return {StatusCode::invalid_argument, std::move(message)};
  }
  static Status resource_exhausted(std::string message) {
    return {StatusCode::resource_exhausted, std::move(message)};
  }
  static Status internal(std::string message) { return {StatusCode::internal, std::move(message)}; }

  [[nodiscard]] bool ok() const { return code_ == StatusCode::ok; }
  [[nodiscard]] StatusCode code() const { return code_; }
  [[nodiscard]] const std::string& message() const { return message_; }

 private:
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}
  StatusCode code_ = StatusCode::ok;
  std::string message_;
};

}  // namespace capserve::runtime
