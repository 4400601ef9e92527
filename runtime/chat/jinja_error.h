#pragma once
// The errors a Jinja2 template raises, by the Python exception class Jinja2 raises for the same fault, so a
// caller (and the golden test) can tell a template's own raise_exception from a template bug.
#include <stdexcept>
#include <string>
#include <string_view>

namespace capserve::runtime::jinja {

enum class ErrorKind {
  syntax_error,     // TemplateSyntaxError: the template does not parse
  template_error,   // TemplateError: raise_exception(message) in the template
  runtime_error,    // TemplateRuntimeError: e.g. assigning an attribute of something not a namespace
  undefined_error,  // UndefinedError: using an undefined value beyond printing or testing it
  type_error,       // TypeError: e.g. None + "text", iterating over None
  value_error,      // ValueError: e.g. unpacking a pair into three names
  zero_division,    // ZeroDivisionError
  security_error,   // SecurityError: the immutable sandbox refused an operation
  limit_error,      // the render exceeded a bound (recursion depth, output size, loop iterations)
};

// The Python exception class name of `kind` ("TemplateError", "UndefinedError", ...).
[[nodiscard]] std::string_view error_class(ErrorKind kind);

class Error : public std::runtime_error {
 public:
  // `line` is the template line (1-based) of the construct that failed, 0 while not yet known; `construct`
  // names it ("filter 'tojson'", "{% for %}").
  Error(ErrorKind kind, std::string message, int line = 0, std::string construct = {});

  [[nodiscard]] ErrorKind kind() const { return kind_; }
  [[nodiscard]] int line() const { return line_; }
  // The message as Python would give it, without the line.
  [[nodiscard]] const std::string& message() const { return message_; }
  [[nodiscard]] const std::string& construct() const { return construct_; }
  // The same error with the line and construct filled in where they were not known yet.
  [[nodiscard]] Error at(int line, std::string construct) const;

 private:
  ErrorKind kind_;
  std::string message_;
  int line_;
  std::string construct_;
};

}  // namespace capserve::runtime::jinja
