// capserve: the expert-parallel MoE inference server. `mpirun -np N capserve --model DIR ...`: every rank
// loads the replicated weights and its own experts and runs the lockstep step loop; rank 0 also serves gRPC
// (the capserve.v1.Inference service, health, reflection) and the OpenAI-compatible HTTP API, schedules
// (continuous batching + CAPS batch selection) and exposes Prometheus metrics. SIGTERM, SIGINT or SIGHUP
// drains: no request is accepted from the moment rank 0 takes the signal, running ones finish, exit 0;
// SIGUSR2 is logged and ignored. A step that makes no progress for --step-timeout-s (a hung rank) fails every
// request UNAVAILABLE and ends the job non-zero. This file holds the flags and the wiring, top-down from
// main(): flags, model and engine, front ends (serve), then the step loop (server/step_loop.h).
#include <fmt/format.h>
#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/impl/server_builder_option.h>
#include <grpcpp/impl/server_builder_plugin.h>
#include <spdlog/spdlog.h>

#include <netdb.h>
#include <pthread.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>

#include "parallel/mpi_world.h"
#include "parallel/rank_heartbeat.h"
#include "parallel/rank_hosts.h"
#include "runtime/chat/chat_template.h"
#include "runtime/cli/cores.h"
#include "runtime/cli/flag_checks.h"
#include "runtime/cli/parallel_flags.h"
#include "runtime/cli/proc_status.h"
#include "runtime/cli/rank_devices.h"
#include "runtime/cli/speculation_flags.h"
#include "runtime/cli/version.h"
#include "runtime/engine.h"
#include "runtime/grammar/grammar_cache.h"
#include "runtime/model.h"
#include "runtime/router_load_predictor.h"
#include "runtime/tokenizer/tokenizer.h"
#include "server/http/http_server.h"
#include "server/http/openai_api.h"
#include "server/inference_service.h"
#include "server/json_config.h"
#include "server/logging.h"
#include "server/rank_worker.h"
#include "server/request_intake.h"
#include "server/scheduler.h"
#include "server/security/api_key.h"
#include "server/security/tls_credentials.h"
#include "server/server_metrics.h"
#include "server/step_loop.h"
#include "server/step_watchdog.h"

