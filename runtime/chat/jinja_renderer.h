#pragma once
// Walks a parsed template (jinja_ast.h) with Jinja2's semantics: scoping (a for-loop iteration and a macro
// call get their own scope, if does not), loop.* variables, macros and caller(), and the sandbox's attribute
// rules. One Renderer renders one template once; it is cheap to make.
#include <cstddef>
#include <cstdint>
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

// What one render may cost. Templates come from --chat-template and from checkpoints, messages and tools from
// clients: all untrusted. Every bound is checked before the work or the allocation it guards, with
// overflow-checked sizes; a render past one fails with LimitError (the server answers 400). The defaults
// leave every template of the real corpus with realistic conversations (up to a 4 MiB request's 200k messages
// or 60k tool properties) unaffected, and stop a hostile template within about a second and 64 MiB.
struct RenderOptions {
  // strftime_now's clock (local time); the system clock when empty.
  std::function<std::tm()> now;
  // The rendered text, in bytes.
  std::size_t max_output_bytes = std::size_t{16} << 20;
  // Any one value the template builds: a string's bytes; a list's or dict's elements at sizeof(Value) each,
  // plus the bytes of the strings it holds directly (copying the list copies them).
  std::size_t max_value_bytes = std::size_t{16} << 20;
  // Work units of one render: one per statement or expression evaluated, one per element and one per
  // kBytesPerStep bytes that an operator, filter or method produces.
  std::uint64_t max_steps = 40'000'000;
  // Macro call depth, and for-loop iterations of one render.
  int max_call_depth = 100;
  std::size_t max_loop_iterations = 1'000'000;
  // Cancels the render (LimitError) when requested, e.g. because the client that asked for it has gone;
  // checked where the bounds are.
  std::stop_token stop = {};
};

// The bytes that count as one work unit: copying them costs about what evaluating one expression does.
inline constexpr std::size_t kBytesPerStep = 16;

// What looking through `v` once costs, in work units: a string's bytes / kBytesPerStep, a list's or dict's
// elements, 1 for anything else. A method or comparison is charged this for its operands; a filter or test
// for its string operands, and for a list or dict where it walks one (Renderer::items).
[[nodiscard]] std::uint64_t work(const Value& v);
[[nodiscard]] std::uint64_t work(const Args& args);

// a * b and a + b, saturating at SIZE_MAX (which every bound refuses) instead of wrapping.
[[nodiscard]] constexpr std::size_t size_mul(std::size_t a, std::size_t b) {
  std::size_t r = 0;
  return __builtin_mul_overflow(a, b, &r) ? SIZE_MAX : r;
}
[[nodiscard]] constexpr std::size_t size_add(std::size_t a, std::size_t b) {
  std::size_t r = 0;
  return __builtin_add_overflow(a, b, &r) ? SIZE_MAX : r;
}

class Renderer {
 public:
  // Renders onto `out`, whose client ranges collect the bytes that came from client strs.
  Renderer(const Dict& context, const RenderOptions& options, Str& out);

  // Renders `body` in the current scope onto the output.
  void render(const Body& body);

  [[nodiscard]] Value eval(const Expr& e);

  // Calls `macro` (a StmtKind::macro) and returns what it rendered; `caller` is its caller() or null. The
  // arguments are moved into the macro's scope.
  [[nodiscard]] Value call_macro(const Stmt& macro, Args& args, std::shared_ptr<const Callable> caller);
  // Renders a call block's body for caller(args), in the scope the call block ran in.
  [[nodiscard]] Value call_caller(const Stmt& block, int scope, Args& args);
  // Calls any callable value (a macro, a global, a bound method).
  [[nodiscard]] Value call(const Value& fn, Args& args);

  [[nodiscard]] const RenderOptions& options() const { return options_; }
  // Counts `units` of work against the step budget, raising LimitError past it or once options().stop is
  // requested. Every budget check of a render goes through here, so that a render can be stopped at any of
  // them.
  void charge(std::uint64_t units);
  // Before a value of `bytes` is built (list_bytes() for a list or dict): raises LimitError when it would
  // exceed max_value_bytes, else charges its bytes as work.
  void produce(std::size_t bytes);
  // What produce() counts for a list or dict of `elements` holding `string_bytes` of strings directly.
  [[nodiscard]] static std::size_t list_bytes(std::size_t elements, std::size_t string_bytes);
  // What produce() counts for a str of `text_bytes` holding up to `client_ranges` client ranges: a hostile
  // template must not grow the ranges unbounded either.
  [[nodiscard]] static std::size_t str_bytes(std::size_t text_bytes, std::size_t client_ranges);
  [[nodiscard]] static std::size_t str_bytes(const Str& s) {
    return str_bytes(s.text.size(), s.client.size());
  }
  // iterate(v) for walking it, charged as work(v); refuses beforehand what would build a list past
  // max_value_bytes (a string's characters, a dict's keys).
  [[nodiscard]] std::shared_ptr<const List> items(const Value& v);
  // Before str(v) of a list, dict or namespace is built: refuses one whose text would pass max_value_bytes
  // (containers that share their items print exponentially larger than they are).
  void check_text(const Value& v);

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
  std::vector<std::pair<std::string_view, Value>> bind_params(const Stmt& callee, Args& args);

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
  // Counts `bytes` written anywhere against the output bound and as work.
  void count_output(std::size_t bytes);
  int push_frame(int parent, const LoopState* loop = nullptr);
  void pop_frame(int saved_top);

  const Dict& context_;
  const RenderOptions& options_;
  Str* target_;               // where write() goes: out_, or a macro's or block's capture buffer
  std::size_t produced_ = 0;  // bytes written anywhere, for the output bound
  std::vector<Frame> frames_;
  int top_ = -1;
  int call_depth_ = 0;
  std::size_t loop_iterations_ = 0;
  std::uint64_t steps_ = 0;
};

}  // namespace capserve::runtime::jinja
