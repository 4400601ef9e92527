#pragma once
// A compiled Jinja2 template: parsed once, rendered any number of times, from any number of threads at once
// (the tree is immutable; each render has its own scopes). Renders byte for byte what Python Jinja2 renders
// in transformers' chat-template environment (ImmutableSandboxedEnvironment, trim_blocks, lstrip_blocks,
// loopcontrols, {% generation %}, transformers' tojson / raise_exception / strftime_now / namespace / dict).
#include <memory>
#include <string>
#include <string_view>

#include "runtime/chat/jinja_ast.h"
#include "runtime/chat/jinja_renderer.h"

namespace capserve::runtime::jinja {

class Template {
 public:
  // Throws Error(syntax_error) naming the line.
  explicit Template(std::string_view source);

  // The template rendered with `context` as its variables, and which of its bytes came from client strs in
  // the context. Throws Error with the Python exception class Jinja2 raises (raise_exception:
  // template_error) and the template line; LimitError past `options`' bounds.
  [[nodiscard]] Str render(const Dict& context, const RenderOptions& options = {}) const;

 private:
  std::shared_ptr<const Body> body_;
};

}  // namespace capserve::runtime::jinja