namespace {

using namespace capserve;

// Set by the stop signals' handler and read by the scheduler's intake (lock-free, so async-signal-safe): no
// request is admitted once it is set, before the step loop has even seen it.
std::atomic<bool> g_stop_requested{false};
static_assert(std::atomic<bool>::is_always_lock_free);
// SIGUSR2s received and not yet logged by the step loop.
std::atomic<int> g_sigusr2_received{0};
static_assert(std::atomic<int>::is_always_lock_free);

extern "C" void on_stop_signal(int) {
  g_stop_requested.store(true);
}

extern "C" void on_sigusr2(int) {
  g_sigusr2_received.fetch_add(1);
}

// sigaction rather than std::signal: the handler replaces whatever disposition was inherited (SIG_IGN
// included: a background job of a non-interactive shell starts with SIGINT ignored) and stays installed.
void handle_signal(int signal, void (*handler)(int)) {
  struct sigaction action {};
  action.sa_handler = handler;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;
  ::sigaction(signal, &action, nullptr);
}

struct Options {
  std::string model_dir;
  std::string host = "0.0.0.0";
  std::string metrics_host;  // empty: --host
  int port = 50051;
  int metrics_port = 9400;
  int http_port = 8000;
  std::size_t max_connections_per_peer = 64;  // on the HTTP API's port and the metrics port
  int threads = 0;
  std::string device = "cpu";
  std::string kv_dtype = "auto";
  std::string model_id;
  runtime::EngineOptions engine;
  server::SchedulerConfig scheduler;
  std::int64_t dry_run_layers = 1;
  std::string load_map = "auto";  // a path, "auto" (the model directory's capserve_load_map.json) or "none"
  std::string step_trace;         // --step-trace FILE (rank 0), empty: none
  bool prefix_cache = true;       // --prefix-cache / --no-prefix-cache, before resolve_prefix_cache
  std::string strategy = "fcfs";
  server::ServiceLimits limits;
  runtime::ParallelFlags parallel;
  std::string chat_template;
  std::int64_t chat_template_max_steps = static_cast<std::int64_t>(runtime::jinja::RenderOptions{}.max_steps);
  std::string generation_defaults = "model";
  std::string tool_call_parser = "auto";  // server/chat_output: vLLM's names, auto: from the chat template
  std::string reasoning_parser = "auto";
  double step_timeout_s = 60;
  runtime::SpeculationConfig speculation;  // server/README.md, "Speculative decoding"
  bool metrics_per_expert = false;
  std::string log_level = "info";
  std::string log_format = "text";
  server::security::TlsFiles tls;
  std::string api_key;
  std::string api_key_file;
  std::optional<server::security::ApiKey> key;  // from --api-key or --api-key-file, checked after parsing
};

// Leaves gRPC's reflection service out of a server: linking grpc++_reflection registers its plugin for every
// server built.
class WithoutReflection : public grpc::ServerBuilderOption {
 public:
  void UpdateArguments(grpc::ChannelArguments*) override {}
  void UpdatePlugins(std::vector<std::unique_ptr<grpc::ServerBuilderPlugin>>* plugins) override {
    std::erase_if(*plugins, [](const auto& plugin) { return plugin->name() == "proto_server_reflection"; });
  }
};

// What each rank's backend allocated, gathered to rank 0 for the start-up lines.
struct RankMemory {
  std::int64_t weights = 0, kv_cache = 0, device_index = 0;
  std::int64_t resident_kib = 0;  // the process's resident set once loaded (the CPU maps weights lazily)
};

void add_flags(CLI::App& app, Options& o) {
  const auto port_range = CLI::Range(0, 65535);
  app.add_option("--model", o.model_dir, "Hugging Face checkpoint directory")
      ->required()
      ->check(CLI::ExistingDirectory);
  app.add_option(
      "--model-id,--served-model-name", o.model_id,
      "the model's name in the API and the metrics' model_name label (default: the directory name)");
  app.add_option(
         "--host", o.host,
         "listen address of gRPC, the HTTP API and /metrics (unless --metrics-host) (0.0.0.0: every IPv4 "
         "interface, :: every interface, 127.0.0.1: this machine only)")
      ->capture_default_str();
  app.add_option(
      "--metrics-host", o.metrics_host,
      "listen address of the /metrics port when it differs from --host (e.g. 127.0.0.1 for a local "
      "scraper while the API listens on 0.0.0.0)");
  app.add_option("--port", o.port, "gRPC port (0: any free port, printed at start)")
      ->check(port_range)
      ->capture_default_str();
  app.add_option("--metrics-port", o.metrics_port, "Prometheus /metrics port on rank 0 (0: any)")
      ->check(port_range)
      ->capture_default_str();
  app.add_option("--http-port", o.http_port,
                 "OpenAI-compatible HTTP API port on rank 0 (0: any free port, printed at start; -1: off)")
      ->check(CLI::Range(-1, 65535))
      ->capture_default_str();
  app.add_option("--threads", o.threads, "CPU threads per rank (default: cores / ranks on the node)")
      ->check(runtime::at_least(0));
  runtime::add_device_flag(app, o.device);
  runtime::add_kv_dtype_flag(app, o.kv_dtype);
  app.add_option("--kv-blocks", o.engine.kv_blocks, "KV cache blocks of 16 tokens per rank")
      ->check(runtime::at_least(1))
      ->capture_default_str();
  app.add_option(
         "--fixed-exchange-tokens", o.engine.fixed_exchange_tokens,
         "steps of at most this many tokens (all ranks) exchange MoE rows in fixed-size blocks where the "
         "capacity factor bounds every expert, with no host wait per layer; 0: never")
      ->check(runtime::at_least(0))
      ->capture_default_str();
  app.add_option("--max-running", o.scheduler.max_running, "sequences decoding at once, all ranks")
      ->check(runtime::at_least(1))
      ->capture_default_str();
  app.add_option("--max-batched-tokens", o.scheduler.max_batched_tokens,
                 "the token budget of one step, all ranks: decodes and prefill chunks share it (a longer "
                 "prompt is prefilled in chunks)")
      ->check(runtime::at_least(1))
      ->capture_default_str();
  app.add_option("--max-queue", o.scheduler.max_queue, "waiting requests before RESOURCE_EXHAUSTED")
      ->check(runtime::at_least(1))
      ->capture_default_str();
  app.add_option("--max-context", o.scheduler.max_context, "prompt + generated tokens (capped by the model)")
      ->check(runtime::at_least(1))
      ->capture_default_str();
  app.add_option("--default-max-tokens", o.limits.default_max_tokens,
                 "max_tokens of a request that sets none (at most --max-tokens-limit)")
      ->check(runtime::at_least(1))
      ->capture_default_str();
  app.add_option("--max-tokens-limit", o.limits.max_tokens_limit, "largest max_tokens a request may ask for")
      ->check(runtime::at_least(1))
      ->capture_default_str();
  app.add_option("--max-requests-per-peer", o.limits.max_requests_per_peer,
                 "requests in flight from one client address before RESOURCE_EXHAUSTED (0: no limit)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--max-protected-requests", o.limits.max_protected_requests,
                 "protected requests (capacity_class \"protected\": never dropped by the capacity scheduler) "
                 "in flight at once; more are RESOURCE_EXHAUSTED (0: refused)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  // Below the metrics port's 256 connections (and the API's 1024): one address cannot take them all.
  app.add_option("--max-connections-per-peer", o.max_connections_per_peer,
                 "HTTP connections (API and metrics ports) from one client address; more are closed at once")
      ->check(CLI::Range(1, 255))
      ->capture_default_str();
  app.add_flag("--allow-special-tokens-in-content", o.limits.special_tokens_in_content,
               "encode special-token text in chat messages as control tokens (default: as plain text)");
  app.add_option("--chat-template", o.chat_template,
                 "a Jinja chat template file to use instead of the checkpoint's own")
      ->check(CLI::ExistingFile);
  app.add_option(
         "--chat-template-max-steps", o.chat_template_max_steps,
         "work budget of one chat-template render (expressions evaluated, elements and 16-byte units "
         "built); a render past it is the request's error (400). Raise it only for a trusted template "
         "that needs more")
      ->check(runtime::at_least(1));
  app.add_option(
         "--generation-defaults", o.generation_defaults,
         "what a request's unset temperature / top_p / top_k take: model (the checkpoint's "
         "generation_config.json, as vLLM) or none (the API's own: temperature 1 on the OpenAI API as OpenAI "
         "and vLLM, greedy on gRPC; no filter)")
      ->check(CLI::IsMember({"model", "none"}))
      ->capture_default_str();
  app.add_option(
         "--tool-call-parser", o.tool_call_parser,
         "the tool-call format of chat output when a request offers tools (vLLM's names): auto (the one "
         "the chat template teaches), none, hermes, mistral, llama3_json or deepseek_v3")
      ->check(CLI::IsMember(std::vector<std::string>(std::begin(server::chat_output::kToolCallParserNames),
                                                     std::end(server::chat_output::kToolCallParserNames))))
      ->capture_default_str();
  app.add_option("--reasoning-parser", o.reasoning_parser,
                 "split <think>...</think> into reasoning_content (vLLM's names): auto (from the chat "
                 "template), none, deepseek_r1 or qwen3")
      ->check(CLI::IsMember(std::vector<std::string>(std::begin(server::chat_output::kReasoningParserNames),
                                                     std::end(server::chat_output::kReasoningParserNames))))
      ->capture_default_str();
  app.add_option("--batch-selector", o.strategy, "fcfs | greedy | power_of_d | lpt_balanced | random")
      ->check(CLI::IsMember({"fcfs", "greedy", "power_of_d", "lpt_balanced", "random"}))
      ->capture_default_str();
  server::SelectorConfig& s = o.scheduler.selector;
  app.add_option("--selector-window", s.window, "candidates considered per decision")
      ->check(runtime::at_least(1))
      ->capture_default_str();
  app.add_option("--selector-min-queue", s.min_queue_depth, "waiting requests below which admission is FCFS")
      ->check(runtime::at_least(0))
      ->capture_default_str();
  app.add_option("--selector-max-wait-ms", s.max_wait_ms, "anti-starvation bound")
      ->check(runtime::at_least(0))
      ->capture_default_str();
  app.add_option("--selector-interval-ms", s.interval_ms, "selection at most this often (FCFS in between)")
      ->check(runtime::at_least(0))
      ->capture_default_str();
  app.add_option("--selector-d", s.power_of_d, "power_of_d samples")
      ->check(runtime::at_least(1))
      ->capture_default_str();
  app.add_option("--selector-seed", s.seed, "seed of the random and power_of_d selectors' sampling")
      ->capture_default_str();
  app.add_option("--dry-run-layers", o.dry_run_layers,
                 "MoE layers the router dry-run predictor covers when no load map is used")
      ->check(runtime::at_least(1))
      ->capture_default_str();
  app.add_option("--load-map", o.load_map,
                 "the batch selector's learned load map (capserve-eval-predictor --write-map): a file, auto "
                 "(the model directory's capserve_load_map.json when it has one) or none (the dry run alone)")
      ->capture_default_str();
  app.add_option(
      "--step-trace", o.step_trace,
      "write one JSON line per engine step to this file (rank 0): each rank's tokens, attention work "
      "and expert load, and the step's time (server/step_trace.h; tools/planner/planner_eval.py calibrate "
      "fits a step cost model to it)");
  app.add_option("--step-timeout-s", o.step_timeout_s,
                 "a step making no progress this long (a hung rank) fails every request and ends the job")
      ->check(CLI::Range(0.1, 86400.0))
      ->capture_default_str();
  app.add_flag("--prefix-cache,!--no-prefix-cache", o.prefix_cache,
               "keep full KV blocks cached by their tokens after their sequence ends, and start each prompt "
               "after the longest prefix its rank holds (default: on; off with --speculative, which it does "
               "not support yet: the scheduler's per-rank mirror of the KV blocks does not follow draft "
               "blocks)");
  app.add_option(
         "--cache-affinity-slack", o.scheduler.cache_affinity_slack,
         "a newcomer goes to the rank whose prefix cache holds most of its prompt among the ranks that "
         "run at most this many more sequences than the least busy one (0: among the least busy only)")
      ->check(CLI::Range(std::int64_t{0}, std::int64_t{1} << 20))
      ->capture_default_str();
  runtime::add_speculation_flags(app, o.speculation);
  runtime::add_parallel_flags(app, o.parallel);
  app.add_flag("--metrics-per-expert", o.metrics_per_expert,
               "token counters per (layer, expert) besides per (layer, rank): layers * experts series");
  app.add_option("--log-level", o.log_level, "trace | debug | info | warn | error | critical | off")
      ->check(CLI::IsMember(
          std::vector<std::string>(std::begin(server::kLogLevels), std::end(server::kLogLevels))));
  app.add_option("--log-format", o.log_format, "text | json (one JSON object per line)")
      ->check(CLI::IsMember({"text", "json"}));
  auto* cert =
      app.add_option("--tls-cert", o.tls.cert,
                     "PEM certificate chain: TLS on gRPC, the HTTP API and /metrics (with --tls-key)");
  auto* key = app.add_option("--tls-key", o.tls.key, "PEM private key of --tls-cert");
  cert->needs(key);
  key->needs(cert);
  app.add_option("--tls-client-ca", o.tls.client_ca,
                 "PEM CA bundle: clients must present a certificate it signed (mutual TLS)")
      ->needs(cert);
  auto* api_key = app.add_option("--api-key", o.api_key,
                                 "require 'Authorization: Bearer KEY' on HTTP (but /health and the /metrics "
                                 "port) and gRPC (visible in ps: prefer --api-key-file)");
  app.add_option("--api-key-file", o.api_key_file, "read the API key from this file's first line")
      ->excludes(api_key);
  app.set_config("--config", "",
                 "JSON file of flags (keys = long flag names); command-line flags override it");
  app.config_formatter(std::make_shared<server::JsonConfig>(app));
}

// The API key of --api-key or --api-key-file, which must not be empty (an unset variable in `--api-key
// "$KEY"` once started a server with no authentication at all): empty, or why it is refused.
std::string read_api_key(const CLI::App& app, Options& o) {
  try {
    if (app.count("--api-key") > 0) o.key.emplace(o.api_key);
    if (app.count("--api-key-file") > 0) o.key = server::security::ApiKey::from_file(o.api_key_file);
  } catch (const std::invalid_argument&) {
    return "--api-key: the key is empty (an unset variable?); give a key, or leave the flag out to serve "
           "without one";
  } catch (const std::exception& e) {
    return e.what();
  }
  return {};
}

// Checks between flags, after parsing: empty, or why the combination is refused.
std::string cross_check(const Options& o) {
  if (o.limits.default_max_tokens > o.limits.max_tokens_limit)
    return "--default-max-tokens " + std::to_string(o.limits.default_max_tokens) +
           " exceeds --max-tokens-limit " + std::to_string(o.limits.max_tokens_limit);
  return runtime::why_speculation_invalid(o.speculation);
}

// The startup line's speculation: the method and its settings.
std::string speculation_summary(const runtime::SpeculationConfig& s) {
  using Method = runtime::SpeculationConfig::Method;
  switch (s.method) {
    case Method::none:
      return "none";
    case Method::ngram:
      return fmt::format("ngram (k={}, n={}..{})", s.num_tokens, s.ngram_min, s.ngram_max);
    case Method::mtp:
      return fmt::format("mtp (k={})", s.num_tokens);
  }
  return "unknown";
}

// --prefix-cache's value: on unless --speculative, which refuses it (the scheduler's per-rank mirror of the
// KV blocks does not follow draft blocks yet). Empty, or why the combination is refused.
std::string resolve_prefix_cache(const CLI::App& app, Options& o) {
  const bool speculative = o.speculation.method != runtime::SpeculationConfig::Method::none;
  const bool given = app.count("--prefix-cache") > 0;
  if (speculative && given && o.prefix_cache)
    return "--prefix-cache does not work with --speculative yet (the scheduler's per-rank mirror of the KV "
           "blocks does not follow draft blocks); leave it out, or give --no-prefix-cache";
  if (speculative && !given) o.prefix_cache = false;
  o.scheduler.prefix_cache = o.prefix_cache;
  o.engine.prefix_cache = o.prefix_cache;
  return {};
}

// "host:port", with an IPv6 literal in brackets ("[::]:50051") as gRPC expects.
std::string host_port(const std::string& host, int port) {
  const bool ipv6 = host.find(':') != std::string::npos && !host.starts_with('[');
  return (ipv6 ? "[" + host + "]" : host) + ":" + std::to_string(port);
}

// Why binding host:port fails, as the OS says it (gRPC only reports that it could not): e.g. "Address already
// in use". Empty when a plain bind now succeeds.
std::string bind_error(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* found = nullptr;
  const std::string service = std::to_string(port);
  if (const int rc = ::getaddrinfo(host.empty() ? nullptr : host.c_str(), service.c_str(), &hints, &found);
      rc != 0)
    return ::gai_strerror(rc);
  const std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> addresses(found, &::freeaddrinfo);
  for (const addrinfo* a = found; a != nullptr; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, a->ai_socktype, a->ai_protocol);
    if (fd < 0) return std::strerror(errno);
    const int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);  // as gRPC does: TIME_WAIT is no conflict
    const int rc = ::bind(fd, a->ai_addr, a->ai_addrlen);
    const int bind_errno = errno;
    ::close(fd);
    if (rc != 0) return std::strerror(bind_errno);
  }
  return {};
}

