// The loggers share one stderr sink. JSON lines are written by our own formatter rather than a pattern: a
// pattern cannot escape the message, and a message with a quote or a newline would break the line's JSON. The
// access log is a logger of its own ("access"), so the JSON formatter can tell its lines (whose message is a
// list of fields already) from plain messages.
#include "server/logging.h"

#include <spdlog/pattern_formatter.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/sinks/stdout_sinks.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <ctime>
#include <iterator>
#include <memory>
#include <stdexcept>
#include <string>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

namespace capserve::server {
namespace {

constexpr const char* kAccessLogger = "access";

// The format configure_logging installed: log_access writes its fields to match.
std::atomic<LogFormat> g_format{LogFormat::text};

// A JSON string literal of `text`; invalid UTF-8 (a client's bytes) is replaced, never thrown on.
std::string json_string(std::string_view text) {
  return nlohmann::json(std::string(text)).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

// {"time":"2026-01-02T03:04:05.678Z","level":"info","rank":0,"logger":"capserve","message":"..."}; access
// lines carry their fields instead of "message".
class JsonFormatter final : public spdlog::formatter {
 public:
  explicit JsonFormatter(int rank) : rank_(rank) {}

  void format(const spdlog::details::log_msg& msg, spdlog::memory_buf_t& dest) override {
    const auto since_epoch = msg.time.time_since_epoch();
    const std::time_t seconds = std::chrono::duration_cast<std::chrono::seconds>(since_epoch).count();
    const auto millis = std::chrono::duration_cast<std::chrono::milliseconds>(since_epoch).count() % 1000;
    std::tm utc{};
    ::gmtime_r(&seconds, &utc);
    const std::string_view logger(msg.logger_name.data(), msg.logger_name.size());
    const std::string_view payload(msg.payload.data(), msg.payload.size());
    const auto level = spdlog::level::to_string_view(msg.level);
    fmt::format_to(
        std::back_inserter(dest),
        R"({{"time":"{:04}-{:02}-{:02}T{:02}:{:02}:{:02}.{:03}Z","level":"{}","rank":{},"logger":{},)",
        utc.tm_year + 1900, utc.tm_mon + 1, utc.tm_mday, utc.tm_hour, utc.tm_min, utc.tm_sec, millis,
        std::string_view(level.data(), level.size()), rank_,
        json_string(logger.empty() ? "capserve" : logger));
    if (logger == kAccessLogger) {
      fmt::format_to(std::back_inserter(dest), "{}}}\n", payload);
    } else {
      fmt::format_to(std::back_inserter(dest),
                     R"("message":{}}})"
                     "\n",
                     json_string(payload));
    }
  }
  [[nodiscard]] std::unique_ptr<spdlog::formatter> clone() const override {
    return std::make_unique<JsonFormatter>(rank_);
  }

 private:
  int rank_;
};

spdlog::level::level_enum parse_level(std::string_view name) {
  if (std::find(std::begin(kLogLevels), std::end(kLogLevels), name) == std::end(kLogLevels))
    throw std::invalid_argument("--log-level: unknown level \"" + std::string(name) +
                                "\" (trace, debug, info, warn, error, critical, off)");
  return spdlog::level::from_str(std::string(name));
}

std::string seconds_text(const std::optional<double>& s, bool json) {
  if (!s) return json ? "null" : "-";
  return fmt::format("{:.6f}", *s);
}

}  // namespace

void configure_logging(std::string_view level, LogFormat format, int rank) {
  const spdlog::level::level_enum lvl = parse_level(level);
  // Colour codes only for a person at a terminal: under mpirun, in a pipe or in a file they are noise.
  spdlog::sink_ptr sink;
  if (::isatty(STDERR_FILENO) != 0 && format == LogFormat::text) {
    sink = std::make_shared<spdlog::sinks::stderr_color_sink_mt>(spdlog::color_mode::always);
  } else {
    sink = std::make_shared<spdlog::sinks::stderr_sink_mt>();
  }
  if (format == LogFormat::json) {
    sink->set_formatter(std::make_unique<JsonFormatter>(rank));
  } else {
    sink->set_formatter(std::make_unique<spdlog::pattern_formatter>("[%Y-%m-%d %H:%M:%S.%e] [rank " +
                                                                    std::to_string(rank) + "] [%^%l%$] %v"));
  }
  auto main_logger = std::make_shared<spdlog::logger>("capserve", sink);
  auto access = std::make_shared<spdlog::logger>(kAccessLogger, sink);
  main_logger->set_level(lvl);
  access->set_level(lvl);
  g_format.store(format, std::memory_order_relaxed);
  spdlog::drop(kAccessLogger);
  spdlog::register_logger(access);
  spdlog::set_default_logger(std::move(main_logger));
}

std::string_view finish_reason(Terminal terminal) {
  switch (terminal) {
    case Terminal::ok_stop:
      return "stop";
    case Terminal::ok_length:
      return "length";
    case Terminal::cancelled:
      return "cancelled";
    case Terminal::deadline_exceeded:
      return "deadline_exceeded";
    case Terminal::unavailable:
      return "unavailable";
    case Terminal::internal:
      return "internal";
    case Terminal::invalid_argument:
      return "invalid_argument";
  }
  return "unknown";
}

void log_access(const AccessRecord& r) {
  const std::shared_ptr<spdlog::logger> access = spdlog::get(kAccessLogger);
  // Before configure_logging (unit tests): the default logger, as text.
  spdlog::logger& logger = access ? *access : *spdlog::default_logger_raw();
  if (!logger.should_log(spdlog::level::info)) return;
  const bool json = access && g_format.load(std::memory_order_relaxed) == LogFormat::json;
  // Speculative decoding's counts end the line when the server speculates, then the prefix cache's and
  // chunked prefill's.
  std::string tail;
  if (r.drafted && r.accepted) {
    tail = json ? fmt::format(R"(,"drafted":{},"accepted":{})", *r.drafted, *r.accepted)
                : fmt::format(" drafted={} accepted={}", *r.drafted, *r.accepted);
  }
  if (json) {
    tail += fmt::format(R"(,"cached_tokens":{},"prefill_chunks":{})", r.cached_tokens, r.prefill_chunks);
  } else {
    if (r.cached_tokens > 0) tail += fmt::format(" cached_tokens={}", r.cached_tokens);
    if (r.prefill_chunks > 1) tail += fmt::format(" prefill_chunks={}", r.prefill_chunks);
  }
  if (json) {
    logger.info(
        R"("request_id":{},"peer":{},"prompt_tokens":{},"completion_tokens":{},"finish_reason":{},"queue_s":{},)"
        R"("ttft_s":{},"e2e_s":{:.6f},"dropped":{},"rerouted":{}{})",
        json_string(r.request_id), json_string(r.peer), r.prompt_tokens, r.completion_tokens,
        json_string(r.finish_reason), seconds_text(r.queue_s, true), seconds_text(r.ttft_s, true), r.e2e_s,
        r.dropped, r.rerouted, tail);
    return;
  }
  logger.info(
      "request id={} peer={} prompt_tokens={} completion_tokens={} finish_reason={} queue_s={} ttft_s={} "
      "e2e_s={:.6f} dropped={} rerouted={}{}",
      r.request_id, r.peer.empty() ? std::string_view("-") : r.peer, r.prompt_tokens, r.completion_tokens,
      r.finish_reason, seconds_text(r.queue_s, false), seconds_text(r.ttft_s, false), r.e2e_s, r.dropped,
      r.rerouted, tail);
}

}  // namespace capserve::server
