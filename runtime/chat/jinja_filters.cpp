#include "runtime/chat/jinja_filters.h"

#include <algorithm>
#include <bit>
#include <charconv>
#include <cmath>
#include <cstdlib>

#include "runtime/chat/jinja_json.h"
#include "runtime/chat/jinja_methods.h"
#include "runtime/chat/jinja_operators.h"
#include "runtime/chat/jinja_renderer.h"
#include "runtime/chat/jinja_strings.h"

namespace capserve::runtime::jinja {
namespace {

[[noreturn]] void type_error(std::string message) {
  throw Error(ErrorKind::type_error, std::move(message));
}

bool flag(const Args& args, std::size_t index, std::string_view name, bool fallback) {
  const Value* v = args.get(index, name);
  return v == nullptr ? fallback : truthy(*v);
}

// Jinja's soft_str: str(value), Undefined as "", within `r`'s bounds.
std::string text(Renderer& r, const Value& v) {
  r.check_text(v);
  return to_str(v);
}

// The same with its client marks (to_marked_str).
Str marked_text(Renderer& r, const Value& v) {
  r.check_text(v);
  return to_marked_str(v);
}

// A filter's str result made from `v` by a mapping that keeps every byte in place (ASCII case mapping): the
// marks of a str stay where they were; the text of any other value is the client's if it came from them.
Str same_places(Renderer& r, const Value& v, std::string (*map)(std::string_view)) {
  Str s = marked_text(r, v);
  s.text = map(s.text);
  return s;
}

// Whether any argument of a filter holds client bytes.
bool args_from_client(const Args& args) {
  return std::any_of(args.positional.begin(), args.positional.end(),
                     [](const Value& a) { return from_client(a); }) ||
         std::any_of(args.keyword.begin(), args.keyword.end(),
                     [](const auto& a) { return from_client(a.second); });
}

// item[part] for each dotted part of `attribute`, as Jinja's make_attrgetter does.
Value attribute_of(const Value& item, const std::string& attribute) {
  Value current = item;
  std::size_t start = 0;
  while (start <= attribute.size()) {
    const std::size_t dot = std::min(attribute.find('.', start), attribute.size());
    const std::string_view part = std::string_view(attribute).substr(start, dot - start);
    require_defined(current);
    Value next = Undefined{object_description(current) + " has no attribute '" + std::string(part) + "'"};
    std::int64_t index = 0;
    const bool numeric =
        std::from_chars(part.data(), part.data() + part.size(), index).ptr == part.data() + part.size() &&
        !part.empty();
    if (current.is_dict()) {
      if (const Value* v = current.dict().find(part)) next = *v;
    } else if (current.is_namespace()) {
      if (const Value* v = current.ns().attrs.find(part)) next = *v;
    } else if (current.is_list() && numeric && index >= 0 &&
               static_cast<std::size_t>(index) < current.list().size()) {
      next = current.list()[static_cast<std::size_t>(index)];
    } else if (const Value* field = current.is_list() ? group_field(current.list(), part) : nullptr) {
      next = *field;
    }
    current = std::move(next);
    start = dot + 1;
  }
  return current;
}

const std::string& attribute_arg(const Args& args, std::size_t index, std::string_view filter) {
  const Value* a = args.get(index, "attribute");
  if (a == nullptr || !a->is_string()) type_error(std::string(filter) + "() needs an attribute name");
  return a->str();
}

// Jinja's ignore_case for sorting: strings compare lower-cased unless case_sensitive.
Value sort_key(const Value& v, bool case_sensitive) {
  if (!case_sensitive && v.is_string()) return py_lower(v.str());
  return v;
}

Value f_tojson(Renderer& r, const Value& v, const Args& args) {
  JsonOptions o;
  o.max_bytes = r.options().max_value_bytes;
  o.ensure_ascii = flag(args, 0, "ensure_ascii", false);
  if (const Value* indent = args.get(1, "indent"); indent != nullptr && !indent->is_none()) {
    if (indent->is_string()) {
      o.indent = indent->str();
    } else if (indent->is_int() || indent->is_bool()) {
      const auto width = static_cast<std::size_t>(std::max<std::int64_t>(indent->as_int(), 0));
      r.produce(width);
      o.indent = std::string(width, ' ');
    } else {
      type_error("indent must be an int or a str");
    }
    o.item_separator = ",";
  }
  if (const Value* separators = args.get(2, "separators"); separators != nullptr && !separators->is_none()) {
    if (!separators->is_list() || separators->list().size() != 2 || !separators->list()[0].is_string() ||
        !separators->list()[1].is_string()) {
      type_error("separators must be a pair of strings");
    }
    o.item_separator = separators->list()[0].str();
    o.key_separator = separators->list()[1].str();
  }
  o.sort_keys = flag(args, 3, "sort_keys", false);
  std::string out;
  append_json(v, o, out);
  r.produce(out.size());
  // JSON escapes and reorders the text: it is the client's as a whole if any of it was.
  return client_str(std::move(out), from_client(v) || args_from_client(args));
}

Value f_length(Renderer&, const Value& v, const Args&) {
  return static_cast<std::int64_t>(length(v));
}

Value f_trim(Renderer& r, const Value& v, const Args& args) {
  const Value* chars = args.get(0, "chars");
  std::optional<std::string> set;
  if (chars != nullptr && !chars->is_none()) set = text(r, *chars);
  const Str s = marked_text(r, v);
  return substr(s, py_strip_chars(s.text, set, true, true));
}

Value f_string(Renderer& r, const Value& v, const Args&) {
  return marked_text(r, v);
}
Value f_upper(Renderer& r, const Value& v, const Args&) {
  return same_places(r, v, py_upper);
}
Value f_lower(Renderer& r, const Value& v, const Args&) {
  return same_places(r, v, py_lower);
}
Value f_capitalize(Renderer& r, const Value& v, const Args&) {
  return same_places(r, v, py_capitalize);
}

// Jinja's title filter: upper-cases the first character of each word, words split at whitespace, "-", and
// opening brackets; lower-cases the rest.
Value f_title(Renderer& r, const Value& v, const Args&) {
  Str marked = marked_text(r, v);
  std::string& s = marked.text;
  bool word_start = true;
  for (char& c : s) {
    const auto u = static_cast<unsigned char>(c);
    if (std::string_view(" \t\n\r\f\v-({[<").find(c) != std::string_view::npos) {
      word_start = true;
      continue;
    }
    c = static_cast<char>(word_start ? std::toupper(u) : std::tolower(u));
    word_start = false;
  }
  return marked;
}

Value f_default(Renderer&, const Value& v, const Args& args) {
  const bool boolean = flag(args, 1, "boolean", false);
  if (v.is_undefined() || (boolean && !truthy(v))) {
    const Value* fallback = args.get(0, "default_value");
    return fallback != nullptr ? *fallback : Value(std::string());
  }
  return v;
}

Value f_safe(Renderer& r, const Value& v, const Args&) {
  return marked_text(r, v);
}

Value f_list(Renderer& r, const Value& v, const Args&) {
  return v.is_list() ? iterate(v) : r.items(v);
}

Value f_items(Renderer& r, const Value& v, const Args&) {
  if (v.is_undefined()) return List{};
  if (!v.is_dict()) type_error("Can only get item pairs from a mapping.");
  // Each item is a pair: a list of two.
  r.produce(Renderer::list_bytes(size_mul(v.dict().items.size(), 3), 0));
  List out;
  out.reserve(v.dict().items.size());
  for (const auto& [k, item] : v.dict().items) out.push_back(pair(k, item));
  return out;
}

Value f_join(Renderer& r, const Value& v, const Args& args) {
  const Value* sep = args.get(0, "d");
  const Str separator = sep == nullptr ? Str() : marked_text(r, *sep);
  const Value* attribute = args.get(1, "attribute");
  const std::shared_ptr<const List> items = r.items(v);
  // The strings' share of the size first, so that joining them is refused before it is built.
  std::size_t size = 0;
  std::size_t client_ranges = 0;
  for (const Value& item : *items) {
    size = size_add(size, size_add(separator.text.size(), item.is_string() ? item.str().size() : 0));
    client_ranges = size_add(
        client_ranges, size_add(separator.client.size(), item.is_string() ? item.marked().client.size() : 0));
  }
  r.produce(Renderer::str_bytes(size, client_ranges));
  Str out;
  out.text.reserve(size);
  out.client.reserve(client_ranges);
  bool first = true;
  for (const Value& item : *items) {
    if (!first) append(out, separator);
    first = false;
    if (attribute != nullptr && attribute->is_string()) {
      append_str(attribute_of(item, attribute->str()), out);
    } else {
      r.check_text(item);
      append_str(item, out);
    }
    if (Renderer::str_bytes(out) > r.options().max_value_bytes) r.produce(Renderer::str_bytes(out));
  }
  return out;
}

Value f_first(Renderer& r, const Value& v, const Args&) {
  const std::shared_ptr<const List> items = v.is_list() ? iterate(v) : r.items(v);
  if (items->empty()) return Undefined{"No first item, sequence was empty."};
  return items->front();
}

Value f_last(Renderer& r, const Value& v, const Args&) {
  const std::shared_ptr<const List> items = v.is_list() ? iterate(v) : r.items(v);
  if (items->empty()) return Undefined{"No last item, sequence was empty."};
  return items->back();
}

Value f_reverse(Renderer& r, const Value& v, const Args&) {
  if (v.is_string()) return slice(r, v, None{}, None{}, Value(-1));
  List items = *r.items(v);
  std::reverse(items.begin(), items.end());
  return items;
}

Value f_indent(Renderer& r, const Value& v, const Args& args) {
  const Value* width = args.get(0, "width");
  Str indentation{"    ", {}};
  if (width != nullptr) {
    if (width->is_string()) {
      indentation = width->marked();
    } else if (width->is_int() || width->is_bool()) {
      const auto n = static_cast<std::size_t>(std::max<std::int64_t>(width->as_int(), 0));
      r.produce(n);
      indentation.text.assign(n, ' ');
    } else {
      type_error("indent width must be an int or a str");
    }
  }
  const bool first = flag(args, 1, "first", false);
  const bool blank = flag(args, 2, "blank", false);
  Str s = marked_text(r, v);
  append(s, "\n");
  const std::vector<std::string_view> lines = py_splitlines(s.text);
  // Where anything is the client's: its ranges, split at most once per line, each line break and each
  // indentation's.
  const std::size_t client_ranges =
      s.client.empty() && indentation.client.empty()
          ? 0
          : size_add(s.client.size(), size_mul(lines.size(), size_add(indentation.client.size(), 2)));
  r.produce(Renderer::str_bytes(size_add(s.text.size(), size_mul(lines.size(), indentation.text.size())),
                                client_ranges));
  Str out;
  if (first) append(out, indentation);
  for (std::size_t i = 0; i < lines.size(); ++i) {
    if (i > 0) {
      // Each line break becomes "\n", the client's where the break it replaces was.
      const char* const break_at = lines[i - 1].data() + lines[i - 1].size();
      const Str line_break = substr(s, std::string_view(break_at, lines[i].data() - break_at));
      append(out, client_str("\n", !line_break.client.empty()));
      if (blank || !lines[i].empty()) append(out, indentation);
    }
    append(out, substr(s, lines[i]));
  }
  return out;
}

Value f_replace(Renderer& r, const Value& v, const Args& args) {
  const Value* old = args.get(0, "old");
  const Value* replacement = args.get(1, "new");
  if (old == nullptr || replacement == nullptr) type_error("replace() needs old and new");
  const Value* count = args.get(2, "count");
  return replace(r, marked_text(r, v), text(r, *old), marked_text(r, *replacement),
                 count == nullptr || count->is_none() ? -1 : count->as_int());
}

Value f_int(Renderer&, const Value& v, const Args& args) {
  const Value* fallback = args.get(0, "default");
  const Value dflt = fallback != nullptr ? *fallback : Value(0);
  if (v.is_int() || v.is_bool()) return v.as_int();
  if (v.is_float())
    return std::isfinite(v.as_double()) ? Value(static_cast<std::int64_t>(v.as_double())) : dflt;
  if (v.is_string()) {
    const std::string s(py_strip_chars(v.str(), std::nullopt, true, true));
    std::int64_t i = 0;
    const char* begin = s.data() + (s.starts_with('+') ? 1 : 0);
    if (!s.empty() && std::from_chars(begin, s.data() + s.size(), i).ptr == s.data() + s.size()) return i;
    char* end = nullptr;
    const double d = std::strtod(s.c_str(), &end);
    if (!s.empty() && end == s.c_str() + s.size() && std::isfinite(d)) return static_cast<std::int64_t>(d);
  }
  return dflt;
}

Value f_float(Renderer&, const Value& v, const Args& args) {
  const Value* fallback = args.get(0, "default");
  const Value dflt = fallback != nullptr ? *fallback : Value(0.0);
  if (v.is_number()) return v.as_double();
  if (v.is_string()) {
    const std::string s(py_strip_chars(v.str(), std::nullopt, true, true));
    char* end = nullptr;
    const double d = std::strtod(s.c_str(), &end);
    if (!s.empty() && end == s.c_str() + s.size()) return d;
  }
  return dflt;
}

Value f_abs(Renderer&, const Value& v, const Args&) {
  require_defined(v);
  if (v.is_float()) return std::fabs(v.as_double());
  if (v.is_int() || v.is_bool()) return v.as_int() < 0 ? -v.as_int() : v.as_int();
  type_error("bad operand type for abs(): '" + std::string(type_name(v)) + "'");
}

Value f_round(Renderer& r, const Value& v, const Args& args) {
  require_defined(v);
  if (!v.is_number()) type_error("type " + std::string(type_name(v)) + " doesn't define __round__ method");
  const Value* precision = args.get(0, "precision");
  const std::int64_t digits = precision == nullptr ? 0 : precision->as_int();
  const Value* method = args.get(1, "method");
  const std::string how = method == nullptr ? "common" : text(r, *method);
  const double scale = std::pow(10.0, static_cast<double>(digits));
  const double x = v.as_double() * scale;
  double rounded = 0;
  if (how == "common") {
    rounded = std::nearbyint(x);  // round-half-even, as Python's round()
  } else if (how == "ceil") {
    rounded = std::ceil(x);
  } else if (how == "floor") {
    rounded = std::floor(x);
  } else {
    throw Error(ErrorKind::template_error, "method must be 'common', 'ceil' or 'floor'");
  }
  return rounded / scale;
}

Value f_escape(Renderer& r, const Value& v, const Args&) {
  // At most 5 bytes ("&amp;") for each.
  r.produce(size_mul(text(r, v).size(), 5));
  std::string out;
  for (const char c : text(r, v)) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&#34;";
        break;
      case '\'':
        out += "&#39;";
        break;
      default:
        out += c;
    }
  }
  return client_str(std::move(out), from_client(v));
}