// --step-timeout-s as the watchdog's bound.
server::StepWatchdog::Clock::duration step_bound(const Options& o) {
  return std::chrono::duration_cast<server::StepWatchdog::Clock::duration>(
      std::chrono::duration<double>(o.step_timeout_s));
}

// "27.3 MB (26.1 MiB)": a model of a few MB is no "0 MiB".
std::string megabytes(std::int64_t bytes) {
  return fmt::format("{:.1f} MB ({:.1f} MiB)", static_cast<double>(bytes) / 1e6,
                     static_cast<double>(bytes) / (1024.0 * 1024.0));
}

// 2000 for 2000.0 (std::to_string prints "2000.000000"), 0.5 for 0.5.
std::string milliseconds(double ms) {
  return fmt::format("{}", ms);
}

// The start-up summary on the log: what serves, where, and with which limits.
void log_startup_summary(const Options& o, const runtime::Model& model, const capserve::v1::ServerInfo& info,
                         std::span<const RankMemory> memory, const std::string& grpc_address,
                         const std::string& http_address, int metrics_port) {
  const runtime::ModelConfig& c = model.config();
  spdlog::info("capserve {}: model {} ({}) from {}: {}, {} layers ({} MoE), {} experts, top-{}",
               runtime::build_info().version, o.limits.model_id, o.device, o.model_dir, c.architecture,
               c.num_layers, model.moe_layers().size(), c.num_experts, c.top_k);
  spdlog::info("placement {} over {} ranks; capacity {}", info.placement(), info.ranks(), info.capacity());
  for (std::size_t r = 0; r < memory.size(); ++r) {
    spdlog::info(
        "rank {}: {} experts per MoE layer, {} of weights, {} of KV cache ({} blocks of {} tokens), "
        "{} resident",
        r,
        r < static_cast<std::size_t>(info.experts_per_rank_size())
            ? info.experts_per_rank(static_cast<int>(r))
            : 0U,
        megabytes(memory[r].weights), megabytes(memory[r].kv_cache), o.engine.kv_blocks,
        o.engine.kv_block_size, megabytes(memory[r].resident_kib * 1024));
  }
  spdlog::info(
      "scheduler: max_running={} max_batched_tokens={} max_queue={} max_context={}; prefix cache {}; "
      "selector "
      "{}; speculative {}",
      o.scheduler.max_running, o.scheduler.max_batched_tokens, o.scheduler.max_queue, o.scheduler.max_context,
      o.scheduler.prefix_cache ? "on" : "off", info.batch_selector(), speculation_summary(o.speculation));
  spdlog::info("listening: gRPC at {}; HTTP API at {}; metrics (/metrics) at {}; {}; {}{}", grpc_address,
               http_address, host_port(o.metrics_host.empty() ? o.host : o.metrics_host, metrics_port),
               o.tls.cert.empty()        ? "plain TCP (no TLS)"
               : o.tls.client_ca.empty() ? "TLS"
                                         : "TLS with client certificates",
               o.key ? "API key required" : "no API key",
               o.key ? " (gRPC reflection off: it cannot check the key)" : "");
}
// The server's description for the API's ServerInfo (and the start-up summary).
capserve::v1::ServerInfo describe_server(const parallel::MpiWorld& world, const Options& o,
                                         const runtime::Model& model,
                                         const runtime::RouterLoadPredictor& predictor) {
  const runtime::ModelConfig& config = model.config();
  const parallel::ExpertPlacement& placement = model.placement();
  capserve::v1::ServerInfo info;
  info.set_version(std::string(runtime::build_info().version));
  info.set_ranks(static_cast<std::uint32_t>(world.size()));
  capserve::v1::ModelCard* card = info.mutable_model();
  card->set_id(o.limits.model_id);
  card->set_architecture(config.architecture);
  card->set_num_layers(static_cast<std::uint32_t>(config.num_layers));
  card->set_num_experts(static_cast<std::uint32_t>(config.num_experts));
  card->set_experts_per_token(static_cast<std::uint32_t>(config.top_k));
  card->set_max_context(static_cast<std::uint32_t>(o.scheduler.max_context));
  info.set_placement(placement.replicated()
                         ? placement.kind() + " (" +
                               std::to_string(placement.num_slots() - placement.num_experts()) +
                               " redundant experts per layer)"
                         : placement.kind());
  if (!model.moe_layers().empty()) {
    for (int r = 0; r < world.size(); ++r)
      info.add_experts_per_rank(
          static_cast<std::uint32_t>(placement.local_experts(model.moe_layers().front(), r).size()));
  }
  info.set_capacity(parallel::describe(model.capacity()));
  const server::SelectorConfig& sel = o.scheduler.selector;
  info.set_batch_selector(
      "strategy=" + server::to_string(sel.strategy) + " window=" + std::to_string(sel.window) +
      " min_queue=" + std::to_string(sel.min_queue_depth) + " max_wait_ms=" + milliseconds(sel.max_wait_ms) +
      " interval_ms=" + milliseconds(sel.interval_ms) + " d=" + std::to_string(sel.power_of_d) +
      " predictor=" + (predictor.learned() ? "load_map" : "dry_run") +
      " predicted_layers=" + std::to_string(predictor.layers()));
  info.set_max_running_sequences(static_cast<std::uint32_t>(o.scheduler.max_running));
  info.set_max_batched_tokens(static_cast<std::uint32_t>(o.scheduler.max_batched_tokens));
  info.set_kv_blocks_per_rank(static_cast<std::uint32_t>(o.engine.kv_blocks));
  return info;
}

