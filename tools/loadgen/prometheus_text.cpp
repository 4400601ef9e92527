#include "tools/loadgen/prometheus_text.h"

#include <charconv>
#include <cmath>
#include <limits>

namespace capserve::loadgen {
namespace {

bool is_space(char c) {
  return c == ' ' || c == '\t';
}

void skip_spaces(std::string_view s, std::size_t& pos) {
  while (pos < s.size() && is_space(s[pos])) ++pos;
}

bool is_name_char(char c, bool first) {
  const bool alpha = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || c == ':';
  return alpha || (!first && c >= '0' && c <= '9');
}

std::optional<std::string> read_name(std::string_view s, std::size_t& pos) {
  const std::size_t begin = pos;
  while (pos < s.size() && is_name_char(s[pos], pos == begin)) ++pos;
  if (pos == begin) return std::nullopt;
  return std::string(s.substr(begin, pos - begin));
}

std::optional<double> read_value(std::string_view s) {
  if (s == "+Inf" || s == "Inf") return std::numeric_limits<double>::infinity();
  if (s == "-Inf") return -std::numeric_limits<double>::infinity();
  if (s == "NaN") return std::numeric_limits<double>::quiet_NaN();
  if (!s.empty() && s.front() == '+') s.remove_prefix(1);
  double v = 0;
  const auto [end, error] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (error != std::errc() || end != s.data() + s.size()) return std::nullopt;
  return v;
}

// `{name="value",...}` starting at s[pos] == '{'.
bool read_labels(std::string_view s, std::size_t& pos, std::map<std::string, std::string>& labels) {
  ++pos;
  for (;;) {
    skip_spaces(s, pos);
    if (pos < s.size() && s[pos] == '}') {
      ++pos;
      return true;
    }
    const std::optional<std::string> name = read_name(s, pos);
    if (!name) return false;
    skip_spaces(s, pos);
    if (pos >= s.size() || s[pos] != '=') return false;
    ++pos;
    skip_spaces(s, pos);
    if (pos >= s.size() || s[pos] != '"') return false;
    ++pos;
    std::string value;
    for (;;) {
      if (pos >= s.size()) return false;
      const char c = s[pos++];
      if (c == '"') break;
      if (c == '\\') {
        if (pos >= s.size()) return false;
        const char e = s[pos++];
        value += e == 'n' ? '\n' : e;  // \\ and \" stand for themselves
      } else {
        value += c;
      }
    }
    labels[*name] = std::move(value);
    skip_spaces(s, pos);
    if (pos < s.size() && s[pos] == ',') ++pos;
  }
}

std::optional<Sample> read_sample(std::string_view line) {
  std::size_t pos = 0;
  Sample sample;
  std::optional<std::string> name = read_name(line, pos);
  if (!name) return std::nullopt;
  sample.name = std::move(*name);
  skip_spaces(line, pos);
  if (pos < line.size() && line[pos] == '{' && !read_labels(line, pos, sample.labels)) return std::nullopt;
  skip_spaces(line, pos);
  std::size_t end = pos;
  while (end < line.size() && !is_space(line[end])) ++end;
  const std::optional<double> value = read_value(line.substr(pos, end - pos));
  if (!value) return std::nullopt;
  sample.value = *value;
  return sample;  // a trailing timestamp, if any, is ignored
}

bool matches(const Sample& s, const std::vector<std::pair<std::string, std::string>>& match) {
  for (const auto& [k, v] : match) {
    const auto it = s.labels.find(k);
    if (it == s.labels.end() || it->second != v) return false;
  }
  return true;
}

}  // namespace

Scrape parse_prometheus_text(std::string_view text) {
  Scrape scrape;
  while (!text.empty()) {
    const std::size_t nl = text.find('\n');
    std::string_view line = text.substr(0, nl);
    text.remove_prefix(nl == std::string_view::npos ? text.size() : nl + 1);
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    std::size_t pos = 0;
    skip_spaces(line, pos);
    line.remove_prefix(pos);
    if (line.empty() || line.front() == '#') continue;
    if (std::optional<Sample> s = read_sample(line)) {
      scrape.samples.push_back(std::move(*s));
    } else {
      ++scrape.unreadable_lines;
    }
  }
  return scrape;
}

std::optional<double> Scrape::sum(std::string_view name,
                                  const std::vector<std::pair<std::string, std::string>>& match) const {
  std::optional<double> total;
  for (const Sample& s : samples) {
    if (s.name != name || !matches(s, match)) continue;
    total = total.value_or(0) + s.value;
  }
  return total;
}

std::map<std::string, double> Scrape::by_label(std::string_view name, const std::string& label) const {
  std::map<std::string, double> out;
  for (const Sample& s : samples) {
    if (s.name != name) continue;
    const auto it = s.labels.find(label);
    if (it != s.labels.end()) out[it->second] += s.value;
  }
  return out;
}

}  // namespace capserve::loadgen
