#include "runtime/chat/jinja_parser.h"

#include <charconv>
#include <initializer_list>
#include <utility>

#include "runtime/chat/jinja_filters.h"
#include "runtime/chat/jinja_globals.h"
#include "runtime/chat/jinja_lexer.h"

namespace capserve::runtime::jinja {
namespace {

// Deeper nesting than any real template, shallow enough that the recursive descent cannot overflow the stack.
constexpr int kMaxDepth = 200;

class Parser {
 public:
  explicit Parser(std::vector<Token> tokens) : tokens_(std::move(tokens)) {}

  Body parse() {
    std::string end;
    Body body = parse_body({}, end);
    return body;
  }

 private:
  struct DepthGuard {
    explicit DepthGuard(Parser& p) : parser(p) {
      if (++parser.depth_ > kMaxDepth) parser.fail("template nesting is too deep");
    }
    ~DepthGuard() { --parser.depth_; }
    DepthGuard(const DepthGuard&) = delete;
    DepthGuard& operator=(const DepthGuard&) = delete;
    Parser& parser;
  };

  const Token& cur() const { return tokens_[pos_]; }
  const Token& peek(std::size_t ahead = 1) const {
    return tokens_[std::min(pos_ + ahead, tokens_.size() - 1)];
  }
  void advance() {
    if (pos_ + 1 < tokens_.size()) ++pos_;
  }
  bool is_op(std::string_view op) const { return cur().kind == TokenKind::op && cur().text == op; }
  bool is_name(std::string_view name) const { return cur().kind == TokenKind::name && cur().text == name; }
  bool skip_op(std::string_view op) {
    if (!is_op(op)) return false;
    advance();
    return true;
  }
  bool skip_name(std::string_view name) {
    if (!is_name(name)) return false;
    advance();
    return true;
  }

  [[noreturn]] void fail(const std::string& what) const {
    throw Error(ErrorKind::syntax_error, what, cur().line);
  }

  std::string describe(const Token& t) const {
    switch (t.kind) {
      case TokenKind::data:
        return "template data";
      case TokenKind::var_begin:
        return "'{{'";
      case TokenKind::var_end:
        return "end of print statement";
      case TokenKind::block_begin:
        return "'{%'";
      case TokenKind::block_end:
        return "end of statement block";
      case TokenKind::end:
        return "end of template";
      default:
        return "'" + t.text + "'";
    }
  }

  void expect_op(std::string_view op) {
    if (!skip_op(op)) fail("expected '" + std::string(op) + "', got " + describe(cur()));
  }
  std::string expect_name() {
    if (cur().kind != TokenKind::name) fail("expected a name, got " + describe(cur()));
    std::string name = cur().text;
    advance();
    return name;
  }
  void expect_block_end() {
    if (cur().kind != TokenKind::block_end) fail("expected end of statement block, got " + describe(cur()));
    advance();
  }

  ExprPtr node(ExprKind kind, int line) {
    auto e = std::make_unique<Expr>();
    e->kind = kind;
    e->line = line;
    return e;
  }
  StmtPtr stmt(StmtKind kind, int line) {
    auto s = std::make_unique<Stmt>();
    s->kind = kind;
    s->line = line;
    return s;
  }