// The checkpoint's tokenizer, when it has one, on every rank: rank 0 serves text with it, and every rank
// compiles output constraints (structured output) against its vocabulary.
struct RankText {
  std::optional<runtime::Tokenizer> tokenizer;
  std::unique_ptr<runtime::grammar::GrammarCache> grammars;  // null: structured output is refused
  std::string error;                                         // why the tokenizer could not be loaded
};

// Compiled grammars a rank keeps for requests that repeat a constraint.
constexpr std::size_t kCachedGrammars = 64;

RankText load_rank_text(const Options& o, const runtime::Model& model, int rank) {
  RankText text;
  if (!std::filesystem::exists(std::filesystem::path(o.model_dir) / "tokenizer.json")) return text;
  try {
    text.tokenizer = runtime::Tokenizer::load(o.model_dir);
  } catch (const std::exception& e) {
    // Rank 0 refuses to start with it; another rank (which read the same file) cannot serve constraints.
    text.error = e.what();
    if (rank != 0) spdlog::error("capserve: rank {}: {}", rank, text.error);
    return text;
  }
  const runtime::ModelConfig& config = model.config();
  if (text.tokenizer->vocab_size() > config.vocab_size) {
    if (rank == 0)
      spdlog::warn(
          "capserve: structured output off: the tokenizer has {} tokens, more than the model's {} logits",
          text.tokenizer->vocab_size(), config.vocab_size);
    return text;
  }
  text.grammars = std::make_unique<runtime::grammar::GrammarCache>(
      std::make_shared<const runtime::grammar::TokenVocabulary>(
          runtime::grammar::TokenVocabulary::from_tokenizer(*text.tokenizer, config.eos_token_ids)),
      kCachedGrammars);
  return text;
}