Value f_dictsort(Renderer& r, const Value& v, const Args& args) {
  if (!v.is_dict()) {
    require_defined(v);
    type_error("You can only sort by either 'key' or 'value'");
  }
  const bool case_sensitive = flag(args, 0, "case_sensitive", false);
  const Value* by = args.get(1, "by");
  const bool by_value = by != nullptr && by->is_string() && by->str() == "value";
  const bool reverse = flag(args, 2, "reverse", false);
  r.produce(Renderer::list_bytes(size_mul(v.dict().items.size(), 4), 0));
  std::vector<std::pair<Value, const std::pair<Value, Value>*>> keyed;
  for (const auto& entry : v.dict().items) {
    keyed.emplace_back(sort_key(by_value ? entry.second : entry.first, case_sensitive), &entry);
  }
  std::stable_sort(keyed.begin(), keyed.end(), [&](const auto& a, const auto& b) {
    return reverse ? less(b.first, a.first) : less(a.first, b.first);
  });
  List out;
  for (const auto& [key, entry] : keyed) out.push_back(pair(entry->first, entry->second));
  return out;
}

Value f_sort(Renderer& r, const Value& v, const Args& args) {
  const bool reverse = flag(args, 0, "reverse", false);
  const bool case_sensitive = flag(args, 1, "case_sensitive", false);
  const Value* attribute = args.get(2, "attribute");
  List items = *r.items(v);
  r.produce(Renderer::list_bytes(size_mul(items.size(), 3), 0));
  // n log n comparisons.
  r.charge(items.size() * static_cast<std::uint64_t>(std::bit_width(items.size())));
  std::vector<std::pair<Value, std::size_t>> keyed;
  for (std::size_t i = 0; i < items.size(); ++i) {
    const Value key =
        attribute != nullptr && attribute->is_string() ? attribute_of(items[i], attribute->str()) : items[i];
    keyed.emplace_back(sort_key(key, case_sensitive), i);
  }
  std::stable_sort(keyed.begin(), keyed.end(), [&](const auto& a, const auto& b) {
    return reverse ? less(b.first, a.first) : less(a.first, b.first);
  });
  List out;
  for (const auto& [key, i] : keyed) out.push_back(items[i]);
  return out;
}

