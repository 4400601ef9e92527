#include "runtime/chat/jinja_renderer.h"

#include "runtime/chat/jinja_globals.h"
#include "runtime/chat/jinja_methods.h"
#include "runtime/chat/jinja_operators.h"

namespace capserve::runtime::jinja {
namespace {

[[noreturn]] void fail(ErrorKind kind, std::string message, int line = 0) {
  throw Error(kind, std::move(message), line);
}

// What a macro call costs in steps (a new scope, its arguments bound, a capture buffer), measured against
// evaluating an expression.
constexpr std::uint64_t kCallSteps = 32;

struct MacroFn final : Callable {
  explicit MacroFn(const Stmt& m) : macro(m) {}
  Value call(Renderer& r, Args& args) const override { return r.call_macro(macro, args, nullptr); }
  std::string_view name() const override { return macro.text; }
  const Stmt& macro;
};

struct CallerFn final : Callable {
  CallerFn(const Stmt& b, int s) : block(b), scope(s) {}
  Value call(Renderer& r, Args& args) const override { return r.call_caller(block, scope, args); }
  std::string_view name() const override { return "caller"; }
  const Stmt& block;
  int scope;
};

// What an error message calls the statement or expression that failed.
std::string describe(const Stmt& s) {
  switch (s.kind) {
    case StmtKind::print:
      return "{{ ... }}";
    case StmtKind::if_:
      return "{% if %}";
    case StmtKind::for_:
      return "{% for %}";
    case StmtKind::set:
    case StmtKind::set_block:
      return "{% set %}";
    case StmtKind::macro:
      return "{% macro " + s.text + " %}";
    case StmtKind::call_block:
      return "{% call %}";
    case StmtKind::generation:
      return "{% generation %}";
    case StmtKind::filter_block:
      return "{% filter %}";
    default:
      return "template text";
  }
}

std::string describe(const Expr& e) {
  switch (e.kind) {
    case ExprKind::name:
      return "name '" + e.name + "'";
    case ExprKind::attr:
      return "attribute '" + e.name + "'";
    case ExprKind::item:
      return "subscript";
    case ExprKind::slice:
      return "slice";
    case ExprKind::call: {
      const Expr& callee = *e.args[0];
      if (callee.kind == ExprKind::name || callee.kind == ExprKind::attr)
        return "call of '" + callee.name + "'";
      return "call";
    }
    case ExprKind::filter:
      return "filter '" + e.name + "'";
    case ExprKind::test:
      return "test '" + e.name + "'";
    case ExprKind::binary: {
      static constexpr const char* kOps[] = {"+", "-", "*", "/", "//", "%", "**"};
      return std::string("operator '") + kOps[static_cast<int>(e.op)] + "'";
    }
    case ExprKind::compare:
      return "comparison";
    case ExprKind::concat:
      return "operator '~'";
    case ExprKind::neg:
    case ExprKind::pos:
      return "unary operator";
    default:
      return "expression";
  }
}

bool is_loop_name(const Expr& e) {
  return e.kind == ExprKind::name && e.name == "loop";
}

Undefined no_attribute(const Value& obj, std::string_view attr) {
  return {object_description(obj) + " has no attribute '" + std::string(attr) + "'"};
}

// Containers nested deeper than this (or containing themselves, through a namespace) are not printed:
// printing recurses once per level.
constexpr int kMaxPrintDepth = 256;

// At least the bytes repr(v) has, counted up to `limit` only: a walk of O(limit) however large the text.
std::size_t repr_floor(const Value& v, std::size_t limit, int depth) {
  if (v.is_string()) return v.str().size();
  if (!v.is_list() && !v.is_dict() && !v.is_namespace()) return 1;
  if (depth > kMaxPrintDepth) {
    fail(ErrorKind::limit_error, "a value nests deeper than " + std::to_string(kMaxPrintDepth) +
                                     " levels, or contains itself, and cannot be printed");
  }
  std::size_t bytes = 2;
  if (v.is_list()) {
    for (const Value& item : v.list()) {
      if (bytes > limit) break;
      bytes += 2 + repr_floor(item, limit - bytes, depth + 1);
    }
  } else {
    for (const auto& [key, item] : (v.is_dict() ? v.dict() : v.ns().attrs).items) {
      if (bytes > limit) break;
      bytes += 4 + repr_floor(key, limit - bytes, depth + 1) + repr_floor(item, limit - bytes, depth + 1);
    }
  }
  return bytes;
}

}  // namespace

std::uint64_t work(const Value& v) {
  if (v.is_string()) return 1 + v.str().size() / kBytesPerStep;
  if (v.is_list()) return 1 + v.list().size();
  if (v.is_dict()) return 1 + v.dict().items.size();
  if (v.is_namespace()) return 1 + v.ns().attrs.items.size();
  return 1;
}

// A filter's or test's operands: strings cost what reading them does; a filter that walks a list or dict is
// charged for it by Renderer::items, so that O(1) ones (length, first, last) stay O(1) on long lists.
std::uint64_t operand_work(const Value& v) {
  return v.is_string() ? work(v) : 1;
}

std::uint64_t work(const Args& args) {
  std::uint64_t units = 0;
  for (const Value& v : args.positional) units += work(v);
  for (const auto& [key, v] : args.keyword) units += work(v);
  return units;
}

Renderer::Renderer(const Dict& context, const RenderOptions& options, Str& out)
    : context_(context), options_(options), target_(&out) {
  frames_.reserve(16);
  push_frame(-1);
}

int Renderer::push_frame(int parent, const LoopState* loop) {
  frames_.push_back({{}, parent, loop});
  top_ = static_cast<int>(frames_.size()) - 1;
  return top_;
}

void Renderer::pop_frame(int saved_top) {
  frames_.pop_back();
  top_ = saved_top;
}

void Renderer::charge(std::uint64_t units) {
  if (options_.stop.stop_requested()) fail(ErrorKind::limit_error, "the render was cancelled");
  steps_ += units;
  if (steps_ > options_.max_steps) {
    fail(ErrorKind::limit_error,
         "the chat template exceeded its work budget (" + std::to_string(options_.max_steps) + " steps)");
  }
}

void Renderer::produce(std::size_t bytes) {
  if (bytes > options_.max_value_bytes) {
    fail(ErrorKind::limit_error,
         "a value would exceed " + std::to_string(options_.max_value_bytes) + " bytes (" +
             (bytes == SIZE_MAX ? std::string("overflow") : std::to_string(bytes)) + " asked)");
  }
  charge(bytes / kBytesPerStep);
}

std::shared_ptr<const List> Renderer::items(const Value& v) {
  charge(work(v));
  if (v.is_string()) produce(list_bytes(code_point_count(v.str()), v.str().size()));
  if (v.is_dict()) produce(list_bytes(v.dict().items.size(), 0));
  return iterate(v);
}

void Renderer::check_text(const Value& v) {
  if (!v.is_list() && !v.is_dict() && !v.is_namespace()) return;
  const std::size_t floor = repr_floor(v, options_.max_value_bytes, 0);
  produce(floor > options_.max_value_bytes ? floor : 0);
}

std::size_t Renderer::list_bytes(std::size_t elements, std::size_t string_bytes) {
  return size_add(size_mul(elements, sizeof(Value)), string_bytes);
}

std::size_t Renderer::str_bytes(std::size_t text_bytes, std::size_t client_ranges) {
  return size_add(text_bytes, size_mul(client_ranges, sizeof(TextRange)));
}

void Renderer::write(std::string_view text) {
  count_output(text.size());
  append(*target_, text);
}

void Renderer::write(const Str& text) {
  count_output(text.text.size());
  // The client ranges cost memory too: the output's, like any value's, stay within max_value_bytes.
  const std::size_t range_bytes =
      size_mul(size_add(target_->client.size(), text.client.size()), sizeof(TextRange));
  if (range_bytes > options_.max_value_bytes) produce(range_bytes);
  append(*target_, text);
}

void Renderer::count_output(std::size_t bytes) {
  produced_ = size_add(produced_, bytes);
  if (produced_ > options_.max_output_bytes) {
    fail(ErrorKind::limit_error,
         "the rendered text would exceed " + std::to_string(options_.max_output_bytes) + " bytes");
  }
  charge(bytes / kBytesPerStep);
}

void Renderer::render(const Body& body) {
  (void)render_body(body);
}

Renderer::Flow Renderer::render_body(const Body& body) {
  for (const StmtPtr& s : body) {
    const Flow flow = render_stmt(*s);
    if (flow != Flow::normal) return flow;
  }
  return Flow::normal;
}

Renderer::Flow Renderer::render_stmt(const Stmt& s) {
  try {
    charge(1);
    switch (s.kind) {
      case StmtKind::text:
        write(s.text);
        return Flow::normal;
      case StmtKind::print: {
        Value storage;
        const Value* v = eval_ref(*s.expr, storage);
        if (v->is_string()) {
          write(v->marked());
        } else {
          check_text(*v);
          write(to_marked_str(*v));
        }
        return Flow::normal;
      }
      case StmtKind::if_: {
        Value storage;
        return render_body(truthy(*eval_ref(*s.expr, storage)) ? s.body : s.else_body);
      }
      case StmtKind::for_:
        return render_for(s);
      case StmtKind::set:
        render_set(s);
        return Flow::normal;
      case StmtKind::set_block: {
        Value v = capture(s.body, top_, {});
        if (s.expr) v = apply_filters(*s.expr, std::move(v));
        assign(s.targets[0], std::move(v));
        return Flow::normal;
      }
      case StmtKind::macro:
        assign(s.text, Value(std::shared_ptr<const Callable>(std::make_shared<const MacroFn>(s))));
        return Flow::normal;
      case StmtKind::call_block: {
        const Value fn = eval(*s.expr->args[0]);
        Args args = eval_args(*s.expr, 1);
        const auto* macro = fn.is_callable() ? dynamic_cast<const MacroFn*>(&fn.callable()) : nullptr;
        if (macro == nullptr) fail(ErrorKind::type_error, "a call block needs a macro to call");
        const Value v = call_macro(macro->macro, args, std::make_shared<const CallerFn>(s, top_));
        write(v.marked());
        return Flow::normal;
      }
      case StmtKind::generation:
        write(capture(s.body, top_, {}));
        return Flow::normal;
      case StmtKind::filter_block: {
        const Value v = apply_filters(*s.expr, capture(s.body, top_, {}));
        write(to_marked_str(v));
        return Flow::normal;
      }
      case StmtKind::break_:
        return Flow::break_;
      case StmtKind::continue_:
        return Flow::continue_;
    }
  } catch (const Error& e) {
    if (e.line() == 0) throw e.at(s.line, describe(s));
    throw;
  }
  return Flow::normal;
}

Value Renderer::apply_filters(const Expr& f, Value operand) {
  if (f.args[0]) operand = apply_filters(*f.args[0], std::move(operand));
  const Args args = eval_args(f, 1);
  charge(operand_work(operand) + work(args));
  return f.filter(*this, operand, args);
}

Renderer::Flow Renderer::render_for(const Stmt& s) {
  std::shared_ptr<const List> items = this->items(eval(*s.expr));
  const int saved_top = top_;
  if (s.cond) {
    auto kept = std::make_shared<List>();
    for (const Value& item : *items) {
      push_frame(saved_top);
      bind_targets(s.targets, item);
      Value storage;
      if (truthy(*eval_ref(*s.cond, storage))) kept->push_back(item);
      pop_frame(saved_top);
    }
    items = std::move(kept);
  }
  if (items->empty()) return render_body(s.else_body);
  LoopState state{items.get(), 0};
  for (std::size_t i = 0; i < items->size(); ++i) {
    charge(1);  // an iteration is work even with an empty body (and a stop is seen here)
    if (++loop_iterations_ > options_.max_loop_iterations) {
      fail(ErrorKind::limit_error,
           "the template ran more than " + std::to_string(options_.max_loop_iterations) + " loop iterations");
    }
    state.index = i;
    push_frame(saved_top, &state);
    bind_targets(s.targets, (*items)[i]);
    const Flow flow = render_body(s.body);
    pop_frame(saved_top);
    if (flow == Flow::break_) break;
  }
  return Flow::normal;
}

void Renderer::render_set(const Stmt& s) {
  if (s.attr.empty()) {
    bind_targets(s.targets, eval(*s.expr));
    return;
  }
  Value value = eval(*s.expr);
  Value storage;
  const Value* target = lookup(s.targets[0], storage);
  if (!target->is_namespace())
    fail(ErrorKind::runtime_error, "cannot assign attribute on non-namespace object");
  if (s.attr.starts_with('_')) {
    fail(ErrorKind::security_error,
         "Chat templates cannot store underscore-prefixed attributes on a namespace, "
         "but got '" +
             s.attr + "'. Please rename the attribute.");
  }
  target->ns().attrs.set(s.attr, std::move(value));
}

void Renderer::assign(std::string_view name, Value value) {
  for (auto& [k, v] : frames_[static_cast<std::size_t>(top_)].vars) {
    if (k == name) {
      v = std::move(value);
      return;
    }
  }
  frames_[static_cast<std::size_t>(top_)].vars.emplace_back(name, std::move(value));
}

void Renderer::bind_targets(const std::vector<std::string>& targets, const Value& value) {
  if (targets.size() == 1) {
    assign(targets[0], value);
    return;
  }
  const std::shared_ptr<const List> items = this->items(value);
  if (items->size() < targets.size()) {
    fail(ErrorKind::value_error, "not enough values to unpack (expected " + std::to_string(targets.size()) +
                                     ", got " + std::to_string(items->size()) + ")");
  }
  if (items->size() > targets.size()) {
    fail(ErrorKind::value_error,
         "too many values to unpack (expected " + std::to_string(targets.size()) + ")");
  }
  for (std::size_t i = 0; i < targets.size(); ++i) assign(targets[i], (*items)[i]);
}

Str Renderer::capture(const Body& body, int parent, std::vector<std::pair<std::string_view, Value>> vars) {
  Str buffer;
  Str* const saved_target = std::exchange(target_, &buffer);
  const int saved_top = top_;
  push_frame(parent);
  frames_.back().vars = std::move(vars);
  (void)render_body(body);
  pop_frame(saved_top);
  target_ = saved_target;
  return buffer;
}

std::vector<std::pair<std::string_view, Value>> Renderer::bind_params(const Stmt& callee, Args& args) {
  const std::vector<Param>& params = callee.params;
  if (args.positional.size() > params.size()) {
    fail(ErrorKind::type_error,
         "macro '" + callee.text + "' takes not more than " + std::to_string(params.size()) + " argument(s)");
  }
  for (const auto& [key, value] : args.keyword) {
    bool known = false;
    for (const Param& p : params) known = known || p.name == key;
    if (!known)
      fail(ErrorKind::type_error, "macro '" + callee.text + "' takes no keyword argument '" + key + "'");
  }
  std::vector<std::pair<std::string_view, Value>> vars;
  vars.reserve(params.size() + 1);
  for (std::size_t i = 0; i < params.size(); ++i) {
    if (const Value* v = args.get(i, params[i].name)) {
      // Moved, not copied: a macro recursing on a growing string would otherwise hold it twice per level.
      vars.emplace_back(params[i].name, std::move(const_cast<Value&>(*v)));
    } else if (params[i].default_value) {
      vars.emplace_back(params[i].name, eval(*params[i].default_value));
    } else {
      vars.emplace_back(params[i].name, Undefined{"'" + params[i].name + "' is undefined"});
    }
  }
  return vars;
}

Value Renderer::call_macro(const Stmt& macro, Args& args, std::shared_ptr<const Callable> caller) {
  if (call_depth_ >= options_.max_call_depth) {
    fail(ErrorKind::limit_error, "macro calls nested deeper than " + std::to_string(options_.max_call_depth));
  }
  // A call allocates a scope and a capture buffer: about the work of kCallSteps expressions.
  charge(kCallSteps);
  auto vars = bind_params(macro, args);
  if (caller) vars.emplace_back("caller", Value(std::move(caller)));
  ++call_depth_;
  Str text = capture(macro.body, 0, std::move(vars));
  --call_depth_;
  return text;
}

Value Renderer::call_caller(const Stmt& block, int scope, Args& args) {
  if (call_depth_ >= options_.max_call_depth) {
    fail(ErrorKind::limit_error, "macro calls nested deeper than " + std::to_string(options_.max_call_depth));
  }
  charge(kCallSteps);
  auto vars = bind_params(block, args);
  ++call_depth_;
  Str text = capture(block.body, scope, std::move(vars));
  --call_depth_;
  return text;
}

Value Renderer::call(const Value& fn, Args& args) {
  if (fn.is_callable()) return fn.callable().call(*this, args);
  require_defined(fn);
  fail(ErrorKind::type_error, "'" + std::string(type_name(fn)) + "' object is not callable");
}

const Renderer::LoopState* Renderer::find_loop() const {
  for (int i = top_; i >= 0; i = frames_[static_cast<std::size_t>(i)].parent) {
    const Frame& f = frames_[static_cast<std::size_t>(i)];
    for (const auto& entry : f.vars) {
      if (entry.first == "loop") return nullptr;
    }
    if (f.loop != nullptr) return f.loop;
  }
  return nullptr;
}

const Value* Renderer::lookup(std::string_view name, Value& storage) {
  for (int i = top_; i >= 0; i = frames_[static_cast<std::size_t>(i)].parent) {
    Frame& f = frames_[static_cast<std::size_t>(i)];
    for (auto& [k, v] : f.vars) {
      if (k == name) return &v;
    }
    if (f.loop != nullptr && name == "loop") {
      Dict d;
      for (const char* attr : {"index", "index0", "revindex", "revindex0", "first", "last", "length",
                               "previtem", "nextitem", "depth", "depth0"}) {
        d.set(attr, loop_attr(*f.loop, attr));
      }
      storage = std::move(d);
      return &storage;
    }
  }
  if (const Value* v = context_.find(name)) return v;
  if (std::optional<Value> g = find_global(name)) {
    storage = std::move(*g);
    return &storage;
  }
  storage = Undefined{"'" + std::string(name) + "' is undefined"};
  return &storage;
}

Value Renderer::loop_attr(const LoopState& loop, std::string_view attr) const {
  const auto n = static_cast<std::int64_t>(loop.items->size());
  const auto i = static_cast<std::int64_t>(loop.index);
  if (attr == "index") return i + 1;
  if (attr == "index0") return i;
  if (attr == "revindex") return n - i;
  if (attr == "revindex0") return n - i - 1;
  if (attr == "first") return i == 0;
  if (attr == "last") return i == n - 1;
  if (attr == "length") return n;
  if (attr == "depth") return 1;
  if (attr == "depth0") return 0;
  if (attr == "previtem") {
    return i > 0 ? (*loop.items)[loop.index - 1] : Value(Undefined{"there is no previous item"});
  }
  if (attr == "nextitem") {
    return i + 1 < n ? (*loop.items)[loop.index + 1] : Value(Undefined{"there is no next item"});
  }
  return Undefined{"'LoopContext object' has no attribute '" + std::string(attr) + "'"};
}

const Value* Renderer::get_attr(const Value& obj, std::string_view name, bool temporary, Value& storage) {
  require_defined(obj);
  const Value* found = nullptr;
  if (obj.is_dict() || obj.is_namespace()) {
    if (obj.is_dict()) {
      if (std::optional<Value> method = bound_method(obj, name)) {
        storage = std::move(*method);
        return &storage;
      }
    }
    const Dict& d = obj.is_dict() ? obj.dict() : obj.ns().attrs;
    // A dict looks its keys up one by one.
    charge(d.items.size());
    found = d.find(name);
  } else if (std::optional<Value> method = bound_method(obj, name)) {
    storage = std::move(*method);
    return &storage;
  } else if (obj.is_list()) {
    found = group_field(obj.list(), name);
  }
  if (found == nullptr) {
    storage = no_attribute(obj, name);
    return &storage;
  }
  if (!temporary) return found;
  storage = *found;
  return &storage;
}

const Value* Renderer::get_item(const Value& obj, const Value& key, bool temporary, Value& storage) {
  require_defined(obj);
  const Value* found = nullptr;
  if (obj.is_dict()) {
    charge(obj.dict().items.size());
    found = obj.dict().find_key(key);
  } else if ((obj.is_list() || obj.is_string()) && (key.is_int() || key.is_bool())) {
    const std::int64_t n = obj.is_list() ? static_cast<std::int64_t>(obj.list().size())
                                         : static_cast<std::int64_t>(code_point_count(obj.str()));
    std::int64_t i = key.as_int();
    if (i < 0) i += n;
    if (i >= 0 && i < n) {
      if (obj.is_string()) {
        storage = slice(*this, obj, Value(i), Value(i + 1), Value(1));
        return &storage;
      }
      found = &obj.list()[static_cast<std::size_t>(i)];
    }
  }
  if (found == nullptr) {
    if (key.is_string()) return get_attr(obj, key.str(), temporary, storage);
    storage = Undefined{object_description(obj) + " has no attribute '" + to_str(key) + "'"};
    return &storage;
  }
  if (!temporary) return found;
  storage = *found;
  return &storage;
}

const Value* Renderer::eval_ref(const Expr& e, Value& storage) {
  charge(1);
  switch (e.kind) {
    case ExprKind::literal:
      return &e.value;
    case ExprKind::name:
      return lookup(e.name, storage);
    case ExprKind::attr: {
      if (is_loop_name(*e.args[0])) {
        if (const LoopState* loop = find_loop()) {
          storage = loop_attr(*loop, e.name);
          return &storage;
        }
      }
      try {
        Value object_storage;
        const Value* obj = eval_ref(*e.args[0], object_storage);
        return get_attr(*obj, e.name, obj == &object_storage, storage);
      } catch (const Error& err) {
        if (err.line() == 0) throw err.at(e.line, describe(e));
        throw;
      }
    }
    case ExprKind::item: {
      const Value key = eval(*e.args[1]);
      try {
        Value object_storage;
        const Value* obj = eval_ref(*e.args[0], object_storage);
        return get_item(*obj, key, obj == &object_storage, storage);
      } catch (const Error& err) {
        if (err.line() == 0) throw err.at(e.line, describe(e));
        throw;
      }
    }
    default:
      storage = eval(e);
      return &storage;
  }
}

Args Renderer::eval_args(const Expr& e, std::size_t first) {
  Args args;
  args.positional.reserve(e.args.size() - first);
  for (std::size_t i = first; i < e.args.size(); ++i) args.positional.push_back(eval(*e.args[i]));
  if (e.star_args) {
    for (const auto items = this->items(eval(*e.star_args)); const Value& item : *items)
      args.positional.push_back(item);
  }
  for (const auto& [key, expr] : e.kwargs) args.keyword.emplace_back(key, eval(*expr));
  if (e.star_kwargs) {
    const Value extra = eval(*e.star_kwargs);
    if (!extra.is_dict())
      fail(ErrorKind::type_error,
           "argument after ** must be a mapping, not " + std::string(type_name(extra)));
    for (const auto& [key, value] : extra.dict().items) {
      if (!key.is_string()) fail(ErrorKind::type_error, "keywords must be strings");
      args.keyword.emplace_back(key.str(), value);
    }
  }
  return args;
}

Value Renderer::eval(const Expr& e) {
  try {
    return eval_node(e);
  } catch (const Error& err) {
    if (err.line() == 0) throw err.at(e.line, describe(e));
    throw;
  }
}

Value Renderer::eval_call(const Expr& e) {
  Args args = eval_args(e, 1);
  const Expr& callee = *e.args[0];
  if (callee.kind == ExprKind::attr) {
    if (is_loop_name(*callee.args[0]) && callee.name == "cycle") {
      if (const LoopState* loop = find_loop()) {
        if (args.positional.empty()) fail(ErrorKind::type_error, "no items for cycling given");
        return args.positional[loop->index % args.positional.size()];
      }
    }
    Value object_storage;
    const Value* obj = eval_ref(*callee.args[0], object_storage);
    require_defined(*obj);
    if (!obj->is_namespace()) {
      if (std::optional<Value> result = call_method(*this, *obj, callee.name, args))
        return std::move(*result);
    }
    Value fn_storage;
    const Value fn = *get_attr(*obj, callee.name, true, fn_storage);
    return call(fn, args);
  }
  const Value fn = eval(callee);
  return call(fn, args);
}

Value Renderer::eval_node(const Expr& e) {
  charge(1);
  switch (e.kind) {
    case ExprKind::literal:
      return e.value;
    case ExprKind::name:
    case ExprKind::attr:
    case ExprKind::item: {
      Value storage;
      const Value* v = eval_ref(e, storage);
      return v == &storage ? std::move(storage) : *v;
    }
    case ExprKind::slice: {
      Value bounds[3] = {None{}, None{}, None{}};
      for (std::size_t i = 0; i < 3; ++i) {
        if (e.args[i + 1]) bounds[i] = eval(*e.args[i + 1]);
      }
      Value storage;
      const Value* obj = eval_ref(*e.args[0], storage);
      return slice(*this, *obj, bounds[0], bounds[1], bounds[2]);
    }
    case ExprKind::call:
      return eval_call(e);
    case ExprKind::filter: {
      const Args args = eval_args(e, 1);
      Value storage;
      const Value* operand = eval_ref(*e.args[0], storage);
      charge(operand_work(*operand) + work(args));
      return e.filter(*this, *operand, args);
    }
    case ExprKind::test: {
      const Args args = eval_args(e, 1);
      Value storage;
      const Value* operand = eval_ref(*e.args[0], storage);
      charge(operand_work(*operand) + work(args));
      return e.test(*this, *operand, args) != e.negated;
    }
    case ExprKind::not_: {
      Value storage;
      return !truthy(*eval_ref(*e.args[0], storage));
    }
    case ExprKind::neg:
    case ExprKind::pos: {
      const Value v = eval(*e.args[0]);
      require_defined(v);
      if (!v.is_number()) {
        fail(ErrorKind::type_error, std::string("bad operand type for unary ") +
                                        (e.kind == ExprKind::neg ? "-" : "+") + ": '" +
                                        std::string(type_name(v)) + "'");
      }
      if (e.kind == ExprKind::pos) return v.is_bool() ? Value(v.as_int()) : v;
      if (v.is_float()) return -v.as_double();
      return -v.as_int();
    }
    case ExprKind::binary: {
      const Value a = eval(*e.args[0]);
      const Value b = eval(*e.args[1]);
      return binary_op(*this, e.op, a, b);
    }
    case ExprKind::compare: {
      Value a = eval(*e.args[0]);
      for (std::size_t i = 0; i < e.compare_ops.size(); ++i) {
        Value b = eval(*e.args[i + 1]);
        charge(work(a) + work(b));
        if (!compare(e.compare_ops[i], a, b)) return false;
        a = std::move(b);
      }
      return true;
    }
    case ExprKind::and_: {
      Value a = eval(*e.args[0]);
      return truthy(a) ? eval(*e.args[1]) : a;
    }
    case ExprKind::or_: {
      Value a = eval(*e.args[0]);
      return truthy(a) ? a : eval(*e.args[1]);
    }
    case ExprKind::cond: {
      Value storage;
      if (truthy(*eval_ref(*e.args[1], storage))) return eval(*e.args[0]);
      if (e.args[2]) return eval(*e.args[2]);
      return Undefined{"the inline if-expression on line " + std::to_string(e.line) +
                       " evaluated to false and no else section was defined."};
    }
    case ExprKind::list:
    case ExprKind::tuple: {
      List items;
      items.reserve(e.args.size());
      std::size_t string_bytes = 0;
      for (const ExprPtr& a : e.args) {
        items.push_back(eval(*a));
        if (items.back().is_string()) string_bytes += items.back().str().size();
      }
      produce(list_bytes(items.size(), string_bytes));
      items.tuple = e.kind == ExprKind::tuple;
      return items;
    }
    case ExprKind::dict: {
      Dict d;
      for (std::size_t i = 0; i + 1 < e.args.size(); i += 2) {
        Value key = eval(*e.args[i]);
        if (key.is_list() || key.is_dict() || key.is_namespace() || key.is_undefined()) {
          fail(ErrorKind::type_error, "unhashable type: '" + std::string(type_name(key)) + "'");
        }
        d.set(std::move(key), eval(*e.args[i + 1]));
      }
      return d;
    }
    case ExprKind::concat: {
      // The parts first, so that the result's size is checked before it is built.
      std::vector<Value> parts;
      parts.reserve(e.args.size());
      std::size_t size = 0;
      std::size_t client_ranges = 0;
      for (const ExprPtr& a : e.args) {
        parts.push_back(eval(*a));
        check_text(parts.back());
        if (!parts.back().is_string()) parts.back() = to_marked_str(parts.back());
        size = size_add(size, parts.back().str().size());
        client_ranges = size_add(client_ranges, parts.back().marked().client.size());
      }
      produce(str_bytes(size, client_ranges));
      Str out;
      out.text.reserve(size);
      for (const Value& part : parts) append(out, part.marked());
      return out;
    }
  }
  return Undefined{};
}

}  // namespace capserve::runtime::jinja