// Rank 0's front ends and what they serve: the tokenizer and chat template, the metrics and their port, the
// scheduler, the intake both APIs share, the gRPC service and the HTTP API. Members in construction order:
// a server goes before what it serves.
class FrontEnds final : public server::FrontEndControl {
 public:
  // Starts everything: empty, or why it could not (a port in use, a bad certificate, a broken template).
  std::string start(const parallel::MpiWorld& world, const Options& o, const runtime::Model& model,
                    const capserve::v1::ServerInfo& info, runtime::LoadPredictor& predictor,
                    const RankText& text) {
    try {
      if (!text.error.empty()) return text.error;
      load_chat_template(o, text);
      const runtime::BuildInfo& build = runtime::build_info();
      metrics_ = std::make_unique<server::ServerMetrics>(
          model.moe_layers(), model.config().num_experts, world.size(),
          server::MetricsOptions{.model_name = o.limits.model_id,
                                 .per_expert = o.metrics_per_expert,
                                 .max_context = o.scheduler.max_context,
                                 .speculative_tokens = o.scheduler.speculative_tokens,
                                 .version = std::string(build.version),
                                 .git_commit = std::string(build.git_commit),
                                 .build_type = std::string(build.build_type),
                                 .device = o.device});
      std::shared_ptr<const server::security::TlsCredentials> tls;
      if (!o.tls.cert.empty())
        tls = std::make_shared<const server::security::TlsCredentials>(
            server::security::load_tls_credentials(o.tls));
      if (tls && !tls->warning.empty()) spdlog::warn("capserve: {}", tls->warning);
      start_metrics_port(o, tls);
      const runtime::Tokenizer* tokenizer = text.tokenizer ? &*text.tokenizer : nullptr;
      scheduler_ = std::make_unique<server::Scheduler>(o.scheduler, world.size(), tokenizer, &predictor,
                                                       metrics_.get(), &g_stop_requested);
      // Its size is known now; the gauge would otherwise read 0 until the first step.
      metrics_->set_kv_cache_usage(std::vector<std::int64_t>(static_cast<std::size_t>(world.size()), 0),
                                   o.engine.kv_blocks);
      intake_ = std::make_unique<server::RequestIntake>(*scheduler_, tokenizer, chat_, o.limits,
                                                        metrics_.get(), text.grammars.get());
      service_ = std::make_unique<server::InferenceService>(*intake_, info, o.key);
      if (o.http_port >= 0) start_http_api(o, info, tls);
      return start_grpc(o, tls);
    } catch (const std::exception& e) {
      return e.what();
    }
  }

  // Once every rank agreed to serve: health reads SERVING for the API's service name too (as for "").
  void serve_health() { health().SetServingStatus(capserve::v1::Inference::service_full_name(), true); }

  void stop_serving() override {
    if (api_http_) api_http_->cancel_pending();  // a render in progress would only be refused
    health().SetServingStatus(false);
  }
  void mark_stalled() override {
    health().SetServingStatus(false);
    stalled_.store(true);
  }
  void shutdown(std::chrono::system_clock::time_point deadline) override { grpc_server_->Shutdown(deadline); }

  [[nodiscard]] server::Scheduler& scheduler() { return *scheduler_; }
  [[nodiscard]] server::ServerMetrics& metrics() { return *metrics_; }
  [[nodiscard]] int grpc_port() const { return grpc_port_; }
  [[nodiscard]] int metrics_port() const { return metrics_http_->port(); }
  // -1 when the HTTP API is off.
  [[nodiscard]] int http_port() const { return api_http_ ? api_http_->port() : -1; }

 private:
  grpc::HealthCheckServiceInterface& health() { return *grpc_server_->GetHealthCheckService(); }

  // The checkpoint's chat template, when it has one beside its tokenizer (a model served by token ids has
  // neither).
  void load_chat_template(const Options& o, const RankText& text) {
    if (!text.tokenizer) return;
    std::optional<std::filesystem::path> template_file;
    if (!o.chat_template.empty()) template_file = o.chat_template;
    const auto tokenizer_config = std::filesystem::path(o.model_dir) / "tokenizer_config.json";
    if (!std::filesystem::exists(tokenizer_config)) return;
    chat_ = runtime::ChatTemplate::load(tokenizer_config, template_file);
    runtime::jinja::RenderOptions limits = chat_->limits();
    limits.max_steps = static_cast<std::uint64_t>(o.chat_template_max_steps);
    chat_->set_limits(limits);
  }

  // The chat output parsers: the flags, "auto" resolved from the chat template.
  [[nodiscard]] server::chat_output::ChatOutputFormats output_formats(const Options& o) const {
    const std::string_view source = chat_ ? std::string_view(chat_->source()) : std::string_view();
    return {server::chat_output::tool_call_format_for(o.tool_call_parser, source),
            server::chat_output::reasoning_format_for(o.reasoning_parser, source)};
  }