  // Statements up to a {% name %} with name in `ends` (consumed up to the name; `end` says which).
  Body parse_body(std::initializer_list<std::string_view> ends, std::string& end) {
    DepthGuard guard(*this);
    Body body;
    while (true) {
      const Token& t = cur();
      if (t.kind == TokenKind::end) {
        if (ends.size() != 0) {
          std::string expected;
          for (const std::string_view e : ends)
            expected += (expected.empty() ? "'" : " or '") + std::string(e) + "'";
          fail("unexpected end of template; Jinja was looking for " + expected);
        }
        return body;
      }
      if (t.kind == TokenKind::data) {
        auto s = stmt(StmtKind::text, t.line);
        s->text = t.text;
        body.push_back(std::move(s));
        advance();
      } else if (t.kind == TokenKind::var_begin) {
        auto s = stmt(StmtKind::print, t.line);
        advance();
        s->expr = parse_tuple(true);
        if (cur().kind != TokenKind::var_end) fail("expected end of print statement, got " + describe(cur()));
        advance();
        body.push_back(std::move(s));
      } else if (t.kind == TokenKind::block_begin) {
        advance();
        if (cur().kind != TokenKind::name) fail("expected a statement name, got " + describe(cur()));
        for (const std::string_view e : ends) {
          if (cur().text == e) {
            end = cur().text;
            advance();
            return body;
          }
        }
        body.push_back(parse_statement());
      } else {
        fail("unexpected " + describe(t));
      }
    }
  }

  StmtPtr parse_statement() {
    const int line = cur().line;
    const std::string tag = cur().text;
    advance();
    std::string end;
    if (tag == "if") return parse_if(line);
    if (tag == "for") return parse_for(line);
    if (tag == "set") return parse_set(line);
    if (tag == "macro") return parse_macro(line);
    if (tag == "call") {
      auto s = stmt(StmtKind::call_block, line);
      if (is_op("(")) s->params = parse_params();
      s->expr = parse_expression(true);
      if (s->expr->kind != ExprKind::call) fail("expected a call after 'call'");
      expect_block_end();
      s->body = parse_body({"endcall"}, end);
      expect_block_end();
      return s;
    }
    if (tag == "filter") {
      auto s = stmt(StmtKind::filter_block, line);
      s->expr = parse_filters(nullptr, /*leading_pipe=*/false);
      expect_block_end();
      s->body = parse_body({"endfilter"}, end);
      expect_block_end();
      return s;
    }
    if (tag == "generation") {
      auto s = stmt(StmtKind::generation, line);
      expect_block_end();
      s->body = parse_body({"endgeneration"}, end);
      expect_block_end();
      return s;
    }
    if (tag == "break" || tag == "continue") {
      if (loop_depth_ == 0) fail("'" + tag + "' outside of a loop");
      auto s = stmt(tag == "break" ? StmtKind::break_ : StmtKind::continue_, line);
      expect_block_end();
      return s;
    }
    --pos_;
    fail("Encountered unknown tag '" + tag + "'");
  }

  StmtPtr parse_if(int line) {
    auto s = stmt(StmtKind::if_, line);
    s->expr = parse_tuple(false);
    expect_block_end();
    std::string end;
    s->body = parse_body({"elif", "else", "endif"}, end);
    if (end == "elif") {
      s->else_body.push_back(parse_if(cur().line));
      return s;
    }
    if (end == "else") {
      expect_block_end();
      s->else_body = parse_body({"endif"}, end);
    }
    expect_block_end();
    return s;
  }

  std::vector<std::string> parse_targets() {
    std::vector<std::string> names;
    const bool parens = skip_op("(");
    do {
      names.push_back(expect_name());
    } while (skip_op(",") && cur().kind == TokenKind::name && !is_name("in"));
    if (parens) expect_op(")");
    return names;
  }

  StmtPtr parse_for(int line) {
    auto s = stmt(StmtKind::for_, line);
    s->targets = parse_targets();
    if (!skip_name("in")) fail("expected 'in', got " + describe(cur()));
    s->expr = parse_tuple(false, {"recursive"});
    if (skip_name("if")) s->cond = parse_expression(true);
    if (is_name("recursive")) fail("recursive for loops are not supported");
    expect_block_end();
    std::string end;
    ++loop_depth_;
    s->body = parse_body({"endfor", "else"}, end);
    --loop_depth_;
    if (end == "else") {
      expect_block_end();
      s->else_body = parse_body({"endfor"}, end);
    }
    expect_block_end();
    return s;
  }