Value f_unique(Renderer& r, const Value& v, const Args& args) {
  const bool case_sensitive = flag(args, 0, "case_sensitive", false);
  List out;
  List seen;
  for (const auto items = r.items(v); const Value& item : *items) {
    // Each item is compared with every distinct one before it.
    r.charge(seen.size());
    Value key = sort_key(item, case_sensitive);
    if (std::none_of(seen.begin(), seen.end(), [&](const Value& s) { return equals(s, key); })) {
      seen.push_back(std::move(key));
      out.push_back(item);
    }
  }
  return out;
}

// select / reject / selectattr / rejectattr: keep the items whose (attribute's) test result is `keep`.
Value select_items(Renderer& r, const Value& v, const Args& args, bool by_attribute, bool keep) {
  std::size_t next = 0;
  std::string attribute;
  if (by_attribute) attribute = attribute_arg(args, next++, keep ? "selectattr" : "rejectattr");
  TestFn test = nullptr;
  if (next < args.positional.size()) {
    const Value& name = args.positional[next++];
    if (!name.is_string()) type_error("the test name must be a string");
    test = find_test(name.str());
    if (test == nullptr) throw Error(ErrorKind::template_error, "No test named '" + name.str() + "'.");
  }
  Args test_args;
  test_args.positional.assign(args.positional.begin() + static_cast<std::ptrdiff_t>(next),
                              args.positional.end());
  List out;
  for (const auto items = r.items(v); const Value& item : *items) {
    const Value subject = by_attribute ? attribute_of(item, attribute) : item;
    r.charge(work(subject) + work(test_args));
    const bool passed = test != nullptr ? test(r, subject, test_args) : truthy(subject);
    if (passed == keep) out.push_back(item);
  }
  return out;
}

