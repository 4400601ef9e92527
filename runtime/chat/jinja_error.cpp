#include "runtime/chat/jinja_error.h"

#include <utility>

namespace capserve::runtime::jinja {
namespace {

std::string describe(ErrorKind kind, const std::string& message, int line, const std::string& construct) {
  std::string out(error_class(kind));
  if (line > 0) out += " at template line " + std::to_string(line);
  if (!construct.empty()) out += " in " + construct;
  return out + ": " + message;
}

}  // namespace

std::string_view error_class(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::syntax_error:
      return "TemplateSyntaxError";
    case ErrorKind::template_error:
      return "TemplateError";
    case ErrorKind::runtime_error:
      return "TemplateRuntimeError";
    case ErrorKind::undefined_error:
      return "UndefinedError";
    case ErrorKind::type_error:
      return "TypeError";
    case ErrorKind::value_error:
      return "ValueError";
    case ErrorKind::zero_division:
      return "ZeroDivisionError";
    case ErrorKind::security_error:
      return "SecurityError";
    case ErrorKind::limit_error:
      return "LimitError";
  }
  return "Error";
}

Error::Error(ErrorKind kind, std::string message, int line, std::string construct)
    : std::runtime_error(describe(kind, message, line, construct)),
      kind_(kind),
      message_(std::move(message)),
      line_(line),
      construct_(std::move(construct)) {}

Error Error::at(int line, std::string construct) const {
  return line_ > 0 ? *this : Error(kind_, message_, line, std::move(construct));
}

}  // namespace capserve::runtime::jinja
