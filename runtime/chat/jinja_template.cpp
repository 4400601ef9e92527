#include "runtime/chat/jinja_template.h"

#include "runtime/chat/jinja_parser.h"

namespace capserve::runtime::jinja {

Template::Template(std::string_view source) : body_(std::make_shared<const Body>(parse_template(source))) {}

Str Template::render(const Dict& context, const RenderOptions& options) const {
  Str out;
  Renderer renderer(context, options, out);
  renderer.render(*body_);
  return out;
}

}  // namespace capserve::runtime::jinja
