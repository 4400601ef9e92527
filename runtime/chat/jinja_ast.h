#pragma once
// The parsed form of a Jinja2 template: expressions and statements as trees that the renderer walks. Built
// once per template (jinja_parser.h) and only read afterwards, so one tree serves concurrent renders.
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "runtime/chat/jinja_value.h"

namespace capserve::runtime::jinja {

class Renderer;
using FilterFn = Value (*)(Renderer& r, const Value& operand, const Args& args);
using TestFn = bool (*)(Renderer& r, const Value& operand, const Args& args);

enum class ExprKind {
  literal,  // value
  name,     // name
  attr,     // args[0].name
  item,     // args[0][args[1]]
  slice,    // args[0][args[1]:args[2]:args[3]], any of the bounds null
  call,     // args[0](args[1:], kwargs)
  filter,   // args[0] | name(args[1:], kwargs)
  test,     // args[0] is [not] name(args[1:], kwargs)
  not_,     // not args[0]
  neg,      // -args[0]
  pos,      // +args[0]
  binary,   // args[0] op args[1]
  compare,  // args[0] cmp[0] args[1] cmp[1] args[2] ...
  and_,     // args[0] and args[1]
  or_,      // args[0] or args[1]
  cond,     // args[0] if args[1] else args[2] (null: undefined)
  list,     // [args...]
  tuple,    // (args...)
  dict,     // {args[0]: args[1], ...}
  concat,   // args[0] ~ args[1] ~ ...
};

enum class BinaryOp { add, sub, mul, div, floordiv, mod, pow };
enum class CompareOp { eq, ne, lt, le, gt, ge, in, not_in };

struct Expr;
using ExprPtr = std::unique_ptr<Expr>;

struct Expr {
  ExprKind kind;
  int line;
  Value value;
  std::string name;
  BinaryOp op = BinaryOp::add;
  std::vector<CompareOp> compare_ops;
  bool negated = false;
  FilterFn filter = nullptr;
  TestFn test = nullptr;
  std::vector<ExprPtr> args;
  std::vector<std::pair<std::string, ExprPtr>> kwargs;
  ExprPtr star_args;    // call(*star_args)
  ExprPtr star_kwargs;  // call(**star_kwargs)
};

enum class StmtKind {
  text,          // text
  print,         // {{ expr }}
  if_,           // if expr: body else else_body (elif nests an if in else_body)
  for_,          // for targets in expr [if cond]: body else else_body
  set,           // set targets = expr; set targets[0].attr = expr when attr is not empty
  set_block,     // set targets[0] %}body{% endset (then through filter, if any)
  macro,         // macro name(params) body
  call_block,    // call(params) expr (a call) with caller() rendering body
  generation,    // generation body
  filter_block,  // filter expr (a filter whose args[0] is null) body
  break_,
  continue_,
};

struct Stmt;
using StmtPtr = std::unique_ptr<Stmt>;
using Body = std::vector<StmtPtr>;

struct Param {
  std::string name;
  ExprPtr default_value;  // null: required
};

struct Stmt {
  StmtKind kind;
  int line;
  std::string text;
  ExprPtr expr;
  ExprPtr cond;
  std::vector<std::string> targets;
  std::string attr;
  std::vector<Param> params;
  Body body;
  Body else_body;
};

}  // namespace capserve::runtime::jinja
