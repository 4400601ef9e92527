#pragma once
// capserve's log (server/README.md, "Logging"): spdlog on stderr, as text (ANSI colour only on a terminal) or
// one JSON object per line (--log-format json, for log shippers), at --log-level; and the access log, one
// line per finished request whatever front end created it, written by the scheduler where every request ends.
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "server/request.h"

namespace capserve::server {

enum class LogFormat { text, json };

// The level names --log-level takes, most verbose first.
inline constexpr std::string_view kLogLevels[] = {"trace", "debug",    "info", "warn",
                                                  "error", "critical", "off"};

// Installs the process's loggers (the default one and the access log) on stderr; every line names the MPI
// `rank` that wrote it (under mpirun all ranks share one stderr). Throws std::invalid_argument for a level
// name not in kLogLevels.
void configure_logging(std::string_view level, LogFormat format, int rank);

// How a request ended, as the access log names it: stop, length, cancelled, deadline_exceeded, unavailable,
// internal, invalid_argument.
[[nodiscard]] std::string_view finish_reason(Terminal terminal);

// One finished request. Times in seconds; queue and ttft absent when the request never got that far.
struct AccessRecord {
  std::string_view request_id;
  std::string_view peer;
  std::int64_t prompt_tokens = 0;
  std::int64_t completion_tokens = 0;
  std::string_view finish_reason;
  std::optional<double> queue_s;
  std::optional<double> ttft_s;
  double e2e_s = 0;
  std::int64_t dropped = 0;   // MoE assignments of this request dropped by the capacity scheduler
  std::int64_t rerouted = 0;  // ... and rerouted to another expert
  // Speculative decoding (only when the server speculates): draft tokens verified for the request, and kept.
  std::optional<std::int64_t> drafted = std::nullopt;
  std::optional<std::int64_t> accepted = std::nullopt;
  // Prompt tokens taken from the prefix cache instead of being computed; prefill steps the prompt took.
  std::int64_t cached_tokens = 0;
  std::int64_t prefill_chunks = 1;
};

// Text: "request id=... peer=... prompt_tokens=... completion_tokens=... finish_reason=... queue_s=...
// ttft_s=... e2e_s=... dropped=... rerouted=...[ drafted=... accepted=...][ cached_tokens=...][
// prefill_chunks=...]" (absent times as "-"; the draft counts only when present, the cached tokens when some
// were, the chunks when more than one); JSON: the same keys as fields of the line's object, absent times
// null, cached_tokens and prefill_chunks always, with "logger": "access".
void log_access(const AccessRecord& record);

}  // namespace capserve::server
