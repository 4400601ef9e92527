#include "tools/loadgen/report.h"

#include <algorithm>
#include <array>
#include <cstdio>

namespace capserve::loadgen {
namespace {

const char* finish_name(capserve::v1::FinishReason f) {
  switch (f) {
    case capserve::v1::FINISH_REASON_STOP:
      return "stop";
    case capserve::v1::FINISH_REASON_LENGTH:
      return "length";
    case capserve::v1::FINISH_REASON_CANCELLED:
      return "cancelled";
    case capserve::v1::FINISH_REASON_ERROR:
      return "error";
    default:
      return "unspecified";
  }
}

nlohmann::json to_json(const Distribution& d) {
  return {{"count", d.count}, {"mean", d.mean}, {"p50", d.p50},
          {"p90", d.p90},     {"p99", d.p99},   {"max", d.max}};
}

template <typename T>
nlohmann::json optional_json(const std::optional<T>& v) {
  return v ? nlohmann::json(*v) : nlohmann::json(nullptr);
}

void print_latency(const char* name, const Distribution& d) {
  std::printf("  %-22s %8zu %10.1f %10.1f %10.1f %10.1f %10.1f\n", name, d.count, d.mean * 1e3, d.p50 * 1e3,
              d.p90 * 1e3, d.p99 * 1e3, d.max * 1e3);
}

void print_optional(const char* name, const std::optional<double>& v, const char* format = "%.4g") {
  std::printf("  %-34s ", name);
  if (v) {
    std::printf(format, *v);
  } else {
    std::printf("(not exported)");
  }
  std::printf("\n");
}

std::string layer_list(const std::map<std::string, double>& by_layer) {
  std::vector<std::pair<std::string, double>> sorted(by_layer.begin(), by_layer.end());
  std::sort(sorted.begin(), sorted.end(), [](const auto& a, const auto& b) {
    return a.first.size() != b.first.size() ? a.first.size() < b.first.size() : a.first < b.first;
  });
  std::string out;
  for (const auto& [layer, v] : sorted) {
    char buffer[64];
    std::snprintf(buffer, sizeof buffer, "%sL%s=%.3f", out.empty() ? "" : " ", layer.c_str(), v);
    out += buffer;
  }
  return out.empty() ? "(none)" : out;
}

}  // namespace

std::string status_code_name(grpc::StatusCode code) {
  static constexpr std::array<const char*, 17> names{
      "OK",        "CANCELLED",      "UNKNOWN",           "INVALID_ARGUMENT",   "DEADLINE_EXCEEDED",
      "NOT_FOUND", "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
      "ABORTED",   "OUT_OF_RANGE",   "UNIMPLEMENTED",     "INTERNAL",           "UNAVAILABLE",
      "DATA_LOSS", "UNAUTHENTICATED"};
  const auto i = static_cast<std::size_t>(code);
  return i < names.size() ? names[i] : "CODE_" + std::to_string(i);
}

ClientFigures client_figures(const std::vector<RequestRecord>& records, std::int64_t sent,
                             std::int64_t unterminated, std::int64_t max_in_flight) {
  ClientFigures f;
  f.sent = sent;
  f.unterminated = unterminated;
  f.max_in_flight = max_in_flight;
  std::vector<double> ttft, itl, e2e, lag, prompt, completion;
  double first_sent = 0, last_done = 0, busy = 0;
  bool any = false;
  for (const RequestRecord& r : records) {
    first_sent = any ? std::min(first_sent, r.sent_s) : r.sent_s;
    last_done = any ? std::max(last_done, r.done_s) : r.done_s;
    any = true;
    busy += r.done_s - r.sent_s;
    lag.push_back(std::max(0.0, r.sent_s - r.scheduled_s));
    ++f.requests_by_domain[r.domain];
    f.moe_dropped += r.moe_dropped;
    f.moe_rerouted += r.moe_rerouted;
    for (const std::string& p : r.protocol_errors) {
      ++f.protocol_errors;
      if (f.protocol_error_examples.size() < 5)
        f.protocol_error_examples.push_back("request " + std::to_string(r.index) + ": " + p);
    }
    if (r.lost) {
      ++f.lost;
      continue;
    }
    ++f.terminated;
    ++f.status_counts[status_code_name(r.status)];
    if (r.first_token_s) {
      ttft.push_back(*r.first_token_s - r.sent_s);
      itl.insert(itl.end(), r.itl_s.begin(), r.itl_s.end());
    }
    if (r.status != grpc::StatusCode::OK) {
      ++f.error_examples_count[status_code_name(r.status) + ": " + r.status_message.substr(0, 120)];
      continue;
    }
    ++f.ok;
    ++f.finish_reasons[finish_name(r.finish_reason)];
    e2e.push_back(r.done_s - r.sent_s);
    prompt.push_back(r.prompt_tokens);
    completion.push_back(r.completion_tokens);
  }
  // Requests that never ended are lost too, though they left no record.
  f.lost += unterminated;
  f.wall_s = any ? last_done - first_sent : 0;
  f.ttft_s = summarize(ttft);
  f.itl_s = summarize(itl);
  f.e2e_s = summarize(e2e);
  f.dispatch_lag_s = summarize(lag);
  f.prompt_tokens = summarize(prompt);
  f.completion_tokens = summarize(completion);
  double tokens = 0;
  for (const double c : completion) tokens += c;
  if (f.wall_s > 0) {
    f.requests_per_s = static_cast<double>(f.ok) / f.wall_s;
    f.output_tokens_per_s = tokens / f.wall_s;
    f.mean_in_flight = busy / f.wall_s;
  }
  return f;
}

void print_report(const Report& r) {
  const ClientFigures& c = r.client;
  std::printf("\ncapserve-loadgen: %s\n", r.run.value("summary", std::string()).c_str());
  if (r.run.contains("server_info")) {
    const auto& s = r.run["server_info"];
    std::printf("server: %s on %d ranks; capacity: %s; selector: %s\n",
                s.value("model", std::string()).c_str(), s.value("ranks", 0),
                s.value("capacity", std::string()).c_str(), s.value("batch_selector", std::string()).c_str());
  }
  if (r.run.contains("length_caps_summary"))
    std::printf("lengths: %s\n", r.run["length_caps_summary"].get<std::string>().c_str());
  std::printf("\nrequests: %lld sent, %lld ended, %lld OK, LOST %lld", static_cast<long long>(c.sent),
              static_cast<long long>(c.terminated), static_cast<long long>(c.ok),
              static_cast<long long>(c.lost));
  if (c.unterminated > 0)
    std::printf(" (%lld never ended even when cancelled)", static_cast<long long>(c.unterminated));
  std::printf(", protocol errors %lld\n", static_cast<long long>(c.protocol_errors));
  std::printf("status:");
  for (const auto& [code, n] : c.status_counts)
    std::printf(" %s=%lld", code.c_str(), static_cast<long long>(n));
  std::printf("\nfinish_reason (OK):");
  for (const auto& [why, n] : c.finish_reasons)
    std::printf(" %s=%lld", why.c_str(), static_cast<long long>(n));
  std::printf("\ndomains:");
  for (const auto& [d, n] : c.requests_by_domain)
    std::printf(" %s=%lld", d.c_str(), static_cast<long long>(n));
  std::printf("\n");
  for (const auto& [message, n] : c.error_examples_count)
    std::printf("  error x%lld: %s\n", static_cast<long long>(n), message.c_str());
  for (const std::string& p : c.protocol_error_examples) std::printf("  protocol error: %s\n", p.c_str());

  std::printf("\n  %-22s %8s %10s %10s %10s %10s %10s\n", "latency (ms)", "n", "mean", "p50", "p90", "p99",
              "max");
  print_latency("time to first token", c.ttft_s);
  print_latency("inter-token", c.itl_s);
  print_latency("end-to-end (OK)", c.e2e_s);
  print_latency("dispatch lag", c.dispatch_lag_s);
  std::printf("\n  %-22s %8s %10s %10s %10s %10s %10s\n", "tokens per request", "n", "mean", "p50", "p90",
              "p99", "max");
  const auto print_tokens = [](const char* name, const Distribution& d) {
    std::printf("  %-22s %8zu %10.1f %10.0f %10.0f %10.0f %10.0f\n", name, d.count, d.mean, d.p50, d.p90,
                d.p99, d.max);
  };
  print_tokens("prompt", c.prompt_tokens);
  print_tokens("completion", c.completion_tokens);
  std::printf(
      "\nthroughput: %.3f requests/s, %.1f output tokens/s over %.1f s; in flight: mean %.1f, max %lld\n",
      c.requests_per_s, c.output_tokens_per_s, c.wall_s, c.mean_in_flight,
      static_cast<long long>(c.max_in_flight));
  std::printf("per-request MoE statistics (summed): dropped %llu, rerouted %llu\n",
              static_cast<unsigned long long>(c.moe_dropped),
              static_cast<unsigned long long>(c.moe_rerouted));

  if (r.server) {
    const ServerFigures& s = *r.server;
    std::printf("\nserver (/metrics, after - before):\n");
    print_optional("engine steps", s.moe_steps, "%.0f");
    print_optional("MoE assignments", s.assignments, "%.0f");
    print_optional("dropped assignments", s.dropped, "%.0f");
    print_optional("rerouted assignments", s.rerouted, "%.0f");
    if (s.assignments && *s.assignments > 0 && s.dropped && s.rerouted)
      std::printf("  %-34s %.4f%% / %.4f%%\n", "dropped / rerouted share", 100 * *s.dropped / *s.assignments,
                  100 * *s.rerouted / *s.assignments);
    print_optional("generation tokens", s.generation_tokens, "%.0f");
    print_optional("prompt tokens", s.prompt_tokens, "%.0f");
    // A server without a prefix cache exports none of these: one line says so instead of six.
    if (s.prefill_tokens_computed || s.prefix_cache_query_tokens) {
      print_optional("prefill tokens computed", s.prefill_tokens_computed, "%.0f");
      print_optional("prefix cache query tokens", s.prefix_cache_query_tokens, "%.0f");
      print_optional("prefix cache hit tokens", s.prefix_cache_hit_tokens, "%.0f");
      print_optional("prefix cache query blocks", s.prefix_cache_query_blocks, "%.0f");
      print_optional("prefix cache hit blocks", s.prefix_cache_hit_blocks, "%.0f");
      print_optional("prefix cache evictions", s.prefix_cache_evictions, "%.0f");
    } else {
      std::printf("  %-34s (not exported)\n", "prefix cache");
    }
    print_optional("mean rank imbalance (steps)", s.imbalance_mean, "%.4f");
    std::printf("  %-34s %s\n", "rank imbalance over the run", layer_list(s.imbalance_run_by_layer).c_str());
    std::printf("  %-34s %s\n", "rank imbalance gauge (last step)",
                layer_list(s.imbalance_last_by_layer).c_str());
    print_optional("predictor load cosine (step mean)", s.predictor_cosine, "%.4f");
    print_optional("predicted imbalance (step mean)", s.selector_predicted_imbalance, "%.4f");
    print_optional("realized imbalance (step mean)", s.selector_realized_imbalance, "%.4f");
    print_optional("selector decisions", s.selector_decisions, "%.0f");
    if (s.selector_decision_mean_s)
      print_optional("selector decision mean (us)", *s.selector_decision_mean_s * 1e6, "%.2f");
    if (s.ttft_mean_s) print_optional("server TTFT mean (ms)", *s.ttft_mean_s * 1e3, "%.1f");
    if (s.itl_mean_s) print_optional("server inter-token mean (ms)", *s.itl_mean_s * 1e3, "%.1f");
    if (s.e2e_mean_s) print_optional("server end-to-end mean (ms)", *s.e2e_mean_s * 1e3, "%.1f");
    if (s.queue_time_mean_s)
      print_optional("server queue time mean (ms)", *s.queue_time_mean_s * 1e3, "%.1f");
    std::printf("  %-34s", "server outcomes");
    for (const auto& [why, n] : s.requests_by_finish_reason) std::printf(" %s=%.0f", why.c_str(), n);
    std::printf("\n  %-34s", "server errors");
    if (s.errors_by_code.empty()) std::printf(" none");
    for (const auto& [code, n] : s.errors_by_code) std::printf(" %s=%.0f", code.c_str(), n);
    std::printf("\n");
    if (s.unreadable_lines > 0) std::printf("  (%zu unreadable /metrics lines)\n", s.unreadable_lines);
  } else if (!r.server_error.empty()) {
    std::printf("\nserver figures unavailable: %s\n", r.server_error.c_str());
  }

  if (r.soak) {
    std::printf(
        "\nserver processes: resident memory (VmRSS; growth from %.0f s to the end of the load at %.0f s; "
        "flat: "
        "within %.1f%%):\n",
        r.soak->warmup_s, r.soak->load_end_s, r.soak->tolerance_pct);
    std::printf("  %8s %8s %12s %12s %12s %9s %14s %12s %s\n", "pid", "samples", "warm-up MiB", "last MiB",
                "max MiB", "growth %", "slope KiB/min", "max threads", "verdict");
    for (std::size_t i = 0; i < r.soak->verdicts.size(); ++i) {
      const RssVerdict& v = r.soak->verdicts[i];
      const std::vector<std::int64_t>& threads = r.soak->series[i].threads;
      const std::int64_t max_threads =
          threads.empty() ? 0 : *std::max_element(threads.begin(), threads.end());
      std::printf("  %8d %8zu %12.1f %12.1f %12.1f %9.2f %14.1f %12lld %s\n", v.pid,
                  r.soak->series[i].kib.size(), static_cast<double>(v.at_warmup_kib) / 1024,
                  static_cast<double>(v.last_kib) / 1024, static_cast<double>(v.max_kib) / 1024, v.growth_pct,
                  v.slope_kib_per_min, static_cast<long long>(max_threads),
                  v.exited ? "EXITED" : (v.flat ? "flat" : "GROWING"));
    }
  }
  std::fflush(stdout);
}

nlohmann::json to_json(const Report& r, const std::vector<RequestRecord>* per_request) {
  const ClientFigures& c = r.client;
  nlohmann::json j;
  j["run"] = r.run;
  j["client"] = {{"wall_s", c.wall_s},
                 {"sent", c.sent},
                 {"terminated", c.terminated},
                 {"ok", c.ok},
                 {"lost", c.lost},
                 {"unterminated", c.unterminated},
                 {"protocol_errors", c.protocol_errors},
                 {"protocol_error_examples", c.protocol_error_examples},
                 {"status_counts", c.status_counts},
                 {"errors", c.error_examples_count},
                 {"finish_reasons", c.finish_reasons},
                 {"requests_by_domain", c.requests_by_domain},
                 {"ttft_s", to_json(c.ttft_s)},
                 {"itl_s", to_json(c.itl_s)},
                 {"e2e_s", to_json(c.e2e_s)},
                 {"dispatch_lag_s", to_json(c.dispatch_lag_s)},
                 {"prompt_tokens", to_json(c.prompt_tokens)},
                 {"completion_tokens", to_json(c.completion_tokens)},
                 {"requests_per_s", c.requests_per_s},
                 {"output_tokens_per_s", c.output_tokens_per_s},
                 {"mean_in_flight", c.mean_in_flight},
                 {"max_in_flight", c.max_in_flight},
                 {"moe_dropped", c.moe_dropped},
                 {"moe_rerouted", c.moe_rerouted}};
  if (r.server) {
    const ServerFigures& s = *r.server;
    j["server"] = {{"moe_steps", optional_json(s.moe_steps)},
                   {"assignments", optional_json(s.assignments)},
                   {"dropped", optional_json(s.dropped)},
                   {"rerouted", optional_json(s.rerouted)},
                   {"generation_tokens", optional_json(s.generation_tokens)},
                   {"prompt_tokens", optional_json(s.prompt_tokens)},
                   {"prefill_tokens_computed", optional_json(s.prefill_tokens_computed)},
                   {"prefix_cache_query_tokens", optional_json(s.prefix_cache_query_tokens)},
                   {"prefix_cache_hit_tokens", optional_json(s.prefix_cache_hit_tokens)},
                   {"prefix_cache_query_blocks", optional_json(s.prefix_cache_query_blocks)},
                   {"prefix_cache_hit_blocks", optional_json(s.prefix_cache_hit_blocks)},
                   {"prefix_cache_evictions", optional_json(s.prefix_cache_evictions)},
                   {"imbalance_mean", optional_json(s.imbalance_mean)},
                   {"imbalance_run_by_layer", s.imbalance_run_by_layer},
                   {"imbalance_last_by_layer", s.imbalance_last_by_layer},
                   {"predictor_cosine", optional_json(s.predictor_cosine)},
                   {"selector_predicted_imbalance", optional_json(s.selector_predicted_imbalance)},
                   {"selector_realized_imbalance", optional_json(s.selector_realized_imbalance)},
                   {"selector_decision_mean_s", optional_json(s.selector_decision_mean_s)},
                   {"selector_decisions", optional_json(s.selector_decisions)},
                   {"ttft_mean_s", optional_json(s.ttft_mean_s)},
                   {"itl_mean_s", optional_json(s.itl_mean_s)},
                   {"e2e_mean_s", optional_json(s.e2e_mean_s)},
                   {"queue_time_mean_s", optional_json(s.queue_time_mean_s)},
                   {"requests_by_finish_reason", s.requests_by_finish_reason},
                   {"errors_by_code", s.errors_by_code},
                   {"unreadable_lines", s.unreadable_lines}};
  } else if (!r.server_error.empty()) {
    j["server_error"] = r.server_error;
  }
  if (r.soak) {
    nlohmann::json processes = nlohmann::json::array();
    for (std::size_t i = 0; i < r.soak->verdicts.size(); ++i) {
      const RssVerdict& v = r.soak->verdicts[i];
      const RssSeries& s = r.soak->series[i];
      processes.push_back({{"pid", v.pid},
                           {"at_warmup_kib", v.at_warmup_kib},
                           {"last_kib", v.last_kib},
                           {"max_kib", v.max_kib},
                           {"growth_pct", v.growth_pct},
                           {"slope_kib_per_min", v.slope_kib_per_min},
                           {"exited", v.exited},
                           {"exited_at_s", optional_json(s.exited_at_s)},
                           {"flat", v.flat},
                           {"t_s", s.t_s},
                           {"rss_kib", s.kib},
                           {"threads", s.threads}});
    }
    j["soak"] = {{"warmup_s", r.soak->warmup_s},
                 {"load_end_s", r.soak->load_end_s},
                 {"tolerance_pct", r.soak->tolerance_pct},
                 {"processes", processes}};
  }
  if (per_request != nullptr) {
    nlohmann::json list = nlohmann::json::array();
    for (const RequestRecord& q : *per_request) {
      list.push_back(
          {{"index", q.index},
           {"domain", q.domain},
           {"prompt_tokens_target", q.prompt_tokens_target},
           {"max_tokens", q.max_tokens},
           {"scheduled_s", q.scheduled_s},
           {"sent_s", q.sent_s},
           {"ttft_s", q.first_token_s ? nlohmann::json(*q.first_token_s - q.sent_s) : nlohmann::json()},
           {"e2e_s", q.done_s - q.sent_s},
           {"status", status_code_name(q.status)},
           {"message", q.status_message},
           {"finish_reason", finish_name(q.finish_reason)},
           {"prompt_tokens", q.prompt_tokens},
           {"completion_tokens", q.completion_tokens},
           {"chunks", q.content_chunks},
           {"lost", q.lost}});
    }
    j["requests"] = list;
  }
  return j;
}

}  // namespace capserve::loadgen
