#pragma once
// Status-style results for operations whose failure a caller must handle (a step that does not fit the cache,
// a request beyond the context length, a client request the server refuses), as opposed to load-time
// LoadError. One vocabulary for runtime/ and server/: the codes are gRPC's (the HTTP API maps them onto its
// statuses), and a status may name the request field at fault as the client spells it.
#include <string>
#include <utility>
#include <variant>

namespace capserve::runtime {

enum class StatusCode {
  ok,
  invalid_argument,
  resource_exhausted,
  internal,
  unavailable,
  failed_precondition,
  cancelled,
  deadline_exceeded
};

// The gRPC name of a code ("INVALID_ARGUMENT"), as logs and the error metrics label it.
constexpr const char* code_name(StatusCode code) {
  switch (code) {
    case StatusCode::ok:
      return "OK";
    case StatusCode::invalid_argument:
      return "INVALID_ARGUMENT";
    case StatusCode::resource_exhausted:
      return "RESOURCE_EXHAUSTED";
    case StatusCode::unavailable:
      return "UNAVAILABLE";
    case StatusCode::failed_precondition:
      return "FAILED_PRECONDITION";
    case StatusCode::cancelled:
      return "CANCELLED";
    case StatusCode::deadline_exceeded:
      return "DEADLINE_EXCEEDED";
    case StatusCode::internal:
      break;
  }
  return "INTERNAL";
}

class [[nodiscard]] Status {
 public:
  Status() = default;
  // `field`: the request field at fault, as its front end spells it ("sampling.top_p", "top_p"); empty when
  // none.
  Status(StatusCode code, std::string message, std::string field = {})
      : code_(code), message_(std::move(message)), field_(std::move(field)) {}
  static Status invalid_argument(std::string message, std::string field = {}) {
    return {StatusCode::invalid_argument, std::move(message), std::move(field)};
  }
  static Status resource_exhausted(std::string message) {
    return {StatusCode::resource_exhausted, std::move(message)};
  }
  static Status internal(std::string message) { return {StatusCode::internal, std::move(message)}; }

  [[nodiscard]] bool ok() const { return code_ == StatusCode::ok; }
  [[nodiscard]] StatusCode code() const { return code_; }
  [[nodiscard]] const std::string& message() const { return message_; }
  [[nodiscard]] const std::string& field() const { return field_; }
  // The same error blamed on another field (a front end's own spelling of it).
  [[nodiscard]] Status with_field(std::string field) && {
    field_ = std::move(field);
    return std::move(*this);
  }

 private:
  StatusCode code_ = StatusCode::ok;
  std::string message_;
  std::string field_;
};

// A value, or the error status that stands in its place (never an ok status): what a fallible function
// returns instead of filling an out-parameter.
template <typename T>
class [[nodiscard]] StatusOr {
 public:
  StatusOr(T value) : v_(std::move(value)) {}       // NOLINT(google-explicit-constructor): returned as T
  StatusOr(Status error) : v_(std::move(error)) {}  // NOLINT(google-explicit-constructor): returned as Status

  [[nodiscard]] bool ok() const { return std::holds_alternative<T>(v_); }
  [[nodiscard]] const Status& status() const { return std::get<Status>(v_); }
  [[nodiscard]] Status&& take_status() && { return std::get<Status>(std::move(v_)); }
  [[nodiscard]] T& value() { return std::get<T>(v_); }
  [[nodiscard]] const T& value() const { return std::get<T>(v_); }
  T& operator*() { return value(); }
  const T& operator*() const { return value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }

 private:
  std::variant<T, Status> v_;
};

}  // namespace capserve::runtime