  StmtPtr parse_set(int line) {
    auto s = stmt(StmtKind::set, line);
    if (cur().kind == TokenKind::name && peek().kind == TokenKind::op && peek().text == ".") {
      s->targets.push_back(expect_name());
      advance();
      s->attr = expect_name();
    } else {
      s->targets = parse_targets();
    }
    if (skip_op("=")) {
      s->expr = parse_tuple(true);
      expect_block_end();
      return s;
    }
    if (!s->attr.empty() || s->targets.size() != 1) fail("expected '='");
    s->kind = StmtKind::set_block;
    if (is_op("|")) s->expr = parse_filters(nullptr);
    expect_block_end();
    std::string end;
    s->body = parse_body({"endset"}, end);
    expect_block_end();
    return s;
  }

  std::vector<Param> parse_params() {
    std::vector<Param> params;
    expect_op("(");
    while (!is_op(")")) {
      if (!params.empty()) expect_op(",");
      if (is_op(")")) break;
      Param p{expect_name(), nullptr};
      if (skip_op("=")) p.default_value = parse_expression(true);
      params.push_back(std::move(p));
    }
    advance();
    return params;
  }

  StmtPtr parse_macro(int line) {
    auto s = stmt(StmtKind::macro, line);
    s->text = expect_name();
    s->params = parse_params();
    expect_block_end();
    std::string end;
    const int loops = std::exchange(loop_depth_, 0);
    s->body = parse_body({"endmacro"}, end);
    loop_depth_ = loops;
    if (cur().kind == TokenKind::name) advance();  // {% endmacro name %}
    expect_block_end();
    return s;
  }

  // ---- expressions ----

  bool is_tuple_end(std::initializer_list<std::string_view> extra_ends) const {
    const TokenKind k = cur().kind;
    if (k == TokenKind::var_end || k == TokenKind::block_end || k == TokenKind::end) return true;
    if (k == TokenKind::op && cur().text == ")") return true;
    for (const std::string_view e : extra_ends) {
      if (k == TokenKind::name && cur().text == e) return true;
    }
    return false;
  }

  ExprPtr parse_tuple(bool with_condexpr, std::initializer_list<std::string_view> extra_ends = {},
                      bool explicit_parentheses = false) {
    const int line = cur().line;
    std::vector<ExprPtr> items;
    bool is_tuple = false;
    while (true) {
      if (!items.empty()) expect_op(",");
      if (is_tuple_end(extra_ends)) break;
      items.push_back(parse_expression(with_condexpr));
      if (is_op(",")) {
        is_tuple = true;
      } else {
        break;
      }
    }
    if (!is_tuple) {
      if (!items.empty()) return std::move(items[0]);
      if (!explicit_parentheses) fail("Expected an expression, got " + describe(cur()));
    }
    auto t = node(ExprKind::tuple, line);
    t->args = std::move(items);
    return fold_constant(std::move(t));
  }

  ExprPtr parse_expression(bool with_condexpr) {
    DepthGuard guard(*this);
    if (!with_condexpr) return parse_or();
    ExprPtr expr = parse_or();
    while (is_name("if")) {
      const int line = cur().line;
      advance();
      auto c = node(ExprKind::cond, line);
      ExprPtr test = parse_or();
      ExprPtr otherwise = skip_name("else") ? parse_expression(true) : nullptr;
      c->args.push_back(std::move(expr));
      c->args.push_back(std::move(test));
      c->args.push_back(std::move(otherwise));
      expr = std::move(c);
    }
    return expr;
  }

  ExprPtr binary_chain(ExprKind kind, std::string_view keyword, ExprPtr (Parser::*next)()) {
    ExprPtr left = (this->*next)();
    while (is_name(keyword)) {
      const int line = cur().line;
      advance();
      auto n = node(kind, line);
      n->args.push_back(std::move(left));
      n->args.push_back((this->*next)());
      left = std::move(n);
    }
    return left;
  }
  ExprPtr parse_or() { return binary_chain(ExprKind::or_, "or", &Parser::parse_and); }
  ExprPtr parse_and() { return binary_chain(ExprKind::and_, "and", &Parser::parse_not); }

