#include "runtime/chat/jinja_operators.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdio>
#include <string>

#include "runtime/chat/jinja_renderer.h"

namespace capserve::runtime::jinja {
namespace {

[[noreturn]] void type_error(std::string message) {
  throw Error(ErrorKind::type_error, std::move(message));
}

[[noreturn]] void unsupported(const char* op, const Value& a, const Value& b) {
  type_error(std::string("unsupported operand type(s) for ") + op + ": '" + std::string(type_name(a)) +
             "' and '" + std::string(type_name(b)) + "'");
}

// The bytes of the strings a list holds directly, their client ranges too: copying the list copies them.
std::size_t string_bytes(const List& l) {
  std::size_t bytes = 0;
  for (const Value& v : l) {
    if (v.is_string()) bytes += Renderer::str_bytes(v.marked());
  }
  return bytes;
}

Value repeat(Renderer& r, const Value& seq, std::int64_t times) {
  const auto n = static_cast<std::size_t>(std::max<std::int64_t>(times, 0));
  if (seq.is_string()) {
    const Str& piece = seq.marked();
    const std::size_t size = size_mul(piece.text.size(), n);
    // The copies' client ranges, of which two meet and merge at every seam where the piece both starts and
    // ends with client bytes (a message's content repeated stays one range).
    const std::size_t k = piece.client.size();
    const bool seams_merge =
        k > 0 && piece.client.front().begin == 0 && piece.client.back().end == piece.text.size();
    const std::size_t ranges = n == 0 ? 0 : seams_merge ? size_add(size_mul(n, k - 1), 1) : size_mul(n, k);
    r.produce(Renderer::str_bytes(size, ranges));
    if (size == 0) return std::string();
    // Doubling what is there already, bit by bit of n from the highest: a few large copies instead of n small
    // appends; append() shifts the copied marks, so every copy keeps its client bytes.
    Str out;
    out.text.reserve(size);
    out.client.reserve(ranges);
    for (int bit = std::bit_width(n) - 1; bit >= 0; --bit) {
      append(out, out);
      if ((n >> bit) & 1U) append(out, piece);
    }
    return out;
  }
  const List& l = seq.list();
  // An empty list repeated any number of times costs nothing, but counts as n steps of work all the same.
  r.charge(n);
  r.produce(Renderer::list_bytes(size_mul(l.size(), n), size_mul(string_bytes(l), n)));
  List out;
  out.reserve(l.size() * n);
  for (std::size_t i = 0; i < n; ++i) out.insert(out.end(), l.begin(), l.end());
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

Value binary_op(Renderer& r, BinaryOp op, const Value& a, const Value& b) {
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
        r.produce(Renderer::str_bytes(size_add(a.str().size(), b.str().size()),
                                      size_add(a.marked().client.size(), b.marked().client.size())));
        Str out;
        out.text.reserve(a.str().size() + b.str().size());
        append(out, a.marked());
        append(out, b.marked());
        return out;
      }
      if (a.is_list() && b.is_list()) {
        r.produce(Renderer::list_bytes(size_add(a.list().size(), b.list().size()),
                                       size_add(string_bytes(a.list()), string_bytes(b.list()))));
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
      if ((a.is_string() || a.is_list()) && (b.is_int() || b.is_bool())) return repeat(r, a, b.as_int());
      if ((b.is_string() || b.is_list()) && (a.is_int() || a.is_bool())) return repeat(r, b, a.as_int());
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
      if (a.is_string()) {
        r.check_text(b);
        Str out = percent_format(a.marked(), b);
        r.produce(Renderer::str_bytes(out));
        return out;
      }
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

Value slice(Renderer& r, const Value& obj, const Value& start, const Value& stop, const Value& step) {
  require_defined(obj);
  if (!obj.is_string() && !obj.is_list())
    type_error("'" + std::string(type_name(obj)) + "' object is not subscriptable");
  const std::int64_t st = step.is_none() ? 1 : slice_index(&step);
  if (st == 0) throw Error(ErrorKind::value_error, "slice step cannot be zero");
  // Python indexes a str by code point: each one's bytes, unless every byte is one (the common case).
  std::vector<std::string_view> chars;
  std::size_t n = 0;
  if (obj.is_string()) {
    const std::string& text = obj.str();
    r.charge(work(obj));
    n = code_point_count(text);
    if (n != text.size()) {
      r.produce(size_mul(n, sizeof(std::string_view)));
      chars = code_points(text);
    }
  } else {
    n = obj.list().size();
  }
  const auto count = static_cast<std::int64_t>(n);
  auto clamp = [&](std::int64_t i, bool forward) {
    if (i < 0) i += count;
    if (forward) return std::clamp<std::int64_t>(i, 0, count);
    return std::clamp<std::int64_t>(i, -1, count - 1);
  };
  const bool forward = st > 0;
  const std::int64_t from = start.is_none() ? (forward ? 0 : count - 1) : clamp(slice_index(&start), forward);
  const std::int64_t to = stop.is_none() ? (forward ? count : -1) : clamp(slice_index(&stop), forward);
  const std::int64_t span = forward ? to - from : from - to;
  const auto taken = static_cast<std::size_t>(span <= 0 ? 0 : (span - 1) / (forward ? st : -st) + 1);
  if (obj.is_string()) {
    const Str& marked = obj.marked();
    const std::string& text = marked.text;
    auto char_at = [&](std::int64_t i) {
      const auto k = static_cast<std::size_t>(i);
      return chars.empty() ? std::string_view(text).substr(k, 1) : chars[k];
    };
    if (st == 1) {
      if (taken == 0) return std::string();
      const char* begin = char_at(from).data();
      const char* end = char_at(to - 1).data() + char_at(to - 1).size();
      return substr(marked, std::string_view(begin, end - begin));
    }
    Str out;
    out.text.reserve(taken);
    for (std::int64_t i = from; forward ? i < to : i > to; i += st) append(out, substr(marked, char_at(i)));
    return out;
  }
  r.produce(Renderer::list_bytes(taken, 0));
  List out;
  out.reserve(taken);
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