Value f_select(Renderer& r, const Value& v, const Args& a) {
  return select_items(r, v, a, false, true);
}
Value f_reject(Renderer& r, const Value& v, const Args& a) {
  return select_items(r, v, a, false, false);
}
Value f_selectattr(Renderer& r, const Value& v, const Args& a) {
  return select_items(r, v, a, true, true);
}
Value f_rejectattr(Renderer& r, const Value& v, const Args& a) {
  return select_items(r, v, a, true, false);
}

Value f_map(Renderer& r, const Value& v, const Args& args) {
  List out;
  const Value* attribute = args.get(args.positional.size(), "attribute");
  if (args.positional.empty() && attribute != nullptr) {
    if (!attribute->is_string()) type_error("map(attribute=...) needs a string");
    const Value* fallback = args.get(args.positional.size(), "default");
    for (const auto items = r.items(v); const Value& item : *items) {
      Value value = attribute_of(item, attribute->str());
      out.push_back(value.is_undefined() && fallback != nullptr ? *fallback : std::move(value));
    }
    return out;
  }
  if (args.positional.empty() || !args.positional[0].is_string())
    type_error("map() needs a filter name or attribute=");
  const FilterFn filter = find_filter(args.positional[0].str());
  if (filter == nullptr)
    throw Error(ErrorKind::template_error, unknown_filter_message(args.positional[0].str()));
  Args filter_args;
  filter_args.positional.assign(args.positional.begin() + 1, args.positional.end());
  filter_args.keyword = args.keyword;
  for (const auto items = r.items(v); const Value& item : *items) {
    r.charge(work(item) + work(filter_args));
    out.push_back(filter(r, item, filter_args));
  }
  return out;
}

Value f_sum(Renderer& r, const Value& v, const Args& args) {
  const Value* attribute = args.get(0, "attribute");
  const Value* start = args.get(1, "start");
  Value total = start != nullptr ? *start : Value(0);
  for (const auto items = r.items(v); const Value& item : *items) {
    total = binary_op(
        r, BinaryOp::add, total,
        attribute != nullptr && attribute->is_string() ? attribute_of(item, attribute->str()) : item);
  }
  return total;
}

Value f_wordcount(Renderer& r, const Value& v, const Args&) {
  std::int64_t n = 0;
  bool in_word = false;
  for (const char c : text(r, v)) {
    const bool word = std::isalnum(static_cast<unsigned char>(c)) != 0 || c == '_' ||
                      (static_cast<unsigned char>(c) >= 0x80);
    if (word && !in_word) ++n;
    in_word = word;
  }
  return n;
}