  [[nodiscard]] server::http::Response exposition() const {
    return server::http::Response{200, "text/plain; version=0.0.4; charset=utf-8", metrics_->exposition()};
  }

  void start_metrics_port(const Options& o,
                          const std::shared_ptr<const server::security::TlsCredentials>& tls) {
    metrics_http_ = std::make_unique<server::http::Server>(
        server::http::Options{.host = o.metrics_host.empty() ? o.host : o.metrics_host,
                              .port = o.metrics_port,
                              .max_connections_per_peer = o.max_connections_per_peer,
                              .tls = tls},
        std::map<std::string, server::http::Route, std::less<>>{
            {"/metrics", [this] { return exposition(); }}});
  }

  void start_http_api(const Options& o, const capserve::v1::ServerInfo& info,
                      const std::shared_ptr<const server::security::TlsCredentials>& tls) {
    const server::chat_output::ChatOutputFormats formats = output_formats(o);
    openai_ = std::make_unique<server::http::OpenAiApi>(
        *intake_,
        server::http::OpenAiOptions{
            .version = info.version(), .stalled = [this] { return stalled_.load(); }, .formats = formats});
    spdlog::info("chat output: tool calls {}, reasoning {}",
                 formats.tool_calls ? server::chat_output::format_name(*formats.tool_calls) : "none",
                 formats.reasoning ? server::chat_output::format_name(*formats.reasoning) : "none");
    auto routes = openai_->routes();
    routes.emplace("/metrics", [this] { return exposition(); });
    // /metrics on the API's port sits on the public address, so it takes the key too; the metrics port
    // stays open for scrapers (bind it to a private address with --metrics-host).
    if (o.key)
      server::http::require_api_key(routes, std::make_shared<const server::security::ApiKey>(*o.key));
    // Streams hold a connection each but no thread: two I/O threads serve hundreds of them.
    api_http_ = std::make_unique<server::http::Server>(
        server::http::Options{.host = o.host,
                              .port = o.http_port,
                              .io_threads = 2,
                              .max_connections = 1024,
                              .max_connections_per_peer = o.max_connections_per_peer,
                              .read_timeout = std::chrono::seconds(10),
                              .write_timeout = std::chrono::seconds(30),
                              .max_header_bytes = 16 * 1024,
                              .max_body_bytes = 4 * 1024 * 1024,
                              .error_response = server::http::server_error_response,
                              .tls = tls},
        std::move(routes));
  }