  ExprPtr parse_not() {
    if (is_name("not")) {
      DepthGuard guard(*this);
      auto n = node(ExprKind::not_, cur().line);
      advance();
      n->args.push_back(parse_not());
      return n;
    }
    return parse_compare();
  }

  ExprPtr parse_compare() {
    const int line = cur().line;
    ExprPtr first = parse_math1();
    ExprPtr cmp;
    while (true) {
      CompareOp op;
      if (is_op("==")) {
        op = CompareOp::eq;
      } else if (is_op("!=")) {
        op = CompareOp::ne;
      } else if (is_op("<")) {
        op = CompareOp::lt;
      } else if (is_op("<=")) {
        op = CompareOp::le;
      } else if (is_op(">")) {
        op = CompareOp::gt;
      } else if (is_op(">=")) {
        op = CompareOp::ge;
      } else if (is_name("in")) {
        op = CompareOp::in;
      } else if (is_name("not") && peek().kind == TokenKind::name && peek().text == "in") {
        op = CompareOp::not_in;
        advance();
      } else {
        break;
      }
      advance();
      if (!cmp) {
        cmp = node(ExprKind::compare, line);
        cmp->args.push_back(std::move(first));
      }
      cmp->compare_ops.push_back(op);
      cmp->args.push_back(parse_math1());
    }
    return cmp ? std::move(cmp) : std::move(first);
  }

  ExprPtr binary(BinaryOp op, ExprPtr left, ExprPtr right, int line) {
    auto n = node(ExprKind::binary, line);
    n->op = op;
    n->args.push_back(std::move(left));
    n->args.push_back(std::move(right));
    return n;
  }

  ExprPtr parse_math1() {
    ExprPtr left = parse_concat();
    while (is_op("+") || is_op("-")) {
      const BinaryOp op = is_op("+") ? BinaryOp::add : BinaryOp::sub;
      const int line = cur().line;
      advance();
      left = binary(op, std::move(left), parse_concat(), line);
    }
    return left;
  }

  ExprPtr parse_concat() {
    const int line = cur().line;
    ExprPtr first = parse_math2();
    if (!is_op("~")) return first;
    auto n = node(ExprKind::concat, line);
    n->args.push_back(std::move(first));
    while (skip_op("~")) n->args.push_back(parse_math2());
    return n;
  }

  ExprPtr parse_math2() {
    ExprPtr left = parse_pow();
    while (true) {
      BinaryOp op;
      if (is_op("*")) {
        op = BinaryOp::mul;
      } else if (is_op("/")) {
        op = BinaryOp::div;
      } else if (is_op("//")) {
        op = BinaryOp::floordiv;
      } else if (is_op("%")) {
        op = BinaryOp::mod;
      } else {
        return left;
      }
      const int line = cur().line;
      advance();
      left = binary(op, std::move(left), parse_pow(), line);
    }
  }

  ExprPtr parse_pow() {
    ExprPtr left = parse_unary(true);
    while (is_op("**")) {
      const int line = cur().line;
      advance();
      left = binary(BinaryOp::pow, std::move(left), parse_unary(true), line);
    }
    return left;
  }

  ExprPtr parse_unary(bool with_filter) {
    DepthGuard guard(*this);
    ExprPtr n;
    if (is_op("-") || is_op("+")) {
      n = node(is_op("-") ? ExprKind::neg : ExprKind::pos, cur().line);
      advance();
      n->args.push_back(parse_unary(false));
    } else {
      n = parse_primary();
    }
    n = parse_postfix(std::move(n));
    if (with_filter) n = parse_filter_expr(std::move(n));
    return n;
  }

