#pragma once
// Walks a parsed template (jinja_ast.h) with Jinja2's semantics: scoping (a for-loop iteration and a macro
// call get their own scope, if does not), loop.* variables, macros and caller(), and the sandbox's attribute
// rules. One Renderer renders one template once; it is cheap to make.
#include <cstddef>
#include <ctime>
#include <functional>
#include <memory>
#include <stop_token>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "runtime/chat/jinja_ast.h"

namespace capserve::runtime::jinja {

struct RenderOptions {
  // strftime_now's clock (local time); the system clock when empty.
  std::function<std::tm()> now;
  // Bounds on a runaway template: rendered bytes, macro call depth and for-loop iterations of one render.
  std::size_t max_output_bytes = std::size_t{64} << 20;
  int max_call_depth = 100;
  std::size_t max_loop_iterations = 1'000'000;
  // Cancels the render (LimitError) when requested, e.g. because the client that asked for it has gone;
  // checked where the bounds are.
  std::stop_token stop = {};
};

class Renderer {
 public:
  // Renders onto `out`, whose client ranges collect the bytes that came from client strs.
  Renderer(const Dict& context, const RenderOptions& options, Str& out);

  // Renders `body` in the current scope onto the output.
  void render(const Body& body);

  [[nodiscard]] Value eval(const Expr& e);

  // Calls `macro` (a StmtKind::macro) and returns what it rendered; `caller` is its caller() or null.
  [[nodiscard]] Value call_macro(const Stmt& macro, const Args& args, std::shared_ptr<const Callable> caller);
  // Renders a call block's body for caller(args), in the scope the call block ran in.
  [[nodiscard]] Value call_caller(const Stmt& block, int scope, const Args& args);
  // Calls any callable value (a macro, a global, a bound method).
  [[nodiscard]] Value call(const Value& fn, Args& args);

  [[nodiscard]] const RenderOptions& options() const { return options_; }
  // Raises LimitError when a value of `bytes` would exceed the output bound, or the render is cancelled.
  void check_size(std::size_t bytes) const;

 private:
  enum class Flow { normal, break_, continue_ };

  struct LoopState {
    const List* items;
    std::size_t index;
  };

  struct Frame {
    std::vector<std::pair<std::string_view, Value>> vars;
    int parent;  // the enclosing scope, -1 past the template's top level
    const LoopState* loop = nullptr;
  };

  Flow render_body(const Body& body);
  Flow render_stmt(const Stmt& s);
  Flow render_for(const Stmt& s);
  void render_set(const Stmt& s);
  // Renders `body` in a new scope (parented by `parent`, holding `vars`) into a string.
  Str capture(const Body& body, int parent, std::vector<std::pair<std::string_view, Value>> vars);
  // The filter chain `f` (whose innermost operand is null) applied to `operand`.
  Value apply_filters(const Expr& f, Value operand);
  std::vector<std::pair<std::string_view, Value>> bind_params(const Stmt& callee, const Args& args);

  Value eval_node(const Expr& e);
  // A pointer to the value of `e`: into the scope or a container where it is one, else into `storage`.
  const Value* eval_ref(const Expr& e, Value& storage);
  Value eval_call(const Expr& e);
  Args eval_args(const Expr& e, std::size_t first);
  // obj.name and obj[key] with Jinja's sandboxed lookup; `temporary`: obj dies with the caller's storage, so
  // the result is copied into `storage`.
  const Value* get_attr(const Value& obj, std::string_view name, bool temporary, Value& storage);
  const Value* get_item(const Value& obj, const Value& key, bool temporary, Value& storage);

  const Value* lookup(std::string_view name, Value& storage);
  // The innermost loop's state, unless a variable named "loop" hides it.
  const LoopState* find_loop() const;
  Value loop_attr(const LoopState& loop, std::string_view attr) const;
  void assign(std::string_view name, Value value);
  void bind_targets(const std::vector<std::string>& targets, const Value& value);
  void write(std::string_view text);  // template text
  void write(const Str& text);
  int push_frame(int parent, const LoopState* loop = nullptr);
  void pop_frame(int saved_top);
  // Raises LimitError once options_.stop is requested.
  void check_stop() const;

  const Dict& context_;
  const RenderOptions& options_;
  Str* target_;               // where write() goes: out_, or a macro's or block's capture buffer
  std::size_t produced_ = 0;  // bytes written anywhere, for the output bound
  std::vector<Frame> frames_;
  int top_ = -1;
  int call_depth_ = 0;
  std::size_t loop_iterations_ = 0;
};

}  // namespace capserve::runtime::jinja