// min / max: Python's min() / max() over the items keyed by (attribute and) case, so the first of equal items
// wins; an empty sequence gives Undefined, as Jinja's _min_or_max does.
Value min_or_max(Renderer& r, const Value& v, const Args& args, bool want_max) {
  const bool case_sensitive = flag(args, 0, "case_sensitive", false);
  const Value* attribute = args.get(1, "attribute");
  const std::shared_ptr<const List> items = r.items(v);
  if (items->empty()) return Undefined{"No aggregated item, sequence was empty."};
  const auto key = [&](const Value& item) {
    return sort_key(
        attribute != nullptr && !attribute->is_none() ? attribute_of(item, to_str(*attribute)) : item,
        case_sensitive);
  };
  r.charge(items->size());
  std::size_t best = 0;
  Value best_key = key((*items)[0]);
  for (std::size_t i = 1; i < items->size(); ++i) {
    Value k = key((*items)[i]);
    if (want_max ? less(best_key, k) : less(k, best_key)) {
      best = i;
      best_key = std::move(k);
    }
  }
  return (*items)[best];
}

Value f_min(Renderer& r, const Value& v, const Args& args) {
  return min_or_max(r, v, args, false);
}
Value f_max(Renderer& r, const Value& v, const Args& args) {
  return min_or_max(r, v, args, true);
}

std::int64_t int_arg(const Args& args, std::size_t index, std::string_view name, std::int64_t fallback) {
  const Value* v = args.get(index, name);
  if (v == nullptr) return fallback;
  if (!v->is_int() && !v->is_bool()) {
    require_defined(*v);
    type_error("'" + std::string(type_name(*v)) + "' object cannot be interpreted as an integer");
  }
  return v->as_int();
}

// batch(n, fill_with): rows of n items, the last padded with fill_with when given (Jinja's do_batch, a list
// of lists where Jinja yields them).
Value f_batch(Renderer& r, const Value& v, const Args& args) {
  const std::int64_t n = int_arg(args, 0, "linecount", 0);
  const Value* fill = args.get(1, "fill_with");
  const std::shared_ptr<const List> items = r.items(v);
  r.produce(Renderer::list_bytes(size_mul(items->size(), 2), 0));
  List out;
  List row;
  for (const Value& item : *items) {
    if (std::cmp_equal(row.size(), n)) out.push_back(std::exchange(row, List{}));
    row.push_back(item);
  }
  if (!row.empty()) {
    if (fill != nullptr && !fill->is_none() && std::cmp_less(row.size(), n)) {
      r.produce(Renderer::list_bytes(static_cast<std::size_t>(n), 0));
      row.resize(static_cast<std::size_t>(n), *fill);
    }
    out.push_back(std::move(row));
  }
  return out;
}

// slice(n, fill_with): n columns, the first len % n one item longer; the others padded with fill_with when
// given (Jinja's do_slice).
Value f_slice(Renderer& r, const Value& v, const Args& args) {
  const std::int64_t slices = int_arg(args, 0, "slices", 0);
  const Value* fill = args.get(1, "fill_with");
  const std::shared_ptr<const List> items = r.items(v);
  if (slices == 0) throw Error(ErrorKind::zero_division, "integer division or modulo by zero");
  if (slices < 0) return List{};
  const auto n = static_cast<std::size_t>(slices);
  r.produce(Renderer::list_bytes(size_add(size_mul(n, 2), items->size()), 0));
  const std::size_t per_slice = items->size() / n;
  const std::size_t with_extra = items->size() % n;
  List out;
  std::size_t start = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const std::size_t end = start + per_slice + (i < with_extra ? 1 : 0);
    List column(items->begin() + static_cast<std::ptrdiff_t>(start),
                items->begin() + static_cast<std::ptrdiff_t>(end));
    if (fill != nullptr && !fill->is_none() && i >= with_extra) column.push_back(*fill);
    out.push_back(std::move(column));
    start = end;
  }
  return out;
}

std::string spaces(Renderer& r, std::size_t n) {
  r.produce(n);
  return std::string(n, ' ');
}

// str.center(width), widths counted in code points, the odd space where CPython puts it.
Value f_center(Renderer& r, const Value& v, const Args& args) {
  const std::int64_t width = int_arg(args, 0, "width", 80);
  const Str s = marked_text(r, v);
  const auto chars = static_cast<std::int64_t>(length(Value(s)));
  if (width <= chars) return s;
  const std::int64_t margin = width - chars;
  const std::int64_t left = margin / 2 + (margin & width & 1);
  Str out = client_str(spaces(r, static_cast<std::size_t>(left)), false);
  append(out, s);
  append(out, spaces(r, static_cast<std::size_t>(margin - left)));
  return out;
}

