#include "runtime/chat/jinja_operators.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>

namespace capserve::runtime::jinja {
namespace {

[[noreturn]] void type_error(std::string message) {
  throw Error(ErrorKind::type_error, std::move(message));
}

[[noreturn]] void unsupported(const char* op, const Value& a, const Value& b) {
  type_error(std::string("unsupported operand type(s) for ") + op + ": '" + std::string(type_name(a)) +
             "' and '" + std::string(type_name(b)) + "'");
}

void check(std::size_t size, std::size_t max_size) {
  if (size > max_size)
    throw Error(ErrorKind::limit_error, "a value would exceed " + std::to_string(max_size) + " bytes");
}

Value repeat(const Value& seq, std::int64_t times, std::size_t max_size) {
  const auto n = static_cast<std::size_t>(std::max<std::int64_t>(times, 0));
  if (seq.is_string()) {
    check(seq.str().size() * n, max_size);
    Str out;
    out.text.reserve(seq.str().size() * n);
    for (std::size_t i = 0; i < n; ++i) append(out, seq.marked());
    return out;
  }
  check(seq.list().size() * n, max_size);
  List out;
  for (std::size_t i = 0; i < n; ++i) out.insert(out.end(), seq.list().begin(), seq.list().end());
  return out;
}

double py_fmod(double a, double b) {
  const double r = std::fmod(a, b);
  return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r;
}

std::int64_t slice_index(const Value* v) {
  if (!v->is_int() && !v->is_bool())
    type_error("slice indices must be integers or None or have an __index__ method");
  return v->as_int();
}

}  // namespace

Value binary_op(BinaryOp op, const Value& a, const Value& b, std::size_t max_size) {
  require_defined(a);
  require_defined(b);
  const bool ints = (a.is_int() || a.is_bool()) && (b.is_int() || b.is_bool());
  const bool nums = a.is_number() && b.is_number();
  switch (op) {
    case BinaryOp::add:
      if (ints) {
        std::int64_t r = 0;
        if (!__builtin_add_overflow(a.as_int(), b.as_int(), &r)) return r;
        return a.as_double() + b.as_double();
      }
      if (nums) return a.as_double() + b.as_double();
      if (a.is_string() && b.is_string()) {
        check(a.str().size() + b.str().size(), max_size);
        Str out = a.marked();
        append(out, b.marked());
        return out;
      }
      if (a.is_list() && b.is_list()) {
        check(a.list().size() + b.list().size(), max_size);
        List out = a.list();
        out.insert(out.end(), b.list().begin(), b.list().end());
        return out;
      }
      if (a.is_string() || a.is_list()) {
        type_error("can only concatenate " + std::string(type_name(a)) + " (not \"" +
                   std::string(type_name(b)) + "\") to " + std::string(type_name(a)));
      }
      unsupported("+", a, b);
    case BinaryOp::sub:
      if (ints) {
        std::int64_t r = 0;
        if (!__builtin_sub_overflow(a.as_int(), b.as_int(), &r)) return r;
        return a.as_double() - b.as_double();
      }
      if (nums) return a.as_double() - b.as_double();
      unsupported("-", a, b);
    case BinaryOp::mul:
      if (ints) {
        std::int64_t r = 0;
        if (!__builtin_mul_overflow(a.as_int(), b.as_int(), &r)) return r;
        return a.as_double() * b.as_double();
      }
      if (nums) return a.as_double() * b.as_double();
      if ((a.is_string() || a.is_list()) && (b.is_int() || b.is_bool()))
        return repeat(a, b.as_int(), max_size);
      if ((b.is_string() || b.is_list()) && (a.is_int() || a.is_bool()))
        return repeat(b, a.as_int(), max_size);
      unsupported("*", a, b);
    case BinaryOp::div:
      if (!nums) unsupported("/", a, b);
      if (b.as_double() == 0) throw Error(ErrorKind::zero_division, "division by zero");
      return a.as_double() / b.as_double();
    case BinaryOp::floordiv:
      if (!nums) unsupported("//", a, b);
      if (b.as_double() == 0) throw Error(ErrorKind::zero_division, "integer division or modulo by zero");
      if (ints) {
        const std::int64_t x = a.as_int();
        const std::int64_t y = b.as_int();
        if (x == INT64_MIN && y == -1) return -a.as_double();
        std::int64_t q = x / y;
        if ((x % y != 0) && ((x < 0) != (y < 0))) --q;
        return q;
      }
      return std::floor(a.as_double() / b.as_double());
    case BinaryOp::mod:
      if (a.is_string()) return percent_format(a.marked(), b);
      if (!nums) unsupported("%", a, b);
      if (b.as_double() == 0) throw Error(ErrorKind::zero_division, "integer division or modulo by zero");
      if (ints) {
        const std::int64_t y = b.as_int();
        if (y == -1) return std::int64_t{0};
        std::int64_t r = a.as_int() % y;
        if (r != 0 && ((r < 0) != (y < 0))) r += y;
        return r;
      }
      return py_fmod(a.as_double(), b.as_double());
    case BinaryOp::pow:
      if (!nums) unsupported("** or pow()", a, b);
      if (ints && b.as_int() >= 0) {
        std::int64_t r = 1;
        std::int64_t base = a.as_int();
        bool overflow = false;
        for (std::int64_t e = b.as_int(); e > 0 && !overflow; --e) {
          overflow = __builtin_mul_overflow(r, base, &r);
          if (r == 0 || r == 1) break;
        }
        if (!overflow) return r;
      }
      return std::pow(a.as_double(), b.as_double());
  }
  unsupported("?", a, b);
}

bool contains(const Value& container, const Value& item) {
  if (container.is_string()) {
    if (!item.is_string()) {
      require_defined(item);
      type_error("'in <string>' requires string as left operand, not " + std::string(type_name(item)));
    }
    return container.str().find(item.str()) != std::string::npos;
  }
  if (container.is_list()) {
    for (const Value& v : container.list()) {
      if (equals(v, item)) return true;
    }
    return false;
  }
  if (container.is_dict()) return item.is_string() && container.dict().find(item.str()) != nullptr;
  if (container.is_undefined()) return false;
  type_error("argument of type '" + std::string(type_name(container)) + "' is not iterable");
}

bool compare(CompareOp op, const Value& a, const Value& b) {
  switch (op) {
    case CompareOp::eq:
      return equals(a, b);
    case CompareOp::ne:
      return !equals(a, b);
    case CompareOp::lt:
      return less(a, b);
    case CompareOp::le:
      return less(a, b) || equals(a, b);
    case CompareOp::gt:
      return less(b, a);
    case CompareOp::ge:
      return less(b, a) || equals(a, b);
    case CompareOp::in:
      return contains(b, a);
    case CompareOp::not_in:
      return !contains(b, a);
  }
  return false;
}

Value slice(const Value& obj, const Value* start, const Value* stop, const Value* step) {
  require_defined(obj);
  if (!obj.is_string() && !obj.is_list())
    type_error("'" + std::string(type_name(obj)) + "' object is not subscriptable");
  const bool none_start = start == nullptr || start->is_none();
  const bool none_stop = stop == nullptr || stop->is_none();
  const std::int64_t st = (step == nullptr || step->is_none()) ? 1 : slice_index(step);
  if (st == 0) throw Error(ErrorKind::value_error, "slice step cannot be zero");
  std::vector<std::string_view> chars;
  if (obj.is_string()) chars = code_points(obj.str());
  const auto n = static_cast<std::int64_t>(obj.is_string() ? chars.size() : obj.list().size());
  auto clamp = [&](std::int64_t i, bool forward) {
    if (i < 0) i += n;
    if (forward) return std::clamp<std::int64_t>(i, 0, n);
    return std::clamp<std::int64_t>(i, -1, n - 1);
  };
  const bool forward = st > 0;
  const std::int64_t from = none_start ? (forward ? 0 : n - 1) : clamp(slice_index(start), forward);
  const std::int64_t to = none_stop ? (forward ? n : -1) : clamp(slice_index(stop), forward);
  if (obj.is_string()) {
    if (st == 1) {
      if (from >= to) return std::string();
      const std::string_view first = chars[static_cast<std::size_t>(from)];
      const std::string_view last = chars[static_cast<std::size_t>(to - 1)];
      return substr(obj.marked(), std::string_view(first.data(), last.data() + last.size() - first.data()));
    }
    Str out;
    for (std::int64_t i = from; forward ? i < to : i > to; i += st)
      append(out, substr(obj.marked(), chars[static_cast<std::size_t>(i)]));
    return out;
  }
  List out;
  for (std::int64_t i = from; forward ? i < to : i > to; i += st)
    out.push_back(obj.list()[static_cast<std::size_t>(i)]);
  return out;
}

Str percent_format(const Str& marked_format, const Value& args) {
  const std::string& format = marked_format.text;
  std::vector<Value> items;
  if (args.is_list()) {
    items = args.list();
  } else {
    items.push_back(args);
  }
  std::size_t next = 0;
  Str out;
  for (std::size_t i = 0; i < format.size(); ++i) {
    if (format[i] != '%') {
      const std::size_t end = std::min(format.find('%', i), format.size());
      append(out, substr(marked_format, std::string_view(format).substr(i, end - i)));
      i = end - 1;
      continue;
    }
    if (++i >= format.size()) throw Error(ErrorKind::value_error, "incomplete format");
    const char conv = format[i];
    if (conv == '%') {
      append(out, substr(marked_format, std::string_view(format).substr(i, 1)));
      continue;
    }
    if (next >= items.size()) type_error("not enough arguments for format string");
    const Value& v = items[next++];
    if (conv == 's') {
      append_str(v, out);
    } else if (conv == 'r') {
      std::string repr;
      append_repr(v, repr);
      append(out, client_str(std::move(repr), from_client(v)));
    } else if (conv == 'd' || conv == 'i') {
      if (!v.is_number())
        type_error("%d format: a real number is required, not " + std::string(type_name(v)));
      append(out, std::to_string(v.is_float() ? static_cast<std::int64_t>(v.as_double()) : v.as_int()));
    } else if (conv == 'f') {
      if (!v.is_number()) type_error("must be real number, not " + std::string(type_name(v)));
      char buf[64];
      std::snprintf(buf, sizeof buf, "%.6f", v.as_double());
      append(out, std::string_view(buf));
    } else {
      throw Error(ErrorKind::value_error, std::string("unsupported format character '") + conv + "'");
    }
  }
  if (next < items.size()) type_error("not all arguments converted during string formatting");
  return out;
}

}  // namespace capserve::runtime::jinja
