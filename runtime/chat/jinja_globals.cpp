#include "runtime/chat/jinja_globals.h"

#include <chrono>
#include <ctime>

#include "runtime/chat/jinja_renderer.h"

namespace capserve::runtime::jinja {
namespace {

[[noreturn]] void type_error(std::string message) {
  throw Error(ErrorKind::type_error, std::move(message));
}

std::int64_t int_arg(const Value& v) {
  if (!v.is_int() && !v.is_bool()) {
    require_defined(v);
    type_error("'" + std::string(type_name(v)) + "' object cannot be interpreted as an integer");
  }
  return v.as_int();
}

void check_name(const Value& key) {
  if (key.is_string() && key.str().starts_with('_')) {
    throw Error(ErrorKind::security_error,
                "Chat templates cannot store underscore-prefixed attributes on a "
                "namespace, but got '" +
                    key.str() + "'. Please rename the attribute.");
  }
}

// dict(mapping_or_pairs, **kwargs), as Python builds it.
Dict make_dict(Renderer& r, const Args& args) {
  Dict d;
  if (args.positional.size() > 1)
    type_error("dict expected at most 1 argument, got " + std::to_string(args.positional.size()));
  if (!args.positional.empty()) {
    const Value& src = args.positional[0];
    if (src.is_dict()) {
      d = src.dict();
    } else if (src.is_namespace()) {
      d = src.ns().attrs;
    } else {
      const std::shared_ptr<const List> items = r.items(src);
      // Each key is looked up among those before it.
      r.charge(size_mul(items->size(), items->size()) / 2);
      for (const Value& pair : *items) {
        const std::shared_ptr<const List> kv = r.items(pair);
        if (kv->size() != 2) type_error("dictionary update sequence element has length != 2");
        d.set((*kv)[0], (*kv)[1]);
      }
    }
  }
  for (const auto& [k, v] : args.keyword) d.set(k, v);
  return d;
}

struct Range final : Callable {
  Value call(Renderer& r, Args& args) const override {
    const auto& p = args.positional;
    if (p.empty() || p.size() > 3)
      type_error("range expected 1 to 3 arguments, got " + std::to_string(p.size()));
    const std::int64_t start = p.size() == 1 ? 0 : int_arg(p[0]);
    const std::int64_t stop = int_arg(p.size() == 1 ? p[0] : p[1]);
    const std::int64_t step = p.size() == 3 ? int_arg(p[2]) : 1;
    if (step == 0) throw Error(ErrorKind::value_error, "range() arg 3 must not be zero");
    // Python's len(range(...)), in unsigned arithmetic so that no span overflows.
    const bool up = step > 0;
    const std::uint64_t span =
        up ? (stop > start ? static_cast<std::uint64_t>(stop) - static_cast<std::uint64_t>(start) : 0)
           : (start > stop ? static_cast<std::uint64_t>(start) - static_cast<std::uint64_t>(stop) : 0);
    const std::uint64_t stride = up ? static_cast<std::uint64_t>(step) : 0 - static_cast<std::uint64_t>(step);
    const std::uint64_t count = span == 0 ? 0 : (span - 1) / stride + 1;
    r.charge(count);
    r.produce(Renderer::list_bytes(count > SIZE_MAX / sizeof(Value) ? SIZE_MAX : count, 0));
    List out;
    out.reserve(count);
    for (std::int64_t i = start, k = 0; static_cast<std::uint64_t>(k) < count; ++k, i += step)
      out.emplace_back(i);
    return out;
  }
  std::string_view name() const override { return "range"; }
};

struct MakeNamespace final : Callable {
  Value call(Renderer& r, Args& args) const override {
    auto ns = std::make_shared<Namespace>();
    ns->attrs = make_dict(r, args);
    for (const auto& [k, v] : ns->attrs.items) check_name(k);
    return ns;
  }
  std::string_view name() const override { return "namespace"; }
};

struct MakeDict final : Callable {
  Value call(Renderer& r, Args& args) const override { return make_dict(r, args); }
  std::string_view name() const override { return "dict"; }
};

struct RaiseException final : Callable {
  Value call(Renderer&, Args& args) const override {
    const Value* message = args.get(0, "message");
    throw Error(ErrorKind::template_error, message == nullptr ? std::string() : to_str(*message));
  }
  std::string_view name() const override { return "raise_exception"; }
};

struct StrftimeNow final : Callable {
  Value call(Renderer& r, Args& args) const override {
    const Value* format = args.get(0, "format");
    if (format == nullptr || !format->is_string()) type_error("strftime() argument 1 must be str");
    std::tm now{};
    if (r.options().now) {
      now = r.options().now();
    } else {
      const std::time_t t = std::chrono::system_clock::to_time_t(std::chrono::system_clock::now());
      localtime_r(&t, &now);
    }
    if (format->str().empty()) return std::string();
    std::string out(256, '\0');
    // strftime returns 0 both for an empty result and for a too-small buffer; grow a few times, then give up.
    for (int attempt = 0; attempt < 6; ++attempt) {
      const std::size_t n = std::strftime(out.data(), out.size(), format->str().c_str(), &now);
      if (n > 0) {
        out.resize(n);
        return client_str(std::move(out),
                          from_client(*format));  // a client's format writes the client's text
      }
      out.resize(out.size() * 4);
    }
    return std::string();
  }
  std::string_view name() const override { return "strftime_now"; }
};

template <typename T>
Value global() {
  static const std::shared_ptr<const Callable> instance = std::make_shared<const T>();
  return Value(instance);
}

}  // namespace

std::optional<Value> find_global(std::string_view name) {
  if (name == "range") return global<Range>();
  if (name == "namespace") return global<MakeNamespace>();
  if (name == "dict") return global<MakeDict>();
  if (name == "raise_exception") return global<RaiseException>();
  if (name == "strftime_now") return global<StrftimeNow>();
  return std::nullopt;
}

const char* refused_global_reason(std::string_view name) {
  if (name == "cycler" || name == "joiner") return "stateful helper objects; use loop.cycle() or loop.first";
  if (name == "lipsum") return "random placeholder text";
  return nullptr;
}

}  // namespace capserve::runtime::jinja