// truncate(length=255, killwords=False, end='...', leeway=5), lengths in code points as Jinja's do_truncate.
Value f_truncate(Renderer& r, const Value& v, const Args& args) {
  const Str s = marked_text(r, v);
  const std::int64_t max_length = int_arg(args, 0, "length", 255);
  const bool killwords = flag(args, 1, "killwords", false);
  const Value* end_arg = args.get(2, "end");
  const Str end = end_arg == nullptr ? client_str("...", false) : marked_text(r, *end_arg);
  const std::int64_t leeway = int_arg(args, 3, "leeway", 5);
  const auto end_length = static_cast<std::int64_t>(length(Value(end)));
  if (max_length < end_length || leeway < 0) {
    throw Error(ErrorKind::template_error, "truncate: expected length >= " + std::to_string(end_length) +
                                               " and leeway >= 0, got " + std::to_string(max_length) +
                                               " and " + std::to_string(leeway));
  }
  if (static_cast<std::int64_t>(length(Value(s))) <= max_length + leeway) return s;
  const Value head = slice(r, Value(s), Value(None{}), Value(max_length - end_length), Value(None{}));
  Str out = head.marked();
  if (!killwords) {
    if (const std::size_t space = out.text.rfind(' '); space != std::string::npos) {
      out = substr(out, std::string_view(out.text).substr(0, space));
    }
  }
  append(out, end);
  return out;
}

// format(*args): printf-style, as "%s" % args; keyword arguments (%(name)s) are refused by name.
Value f_format(Renderer& r, const Value& v, const Args& args) {
  if (!args.keyword.empty()) {
    if (!args.positional.empty())
      throw Error(ErrorKind::runtime_error, "can't handle positional and keyword arguments at the same time");
    throw Error(ErrorKind::template_error, "filter 'format' with keyword arguments is not supported");
  }
  List tuple(args.positional.begin(), args.positional.end());
  tuple.tuple = true;
  Str out = percent_format(marked_text(r, v), Value(std::move(tuple)));
  r.produce(Renderer::str_bytes(out));
  return out;
}

// filesizeformat(binary=False): Jinja's decimal (kB, MB) or binary (KiB, MiB) units with one decimal.
Value f_filesizeformat(Renderer&, const Value& v, const Args& args) {
  require_defined(v);
  double bytes = 0;
  if (v.is_number()) {
    bytes = v.as_double();
  } else if (v.is_string()) {
    const std::string s(py_strip_chars(v.str(), std::nullopt, true, true));
    char* end = nullptr;
    bytes = std::strtod(s.c_str(), &end);
    if (s.empty() || end != s.c_str() + s.size()) {
      std::string quoted;
      append_repr(v, quoted);
      throw Error(ErrorKind::value_error, "could not convert string to float: " + quoted);
    }
  } else {
    type_error("float() argument must be a string or a real number, not '" + std::string(type_name(v)) + "'");
  }
  const bool binary = flag(args, 0, "binary", false);
  const double base = binary ? 1024 : 1000;
  if (bytes == 1) return std::string("1 Byte");
  if (bytes < base) {
    if (!std::isfinite(bytes)) return std::string(std::isnan(bytes) ? "nan" : "-inf") + " Bytes";
    return std::to_string(static_cast<std::int64_t>(bytes)) + " Bytes";
  }
  static constexpr std::string_view kDecimal[] = {"kB", "MB", "GB", "TB", "PB", "EB", "ZB", "YB"};
  static constexpr std::string_view kBinary[] = {"KiB", "MiB", "GiB", "TiB", "PiB", "EiB", "ZiB", "YiB"};
  std::size_t i = 0;
  double unit = base * base;
  for (; i + 1 < std::size(kDecimal) && !(bytes < unit); ++i) unit *= base;
  char number[400];
  std::snprintf(number, sizeof number, "%.1f", base * bytes / unit);
  return std::string(number) + " " + std::string(binary ? kBinary[i] : kDecimal[i]);
}

// Python's urllib quote of str(v)'s UTF-8: unreserved bytes kept, "/" too unless for a query string, where a
// space is "+".
void url_quote(const Value& v, bool for_query, std::string& out) {
  for (const char c : to_str(v)) {
    const auto u = static_cast<unsigned char>(c);
    if (std::isalnum(u) != 0 || c == '_' || c == '.' || c == '-' || c == '~' || (c == '/' && !for_query)) {
      out += c;
    } else if (c == ' ' && for_query) {
      out += '+';
    } else {
      static constexpr char kHex[] = "0123456789ABCDEF";
      out += '%';
      out += kHex[u >> 4];
      out += kHex[u & 15];
    }
  }
}

// urlencode: a str (or any non-iterable) quoted; a dict or a sequence of pairs as a query string.
Value f_urlencode(Renderer& r, const Value& v, const Args&) {
  std::string out;
  if (v.is_string() || !(v.is_list() || v.is_dict() || v.is_undefined())) {
    r.check_text(v);
    r.produce(size_mul(to_str(v).size(), 3));
    url_quote(v, false, out);
    return client_str(std::move(out), from_client(v));
  }
  const std::shared_ptr<const List> pairs =
      v.is_dict() ? std::make_shared<const List>(f_items(r, v, {}).list()) : r.items(v);
  for (const Value& p : *pairs) {
    const std::shared_ptr<const List> kv = r.items(p);
    if (kv->size() != 2) throw Error(ErrorKind::value_error, "urlencode needs pairs of key and value");
    r.check_text((*kv)[0]);
    r.check_text((*kv)[1]);
    r.produce(size_mul(size_add(to_str((*kv)[0]).size(), to_str((*kv)[1]).size()), 3));
    if (!out.empty()) out += '&';
    url_quote((*kv)[0], true, out);
    out += '=';
    url_quote((*kv)[1], true, out);
  }
  return client_str(std::move(out), from_client(v));
}