  // Empty, or why gRPC could not listen.
  std::string start_grpc(const Options& o,
                         const std::shared_ptr<const server::security::TlsCredentials>& tls) {
    grpc::EnableDefaultHealthCheckService(true);
    grpc::reflection::InitProtoReflectionServerBuilderPlugin();
    grpc::ServerBuilder builder;
    // gRPC's reflection service takes no part in the API key check (the plugin has no hook for one, and a
    // server interceptor cannot answer UNAUTHENTICATED), so with a key it is not served at all.
    if (o.key) builder.SetOption(std::make_unique<WithoutReflection>());
    // gRPC sets SO_REUSEPORT by default, so a second server on a busy port would start and take half of the
    // new connections; a port in use must be an error instead.
    builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
    std::shared_ptr<grpc::ServerCredentials> credentials = grpc::InsecureServerCredentials();
    if (tls) {
      grpc::SslServerCredentialsOptions ssl(tls->client_ca_pem.empty()
                                                ? GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE
                                                : GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
      ssl.pem_root_certs = tls->client_ca_pem;
      ssl.pem_key_cert_pairs.push_back({tls->private_key_pem, tls->cert_chain_pem});
      credentials = grpc::SslServerCredentials(ssl);
    }
    builder.AddListeningPort(host_port(o.host, o.port), credentials, &grpc_port_);
    builder.RegisterService(service_.get());
    grpc_server_ = builder.BuildAndStart();
    if (grpc_server_ && grpc_port_ != 0) return {};
    const std::string why = bind_error(o.host, o.port);
    return "cannot listen on " + host_port(o.host, o.port) + (why.empty() ? "" : ": " + why);
  }

  std::atomic<bool> stalled_{false};  // the step watchdog fired: /health answers 503
  std::optional<runtime::ChatTemplate> chat_;
  std::unique_ptr<server::ServerMetrics> metrics_;
  std::unique_ptr<server::http::Server> metrics_http_;
  std::unique_ptr<server::Scheduler> scheduler_;
  std::unique_ptr<server::RequestIntake> intake_;
  std::unique_ptr<server::InferenceService> service_;
  std::unique_ptr<grpc::Server> grpc_server_;
  std::unique_ptr<server::http::OpenAiApi> openai_;
  std::unique_ptr<server::http::Server> api_http_;
  int grpc_port_ = 0;
};

// The batch selector's load predictor: the router dry run, through the learned load map --load-map names
// (auto: the model directory's, if it has one). std::runtime_error / std::invalid_argument for a map that
// cannot be read or was fitted for another model.
std::unique_ptr<runtime::RouterLoadPredictor> make_load_predictor(const Options& o, runtime::Engine& engine) {
  std::optional<runtime::LoadMap> map;
  const std::filesystem::path beside_model = std::filesystem::path(o.model_dir) / "capserve_load_map.json";
  if (o.load_map == "auto" ? std::filesystem::exists(beside_model) : o.load_map != "none")
    map = runtime::LoadMap::read(o.load_map == "auto" ? beside_model : std::filesystem::path(o.load_map));
  return std::make_unique<runtime::RouterLoadPredictor>(engine, engine.model().placement(), o.dry_run_layers,
                                                        std::move(map));
}

// Rank 0: the front ends, the scheduler and the step loop's driving side. Every rank learns whether the front
// ends started (the one collective before the step loop): on failure all of them exit 1 cleanly, rank 0 with
// the reason as its last line.
int serve(parallel::MpiWorld& world, const Options& o, runtime::Engine& engine, server::RankWorker& worker,
          const RankText& text, parallel::RankHeartbeat* heartbeat, std::span<const RankMemory> memory) {
  const runtime::Model& model = engine.model();
  std::unique_ptr<runtime::RouterLoadPredictor> predictor;
  std::string failure;
  try {
    predictor = make_load_predictor(o, engine);
  } catch (const std::exception& e) {
    failure = e.what();
  }
  const capserve::v1::ServerInfo info =
      predictor ? describe_server(world, o, model, *predictor) : capserve::v1::ServerInfo{};
  std::unique_ptr<server::StepTraceWriter> step_trace;
  if (failure.empty() && !o.step_trace.empty()) {
    try {
      step_trace = std::make_unique<server::StepTraceWriter>(o.step_trace);
    } catch (const std::exception& e) {
      failure = e.what();
    }
  }
  FrontEnds front_ends;
  if (failure.empty()) failure = front_ends.start(world, o, model, info, *predictor, text);
  if (!world.all_agree(failure.empty())) {
    std::fprintf(stderr, "capserve: %s\n", failure.c_str());
    return 1;
  }
  front_ends.serve_health();
  server::StepLoop loop(world, worker, engine, front_ends.scheduler(), front_ends.metrics(), front_ends,
                        {g_stop_requested, g_sigusr2_received}, step_bound(o), heartbeat, step_trace.get());

  // Machine-readable start line: tests and scripts wait for it.
  const std::string grpc_address = host_port(o.host, front_ends.grpc_port());
  const bool http_on = front_ends.http_port() >= 0;
  const std::string http_api = http_on ? "on port " + std::to_string(front_ends.http_port()) : "off";
  std::printf("capserve: serving %s on %s, metrics on port %d, %d ranks on %s, HTTP API %s\n",
              o.limits.model_id.c_str(), grpc_address.c_str(), front_ends.metrics_port(), world.size(),
              kernels::to_string(model.backend().device()).c_str(), http_api.c_str());
  std::fflush(stdout);
  log_startup_summary(o, model, info, memory, grpc_address,
                      http_on ? host_port(o.host, front_ends.http_port()) : "off", front_ends.metrics_port());
  return loop.run();
}

// deploy/launch.sh starts mpirun with SIGTERM, SIGINT and SIGHUP blocked (so that they cannot abort the job);
// this process must receive them. Before MPI starts its threads, which inherit the mask.
void unblock_signals() {
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  for (const int signal : {SIGTERM, SIGINT, SIGHUP, SIGUSR2}) sigaddset(&stop_signals, signal);
  pthread_sigmask(SIG_UNBLOCK, &stop_signals, nullptr);
}

void install_signal_handlers(int rank) {
  // Only rank 0 acts on a stop signal (it drains and then tells the others); the others ignore theirs. SIGHUP
  // (the terminal or session went away) drains too: its default would kill rank 0 and reset every stream.
  for (const int signal : {SIGTERM, SIGINT, SIGHUP}) handle_signal(signal, on_stop_signal);
  // mpirun forwards SIGUSR1 to every rank on every host: deploy/launch.sh's stop when rank 0 runs elsewhere.
  handle_signal(SIGUSR1, on_stop_signal);
  // mpirun forwards SIGUSR2 too; its default would kill the rank. Nothing uses it: logged and ignored.
  handle_signal(SIGUSR2, on_sigusr2);
  // deploy/launch.sh sends its SIGTERM to this process. A stop before the server is up ends it right after.
  if (const char* pid_file = std::getenv("CAPSERVE_RANK0_PID_FILE");
      rank == 0 && pid_file != nullptr && *pid_file != 0) {
    std::ofstream(pid_file) << ::getpid() << "\n";
  }
}

// Every rank parses the same flags; rank 0 alone prints. The exit code when the process ends here (--help,
// --version, a refused flag: 2).
std::optional<int> parse_options(int argc, char** argv, int rank, Options& o) {
  CLI::App app{"CapServe: expert-parallel MoE inference server (run under mpirun; rank 0 serves gRPC)"};
  capserve::runtime::add_common_flags(app, "capserve");
  add_flags(app, o);
  if (const std::optional<int> exit_code = runtime::parse_flags(app, argc, argv, "capserve", rank == 0))
    return exit_code;
  std::string bad = read_api_key(app, o);
  if (bad.empty()) bad = cross_check(o);
  if (bad.empty()) bad = resolve_prefix_cache(app, o);
  if (!bad.empty()) {
    if (rank == 0) std::fprintf(stderr, "capserve: %s\n", bad.c_str());
    return 2;
  }
  if (!server::parse_strategy(o.strategy, o.scheduler.selector.strategy)) return 2;
  return std::nullopt;
}

// Where each rank runs, before anything can fail on one of them (a job may span hosts: deploy/launch.sh
// --hosts); the CPU threads of this rank, with a warning per host that oversubscribes its cores.
int rank_threads(parallel::MpiWorld& world, const Options& o) {
  const std::vector<parallel::RankHost> hosts = parallel::gather_rank_hosts(world);
  if (world.rank() == 0) {
    for (std::size_t r = 0; r < hosts.size(); ++r)
      std::printf("capserve: rank %zu runs on host %s (local rank %d of %d)\n", r, hosts[r].host.c_str(),
                  hosts[r].local_rank, hosts[r].local_size);
    std::printf("capserve: MPI transport: %s\n", parallel::mpi_transport().c_str());
  }
  const int threads = o.threads > 0 ? o.threads : runtime::default_threads(world.local_size());
  if (world.local_rank() == 0) {
    if (const std::string w =
            runtime::oversubscription_warning(threads, world.local_size(), runtime::available_cores());
        !w.empty())
      spdlog::warn("capserve: host {}: {}", hosts[static_cast<std::size_t>(world.rank())].host, w);
  }
  return threads;
}

// Whether every rank succeeded at a start-up stage (`failure` empty on this one). The other ranks report
// first and rank 0 after the collective, so that its line comes last.
bool all_succeeded(parallel::MpiWorld& world, const std::string& failure) {
  const int rank = world.rank();
  if (rank != 0 && !failure.empty()) std::fprintf(stderr, "capserve: rank %d: %s\n", rank, failure.c_str());
  const bool ok = world.all_agree(failure.empty());
  if (rank == 0 && !failure.empty()) std::fprintf(stderr, "capserve: %s\n", failure.c_str());
  return ok;
}

// This rank's device, model (the replicated weights and its own experts) and engine (its KV cache).
struct RankEngine {
  runtime::RankDevices devices;
  std::unique_ptr<runtime::Model> model;
  std::unique_ptr<runtime::Engine> engine;
  // Its weights (device copies; on the CPU, mapped from the checkpoint) and the KV cache its backend
  // allocated.
  RankMemory memory;
};

// Loads every rank's engine: false (the reasons printed) when one rank failed.
bool load_engine(parallel::MpiWorld& world, Options& o, int threads, RankEngine& out) {
  std::string failure;
  try {
    out.devices = runtime::make_rank_devices(o.device, threads, world);
    runtime::ParallelOptions options = runtime::finish_parallel_flags(o.parallel);
    options.mtp = runtime::loads_mtp_layers(o.speculation);
    out.model = out.devices.load(o.model_dir, options);
    out.memory.weights = out.model->weights().bytes;
    o.engine.kv_dtype = runtime::kv_dtype_for(o.kv_dtype, out.devices.backend->device());
    out.engine = std::make_unique<runtime::Engine>(*out.model, o.engine);
    out.memory.kv_cache = out.engine->cache().bytes();
    out.memory.device_index = out.devices.backend->device().index;
    out.memory.resident_kib = runtime::self_status_kib("VmRSS:");
  } catch (const std::exception& e) {
    failure = e.what();
  }
  if (!all_succeeded(world, failure)) return false;
  // On a GPU every step buffer is sized now, for the largest step the scheduler forms (one step, every rank
  // together, once all have built their engines): a step that grew one would free and allocate device memory,
  // a device-wide wait behind queued NCCL work (runtime/README.md, "Step memory").
  if (out.devices.backend->device().kind != kernels::DeviceKind::cuda) return true;
  try {
    out.engine->reserve_step_memory(o.scheduler.max_batched_tokens);
  } catch (const std::exception& e) {
    failure = std::string("sizing the step buffers for --max-batched-tokens: ") + e.what();
  }
  return all_succeeded(world, failure);
}

// Every rank's memory, gathered to rank 0, which prints a line per rank (the others get an empty list).
std::vector<RankMemory> gather_memory(parallel::MpiWorld& world, const runtime::Model& model,
                                      const RankMemory& memory) {
  const auto gathered = world.gather(std::as_bytes(std::span(&memory, 1)), 0);
  std::vector<RankMemory> rank_memory(gathered.size());
  for (std::size_t r = 0; r < gathered.size(); ++r) {
    RankMemory& m = rank_memory[r];
    std::memcpy(&m, gathered[r].data(), sizeof m);
    const kernels::Device device{model.backend().device().kind, static_cast<int>(m.device_index)};
    std::printf("capserve: rank %zu on %s: %s of weights, %s of KV cache\n", r,
                kernels::to_string(device).c_str(), megabytes(m.weights).c_str(),
                megabytes(m.kv_cache).c_str());
  }
  return rank_memory;
}

// The limits the model sets: its context, its KV blocks, its expert assignments per token, its vocabulary,
// stop tokens, generation defaults and name.
void fit_to_model(Options& o, const runtime::Model& model) {
  const runtime::ModelConfig& config = model.config();
  o.scheduler.max_context = std::min<std::int64_t>(o.scheduler.max_context, config.max_context_length());
  o.scheduler.kv_blocks_per_rank = o.engine.kv_blocks;
  o.scheduler.kv_block_size = o.engine.kv_block_size;
  o.scheduler.assignments_per_token = config.top_k * static_cast<std::int64_t>(model.moe_layers().size());
  // Dynamic NTK rope turns a step's keys with frequencies of the sequence's length past
  // max_position_embeddings: such prompts are prefilled whole, and cached keys would carry another length's
  // frequencies.
  if (config.rope_scaling.type == runtime::RopeScaling::Type::dynamic) {
    o.scheduler.whole_prefill_above = config.max_position_embeddings;
    if (o.scheduler.prefix_cache)
      spdlog::info(
          "capserve: prefix cache off: the model's dynamic rope scaling makes cached keys depend on the "
          "length of the sequence that wrote them");
    o.scheduler.prefix_cache = false;
  }
  o.limits.max_context = o.scheduler.max_context;
  o.limits.vocab_size = config.vocab_size;
  o.limits.eos_token_ids = config.eos_token_ids;
  if (o.generation_defaults == "model") o.limits.generation_defaults = config.generation;
  o.limits.model_id =
      o.model_id.empty() ? std::filesystem::path(o.model_dir).filename().string() : o.model_id;
}

}  // namespace

