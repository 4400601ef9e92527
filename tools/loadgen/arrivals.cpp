#include "tools/loadgen/arrivals.h"

#include <algorithm>
#include <charconv>
#include <fstream>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>

namespace capserve::loadgen {
namespace {

// Days from 1970-01-01 to year-month-day of the proleptic Gregorian calendar (H. Hinnant's days_from_civil).
std::int64_t days_from_civil(std::int64_t y, std::int64_t m, std::int64_t d) {
  y -= m <= 2 ? 1 : 0;
  const std::int64_t era = (y >= 0 ? y : y - 399) / 400;
  const std::int64_t yoe = y - era * 400;
  const std::int64_t doy = (153 * (m + (m > 2 ? -3 : 9)) + 2) / 5 + d - 1;
  const std::int64_t doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
  return era * 146097 + doe - 719468;
}

// Parses exactly `width` decimal digits at text[pos]; advances pos.
std::int64_t digits(std::string_view text, std::size_t& pos, std::size_t width) {
  std::int64_t v = 0;
  if (pos + width > text.size()) throw std::invalid_argument("truncated");
  const auto [end, error] = std::from_chars(text.data() + pos, text.data() + pos + width, v);
  if (error != std::errc() || end != text.data() + pos + width) throw std::invalid_argument("not a number");
  pos += width;
  return v;
}

void expect(std::string_view text, std::size_t& pos, char c) {
  if (pos >= text.size() || text[pos] != c) throw std::invalid_argument(std::string("expected '") + c + "'");
  ++pos;
}

std::int64_t parse_count(std::string_view field) {
  std::int64_t v = 0;
  const auto [end, error] = std::from_chars(field.data(), field.data() + field.size(), v);
  if (error != std::errc() || end != field.data() + field.size() || v < 0)
    throw std::invalid_argument("'" + std::string(field) + "' is not a token count");
  return v;
}

}  // namespace

double parse_trace_timestamp(std::string_view text) {
  try {
    std::size_t pos = 0;
    const std::int64_t year = digits(text, pos, 4);
    expect(text, pos, '-');
    const std::int64_t month = digits(text, pos, 2);
    expect(text, pos, '-');
    const std::int64_t day = digits(text, pos, 2);
    if (pos < text.size() && (text[pos] == ' ' || text[pos] == 'T')) {
      ++pos;
    } else {
      throw std::invalid_argument("expected ' ' between date and time");
    }
    const std::int64_t hour = digits(text, pos, 2);
    expect(text, pos, ':');
    const std::int64_t minute = digits(text, pos, 2);
    expect(text, pos, ':');
    const std::int64_t second = digits(text, pos, 2);
    double fraction = 0;
    if (pos < text.size() && text[pos] == '.') {
      ++pos;
      double scale = 0.1;
      for (; pos < text.size() && text[pos] >= '0' && text[pos] <= '9'; ++pos, scale /= 10)
        fraction += (text[pos] - '0') * scale;
    }
    if (pos != text.size()) throw std::invalid_argument("trailing characters");
    if (month < 1 || month > 12 || day < 1 || day > 31 || hour > 23 || minute > 59 || second > 60)
      throw std::invalid_argument("field out of range");
    const std::int64_t days = days_from_civil(year, month, day);
    return static_cast<double>(days * 86400 + hour * 3600 + minute * 60 + second) + fraction;
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument("timestamp '" + std::string(text) + "': " + e.what() +
                                " (expected YYYY-MM-DD HH:MM:SS.fraction)");
  }
}

std::vector<TraceRecord> read_azure_trace(const std::filesystem::path& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error("cannot open trace " + path.string());
  std::vector<TraceRecord> rows;
  std::vector<double> absolute;
  std::string line;
  std::int64_t number = 0;
  while (std::getline(in, line)) {
    ++number;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty()) continue;
    if (number == 1 && line.starts_with("TIMESTAMP")) continue;  // the header
    const std::size_t a = line.find(',');
    const std::size_t b = a == std::string::npos ? a : line.find(',', a + 1);
    try {
      if (b == std::string::npos || line.find(',', b + 1) != std::string::npos)
        throw std::invalid_argument("expected 3 fields TIMESTAMP,ContextTokens,GeneratedTokens");
      const std::string_view view(line);
      absolute.push_back(parse_trace_timestamp(view.substr(0, a)));
      rows.push_back({0, parse_count(view.substr(a + 1, b - a - 1)), parse_count(view.substr(b + 1)), {}});
    } catch (const std::invalid_argument& e) {
      throw std::runtime_error(path.string() + ":" + std::to_string(number) + ": " + e.what());
    }
  }
  if (rows.empty()) throw std::runtime_error("trace " + path.string() + " has no requests");
  const double first = *std::min_element(absolute.begin(), absolute.end());
  for (std::size_t i = 0; i < rows.size(); ++i) rows[i].t_s = absolute[i] - first;
  std::stable_sort(rows.begin(), rows.end(),
                   [](const TraceRecord& x, const TraceRecord& y) { return x.t_s < y.t_s; });
  return rows;
}

std::vector<Arrival> slice_trace(const std::vector<TraceRecord>& trace, const TraceSlice& slice) {
  if (!(slice.time_scale > 0)) throw std::invalid_argument("time scale must be > 0");
  const double end_s = slice.duration_s > 0 ? slice.start_s + slice.duration_s / slice.time_scale
                                            : std::numeric_limits<double>::infinity();
  std::vector<Arrival> out;
  for (const TraceRecord& r : trace) {
    if (r.t_s < slice.start_s || r.t_s >= end_s) continue;
    if (slice.max_requests > 0 && static_cast<std::int64_t>(out.size()) >= slice.max_requests) break;
    out.push_back(
        {(r.t_s - slice.start_s) * slice.time_scale, r.context_tokens, r.generated_tokens, r.hash_ids});
  }
  return out;
}

SizeSource::SizeSource(std::vector<TraceRecord> rows, std::int64_t context_tokens,
                       std::int64_t generated_tokens, std::uint64_t seed)
    : rows_(std::move(rows)),
      context_tokens_(context_tokens),
      generated_tokens_(generated_tokens),
      rng_(seed) {}

void SizeSource::draw(Arrival& a) {
  if (rows_.empty()) {
    a.context_tokens = context_tokens_;
    a.generated_tokens = generated_tokens_;
    return;
  }
  const TraceRecord& r = rows_[std::uniform_int_distribution<std::size_t>(0, rows_.size() - 1)(rng_)];
  a.context_tokens = r.context_tokens;
  a.generated_tokens = r.generated_tokens;
  a.hash_ids = r.hash_ids;
}

std::vector<Arrival> poisson_arrivals(const PoissonSpec& spec, SizeSource& sizes) {
  if (!(spec.rate > 0)) throw std::invalid_argument("Poisson rate must be > 0");
  std::mt19937_64 rng(spec.seed);
  std::exponential_distribution<double> gap(spec.rate);
  std::vector<Arrival> out;
  for (double t = gap(rng); t < spec.duration_s; t += gap(rng)) {
    if (spec.max_requests > 0 && static_cast<std::int64_t>(out.size()) >= spec.max_requests) break;
    Arrival a{t, 0, 0, {}};
    sizes.draw(a);
    out.push_back(a);
  }
  return out;
}

}  // namespace capserve::loadgen