// groupby(attribute, default=None, case_sensitive=False): the items sorted by the attribute, grouped where it
// is equal; each group a (grouper, list) pair that also answers .grouper and .list, the grouper as the
// group's first item spells it.
Value f_groupby(Renderer& r, const Value& v, const Args& args) {
  const Value* attribute = args.get(0, "attribute");
  if (attribute == nullptr) type_error("groupby() needs an attribute");
  const std::string name = to_str(*attribute);
  const Value* fallback = args.get(1, "default");
  const bool case_sensitive = flag(args, 2, "case_sensitive", false);
  const auto value_of = [&](const Value& item) {
    Value value = attribute_of(item, name);
    return value.is_undefined() && fallback != nullptr && !fallback->is_none() ? *fallback : value;
  };
  const std::shared_ptr<const List> items = r.items(v);
  r.produce(Renderer::list_bytes(size_mul(items->size(), 4), 0));
  r.charge(items->size() * static_cast<std::uint64_t>(std::bit_width(items->size())));
  std::vector<std::pair<Value, std::size_t>> keyed;
  for (std::size_t i = 0; i < items->size(); ++i)
    keyed.emplace_back(sort_key(value_of((*items)[i]), case_sensitive), i);
  std::stable_sort(keyed.begin(), keyed.end(),
                   [](const auto& a, const auto& b) { return less(a.first, b.first); });
  List out;
  for (std::size_t i = 0; i < keyed.size();) {
    List group;
    std::size_t j = i;
    for (; j < keyed.size() && equals(keyed[j].first, keyed[i].first); ++j)
      group.push_back((*items)[keyed[j].second]);
    List grouped{value_of((*items)[keyed[i].second]), Value(std::move(group))};
    grouped.tuple = true;
    grouped.group = true;
    out.push_back(std::move(grouped));
    i = j;
  }
  return out;
}

// ---- tests ----

bool t_defined(Renderer&, const Value& v, const Args&) {
  return !v.is_undefined();
}
bool t_undefined(Renderer&, const Value& v, const Args&) {
  return v.is_undefined();
}
bool t_none(Renderer&, const Value& v, const Args&) {
  return v.is_none();
}
bool t_string(Renderer&, const Value& v, const Args&) {
  return v.is_string();
}
bool t_mapping(Renderer&, const Value& v, const Args&) {
  return v.is_dict();
}
bool t_iterable(Renderer&, const Value& v, const Args&) {
  return v.is_string() || v.is_list() || v.is_dict() || v.is_undefined();
}
bool t_sequence(Renderer&, const Value& v, const Args&) {
  return v.is_string() || v.is_list() || v.is_dict() || v.is_undefined();
}
bool t_number(Renderer&, const Value& v, const Args&) {
  return v.is_number();
}
bool t_integer(Renderer&, const Value& v, const Args&) {
  return v.is_int();
}
bool t_float(Renderer&, const Value& v, const Args&) {
  return v.is_float();
}
bool t_boolean(Renderer&, const Value& v, const Args&) {
  return v.is_bool();
}
bool t_true(Renderer&, const Value& v, const Args&) {
  return v.is_bool() && v.as_int() != 0;
}
bool t_false(Renderer&, const Value& v, const Args&) {
  return v.is_bool() && v.as_int() == 0;
}
bool t_callable(Renderer&, const Value& v, const Args&) {
  return v.is_callable();
}
bool t_escaped(Renderer&, const Value&, const Args&) {
  return false;
}

const Value& other(const Args& args, std::string_view test) {
  const Value* v = args.get(0, "other");
  if (v == nullptr) type_error("the '" + std::string(test) + "' test needs an argument");
  return *v;
}

bool t_eq(Renderer&, const Value& v, const Args& a) {
  return compare(CompareOp::eq, v, other(a, "eq"));
}
bool t_ne(Renderer&, const Value& v, const Args& a) {
  return compare(CompareOp::ne, v, other(a, "ne"));
}
bool t_lt(Renderer&, const Value& v, const Args& a) {
  return compare(CompareOp::lt, v, other(a, "lt"));
}
bool t_le(Renderer&, const Value& v, const Args& a) {
  return compare(CompareOp::le, v, other(a, "le"));
}
bool t_gt(Renderer&, const Value& v, const Args& a) {
  return compare(CompareOp::gt, v, other(a, "gt"));
}
bool t_ge(Renderer&, const Value& v, const Args& a) {
  return compare(CompareOp::ge, v, other(a, "ge"));
}
bool t_in(Renderer&, const Value& v, const Args& a) {
  return contains(other(a, "in"), v);
}
bool t_sameas(Renderer&, const Value& v, const Args& a) {
  const Value& o = other(a, "sameas");
  if (v.v.index() != o.v.index()) return false;
  if (v.is_list()) return &v.list() == &o.list();
  if (v.is_dict()) return &v.dict() == &o.dict();
  return equals(v, o);
}
bool t_odd(Renderer&, const Value& v, const Args&) {
  require_defined(v);
  if (!v.is_int() && !v.is_bool()) type_error("the 'odd' test needs an integer");
  return v.as_int() % 2 != 0;
}
bool t_even(Renderer& r, const Value& v, const Args& a) {
  return !t_odd(r, v, a);
}
bool t_divisibleby(Renderer& r, const Value& v, const Args& a) {
  const Value& d = other(a, "divisibleby");
  const Value rem = binary_op(r, BinaryOp::mod, v, d);
  return rem.as_double() == 0;
}
bool t_lower(Renderer&, const Value& v, const Args&) {
  return v.is_string() && py_lower(v.str()) == v.str();
}
bool t_upper(Renderer&, const Value& v, const Args&) {
  return v.is_string() && py_upper(v.str()) == v.str();
}