  ExprPtr parse_primary() {
    DepthGuard guard(*this);
    const Token& t = cur();
    const int line = t.line;
    auto lit = node(ExprKind::literal, line);
    switch (t.kind) {
      case TokenKind::name: {
        if (t.text == "true" || t.text == "True") {
          lit->value = true;
        } else if (t.text == "false" || t.text == "False") {
          lit->value = false;
        } else if (t.text == "none" || t.text == "None") {
          lit->value = None{};
        } else {
          if (const char* why = refused_global_reason(t.text))
            fail("global '" + t.text + "' is not supported (" + why + ")");
          auto n = node(ExprKind::name, line);
          n->name = t.text;
          advance();
          return n;
        }
        advance();
        return lit;
      }
      case TokenKind::string: {
        std::string s = t.text;
        advance();
        while (cur().kind == TokenKind::string) {
          s += cur().text;
          advance();
        }
        lit->value = std::move(s);
        return lit;
      }
      case TokenKind::integer: {
        std::int64_t v = 0;
        const auto [p, ec] = std::from_chars(t.text.data(), t.text.data() + t.text.size(), v);
        if (ec != std::errc()) fail("integer literal " + t.text + " is out of range");
        lit->value = v;
        advance();
        return lit;
      }
      case TokenKind::floating: {
        double v = 0;
        std::from_chars(t.text.data(), t.text.data() + t.text.size(), v);
        lit->value = v;
        advance();
        return lit;
      }
      case TokenKind::op:
        if (t.text == "(") {
          advance();
          ExprPtr e = parse_tuple(true, {}, true);
          expect_op(")");
          return e;
        }
        if (t.text == "[") {
          advance();
          auto l = node(ExprKind::list, line);
          while (!is_op("]")) {
            if (!l->args.empty()) expect_op(",");
            if (is_op("]")) break;
            l->args.push_back(parse_expression(true));
          }
          advance();
          return fold_constant(std::move(l));
        }
        if (t.text == "{") {
          advance();
          auto d = node(ExprKind::dict, line);
          while (!is_op("}")) {
            if (!d->args.empty()) expect_op(",");
            if (is_op("}")) break;
            d->args.push_back(parse_expression(true));
            expect_op(":");
            d->args.push_back(parse_expression(true));
          }
          advance();
          return fold_constant(std::move(d));
        }
        break;
      default:
        break;
    }
    fail("unexpected " + describe(t));
  }

  ExprPtr parse_postfix(ExprPtr n) {
    while (true) {
      if (is_op(".") || is_op("[")) {
        n = parse_subscript(std::move(n));
      } else if (is_op("(")) {
        n = parse_call(std::move(n));
      } else {
        return n;
      }
    }
  }

  ExprPtr parse_filter_expr(ExprPtr n) {
    while (true) {
      if (is_op("|")) {
        n = parse_filters(std::move(n));
      } else if (is_name("is")) {
        n = parse_test(std::move(n));
      } else if (is_op("(")) {
        n = parse_call(std::move(n));
      } else {
        return n;
      }
    }
  }

  ExprPtr parse_subscript(ExprPtr obj) {
    const int line = cur().line;
    if (skip_op(".")) {
      if (cur().kind == TokenKind::integer) {
        auto n = node(ExprKind::item, line);
        n->args.push_back(std::move(obj));
        n->args.push_back(parse_primary());
        return n;
      }
      auto n = node(ExprKind::attr, line);
      n->name = expect_name();
      n->args.push_back(std::move(obj));
      return n;
    }
    expect_op("[");
    ExprPtr parts[3];
    bool is_slice = false;
    for (int i = 0; i < 3; ++i) {
      if (!is_op(":") && !is_op("]")) parts[i] = parse_expression(true);
      if (i < 2 && skip_op(":")) {
        is_slice = true;
        continue;
      }
      break;
    }
    expect_op("]");
    auto n = node(is_slice ? ExprKind::slice : ExprKind::item, line);
    n->args.push_back(std::move(obj));
    if (!is_slice) {
      if (!parts[0]) fail("expected an index");
      n->args.push_back(std::move(parts[0]));
      return n;
    }
    for (ExprPtr& p : parts) n->args.push_back(std::move(p));
    return n;
  }