int main(int argc, char** argv) {
  capserve::runtime::log_to_stderr();
  unblock_signals();
  std::optional<parallel::MpiWorld> world;
  if (!parallel::start_mpi(world, argc, argv, "capserve")) return 1;
  const int rank = world->rank();
  install_signal_handlers(rank);

  Options o;
  if (const std::optional<int> exit_code = parse_options(argc, argv, rank, o)) return *exit_code;
  server::configure_logging(o.log_level,
                            o.log_format == "json" ? server::LogFormat::json : server::LogFormat::text, rank);
  const int threads = rank_threads(*world, o);

  RankEngine loaded;
  if (!load_engine(*world, o, threads, loaded)) return 1;
  const std::vector<RankMemory> rank_memory = gather_memory(*world, *loaded.model, loaded.memory);
  fit_to_model(o, *loaded.model);
  runtime::Engine& engine = *loaded.engine;
  // Every rank drafts for its own sequences (MTP drafting is a collective; the n-gram drafter needs no
  // model). The flags were checked and the MTP layers loaded.
  const std::unique_ptr<runtime::Drafter> drafter = runtime::make_drafter(o.speculation, engine);
  if (drafter != nullptr) o.scheduler.speculative_tokens = drafter->max_drafts();
  const RankText text = load_rank_text(o, *loaded.model, rank);
  server::RankWorker worker(engine, rank, drafter.get(), text.grammars.get());
  // Lets rank 0's step watchdog name a stalled rank. Every rank decides alike (same flags, same MPI).
  std::optional<parallel::RankHeartbeat> heartbeat;
  if (world->size() > 1 && world->thread_level() == MPI_THREAD_MULTIPLE) {
    heartbeat.emplace(*world, server::StepWatchdog::beat_interval(step_bound(o)));
  }

  // The other ranks learn whether rank 0's front ends started, then follow its plans.
  if (rank != 0) return world->all_agree(true) ? server::StepLoop::follow(*world, worker) : 1;
  try {
    return serve(*world, o, engine, worker, text, heartbeat ? &*heartbeat : nullptr, rank_memory);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "capserve: %s\n", e.what());
    world->abort(1);
  }
}