// `name is filter` / `name is test`: whether Jinja2's environment has it (a refused filter too: Jinja2 has
// it).
void require_hashable(const Value& v) {
  if (v.is_list() || v.is_dict()) type_error("unhashable type: '" + std::string(type_name(v)) + "'");
}
bool t_filter(Renderer&, const Value& v, const Args&) {
  require_hashable(v);
  return v.is_string() && (find_filter(v.str()) != nullptr || refused_filter_reason(v.str()) != nullptr);
}
bool t_test(Renderer&, const Value& v, const Args&) {
  require_hashable(v);
  return v.is_string() && find_test(v.str()) != nullptr;
}

struct NamedFilter {
  std::string_view name;
  FilterFn fn;
};
struct NamedTest {
  std::string_view name;
  TestFn fn;
};

constexpr NamedFilter kFilters[] = {
    {"tojson", f_tojson},
    {"length", f_length},
    {"count", f_length},
    {"trim", f_trim},
    {"string", f_string},
    {"upper", f_upper},
    {"lower", f_lower},
    {"capitalize", f_capitalize},
    {"title", f_title},
    {"default", f_default},
    {"d", f_default},
    {"safe", f_safe},
    {"list", f_list},
    {"items", f_items},
    {"join", f_join},
    {"first", f_first},
    {"last", f_last},
    {"reverse", f_reverse},
    {"indent", f_indent},
    {"replace", f_replace},
    {"int", f_int},
    {"float", f_float},
    {"abs", f_abs},
    {"round", f_round},
    {"escape", f_escape},
    {"e", f_escape},
    {"dictsort", f_dictsort},
    {"sort", f_sort},
    {"unique", f_unique},
    {"select", f_select},
    {"reject", f_reject},
    {"selectattr", f_selectattr},
    {"rejectattr", f_rejectattr},
    {"map", f_map},
    {"sum", f_sum},
    {"wordcount", f_wordcount},
    {"min", f_min},
    {"max", f_max},
    {"batch", f_batch},
    {"slice", f_slice},
    {"center", f_center},
    {"truncate", f_truncate},
    {"format", f_format},
    {"filesizeformat", f_filesizeformat},
    {"urlencode", f_urlencode},
    {"groupby", f_groupby},
    // Without Markup values escape already escapes everything.
    {"forceescape", f_escape},
};

// Jinja2's built-in filters that this engine refuses when it compiles a template, and why.
struct RefusedFilter {
  std::string_view name;
  const char* reason;
};
constexpr RefusedFilter kRefusedFilters[] = {
    {"attr", "Python attribute access; use x.name or x['name']"},
    {"pprint", "Python's pprint layout is not reproduced; use tojson"},
    {"random", "a chat template must render deterministically"},
    {"striptags", "HTML tag stripping and entity decoding are not reproduced"},
    {"urlize", "URL detection in text is not reproduced"},
    {"wordwrap", "Python's textwrap line breaking is not reproduced"},
    {"xmlattr", "XML attribute rendering is not reproduced"},
};

constexpr NamedTest kTests[] = {
    {"defined", t_defined},
    {"undefined", t_undefined},
    {"none", t_none},
    {"string", t_string},
    {"mapping", t_mapping},
    {"iterable", t_iterable},
    {"sequence", t_sequence},
    {"number", t_number},
    {"integer", t_integer},
    {"float", t_float},
    {"boolean", t_boolean},
    {"true", t_true},
    {"false", t_false},
    {"callable", t_callable},
    {"escaped", t_escaped},
    {"eq", t_eq},
    {"equalto", t_eq},
    {"==", t_eq},
    {"ne", t_ne},
    {"!=", t_ne},
    {"lt", t_lt},
    {"lessthan", t_lt},
    {"<", t_lt},
    {"le", t_le},
    {"<=", t_le},
    {"gt", t_gt},
    {"greaterthan", t_gt},
    {">", t_gt},
    {"ge", t_ge},
    {">=", t_ge},
    {"in", t_in},
    {"sameas", t_sameas},
    {"odd", t_odd},
    {"even", t_even},
    {"divisibleby", t_divisibleby},
    {"lower", t_lower},
    {"upper", t_upper},
    {"filter", t_filter},
    {"test", t_test},
};

}  // namespace

FilterFn find_filter(std::string_view name) {
  for (const NamedFilter& f : kFilters) {
    if (f.name == name) return f.fn;
  }
  return nullptr;
}

const char* refused_filter_reason(std::string_view name) {
  for (const RefusedFilter& f : kRefusedFilters) {
    if (f.name == name) return f.reason;
  }
  return nullptr;
}

std::string unknown_filter_message(const std::string& name) {
  if (const char* why = refused_filter_reason(name))
    return "filter '" + name + "' is not supported (" + why + ")";
  return "No filter named '" + name + "'.";
}

TestFn find_test(std::string_view name) {
  for (const NamedTest& t : kTests) {
    if (t.name == name) return t.fn;
  }
  return nullptr;
}

}  // namespace capserve::runtime::jinja