  // (args) into n->args after whatever n already holds, keywords into n->kwargs.
  void parse_call_args(Expr& n) {
    expect_op("(");
    bool first = true;
    while (!is_op(")")) {
      if (!first) expect_op(",");
      first = false;
      if (is_op(")")) break;
      if (is_op("*") || is_op("**")) {
        const bool keywords = is_op("**");
        advance();
        (keywords ? n.star_kwargs : n.star_args) = parse_expression(true);
        continue;
      }
      if (cur().kind == TokenKind::name && peek().kind == TokenKind::op && peek().text == "=") {
        std::string key = expect_name();
        advance();
        n.kwargs.emplace_back(std::move(key), parse_expression(true));
      } else {
        if (!n.kwargs.empty()) fail("positional argument after a keyword argument");
        n.args.push_back(parse_expression(true));
      }
    }
    advance();
  }

  ExprPtr parse_call(ExprPtr callee) {
    auto n = node(ExprKind::call, cur().line);
    n->args.push_back(std::move(callee));
    parse_call_args(*n);
    return n;
  }

  // One or more "| name(args)" (the first without "|" in a filter block, whose `operand` is null).
  ExprPtr parse_filters(ExprPtr operand, bool leading_pipe = true) {
    for (bool first = true; (first && !leading_pipe) || skip_op("|"); first = false) {
      auto n = node(ExprKind::filter, cur().line);
      n->name = expect_name();
      while (skip_op(".")) {
        n->name += '.';
        n->name += expect_name();
      }
      n->filter = find_filter(n->name);
      if (n->filter == nullptr) fail(unknown_filter_message(n->name));
      n->args.push_back(std::move(operand));
      if (is_op("(")) parse_call_args(*n);
      operand = std::move(n);
    }
    return operand;
  }

  ExprPtr parse_test(ExprPtr operand) {
    auto n = node(ExprKind::test, cur().line);
    advance();  // is
    n->negated = skip_name("not");
    n->name = expect_name();
    n->test = find_test(n->name);
    if (n->test == nullptr) fail("No test named '" + n->name + "'.");
    n->args.push_back(std::move(operand));
    if (is_op("(")) {
      parse_call_args(*n);
    } else if ((cur().kind == TokenKind::name || cur().kind == TokenKind::string ||
                cur().kind == TokenKind::integer || cur().kind == TokenKind::floating || is_op("[") ||
                is_op("{")) &&
               !is_name("else") && !is_name("or") && !is_name("and")) {
      if (is_name("is")) fail("You cannot chain multiple tests with is");
      n->args.push_back(parse_postfix(parse_primary()));
    }
    return n;
  }

  // A list, tuple or dict display of literals is built once, here, instead of on every render.
  static ExprPtr fold_constant(ExprPtr n) {
    for (const ExprPtr& a : n->args) {
      if (a->kind != ExprKind::literal) return n;
    }
    if (n->kind == ExprKind::dict) {
      Dict d;
      for (std::size_t i = 0; i + 1 < n->args.size(); i += 2) {
        if (n->args[i]->value.is_list() || n->args[i]->value.is_dict())
          return n;  // unhashable: fails at run time
        d.set(n->args[i]->value, n->args[i + 1]->value);
      }
      n->value = std::move(d);
    } else {
      List l;
      l.reserve(n->args.size());
      for (const ExprPtr& a : n->args) l.push_back(a->value);
      l.tuple = n->kind == ExprKind::tuple;
      n->value = std::move(l);
    }
    n->kind = ExprKind::literal;
    n->args.clear();
    return n;
  }

  std::vector<Token> tokens_;
  std::size_t pos_ = 0;
  int depth_ = 0;
  int loop_depth_ = 0;
};

}  // namespace

Body parse_template(std::string_view source) {
  return Parser(tokenize(source)).parse();
}

}  // namespace capserve::runtime::jinja
