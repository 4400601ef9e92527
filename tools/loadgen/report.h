#pragma once
// The load generator's results: client-side latency and throughput from the request records, status counts,
// the server's own figures from /metrics, and (soak runs) the server's resident memory; printed as a table
// and written as JSON.
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "tools/loadgen/latency_stats.h"
#include "tools/loadgen/rss_sampler.h"
#include "tools/loadgen/server_figures.h"
#include "tools/loadgen/stream_client.h"

namespace capserve::loadgen {

// "OK", "CANCELLED", ... as gRPC spells the codes.
std::string status_code_name(grpc::StatusCode code);

struct ClientFigures {
  double wall_s = 0;  // first request sent to last terminal status
  std::int64_t sent = 0;
  std::int64_t terminated = 0;  // requests with a terminal status in time (lost ones excluded)
  std::int64_t ok = 0;
  std::int64_t lost = 0;          // no terminal status in time
  std::int64_t unterminated = 0;  // not even after cancellation
  std::int64_t protocol_errors = 0;
  std::vector<std::string> protocol_error_examples;          // a few, with their request index
  std::map<std::string, std::int64_t> status_counts;         // by gRPC code name (lost ones excluded)
  std::map<std::string, std::int64_t> error_examples_count;  // distinct error messages (first 120 bytes)
  std::map<std::string, std::int64_t> finish_reasons;        // OK requests
  std::map<std::string, std::int64_t> requests_by_domain;
  Distribution ttft_s, itl_s, e2e_s, dispatch_lag_s;  // e2e: OK requests
  Distribution prompt_tokens, completion_tokens;      // OK requests, the server's counts
  double requests_per_s = 0;                          // OK requests
  double output_tokens_per_s = 0;                     // completion tokens of OK requests
  double mean_in_flight = 0;                          // sum of request durations / wall time
  std::int64_t max_in_flight = 0;
  std::uint64_t moe_dropped = 0, moe_rerouted = 0;  // summed over the requests' own statistics
};

ClientFigures client_figures(const std::vector<RequestRecord>& records, std::int64_t sent,
                             std::int64_t unterminated, std::int64_t max_in_flight);

struct SoakFigures {
  double warmup_s = 0;
  double load_end_s = 0;  // on the series' time axis
  double tolerance_pct = 0;
  std::vector<RssSeries> series;
  std::vector<RssVerdict> verdicts;
};

struct Report {
  nlohmann::json run;  // what was run: flags, arrivals, server info
  ClientFigures client;
  std::optional<ServerFigures> server;
  std::string server_error;  // why there are no server figures, when asked for
  std::optional<SoakFigures> soak;
};

void print_report(const Report& r);
nlohmann::json to_json(const Report& r, const std::vector<RequestRecord>* per_request);

}  // namespace capserve::loadgen
